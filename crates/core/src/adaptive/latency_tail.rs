//! The latency flows' tail, the law's measured input: the p99 of the round trips the
//! latency applications' own requests took, gathered per tenant between two updates.
//!
//! **Why per tenant.** The round trips come from the applications' shapers, which a
//! tenant controls. Pooled, a tenant that reports a flood of short round trips (made up,
//! or of a cheap flow of its own) would push the pool's p99 below what another tenant's
//! latency flow sees, and the law would grow the chunks that hurt that flow. Taken per
//! tenant, the tail the law reads is the worst of the tenants' p99s: a tenant's reports
//! can make the law more careful (costing the bandwidth flows at most what the law's
//! sharing guarantee leaves them), never less careful about another tenant's flows.
//!
//! **What is kept.** A tenant's count of round trips and its [`KEPT`] longest. The p99 of
//! `n` samples (nearest rank: the `ceil(0.99 n)`-th shortest) is the
//! `n - ceil(0.99 n) + 1`-th longest, so the kept ones give it exactly while that rank is
//! at most [`KEPT`] (up to 6 399 round trips between two updates); beyond, the shortest
//! kept one stands in, which is never shorter than the true p99. A shaper reports the
//! same way, its count and its longest round trips since its last report
//! ([`LatencyTail::record_longest`]), so merging reports loses nothing the p99 needs
//! while the rank is within each report's longest (a report of 12 covers 1 199 round
//! trips).
//!
//! Invariants: a tenant's pool keeps at most [`KEPT`] samples, its longest, and counts
//! every sample recorded into it; at most `max_tenants` pools exist (a new tenant beyond
//! them is not recorded); [`LatencyTail::take_p99`] empties exactly the pools it read a
//! p99 from (those with at least [`MIN_SAMPLES`]), the others keep gathering.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::flow::TenantId;

/// Round trips a tenant's pool needs before its p99 is read (fewer keep gathering into
/// the next update).
pub const MIN_SAMPLES: u64 = 20;

/// The longest round trips kept per tenant between two updates.
pub const KEPT: usize = 64;

/// One tenant's round trips since the last time its p99 was read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Pool {
    /// Round trips recorded.
    count: u64,
    /// The longest of them, shortest first, at most [`KEPT`].
    longest: Vec<Duration>,
}

impl Pool {
    fn keep(&mut self, sample: Duration) {
        if self.longest.len() == KEPT {
            if self
                .longest
                .first()
                .is_some_and(|&shortest| sample <= shortest)
            {
                return;
            }
            self.longest.remove(0);
        }
        let at = self.longest.partition_point(|&s| s <= sample);
        self.longest.insert(at, sample);
    }

    /// The nearest-rank p99 (see the module documentation), `None` below [`MIN_SAMPLES`].
    fn p99(&self) -> Option<Duration> {
        if self.count < MIN_SAMPLES {
            return None;
        }
        // Rank from the longest: n - ceil(0.99 n) + 1, in integers.
        let rank = self.count - (self.count * 99).div_ceil(100) + 1;
        let kept = self.longest.len() as u64;
        let from_shortest = kept.saturating_sub(rank.min(kept));
        self.longest.get(from_shortest as usize).copied()
    }
}

/// The latency flows' round trips, per tenant, until the law's next update reads their
/// tail. See the module documentation.
#[derive(Clone, Debug)]
pub struct LatencyTail {
    pools: BTreeMap<TenantId, Pool>,
    max_tenants: usize,
}

impl LatencyTail {
    /// Empty, with room for `max_tenants` tenants' pools.
    pub fn new(max_tenants: usize) -> Self {
        LatencyTail {
            pools: BTreeMap::new(),
            max_tenants,
        }
    }

    fn pool(&mut self, tenant: TenantId) -> Option<&mut Pool> {
        if !self.pools.contains_key(&tenant) && self.pools.len() >= self.max_tenants {
            return None;
        }
        Some(self.pools.entry(tenant).or_default())
    }

