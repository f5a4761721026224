//! Attacks on the peer channel from the network and from key holders, each with the figure
//! the channel of version 1 (one cluster key, the sender a header field) showed: that
//! figure is in the test's assertion message.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use justitia_core::flow::{FlowClass, TenantId};
use justitia_core::remote_read::ReadGuarantee;
use justitia_peer::channel::{Channel, ChannelConfig, ChannelEvent, Member};
use justitia_peer::keys::PrivateKey;
use justitia_peer::wire::{self, DemandEntry, Role};
use justitia_peer::{NodeId, Refusal};

const A: NodeId = NodeId([0xa; 16]);
const B: NodeId = NodeId([0xb; 16]);
const C: NodeId = NodeId([0xc; 16]);

fn key_of(node: NodeId, generation: u8) -> PrivateKey {
    let mut bytes = [0u8; 32];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = node.0[0] ^ generation.wrapping_mul(97) ^ (i as u8).wrapping_mul(7);
    }
    PrivateKey::from_bytes(bytes).unwrap()
}

fn members() -> Vec<Member> {
    [A, B, C]
        .into_iter()
        .map(|node| Member {
            node,
            public: key_of(node, 0).public(),
        })
        .collect()
}

/// Host `own`'s channel with key `key` (its own unless a test says otherwise).
fn channel_with(own: NodeId, key: PrivateKey, seed: u8) -> Channel {
    Channel::new(
        ChannelConfig::default(),
        own,
        key,
        &members(),
        [seed; 32],
        Duration::ZERO,
    )
    .unwrap()
}

fn channel(own: NodeId, seed: u8) -> Channel {
    channel_with(own, key_of(own, 0), seed)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn read(tenant: u64, flows: u16) -> DemandEntry {
    DemandEntry {
        tenant: TenantId(tenant),
        class: FlowClass::Bandwidth,
        role: Role::Read,
        flows,
        weight: 1,
    }
}

fn guarantee(fraction: f64) -> ReadGuarantee {
    ReadGuarantee {
        epoch: 0,
        sequence: 0,
        fraction,
        bytes_per_sec: fraction * 12.5e9,
        ops_per_sec: fraction * 1e8,
        chunk_bytes: 5120,
    }
}

/// Everything due from `from` to `to` at `now`, delivered; the refusals.
fn deliver(from: &mut Channel, to: &mut Channel, now: Duration) -> Vec<Refusal> {
    let mut refused = Vec::new();
    while let Some(t) = from.poll_transmit(now) {
        if t.to == to.own() {
            if let Err(r) = to.receive(now, &t.bytes) {
                refused.push(r);
            }
        }
    }
    refused
}

/// Both ways until quiet.
fn pump(a: &mut Channel, b: &mut Channel, now: Duration) -> Vec<Refusal> {
    let mut refused = Vec::new();
    for _ in 0..4 {
        refused.extend(deliver(a, b, now));
        refused.extend(deliver(b, a, now));
    }
    refused
}

/// Issue 36: one A->B datagram replayed at 10 k/s made B refuse A's real demands as
/// rate-limited (195 of A's real datagrams refused here with version 1).
#[test]
fn one_datagram_replayed_10000_times_does_not_rate_limit_the_real_sender() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(0)), vec![]);
    a.set_demand(ms(1), B, &[read(1, 2)]).unwrap();
    let captured = a.poll_transmit(ms(1)).unwrap();
    b.receive(ms(1), &captured.bytes).unwrap();
    let mut replays_refused = 0;
    let mut real_refused = Vec::new();
    for i in 0..10_000u64 {
        let t = ms(1) + Duration::from_micros(100 * i);
        if b.receive(t, &captured.bytes) == Err(Refusal::Replayed) {
            replays_refused += 1;
        }
        a.handle_timeout(t);
        b.handle_timeout(t);
        real_refused.extend(pump(&mut a, &mut b, t));
    }
    assert_eq!(replays_refused, 10_000, "every replay refused as replayed");
    assert_eq!(
        real_refused,
        vec![],
        "A's real datagrams refused (195 with version 1)"
    );
    assert_eq!(b.served().count(), 1);
}

