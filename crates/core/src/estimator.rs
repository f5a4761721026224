//! Tail-latency estimation over the reference flow's most recent samples.
//!
//! Justitia does not watch applications' latency-sensitive flows. It runs its own reference
//! flow (10 B messages every RefPeriod) and keeps a sliding window of the most recent
//! RefCount = 10000 latencies; the 99th percentile of that window is Current99, the signal
//! of the SafeUtil controller (§4.2.1). The paper estimates it with a sketch; this module
//! gives a bounded-error answer instead, so the controller's decisions are reproducible.
//!
//! [`TailEstimator`] keeps the window as a ring of bucket numbers and a Fenwick tree of
//! counts over log-linear latency buckets: every nanosecond value below 512 ns has its own
//! bucket, and above that every power of two is cut into 256 equal sub-buckets. Recording a
//! sample (insert plus eviction of the oldest) and answering a quantile each cost
//! O(log number-of-buckets), independent of the window length.
//!
//! Invariants:
//! - the window never holds more than its capacity; the oldest sample leaves first;
//! - recording never allocates: the window's room is taken when the estimator is built;
//! - the quantile `q` of `n` samples is the sample of rank [`Quantile::rank`] (nearest rank,
//!   `ceil(q * n)`), and the estimate differs from it by at most
//!   [`MAX_RELATIVE_ERROR`] of its value (it is the midpoint of that sample's bucket);
//! - an empty window gives no estimate rather than a made-up one;
//! - latencies are taken at nanosecond resolution and saturate at `u64::MAX` nanoseconds.

use std::collections::VecDeque;
use std::time::Duration;

/// Sub-bucket bits: each power of two above 512 ns is split into `2^SUB_BITS` buckets.
const SUB_BITS: u32 = 8;
/// Sub-buckets per power of two.
const SUB_COUNT: u64 = 1 << SUB_BITS;
/// Bucket groups: one exact group for values below `SUB_COUNT`, then one per exponent
/// from `SUB_BITS` to 63.
const GROUPS: u64 = 64 - SUB_BITS as u64 + 1;
/// Total number of buckets (14592, so a bucket number fits in a `u16`).
const BUCKETS: usize = (GROUPS * SUB_COUNT) as usize;

/// The largest relative error of an estimate: `|estimate - exact| <= exact * MAX_RELATIVE_ERROR`.
///
/// An estimate is the midpoint of the bucket holding the exact order statistic; a bucket
/// starting at `lo` is at most `lo / 256` wide, so the midpoint is within `lo / 512`.
pub const MAX_RELATIVE_ERROR: f64 = 1.0 / (2 * SUB_COUNT) as f64;

/// Why an estimator could not be built.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum EstimatorError {
    /// A quantile must lie in (0, 1].
    #[error("quantile must be in (0, 1], got {0}")]
    QuantileOutOfRange(f64),
    /// A window must hold at least one sample.
    #[error("the sample window must hold at least one sample")]
    EmptyWindow,
}

/// A quantile in (0, 1], e.g. 0.99 for the 99th percentile.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Quantile(f64);

impl Quantile {
    /// The 99th percentile: Justitia's Current99 and Target99.
    pub const P99: Quantile = Quantile(0.99);
    /// The median.
    pub const P50: Quantile = Quantile(0.5);

    /// A quantile, refusing values outside (0, 1] (including NaN).
    pub fn new(q: f64) -> Result<Self, EstimatorError> {
        if q > 0.0 && q <= 1.0 {
            Ok(Quantile(q))
        } else {
            Err(EstimatorError::QuantileOutOfRange(q))
        }
    }

    /// The quantile as a number in (0, 1].
    pub fn get(self) -> f64 {
        self.0
    }

    /// The 1-based rank of this quantile among `n` sorted samples: `ceil(q * n)`, at
    /// least 1 and at most `n` (nearest-rank definition). A relative slack of 1e-12 keeps
    /// products such as `0.07 * 100` (7.000000000000001 in binary floating point) at the
    /// intended rank; it is far below one rank for any window shorter than 10^9.
    pub fn rank(self, n: usize) -> usize {
        let exact = self.0 * n as f64;
        let rank = (exact - exact * 1e-12).ceil() as usize;
        rank.clamp(1, n.max(1))
    }
}

impl Default for Quantile {
    fn default() -> Self {
        Quantile::P99
    }
}

/// A quantile of a sliding window of the most recent latencies (Justitia's Current99).
#[derive(Debug, Clone)]
pub struct TailEstimator {
    quantile: Quantile,
    capacity: usize,
    /// Bucket numbers of the samples in the window, oldest first.
    window: VecDeque<u16>,
    counts: BucketTree,
}

