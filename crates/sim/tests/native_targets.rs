//! Native behaviour against the papers' measurements (validation targets N1-N11).
//!
//! Each test runs the scenario named after what it shows and checks the published figure.
//! Ratios are checked within 25% of the paper on the profile the model was fitted to
//! (IB-56 for Justitia's InfiniBand figures, RoCE-40 for its RoCEv2 ones, RoCE-10 for the
//! DCQCN testbed, RoCE-100 for PeRF's). Where the model does not reach a figure, the test
//! says why and asserts what the model does show.

mod common;

use common::{assert_between, assert_near, assert_target, flow, latency, report, run};

/// Native ratios: within 25% of the paper.
const NATIVE: f64 = 0.25;
/// Absolute figures a parameter was fitted to directly.
const FITTED: f64 = 0.10;

/// N1: a 16 B latency flow alone on IB-56 has median 1.3 us, p99 1.4 us (Justitia §6.5.1).
#[test]
fn n1_latency_flow_alone_ib56() {
    let r = report("lat-vs-1mb-bw-ib56");
    let alone = latency(run(&r, "alone"), "lat");
    assert_near("N1 median (us)", alone.p50_us, 1.3, FITTED);
    assert_near("N1 p99 (us)", alone.p99_us, 1.4, FITTED);
}

/// N2: against one 1 MB bandwidth flow the latency flow's median grows x1.85 and its p99
/// x2.23 on IB-56, x3.82 and x4 on RoCE-40; the bandwidth flow is unaffected (Justitia
/// §2.1.1, Fig 1). iWARP is not modelled.
#[test]
fn n2_latency_flow_behind_one_bandwidth_flow() {
    for (scenario, median, p99) in [
        ("lat-vs-1mb-bw-ib56", 1.85, 2.23),
        ("lat-vs-1mb-bw-roce40", 3.82, 4.0),
    ] {
        let r = report(scenario);
        let alone = latency(run(&r, "alone"), "lat");
        let with = latency(run(&r, "with bw"), "lat");
        assert_near(
            &format!("N2 {scenario} median ratio"),
            with.p50_us / alone.p50_us,
            median,
            NATIVE,
        );
        assert_near(
            &format!("N2 {scenario} p99 ratio"),
            with.p99_us / alone.p99_us,
            p99,
            NATIVE,
        );
        let bw_alone = flow(run(&r, "bw alone"), "bw").gbps;
        let bw_with = flow(run(&r, "with bw"), "bw").gbps;
        assert_between(
            &format!("N2 {scenario} bandwidth flow with/alone"),
            bw_with / bw_alone,
            0.97,
            1.01,
        );
    }
}

/// N3: a 1 MB flow on 4 QPs: RoCE-40 median 7.1 us, bandwidth 32.8 Gb/s (Justitia Fig 10).
///
/// Gaps: the measured p99 on RoCE (16.2 us) and everything on IB (median 10.8 us, p99
/// 14.1 us) are far above what the model gives. In the model a latency packet waits for the
/// transmit FIFO plus at most one packet per competing QP (PeRF §2.3.1), so three more QPs
/// add three MTU packets; the ConnectX-3 measurements grow much faster with the QP count,
/// by a mechanism the papers do not identify. The test asserts what the model shows: more
/// QPs never lower the latency, and the bandwidth stays at the line rate.
#[test]
fn n3_latency_flow_behind_four_qps() {
    let r = report("lat-vs-1mb-bw-4qps-roce40");
    let alone = latency(run(&r, "alone"), "lat");
    let with = latency(run(&r, "with bw"), "lat");
    // The paper's alone median on RoCE-40 is 1.7 us (N2): 7.1 / 1.7.
    assert_near(
        "N3 RoCE-40 median ratio",
        with.p50_us / alone.p50_us,
        7.1 / 1.7,
        NATIVE,
    );
    assert_near(
        "N3 RoCE-40 bandwidth (Gb/s)",
        flow(run(&r, "with bw"), "bw").gbps,
        32.8,
        NATIVE,
    );
    let one_qp = latency(run(&report("lat-vs-1mb-bw-roce40"), "with bw"), "lat");
    assert!(
        with.p50_us >= one_qp.p50_us,
        "4 QPs: {with:?}, 1 QP: {one_qp:?}"
    );

    let r = report("lat-vs-1mb-bw-4qps-ib56");
    let with = latency(run(&r, "with bw"), "lat");
    let one_qp = latency(run(&report("lat-vs-1mb-bw-ib56"), "with bw"), "lat");
    assert!(
        with.p50_us >= one_qp.p50_us,
        "IB 4 QPs: {with:?}, 1 QP: {one_qp:?}"
    );
    assert_near(
        "N3 IB-56 bandwidth (Gb/s)",
        flow(run(&r, "with bw"), "bw").gbps,
        47.7,
        NATIVE,
    );
}

