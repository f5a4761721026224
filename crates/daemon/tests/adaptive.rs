//! `policy = "adaptive"`: the daemon publishes the adaptive law's plan as allotments. Every
//! expected figure is worked out here from the law's documented formula
//! (`justitia_core::adaptive`, steps 2-4 and 6) and the RoCE-100 profile, not by calling
//! the law.
//!
//! RoCE-100: MaxRate 97 Gb/s = 12.125e9 B/s, MaxTput 105 M ops/s, 4 KB MTU, 1 MB chunks
//! without latency flows. Target99 48 us absolute with the law's band 1.2 leaves a slack of
//! 48 / 1.2 x 0.2 = 8 us, 97 000 B at MaxRate, rounded down to 23 whole packets: 94 208 B.
//! The synthetic probe completes 20 us after it is sent, within the target, so the chunk
//! stays at that budget and the fraction at 1. With no bytes reported by the other flows
//! the stream is paced at the headroom 0.975 x MaxRate = 11.821875e9 B/s, above the
//! bandwidth tenants' floor B/(L+B+T) x MaxRate.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use justitia_agent::admin::{AdminReply, AdminRequest, TailSource};
use justitia_agent::client::{AgentClient, Allotment, FlowHandle};
use justitia_agent::proto::LATENCY_LONGEST;
use justitia_core::flow::FlowClass;

use common::{eventually, metric, Daemon};

const MAX_RATE: u64 = 12_125_000_000;
const PACE: u64 = 11_821_875_000;
const CHUNK: u64 = 23 * 4096;

/// Within one byte (or operation) per second: the law works in floating point and the
/// slot holds whole units.
fn near(got: u64, want: u64) -> bool {
    got.abs_diff(want) <= 1
}

fn near_f(got: Option<f64>, want: u64) -> bool {
    got.is_some_and(|g| (g - want as f64).abs() <= 1.0)
}

const CONFIG: &str = "policy = \"adaptive\"\nprofile = \"roce-100\"\ntarget = \"48us\"\n";

fn registered(c: &mut AgentClient, class: FlowClass, qps: u32) -> FlowHandle {
    let h = c.register(class, qps, 0);
    c.wait_registered(h, Duration::from_secs(2));
    // Active, with no bytes: the others' load stays zero.
    assert!(c.report_usage(h, true, 0, 1));
    h
}

fn wait_for(c: &mut AgentClient, h: FlowHandle, what: &str, want: impl Fn(&Allotment) -> bool) {
    eventually(what, Duration::from_secs(5), || {
        c.tick(justitia_agent::block::monotonic_ns());
        c.allotment(h).is_some_and(|a| want(&a))
    });
}

