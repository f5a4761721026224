//! Property tests of the pacer: the burst bound over any interval, and the rate under
//! continuous demand, with the default burst window and with an enforcer's own. The bounds
//! are the ones the `pacer` module documents, computed here from the rate, the chunk size,
//! the window and the constants, never from the pacer's own state.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use justitia_core::pacer::{PaceRate, Pacer, BURST_CHUNKS, BURST_WINDOW, MAX_LATENESS_CREDIT};
use proptest::prelude::*;

/// The documented burst with the default window: max(2 chunks, 1 us at the rate), in bytes.
fn burst(rate: u64, chunk: u32) -> f64 {
    burst_within(rate, chunk, BURST_WINDOW)
}

/// The documented burst with an enforcer's window: max(2 chunks, window x rate), in bytes.
fn burst_within(rate: u64, chunk: u32, window: Duration) -> f64 {
    (rate as f64 * window.as_secs_f64()).max((BURST_CHUNKS * u64::from(chunk)) as f64)
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
    /// After a refusal: nanoseconds to come back later still, on top of `return_at`.
    late_ns: u64,
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
                late_ns: 0,
            }),
        1..600,
    )
}

/// Steps of a caller that comes back after the time it was told by up to `window_ns`.
fn steps_late_within(max_request: u32, window_ns: u64) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (
            1..=max_request,
            prop_oneof![3 => Just(0u64), 1 => 0u64..2_000_000],
            0..=window_ns,
        )
            .prop_map(|(bytes, gap_ns, late_ns)| Step {
                bytes,
                gap_ns,
                return_at: 1.0,
                late_ns,
            }),
        1..600,
    )
}

/// Runs a caller through `steps`; returns the releases as (time in ns, bytes).
fn run(rate: PaceRate, steps: &[Step]) -> Vec<(u64, u64)> {
    run_pacer(Pacer::new(rate, Duration::ZERO), steps)
}