impl TailEstimator {
    /// RefCount: the window length Justitia uses (§4.2.1).
    pub const DEFAULT_WINDOW: usize = 10_000;

    /// An estimator of `quantile` over the most recent `window` samples.
    pub fn new(window: usize, quantile: Quantile) -> Result<Self, EstimatorError> {
        if window == 0 {
            return Err(EstimatorError::EmptyWindow);
        }
        Ok(TailEstimator {
            quantile,
            capacity: window,
            // The whole window at once, so that recording never allocates.
            window: VecDeque::with_capacity(window),
            counts: BucketTree::new(),
        })
    }

    /// Adds one latency sample, evicting the oldest one if the window is full.
    pub fn record(&mut self, latency: Duration) {
        if self.window.len() == self.capacity {
            if let Some(oldest) = self.window.pop_front() {
                self.counts.remove(usize::from(oldest));
            }
        }
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        let bucket = bucket_of(nanos);
        self.counts.add(usize::from(bucket));
        self.window.push_back(bucket);
    }

    /// The configured quantile of the window (Current99 with the default quantile), or
    /// `None` while the window is empty.
    pub fn estimate(&self) -> Option<Duration> {
        self.quantile_of(self.quantile)
    }

    /// Any quantile of the window, or `None` while the window is empty.
    pub fn quantile_of(&self, quantile: Quantile) -> Option<Duration> {
        if self.window.is_empty() {
            return None;
        }
        let rank = quantile.rank(self.window.len());
        let bucket = self.counts.find_rank(rank);
        Some(Duration::from_nanos(bucket_midpoint(bucket)))
    }

    /// The sample of 1-based `rank` in sorted order (as the midpoint of its bucket), or
    /// `None` when the window holds fewer than `rank` samples or `rank` is 0.
    pub fn at_rank(&self, rank: usize) -> Option<Duration> {
        if rank == 0 || rank > self.window.len() {
            return None;
        }
        Some(Duration::from_nanos(bucket_midpoint(
            self.counts.find_rank(rank),
        )))
    }

    /// The smallest and the largest of the newest `count` samples (as the midpoints of
    /// their buckets), or `None` when the window holds fewer than `count` samples or
    /// `count` is 0.
    pub fn newest_range(&self, count: usize) -> Option<(Duration, Duration)> {
        if count == 0 || count > self.window.len() {
            return None;
        }
        let newest = self.window.iter().rev().take(count);
        let least = newest.clone().min()?;
        let greatest = newest.max()?;
        let midpoint = |b: &u16| Duration::from_nanos(bucket_midpoint(usize::from(*b)));
        Some((midpoint(least), midpoint(greatest)))
    }

    /// The quantile this estimator reports from [`TailEstimator::estimate`].
    pub fn quantile(&self) -> Quantile {
        self.quantile
    }

    /// The window length (RefCount).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Samples currently in the window.
    pub fn len(&self) -> usize {
        self.window.len()
    }

    /// True while no sample has been recorded since creation or the last [`clear`](Self::clear).
    pub fn is_empty(&self) -> bool {
        self.window.is_empty()
    }

    /// Forgets every sample, e.g. when the reference flow restarts after a period without
    /// latency-sensitive flows, so old conditions do not colour the new estimate.
    pub fn clear(&mut self) {
        // Taking the few samples of a short window out one by one is cheaper than zeroing
        // the whole tree (14592 counts), which the control loop would otherwise pay at
        // every restart of its window.
        if self.window.len() * 16 < BUCKETS {
            for bucket in self.window.drain(..) {
                self.counts.remove(usize::from(bucket));
            }
        } else {
            self.window.clear();
            self.counts = BucketTree::new();
        }
    }
}

impl Default for TailEstimator {
    /// The paper's estimator: p99 over the last 10000 samples.
    fn default() -> Self {
        TailEstimator {
            quantile: Quantile::P99,
            capacity: Self::DEFAULT_WINDOW,
            window: VecDeque::with_capacity(Self::DEFAULT_WINDOW),
            counts: BucketTree::new(),
        }
    }
}

/// The bucket holding a latency of `nanos` nanoseconds.
fn bucket_of(nanos: u64) -> u16 {
    let index = if nanos < SUB_COUNT {
        nanos
    } else {
        let exponent = u64::from(63 - nanos.leading_zeros());
        let shift = exponent - u64::from(SUB_BITS);
        let group = shift + 1;
        group * SUB_COUNT + ((nanos >> shift) - SUB_COUNT)
    };
    // Every index is below BUCKETS (14592), which fits in a u16.
    index as u16
}

/// The midpoint, in nanoseconds, of the values that fall into `bucket`.
fn bucket_midpoint(bucket: usize) -> u64 {
    let bucket = bucket as u64;
    let group = bucket / SUB_COUNT;
    if group == 0 {
        return bucket;
    }
    let shift = group - 1;
    let low = (SUB_COUNT + bucket % SUB_COUNT) << shift;
    let half_width = (1u64 << shift) >> 1;
    low + half_width
}

