//! The `preempt` policy against PeRF's reported effects (validation targets P1, P2),
//! `adaptive` against both `justitia` and `preempt`, and `priority` (hardware strict
//! priority, P1's reference point), on RoCE-100
//! (`scenarios/preempt-vs-justitia-roce100.toml`).
//!
//! P1 and P2 are asserted through the validation table (`crates/sim/validation/targets.toml`):
//! within tolerance, or on the known-gap list (`common/gaps.rs`) with the model's figure.
//! The other effects are checked within 30% of the paper, or in the direction the paper
//! states where it gives no figure.

mod common;

use common::{
    assert_between, assert_near, assert_target, assert_targets, flow, latency, report, run,
};
use justitia_sim::ScenarioReport;

/// PeRF's effects: within 30% of the paper.
const EFFECT: f64 = 0.30;

const SCENARIO: &str = "preempt-vs-justitia-roce100";

fn gbps(r: &ScenarioReport, variant: &str, name: &str) -> f64 {
    flow(run(r, variant), name).gbps
}

fn mmsgs(r: &ScenarioReport, variant: &str, name: &str) -> f64 {
    flow(run(r, variant), name).msgs_per_sec / 1e6
}

/// P1 with the D_App: PeRF keeps the B_App within about 5% of native while the D_App's
/// latency approaches a strict-priority queue (PeRF §5.2.1, Fig 7a).
///
/// Known gaps (`common/gaps.rs`), both from the standard-verbs form of the yield. (1) Each
/// yield is a header-only packet: 16 x 82 B of RoCE headers per 16 KB sub-message, 8.0% of
/// the payload, which PeRF's vendor zero-wait request does not put on the wire, so the
/// B_App loses 8.5%, not under 5%. (2) A sub-message enters the model's 24 KB transmit FIFO
/// as one 16 KB burst, so a D_App message still waits behind most of one: the median falls
/// (about 3.6 to 3.1 us) but stays 1.8 times the model's strict priority's. The direction
/// (preempt beats native) is asserted too.
#[test]
fn p1_preempt_keeps_bandwidth_and_helps_the_delay_app() {
    assert_target("P1.dapp.bw");
    assert_target("P1.dapp.p50");
    let r = report(SCENARIO);
    let native = latency(run(&r, "D_App + B_App native"), "D_App");
    let preempt = latency(run(&r, "D_App + B_App preempt"), "D_App");
    let alone = latency(run(&r, "D_App alone"), "D_App");
    assert!(
        preempt.p50_us < native.p50_us && preempt.p99_us <= native.p99_us,
        "P1: preempt {preempt:?} must beat native {native:?}"
    );
    assert!(preempt.p50_us > alone.p50_us);
    eprintln!(
        "P1 D_App p50/p99 (us): alone {:.2}/{:.2}, native {:.2}/{:.2}, preempt {:.2}/{:.2}",
        alone.p50_us, alone.p99_us, native.p50_us, native.p99_us, preempt.p50_us, preempt.p99_us
    );
}

/// P1 with the M_App: PeRF gives the M_App close to the rate a strict-priority queue would
/// (natively it collapses, N10) while the B_App keeps within about 5% of native (PeRF
/// §5.2.1, Fig 7b).
///
/// Known gaps (`common/gaps.rs`): the B_App loses 15% (the yields' headers and the wire the
/// recovered M_App takes), and the M_App under preempt gets 1.9 times what the model's
/// strict priority gives it (see `p1_priority_with_the_message_app` for why the model's SP
/// stays low). The direction, preempt restoring the M_App well above native, is asserted.
#[test]
fn p1_preempt_restores_the_message_app() {
    assert_target("P1.mapp.bw");
    assert_target("P1.mapp.rate");
    let r = report(SCENARIO);
    let native = mmsgs(&r, "M_App + B_App native", "M_App");
    let preempt = mmsgs(&r, "M_App + B_App preempt", "M_App");
    assert!(
        preempt > 2.0 * native,
        "P1: preempt {preempt} vs native {native}"
    );
}

