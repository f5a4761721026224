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
//!     20  n+16  AEAD of the plaintext: kind (0 keepalive, 1 demand, 2 grant, 3 probe offer,
//!               4 probe answer, 5 pairings), then the body
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
//! A probe offer's and a probe answer's body are 44 bytes each, one RC queue pair's end
//! for the reference probe ([`ProbeEndpoint`]):
//!
//! ```text
//!      0    16  gid
//!     16     4  qpn (24 bits: 1 ..= 2^24 - 1)
//!     20     4  psn, the first packet sequence number (24 bits)
//!     24     2  lid (0 on RoCE)
//!     26     2  zero
//!     28     4  rkey (0 in an offer)
//!     32     8  addr (0 in an offer)
//!     40     4  answers_qpn: the offer's qpn an answer answers (0 in an offer, never 0 in
//!               an answer)
//! ```
//!
//! A pairings body ([`Pairing`]) tells the receiver the side channel of the process at
//! the sender's end of RC queue pairs connected to it, so that the two hosts' shapers can
//! reach each other: a count (u16: 1 ..= [`MAX_PAIRINGS`]), two zero bytes, then `count`
//! entries of 16 bytes:
//!
//! ```text
//!      0     4  this_qpn: the sender's RC queue pair (24 bits: 1 ..= 2^24 - 1)
//!      4     4  that_qpn: the receiver's RC queue pair it is connected to (24 bits, not 0)
//!      8     4  side_qpn: the sender's process's side channel, a UD queue pair (24 bits,
//!               not 0)
//!     12     4  side_qkey: that queue pair's Q_Key (most significant bit 0)
//! ```
//!
//! No two entries of a message share (this_qpn, that_qpn). At most [`MAX_PAIRINGS`]
//! entries make the largest pairings body 4 + 128 x 16 = 2,052 bytes, the largest
//! demand's: [`MAX_PLAINTEXT`] and [`MAX_DATAGRAM`] hold both.
//!
//! Kinds 3, 4 and 5 came within version 3 and do not change it: a host that does not know
//! them refuses those messages alone ([`Refusal::Kind`], after the tag, before its
//! replay window or bucket is touched), as it refuses any unknown kind, and its session
//! and the other kinds go on. The channel never confirms a new session with one of them,
//! so that such a host still takes the session.
//!
//! This module frames and parses; the cryptography is the channel's (through snow) and
//! the keys module's. No field of a message names its sender for trust: the pair key
//! its MAC verifies under and the session a transport message decrypts under do.
//!
//! Invariants: [`parse`] checks the length, the magic, version and type and every fixed
//! size before anything is looked up or computed; [`parse_body`] (run only on
//! authenticated plaintext) checks every field's range (see [`Grant`], [`DemandEntry`],
//! [`ProbeEndpoint`] and [`Pairing`]);
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
/// Bytes of a probe offer's or a probe answer's body.
pub const PROBE_BODY_LEN: usize = 44;
/// Bytes of one pairing.
pub const PAIRING_LEN: usize = 16;
/// The most pairings one message carries: the largest pairings body (4 + 128 x 16 =
/// 2,052 bytes) is the largest demand's, so it adds nothing to [`MAX_DATAGRAM`].
pub const MAX_PAIRINGS: usize = 128;
/// Queue pair numbers and packet sequence numbers are 24 bits (InfiniBand and RoCE): a
/// decoded one is below this.
pub const QPN_LIMIT: u32 = 1 << 24;
/// The most entries one demand carries: a sender's (tenant, class, role) triples against
/// one peer. 128 keeps the largest datagram (2,089 bytes) within two Ethernet frames.
pub const MAX_DEMAND_ENTRIES: usize = 128;
/// The largest plaintext: a kind byte and the largest demand (a probe body is smaller, the
/// largest pairings body the same size).
pub const MAX_PLAINTEXT: usize = 1 + 4 + MAX_DEMAND_ENTRIES * ENTRY_LEN;
// The largest pairings message fits, so that no message this code sends is refused as
// oversized.
const _: () = assert!(1 + 4 + MAX_PAIRINGS * PAIRING_LEN <= MAX_PLAINTEXT);
/// The largest datagram of this version (a transport message of the largest plaintext).
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
const KIND_PROBE_OFFER: u8 = 3;
const KIND_PROBE_ANSWER: u8 = 4;
const KIND_PAIRINGS: u8 = 5;
/// A Q_Key with this bit set is "controlled": only a privileged process may give a queue
/// pair one, so no shaper's side channel (an unprivileged process's) has one.
const QKEY_CONTROLLED: u32 = 1 << 31;

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
    /// The sender's requester queue pair for the reference probe against the receiver:
    /// the receiver makes a responder queue pair for it and answers.
    ProbeOffer(ProbeEndpoint),
    /// The sender's responder queue pair for the receiver's probe offer numbered
    /// `answers_qpn`, and the memory the receiver's probe WRITEs into.
    ProbeAnswer(ProbeEndpoint),
    /// Side channels of the processes at the sender's end of RC queue pairs connected to
    /// the receiver: some of the sender's pairings toward it (1 ..= [`MAX_PAIRINGS`] of
    /// them, not necessarily all: the set goes over several messages).
    Pairings(Vec<Pairing>),
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