/// N4: a second 1 MB flow makes the IB latency flow a further x2.65 slower at the median
/// and x3.79 at the p99, and with 16 flows it barely progresses (Justitia §2.1.3, Fig 3).
/// The table's figures are the paper's own multiplied out: 1.3 us alone x1.85 (N2) x2.65 =
/// 6.37 us, 1.4 us x2.23 x3.79 = 11.8 us; "barely any progress" is read as under a tenth of
/// the alone message rate.
///
/// Known gaps (`common/gaps.rs`): in the model each added QP costs one more MTU packet of
/// waiting (about 0.7 us on IB-56, half of it in a ping-pong sample), so two flows give
/// 2.7 us, not 6.4, and 16 flows leave the latency flow a quarter of its alone rate. The
/// paper's direction, latency growing with every flow added, is asserted as well.
#[test]
fn n4_more_bandwidth_flows_hurt_more() {
    let r = report("lat-vs-more-bw-flows-ib56");
    let alone = latency(run(&r, "alone"), "lat").p50_us;
    let one = latency(run(&r, "1 bw flow"), "lat").p50_us;
    let two = latency(run(&r, "2 bw flows"), "lat").p50_us;
    let sixteen = latency(run(&r, "16 bw flows"), "lat").p50_us;
    assert!(
        alone < one && one < two && two < sixteen,
        "{alone} {one} {two} {sixteen}"
    );
    for id in ["N4.p50", "N4.p99", "N4.16"] {
        assert_target(id);
    }
}

/// N5: a throughput flow (batches of 64 x 16 B) loses 69.5% of its messages per second to
/// one 1 MB flow on InfiniBand (Justitia §1), and x2.85 or more on every fabric (§2.1.2);
/// against 16 bandwidth flows it loses 90% (§2.1.3).
///
/// Known gap (`common/gaps.rs`): against 16 flows the model's throughput flow loses 98%
/// (91.6 k msgs/s of 4.87 M), not 90%: the model's arbiter gives its one QP one packet per
/// turn of 17, and each turn costs 16 packets of 4 KB, while the real RNIC evidently serves
/// small messages faster than that (several processing units fetching and sending in
/// parallel).
#[test]
fn n5_throughput_flow_behind_one_bandwidth_flow() {
    let r = report("tput-vs-1mb-bw-ib56");
    let alone = flow(run(&r, "alone"), "tput").msgs_per_sec;
    let with = flow(run(&r, "with bw"), "tput").msgs_per_sec;
    assert_near(
        "N5 IB-56 drop (alone / with)",
        alone / with,
        1.0 / (1.0 - 0.695),
        NATIVE,
    );
    let bw_alone = flow(run(&r, "bw alone"), "bw").gbps;
    let bw_with = flow(run(&r, "with bw"), "bw").gbps;
    assert_between(
        "N5 bandwidth flow with/alone",
        bw_with / bw_alone,
        0.95,
        1.01,
    );

    // Against 16 flows: 10% of the alone rate kept, within 0.03 (a known gap).
    assert_target("N5.16");
    // On RoCE-40 the paper gives only the lower bound, x2.85.
    assert_target("N5.roce.drop");
}

/// N6: with event-driven polling and one message in flight, a 1 GB flow gets x1.42 (IB)
/// and x1.22 (RoCE) the bandwidth of a 1 MB flow; busy polling removes the gap, and so do
/// messages of 5 MB or more (Justitia §2.1.5; KBNets study Table 3, Fig 4).
#[test]
fn n6_message_size_unfairness_with_event_polling() {
    for (scenario, expected) in [("1mb-vs-1gb-bw-ib56", 1.42), ("1mb-vs-1gb-bw-roce40", 1.22)] {
        let r = report(scenario);
        let event = run(&r, "1MB vs 1GB, event");
        assert_near(
            &format!("N6 {scenario} 1GB / 1MB, event polling"),
            flow(event, "1GB").gbps / flow(event, "1MB").gbps,
            expected,
            NATIVE,
        );
        let busy = run(&r, "1MB vs 1GB, busy");
        assert_between(
            &format!("N6 {scenario} 1GB / 1MB, busy polling"),
            flow(busy, "1GB busy").gbps / flow(busy, "1MB busy").gbps,
            0.95,
            1.06,
        );
        let five = run(&r, "5MB vs 1GB, event");
        assert_between(
            &format!("N6 {scenario} 1GB / 5MB, event polling"),
            flow(five, "1GB").gbps / flow(five, "5MB").gbps,
            0.95,
            1.12,
        );
    }
}

/// N7: bandwidth follows the number of QPs: an application with 4 QPs gets 4 times the
/// bandwidth of one with 1 (Justitia Fig 5b; PeRF §2.3.2, Fig 3a).
#[test]
fn n7_bandwidth_share_follows_qp_count() {
    let r = report("bw-share-follows-qps-roce100");
    let both = run(&r, "single vs multi");
    assert_near(
        "N7 multi (4 QPs) / single (1 QP)",
        flow(both, "multi").gbps / flow(both, "single").gbps,
        4.0,
        NATIVE,
    );
    let alone = flow(run(&r, "single alone"), "single").gbps;
    let total = flow(both, "single").gbps + flow(both, "multi").gbps;
    assert_between("N7 total / one flow alone", total / alone, 0.97, 1.01);
}

