//! The peer channel's wire format, version 3: three message types, each behind an 8-byte
//! preamble (magic "JSPC", version 3, type, two zero bytes). Integers are big-endian.
//!
//! ```text
//! type 1, handshake initiation (Noise KK message 1: e, es, ss), 92 bytes
//!      8    16  the initiator's node id (which member's static key to expect; only a hint:
//!               a false one fails the MAC and the handshake's DH)
//!     24     4  the initiator's session index
//!     28    48  Noise message: ephemeral key (32), AEAD tag of the empty payload (16)
//!     76    16  MAC of bytes 0..76 under the pair's static key
//! type 2, handshake response (Noise KK message 2: e, ee, se), 80 bytes
//!      8     4  the responder's session index
//!     12     4  the initiator's session index (the one it chose)
//!     16    48  Noise message: ephemeral key (32), AEAD tag of the empty payload (16)
//!     64    16  MAC of bytes 0..64 under the pair's static key
//! type 3, transport, 20 + n + 16 bytes
//!      8     4  the receiver's session index
//!     12     8  counter (the ChaCha20-Poly1305 nonce)
//!     20  n+16  AEAD of the plaintext: kind (0 keepalive, 1 demand, 2 grant), then the body
//! ```
//!
//! The handshake MAC ([`crate::keys::PairKey`]) is keyed by the two members' static keys
//! alone, so a receiver checks it with one keyed hash before it computes any DH or spends
//! any budget: a datagram from a host without either key is refused at that cost.
//!
//! A demand's body is a count (u16), two zero bytes, then `count` entries of 16 bytes:
//! tenant (u64), class (u8: 0 latency, 1 throughput, 2 bandwidth), role (u8: 1 READ,
//! 2 incast), flows (u16), weight (u32). A grant's body is 40 bytes: fraction, bytes/s,
//! ops/s (f64 each), chunk bytes (u32), four zero bytes, incast bytes/s per unit of weight
//! (f64, 0 when the receiver gives no incast share). A keepalive has no body.
//!
//! This module frames and parses; the cryptography is the channel's (through snow) and
//! the keys module's. No field of a message names its sender for trust: the pair key
//! its MAC verifies under and the session a transport message decrypts under do.
//!
//! Invariants: [`parse`] checks the length, the magic, version and type and every fixed
//! size before anything is looked up or computed; [`parse_body`] (run only on
//! authenticated plaintext) checks every field's range (see [`Grant`] and [`DemandEntry`]);
//! [`encode_body`] of a body [`parse_body`] accepts gives the same bytes back.

use justitia_core::flow::{FlowClass, TenantId};

use crate::{NodeId, Refusal};

/// The first bytes of every message.
pub const MAGIC: [u8; 4] = *b"JSPC";
/// The version this code speaks; a datagram of another is refused.
pub const VERSION: u8 = 3;
/// Bytes of the preamble every message starts with.
pub const PREAMBLE_LEN: usize = 8;
/// Bytes of a Noise KK handshake message with an empty payload: an ephemeral key and a tag.
pub const NOISE_HANDSHAKE_LEN: usize = 48;
/// Bytes of a handshake message's MAC.
pub const MAC_LEN: usize = crate::keys::MAC_LEN;
/// Bytes of a handshake initiation.
pub const INITIATION_LEN: usize = PREAMBLE_LEN + 16 + 4 + NOISE_HANDSHAKE_LEN + MAC_LEN;
/// Bytes of a handshake response.
pub const RESPONSE_LEN: usize = PREAMBLE_LEN + 4 + 4 + NOISE_HANDSHAKE_LEN + MAC_LEN;
/// Bytes of a transport message before its ciphertext.
pub const TRANSPORT_HEADER_LEN: usize = PREAMBLE_LEN + 4 + 8;
/// Bytes of the AEAD tag.
pub const TAG_LEN: usize = 16;
/// Bytes of one demand entry.
pub const ENTRY_LEN: usize = 16;
/// Bytes of a grant's body.
pub const GRANT_BODY_LEN: usize = 40;
/// The most entries one demand carries: a sender's (tenant, class, role) triples against
/// one peer. 128 keeps the largest datagram (2,089 bytes) within two Ethernet frames.
pub const MAX_DEMAND_ENTRIES: usize = 128;
/// The largest plaintext: a kind byte and the largest demand.
pub const MAX_PLAINTEXT: usize = 1 + 4 + MAX_DEMAND_ENTRIES * ENTRY_LEN;
/// The largest datagram of version 2.
pub const MAX_DATAGRAM: usize = TRANSPORT_HEADER_LEN + MAX_PLAINTEXT + TAG_LEN;
/// The largest weight a demand may declare (the core's weights are relative shares; a
/// million to one is beyond any configured ratio).
pub const MAX_WEIGHT: u32 = 1_000_000;
/// The largest rate a grant may state: 10^12 bytes/s (8 Tb/s), above any RNIC.
pub const MAX_BYTES_PER_SEC: f64 = 1e12;
/// The largest operation rate a grant may state: 10^10 ops/s.
pub const MAX_OPS_PER_SEC: f64 = 1e10;
/// The smallest and largest chunk a grant may ask for.
pub const CHUNK_RANGE: (u32, u32) = (64, 1 << 30);

