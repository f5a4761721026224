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
//!
//!    A unit needs the queue pair's context (its transport state) to start a message: a
//!    send, a READ request or a READ response. The RNIC holds `rnic.qp_cache_entries`
//!    contexts on chip, the least recently used evicted first (`qp_cache`); a unit that
//!    starts a message of a queue pair whose context the RNIC does not hold reads it over
//!    PCIe first, starting one `pcie.read_latency_ns` later and busy meanwhile. The
//!    context is looked up when the message books its turn at the unit, so recency is the
//!    order of bookings. Assumed: only a message's start needs the context, as the
//!    per-packet state of a message being streamed is the unit's own and is not cached;
//!    and WQEs are not cached at all: every non-inline WQE is fetched by a DMA read anyway
//!    (step 1, a WQE cache that always misses) and an inline one arrives with its
//!    doorbell. 0, in every shipped profile: every context is on chip, and no cache is
//!    kept.
//! 3. **Arbiter.** The arbiter takes one packet (at most one MTU) from the next queue pair,
//!    in round-robin order of queue-pair number, that has a packet ready: service is
//!    round-robin over queue pairs at MTU-packet granularity, whatever the message sizes
//!    (PeRF §2.2). It decides at most `rnic.nic_mops` times per second. Queue pairs on a
//!    higher virtual lane (service level, set by the scenario's `sl` or by a policy) come
//!    first: the arbiter serves the highest lane that has a ready queue pair, round-robin
//!    within that lane with a turn of its own, as an RNIC whose traffic classes are
//!    configured for strict priority (ETS strict-priority classes, one per lane) does.
//!    Into a switch, a lane without credits for its next packet (or paused by PFC) is
//!    passed over for a lower one. While every ready queue pair of an RNIC is on lane 0
//!    (always, in scenarios without `sl` or the `priority` policy) this is plain round
//!    robin, and a decision looks at no lane.
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
//!    the RNIC, and per-lane limits on the processing units. A PFC pause stops the
//!    arbiter, not the FIFO: packets already in it still leave (a PFC profile's headroom
//!    counts them).
//!
//!    The FIFO deepens with the queue pairs streaming large messages: while more than one
//!    queue pair sends a message larger than `rnic.fetch_burst_bytes`, the RNIC fetches
//!    their payload in bursts of that size, and the FIFO holds one burst more for each
//!    such queue pair beyond the first (the one fetched just in time, which
//!    `rnic.tx_fifo_bytes` covers). A packet of a queue pair that was idle then waits
//!    behind all of it, so a latency flow suffers super-linearly in the number of
//!    bandwidth queue pairs (Justitia §2.1.3, Fig 3 and 10, on ConnectX-3 Pro), while the
//!    arbiter's order, and so a backlogged queue pair's share of packets, is unchanged.
//!    Profiles without fetch bursts (0) keep one FIFO depth whatever streams, as PeRF
//!    §2.2 finds on ConnectX-6.
//! 5. **Receive side.** After `rnic.rx_process_ns` the receiving RNIC acknowledges the
//!    last packet of a message (the ACK joins its own transmit FIFO, ahead of no one) and
//!    writes the data; a READ request becomes a response job that competes in the
//!    responder's arbiter with the responder's own sends.
//!    With `rnic.rx_buffer_bytes`, a packet first passes the receive stage (`rx_stage`):
//!    payload written into host memory at `pcie.write_gbps`, at most `rnic.rx_mops`
//!    packets per second, the rest waiting in a receive buffer whose credits hold back
//!    the sender on the link into the host. Without it (every shipped profile) a packet is
//!    processed the moment it arrives.
//! 6. **Completion.** An ACK (or the last READ response) makes the requester write a CQE
//!    (`pcie.write_latency_ns`), after which the owner of the queue pair is told.
//!
//! Husky's hidden resources, each off by default (docs/simulator.md has the table): MPT
//! and MTT caches looked up at step 2 beside the context (`translation`, `memory`), a
//! doorbell engine at step 1 (`doorbell`), PCIe read TLPs in step 4's drain, RNR NAKs at
//! step 5 (`rnr`), and the control path of control verbs (`control`).
//!
//! Each stage has a file of its own: `arbiter` (steps 2 and 3's choice of a queue pair,
//! and the messages' packetisation), `qp_cache` (step 2's contexts), `tx_fifo` (step 4
//! and the uplink), `receive` and `rx_stage` (step 5) and `completion` (step 6); this
//! file holds the queue pairs, posting, the fabric's events (`RnicEvent`) and its one
//! entry point (`Fabric::handle`). The switches are [`crate::switch`]'s, and packets
//! [`crate::link`]'s.
//!
//! Per data packet the model costs one event, the arbiter's decision; only packets that
//! end a message (or cross a switch, later) cost an arrival too, and with a receive stage
//! each packet into a host one more, its credits coming back. The arbiter never wakes
//! per byte: when the FIFO is full it sleeps until exactly the time it has room again.

