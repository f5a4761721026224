//! The RNIC model, for every host of a topology.
//!
//! What one work request goes through, and the parameter that prices each step
//! ([`crate::model_profile`]):
//!
//! 1. **Post.** The application's CPU builds the WQE (`host.post_ns`, serialized per queue
//!    pair) and rings the doorbell (`pcie.doorbell_ns`, plus an exponential
//!    `host.jitter_ns`). An inline WQE carries its payload with the doorbell; any other is
//!    fetched by a DMA read (`pcie.read_latency_ns`).
//! 2. **Processing unit.** The `i`-th queue pair of a host is served by unit
//!    `i mod rnic.processing_units`; a unit starts at most `rnic.qp_mops` messages per
//!    second, first come first served among its queue pairs, and needs
//!    `rnic.wqe_process_ns` to turn a WQE into its first packet. A non-inline payload is
//!    read from host memory first (one more DMA round trip); later packets of the message
//!    are prefetched while earlier ones are sent.
//! 3. **Arbiter.** The arbiter takes one packet (at most one MTU) from the next queue pair,
//!    in round-robin order of queue-pair number, that has a packet ready: service is
//!    round-robin over queue pairs at MTU-packet granularity, whatever the message sizes
//!    (PeRF §2.2). It decides at most `rnic.nic_mops` times per second. Queue pairs on a
//!    higher virtual lane (service level, set by the scenario's `sl` or by a policy) come
//!    first: the arbiter serves the highest lane that has a ready queue pair, round-robin
//!    within that lane with a turn of its own, as an RNIC whose traffic classes are
//!    configured for strict priority (ETS strict-priority classes, one per lane) does.
//!    Into a switch, a lane without credits for its next packet is passed over for a
//!    lower one. While every ready queue pair of an RNIC is on lane 0 (always, in
//!    scenarios without `sl` or the `priority` policy) this is plain round robin, and a
//!    decision looks at no lane.
//! 4. **Transmit FIFO.** A chosen packet enters a FIFO behind the arbiter; the arbiter
//!    stalls while the FIFO holds `rnic.tx_fifo_bytes` wire bytes or more. The FIFO
//!    drains at the wire rate, or at `pcie.read_gbps` for payload that must still be read
//!    over PCIe, whichever is slower; each payload read varies by up to
//!    ±`pcie.read_jitter_ns`, so packet departures do not form a perfect grid that a
//!    closed-loop latency flow could lock onto. This FIFO is why a small message waits
//!    behind the bandwidth flow's packets already in the pipeline (Justitia §2.4, N2).
//!    It is one FIFO for all lanes, but while an RNIC has queue pairs on a lane above 0,
//!    a lane-0 packet enters it only when it is empty: a higher lane then waits for at
//!    most the packet being sent, as behind an RNIC whose traffic classes queue apart and
//!    are picked at every packet. Not modelled: weighted (ETS bandwidth-share) classes at
//!    the RNIC, per-lane limits on the processing units, and PFC pauses per priority.
//! 5. **Receive side.** After `rnic.rx_process_ns` the receiving RNIC acknowledges the
//!    last packet of a message (the ACK joins its own transmit FIFO, ahead of no one) and
//!    writes the data; a READ request becomes a response job that competes in the
//!    responder's arbiter with the responder's own sends.
//! 6. **Completion.** An ACK (or the last READ response) makes the requester write a CQE
//!    (`pcie.write_latency_ns`), after which the owner of the queue pair is told.
//!
//! Per data packet the model costs one event, the arbiter's decision; only packets that
//! end a message (or cross a switch, later) cost an arrival too. The arbiter never wakes
//! per byte: when the FIFO is full it sleeps until exactly the time it has room again.

use std::collections::VecDeque;

use rand_core::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};

use crate::engine::EventQueue;
use crate::model_profile::{ModelProfile, VIRTUAL_LANES};
use crate::switch::{Queued, Switch};
use crate::time::{self, ByteTime, Picos};
use crate::topology::{HostId, LinkId, NodeKind, SwitchId, Topology};
use crate::world::Event;

/// A queue pair, unique across all hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpId(pub u32);

impl QpId {
    fn index(self) -> usize {
        self.0 as usize
    }
}

/// The RDMA operation of a work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Opcode {
    /// One-sided RDMA WRITE: data flows from requester to responder.
    Write,
    /// Two-sided SEND: like a WRITE on the wire; the responder's application receives it.
    Send,
    /// One-sided RDMA READ: a small request, and the data flows back from the responder.
    Read,
}

/// A work request as the RNIC sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Opaque to the RNIC; returned in the completion.
    pub tag: u64,
    /// The operation.
    pub opcode: Opcode,
    /// Payload bytes (0 is allowed: a header-only packet).
    pub bytes: u32,
    /// Whether the CPU copies the payload into the WQE (only up to the inline limit).
    pub inline: bool,
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

/// One side of a connection: where it is, who owns it, whether its owner wants to hear of
/// messages that arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// The host.
    pub(crate) host: HostId,
    /// Who receives its completions and deliveries.
    pub(crate) owner: QpOwner,
    /// Whether arriving messages are delivered to the owner.
    pub(crate) deliver: bool,
}

/// Who receives a queue pair's completions and deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpOwner {
    /// An application model (index into the run's applications).
    App(u32),
    /// The host's policy (e.g. the reference flow's probe queue pair).
    Policy,
}

#[derive(Clone, Copy, Debug)]
struct Wqe {
    tag: u64,
    opcode: Opcode,
    bytes: u32,
    dma: bool,
    visible_at: Picos,
}