const TYPE_INITIATION: u8 = 1;
const TYPE_RESPONSE: u8 = 2;
const TYPE_TRANSPORT: u8 = 3;
const KIND_KEEPALIVE: u8 = 0;
const KIND_DEMAND: u8 = 1;
const KIND_GRANT: u8 = 2;

/// A datagram's framing, parsed (nothing in it is authenticated yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message<'a> {
    /// A handshake initiation.
    Initiation {
        /// The node id the initiator claims (checked by the handshake).
        from: NodeId,
        /// The index it chose for the session.
        sender_index: u32,
        /// The Noise message.
        noise: &'a [u8],
        /// The bytes the MAC covers (all before it).
        covered: &'a [u8],
        /// The MAC.
        mac: &'a [u8],
    },
    /// A handshake response.
    Response {
        /// The index the responder chose.
        sender_index: u32,
        /// The initiator's index.
        receiver_index: u32,
        /// The Noise message.
        noise: &'a [u8],
        /// The bytes the MAC covers (all before it).
        covered: &'a [u8],
        /// The MAC.
        mac: &'a [u8],
    },
    /// A transport message.
    Transport {
        /// The receiver's index for the session.
        receiver_index: u32,
        /// The message's counter (nonce).
        counter: u64,
        /// The ciphertext and its tag.
        ciphertext: &'a [u8],
    },
}

/// Checks a datagram's framing and sizes. See the module documentation.
pub fn parse(datagram: &[u8]) -> Result<Message<'_>, Refusal> {
    if datagram.len() < PREAMBLE_LEN {
        return Err(Refusal::Truncated);
    }
    if datagram.len() > MAX_DATAGRAM {
        return Err(Refusal::Oversized);
    }
    if datagram[0..4] != MAGIC {
        return Err(Refusal::BadMagic);
    }
    if datagram[4] != VERSION {
        return Err(Refusal::Version);
    }
    if datagram[6..8] != [0, 0] {
        return Err(Refusal::Length);
    }
    let u32_at = |at: usize| {
        u32::from_be_bytes([
            datagram[at],
            datagram[at + 1],
            datagram[at + 2],
            datagram[at + 3],
        ])
    };
    match datagram[5] {
        TYPE_INITIATION if datagram.len() == INITIATION_LEN => Ok(Message::Initiation {
            from: NodeId(take16(&datagram[8..24])),
            sender_index: u32_at(24),
            noise: &datagram[28..INITIATION_LEN - MAC_LEN],
            covered: &datagram[..INITIATION_LEN - MAC_LEN],
            mac: &datagram[INITIATION_LEN - MAC_LEN..],
        }),
        TYPE_RESPONSE if datagram.len() == RESPONSE_LEN => Ok(Message::Response {
            sender_index: u32_at(8),
            receiver_index: u32_at(12),
            noise: &datagram[16..RESPONSE_LEN - MAC_LEN],
            covered: &datagram[..RESPONSE_LEN - MAC_LEN],
            mac: &datagram[RESPONSE_LEN - MAC_LEN..],
        }),
        TYPE_TRANSPORT if datagram.len() >= TRANSPORT_HEADER_LEN + 1 + TAG_LEN => {
            Ok(Message::Transport {
                receiver_index: u32_at(8),
                counter: u64::from_be_bytes(take8(&datagram[12..20])),
                ciphertext: &datagram[TRANSPORT_HEADER_LEN..],
            })
        }
        TYPE_INITIATION | TYPE_RESPONSE | TYPE_TRANSPORT => Err(Refusal::Length),
        _ => Err(Refusal::Kind),
    }
}

