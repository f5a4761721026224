//! The switch model: per-input buffers, lossless flow control (credits or PFC), input
//! arbitration at each output port, and virtual lanes.
//!
//! What a packet goes through (InfiniBand, as RPerf §II-D and §VIII describe it; RoCE
//! differs only in step 1):
//!
//! 1. **Flow control.** The sender on a link into a switch (an RNIC or another switch's
//!    output port) may send a packet of a virtual lane only when the link's `SendGate`
//!    allows it. InfiniBand: the sender holds, per lane, credits worth the input buffer of
//!    the far port (`switch.input_buffer_bytes`); it spends a packet's wire bytes when it
//!    sends it and gets them back when the packet leaves that input buffer plus one cable
//!    delay. RoCE with PFC (`switch.pfc`): an input buffer holding `xoff_bytes` or more
//!    pauses its lane at the sender one cable delay later, and one drained to `xon_bytes`
//!    resumes it the same way; a paused sender finishes the packet it is sending. Either
//!    way a sender waits and nothing is ever dropped (the profile's check keeps PFC's
//!    headroom inside the buffer). A link into a host with a receive stage
//!    (`rnic.rx_buffer_bytes`, [`crate::rnic`]) carries credits of that host's receive
//!    buffer the same way, whether a switch's output port or an RNIC sends on it.
//! 2. **Input buffer.** A packet is eligible `switch.port_latency_ns` (plus up to
//!    `switch.jitter_ns`) after its head arrived: forwarding is cut-through. Each (input
//!    port, virtual lane) is one FIFO whatever the packets' outputs, so a packet for an idle
//!    output can wait behind one for a busy output (head-of-line blocking, RPerf's two-hop
//!    case).
//! 3. **Output arbitration.** When an output port is free it picks a virtual lane (strict
//!    priority, or weighted round robin in bytes), then, among the input buffers of that
//!    lane whose head packet goes to this output, the oldest head (`fcfs`) or the next
//!    input port in turn (`round-robin`).
//!
//! Every packet that crosses a switch costs three events under credits (eligible at the
//! input, its output's next decision, its credit coming back) and two under PFC, plus one
//! per pause or resume; middle packets into a host still cost none.

use std::collections::{BTreeMap, VecDeque};

use rand_core::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;

use crate::engine::EventQueue;
use crate::link::Packet;
use crate::model_profile::{
    InputArbitration, ModelProfile, PfcParams, SwitchParams, VlArbitration, VIRTUAL_LANES,
};
use crate::time::{self, Picos};
use crate::topology::{LinkId, NodeKind, SwitchId, SwitchPorts, Topology};

/// What happens at the switches.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SwitchEvent {
    /// A packet is eligible in a switch's input buffer.
    Arrive {
        /// The switch.
        switch: u16,
        /// The input port it entered by.
        port: u8,
        /// The packet.
        packet: Packet,
    },
    /// A switch's output port picks its next packet.
    Output {
        /// The switch.
        switch: u16,
        /// The output port.
        port: u8,
    },
    /// Buffer credits reach the sender on a link into a switch (or into a host with a
    /// receive stage, whose RNIC schedules them).
    CreditReturn {
        /// The link into the switch (or the host).
        link: LinkId,
        /// The lane whose buffer space was freed.
        lane: u8,
        /// Wire bytes freed.
        bytes: u32,
    },
    /// A PFC pause or resume reaches the sender on a link into a switch.
    Pause {
        /// The link into the switch.
        link: LinkId,
        /// The lane paused or resumed.
        lane: u8,
        /// Paused (true) or resumed.
        paused: bool,
    },
}

/// What the rest of the fabric must do after a switch event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SwitchOutcome {
    /// Nothing.
    Nothing,
    /// An output port put `packet` on `link`: its first bit leaves at `head_leaves`, its
    /// last at `done`.
    Forward {
        /// The output port's link.
        link: LinkId,
        /// The packet.
        packet: Packet,
        /// When its first bit leaves.
        head_leaves: Picos,
        /// When its last bit leaves.
        done: Picos,
    },
    /// A host sending on `link` may send again (credits came back, or a lane was resumed):
    /// its arbiter may have waited.
    HostUnblocked(LinkId),
}

