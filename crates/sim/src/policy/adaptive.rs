//! `adaptive`: a thin driver of the core's adaptive law
//! ([`justitia_core::adaptive::AdaptiveLaw`]): the host's bandwidth flows paced together,
//! just below the rate the transmitter drains them, in chunks sized from the latency flows'
//! measured tail.
//!
//! What the driver does, as a shaper on a real host would:
//!
//! - **Target.** The core's control loop (driven as `justitia` drives it) resolves
//!   Target99 from the `[justitia]` parameters, absolute or a multiple of the reference
//!   probe's idle p99, and keeps the probe; its SafeUtil and allotments are not used.
//! - **Measured tail.** The driver sees every request the latency flows post and its
//!   completion, and gathers those post-to-completion times per tenant in the core's
//!   [`LatencyTail`] (the application's own messages, hundreds per period, where the probe
//!   gives one); after each RefPeriod the law reads the worst tenant's p99, and a tenant
//!   without [`MIN_SAMPLES`](justitia_core::adaptive::latency_tail::MIN_SAMPLES) of them keeps gathering into the next, as the daemon does
//!   with its shapers' reports.
//! - **Others' load.** Wire bytes the latency and throughput flows posted over the period
//!   (payload plus the profile's per-packet headers), so that the bandwidth flows are paced
//!   within what is left.
//! - **Plan.** After each RefPeriod the law takes the counts, the target, the tail and the
//!   others' load and returns a plan; on any flow's arrival or departure the plan for the
//!   new counts is applied at once. The plan goes to a [`ChunkShaper`]: one stream of
//!   chunks for all bandwidth flows of the host charged to one resource, round robin over
//!   their queue pairs, paced by the core's [`Pacer`] (the one enforcement algorithm) at
//!   the plan's total rate.
//!   Which queue pair the next chunk comes from is the core's [`TenantRoundRobin`]: by
//!   tenant and weight, then among the tenant's own flows and queue pairs, so a tenant's
//!   share does not grow with its applications or queue pairs. Without pacing, chunks are
//!   the plan's large ones and the shaper keeps at most two of them on the RNIC (far more
//!   than the link's bandwidth-delay product, so the link stays busy): the RNIC serves its
//!   queue pairs in turn, and only what the shaper holds back lets the round robin, not the
//!   number of queue pairs, decide the tenants' shares.
//! - **Resources.** A bandwidth flow's chunks go in the stream of the send path its bytes
//!   leave by (the core's [`Resource`]): this host's for WRITEs and SENDs, the responder's
//!   for a READ requester. Each stream has its own round robin and pacer and follows the
//!   plan of its resource's flows ([`AdaptiveLaw::plan_charged`], from the core's
//!   [`charged_to`]; the send paths a latency message crosses from [`latency_paths`]), with the law's chunk split among the send paths a latency message's
//!   round trip crosses. Each send path is charged the wire its stream does not carry but
//!   this host's traffic makes it send: on this host's, the unshaped flows' messages and a
//!   request packet per READ chunk; on a peer's, an acknowledgement per message sent to it.
//! - **Tenants.** The law is told L, B and T as weighted tenant counts (the core's
//!   [`TenantWeights`] of the flows present).
//! - **Throughput flows.** When the plan paces them by operations, each throughput flow's
//!   requests go through a [`PacedShaper`] (the same enforcement the `justitia` policy
//!   uses) at the plan's operations/s for its tenant, split among the tenant's throughput
//!   flows; otherwise they pass as posted.
//!
//! No hardware classes, no change to applications: chunks are ordinary WRITEs of the
//! application's own buffers, and the application hears of a message when its last chunk
//! completes.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use justitia_core::adaptive::allotments::{throughput_paces, HostFlow};
use justitia_core::adaptive::latency_tail::LatencyTail;
#[cfg(test)]
use justitia_core::adaptive::latency_tail::MIN_SAMPLES;
use justitia_core::adaptive::{
    charged_to, latency_paths, AdaptiveConfig, AdaptiveConfigError, AdaptiveLaw, Observation, Plan,
    Resource, TenantRoundRobin, TenantWeights,
};
use justitia_core::flow::{FlowClass, FlowSpec, TenantId};
use justitia_core::pacer::{PaceRate, Pacer};

use super::control_verbs::ControlVerbShaper;
use super::justitia::{core_time, JustitiaError, JustitiaParams, LoopDriver};
use super::paced::{self, PacedShaper};
use super::preempt::PreemptParams;
use super::split::{SideChannel, SplitSender};
use super::translation::TranslationCharge;
use super::{ControlCall, FlowInfo, Policy, PolicyContext, PolicyFigures, PolicyMessage};
use crate::model_profile::ModelProfile;
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::series::{ControlState, Mode};
use crate::time::{self, Picos};
use crate::topology::HostId;
use justitia_core::two_sided::Posting;

/// Timer tags at or above this are a stream's pacing timer, `PACE_TIMER + its index` (the
/// loop's is 0).
const PACE_TIMER: u64 = 1 << 61;

/// Chunks one queue pair may have on the RNIC: enough for the bandwidth-delay product of
/// a 100 Gb/s link with chunks of a few KB, so that pacing, not the window, sets the rate.
const WINDOW_CHUNKS: u32 = 64;

/// Chunks of the plan's size the shaper keeps on the RNIC while not pacing.
const UNPACED_WINDOW_CHUNKS: u64 = 2;

