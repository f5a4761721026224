//! Justitia's control loop, as the `justitia` policy drives the core's loop, read from the
//! recorded trajectory of real runs (`scenarios/control-loop-ib56.toml`, sampled every
//! 0.1 ms), and the operating points of J1, J4 and P3 with targets in the probe's units.
//!
//! Expected values come from the scenario and the profile (IB-56: MaxRate 48 Gb/s; one
//! latency and one bandwidth flow: sharing floor 1/2 x MaxRate), never from the loop.

mod common;

use common::{flow, latency, report, run};
use justitia_sim::series::{ControlSeries, Mode, RunSeries};

const SCENARIO: &str = "control-loop-ib56";
const MAX_RATE_GBPS: f64 = 48.0;
const FLOOR_GBPS: f64 = 24.0;
const REF_PERIOD_MS: f64 = 0.5;

fn series(variant: &str) -> RunSeries {
    run(&report(SCENARIO), variant).series.clone()
}

fn control(s: &RunSeries) -> &ControlSeries {
    s.control("a")
        .unwrap_or_else(|| panic!("host a runs no loop"))
}

fn gbps<'a>(s: &'a RunSeries, name: &str) -> &'a [f64] {
    &s.flow(name)
        .unwrap_or_else(|| panic!("no flow {name}"))
        .gbps
}

/// Mean of `values[from..to]`.
fn mean(values: &[f64], from: usize, to: usize) -> f64 {
    values[from..to].iter().sum::<f64>() / (to - from) as f64
}

/// A target below the probe's idle p99 is violated at every update: SafeUtil halves from
/// MaxRate once, to the sharing floor, and holds it.
#[test]
fn halving_on_a_violation_and_the_floor_holding() {
    let s = series("floor");
    let safe = &control(&s).safe_util_gbps;
    assert!((safe[0] - MAX_RATE_GBPS).abs() < 1e-6, "starts at MaxRate");
    let first_drop = (1..safe.len())
        .find(|&i| safe[i] < safe[i - 1])
        .unwrap_or_else(|| panic!("SafeUtil never decreased"));
    assert!(
        (safe[first_drop] - safe[first_drop - 1] / 2.0).abs() < 1e-6,
        "a violation halves: {} -> {}",
        safe[first_drop - 1],
        safe[first_drop]
    );
    let low = safe[first_drop..].iter().copied().fold(f64::MAX, f64::min);
    let high = safe[first_drop..].iter().copied().fold(0.0, f64::max);
    assert!(
        (low - FLOOR_GBPS).abs() < 1e-3 && (high - FLOOR_GBPS).abs() < 1e-3,
        "the floor holds: SafeUtil in [{low}, {high}] after the halving"
    );
    let bw = flow(run(&report(SCENARIO), "floor"), "bw").gbps;
    assert!((bw - FLOOR_GBPS).abs() < 0.03 * FLOOR_GBPS, "bw {bw} Gb/s");
}