#[derive(Clone, Copy, Debug)]
struct TxMessage {
    kind: PacketKind,
    remaining: u32,
    first: bool,
    msn: u32,
    dma: bool,
    request_bytes: u32,
}

#[derive(Clone, Copy, Debug)]
struct ResponseJob {
    msn: u32,
    bytes: u32,
    ready_at: Picos,
}

#[derive(Clone, Copy, Debug)]
struct Unacked {
    msn: u32,
    tag: u64,
    /// When the last bit of the request left the RNIC (`Picos::MAX` until then).
    sent_at: Picos,
}

struct Qp {
    host: HostId,
    peer: QpId,
    owner: QpOwner,
    flow: Option<u32>,
    wants_delivery: bool,
    pu: usize,
    /// When the processing unit will start the head message, once booked.
    pu_booking: Option<Picos>,
    cpu_free: Picos,
    sq: VecDeque<Wqe>,
    current: Option<TxMessage>,
    responses: VecDeque<ResponseJob>,
    unacked: VecDeque<Unacked>,
    next_msn: u32,
    rx_message_bytes: u32,
    ready_listed: bool,
    ready_event_at: Picos,
    /// Service level (= virtual lane) of its packets.
    lane: u8,
    /// The latest request's network round trip as RPerf measures it.
    last_wire_rtt: Option<Picos>,
}

/// The transmit FIFO between the arbiter and the wire. Its occupancy is the wire bytes not
/// yet sent: the packet being sent drains byte by byte.
struct TxFifo {
    capacity: u32,
    /// (start, done, wire bytes) of each packet not yet fully sent, in order.
    queue: VecDeque<(Picos, Picos, u32)>,
    /// Wire bytes of the packets in `queue`.
    queued: u64,
    engine_free: Picos,
}

impl TxFifo {
    fn drain(&mut self, now: Picos) {
        while let Some(&(_, done, bytes)) = self.queue.front() {
            if done > now {
                break;
            }
            self.queued -= u64::from(bytes);
            self.queue.pop_front();
        }
    }

