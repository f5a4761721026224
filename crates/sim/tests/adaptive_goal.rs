//! `adaptive` against its goal on the comparison suite (`scenarios/suite-*.toml`): every
//! latency flow's p99 within x1.2 of its alone p99, the bandwidth flows together at 95% of
//! their alone goodput or more, and every tenant at or above its tenant-fair share (what a
//! weighted equal split of the RNIC among the run's tenants leaves it, or its alone figure
//! when smaller; `justitia_sim::fairness`; a flow is a tenant of its own unless the
//! scenario says). The bands are the goal's, not the model's output. On every workload,
//! goal met or not, every tenant keeps 0.8 of its tenant-fair share.
//!
//! Where the goal cannot be met, a known-miss entry gives the bound, computed from the
//! profile's parameters and the alone runs (references, not runs of the policy under
//! test), and pins the measured figure so that the entry fails if it moves either way.
//! Also: a sweep of message sizes, queue-pair counts and MTUs on RoCE-100, and recovery
//! when latency flows leave and arrive.

#![allow(clippy::expect_used)]

mod common;

use common::experiment;
use justitia_core::flow::FlowClass;
use justitia_sim::fairness;
use justitia_sim::{Experiment, ModelProfile, RunReport, ScenarioReport};

/// The goal's latency band.
const BAND: f64 = 1.2;
/// The goal's bandwidth floor.
const BANDWIDTH: f64 = 0.95;
/// What every tenant keeps of its tenant-fair share on every workload.
const TENANT_FAIR: f64 = 0.8;
/// A measured rate within 2% of its floor keeps it (finite windows).
const FLOOR_SLACK: f64 = 0.98;
/// How far a pinned known-miss figure may move before the entry fails.
const PIN: f64 = 0.03;

/// What adaptive did on one workload, against the flows alone.
#[derive(Debug)]
struct Outcome {
    /// Worst latency flow's p99 over its alone p99.
    latency_x: Option<f64>,
    /// Bandwidth flows' goodput together over theirs alone.
    bandwidth: f64,
    /// Lowest ratio of a tenant's rate to its tenant-fair share (`justitia_sim::fairness`;
    /// a flow is a tenant of its own unless the scenario says).
    floor_ratio: f64,
    /// Throughput flows' messages/s together alone, and their count.
    throughput_alone: Option<(f64, usize)>,
    /// Bandwidth flows' Gb/s together alone.
    bandwidth_alone: f64,
    /// Flows in the adaptive run.
    flows: usize,
}

impl Outcome {
    fn meets_goal(&self) -> bool {
        self.latency_x.is_none_or(|x| x <= BAND)
            && self.bandwidth >= BANDWIDTH
            && self.floor_ratio >= FLOOR_SLACK
    }
}

/// Runs the alone references and the `adaptive` run of a scenario only.
fn run_adaptive(mut e: Experiment) -> ScenarioReport {
    e.scenario
        .variants
        .retain(|v| v.name.starts_with("alone") || v.name == "adaptive");
    e.run().expect("runs")
}

fn outcome(e: &Experiment, report: &ScenarioReport, policy_run: &str) -> Outcome {
    let run = report.run(policy_run).expect("policy run");
    let mut latency_x: Option<f64> = None;
    for f in run.flows.iter().filter(|f| f.class == FlowClass::Latency) {
        let base = report
            .runs
            .iter()
            .filter(|r| r.variant.starts_with("alone"))
            .find_map(|r| r.flow(&f.name))
            .expect("every flow has an alone run");
        if let (Some(now), Some(then)) = (f.latency, base.latency) {
            let x = now.p99_us / then.p99_us;
            latency_x = Some(latency_x.map_or(x, |w: f64| w.max(x)));
        }
    }
    let capacity = fairness::capacity(report);
    let total = |class| -> f64 {
        run.flows
            .iter()
            .filter(|f| f.class == class)
            .map(|f| fairness::rate(class, f.gbps, f.msgs_per_sec))
            .sum()
    };
    let shares = fairness::tenant_shares(report, run, &fairness::tenants(&e.scenario), &e.profile);
    let throughput: Vec<_> = shares
        .iter()
        .filter(|s| s.class == FlowClass::Throughput)
        .collect();
    let bandwidth_alone = capacity.get(&FlowClass::Bandwidth).copied().unwrap_or(0.0);
    Outcome {
        latency_x,
        bandwidth: total(FlowClass::Bandwidth) / bandwidth_alone,
        floor_ratio: shares
            .iter()
            .map(|s| s.ratio())
            .fold(f64::INFINITY, f64::min),
        throughput_alone: (!throughput.is_empty())
            .then(|| (throughput.iter().map(|s| s.alone).sum(), throughput.len())),
        bandwidth_alone,
        flows: run.flows.len(),
    }
}

