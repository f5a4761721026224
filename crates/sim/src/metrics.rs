//! Per-flow measurements inside the measurement window.
//!
//! Latencies go into an HDR histogram in nanoseconds with three significant digits, so
//! percentiles are exact to 0.1% at any scale from nanoseconds to seconds. Only samples
//! that complete inside the window (after the warm-up, before the end) count.
//!
//! The histogram is made at a flow's first sample and grows to its largest: one covering
//! an hour from the start took 270 kB per flow, which a thousand flows paid in page faults
//! and zeroing before the first event. Its buckets depend only on the lowest value and the
//! precision, never on the range, so the percentiles are the same as with a fixed range.
//!
//! Even grown to its largest only, a histogram of millisecond latencies takes tens of kB:
//! a thousand bandwidth flows, each completing a few messages, made zeroing fresh pages
//! for their histograms the dearest part of their completions. So a flow's first samples
//! wait in a short list, and its histogram is made only when the list fills; the report of
//! a flow whose samples are all in its list reads from the list the figures the histogram
//! would give (see `listed_latency`).

use std::sync::OnceLock;

use hdrhistogram::Histogram;

use crate::report::LatencyReport;
use crate::time::Picos;

/// Precision of the latency histogram: 0.1%.
const SIGNIFICANT_DIGITS: u8 = 3;

/// Longest latency recorded as itself, ns: one hour, far beyond any sample; longer ones
/// count as an hour.
const LONGEST_NS: u64 = 3_600_000_000_000;

/// Samples a flow keeps in its list before it makes its histogram.
const LISTED_SAMPLES: usize = 256;

/// Measurements of one flow.
pub struct FlowMetrics {
    window: (Picos, Picos),
    /// `None` until the first sample inside the window. Counts of 32 bits: no bucket of
    /// a run comes near 4 G samples (adding saturates), and a flow whose latencies reach
    /// milliseconds holds half the memory that 64-bit counts would, zeroed and copied as
    /// the histogram grows.
    latency_ns: Option<Histogram<u32>>,
    /// Samples (ns, clamped) not yet in `latency_ns`, which is made when this fills.
    listed_ns: Vec<u64>,
    messages: u64,
    /// Messages completed since the start of the run, window or not (for time series).
    all_messages: u64,
}

impl FlowMetrics {
    /// Empty measurements for the window `[start, end)`.
    pub fn new(window: (Picos, Picos)) -> Self {
        FlowMetrics {
            window,
            latency_ns: None,
            listed_ns: Vec::new(),
            messages: 0,
            all_messages: 0,
        }
    }

    fn in_window(&self, t: Picos) -> bool {
        t >= self.window.0 && t < self.window.1
    }

    /// A latency sample that completed at `at`.
    pub fn record_latency(&mut self, at: Picos, latency: Picos) {
        if self.in_window(at) {
            let ns = (latency / 1_000).clamp(1, LONGEST_NS);
            match &mut self.latency_ns {
                Some(h) => record(h, ns),
                None if self.listed_ns.len() < LISTED_SAMPLES => self.listed_ns.push(ns),
                None => {
                    let mut h = histogram(&self.listed_ns);
                    record(&mut h, ns);
                    self.latency_ns = Some(h);
                    self.listed_ns = Vec::new();
                }
            }
        }
    }

    /// One application-level message (or request, or object) completed at `at`.
    pub fn record_message(&mut self, at: Picos) {
        self.all_messages += 1;
        if self.in_window(at) {
            self.messages += 1;
        }
    }

    /// Messages completed inside the window.
    pub fn messages(&self) -> u64 {
        self.messages
    }

    /// Messages completed since the start of the run, inside the window or not.
    pub fn all_messages(&self) -> u64 {
        self.all_messages
    }

