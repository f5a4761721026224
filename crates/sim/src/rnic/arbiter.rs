//! The processing units' hand-over and the arbiter (steps 2 and 3): which ready queue
//! pair sends next, one packet of at most an MTU at a time, and how a message becomes
//! packets.

use super::ready_bits::ReadyBits;
use super::{Fabric, FabricEvents, PacketKind, QpId, Rnic, RnicEvent, TxMessage, Unacked};
use crate::engine::EventQueue;
use crate::link::Packet;
use crate::model_profile::VIRTUAL_LANES;
use crate::rnic::Opcode;
use crate::time::Picos;
use crate::topology::HostId;

/// Ready queue-pair numbers in ascending order, and the lanes of those above lane 0.
/// `all` is a two-level bit set, so that listing, unlisting and finding whose turn it is
/// cost the same with thousands of ready queue pairs as with a few (a sorted vector moved a
/// whole slice on each change, an ordered tree a cache miss per level); `raised` stays a
/// sorted vector, as it is empty unless a scenario or a policy raises queue pairs, and
/// then small.
#[derive(Default)]
pub(super) struct ReadySet {
    /// Every listed number.
    all: ReadyBits,
    /// The listed numbers on a lane above 0, with their lanes: while it is empty (always,
    /// unless a queue pair was put on another lane) the turn is plain round robin over
    /// `all` and no lane is looked at.
    raised: Vec<(u32, u8)>,
}

/// The first of `list` after `n`, wrapping around, then the rest in turn.
pub(super) fn turn_after<T>(
    list: &[T],
    key: impl Fn(&T) -> u32,
    n: u32,
) -> impl Iterator<Item = &T> {
    let at = list.partition_point(|e| key(e) <= n);
    list[at..].iter().chain(&list[..at])
}

impl ReadySet {
    pub(super) fn insert(&mut self, n: u32, lane: u8) {
        // `insert` runs first: the lane is looked at only for a number newly listed.
        if self.all.insert(n) && lane > 0 {
            self.set_raised(n, lane);
        }
    }

    pub(super) fn remove(&mut self, n: u32) {
        if self.all.remove(n) && !self.raised.is_empty() {
            self.set_raised(n, 0);
        }
    }

    /// Moves a listed queue pair to another lane (nothing if it is not listed).
    pub(super) fn set_lane(&mut self, n: u32, lane: u8) {
        if self.all.contains(n) {
            self.set_raised(n, lane);
        }
    }

    /// Records `n` on `lane` in `raised` (0: not there).
    pub(super) fn set_raised(&mut self, n: u32, lane: u8) {
        match self.raised.binary_search_by_key(&n, |e| e.0) {
            Ok(at) if lane > 0 => self.raised[at].1 = lane,
            Ok(at) => {
                self.raised.remove(at);
            }
            Err(at) if lane > 0 => self.raised.insert(at, (n, lane)),
            Err(_) => {}
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    /// The highest lane with an entry above 0, if any.
    pub(super) fn top_lane(&self) -> Option<u8> {
        self.raised.iter().map(|e| e.1).max()
    }

    /// Whose turn it is: on the highest lane listed, the first number after that lane's
    /// `last_served`, wrapping around.
    pub(super) fn next(&self, last_served: &[u32; VIRTUAL_LANES]) -> Option<u32> {
        let Some(top) = self.top_lane() else {
            return self.all.after_wrapping(last_served[0]);
        };
        turn_after(&self.raised, |e| e.0, last_served[usize::from(top)])
            .find(|e| e.1 == top)
            .map(|e| e.0)
    }

    /// Every listed number in the order the arbiter would serve them if each were the only
    /// one it could send: lanes from the highest down, each from its turn on. Lazy, so that
    /// a decision that takes the first does not list every ready queue pair.
    pub(super) fn service_order<'a>(
        &'a self,
        last_served: &'a [u32; VIRTUAL_LANES],
    ) -> impl Iterator<Item = u32> + 'a {
        let n = last_served[0];
        let lane_0 = n
            .checked_add(1)
            .into_iter()
            .flat_map(|m| self.all.iter_from(m))
            .chain(self.all.iter_from(0).take_while(move |&m| m <= n));
        // Without raised queue pairs, no lane above 0 is visited and none is filtered out.
        let top = self.top_lane().unwrap_or(0);
        let raised = (1..=top).rev().flat_map(move |lane| {
            turn_after(&self.raised, |e| e.0, last_served[usize::from(lane)])
                .filter(move |e| e.1 == lane)
                .map(|e| e.0)
        });
        let rest = lane_0.filter(|&m| self.raised.binary_search_by_key(&m, |e| e.0).is_err());
        raised.chain(rest)
    }
}