/// N8: latency flows among themselves, and throughput flows among themselves, show no
/// anomaly: all get alike and about what they get alone (Justitia App. B, Fig 26-28).
#[test]
fn n8_small_flows_coexist() {
    let r = report("lat-and-tput-among-themselves-ib56");
    let alone = latency(run(&r, "1 latency flow"), "one lat").p50_us;
    let four = run(&r, "4 latency flows");
    for i in 1..=4 {
        let m = latency(four, &format!("lat#{i}")).p50_us;
        assert_near(&format!("N8 lat#{i} median vs alone"), m, alone, 0.10);
    }
    let tput_alone = flow(run(&r, "1 throughput flow"), "one tput").msgs_per_sec;
    let four = run(&r, "4 throughput flows");
    let rates: Vec<f64> = (1..=4)
        .map(|i| flow(four, &format!("tput#{i}")).msgs_per_sec)
        .collect();
    let jain = justitia_sim::report::jain_index(&rates).unwrap_or(0.0);
    assert_between("N8 Jain index of 4 throughput flows", jain, 0.99, 1.0);
    assert_near("N8 tput#1 vs alone", rates[0], tput_alone, 0.10);
    let mixed = run(&r, "latency vs throughput");
    assert_near(
        "N8 latency flow next to a throughput flow",
        latency(mixed, "one lat").p50_us,
        alone,
        0.10,
    );
    assert_near(
        "N8 throughput flow next to a latency flow",
        flow(mixed, "one tput").msgs_per_sec,
        tput_alone,
        0.10,
    );
}

/// N9: on 10 Gb/s RoCE (DCQCN on, which between two hosts never throttles) a throughput
/// flow does 5.6 M msgs/s alone and 1.0 M with a bandwidth flow, which gets 7.6 Gb/s
/// (Justitia Fig 19).
#[test]
fn n9_throughput_vs_bandwidth_roce10() {
    let r = report("tput-vs-1mb-bw-roce10");
    let alone = flow(run(&r, "alone"), "tput").msgs_per_sec / 1e6;
    assert_near("N9 throughput flow alone (M msgs/s)", alone, 5.6, FITTED);
    let with = run(&r, "with bw");
    assert_near(
        "N9 throughput flow with bw (M msgs/s)",
        flow(with, "tput").msgs_per_sec / 1e6,
        1.0,
        NATIVE,
    );
    assert_near(
        "N9 bandwidth flow (Gb/s)",
        flow(with, "bw").gbps,
        7.6,
        NATIVE,
    );
}

/// N10: on RoCE-100 a 1 MB B_App keeps 94.8-96.9 Gb/s while a single-QP M_App's rate
/// collapses: the RNIC serves QPs round robin at MTU granularity, so each small message
/// waits for one MTU packet of the competitor (PeRF §2.2, §2.3.1).
#[test]
fn n10_message_app_vs_bandwidth_app_roce100() {
    let r = report("mapp-dapp-vs-bapp-roce100");
    let both = run(&r, "M_App vs B_App");
    // The published range itself, with 2% for the model's packet-level timing: a 25% band
    // around a figure this close to line rate would reach beyond the link.
    assert_between(
        "N10 B_App next to M_App (Gb/s)",
        flow(both, "B_App").gbps,
        94.8 * 0.98,
        96.9 * 1.02,
    );
    let alone = flow(run(&r, "M_App alone"), "M_App").msgs_per_sec;
    let with = flow(both, "M_App").msgs_per_sec;
    assert!(with < alone, "M_App: {with} with the B_App, {alone} alone");
    // "Collapses", read as losing more than half of its alone rate.
    assert_target("N10.mapp");
    let d_alone = latency(run(&r, "D_App alone"), "D_App").p50_us;
    let d_with = latency(run(&r, "D_App vs B_App"), "D_App").p50_us;
    assert!(
        d_with > d_alone,
        "D_App: {d_with} with B_App, {d_alone} alone"
    );
}

/// N11: on RoCE-100 one QP carries about 13 M msgs/s and 9 QPs about 105 M; past that
/// capacity a multi-QP message app degrades a single-QP one (PeRF §2.3.2, Fig 3b).
#[test]
fn n11_message_rate_and_qp_count_roce100() {
    let r = report("mapp-multi-qp-roce100");
    let one = flow(run(&r, "1 QP"), "M_App 1 QP").msgs_per_sec / 1e6;
    assert_near("N11 one QP (M msgs/s)", one, 13.0, NATIVE);
    let nine = flow(run(&r, "9 QPs"), "M_App 9 QPs").msgs_per_sec / 1e6;
    assert_near("N11 nine QPs (M msgs/s)", nine, 105.0, NATIVE);
    let crowded = flow(run(&r, "1 QP vs 16 QPs"), "M_App 1 QP").msgs_per_sec / 1e6;
    assert_between(
        "N11 single-QP app next to a 16-QP app / alone",
        crowded / one,
        0.0,
        0.75,
    );
}
