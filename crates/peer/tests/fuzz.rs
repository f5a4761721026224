//! A bounded, structure-aware fuzz run of the peer message parsers and the channel that
//! consumes them (`scripts/test.sh` runs it for 30 s; `JUSTITIA_FUZZ_SECS` sets the time).
//!
//! Why not cargo-fuzz: it needs the nightly toolchain and a libFuzzer build of its own in
//! every CI run, and a coverage-guided fuzzer could not get past the AEAD tag anyway. So
//! two harnesses: datagrams of a real session (initiation, response, transport messages
//! of every kind), mutated (bits flipped, bytes set, cut, grown, spliced from another),
//! go to a channel holding that session; and the plaintexts behind the tag, mutated the
//! same way, go to the body parser. The checks: nothing panics, a refused datagram changes
//! nothing the channel shows, whatever parses is in range and encodes back to the same
//! bytes, and no mutated transport message authenticates.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use justitia_core::flow::{FlowClass, TenantId};
use justitia_peer::channel::{Channel, ChannelConfig, Member};
use justitia_peer::keys::PrivateKey;
use justitia_peer::wire::{self, Body, DemandEntry, Grant, Pairing, ProbeEndpoint, Role};
use justitia_peer::NodeId;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

const A: NodeId = NodeId([0xa; 16]);
const B: NodeId = NodeId([0xb; 16]);

fn key(n: u8) -> PrivateKey {
    let mut bytes = [0u8; 32];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = n.wrapping_add(i as u8);
    }
    PrivateKey::from_bytes(bytes).unwrap()
}

fn pair() -> (Channel, Channel) {
    let members = [
        Member {
            node: A,
            public: key(1).public(),
        },
        Member {
            node: B,
            public: key(2).public(),
        },
    ];
    let new = |own, k, seed| {
        Channel::new(
            ChannelConfig::default(),
            own,
            k,
            &members,
            [seed; 32],
            Duration::ZERO,
        )
        .unwrap()
    };
    (new(A, key(1), 1), new(B, key(2), 2))
}

fn entry(t: u64, class: FlowClass, role: Role) -> DemandEntry {
    DemandEntry {
        tenant: TenantId(t),
        class,
        role,
        flows: 3,
        weight: 2,
    }
}

fn probe_offer() -> ProbeEndpoint {
    ProbeEndpoint {
        gid: [0xfe; 16],
        lid: 7,
        qpn: 0x101,
        psn: 0x12_3456,
        rkey: 0,
        addr: 0,
        answers_qpn: 0,
    }
}

fn pairings() -> Vec<Pairing> {
    vec![
        Pairing {
            this_qpn: 0x101,
            that_qpn: 0x202,
            side_qpn: 0x303,
            side_qkey: 0x1234_5678,
        },
        Pairing {
            this_qpn: 0x102,
            that_qpn: 0x202,
            side_qpn: 0x303,
            side_qkey: 0x1234_5678,
        },
    ]
}

fn bodies() -> Vec<Body> {
    vec![
        Body::Keepalive,
        Body::Demand(vec![]),
        Body::Demand(vec![
            entry(1, FlowClass::Bandwidth, Role::Read),
            entry(1, FlowClass::Bandwidth, Role::Incast),
            entry(2, FlowClass::Latency, Role::Read),
        ]),
        Body::Grant(Grant {
            fraction: 0.5,
            bytes_per_sec: 6e9,
            ops_per_sec: 5e7,
            chunk_bytes: 5120,
            incast_bytes_per_sec: 3e9,
        }),
        Body::ProbeOffer(probe_offer()),
        Body::ProbeAnswer(ProbeEndpoint {
            qpn: 0x202,
            rkey: 0x1234,
            addr: 0x7f00_0000_1000,
            answers_qpn: 0x101,
            ..probe_offer()
        }),
        Body::Pairings(pairings()),
    ]
}

/// The datagrams of one session between A and B, and a B that holds it (cloned per case
/// by replaying the same handshake into a fresh pair: the seeds make it the same).
fn session_datagrams() -> Vec<Vec<u8>> {
    let (mut a, mut b) = pair();
    let ms = Duration::from_millis;
    let mut out = Vec::new();
    a.set_demand(ms(0), B, &[entry(1, FlowClass::Bandwidth, Role::Read)])
        .unwrap();
    a.set_probe_offer(ms(0), B, Some(probe_offer())).unwrap();
    a.set_pairings(ms(0), B, &pairings()).unwrap();
    for _ in 0..3 {
        while let Some(t) = a.poll_transmit(ms(0)) {
            b.receive(ms(0), &t.bytes).unwrap();
            out.push(t.bytes);
        }
        while let Some(t) = b.poll_transmit(ms(0)) {
            a.receive(ms(0), &t.bytes).unwrap();
            out.push(t.bytes);
        }
    }
    a.set_demand(ms(1), B, &[entry(2, FlowClass::Latency, Role::Incast)])
        .unwrap();
    out.extend(a.poll_transmit(ms(1)).map(|t| t.bytes));
    out
}