impl Rnic {
    /// The ready queue pair whose turn it is.
    pub(super) fn next_in_turn(&self) -> Option<QpId> {
        self.ready.next(&self.last_served).map(QpId)
    }

    /// Below how many waiting bytes the transmit FIFO takes a packet of `lane`: its
    /// capacity, except for lane 0 on an RNIC with queue pairs on higher lanes, where a
    /// packet enters only an empty FIFO. An RNIC with strict-priority traffic classes
    /// queues each class apart and picks among them at every packet, so a higher class
    /// waits for at most the packet being sent; lane 0 entering only an empty FIFO gives
    /// that bound, and the arbiter, woken as the FIFO empties, still keeps the wire busy.
    pub(super) fn fifo_limit(&self, lane: u8) -> u32 {
        if lane == 0 && self.raised_qps > 0 {
            1
        } else {
            self.fifo.limit()
        }
    }
}

impl Fabric {
    pub(super) fn kick<E: FabricEvents>(&mut self, host: HostId, q: &mut EventQueue<E>) {
        let nic = &mut self.rnics[usize::from(host.0)];
        if !nic.arbiter_pending {
            nic.arbiter_pending = true;
            nic.arbiter_gen = nic.arbiter_gen.wrapping_add(1);
            let at = nic.next_decision.max(q.now());
            q.schedule(
                at,
                RnicEvent::ArbiterWake {
                    host,
                    gen: nic.arbiter_gen,
                },
            );
        }
    }

    /// The packet a ready queue pair would send next: (wire bytes, DMA bytes).
    pub(super) fn peek_packet(&self, qp: QpId) -> Option<(u32, u32)> {
        let q = &self.qps[qp.index()];
        let c = &self.costs;
        let (kind, remaining, first, dma) = if let Some(m) = q.current {
            (m.kind, m.remaining, m.first, m.dma)
        } else if let Some(job) = q.responses.front() {
            (PacketKind::ReadResponse, job.bytes, true, true)
        } else if let Some(w) = q.sq.front() {
            let kind = if w.opcode == Opcode::Read {
                PacketKind::ReadRequest
            } else {
                PacketKind::Data
            };
            let remaining = if kind == PacketKind::ReadRequest {
                0
            } else {
                w.bytes
            };
            (kind, remaining, true, w.dma)
        } else {
            return None;
        };
        let payload = remaining.min(c.mtu);
        let extra = if first && kind != PacketKind::ReadResponse {
            c.first_extra
        } else {
            0
        };
        Some((payload + c.header + extra, if dma { payload } else { 0 }))
    }