fn preamble(out: &mut Vec<u8>, kind: u8) {
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(kind);
    out.extend_from_slice(&[0, 0]);
}

/// Frames a handshake initiation around its Noise message, up to its MAC: the sender
/// appends [`MAC_LEN`] bytes, the MAC of what precedes under the pair key.
pub fn initiation(from: NodeId, sender_index: u32, noise: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(INITIATION_LEN);
    preamble(&mut out, TYPE_INITIATION);
    out.extend_from_slice(&from.0);
    out.extend_from_slice(&sender_index.to_be_bytes());
    out.extend_from_slice(noise);
    out
}

/// Frames a handshake response around its Noise message, up to its MAC (as
/// [`initiation`]).
pub fn response(sender_index: u32, receiver_index: u32, noise: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(RESPONSE_LEN);
    preamble(&mut out, TYPE_RESPONSE);
    out.extend_from_slice(&sender_index.to_be_bytes());
    out.extend_from_slice(&receiver_index.to_be_bytes());
    out.extend_from_slice(noise);
    out
}

/// A transport message's header; the caller appends the ciphertext.
pub fn transport_header(receiver_index: u32, counter: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAX_DATAGRAM);
    preamble(&mut out, TYPE_TRANSPORT);
    out.extend_from_slice(&receiver_index.to_be_bytes());
    out.extend_from_slice(&counter.to_be_bytes());
    out
}

/// What a message says.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// Nothing to say: confirms a new session (the initiator's first message) when no
    /// demand or grant is due.
    Keepalive,
    /// The sender's flows against the receiver: READs it posts there, bandwidth flows it
    /// sends there (incast). The whole set, not a change: a lost demand is made good by the
    /// next.
    Demand(Vec<DemandEntry>),
    /// The receiver's answer: the guarantee of §4.4 and its incast share.
    Grant(Grant),
}

/// Why a flow counts at the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// The sender posts READs against the receiver: their data leaves the receiver's RNIC.
    Read,
    /// The sender's flow goes into the receiver, whose link is the contended one in an
    /// incast: the receiver counts it among the flows sharing that link (a bandwidth flow
    /// is then paced to the receiver's share).
    Incast,
}

/// One (tenant, class, role) of the sender's flows against the receiver.
///
/// Invariants of a decoded entry: `flows` >= 1, 1 <= `weight` <= [`MAX_WEIGHT`], and no
/// two entries of a demand share (tenant, class, role).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DemandEntry {
    /// The tenant on the sender's host.
    pub tenant: TenantId,
    /// The flows' class.
    pub class: FlowClass,
    /// READ or incast.
    pub role: Role,
    /// How many such flows have work (the receiver counts the tenant once however many).
    pub flows: u16,
    /// The tenant's weight.
    pub weight: u32,
}

/// A host's answer to the hosts whose flows it counts.
///
/// Invariants of a decoded grant: 0 < `fraction` <= 1; 0 < `bytes_per_sec` <=
/// [`MAX_BYTES_PER_SEC`]; 0 < `ops_per_sec` <= [`MAX_OPS_PER_SEC`]; `chunk_bytes` in
/// [`CHUNK_RANGE`]; `incast_bytes_per_sec` is 0 or in (0, [`MAX_BYTES_PER_SEC`]].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grant {
    /// The READ guarantee per unit of weight: 1/(L'+B'+T') when every weight is 1.
    pub fraction: f64,
    /// That fraction of the sender's MaxRate.
    pub bytes_per_sec: f64,
    /// That fraction of the sender's MaxTput.
    pub ops_per_sec: f64,
    /// The size READs from the sender are cut to.
    pub chunk_bytes: u32,
    /// The sender's link divided among the incast flows it receives, per unit of weight;
    /// 0 when it receives none.
    pub incast_bytes_per_sec: f64,
}