/// One RC queue pair's end for the reference probe (10-byte RDMA WRITEs timed from post to
/// completion): what the other host needs to connect its queue pair to this one.
///
/// Invariants of a decoded endpoint: 1 <= `qpn` < [`QPN_LIMIT`], `psn` < [`QPN_LIMIT`],
/// `answers_qpn` < [`QPN_LIMIT`]; in an offer `rkey`, `addr` and `answers_qpn` are 0, in
/// an answer `answers_qpn` is not ([`ProbeEndpoint::check_offer`],
/// [`ProbeEndpoint::check_answer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeEndpoint {
    /// The port's GID the queue pair is reached at.
    pub gid: [u8; 16],
    /// The port's LID (0 on RoCE, where the GID routes).
    pub lid: u16,
    /// The queue pair's number.
    pub qpn: u32,
    /// The first packet sequence number it sends (a requester) or expects (a responder).
    pub psn: u32,
    /// The remote key of the memory the prober WRITEs into (an answer's; 0 in an offer).
    pub rkey: u32,
    /// That memory's address (an answer's; 0 in an offer).
    pub addr: u64,
    /// The `qpn` of the offer an answer answers (0 in an offer): so that an answer to an
    /// offer since replaced is told from the answer to the current one.
    pub answers_qpn: u32,
}

/// One RC queue pair's two ends and the side channel of the process at the sender's end:
/// a shaper splits SENDs and WRITEs with immediate only when the shaper at the other end
/// of the queue pair takes part, and reaches it over its side channel (a UD queue pair,
/// one per process and device), whose number the RC queue pair's remote end does not
/// give. The receiver matches (`that_qpn`, the sender, `this_qpn`) exactly against the
/// queue pairs its own shapers reported.
///
/// Invariants of a decoded pairing: `this_qpn`, `that_qpn` and `side_qpn` in
/// 1 ..= [`QPN_LIMIT`] - 1; `side_qkey`'s most significant bit is 0
/// ([`Pairing::check`]); no two pairings of a message share (`this_qpn`, `that_qpn`).
/// The order (derived, field by field) sorts by that pair first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pairing {
    /// The sender's RC queue pair.
    pub this_qpn: u32,
    /// The receiver's RC queue pair it is connected to.
    pub that_qpn: u32,
    /// The side channel (a UD queue pair) of the sender's process that owns `this_qpn`.
    pub side_qpn: u32,
    /// That side channel's Q_Key.
    pub side_qkey: u32,
}