/// Issue 36: any key holder could send "from A". Member C, with its own key, claims A's
/// node id: its handshake fails B's DH with A's key (version 1 accepted the demand).
#[test]
fn member_c_cannot_speak_for_a() {
    let mut b = channel(B, 2);
    let mut c_as_a = channel_with(A, key_of(C, 0), 3);
    c_as_a.set_demand(ms(0), B, &[read(9, 1)]).unwrap();
    let forged = c_as_a.poll_transmit(ms(0)).unwrap();
    assert_eq!(
        b.receive(ms(0), &forged.bytes),
        Err(Refusal::Authentication),
        "a forged sender (accepted with version 1)"
    );
    assert_eq!(b.served().count(), 0);
    assert_eq!(b.poll_event(), None);
    assert!(b.poll_transmit(ms(0)).is_none(), "nothing sent back");
    // C as itself is served: it speaks for itself only.
    let mut c = channel(C, 4);
    c.set_demand(ms(0), B, &[read(9, 1)]).unwrap();
    assert_eq!(pump(&mut c, &mut b, ms(0)), vec![]);
    let served: Vec<_> = b.served().map(|(n, _)| n).collect();
    assert_eq!(served, vec![C]);
}

/// Issue 36: one datagram with epoch 2^64-1 "from A" locked A out until B restarted (99 of
/// 99 real datagrams refused here with version 1). A counter of 2^64-1 on A's session, or
/// anything near it, without A's session key is refused and moves nothing.
#[test]
fn a_counter_of_2_64_minus_1_locks_no_one_out() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(0)), vec![]);
    a.set_demand(ms(1), B, &[read(1, 2)]).unwrap();
    let real = a.poll_transmit(ms(1)).unwrap().bytes;
    for counter in [u64::MAX, u64::MAX - (1 << 13) - 1, 1 << 40] {
        let mut forged = real.clone();
        forged[12..20].copy_from_slice(&counter.to_be_bytes());
        let r = b.receive(ms(1), &forged);
        assert!(
            matches!(r, Err(Refusal::Authentication | Refusal::OutOfRange(_))),
            "{counter}: {r:?}"
        );
    }
    b.receive(ms(1), &real).unwrap();
    let mut refused = Vec::new();
    for i in 2..100u64 {
        a.set_demand(ms(i * 5), B, &[read(1, i as u16)]).unwrap();
        refused.extend(deliver(&mut a, &mut b, ms(i * 5)));
    }
    assert_eq!(
        refused,
        vec![],
        "real datagrams refused after the forged counter (99 of 99 with version 1)"
    );
}

/// Issue 36: after B restarted, 599 of 600 replayed old A->B demands were accepted (200 of
/// 600 here with version 1, whose rate cap refused the rest). The sessions died with B.
#[test]
fn after_the_receiver_restarts_all_600_replayed_demands_are_refused() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    let mut captured = Vec::new();
    for i in 0..600u64 {
        let t = ms(i * 5);
        a.set_demand(t, B, &[read(i, 1)]).unwrap();
        // Twice: at the start the first round is the handshake.
        for _ in 0..2 {
            while let Some(m) = a.poll_transmit(t) {
                b.receive(t, &m.bytes).unwrap();
                captured.push(m.bytes);
            }
            while let Some(m) = b.poll_transmit(t) {
                a.receive(t, &m.bytes).unwrap();
            }
        }
    }
    // Transport messages (type 3); the rest are A's initiations (the first, and one a
    // second while B, granting nothing, never answers).
    let (demands, initiations): (Vec<_>, Vec<_>) = captured.iter().partition(|m| m[5] == 3);
    // 600 demands, and the same demand again on each new session A made (B, which
    // grants nothing here, never answers, so A handshakes again every UNANSWERED).
    assert!(demands.len() >= 600, "{}", demands.len());
    let mut restarted = channel(B, 3);
    let accepted = demands
        .iter()
        .filter(|m| restarted.receive(ms(4000), m).is_ok())
        .count();
    assert_eq!(
        accepted,
        0,
        "of {} replayed demands accepted (200 of 600 with version 1)",
        demands.len()
    );
    // A replayed initiation authenticates (it is A's) but makes only a pending session,
    // whose keys the replayer lacks: nothing is served.
    for m in initiations {
        let _ = restarted.receive(ms(4000), m);
    }
    let replayed_again = demands
        .iter()
        .filter(|m| restarted.receive(ms(4000), m).is_ok())
        .count();
    assert_eq!(replayed_again, 0);
    assert_eq!(restarted.served().count(), 0);
}

