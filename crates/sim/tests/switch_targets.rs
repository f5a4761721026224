//! The switch against RPerf's measurements (validation targets R1-R8).
//!
//! Scenarios ending in `-ib56` run on the IB-56-switch profile (the real SX6012, FCFS,
//! jitter); those ending in `-sim` override its switch to RPerf's simulated one (32 KB input
//! buffers, no jitter, 200 ns ports). Each test asserts every check of its target in the
//! validation table (`crates/sim/validation/targets.toml`: the published figure, the
//! tolerance and why): within tolerance, or on the known-gap list (`common/gaps.rs`) with
//! the model's figure. RPerf's equations (R4, R5) are checked within 10%, and the
//! directions the paper states without a figure are asserted here too.

mod common;

use common::{assert_between, assert_near, assert_targets, latency, report, run};
use justitia_core::flow::FlowClass;
use justitia_sim::{RunReport, ScenarioReport};

/// RPerf's equations.
const ANALYTIC: f64 = 0.10;
/// RPerf's link bandwidth in its equation (2), bits per us.
const LINK_BITS_PER_US: f64 = 56_000.0;
/// A 4 KB packet on the wire, in us at the FDR data rate (54.54 Gb/s).
const PACKET_US: f64 = (4096.0 + 26.0) * 8.0 / 54_540.0;

fn bandwidth_total(run: &RunReport) -> f64 {
    run.flows
        .iter()
        .filter(|f| f.class == FlowClass::Bandwidth)
        .map(|f| f.gbps)
        .sum()
}

/// The LSG's median with 2 to 5 BSGs, each step from one to the next checked to lie in
/// `step` (us).
fn medians_from_two_bsgs(r: &ScenarioReport, target: &str, step: (f64, f64)) -> Vec<f64> {
    let medians: Vec<f64> = ["2 BSGs", "3 BSGs", "4 BSGs", "5 BSGs"]
        .iter()
        .map(|v| latency(run(r, v), "lsg").p50_us)
        .collect();
    for pair in medians.windows(2) {
        assert_between(
            &format!("{target} step per added BSG (us)"),
            pair[1] - pair[0],
            step.0,
            step.1,
        );
    }
    medians
}

/// R1: zero-load RTT through the switch, median 432-498 ns for 64 B to 4 KB, tail (p99.9)
/// about 200 ns above the median. R2: one BSG alone, 52.2 Gb/s at 4 KB, 3.9 Gb/s at 64 B.
/// All four are fitted figures.
#[test]
fn r1_r2_one_to_one_through_the_switch() {
    assert_targets("R1");
    assert_targets("R2");
}

/// R3: LSG vs 1..5 BSGs on the real switch: 0.6/0.9 us (1), 5.2/5.7 (2), 10.7/12.6 (3),
/// each added BSG +4.8 to 6.1 us (fitted); BSG total 52.2 (1) to 48.4 Gb/s (5).
///
/// Known gaps (`common/gaps.rs`): the model's LSG waits for every full input buffer (N
/// buffers with N BSGs, as RPerf's equation (2) says), so from two BSGs on it sits one
/// buffer (about 5 us) above the published points, whose growth starts one BSG later; with
/// one BSG it queues behind the packet being forwarded (0.78 us against 0.6). The real
/// switch loses bandwidth as BSGs are added (48.4 Gb/s with five), the model does not: its
/// total rises towards the output's payload rate as more senders keep the output busy.
/// Whatever costs the SX6012 that bandwidth (arbitration between inputs, credit turnaround)
/// is not modelled; the model's total is asserted not to exceed the output's capacity.
#[test]
fn r3_lsg_vs_bsgs_real_switch() {
    assert_targets("R3");
    let five = bandwidth_total(run(&report("switch-lsg-vs-bsgs-ib56"), "5 BSGs"));
    let output_payload_gbps = 54.54 * 4096.0 / (4096.0 + 26.0);
    assert!(
        five <= output_payload_gbps,
        "R3: five BSGs share one output: {five:.1} Gb/s above its {output_payload_gbps:.1}"
    );
}

