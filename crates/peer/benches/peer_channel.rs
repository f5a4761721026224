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
//! counted above). Before both, the cost of the datagrams themselves: a whole handshake
//! (two fresh channels, then the initiation, the response and the initiator's
//! confirmation: both ends' work) and a refresh of a live session (a 10-entry demand one
//! way and a grant the other, each encrypted, decrypted, parsed and taken by the channel).
//!
//! Before (version 1: HMAC-SHA256 with one cluster key, the sender a header field; the same
//! machine, `cargo bench -p justitia-peer` on the parent commit, medians):
//! a 10-entry demand encoded and signed 0.78 us, verified and decoded 0.91 us, a grant
//! signed, verified and decoded 1.61 us (so a refresh, both messages, about 3.3 us, wire
//! only); one virtual second of the channel, 1 peer x 100 flows 4.89 ms, 10 peers x 100
//! flows 54.1 ms (5.4% of a core). No handshake existed.
//!
//! Version 2 (Noise KK sessions, the same machine, one run): a handshake, both ends and two
//! fresh channels, 1.12 ms; a refresh (demand and grant, each through the whole channel)
//! 11.0 us; one virtual second, 1 peer 5.50 ms, 10 peers 64.0 ms (6.4% of a core). The
//! datagrams are smaller than version 1's: 213 demands/s in 42,688 B/s (was 212 in
//! 53,424), 201 grants/s in 15,464 B/s (was 200 in 25,600).
//!
//! Version 3 (handshake messages MACed under the pair key; one run while the machine ran a
//! guest suite beside it, so every figure is inflated alike): a handshake 2.27 ms (each
//! fresh channel now also derives its pair keys, one X25519 per member); an initiation
//! without the member's key, refused by its MAC before any DH or bucket, 1.59 us, about
//! 1/1400 of the handshake (version 2 charged the member's bucket for it and, while the
//! bucket had tokens, computed the DH); a refresh 16.5 us; one virtual second, 1 peer
//! 8.71 ms, 10 peers 103 ms. Datagrams: 213 demands/s in 42,704 B/s, 201 grants/s in
//! 15,480 B/s (the 16-byte MAC is on handshake messages only). The machine is shared:
//! figures move by 10% or so from run to run on a quiet one.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use justitia_core::control_loop::{ControlLoop, Event, FlowRegistration, LoopConfig, Target99};
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;
use justitia_core::remote_read::ReadGuarantee;
use justitia_core::remote_read::RemoteReadUnit;
use justitia_peer::channel::{Channel, ChannelConfig, ChannelEvent, Member};
use justitia_peer::keys::PrivateKey;
use justitia_peer::wire::{DemandEntry, Role};
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

fn key_of(node: NodeId) -> PrivateKey {
    let mut bytes = [0u8; 32];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = node.0[15].wrapping_mul(53) ^ node.0[0] ^ (i as u8);
    }
    PrivateKey::from_bytes(bytes).unwrap()
}

fn requester(i: usize) -> NodeId {
    let mut id = [0xa; 16];
    id[15] = i as u8;
    NodeId(id)
}

const B_NODE: NodeId = NodeId([0xb; 16]);

/// The responder and `peers` requesters, all members.
fn members(peers: usize) -> Vec<Member> {
    (0..peers)
        .map(requester)
        .chain([B_NODE])
        .map(|node| Member {
            node,
            public: key_of(node).public(),
        })
        .collect()
}

fn channel(node: NodeId, members: &[Member]) -> Channel {
    Channel::new(
        ChannelConfig::default(),
        node,
        key_of(node),
        members,
        [node.0[15]; 32],
        Duration::ZERO,
    )
    .unwrap()
}