/// Why the `adaptive` policy could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AdaptiveError {
    /// The control loop refused its settings.
    #[error(transparent)]
    Justitia(#[from] JustitiaError),
    /// The law refused its settings.
    #[error(transparent)]
    Law(#[from] AdaptiveConfigError),
}

/// A bandwidth flow's message not yet fully handed to the RNIC.
struct Pending {
    app_tag: u64,
    opcode: Opcode,
    remaining: u64,
    /// Its number in the split-SEND protocol: its chunks come from the queue pair's
    /// [`SplitSender`], each against the receiver's credit.
    split: Option<u64>,
}

/// A bandwidth flow's queue pair.
struct ShapedQp {
    pending: VecDeque<Pending>,
    in_flight: u32,
    /// The host at the other end.
    peer: HostId,
    /// The sending half of the split-SEND protocol, from the queue pair's first SEND.
    sender: Option<SplitSender>,
}

/// What a request the shaper handed to the RNIC stands for.
#[derive(Clone, Copy)]
enum Handed {
    /// A chunk of `bytes`; `last` ends the application's message.
    Chunk {
        app_tag: u64,
        bytes: u64,
        last: bool,
        /// The announced message it is a chunk of.
        split: Option<u64>,
    },
    /// A zero-length yield.
    Yield,
}

/// The host's bandwidth flows charged to one resource as one paced stream of chunks.
pub struct ChunkShaper {
    /// Its pacing timer's tag.
    timer_tag: u64,
    qps: BTreeMap<QpId, ShapedQp>,
    /// Which queue pair's chunk goes next.
    order: TenantRoundRobin<QpId>,
    /// The queue pair picked whose chunk the pacer has not let go yet: it goes first.
    held: Option<QpId>,
    /// Bytes of chunks on the RNIC.
    in_flight_bytes: u64,
    plan: Plan,
    pacer: Option<Pacer>,
    timer_at: Option<Picos>,
    handed: BTreeMap<(QpId, u64), Handed>,
    next_tag: u64,
    chunks: u64,
    yields: u64,
    /// Chunks handed over since the driver last took the count, by the host at the other
    /// end: each costs that host's send path an acknowledgement (a WRITE or a SEND) or
    /// this host's a request packet (a READ).
    messages_to: BTreeMap<HostId, u64>,
    /// The law's settings: what a chunk is charged ([`AdaptiveConfig::charged_bytes`]).
    config: AdaptiveConfig,
}

impl ChunkShaper {
    fn new<'a>(
        flows: impl IntoIterator<Item = &'a FlowInfo>,
        timer_tag: u64,
        config: AdaptiveConfig,
    ) -> Self {
        let mut order = TenantRoundRobin::new();
        let mut qps = BTreeMap::new();
        for f in flows
            .into_iter()
            .filter(|f| f.spec.class == FlowClass::Bandwidth)
        {
            for &qp in &f.qps {
                qps.insert(
                    qp,
                    ShapedQp {
                        pending: VecDeque::new(),
                        in_flight: 0,
                        peer: f.peer,
                        sender: None,
                    },
                );
                order.insert(&f.spec, qp);
            }
        }
        ChunkShaper {
            timer_tag,
            qps,
            order,
            held: None,
            in_flight_bytes: 0,
            plan: Plan {
                pace_bytes_per_sec: None,
                chunk_bytes: u32::MAX,
                yields_per_chunk: 0,
                throughput_share: None,
                queue_budget: None,
            },
            pacer: None,
            timer_at: None,
            handed: BTreeMap::new(),
            next_tag: 1,
            chunks: 0,
            yields: 0,
            messages_to: BTreeMap::new(),
            config,
        }
    }

    fn shapes(&self, qp: QpId) -> bool {
        self.qps.contains_key(&qp)
    }

    /// Applies a plan: the pacer follows its rate (or goes), and whatever it now allows
    /// is handed over.
    fn apply(&mut self, ctx: &mut PolicyContext<'_>, plan: Plan) {
        let now = core_time(ctx.now());
        match plan.pace_bytes_per_sec {
            Some(rate) => {
                // No burst beyond the request that overdraws the balance: the latency
                // flows' band has room for one chunk ahead of them, and the pacer's usual
                // two-chunk burst put two back to back whenever an idle flow posted (an
                // application posting 4 KB messages at 6 Gb/s pushed the latency flow's p99
                // to x1.21 of alone).
                let rate = PaceRate {
                    bytes_per_sec: rate.max(1.0) as u64,
                    ops_per_sec: None,
                    chunk_bytes: 1,
                };
                match &mut self.pacer {
                    Some(p) => p.set_rate(now, rate),
                    // A burst of the minimum the pacer allows: the window is the enforcer's
                    // lateness, and the simulator comes back exactly when told.
                    None => self.pacer = Some(Pacer::with_burst_window(rate, Duration::ZERO, now)),
                }
            }
            None => self.pacer = None,
        }
        self.order.set_quantum(u64::from(plan.chunk_bytes.max(1)));
        self.order.set_queue_budget(plan.queue_budget);
        self.plan = plan;
        self.pump(ctx);
    }

    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        let chunk_bytes = self.plan.chunk_bytes;
        if let Some(entry) = self.qps.get_mut(&qp) {
            // A SEND is split only through the protocol: announced now, at the plan's
            // chunk size, its chunks sent against the receiver's credits.
            let split = (wr.opcode == Opcode::Send && !wr.inline)
                .then(|| {
                    let peer = entry.peer;
                    entry
                        .sender
                        .get_or_insert_with(|| SplitSender::new(peer, ctx.peer_of(qp)))
                        .post(wr.tag, wr.bytes, equal_chunk(wr.bytes, chunk_bytes))
                })
                .flatten();
            entry.pending.push_back(Pending {
                app_tag: wr.tag,
                opcode: wr.opcode,
                remaining: u64::from(wr.bytes),
                split,
            });
        }
        self.pump(ctx);
    }

    /// Hands the announcements made since the last call to the side channel.
    fn flush_side(&mut self, ctx: &mut PolicyContext<'_>, side: &mut SideChannel) {
        for sender in self.qps.values_mut().filter_map(|e| e.sender.as_mut()) {
            side.flush(ctx, sender);
        }
    }

    /// The receiver's credit for message `seq` of `qp`.
    fn on_credit(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, seq: u64, posting: Posting) {
        if let Some(sender) = self.qps.get_mut(&qp).and_then(|e| e.sender.as_mut()) {
            sender.on_credit(seq, posting);
        }
        self.pump(ctx);
    }

    /// Bytes of the next piece of `entry`'s head message, `None` while it waits for a
    /// credit.
    fn head_bytes(entry: &ShapedQp, chunk_bytes: u64) -> Option<u64> {
        let head = entry.pending.front()?;
        match head.split {
            Some(_) => entry.sender.as_ref()?.ready_bytes().map(u64::from),
            None => Some(Self::piece(head.remaining, chunk_bytes)),
        }
    }

    /// A completion on a shaped queue pair: true if it was one of the shaper's.
    fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) -> bool {
        match self.handed.remove(&(qp, tag)) {
            Some(Handed::Chunk {
                app_tag,
                bytes,
                last,
                split,
            }) => {
                let mut split_done = None;
                if let Some(entry) = self.qps.get_mut(&qp) {
                    entry.in_flight = entry.in_flight.saturating_sub(1);
                    split_done = split.and_then(|seq| entry.sender.as_mut()?.chunk_done(seq));
                }
                self.in_flight_bytes = self.in_flight_bytes.saturating_sub(bytes);
                if let Some(app_tag) = split_done {
                    ctx.complete(qp, app_tag);
                } else if last && split.is_none() {
                    ctx.complete(qp, app_tag);
                }
                self.pump(ctx);
                true
            }
            Some(Handed::Yield) => true,
            None => false,
        }
    }

    fn on_timer(&mut self, ctx: &mut PolicyContext<'_>) {
        if self.timer_at == Some(ctx.now()) {
            self.timer_at = None;
        }
        self.pump(ctx);
    }

    /// The next piece of a message of `remaining` bytes: its rest in equal pieces of at
    /// most a chunk, so that a 4 KB message with 4000 B chunks goes as two of 2 KB, not
    /// 4000 B and a 96 B tail that costs a whole packet's headers.
    fn piece(remaining: u64, chunk_bytes: u64) -> u64 {
        let pieces = remaining.div_ceil(chunk_bytes).max(1);
        remaining.div_ceil(pieces)
    }

    /// The queue pair whose chunk goes next: the one held for the pacer, else the round
    /// robin's pick among those with a message waiting and room in their window, each
    /// tenant charged what its chunk costs the RNIC.
    fn next_qp(&mut self, window: u32, chunk_bytes: u64) -> Option<QpId> {
        let qps = &self.qps;
        let (config, plan_chunk) = (&self.config, self.plan.chunk_bytes);
        let ready = |qp: QpId| {
            qps.get(&qp)
                .filter(|e| e.in_flight < window)
                .and_then(|e| Self::head_bytes(e, chunk_bytes))
                .map(|bytes| config.charged_bytes(bytes, plan_chunk))
        };
        if let Some(qp) = self.held.take().filter(|&qp| ready(qp).is_some()) {
            return Some(qp);
        }
        self.order.pick(ready)
    }

    /// Hands the RNIC what the plan allows.
    fn pump(&mut self, ctx: &mut PolicyContext<'_>) {
        let chunk_bytes = u64::from(self.plan.chunk_bytes.max(1));
        let (window, bytes_window) = if self.pacer.is_some() {
            (WINDOW_CHUNKS, u64::MAX)
        } else {
            (u32::MAX, UNPACED_WINDOW_CHUNKS.saturating_mul(chunk_bytes))
        };
        while self.in_flight_bytes < bytes_window {
            let Some(qp) = self.next_qp(window, chunk_bytes) else {
                return;
            };
            let Some(entry) = self.qps.get_mut(&qp) else {
                return;
            };
            let Some(bytes) = Self::head_bytes(entry, chunk_bytes) else {
                return;
            };
            let Some(head) = entry.pending.front_mut() else {
                return;
            };
            if let Some(pacer) = &mut self.pacer {
                // Paced by what the chunk costs: a 64 B message takes a whole message's
                // wire headers, or processing slot, not 64 B of MaxRate.
                let charged = self.config.charged_bytes(bytes, self.plan.chunk_bytes);
                if let Err(wait) = pacer.try_release(core_time(ctx.now()), charged, 1) {
                    self.held = Some(qp);
                    let at = ctx.now() + time::from_ns(wait.as_nanos() as f64);
                    // A timer already due no later serves; one is never left in the
                    // past, as `on_timer` forgets it when it fires.
                    if self.timer_at.is_none_or(|t| t > at) {
                        self.timer_at = Some(at);
                        ctx.set_timer(at, self.timer_tag);
                    }
                    return;
                }
            }
            let split = head.split;
            if split.is_some()
                && entry
                    .sender
                    .as_mut()
                    .and_then(SplitSender::next_chunk)
                    .is_none()
            {
                return;
            }
            head.remaining = head.remaining.saturating_sub(bytes);
            let (app_tag, opcode, last) = (head.app_tag, head.opcode, head.remaining == 0);
            *self.messages_to.entry(entry.peer).or_insert(0) += 1;
            if last {
                entry.pending.pop_front();
            }
            entry.in_flight += 1;
            self.in_flight_bytes += bytes;
            let tag = self.hand(
                qp,
                Handed::Chunk {
                    app_tag,
                    bytes,
                    last,
                    split,
                },
            );
            self.chunks += 1;
            ctx.post(
                qp,
                WorkRequest {
                    tag,
                    opcode,
                    bytes: u32::try_from(bytes).unwrap_or(u32::MAX),
                    inline: false,
                },
            );
            for _ in 0..self.plan.yields_per_chunk {
                let tag = self.hand(qp, Handed::Yield);
                self.yields += 1;
                ctx.post(
                    qp,
                    WorkRequest {
                        tag,
                        opcode: Opcode::Write,
                        bytes: 0,
                        inline: true,
                    },
                );
            }
        }
    }

    fn hand(&mut self, qp: QpId, what: Handed) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        self.handed.insert((qp, tag), what);
        tag
    }
}