/// 1.5 x the probe's idle p99 is met only partly loaded: SafeUtil settles strictly between
/// the floor and MaxRate (24 and 48 Gb/s: 1.25 x the floor to 0.95 x MaxRate on average,
/// pinned at neither), and the latency flow (which measures as the probe does) stays at the
/// target.
#[test]
fn safe_util_settles_between_floor_and_max_rate_and_the_target_holds() {
    let r = report(SCENARIO);
    let s = series("settle");
    let c = control(&s);
    let from = s.index_at(200.0);
    let tail = &c.safe_util_gbps[from..];
    let avg = mean(tail, 0, tail.len());
    let at_floor = tail.iter().filter(|&&v| v <= FLOOR_GBPS * 1.001).count() as f64;
    let at_max = tail.iter().filter(|&&v| v >= MAX_RATE_GBPS * 0.999).count() as f64;
    eprintln!(
        "settle: SafeUtil mean {avg:.1} Gb/s, {:.1}% of samples at the floor, {:.1}% at MaxRate",
        100.0 * at_floor / tail.len() as f64,
        100.0 * at_max / tail.len() as f64
    );
    assert!(
        avg > FLOOR_GBPS * 1.25 && avg < MAX_RATE_GBPS * 0.95,
        "SafeUtil mean {avg} Gb/s is not strictly between floor and MaxRate"
    );
    assert!(at_floor / (tail.len() as f64) < 0.05, "pinned at the floor");
    assert!(at_max / (tail.len() as f64) < 0.05, "pinned at MaxRate");
    // The target is the loop's 1.5 x its probe's idle p99 (how it is measured is the core's
    // `an_idle_multiple_target_is_measured_uncontended_then_regulates`); what is asserted
    // here is where the loop settles against it.
    let target = c.target99_us[c.target99_us.len() - 1]
        .unwrap_or_else(|| panic!("the idle p99 was never measured"));
    // The loop halves only when its window shows the p99 above the target beyond chance
    // (the default rule, 10^-3 per update), so it settles where the p99 is at the target,
    // not below it: within 1% (2.609 us against 2.601 us), where MaxRate gives 4.5 us.
    // The 1% is the measured 0.3% with room, a regression bound, not one derived: what
    // the rule bounds is how many of a window's probes exceed the target without a
    // halving (at most 21 of 1000, 5 of 100), a quantile near the 98th; how far the p99
    // then lies above the target is the plant's rise between those quantiles, and the
    // report gives only p50, p99 and p99.9.
    let lat = latency(run(&r, "settle"), "lat");
    assert!(
        lat.p99_us <= target * 1.01,
        "latency flow p99 {} us more than 1% above the target {target} us",
        lat.p99_us
    );
    let bw = flow(run(&r, "settle"), "bw").gbps;
    eprintln!(
        "settle operating point: lat p99 {:.2} us (target {target:.2}), bw {bw:.1} Gb/s",
        lat.p99_us
    );
    assert!(
        bw > FLOOR_GBPS * 1.25,
        "bw {bw} Gb/s no better than the floor"
    );
}

/// When the only latency flow leaves (500 ms), SafeUtil and the bandwidth flow are back to
/// 95% of MaxRate within 10 ms.
#[test]
fn recovery_to_95_percent_of_max_rate_within_10_ms() {
    let s = series("recovery");
    let c = control(&s);
    let left = s.index_at(500.0);
    let safe_back = (left..s.t_ms.len())
        .find(|&i| c.safe_util_gbps[i] >= 0.95 * MAX_RATE_GBPS)
        .map(|i| s.t_ms[i] - 500.0)
        .unwrap_or(f64::INFINITY);
    let bw = gbps(&s, "bw");
    // Goodput over 1 ms (ten samples), so that one packet more or less does not count.
    let bw_back = (left..s.t_ms.len() - 10)
        .find(|&i| mean(bw, i, i + 10) >= 0.95 * MAX_RATE_GBPS)
        .map(|i| s.t_ms[i + 9] - 500.0)
        .unwrap_or(f64::INFINITY);
    eprintln!("recovery: SafeUtil at 95% after {safe_back:.1} ms, bw after {bw_back:.1} ms");
    assert!(safe_back <= 10.0, "SafeUtil back after {safe_back} ms");
    assert!(bw_back <= 10.0, "bandwidth back after {bw_back} ms");
    // And it was regulating below 95% before: the recovery is a recovery.
    assert!(mean(&c.safe_util_gbps, s.index_at(400.0), left) < 0.95 * MAX_RATE_GBPS);
}

/// A target no load meets is given up after delta (100 ms here), and pursued again when a
/// second latency flow joins (L/(B+T) above its value at entry).
#[test]
fn unattainable_mode_entered_and_left() {
    let s = series("unattainable");
    let c = control(&s);
    let entered = (0..s.t_ms.len())
        .find(|&i| c.mode[i] == Mode::Unattainable)
        .unwrap_or_else(|| panic!("never entered the unattainable mode"));
    let left = (entered..s.t_ms.len())
        .find(|&i| c.mode[i] == Mode::Normal)
        .unwrap_or_else(|| panic!("never left the unattainable mode"));
    let (entered_ms, left_ms) = (s.t_ms[entered], s.t_ms[left]);
    eprintln!("unattainable: entered at {entered_ms} ms, left at {left_ms} ms");
    assert!(
        (100.0..=100.0 + 62.0).contains(&entered_ms),
        "entered at {entered_ms}"
    );
    assert!(
        (500.0..=500.0 + 2.0 * REF_PERIOD_MS).contains(&left_ms),
        "left at {left_ms}"
    );
    // In the mode the resource-hungry flows share the whole RNIC.
    assert!((c.safe_util_gbps[(entered + left) / 2] - MAX_RATE_GBPS).abs() < 1e-6);
    assert!(mean(gbps(&s, "bw"), entered + 10, left - 10) > 0.9 * MAX_RATE_GBPS);
}

