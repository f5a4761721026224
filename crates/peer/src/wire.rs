//! The peer message's wire format, version 1: a fixed header, a body of the kind's fixed
//! layout, and an HMAC-SHA256 tag over both with the cluster key.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "JSPC"
//!      4     1  version (1)
//!      5     1  kind (1 demand, 2 grant)
//!      6     2  body length, big-endian
//!      8    16  sender's node id (its GID)
//!     24    16  receiver's node id (its GID)
//!     40     8  sender's epoch, big-endian
//!     48     8  sequence within the epoch, big-endian
//!     56     n  body
//!   56+n    32  HMAC-SHA256(cluster key, bytes 0 .. 56+n)
//! ```
//!
//! A demand's body is a count (u16), two zero bytes, then `count` entries of 16 bytes:
//! tenant (u64), class (u8: 0 latency, 1 throughput, 2 bandwidth), role (u8: 1 READ,
//! 2 incast), flows (u16), weight (u32). A grant's body is 40 bytes: fraction, bytes/s,
//! ops/s (f64 each), chunk bytes (u32), four zero bytes, incast bytes/s per unit of weight
//! (f64, 0 when the receiver gives no incast share). All integers and floats big-endian.
//!
//! Invariants: [`decode`] checks the length, the magic and version and the body length
//! against the datagram's length before it computes the tag, and checks the tag (in
//! constant time) before it parses the body, so a datagram without the key reaches no
//! parser; every field of a decoded message is in its stated range (see [`Grant`] and
//! [`DemandEntry`]); [`encode`] of a message [`decode`] accepts gives the same bytes back.

use hmac::{Hmac, Mac};
use justitia_core::flow::{FlowClass, TenantId};
use sha2::Sha256;

use crate::{NodeId, Refusal};

/// The first bytes of every message.
pub const MAGIC: [u8; 4] = *b"JSPC";
/// The version this code speaks; a datagram of another is refused.
pub const VERSION: u8 = 1;
/// Bytes before the body.
pub const HEADER_LEN: usize = 56;
/// Bytes of the authentication tag.
pub const TAG_LEN: usize = 32;
/// Bytes of one demand entry.
pub const ENTRY_LEN: usize = 16;
/// Bytes of a grant's body.
pub const GRANT_BODY_LEN: usize = 40;
/// The most entries one demand carries: a sender's (tenant, class, role) triples against
/// one peer. 128 keeps the largest datagram (2,140 bytes) within two Ethernet frames.
pub const MAX_DEMAND_ENTRIES: usize = 128;
/// The largest datagram of version 1.
pub const MAX_DATAGRAM: usize = HEADER_LEN + 4 + MAX_DEMAND_ENTRIES * ENTRY_LEN + TAG_LEN;
/// The largest weight a demand may declare (the core's weights are relative shares; a
/// million to one is beyond any configured ratio).
pub const MAX_WEIGHT: u32 = 1_000_000;
/// The largest rate a grant may state: 10^12 bytes/s (8 Tb/s), above any RNIC.
pub const MAX_BYTES_PER_SEC: f64 = 1e12;
/// The largest operation rate a grant may state: 10^10 ops/s.
pub const MAX_OPS_PER_SEC: f64 = 1e10;
/// The smallest and largest chunk a grant may ask for.
pub const CHUNK_RANGE: (u32, u32) = (64, 1 << 30);

const KIND_DEMAND: u8 = 1;
const KIND_GRANT: u8 = 2;

type HmacSha256 = Hmac<Sha256>;

/// The pre-shared cluster key every daemon of a cluster holds (like munge's or corosync's
/// authkey). At least [`ClusterKey::MIN_LEN`] bytes.
#[derive(Clone)]
pub struct ClusterKey(Vec<u8>);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself, even in a debug log.
        write!(f, "ClusterKey({} bytes)", self.0.len())
    }
}

/// A key shorter than [`ClusterKey::MIN_LEN`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the cluster key has {0} bytes; at least 32 are needed (e.g. `head -c 32 /dev/urandom`)")]
pub struct ShortKey(pub usize);

impl ClusterKey {
    /// The fewest bytes a key may have: SHA-256's output, so the key is not the weak point.
    pub const MIN_LEN: usize = 32;