    /// Bytes not yet sent at `now` (after [`TxFifo::drain`] to `now`).
    fn occupancy(&self, now: Picos) -> u64 {
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
    fn has_room(&self, now: Picos, limit: u32) -> bool {
        self.occupancy(now) < u64::from(limit)
    }

    /// The earliest time at which fewer than `limit` bytes wait, given what is queued.
    fn room_at(&self, limit: u32) -> Picos {
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
    fn admit(&mut self, not_before: Picos, wire: u32, service: Picos) -> Picos {
        let start = self.engine_free.max(not_before);
        let done = start + service;
        self.engine_free = done;
        self.queue.push_back((start, done, wire));
        self.queued += u64::from(wire);
        done
    }
}

struct Rnic {
    uplink: LinkId,
    /// Queue pairs with a packet ready, by number: the arbiter serves, on the highest lane
    /// among them, the first one after the last served on that lane, wrapping around (a
    /// round-robin pointer, not a queue in order of readiness, so a queue pair that was
    /// briefly not ready keeps its turn).
    ready: ReadySet,
    /// Per lane, the number of the queue pair served last on it.
    last_served: [u32; VIRTUAL_LANES],
    /// Queue pairs of this RNIC on a lane above 0, ready or not: while there are any, the
    /// RNIC's traffic classes are in use and lane 0 may fill less of the FIFO.
    raised_qps: u32,
    fifo: TxFifo,
    pu_free: Vec<Picos>,
    next_decision: Picos,
    arbiter_gen: u32,
    arbiter_pending: bool,
    payload_bytes_in_window: u64,
}

/// Credits of a link into a switch, per virtual lane, in wire bytes; they may dip below
/// zero only by acknowledgements, which an RNIC sends without asking.
type Credits = [i64; VIRTUAL_LANES];

/// Ready queue-pair numbers in ascending order, and the lanes of those above lane 0.
/// Sorted vectors: an RNIC has few ready queue pairs at a time, and this is faster than a
/// tree for that.
#[derive(Default)]
struct ReadySet {
    /// Every listed number.
    all: Vec<u32>,
    /// The listed numbers on a lane above 0, with their lanes: while it is empty (always,
    /// unless a queue pair was put on another lane) the turn is plain round robin over
    /// `all` and no lane is looked at.
    raised: Vec<(u32, u8)>,
}

/// The first of `list` after `n`, wrapping around, then the rest in turn.
fn turn_after<T>(list: &[T], key: impl Fn(&T) -> u32, n: u32) -> impl Iterator<Item = &T> {
    let at = list.partition_point(|e| key(e) <= n);
    list[at..].iter().chain(&list[..at])
}

impl ReadySet {
    fn insert(&mut self, n: u32, lane: u8) {
        if let Err(at) = self.all.binary_search(&n) {
            self.all.insert(at, n);
            if lane > 0 {
                self.set_raised(n, lane);
            }
        }
    }

    fn remove(&mut self, n: u32) {
        if let Ok(at) = self.all.binary_search(&n) {
            self.all.remove(at);
            if !self.raised.is_empty() {
                self.set_raised(n, 0);
            }
        }
    }

    /// Moves a listed queue pair to another lane (nothing if it is not listed).
    fn set_lane(&mut self, n: u32, lane: u8) {
        if self.all.binary_search(&n).is_ok() {
            self.set_raised(n, lane);
        }
    }

    /// Records `n` on `lane` in `raised` (0: not there).
    fn set_raised(&mut self, n: u32, lane: u8) {
        match self.raised.binary_search_by_key(&n, |e| e.0) {
            Ok(at) if lane > 0 => self.raised[at].1 = lane,
            Ok(at) => {
                self.raised.remove(at);
            }
            Err(at) if lane > 0 => self.raised.insert(at, (n, lane)),
            Err(_) => {}
        }
    }

    fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    /// The highest lane with an entry above 0, if any.
    fn top_lane(&self) -> Option<u8> {
        self.raised.iter().map(|e| e.1).max()
    }

    /// Whose turn it is: on the highest lane listed, the first number after that lane's
    /// `last_served`, wrapping around.
    fn next(&self, last_served: &[u32; VIRTUAL_LANES]) -> Option<u32> {
        let Some(top) = self.top_lane() else {
            let at = self.all.partition_point(|&m| m <= last_served[0]);
            return self.all.get(at).or_else(|| self.all.first()).copied();
        };
        turn_after(&self.raised, |e| e.0, last_served[usize::from(top)])
            .find(|e| e.1 == top)
            .map(|e| e.0)
    }

    /// Every listed number in the order the arbiter would serve them if each were the only
    /// one it could send: lanes from the highest down, each from its turn on.
    fn service_order(&self, last_served: &[u32; VIRTUAL_LANES]) -> Vec<u32> {
        let lane_0 = turn_after(&self.all, |&m| m, last_served[0]);
        let Some(top) = self.top_lane() else {
            return lane_0.copied().collect();
        };
        let raised = (1..=top).rev().flat_map(|lane| {
            turn_after(&self.raised, |e| e.0, last_served[usize::from(lane)])
                .filter(move |e| e.1 == lane)
                .map(|e| e.0)
        });
        let rest = lane_0
            .filter(|&&m| self.raised.binary_search_by_key(&m, |e| e.0).is_err())
            .copied();
        raised.chain(rest).collect()
    }
}

impl Rnic {
    /// The ready queue pair whose turn it is.
    fn next_in_turn(&self) -> Option<QpId> {
        self.ready.next(&self.last_served).map(QpId)
    }

    /// Below how many waiting bytes the transmit FIFO takes a packet of `lane`: its
    /// capacity, except for lane 0 on an RNIC with queue pairs on higher lanes, where a
    /// packet enters only an empty FIFO. An RNIC with strict-priority traffic classes
    /// queues each class apart and picks among them at every packet, so a higher class
    /// waits for at most the packet being sent; lane 0 entering only an empty FIFO gives
    /// that bound, and the arbiter, woken as the FIFO empties, still keeps the wire busy.
    fn fifo_limit(&self, lane: u8) -> u32 {
        if lane == 0 && self.raised_qps > 0 {
            1
        } else {
            self.fifo.capacity
        }
    }
}

/// Costs derived once from the profile, in picoseconds.
#[derive(Clone, Copy, Debug)]
struct Costs {
    mtu: u32,
    header: u32,
    first_extra: u32,
    ack_wire: u32,
    wire: ByteTime,
    dma: ByteTime,
    post: Picos,
    doorbell: Picos,
    jitter_mean_ns: f64,
    dma_read: Picos,
    dma_jitter: Picos,
    dma_write: Picos,
    wqe_process: Picos,
    rx_process: Picos,
    pu_interval: Picos,
    decision_interval: Picos,
    max_inline: u32,
}

/// A completion that the world hands to the policy of the queue pair's host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Completion {
    /// The queue pair.
    pub(crate) qp: QpId,
    /// The tag of the completed work request.
    pub(crate) tag: u64,
}

/// All RNICs and queue pairs of a run, and the links between them.
pub(crate) struct Fabric {
    topology: Topology,
    rnics: Vec<Rnic>,
    qps: Vec<Qp>,
    costs: Costs,
    rng: Pcg64Mcg,
    window: (Picos, Picos),
    flow_bytes: Vec<u64>,
    /// Per flow: payload bytes arrived since the start, window or not (for time series).
    flow_bytes_total: Vec<u64>,
    switches: Vec<Switch>,
    /// Per link: its sender's credits when it ends at a switch.
    credits: Vec<Option<Credits>>,
    /// Per link: the (switch, port) that sends on it, when a switch does.
    sent_by_switch: Vec<Option<(usize, usize)>>,
    switch_rng: Pcg64Mcg,
}

impl Fabric {
    /// RNICs for every host of `topology`, modelled after `profile`. Payload bytes are
    /// counted only when they arrive inside `window`.
    pub(crate) fn new(
        topology: Topology,
        profile: &ModelProfile,
        seed: u64,
        window: (Picos, Picos),
    ) -> Self {
        let costs = Costs {
            mtu: profile.mtu(),
            header: profile.link.header_bytes,
            first_extra: profile.link.first_packet_extra_bytes,
            ack_wire: profile.link.ack_bytes,
            wire: profile.wire_byte_time(),
            dma: profile.dma_byte_time(),
            post: time::from_ns(profile.host.post_ns),
            doorbell: time::from_ns(profile.pcie.doorbell_ns),
            jitter_mean_ns: profile.host.jitter_ns,
            dma_read: time::from_ns(profile.pcie.read_latency_ns),
            dma_jitter: time::from_ns(profile.pcie.read_jitter_ns),
            dma_write: time::from_ns(profile.pcie.write_latency_ns),
            wqe_process: time::from_ns(profile.rnic.wqe_process_ns),
            rx_process: time::from_ns(profile.rnic.rx_process_ns),
            pu_interval: time::interval_of_mops(profile.rnic.qp_mops),
            decision_interval: time::interval_of_mops(profile.rnic.nic_mops),
            max_inline: profile.rnic.max_inline_bytes,
        };
        let rnics = (0..topology.host_count())
            .map(|h| Rnic {
                uplink: topology.uplink(HostId(h as u16)),
                ready: ReadySet::default(),
                last_served: [0; VIRTUAL_LANES],
                raised_qps: 0,
                fifo: TxFifo {
                    capacity: profile.rnic.tx_fifo_bytes,
                    queue: VecDeque::new(),
                    queued: 0,
                    engine_free: 0,
                },
                pu_free: vec![0; profile.rnic.processing_units as usize],
                next_decision: 0,
                arbiter_gen: 0,
                arbiter_pending: false,
                payload_bytes_in_window: 0,
            })
            .collect();
        let mut credits = vec![None; topology.links().len()];
        let mut sent_by_switch = vec![None; topology.links().len()];
        let mut switches = Vec::new();
        if let Some(params) = &profile.switch {
            let full = i64::from(params.input_buffer_bytes);
            for (l, link) in topology.links().iter().enumerate() {
                if matches!(topology.node(link.to), NodeKind::Switch(_)) {
                    credits[l] = Some([full; VIRTUAL_LANES]);
                }
            }
            let mtu_wire = profile.mtu() + profile.link.header_bytes;
            for (s, ports) in topology.switches().iter().enumerate() {
                for (p, port) in ports.ports.iter().enumerate() {
                    sent_by_switch[port.output.0 as usize] = Some((s, p));
                }
                switches.push(Switch::new(ports.clone(), params, mtu_wire));
            }
        }
        Fabric {
            topology,
            rnics,
            qps: Vec::new(),
            costs,
            rng: Pcg64Mcg::seed_from_u64(seed),
            window,
            flow_bytes: Vec::new(),
            flow_bytes_total: Vec::new(),
            switches,
            credits,
            sent_by_switch,
            // A stream of its own, so that switch jitter does not shift the RNICs' draws.
            switch_rng: Pcg64Mcg::seed_from_u64(seed ^ 0x0057_17C4),
        }
    }