/// R4: simulated switch, FCFS, 32 KB input buffers: the LSG waits N x BufferSize /
/// LinkBandwidth (equation (2)), checked within 10%. Published: 0.4 us (0 BSG), 0.6 (1),
/// 4.5/4.6 (2), 18.2/18.3 (5).
///
/// The model follows the equation within 10%, and each added BSG costs the LSG what it
/// costs in RPerf's simulator (3.9 to 4.6 us; the model 4.2 to 4.3 us).
///
/// Known gaps (`common/gaps.rs`): RPerf's own published points do not follow its equation:
/// with 2 BSGs the LSG waited one buffer (4.5 us), not two; the model keeps the equation
/// (9.1 us). With 1 BSG the model's LSG (0.77 us) queues behind the BSG packet being
/// forwarded, which RPerf's simulator seems to cut short.
#[test]
fn r4_fcfs_waits_for_every_full_buffer() {
    assert_targets("R4");
    let r = report("switch-fcfs-lsg-vs-bsgs-sim");
    let base = latency(run(&r, "0 BSG"), "lsg").p50_us;
    for (variant, n) in [("2 BSGs", 2.0), ("3 BSGs", 3.0), ("5 BSGs", 5.0)] {
        let wait = latency(run(&r, variant), "lsg").p50_us - base;
        let equation = n * 32_768.0 * 8.0 / LINK_BITS_PER_US;
        assert_near(
            &format!("R4 {variant} wait vs N x 32 KB / 56 Gb/s (us)"),
            wait,
            equation,
            ANALYTIC,
        );
    }
    medians_from_two_bsgs(&r, "R4", (3.9 * (1.0 - ANALYTIC), 4.6 * (1.0 + ANALYTIC)));
}

/// R5: simulated switch, round robin: 0.4, 0.6, 2.5/2.6 us with 5 BSGs. Analytically the
/// LSG waits for at most one packet per active input: with 5 BSGs, 5 x 4 KB packets.
///
/// Known gaps (`common/gaps.rs`): the model's median with 5 BSGs (about 1.9 us) is within
/// the analytic bound but 25.5% under the published 2.5 us: where the LSG's packet falls
/// in the turn is set by its closed loop, which the model and RPerf's simulator need not
/// share. With 1 BSG the LSG is 0.77 us against the published 0.6, as under FCFS (R4).
#[test]
fn r5_round_robin_bounds_the_wait_by_one_packet_per_input() {
    assert_targets("R5");
    let r = report("switch-rr-lsg-vs-bsgs-sim");
    let base = latency(run(&r, "0 BSG"), "lsg").p50_us;
    for (variant, n) in [
        ("1 BSG", 1.0),
        ("2 BSGs", 2.0),
        ("3 BSGs", 3.0),
        ("4 BSGs", 4.0),
        ("5 BSGs", 5.0),
    ] {
        let l = latency(run(&r, variant), "lsg");
        assert_between(
            &format!("R5 {variant} p99.9 within base + N packets (us)"),
            l.p999_us,
            base,
            (base + n * PACKET_US) * (1.0 + ANALYTIC),
        );
    }
    let five = latency(run(&r, "5 BSGs"), "lsg").p50_us;
    let fcfs_five = latency(run(&report("switch-fcfs-lsg-vs-bsgs-sim"), "5 BSGs"), "lsg").p50_us;
    assert!(
        five * 5.0 < fcfs_five,
        "R5: round robin protects the LSG (model {five:.2} us vs FCFS {fcfs_five:.2} us)"
    );
}