/// Runs a caller of `pacer`, new at time zero, through `steps`.
fn run_pacer(mut pacer: Pacer, steps: &[Step]) -> Vec<(u64, u64)> {
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
                now += (wait.as_nanos() as f64 * step.return_at) as u64 + step.late_ns;
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

/// An enforcer's window, from none to 1 ms.
fn window() -> impl Strategy<Value = Duration> {
    (0u64..=1_000_000).prop_map(Duration::from_nanos)
}

/// How a caller with requests always waiting comes back to the pacer.
#[derive(Debug, Clone, Copy)]
enum Visits {
    /// Every `period` ns, whatever it was told.
    Periodic { period: u64 },
    /// Always `late` ns after the time it was told.
    Late { late: u64 },
    /// After the time it was told by a lateness drawn uniformly from [0, window], from a
    /// xorshift sequence started at `seed`.
    Uniform { seed: u64 },
}

/// Ways of visiting within a window of `window_ns`.
fn visits_within(window_ns: u64) -> impl Strategy<Value = Visits> {
    prop_oneof![
        (window_ns / 20..=window_ns).prop_map(|period| Visits::Periodic {
            period: period.max(1)
        }),
        (0..=window_ns).prop_map(|late| Visits::Late { late }),
        (1u64..).prop_map(|seed| Visits::Uniform { seed }),
    ]
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

    /// With an enforcer's window and a punctual caller: over any interval,
    /// released <= rate x interval + max(2 chunks, window x rate) + one request.
    #[test]
    fn punctual_callers_never_exceed_rate_plus_the_window_burst(
        rate in pace_rate(),
        window in window(),
        steps in steps(1_048_576, 1.0),
    ) {
        let largest = steps.iter().map(|s| s.bytes).max().unwrap_or(0);
        let released = run_pacer(Pacer::with_burst_window(rate, window, Duration::ZERO), &steps);
        let bound = burst_within(rate.bytes_per_sec, rate.chunk_bytes, window) + f64::from(largest);
        let excess = worst_excess(rate.bytes_per_sec, &released);
        prop_assert!(excess <= bound, "excess {} > bound {}", excess, bound);
    }

    /// A caller late by up to its window is still held to the window burst: lateness the
    /// burst absorbs earns no credit on top of it.
    #[test]
    fn callers_late_within_the_window_never_exceed_rate_plus_the_window_burst(
        rate in pace_rate(),
        window in window(),
        steps in steps_late_within(1_048_576, 1_000_000),
    ) {
        let window_ns = window.as_nanos() as u64;
        let steps: Vec<Step> = steps
            .into_iter()
            .map(|s| Step { late_ns: s.late_ns.min(window_ns), ..s })
            .collect();
        let largest = steps.iter().map(|s| s.bytes).max().unwrap_or(0);
        let released = run_pacer(Pacer::with_burst_window(rate, window, Duration::ZERO), &steps);
        let bound = burst_within(rate.bytes_per_sec, rate.chunk_bytes, window) + f64::from(largest);
        let excess = worst_excess(rate.bytes_per_sec, &released);
        prop_assert!(excess <= bound, "excess {} > bound {}", excess, bound);
    }

    /// Any caller, late or not, with an enforcer's window: the lateness credit is the only
    /// thing on top of the window's bound.
    #[test]
    fn late_callers_with_a_window_gain_at_most_the_lateness_credit(
        rate in pace_rate(),
        window in window(),
        steps in steps(1_048_576, 30.0),
    ) {
        let largest = steps.iter().map(|s| s.bytes).max().unwrap_or(0);
        let released = run_pacer(Pacer::with_burst_window(rate, window, Duration::ZERO), &steps);
        let r = rate.bytes_per_sec as f64;
        let bound = burst_within(rate.bytes_per_sec, rate.chunk_bytes, window) + f64::from(largest);
        let credit = r * MAX_LATENESS_CREDIT.as_secs_f64();
        let excess = worst_excess(rate.bytes_per_sec, &released);
        prop_assert!(excess <= bound + credit, "excess {} > {}", excess, bound + credit);
    }

    /// A caller with requests always waiting that visits within its window (every period up
    /// to the window, or late by up to the window, fixed or uniformly random) and releases
    /// what is due each time keeps at least 99 % of the rate.
    #[test]
    fn callers_within_the_window_keep_the_rate(
        (window_ns, visits) in (1_000u64..=100_000)
            .prop_flat_map(|w| (Just(w), visits_within(w))),
        bytes_per_sec in 1_000_000u64..=12_500_000_000,
        chunk in 4_096u32..=1_048_576,
        sizes in prop::collection::vec(1u32..=64, 1..20),
    ) {
        let rate = PaceRate { bytes_per_sec, ops_per_sec: None, chunk_bytes: chunk };
        let window = Duration::from_nanos(window_ns);
        let mut pacer = Pacer::with_burst_window(rate, window, Duration::ZERO);
        // Requests from half a chunk to a chunk, in 64ths.
        let sizes: Vec<u64> = sizes
            .iter()
            .map(|&s| u64::from(chunk) * u64::from(32 + s / 2) / 64)
            .collect();
        let r = bytes_per_sec as f64;
        // Long enough for a hundred bursts of the larger kind, so the first burst's credit
        // is small beside what the rate earns.
        let horizon = (100.0 * (window_ns as f64 + 2e9 * f64::from(chunk) / r)) as u64;
        let (mut now, mut sent, mut i, mut last_visit) = (0u64, 0u64, 0usize, 0u64);
        let mut x = match visits { Visits::Uniform { seed } => seed, _ => 0 };
        while now < horizon {
            let at = Duration::from_nanos(now);
            last_visit = now;
            let wait = loop {
                match pacer.try_release(at, sizes[i % sizes.len()], 1) {
                    Ok(()) => {
                        sent += sizes[i % sizes.len()];
                        i += 1;
                    }
                    Err(wait) => break wait.as_nanos() as u64,
                }
            };
            now += match visits {
                Visits::Periodic { period } => period,
                Visits::Late { late } => wait + late,
                Visits::Uniform { .. } => {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    wait + x % (window_ns + 1)
                }
            };
        }
        // By the last visit, which released what was due then.
        let earned = r * last_visit as f64 * 1e-9;
        prop_assert!(
            sent as f64 >= 0.99 * earned,
            "{} B < 99 % of {} B over {} ns",
            sent,
            earned,
            last_visit
        );
    }
}