/// A body's plaintext: its kind byte, then its layout. Entries beyond
/// [`MAX_DEMAND_ENTRIES`] are the caller's error (the channel never builds one): they are
/// cut.
pub fn encode_body(body: &Body) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAX_PLAINTEXT);
    match body {
        Body::Keepalive => out.push(KIND_KEEPALIVE),
        Body::Demand(entries) => {
            out.push(KIND_DEMAND);
            let entries = &entries[..entries.len().min(MAX_DEMAND_ENTRIES)];
            // At most 128: fits.
            out.extend_from_slice(&(entries.len() as u16).to_be_bytes());
            out.extend_from_slice(&[0, 0]);
            for e in entries {
                out.extend_from_slice(&e.tenant.0.to_be_bytes());
                out.push(class_code(e.class));
                out.push(match e.role {
                    Role::Read => 1,
                    Role::Incast => 2,
                });
                out.extend_from_slice(&e.flows.to_be_bytes());
                out.extend_from_slice(&e.weight.to_be_bytes());
            }
        }
        Body::Grant(g) => {
            out.push(KIND_GRANT);
            out.extend_from_slice(&g.fraction.to_be_bytes());
            out.extend_from_slice(&g.bytes_per_sec.to_be_bytes());
            out.extend_from_slice(&g.ops_per_sec.to_be_bytes());
            out.extend_from_slice(&g.chunk_bytes.to_be_bytes());
            out.extend_from_slice(&[0, 0, 0, 0]);
            out.extend_from_slice(&g.incast_bytes_per_sec.to_be_bytes());
        }
    }
    out
}

/// Parses an authenticated plaintext (kind byte and body), checking every field's range.
pub fn decode_body(plaintext: &[u8]) -> Result<Body, Refusal> {
    let (&kind, body) = plaintext.split_first().ok_or(Refusal::Length)?;
    parse_body(kind, body)
}

/// Parses a body of `kind`, checking every field's range. Public for the fuzz target: in
/// the channel only authenticated bodies get here.
pub fn parse_body(kind: u8, body: &[u8]) -> Result<Body, Refusal> {
    match kind {
        KIND_KEEPALIVE if body.is_empty() => Ok(Body::Keepalive),
        KIND_KEEPALIVE => Err(Refusal::Length),
        KIND_DEMAND => parse_demand(body).map(Body::Demand),
        KIND_GRANT => parse_grant(body).map(Body::Grant),
        _ => Err(Refusal::Kind),
    }
}

fn parse_demand(body: &[u8]) -> Result<Vec<DemandEntry>, Refusal> {
    if body.len() < 4 {
        return Err(Refusal::Length);
    }
    let count = usize::from(u16::from_be_bytes([body[0], body[1]]));
    if count > MAX_DEMAND_ENTRIES {
        return Err(Refusal::OutOfRange("demand entries"));
    }
    if body.len() != 4 + count * ENTRY_LEN {
        return Err(Refusal::Length);
    }
    if body[2..4] != [0, 0] {
        return Err(Refusal::OutOfRange("demand reserved"));
    }
    let mut entries = Vec::with_capacity(count);
    for raw in body[4..].chunks_exact(ENTRY_LEN) {
        let class = match raw[8] {
            0 => FlowClass::Latency,
            1 => FlowClass::Throughput,
            2 => FlowClass::Bandwidth,
            _ => return Err(Refusal::OutOfRange("class")),
        };
        let role = match raw[9] {
            1 => Role::Read,
            2 => Role::Incast,
            _ => return Err(Refusal::OutOfRange("role")),
        };
        let flows = u16::from_be_bytes([raw[10], raw[11]]);
        if flows == 0 {
            return Err(Refusal::OutOfRange("flows"));
        }
        let weight = u32::from_be_bytes([raw[12], raw[13], raw[14], raw[15]]);
        if !(1..=MAX_WEIGHT).contains(&weight) {
            return Err(Refusal::OutOfRange("weight"));
        }
        entries.push(DemandEntry {
            tenant: TenantId(u64::from_be_bytes(take8(&raw[0..8]))),
            class,
            role,
            flows,
            weight,
        });
    }
    let mut keys: Vec<_> = entries
        .iter()
        .map(|e| (e.tenant, e.class, e.role))
        .collect();
    keys.sort_unstable();
    if keys.windows(2).any(|w| w[0] == w[1]) {
        return Err(Refusal::OutOfRange("duplicate entry"));
    }
    Ok(entries)
}