/// However the flows and the probe behave, SafeUtil decreases at most once per RefPeriod.
#[test]
fn at_most_one_decrease_per_ref_period() {
    let r = report(SCENARIO);
    let mut checked = 0;
    for run in r.runs.iter().filter(|run| !run.series.controls.is_empty()) {
        let s = &run.series;
        let safe = &control(s).safe_util_gbps;
        let drops: Vec<f64> = (1..safe.len())
            .filter(|&i| safe[i] < safe[i - 1])
            .map(|i| s.t_ms[i])
            .collect();
        for pair in drops.windows(2) {
            assert!(
                pair[1] - pair[0] >= REF_PERIOD_MS - 1e-6,
                "{}: decreases at {} and {} ms",
                run.variant,
                pair[0],
                pair[1]
            );
        }
        checked += drops.len();
    }
    // The default rule makes few false decreases: 10 over the scenario's runs.
    assert!(checked >= 5, "too few decreases to check: {checked}");
}

/// A bandwidth flow whose application pauses (300-400 ms) without leaving gives its share
/// to the other and gets it back when it resumes. With the latency flow and a target no
/// load meets, SafeUtil is the sharing floor: 2/3 x MaxRate for two bandwidth flows (16 Gb/s
/// each), 1/2 x MaxRate for one (24 Gb/s). The loop counts the flow idle once its idle
/// grace (two RefPeriods) has run since its last chunk completed, and shares move at the
/// next update: within 1.5 ms. It is back at the first update after it resumes: within one
/// RefPeriod.
#[test]
fn an_idle_flow_gives_its_share_and_gets_it_back() {
    let s = series("idle share");
    let (bw, pausing) = (gbps(&s, "bw"), gbps(&s, "bw pausing"));
    let both = MAX_RATE_GBPS * 2.0 / 3.0 / 2.0;
    let alone = MAX_RATE_GBPS / 2.0;
    let before = s.index_at(250.0);
    assert!((mean(bw, before, before + 100) - both).abs() < 0.05 * both);
    assert!((mean(pausing, before, before + 100) - both).abs() < 0.05 * both);
    // Its last byte: what was queued when the application paused drains first.
    let stopped = (s.index_at(300.0)..s.index_at(400.0))
        .find(|&i| pausing[i] == 0.0)
        .unwrap_or_else(|| panic!("the pausing flow never stopped sending"));
    let taken = (stopped..s.index_at(400.0) - 10)
        .find(|&i| mean(bw, i, i + 5) >= 0.95 * alone)
        .map(|i| s.t_ms[i] - s.t_ms[stopped])
        .unwrap_or(f64::INFINITY);
    eprintln!(
        "idle: last byte at {:.1} ms, share taken {taken:.1} ms later",
        s.t_ms[stopped]
    );
    assert!(taken <= 1.5, "the share moved after {taken} ms");
    let during = s.index_at(350.0);
    assert!((mean(bw, during, during + 100) - alone).abs() < 0.05 * alone);
    let resumed = s.index_at(400.0);
    let back = (resumed..s.t_ms.len() - 5)
        .find(|&i| mean(pausing, i, i + 5) >= 0.9 * both && mean(bw, i, i + 5) <= 1.1 * both)
        .map(|i| s.t_ms[i] - 400.0)
        .unwrap_or(f64::INFINITY);
    eprintln!("idle: share back {back:.1} ms after the resume");
    assert!(
        back <= REF_PERIOD_MS + 0.2,
        "the share came back after {back} ms"
    );
}

