//! Benchmark: what the incast caps cost a publication of the allotments, with 10, 100
//! and 1000 flows, counted once per publication (the daemon's [`IncastCaps`]) against
//! counted again for every flow (the daemon's way until the caps were made once; kept
//! here only, as the reference).
//!
//! Run with `cargo bench -p justitia-daemon --bench incast_publish`. It first prints a
//! table, both ways side by side and their ratio, from one run (the median of 101 timed
//! publications each, interleaved), then criterion times both ways. It asserts nothing
//! about time (a benchmark, not a test), only that both ways give every flow the same cap.
//!
//! One publication, as `justitiad`'s under `policy = "justitia"`: for every flow its cap
//! (`None` for one not into a peer), its allotment paced to it
//! ([`justitia_core::incast::paced`]), and its slot written in a tenant page. The flows:
//! bandwidth flows of 10 tenants (weights 1 to 3), all active, three in four into one of
//! four receivers that each granted a share, the fourth going nowhere.
//!
//! - **before**: for each flow, the clock read and every flow scanned for the active
//!   bandwidth flows of its tenant into its receiver: O(n²);
//! - **after**: the clock read once and the flows counted once by (tenant, receiver),
//!   then one look-up per flow: O(n log n).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use justitia_agent::block::{monotonic_ns, BlockWriter, SlotAllotment, SlotState};
use justitia_core::allotment::Token;
use justitia_core::control_loop::Allotment;
use justitia_core::flow::{FlowClass, TenantId, Weight};
use justitia_core::incast::{paced, IncastLimits};
use justitia_core::pacer::ReleasePhase;
use justitia_daemon::peer::{responder_key, IncastCaps, IncastFlow};
use justitia_peer::wire::Role;
use justitia_peer::NodeId;

const SIZES: [usize; 3] = [10, 100, 1000];
const TENANTS: u64 = 10;
const RECEIVERS: u8 = 4;
const ROUNDS: usize = 101;

/// A host's flows: (flow, its tenant's weight).
fn flows(n: usize) -> Vec<(IncastFlow, Weight)> {
    (0..n)
        .map(|i| {
            let tenant = i as u64 % TENANTS;
            let receiver = (i / TENANTS as usize) % (usize::from(RECEIVERS) + 1);
            let remote = (receiver < usize::from(RECEIVERS)).then(|| {
                let peer = std::net::Ipv4Addr::new(10, 0, 0, receiver as u8 + 2);
                (NodeId(peer.to_ipv6_mapped().octets()), Role::Incast)
            });
            let flow = IncastFlow {
                tenant: TenantId(tenant),
                class: FlowClass::Bandwidth,
                remote,
                active: true,
            };
            (flow, Weight::new(1 + tenant as u32 % 3).unwrap())
        })
        .collect()
}

/// Shares from every receiver, heard just now (they lapse in an hour).
fn limits() -> IncastLimits {
    let mut limits = IncastLimits::new(Duration::from_secs(3600));
    let now = Duration::from_nanos(monotonic_ns());
    for r in 0..RECEIVERS {
        let peer = std::net::Ipv4Addr::new(10, 0, 0, r + 2);
        let key = responder_key(NodeId(peer.to_ipv6_mapped().octets()));
        limits
            .grant_received(now, key, 1e9 * f64::from(r + 1))
            .unwrap();
    }
    limits
}

/// The loop's allotment every flow has before its cap.
fn allotment() -> Allotment {
    Allotment {
        bytes_per_sec: 12.125e9,
        ops_per_sec: 1e6,
        chunk_bytes: 1 << 20,
        token: Token {
            bytes: 1 << 20,
            ops: 16,
        },
        phase: ReleasePhase {
            offset: 0.0,
            epoch: 1,
        },
        generation: 1,
    }
}