    /// A key from a key file's contents, used whole: random bytes may end in what looks
    /// like whitespace (`head -c 32 /dev/urandom` does about one time in 40), so nothing is
    /// trimmed; every host copies the same file.
    pub fn from_file_contents(bytes: &[u8]) -> Result<Self, ShortKey> {
        if bytes.len() < Self::MIN_LEN {
            return Err(ShortKey(bytes.len()));
        }
        Ok(ClusterKey(bytes.to_vec()))
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes a key of any length; this cannot fail.
        match HmacSha256::new_from_slice(&self.0) {
            Ok(mac) => mac,
            Err(_) => unreachable!("HMAC accepts keys of every length"),
        }
    }
}

/// What a message says.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
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

/// A message's header fields, as authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Who sent it.
    pub from: NodeId,
    /// Whom it is for.
    pub to: NodeId,
    /// The sender's incarnation.
    pub epoch: u64,
    /// The message's place in that incarnation.
    pub sequence: u64,
}

/// Encodes a message and signs it. Entries beyond [`MAX_DEMAND_ENTRIES`] are the caller's
/// error (the channel never builds one): they are cut.
pub fn encode(key: &ClusterKey, header: &Header, body: &Body) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + GRANT_BODY_LEN + TAG_LEN);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    let (kind, body_len) = match body {
        Body::Demand(entries) => (
            KIND_DEMAND,
            4 + entries.len().min(MAX_DEMAND_ENTRIES) * ENTRY_LEN,
        ),
        Body::Grant(_) => (KIND_GRANT, GRANT_BODY_LEN),
    };
    out.push(kind);
    // At most 4 + 128 x 16 = 2,052: fits.
    out.extend_from_slice(&(body_len as u16).to_be_bytes());
    out.extend_from_slice(&header.from.0);
    out.extend_from_slice(&header.to.0);
    out.extend_from_slice(&header.epoch.to_be_bytes());
    out.extend_from_slice(&header.sequence.to_be_bytes());
    match body {
        Body::Demand(entries) => {
            let entries = &entries[..entries.len().min(MAX_DEMAND_ENTRIES)];
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
            out.extend_from_slice(&g.fraction.to_be_bytes());
            out.extend_from_slice(&g.bytes_per_sec.to_be_bytes());
            out.extend_from_slice(&g.ops_per_sec.to_be_bytes());
            out.extend_from_slice(&g.chunk_bytes.to_be_bytes());
            out.extend_from_slice(&[0, 0, 0, 0]);
            out.extend_from_slice(&g.incast_bytes_per_sec.to_be_bytes());
        }
    }
    let mut mac = key.mac();
    mac.update(&out);
    out.extend_from_slice(&mac.finalize().into_bytes());
    out
}