/// Issue 36: a host restarted with its clock an hour behind was refused by every peer for
/// its whole run. There are no clocks: the restarted A handshakes and B serves it within
/// one round trip; and when B restarts instead, B's greeting makes A's next demand
/// reach it at once.
#[test]
fn a_restarted_sender_is_served_within_one_round_trip_and_a_restarted_receiver_at_its_greeting() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(0)), vec![]);
    let mut a2 = channel(A, 5);
    a2.set_demand(ms(10), B, &[read(2, 1)]).unwrap();
    assert_eq!(pump(&mut a2, &mut b, ms(10)), vec![]);
    let served: Vec<_> = b.served().map(|(_, e)| e.tenant).collect();
    assert_eq!(
        served,
        vec![TenantId(2)],
        "served at 10 ms, the restart's own time"
    );

    let mut b2 = channel(B, 6);
    b2.greet(ms(20));
    // A's refresh on the session B lost, sent before B's confirmation reaches it, is the
    // only refusal.
    let refused = pump(&mut b2, &mut a2, ms(20));
    assert!(
        refused.iter().all(|r| *r == Refusal::UnknownSession),
        "{refused:?}"
    );
    let served: Vec<_> = b2.served().map(|(_, e)| e.tenant).collect();
    assert_eq!(
        served,
        vec![TenantId(2)],
        "the restarted B serves A at 20 ms"
    );
}

/// Issue 36: forged grants "from B" paced A's READ flow at 1 B/s (accepted with version 1).
/// Neither C's handshake as B nor a transport message on B's session without its key
/// reaches A's record of B.
#[test]
fn a_forged_grant_cannot_pace_a_read_flow() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(0)), vec![]);
    b.set_grant(ms(1), &guarantee(0.5), 12.5e9);
    let real = b.poll_transmit(ms(1)).unwrap().bytes;
    a.receive(ms(1), &real).unwrap();
    while a.poll_event().is_some() {}
    // C as B: the handshake fails A's DH with B's key.
    let mut c_as_b = channel_with(B, key_of(C, 0), 7);
    c_as_b.set_demand(ms(2), A, &[read(1, 1)]).unwrap();
    let forged = c_as_b.poll_transmit(ms(2)).unwrap();
    assert_eq!(
        a.receive(ms(2), &forged.bytes),
        Err(Refusal::Authentication)
    );
    // On B's session: the ciphertext of a 1 B/s grant under another key.
    let mut on_session = real.clone();
    on_session[wire::TRANSPORT_HEADER_LEN..].fill(0x42);
    on_session[12..20].copy_from_slice(&99u64.to_be_bytes());
    assert_eq!(a.receive(ms(2), &on_session), Err(Refusal::Authentication));
    assert_eq!(a.grant_from(B).map(|g| g.bytes_per_sec), Some(0.5 * 12.5e9));
    assert_eq!(a.poll_event(), None, "no guarantee from a forgery");
}

/// Issue 36: 64 forged hosts x 128 entries every 5 ms took a victim's guarantee to bytes
/// per second (64 of 64 accepted here with version 1). Hosts off the member list are
/// refused before any DH, and hold nothing.
#[test]
fn sixty_four_forged_hosts_with_128_entries_are_refused_as_non_members() {
    let mut b = channel(B, 2);
    let entries: Vec<_> = (0..128).map(|t| read(t, 1)).collect();
    let mut refused = Vec::new();
    for h in 0..64u8 {
        let mut id = [0x77; 16];
        id[15] = h;
        let node = NodeId(id);
        let mut forger = Channel::new(
            ChannelConfig::default(),
            node,
            key_of(node, 1),
            &members(),
            [h; 32],
            Duration::ZERO,
        )
        .unwrap();
        forger.set_demand(ms(0), B, &entries).unwrap();
        while let Some(m) = forger.poll_transmit(ms(0)) {
            refused.push(b.receive(ms(0), &m.bytes));
        }
    }
    assert_eq!(refused.len(), 64);
    assert!(
        refused.iter().all(|r| *r == Err(Refusal::NotMember)),
        "forged hosts accepted (64 of 64 with version 1): {refused:?}"
    );
    assert_eq!(b.served().count(), 0);
    assert!(
        b.poll_transmit(ms(0)).is_none(),
        "nothing sent to a non-member"
    );
}