    /// The topology.
    pub(crate) fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Connects a queue pair on `a.host` to one on `b.host` (an RC connection); returns
    /// them in that order. `flow` attributes the payload both ways to a flow's byte count.
    pub(crate) fn connect(&mut self, a: Endpoint, b: Endpoint, flow: Option<u32>) -> (QpId, QpId) {
        let ia = QpId(self.qps.len() as u32);
        let ib = QpId(ia.0 + 1);
        for (end, peer) in [(a, ib), (b, ia)] {
            let units = self.rnics[usize::from(end.host.0)].pu_free.len().max(1);
            let on_host = self.qps.iter().filter(|q| q.host == end.host).count();
            self.qps.push(Qp {
                host: end.host,
                peer,
                owner: end.owner,
                flow,
                wants_delivery: end.deliver,
                pu: on_host % units,
                pu_booking: None,
                cpu_free: 0,
                sq: VecDeque::new(),
                current: None,
                responses: VecDeque::new(),
                unacked: VecDeque::new(),
                next_msn: 0,
                rx_message_bytes: 0,
                ready_listed: false,
                ready_event_at: Picos::MAX,
                lane: 0,
                last_wire_rtt: None,
            });
        }
        if let Some(f) = flow {
            let needed = f as usize + 1;
            if self.flow_bytes.len() < needed {
                self.flow_bytes.resize(needed, 0);
                self.flow_bytes_total.resize(needed, 0);
            }
        }
        (ia, ib)
    }

    /// Puts the packets of `qp`'s connection, both ways, on virtual lane `lane` (its
    /// service level; clamped to the lanes there are): switches buffer and arbitrate them
    /// on that lane, and each end's arbiter serves it before lower lanes. Takes effect from
    /// each end's next packet.
    pub(crate) fn set_lane(&mut self, qp: QpId, lane: u8) {
        let lane = lane.min(VIRTUAL_LANES as u8 - 1);
        let peer = self.qps[qp.index()].peer;
        for end in [qp, peer] {
            let entry = &mut self.qps[end.index()];
            let was = entry.lane;
            entry.lane = lane;
            let nic = &mut self.rnics[usize::from(entry.host.0)];
            if entry.ready_listed {
                nic.ready.set_lane(end.0, lane);
            }
            match (was > 0, lane > 0) {
                (false, true) => nic.raised_qps += 1,
                (true, false) => nic.raised_qps -= 1,
                _ => {}
            }
        }
    }

    /// The network round trip of the queue pair's latest acknowledged request, as RPerf
    /// measures it: from the request's last bit leaving the RNIC to its ACK arriving,
    /// less the receive processing that RPerf's loopback message also goes through.
    pub(crate) fn last_wire_rtt(&self, qp: QpId) -> Option<Picos> {
        self.qps[qp.index()].last_wire_rtt
    }

    /// The host a queue pair lives on.
    pub(crate) fn host_of(&self, qp: QpId) -> HostId {
        self.qps[qp.index()].host
    }

    /// Payload bytes of a flow that arrived inside the measurement window.
    pub(crate) fn flow_bytes(&self, flow: u32) -> u64 {
        self.flow_bytes.get(flow as usize).copied().unwrap_or(0)
    }