/// What lets the sender on a link into a switch (or into a host with a receive stage)
/// send a packet of a virtual lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SendGate {
    /// InfiniBand: per lane, credits in wire bytes; they may dip below zero only by
    /// acknowledgements, which an RNIC sends without asking.
    Credits([i64; VIRTUAL_LANES]),
    /// PFC: per lane, whether the far end has paused it.
    Paused([bool; VIRTUAL_LANES]),
}

impl SendGate {
    /// Whether a packet of `wire` bytes on `lane` may leave now.
    pub(crate) fn allows(&self, lane: u8, wire: u32) -> bool {
        match self {
            SendGate::Credits(c) => c[usize::from(lane)] >= i64::from(wire),
            SendGate::Paused(p) => !p[usize::from(lane)],
        }
    }
}

/// PFC state of one switch input port: bytes held per lane, and the lanes it has paused.
#[derive(Clone, Copy, Debug, Default)]
struct PfcInput {
    held: [u32; VIRTUAL_LANES],
    pausing: [bool; VIRTUAL_LANES],
}

/// Every switch of a run, and the send gate of every link into one or into a host with a
/// receive stage (`rnic.rx_buffer_bytes`).
pub(crate) struct Switches {
    switches: Vec<Switch>,
    /// Per link: its sender's gate when it ends at a switch, or at a host with a receive
    /// stage.
    gates: Vec<Option<SendGate>>,
    /// Per link: the (switch, port) that sends on it, when a switch does.
    sent_by_switch: Vec<Option<(usize, usize)>>,
    rng: Pcg64Mcg,
}

impl Switches {
    /// The switches of `topology`, configured by the profile's switch parameters (none
    /// without them); `seed` is the run's seed.
    pub(crate) fn new(topology: &Topology, profile: &ModelProfile, seed: u64) -> Self {
        let mut sent_by_switch = vec![None; topology.links().len()];
        let mut switches = Vec::new();
        // Hosts with a receive stage grant credits of their receive buffer, whatever the
        // fabric: an InfiniBand HCA by link-level credits, a RoCE NIC by the pause it sends
        // before that buffer overflows (modelled as the credits it stands for).
        let into_host = (profile.rnic.rx_buffer_bytes > 0)
            .then(|| SendGate::Credits([i64::from(profile.rnic.rx_buffer_bytes); VIRTUAL_LANES]));
        let into_switch = profile.switch.as_ref().map(|params| match params.pfc {
            Some(_) => SendGate::Paused([false; VIRTUAL_LANES]),
            None => SendGate::Credits([i64::from(params.input_buffer_bytes); VIRTUAL_LANES]),
        });
        let gates = topology
            .links()
            .iter()
            .map(|link| match topology.node(link.to) {
                NodeKind::Host(_) => into_host,
                NodeKind::Switch(_) => into_switch,
            })
            .collect();
        if let Some(params) = &profile.switch {
            let mtu_wire = profile.mtu() + profile.link.header_bytes;
            for (s, ports) in topology.switches().iter().enumerate() {
                for (p, port) in ports.ports.iter().enumerate() {
                    sent_by_switch[port.output.0 as usize] = Some((s, p));
                }
                switches.push(Switch::new(ports.clone(), params, mtu_wire));
            }
        }
        Switches {
            switches,
            gates,
            sent_by_switch,
            // A stream of its own, so that switch jitter does not shift the RNICs' draws.
            rng: Pcg64Mcg::seed_from_u64(seed ^ 0x0057_17C4),
        }
    }

    /// The gate of the sender on `link`, when it leads into a switch or a host with a
    /// receive stage.
    pub(crate) fn gate(&self, link: LinkId) -> Option<SendGate> {
        self.gates[link.0 as usize]
    }