/// One mutation of a message.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Cut(usize),
    Grow(Vec<u8>),
    Splice(usize, usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::Set(i, v)),
        any::<usize>().prop_map(Mutation::Cut),
        proptest::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Grow),
        (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(a, b, c)| Mutation::Splice(a, b, c)),
    ]
}

fn apply(seeds: &[Vec<u8>], base: usize, ms: &[Mutation]) -> Vec<u8> {
    let mut m = seeds[base % seeds.len()].clone();
    for mu in ms {
        let len = m.len().max(1);
        match mu {
            Mutation::Flip(i, b) => {
                if !m.is_empty() {
                    m[i % len] ^= 1 << b;
                }
            }
            Mutation::Set(i, v) => {
                if !m.is_empty() {
                    m[i % len] = *v;
                }
            }
            Mutation::Cut(i) => m.truncate(i % len),
            Mutation::Grow(extra) => m.extend_from_slice(extra),
            Mutation::Splice(s, at, n) => {
                let other = &seeds[s % seeds.len()];
                let at = at % len;
                let n = n % other.len();
                let end = (at + n).min(m.len());
                m.splice(at..end, other[..n].iter().copied());
            }
        }
    }
    m
}

/// Runs `cases` proptest cases of `test` `budget` long; returns how many ran.
fn timed<S: Strategy>(
    budget: Duration,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> u64 {
    let start = Instant::now();
    let mut round = 0u64;
    while start.elapsed() < budget {
        round += 1;
        let mut seed = [0u8; 32];
        seed[..8].copy_from_slice(&round.to_le_bytes());
        seed[8..16].copy_from_slice(&(start.elapsed().as_nanos() as u64).to_le_bytes());
        let mut runner = TestRunner::new_with_rng(
            Config {
                cases: 500,
                failure_persistence: None,
                ..Config::default()
            },
            TestRng::from_seed(RngAlgorithm::ChaCha, &seed),
        );
        if let Err(e) = runner.run(&strategy, &test) {
            panic!("fuzz case failed: {e}");
        }
    }
    round * 500
}

#[test]
#[ignore = "a timed fuzz run; scripts/test.sh runs it with --ignored for 30 s"]
fn fuzz_the_peer_parsers_and_channel() {
    let secs: u64 = std::env::var("JUSTITIA_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let half = Duration::from_secs(secs) / 2;
    let seeds = session_datagrams();
    let start = Instant::now();
    let datagram_cases = timed(
        half,
        (any::<usize>(), proptest::collection::vec(mutation(), 1..6)),
        |(base, ms)| {
            let m = apply(&seeds, base, &ms);
            // A B that took the session's handshake and first messages.
            let (mut a, mut b) = pair();
            let t0 = Duration::ZERO;
            for d in &seeds[..seeds.len() - 1] {
                let _ = if d[5] == 2 {
                    a.receive(t0, d)
                } else {
                    b.receive(t0, d)
                };
            }
            while b.poll_event().is_some() {}
            let served: Vec<_> = b.served().map(|(n, e)| (n, *e)).collect();
            let received = b.receive(Duration::from_millis(1), &m);
            let mutated = m != seeds[base % seeds.len()];
            if received.is_err() {
                let now: Vec<_> = b.served().map(|(n, e)| (n, *e)).collect();
                prop_assert_eq!(now, served);
                prop_assert_eq!(b.poll_event(), None);
            } else if mutated && m.len() > 5 && m[5] == 3 {
                // A transport message that differs from every real one never decrypts.
                prop_assert!(
                    seeds.contains(&m),
                    "a mutated transport message authenticated"
                );
            }
            Ok(())
        },
    );
    let plaintexts: Vec<Vec<u8>> = bodies().iter().map(wire::encode_body).collect();
    let body_cases = timed(
        half,
        (any::<usize>(), proptest::collection::vec(mutation(), 1..6)),
        |(base, ms)| {
            let m = apply(&plaintexts, base, &ms);
            if let Ok(body) = wire::decode_body(&m) {
                prop_assert_eq!(wire::encode_body(&body), m.clone());
                if let Body::Grant(g) = &body {
                    prop_assert!(g.fraction > 0.0 && g.fraction <= 1.0);
                    prop_assert!(g.bytes_per_sec > 0.0 && g.bytes_per_sec.is_finite());
                }
                if let Body::Demand(entries) = &body {
                    prop_assert!(entries.iter().all(|e| e.flows >= 1 && e.weight >= 1));
                }
                if let Body::ProbeOffer(e) = &body {
                    prop_assert_eq!(e.check_offer(), Ok(()));
                }
                if let Body::ProbeAnswer(e) = &body {
                    prop_assert_eq!(e.check_answer(), Ok(()));
                }
                if let Body::Pairings(pairings) = &body {
                    prop_assert!(!pairings.is_empty() && pairings.len() <= wire::MAX_PAIRINGS);
                    prop_assert!(pairings.iter().all(|e| e.check().is_ok()));
                }
            }
            Ok(())
        },
    );
    let s = start.elapsed().as_secs_f64();
    eprintln!(
        "peer fuzz: {datagram_cases} datagram cases and {body_cases} plaintext cases in {s:.1} s"
    );
}
