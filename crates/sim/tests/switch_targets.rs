//! The switch against RPerf's measurements (validation targets R1-R8).
//!
//! Scenarios ending in `-ib56` run on the IB-56-switch profile (the real SX6012, FCFS,
//! jitter); those ending in `-sim` override its switch to RPerf's simulated one (32 KB input
//! buffers, no jitter, 200 ns ports). The analytic cases (R4, R5) are checked within 10% of
//! the paper's equations; published figures within 25% where the model reaches them, and
//! otherwise the test says why and asserts the direction.

mod common;

use common::{assert_between, assert_near, assert_target, flow, latency, report, run};
use justitia_core::flow::FlowClass;
use justitia_sim::{RunReport, ScenarioReport};

/// Analytic cases.
const ANALYTIC: f64 = 0.10;
/// Published measurements.
const MEASURED: f64 = 0.25;
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
#[test]
fn r1_r2_one_to_one_through_the_switch() {
    let r = report("switch-one-to-one-ib56");
    for (variant, name) in [("rtt 64 B", "rtt64"), ("rtt 4 KB", "rtt4k")] {
        let l = latency(run(&r, variant), name);
        assert_between(
            &format!("R1 {variant} median (us)"),
            l.p50_us,
            0.432 * (1.0 - ANALYTIC),
            0.498 * (1.0 + ANALYTIC),
        );
        assert_near(
            &format!("R1 {variant} p99.9 - median (us)"),
            l.p999_us - l.p50_us,
            0.2,
            MEASURED,
        );
    }
    assert_near(
        "R2 4 KB BSG (Gb/s)",
        flow(run(&r, "bsg 4 KB"), "bsg4k").gbps,
        52.2,
        ANALYTIC,
    );
    assert_near(
        "R2 64 B BSG (Gb/s)",
        flow(run(&r, "bsg 64 B"), "bsg64").gbps,
        3.9,
        ANALYTIC,
    );
}