    /// The sender on `link` sends `bytes` on `lane`: they come off its credits (nothing
    /// under PFC, or if the link does not lead into a switch).
    pub(crate) fn spend(&mut self, link: LinkId, lane: u8, bytes: u32) {
        if let Some(SendGate::Credits(credits)) = &mut self.gates[link.0 as usize] {
            credits[usize::from(lane)] -= i64::from(bytes);
        }
    }

    /// With PFC switches, the pause frames all of them sent (`pfc_pauses`) and the most
    /// wire bytes one input buffer lane held (`pfc_peak_held_bytes`); empty without.
    pub(crate) fn pfc_figures(&self) -> BTreeMap<String, f64> {
        let pfc: Vec<&Switch> = self.switches.iter().filter(|s| s.pfc.is_some()).collect();
        if pfc.is_empty() {
            return BTreeMap::new();
        }
        let pauses: u64 = pfc.iter().map(|s| s.pauses_sent).sum();
        let peak = pfc.iter().map(|s| s.peak_held).max().unwrap_or(0);
        BTreeMap::from([
            ("pfc_pauses".to_string(), pauses as f64),
            ("pfc_peak_held_bytes".to_string(), f64::from(peak)),
        ])
    }

    /// A packet's head reaches switch `sw` by `link` at `head_arrives`: it becomes eligible
    /// for its output after the forwarding latency and jitter, never before the packet
    /// ahead of it in the same input port.
    pub(crate) fn enter<E: Copy + From<SwitchEvent>>(
        &mut self,
        topology: &Topology,
        sw: SwitchId,
        link: LinkId,
        packet: Packet,
        head_arrives: Picos,
        q: &mut EventQueue<E>,
    ) {
        let Some(port) = topology.input_port(link) else {
            return;
        };
        let s = usize::from(sw.0);
        let switch = &mut self.switches[s];
        let jitter = if switch.jitter > 0 {
            self.rng.next_u64() % (switch.jitter + 1)
        } else {
            0
        };
        let p = usize::from(port);
        let eligible = (head_arrives + switch.latency + jitter).max(switch.last_eligible[p]);
        switch.last_eligible[p] = eligible;
        q.schedule(
            eligible,
            SwitchEvent::Arrive {
                switch: sw.0,
                port,
                packet,
            },
        );
    }

    /// Handles a switch event: the one entry point of the switches.
    pub(crate) fn handle<E: Copy + From<SwitchEvent>>(
        &mut self,
        topology: &Topology,
        event: SwitchEvent,
        q: &mut EventQueue<E>,
    ) -> SwitchOutcome {
        match event {
            SwitchEvent::Arrive {
                switch,
                port,
                packet,
            } => {
                self.on_arrive(topology, switch, port, packet, q);
                SwitchOutcome::Nothing
            }
            SwitchEvent::Output { switch, port } => self.on_output(topology, switch, port, q),
            SwitchEvent::CreditReturn { link, lane, bytes } => {
                if let Some(SendGate::Credits(credits)) = &mut self.gates[link.0 as usize] {
                    credits[usize::from(lane)] += i64::from(bytes);
                }
                self.unblock_sender(topology, link, q)
            }
            SwitchEvent::Pause { link, lane, paused } => {
                if let Some(SendGate::Paused(lanes)) = &mut self.gates[link.0 as usize] {
                    lanes[usize::from(lane)] = paused;
                }
                if paused {
                    SwitchOutcome::Nothing
                } else {
                    self.unblock_sender(topology, link, q)
                }
            }
        }
    }