/// The chunk size that cuts a message of `bytes` into equal pieces of at most
/// `chunk_bytes` (the last shorter by less than one byte per piece), as
/// [`ChunkShaper::piece`] cuts an unannounced one: an announced message keeps one chunk
/// size, so it is chosen here rather than leave a short tail that costs a whole packet's
/// headers.
fn equal_chunk(bytes: u32, chunk_bytes: u32) -> u32 {
    let chunk = u64::from(chunk_bytes.max(1));
    u32::try_from(ChunkShaper::piece(u64::from(bytes), chunk))
        .unwrap_or(chunk_bytes)
        .max(1)
}

/// The `adaptive` policy on one host.
pub struct AdaptivePolicy {
    driver: LoopDriver,
    /// The side channel of split SENDs, and this host's receiving halves.
    side: SideChannel,
    law: AdaptiveLaw,
    /// One stream per resource the bandwidth flows are charged to, this host's send path
    /// first; a stream's index is its timer's offset from [`PACE_TIMER`].
    streams: Vec<(Resource<HostId>, ChunkShaper)>,
    /// What each flow is charged to, and the host at its other end.
    charged: BTreeMap<u64, Resource<HostId>>,
    peers: BTreeMap<u64, HostId>,
    /// The throughput flows' operations pacing, and each throughput flow's queue pairs.
    throughput: Option<PacedShaper>,
    throughput_qps: BTreeMap<u64, u32>,
    /// Wire bytes/s, and the MTU, given to a throughput flow's pacer for its bytes lane
    /// (never the lane that binds: its small messages are paced by operations).
    wire_bytes_per_sec: u64,
    mtu: u32,
    header_bytes: f64,
    /// Wire bytes of an acknowledgement, and of a READ request packet.
    ack_bytes: f64,
    request_bytes: f64,
    /// Class, peer and tenant of each flow's queue pairs that the policy does not shape.
    watched: BTreeMap<QpId, (FlowClass, HostId, TenantId)>,
    /// Present flows.
    present: BTreeMap<u64, FlowSpec>,
    /// Post times of the latency flows' requests on the RNIC, by (queue pair, tag).
    posted_at: BTreeMap<(QpId, u64), Picos>,
    /// The latency flows' round trips since the last fed period, per tenant.
    tail: LatencyTail,
    /// Wire bytes each send path carried besides its stream's chunks since the last update
    /// (the unshaped flows' messages on this host's, the acknowledgements and READ requests
    /// of this host's messages on either), since when, and their rates over the last span.
    other_bytes: BTreeMap<Resource<HostId>, f64>,
    other_since: Picos,
    other_rate: BTreeMap<Resource<HostId>, f64>,
    updates_seen: u64,
    /// The latency flows' p99 fed to the law last.
    last_p99: Option<Duration>,
    steers: bool,
    paced_updates: u64,
    updates: u64,
    /// The applications' control verbs, paced when the scenario gives a host budget (in
    /// `[justitia]`, with the target).
    control_verbs: Option<ControlVerbShaper>,
}