fn suite(name: &str) -> Outcome {
    let e = experiment(&format!("suite-{name}"));
    let report = run_adaptive(e.clone());
    let o = outcome(&e, &report, "adaptive");
    eprintln!("{name}: {o:?}");
    o
}

/// The workloads where adaptive meets the goal.
#[test]
fn the_goal_holds_on_these_workloads() {
    let mut failed = Vec::new();
    for name in [
        "lat-vs-1bw-roce100",
        "lat-vs-4bw-roce100",
        "dapp-vs-bapp-roce100",
        "lat-vs-1bw-roce40",
        "lat-vs-4bw-roce40",
        "dapp-vs-bapp-roce40",
        "tput-vs-bw-ib56",
        "mapp-vs-bapp-ib56",
        // Tenants that differ in applications and queue pairs.
        "1app-vs-16apps-roce100",
        "2qps-vs-64qps-roce100",
        // 512 queue pairs against 256 cached contexts: each queue pair of the budget is
        // served for a turn long enough that the context read opening the next disturbs
        // the latency flow at most 1% of the time (28 MB, from the 600 ns read; with 1 MB
        // turns x1.18 / 94.9%, a pinned miss).
        "4qps-vs-512qps-roce100qpc",
    ] {
        let o = suite(name);
        if !o.meets_goal() {
            failed.push(format!("{name}: {o:?}"));
        }
    }
    assert!(failed.is_empty(), "goal missed:\n{}", failed.join("\n"));
}

/// The most the bandwidth flows can get, as a fraction of alone, once the throughput flows
/// keep their sharing-incentive floor: the floor's messages take `wire_bytes(16 B)` each
/// of the link, and what is left carries full MTU packets (payload / (payload + headers)).
/// From the profile's link and MTU and the alone runs' rates only.
fn throughput_wire_bound(e: &Experiment, o: &Outcome) -> f64 {
    let p = &e.profile;
    let (tput_alone, k) = o.throughput_alone.expect("throughput flows");
    let floor_msgs = tput_alone * k as f64 / o.flows as f64;
    let floor_gbps = floor_msgs * f64::from(p.wire_bytes(16, true)) * 8.0 / 1e9;
    let mtu = p.mtu();
    let efficiency = f64::from(mtu) / f64::from(mtu + p.link.header_bytes);
    let payload = ((p.link.gbps - floor_gbps) * efficiency).min(p.policy.max_rate_gbps * 1.02);
    payload / o.bandwidth_alone
}

