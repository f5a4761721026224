//! The receive stage (step 5's resources): the receive buffer behind a host's port, the
//! receive pipeline's packet rate and the PCIe writes of the payload into host memory.
//!
//! Packets into a host reach the stage in the order they arrive (a host has one link in,
//! and links keep order), so the stage is a FIFO server whose finishing times follow from
//! the arrivals alone: it can be computed when a packet is put on the link, and costs no
//! event of its own. A packet is through the stage when
//!
//! ```text
//! done = max(arrival, max(free, head) + service),  service = max(payload / write rate, 1 / rx_mops)
//! ```
//!
//! where `head` is when its first bit arrived, `arrival` its last, and `free` when the
//! stage finished the packet before. The stage writes a packet as it streams in (cut
//! through), so a stage that keeps up with the link (`service` at most the packet's
//! serialization) finishes every packet the moment its last bit arrives, exactly as a host
//! without a receive stage; one that does not falls behind, and the bytes between the port
//! and the stage wait in the receive buffer. That buffer is bounded by the credits of the
//! link into the host ([`crate::switch::SendGate`]): its sender spends a packet's wire
//! bytes when it sends it and gets them back one cable delay after the stage is through
//! with it, so nothing is ever dropped.

use crate::time::{ByteTime, Picos};

/// A host's receive pipeline and PCIe writes. Invariant: `free` is the time the stage
/// finished the last packet it took, and never decreases.
#[derive(Clone, Copy, Debug)]
pub(super) struct RxStage {
    /// Time per payload byte written into host memory (zero: writes never limit).
    write: ByteTime,
    /// Least time per packet (zero: no packet-rate cap).
    per_packet: Picos,
    /// When the stage finished the last packet it took.
    free: Picos,
    /// The longest a packet waited beyond its arrival.
    peak_wait: Picos,
}

impl RxStage {
    /// A stage writing payload at `write` per byte and taking at least `per_packet` per
    /// packet.
    pub(super) fn new(write: ByteTime, per_packet: Picos) -> Self {
        RxStage {
            write,
            per_packet,
            free: 0,
            peak_wait: 0,
        }
    }

    /// Takes the next packet to arrive: its first bit arrives at `head`, its last at
    /// `arrival`, and it carries `payload` bytes to write. Returns when the stage is
    /// through with it. Packets must be taken in the order they arrive.
    pub(super) fn take(&mut self, head: Picos, arrival: Picos, payload: u32) -> Picos {
        let service = self.write.of(u64::from(payload)).max(self.per_packet);
        let done = arrival.max(self.free.max(head) + service);
        self.free = done;
        self.peak_wait = self.peak_wait.max(done - arrival);
        done
    }

    /// After the packet just taken, the stage spends `extra` more before the next one
    /// (an RNR NAK's handling): returns when it is through.
    pub(super) fn hold(&mut self, extra: Picos) -> Picos {
        self.free += extra;
        self.free
    }