impl AdaptivePolicy {
    /// A policy for a host with this RNIC: the target and probe from `justitia`'s
    /// parameters; `preempt`'s are not used (accepted so that a scenario's `[preempt]`
    /// table applies to every policy alike).
    pub fn new(
        profile: &ModelProfile,
        justitia: &JustitiaParams,
        _preempt: &PreemptParams,
    ) -> Result<Self, AdaptiveError> {
        let driver = LoopDriver::new(&profile.policy, justitia)
            .map_err(|e| AdaptiveError::Justitia(e.into()))?;
        let config = AdaptiveConfig::for_model(&profile.policy, &profile.facts());
        Ok(AdaptivePolicy {
            side: SideChannel::new(profile.link.header_bytes),
            driver,
            law: AdaptiveLaw::new(config)?,
            streams: Vec::new(),
            charged: BTreeMap::new(),
            peers: BTreeMap::new(),
            throughput: None,
            throughput_qps: BTreeMap::new(),
            wire_bytes_per_sec: (profile.link.gbps * 1e9 / 8.0) as u64,
            mtu: profile.mtu(),
            header_bytes: f64::from(profile.link.header_bytes),
            ack_bytes: f64::from(profile.link.ack_bytes),
            request_bytes: f64::from(
                profile.link.header_bytes + profile.link.first_packet_extra_bytes,
            ),
            watched: BTreeMap::new(),
            present: BTreeMap::new(),
            posted_at: BTreeMap::new(),
            tail: LatencyTail::new(usize::MAX),
            other_bytes: BTreeMap::new(),
            other_since: 0,
            other_rate: BTreeMap::new(),
            updates_seen: 0,
            last_p99: None,
            steers: false,
            paced_updates: 0,
            updates: 0,
            control_verbs: ControlVerbShaper::new(justitia),
        })
    }

    fn observation(&self, current99: Option<Duration>) -> Observation {
        Observation {
            tenants: TenantWeights::of(self.present.values()),
            target99: self.driver.control.target().value,
            current99,
            other_bytes_per_sec: self.other_rate(&Resource::SendPath),
        }
    }

    /// Charges `bytes` of wire to a send path.
    fn charge(&mut self, resource: Resource<HostId>, bytes: f64) {
        *self.other_bytes.entry(resource).or_insert(0.0) += bytes;
    }

    /// What a send path carried lately besides its stream, wire bytes/s.
    fn other_rate(&self, resource: &Resource<HostId>) -> f64 {
        self.other_rate.get(resource).copied().unwrap_or(0.0)
    }

    /// Charges the streams' chunks since the last count to the send paths they cost
    /// besides their own: a WRITE or SEND chunk its acknowledgement on the peer's, a READ
    /// chunk its request packet on this host's.
    fn count_stream_messages(&mut self) {
        let mut charges = Vec::new();
        for (resource, stream) in &mut self.streams {
            for (peer, n) in std::mem::take(&mut stream.messages_to) {
                charges.push(match resource {
                    Resource::SendPath => (Resource::Responder(peer), n as f64 * self.ack_bytes),
                    Resource::Responder(_) => (Resource::SendPath, n as f64 * self.request_bytes),
                });
            }
        }
        for (resource, bytes) in charges {
            self.charge(resource, bytes);
        }
    }

    fn replan(&mut self, ctx: &mut PolicyContext<'_>) {
        self.apply(ctx, &self.observation(None));
    }

    /// The plan for the flows charged to `resource`.
    fn plan_for(&self, resource: &Resource<HostId>, host: &Observation) -> Plan {
        let other = match resource {
            Resource::SendPath => host.other_bytes_per_sec,
            Resource::Responder(_) => self.other_rate(resource),
        };
        let flows = self
            .present
            .iter()
            .filter_map(|(id, spec)| Some((spec, self.charged.get(id)?, self.peers.get(id))));
        let charged = charged_to(resource, host, flows.clone().map(|(f, r, _)| (f, r)), other);
        self.law.plan_charged(host, &charged, latency_paths(flows))
    }

    /// Hands each stream its resource's plan, and the throughput flows' pacers the send
    /// path's.
    fn apply(&mut self, ctx: &mut PolicyContext<'_>, host: &Observation) {
        let plans: Vec<Plan> = self
            .streams
            .iter()
            .map(|(resource, _)| self.plan_for(resource, host))
            .collect();
        for ((_, stream), plan) in self.streams.iter_mut().zip(plans) {
            stream.apply(ctx, plan);
        }
        let plan = self.plan_for(&Resource::SendPath, host);
        if let Some(throughput) = &mut self.throughput {
            let present: Vec<HostFlow> = self
                .throughput_qps
                .iter()
                .filter_map(|(id, &qps)| self.present.get(id).map(|&spec| HostFlow { spec, qps }))
                .collect();
            if let Some(charge) = throughput.translation_mut() {
                let mut weights: BTreeMap<TenantId, u32> = BTreeMap::new();
                for f in &present {
                    let w = weights.entry(f.spec.tenant).or_insert(0);
                    *w = (*w).max(f.spec.weight.get());
                }
                charge.set_shares(
                    weights
                        .into_iter()
                        .map(|(t, w)| (t, self.law.translation_share(w, host))),
                );
            }
            for (id, ops) in throughput_paces(&self.law, &plan, &present) {
                let rate = ops.map(|ops| PaceRate {
                    bytes_per_sec: self.wire_bytes_per_sec,
                    ops_per_sec: Some(ops.max(1.0) as u64),
                    chunk_bytes: self.mtu,
                });
                throughput.set_pace(ctx, id, rate);
            }
            // The law counts flows by presence, not by the shaper's view of their work.
            throughput.take_activity();
        }
    }

