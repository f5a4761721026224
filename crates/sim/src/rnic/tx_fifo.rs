//! The transmit FIFO between the arbiter and the wire (step 4), and the uplink it drains
//! into.

use std::collections::VecDeque;

use super::{Fabric, FabricEvents};
use crate::engine::EventQueue;
use crate::link::Packet;
use crate::time::Picos;
use crate::topology::HostId;

/// The transmit FIFO between the arbiter and the wire. Its occupancy is the wire bytes not
/// yet sent: the packet being sent drains byte by byte.
///
/// What it may hold grows with the queue pairs streaming large messages: an RNIC that
/// fetches the payload of several such messages does so in bursts of
/// [`TxFifo::burst`] bytes per queue pair, and what it fetched leaves in the order fetched,
/// so a packet of a queue pair that was idle waits behind a burst of every streaming queue
/// pair but one (the one being fetched just in time, which `capacity` covers). Invariant:
/// `streaming` counts the queue pairs whose current message is larger than `burst`, from
/// its first packet's admission to its last's (none while `burst` is 0).
pub(super) struct TxFifo {
    /// Wire bytes it holds before the arbiter stalls, with at most one queue pair streaming.
    pub(super) capacity: u32,
    /// Bytes fetched ahead per streaming queue pair beyond the first; 0: no growth.
    pub(super) burst: u32,
    /// Queue pairs streaming a message larger than `burst`.
    pub(super) streaming: u32,
    /// (start, done, wire bytes) of each packet not yet fully sent, in order.
    pub(super) queue: VecDeque<(Picos, Picos, u32)>,
    /// Wire bytes of the packets in `queue`.
    pub(super) queued: u64,
    pub(super) engine_free: Picos,
}

impl TxFifo {
    /// An empty FIFO of `capacity` bytes that grows by `burst` per streaming queue pair
    /// beyond the first.
    pub(super) fn new(capacity: u32, burst: u32) -> Self {
        TxFifo {
            capacity,
            burst,
            streaming: 0,
            queue: VecDeque::new(),
            queued: 0,
            engine_free: 0,
        }
    }

    /// Wire bytes it holds before the arbiter stalls, now.
    pub(super) fn limit(&self) -> u32 {
        self.capacity
            .saturating_add(self.burst.saturating_mul(self.streaming.saturating_sub(1)))
    }

    /// Whether a message of `payload` bytes is fetched in bursts (counts as streaming).
    pub(super) fn streams(&self, payload: u32) -> bool {
        self.burst > 0 && payload > self.burst
    }

    pub(super) fn drain(&mut self, now: Picos) {
        while let Some(&(_, done, bytes)) = self.queue.front() {
            if done > now {
                break;
            }
            self.queued -= u64::from(bytes);
            self.queue.pop_front();
        }
    }

    /// Bytes not yet sent at `now` (after [`TxFifo::drain`] to `now`).
    pub(super) fn occupancy(&self, now: Picos) -> u64 {
        let Some(&(start, done, bytes)) = self.queue.front() else {
            return 0;
        };
        let sent = if now <= start {
            0
        } else {
            u64::from(bytes) * (now - start) / (done - start).max(1)
        };
        self.queued - sent
    }

    /// True while fewer than `limit` bytes wait (the FIFO's capacity, or less for a lower
    /// lane's packet: see [`Rnic::fifo_limit`]): the arbiter pushes whole packets while
    /// there is room left, so the FIFO may overshoot by less than one packet. (A strict
    /// limit in bytes would let a 58-byte packet be refused behind two 4 KB ones, an
    /// artefact of the granularity, not a behaviour of the hardware.)
    pub(super) fn has_room(&self, now: Picos, limit: u32) -> bool {
        self.occupancy(now) < u64::from(limit)
    }

    /// The earliest time at which fewer than `limit` bytes wait, given what is queued.
    pub(super) fn room_at(&self, limit: u32) -> Picos {
        let capacity = u64::from(limit);
        let mut waiting = self.queued;
        for &(start, done, bytes) in &self.queue {
            let bytes = u64::from(bytes);
            if waiting - bytes < capacity {
                // Part way through this packet: solve for when `waiting - sent < capacity`.
                let needed = waiting - capacity + 1;
                let span = done - start;
                return start + (needed * span).div_ceil(bytes.max(1)).min(span);
            }
            waiting -= bytes;
        }
        self.engine_free
    }