    /// The latency percentiles, or `None` without samples.
    pub fn latency(&self) -> Option<LatencyReport> {
        let us = |ns: u64| ns as f64 / 1e3;
        let Some(h) = &self.latency_ns else {
            return listed_latency(&self.listed_ns);
        };
        let h = Some(h).filter(|h| !h.is_empty())?;
        Some(LatencyReport {
            samples: h.len(),
            p50_us: us(h.value_at_quantile(0.5)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            mean_us: h.mean() / 1e3,
            max_us: us(h.max()),
        })
    }
}

/// The figures a histogram of the samples `ns` gives, from the samples themselves: a
/// histogram of millisecond latencies holds tens of thousands of counts, zeroed and read
/// four times over for a report, where a flow with a few samples sorts them.
///
/// The same figures exactly: a histogram's percentile is the highest value equivalent to
/// the sample of that rank (the first bucket whose running count reaches the rank is that
/// sample's), its maximum the highest equivalent to the largest sample, and its mean the
/// sum, bucket by bucket in increasing order, of each bucket's median equivalent times its
/// count over the total (the same operations in the same order).
fn listed_latency(ns: &[u64]) -> Option<LatencyReport> {
    if ns.is_empty() {
        return None;
    }
    // Which values are equivalent depends on the precision only, not on the range.
    static BUCKETS: OnceLock<Histogram<u32>> = OnceLock::new();
    let buckets = BUCKETS.get_or_init(|| histogram(&[]));
    let mut sorted = ns.to_vec();
    sorted.sort_unstable();
    let total = sorted.len() as u64;
    let us = |ns: u64| ns as f64 / 1e3;
    let at = |quantile: f64| {
        let rank = ((quantile * total as f64).ceil() as u64).max(1);
        us(buckets.highest_equivalent(sorted[(rank - 1) as usize]))
    };
    let mut mean = 0.0_f64;
    let mut rest = &sorted[..];
    while let Some(&first) = rest.first() {
        let top = buckets.highest_equivalent(first);
        let count = rest.partition_point(|&v| v <= top);
        mean += buckets.median_equivalent(top) as f64 * count as f64 / total as f64;
        rest = &rest[count..];
    }
    Some(LatencyReport {
        samples: total,
        p50_us: at(0.5),
        p99_us: at(0.99),
        p999_us: at(0.999),
        mean_us: mean / 1e3,
        max_us: us(buckets.highest_equivalent(sorted[sorted.len() - 1])),
    })
}

/// A histogram of the samples `ns`.
fn histogram(ns: &[u64]) -> Histogram<u32> {
    let mut h = Histogram::new(SIGNIFICANT_DIGITS)
        .unwrap_or_else(|_| unreachable!("three significant digits are valid"));
    for &ns in ns {
        record(&mut h, ns);
    }
    h
}

/// Records `ns` in `h`, growing it as needed.
fn record(h: &mut Histogram<u32>, ns: u64) {
    // Growing fails only beyond i64::MAX / 2 ns, far above the clamp; should it ever, the
    // sample still counts, at the largest value tracked.
    if h.record(ns).is_err() {
        h.saturating_record(ns);
    }
}

/// Which flows changed since the last look, each listed once, so that whoever samples
/// visits those flows only, not all of them.
#[derive(Default)]
pub(crate) struct ChangedFlows {
    listed: Vec<bool>,
    list: Vec<u32>,
}

impl ChangedFlows {
    /// Notes that `flow` changed.
    pub(crate) fn mark(&mut self, flow: u32) {
        let i = flow as usize;
        if self.listed.len() <= i {
            self.listed.resize(i + 1, false);
        }
        if !self.listed[i] {
            self.listed[i] = true;
            self.list.push(flow);
        }
    }