    fn drive(&mut self, ctx: &mut PolicyContext<'_>) {
        self.driver.drive(ctx);
        let updates = self.driver.control.updates();
        if updates == self.updates_seen {
            return;
        }
        self.updates_seen = updates;
        let now = ctx.now();
        self.count_stream_messages();
        let span = now.saturating_sub(self.other_since);
        if span > 0 {
            let seconds = span as f64 / time::SECOND as f64;
            self.other_rate = std::mem::take(&mut self.other_bytes)
                .into_iter()
                .map(|(r, bytes)| (r, bytes / seconds))
                .collect();
        }
        self.other_since = now;
        let p99 = self.tail.take_p99();
        if p99.is_some() {
            self.last_p99 = p99;
        }
        let o = self.observation(p99);
        // One feedback for every stream: the law's chunk and fraction step on the host's
        // tail; each stream's plan is then its resource's.
        let _ = self.law.update(core_time(now), &o);
        self.apply(ctx, &o);
        self.updates += 1;
        if self
            .streams
            .first()
            .is_some_and(|(_, s)| s.plan.pace_bytes_per_sec.is_some())
        {
            self.paced_updates += 1;
        }
    }
}

impl Policy for AdaptivePolicy {
    fn name(&self) -> &str {
        "adaptive"
    }

    fn on_start(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        for f in flows {
            self.charged
                .insert(f.spec.id.0, Resource::of(f.reads, f.peer));
            self.peers.insert(f.spec.id.0, f.peer);
        }
        // This host's send path always has a stream (its plan paces the throughput flows
        // and is the one the figures show), then one per responder read from.
        let mut resources = vec![Resource::SendPath];
        for r in self.charged.values() {
            if !resources.contains(r) {
                resources.push(*r);
            }
        }
        self.streams = resources
            .into_iter()
            .enumerate()
            .map(|(i, resource)| {
                let flows = flows
                    .iter()
                    .filter(|f| self.charged.get(&f.spec.id.0) == Some(&resource));
                (
                    resource,
                    ChunkShaper::new(flows, PACE_TIMER + i as u64, *self.law.config()),
                )
            })
            .collect();
        let throughput: Vec<FlowInfo> = flows
            .iter()
            .filter(|f| f.spec.class == FlowClass::Throughput)
            .cloned()
            .collect();
        for f in &throughput {
            let qps = u32::try_from(f.qps.len()).unwrap_or(u32::MAX);
            self.throughput_qps.insert(f.spec.id.0, qps);
        }
        self.throughput = Some(
            PacedShaper::new(&throughput)
                .with_translation(TranslationCharge::new(*self.law.config())),
        );
        for f in flows
            .iter()
            .filter(|f| f.spec.class != FlowClass::Bandwidth)
        {
            for &qp in &f.qps {
                self.watched
                    .insert(qp, (f.spec.class, f.peer, f.spec.tenant));
            }
        }
        self.steers = flows.iter().any(|f| f.spec.class.is_resource_hungry());
        self.driver.connect(ctx, flows);
        self.drive(ctx);
    }

