//! The `justitia` policy against the effects its paper reports (validation targets J1-J8).
//!
//! Each target's test asserts every check of it in the validation table
//! (`crates/sim/validation/targets.toml`: the paper's figure, the tolerance and why):
//! within tolerance, or on the known-gap list (`common/gaps.rs`) with the model's figure.
//! Directions the paper states without a figure (Justitia beats native) are asserted here.
//! The last three tests cover effects outside the target list, each with its own bounds.

mod common;

use common::{assert_between, assert_near, assert_targets, flow, latency, report, run};
use justitia_sim::report::jain_index;

/// Justitia's effects outside the target list: within 30% of the paper.
const EFFECT: f64 = 0.30;

/// J1: with Target99 set to the latency flow's alone p99, Justitia brings its median back
/// to the alone value (1.3 us IB, 1.8 us RoCE) and limits the bandwidth flow to half
/// (sharing incentive) (Justitia Fig 9).
#[test]
fn j1_latency_isolation_with_sharing_incentive() {
    assert_targets("J1");
    for scenario in ["lat-vs-1mb-bw-ib56", "lat-vs-1mb-bw-roce40"] {
        let r = report(scenario);
        let native = latency(run(&r, "with bw"), "lat");
        let justitia = latency(run(&r, "with bw + justitia"), "lat");
        assert!(
            justitia.p50_us < native.p50_us && justitia.p99_us < native.p99_us,
            "J1 {scenario}: Justitia {justitia:?} must beat native {native:?}"
        );
    }
}

/// J2: with a relaxed target (10 us) and the bandwidth flow on 4 QPs, Justitia keeps most
/// of the bandwidth and bounds the latency: median 2.2 / 6.7 us, p99 3.2 / 7.1 us,
/// 41.3 / 29.7 Gb/s on IB / RoCE (Justitia Fig 10).
///
/// Known gaps (`common/gaps.rs`): both bandwidth flows keep more than measured (46.4 and
/// 36.5 Gb/s); on RoCE-40 the latency flow gets about 2.2 us against 6.7, because the
/// model's 5 KB chunks paced below the line rate never let the transmit FIFO fill,
/// whatever the target.
#[test]
fn j2_relaxed_target_keeps_bandwidth() {
    assert_targets("J2");
}

/// J3: Justitia gives a 1 MB and a 1 GB flow equal shares (against x1.42 / x1.22
/// natively), at a bandwidth cost under 6% on IB and 2% on RoCE (Justitia §6.1.2, Fig 11).
#[test]
fn j3_equal_shares_regardless_of_message_size() {
    assert_targets("J3");
    for scenario in ["1mb-vs-1gb-bw-ib56", "1mb-vs-1gb-bw-roce40"] {
        let r = report(scenario);
        let native = run(&r, "1MB vs 1GB, event");
        let j = run(&r, "1MB vs 1GB, event + justitia");
        let ratio = flow(j, "1GB").gbps / flow(j, "1MB").gbps;
        let native_ratio = flow(native, "1GB").gbps / flow(native, "1MB").gbps;
        assert!(
            (ratio - 1.0).abs() < (native_ratio - 1.0).abs(),
            "J3 {scenario}: Justitia {ratio} must be fairer than native {native_ratio}"
        );
    }
}

/// J4: against a 1 MB flow, Justitia gives the throughput flow half its alone rate and the
/// bandwidth flow half its bandwidth (Justitia Fig 12).
#[test]
fn j4_throughput_and_bandwidth_halve() {
    assert_targets("J4");
    let r = report("tput-vs-1mb-bw-ib56");
    assert!(
        flow(run(&r, "with bw + justitia"), "tput").msgs_per_sec
            > flow(run(&r, "with bw"), "tput").msgs_per_sec
    );
}

/// J5: on 10 Gb/s RoCE with DCQCN, Justitia gives the throughput flow 2.6 M msgs/s and the
/// bandwidth flow 4.1 Gb/s (Justitia Fig 19).
#[test]
fn j5_throughput_vs_bandwidth_roce10() {
    assert_targets("J5");
}

