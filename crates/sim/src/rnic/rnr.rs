//! Receiver not ready (step 5's exception): a SEND that reaches a queue pair whose owner
//! posted no receive is dropped, and the responder answers it with an RNR NAK instead of
//! an ACK; the requester sends the message again after the RNR timer
//! (`rnic.rnr_timer_us`), and again after each NAK, for ever (`rnr_retry = 7`). With a
//! receive stage, the NAK's handling occupies it for `rnic.rnr_nak_ns` beyond the packet,
//! so every packet into that host waits behind it: Husky (NSDI'23, §4) finds such storms
//! of RNR NAKs slowing the responder's other tenants.
//!
//! Assumed: each NAK'd message is sent again on its own (its place in the send queue's
//! order is not kept: it goes to the back), rather than go-back-N from the oldest; with no
//! receive ever posted every message of the queue pair is NAK'd anyway. A message sent
//! again takes its place in memory anew and passes the processing unit again.

use super::{Fabric, FabricEvents, Opcode, PacketKind, QpId, Wqe};
use crate::engine::EventQueue;
use crate::link::Packet;

impl Fabric {
    /// Whether `packet` is the last packet of a SEND into a queue pair without receives:
    /// the one the responder answers with an RNR NAK.
    pub(super) fn meets_rnr(&self, packet: &Packet) -> bool {
        packet.last && packet.kind == PacketKind::Data && !self.qps[packet.qp.index()].receives
    }

    /// The owner of `qp` posts no receives: SENDs that reach it meet RNR NAKs.
    pub(crate) fn post_no_receives(&mut self, qp: QpId) {
        self.qps[qp.index()].receives = false;
    }

    /// Handles an RNR NAK of message `msn` at its requester `qp`: the message goes back
    /// into the send queue, visible to the processing unit after the RNR timer.
    pub(super) fn on_rnr_nak<E: FabricEvents>(
        &mut self,
        qp: QpId,
        msn: u32,
        q: &mut EventQueue<E>,
    ) {
        let now = q.now();
        let entry = &mut self.qps[qp.index()];
        let Some(at) = entry.unacked.iter().position(|u| u.msn == msn) else {
            return;
        };
        let Some(u) = entry.unacked.remove(at) else {
            return;
        };
        let placement = entry.memory.place(u.bytes);
        entry.sq.push_back(Wqe {
            tag: u.tag,
            opcode: Opcode::Send,
            bytes: u.bytes,
            dma: u.dma,
            visible_at: now + self.costs.rnr_timer,
            placement,
        });
        self.refresh(qp, q);
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::EventQueue;
    use crate::link::PacketKind;
    use crate::rnic::testing::{dispatch, end, quiet_profile, two_hosts, TestEvent};
    use crate::rnic::{Opcode, RnicEvent, WorkRequest};
    use crate::time::{self, Picos};
    use crate::topology::HostId;

    /// A 16 B inline SEND from host 0 into a queue pair of host 1 that posts no receives,
    /// on a quiet RoCE-100 with a receive stage (it keeps up), an RNR timer of 10 us and
    /// 500 ns of stage per NAK. Each time the SEND arrives it is NAK'd and sent again:
    ///
    /// - the receive stage handles the NAK for 500 ns, then it leaves host 1 after the
    ///   receive processing, 120 ns, takes 86 B x 80 ps = 6.88 ns on the wire and 350 ns
    ///   of propagation: at host 0 976.88 ns after the SEND;
    /// - the SEND is visible again 10 us later, processed in 100 ns, takes
    ///   114 B (16 + 82 + 16) x 80 ps = 9.12 ns on the wire and 350 ns of propagation;
    ///
    /// so it arrives every 976.88 + 10000 + 100 + 9.12 + 350 = 11436 ns, is never
    /// delivered nor completed, and none of its payload is counted.
    #[test]
    fn a_send_without_a_receive_is_sent_again_after_each_nak() {
        let mut profile = quiet_profile();
        profile.rnic.rx_buffer_bytes = 65_536;
        profile.rnic.rnr_timer_us = 10.0;
        profile.rnic.rnr_nak_ns = 500.0;
        let mut f = two_hosts(&profile);
        let mut q = EventQueue::<TestEvent>::new();
        let (a, b) = f.connect(end(0, false), end(1, true), Some(0));
        f.post_no_receives(b);
        let wr = WorkRequest {
            tag: 1,
            opcode: Opcode::Send,
            bytes: 16,
            inline: true,
        };
        f.post(a, wr, &mut q);
        let mut arrivals: Vec<Picos> = Vec::new();
        let horizon = time::from_ns(60_000.0);
        while let Some((at, event)) = q.pop_until(horizon) {
            if let TestEvent::Rnic(RnicEvent::PacketArrive { packet, .. }) = event {
                if packet.kind == PacketKind::Data && packet.dst == HostId(1) {
                    arrivals.push(at);
                }
            }
            assert_eq!(dispatch(&mut f, event, &mut q), None, "nothing completes");
        }
        assert!(arrivals.len() >= 5, "{arrivals:?}");
        for pair in arrivals.windows(2) {
            assert_eq!(pair[1] - pair[0], time::from_ns(11_436.0));
        }
        assert_eq!(f.outstanding(a), 1, "the SEND is still outstanding");
        assert_eq!(f.flow_bytes_total(0), 0, "a dropped SEND delivers nothing");
    }
}