    /// Appends the flows that changed to `out` (in the order first marked) and forgets them.
    pub(crate) fn drain_into(&mut self, out: &mut Vec<u32>) {
        for &flow in &self.list {
            self.listed[flow as usize] = false;
        }
        out.append(&mut self.list);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::time::{MICROSECOND, MILLISECOND, SECOND};

    #[test]
    fn only_the_window_counts() {
        let mut m = FlowMetrics::new((10 * MICROSECOND, 20 * MICROSECOND));
        m.record_latency(5 * MICROSECOND, MICROSECOND);
        m.record_message(5 * MICROSECOND);
        for i in 0..100 {
            m.record_latency(15 * MICROSECOND, (1_000 + i) * 1_000);
            m.record_message(15 * MICROSECOND);
        }
        m.record_message(20 * MICROSECOND);
        assert_eq!(m.messages(), 100);
        assert_eq!(m.all_messages(), 102);
        let l = m.latency().unwrap();
        assert_eq!(l.samples, 100);
        assert!((l.p50_us - 1.05).abs() < 0.002, "{l:?}");
        assert!((l.p99_us - 1.099).abs() < 0.002, "{l:?}");
    }

    #[test]
    fn changed_flows_are_listed_once_until_drained() {
        let mut c = ChangedFlows::default();
        for f in [7, 2, 7, 7, 2, 0] {
            c.mark(f);
        }
        let mut out = Vec::new();
        c.drain_into(&mut out);
        assert_eq!(out, vec![7, 2, 0]);
        c.mark(2);
        out.clear();
        c.drain_into(&mut out);
        assert_eq!(out, vec![2]);
        out.clear();
        c.drain_into(&mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn listed_samples_report_as_the_histogram_made_from_them() {
        let mut m = FlowMetrics::new((0, SECOND));
        // Ties, neighbours in one bucket, and values from nanoseconds to milliseconds.
        let samples: Vec<u64> = (0..3 * LISTED_SAMPLES as u64)
            .map(|i| match i % 4 {
                0 => (i * 7_919) % 5_000_000 + 1,
                1 => 2_048 + i % 7,
                2 => 1_400_000 + (i % 3) * 300,
                _ => i % 13 + 1,
            })
            .collect();
        for (i, &ns) in samples.iter().enumerate() {
            m.record_latency(MICROSECOND, ns * 1_000);
            // Before and after the histogram is made, the figures of all samples so far,
            // bit for bit.
            let h = histogram(&samples[..=i]);
            let l = m.latency().unwrap();
            assert_eq!(l.samples, h.len());
            let us = |ns: u64| ns as f64 / 1e3;
            assert_eq!(l.p50_us.to_bits(), us(h.value_at_quantile(0.5)).to_bits());
            assert_eq!(l.p99_us.to_bits(), us(h.value_at_quantile(0.99)).to_bits());
            assert_eq!(
                l.p999_us.to_bits(),
                us(h.value_at_quantile(0.999)).to_bits()
            );
            assert_eq!(l.mean_us.to_bits(), (h.mean() / 1e3).to_bits(), "{i}");
            assert_eq!(l.max_us.to_bits(), us(h.max()).to_bits());
        }
        assert!(m.latency_ns.is_some() && m.listed_ns.is_empty());
    }

    #[test]
    fn no_samples_no_percentiles() {
        assert!(FlowMetrics::new((0, 1)).latency().is_none());
        // A sample outside the window allocates nothing and reports nothing.
        let mut m = FlowMetrics::new((10, 20));
        m.record_latency(5, MICROSECOND);
        assert!(m.latency_ns.is_none() && m.listed_ns.is_empty());
        assert!(m.latency().is_none());
    }

    #[test]
    fn growing_histogram_keeps_the_buckets_of_a_fixed_range() {
        // 2.5 us, then 1.4 ms: the histogram grows past its first range; every figure is
        // the one a histogram covering an hour from the start gives, rounded to its
        // bucket (1 ns wide below 2048 ns, 1024 ns wide at 1.4 ms).
        let mut m = FlowMetrics::new((0, 10 * MILLISECOND));
        for _ in 0..98 {
            m.record_latency(MICROSECOND, 2_500 * 1_000);
        }
        m.record_latency(MICROSECOND, 1_400_000 * 1_000);
        m.record_latency(MICROSECOND, 1_400_000 * 1_000);
        let l = m.latency().unwrap();
        assert_eq!(l.samples, 100);
        assert!((l.p50_us - 2.501).abs() < 1e-9, "{l:?}");
        assert!((l.p999_us - 1_400.831).abs() < 1e-9, "{l:?}");
        assert!((l.max_us - 1_400.831).abs() < 1e-9, "{l:?}");
        // An hour and more counts as an hour (to 0.1%).
        m.record_latency(MICROSECOND, 7_200 * SECOND);
        let max = m.latency().unwrap().max_us;
        assert!((max / 3.6e9 - 1.0).abs() < 1e-3, "{max}");
    }
}