/// Known misses the link bounds: with the throughput flows at their sharing-incentive
/// floor, what their small messages take of the wire leaves the bandwidth flows less than
/// 95% of alone, so no policy that keeps every floor meets the goal there. Pinned: the
/// measured bandwidth (and, with latency flows, the latency multiple), within 3%.
#[test]
fn known_misses_bounded_by_the_throughput_flows_floor_on_the_wire() {
    // (workload, measured bandwidth fraction, measured worst latency multiple)
    let cases: [(&str, f64, Option<f64>); 5] = [
        ("mapp-vs-bapp-roce100", 0.871, None),
        ("tput-vs-bw-roce40", 0.838, None),
        ("mapp-vs-bapp-roce40", 0.833, None),
        // In the mix the throughput flows are paced at their floor too; the bandwidth flows
        // keep about 60%, under the wire's bound (about 75%), and over their own floor
        // (8/24). Before the throughput flows were paced they kept 28% and 22%, under it.
        ("mix-8-8-8-roce100", 0.605, Some(1.298)),
        ("mix-8-8-8-roce40", 0.603, Some(1.407)),
    ];
    let mut moved = Vec::new();
    for (name, bandwidth, latency_x) in cases {
        let e = experiment(&format!("suite-{name}"));
        let o = outcome(&e, &run_adaptive(e.clone()), "adaptive");
        let bound = throughput_wire_bound(&e, &o);
        eprintln!("{name}: bound {bound:.3}, measured {o:?}");
        assert!(
            bound < BANDWIDTH,
            "{name}: the wire leaves {bound:.3} of alone: the goal is not provably out of reach"
        );
        assert!(
            o.bandwidth <= bound + 0.01,
            "{name}: {:.3} beats the bound {bound:.3}: a floor was broken",
            o.bandwidth
        );
        if (o.bandwidth - bandwidth).abs() > PIN
            || latency_x
                .zip(o.latency_x)
                .is_some_and(|(pinned, now)| (now / pinned - 1.0).abs() > PIN)
        {
            moved.push(format!("{name}: now {o:?}"));
        }
    }
    assert!(
        moved.is_empty(),
        "pinned figures moved:\n{}",
        moved.join("\n")
    );
}

/// The expected service time of a chunk of `c` bytes at the transmitter of a profile whose
/// payload is read over PCIe: the longer of its wire time and its payload read, which
/// varies uniformly by +-`read_jitter_ns` (the model's stated per-read jitter), in seconds.
fn mean_service(p: &ModelProfile, c: u32) -> f64 {
    let wire = f64::from(c + p.link.header_bytes + p.link.first_packet_extra_bytes)
        / (p.link.gbps * 1e9 / 8.0);
    let read = f64::from(c) / (p.pcie.read_gbps * 1e9 / 8.0);
    let j = p.pcie.read_jitter_ns * 1e-9;
    // E[max(wire, read + U)], U uniform on [-j, j].
    let a = (wire - read).clamp(-j, j);
    wire * (a + j) / (2.0 * j) + (read + (a + j) / 2.0) * (j - a) / (2.0 * j)
}

/// IB-56 latency workloads: a known miss, with an estimated bound. The payload of every
/// chunk is read over PCIe at 48.9 Gb/s with +-150 ns of jitter per read, so the
/// transmitter's service time per chunk is random and its mean is above the read time.
/// A latency message that finds the wire busy waits for the rest of the chunk in service;
/// taking that wait as adding its mean, the chunk must serve within the band's slack
/// (0.2 x the alone p99) on average. The largest such chunk drains at about 45.6 Gb/s,
/// 95% of alone before the pacing headroom; with the law's 2.5% headroom (without which
/// the queue grows without bound) the bandwidth flows get at most about 92.5%. Computed
/// from the profile's link and PCIe parameters and the alone runs; it is an estimate
/// (the wait's addition to the alone tail is assumed, not proven). Pinned: the measured
/// figures, within 3%.
#[test]
fn ib56_latency_workloads_miss_by_the_payload_reads_jitter() {
    let cases = [
        ("lat-vs-1bw-ib56", 0.825, 1.226),
        ("lat-vs-4bw-ib56", 0.840, 1.267),
        ("dapp-vs-bapp-ib56", 0.815, 1.231),
    ];
    let mut moved = Vec::new();
    for (name, bandwidth, latency_x) in cases {
        let e = experiment(&format!("suite-{name}"));
        let report = run_adaptive(e.clone());
        let o = outcome(&e, &report, "adaptive");
        let alone_p99 = report
            .runs
            .iter()
            .filter(|r| r.variant == "alone latency")
            .flat_map(|r| &r.flows)
            .filter_map(|f| f.latency.map(|l| l.p99_us))
            .fold(0.0, f64::max);
        let slack = (BAND - 1.0) * alone_p99 * 1e-6;
        let p = &e.profile;
        let chunk = (256..=8192)
            .step_by(16)
            .filter(|&c| mean_service(p, c) <= slack)
            .max()
            .expect("some chunk fits");
        let drain_gbps = f64::from(chunk) / mean_service(p, chunk) * 8.0 / 1e9;
        let bound = 0.975 * drain_gbps / o.bandwidth_alone;
        // The service model reproduces the alone flow: 4 KB packets drain at its rate.
        let full = 4096.0 / mean_service(p, 4096) * 8.0 / 1e9;
        assert!((full / o.bandwidth_alone - 1.0).abs() < 0.01, "{full} Gb/s");
        eprintln!("{name}: chunk {chunk} B drains {drain_gbps:.2} Gb/s, bound {bound:.3}; {o:?}");
        assert!(bound < BANDWIDTH, "{name}: bound {bound:.3}");
        if (o.bandwidth - bandwidth).abs() > PIN
            || o.latency_x
                .is_some_and(|x| (x / latency_x - 1.0).abs() > PIN)
        {
            moved.push(format!("{name}: now {o:?}"));
        }
    }
    assert!(
        moved.is_empty(),
        "pinned figures moved:\n{}",
        moved.join("\n")
    );
}