/// Checks a datagram's framing and tag and parses it. See the module documentation for
/// the order of the checks.
pub fn decode(key: &ClusterKey, datagram: &[u8]) -> Result<(Header, Body), Refusal> {
    if datagram.len() < HEADER_LEN + TAG_LEN {
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
    let body_len = usize::from(u16::from_be_bytes([datagram[6], datagram[7]]));
    if HEADER_LEN + body_len + TAG_LEN != datagram.len() {
        return Err(Refusal::Length);
    }
    let (signed, tag) = datagram.split_at(HEADER_LEN + body_len);
    let mut mac = key.mac();
    mac.update(signed);
    mac.verify_slice(tag).map_err(|_| Refusal::Authentication)?;
    let header = Header {
        from: NodeId(take16(&signed[8..24])),
        to: NodeId(take16(&signed[24..40])),
        epoch: u64::from_be_bytes(take8(&signed[40..48])),
        sequence: u64::from_be_bytes(take8(&signed[48..56])),
    };
    let body = parse_body(datagram[5], &signed[HEADER_LEN..])?;
    Ok((header, body))
}

/// Parses a body of `kind` (a message's byte 5), checking every field's range. Public
/// for the fuzz target: in [`decode`] only authenticated bodies get here.
pub fn parse_body(kind: u8, body: &[u8]) -> Result<Body, Refusal> {
    match kind {
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

    fn key(byte: u8) -> ClusterKey {
        ClusterKey::from_file_contents(&[byte; 32]).unwrap()
    }

    fn header() -> Header {
        Header {
            from: NodeId([1; 16]),
            to: NodeId([2; 16]),
            epoch: 7,
            sequence: 9,
        }
    }

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
        let bytes = encode(&key(3), &header(), &Body::Grant(grant()));
        assert_eq!(bytes.len(), 56 + 40 + 32);
        assert_eq!(&bytes[..6], b"JSPC\x01\x02");
        assert_eq!(&bytes[6..8], &[0, 40]);
        assert_eq!(&bytes[40..48], &7u64.to_be_bytes());
        assert_eq!(&bytes[56..64], &0.25f64.to_be_bytes());
        let demand = encode(&key(3), &header(), &Body::Demand(vec![entry(5)]));
        assert_eq!(demand.len(), 56 + 4 + 16 + 32);
        assert_eq!(&demand[56..60], &[0, 1, 0, 0]);
        assert_eq!(
            &demand[60..76],
            &[0, 0, 0, 0, 0, 0, 0, 5, 2, 1, 0, 2, 0, 0, 0, 1]
        );
        assert_eq!(MAX_DATAGRAM, 2140);
    }

    #[test]
    fn a_key_file_is_used_whole_and_must_be_long_enough() {
        // Random bytes that end in tabs and newlines are a whole key, not a short one.
        let mut random = [0x5c; 32];
        random[29..].copy_from_slice(b"\t\n ");
        let a = ClusterKey::from_file_contents(&random).unwrap();
        let m = encode(&a, &header(), &Body::Grant(grant()));
        assert!(decode(&a, &m).is_ok());
        let mut other = random;
        other[31] = b'\n';
        assert_eq!(
            decode(&ClusterKey::from_file_contents(&other).unwrap(), &m).err(),
            Some(Refusal::Authentication),
            "every byte is the key's"
        );
        assert_eq!(
            ClusterKey::from_file_contents(b"short\n").err(),
            Some(ShortKey(6))
        );
        assert!(!format!("{a:?}").contains("5c"), "the key is never printed");
    }

    #[test]
    fn a_message_signed_with_another_key_or_altered_is_refused_as_unauthenticated() {
        let m = encode(&key(3), &header(), &Body::Demand(vec![entry(1)]));
        assert_eq!(decode(&key(4), &m).err(), Some(Refusal::Authentication));
        for at in [8, 40, 48, 57, m.len() - 1] {
            let mut forged = m.clone();
            forged[at] ^= 1;
            assert_eq!(
                decode(&key(3), &forged).err(),
                Some(Refusal::Authentication),
                "byte {at}"
            );
        }
    }

    #[test]
    fn framing_errors_are_refused_before_the_tag() {
        let k = key(3);
        let m = encode(&k, &header(), &Body::Grant(grant()));
        assert_eq!(decode(&k, &m[..80]).err(), Some(Refusal::Truncated));
        assert_eq!(
            decode(&k, &vec![0; MAX_DATAGRAM + 1]).err(),
            Some(Refusal::Oversized)
        );
        let mut bad = m.clone();
        bad[0] = b'X';
        assert_eq!(decode(&k, &bad).err(), Some(Refusal::BadMagic));
        let mut bad = m.clone();
        bad[4] = 2;
        assert_eq!(decode(&k, &bad).err(), Some(Refusal::Version));
        let mut bad = m.clone();
        bad.push(0);
        assert_eq!(decode(&k, &bad).err(), Some(Refusal::Length));
    }

    /// Signs a body of raw bytes as a message of `kind`, to show the parser's checks on
    /// authenticated but malformed input.
    fn signed_raw(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(kind);
        out.extend_from_slice(&(body.len() as u16).to_be_bytes());
        out.extend_from_slice(&[1; 16]);
        out.extend_from_slice(&[2; 16]);
        out.extend_from_slice(&[0; 16]);
        out.extend_from_slice(body);
        let mut mac = key(3).mac();
        mac.update(&out);
        out.extend_from_slice(&mac.finalize().into_bytes());
        out
    }

    #[test]
    fn every_field_out_of_range_is_refused_by_name() {
        let k = key(3);
        let good = encode(&k, &header(), &Body::Grant(grant()));
        let body = &good[56..96];
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
            let mut b = body.to_vec();
            b[at..at + 8].copy_from_slice(&value);
            assert_eq!(
                decode(&k, &signed_raw(2, &b)).err(),
                Some(Refusal::OutOfRange(field))
            );
        }
        let mut b = body.to_vec();
        b[24..28].copy_from_slice(&1u32.to_be_bytes());
        assert_eq!(
            decode(&k, &signed_raw(2, &b)).err(),
            Some(Refusal::OutOfRange("chunk_bytes"))
        );
        assert_eq!(decode(&k, &signed_raw(9, body)).err(), Some(Refusal::Kind));
        assert_eq!(
            decode(&k, &signed_raw(2, &body[..39])).err(),
            Some(Refusal::Length)
        );

        let demand = encode(&k, &header(), &Body::Demand(vec![entry(1)]));
        let body = &demand[56..76];
        let cases: [(usize, u8, &str); 6] = [
            (12, 3, "class"),
            (13, 0, "role"),
            (15, 0, "flows"),
            (16, 0x7f, "weight"),
            (19, 0, "weight"),
            (2, 1, "demand reserved"),
        ];
        for (at, value, field) in cases {
            let mut b = body.to_vec();
            b[at] = value;
            if at == 15 {
                b[14] = 0;
            }
            assert_eq!(
                decode(&k, &signed_raw(1, &b)).err(),
                Some(Refusal::OutOfRange(field)),
                "{field}"
            );
        }
        // A latency flow into the receiver is declared too: it counts there (§6.7).
        let mut b = body.to_vec();
        b[12] = 0; // latency
        b[13] = 2; // incast
        assert!(decode(&k, &signed_raw(1, &b)).is_ok());
        let twice = encode(&k, &header(), &Body::Demand(vec![entry(1), entry(1)]));
        assert_eq!(
            decode(&k, &twice).err(),
            Some(Refusal::OutOfRange("duplicate entry"))
        );
        let mut b = body.to_vec();
        b[1] = 2; // claims two entries, holds one
        assert_eq!(decode(&k, &signed_raw(1, &b)).err(), Some(Refusal::Length));
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
            epoch: u64,
            sequence: u64,
        ) {
            // Distinct (tenant, class, role): keep the first of each.
            let mut seen = std::collections::BTreeSet::new();
            let entries: Vec<_> = entries
                .into_iter()
                .filter(|e| seen.insert((e.tenant, e.class, e.role)))
                .collect();
            let h = Header { epoch, sequence, ..header() };
            let bytes = encode(&key(1), &h, &Body::Demand(entries.clone()));
            prop_assert!(bytes.len() <= MAX_DATAGRAM);
            let (back_h, back) = decode(&key(1), &bytes).unwrap();
            prop_assert_eq!(back_h, h);
            prop_assert_eq!(&back, &Body::Demand(entries));
            prop_assert_eq!(encode(&key(1), &back_h, &back), bytes);
        }

        #[test]
        fn grants_in_range_round_trip_and_decoded_grants_are_in_range(
            body in proptest::collection::vec(any::<u8>(), GRANT_BODY_LEN),
        ) {
            let bytes = signed_raw(2, &body);
            if let Ok((h, Body::Grant(g))) = decode(&key(3), &bytes) {
                prop_assert!(g.fraction > 0.0 && g.fraction <= 1.0);
                prop_assert!(g.bytes_per_sec > 0.0 && g.bytes_per_sec <= MAX_BYTES_PER_SEC);
                prop_assert!(g.ops_per_sec > 0.0 && g.ops_per_sec <= MAX_OPS_PER_SEC);
                prop_assert!(g.incast_bytes_per_sec >= 0.0);
                prop_assert_eq!(encode(&key(3), &h, &Body::Grant(g)), bytes);
            }
        }

        #[test]
        fn any_bytes_are_refused_or_parsed_never_a_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            kind: u8,
        ) {
            let _ = decode(&key(3), &bytes);
            if let Ok(Body::Demand(entries)) = parse_body(kind, &bytes) {
                prop_assert!(entries.iter().all(|e| e.flows >= 1 && e.weight >= 1));
            }
        }

        #[test]
        fn a_single_flipped_bit_is_never_accepted(at in 0usize..128, bit in 0u8..8) {
            let mut m = encode(&key(3), &header(), &Body::Grant(grant()));
            m[at] ^= 1 << bit;
            prop_assert!(decode(&key(3), &m).is_err());
        }
    }
}