#[test]
fn a_latency_and_a_bandwidth_flow_get_the_laws_allotments() {
    let d = Daemon::start_with(CONFIG, true);
    let mut c = AgentClient::connect(d.socket()).unwrap();
    // A bandwidth flow alone: nothing to protect, not paced: all of MaxRate (which no
    // flow exceeds) in 1 MB chunks.
    let b = registered(&mut c, FlowClass::Bandwidth, 1);
    wait_for(&mut c, b, "the unpaced allotment", |a| {
        near(a.bytes_per_sec, MAX_RATE) && a.chunk_bytes == 1 << 20
    });
    // A latency flow arrives: the bandwidth flow is paced at the headroom of MaxRate in
    // chunks of the target's slack; the latency flow is never shaped.
    let l = registered(&mut c, FlowClass::Latency, 1);
    wait_for(&mut c, b, "the paced allotment", |a| {
        near(a.bytes_per_sec, PACE) && a.chunk_bytes == CHUNK
    });
    assert_eq!(c.allotment(l), None, "latency flows are never shaped");
    let a = c.allotment(b).unwrap();
    assert_eq!(a.ops_per_sec, 0, "bandwidth flows are paced by bytes only");
    // Each request is charged what it costs in the chunk's bytes (the profile's `[link]`:
    // 100 Gb/s of wire, 82 B a packet, a 16 B RETH). A chunk of 23 packets is 94 208 +
    // 23 x 82 + 16 = 96 110 wire bytes, 93 226.7 B of MaxRate at 97/100: its payload is
    // more, so a chunk byte costs a byte. So a request is charged at least one operation
    // at MaxTput, 12.125e9 / 105e6 = 115.5 -> 115 B, and 0.97 of its wire bytes: a 64 B
    // WRITE (162 wire bytes) 157 B, a chunk its 94 208.
    assert_eq!(a.charge.least_bytes, 115);
    assert_eq!(a.charge.mtu_shift, 12);
    assert_eq!(a.charge.charged(64), 157);
    assert_eq!(a.charge.charged(CHUNK), CHUNK);
    let flows = d.flows();
    let report = flows.iter().find(|f| f.class == "bandwidth").unwrap();
    assert!(near_f(report.allot_bytes_per_sec, PACE), "{report:?}");
    // Status and metrics carry the law's state.
    let AdminReply::Status(s) = d.admin(&AdminRequest::Status) else {
        panic!("no status")
    };
    let adaptive = s.adaptive.expect("adaptive's state in the status");
    assert_eq!(adaptive.chunk_bytes as u64, CHUNK);
    assert!(near_f(adaptive.pace_bytes_per_sec, PACE), "{adaptive:?}");
    assert_eq!(adaptive.fraction, 1.0);
    let scrape = d.scrape();
    assert_eq!(
        metric(&scrape, "justitia_policy", Some(("policy", "adaptive"))),
        Some(1.0)
    );
    assert_eq!(
        metric(&scrape, "justitia_adaptive_chunk_bytes", None),
        Some(CHUNK as f64)
    );
    assert!(near_f(
        metric(&scrape, "justitia_adaptive_pace_bytes_per_second", None),
        PACE
    ));
    // A second bandwidth flow of the same tenant (this uid) splits the tenant's pace: the
    // tenant does not get more by opening more flows.
    let b2 = registered(&mut c, FlowClass::Bandwidth, 1);
    for h in [b, b2] {
        wait_for(&mut c, h, "half the pace each", |a| {
            near(a.bytes_per_sec, PACE / 2) && a.chunk_bytes == CHUNK
        });
    }
    // A throughput flow on 2 queue pairs: with latency and bandwidth flows present it is
    // paced by operations at 1/(L+B+T) = 1/3 of what its queue pairs post alone, at most
    // 2 x 13 M messages/s (the profile's `[rnic] qp_mops`, under MaxTput's 105 M):
    // 8 666 667 ops/s; the bandwidth pace is unchanged (its floor, 1/3 of MaxRate, is
    // below it).
    let t = registered(&mut c, FlowClass::Throughput, 2);
    wait_for(&mut c, t, "the throughput flow's pace", |a| {
        near(a.ops_per_sec, 8_666_667) && near(a.bytes_per_sec, MAX_RATE)
    });
    assert_eq!(
        c.allotment(t).unwrap().charge,
        justitia_core::message_charge::MessageCharge::NONE,
        "its operations pace binds: a request is charged its payload"
    );
    assert!(near(c.allotment(b).unwrap().bytes_per_sec, PACE / 2));
    // The latency flow leaves: the throughput flow is the protected class now (step 2),
    // not paced by operations; the bandwidth flows are paced at the headroom in chunks of
    // one MTU packet (step 3's budget without a target).
    c.unregister(l);
    for h in [b, b2] {
        wait_for(&mut c, h, "one-packet chunks", |a| {
            near(a.bytes_per_sec, PACE / 2) && a.chunk_bytes == 4096
        });
    }
    wait_for(&mut c, t, "no operations pace", |a| a.ops_per_sec == 0);
    // And the throughput flow leaves: nothing to protect, unpaced again, at once, the
    // tenant's MaxRate split between its two flows.
    c.unregister(t);
    for h in [b, b2] {
        wait_for(&mut c, h, "the unpaced allotment again", |a| {
            near(a.bytes_per_sec, MAX_RATE / 2) && a.chunk_bytes == 1 << 20
        });
    }
}