/// P1's reference point, hardware strict priority (PeRF's SP, §5.2.1, Fig 7a): the D_App's
/// latency close to its alone latency while the B_App keeps its bandwidth. Within 30%.
///
/// Measured, D_App p50/p99 (us): alone 1.55/1.66, native 3.64/3.84, priority 1.72/1.93,
/// preempt 3.10/3.74; B_App (Gb/s): native 97.95, priority 97.94, preempt 89.6.
///
/// Gap: PeRF reports its preemption close to SP; in the model `preempt` stays about 1.8
/// times SP's median (its 16 KB sub-message enters the transmit FIFO as one burst; see
/// `p1_preempt_keeps_bandwidth_and_helps_the_delay_app`), so only its direction between
/// native and SP is asserted.
#[test]
fn p1_priority_reference_point() {
    let r = report(SCENARIO);
    let native_bw = gbps(&r, "D_App + B_App native", "B_App");
    let priority_bw = gbps(&r, "D_App + B_App priority", "B_App");
    assert_between(
        "P1 B_App bandwidth lost to priority (D_App case)",
        1.0 - priority_bw / native_bw,
        0.0,
        0.05,
    );
    let alone = latency(run(&r, "D_App alone"), "D_App");
    let native = latency(run(&r, "D_App + B_App native"), "D_App");
    let priority = latency(run(&r, "D_App + B_App priority"), "D_App");
    let preempt = latency(run(&r, "D_App + B_App preempt"), "D_App");
    eprintln!(
        "P1 D_App p50/p99 (us): alone {:.2}/{:.2}, native {:.2}/{:.2}, priority {:.2}/{:.2}, preempt {:.2}/{:.2}",
        alone.p50_us, alone.p99_us, native.p50_us, native.p99_us, priority.p50_us,
        priority.p99_us, preempt.p50_us, preempt.p99_us
    );
    assert_near(
        "P1 SP D_App median / alone",
        priority.p50_us / alone.p50_us,
        1.0,
        EFFECT,
    );
    assert_near(
        "P1 SP D_App p99 / alone",
        priority.p99_us / alone.p99_us,
        1.0,
        EFFECT,
    );
    assert!(
        priority.p50_us < preempt.p50_us && preempt.p50_us < native.p50_us,
        "P1 direction: SP {priority:?} below preempt {preempt:?} below native {native:?}"
    );
}

/// SP with the M_App (PeRF §5.2.1, Fig 7b): strict priority lets the M_App's small
/// messages dominate the RNIC, and the B_App's throughput is severely degraded.
///
/// Measured: M_App 13.0 M msgs/s alone, 2.91 M native, 5.66 M priority, 10.9 M preempt;
/// B_App 95.4 Gb/s native, 92.8 priority, 80.7 preempt.
///
/// Gap: the model's B_App is not degraded and the M_App gets under half its alone rate.
/// Strict priority picks per packet and cannot take back a packet already sent: the
/// M_App's one queue pair has a message ready only every 77 ns (its processing unit's
/// 13 M msgs/s), and in every such gap the arbiter sends one 4 KB B_App packet (330 ns),
/// so the M_App gets about two messages in per B_App packet. How PeRF's SP starves the
/// B_App is not described closely enough to model. Asserted: what the model shows,
/// priority between native and preempt for the M_App, and the B_App keeping 90% of
/// native.
#[test]
fn p1_priority_with_the_message_app() {
    let r = report(SCENARIO);
    let native = mmsgs(&r, "M_App + B_App native", "M_App");
    let priority = mmsgs(&r, "M_App + B_App priority", "M_App");
    let preempt = mmsgs(&r, "M_App + B_App preempt", "M_App");
    assert!(
        priority > 1.5 * native && priority < preempt,
        "M_App (M msgs/s): native {native}, priority {priority}, preempt {preempt}"
    );
    let kept =
        gbps(&r, "M_App + B_App priority", "B_App") / gbps(&r, "M_App + B_App native", "B_App");
    assert!(
        kept > 0.9,
        "SP now starves the B_App (keeps {kept:.2} of native), as in PeRF Fig 7b: update this test"
    );
    eprintln!("SP M_App case: M_App {priority:.2} M msgs/s, B_App keeps {kept:.3} of native");
}

