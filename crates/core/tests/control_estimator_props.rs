//! Property tests of the tail estimator against a sorted-window oracle.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use justitia_core::estimator::{Quantile, TailEstimator, MAX_RELATIVE_ERROR};
use proptest::prelude::*;

/// The exact quantile: the sample of nearest rank in the sorted window.
fn oracle(window: &[u64], quantile: Quantile) -> u64 {
    let mut sorted = window.to_vec();
    sorted.sort_unstable();
    sorted[quantile.rank(sorted.len()) - 1]
}

/// Latencies spread over many orders of magnitude: exact buckets, microseconds, seconds.
fn latency_nanos() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..600,
        600u64..20_000,
        20_000u64..10_000_000_000,
        any::<u64>()
    ]
}

proptest! {
    #[test]
    fn estimate_is_within_the_documented_bound_after_every_sample(
        capacity in 1usize..300,
        q in 0.001f64..=1.0,
        samples in prop::collection::vec(latency_nanos(), 1..800),
    ) {
        let quantile = Quantile::new(q).unwrap();
        let mut estimator = TailEstimator::new(capacity, quantile).unwrap();
        for (i, &nanos) in samples.iter().enumerate() {
            estimator.record(Duration::from_nanos(nanos));
            let start = (i + 1).saturating_sub(capacity);
            let window = &samples[start..=i];
            prop_assert_eq!(estimator.len(), window.len());
            let exact = oracle(window, quantile) as f64;
            let estimate = estimator.estimate().unwrap().as_nanos() as f64;
            prop_assert!(
                (estimate - exact).abs() <= exact * MAX_RELATIVE_ERROR,
                "q {} over {} samples: exact {} estimated {}", q, window.len(), exact, estimate
            );
        }
    }

    #[test]
    fn every_quantile_of_one_window_is_within_the_bound(
        samples in prop::collection::vec(latency_nanos(), 1..2_000),
        qs in prop::collection::vec(0.0001f64..=1.0, 1..20),
    ) {
        let mut estimator = TailEstimator::default();
        for &nanos in &samples {
            estimator.record(Duration::from_nanos(nanos));
        }
        for q in qs {
            let quantile = Quantile::new(q).unwrap();
            let exact = oracle(&samples, quantile) as f64;
            let estimate = estimator.quantile_of(quantile).unwrap().as_nanos() as f64;
            prop_assert!((estimate - exact).abs() <= exact * MAX_RELATIVE_ERROR);
        }
    }
}

#[test]
fn full_refcount_window_of_reference_latencies() {
    // 30000 samples around 1.3 us with a slow tail, of which the last 10000 count.
    let mut estimator = TailEstimator::default();
    let mut all = Vec::new();
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..30_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let nanos = 1_300 + state % 200 + if state.is_multiple_of(50) { 10_000 } else { 0 };
        all.push(nanos);
        estimator.record(Duration::from_nanos(nanos));
    }
    assert_eq!(estimator.len(), TailEstimator::DEFAULT_WINDOW);
    let window = &all[all.len() - TailEstimator::DEFAULT_WINDOW..];
    for quantile in [Quantile::P50, Quantile::P99] {
        let exact = oracle(window, quantile) as f64;
        let estimate = estimator.quantile_of(quantile).unwrap().as_nanos() as f64;
        assert!(
            (estimate - exact).abs() <= exact * MAX_RELATIVE_ERROR,
            "{quantile:?}: exact {exact} estimated {estimate}"
        );
    }
}