    /// Records one round trip of one of `tenant`'s latency requests. Returns false when
    /// the tenant has no pool and there is no room for one.
    pub fn record(&mut self, tenant: TenantId, sample: Duration) -> bool {
        let Some(pool) = self.pool(tenant) else {
            return false;
        };
        pool.count = pool.count.saturating_add(1);
        pool.keep(sample);
        true
    }

    /// Records a shaper's report: `count` round trips of `tenant`'s, of which `longest`
    /// are the longest (at most `count` of them are read: a report that names more
    /// than it counts is held to its count). Returns false when the
    /// tenant has no pool and there is no room for one.
    pub fn record_longest(&mut self, tenant: TenantId, count: u64, longest: &[Duration]) -> bool {
        let Some(pool) = self.pool(tenant) else {
            return false;
        };
        let named = longest
            .len()
            .min(usize::try_from(count).unwrap_or(usize::MAX));
        pool.count = pool.count.saturating_add(count);
        for &sample in &longest[..named] {
            pool.keep(sample);
        }
        true
    }

    /// The latency flows' tail since the last call: the longest p99 among the tenants with
    /// at least [`MIN_SAMPLES`] round trips, whose pools are then emptied; `None` when no
    /// tenant has that many (all keep gathering).
    pub fn take_p99(&mut self) -> Option<Duration> {
        let mut tail = None;
        self.pools.retain(|_, pool| match pool.p99() {
            Some(p99) => {
                tail = tail.max(Some(p99));
                false
            }
            None => true,
        });
        tail
    }

    /// Keeps the round trips of the tenants `keep` names, forgets the others' (they left,
    /// and their pools would hold room another tenant needs).
    pub fn retain(&mut self, mut keep: impl FnMut(TenantId) -> bool) {
        self.pools.retain(|&tenant, _| keep(tenant));
    }