impl Pairing {
    /// Whether it is a pairing the wire carries (see the type's invariants).
    pub fn check(&self) -> Result<(), Refusal> {
        // QP 0 is the subnet manager's, never an RC queue pair's or a shaper's UD one: a
        // zero is a field unset.
        for (qpn, field) in [
            (self.this_qpn, "this_qpn"),
            (self.that_qpn, "that_qpn"),
            (self.side_qpn, "side_qpn"),
        ] {
            if !(1..QPN_LIMIT).contains(&qpn) {
                return Err(Refusal::OutOfRange(field));
            }
        }
        if self.side_qkey & QKEY_CONTROLLED != 0 {
            return Err(Refusal::OutOfRange("side_qkey"));
        }
        Ok(())
    }

    /// What no two pairings of a message share.
    pub fn key(&self) -> (u32, u32) {
        (self.this_qpn, self.that_qpn)
    }
}

impl ProbeEndpoint {
    /// Whether it is a probe offer the wire carries (see the type's invariants).
    pub fn check_offer(&self) -> Result<(), Refusal> {
        self.check_queue_pair()?;
        if self.rkey != 0 {
            return Err(Refusal::OutOfRange("rkey"));
        }
        if self.addr != 0 {
            return Err(Refusal::OutOfRange("addr"));
        }
        if self.answers_qpn != 0 {
            return Err(Refusal::OutOfRange("answers_qpn"));
        }
        Ok(())
    }

    /// Whether it is a probe answer the wire carries (see the type's invariants).
    pub fn check_answer(&self) -> Result<(), Refusal> {
        self.check_queue_pair()?;
        if !(1..QPN_LIMIT).contains(&self.answers_qpn) {
            return Err(Refusal::OutOfRange("answers_qpn"));
        }
        Ok(())
    }

    /// The ranges common to an offer and an answer.
    fn check_queue_pair(&self) -> Result<(), Refusal> {
        // QP 0 is the subnet manager's, never an RC queue pair's: a zero is a field unset.
        if !(1..QPN_LIMIT).contains(&self.qpn) {
            return Err(Refusal::OutOfRange("qpn"));
        }
        if self.psn >= QPN_LIMIT {
            return Err(Refusal::OutOfRange("psn"));
        }
        Ok(())
    }
}

/// A body's plaintext: its kind byte, then its layout. Entries beyond
/// [`MAX_DEMAND_ENTRIES`] or [`MAX_PAIRINGS`], and a pairings body with none (which
/// [`parse_body`] refuses), are the caller's error (the channel never builds one): the
/// entries are cut, the empty body is encoded as it is.
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
        Body::ProbeOffer(e) => {
            out.push(KIND_PROBE_OFFER);
            encode_probe(&mut out, e);
        }
        Body::ProbeAnswer(e) => {
            out.push(KIND_PROBE_ANSWER);
            encode_probe(&mut out, e);
        }
        Body::Pairings(pairings) => {
            out.push(KIND_PAIRINGS);
            let pairings = &pairings[..pairings.len().min(MAX_PAIRINGS)];
            // At most 128: fits.
            out.extend_from_slice(&(pairings.len() as u16).to_be_bytes());
            out.extend_from_slice(&[0, 0]);
            for e in pairings {
                out.extend_from_slice(&e.this_qpn.to_be_bytes());
                out.extend_from_slice(&e.that_qpn.to_be_bytes());
                out.extend_from_slice(&e.side_qpn.to_be_bytes());
                out.extend_from_slice(&e.side_qkey.to_be_bytes());
            }
        }
    }
    out
}

