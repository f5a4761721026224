//! Benchmark: what one scan for unshaped processes costs the daemon's user space, with
//! 100, 1,000 and 10,000 queue pairs in the kernel's table, and the CPU share that gives
//! at candidate intervals.
//!
//! Run with `cargo bench -p justitia-daemon --bench unshaped_scan`. It first prints a
//! table from one run (the median of timed rounds of each stage), then criterion times
//! the stages. It asserts nothing about time (a benchmark, not a test), only that the
//! stages find what the synthetic table holds.
//!
//! The stages, as `justitiad`'s scanning thread runs them:
//!
//! - **parse**: the datagrams of one device's QP dump, built here with the attribute
//!   layout the parser reads (per datagram one `RDMA_NLDEV_CMD_RES_QP_GET` message of up
//!   to 32 KiB: the device's index and name, then the QP table; per queue pair its number,
//!   type, state and pid, and five 4-byte attributes the parser skips, as a kernel sends
//!   more than it reads), then `NLMSG_DONE`; handed to
//!   [`QpGather::take_datagram`], the code `dump_queue_pairs` runs on each datagram read.
//! - **match**: the connected shapers' pids copied as the scan takes them, the candidates
//!   ([`unshaped_candidates`]), the decision ([`classify`]) and the per-tenant series
//!   ([`tenant_series`]). The table: 10 RC queue pairs per process, every process with a
//!   shaper connected except two (as a host with a couple of escapees).
//! - **lookup**: one unshaped process looked up in `/proc` ([`look_up`] of this process:
//!   its `status` and `comm`), which a scan does for each candidate (here two).
//!
//! Not measured: the kernel's side of the dump (walking its resource table and, on some
//! RNICs, a firmware query per queue pair) and the socket's system calls. The build
//! machines have no RDMA hardware and their kernel no RDMA subsystem (Soft-RoCE exists only
//! in the QEMU guests, whose emulated timings measure nothing), so the figures are the
//! daemon's own work per scan; the scanning thread bounds the whole, kernel included, by
//! waiting at least [`IDLE_PER_SCAN`] times each scan's duration before the next.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use justitia_daemon::config::TenantBy;
use justitia_daemon::rdma_netlink::{DeviceQps, QpDump, QpGather, RdmaDevice};
use justitia_daemon::unshaped::{
    classify, look_up, tenant_series, unshaped_candidates, Lookup, ScanTimes, IDLE_PER_SCAN,
};

const SIZES: [usize; 3] = [100, 1_000, 10_000];
const ROUNDS: usize = 201;
/// Candidate intervals, in ms.
const INTERVALS_MS: [u64; 5] = [10, 50, 100, 250, 1000];
const QPS_PER_PROCESS: usize = 10;
const UNSHAPED: usize = 2;
const SEQ: u32 = 7;
const DEVICE_INDEX: u32 = 3;
/// The kernel's netlink dumps fill datagrams of up to 32 KiB.
const DATAGRAM: usize = 32 * 1024;
const FIRST_PID: usize = 100_000;

// The nldev numbers (the kernel's ABI, `include/uapi/rdma/rdma_netlink.h`).
const RDMA_NL_NLDEV: u16 = 5;
const RDMA_NLDEV_CMD_RES_QP_GET: u16 = 10;
const ATTR_DEV_INDEX: u16 = 1;
const ATTR_DEV_NAME: u16 = 2;
const ATTR_PORT_INDEX: u16 = 3;
const ATTR_RES_QP: u16 = 19;
const ATTR_RES_QP_ENTRY: u16 = 20;
const ATTR_RES_LQPN: u16 = 21;
const ATTR_RES_RQPN: u16 = 22;
const ATTR_RES_RQ_PSN: u16 = 23;
const ATTR_RES_SQ_PSN: u16 = 24;
const ATTR_RES_TYPE: u16 = 26;
const ATTR_RES_STATE: u16 = 27;
const ATTR_RES_PID: u16 = 28;
/// An attribute this reader does not know (as a newer kernel's).
const ATTR_UNKNOWN: u16 = 200;
const NLM_F_MULTI: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;

fn attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = u16::try_from(4 + value.len()).unwrap();
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len().next_multiple_of(4), 0);
}