    /// Queues a packet that may not start before `not_before`; returns when its last bit
    /// has left.
    pub(super) fn admit(&mut self, not_before: Picos, wire: u32, service: Picos) -> Picos {
        let start = self.engine_free.max(not_before);
        let done = start + service;
        self.engine_free = done;
        self.queue.push_back((start, done, wire));
        self.queued += u64::from(wire);
        done
    }
}

impl Fabric {
    /// Schedules the arrival of a packet whose last bit leaves `host` at `done`.
    pub(super) fn transmit<E: FabricEvents>(
        &mut self,
        host: HostId,
        packet: Packet,
        done: Picos,
        q: &mut EventQueue<E>,
    ) {
        let link_id = self.rnics[usize::from(host.0)].uplink;
        let link = self.topology.link(link_id);
        let arrival = link.arrival(done);
        if packet.payload > 0 && arrival >= self.window.0 && arrival < self.window.1 {
            self.rnics[usize::from(host.0)].payload_bytes_in_window += u64::from(packet.payload);
        }
        let head_leaves = done.saturating_sub(link.serialization(packet.wire));
        self.forward(link_id, packet, head_leaves, done, q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::ByteTime;

    #[test]
    fn the_fifo_drains_at_line_rate() {
        // At 100 Gb/s a byte takes 8 / 100 ns = 80 ps: packets of 4178 wire bytes (a 4 KB
        // payload and RoCE's 82 header bytes) admitted back to back at time 0 leave at
        // 334.24 ns, 668.48 ns and 1002.72 ns.
        let rate = ByteTime::from_gbps(100.0);
        let mut f = TxFifo::new(24_000, 0);
        let done: Vec<Picos> = (0..3).map(|_| f.admit(0, 4_178, rate.of(4_178))).collect();
        assert_eq!(done, [334_240, 668_480, 1_002_720]);
        assert_eq!(f.occupancy(0), 3 * 4_178);
        // Half way through the second packet, 1.5 packets have left.
        assert_eq!(f.occupancy(501_360), 4_178 + 4_178 / 2);
        f.drain(1_002_720);
        assert_eq!(f.occupancy(1_002_720), 0);
    }

    #[test]
    fn each_streaming_queue_pair_beyond_the_first_adds_a_burst() {
        let mut f = TxFifo::new(12_000, 32_768);
        assert!(
            !f.streams(32_768),
            "a message of one burst is fetched whole"
        );
        assert!(f.streams(32_769));
        assert_eq!(f.limit(), 12_000, "nothing streaming");
        f.streaming = 1;
        assert_eq!(f.limit(), 12_000, "the first is fetched just in time");
        f.streaming = 4;
        assert_eq!(f.limit(), 12_000 + 3 * 32_768);
        let plain = TxFifo {
            streaming: 4,
            ..TxFifo::new(12_000, 0)
        };
        assert!(!plain.streams(u32::MAX), "no bursts: nothing streams");
        assert_eq!(plain.limit(), 12_000);
    }

    #[test]
    fn fifo_drains_byte_by_byte() {
        let mut f = TxFifo::new(6_000, 0);
        assert!(f.has_room(0, f.limit()));
        assert_eq!(f.admit(0, 4_000, 400), 400);
        assert_eq!(f.admit(0, 4_000, 400), 800);
        assert!(!f.has_room(0, f.limit()), "8000 bytes wait");
        assert_eq!(
            f.occupancy(100),
            7_000,
            "a quarter of the first packet has left"
        );
        // Below 6000 bytes once more than 2000 have left: at 200 ps plus one byte's time.
        assert_eq!(f.room_at(f.limit()), 201);
        assert!(f.has_room(201, f.limit()));
        f.drain(400);
        assert_eq!(f.occupancy(400), 4_000);
        // A packet that may not start yet waits for its time, not for the queue.
        assert_eq!(f.admit(1_000, 100, 10), 1_010);
    }
}