fn parse_grant(body: &[u8]) -> Result<Grant, Refusal> {
    if body.len() != GRANT_BODY_LEN {
        return Err(Refusal::Length);
    }
    let f = |at: usize| f64::from_be_bytes(take8(&body[at..at + 8]));
    let grant = Grant {
        fraction: f(0),
        bytes_per_sec: f(8),
        ops_per_sec: f(16),
        chunk_bytes: u32::from_be_bytes([body[24], body[25], body[26], body[27]]),
        incast_bytes_per_sec: f(32),
    };
    if body[28..32] != [0, 0, 0, 0] {
        return Err(Refusal::OutOfRange("grant reserved"));
    }
    if !(grant.fraction > 0.0 && grant.fraction <= 1.0) {
        return Err(Refusal::OutOfRange("fraction"));
    }
    if !(grant.bytes_per_sec > 0.0 && grant.bytes_per_sec <= MAX_BYTES_PER_SEC) {
        return Err(Refusal::OutOfRange("bytes_per_sec"));
    }
    if !(grant.ops_per_sec > 0.0 && grant.ops_per_sec <= MAX_OPS_PER_SEC) {
        return Err(Refusal::OutOfRange("ops_per_sec"));
    }
    if !(CHUNK_RANGE.0..=CHUNK_RANGE.1).contains(&grant.chunk_bytes) {
        return Err(Refusal::OutOfRange("chunk_bytes"));
    }
    let incast = grant.incast_bytes_per_sec;
    if !(incast == 0.0 || (incast > 0.0 && incast <= MAX_BYTES_PER_SEC)) {
        return Err(Refusal::OutOfRange("incast_bytes_per_sec"));
    }
    Ok(grant)
}

fn class_code(class: FlowClass) -> u8 {
    match class {
        FlowClass::Latency => 0,
        FlowClass::Throughput => 1,
        FlowClass::Bandwidth => 2,
    }
}

fn take8(bytes: &[u8]) -> [u8; 8] {
    let mut out = [0; 8];
    out.copy_from_slice(&bytes[..8]);
    out
}