/// The law's tail is the latency applications' own round trips, as their shapers report
/// them: a report of 100 round trips whose two longest are 9 and 8 ms has a p99 of 8 ms
/// (the second longest: rank 100 - 99 + 1), far over the 48 us target, where the
/// synthetic probe's 20 us never is; so the law steps down on the report alone. A
/// report for a flow that is not a latency flow is refused and read by nobody.
#[test]
fn the_law_reads_the_latency_flows_reported_round_trips() {
    // Updates 50 ms apart: the reports, a few milliseconds apart, reach every update, so
    // each one reads the applications' tail and the status shows it until the next.
    let d = Daemon::start_with(
        &format!("{CONFIG}ref_period_us = 50000\nprobe_timeout_ms = 100\n"),
        true,
    );
    let mut c = AgentClient::connect(d.socket()).unwrap();
    let b = registered(&mut c, FlowClass::Bandwidth, 1);
    let l = registered(&mut c, FlowClass::Latency, 1);
    wait_for(&mut c, b, "the paced allotment", |a| {
        near(a.bytes_per_sec, PACE) && a.chunk_bytes == CHUNK
    });
    let status = || {
        let AdminReply::Status(s) = d.admin(&AdminRequest::Status) else {
            panic!("no status")
        };
        *s.adaptive.expect("adaptive's state in the status")
    };
    eventually("the probe's tail read", Duration::from_secs(5), || {
        status().tail_source == TailSource::Probe
    });
    let before = status();
    assert_eq!(before.decreases, 0, "the probe is within the target");
    let mut longest = [10_000u32; LATENCY_LONGEST];
    longest[..2].copy_from_slice(&[9_000_000, 8_000_000]);
    // Refused for the bandwidth flow: nothing is read.
    assert!(c.report_latency(b, 100, longest));
    eventually("the report refused", Duration::from_secs(5), || {
        metric(
            &d.scrape(),
            "justitia_messages_refused_total",
            Some(("value", "not_latency")),
        ) == Some(1.0)
    });
    assert_eq!(status().round_trips, 0);
    // Each report is read at the next update, which the status shows until the one
    // after: reported until one is seen.
    let mut sent = 0u64;
    eventually(
        "the applications' tail read",
        Duration::from_secs(5),
        || {
            c.tick(justitia_agent::block::monotonic_ns());
            if c.report_latency(l, 100, longest) {
                sent += 100;
            }
            std::thread::sleep(Duration::from_millis(1));
            let s = status();
            s.tail_source == TailSource::Applications && s.tail_ns == Some(8_000_000)
        },
    );
    let after = status();
    assert!(after.decreases >= 1, "{after:?}");
    assert!(after.applications_tail_updates >= 1, "{after:?}");
    assert!(
        after.round_trips >= 100 && after.round_trips <= sent,
        "{after:?} of {sent}"
    );
    let scrape = d.scrape();
    assert!(metric(&scrape, "justitia_round_trips_reported_total", None) >= Some(100.0));
    assert!(metric(&scrape, "justitia_adaptive_decreases_total", None) >= Some(1.0));
    assert!(
        metric(
            &scrape,
            "justitia_adaptive_applications_tail_updates_total",
            None
        ) >= Some(1.0)
    );
}