/// RoCE-100's throughput flow against a 1 MB flow: a miss within the pacing headroom of
/// the wire's bound. With the throughput flow at its floor (half its alone rate) the wire
/// leaves the bandwidth flow at most about 95.4% of alone, so only a transmitter kept
/// within 0.4% of saturation meets the goal; at the law's headroom (2.5% under what the
/// wire leaves, so that the transmit queue, and every small message's wait behind it,
/// stays bounded) the best is about 93%, under the goal. `adaptive` does less: without a
/// latency flow it leaves the throughput flow unpaced (the protected class: it keeps 95%
/// of alone, and the M_App keeps its rate above preempt's), whose messages then take the
/// wire the bandwidth flow would need. Bound computed from the profile's link and MTU and
/// the alone runs; the measured bandwidth pinned within 3%.
#[test]
fn roce100_throughput_miss_lies_within_the_headroom_of_the_wire_bound() {
    let e = experiment("suite-tput-vs-bw-roce100");
    let o = outcome(&e, &run_adaptive(e.clone()), "adaptive");
    let bound = throughput_wire_bound(&e, &o);
    let headroom = justitia_core::adaptive::DEFAULT_HEADROOM;
    eprintln!(
        "tput-vs-bw-roce100: bound {bound:.3}, at the headroom {:.3}; {o:?}",
        bound * headroom
    );
    assert!(
        bound >= BANDWIDTH,
        "bound {bound:.3}: the wire alone rules the goal out"
    );
    assert!(
        bound * headroom < BANDWIDTH,
        "bound {bound:.3} leaves the goal in reach at the headroom {headroom}"
    );
    assert!(
        !o.meets_goal(),
        "now meets the goal: move it to the goal test"
    );
    assert!(
        (o.bandwidth - 0.898).abs() <= PIN,
        "pinned figure moved: now {o:?}"
    );
}