mod arbiter;
mod completion;
pub mod control;
mod doorbell;
mod memory;
mod qp_cache;
mod ready_bits;
mod receive;
mod rnr;
mod rx_stage;
mod translation;
mod tx_fifo;

use std::collections::VecDeque;

use rand_core::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};

pub use crate::link::{Packet, PacketKind, QpId};

use crate::engine::EventQueue;
use crate::metrics::ChangedFlows;
use crate::model_profile::{ModelProfile, VIRTUAL_LANES};
use crate::switch::{SwitchEvent, SwitchOutcome, Switches};
use crate::time::{self, ByteTime, Picos};
use crate::topology::{HostId, LinkId, NodeKind, Topology};

use arbiter::ReadySet;
pub(crate) use completion::Completion;
use control::ControlPath;
pub use control::ControlVerb;
use doorbell::DoorbellEngine;
pub(crate) use memory::MemoryLayout;
use qp_cache::QpCache;
use rx_stage::RxStage;
use translation::Translation;
use tx_fifo::TxFifo;

/// What happens at the RNICs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum RnicEvent {
    /// A queue pair may have a packet ready for its arbiter.
    QpReady(QpId),
    /// A host's arbiter decides (stale when `gen` is not the current generation).
    ArbiterWake {
        /// The host.
        host: HostId,
        /// The arbiter's generation when it was scheduled.
        gen: u32,
    },
    /// The last bit of a packet reached the far end of a link.
    PacketArrive {
        /// The link.
        link: LinkId,
        /// The packet.
        packet: Packet,
    },
    /// CQEs for all messages up to `upto` on `qp` are in host memory.
    CqeVisible {
        /// The queue pair.
        qp: QpId,
        /// The last message sequence number completed.
        upto: u32,
    },
    /// A received message of `bytes` is in the memory of `qp`'s host.
    Deliver {
        /// The queue pair that received it.
        qp: QpId,
        /// Its payload bytes.
        bytes: u32,
    },
    /// A control verb an application issued completes on its host's control path.
    ControlDone {
        /// The host.
        host: HostId,
        /// The application.
        app: u32,
        /// The verb.
        verb: ControlVerb,
        /// For a region registered: its pages.
        pages: u32,
        /// When it was issued.
        issued: Picos,
    },
}

/// What the fabric hands up to the hosts' software after an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Upcall {
    /// The CQEs of `qp` up to `upto` are visible: [`Fabric::take_completions`] has them.
    Completions {
        /// The queue pair.
        qp: QpId,
        /// The last message sequence number completed.
        upto: u32,
    },
    /// A received message of `bytes` is in the memory of `qp`'s host.
    Deliver {
        /// The queue pair that received it.
        qp: QpId,
        /// Its payload bytes.
        bytes: u32,
    },
    /// A control verb application `app` issued at `issued` completed.
    ControlDone {
        /// The application.
        app: u32,
        /// When it was issued.
        issued: Picos,
    },
}