    /// The packet joins its input buffer; under PFC, a buffer reaching XOFF pauses its
    /// lane upstream.
    fn on_arrive<E: Copy + From<SwitchEvent>>(
        &mut self,
        topology: &Topology,
        switch: u16,
        port: u8,
        packet: Packet,
        q: &mut EventQueue<E>,
    ) {
        let s = usize::from(switch);
        let sw = &mut self.switches[s];
        if let Some(pfc) = sw.pfc {
            let input = &mut sw.pfc_inputs[usize::from(port)];
            let lane = usize::from(packet.lane);
            input.held[lane] += packet.wire;
            sw.peak_held = sw.peak_held.max(input.held[lane]);
            if input.held[lane] >= pfc.xoff_bytes && !input.pausing[lane] {
                input.pausing[lane] = true;
                sw.pauses_sent += 1;
                let link = sw.ports.ports[usize::from(port)].input;
                q.schedule(
                    q.now() + topology.link(link).propagation(),
                    SwitchEvent::Pause {
                        link,
                        lane: packet.lane,
                        paused: true,
                    },
                );
            }
        }
        let buffer = &mut sw.inputs[usize::from(port)][usize::from(packet.lane)];
        buffer.push_back(Queued {
            entered: q.now(),
            packet,
        });
        if buffer.len() == 1 {
            let output = sw.route(&packet);
            self.kick_output(s, output, q);
        }
    }

    /// Makes sure output `output` of switch `s` decides once it is free.
    fn kick_output<E: Copy + From<SwitchEvent>>(
        &mut self,
        s: usize,
        output: usize,
        q: &mut EventQueue<E>,
    ) {
        let out = &mut self.switches[s].outputs[output];
        if !out.pending {
            out.pending = true;
            q.schedule(
                out.free_at.max(q.now()),
                SwitchEvent::Output {
                    switch: s as u16,
                    port: output as u8,
                },
            );
        }
    }

    /// The output port is free and picks its next packet, which the caller forwards.
    fn on_output<E: Copy + From<SwitchEvent>>(
        &mut self,
        topology: &Topology,
        switch: u16,
        port: u8,
        q: &mut EventQueue<E>,
    ) -> SwitchOutcome {
        let (s, o) = (usize::from(switch), usize::from(port));
        let now = q.now();
        self.switches[s].outputs[o].pending = false;
        let out_link = self.switches[s].ports.ports[o].output;
        let next_hop = self.gates[out_link.0 as usize];
        let can_send = |_: usize, p: &Packet| next_hop.is_none_or(|g| g.allows(p.lane, p.wire));
        let Some(pick) = self.switches[s].arbitrate(o, &can_send) else {
            return SwitchOutcome::Nothing;
        };
        let sw = &mut self.switches[s];
        let Some(queued) = sw.inputs[pick.input][pick.lane].pop_front() else {
            return SwitchOutcome::Nothing;
        };
        let packet = queued.packet;
        let link = topology.link(out_link);
        let done = now + link.serialization(packet.wire);
        sw.outputs[o].free_at = done;
        // The buffer space is free again: its credits travel back up the input cable, or
        // under PFC a paused lane drained to XON is resumed the same way.
        let in_link = sw.ports.ports[pick.input].input;
        let back = topology.link(in_link).propagation();
        match sw.pfc {
            None => q.schedule(
                now + back,
                SwitchEvent::CreditReturn {
                    link: in_link,
                    lane: packet.lane,
                    bytes: packet.wire,
                },
            ),
            Some(pfc) => {
                let input = &mut sw.pfc_inputs[pick.input];
                input.held[pick.lane] -= packet.wire;
                if input.pausing[pick.lane] && input.held[pick.lane] <= pfc.xon_bytes {
                    input.pausing[pick.lane] = false;
                    q.schedule(
                        now + back,
                        SwitchEvent::Pause {
                            link: in_link,
                            lane: packet.lane,
                            paused: false,
                        },
                    );
                }
            }
        }
        self.spend(out_link, packet.lane, packet.wire);
        if let Some(next) = self.switches[s].inputs[pick.input][pick.lane].front() {
            let output = self.switches[s].route(&next.packet);
            if output != o {
                self.kick_output(s, output, q);
            }
        }
        self.kick_output(s, o, q);
        SwitchOutcome::Forward {
            link: out_link,
            packet,
            head_leaves: now,
            done,
        }
    }