/// IB-56's mix of 8 latency, 8 bandwidth and 8 throughput flows: a miss with every lever
/// of the law at its floor. The latency flows' tail stays over the band (x1.27) with the
/// bandwidth flows paced at their sharing floor, (B+T)/(L+B+T) = 16/24 of what is left, in
/// the smallest chunks the host can post at that rate (headroom x MaxRate / half a queue
/// pair's message rate), and the throughput flows paced at their own floor; lowering any
/// of these would break a floor, and the bandwidth miss (about 65% of alone) is that
/// pacing fraction. What still queues ahead of a latency message is the other latency
/// flows' and the throughput flows' small messages. Expected values from the flow counts
/// and the profile; the measured figures pinned within 3%.
#[test]
fn ib56_mix_misses_with_every_lever_at_its_floor() {
    let e = experiment("suite-mix-8-8-8-ib56");
    let report = run_adaptive(e.clone());
    let o = outcome(&e, &report, "adaptive");
    let figures = &report
        .runs
        .iter()
        .find(|r| r.variant == "adaptive")
        .expect("an adaptive run")
        .policy_figures;
    // Host a sends every flow of the mix.
    let figure = |k: &str| {
        *figures
            .get(&format!("a.{k}"))
            .unwrap_or_else(|| panic!("no figure a.{k}"))
    };
    let p = &e.profile;
    let max_rate = p.policy.max_rate_gbps * 1e9 / 8.0;
    let headroom = justitia_core::adaptive::DEFAULT_HEADROOM;
    let smallest_chunk = (headroom * max_rate / (p.rnic.qp_mops * 1e6 / 2.0)).ceil();
    eprintln!("mix-8-8-8-ib56: smallest chunk {smallest_chunk} B; {figures:?}; {o:?}");
    assert!((figure("pace_fraction") - 16.0 / 24.0).abs() < 1e-9);
    assert_eq!(figure("chunk_bytes"), smallest_chunk);
    assert!(o.floor_ratio >= FLOOR_SLACK, "a floor was broken: {o:?}");
    assert!(
        !o.meets_goal(),
        "now meets the goal: move it to the goal test"
    );
    let latency_x = o.latency_x.expect("latency flows");
    assert!(
        (o.bandwidth - 0.649).abs() <= PIN && (latency_x / 1.269 - 1.0).abs() <= PIN,
        "pinned figures moved: now {o:?}"
    );
}

/// A 16 B latency flow against one bandwidth flow of `size` on `qps` queue pairs, on
/// RoCE-100 with path MTU `mtu`: each class alone, then `adaptive` with Target99 at x1.2 of
/// the latency flow's alone p99 on RoCE-100 (1.65 us).
fn sweep_point(size: &str, qps: u32, mtu: u32) -> Experiment {
    let depth = if size == "16MB" { 2 } else { 8 };
    let text = format!(
        r#"
description = "sweep point"
profile = "RoCE-100"
duration_ms = 12
warmup_ms = 3

[[flows]]
name = "lat"
[flows.latency]
size = 16

[[flows]]
name = "bw"
[flows.bandwidth]
size = "{size}"
qps = {qps}
depth = {depth}

[[variants]]
name = "alone latency"
flows = ["lat"]

[[variants]]
name = "alone bandwidth"
flows = ["bw"]

[[variants]]
name = "adaptive"
policy = "adaptive"
[variants.justitia]
target99_us = 1.98
unattainable_after_ms = 0
"#
    );
    let e = Experiment::from_toml(&format!("sweep-{size}-{qps}qp-{mtu}"), &text, None)
        .expect("sweep scenario");
    let mut profile = e.profile.clone();
    profile.policy.mtu = mtu;
    e.with_profile(profile)
}

/// The goal beyond the tuned points, on RoCE-100: message sizes 4 KB to 16 MB, 1 to 16
/// queue pairs, path MTU 1 KB and 4 KB, a dozen points. About 10 s in a debug build.
#[test]
fn the_goal_holds_across_sizes_queue_pairs_and_mtus_on_roce100() {
    let points: [(&str, u32, u32); 12] = [
        ("4KB", 1, 4096),
        ("64KB", 1, 4096),
        ("1MB", 1, 4096),
        ("16MB", 1, 4096),
        ("1MB", 4, 4096),
        ("1MB", 16, 4096),
        ("4KB", 16, 4096),
        ("16MB", 16, 4096),
        ("4KB", 1, 1024),
        ("1MB", 1, 1024),
        ("16MB", 4, 1024),
        ("64KB", 16, 1024),
    ];
    let mut failed = Vec::new();
    for (size, qps, mtu) in points {
        let e = sweep_point(size, qps, mtu);
        let report = e.run().expect("runs");
        let o = outcome(&e, &report, "adaptive");
        eprintln!("{size} x {qps} QPs, MTU {mtu}: {o:?}");
        if !o.meets_goal() {
            failed.push(format!("{size} x {qps} QPs, MTU {mtu}: {o:?}"));
        }
    }
    assert!(failed.is_empty(), "goal missed:\n{}", failed.join("\n"));
}