/// P2: PeRF gets about x2.04 the B_App throughput of Justitia, because Justitia halves the
/// B_App (and the M_App) when they share (PeRF §1, §5.2.2, Fig 8).
///
/// Gap: "at similar latency" does not hold for the D_App in the model (see P1: preempt's
/// median stays about twice Justitia's); asserted besides is that preempt gives the M_App more
/// than Justitia does.
#[test]
fn p2_preempt_doubles_bandwidth_over_justitia() {
    assert_targets("P2");
    let r = report(SCENARIO);
    assert!(
        mmsgs(&r, "M_App + B_App preempt", "M_App") > mmsgs(&r, "M_App + B_App justitia", "M_App")
    );
}

/// `adaptive` in the headline setting (D_App + B_App, and M_App + B_App), against both
/// `justitia` and `preempt`: it must dominate each, not trade one figure for another.
///
/// With the D_App, adaptive paces the host's bandwidth flows as one chunk stream just under
/// what the transmitter drains, so the D_App's p99 is no worse than Justitia's (whose 5 KB
/// chunks hold it near 2 us) while the B_App keeps more than Justitia's paced share, and
/// both the D_App's median and tail beat preempt's (its 16 KB sub-messages enter the
/// transmit FIFO whole). With the M_App (no latency flow), adaptive does not yield: both the
/// M_App's rate and the B_App's bandwidth must be at least preempt's. This scenario's 1 us
/// Target99 is under the D_App's alone p99, so adaptive runs at its floor chunk here; the
/// goal of x1.2 of alone is asserted in `adaptive_goal.rs`.
#[test]
fn adaptive_against_justitia_and_preempt() {
    let r = report(SCENARIO);
    let j = latency(run(&r, "D_App + B_App justitia"), "D_App");
    let p = latency(run(&r, "D_App + B_App preempt"), "D_App");
    let a = latency(run(&r, "D_App + B_App adaptive"), "D_App");
    let j_bw = gbps(&r, "D_App + B_App justitia", "B_App");
    let a_bw = gbps(&r, "D_App + B_App adaptive", "B_App");
    eprintln!(
        "headline D_App p50/p99 (us) and B_App Gb/s: justitia {:.2}/{:.2} {:.1}, preempt {:.2}/{:.2} {:.1}, adaptive {:.2}/{:.2} {:.1}",
        j.p50_us, j.p99_us, j_bw, p.p50_us, p.p99_us,
        gbps(&r, "D_App + B_App preempt", "B_App"), a.p50_us, a.p99_us, a_bw
    );
    assert!(a_bw >= j_bw, "adaptive {a_bw} Gb/s vs justitia {j_bw}");
    assert!(a.p99_us <= j.p99_us, "adaptive {a:?} vs justitia {j:?}");
    assert!(
        a.p50_us < p.p50_us && a.p99_us < p.p99_us,
        "adaptive {a:?} vs preempt {p:?}"
    );
    let (a_m, p_m) = (
        mmsgs(&r, "M_App + B_App adaptive", "M_App"),
        mmsgs(&r, "M_App + B_App preempt", "M_App"),
    );
    let (a_b, p_b) = (
        gbps(&r, "M_App + B_App adaptive", "B_App"),
        gbps(&r, "M_App + B_App preempt", "B_App"),
    );
    assert!(
        a_m >= p_m && a_b >= p_b,
        "M_App case: adaptive {a_m} M msgs/s and {a_b} Gb/s vs preempt {p_m} and {p_b}"
    );
}