    /// The sender on `link` may send more: a switch's output decides again, a host is
    /// told.
    fn unblock_sender<E: Copy + From<SwitchEvent>>(
        &mut self,
        topology: &Topology,
        link: LinkId,
        q: &mut EventQueue<E>,
    ) -> SwitchOutcome {
        if let Some((s, o)) = self.sent_by_switch[link.0 as usize] {
            self.kick_output(s, o, q);
            SwitchOutcome::Nothing
        } else if let NodeKind::Host(_) = topology.node(topology.link(link).from) {
            SwitchOutcome::HostUnblocked(link)
        } else {
            SwitchOutcome::Nothing
        }
    }
}

/// A packet waiting in an input buffer, with the time it entered the switch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Queued {
    pub(crate) entered: Picos,
    pub(crate) packet: Packet,
}

/// Deficit round robin state of one output port over virtual lanes.
#[derive(Clone, Debug, Default)]
struct LaneTurn {
    lane: usize,
    deficit: [i64; VIRTUAL_LANES],
    credited: bool,
}

/// One output port.
#[derive(Clone, Debug, Default)]
pub(crate) struct OutputPort {
    /// When the port finishes sending its current packet.
    pub(crate) free_at: Picos,
    /// Whether a decision event is scheduled.
    pub(crate) pending: bool,
    /// Per lane: the input port served last (round robin).
    last_input: [usize; VIRTUAL_LANES],
    lanes: LaneTurn,
}

/// The choice of an output port: the input buffer to take the head packet from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pick {
    pub(crate) input: usize,
    pub(crate) lane: usize,
}

/// One switch's buffers and ports.
pub(crate) struct Switch {
    /// The switch's ports and routing table.
    pub(crate) ports: SwitchPorts,
    /// Per input port, per lane: the packets in the buffer, in arrival order.
    pub(crate) inputs: Vec<[VecDeque<Queued>; VIRTUAL_LANES]>,
    /// When the last packet into each input port becomes eligible (packets keep their
    /// order through jitter).
    pub(crate) last_eligible: Vec<Picos>,
    /// The output ports.
    pub(crate) outputs: Vec<OutputPort>,
    arbitration: InputArbitration,
    vl_arbitration: VlArbitration,
    quantum: [i64; VIRTUAL_LANES],
    /// Forwarding latency with an idle output.
    pub(crate) latency: Picos,
    /// Upper bound of the extra per-packet latency.
    pub(crate) jitter: Picos,
    /// PFC's thresholds, when the switch pauses its senders instead of crediting them.
    pfc: Option<PfcParams>,
    /// Per input port, what PFC counts.
    pfc_inputs: Vec<PfcInput>,
    /// Pause frames sent.
    pauses_sent: u64,
    /// The most bytes one input buffer lane has held (PFC only).
    peak_held: u32,
}

impl Switch {
    /// A switch with `ports`, configured by `params`; `mtu_wire` is the wire size of a full
    /// packet (the quantum of one unit of lane weight).
    pub(crate) fn new(ports: SwitchPorts, params: &SwitchParams, mtu_wire: u32) -> Self {
        let n = ports.ports.len();
        let mut quantum = [i64::from(mtu_wire); VIRTUAL_LANES];
        for (q, w) in quantum.iter_mut().zip(&params.vl_weights) {
            *q = i64::from(*w) * i64::from(mtu_wire);
        }
        Switch {
            ports,
            inputs: (0..n).map(|_| Default::default()).collect(),
            last_eligible: vec![0; n],
            outputs: vec![OutputPort::default(); n],
            arbitration: params.arbitration,
            vl_arbitration: params.vl_arbitration,
            quantum,
            latency: time::from_ns(params.port_latency_ns),
            jitter: time::from_ns(params.jitter_ns),
            pfc: params.pfc,
            pfc_inputs: vec![PfcInput::default(); n],
            pauses_sent: 0,
            peak_held: 0,
        }
    }