/// One virtual second: `peers` requesters, each with 100 READ flows against one responder.
fn one_second(peers: usize) -> Traffic {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let b_node = B_NODE;
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
    let members = members(peers);
    let mut b = channel(b_node, &members);
    let mut requesters: Vec<Channel> = (0..peers)
        .map(|i| channel(requester(i), &members))
        .collect();
    // Each flow's activity, flipped by a fixed pseudo-random schedule (xorshift).
    let mut active = vec![vec![true; FLOWS_PER_PEER]; peers];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut traffic = Traffic::default();
    let steps = (Duration::from_secs(1).as_nanos() / REF_PERIOD.as_nanos()) as u64;
    for step in 1..=steps {
        let now = REF_PERIOD * step as u32;
        for p in 0..peers {
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
            requesters[p].set_demand(now, b_node, &entries).unwrap();
            // Twice: at the start the first round is the handshake (its response comes
            // back at once).
            for _ in 0..2 {
                while let Some(t) = requesters[p].poll_transmit(now) {
                    traffic.demands += 1;
                    traffic.demand_bytes += t.bytes.len() as u64;
                    b.receive(now, &t.bytes).unwrap();
                }
                while let Some(t) = b.poll_transmit(now) {
                    traffic.grants += 1;
                    traffic.grant_bytes += t.bytes.len() as u64;
                    let i = usize::from(t.to.0[15]);
                    requesters[i].receive(now, &t.bytes).unwrap();
                }
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

/// A whole handshake between two fresh channels: initiation, response, confirmation.
fn handshake(members: &[Member]) -> (Channel, Channel) {
    let a_node = requester(0);
    let mut a = channel(a_node, members);
    let mut b = channel(B_NODE, members);
    let entry = DemandEntry {
        tenant: TenantId(1),
        class: FlowClass::Bandwidth,
        role: Role::Read,
        flows: 1,
        weight: 1,
    };
    a.set_demand(Duration::ZERO, B_NODE, &[entry]).unwrap();
    let init = a.poll_transmit(Duration::ZERO).unwrap();
    b.receive(Duration::ZERO, &init.bytes).unwrap();
    let resp = b.poll_transmit(Duration::ZERO).unwrap();
    a.receive(Duration::ZERO, &resp.bytes).unwrap();
    let confirm = a.poll_transmit(Duration::ZERO).unwrap();
    b.receive(Duration::ZERO, &confirm.bytes).unwrap();
    (a, b)
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
    let members = members(1);
    let mut g = c.benchmark_group("per datagram, Noise KK sessions (version 3)");
    g.bench_function(
        "handshake: initiation, response, confirmation (both ends)",
        |bench| bench.iter(|| handshake(&members)),
    );
    let (mut a, mut b) = handshake(&members);
    // An initiation that names the requester, made with another key: B refuses it by its
    // MAC, before any DH or bucket, every time (it never authenticates, so it is never
    // remembered as a replay).
    let forged = {
        let mut forger = Channel::new(
            ChannelConfig::default(),
            requester(0),
            key_of(NodeId([0xee; 16])),
            &members,
            [9; 32],
            Duration::ZERO,
        )
        .unwrap();
        forger.greet(Duration::ZERO);
        forger.poll_transmit(Duration::ZERO).unwrap().bytes
    };
    g.bench_function(
        "an initiation without the member's key, refused by its MAC",
        |bench| {
            bench.iter(|| {
                assert_eq!(
                    b.receive(Duration::from_millis(1), &forged),
                    Err(justitia_peer::Refusal::Authentication)
                )
            })
        },
    );
    let entries: Vec<DemandEntry> = (0..10)
        .map(|t| DemandEntry {
            tenant: TenantId(t),
            class: FlowClass::Bandwidth,
            role: Role::Read,
            flows: 10,
            weight: 1,
        })
        .collect();
    let guarantee = ReadGuarantee {
        epoch: 0,
        sequence: 0,
        fraction: 0.5,
        bytes_per_sec: 6e9,
        ops_per_sec: 5e7,
        chunk_bytes: 5120,
    };
    let mut t = Duration::from_millis(1);
    b.set_grant(t, &guarantee, 12.5e9);
    g.bench_function(
        "a refresh: a 10-entry demand and a grant, each encrypted, decrypted and taken",
        |bench| {
            bench.iter(|| {
                // Every 5 ms of virtual time, the refresh: the sessions renew themselves
                // every 120 s of it (a handshake per 24,000 rounds).
                t += Duration::from_millis(5);
                a.set_demand(t, B_NODE, &entries).unwrap();
                a.handle_timeout(t);
                b.handle_timeout(t);
                for _ in 0..2 {
                    while let Some(m) = a.poll_transmit(t) {
                        b.receive(t, &m.bytes).unwrap();
                    }
                    while let Some(m) = b.poll_transmit(t) {
                        a.receive(t, &m.bytes).unwrap();
                    }
                }
                while a.poll_event().is_some() {}
                while b.poll_event().is_some() {}
            })
        },
    );
    g.finish();
    let mut g = c.benchmark_group("one virtual second of the channel");
    g.sample_size(10);
    g.bench_function("1 peer x 100 flows", |b| b.iter(|| one_second(1)));
    g.bench_function("10 peers x 100 flows", |b| b.iter(|| one_second(10)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