/// The page size of a queue pair's memory when its flow does not say (4 KB, the host's
/// base page).
pub(crate) const DEFAULT_PAGE_BYTES: u64 = 4096;

/// The fabric's events: what an event queue must hold to run RNICs and switches (the
/// run's own event type, or a test's).
pub(crate) trait FabricEvents: Copy + From<RnicEvent> + From<SwitchEvent> {}

impl<E: Copy + From<RnicEvent> + From<SwitchEvent>> FabricEvents for E {}

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
    /// Where its payload lies (see `memory`).
    placement: memory::Placement,
}

#[derive(Clone, Copy, Debug)]
struct TxMessage {
    kind: PacketKind,
    remaining: u32,
    first: bool,
    msn: u32,
    dma: bool,
    request_bytes: u32,
    /// Counted in its RNIC's [`TxFifo::streaming`] until its last packet is admitted.
    streaming: bool,
    /// Its payload's offset from the last PCIe max-payload boundary before it.
    misalign: u32,
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
    /// Its payload bytes, and whether the RNIC reads them from host memory: what a SEND
    /// sent again after an RNR NAK needs.
    bytes: u32,
    dma: bool,
}

struct Qp {
    host: HostId,
    peer: QpId,
    owner: QpOwner,
    flow: Option<u32>,
    wants_delivery: bool,
    /// Its index among its RNIC's queue pairs (its key in [`Rnic::contexts`]).
    on_host: u32,
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
    /// Where its messages lie in registered memory.
    memory: MemoryLayout,
    /// When its owner last posted (WQEs posted at one instant are one post list).
    last_post: Picos,
    /// Whether its owner posts receives; a SEND into one that does not meets an RNR NAK.
    receives: bool,
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
    /// The receive stage, when the profile has a receive buffer (`rnic.rx_buffer_bytes`).
    rx: Option<RxStage>,
    pu_free: Vec<Picos>,
    /// The queue-pair contexts on chip (`rnic.qp_cache_entries`; 0: all of them).
    contexts: QpCache,
    /// The MPT and MTT entries on chip (`rnic.mpt_cache_entries`, `rnic.mtt_cache_entries`).
    translation: Translation,
    /// The doorbell engine (`rnic.doorbell_process_ns`, `rnic.wqe_fetch_ns`).
    doorbells: DoorbellEngine,
    /// The control path (`rnic.reg_mr_us`, `rnic.create_qp_us`).
    control: ControlPath,
    /// Queue pairs connected on this host so far: the next one's index among them picks
    /// its processing unit (a count kept, so that connecting stays constant-time).
    qps_on_host: u32,
    next_decision: Picos,
    arbiter_gen: u32,
    arbiter_pending: bool,
    payload_bytes_in_window: u64,
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
    /// PCIe max payload size (a TLP's payload), and the read path's time per TLP (0: TLPs
    /// not modelled).
    max_payload: u32,
    read_tlp: Picos,
    /// The receive stage's time per RNR NAK, and the requester's wait before it retries.
    rnr_nak: Picos,
    rnr_timer: Picos,
}