/// A replayed initiation (however often) makes at most a pending session and never breaks
/// the live one; its exact replays are dropped before any DH.
#[test]
fn a_replayed_initiation_never_breaks_the_live_session() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
    let initiation = a.poll_transmit(ms(0)).unwrap().bytes;
    b.receive(ms(0), &initiation).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(0)), vec![]);
    for _ in 0..1000 {
        assert_eq!(b.receive(ms(1), &initiation), Err(Refusal::Replayed));
    }
    a.set_demand(ms(5), B, &[read(1, 3)]).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(5)), vec![]);
    let served: Vec<_> = b.served().map(|(_, e)| e.flows).collect();
    assert_eq!(served, vec![3]);
}

/// Key rotation: B gets a new key and A the new member list; B's greeting makes a new
/// session; the old one still serves through the overlap.
#[test]
fn a_rotated_key_takes_over_through_a_new_handshake() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(0)), vec![]);
    let new_b = key_of(B, 1);
    let mut list = members();
    list[1].public = new_b.public();
    a.set_members(ms(1), &list).unwrap();
    b.set_key(ms(1), new_b);
    assert_eq!(pump(&mut a, &mut b, ms(1)), vec![]);
    a.set_demand(ms(6), B, &[read(1, 4)]).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(6)), vec![]);
    let served: Vec<_> = b.served().map(|(_, e)| e.flows).collect();
    assert_eq!(served, vec![4]);
    assert!(matches!(b.poll_event(), Some(ChannelEvent::ServedChanged)));
}

/// A flood of initiations naming A, without A's key (fresh ephemeral keys, so no replay):
/// every one is refused by its MAC before any DH or bucket, so A's handshake budget stays
/// whole. With version 2 (the budget charged before the DH) the flood spent it: 996 of
/// 1000 refused as rate-limited, and A, restarted during the flood, could not make a new
/// session until the bucket refilled. Here A restarts at the flood's end and is served in
/// the same millisecond; C's handshake goes through too.
#[test]
fn a_keyless_flood_of_1000_initiations_naming_a_spends_none_of_as_handshakes() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(0)), vec![]);
    let mut refusals = std::collections::BTreeMap::new();
    for i in 0..1000u64 {
        // Seeds other than A's own: each forger's ephemeral key is its own. Its static key
        // is none of A's (generation 198 of this family would be A's own).
        let mut forger = channel_with(A, key_of(C, (i % 150) as u8 + 1), 100 + (i % 100) as u8);
        forger.set_demand(ms(1), B, &[read(9, 1)]).unwrap();
        let init = forger.poll_transmit(ms(1)).unwrap();
        let r = b.receive(ms(1), &init.bytes).err().map(|r| r.label());
        *refusals.entry(r).or_insert(0) += 1;
    }
    assert_eq!(
        refusals.get(&Some("authentication")),
        Some(&1000),
        "version 2: 996 rate_limited, 4 authentication: {refusals:?}"
    );
    // A restarts (its sessions lost) at the same moment, four times: the four tokens its
    // live handshake left of the burst of five are all there. A fifth restart in the same
    // millisecond finds the bucket empty: the budget is A's, spent by A alone.
    for restart in 0..5u8 {
        let mut a = channel(A, 10 + restart);
        a.greet(ms(1));
        a.set_demand(ms(1), B, &[read(1, 5 + u16::from(restart))])
            .unwrap();
        let refused = pump(&mut a, &mut b, ms(1));
        let expected = if restart < 4 {
            vec![]
        } else {
            vec![Refusal::RateLimited]
        };
        assert_eq!(refused, expected, "A's handshake {restart} after the flood");
    }
    let served: Vec<_> = b.served().map(|(n, e)| (n, e.flows)).collect();
    assert_eq!(served, vec![(A, 8)]);
    let mut c = channel(C, 3);
    c.set_demand(ms(3), B, &[read(2, 1)]).unwrap();
    assert_eq!(pump(&mut c, &mut b, ms(3)), vec![]);
    assert_eq!(b.served().count(), 2);
}