    /// Tenants with round trips gathering.
    pub fn tenants(&self) -> usize {
        self.pools.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// The nearest-rank p99 of all the samples, sorted in full: what the pool must give.
    fn sorted_p99(samples: &[Duration]) -> Duration {
        let mut s = samples.to_vec();
        s.sort();
        let at = (s.len() * 99).div_ceil(100) - 1;
        s[at]
    }

    #[test]
    fn fewer_than_the_minimum_keep_gathering() {
        let mut tail = LatencyTail::new(4);
        for n in 1..MIN_SAMPLES {
            tail.record(TenantId(1), us(n));
        }
        assert_eq!(tail.take_p99(), None);
        assert_eq!(tail.tenants(), 1);
        tail.record(TenantId(1), us(100));
        // 20 samples: ceil(19.8) = 20th shortest, the longest.
        assert_eq!(tail.take_p99(), Some(us(100)));
        assert_eq!(tail.tenants(), 0);
        assert_eq!(tail.take_p99(), None);
    }

    #[test]
    fn the_p99_of_a_hundred_and_of_two_hundred() {
        let mut tail = LatencyTail::new(4);
        for n in 1..=100 {
            tail.record(TenantId(1), us(n));
        }
        assert_eq!(tail.take_p99(), Some(us(99)));
        for n in 1..=200 {
            tail.record(TenantId(1), us(n));
        }
        assert_eq!(tail.take_p99(), Some(us(198)));
    }

    /// 10 000 samples 1..=10 000 us: the p99 is the 9 900th shortest, the 101st longest,
    /// beyond the 64 kept: the shortest kept, 9 937 us, stands in (never below the true
    /// 9 900 us).
    #[test]
    fn beyond_what_is_kept_the_shortest_kept_stands_in() {
        let mut tail = LatencyTail::new(4);
        for n in 1..=10_000 {
            tail.record(TenantId(1), us(n));
        }
        assert_eq!(tail.take_p99(), Some(us(10_000 - KEPT as u64 + 1)));
    }

    #[test]
    fn the_worst_tenant_is_the_tail_and_a_flood_of_short_ones_does_not_hide_it() {
        let mut tail = LatencyTail::new(4);
        for _ in 0..100 {
            tail.record(TenantId(1), us(50));
        }
        // Tenant 2 floods: pooled, 100 000 samples of 1 us would make the p99 1 us.
        assert!(tail.record_longest(TenantId(2), 100_000, &[us(1); 12]));
        assert_eq!(tail.take_p99(), Some(us(50)));
    }

    #[test]
    fn a_tenant_below_the_minimum_waits_while_another_is_read() {
        let mut tail = LatencyTail::new(4);
        for _ in 0..30 {
            tail.record(TenantId(1), us(10));
        }
        for _ in 0..5 {
            tail.record(TenantId(2), us(500));
        }
        assert_eq!(tail.take_p99(), Some(us(10)));
        for _ in 0..15 {
            tail.record(TenantId(2), us(400));
        }
        // Tenant 2's 20: its five of 500 us gathered since before are its longest.
        assert_eq!(tail.take_p99(), Some(us(500)));
    }

    #[test]
    fn a_report_is_read_no_further_than_it_counts() {
        let mut tail = LatencyTail::new(4);
        // Counts 2, names 3: the third is not read.
        tail.record_longest(TenantId(1), 2, &[us(1), us(2), us(900)]);
        // Counts 0 and names 18: nothing.
        tail.record_longest(TenantId(1), 0, &[us(3); 18]);
        assert_eq!(tail.take_p99(), None);
        tail.record_longest(TenantId(1), 18, &[us(3); 18]);
        // 20 counted: 1, 2 and 18 of 3 us; the 900 us named beyond its count is not read.
        assert_eq!(tail.take_p99(), Some(us(3)));
    }

    #[test]
    fn pools_are_capped_at_the_tenants_given() {
        let mut tail = LatencyTail::new(2);
        assert!(tail.record(TenantId(1), us(1)));
        assert!(tail.record(TenantId(2), us(1)));
        assert!(!tail.record(TenantId(3), us(1)));
        assert!(!tail.record_longest(TenantId(3), 40, &[us(1)]));
        assert!(tail.record(TenantId(2), us(1)));
        tail.retain(|t| t != TenantId(1));
        assert!(tail.record(TenantId(3), us(1)));
        assert_eq!(tail.tenants(), 2);
    }

    proptest! {
        /// While the rank of the p99 is within what is kept, the pool's p99 is exactly
        /// that of all samples sorted; whatever the count, it is never below it.
        #[test]
        fn the_pool_gives_the_sorted_p99(
            samples in proptest::collection::vec(0u64..1_000_000, MIN_SAMPLES as usize..8_000),
        ) {
            let samples: Vec<Duration> = samples.into_iter().map(Duration::from_nanos).collect();
            let mut tail = LatencyTail::new(1);
            for &s in &samples {
                tail.record(TenantId(7), s);
            }
            let n = samples.len() as u64;
            let rank = n - (n * 99).div_ceil(100) + 1;
            let got = tail.take_p99().unwrap();
            let want = sorted_p99(&samples);
            if rank <= KEPT as u64 {
                prop_assert_eq!(got, want);
            } else {
                prop_assert!(got >= want);
            }
        }

        /// A shaper's reports (its count and its longest 12 of each batch) give the
        /// daemon's pool the p99 the samples themselves give, while the rank is within
        /// the 12 longest of every batch (beyond, the report is a subset of the samples
        /// and promises nothing).
        #[test]
        fn reports_of_the_longest_lose_nothing_the_p99_needs(
            batches in proptest::collection::vec(
                proptest::collection::vec(0u64..1_000_000, 1..400), 1..6),
        ) {
            let mut direct = LatencyTail::new(1);
            let mut reported = LatencyTail::new(1);
            for batch in &batches {
                let batch: Vec<Duration> = batch.iter().copied().map(Duration::from_nanos).collect();
                for &s in &batch {
                    direct.record(TenantId(1), s);
                }
                let mut longest = batch.clone();
                longest.sort();
                let longest = &longest[longest.len().saturating_sub(12)..];
                reported.record_longest(TenantId(1), batch.len() as u64, longest);
            }
            let n: u64 = batches.iter().map(|b| b.len() as u64).sum();
            let rank = n.saturating_sub((n * 99).div_ceil(100)) + 1;
            let (d, r) = (direct.take_p99(), reported.take_p99());
            prop_assume!(rank <= 12);
            prop_assert_eq!(d, r);
        }
    }
}