    /// Handles [`RnicEvent::ArbiterWake`]: admits the packet of the queue pair at the head of
    /// the arbiter into the transmit FIFO, or sleeps until the FIFO has room.
    pub(crate) fn on_arbiter_wake<E: FabricEvents>(
        &mut self,
        host: HostId,
        gen: u32,
        q: &mut EventQueue<E>,
    ) {
        let h = usize::from(host.0);
        if self.rnics[h].arbiter_gen != gen {
            return;
        }
        // `arbiter_pending` stays set while deciding, so that queue pairs made ready on the
        // way do not schedule a second wake-up.
        let now = q.now();
        let uplink = self.rnics[h].uplink;
        while let Some(turn) = self.rnics[h].next_in_turn() {
            let Some((wire, dma)) = self.peek_packet(turn) else {
                self.rnics[h].ready.remove(turn.0);
                self.qps[turn.index()].ready_listed = false;
                continue;
            };
            let (qp, wire, dma) = if self.switches.gate(uplink).is_some() {
                // Into a switch or a receive stage: the lane of the queue pair in turn may
                // lack credits, or be paused, while another's may send.
                match self.next_allowed(h) {
                    Some(found) => found,
                    None => break,
                }
            } else {
                (turn, wire, dma)
            };
            let limit = self.rnics[h].fifo_limit(self.qps[qp.index()].lane);
            let nic = &mut self.rnics[h];
            nic.fifo.drain(now);
            if !nic.fifo.has_room(now, limit) {
                let at = nic.fifo.room_at(limit);
                self.sleep_until(host, at, q);
                return;
            }
            let lane = usize::from(self.qps[qp.index()].lane);
            nic.last_served[lane] = qp.0;
            self.switches.spend(uplink, lane as u8, wire);
            self.send_packet(qp, wire, dma, q);
            self.rnics[h].next_decision = now + self.costs.decision_interval;
            if self.next_ready(qp, now) > now {
                self.rnics[h].ready.remove(qp.0);
                self.qps[qp.index()].ready_listed = false;
                self.refresh(qp, q);
            }
            if !self.rnics[h].ready.is_empty() {
                // The next packet's lane is not known yet: wake when the FIFO has room for
                // the highest lane's, and look again then.
                let nic = &self.rnics[h];
                let capacity = nic.fifo.limit();
                let at = if nic.fifo.has_room(now, capacity) {
                    nic.next_decision
                } else {
                    nic.next_decision.max(nic.fifo.room_at(capacity))
                };
                self.sleep_until(host, at, q);
                return;
            }
            break;
        }
        self.rnics[h].arbiter_pending = false;
    }

    /// The first ready queue pair in service order (highest lane first, round robin
    /// within a lane) whose next packet the uplink's gate allows, with that packet's
    /// (wire, DMA) bytes; queue pairs found with nothing to send leave the ready set.
    pub(super) fn next_allowed(&mut self, h: usize) -> Option<(QpId, u32, u32)> {
        let uplink = self.rnics[h].uplink;
        let gate = self.switches.gate(uplink)?;
        let nic = &self.rnics[h];
        // Queue pairs found empty leave the ready set after the walk, which reads it.
        let mut empty = Vec::new();
        let mut found = None;
        for n in nic.ready.service_order(&nic.last_served) {
            let qp = QpId(n);
            let Some((wire, dma)) = self.peek_packet(qp) else {
                empty.push(n);
                continue;
            };
            if gate.allows(self.qps[qp.index()].lane, wire) {
                found = Some((qp, wire, dma));
                break;
            }
        }
        for n in empty {
            self.rnics[h].ready.remove(n);
            self.qps[QpId(n).index()].ready_listed = false;
        }
        found
    }

    pub(super) fn sleep_until<E: FabricEvents>(
        &mut self,
        host: HostId,
        at: Picos,
        q: &mut EventQueue<E>,
    ) {
        let nic = &mut self.rnics[usize::from(host.0)];
        nic.arbiter_pending = true;
        nic.arbiter_gen = nic.arbiter_gen.wrapping_add(1);
        q.schedule(
            at,
            RnicEvent::ArbiterWake {
                host,
                gen: nic.arbiter_gen,
            },
        );
    }

    /// Takes the next packet of a queue pair and puts it in its RNIC's FIFO.
    pub(super) fn send_packet<E: FabricEvents>(
        &mut self,
        qp: QpId,
        wire: u32,
        dma: u32,
        q: &mut EventQueue<E>,
    ) {
        let now = q.now();
        let c = self.costs;
        let (host, peer) = {
            let e = &self.qps[qp.index()];
            (e.host, e.peer)
        };
        let h = usize::from(host.0);
        if self.qps[qp.index()].current.is_none() {
            self.start_message(qp);
        }
        let entry = &mut self.qps[qp.index()];
        let Some(mut m) = entry.current else {
            return;
        };
        let payload = m.remaining.min(c.mtu);
        m.remaining -= payload;
        m.first = false;
        let last = m.remaining == 0;
        let packet = Packet {
            kind: m.kind,
            last,
            dst: self.qps[peer.index()].host,
            qp: peer,
            msn: m.msn,
            payload,
            wire,
            request_bytes: m.request_bytes,
            lane: self.qps[qp.index()].lane,
        };
        let entry = &mut self.qps[qp.index()];
        entry.current = if last { None } else { Some(m) };
        if last && m.streaming {
            self.rnics[h].fifo.streaming -= 1;
        }
        let pcie = self.dma_time(dma) + self.tlp_time(dma, m.misalign);
        let service = c.wire.of(u64::from(wire)).max(pcie);
        let done = self.rnics[h].fifo.admit(now, wire, service);
        if last && m.kind != PacketKind::ReadResponse {
            if let Some(u) = self.qps[qp.index()]
                .unacked
                .iter_mut()
                .rev()
                .find(|u| u.msn == m.msn)
            {
                u.sent_at = done;
            }
        }
        self.transmit(host, packet, done, q);
    }