/// R3: LSG vs 1..5 BSGs on the real switch: 0.6/0.9 us (1), 5.2/5.7 (2), 10.7/12.6 (3),
/// each added BSG +4.8 to 6.1 us; BSG total 52.2 (1) to 48.4 Gb/s (5).
///
/// Gap: the model's LSG waits for every full input buffer (N buffers with N BSGs, as
/// RPerf's equation (2) says), so from two BSGs on it sits one buffer (about 5 us) above
/// the published points, whose growth starts one BSG later. The step per BSG, which
/// `switch.input_buffer_bytes` is fitted to, is checked; so are 1 BSG and the totals.
///
/// Gap: the real switch loses bandwidth as BSGs are added (52.2 Gb/s in total with one,
/// 48.4 with five), the model does not: its total rises towards the output's payload rate
/// (about 54 Gb/s) as more senders keep the output busy. Whatever costs the SX6012 that
/// bandwidth (arbitration between inputs, credit turnaround) is not modelled, so the two
/// totals are checked against the paper within 25% and the model's trend against the
/// output's capacity, not against the paper's.
#[test]
fn r3_lsg_vs_bsgs_real_switch() {
    let r = report("switch-lsg-vs-bsgs-ib56");
    let one = latency(run(&r, "1 BSG"), "lsg");
    assert_between("R3 1 BSG median (us)", one.p50_us, 0.6, 0.6 * 1.4);
    let medians = medians_from_two_bsgs(&r, "R3", (4.8 * (1.0 - MEASURED), 6.1 * (1.0 + MEASURED)));
    assert!(
        medians[0] > 5.2,
        "R3 direction: 2 BSGs at least the published 5.2 us, model {:.2}",
        medians[0]
    );
    assert_near(
        "R3 BSG total, 1 BSG (Gb/s)",
        bandwidth_total(run(&r, "1 BSG")),
        52.2,
        MEASURED,
    );
    let five = bandwidth_total(run(&r, "5 BSGs"));
    assert_near("R3 BSG total, 5 BSGs (Gb/s)", five, 48.4, MEASURED);
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
/// Gap: RPerf's own published points do not follow its equation: with 2 BSGs the LSG
/// waited one buffer (4.5 us), not two, and every later point is about one buffer under
/// the equation. The model keeps the equation, so it sits above the published points:
/// 2 BSGs 9.1 us against 4.5 (checked for direction), 5 BSGs 21.8 us against 18.2 (+20%,
/// checked to lie at most one buffer above). With 1 BSG the model's LSG (0.77 us) is 28%
/// over the published 0.6 us: it queues behind the BSG packet being forwarded, which
/// RPerf's simulator seems to cut short; only the direction is asserted.
#[test]
fn r4_fcfs_waits_for_every_full_buffer() {
    let r = report("switch-fcfs-lsg-vs-bsgs-sim");
    let base = latency(run(&r, "0 BSG"), "lsg").p50_us;
    assert_near("R4 0 BSG median (us)", base, 0.4, MEASURED);
    let one = latency(run(&r, "1 BSG"), "lsg").p50_us;
    assert!(
        base < one && one < 2.0 * 0.6,
        "R4 direction: 1 BSG costs the LSG less than one packet more, model {one:.2} us"
    );
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
    let buffer_us = 32_768.0 * 8.0 / LINK_BITS_PER_US;
    let five = latency(run(&r, "5 BSGs"), "lsg");
    assert_between(
        "R4 5 BSGs median, published 18.2 us, at most one buffer above (us)",
        five.p50_us,
        18.2,
        18.2 + buffer_us,
    );
    assert_between(
        "R4 5 BSGs p99.9, published 18.3 us, at most one buffer above (us)",
        five.p999_us,
        18.3,
        18.3 + buffer_us,
    );
    let two = latency(run(&r, "2 BSGs"), "lsg").p50_us;
    assert!(
        two > 4.5,
        "R4 direction: 2 BSGs above 4.5 us, model {two:.2}"
    );
}

/// R5: simulated switch, round robin: 0.4, 0.6, 2.5/2.6 us with 5 BSGs. Analytically the
/// LSG waits for at most one packet per active input: with 5 BSGs, 5 x 4 KB packets.
///
/// Gap: the model's median with 5 BSGs (about 1.9 us) is within the analytic bound but
/// 25% under the published 2.5 us: where the LSG's packet falls in the turn is set by its
/// closed loop, which the model and RPerf's simulator need not share. For the same reason
/// the model's median does not grow with every BSG (3 BSGs: 0.65 us, 2 and 4: 1.26 us),
/// so only the bound and the published 5-BSG point's direction are asserted. With 1 BSG
/// the LSG is 0.77 us against the published 0.6, as under FCFS (see R4).
#[test]
fn r5_round_robin_bounds_the_wait_by_one_packet_per_input() {
    let r = report("switch-rr-lsg-vs-bsgs-sim");
    let base = latency(run(&r, "0 BSG"), "lsg").p50_us;
    assert_near("R5 0 BSG median (us)", base, 0.4, MEASURED);
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
    let five = latency(run(&r, "5 BSGs"), "lsg");
    assert!(
        five.p50_us < 2.5,
        "R5 direction: at most the published median, model {:.2} us",
        five.p50_us
    );
    let fcfs = report("switch-fcfs-lsg-vs-bsgs-sim");
    let fcfs_five = latency(run(&fcfs, "5 BSGs"), "lsg").p50_us;
    assert!(
        five.p50_us * 5.0 < fcfs_five,
        "R5: round robin protects the LSG (model {:.2} us vs FCFS {fcfs_five:.2} us)",
        five.p50_us
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
    for id in ["R6.fcfs.p50", "R6.fcfs.p999", "R6.rr.p50", "R6.rr.p999"] {
        assert_target(id);
    }
    let rr = latency(run(&report("switch-two-hop-rr-sim"), "5 BSGs"), "lsg");
    let one_hop = latency(run(&report("switch-rr-lsg-vs-bsgs-sim"), "5 BSGs"), "lsg");
    assert!(
        rr.p50_us > 4.0 * one_hop.p50_us,
        "R6: behind a shared link round robin loses its protection"
    );
}

/// R7: 5 BSGs of 64 B: LSG 0.4/0.6 us at 35% of the link; 128 B: 0.6/0.9 at 70%; 512 B:
/// 20.0/20.6 us; 4 KB: 26.3/28.2 us at 88-93%.
///
/// Gap: with 512 B BSGs the model's LSG (about 25 us) is 26% over the published 20.0 us:
/// the model's input buffers hold the same bytes whatever the packet size, where the real
/// switch seems to hold fewer small packets; the 512 B case asserts it sits near the 4 KB
/// one and far above 128 B.
#[test]
fn r7_bsg_message_size_sweep() {
    let r = report("switch-bsg-size-sweep-ib56");
    let link = 56.0;
    let cases = [
        ("BSGs 64B", 0.4, 0.6, Some(0.35)),
        ("BSGs 128B", 0.6, 0.9, Some(0.70)),
        ("BSGs 4KB", 26.3, 28.2, Some(0.905)),
    ];
    let at = |variant: &str| latency(run(&r, variant), "lsg").p50_us;
    let (small, mid, large) = (at("BSGs 128B"), at("BSGs 512B"), at("BSGs 4KB"));
    assert!(
        mid > 10.0 * small && mid <= large * 1.05,
        "R7 direction: 512 B BSGs hurt like 4 KB ones, model {small:.2} / {mid:.2} / {large:.2} us"
    );
    for (variant, median, tail, share) in cases {
        let v = run(&r, variant);
        let l = latency(v, "lsg");
        if median < 0.5 {
            // Gap: 0.53 us against 0.4: the zero-load RTT fitted to R1 is already 0.48 us,
            // so only the direction (no worse than with 128 B BSGs) is asserted.
            assert!(l.p50_us <= small, "R7 {variant}: model {:.2} us", l.p50_us);
        } else {
            assert_near(
                &format!("R7 {variant} median (us)"),
                l.p50_us,
                median,
                MEASURED,
            );
        }
        assert_near(
            &format!("R7 {variant} p99.9 (us)"),
            l.p999_us,
            tail,
            MEASURED,
        );
        if let Some(share) = share {
            assert_near(
                &format!("R7 {variant} share of the link"),
                bandwidth_total(v) / link,
                share,
                MEASURED,
            );
        }
    }
}

/// R8: LSG on the BSGs' SL/VL 20.2/22.1 us, on a dedicated high-priority SL/VL 0.7/1.1 us
/// with the BSGs' bandwidth unchanged; a 256 B batched BSG posing as latency traffic on
/// the LSG's VL takes 21.5 Gb/s against 6.7-7 Gb/s for the others and pushes the LSG to
/// 8.5/9.1 us.
///
/// Gap: the model's pretend LSG (two queue pairs of 256 B batches) takes about 16 Gb/s, not
/// 21.5: its rate is set by the RNIC's per-queue-pair message rate, fitted to R2, and under
/// strict priority it takes all it can send. The LSG then rarely finds its lane backlogged
/// (about 1 us against 8.5). Both effects are asserted in direction: the pretender takes
/// well over the others' share and the LSG is slower than alone on its lane.
#[test]
fn r8_dedicated_virtual_lane_and_its_gaming() {
    let r = report("switch-sl-vl-qos-ib56");
    let shared = run(&r, "shared SL/VL");
    let dedicated = run(&r, "dedicated SL/VL");
    let s = latency(shared, "lsg-shared");
    let d = latency(dedicated, "lsg-dedicated");
    assert_near("R8 shared median (us)", s.p50_us, 20.2, MEASURED);
    assert_near("R8 shared p99.9 (us)", s.p999_us, 22.1, MEASURED);
    assert_near("R8 dedicated median (us)", d.p50_us, 0.7, MEASURED);
    assert_near("R8 dedicated p99.9 (us)", d.p999_us, 1.1, MEASURED);
    assert_near(
        "R8 BSG total, dedicated vs shared",
        bandwidth_total(dedicated),
        bandwidth_total(shared),
        0.02,
    );
    let gamed = run(&r, "dedicated, one BSG pretends");
    let pretend = flow(gamed, "pretend").gbps;
    for b in ["bsg2", "bsg3", "bsg4", "bsg5"] {
        let other = flow(gamed, b).gbps;
        assert!(
            pretend > 1.5 * other,
            "R8: the pretender ({pretend:.1} Gb/s) takes over 1.5x {b} ({other:.1} Gb/s)"
        );
    }
    let g = latency(gamed, "lsg-dedicated");
    assert!(
        g.p50_us > d.p50_us,
        "R8: the pretend LSG hurts the real one ({:.2} vs {:.2} us)",
        g.p50_us,
        d.p50_us
    );
}