    /// The output port a packet leaves by.
    pub(crate) fn route(&self, packet: &Packet) -> usize {
        usize::from(self.ports.route[usize::from(packet.dst.0)])
    }

    /// The input buffer of `lane` whose head goes to `output` and that `can_send` allows,
    /// chosen by the input arbitration.
    fn pick_in_lane(
        &self,
        output: usize,
        lane: usize,
        can_send: &dyn Fn(usize, &Packet) -> bool,
    ) -> Option<usize> {
        let n = self.inputs.len();
        let eligible = |i: usize| {
            self.inputs[i][lane]
                .front()
                .filter(|q| self.route(&q.packet) == output && can_send(lane, &q.packet))
        };
        match self.arbitration {
            InputArbitration::Fcfs => (0..n)
                .filter_map(|i| eligible(i).map(|q| (q.entered, i)))
                .min()
                .map(|(_, i)| i),
            InputArbitration::RoundRobin => {
                let last = self.outputs[output].last_input[lane];
                (1..=n)
                    .map(|k| (last + k) % n)
                    .find(|&i| eligible(i).is_some())
            }
        }
    }

    /// Decides what `output` sends next; `None` when no input buffer has a sendable packet
    /// for it. `can_send(lane, packet)` says whether the next hop has credits for it.
    pub(crate) fn arbitrate(
        &mut self,
        output: usize,
        can_send: &dyn Fn(usize, &Packet) -> bool,
    ) -> Option<Pick> {
        let pick = match self.vl_arbitration {
            VlArbitration::Strict => (0..VIRTUAL_LANES)
                .rev()
                .find_map(|lane| self.pick_in_lane(output, lane, can_send).map(|i| (i, lane))),
            VlArbitration::Weighted => self.weighted(output, can_send),
        };
        let (input, lane) = pick?;
        self.outputs[output].last_input[lane] = input;
        Some(Pick { input, lane })
    }