/// A's own initiations replayed from a capture longer than B remembers (its last 64
/// ephemeral keys) carry A's MAC: they spend A's handshake budget (5 back to back, then
/// 10 a second) and no other member's, and A's live session carries its demands
/// throughout.
#[test]
fn as_captured_initiations_replayed_spend_only_as_handshake_budget() {
    let mut b = channel(B, 2);
    let mut captured = Vec::new();
    for i in 0..100u8 {
        let mut a = channel(A, 20 + i);
        a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
        captured.push(a.poll_transmit(ms(0)).unwrap().bytes);
    }
    let mut a = channel(A, 1);
    a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
    assert_eq!(pump(&mut a, &mut b, ms(0)), vec![]);
    let mut refusals = std::collections::BTreeMap::new();
    for init in &captured {
        let r = b.receive(ms(1), init).err().map(|r| r.label());
        *refusals.entry(r).or_insert(0) += 1;
    }
    // The live handshake took one token of five: four replays computed (each a pending
    // session A never confirms), 96 refused before the DH.
    assert_eq!(refusals.get(&None), Some(&4), "{refusals:?}");
    assert_eq!(
        refusals.get(&Some("rate_limited")),
        Some(&96),
        "{refusals:?}"
    );
    a.set_demand(ms(2), B, &[read(1, 5)]).unwrap();
    // B answers the last replay it computed; A, which sent no such initiation, refuses
    // the answer.
    let refused = pump(&mut a, &mut b, ms(2));
    assert_eq!(refused, vec![Refusal::UnknownSession]);
    let served: Vec<_> = b.served().map(|(n, e)| (n, e.flows)).collect();
    assert_eq!(served, vec![(A, 5)]);
    let mut c = channel(C, 3);
    c.set_demand(ms(2), B, &[read(2, 1)]).unwrap();
    assert_eq!(pump(&mut c, &mut b, ms(2)), vec![], "C's budget is its own");
}

/// A response forged by one who saw the initiation's index (without B's key) is refused by
/// its MAC and leaves the initiation in flight: B's real response completes it. With
/// version 2 the forged response's failed Noise read spent the handshake, and B's real
/// response was refused as unknown_session.
#[test]
fn a_forged_response_leaves_the_handshake_in_flight() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    a.set_demand(ms(0), B, &[read(1, 2)]).unwrap();
    let init = a.poll_transmit(ms(0)).unwrap().bytes;
    b.receive(ms(0), &init).unwrap();
    let real = b.poll_transmit(ms(0)).unwrap().bytes;
    // The forger answers A's index with its own ephemeral key and a guessed MAC.
    let mut forged = real.clone();
    forged[16..48].fill(0x5a);
    forged[wire::RESPONSE_LEN - wire::MAC_LEN..].fill(0x77);
    assert_eq!(a.receive(ms(0), &forged), Err(Refusal::Authentication));
    assert_eq!(
        a.receive(ms(0), &real),
        Ok(()),
        "version 2: unknown_session"
    );
    assert_eq!(pump(&mut a, &mut b, ms(0)), vec![]);
    let served: Vec<_> = b.served().map(|(_, e)| e.flows).collect();
    assert_eq!(served, vec![2]);
}

/// A receiver that counts a sender's flows but grants it nothing (one sending host's
/// incast: no share to give) still answers with a keepalive every half second, so the
/// sender never takes its session for lost: one handshake in 10 s, not one a second.
#[test]
fn a_receiver_that_grants_nothing_keeps_the_session_alive() {
    let mut a = channel(A, 1);
    let mut b = channel(B, 2);
    let incast = DemandEntry {
        role: Role::Incast,
        ..read(1, 1)
    };
    a.set_demand(ms(0), B, &[incast]).unwrap();
    let mut initiations = 0;
    let mut keepalives = 0;
    for step in 0..2000u64 {
        let t = ms(step * 5);
        a.handle_timeout(t);
        b.handle_timeout(t);
        while let Some(m) = a.poll_transmit(t) {
            initiations += usize::from(m.bytes[5] == 1);
            b.receive(t, &m.bytes).unwrap();
        }
        while let Some(m) = b.poll_transmit(t) {
            keepalives += usize::from(m.bytes[5] == 3);
            a.receive(t, &m.bytes).unwrap();
        }
    }
    assert_eq!(initiations, 1, "handshakes in 10 s");
    assert!(
        (19..=22).contains(&keepalives),
        "{keepalives} keepalives in 10 s"
    );
    assert_eq!(b.served().count(), 1);
}