fn encode_probe(out: &mut Vec<u8>, e: &ProbeEndpoint) {
    out.extend_from_slice(&e.gid);
    out.extend_from_slice(&e.qpn.to_be_bytes());
    out.extend_from_slice(&e.psn.to_be_bytes());
    out.extend_from_slice(&e.lid.to_be_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&e.rkey.to_be_bytes());
    out.extend_from_slice(&e.addr.to_be_bytes());
    out.extend_from_slice(&e.answers_qpn.to_be_bytes());
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
        KIND_PROBE_OFFER => {
            let offer = parse_probe(body)?;
            offer.check_offer()?;
            Ok(Body::ProbeOffer(offer))
        }
        KIND_PROBE_ANSWER => {
            let answer = parse_probe(body)?;
            answer.check_answer()?;
            Ok(Body::ProbeAnswer(answer))
        }
        KIND_PAIRINGS => parse_pairings(body).map(Body::Pairings),
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

fn parse_pairings(body: &[u8]) -> Result<Vec<Pairing>, Refusal> {
    if body.len() < 4 {
        return Err(Refusal::Length);
    }
    let count = usize::from(u16::from_be_bytes([body[0], body[1]]));
    // None is never sent: a host with no pairings toward a peer sends no message.
    if !(1..=MAX_PAIRINGS).contains(&count) {
        return Err(Refusal::OutOfRange("pairing count"));
    }
    if body.len() != 4 + count * PAIRING_LEN {
        return Err(Refusal::Length);
    }
    if body[2..4] != [0, 0] {
        return Err(Refusal::OutOfRange("pairings reserved"));
    }
    let mut pairings = Vec::with_capacity(count);
    for raw in body[4..].chunks_exact(PAIRING_LEN) {
        let u32_at =
            |at: usize| u32::from_be_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]);
        let pairing = Pairing {
            this_qpn: u32_at(0),
            that_qpn: u32_at(4),
            side_qpn: u32_at(8),
            side_qkey: u32_at(12),
        };
        pairing.check()?;
        pairings.push(pairing);
    }
    // Two side channels for one queue pair: the receiver could not tell which is meant.
    let mut keys: Vec<_> = pairings.iter().map(Pairing::key).collect();
    keys.sort_unstable();
    if keys.windows(2).any(|w| w[0] == w[1]) {
        return Err(Refusal::OutOfRange("duplicate pairing"));
    }
    Ok(pairings)
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