    /// Payload bytes of a flow that arrived since the start of the run.
    pub(crate) fn flow_bytes_total(&self, flow: u32) -> u64 {
        self.flow_bytes_total
            .get(flow as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Payload bytes each host transmitted that arrived inside the window, by host.
    pub(crate) fn host_payload_bytes(&self) -> Vec<u64> {
        self.rnics
            .iter()
            .map(|r| r.payload_bytes_in_window)
            .collect()
    }

    /// Work requests posted on a queue pair and not yet completed.
    pub(crate) fn outstanding(&self, qp: QpId) -> usize {
        let q = &self.qps[qp.index()];
        q.sq.len() + usize::from(q.current.is_some()) + q.unacked.len()
    }

    fn exp_jitter(&mut self) -> Picos {
        if self.costs.jitter_mean_ns <= 0.0 {
            return 0;
        }
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        time::from_ns(-self.costs.jitter_mean_ns * (1.0 - u).ln())
    }

    /// Time to read `bytes` of payload over PCIe, with its jitter.
    fn dma_time(&mut self, bytes: u32) -> Picos {
        let base = self.costs.dma.of(u64::from(bytes));
        let j = self.costs.dma_jitter;
        if bytes == 0 || base == 0 || j == 0 {
            return base;
        }
        let offset = self.rng.next_u64() % (2 * j + 1);
        (base + offset).saturating_sub(j)
    }

    /// The CPU of the queue pair's owner posts a work request now (or once its previous
    /// post is done).
    pub(crate) fn post(&mut self, qp: QpId, wr: WorkRequest, q: &mut EventQueue<Event>) {
        let now = q.now();
        let jitter = self.exp_jitter();
        let c = self.costs;
        let inline = wr.inline && wr.bytes <= c.max_inline && wr.opcode != Opcode::Read;
        let entry = &mut self.qps[qp.index()];
        let cpu_done = entry.cpu_free.max(now) + c.post;
        entry.cpu_free = cpu_done;
        let fetch = if inline { 0 } else { c.dma_read };
        entry.sq.push_back(Wqe {
            tag: wr.tag,
            opcode: wr.opcode,
            bytes: wr.bytes,
            dma: !inline && wr.bytes > 0 && wr.opcode != Opcode::Read,
            visible_at: cpu_done + c.doorbell + jitter + fetch,
        });
        self.refresh(qp, q);
    }

    /// When the queue pair can next hand the arbiter a packet (`Picos::MAX`: nothing to
    /// send). Once its head message is ready for processing (not before: the unit works in
    /// time order), the message books its slot at the processing unit: units serve the
    /// messages of their queue pairs first come, first served, one every 1/`rnic.qp_mops`.
    fn next_ready(&mut self, qp: QpId, now: Picos) -> Picos {
        let q = &self.qps[qp.index()];
        if q.current.is_some() {
            return 0;
        }
        if let Some(start) = q.pu_booking {
            return start;
        }
        let head_ready = if let Some(job) = q.responses.front() {
            job.ready_at
        } else if let Some(w) = q.sq.front() {
            let payload_read = if w.dma { self.costs.dma_read } else { 0 };
            w.visible_at + self.costs.wqe_process + payload_read
        } else {
            return Picos::MAX;
        };
        if head_ready > now {
            return head_ready;
        }
        let (host, pu) = (usize::from(q.host.0), q.pu);
        let unit = &mut self.rnics[host].pu_free[pu];
        let start = now.max(*unit);
        *unit = start + self.costs.pu_interval;
        self.qps[qp.index()].pu_booking = Some(start);
        start
    }

    /// Lists a queue pair as ready at its RNIC if it has a packet ready, or makes sure a
    /// wake-up is scheduled for when it will.
    fn refresh(&mut self, qp: QpId, q: &mut EventQueue<Event>) {
        if self.qps[qp.index()].ready_listed {
            return;
        }
        let ready = self.next_ready(qp, q.now());
        if ready == Picos::MAX {
            return;
        }
        if ready <= q.now() {
            let host = self.qps[qp.index()].host;
            let entry = &mut self.qps[qp.index()];
            entry.ready_listed = true;
            let lane = entry.lane;
            self.rnics[usize::from(host.0)].ready.insert(qp.0, lane);
            self.kick(host, q);
        } else if ready < self.qps[qp.index()].ready_event_at {
            self.qps[qp.index()].ready_event_at = ready;
            q.schedule(ready, Event::QpReady(qp));
        }
    }

    /// Handles [`Event::QpReady`].
    pub(crate) fn on_qp_ready(&mut self, qp: QpId, q: &mut EventQueue<Event>) {
        let entry = &mut self.qps[qp.index()];
        if entry.ready_event_at == q.now() {
            entry.ready_event_at = Picos::MAX;
        }
        self.refresh(qp, q);
    }

    fn kick(&mut self, host: HostId, q: &mut EventQueue<Event>) {
        let nic = &mut self.rnics[usize::from(host.0)];
        if !nic.arbiter_pending {
            nic.arbiter_pending = true;
            nic.arbiter_gen = nic.arbiter_gen.wrapping_add(1);
            let at = nic.next_decision.max(q.now());
            q.schedule(
                at,
                Event::ArbiterWake {
                    host,
                    gen: nic.arbiter_gen,
                },
            );
        }
    }

    /// The packet a ready queue pair would send next: (wire bytes, DMA bytes).
    fn peek_packet(&self, qp: QpId) -> Option<(u32, u32)> {
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

    /// Handles [`Event::ArbiterWake`]: admits the packet of the queue pair at the head of
    /// the arbiter into the transmit FIFO, or sleeps until the FIFO has room.
    pub(crate) fn on_arbiter_wake(&mut self, host: HostId, gen: u32, q: &mut EventQueue<Event>) {
        let h = usize::from(host.0);
        if self.rnics[h].arbiter_gen != gen {
            return;
        }
        // `arbiter_pending` stays set while deciding, so that queue pairs made ready on the
        // way do not schedule a second wake-up.
        let now = q.now();
        let uplink = self.rnics[h].uplink.0 as usize;
        while let Some(turn) = self.rnics[h].next_in_turn() {
            let Some((wire, dma)) = self.peek_packet(turn) else {
                self.rnics[h].ready.remove(turn.0);
                self.qps[turn.index()].ready_listed = false;
                continue;
            };
            let (qp, wire, dma) = if self.credits[uplink].is_some() {
                // Into a switch: the queue pair in turn may lack credits for its lane
                // while another has them.
                match self.next_with_credit(h) {
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
            if let Some(credits) = &mut self.credits[uplink] {
                credits[lane] -= i64::from(wire);
            }
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
                let capacity = nic.fifo.capacity;
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
    /// within a lane) whose next packet the uplink has credits for, with that packet's
    /// (wire, DMA) bytes; queue pairs found with nothing to send leave the ready set.
    fn next_with_credit(&mut self, h: usize) -> Option<(QpId, u32, u32)> {
        let uplink = self.rnics[h].uplink.0 as usize;
        let credits = self.credits[uplink]?;
        let nic = &self.rnics[h];
        let order = nic.ready.service_order(&nic.last_served);
        for n in order {
            let qp = QpId(n);
            let Some((wire, dma)) = self.peek_packet(qp) else {
                self.rnics[h].ready.remove(n);
                self.qps[qp.index()].ready_listed = false;
                continue;
            };
            if credits[usize::from(self.qps[qp.index()].lane)] >= i64::from(wire) {
                return Some((qp, wire, dma));
            }
        }
        None
    }

    fn sleep_until(&mut self, host: HostId, at: Picos, q: &mut EventQueue<Event>) {
        let nic = &mut self.rnics[usize::from(host.0)];
        nic.arbiter_pending = true;
        nic.arbiter_gen = nic.arbiter_gen.wrapping_add(1);
        q.schedule(
            at,
            Event::ArbiterWake {
                host,
                gen: nic.arbiter_gen,
            },
        );
    }

    /// Takes the next packet of a queue pair and puts it in its RNIC's FIFO.
    fn send_packet(&mut self, qp: QpId, wire: u32, dma: u32, q: &mut EventQueue<Event>) {
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
        let service = c.wire.of(u64::from(wire)).max(self.dma_time(dma));
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
    fn start_message(&mut self, qp: QpId) {
        let entry = &mut self.qps[qp.index()];
        let message = if let Some(job) = entry.responses.pop_front() {
            TxMessage {
                kind: PacketKind::ReadResponse,
                remaining: job.bytes,
                first: true,
                msn: job.msn,
                dma: true,
                request_bytes: 0,
            }
        } else if let Some(w) = entry.sq.pop_front() {
            let msn = entry.next_msn;
            entry.next_msn = entry.next_msn.wrapping_add(1);
            entry.unacked.push_back(Unacked {
                msn,
                tag: w.tag,
                sent_at: Picos::MAX,
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
            }
        } else {
            return;
        };
        entry.current = Some(message);
        entry.pu_booking = None;
    }

    /// Schedules the arrival of a packet whose last bit leaves `host` at `done`.
    fn transmit(&mut self, host: HostId, packet: Packet, done: Picos, q: &mut EventQueue<Event>) {
        let link_id = self.rnics[usize::from(host.0)].uplink;
        let link = self.topology.link(link_id);
        let arrival = link.arrival(done);
        if packet.payload > 0 && arrival >= self.window.0 && arrival < self.window.1 {
            self.rnics[usize::from(host.0)].payload_bytes_in_window += u64::from(packet.payload);
        }
        let head_leaves = done.saturating_sub(link.serialization(packet.wire));
        self.forward(link_id, packet, head_leaves, done, q);
    }

    /// Sends `packet` down `link_id`, whose sender puts its first bit on the wire at
    /// `head_leaves` and its last at `done`: into a switch's input buffer, or to a host.
    pub(crate) fn forward(
        &mut self,
        link_id: LinkId,
        packet: Packet,
        head_leaves: Picos,
        done: Picos,
        q: &mut EventQueue<Event>,
    ) {
        let link = self.topology.link(link_id);
        let arrival = link.arrival(done);
        if let NodeKind::Switch(sw) = self.topology.node(link.to) {
            let head_arrives = link.arrival(head_leaves);
            self.enter_switch(sw, link_id, packet, head_arrives, q);
            return;
        }
        let silent =
            !packet.last && matches!(packet.kind, PacketKind::Data | PacketKind::ReadResponse);
        if silent {
            // A packet in the middle of a message changes nothing at the receiving host but
            // its byte counts; links keep packets in order, so those are kept now, and no
            // event is spent on it. (A switch on the way would need every packet.)
            self.count_received(&packet, arrival);
            return;
        }
        q.schedule(
            arrival,
            Event::PacketArrive {
                link: link_id,
                packet,
            },
        );
    }

    /// Counts a packet's payload for its flow (if it arrives in the window) and for the
    /// message it belongs to.
    fn count_received(&mut self, packet: &Packet, arrival: Picos) {
        if packet.payload == 0 {
            return;
        }
        let entry = &mut self.qps[packet.qp.index()];
        if packet.kind == PacketKind::Data {
            entry.rx_message_bytes += packet.payload;
        }
        if let Some(f) = entry.flow {
            self.flow_bytes_total[f as usize] += u64::from(packet.payload);
            if arrival >= self.window.0 && arrival < self.window.1 {
                self.flow_bytes[f as usize] += u64::from(packet.payload);
            }
        }
    }

    /// Handles [`Event::PacketArrive`]: the last bit of `packet` reached the far end of
    /// `link`.
    pub(crate) fn on_packet_arrive(
        &mut self,
        link: LinkId,
        packet: Packet,
        q: &mut EventQueue<Event>,
    ) {
        let to = self.topology.link(link).to;
        if let NodeKind::Host(host) = self.topology.node(to) {
            debug_assert_eq!(host, packet.dst);
            self.receive(packet, q);
        }
    }

    fn receive(&mut self, packet: Packet, q: &mut EventQueue<Event>) {
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
                let bytes = std::mem::take(&mut entry.rx_message_bytes);
                let (host, peer, deliver, lane) =
                    (entry.host, entry.peer, entry.wants_delivery, entry.lane);
                if deliver {
                    q.schedule(
                        now + c.rx_process + c.dma_write,
                        Event::Deliver { qp, bytes },
                    );
                }
                let ack = Packet {
                    kind: PacketKind::Ack,
                    last: true,
                    dst: self.qps[peer.index()].host,
                    qp: peer,
                    msn: packet.msn,
                    payload: 0,
                    wire: c.ack_wire,
                    request_bytes: 0,
                    lane,
                };
                let service = c.wire.of(u64::from(c.ack_wire));
                let h = usize::from(host.0);
                let done = self.rnics[h]
                    .fifo
                    .admit(now + c.rx_process, c.ack_wire, service);
                let uplink = self.rnics[h].uplink.0 as usize;
                if let Some(credits) = &mut self.credits[uplink] {
                    credits[usize::from(ack.lane)] -= i64::from(c.ack_wire);
                }
                self.transmit(host, ack, done, q);
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
                        Event::CqeVisible {
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
                    Event::CqeVisible {
                        qp,
                        upto: packet.msn,
                    },
                );
            }
        }
    }

    /// Handles [`Event::CqeVisible`]: the completions of all messages up to `upto`, in
    /// order, appended to `out`.
    pub(crate) fn take_completions(&mut self, qp: QpId, upto: u32, out: &mut Vec<Completion>) {
        let entry = &mut self.qps[qp.index()];
        while let Some(u) = entry.unacked.front() {
            // Sequence numbers wrap; "at or before" is a small forward distance.
            if upto.wrapping_sub(u.msn) > u32::MAX / 2 {
                break;
            }
            out.push(Completion { qp, tag: u.tag });
            entry.unacked.pop_front();
        }
    }

    /// A packet's head reaches switch `sw` by `link` at `head_arrives`: it becomes eligible
    /// for its output after the forwarding latency and jitter, never before the packet
    /// ahead of it in the same input port.
    fn enter_switch(
        &mut self,
        sw: SwitchId,
        link: LinkId,
        packet: Packet,
        head_arrives: Picos,
        q: &mut EventQueue<Event>,
    ) {
        let Some(port) = self.topology.input_port(link) else {
            return;
        };
        let s = usize::from(sw.0);
        let switch = &mut self.switches[s];
        let jitter = if switch.jitter > 0 {
            self.switch_rng.next_u64() % (switch.jitter + 1)
        } else {
            0
        };
        let p = usize::from(port);
        let eligible = (head_arrives + switch.latency + jitter).max(switch.last_eligible[p]);
        switch.last_eligible[p] = eligible;
        q.schedule(
            eligible,
            Event::SwitchArrive {
                switch: sw.0,
                port,
                packet,
            },
        );
    }

    /// Handles [`Event::SwitchArrive`]: the packet joins its input buffer.
    pub(crate) fn on_switch_arrive(
        &mut self,
        switch: u16,
        port: u8,
        packet: Packet,
        q: &mut EventQueue<Event>,
    ) {
        let s = usize::from(switch);
        let sw = &mut self.switches[s];
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
    fn kick_output(&mut self, s: usize, output: usize, q: &mut EventQueue<Event>) {
        let out = &mut self.switches[s].outputs[output];
        if !out.pending {
            out.pending = true;
            q.schedule(
                out.free_at.max(q.now()),
                Event::SwitchOutput {
                    switch: s as u16,
                    port: output as u8,
                },
            );
        }
    }

    /// Handles [`Event::SwitchOutput`]: the output port is free and picks its next packet.
    pub(crate) fn on_switch_output(&mut self, switch: u16, port: u8, q: &mut EventQueue<Event>) {
        let (s, o) = (usize::from(switch), usize::from(port));
        let now = q.now();
        self.switches[s].outputs[o].pending = false;
        let out_link = self.switches[s].ports.ports[o].output;
        let next_hop = self.credits[out_link.0 as usize];
        let can_send =
            |lane: usize, p: &Packet| next_hop.is_none_or(|c| c[lane] >= i64::from(p.wire));
        let Some(pick) = self.switches[s].arbitrate(o, &can_send) else {
            return;
        };
        let sw = &mut self.switches[s];
        let Some(queued) = sw.inputs[pick.input][pick.lane].pop_front() else {
            return;
        };
        let packet = queued.packet;
        let link = self.topology.link(out_link);
        let done = now + link.serialization(packet.wire);
        sw.outputs[o].free_at = done;
        // The buffer space is free again: its credits travel back up the input cable.
        let in_link = sw.ports.ports[pick.input].input;
        let back = self.topology.link(in_link).propagation();
        q.schedule(
            now + back,
            Event::CreditReturn {
                link: in_link,
                lane: packet.lane,
                bytes: packet.wire,
            },
        );
        if let Some(credits) = &mut self.credits[out_link.0 as usize] {
            credits[usize::from(packet.lane)] -= i64::from(packet.wire);
        }
        if let Some(next) = self.switches[s].inputs[pick.input][pick.lane].front() {
            let output = self.switches[s].route(&next.packet);
            if output != o {
                self.kick_output(s, output, q);
            }
        }
        self.kick_output(s, o, q);
        self.forward(out_link, packet, now, done, q);
    }

    /// Handles [`Event::CreditReturn`]: the sender on `link` may use `bytes` more of
    /// `lane`'s buffer at the far end.
    pub(crate) fn on_credit_return(
        &mut self,
        link: LinkId,
        lane: u8,
        bytes: u32,
        q: &mut EventQueue<Event>,
    ) {
        let l = link.0 as usize;
        if let Some(credits) = &mut self.credits[l] {
            credits[usize::from(lane)] += i64::from(bytes);
        }
        if let Some((s, o)) = self.sent_by_switch[l] {
            self.kick_output(s, o, q);
        } else if let NodeKind::Host(host) = self.topology.node(self.topology.link(link).from) {
            if !self.rnics[usize::from(host.0)].ready.is_empty() {
                self.kick(host, q);
            }
        }
    }

    /// The owner of a queue pair.
    pub(crate) fn owner(&self, qp: QpId) -> QpOwner {
        self.qps[qp.index()].owner
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::*;

    #[test]
    fn ready_set_turns_round_robin() {
        let mut r = ReadySet::default();
        for n in [7, 2, 5, 2] {
            r.insert(n, 0);
        }
        assert_eq!(r.all, vec![2, 5, 7]);
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
        assert_eq!(r.service_order(&last), vec![7, 2, 5]);
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
        assert_eq!(r.service_order(&last), vec![7, 3, 9, 1, 5]);
        r.remove(7);
        assert_eq!(r.raised.len(), 2);
        last[1] = 3;
        assert_eq!(r.next(&last), Some(9), "round robin within lane 1");
        last[1] = 9;
        assert_eq!(r.next(&last), Some(3), "and around");
        assert_eq!(r.service_order(&last), vec![3, 9, 1, 5]);
        r.set_lane(3, 0);
        r.set_lane(9, 0);
        r.set_lane(4, 3);
        assert!(r.raised.is_empty(), "a number not listed is not added");
        last[0] = 3;
        assert_eq!(r.next(&last), Some(5), "lane 0 keeps its own turn");
        assert_eq!(r.service_order(&last), vec![5, 9, 1, 3]);
    }

    /// Bytes a queue pair still has to send.
    fn unsent(f: &Fabric, qp: QpId) -> u64 {
        let q = &f.qps[qp.index()];
        let current = q.current.map_or(0, |m| u64::from(m.remaining));
        current + q.sq.iter().map(|w| u64::from(w.bytes)).sum::<u64>()
    }

    /// Three queue pairs of one host, on `lanes`, post four MTU-sized packets each at
    /// once. Returns the packets' queue pairs in the order the arbiter served them, and the
    /// queue pairs.
    fn served_order(lanes: [u8; 3]) -> (Vec<QpId>, Vec<QpId>) {
        let mut profile = ModelProfile::builtin("RoCE-100").expect("built-in profile");
        // No randomness, so that all three are ready at the same instant.
        profile.host.jitter_ns = 0.0;
        profile.pcie.read_jitter_ns = 0.0;
        let topology = Topology::back_to_back(["a", "b"], &profile.link);
        let mut f = Fabric::new(topology, &profile, 1, (0, Picos::MAX));
        let end = |host| Endpoint {
            host: HostId(host),
            owner: QpOwner::Policy,
            deliver: false,
        };
        let mut q = EventQueue::new();
        let mut qps = Vec::new();
        for lane in lanes {
            let (qp, _) = f.connect(end(0), end(1), None);
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
                Event::QpReady(qp) => f.on_qp_ready(qp, &mut q),
                Event::ArbiterWake { host, gen } if host == HostId(0) => {
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

    #[test]
    fn fifo_drains_byte_by_byte() {
        let mut f = TxFifo {
            capacity: 6_000,
            queue: VecDeque::new(),
            queued: 0,
            engine_free: 0,
        };
        assert!(f.has_room(0, f.capacity));
        assert_eq!(f.admit(0, 4_000, 400), 400);
        assert_eq!(f.admit(0, 4_000, 400), 800);
        assert!(!f.has_room(0, f.capacity), "8000 bytes wait");
        assert_eq!(
            f.occupancy(100),
            7_000,
            "a quarter of the first packet has left"
        );
        // Below 6000 bytes once more than 2000 have left: at 200 ps plus one byte's time.
        assert_eq!(f.room_at(f.capacity), 201);
        assert!(f.has_room(201, f.capacity));
        f.drain(400);
        assert_eq!(f.occupancy(400), 4_000);
        // A packet that may not start yet waits for its time, not for the queue.
        assert_eq!(f.admit(1_000, 100, 10), 1_010);
    }
}