/// J1 with the target in the probe's units: the probe's idle p99 (1.73 us), the latency
/// flow's alone latency as the paper sets it, which no load meets. The loop holds the
/// sharing floor: the bandwidth flow gets half (the paper's J1), and the latency flow
/// (ping-pong, half round trips) is near its alone figure.
#[test]
fn j1_operating_point_in_probe_units() {
    let r = report("lat-vs-1mb-bw-ib56");
    let j = run(&r, "with bw + justitia");
    let alone = latency(run(&r, "alone"), "lat");
    let lat = latency(j, "lat");
    let bw = flow(j, "bw").gbps;
    eprintln!(
        "J1: lat p50 {:.2} / p99 {:.2} us (alone {:.2} / {:.2}), bw {bw:.1} Gb/s, SafeUtil {:?}",
        lat.p50_us,
        lat.p99_us,
        alone.p50_us,
        alone.p99_us,
        j.policy_figures.get("a.safe_util_gbps")
    );
    // The measured window starts 3 ms in; the first updates before it ran above the floor.
    assert!((bw - FLOOR_GBPS).abs() < 0.1 * FLOOR_GBPS, "bw {bw} Gb/s");
    // Paper: the median back to 1.3 us (alone); within 30%.
    common::assert_near("J1 median with Justitia", lat.p50_us, alone.p50_us, 0.30);
}

/// J4 (no latency flow, so SafeUtil is MaxRate): the throughput flow and the 1 MB bandwidth
/// flow are two resource-hungry flows of equal weight, so each is allotted half of MaxRate
/// (48 Gb/s on IB-56): the bandwidth flow runs at 24 Gb/s, within 3%, and the throughput flow
/// keeps at least half its alone rate (the sharing incentive, Justitia Fig 12), where
/// natively it keeps about a quarter. A loop that does not divide, or a pacer that does not
/// hold the bandwidth flow to its allotment, leaves it at the link's 48 Gb/s.
#[test]
fn j4_each_of_two_hungry_flows_gets_half_of_max_rate() {
    let r = report("tput-vs-1mb-bw-ib56");
    let j = run(&r, "with bw + justitia");
    let alone = flow(run(&r, "alone"), "tput").msgs_per_sec;
    let native = flow(run(&r, "with bw"), "tput").msgs_per_sec;
    let tput = flow(j, "tput").msgs_per_sec;
    let bw = flow(j, "bw").gbps;
    eprintln!(
        "J4: tput {:.2} M msgs/s (alone {:.2}, native {:.2}), bw {bw:.1} Gb/s",
        tput / 1e6,
        alone / 1e6,
        native / 1e6
    );
    common::assert_near("J4 bandwidth flow (Gb/s)", bw, MAX_RATE_GBPS / 2.0, 0.03);
    assert!(
        tput >= 0.5 * alone,
        "throughput flow at {tput} msgs/s, under half its alone {alone}"
    );
    assert!(
        native < 0.5 * alone,
        "natively the throughput flow must lose more than half: {native} of {alone}"
    );
}

/// P3: PeRF's relaxed Justitia (target 15 us) reports the D_App at 1.5 us on average with
/// the B_App at 86 Gb/s (PeRF §5.1); those figures are the validation table's `P3` checks.
///
/// Gap (listed in `common/gaps.rs` with the model's figures, so the test fails if they move):
/// the model's loop meets 15 us at MaxRate (the probe's p99 stays under 4 us), so the B_App
/// is paced at 97 Gb/s, at the link's payload rate, and the D_App waits behind its queue as
/// natively (about 3.6 us on average, not 1.5). Asserted beyond the table: the loop never
/// cuts, and the D_App is no worse than natively.
#[test]
fn p3_relaxed_target() {
    common::assert_targets("P3");
    let r = report("relaxed-justitia-roce100");
    let j = run(&r, "justitia, 15 us");
    let native = latency(run(&r, "native"), "D_App");
    let d = latency(j, "D_App");
    let b = flow(j, "B_App").gbps;
    eprintln!(
        "P3: D_App mean {:.2} us (native {:.2}), B_App {b:.1} Gb/s",
        d.mean_us, native.mean_us
    );
    let decreases: Vec<f64> = j
        .policy_figures
        .iter()
        .filter(|(k, _)| k.ends_with(".decreases"))
        .map(|(_, v)| *v)
        .collect();
    assert!(
        !decreases.is_empty() && decreases.iter().all(|&n| n == 0.0),
        "{:?}",
        j.policy_figures
    );
    assert!(
        d.mean_us <= native.mean_us * 1.02,
        "D_App {d:?} vs native {native:?}"
    );
}