    fn on_flow_active(&mut self, ctx: &mut PolicyContext<'_>, flow: &FlowInfo, active: bool) {
        // The loop counts flows only for its probe; the law's counts are the driver's.
        self.driver.flow_present(ctx, flow, active);
        if active {
            let _ = self
                .driver
                .control
                .set_flow_active(core_time(ctx.now()), flow.spec.id, true);
            self.present.insert(flow.spec.id.0, flow.spec);
        } else {
            self.present.remove(&flow.spec.id.0);
        }
        self.replan(ctx);
    }

    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        if let Some((_, stream)) = self.streams.iter_mut().find(|(_, s)| s.shapes(qp)) {
            stream.on_post(ctx, qp, wr);
            stream.flush_side(ctx, &mut self.side);
            return;
        }
        if let Some(&(class, peer, _)) = self.watched.get(&qp) {
            self.charge(Resource::SendPath, f64::from(wr.bytes) + self.header_bytes);
            self.charge(Resource::Responder(peer), self.ack_bytes);
            if class == FlowClass::Latency {
                self.posted_at.insert((qp, wr.tag), ctx.now());
            }
        }
        if let Some(throughput) = &mut self.throughput {
            if throughput.shapes(qp) {
                throughput.on_post(ctx, qp, wr);
                throughput.take_activity();
                return;
            }
        }
        ctx.post(qp, wr);
    }

    fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        if SideChannel::owns_tag(tag) || self.driver.on_completion(ctx, qp) {
            return;
        }
        if let Some((_, stream)) = self.streams.iter_mut().find(|(_, s)| s.shapes(qp)) {
            if stream.on_completion(ctx, qp, tag) {
                return;
            }
        }
        if let Some(throughput) = &mut self.throughput {
            if throughput.shapes(qp) {
                throughput.on_completion(ctx, qp, tag);
                throughput.take_activity();
                return;
            }
        }
        if let Some(at) = self.posted_at.remove(&(qp, tag)) {
            if let Some(&(_, _, tenant)) = self.watched.get(&qp) {
                let ns = ctx.now().saturating_sub(at) / time::NANOSECOND;
                self.tail.record(tenant, Duration::from_nanos(ns));
            }
        }
        ctx.complete(qp, tag);
    }

    fn on_delivery(&mut self, _ctx: &mut PolicyContext<'_>, qp: QpId, bytes: u32) -> Option<u32> {
        self.side.on_delivery(qp, bytes)
    }

    fn on_control(&mut self, ctx: &mut PolicyContext<'_>, call: ControlCall) {
        match &mut self.control_verbs {
            Some(shaper) => shaper.on_control(ctx, call),
            None => ctx.control(call),
        }
    }

    fn on_message(&mut self, ctx: &mut PolicyContext<'_>, from: HostId, message: PolicyMessage) {
        let PolicyMessage::Side(bytes) = message else {
            return;
        };
        if let Some((qp, seq, posting)) = self.side.on_message(ctx, from, &bytes) {
            if let Some((_, stream)) = self.streams.iter_mut().find(|(_, s)| s.shapes(qp)) {
                stream.on_credit(ctx, qp, seq, posting);
            }
        }
    }

    fn on_timer(&mut self, ctx: &mut PolicyContext<'_>, tag: u64) {
        if tag >= paced::PACE_TIMER {
            if let Some(throughput) = &mut self.throughput {
                throughput.on_timer(ctx, tag);
                throughput.take_activity();
            }
        } else if tag >= PACE_TIMER {
            let index = usize::try_from(tag - PACE_TIMER).unwrap_or(usize::MAX);
            if let Some((_, stream)) = self.streams.get_mut(index) {
                stream.on_timer(ctx);
            }
        } else if self.driver.timer_is_current(ctx) {
            self.drive(ctx);
        }
    }

    /// The law's state in the series' terms: the rate the bandwidth flows are held to
    /// (MaxRate while not paced) as SafeUtil, and the latency flows' own p99 as Current99
    /// (not the probe's: the law reads the applications' tail).
    fn control_state(&self) -> Option<ControlState> {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        self.steers.then(|| ControlState {
            safe_util_gbps: self
                .streams
                .first()
                .and_then(|(_, s)| s.plan.pace_bytes_per_sec)
                .unwrap_or(self.law.config().max_rate_bytes_per_sec)
                * 8.0
                / 1e9,
            current99_us: self.last_p99.map(us),
            target99_us: self.driver.control.target().value.map(us),
            mode: Mode::Normal,
        })
    }

    fn figures(&self) -> PolicyFigures {
        let mut f = PolicyFigures::new();
        self.side.figures(&mut f);
        if let Some(t) = self.driver.control.target().value {
            f.insert("target99_us".into(), t.as_secs_f64() * 1e6);
        }
        let chunks: u64 = self.streams.iter().map(|(_, s)| s.chunks).sum();
        let yields: u64 = self.streams.iter().map(|(_, s)| s.yields).sum();
        f.insert("sub_messages".into(), chunks as f64);
        f.insert("yields".into(), yields as f64);
        // The send path's stream; a responder's as `read_pace_gbps.<host>`.
        for (resource, stream) in &self.streams {
            match resource {
                Resource::SendPath => {
                    f.insert("chunk_bytes".into(), f64::from(stream.plan.chunk_bytes));
                    if let Some(rate) = stream.plan.pace_bytes_per_sec {
                        f.insert("pace_gbps".into(), rate * 8.0 / 1e9);
                    }
                }
                Resource::Responder(host) => {
                    if let Some(rate) = stream.plan.pace_bytes_per_sec {
                        f.insert(format!("read_pace_gbps.{}", host.0), rate * 8.0 / 1e9);
                    }
                }
            }
        }
        f.insert("probes".into(), self.driver.control.updates() as f64);
        f.insert("decreases".into(), self.law.decreases() as f64);
        f.insert("pace_fraction".into(), self.law.fraction());
        if self.updates > 0 {
            f.insert(
                "paced_fraction".into(),
                self.paced_updates as f64 / self.updates as f64,
            );
        }
        if let Some(shaper) = &self.control_verbs {
            shaper.figures(&mut f);
        }
        f
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::policy::test_host::{write, TestHost};

    const KIB: u32 = 1024;

    /// The law's settings with a wire that costs nothing beyond MaxRate: a chunk is
    /// charged its payload.
    fn config() -> AdaptiveConfig {
        AdaptiveConfig::for_rnic(12.5e9, 4096, 64 * KIB)
    }

    fn plan(pace_bytes_per_sec: Option<f64>, chunk_bytes: u32, yields_per_chunk: u32) -> Plan {
        Plan {
            pace_bytes_per_sec,
            chunk_bytes,
            yields_per_chunk,
            throughput_share: None,
            queue_budget: None,
        }
    }

    /// A message is cut into equal pieces of at most a chunk; one no larger goes whole.
    #[test]
    fn a_message_is_cut_into_equal_pieces() {
        assert_eq!(ChunkShaper::piece(4096, 4000), 2048);
        assert_eq!(ChunkShaper::piece(10_000, 4096), 3334);
        assert_eq!(ChunkShaper::piece(4096, 4096), 4096);
        assert_eq!(ChunkShaper::piece(100, 4096), 100);
        assert_eq!(ChunkShaper::piece(0, 4096), 0);
    }

    /// Unpaced, two chunks of the plan's size are on the RNIC at a time, each followed by
    /// the plan's yields; a chunk's completion lets the next go, a yield's does not; the
    /// application hears once, at the last chunk.
    #[test]
    fn unpaced_two_chunks_are_on_the_rnic() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = ChunkShaper::new([&info], PACE_TIMER, config());
        assert!(shaper.shapes(qp));
        shaper.apply(&mut host.ctx(), plan(None, 16 * KIB, 2));
        shaper.on_post(&mut host.ctx(), qp, write(7, 64 * KIB));
        let sizes = |host: &TestHost| host.posted(qp).iter().map(|w| w.bytes).collect::<Vec<_>>();
        assert_eq!(sizes(&host), [16384, 0, 0, 16384, 0, 0]);
        let posted = host.posted(qp);
        assert!(shaper.on_completion(&mut host.ctx(), qp, posted[1].tag));
        assert_eq!(host.posted(qp).len(), 6);
        assert!(!shaper.on_completion(&mut host.ctx(), qp, 1 << 40));
        let mut done = 0;
        while done < host.posted(qp).len() {
            let w = host.posted(qp)[done];
            done += 1;
            if w.bytes == 0 {
                continue;
            }
            assert!(shaper.on_completion(&mut host.ctx(), qp, w.tag));
            let last = done == host.posted(qp).len() - 2;
            assert_eq!(host.completed(), if last { vec![7] } else { vec![] });
        }
        assert_eq!(sizes(&host).iter().filter(|&&b| b == 16384).count(), 4);
        assert_eq!((shaper.chunks, shaper.yields), (4, 8));
        assert_eq!(shaper.messages_to.get(&HostId(1)), Some(&4));
        assert_eq!(shaper.in_flight_bytes, 0);
    }

    /// Paced, chunks leave at the plan's rate with no burst: the first at once, each next
    /// one chunk's time at the rate (16 KB at 1 GB/s: 16.384 us) later.
    #[test]
    fn paced_chunks_leave_at_the_rate() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = ChunkShaper::new([&info], PACE_TIMER + 3, config());
        shaper.apply(&mut host.ctx(), plan(Some(1e9), 16 * KIB, 0));
        shaper.on_post(&mut host.ctx(), qp, write(7, 256 * KIB));
        assert_eq!(host.posted(qp).len(), 1);
        let start = host.now();
        while let Some((_, tag)) = host.next_timer() {
            assert_eq!(tag, PACE_TIMER + 3);
            shaper.on_timer(&mut host.ctx());
        }
        let posted = host.posted(qp);
        assert_eq!(posted.len(), 16);
        assert!(posted.iter().all(|w| w.bytes == 16 * KIB));
        let spent_us = (host.now() - start) as f64 / 1e6;
        assert!((spent_us - 15.0 * 16.384).abs() < 0.01, "{spent_us} us");
        // Unpaced, what is on the RNIC holds chunks back: 16 of them, where two may be.
        shaper.apply(&mut host.ctx(), plan(None, 16 * KIB, 0));
        shaper.on_post(&mut host.ctx(), qp, write(8, 256 * KIB));
        assert_eq!(host.posted(qp).len(), 16);
        for w in &posted {
            shaper.on_completion(&mut host.ctx(), qp, w.tag);
        }
        assert_eq!(host.posted(qp).len(), 18);
        assert_eq!(host.completed(), vec![7]);
    }

    /// Two tenants' queue pairs take turns once both have work: with chunks completing in
    /// the order they were posted, the first tenant's eight chunks do not all go before
    /// the second's.
    #[test]
    fn tenants_take_turns() {
        let mut host = TestHost::new();
        let a = host.flow(1, FlowClass::Bandwidth);
        let b = host.flow(2, FlowClass::Bandwidth);
        let (qa, qb) = (a.qps[0], b.qps[0]);
        let mut shaper = ChunkShaper::new([&a, &b], PACE_TIMER, config());
        shaper.apply(&mut host.ctx(), plan(None, 16 * KIB, 0));
        shaper.on_post(&mut host.ctx(), qa, write(1, 128 * KIB));
        shaper.on_post(&mut host.ctx(), qb, write(2, 128 * KIB));
        // A went alone while B had nothing: two chunks, the window.
        let counts = |host: &TestHost| (host.posted(qa).len(), host.posted(qb).len());
        assert_eq!(counts(&host), (2, 0));
        let mut outstanding: VecDeque<(QpId, u64)> =
            host.posted(qa).iter().map(|w| (qa, w.tag)).collect();
        let mut b_when_a_done = None;
        while let Some((qp, tag)) = outstanding.pop_front() {
            let before = counts(&host);
            shaper.on_completion(&mut host.ctx(), qp, tag);
            let after = counts(&host);
            for (q, (was, is)) in [(qa, (before.0, after.0)), (qb, (before.1, after.1))] {
                outstanding.extend(host.posted(q)[was..is].iter().map(|w| (q, w.tag)));
            }
            if after.0 == 8 && b_when_a_done.is_none() {
                b_when_a_done = Some(after.1);
            }
        }
        assert_eq!(counts(&host), (8, 8));
        // Turns in alternation from (2, 0) on: A's eighth chunk goes after B's fifth.
        assert!(b_when_a_done >= Some(5), "{b_when_a_done:?}");
        assert_eq!(host.completed().len(), 2);
    }

    /// The latency flows' p99 is the nearest-rank p99 of at least MIN_SAMPLES samples,
    /// which it uses up; fewer keep gathering.
    #[test]
    fn the_tail_is_a_nearest_rank_p99_of_enough_samples() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let justitia = JustitiaParams::default();
        let mut policy =
            AdaptivePolicy::new(&profile, &justitia, &PreemptParams::default()).unwrap();
        let us = Duration::from_micros;
        let t = TenantId(1);
        for n in 1..MIN_SAMPLES {
            policy.tail.record(t, us(n));
        }
        assert_eq!(policy.tail.take_p99(), None);
        assert_eq!(policy.tail.tenants(), 1);
        policy.tail.retain(|_| false);
        // 100 samples of 1 to 100 us, shuffled: the 99th smallest is 99 us.
        for n in 1..=100u64 {
            policy.tail.record(t, us((n * 37) % 100 + 1));
        }
        assert_eq!(policy.tail.take_p99(), Some(us(99)));
        assert_eq!(policy.tail.tenants(), 0);
        // 20 samples: rank ceil(19.8) = 20, the largest.
        for n in 1..=20 {
            policy.tail.record(t, us(n));
        }
        assert_eq!(policy.tail.take_p99(), Some(us(20)));
    }

    /// On a host with a latency, a bandwidth and a throughput flow: the latency flow's
    /// requests pass as posted and are timed from post to completion, their wire (payload
    /// and headers) is counted against the send path, and after the next RefPeriod the
    /// state shows their p99; the bandwidth flow's message goes in chunks of the plan's
    /// size, counted in the figures.
    #[test]
    fn the_policy_times_latency_requests_and_chunks_bandwidth() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let justitia = JustitiaParams {
            target99_us: Some(20.0),
            ..JustitiaParams::default()
        };
        let mut policy =
            AdaptivePolicy::new(&profile, &justitia, &PreemptParams::default()).unwrap();
        let mut host = TestHost::new();
        let mut reader = host.flow_to(4, FlowClass::Bandwidth, HostId(2));
        reader.reads = true;
        let flows = [
            host.flow(1, FlowClass::Latency),
            host.flow(2, FlowClass::Bandwidth),
            host.flow(3, FlowClass::Throughput),
            reader,
        ];
        policy.on_start(&mut host.ctx(), &flows);
        for f in &flows {
            policy.on_flow_active(&mut host.ctx(), f, true);
        }
        let (latency, bandwidth, throughput) = (flows[0].qps[0], flows[1].qps[0], flows[2].qps[0]);
        let read = flows[3].qps[0];
        // A stream for this host's send path and one for host 2's, which the READ uses.
        let resources: Vec<_> = policy.streams.iter().map(|(r, _)| *r).collect();
        assert_eq!(
            resources,
            [Resource::SendPath, Resource::Responder(HostId(2))]
        );
        let state = policy.control_state().unwrap();
        assert_eq!(state.current99_us, None);
        assert_eq!(state.target99_us, Some(20.0));

        let start = host.now();
        for i in 0..30 {
            policy.on_post(&mut host.ctx(), latency, write(100 + i, 64));
            let posted = host.posted(latency);
            let w = posted[posted.len() - 1];
            assert_eq!((w.tag, w.bytes), (100 + i, 64));
            host.advance_to(host.now() + 7_000_000);
            policy.on_completion(&mut host.ctx(), latency, w.tag);
            assert_eq!(host.completed(), vec![100 + i]);
        }
        policy.on_post(&mut host.ctx(), throughput, write(7, 64));
        assert_eq!(host.posted(throughput).len(), 1);
        policy.on_post(&mut host.ctx(), bandwidth, write(9, 1 << 20));
        let chunk = policy.streams[0].1.plan.chunk_bytes;
        assert!(chunk < 1 << 20);
        assert!(host.posted(bandwidth).iter().all(|w| w.bytes <= chunk));
        let read_request = WorkRequest {
            opcode: Opcode::Read,
            ..write(10, 1 << 20)
        };
        policy.on_post(&mut host.ctx(), read, read_request);
        let read_chunk = policy.streams[1].1.plan.chunk_bytes;
        assert!(read_chunk < 1 << 20);
        assert!(host.posted(read).iter().all(|w| w.bytes <= read_chunk));

        // The next update takes the period's samples, and the chunks posted until then.
        let (written, reads) = loop {
            let (_, tag) = host.next_timer().unwrap();
            let before = policy.updates;
            let chunks = |qp| host.posted(qp).iter().filter(|w| w.bytes > 0).count();
            let sent = (chunks(bandwidth), chunks(read));
            policy.on_timer(&mut host.ctx(), tag);
            if policy.updates > before {
                break sent;
            }
        };
        assert_eq!(policy.control_state().unwrap().current99_us, Some(7.0));
        // This host's send path carried 31 messages of 64 B with their headers and a
        // request packet per READ chunk; host 1's an acknowledgement per message this host
        // sent it, the 31 and the WRITE chunks; all over the time since the start.
        let seconds = (host.now() - start) as f64 / time::SECOND as f64;
        let link = &profile.link;
        let request = f64::from(link.header_bytes + link.first_packet_extra_bytes);
        let sent = 31.0 * (64.0 + f64::from(link.header_bytes)) + reads as f64 * request;
        let acks = (31 + written) as f64 * f64::from(link.ack_bytes);
        for (resource, wire) in [
            (Resource::SendPath, sent),
            (Resource::Responder(HostId(1)), acks),
        ] {
            let other = policy.other_rate(&resource);
            let expected = wire / seconds;
            assert!(
                (other - expected).abs() < 1e-9 * expected,
                "{resource:?}: {other} vs {expected}"
            );
        }
        let state = policy.control_state().unwrap();
        let max_gbps = profile.policy.max_rate_gbps;
        match policy.streams[0].1.plan.pace_bytes_per_sec {
            Some(rate) => assert_eq!(state.safe_util_gbps, rate * 8.0 / 1e9),
            None => assert!((state.safe_util_gbps - max_gbps).abs() < 1e-9 * max_gbps),
        }
        let figures = policy.figures();
        let chunks = host
            .posted(bandwidth)
            .iter()
            .filter(|w| w.bytes > 0)
            .count();
        let read_chunks = host.posted(read).iter().filter(|w| w.bytes > 0).count();
        assert_eq!(figures["sub_messages"], (chunks + read_chunks) as f64);
        assert_eq!(figures["target99_us"], 20.0);
        let paced = policy.streams[0].1.plan.pace_bytes_per_sec.is_some();
        assert_eq!(figures.contains_key("pace_gbps"), paced);
        // The update just made paced the stream or did not.
        assert_eq!(figures["paced_fraction"] > 0.0, paced, "{figures:?}");
    }

    /// Paced, a queue pair has at most WINDOW_CHUNKS chunks on the RNIC however fast the
    /// pace lets them go.
    #[test]
    fn paced_a_queue_pair_keeps_its_window() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = ChunkShaper::new([&info], PACE_TIMER, config());
        shaper.apply(&mut host.ctx(), plan(Some(1e12), 4 * KIB, 0));
        shaper.on_post(&mut host.ctx(), qp, write(7, 128 * 4 * KIB));
        while let Some((_, tag)) = host.next_timer() {
            assert_eq!(tag, PACE_TIMER);
            shaper.on_timer(&mut host.ctx());
        }
        assert_eq!(host.posted(qp).len(), WINDOW_CHUNKS as usize);
        let first = host.posted(qp)[0].tag;
        shaper.on_completion(&mut host.ctx(), qp, first);
        while let Some((_, tag)) = host.next_timer() {
            assert_eq!(tag, PACE_TIMER);
            shaper.on_timer(&mut host.ctx());
        }
        assert_eq!(host.posted(qp).len(), WINDOW_CHUNKS as usize + 1);
    }

    /// A faster plan while a chunk waits brings its timer forward: at 1 MB/s the next
    /// 16 KiB chunk is 16 ms away; at 1 GB/s it is 16.384 us away and goes then.
    #[test]
    fn a_faster_pace_brings_the_timer_forward() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = ChunkShaper::new([&info], PACE_TIMER, config());
        shaper.apply(&mut host.ctx(), plan(Some(1e6), 16 * KIB, 0));
        shaper.on_post(&mut host.ctx(), qp, write(7, 64 * KIB));
        assert_eq!(host.posted(qp).len(), 1);
        let start = host.now();
        shaper.apply(&mut host.ctx(), plan(Some(1e9), 16 * KIB, 0));
        let (at, tag) = host.next_timer().unwrap();
        assert_eq!(tag, PACE_TIMER);
        assert!(at - start <= 16_384_000 + 1_000, "{} ps", at - start);
        shaper.on_timer(&mut host.ctx());
        assert_eq!(host.posted(qp).len(), 2);
    }

    /// The figures give each stream's pace in Gb/s, the send path's as `pace_gbps` and a
    /// responder's under its host, and the share of updates that paced; before any update
    /// there is no such share to give.
    #[test]
    fn figures_give_each_streams_pace_in_gbps() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let justitia = JustitiaParams::default();
        let mut policy =
            AdaptivePolicy::new(&profile, &justitia, &PreemptParams::default()).unwrap();
        assert!(!policy.figures().contains_key("paced_fraction"));
        let mut host = TestHost::new();
        let mut reader = host.flow_to(1, FlowClass::Bandwidth, HostId(2));
        reader.reads = true;
        let flows = [host.flow(2, FlowClass::Bandwidth), reader];
        policy.on_start(&mut host.ctx(), &flows);
        policy.streams[0].1.plan.pace_bytes_per_sec = Some(1.25e9);
        policy.streams[1].1.plan.pace_bytes_per_sec = Some(2.5e8);
        (policy.updates, policy.paced_updates) = (4, 1);
        let figures = policy.figures();
        assert_eq!(figures["pace_gbps"], 10.0);
        assert_eq!(figures["read_pace_gbps.2"], 2.0);
        assert_eq!(figures["paced_fraction"], 0.25);
    }
}
