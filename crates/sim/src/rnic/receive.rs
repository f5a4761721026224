//! The receive side (step 5): payload counted, messages delivered, acknowledgements sent,
//! READ requests turned into response jobs.

use super::{Fabric, FabricEvents, PacketKind, QpId, ResponseJob, RnicEvent};
use crate::engine::EventQueue;
use crate::link::Packet;
use crate::time::Picos;
use crate::topology::{LinkId, NodeKind};

impl Fabric {
    /// Counts a packet's payload for its flow (if it arrives in the window) and for the
    /// message it belongs to.
    pub(super) fn count_received(&mut self, packet: &Packet, arrival: Picos) {
        if packet.payload == 0 {
            return;
        }
        let entry = &mut self.qps[packet.qp.index()];
        if packet.kind == PacketKind::Data {
            if !entry.receives {
                // Dropped: no receive to take it (`rnr`).
                return;
            }
            entry.rx_message_bytes += packet.payload;
        }
        if let Some(f) = entry.flow {
            self.flow_bytes_total[f as usize] += u64::from(packet.payload);
            self.flows_changed.mark(f);
            if arrival >= self.window.0 && arrival < self.window.1 {
                self.flow_bytes[f as usize] += u64::from(packet.payload);
            }
        }
    }

    /// Handles [`RnicEvent::PacketArrive`]: the last bit of `packet` reached the far end of
    /// `link`.
    pub(crate) fn on_packet_arrive<E: FabricEvents>(
        &mut self,
        link: LinkId,
        packet: Packet,
        q: &mut EventQueue<E>,
    ) {
        let to = self.topology.link(link).to;
        if let NodeKind::Host(host) = self.topology.node(to) {
            debug_assert_eq!(host, packet.dst);
            self.receive(packet, q);
        }
    }

    pub(super) fn receive<E: FabricEvents>(&mut self, packet: Packet, q: &mut EventQueue<E>) {
        let now = q.now();
        let c = self.costs;
        let qp = packet.qp;
        self.count_received(&packet, now);
        match packet.kind {
            PacketKind::Data => {
                if !packet.last {
                    return;
                }
                let entry = &mut self.qps[qp.index()];
                if !entry.receives {
                    self.acknowledge(qp, packet.msn, PacketKind::RnrNak, q);
                    return;
                }
                let bytes = std::mem::take(&mut entry.rx_message_bytes);
                if entry.wants_delivery {
                    q.schedule(
                        now + c.rx_process + c.dma_write,
                        RnicEvent::Deliver { qp, bytes },
                    );
                }
                self.acknowledge(qp, packet.msn, PacketKind::Ack, q);
            }
            PacketKind::ReadRequest => {
                let entry = &mut self.qps[qp.index()];
                entry.responses.push_back(ResponseJob {
                    msn: packet.msn,
                    bytes: packet.request_bytes,
                    ready_at: now + c.rx_process + c.dma_read,
                });
                self.refresh(qp, q);
            }
            PacketKind::ReadResponse => {
                if packet.last {
                    q.schedule(
                        now + c.rx_process + c.dma_write,
                        RnicEvent::CqeVisible {
                            qp,
                            upto: packet.msn,
                        },
                    );
                }
            }
            PacketKind::Ack => {
                let entry = &mut self.qps[qp.index()];
                if let Some(u) = entry.unacked.iter().find(|u| u.msn == packet.msn) {
                    if u.sent_at <= now {
                        entry.last_wire_rtt = Some((now - u.sent_at).saturating_sub(c.rx_process));
                    }
                }
                q.schedule(
                    now + c.rx_process + c.dma_write,
                    RnicEvent::CqeVisible {
                        qp,
                        upto: packet.msn,
                    },
                );
            }
            PacketKind::RnrNak => self.on_rnr_nak(qp, packet.msn, q),
        }
    }

    /// Answers the message `msn` that arrived on `qp` with an ACK or an RNR NAK (`kind`),
    /// after the receive processing; it joins the receiver's transmit FIFO.
    fn acknowledge<E: FabricEvents>(
        &mut self,
        qp: QpId,
        msn: u32,
        kind: PacketKind,
        q: &mut EventQueue<E>,
    ) {
        let c = self.costs;
        let entry = &self.qps[qp.index()];
        let (host, peer, lane) = (entry.host, entry.peer, entry.lane);
        let ack = Packet {
            kind,
            last: true,
            dst: self.qps[peer.index()].host,
            qp: peer,
            msn,
            payload: 0,
            wire: c.ack_wire,
            request_bytes: 0,
            lane,
        };
        let service = c.wire.of(u64::from(c.ack_wire));
        let h = usize::from(host.0);
        let done = self.rnics[h]
            .fifo
            .admit(q.now() + c.rx_process, c.ack_wire, service);
        let uplink = self.rnics[h].uplink;
        self.switches.spend(uplink, ack.lane, c.ack_wire);
        self.transmit(host, ack, done, q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rnic::testing::{end, quiet_profile, two_hosts, TestEvent};
    use crate::rnic::Upcall;
    use crate::topology::HostId;

    #[test]
    fn the_last_packet_of_a_message_is_delivered_and_acknowledged() {
        // A message's last 1000-byte packet reaches host 1 at time 0 on RoCE-100 (receive
        // processing 120 ns, PCIe write 200 ns, 86-byte ACKs at 80 ps a byte, 350 ns of
        // propagation). The data is delivered at 120 + 200 = 320 ns; the ACK leaves the
        // receiver's FIFO at 120 + 6.88 = 126.88 ns and reaches host 0 at 476.88 ns, whose
        // CQE is visible 120 + 200 ns later, at 796.88 ns.
        let profile = quiet_profile();
        let mut f = two_hosts(&profile);
        let mut q = EventQueue::<TestEvent>::new();
        let (a, b) = f.connect(end(0, false), end(1, true), None);
        let packet = Packet {
            kind: PacketKind::Data,
            last: true,
            dst: HostId(1),
            qp: b,
            msn: 0,
            payload: 1_000,
            wire: 1_098,
            request_bytes: 0,
            lane: 0,
        };
        f.handle(
            RnicEvent::PacketArrive {
                link: LinkId(0),
                packet,
            },
            &mut q,
        );
        let mut seen = Vec::new();
        while let Some((at, TestEvent::Rnic(event))) = q.pop_until(Picos::MAX) {
            if let RnicEvent::PacketArrive { link, packet } = event {
                assert_eq!(link, LinkId(1), "the ACK goes back on the other link");
                assert_eq!(
                    (packet.kind, packet.qp, packet.wire),
                    (PacketKind::Ack, a, 86)
                );
            }
            if let Some(up) = f.handle(event, &mut q) {
                seen.push((at, up));
            } else {
                seen.push((
                    at,
                    Upcall::Deliver {
                        qp: QpId(u32::MAX),
                        bytes: 0,
                    },
                ));
            }
        }
        assert_eq!(
            seen,
            [
                (
                    320_000,
                    Upcall::Deliver {
                        qp: b,
                        bytes: 1_000
                    }
                ),
                (
                    476_880,
                    Upcall::Deliver {
                        qp: QpId(u32::MAX),
                        bytes: 0
                    }
                ),
                (796_880, Upcall::Completions { qp: a, upto: 0 }),
            ]
        );
    }
}