/// J6: eight latency flows against eight bandwidth flows of 1 MB to 1 GB: natively x71.4
/// the alone median (x79.8 p99); Justitia improves the median x48.8 and the p99 x16.4
/// (Justitia §6.5.1, Fig 22), so it leaves them at x1.46 and x4.87 alone. The paper states
/// these as ratios to the flow alone, so the model's are ratios to its own alone run.
///
/// Known gaps (`common/gaps.rs`): the model's native degradation is about x2 (each of the
/// eight QPs adds one MTU packet of waiting, see N3/N4), so there is far less for Justitia
/// to win back and none of the paper's factors is reached; Justitia's median (x1.08 alone)
/// is within tolerance of the paper's x1.46, its p99 (x1.6) is not of x4.87. What is left
/// is a chunk the latency packet meets on the wire at the sharing floor. The eight flows'
/// pacers release one after another only because the loop gives them release phases; with
/// their releases in step (every flow given its rate at the same update with a full burst)
/// the p99 was 4.9 us, above native. The directions (native worse than alone, Justitia
/// better than native) and sharing incentive among the bandwidth flows are asserted too.
#[test]
fn j6_many_latency_flows_against_arriving_bandwidth_flows() {
    assert_targets("J6");
    let r = report("many-latency-vs-arriving-bw-ib56");
    let alone = latency(run(&r, "latency alone"), "lat#1");
    let native = latency(run(&r, "with bw"), "lat#1");
    let j = run(&r, "with bw + justitia");
    let justitia = latency(j, "lat#1");
    assert!(
        native.p50_us > alone.p50_us && native.p99_us > alone.p99_us,
        "native {native:?} vs alone {alone:?}"
    );
    assert!(
        justitia.p50_us < native.p50_us && justitia.p99_us < native.p99_us,
        "Justitia {justitia:?} must beat native {native:?}"
    );
    let bw: Vec<f64> = j
        .flows
        .iter()
        .filter(|f| f.name.starts_with("bw"))
        .map(|f| f.gbps)
        .collect();
    assert_between(
        "J6 Jain index of the bandwidth flows",
        jain_index(&bw).unwrap_or(0.0),
        0.98,
        1.0,
    );
}

/// J7: many bandwidth flows, or many throughput flows, all get equal shares and the total
/// stays near capacity (MaxRate 48 Gb/s, MaxTput 30 M ops/s) (Justitia §6.3.1, Fig 16).
#[test]
fn j7_many_flows_equal_shares() {
    assert_targets("J7");
}

/// J8: when Target99 cannot be met, Justitia first keeps sharing incentive; with the
/// unattainable-target option it gives up after delta, increases utilization and shares the
/// bandwidth equally among the resource-hungry flows (Justitia §4.5, §6.5.2, Fig 23). The
/// scenario's delta is 20 ms instead of 5 s, so the run stays short. The paper gives no
/// figure for the total, so the increase is a direction; the total after delta is checked
/// against the paper's MaxRate (48 Gb/s, §4.2.3).
#[test]
fn j8_unattainable_target() {
    assert_targets("J8");
    let r = report("unattainable-target-ib56");
    let total: f64 = run(&r, "justitia, gives up after delta")
        .flows
        .iter()
        .filter(|f| f.name.starts_with("bw"))
        .map(|f| f.gbps)
        .sum();
    assert_near("J8 after delta: bandwidth total (Gb/s)", total, 48.0, 0.10);
}

/// The application-level models of Justitia §2.2 and §6.2: an RPC service loses most of its
/// rate to a storage service moving 1 MB splits, and Justitia gives much of it back while the
/// storage service keeps about half its bandwidth. The paper's figures (FaSST: -74%, x2.5,
/// storage / 1.7) are the validation table's `A1` checks; the directions hold whatever the
/// magnitudes.
#[test]
fn rpc_service_against_storage_service() {
    assert_targets("A1");
    let r = report("fasst-vs-storage-ib56");
    let alone = flow(run(&r, "rpc alone"), "rpc").msgs_per_sec;
    let native = flow(run(&r, "with storage"), "rpc").msgs_per_sec;
    let j = run(&r, "with storage + justitia");
    assert!(
        native < 0.5 * alone,
        "the storage service takes most of the RPC rate: {native} of {alone} msgs/s"
    );
    assert!(
        flow(j, "rpc").msgs_per_sec > 2.0 * native,
        "Justitia gives the RPC service its rate back: {} against {native} msgs/s",
        flow(j, "rpc").msgs_per_sec
    );
}

/// eRPC against the same storage service (Justitia §2.2.3, §6.2): the paper's figures are the
/// validation table's `A2` checks. Whatever their magnitudes, the storage service costs the
/// RPC most of its rate and multiplies its latency, and Justitia gives back both.
#[test]
fn latency_rpc_against_storage_service() {
    assert_targets("A2");
    let r = report("erpc-vs-storage-ib56");
    let lat = |variant: &str| latency(run(&r, variant), "erpc-lat");
    let (alone, native, j) = (
        lat("latency alone"),
        lat("latency with storage"),
        lat("latency with storage + justitia"),
    );
    assert!(
        native.p50_us > 2.0 * alone.p50_us,
        "{native:?} against {alone:?}"
    );
    assert!(j.p50_us < 0.5 * native.p50_us, "{j:?} against {native:?}");
    let rate = |variant: &str| flow(run(&r, variant), "erpc").msgs_per_sec;
    assert!(rate("erpc with storage") < 0.5 * rate("erpc alone"));
    assert!(rate("erpc with storage + justitia") > 2.0 * rate("erpc with storage"));
}