    /// The longest any packet waited in the receive buffer beyond its arrival.
    pub(super) fn peak_wait(&self) -> Picos {
        self.peak_wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EventQueue;
    use crate::rnic::testing::{dispatch, end, quiet_profile, two_hosts, TestEvent};
    use crate::rnic::{Opcode, Upcall, WorkRequest};
    use crate::switch::SendGate;
    use crate::topology::LinkId;

    /// Two quiet RoCE-100 hosts back to back, the receiver writing at `write_gbps` behind a
    /// 32 KB receive buffer (none when 0): host 0 WRITEs 1 MiB to host 1. Returns when its
    /// completion is visible, and the fewest credits host 0 held on lane 0.
    fn write_one_mib(write_gbps: f64) -> (Picos, i64) {
        let mut profile = quiet_profile();
        if write_gbps > 0.0 {
            profile.pcie.write_gbps = write_gbps;
            profile.rnic.rx_buffer_bytes = 32_768;
        }
        let mut f = two_hosts(&profile);
        let mut q = EventQueue::<TestEvent>::new();
        let (qp, _) = f.connect(end(0, false), end(1, false), None);
        let wr = WorkRequest {
            tag: 7,
            opcode: Opcode::Write,
            bytes: 1 << 20,
            inline: false,
        };
        f.post(qp, wr, &mut q);
        let mut fewest = i64::MAX;
        let mut completed = None;
        while let Some((at, event)) = q.pop_until(Picos::MAX) {
            if let Some(Upcall::Completions { .. }) = dispatch(&mut f, event, &mut q) {
                completed = Some(at);
            }
            if let Some(SendGate::Credits(c)) = f.switches.gate(LinkId(0)) {
                fewest = fewest.min(c[0]);
            }
        }
        (completed.unwrap_or(Picos::MAX), fewest)
    }

    #[test]
    fn a_receiver_writing_slower_than_its_port_paces_its_sender_by_credits() {
        // Both runs: the first packet starts after the post (40 ns), the doorbell (200),
        // the WQE's and the payload's DMA reads (600 each) and the WQE's processing (100):
        // 1540 ns; its head arrives 350 ns later. The last packet is through, the
        // completion follows after receive processing (120), the ACK's 86 bytes (6.88),
        // the cable (350), the requester's receive processing (120) and the CQE write
        // (200): 796.88 ns.
        let ahead = 1_540_000 + 350_000;
        let behind = 796_880;
        // Without a receive stage the last packet arrives when 256 packets of 4178 wire
        // bytes (the first 16 more) have left at 100 Gb/s: its last bit arrives
        // 85 566.72 ns after the first packet's head (both cross the same cable).
        let (free, fewest) = write_one_mib(0.0);
        assert_eq!(fewest, i64::MAX, "no receive stage: no credits");
        assert_eq!(free, ahead + 85_566_720 + behind, "unlimited");
        // Writing at 50 Gb/s, each packet's 4096 bytes take 655.36 ns: the stage, never
        // idle behind 32 KB of credits while the sender sends twice as fast, is through
        // with the last 256 x 655.36 ns after the first head arrived.
        let (paced, fewest) = write_one_mib(50.0);
        assert!(
            (0..4_194).contains(&fewest),
            "credits run down to less than a packet, never below zero: {fewest}"
        );
        assert_eq!(paced, ahead + 256 * 655_360 + behind, "written at 50 Gb/s");
    }

    #[test]
    fn a_receive_pipeline_capped_at_1_m_packets_a_second_spaces_completions_by_1_us() {
        // Eight 16 B inline WRITEs on eight queue pairs leave host 0 about 9.5 ns apart (its
        // arbiter decides 105 M times a second); host 1's pipeline takes each 1 us, so its
        // ACKs, and the completions they cause, follow 1 us apart. (The ACKs pass host 0's
        // own pipeline, 1 us each, but arrive 1 us apart, so it never holds one longer
        // than the one before.)
        let mut profile = quiet_profile();
        profile.rnic.rx_mops = 1.0;
        profile.rnic.rx_buffer_bytes = 32_768;
        let mut f = two_hosts(&profile);
        let mut q = EventQueue::<TestEvent>::new();
        for tag in 0..8 {
            let (qp, _) = f.connect(end(0, false), end(1, false), None);
            let wr = WorkRequest {
                tag,
                opcode: Opcode::Write,
                bytes: 16,
                inline: true,
            };
            f.post(qp, wr, &mut q);
        }
        let mut completed = Vec::new();
        while let Some((at, event)) = q.pop_until(Picos::MAX) {
            if let Some(Upcall::Completions { .. }) = dispatch(&mut f, event, &mut q) {
                completed.push(at);
            }
        }
        let gaps: Vec<Picos> = completed.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(gaps, [1_000_000; 7], "completions at {completed:?}");
    }

    #[test]
    fn a_stage_that_keeps_up_finishes_each_packet_as_it_arrives() {
        // 4096 B of payload at 100 Gb/s of writes take 327.68 ns; the packet's 4178 wire
        // bytes take 334.24 ns on a 100 Gb/s link, so back-to-back packets never wait.
        let mut rx = RxStage::new(ByteTime::from_gbps(100.0), 0);
        let mut arrival = 1_000_000;
        for _ in 0..10 {
            let head = arrival - 334_240;
            assert_eq!(rx.take(head, arrival, 4_096), arrival);
            arrival += 334_240;
        }
        assert_eq!(rx.peak_wait(), 0);
    }

    #[test]
    fn a_slower_writer_falls_behind_by_the_difference_per_packet() {
        // Writes at 50 Gb/s: 4096 B take 655.36 ns. The first packet (head at 0, last bit
        // at 334.24 ns) is through at 655.36 ns; each next one, arriving 334.24 ns after
        // the one before, 655.36 ns after the one before, so the k-th (from 0) waits
        // 655.36 (k + 1) - 334.24 (k + 1) ns beyond its arrival.
        let mut rx = RxStage::new(ByteTime::from_gbps(50.0), 0);
        for k in 0..8u64 {
            let head = k * 334_240;
            let done = rx.take(head, head + 334_240, 4_096);
            assert_eq!(done, (k + 1) * 655_360);
        }
        assert_eq!(rx.peak_wait(), 8 * (655_360 - 334_240));
    }

    #[test]
    fn the_packet_rate_caps_small_packets() {
        // 100 M packets/s: 10 ns each. Headers of 86 B arrive every 6.88 ns at 100 Gb/s;
        // the stage finishes them 10 ns apart.
        let mut rx = RxStage::new(ByteTime::from_gbps(0.0), 10_000);
        let done: Vec<Picos> = (0..4u64)
            .map(|k| rx.take(k * 6_880, (k + 1) * 6_880, 0))
            .collect();
        assert_eq!(done, [10_000, 20_000, 30_000, 40_000]);
    }

    #[test]
    fn an_idle_stage_waits_for_the_last_bit() {
        // A packet arriving long after the last is through when its last bit is in, even
        // if writing its payload takes less than its serialization.
        let mut rx = RxStage::new(ByteTime::from_gbps(200.0), 0);
        assert_eq!(rx.take(0, 334_240, 4_096), 334_240);
        assert_eq!(rx.take(10_000_000, 10_334_240, 4_096), 10_334_240);
    }
}