/// The slot a flow's allotment paced to `cap` fills.
fn publish_one(page: &BlockWriter, index: usize, cap: Option<f64>) {
    let a = paced(allotment(), cap);
    page.set_slot(
        index as u32,
        SlotAllotment {
            flow: index as u64,
            state: SlotState::Allotted,
            bytes_per_sec: a.bytes_per_sec as u64,
            ops_per_sec: a.ops_per_sec as u64,
            chunk_bytes: u64::from(a.chunk_bytes),
            token_bytes: a.token.bytes,
            generation: a.generation,
            phase_offset: 0,
            phase_epoch: a.phase.epoch,
            charge: justitia_core::message_charge::MessageCharge::NONE,
        },
    );
}

/// The reference: each flow's cap found by scanning every flow, the clock read for each.
fn cap_by_scan(limits: &IncastLimits, flows: &[(IncastFlow, Weight)], i: usize) -> Option<f64> {
    let (f, weight) = flows[i];
    let (peer, Role::Incast) = f.remote? else {
        return None;
    };
    if f.class != FlowClass::Bandwidth {
        return None;
    }
    let count = flows
        .iter()
        .filter(|(g, _)| {
            g.active && g.tenant == f.tenant && g.class == f.class && g.remote == f.remote
        })
        .count();
    limits.cap(
        Duration::from_nanos(monotonic_ns()),
        responder_key(peer),
        weight,
        u32::try_from(count).unwrap_or(u32::MAX),
    )
}

fn publish_before(page: &BlockWriter, limits: &IncastLimits, flows: &[(IncastFlow, Weight)]) {
    for i in 0..flows.len() {
        publish_one(page, i, cap_by_scan(limits, flows, i));
    }
}

fn publish_after(page: &BlockWriter, limits: &IncastLimits, flows: &[(IncastFlow, Weight)]) {
    let caps = IncastCaps::new(
        limits,
        Duration::from_nanos(monotonic_ns()),
        flows.iter().map(|&(f, _)| f),
    );
    for (i, (f, weight)) in flows.iter().enumerate() {
        publish_one(page, i, caps.cap(f, *weight));
    }
}

fn median_ns(mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    samples[samples.len() / 2].as_nanos() as f64
}

/// The table: both ways, interleaved, in one run.
fn table(page: &BlockWriter, limits: &IncastLimits) {
    println!("incast caps in one publication (median of {ROUNDS}):");
    println!(
        "{:>6} {:>14} {:>14} {:>8}",
        "flows", "before (us)", "after (us)", "ratio"
    );
    for n in SIZES {
        let flows = flows(n);
        // Both ways give every flow the same cap.
        let caps = IncastCaps::new(
            limits,
            Duration::from_nanos(monotonic_ns()),
            flows.iter().map(|&(f, _)| f),
        );
        for (i, (f, w)) in flows.iter().enumerate() {
            assert_eq!(caps.cap(f, *w), cap_by_scan(limits, &flows, i));
        }
        let (mut before, mut after) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let t = Instant::now();
            publish_before(page, limits, black_box(&flows));
            before.push(t.elapsed());
            let t = Instant::now();
            publish_after(page, limits, black_box(&flows));
            after.push(t.elapsed());
        }
        let (b, a) = (median_ns(before), median_ns(after));
        println!("{n:>6} {:>14.2} {:>14.2} {:>7.1}x", b / 1e3, a / 1e3, b / a);
    }
}

fn bench(c: &mut Criterion) {
    let page = BlockWriter::create_tenant_page(1024, 1).unwrap();
    let limits = limits();
    table(&page, &limits);
    let mut group = c.benchmark_group("incast_publish");
    for n in SIZES {
        let flows = flows(n);
        group.bench_with_input(BenchmarkId::new("before", n), &flows, |b, flows| {
            b.iter(|| publish_before(&page, &limits, flows))
        });
        group.bench_with_input(BenchmarkId::new("after", n), &flows, |b, flows| {
            b.iter(|| publish_after(&page, &limits, flows))
        });
    }
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