fn take16(bytes: &[u8]) -> [u8; 16] {
    let mut out = [0; 16];
    out.copy_from_slice(&bytes[..16]);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn grant() -> Grant {
        Grant {
            fraction: 0.25,
            bytes_per_sec: 1.5e9,
            ops_per_sec: 7.5e6,
            chunk_bytes: 5120,
            incast_bytes_per_sec: 0.0,
        }
    }

    fn entry(tenant: u64) -> DemandEntry {
        DemandEntry {
            tenant: TenantId(tenant),
            class: FlowClass::Bandwidth,
            role: Role::Read,
            flows: 2,
            weight: 1,
        }
    }

    #[test]
    fn the_layout_is_the_documented_one() {
        let init = initiation(NodeId([1; 16]), 0x0102_0304, &[9; NOISE_HANDSHAKE_LEN]);
        assert_eq!(init.len() + MAC_LEN, 92);
        assert_eq!(&init[..8], b"JSPC\x03\x01\x00\x00");
        assert_eq!(&init[24..28], &[1, 2, 3, 4]);
        let resp = response(5, 6, &[9; NOISE_HANDSHAKE_LEN]);
        assert_eq!(resp.len() + MAC_LEN, 80);
        assert_eq!(&resp[5..16], &[2, 0, 0, 0, 0, 0, 5, 0, 0, 0, 6]);
        let t = transport_header(7, 8);
        assert_eq!(
            &t[..],
            b"JSPC\x03\x03\x00\x00\x00\x00\x00\x07\x00\x00\x00\x00\x00\x00\x00\x08"
        );
        let g = encode_body(&Body::Grant(grant()));
        assert_eq!(g.len(), 1 + 40);
        assert_eq!(&g[1..9], &0.25f64.to_be_bytes());
        let d = encode_body(&Body::Demand(vec![entry(5)]));
        assert_eq!(
            &d[..],
            &[1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 2, 1, 0, 2, 0, 0, 0, 1]
        );
        assert_eq!(encode_body(&Body::Keepalive), vec![0]);
        assert_eq!(MAX_DATAGRAM, 2089);
    }

    #[test]
    fn framing_errors_are_refused_before_anything_else() {
        let mut init = initiation(NodeId([1; 16]), 1, &[9; NOISE_HANDSHAKE_LEN]);
        init.extend_from_slice(&[7; MAC_LEN]);
        assert!(matches!(
            parse(&init),
            Ok(Message::Initiation {
                sender_index: 1,
                noise,
                covered,
                mac,
                ..
            }) if noise == [9; NOISE_HANDSHAKE_LEN] && covered.len() == 76 && mac == [7; MAC_LEN]
        ));
        assert_eq!(parse(&init[..7]).err(), Some(Refusal::Truncated));
        assert_eq!(
            parse(&init[..91]).err(),
            Some(Refusal::Length),
            "no whole MAC"
        );
        assert_eq!(
            parse(&init[..76]).err(),
            Some(Refusal::Length),
            "version 2's length"
        );
        assert_eq!(
            parse(&vec![0; MAX_DATAGRAM + 1]).err(),
            Some(Refusal::Oversized)
        );
        let mut bad = init.clone();
        bad[0] = b'X';
        assert_eq!(parse(&bad).err(), Some(Refusal::BadMagic));
        for old in [1, 2] {
            let mut bad = init.clone();
            bad[4] = old;
            assert_eq!(parse(&bad).err(), Some(Refusal::Version), "version {old}");
        }
        let mut bad = init.clone();
        bad[5] = 9;
        assert_eq!(parse(&bad).err(), Some(Refusal::Kind));
        let mut bad = init;
        bad[7] = 1;
        assert_eq!(parse(&bad).err(), Some(Refusal::Length));
        let short = transport_header(1, 1);
        assert_eq!(parse(&short).err(), Some(Refusal::Length), "no ciphertext");
    }

    #[test]
    fn every_field_out_of_range_is_refused_by_name() {
        let body = encode_body(&Body::Grant(grant()))[1..].to_vec();
        let cases: [(usize, [u8; 8], &str); 8] = [
            (0, 0f64.to_be_bytes(), "fraction"),
            (0, 1.5f64.to_be_bytes(), "fraction"),
            (0, f64::NAN.to_be_bytes(), "fraction"),
            (8, f64::INFINITY.to_be_bytes(), "bytes_per_sec"),
            (8, (-1f64).to_be_bytes(), "bytes_per_sec"),
            (16, 0f64.to_be_bytes(), "ops_per_sec"),
            (32, (-1f64).to_be_bytes(), "incast_bytes_per_sec"),
            (32, 2e12f64.to_be_bytes(), "incast_bytes_per_sec"),
        ];
        for (at, value, field) in cases {
            let mut b = body.clone();
            b[at..at + 8].copy_from_slice(&value);
            assert_eq!(parse_body(2, &b).err(), Some(Refusal::OutOfRange(field)));
        }
        let mut b = body.clone();
        b[24..28].copy_from_slice(&1u32.to_be_bytes());
        assert_eq!(
            parse_body(2, &b).err(),
            Some(Refusal::OutOfRange("chunk_bytes"))
        );
        assert_eq!(parse_body(9, &body).err(), Some(Refusal::Kind));
        assert_eq!(parse_body(2, &body[..39]).err(), Some(Refusal::Length));
        assert_eq!(parse_body(0, &[1]).err(), Some(Refusal::Length));
        assert_eq!(decode_body(&[]).err(), Some(Refusal::Length));

        let body = encode_body(&Body::Demand(vec![entry(1)]))[1..].to_vec();
        let cases: [(usize, u8, &str); 6] = [
            (12, 3, "class"),
            (13, 0, "role"),
            (15, 0, "flows"),
            (16, 0x7f, "weight"),
            (19, 0, "weight"),
            (2, 1, "demand reserved"),
        ];
        for (at, value, field) in cases {
            let mut b = body.clone();
            b[at] = value;
            if at == 15 {
                b[14] = 0;
            }
            assert_eq!(
                parse_body(1, &b).err(),
                Some(Refusal::OutOfRange(field)),
                "{field}"
            );
        }
        // A latency flow into the receiver is declared too: it counts there (§6.7).
        let mut b = body.clone();
        b[12] = 0; // latency
        b[13] = 2; // incast
        assert!(parse_body(1, &b).is_ok());
        let twice = encode_body(&Body::Demand(vec![entry(1), entry(1)]));
        assert_eq!(
            decode_body(&twice).err(),
            Some(Refusal::OutOfRange("duplicate entry"))
        );
        let mut b = body;
        b[1] = 2; // claims two entries, holds one
        assert_eq!(parse_body(1, &b).err(), Some(Refusal::Length));
    }

    fn arb_entry() -> impl Strategy<Value = DemandEntry> {
        (
            any::<u64>(),
            prop_oneof![
                Just((FlowClass::Latency, Role::Read)),
                Just((FlowClass::Throughput, Role::Read)),
                Just((FlowClass::Bandwidth, Role::Read)),
                Just((FlowClass::Latency, Role::Incast)),
                Just((FlowClass::Throughput, Role::Incast)),
                Just((FlowClass::Bandwidth, Role::Incast)),
            ],
            1u16..,
            1..=MAX_WEIGHT,
        )
            .prop_map(|(tenant, (class, role), flows, weight)| DemandEntry {
                tenant: TenantId(tenant),
                class,
                role,
                flows,
                weight,
            })
    }

    proptest! {
        #[test]
        fn demands_round_trip_byte_for_byte(
            entries in proptest::collection::btree_set(arb_entry(), 0..=MAX_DEMAND_ENTRIES),
        ) {
            // Distinct (tenant, class, role): keep the first of each.
            let mut seen = std::collections::BTreeSet::new();
            let entries: Vec<_> = entries
                .into_iter()
                .filter(|e| seen.insert((e.tenant, e.class, e.role)))
                .collect();
            let bytes = encode_body(&Body::Demand(entries.clone()));
            prop_assert!(TRANSPORT_HEADER_LEN + bytes.len() + TAG_LEN <= MAX_DATAGRAM);
            let back = decode_body(&bytes).unwrap();
            prop_assert_eq!(&back, &Body::Demand(entries));
            prop_assert_eq!(encode_body(&back), bytes);
        }

        #[test]
        fn grants_in_range_round_trip_and_decoded_grants_are_in_range(
            body in proptest::collection::vec(any::<u8>(), GRANT_BODY_LEN),
        ) {
            if let Ok(Body::Grant(g)) = parse_body(2, &body) {
                prop_assert!(g.fraction > 0.0 && g.fraction <= 1.0);
                prop_assert!(g.bytes_per_sec > 0.0 && g.bytes_per_sec <= MAX_BYTES_PER_SEC);
                prop_assert!(g.ops_per_sec > 0.0 && g.ops_per_sec <= MAX_OPS_PER_SEC);
                prop_assert!(g.incast_bytes_per_sec >= 0.0);
                prop_assert_eq!(&encode_body(&Body::Grant(g))[1..], &body[..]);
            }
        }

        #[test]
        fn any_bytes_are_refused_or_parsed_never_a_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            kind: u8,
        ) {
            let _ = parse(&bytes);
            if let Ok(Body::Demand(entries)) = parse_body(kind, &bytes) {
                prop_assert!(entries.iter().all(|e| e.flows >= 1 && e.weight >= 1));
            }
        }
    }
}