/// A probe body's fields, its length and padding checked (the ranges are the kind's).
fn parse_probe(body: &[u8]) -> Result<ProbeEndpoint, Refusal> {
    if body.len() != PROBE_BODY_LEN {
        return Err(Refusal::Length);
    }
    if body[26..28] != [0, 0] {
        return Err(Refusal::OutOfRange("probe reserved"));
    }
    let u32_at =
        |at: usize| u32::from_be_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]);
    Ok(ProbeEndpoint {
        gid: take16(&body[0..16]),
        qpn: u32_at(16),
        psn: u32_at(20),
        lid: u16::from_be_bytes([body[24], body[25]]),
        rkey: u32_at(28),
        addr: u64::from_be_bytes(take8(&body[32..40])),
        answers_qpn: u32_at(40),
    })
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

    fn offer() -> ProbeEndpoint {
        ProbeEndpoint {
            gid: [0xfe; 16],
            lid: 0x0102,
            qpn: 0x00ab_cdef,
            psn: 0x0012_3456,
            rkey: 0,
            addr: 0,
            answers_qpn: 0,
        }
    }

    fn answer() -> ProbeEndpoint {
        ProbeEndpoint {
            gid: [0x11; 16],
            lid: 0,
            qpn: 0x0000_0101,
            psn: 0x00ff_ffff,
            rkey: 0x0a0b_0c0d,
            addr: 0x7f00_1234_5678_9000,
            answers_qpn: 0x00ab_cdef,
        }
    }

    fn pairing(this_qpn: u32, that_qpn: u32) -> Pairing {
        Pairing {
            this_qpn,
            that_qpn,
            side_qpn: 0x0000_0a0b,
            side_qkey: 0x1111_2222,
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
    fn probe_offers_and_answers_have_the_documented_layout_and_round_trip() {
        let o = encode_body(&Body::ProbeOffer(offer()));
        assert_eq!(o.len(), 1 + PROBE_BODY_LEN);
        assert_eq!(o[0], 3);
        assert_eq!(&o[1..17], &[0xfe; 16]);
        assert_eq!(
            &o[17..],
            &[
                0, 0xab, 0xcd, 0xef, // qpn
                0, 0x12, 0x34, 0x56, // psn
                1, 2, // lid
                0, 0, // zero
                0, 0, 0, 0, // rkey
                0, 0, 0, 0, 0, 0, 0, 0, // addr
                0, 0, 0, 0, // answers_qpn
            ]
        );
        assert_eq!(decode_body(&o), Ok(Body::ProbeOffer(offer())));
        let a = encode_body(&Body::ProbeAnswer(answer()));
        assert_eq!(a.len(), 1 + PROBE_BODY_LEN);
        assert_eq!(a[0], 4);
        assert_eq!(
            &a[29..],
            &[
                0x0a, 0x0b, 0x0c, 0x0d, // rkey
                0x7f, 0, 0x12, 0x34, 0x56, 0x78, 0x90, 0, // addr
                0, 0xab, 0xcd, 0xef, // answers_qpn
            ]
        );
        assert_eq!(decode_body(&a), Ok(Body::ProbeAnswer(answer())));
        assert!(TRANSPORT_HEADER_LEN + a.len() + TAG_LEN <= MAX_DATAGRAM);
    }

    #[test]
    fn pairings_have_the_documented_layout_and_round_trip() {
        let pairings = vec![
            pairing(0x00ab_cdef, 0x0000_0101),
            Pairing {
                this_qpn: QPN_LIMIT - 1,
                that_qpn: 1,
                side_qpn: 0x0012_3456,
                side_qkey: 0x7fff_ffff,
            },
        ];
        let b = encode_body(&Body::Pairings(pairings.clone()));
        assert_eq!(b.len(), 1 + 4 + 2 * PAIRING_LEN);
        assert_eq!(
            &b[..],
            &[
                5, // kind
                0, 2, // count
                0, 0, // zero
                0, 0xab, 0xcd, 0xef, // this_qpn
                0, 0, 1, 1, // that_qpn
                0, 0, 0x0a, 0x0b, // side_qpn
                0x11, 0x11, 0x22, 0x22, // side_qkey
                0, 0xff, 0xff, 0xff, // this_qpn
                0, 0, 0, 1, // that_qpn
                0, 0x12, 0x34, 0x56, // side_qpn
                0x7f, 0xff, 0xff, 0xff, // side_qkey
            ][..]
        );
        assert_eq!(decode_body(&b), Ok(Body::Pairings(pairings)));
        // The most a message carries is a datagram no larger than the largest demand's.
        let full: Vec<_> = (1..=MAX_PAIRINGS as u32).map(|q| pairing(q, q)).collect();
        let b = encode_body(&Body::Pairings(full.clone()));
        assert_eq!(b.len(), 1 + 4 + MAX_PAIRINGS * PAIRING_LEN);
        assert_eq!(b.len(), MAX_PLAINTEXT);
        assert_eq!(decode_body(&b), Ok(Body::Pairings(full)));
    }

    /// One field of a valid pairings body changed at a time: each is refused by name, and
    /// the count, length and padding before any entry.
    #[test]
    fn pairing_fields_out_of_range_are_refused_by_name() {
        let body = encode_body(&Body::Pairings(vec![
            pairing(0x101, 0x202),
            pairing(0x102, 0x202),
        ]))[1..]
            .to_vec();
        assert!(parse_body(5, &body).is_ok());
        assert_eq!(parse_body(5, &[]).err(), Some(Refusal::Length));
        assert_eq!(parse_body(5, &body[..3]).err(), Some(Refusal::Length));
        assert_eq!(
            parse_body(5, &body[..body.len() - 1]).err(),
            Some(Refusal::Length)
        );
        let mut long = body.clone();
        long.push(0);
        assert_eq!(parse_body(5, &long).err(), Some(Refusal::Length));
        let mut b = body.clone();
        b[1] = 1; // claims one entry, holds two
        assert_eq!(parse_body(5, &b).err(), Some(Refusal::Length));
        // None is never sent; more than a message carries is refused before the length.
        for count in [0u16, MAX_PAIRINGS as u16 + 1, u16::MAX] {
            let mut b = body.clone();
            b[0..2].copy_from_slice(&count.to_be_bytes());
            assert_eq!(
                parse_body(5, &b).err(),
                Some(Refusal::OutOfRange("pairing count")),
                "count {count}"
            );
        }
        assert_eq!(
            parse_body(5, &[0, 0, 0, 0]).err(),
            Some(Refusal::OutOfRange("pairing count"))
        );
        for at in [2, 3] {
            let mut b = body.clone();
            b[at] = 1;
            assert_eq!(
                parse_body(5, &b).err(),
                Some(Refusal::OutOfRange("pairings reserved")),
                "byte {at}"
            );
        }
        // The second entry's fields (the first entry is 4..20).
        let cases: [(usize, u32, &str); 7] = [
            (20, 0, "this_qpn"),
            (20, QPN_LIMIT, "this_qpn"),
            (24, 0, "that_qpn"),
            (24, QPN_LIMIT, "that_qpn"),
            (28, 0, "side_qpn"),
            (28, u32::MAX, "side_qpn"),
            (32, 0x8000_0000, "side_qkey"),
        ];
        for (at, value, field) in cases {
            let mut b = body.clone();
            b[at..at + 4].copy_from_slice(&value.to_be_bytes());
            assert_eq!(
                parse_body(5, &b).err(),
                Some(Refusal::OutOfRange(field)),
                "{field} {value:#x}"
            );
        }
        // The largest numbers in range, and any Q_Key below the controlled ones, are taken.
        let mut b = body.clone();
        for at in [20, 24, 28] {
            b[at..at + 4].copy_from_slice(&(QPN_LIMIT - 1).to_be_bytes());
        }
        b[32..36].copy_from_slice(&0x7fff_ffffu32.to_be_bytes());
        assert!(parse_body(5, &b).is_ok());
        // Two entries for one queue pair, with the same side channel or another.
        let mut b = body.clone();
        b[23] = 0x01; // this_qpn 0x102 -> 0x101
        assert_eq!(
            parse_body(5, &b).err(),
            Some(Refusal::OutOfRange("duplicate pairing"))
        );
        b[31] = 0x0c;
        assert_eq!(
            parse_body(5, &b).err(),
            Some(Refusal::OutOfRange("duplicate pairing"))
        );
        // The same queue pair connected to two of the receiver's is no duplicate (only the
        // receiver's match can say which is real).
        let mut b = body;
        b[23] = 0x01;
        b[27] = 0x03; // that_qpn 0x202 -> 0x203
        assert!(parse_body(5, &b).is_ok());
        // The checks the channel runs on what it is asked to send are the same.
        assert_eq!(pairing(1, 1).check(), Ok(()));
        assert_eq!(
            Pairing {
                side_qkey: 0x8000_0001,
                ..pairing(1, 1)
            }
            .check(),
            Err(Refusal::OutOfRange("side_qkey"))
        );
    }

    /// One field of a valid offer or answer changed at a time: each is refused by name,
    /// and the length and padding before any field.
    #[test]
    fn probe_fields_out_of_range_are_refused_by_name() {
        let o = encode_body(&Body::ProbeOffer(offer()))[1..].to_vec();
        let a = encode_body(&Body::ProbeAnswer(answer()))[1..].to_vec();
        for (kind, body) in [(3, &o), (4, &a)] {
            assert_eq!(parse_body(kind, &body[..43]).err(), Some(Refusal::Length));
            let mut long = body.clone();
            long.push(0);
            assert_eq!(parse_body(kind, &long).err(), Some(Refusal::Length));
            assert_eq!(parse_body(kind, &[]).err(), Some(Refusal::Length));
            let cases: [(usize, u32, &str); 4] = [
                (16, 0, "qpn"),
                (16, QPN_LIMIT, "qpn"),
                (20, QPN_LIMIT, "psn"),
                (40, QPN_LIMIT, "answers_qpn"),
            ];
            for (at, value, field) in cases {
                let mut b = body.clone();
                b[at..at + 4].copy_from_slice(&value.to_be_bytes());
                assert_eq!(
                    parse_body(kind, &b).err(),
                    Some(Refusal::OutOfRange(field)),
                    "kind {kind}: {field}"
                );
            }
            for at in [26, 27] {
                let mut b = body.clone();
                b[at] = 1;
                assert_eq!(
                    parse_body(kind, &b).err(),
                    Some(Refusal::OutOfRange("probe reserved")),
                    "kind {kind}: byte {at}"
                );
            }
            // The largest numbers in range are taken.
            let mut b = body.clone();
            b[16..20].copy_from_slice(&(QPN_LIMIT - 1).to_be_bytes());
            b[20..24].copy_from_slice(&(QPN_LIMIT - 1).to_be_bytes());
            assert!(parse_body(kind, &b).is_ok(), "kind {kind}");
        }
        // An offer names no memory and answers nothing.
        let cases: [(usize, &str); 3] = [(31, "rkey"), (39, "addr"), (43, "answers_qpn")];
        for (at, field) in cases {
            let mut b = o.clone();
            b[at] = 1;
            assert_eq!(
                parse_body(3, &b).err(),
                Some(Refusal::OutOfRange(field)),
                "offer {field}"
            );
        }
        // An answer answers some offer; its memory may be anything.
        let mut b = a.clone();
        b[40..44].copy_from_slice(&[0; 4]);
        assert_eq!(
            parse_body(4, &b).err(),
            Some(Refusal::OutOfRange("answers_qpn"))
        );
        let mut b = a;
        b[28..40].copy_from_slice(&[0; 12]);
        assert!(parse_body(4, &b).is_ok(), "rkey and addr 0");
        // The checks the channel runs on what it is asked to send are the same.
        assert_eq!(offer().check_offer(), Ok(()));
        assert_eq!(answer().check_answer(), Ok(()));
        assert_eq!(
            answer().check_offer(),
            Err(Refusal::OutOfRange("rkey")),
            "an answer is no offer"
        );
        assert_eq!(
            offer().check_answer(),
            Err(Refusal::OutOfRange("answers_qpn")),
            "an offer is no answer"
        );
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

    fn arb_probe() -> impl Strategy<Value = ProbeEndpoint> {
        (
            any::<[u8; 16]>(),
            any::<u16>(),
            1..QPN_LIMIT,
            0..QPN_LIMIT,
            any::<u32>(),
            any::<u64>(),
            1..QPN_LIMIT,
        )
            .prop_map(
                |(gid, lid, qpn, psn, rkey, addr, answers_qpn)| ProbeEndpoint {
                    gid,
                    lid,
                    qpn,
                    psn,
                    rkey,
                    addr,
                    answers_qpn,
                },
            )
    }

    fn arb_pairing() -> impl Strategy<Value = Pairing> {
        (1..QPN_LIMIT, 1..QPN_LIMIT, 1..QPN_LIMIT, 0..QKEY_CONTROLLED).prop_map(
            |(this_qpn, that_qpn, side_qpn, side_qkey)| Pairing {
                this_qpn,
                that_qpn,
                side_qpn,
                side_qkey,
            },
        )
    }

    fn arb_qpn_field() -> impl Strategy<Value = u32> {
        prop_oneof![
            Just(0),
            Just(QPN_LIMIT - 1),
            Just(QPN_LIMIT),
            1u32..4,
            1..QPN_LIMIT,
            any::<u32>(),
        ]
    }

    fn arb_qkey_field() -> impl Strategy<Value = u32> {
        prop_oneof![
            Just(QKEY_CONTROLLED - 1),
            Just(QKEY_CONTROLLED),
            0..QKEY_CONTROLLED,
            any::<u32>(),
        ]
    }

    proptest! {
        #[test]
        fn pairings_round_trip_byte_for_byte(
            pairings in proptest::collection::vec(arb_pairing(), 1..=MAX_PAIRINGS),
        ) {
            // Distinct (this_qpn, that_qpn): keep the first of each, in the order drawn.
            let mut seen = std::collections::BTreeSet::new();
            let pairings: Vec<_> = pairings.into_iter().filter(|e| seen.insert(e.key())).collect();
            let bytes = encode_body(&Body::Pairings(pairings.clone()));
            prop_assert!(TRANSPORT_HEADER_LEN + bytes.len() + TAG_LEN <= MAX_DATAGRAM);
            let back = decode_body(&bytes).unwrap();
            prop_assert_eq!(&back, &Body::Pairings(pairings));
            prop_assert_eq!(encode_body(&back), bytes);
        }

        /// Entries of edge values and small numbers (so that some share a key): a body is
        /// taken exactly when every entry is in range and no two share a key, and what is
        /// taken encodes back to the same bytes.
        #[test]
        fn decoded_pairings_are_in_range_and_encode_back(
            entries in proptest::collection::vec(
                (arb_qpn_field(), arb_qpn_field(), arb_qpn_field(), arb_qkey_field()),
                1..=4,
            ),
        ) {
            let mut body = vec![0, entries.len() as u8, 0, 0];
            for &(this, that, side, qkey) in &entries {
                for field in [this, that, side, qkey] {
                    body.extend_from_slice(&field.to_be_bytes());
                }
            }
            let in_range = entries.iter().all(|&(this, that, side, qkey)| {
                [this, that, side].iter().all(|q| (1..QPN_LIMIT).contains(q))
                    && qkey < QKEY_CONTROLLED
            });
            let keys: std::collections::BTreeSet<_> =
                entries.iter().map(|&(this, that, ..)| (this, that)).collect();
            match parse_body(5, &body) {
                Ok(Body::Pairings(pairings)) => {
                    prop_assert!(in_range && keys.len() == entries.len());
                    prop_assert!(pairings.iter().all(|e| e.check().is_ok()));
                    prop_assert_eq!(&encode_body(&Body::Pairings(pairings))[1..], &body[..]);
                }
                Ok(other) => prop_assert!(false, "{other:?}"),
                Err(_) => prop_assert!(!in_range || keys.len() < entries.len()),
            }
        }

        #[test]
        fn probe_offers_and_answers_round_trip_byte_for_byte(e in arb_probe()) {
            let offer = ProbeEndpoint { rkey: 0, addr: 0, answers_qpn: 0, ..e };
            for body in [Body::ProbeOffer(offer), Body::ProbeAnswer(e)] {
                let bytes = encode_body(&body);
                let back = decode_body(&bytes).unwrap();
                prop_assert_eq!(&back, &body);
                prop_assert_eq!(encode_body(&back), bytes);
            }
        }

        #[test]
        fn decoded_probe_bodies_are_in_range_and_encode_back(
            body in proptest::collection::vec(any::<u8>(), PROBE_BODY_LEN),
            answer: bool,
        ) {
            let kind = if answer { 4 } else { 3 };
            match parse_body(kind, &body) {
                Ok(Body::ProbeOffer(e)) => {
                    prop_assert!(!answer);
                    prop_assert_eq!(e.check_offer(), Ok(()));
                    prop_assert_eq!(&encode_body(&Body::ProbeOffer(e))[1..], &body[..]);
                }
                Ok(Body::ProbeAnswer(e)) => {
                    prop_assert!(answer);
                    prop_assert_eq!(e.check_answer(), Ok(()));
                    prop_assert_eq!(&encode_body(&Body::ProbeAnswer(e))[1..], &body[..]);
                }
                Ok(other) => prop_assert!(false, "{other:?}"),
                Err(_) => {}
            }
        }

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