/// Recovery on RoCE-100: a 1 MB bandwidth flow throughout; a latency flow arrives at 20 ms
/// and leaves at 120 ms. Over its 100 ms its p99 stays within x1.5 of alone (the same
/// flow over the same 100 ms with nothing else), and from 10 ms after it leaves every
/// 1 ms sample of the bandwidth flow is at 95% of its alone goodput or more.
#[test]
fn bandwidth_comes_back_and_an_arriving_latency_flow_is_protected() {
    let text = r#"
description = "recovery"
profile = "RoCE-100"
duration_ms = 140
series_ms = 1

[[flows]]
name = "lat"
start_ms = 20
stop_ms = 120
[flows.latency]
size = 16

[[flows]]
name = "bw"
[flows.bandwidth]
size = "1MB"
depth = 8

[[variants]]
name = "alone latency"
flows = ["lat"]

[[variants]]
name = "alone bandwidth"
flows = ["bw"]

[[variants]]
name = "adaptive"
policy = "adaptive"
[variants.justitia]
target99_us = 1.98
unattainable_after_ms = 0
"#;
    let report = Experiment::from_toml("recovery", text, None)
        .expect("scenario")
        .run()
        .expect("runs");
    let p99 = |variant: &str| {
        report
            .run(variant)
            .and_then(|r| r.flow("lat"))
            .and_then(|f| f.latency)
            .map(|l| l.p99_us)
            .expect("latency samples")
    };
    let arrival = p99("adaptive") / p99("alone latency");
    let alone_bw = report
        .run("alone bandwidth")
        .and_then(|r| r.flow("bw"))
        .map(|f| f.gbps)
        .expect("alone bandwidth");
    let series = &report.run("adaptive").expect("adaptive").series;
    let bw = series
        .flows
        .iter()
        .find(|f| f.name == "bw")
        .expect("bandwidth series");
    let after: Vec<(f64, f64)> = series
        .t_ms
        .iter()
        .zip(&bw.gbps)
        .filter(|(t, _)| **t > 130.0)
        .map(|(t, g)| (*t, *g))
        .collect();
    let during: f64 = series
        .t_ms
        .iter()
        .zip(&bw.gbps)
        .filter(|(t, _)| **t > 30.0 && **t <= 120.0)
        .map(|(_, g)| *g)
        .sum::<f64>()
        / 90.0;
    eprintln!(
        "arrival p99 x{arrival:.3}; bandwidth alone {alone_bw:.2}, during {during:.2}, after {after:?}"
    );
    assert!(
        arrival <= 1.5,
        "arriving latency flow's p99 x{arrival:.3} of alone"
    );
    assert!(!after.is_empty());
    let low: Vec<_> = after.iter().filter(|(_, g)| *g < 0.95 * alone_bw).collect();
    assert!(
        low.is_empty(),
        "bandwidth below 95% of alone {alone_bw:.2}: {low:?}"
    );
    // The latency flow was protected by pacing: the test would pass trivially if the
    // bandwidth flow ran unpaced throughout.
    assert!(
        during < 0.99 * alone_bw,
        "not paced while the latency flow ran: {during:.2}"
    );
}

/// A tenant's goodput in a run: its flows' Gb/s together (copies `name#n` included).
fn tenant_gbps(run: &RunReport, flow: &str) -> f64 {
    run.flows
        .iter()
        .filter(|f| f.name == flow || f.name.starts_with(&format!("{flow}#")))
        .map(|f| f.gbps)
        .sum()
}

