//! Links: serialization and propagation.
//!
//! A link carries packets one way from one node's port to another node. Its cost for a
//! packet is the serialization of the packet's wire bytes at the signalling rate plus a
//! fixed propagation delay. Links do not queue: the sender's port (the RNIC's transmit
//! FIFO, or later a switch's output queue) decides when a packet starts, so a link stays a
//! pure function of time and size and a multi-hop path is a chain of them.
//!
//! What links carry, [`Packet`], is defined here, so that the RNICs and the switches both
//! depend on the links rather than on each other.

use crate::ids::{HostId, NodeId};
use crate::model_profile::LinkParams;
use crate::time::{self, ByteTime, Picos};

/// A queue pair, unique across all hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpId(pub u32);

impl QpId {
    /// Its index in per-queue-pair tables.
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a packet is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacketKind {
    /// WRITE or SEND payload.
    Data,
    /// A READ request (header only); `request_bytes` says how much to read.
    ReadRequest,
    /// READ response payload.
    ReadResponse,
    /// An acknowledgement of all messages up to `msn`.
    Ack,
    /// A receiver-not-ready NAK: the SEND `msn` found no receive posted, and is to be sent
    /// again after the RNR timer.
    RnrNak,
}

/// One packet on the wire. Small and `Copy`: packets live inside events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    /// What it is.
    pub kind: PacketKind,
    /// Last packet of its message.
    pub last: bool,
    /// Destination host.
    pub dst: HostId,
    /// The queue pair on the destination host it is for.
    pub qp: QpId,
    /// Message sequence number on the sending queue pair (for an ACK: the acknowledged one).
    pub msn: u32,
    /// Payload bytes.
    pub payload: u32,
    /// Bytes on the wire.
    pub wire: u32,
    /// For a READ request: the bytes to read.
    pub request_bytes: u32,
    /// The virtual lane it travels on (its queue pair's service level).
    pub lane: u8,
}

/// One direction of a cable.
#[derive(Clone, Debug)]
pub struct Link {
    /// The node whose port sends on this link.
    pub from: NodeId,
    /// The node that receives.
    pub to: NodeId,
    /// Signalling rate, Gb/s.
    pub gbps: f64,
    byte_time: ByteTime,
    propagation: Picos,
}

impl Link {
    /// A link from `from` to `to` with the profile's link parameters.
    pub fn new(from: NodeId, to: NodeId, params: &LinkParams) -> Self {
        Link {
            from,
            to,
            gbps: params.gbps,
            byte_time: ByteTime::from_gbps(params.gbps),
            propagation: time::from_ns(params.propagation_ns),
        }
    }

    /// Time to serialize `wire_bytes`.
    pub fn serialization(&self, wire_bytes: u32) -> Picos {
        self.byte_time.of(u64::from(wire_bytes))
    }

    /// The one-way propagation delay.
    pub fn propagation(&self) -> Picos {
        self.propagation
    }

    /// When the last bit of a packet whose serialization ends at `sent` reaches `to`.
    pub fn arrival(&self, sent: Picos) -> Picos {
        sent + self.propagation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialization_and_propagation() {
        let params = LinkParams {
            gbps: 40.0,
            propagation_ns: 300.0,
            header_bytes: 82,
            first_packet_extra_bytes: 16,
            ack_bytes: 86,
        };
        let link = Link::new(NodeId(0), NodeId(1), &params);
        // 1106 bytes at 40 Gb/s: 221.2 ns.
        assert_eq!(link.serialization(1106), 221_200);
        assert_eq!(link.arrival(1_000), 301_000);
    }
}