/// R6: two hops with a shared inter-switch link: FCFS 18.4/18.5 us, round robin
/// 14.5/14.9 us: round robin no longer protects.
///
/// Known gap (`common/gaps.rs`): the model's round-robin tail (about 20 us) is 34% over the
/// published 14.9 us: in the model the LSG shares the downstream input buffer with two BSGs
/// that fill it, so it waits nearly as long as under FCFS.
#[test]
fn r6_two_hops_defeat_round_robin() {
    assert_targets("R6");
    let rr = latency(run(&report("switch-two-hop-rr-sim"), "5 BSGs"), "lsg");
    let one_hop = latency(run(&report("switch-rr-lsg-vs-bsgs-sim"), "5 BSGs"), "lsg");
    assert!(
        rr.p50_us > 4.0 * one_hop.p50_us,
        "R6: behind a shared link round robin loses its protection"
    );
}

/// R7: 5 BSGs of 64 B: LSG 0.4/0.6 us at 35% of the link; 128 B: 0.6/0.9 at 70% (the share
/// is fitted); 512 B: 20.0/20.6 us; 4 KB: 26.3/28.2 us at 88-93%.
///
/// Known gaps (`common/gaps.rs`): with 64 B BSGs the LSG's median is 0.53 us against 0.4
/// (the zero-load RTT fitted to R1 is already 0.48 us); with 512 B BSGs 25.1 us against
/// 20.0: the model's input buffers hold the same bytes whatever the packet size, where the
/// real switch seems to hold fewer small packets. The direction, 512 B BSGs hurting like
/// 4 KB ones and far more than 128 B ones, is asserted.
#[test]
fn r7_bsg_message_size_sweep() {
    assert_targets("R7");
    let r = report("switch-bsg-size-sweep-ib56");
    let at = |variant: &str| latency(run(&r, variant), "lsg").p50_us;
    let (small, mid, large) = (at("BSGs 128B"), at("BSGs 512B"), at("BSGs 4KB"));
    assert!(
        mid > 10.0 * small && mid <= large * 1.05,
        "R7 direction: 512 B BSGs hurt like 4 KB ones, model {small:.2} / {mid:.2} / {large:.2} us"
    );
}

/// R8: LSG on the BSGs' SL/VL 20.2/22.1 us, on a dedicated high-priority SL/VL 0.7/1.1 us
/// with the BSGs' bandwidth unchanged; a 256 B batched BSG posing as latency traffic on
/// the LSG's VL takes 21.5 Gb/s against 6.7-7 Gb/s for the others and pushes the LSG to
/// 8.5/9.1 us.
///
/// Known gaps (`common/gaps.rs`): the model's pretender (two queue pairs of 256 B batches)
/// takes about 16 Gb/s, not 21.5, and the others 9.1 Gb/s each: its rate is set by the
/// RNIC's per-queue-pair message rate, fitted to R2. The LSG then rarely finds its lane
/// backlogged (about 0.8 us against 8.5). Both effects are asserted in direction: the
/// pretender takes well over the others' share and the LSG is slower than alone on its
/// lane.
#[test]
fn r8_dedicated_virtual_lane_and_its_gaming() {
    assert_targets("R8");
    let r = report("switch-sl-vl-qos-ib56");
    let gamed = run(&r, "dedicated, one BSG pretends");
    let pretend = common::flow(gamed, "pretend").gbps;
    for b in ["bsg2", "bsg3", "bsg4", "bsg5"] {
        let other = common::flow(gamed, b).gbps;
        assert!(
            pretend > 1.5 * other,
            "R8: the pretender ({pretend:.1} Gb/s) takes over 1.5x {b} ({other:.1} Gb/s)"
        );
    }
    let d = latency(run(&r, "dedicated SL/VL"), "lsg-dedicated");
    let g = latency(gamed, "lsg-dedicated");
    assert!(
        g.p50_us > d.p50_us,
        "R8: the pretend LSG hurts the real one ({:.2} vs {:.2} us)",
        g.p50_us,
        d.p50_us
    );
}