fn header(out: &mut Vec<u8>, len: usize, kind: u16, flags: u16) {
    out.extend_from_slice(&u32::try_from(len).unwrap().to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&SEQ.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
}

/// The pid of queue pair `i`: processes of [`QPS_PER_PROCESS`] each.
fn pid_of(i: usize) -> u32 {
    u32::try_from(FIRST_PID + i / QPS_PER_PROCESS).unwrap()
}

fn entry(i: usize) -> Vec<u8> {
    let qpn = u32::try_from(i + 17).unwrap();
    let mut e = Vec::with_capacity(96);
    attr(&mut e, ATTR_PORT_INDEX, &1u32.to_ne_bytes());
    attr(&mut e, ATTR_RES_LQPN, &qpn.to_ne_bytes());
    attr(&mut e, ATTR_RES_RQPN, &(qpn ^ 1).to_ne_bytes());
    attr(&mut e, ATTR_RES_RQ_PSN, &0x1234u32.to_ne_bytes());
    attr(&mut e, ATTR_RES_SQ_PSN, &0x5678u32.to_ne_bytes());
    attr(&mut e, ATTR_RES_TYPE, &[2]); // RC
    attr(&mut e, ATTR_RES_STATE, &[3]); // RTS
    attr(&mut e, ATTR_RES_PID, &pid_of(i).to_ne_bytes());
    attr(&mut e, ATTR_UNKNOWN, &1u32.to_ne_bytes());
    let mut out = Vec::with_capacity(e.len() + 4);
    attr(&mut out, ATTR_RES_QP_ENTRY, &e);
    out
}

/// One message of `entries` (already encoded).
fn qp_message(entries: &[u8]) -> Vec<u8> {
    let mut payload = Vec::new();
    attr(&mut payload, ATTR_DEV_INDEX, &DEVICE_INDEX.to_ne_bytes());
    attr(&mut payload, ATTR_DEV_NAME, b"mlx5_0\0");
    attr(&mut payload, ATTR_RES_QP, entries);
    let mut out = Vec::with_capacity(NLMSG_HDRLEN + payload.len());
    header(
        &mut out,
        NLMSG_HDRLEN + payload.len(),
        (RDMA_NL_NLDEV << 10) + RDMA_NLDEV_CMD_RES_QP_GET,
        NLM_F_MULTI,
    );
    out.extend_from_slice(&payload);
    out
}

/// The datagrams of a dump of `n` queue pairs, the last one `NLMSG_DONE`.
fn datagrams(n: usize) -> Vec<Vec<u8>> {
    // Room for the entries in a datagram: its header, the index, the name, the table's
    // own header.
    let room = DATAGRAM - NLMSG_HDRLEN - 8 - 12 - 4;
    let mut out = Vec::new();
    let mut entries = Vec::new();
    for i in 0..n {
        let e = entry(i);
        if entries.len() + e.len() > room {
            out.push(qp_message(&entries));
            entries.clear();
        }
        entries.extend_from_slice(&e);
    }
    if !entries.is_empty() {
        out.push(qp_message(&entries));
    }
    let mut done = Vec::new();
    header(&mut done, NLMSG_HDRLEN + 4, NLMSG_DONE, NLM_F_MULTI);
    done.extend_from_slice(&0i32.to_ne_bytes());
    out.push(done);
    out
}

fn parse(datagrams: &[Vec<u8>]) -> QpGather {
    let mut gather = QpGather::new(DEVICE_INDEX, 65_536);
    for d in datagrams {
        if gather.take_datagram(d, SEQ).unwrap() {
            break;
        }
    }
    gather
}

/// The connected shapers' pids, as the loop hands them: every process's but the last
/// [`UNSHAPED`].
fn shapers(n: usize) -> Arc<[i32]> {
    let processes = n.div_ceil(QPS_PER_PROCESS);
    (0..processes.saturating_sub(UNSHAPED))
        .map(|p| i32::try_from(FIRST_PID + p).unwrap())
        .collect()
}

/// Facts of the candidates, as looked up before (the lookup is timed apart).
fn facts(candidates: &BTreeSet<i32>) -> BTreeMap<i32, Lookup> {
    let me = i32::try_from(std::process::id()).unwrap();
    let Lookup::Found(mine) = look_up(me, TenantBy::Uid) else {
        panic!("this process is gone")
    };
    candidates
        .iter()
        .map(|&p| {
            let mut f = mine.clone();
            f.tgid = p;
            (p, Lookup::Found(f))
        })
        .collect()
}

/// The scan's work after the dump, but the lookups: what it decides, and the number of
/// processes listed.
fn match_stage(
    dump: &QpDump,
    shapers: &Arc<[i32]>,
    facts: &BTreeMap<i32, Lookup>,
    seen: &BTreeMap<i32, Duration>,
) -> usize {
    let known: BTreeSet<i32> = shapers.iter().copied().collect();
    let candidates = unshaped_candidates(dump, &known, 1);
    assert_eq!(candidates.len(), facts.len());
    let at = ScanTimes {
        known_at: Duration::from_secs(10),
        dumped_at: Duration::from_secs(10),
    };
    let decided = classify(dump, &known, 1, facts, seen, at);
    black_box(tenant_series(&decided.table));
    decided.table.processes.len()
}

fn dump_of(gather: QpGather) -> QpDump {
    QpDump {
        devices: vec![DeviceQps {
            device: RdmaDevice {
                index: DEVICE_INDEX,
                name: "mlx5_0".into(),
            },
            qps: gather.qps,
        }],
        capped: false,
    }
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn lookup_time() -> Duration {
    let me = i32::try_from(std::process::id()).unwrap();
    median(
        (0..ROUNDS)
            .map(|_| {
                let t = Instant::now();
                black_box(look_up(black_box(me), TenantBy::Uid));
                t.elapsed()
            })
            .collect(),
    )
}

/// The table: each stage's median, the scan's total and its CPU share at each interval.
fn table() {
    let lookup = lookup_time();
    println!(
        "unshaped scan, the daemon's user-space work per scan (median of {ROUNDS}); \
         {QPS_PER_PROCESS} RC QPs per process, all but {UNSHAPED} processes shaped"
    );
    println!(
        "lookup of one unshaped process in /proc: {:.1} us (x{UNSHAPED} per scan below)",
        lookup.as_secs_f64() * 1e6
    );
    print!(
        "{:>6} {:>10} {:>11} {:>11} {:>11}",
        "QPs", "datagrams", "parse (us)", "match (us)", "scan (us)"
    );
    for ms in INTERVALS_MS {
        print!(" {:>9}", format!("@{ms}ms"));
    }
    println!();
    for n in SIZES {
        let grams = datagrams(n);
        let dump = dump_of(parse(&grams));
        assert_eq!(dump.devices[0].qps.len(), n);
        let shapers = shapers(n);
        let known: BTreeSet<i32> = shapers.iter().copied().collect();
        let facts = facts(&unshaped_candidates(&dump, &known, 1));
        let seen: BTreeMap<i32, Duration> = facts.keys().map(|&p| (p, Duration::ZERO)).collect();
        assert_eq!(match_stage(&dump, &shapers, &facts, &seen), UNSHAPED);
        let (mut p, mut m) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let t = Instant::now();
            black_box(parse(black_box(&grams)));
            p.push(t.elapsed());
            let t = Instant::now();
            black_box(match_stage(black_box(&dump), &shapers, &facts, &seen));
            m.push(t.elapsed());
        }
        let (p, m) = (median(p), median(m));
        let scan = p + m + lookup * UNSHAPED as u32;
        print!(
            "{n:>6} {:>10} {:>11.1} {:>11.1} {:>11.1}",
            grams.len(),
            p.as_secs_f64() * 1e6,
            m.as_secs_f64() * 1e6,
            scan.as_secs_f64() * 1e6
        );
        for ms in INTERVALS_MS {
            let share = scan.as_secs_f64() / (ms as f64 / 1e3) * 100.0;
            print!(" {:>8.3}%", share);
        }
        println!();
    }
    println!(
        "not measured: the kernel's side of the dump and the socket's system calls \
         (no RDMA subsystem on this machine); each scan is followed by a wait of at \
         least {IDLE_PER_SCAN} times its duration"
    );
}

fn bench(c: &mut Criterion) {
    table();
    let mut group = c.benchmark_group("unshaped_scan");
    for n in SIZES {
        let grams = datagrams(n);
        group.bench_with_input(BenchmarkId::new("parse", n), &grams, |b, g| {
            b.iter(|| parse(g))
        });
        let dump = dump_of(parse(&grams));
        let shapers = shapers(n);
        let known: BTreeSet<i32> = shapers.iter().copied().collect();
        let facts = facts(&unshaped_candidates(&dump, &known, 1));
        let seen: BTreeMap<i32, Duration> = facts.keys().map(|&p| (p, Duration::ZERO)).collect();
        group.bench_with_input(BenchmarkId::new("match", n), &dump, |b, d| {
            b.iter(|| match_stage(d, &shapers, &facts, &seen))
        });
    }
    let me = i32::try_from(std::process::id()).unwrap();
    group.bench_function("lookup", |b| {
        b.iter(|| look_up(black_box(me), TenantBy::Uid))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