/// Under `adaptive` a QP turn is the law's context turn unless the operator sets
/// `qp_turn_bytes`: long enough that the context read opening the next turn disturbs the
/// tail at most 1% of the time. On RoCE-100 the read is a 600 ns PCIe round trip
/// (`[pcie] read_latency_ns`), which stalls the stream for 600 ns / (1 - 0.975) = 24 us;
/// at MaxRate (97 Gb/s, 12.125e9 B/s) that is 291 000 B, over 1% is 29.1e6 B, rounded up
/// to whole 1 MiB chunks: 28 MiB. How many QPs hold a turn is the operator's `qp_turns`
/// (without it there are no turns); a tenant alone with one process holds all of them.
/// Under `justitia`, the 8 MiB default.
#[test]
fn under_adaptive_a_qp_turn_is_the_laws_context_turn() {
    // The process's budget once the daemon counts it alone (the connection that saw the
    // daemon start is gone at its next pass).
    let turns = |config: &str, want: Option<(usize, u64)>| {
        let d = Daemon::start_with(config, false);
        let mut c = AgentClient::connect(d.socket()).unwrap();
        registered(&mut c, FlowClass::Bandwidth, 1);
        let mut got = None;
        eventually(&format!("turns {want:?}"), Duration::from_secs(5), || {
            c.tick(justitia_agent::block::monotonic_ns());
            got = c.turn_budget().map(|b| (b.open, b.turn_bytes));
            got == want
        });
        got
    };
    let adaptive = "policy = \"adaptive\"\nprofile = \"roce-100\"\ntarget = \"48us\"\n";
    turns(
        &format!("{adaptive}qp_turns = 256\n"),
        Some((256, 28 << 20)),
    );
    turns(
        &format!("{adaptive}qp_turns = 256\nqp_turn_bytes = 65536\n"),
        Some((256, 65_536)),
    );
    turns(adaptive, None);
    turns(
        "profile = \"roce-100\"\nqp_turns = 64\n",
        Some((64, 8 << 20)),
    );
}

/// Under `justitia` (the default) the status has no adaptive state and the metric names
/// the policy.
#[test]
fn justitia_stays_the_default_policy() {
    let d = Daemon::start_with("", true);
    let AdminReply::Status(s) = d.admin(&AdminRequest::Status) else {
        panic!("no status")
    };
    assert_eq!(s.adaptive, None);
    assert_eq!(
        metric(&d.scrape(), "justitia_policy", Some(("policy", "justitia"))),
        Some(1.0)
    );
}

#[test]
fn an_unknown_policy_stops_the_daemon_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "policy = \"perf\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_justitiad"))
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "{}: key `policy`: `perf` is neither `justitia` nor `adaptive`",
            path.display()
        )),
        "{err}"
    );
}

/// Costs by send path (the law's step 8): a WRITE flow's bytes leave by this host's RNIC,
/// a READ requester's by its responder's, so each is planned in its own path's stream.
/// With a latency flow on this host, a WRITE flow and a READ flow (one tenant, this uid)
/// reading from a peer (127.0.0.2, named by the peer channel): on this host's send path
/// L = 1, B = 1 (the WRITE tenant), T = 0, and the latency messages cross only it (their
/// peer is not named), so the chunk is the target's whole 94 208 B and the pace the
/// headroom of MaxRate, the WRITE flow's alone; on the responder's, L = 1, B = 1 (the READ
/// tenant), the same plan, the READ flow's alone. Planned as one stream, the tenant's two
/// bandwidth flows had half of one pace each, and the chunk was never split.
#[test]
fn a_write_and_a_read_flow_are_each_planned_on_their_own_send_path() {
    let cluster = common::PeerCluster::new(2);
    let config = format!("{CONFIG}{}", cluster.config(1));
    let d = Daemon::start_with(&config, true);
    let mut c = AgentClient::connect(d.socket()).unwrap();
    let l = registered(&mut c, FlowClass::Latency, 1);
    let write = registered(&mut c, FlowClass::Bandwidth, 1);
    let read = registered(&mut c, FlowClass::Bandwidth, 1);
    let responder = std::net::Ipv4Addr::new(127, 0, 0, 2)
        .to_ipv6_mapped()
        .octets();
    assert!(c.report_remote(read, responder, 0, 0x42, true));
    eventually(
        "the READ flow's remote end known",
        Duration::from_secs(5),
        || {
            d.flows()
                .iter()
                .any(|f| f.remote.as_deref() == Some("reads from 127.0.0.2"))
        },
    );
    for (h, what) in [(write, "the WRITE flow's"), (read, "the READ flow's")] {
        wait_for(&mut c, h, &format!("{what} own path's pace"), |a| {
            near(a.bytes_per_sec, PACE) && a.chunk_bytes == CHUNK
        });
    }
    // The latency flow's queue pair goes to the responder too: its messages' round trip
    // crosses both paced paths, their requests this host's and their acknowledgements the
    // responder's, and waits behind a chunk on each, so each path's chunk is half the
    // target's: 94 208 / 2 = 47 104 B. The paces are unchanged.
    assert!(c.report_remote(l, responder, 0, 0x43, false));
    for (h, what) in [(write, "the WRITE flow's"), (read, "the READ flow's")] {
        wait_for(&mut c, h, &format!("{what} half chunk"), |a| {
            near(a.bytes_per_sec, PACE) && a.chunk_bytes == CHUNK / 2
        });
    }
}

