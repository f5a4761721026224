//! PeRF's evaluation beyond WRITE and a single pair of applications (P4 SEND and READ, P5
//! 1000 B_Apps, P6 multi-QP M_App), asserted from the validation table, and an incast
//! through the switch asserted from first principles.

mod common;

use common::{assert_between, assert_targets, flow, report, run};

/// P4 (PeRF §5.2.5, Fig 12): with SEND and with READ, preempt against native beside a
/// B_App: the B_App's cost, the D_App's average latency cut and the M_App's rate gain,
/// each within the table's tolerance or on the known-gap list with its model figure.
#[test]
fn p4_send_and_read_against_perf_fig12() {
    assert_targets("P4");
}

/// P5 (PeRF Fig 13): 1000 B_Apps of 8 queue pairs and one M_App under preempt, at full
/// scale (the whole scenario runs in a few seconds, so no scaled-down variant is needed):
/// the M_App's rate, the B_Apps' total and their spread, from the table. Also that the
/// scenario is the paper's: 1000 B_Apps beside the M_App.
#[test]
fn p5_1000_bapps_against_perf_fig13() {
    let r = report("perf-p5-1000-bapps-roce100");
    let preempt = run(&r, "preempt");
    let bapps = preempt
        .flows
        .iter()
        .filter(|f| f.name.starts_with("B_App#"))
        .count();
    assert_eq!(bapps, 1000, "B_Apps in the run");
    flow(preempt, "M_App");
    assert_targets("P5");
}

/// P6 (PeRF §5.2.3, Fig 10): a 16-QP M_App against a single-QP M_App and a single-QP
/// D_App, preempt against native, from the table.
#[test]
fn p6_multi_qp_mapp_against_perf_fig10() {
    assert_targets("P6");
}

/// Incast: 2 and 4 senders of 4 KB SENDs, each able to fill a link alone, to one receiver
/// through the switch. Expected from first principles, not from a model run: the
/// receiver's downlink carries at most its payload rate (line rate x MTU / (MTU +
/// headers), each 4 KB message one packet); the fabric is lossless and every sender keeps 16
/// messages queued, so that link is never idle and the senders together get at least 95%
/// of it; and the FCFS switch serves symmetric inputs alike, so each gets 1/N of it.
#[test]
fn incast_senders_share_the_receivers_link_equally() {
    let exp = common::experiment("incast-4-to-1-ib56");
    let link = &exp.profile.link;
    let mtu = f64::from(exp.profile.policy.mtu);
    assert_eq!(mtu, 4096.0, "each 4 KB message is one packet");
    let payload_gbps = link.gbps * mtu / (mtu + f64::from(link.header_bytes));
    let r = report("incast-4-to-1-ib56");
    for (variant, n) in [("2 senders", 2), ("4 senders", 4)] {
        let run = run(&r, variant);
        let rates: Vec<f64> = (1..=n).map(|i| flow(run, &format!("s{i}")).gbps).collect();
        let total: f64 = rates.iter().sum();
        // The window's edges can count at most one message per sender beyond the rate: far
        // under 0.5% of 3 ms at tens of Gb/s.
        assert_between(
            &format!("{variant}: total goodput, Gb/s"),
            total,
            0.95 * payload_gbps,
            1.005 * payload_gbps,
        );
        let share = payload_gbps / n as f64;
        for (i, rate) in rates.iter().enumerate() {
            assert_between(
                &format!("{variant}: sender s{} goodput, Gb/s", i + 1),
                *rate,
                0.95 * share * 0.95,
                1.05 * share * 1.005,
            );
        }
    }
    // Alone, a sender is held by the receiver's link and by its own PCIe reads, whichever is
    // lower, and the FIFO keeps that bottleneck busy most of the time.
    let alone = flow(run(&r, "1 sender"), "s1").gbps;
    let cap = payload_gbps.min(exp.profile.pcie.read_gbps);
    assert_between("1 sender: goodput, Gb/s", alone, 0.9 * cap, 1.005 * cap);
}