/// Counts per bucket as a Fenwick (binary indexed) tree: O(log B) update and rank search.
#[derive(Debug, Clone)]
struct BucketTree {
    /// 1-based Fenwick array; `tree[0]` is unused.
    tree: Vec<usize>,
}

impl BucketTree {
    fn new() -> Self {
        BucketTree {
            tree: vec![0; BUCKETS + 1],
        }
    }

    fn add(&mut self, bucket: usize) {
        let mut i = bucket + 1;
        while i <= BUCKETS {
            self.tree[i] += 1;
            i += i & i.wrapping_neg();
        }
    }

    /// Removes one sample of `bucket`; callers only remove what they added.
    fn remove(&mut self, bucket: usize) {
        let mut i = bucket + 1;
        while i <= BUCKETS {
            self.tree[i] -= 1;
            i += i & i.wrapping_neg();
        }
    }

    /// The bucket holding the sample of 1-based `rank` in sorted order; the rank must be
    /// between 1 and the number of samples.
    fn find_rank(&self, rank: usize) -> usize {
        let mut position = 0;
        let mut remaining = rank;
        let mut step = BUCKETS.next_power_of_two();
        while step > 0 {
            let next = position + step;
            if next <= BUCKETS && self.tree[next] < remaining {
                position = next;
                remaining -= self.tree[next];
            }
            step >>= 1;
        }
        // `position` is the count of buckets whose prefix sum is below `rank`, i.e. the
        // 0-based index of the bucket that reaches it.
        position
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn us(micros: u64) -> Duration {
        Duration::from_micros(micros)
    }

    #[test]
    fn empty_window_gives_no_estimate() {
        let estimator = TailEstimator::default();
        assert!(estimator.is_empty());
        assert_eq!(estimator.estimate(), None);
        assert_eq!(estimator.quantile_of(Quantile::P50), None);
    }

    #[test]
    fn defaults_are_the_papers_refcount_and_p99() {
        let estimator = TailEstimator::default();
        assert_eq!(estimator.capacity(), 10_000);
        assert_eq!(estimator.quantile(), Quantile::P99);
    }

    #[test]
    fn invalid_configuration_is_refused() {
        assert_eq!(
            TailEstimator::new(0, Quantile::P99).err(),
            Some(EstimatorError::EmptyWindow)
        );
        for q in [0.0, -0.5, 1.5, f64::NAN] {
            assert!(Quantile::new(q).is_err(), "{q}");
        }
        assert_eq!(Quantile::new(1.0).map(Quantile::get), Ok(1.0));
    }

    #[test]
    fn small_latencies_are_exact() {
        let mut estimator = TailEstimator::new(10, Quantile::P99).unwrap();
        for nanos in [3, 1, 2, 511, 7] {
            estimator.record(Duration::from_nanos(nanos));
        }
        assert_eq!(estimator.estimate(), Some(Duration::from_nanos(511)));
        assert_eq!(
            estimator.quantile_of(Quantile::P50),
            Some(Duration::from_nanos(3))
        );
    }

    #[test]
    fn eviction_forgets_the_oldest_samples() {
        let mut estimator = TailEstimator::new(4, Quantile::P99).unwrap();
        for micros in [100, 100, 1, 1] {
            estimator.record(us(micros));
        }
        assert_eq!(estimator.len(), 4);
        // The two 100 us samples leave the window as two more 1 us samples arrive.
        estimator.record(us(1));
        estimator.record(us(1));
        assert_eq!(estimator.len(), 4);
        let p99 = estimator.estimate().unwrap();
        assert!(p99 < us(2), "p99 = {p99:?} after eviction");
    }

    #[test]
    fn quantile_edges_are_min_and_max() {
        // Multiples of 5 ns up to 500 ns: all in exact buckets.
        let mut estimator = TailEstimator::new(100, Quantile::P99).unwrap();
        for i in 1..=100u64 {
            estimator.record(Duration::from_nanos(i * 5));
        }
        let tiny = Quantile::new(1e-9).unwrap();
        assert_eq!(estimator.quantile_of(tiny), Some(Duration::from_nanos(5)));
        let max = Quantile::new(1.0).unwrap();
        assert_eq!(estimator.quantile_of(max), Some(Duration::from_nanos(500)));
        // Nearest rank: ceil(0.99 * 100) = 99, the 99th smallest.
        assert_eq!(estimator.estimate(), Some(Duration::from_nanos(495)));
    }

    #[test]
    fn rank_follows_nearest_rank_definition() {
        assert_eq!(Quantile::P99.rank(10_000), 9_900);
        assert_eq!(Quantile::P99.rank(1), 1);
        assert_eq!(Quantile::P50.rank(3), 2);
        assert_eq!(Quantile::new(0.07).map(|q| q.rank(100)), Ok(7));
        assert_eq!(Quantile::new(1e-9).map(|q| q.rank(5)), Ok(1));
    }

    #[test]
    fn large_latencies_stay_within_the_error_bound() {
        let mut estimator = TailEstimator::new(1, Quantile::P99).unwrap();
        for nanos in [513, 1_000, 1_999, 123_456_789, u64::MAX / 3, u64::MAX] {
            estimator.record(Duration::from_nanos(nanos));
            let estimate = estimator.estimate().unwrap().as_nanos() as f64;
            let exact = nanos as f64;
            assert!(
                (estimate - exact).abs() <= exact * MAX_RELATIVE_ERROR,
                "{nanos} ns estimated as {estimate}"
            );
        }
    }

    #[test]
    fn durations_beyond_u64_nanoseconds_saturate() {
        let mut estimator = TailEstimator::new(1, Quantile::P99).unwrap();
        estimator.record(Duration::MAX);
        let estimate = estimator.estimate().unwrap().as_nanos() as f64;
        assert!(estimate >= u64::MAX as f64 * (1.0 - MAX_RELATIVE_ERROR));
    }

    #[test]
    fn at_rank_is_the_sorted_sample_and_none_beyond_the_window() {
        let mut estimator = TailEstimator::new(10, Quantile::P99).unwrap();
        for nanos in [50, 10, 40, 20, 30] {
            estimator.record(Duration::from_nanos(nanos));
        }
        assert_eq!(estimator.at_rank(0), None);
        assert_eq!(estimator.at_rank(1), Some(Duration::from_nanos(10)));
        assert_eq!(estimator.at_rank(4), Some(Duration::from_nanos(40)));
        assert_eq!(estimator.at_rank(5), Some(Duration::from_nanos(50)));
        assert_eq!(estimator.at_rank(6), None);
        let ns = Duration::from_nanos;
        assert_eq!(estimator.newest_range(0), None);
        assert_eq!(estimator.newest_range(1), Some((ns(30), ns(30))));
        assert_eq!(estimator.newest_range(2), Some((ns(20), ns(30))));
        assert_eq!(estimator.newest_range(3), Some((ns(20), ns(40))));
        assert_eq!(estimator.newest_range(5), Some((ns(10), ns(50))));
        assert_eq!(estimator.newest_range(6), None);
    }

    #[test]
    fn clear_empties_the_window() {
        let mut estimator = TailEstimator::default();
        estimator.record(us(5));
        estimator.clear();
        assert!(estimator.is_empty());
        assert_eq!(estimator.estimate(), None);
        estimator.record(Duration::from_nanos(300));
        assert_eq!(estimator.estimate(), Some(Duration::from_nanos(300)));
    }

    #[test]
    fn every_bucket_midpoint_maps_back_to_its_bucket() {
        for bucket in 0..BUCKETS {
            assert_eq!(usize::from(bucket_of(bucket_midpoint(bucket))), bucket);
        }
        assert_eq!(usize::from(bucket_of(u64::MAX)), BUCKETS - 1);
    }

    /// The error bound from first principles: from 512 ns on a bucket starting at `lo` is at
    /// most `lo / 2^8` wide (8 sub-bucket bits), so its midpoint is at most `lo / 2^9` from any
    /// value in it, and exactly that from `lo` itself: 512 ns (the first bucket 2 ns wide)
    /// is estimated as 513 ns, 1/512 off.
    #[test]
    fn the_error_bound_is_half_a_bucket_and_is_reached_at_a_buckets_low_edge() {
        assert_eq!(MAX_RELATIVE_ERROR, 1.0 / 512.0);
        let mut estimator = TailEstimator::new(1, Quantile::P99).unwrap();
        estimator.record(Duration::from_nanos(512));
        assert_eq!(estimator.estimate(), Some(Duration::from_nanos(513)));
        assert_eq!((513.0 - 512.0) / 512.0, MAX_RELATIVE_ERROR);
    }

    /// An estimator reports the quantile it was built with (not the default p99), and is
    /// empty only until a sample arrives and again after `clear`.
    #[test]
    fn an_estimator_reports_its_own_quantile_and_whether_it_holds_samples() {
        let mut estimator = TailEstimator::new(100, Quantile::P50).unwrap();
        assert_eq!(estimator.quantile(), Quantile::P50);
        estimator.record(us(3));
        assert!(!estimator.is_empty());
        assert_eq!(estimator.len(), 1);
        estimator.clear();
        assert!(estimator.is_empty());
    }
}