/// Incast (§6.7) under `adaptive`: this host A (RoCE-100, `adaptive`) and a second sender
/// C each send one bandwidth flow into a receiver B (RoCE-100). B counts two incast units
/// of weight 1 from two hosts and grants each half its link: 12.125e9 / 2 = 6.0625e9 B/s.
/// A's flow, alone on A, has the law's unpaced allotment, all of MaxRate in 1 MB chunks;
/// it is published to its shaper, shown in `justitia flows` and counted in the tenant's
/// metric at min(MaxRate, 6.0625e9) = 6.0625e9, its chunk kept. When B dies its share lapses
/// (fail-open, the silence bound: 20 ms by default) and the flow is back at MaxRate.
#[test]
fn a_bandwidth_flow_into_a_peer_is_paced_at_its_incast_share_under_adaptive() {
    const SHARE: u64 = MAX_RATE / 2;
    let cluster = common::PeerCluster::new(3);
    // A's per-tenant series are served on a Unix endpoint only.
    let sock = cluster.dir.path().join("a-metrics.sock");
    let a = Daemon::start(&format!(
        "metrics = \"unix:{}\"\n{CONFIG}{}",
        sock.display(),
        cluster.config(1)
    ));
    let b = Daemon::start_with(
        &format!("profile = \"roce-100\"\n{}", cluster.config(2)),
        true,
    );
    let c = Daemon::start_with(&cluster.config(3), true);
    let receiver = std::net::Ipv4Addr::new(127, 0, 0, 2)
        .to_ipv6_mapped()
        .octets();
    let mut on_a = AgentClient::connect(a.socket()).unwrap();
    let mut on_c = AgentClient::connect(c.socket()).unwrap();
    let flow = registered(&mut on_a, FlowClass::Bandwidth, 1);
    wait_for(&mut on_a, flow, "the unpaced allotment", |x| {
        near(x.bytes_per_sec, MAX_RATE) && x.chunk_bytes == 1 << 20
    });
    let other = registered(&mut on_c, FlowClass::Bandwidth, 1);
    assert!(on_c.report_remote(other, receiver, 0, 0x42, false));
    assert!(on_a.report_remote(flow, receiver, 0, 0x43, false));
    wait_for(&mut on_a, flow, "B's share", |x| {
        near(x.bytes_per_sec, SHARE) && x.chunk_bytes == 1 << 20
    });
    assert_eq!(on_a.allotment(flow).unwrap().ops_per_sec, 0, "bytes only");
    let shown = a.flows().remove(0);
    assert_eq!(shown.remote.as_deref(), Some("sends to 127.0.0.2"));
    assert!(near_f(shown.allot_bytes_per_sec, SHARE), "{shown:?}");
    let uid = rustix::process::getuid().as_raw().to_string();
    // The metrics thread binds its endpoint on its own time: scraped once it listens.
    eventually(
        "the tenant's allotment metric",
        Duration::from_secs(5),
        || {
            std::os::unix::net::UnixStream::connect(&sock).is_ok()
                && near_f(
                    metric(
                        &a.scrape_unix(&sock),
                        "justitia_tenant_allotment_bytes_per_second",
                        Some(("uid", &uid)),
                    ),
                    SHARE,
                )
        },
    );

    drop(b);
    wait_for(&mut on_a, flow, "fail-open", |x| {
        near(x.bytes_per_sec, MAX_RATE)
    });
    assert!(near_f(a.flows()[0].allot_bytes_per_sec, MAX_RATE));
}