/// Tenant A with one 1 MB application, tenant B with sixteen (`suite-1app-vs-16apps-roce100`),
/// without and with a latency tenant: by tenant, each keeps half of the link (A's goodput
/// alone) within the goal's 95%, where counting flows would leave A one seventeenth.
/// Without the latency tenant nothing is paced, so this is the round robin and the shaper's
/// window alone; with it, the stream paced for the latency tenant's tail.
#[test]
fn one_application_against_sixteen_keeps_half_the_link() {
    let mut e = experiment("suite-1app-vs-16apps-roce100");
    let adaptive = e
        .scenario
        .variants
        .iter()
        .find(|v| v.name == "adaptive")
        .cloned()
        .expect("an adaptive variant");
    let mut bandwidth_only = adaptive.clone();
    bandwidth_only.name = "adaptive, no latency tenant".into();
    bandwidth_only.flows = Some(vec!["A".into(), "B".into()]);
    e.scenario.variants.retain(|v| v.name == "alone A");
    e.scenario.variants.push(adaptive);
    e.scenario.variants.push(bandwidth_only);
    let report = e.run().expect("runs");
    let link = tenant_gbps(report.run("alone A").expect("alone A"), "A");
    let mut short = Vec::new();
    for variant in ["adaptive, no latency tenant", "adaptive"] {
        let run = report.run(variant).expect("run");
        let (a, b) = (tenant_gbps(run, "A"), tenant_gbps(run, "B"));
        eprintln!("{variant}: A {a:.2} Gb/s, B {b:.2} Gb/s of {link:.2}");
        for (tenant, gbps) in [("A", a), ("B", b)] {
            if gbps < 0.5 * BANDWIDTH * link {
                short.push(format!("{variant}: tenant {tenant} {gbps:.2} Gb/s"));
            }
        }
    }
    assert!(
        short.is_empty(),
        "under half of 95% of {link:.2}: {short:?}"
    );
}

/// Every workload of the suite, met or missed: each tenant keeps 0.8 of its tenant-fair
/// share under `adaptive`.
#[test]
fn every_tenant_keeps_most_of_its_fair_share_on_every_workload() {
    let dir = common::scenarios_dir();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("scenarios")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|f| Some(f.strip_prefix("suite-")?.strip_suffix(".toml")?.to_string()))
        .collect();
    names.sort();
    assert!(names.len() >= 22, "{names:?}");
    let short: Vec<String> = names
        .iter()
        .map(|name| (name, suite(name)))
        .filter(|(_, o)| o.floor_ratio < TENANT_FAIR)
        .map(|(name, o)| format!("{name}: {o:?}"))
        .collect();
    assert!(
        short.is_empty(),
        "tenants under 0.8 of fair:\n{}",
        short.join("\n")
    );
}

/// `read-beside-send` on RoCE-100: tenant A's 1 MB READs from the latency flow's peer beside
/// tenant B's 1 MB SENDs. Charged by resource, A's bytes to the responder's send path and
/// B's to this host's, each tenant has a stream and a link of its own: every tenant keeps
/// its tenant-fair share and the latency flow stays within the band (in one stream the
/// SEND tenant kept 0.72 of fair; charged to a stream the responder paces for itself, the
/// latency flow reached x2.14). The bandwidth goal is missed, by an estimated bound: a
/// latency message now crosses two paced send paths, its request this host's and its
/// acknowledgement the responder's, and waits behind up to a chunk on each, so each
/// stream's chunk is at most half of the band's slack at MaxRate; every chunk costs its
/// packet's headers and its RETH on its own path and, on the other, an acknowledgement (a
/// SEND) or a request packet (a READ), the smaller of which is taken. At the law's
/// headroom the two tenants together then reach at most about 91% of what they reach
/// natively (each its own link). From the profile, the target and the alone runs; an
/// estimate, as the chunks on the two paths could differ. Pinned within 3%: 0.901 and
/// x1.200 since B's SENDs are split through the shapers' protocol (each announced with the
/// chunk size of its post, its chunks sent against credits, the side channel's messages on
/// the same links); 0.899 and x1.194 when the simulated shaper split SENDs for free.
#[test]
fn read_beside_send_keeps_every_tenant_and_misses_by_the_costs_of_split_chunks() {
    let e = experiment("suite-read-beside-send-roce100");
    let report = run_adaptive(e.clone());
    let o = outcome(&e, &report, "adaptive");
    let p = &e.profile;
    let target = report
        .run("adaptive")
        .and_then(|r| r.policy_figures.get("a.target99_us").copied())
        .expect("the target")
        * 1e-6;
    let max_rate = p.policy.max_rate_gbps * 1e9 / 8.0;
    let chunk = target * (BAND - 1.0) / BAND * max_rate / 2.0;
    let own = f64::from(p.link.header_bytes + p.link.first_packet_extra_bytes);
    let reverse = f64::from(p.link.ack_bytes).min(own);
    let wire_gbps = p.link.gbps * chunk / (chunk + own + reverse);
    let headroom = justitia_core::adaptive::DEFAULT_HEADROOM;
    let bound = 2.0 * headroom * wire_gbps.min(p.policy.max_rate_gbps) / o.bandwidth_alone;
    eprintln!("read-beside-send: chunk {chunk:.0} B a path, bound {bound:.3}; {o:?}");
    assert!(bound < BANDWIDTH, "bound {bound:.3}");
    assert!(
        o.floor_ratio >= FLOOR_SLACK,
        "a tenant under its tenant-fair share: {o:?}"
    );
    let latency_x = o.latency_x.expect("a latency flow");
    assert!(latency_x <= BAND, "the latency flow at x{latency_x:.3}");
    assert!(
        o.bandwidth <= bound + 0.01,
        "{:.3} beats the bound {bound:.3}",
        o.bandwidth
    );
    assert!(
        !o.meets_goal(),
        "now meets the goal: move it to the goal test"
    );
    assert!(
        (o.bandwidth - 0.901).abs() <= PIN && (latency_x / 1.200 - 1.0).abs() <= PIN,
        "pinned figures moved: now {o:?}"
    );
}

