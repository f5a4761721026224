//! Per-flow measurements inside the measurement window.
//!
//! Latencies go into an HDR histogram in nanoseconds with three significant digits, so
//! percentiles are exact to 0.1% at any scale from nanoseconds to seconds. Only samples
//! that complete inside the window (after the warm-up, before the end) count.

use hdrhistogram::Histogram;

use crate::report::LatencyReport;
use crate::time::Picos;

/// Measurements of one flow.
pub struct FlowMetrics {
    window: (Picos, Picos),
    latency_ns: Histogram<u64>,
    messages: u64,
    /// Messages completed since the start of the run, window or not (for time series).
    all_messages: u64,
}

impl FlowMetrics {
    /// Empty measurements for the window `[start, end)`.
    pub fn new(window: (Picos, Picos)) -> Self {
        // One hour in ns is far beyond any sample.
        let latency_ns = Histogram::new_with_bounds(1, 3_600_000_000_000, 3)
            .unwrap_or_else(|_| unreachable!("constant histogram bounds are valid"));
        FlowMetrics {
            window,
            latency_ns,
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
            let ns = (latency / 1_000).max(1);
            self.latency_ns.saturating_record(ns);
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
        let h = &self.latency_ns;
        if h.is_empty() {
            return None;
        }
        let us = |ns: u64| ns as f64 / 1e3;
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::time::MICROSECOND;

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
    fn no_samples_no_percentiles() {
        assert!(FlowMetrics::new((0, 1)).latency().is_none());
    }
}