/// All RNICs and queue pairs of a run, and the links and switches between them.
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
    /// The flows whose `flow_bytes_total` grew since the time series last looked.
    flows_changed: ChangedFlows,
    switches: Switches,
    /// Memory regions registered so far (numbers every region of the run apart).
    regions: u32,
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
            max_payload: profile.pcie.max_payload_bytes,
            read_tlp: time::from_ns(profile.pcie.read_tlp_ns),
            rnr_nak: time::from_ns(profile.rnic.rnr_nak_ns),
            rnr_timer: time::from_ns(profile.rnic.rnr_timer_us * 1e3),
        };
        let rnics = (0..topology.host_count())
            .map(|h| Rnic {
                uplink: topology.uplink(HostId(h as u16)),
                ready: ReadySet::default(),
                last_served: [0; VIRTUAL_LANES],
                raised_qps: 0,
                fifo: TxFifo::new(profile.rnic.tx_fifo_bytes, profile.rnic.fetch_burst_bytes),
                rx: (profile.rnic.rx_buffer_bytes > 0).then(|| {
                    RxStage::new(
                        profile.rx_write_byte_time(),
                        time::interval_of_mops(profile.rnic.rx_mops),
                    )
                }),
                pu_free: vec![0; profile.rnic.processing_units as usize],
                contexts: QpCache::new(profile.rnic.qp_cache_entries),
                translation: Translation::new(
                    profile.rnic.mpt_cache_entries,
                    profile.rnic.mtt_cache_entries,
                    time::from_ns(profile.rnic.translation_miss_ns),
                ),
                doorbells: DoorbellEngine::new(
                    time::from_ns(profile.rnic.doorbell_process_ns),
                    time::from_ns(profile.rnic.wqe_fetch_ns),
                ),
                control: ControlPath::new(
                    time::from_ns(profile.rnic.reg_mr_us * 1e3),
                    time::from_ns(profile.rnic.create_qp_us * 1e3),
                ),
                qps_on_host: 0,
                next_decision: 0,
                arbiter_gen: 0,
                arbiter_pending: false,
                payload_bytes_in_window: 0,
            })
            .collect();
        let switches = Switches::new(&topology, profile, seed);
        Fabric {
            topology,
            rnics,
            qps: Vec::new(),
            costs,
            rng: Pcg64Mcg::seed_from_u64(seed),
            window,
            flow_bytes: Vec::new(),
            flow_bytes_total: Vec::new(),
            flows_changed: ChangedFlows::default(),
            switches,
            regions: 0,
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
            let nic = &mut self.rnics[usize::from(end.host.0)];
            let on_host = nic.qps_on_host;
            nic.qps_on_host += 1;
            self.qps.push(Qp {
                host: end.host,
                peer,
                owner: end.owner,
                flow,
                wants_delivery: end.deliver,
                on_host,
                pu: on_host as usize % units,
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
                memory: MemoryLayout::new(self.regions, 1, 0, DEFAULT_PAGE_BYTES, 0),
                last_post: Picos::MAX,
                receives: true,
            });
            self.regions += 1;
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

    /// The client queue pairs `qps` of one flow use `mrs` memory regions of their own, of
    /// `mr_bytes` each (0: as large as a message), registered with pages of `page_bytes`,
    /// their first message at `offset` (see `memory`).
    pub(crate) fn set_memory(
        &mut self,
        qps: &[QpId],
        mrs: u32,
        mr_bytes: u64,
        page_bytes: u64,
        offset: u64,
    ) {
        let first = self.regions;
        self.regions += mrs.max(1);
        let layout = MemoryLayout::new(first, mrs, mr_bytes, page_bytes, offset);
        for (j, qp) in qps.iter().enumerate() {
            self.qps[qp.index()].memory = layout.turn(j as u64, qps.len() as u64);
        }
    }

    /// A control verb that application `app` on `host` issued at `issued` reaches the RNIC
    /// now (later than `issued` when its host's policy held it; `pages`: of the region it
    /// registers): it runs on the host's control path, one verb at a time.
    pub(crate) fn control<E: FabricEvents>(
        &mut self,
        host: HostId,
        app: u32,
        verb: ControlVerb,
        pages: u32,
        issued: Picos,
        q: &mut EventQueue<E>,
    ) {
        let now = q.now();
        let done = self.rnics[usize::from(host.0)].control.take(now, verb);
        q.schedule(
            done,
            RnicEvent::ControlDone {
                host,
                app,
                verb,
                pages,
                issued,
            },
        );
    }

    /// A control verb completed on `host`: what it created takes its entries in the
    /// RNIC's caches, evicting the least recently used (a region is numbered apart from
    /// every other, a queue pair counted among the host's, and neither is used again).
    fn control_done(&mut self, host: HostId, verb: ControlVerb, pages: u32) {
        let nic = &mut self.rnics[usize::from(host.0)];
        match verb {
            ControlVerb::RegMr => {
                let mr = self.regions;
                self.regions += 1;
                nic.translation.look_up(mr, 0, u64::from(pages));
            }
            ControlVerb::CreateQp => {
                let index = nic.qps_on_host;
                nic.qps_on_host += 1;
                nic.contexts.touch(index);
            }
        }
    }

    /// The network round trip of the queue pair's latest acknowledged request, as RPerf
    /// measures it: from the request's last bit leaving the RNIC to its ACK arriving,
    /// less the receive processing that RPerf's loopback message also goes through.
    pub(crate) fn last_wire_rtt(&self, qp: QpId) -> Option<Picos> {
        self.qps[qp.index()].last_wire_rtt
    }

    /// The queue pair at the other end of `qp`'s connection.
    pub(crate) fn peer_of(&self, qp: QpId) -> QpId {
        self.qps[qp.index()].peer
    }

    /// The memory the RNIC will read the payload of `wr` from if it is the next request
    /// posted on `qp`: (region, first page, pages), what the application's request says
    /// (its region, address and length); `None` when it reads none (inline, empty, or a
    /// READ, whose payload the responder reads). Leaves the queue pair's walk where it was.
    pub(crate) fn next_payload_pages(&self, qp: QpId, wr: &WorkRequest) -> Option<(u32, u64, u64)> {
        let inline = wr.inline && wr.bytes <= self.costs.max_inline;
        if inline || wr.bytes == 0 || wr.opcode == Opcode::Read {
            return None;
        }
        let mut layout = self.qps[qp.index()].memory;
        let placement = layout.place(wr.bytes);
        let (first, pages) = layout.pages(placement.at, wr.bytes);
        Some((placement.mr, first, pages))
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

    /// Appends to `out` the flows with payload arrived since the last call.
    pub(crate) fn take_changed_flows(&mut self, out: &mut Vec<u32>) {
        self.flows_changed.drain_into(out);
    }

    /// Payload bytes each host transmitted that arrived inside the window, by host.
    pub(crate) fn host_payload_bytes(&self) -> Vec<u64> {
        self.rnics
            .iter()
            .map(|r| r.payload_bytes_in_window)
            .collect()
    }

    /// Figures of the fabric's flow control: the switches' PFC (see
    /// [`Switches::pfc_figures`]) and, with receive stages, the longest a packet waited in
    /// a receive buffer (`rx_peak_wait_us`).
    pub(crate) fn flow_control_figures(&self) -> std::collections::BTreeMap<String, f64> {
        let mut figures = self.switches.pfc_figures();
        let peak = self
            .rnics
            .iter()
            .filter_map(|r| r.rx.map(|rx| rx.peak_wait()))
            .max();
        if let Some(peak) = peak {
            figures.insert("rx_peak_wait_us".to_string(), time::to_us(peak));
        }
        figures
    }

    /// Work requests posted on a queue pair and not yet completed (the completion tests'
    /// check that none is left).
    #[cfg(test)]
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

    /// The PCIe read path's time for the TLPs of `bytes` of payload that start `misalign`
    /// bytes past a max-payload boundary: one TLP per boundary-to-boundary piece, so a
    /// misaligned payload needs one more than an aligned one of the same size (0 when TLPs
    /// are not modelled).
    fn tlp_time(&self, bytes: u32, misalign: u32) -> Picos {
        let c = &self.costs;
        if c.read_tlp == 0 || bytes == 0 {
            return 0;
        }
        u64::from((misalign + bytes).div_ceil(c.max_payload)) * c.read_tlp
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
    pub(crate) fn post<E: FabricEvents>(
        &mut self,
        qp: QpId,
        wr: WorkRequest,
        q: &mut EventQueue<E>,
    ) {
        let now = q.now();
        let jitter = self.exp_jitter();
        let c = self.costs;
        let inline = wr.inline && wr.bytes <= c.max_inline && wr.opcode != Opcode::Read;
        let entry = &mut self.qps[qp.index()];
        let cpu_done = entry.cpu_free.max(now) + c.post;
        entry.cpu_free = cpu_done;
        // The later WQEs of a post list ring no doorbell of their own.
        let rings = entry.last_post != now;
        entry.last_post = now;
        let placement = entry.memory.place(wr.bytes);
        let fetch = if inline { 0 } else { c.dma_read };
        let engine = &mut self.rnics[usize::from(entry.host.0)].doorbells;
        let taken = engine.take(cpu_done + c.doorbell + jitter, rings, !inline);
        self.qps[qp.index()].sq.push_back(Wqe {
            tag: wr.tag,
            opcode: wr.opcode,
            bytes: wr.bytes,
            dma: !inline && wr.bytes > 0 && wr.opcode != Opcode::Read,
            visible_at: taken + fetch,
            placement,
        });
        self.refresh(qp, q);
    }

    /// The requests waiting in `qp`'s send queue, oldest first (`inline` there: the RNIC
    /// fetches no payload, as for an inline, empty or READ request): for the policy
    /// drivers' unit tests, which never run the event queue, so that every request a
    /// driver posts stays there.
    #[cfg(test)]
    pub(crate) fn send_queue(&self, qp: QpId) -> Vec<WorkRequest> {
        self.qps[qp.index()]
            .sq
            .iter()
            .map(|w| WorkRequest {
                tag: w.tag,
                opcode: w.opcode,
                bytes: w.bytes,
                inline: !w.dma,
            })
            .collect()
    }

    /// When the queue pair can next hand the arbiter a packet (`Picos::MAX`: nothing to
    /// send). Once its head message is ready for processing (not before: the unit works in
    /// time order), the message books its slot at the processing unit: units serve the
    /// messages of their queue pairs first come, first served, one every 1/`rnic.qp_mops`,
    /// each after a DMA read of the queue pair's context if the RNIC's context cache does
    /// not hold it.
    fn next_ready(&mut self, qp: QpId, now: Picos) -> Picos {
        let q = &self.qps[qp.index()];
        if q.current.is_some() {
            return 0;
        }
        if let Some(start) = q.pu_booking {
            return start;
        }
        // The payload a send reads from host memory, to be translated.
        let mut reads = None;
        let head_ready = if let Some(job) = q.responses.front() {
            job.ready_at
        } else if let Some(w) = q.sq.front() {
            let payload_read = if w.dma { self.costs.dma_read } else { 0 };
            if w.dma {
                reads = Some((w.placement, w.bytes));
            }
            w.visible_at + self.costs.wqe_process + payload_read
        } else {
            return Picos::MAX;
        };
        if head_ready > now {
            return head_ready;
        }
        let (host, pu, on_host) = (usize::from(q.host.0), q.pu, q.on_host);
        let layout = q.memory;
        let nic = &mut self.rnics[host];
        // A context not on chip is read over PCIe first, the unit busy meanwhile.
        let mut fetch = if nic.contexts.touch(on_host) {
            self.costs.dma_read
        } else {
            0
        };
        // So are the MPT and MTT entries of the payload's memory that it does not hold.
        if let Some((placement, bytes)) = reads.filter(|_| nic.translation.modelled()) {
            let (first, pages) = layout.pages(placement.at, bytes);
            fetch += nic.translation.look_up(placement.mr, first, pages);
        }
        let unit = &mut nic.pu_free[pu];
        let start = now.max(*unit) + fetch;
        *unit = start + self.costs.pu_interval;
        self.qps[qp.index()].pu_booking = Some(start);
        start
    }

    /// Lists a queue pair as ready at its RNIC if it has a packet ready, or makes sure a
    /// wake-up is scheduled for when it will.
    fn refresh<E: FabricEvents>(&mut self, qp: QpId, q: &mut EventQueue<E>) {
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
            q.schedule(ready, RnicEvent::QpReady(qp));
        }
    }

    /// Handles [`RnicEvent::QpReady`].
    pub(crate) fn on_qp_ready<E: FabricEvents>(&mut self, qp: QpId, q: &mut EventQueue<E>) {
        let entry = &mut self.qps[qp.index()];
        if entry.ready_event_at == q.now() {
            entry.ready_event_at = Picos::MAX;
        }
        self.refresh(qp, q);
    }

    /// Sends `packet` down `link_id`, whose sender puts its first bit on the wire at
    /// `head_leaves` and its last at `done`: into a switch's input buffer, or to a host.
    pub(crate) fn forward<E: FabricEvents>(
        &mut self,
        link_id: LinkId,
        packet: Packet,
        head_leaves: Picos,
        done: Picos,
        q: &mut EventQueue<E>,
    ) {
        let link = self.topology.link(link_id);
        let mut arrival = link.arrival(done);
        let host = match self.topology.node(link.to) {
            NodeKind::Switch(sw) => {
                let head_arrives = link.arrival(head_leaves);
                self.switches
                    .enter(&self.topology, sw, link_id, packet, head_arrives, q);
                return;
            }
            NodeKind::Host(host) => host,
        };
        let rnr = self.costs.rnr_nak > 0 && self.meets_rnr(&packet);
        if let Some(rx) = &mut self.rnics[usize::from(host.0)].rx {
            // The receive stage takes packets in the order they arrive, which is the order
            // they are put on this, the host's one link in; what it has not finished waits
            // in the receive buffer, whose credits come back to the link's sender one cable
            // delay after the stage is through.
            let mut through = rx.take(link.arrival(head_leaves), arrival, packet.payload);
            if rnr {
                through = rx.hold(self.costs.rnr_nak);
            }
            q.schedule(
                through + link.propagation(),
                SwitchEvent::CreditReturn {
                    link: link_id,
                    lane: packet.lane,
                    bytes: packet.wire,
                },
            );
            arrival = through;
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
            RnicEvent::PacketArrive {
                link: link_id,
                packet,
            },
        );
    }

    /// The owner of a queue pair.
    pub(crate) fn owner(&self, qp: QpId) -> QpOwner {
        self.qps[qp.index()].owner
    }

    /// Handles an RNIC event: the one entry point of the RNICs. Returns what the hosts'
    /// software must be told.
    pub(crate) fn handle<E: FabricEvents>(
        &mut self,
        event: RnicEvent,
        q: &mut EventQueue<E>,
    ) -> Option<Upcall> {
        match event {
            RnicEvent::QpReady(qp) => self.on_qp_ready(qp, q),
            RnicEvent::ArbiterWake { host, gen } => self.on_arbiter_wake(host, gen, q),
            RnicEvent::PacketArrive { link, packet } => self.on_packet_arrive(link, packet, q),
            RnicEvent::CqeVisible { qp, upto } => return Some(Upcall::Completions { qp, upto }),
            RnicEvent::Deliver { qp, bytes } => return Some(Upcall::Deliver { qp, bytes }),
            RnicEvent::ControlDone {
                host,
                app,
                verb,
                pages,
                issued,
            } => {
                self.control_done(host, verb, pages);
                return Some(Upcall::ControlDone { app, issued });
            }
        }
        None
    }

    /// Handles a switch event, and forwards what a switch sends or wakes the host that may
    /// send again.
    pub(crate) fn handle_switch<E: FabricEvents>(
        &mut self,
        event: SwitchEvent,
        q: &mut EventQueue<E>,
    ) {
        match self.switches.handle(&self.topology, event, q) {
            SwitchOutcome::Nothing => {}
            SwitchOutcome::Forward {
                link,
                packet,
                head_leaves,
                done,
            } => self.forward(link, packet, head_leaves, done, q),
            SwitchOutcome::HostUnblocked(link) => {
                if let NodeKind::Host(host) = self.topology.node(self.topology.link(link).from) {
                    if !self.rnics[usize::from(host.0)].ready.is_empty() {
                        self.kick(host, q);
                    }
                }
            }
        }
    }
}

/// What the stages' tests need to drive the fabric without a run around it.
#[cfg(test)]
pub(crate) mod testing {
    #![allow(clippy::expect_used)]

    use super::*;

    /// The fabric's events and nothing else: a queue of these runs RNICs and switches
    /// alone.
    #[derive(Clone, Copy, Debug)]
    pub(crate) enum TestEvent {
        /// An RNIC's.
        Rnic(RnicEvent),
        /// A switch's.
        Switch(SwitchEvent),
    }

    impl From<RnicEvent> for TestEvent {
        fn from(event: RnicEvent) -> Self {
            TestEvent::Rnic(event)
        }
    }

    impl From<SwitchEvent> for TestEvent {
        fn from(event: SwitchEvent) -> Self {
            TestEvent::Switch(event)
        }
    }

    /// Handles one event of a test's queue, as a run's loop would.
    pub(crate) fn dispatch(
        f: &mut Fabric,
        event: TestEvent,
        q: &mut EventQueue<TestEvent>,
    ) -> Option<Upcall> {
        match event {
            TestEvent::Rnic(event) => f.handle(event, q),
            TestEvent::Switch(event) => {
                f.handle_switch(event, q);
                None
            }
        }
    }

    /// RoCE-100 without host or PCIe jitter, so that hand-computed times hold exactly.
    pub(crate) fn quiet_profile() -> ModelProfile {
        let mut profile = ModelProfile::builtin("RoCE-100").expect("built-in profile");
        profile.host.jitter_ns = 0.0;
        profile.pcie.read_jitter_ns = 0.0;
        profile
    }

    /// Two hosts back to back, measured from time 0 on.
    pub(crate) fn two_hosts(profile: &ModelProfile) -> Fabric {
        let topology = Topology::back_to_back(["a", "b"], &profile.link);
        Fabric::new(topology, profile, 1, (0, Picos::MAX))
    }

    /// An endpoint on `host` owned by the policy.
    pub(crate) fn end(host: u16, deliver: bool) -> Endpoint {
        Endpoint {
            host: HostId(host),
            owner: QpOwner::Policy,
            deliver,
        }
    }

    /// Bytes a queue pair still has to send.
    pub(crate) fn unsent(f: &Fabric, qp: QpId) -> u64 {
        let q = &f.qps[qp.index()];
        let current = q.current.map_or(0, |m| u64::from(m.remaining));
        current + q.sq.iter().map(|w| u64::from(w.bytes)).sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{quiet_profile, two_hosts};
    use crate::time;

    /// A max payload of 256 B and 10 ns a TLP: 64 B at offset 0 is one TLP (10 ns), at
    /// 224 it crosses a boundary at 256 (224 + 64 = 288 > 256): two, 20 ns; a 4096-byte
    /// packet aligned is 16 TLPs (160 ns), 100 bytes past a boundary
    /// ceil((100 + 4096) / 256) = 17 (170 ns); no payload, nothing.
    #[test]
    fn a_misaligned_payload_needs_one_tlp_more() {
        let mut profile = quiet_profile();
        profile.pcie.max_payload_bytes = 256;
        profile.pcie.read_tlp_ns = 10.0;
        let f = two_hosts(&profile);
        let ns = time::from_ns;
        assert_eq!(f.tlp_time(64, 0), ns(10.0));
        assert_eq!(f.tlp_time(64, 224), ns(20.0));
        assert_eq!(f.tlp_time(4096, 0), ns(160.0));
        assert_eq!(f.tlp_time(4096, 100), ns(170.0));
        assert_eq!(f.tlp_time(0, 100), 0);
        let off = two_hosts(&quiet_profile());
        assert_eq!(off.tlp_time(4096, 100), 0, "not modelled by default");
    }
}