/// `64b-vs-64kb` on RoCE-100: tenant A's 64 B WRITEs, bound by each packet's 98 B of
/// headers (162 wire bytes a message fill the link at 39.5 Gb/s of payload), beside tenant
/// B's 64 KB WRITEs, bound by MaxRate. Each chunk is charged what it costs the RNIC, so the
/// tenants share, and the stream is paced, by the part of the RNIC each uses: charged by
/// payload alone, A's messages were paced as if they cost 64 B and overfilled the wire
/// (the latency flow at x2.21). Every tenant keeps its tenant-fair share (in what it uses
/// of the RNIC) and the latency flow stays within the band. The bandwidth goal, counted in
/// payload against B's alone figure, is missed by a bound from first principles: the
/// stream's charge is at most the headroom times MaxRate, split in two halves; B's half is
/// payload, A's carries 64 B of payload per 162 wire bytes, each of which costs 97/100 of
/// a byte of MaxRate. From the profile and the alone runs; pinned within 3%.
#[test]
fn small_messages_share_by_what_they_use_and_miss_by_their_headers() {
    let e = experiment("suite-64b-vs-64kb-roce100");
    let report = run_adaptive(e.clone());
    let o = outcome(&e, &report, "adaptive");
    let p = &e.profile;
    let message = 64.0;
    let wire = f64::from(p.wire_bytes(64, true));
    assert_eq!(wire, 162.0);
    let charge = wire * p.policy.max_rate_gbps / p.link.gbps;
    let headroom = justitia_core::adaptive::DEFAULT_HEADROOM;
    let payload_gbps = headroom * p.policy.max_rate_gbps * (0.5 + 0.5 * message / charge);
    let bound = payload_gbps / o.bandwidth_alone;
    eprintln!("64b-vs-64kb: bound {bound:.3}; {o:?}");
    assert!(bound < BANDWIDTH, "bound {bound:.3}");
    assert!(
        o.floor_ratio >= FLOOR_SLACK,
        "a tenant under its tenant-fair share: {o:?}"
    );
    let latency_x = o.latency_x.expect("a latency flow");
    assert!(latency_x <= BAND, "the latency flow at x{latency_x:.3}");
    assert!(
        o.bandwidth <= bound + 0.01,
        "{:.3} beats the bound {bound:.3}",
        o.bandwidth
    );
    assert!(
        !o.meets_goal(),
        "now meets the goal: move it to the goal test"
    );
    assert!(
        (o.bandwidth - 0.744).abs() <= PIN && (latency_x / 1.16 - 1.0).abs() <= PIN,
        "pinned figures moved: now {o:?}"
    );
}
