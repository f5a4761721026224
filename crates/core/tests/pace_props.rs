//! Property tests of the pacer: the burst bound over any interval, and the rate under
//! continuous demand. The bounds are the ones the `pacer` module documents, computed here
//! from the rate, the chunk size and the constants, never from the pacer's own state.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use justitia_core::pacer::{PaceRate, Pacer, BURST_CHUNKS, BURST_WINDOW, MAX_LATENESS_CREDIT};
use proptest::prelude::*;

/// The documented burst: max(2 chunks, 1 us at the rate), in bytes.
fn burst(rate: u64, chunk: u32) -> f64 {
    (rate as f64 * BURST_WINDOW.as_secs_f64()).max((BURST_CHUNKS * u64::from(chunk)) as f64)
}

/// What a caller does next after a decision.
#[derive(Debug, Clone, Copy)]
struct Step {
    /// Bytes of the request.
    bytes: u32,
    /// After a release: the gap to the next request, in ns.
    gap_ns: u64,
    /// After a refusal: when to come back, as a fraction of the wait named (above 1 is
    /// late).
    return_at: f64,
}

fn steps(max_request: u32, lateness: f64) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (
            1..=max_request,
            prop_oneof![3 => Just(0u64), 1 => 0u64..2_000_000],
            0.0..=lateness,
        )
            .prop_map(|(bytes, gap_ns, return_at)| Step {
                bytes,
                gap_ns,
                return_at,
            }),
        1..600,
    )
}

/// Runs a caller through `steps`; returns the releases as (time in ns, bytes).
fn run(rate: PaceRate, steps: &[Step]) -> Vec<(u64, u64)> {
    let mut pacer = Pacer::new(rate, Duration::ZERO);
    let mut now = 0u64;
    let mut released = Vec::new();
    for step in steps {
        let at = Duration::from_nanos(now);
        match pacer.try_release(at, u64::from(step.bytes), 1) {
            Ok(()) => {
                released.push((now, u64::from(step.bytes)));
                now += step.gap_ns;
            }
            Err(wait) => {
                now += (wait.as_nanos() as f64 * step.return_at) as u64;
            }
        }
    }
    released
}

/// The largest excess of bytes released over rate x interval, over every interval that
/// starts and ends at a release.
fn worst_excess(rate: u64, released: &[(u64, u64)]) -> f64 {
    let mut worst = f64::NEG_INFINITY;
    for (i, &(start, _)) in released.iter().enumerate() {
        let mut bytes = 0u64;
        for &(end, b) in &released[i..] {
            bytes += b;
            let allowed = rate as f64 * (end - start) as f64 * 1e-9;
            worst = worst.max(bytes as f64 - allowed);
        }
    }
    worst
}

fn pace_rate() -> impl Strategy<Value = PaceRate> {
    (1_000_000u64..=12_500_000_000, 256u32..=1_048_576).prop_map(|(bytes_per_sec, chunk)| {
        PaceRate {
            bytes_per_sec,
            ops_per_sec: None,
            chunk_bytes: chunk,
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// A caller that never comes back later than told: over any interval,
    /// released <= rate x interval + burst + one request.
    #[test]
    fn punctual_callers_never_exceed_rate_plus_burst(
        rate in pace_rate(),
        steps in steps(1_048_576, 1.0),
    ) {
        let largest = steps.iter().map(|s| s.bytes).max().unwrap_or(0);
        let released = run(rate, &steps);
        let bound = burst(rate.bytes_per_sec, rate.chunk_bytes) + f64::from(largest);
        let excess = worst_excess(rate.bytes_per_sec, &released);
        prop_assert!(excess <= bound, "excess {} > bound {}", excess, bound);
    }

    /// Any caller, late or not: from the start the same bound holds, and over any interval
    /// the lateness credit may add at most MAX_LATENESS_CREDIT at the rate.
    #[test]
    fn late_callers_gain_at_most_the_lateness_credit(
        rate in pace_rate(),
        steps in steps(1_048_576, 30.0),
    ) {
        let largest = steps.iter().map(|s| s.bytes).max().unwrap_or(0);
        let released = run(rate, &steps);
        let r = rate.bytes_per_sec as f64;
        let bound = burst(rate.bytes_per_sec, rate.chunk_bytes) + f64::from(largest);
        if let Some(&(end, _)) = released.last() {
            let total: u64 = released.iter().map(|&(_, b)| b).sum();
            let from_start = total as f64 - r * end as f64 * 1e-9;
            prop_assert!(from_start <= bound, "from start {} > {}", from_start, bound);
        }
        let credit = r * MAX_LATENESS_CREDIT.as_secs_f64();
        let excess = worst_excess(rate.bytes_per_sec, &released);
        prop_assert!(excess <= bound + credit, "excess {} > {}", excess, bound + credit);
    }

    /// Continuous demand, coming back exactly when told: by any time T,
    /// released >= rate x T - one request.
    #[test]
    fn continuous_demand_gets_the_rate(
        rate in pace_rate(),
        sizes in prop::collection::vec(1u32..=1_048_576, 1..50),
        horizon_ms in 1u64..2_000,
    ) {
        let mut pacer = Pacer::new(rate, Duration::ZERO);
        let horizon = horizon_ms * 1_000_000;
        let largest = sizes.iter().copied().max().unwrap_or(0);
        let (mut now, mut sent, mut i) = (0u64, 0u64, 0usize);
        let r = rate.bytes_per_sec as f64;
        loop {
            let bytes = sizes[i % sizes.len()];
            match pacer.try_release(Duration::from_nanos(now), u64::from(bytes), 1) {
                Ok(()) => {
                    sent += u64::from(bytes);
                    i += 1;
                }
                Err(wait) => {
                    // Before the caller's next release at now + wait, the bound must hold
                    // at every instant up to then.
                    let until = (now + wait.as_nanos() as u64).min(horizon);
                    let owed = r * until as f64 * 1e-9 - f64::from(largest);
                    prop_assert!(sent as f64 >= owed, "{} < {} at {} ns", sent, owed, until);
                    if until >= horizon {
                        break;
                    }
                    now += wait.as_nanos() as u64;
                }
            }
        }
    }
}