    /// Starts the message at the head of a queue pair's response queue or send queue.
    pub(super) fn start_message(&mut self, qp: QpId) {
        let entry = &mut self.qps[qp.index()];
        let message = if let Some(job) = entry.responses.pop_front() {
            TxMessage {
                kind: PacketKind::ReadResponse,
                remaining: job.bytes,
                first: true,
                msn: job.msn,
                dma: true,
                request_bytes: 0,
                streaming: false,
                misalign: 0,
            }
        } else if let Some(w) = entry.sq.pop_front() {
            let msn = entry.next_msn;
            entry.next_msn = entry.next_msn.wrapping_add(1);
            entry.unacked.push_back(Unacked {
                msn,
                tag: w.tag,
                sent_at: Picos::MAX,
                bytes: w.bytes,
                dma: w.dma,
            });
            let read = w.opcode == Opcode::Read;
            TxMessage {
                kind: if read {
                    PacketKind::ReadRequest
                } else {
                    PacketKind::Data
                },
                remaining: if read { 0 } else { w.bytes },
                first: true,
                msn,
                dma: w.dma,
                request_bytes: if read { w.bytes } else { 0 },
                streaming: false,
                misalign: match self.costs.max_payload {
                    0 => 0,
                    mps => (w.placement.at % u64::from(mps)) as u32,
                },
            }
        } else {
            return;
        };
        entry.pu_booking = None;
        let fifo = &mut self.rnics[usize::from(entry.host.0)].fifo;
        let streaming = fifo.streams(message.remaining);
        fifo.streaming += u32::from(streaming);
        entry.current = Some(TxMessage {
            streaming,
            ..message
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::*;
    use crate::rnic::testing::{dispatch, end, quiet_profile, two_hosts, unsent, TestEvent};
    use crate::rnic::{Opcode, WorkRequest};

    #[test]
    fn ready_set_turns_round_robin() {
        let mut r = ReadySet::default();
        for n in [7, 2, 5, 2] {
            r.insert(n, 0);
        }
        assert_eq!(r.all.iter_from(0).collect::<Vec<_>>(), [2, 5, 7]);
        let after = |r: &ReadySet, n| {
            let mut last = [0; VIRTUAL_LANES];
            last[0] = n;
            r.next(&last)
        };
        assert_eq!(after(&r, 2), Some(5));
        assert_eq!(after(&r, 5), Some(7));
        assert_eq!(after(&r, 7), Some(2), "wraps around");
        assert_eq!(
            after(&r, 3),
            Some(5),
            "a number that left keeps its place in the turn"
        );
        let mut last = [0; VIRTUAL_LANES];
        last[0] = 5;
        assert_eq!(r.service_order(&last).collect::<Vec<_>>(), vec![7, 2, 5]);
        r.remove(5);
        assert_eq!(after(&r, 2), Some(7));
        r.remove(2);
        r.remove(7);
        assert!(r.is_empty());
        assert_eq!(after(&r, 0), None);
    }

    #[test]
    fn ready_set_serves_the_highest_lane_first() {
        let mut r = ReadySet::default();
        for (n, lane) in [(1, 0), (3, 1), (5, 0), (7, 2), (9, 1)] {
            r.insert(n, lane);
        }
        assert_eq!(r.raised, vec![(3, 1), (7, 2), (9, 1)]);
        let mut last = [0; VIRTUAL_LANES];
        assert_eq!(r.next(&last), Some(7), "lane 2 before all others");
        assert_eq!(
            r.service_order(&last).collect::<Vec<_>>(),
            vec![7, 3, 9, 1, 5]
        );
        r.remove(7);
        assert_eq!(r.raised.len(), 2);
        last[1] = 3;
        assert_eq!(r.next(&last), Some(9), "round robin within lane 1");
        last[1] = 9;
        assert_eq!(r.next(&last), Some(3), "and around");
        assert_eq!(r.service_order(&last).collect::<Vec<_>>(), vec![3, 9, 1, 5]);
        r.set_lane(3, 0);
        r.set_lane(9, 0);
        r.set_lane(4, 3);
        assert!(r.raised.is_empty(), "a number not listed is not added");
        last[0] = 3;
        assert_eq!(r.next(&last), Some(5), "lane 0 keeps its own turn");
        assert_eq!(r.service_order(&last).collect::<Vec<_>>(), vec![5, 9, 1, 3]);
    }

    /// Three queue pairs of one host, on `lanes`, post four MTU-sized packets each at
    /// once. Returns the packets' queue pairs in the order the arbiter served them, and the
    /// queue pairs.
    fn served_order(lanes: [u8; 3]) -> (Vec<QpId>, Vec<QpId>) {
        // No randomness, so that all three are ready at the same instant.
        let profile = quiet_profile();
        let mut f = two_hosts(&profile);
        let mut q = EventQueue::<TestEvent>::new();
        let mut qps = Vec::new();
        for lane in lanes {
            let (qp, _) = f.connect(end(0, false), end(1, false), None);
            f.set_lane(qp, lane);
            let peer = f.qps[qp.index()].peer;
            assert_eq!(
                f.qps[peer.index()].lane,
                lane,
                "both ends of the connection"
            );
            qps.push(qp);
        }
        for (tag, &qp) in qps.iter().enumerate() {
            let wr = WorkRequest {
                tag: tag as u64,
                opcode: Opcode::Write,
                bytes: 4 * profile.mtu(),
                inline: false,
            };
            f.post(qp, wr, &mut q);
        }
        let mut order = Vec::new();
        while let Some((_, event)) = q.pop_until(Picos::MAX) {
            match event {
                TestEvent::Rnic(RnicEvent::QpReady(qp)) => f.on_qp_ready(qp, &mut q),
                TestEvent::Rnic(RnicEvent::ArbiterWake { host, gen }) if host == HostId(0) => {
                    let before: Vec<u64> = qps.iter().map(|&qp| unsent(&f, qp)).collect();
                    f.on_arbiter_wake(host, gen, &mut q);
                    order.extend(
                        qps.iter()
                            .zip(before)
                            .filter(|&(&qp, b)| unsent(&f, qp) < b)
                            .map(|(&qp, _)| qp),
                    );
                }
                _ => {}
            }
        }
        (order, qps)
    }

    #[test]
    fn the_arbiter_serves_queue_pairs_round_robin_one_mtu_packet_at_a_time() {
        // Three queue pairs of host 0 (numbers 0, 2 and 4; their peers on host 1 are 1, 3
        // and 5) each post a message of four MTUs at time 0. Without jitter, and each on a
        // processing unit of its own, all three become ready at the same instant, before
        // the arbiter's first decision. The turn starts after queue pair 0 (nothing served
        // yet), so the order is 2, 4, 0 four times over, and each decision takes exactly
        // one 4096-byte packet off one queue pair.
        let profile = quiet_profile();
        let mtu = u64::from(profile.mtu());
        assert_eq!(mtu, 4096);
        let mut f = two_hosts(&profile);
        let mut q = EventQueue::<TestEvent>::new();
        let qps: Vec<QpId> = (0..3)
            .map(|_| f.connect(end(0, false), end(1, false), None).0)
            .collect();
        assert_eq!(qps, [QpId(0), QpId(2), QpId(4)]);
        for (tag, &qp) in qps.iter().enumerate() {
            let wr = WorkRequest {
                tag: tag as u64,
                opcode: Opcode::Write,
                bytes: 4 * profile.mtu(),
                inline: false,
            };
            f.post(qp, wr, &mut q);
        }
        let mut served = Vec::new();
        while let Some((_, event)) = q.pop_until(Picos::MAX) {
            let before: Vec<u64> = qps.iter().map(|&qp| unsent(&f, qp)).collect();
            dispatch(&mut f, event, &mut q);
            for (&qp, b) in qps.iter().zip(before) {
                let taken = b - unsent(&f, qp);
                if taken > 0 {
                    assert_eq!(taken, mtu, "one MTU packet per decision");
                    served.push(qp.0);
                }
            }
        }
        assert_eq!(served, [2, 4, 0, 2, 4, 0, 2, 4, 0, 2, 4, 0]);
    }

    /// Host 0 of a quiet RoCE-100 (24 000-byte FIFO, 4 KB MTU) with fetch bursts of 16 KB
    /// posts one WRITE of each of `sizes` on a queue pair of its own at time 0. Returns the
    /// most wire bytes its FIFO held at any decision, and its streaming count at the end.
    fn fullest_fifo(sizes: &[u32]) -> (u64, u32) {
        let mut profile = quiet_profile();
        profile.rnic.fetch_burst_bytes = 16_384;
        let mut f = two_hosts(&profile);
        let mut q = EventQueue::<TestEvent>::new();
        for (tag, &bytes) in sizes.iter().enumerate() {
            let (qp, _) = f.connect(end(0, false), end(1, false), None);
            let wr = WorkRequest {
                tag: tag as u64,
                opcode: Opcode::Write,
                bytes,
                inline: false,
            };
            f.post(qp, wr, &mut q);
        }
        let mut fullest = 0;
        while let Some((at, event)) = q.pop_until(Picos::MAX) {
            dispatch(&mut f, event, &mut q);
            let fifo = &mut f.rnics[0].fifo;
            fifo.drain(at);
            fullest = fullest.max(fifo.occupancy(at));
        }
        (fullest, f.rnics[0].fifo.streaming)
    }

    #[test]
    fn streaming_queue_pairs_beyond_the_first_deepen_the_fifo_by_a_burst_each() {
        // A 4 KB packet is 4096 + 82 = 4178 wire bytes (the first of a message 16 more).
        // The arbiter admits whole packets while fewer bytes than the limit wait, so the
        // FIFO peaks below the limit plus one packet.
        let packet = 4_178 + 16;
        let mib = 1 << 20;
        let (one, left) = fullest_fifo(&[mib]);
        assert!(
            (24_000..24_000 + packet).contains(&one),
            "one streams: {one}"
        );
        assert_eq!(
            left, 0,
            "streaming counts each message until its last packet"
        );
        let (two, left) = fullest_fifo(&[mib, mib]);
        let limit = 24_000 + 16_384;
        assert!((limit..limit + packet).contains(&two), "two stream: {two}");
        assert_eq!(left, 0);
        let (three, _) = fullest_fifo(&[mib, mib, mib]);
        let limit = 24_000 + 2 * 16_384;
        assert!((limit..limit + packet).contains(&three), "three: {three}");
        // Messages of one burst or less are fetched whole and never deepen the FIFO.
        let (small, _) = fullest_fifo(&[16_384; 6]);
        assert!(small < 24_000 + packet, "six 16 KB messages: {small}");
    }

    #[test]
    fn a_higher_lane_is_served_first_and_lane_0_keeps_its_round_robin() {
        let (order, qps) = served_order([0, 1, 0]);
        assert_eq!(order.len(), 12, "one packet per decision: {order:?}");
        assert_eq!(order[..4], [qps[1]; 4], "lane 1 first, whole: {order:?}");
        let rest = &order[4..];
        assert!(
            rest.windows(2).all(|w| w[0] != w[1])
                && rest.iter().filter(|&&q| q == qps[0]).count() == 4,
            "the two lane-0 queue pairs alternate: {order:?}"
        );
        let (plain, qps) = served_order([0, 0, 0]);
        assert_eq!(plain.len(), 12);
        assert!(
            plain
                .windows(3)
                .all(|w| w[0] != w[1] && w[1] != w[2] && w[0] != w[2]),
            "all on lane 0: round robin over the three, {plain:?} of {qps:?}"
        );
    }
}