/// READs issued by the remote host make the local RNIC send their responses, which compete
/// with its own sends in its arbiter: the local latency flow suffers as from a local
/// bandwidth flow (Justitia §4.4, §6.6, Fig 24c-d). With Justitia the requester paces its
/// READs like a local bandwidth flow (the ping-pong's other end is a latency flow of its
/// host too), at most at the responder's guarantee, and the latency flow recovers.
#[test]
fn remote_reads_compete_with_local_sends() {
    let r = report("lat-vs-remote-read-ib56");
    let alone = latency(run(&r, "alone"), "lat");
    let native = latency(run(&r, "with remote read"), "lat");
    let j = latency(run(&r, "with remote read + justitia"), "lat");
    assert_between(
        "READ responses: latency with / alone",
        native.p50_us / alone.p50_us,
        1.5,
        3.0,
    );
    assert_near(
        "READ flow alone (Gb/s)",
        flow(run(&r, "read alone"), "remote read").gbps,
        48.0,
        0.05,
    );
    assert!(
        j.p50_us < native.p50_us,
        "Justitia {j:?} vs native {native:?}"
    );
}

/// Justitia §4.4 with the latency flow only on the responder (a one-sided latency flow):
/// the reader's host counts no latency flow, so its own loop has no reason to pace its
/// READs. Natively the READ responses queue ahead of the latency messages in the
/// responder's RNIC. Under Justitia the responder counts the READ flow it serves with its
/// latency flow, L'+B'+T' = 2, and announces half its MaxRate (48 Gb/s on IB-56), at which
/// the reader caps its READs, cut to the responder's chunk. Expected values from the
/// scenario and the profile: the READ flow at the guarantee, the latency flow near its
/// alone figures, and the reader's own controller never cutting (the protection is the
/// guarantee's).
#[test]
fn the_responders_guarantee_protects_its_latency_flow_from_remote_reads() {
    let name = "lat-vs-remote-read-responder-ib56";
    let max_rate = common::experiment(name).profile.policy.max_rate_gbps;
    let r = report(name);
    let alone = latency(run(&r, "alone"), "lat");
    let native = latency(run(&r, "with remote read"), "lat");
    let with = run(&r, "with remote read + justitia");
    let j = latency(with, "lat");
    eprintln!("latency alone {alone:?}, native {native:?}, justitia {j:?}");
    assert!(
        native.p99_us > 2.0 * alone.p99_us,
        "natively the READ responses must hurt: {native:?} vs alone {alone:?}"
    );
    assert!(
        j.p50_us <= 1.1 * alone.p50_us && j.p99_us <= 1.1 * alone.p99_us,
        "with the guarantee {j:?} vs alone {alone:?}"
    );
    assert_near(
        "READ flow at the responder's guarantee, 1/2 of MaxRate (Gb/s)",
        flow(with, "remote read").gbps,
        max_rate / 2.0,
        0.02,
    );
    let figures = &with.policy_figures;
    assert_eq!(figures.get("b.decreases"), Some(&0.0), "{figures:?}");
    assert_eq!(
        figures.get("b.safe_util_gbps"),
        Some(&max_rate),
        "{figures:?}"
    );
}

/// The headline on RoCE-100 (the speed benchmark's scenario): Justitia brings the latency
/// flow back near its alone figures (within 30%) and beats native at the median and p99,
/// while the bandwidth flow keeps at least its sharing-incentive floor, half the NIC with
/// one latency and one bandwidth flow.
#[test]
fn headline_roce100_isolates_and_keeps_the_floor() {
    let r = report("lat-vs-1mb-bw-roce100");
    let alone = latency(run(&r, "alone"), "lat");
    let native = latency(run(&r, "with bw"), "lat");
    let justitia = latency(run(&r, "with bw + justitia"), "lat");
    assert_near(
        "RoCE-100 median with Justitia vs alone (us)",
        justitia.p50_us,
        alone.p50_us,
        EFFECT,
    );
    assert!(
        justitia.p50_us < native.p50_us && justitia.p99_us < native.p99_us,
        "Justitia {justitia:?} must beat native {native:?}"
    );
    let native_bw = flow(run(&r, "with bw"), "bw").gbps;
    let shared_bw = flow(run(&r, "with bw + justitia"), "bw").gbps;
    assert_between(
        "RoCE-100 bandwidth flow under Justitia / native",
        shared_bw / native_bw,
        0.5 * (1.0 - 0.05),
        1.0,
    );
}

/// One counting rule for local and remote flows (issues 25 and 27): a host that WRITEs
/// to its peer and READs from it, with no latency flow anywhere, has two RNICs' worth:
/// the WRITE's data leaves its RNIC, the READ's the peer's. Natively each flow gets the
/// whole of its RNIC (48 Gb/s of payload on IB-56); Justitia must not halve the WRITE
/// for READs it never competes with, which it did (24 + 24 Gb/s) while the READ
/// requester's flow counted in its own host's L/B/T.
#[test]
fn a_host_that_writes_and_reads_keeps_both_rnics_full_rate() {
    let r = report("write-and-read-ib56");
    let native = run(&r, "native");
    let justitia = run(&r, "justitia");
    for name in ["write", "read"] {
        let n = flow(native, name).gbps;
        let j = flow(justitia, name).gbps;
        assert_between(&format!("native {name}"), n, 44.0, 52.0);
        assert!(
            j > 0.9 * n,
            "{name}: {j:.1} Gb/s under Justitia against {n:.1} natively (half is {:.1})",
            n / 2.0
        );
    }
}