    /// Deficit round robin over lanes, decided one packet at a time: a lane visited gets
    /// its quantum once and sends while its deficit covers the head packet.
    fn weighted(
        &mut self,
        output: usize,
        can_send: &dyn Fn(usize, &Packet) -> bool,
    ) -> Option<(usize, usize)> {
        let heads: [Option<(usize, i64)>; VIRTUAL_LANES] = std::array::from_fn(|lane| {
            self.pick_in_lane(output, lane, can_send).and_then(|i| {
                self.inputs[i][lane]
                    .front()
                    .map(|q| (i, i64::from(q.packet.wire)))
            })
        });
        if heads.iter().all(Option::is_none) {
            return None;
        }
        let turn = &mut self.outputs[output].lanes;
        // Each visit adds a quantum of at least one packet, so two rounds always decide.
        for _ in 0..=2 * VIRTUAL_LANES {
            let lane = turn.lane;
            match heads[lane] {
                None => {
                    turn.deficit[lane] = 0;
                    turn.credited = false;
                    turn.lane = (lane + 1) % VIRTUAL_LANES;
                }
                Some((input, wire)) => {
                    if !turn.credited {
                        turn.deficit[lane] += self.quantum[lane];
                        turn.credited = true;
                    }
                    if turn.deficit[lane] >= wire {
                        turn.deficit[lane] -= wire;
                        return Some((input, lane));
                    }
                    turn.credited = false;
                    turn.lane = (lane + 1) % VIRTUAL_LANES;
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::link::{PacketKind, QpId};
    use crate::topology::{HostId, SwitchPort};

    fn switch(arbitration: InputArbitration, vl: VlArbitration, weights: Vec<u32>) -> Switch {
        let port = |i: u32| SwitchPort {
            input: LinkId(2 * i),
            output: LinkId(2 * i + 1),
        };
        let ports = SwitchPorts {
            ports: (0..4).map(port).collect(),
            route: vec![0, 1, 2, 3],
        };
        let params = SwitchParams {
            cable_ns: 0.0,
            port_latency_ns: 100.0,
            jitter_ns: 0.0,
            input_buffer_bytes: 32_768,
            pfc: None,
            arbitration,
            vl_arbitration: vl,
            vl_weights: weights,
        };
        Switch::new(ports, &params, 1_000)
    }

    fn packet(dst: u16, wire: u32) -> Packet {
        Packet {
            kind: PacketKind::Data,
            last: true,
            dst: HostId(dst),
            qp: QpId(0),
            msn: 0,
            payload: wire,
            wire,
            request_bytes: 0,
            lane: 0,
        }
    }

    fn push(s: &mut Switch, input: usize, lane: usize, entered: Picos, wire: u32) {
        s.inputs[input][lane].push_back(Queued {
            entered,
            packet: packet(0, wire),
        });
    }

    fn serve(s: &mut Switch, n: usize) -> Vec<(usize, usize)> {
        let all = |_: usize, _: &Packet| true;
        (0..n)
            .map_while(|_| {
                let p = s.arbitrate(0, &all)?;
                s.inputs[p.input][p.lane].pop_front();
                Some((p.input, p.lane))
            })
            .collect()
    }

    #[test]
    fn fcfs_serves_the_oldest_head_and_round_robin_takes_turns() {
        let mut fcfs = switch(InputArbitration::Fcfs, VlArbitration::Strict, vec![]);
        let mut rr = switch(InputArbitration::RoundRobin, VlArbitration::Strict, vec![]);
        for s in [&mut fcfs, &mut rr] {
            // Input 1 holds three old packets; input 2's single packet came after them.
            for t in [10, 20, 30] {
                push(s, 1, 0, t, 100);
            }
            push(s, 2, 0, 35, 100);
        }
        let order: Vec<usize> = serve(&mut fcfs, 4).iter().map(|p| p.0).collect();
        assert_eq!(
            order,
            vec![1, 1, 1, 2],
            "FCFS: the late packet waits for all older ones"
        );
        let order: Vec<usize> = serve(&mut rr, 4).iter().map(|p| p.0).collect();
        assert_eq!(
            order,
            vec![1, 2, 1, 1],
            "round robin: one packet per input per turn"
        );
    }

    #[test]
    fn strict_lanes_go_first_and_weights_share_bytes() {
        let mut strict = switch(InputArbitration::Fcfs, VlArbitration::Strict, vec![]);
        push(&mut strict, 1, 0, 0, 100);
        push(&mut strict, 2, 1, 50, 100);
        assert_eq!(serve(&mut strict, 2), vec![(2, 1), (1, 0)]);

        // Lane 1 weighs 3, lane 0 weighs 1: with both backlogged, lane 1 sends three
        // packets of a quantum's size for each of lane 0.
        let mut weighted = switch(InputArbitration::Fcfs, VlArbitration::Weighted, vec![1, 3]);
        for t in 0..40 {
            push(&mut weighted, 1, 0, t, 1_000);
            push(&mut weighted, 2, 1, t, 1_000);
        }
        let served = serve(&mut weighted, 40);
        let high = served.iter().filter(|p| p.1 == 1).count();
        assert_eq!(high, 30, "{served:?}");
    }

    #[test]
    fn blocked_next_hop_is_skipped() {
        let mut s = switch(InputArbitration::Fcfs, VlArbitration::Strict, vec![]);
        push(&mut s, 1, 1, 0, 100);
        push(&mut s, 2, 0, 10, 100);
        let lane0_only = |lane: usize, _: &Packet| lane == 0;
        let p = s.arbitrate(0, &lane0_only).unwrap();
        assert_eq!((p.input, p.lane), (2, 0));
        let none = |_: usize, _: &Packet| false;
        assert_eq!(s.arbitrate(0, &none), None);
    }
}
