//! The protocol between the daemons of two Justitia hosts, with no I/O and no clock: time
//! is handed in, datagrams are handed in and taken out (as quinn-proto does), so the
//! daemon and the simulator run the same code.
//!
//! A host A whose flows load another host B tells B so in a *demand*: its READ flows
//! against B (their data leaves B's RNIC, §4.4) and its other flows into B (incast, §6.7),
//! by tenant and class. B counts them with its own flows and answers every host that holds
//! any with a *grant*: the READ guarantee 1/(L'+B'+T') of its MaxRate per unit of weight,
//! and, when flows of two hosts or more come in, its link's share per unit of weight
//! (`justitia_core::incast`). A paces its READ and bandwidth flows to it. The same channel
//! carries the ends of the reference probe's queue pairs (a *probe offer* from the host
//! that times RDMA WRITEs against another, a *probe answer* back), so that the two
//! daemons can connect them, and *pairings*: for each of a host's shaped RC queue pairs
//! connected to another host, the side channel (a UD queue pair) of the process that owns
//! it, so that the shapers at the two ends can find each other and split two-sided
//! requests.
//!
//! | module | what it owns |
//! | --- | --- |
//! | [`keys`] | hosts' X25519 keys: parsing, the public key of a private one, degenerate keys refused |
//! | [`wire`] | the datagrams' layout (handshake and transport messages) and every field's range |
//! | [`replay`] | a session's sliding window of received counters |
//! | [`channel`] | per member: Noise KK sessions (through snow), caps, refresh, fail-open |
//!
//! Each host has its own key pair and the member list (node id and public key of every
//! host it talks to); a message is believed to come from the member whose session it
//! decrypts under, so no key holder can speak for another host, and nobody off the list
//! reaches any state.
//!
//! Every refusal is a [`Refusal`], which the daemon counts by [`Refusal::label`]. A refused
//! datagram changes no state.

pub mod channel;
pub mod keys;
pub mod replay;
pub mod wire;

use std::fmt;

/// A host's identity on the peer channel: its RDMA port's GID (on RoCE the GID holds the
/// host's IP address; on InfiniBand it is the port's GUID-based GID).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub [u8; 16]);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks_exact(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

/// Why a datagram, or a local request, was refused. A refused datagram changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Shorter than its message type's layout.
    #[error("datagram too short")]
    Truncated,
    /// Longer than the largest message of this version.
    #[error("datagram too long")]
    Oversized,
    /// Not a Justitia peer message.
    #[error("bad magic")]
    BadMagic,
    /// Another version of the protocol.
    #[error("unsupported version")]
    Version,
    /// The body length does not match the datagram or the kind's layout.
    #[error("bad length")]
    Length,
    /// The handshake or the message's tag does not check out: another key (a host claiming
    /// to be a member it is not), or altered on the way.
    #[error("authentication failed")]
    Authentication,
    /// A handshake from a host that is not a member.
    #[error("not a member")]
    NotMember,
    /// A message for a session (or handshake) this host does not hold: from before its
    /// restart, expired, or made up.
    #[error("unknown session")]
    UnknownSession,
    /// An unknown message type or kind.
    #[error("unknown message kind")]
    Kind,
    /// A field outside its range.
    #[error("{0} out of range")]
    OutOfRange(&'static str),
    /// Claims to come from this host.
    #[error("claims to come from this host")]
    FromSelf,
    /// A counter its session has accepted already, or older than its window; or a
    /// handshake initiation seen already.
    #[error("replayed")]
    Replayed,
    /// A grant from a host this one holds no flow against.
    #[error("unsolicited grant")]
    Unsolicited,
    /// More flows than a peer may hold against this host.
    #[error("too many flows from one peer")]
    TooManyFlows,
    /// The peer sends faster than its cap.
    #[error("message rate above the cap")]
    RateLimited,
}

impl Refusal {
    /// Every reason's label, for metrics that show a zero before the first refusal.
    pub const LABELS: [&'static str; 15] = [
        "truncated",
        "oversized",
        "bad_magic",
        "version",
        "length",
        "authentication",
        "not_member",
        "unknown_session",
        "kind",
        "out_of_range",
        "from_self",
        "replayed",
        "unsolicited",
        "too_many_flows",
        "rate_limited",
    ];

    /// The reason's metric label (one of [`Refusal::LABELS`]).
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Truncated => "truncated",
            Refusal::Oversized => "oversized",
            Refusal::BadMagic => "bad_magic",
            Refusal::Version => "version",
            Refusal::Length => "length",
            Refusal::Authentication => "authentication",
            Refusal::NotMember => "not_member",
            Refusal::UnknownSession => "unknown_session",
            Refusal::Kind => "kind",
            Refusal::OutOfRange(_) => "out_of_range",
            Refusal::FromSelf => "from_self",
            Refusal::Replayed => "replayed",
            Refusal::Unsolicited => "unsolicited",
            Refusal::TooManyFlows => "too_many_flows",
            Refusal::RateLimited => "rate_limited",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_distinct_and_each_reason_has_one_listed() {
        let mut labels = Refusal::LABELS.to_vec();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Refusal::LABELS.len());
        // Every variant: a new one without a label fails to compile in `label` and, listed
        // here, fails this test until LABELS has it.
        for r in [
            Refusal::Truncated,
            Refusal::Oversized,
            Refusal::BadMagic,
            Refusal::Version,
            Refusal::Length,
            Refusal::Authentication,
            Refusal::NotMember,
            Refusal::UnknownSession,
            Refusal::Kind,
            Refusal::OutOfRange("x"),
            Refusal::FromSelf,
            Refusal::Replayed,
            Refusal::Unsolicited,
            Refusal::TooManyFlows,
            Refusal::RateLimited,
        ] {
            assert!(Refusal::LABELS.contains(&r.label()));
        }
        assert_eq!(
            NodeId([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]).to_string(),
            "fe80:0000:0000:0000:0000:0000:0000:0001"
        );
    }
}
