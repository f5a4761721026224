//! The peer channel's traffic and cost.
//!
//! First it prints figures from one second of virtual time at the default RefPeriod
//! (500 us) with a latency flow on the responder (so its loop updates, and announces a
//! guarantee, every RefPeriod): one requester with 100 READ flows of 10 tenants against
//! it, each flow starting or stopping work every 50 ms on average; the datagrams and
//! bytes per second each way. Then criterion times one such virtual second of protocol
//! work (encode, sign, verify, parse, the state machines and the responder's control loop)
//! for 1 peer and for 10 peers (100 flows each), whose ratio to a second is the CPU the
//! daemon spends on the channel, sockets aside (one `sendto`/`recvfrom` per datagram,
//! counted above).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use justitia_core::control_loop::{ControlLoop, Event, FlowRegistration, LoopConfig, Target99};
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;
use justitia_core::remote_read::RemoteReadUnit;
use justitia_peer::channel::{Channel, ChannelConfig, ChannelEvent};
use justitia_peer::wire::{ClusterKey, DemandEntry, Role};
use justitia_peer::NodeId;

const REF_PERIOD: Duration = Duration::from_micros(500);
const FLOWS_PER_PEER: usize = 100;

/// Datagrams and bytes, each way.
#[derive(Default, Debug)]
struct Traffic {
    demands: u64,
    demand_bytes: u64,
    grants: u64,
    grant_bytes: u64,
}

/// One virtual second: `peers` requesters, each with 100 READ flows against one responder.
fn one_second(peers: usize) -> Traffic {
    let key = ClusterKey::from_file_contents(&[9; 32]).unwrap();
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let b_node = NodeId([0xb; 16]);
    let config = LoopConfig {
        target: Target99::Absolute(Duration::from_micros(50)),
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    let lat = FlowSpec {
        id: FlowId(1),
        tenant: TenantId(1),
        class: FlowClass::Latency,
        weight: Weight::ONE,
    };
    lp.register_flow(Duration::ZERO, FlowRegistration { spec: lat, qps: 1 })
        .unwrap();
    lp.set_flow_active(Duration::ZERO, FlowId(1), true).unwrap();
    let mut b = Channel::new(
        ChannelConfig::default(),
        key.clone(),
        b_node,
        1,
        Duration::ZERO,
    )
    .unwrap();
    let mut requesters: Vec<Channel> = (0..peers)
        .map(|i| {
            let mut id = [0xa; 16];
            id[15] = i as u8;
            Channel::new(
                ChannelConfig::default(),
                key.clone(),
                NodeId(id),
                1,
                Duration::ZERO,
            )
            .unwrap()
        })
        .collect();
    // Each flow's activity, flipped by a fixed pseudo-random schedule (xorshift).
    let mut active = vec![vec![true; FLOWS_PER_PEER]; peers];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut traffic = Traffic::default();
    let steps = (Duration::from_secs(1).as_nanos() / REF_PERIOD.as_nanos()) as u64;
    for step in 1..=steps {
        let now = REF_PERIOD * step as u32;
        for (p, a) in requesters.iter_mut().enumerate() {
            // A flow flips every 50 ms on average: 100 flows, 100 RefPeriods.
            for flow in active[p].iter_mut() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                if rng.is_multiple_of(10_000) {
                    *flow = !*flow;
                }
            }
            let mut entries: Vec<DemandEntry> = (0..10)
                .filter_map(|t| {
                    let flows = (0..10).filter(|k| active[p][t * 10 + k]).count() as u16;
                    (flows > 0).then_some(DemandEntry {
                        tenant: TenantId(t as u64),
                        class: FlowClass::Bandwidth,
                        role: Role::Read,
                        flows,
                        weight: 1,
                    })
                })
                .collect();
            entries.sort_unstable();
            a.set_demand(now, b_node, &entries).unwrap();
            while let Some(t) = a.poll_transmit(now) {
                traffic.demands += 1;
                traffic.demand_bytes += t.bytes.len() as u64;
                b.receive(now, &t.bytes).unwrap();
            }
        }
        let mut changed = false;
        while let Some(e) = b.poll_event() {
            changed |= e == ChannelEvent::ServedChanged;
        }
        if changed {
            let units: Vec<RemoteReadUnit> = b
                .served()
                .map(|(_, e)| RemoteReadUnit {
                    class: e.class,
                    weight: Weight::ONE,
                })
                .collect();
            lp.set_remote_reads(now, &units);
        }
        lp.handle_timeout(now);
        while let Some(e) = lp.poll_event() {
            if let Event::ReadGuarantee(g) = e {
                b.set_grant(now, &g, profile.max_rate_bytes_per_sec());
            }
        }
        b.handle_timeout(now);
        while let Some(t) = b.poll_transmit(now) {
            traffic.grants += 1;
            traffic.grant_bytes += t.bytes.len() as u64;
            let i = usize::from(t.to.0[15]);
            requesters[i].receive(now, &t.bytes).unwrap();
        }
    }
    traffic
}

fn bench(c: &mut Criterion) {
    let t = one_second(1);
    println!(
        "one peer, {FLOWS_PER_PEER} READ flows, RefPeriod 500 us: demands {} /s ({} B/s), grants {} /s ({} B/s)",
        t.demands, t.demand_bytes, t.grants, t.grant_bytes
    );
    let t10 = one_second(10);
    println!(
        "ten peers: per peer demands {} /s, grants {} /s; responder total {} datagrams/s in, {} out",
        t10.demands / 10,
        t10.grants / 10,
        t10.demands,
        t10.grants
    );
    let mut g = c.benchmark_group("one virtual second of the channel");
    g.sample_size(10);
    g.bench_function("1 peer x 100 flows", |b| b.iter(|| one_second(1)));
    g.bench_function("10 peers x 100 flows", |b| b.iter(|| one_second(10)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
