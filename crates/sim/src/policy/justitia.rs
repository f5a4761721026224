//! `justitia`: Justitia (NSDI'22), a thin driver of the core's per-host loop.
//!
//! Every decision is the core's [`ControlLoop`]'s: which flows count, SafeUtil, the chunk
//! and token size, each flow's allotment, the mode, when a probe is due. This driver only
//! feeds it and carries out what it says, as the daemon and `libjustitia.so` do on a real
//! host:
//!
//! - **Flows.** A flow that starts is registered (class, tenant, weight, queue pairs); one
//!   that stops is removed. A latency flow has work while it runs; a resource-hungry flow
//!   has work while it has chunks waiting in the shaper or on the RNIC (the loop's idle
//!   grace decides when a flow without work gives its share away).
//! - **Probe.** On [`Event::ProbeDue`] a `ref_size` WRITE is posted on the policy's own
//!   queue pair to the peer of the host's first latency flow; its post-to-completion time
//!   goes back to the loop under the [`ProbeId`] the loop handed out. Completions on one
//!   queue pair come in order, so the oldest outstanding id is the one that completed.
//! - **Time.** A timer is kept at [`ControlLoop::poll_timeout`].
//! - **Allotments.** On [`Event::AllotmentsChanged`] each resource-hungry flow's allotment
//!   goes to the [`PacedShaper`]: the core's pacer at the allotment's bytes/s and ops/s and
//!   at its release phase (so the flows' chunks leave one after another),
//!   bandwidth flows' requests cut to the allotment's chunk size by the core's planner
//!   (what is pending is re-cut when the size changes).
//!
//! - **Remote READs** (§4.4), through the daemons' own protocol (`justitia-peer`, the
//!   code `justitiad` runs): each host has a [`Channel`]; a READ flow's requester declares
//!   its READ flows with work to the host they read from (a demand), that host's loop
//!   counts them per (host, tenant, class) ([`ControlLoop::set_remote_reads`]), and each
//!   [`Event::ReadGuarantee`] it emits becomes the grant it sends every host with such
//!   flows, whose loop allots the flows from it ([`ControlLoop::read_guarantee_received`]).
//!   Datagrams take `peer_delay_us` (default [`MESSAGE_DELAY`](super::MESSAGE_DELAY)) each
//!   way; a host given `peer_silent_after_ms` stops sending from then (its daemon died),
//!   and its peers stop counting it and being constrained by it after the channel's
//!   silence (fail-open).
//!
//! - **Incast** (§6.7), through the same channel: every flow of this host into another
//!   host that is not a READ is declared to that host (role `incast`); the receiver's
//!   channel counts the units coming in and grants each unit of weight its share of the
//!   receiver's MaxRate ([`justitia_core::incast`]), and this host paces each bandwidth flow
//!   into it at the lower of its allotment and its tenant's part of that share
//!   ([`IncastLimits`], [`paced`]) until the share lapses with the channel's silence.
//!
//! Not modelled: the flow-control messages of split SENDs (the peer is assumed to
//! cooperate).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::OnceLock;
use std::time::Duration;

use justitia_core::control_loop::{
    read_guarantee_lifetime, Allotment, ControlLoop, Event, FlowRegistration, LoopConfig,
    LoopError, ProbeId, Target99, DEFAULT_REFRESH_LOSSES,
};
use justitia_core::controller::ControlMode;
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::incast::{paced, IncastLimits};
use justitia_core::profile::RnicProfile;
use justitia_core::remote_read::{ReadGuarantee, ReadGuaranteeSender, RemoteReadUnit};
use justitia_peer::channel::{Channel, ChannelConfig, ChannelEvent, Member};
use justitia_peer::keys::PrivateKey;
use justitia_peer::wire::{DemandEntry, Role, MAX_DEMAND_ENTRIES};
use justitia_peer::NodeId;
use serde::{Deserialize, Serialize};

use super::control_verbs::ControlVerbShaper;
use super::paced::{Activity, PacedShaper, PACE_TIMER};
use super::reference::ReferenceProbe;
use super::split::SideChannel;
use super::{ControlCall, FlowInfo, Policy, PolicyContext, PolicyFigures, PolicyMessage};
use crate::model_profile::ModelProfile;
use crate::rnic::{QpId, WorkRequest};
use crate::series::{ControlState, Mode};
use crate::time::{self, Picos};
use crate::topology::HostId;
use crate::units::ByteSize;

/// How SafeUtil grows while the target is met.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Increase {
    /// The core's search toward the last violating rate (fast recovery; the default).
    #[default]
    Search,
    /// The paper's Pseudocode 1: a fixed step per RefPeriod.
    Fixed,
}

/// Parameters of the `justitia` policy. Target99 is in the reference probe's units: the
/// p99 of its 10 B WRITE's post-to-completion time, a full round trip. Give it as
/// `target99_us` (absolute) or `target99_x_idle` (a multiple of the probe's p99 measured
/// uncontended at start), not both; without either it is twice the idle p99.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JustitiaParams {
    /// Target99 as an absolute p99 of the probe, us.
    #[serde(default)]
    pub target99_us: Option<f64>,
    /// Target99 as a multiple (at least 1) of the probe's idle p99.
    #[serde(default)]
    pub target99_x_idle: Option<f64>,
    /// RefPeriod: time between two reference messages and controller updates, in us
    /// (§4.2.1: 500 us).
    #[serde(default = "default_ref_period_us")]
    pub ref_period_us: f64,
    /// Size of a reference message (§4.2.1: 10 B).
    #[serde(default = "default_ref_size")]
    pub ref_size: ByteSize,
    /// Samples in Current99's window; without it, the increase law's own: 1000 for the
    /// search law (the core's default), the paper's 10000 (RefCount, §4.2.1) for the fixed
    /// law of Pseudocode 1.
    #[serde(default)]
    pub ref_window: Option<u32>,
    /// The increase law.
    #[serde(default)]
    pub increase: Increase,
    /// delta: after Current99 has stayed above Target99 this long, share the RNIC among
    /// resource-hungry flows only (§4.5, §6.5.2: 5 s), in ms; 0 turns the option off.
    #[serde(default = "default_unattainable_after_ms")]
    pub unattainable_after_ms: f64,
    /// How long a peer-channel datagram takes between two hosts' daemons, us.
    #[serde(default = "default_peer_delay_us")]
    pub peer_delay_us: f64,
    /// From this time (ms from the start) every host's daemon sends no peer datagram, as
    /// if it had died; absent, never.
    #[serde(default)]
    pub peer_silent_after_ms: Option<f64>,
    /// The host's budget of control verbs (`ibv_reg_mr`, `ibv_create_qp`), verbs/s,
    /// shared among the tenants with an application on the host by weight and each
    /// tenant's share among its applications ([`super::control_verbs`]); absent or 0, the
    /// verbs are not paced. Read by `justitia` and `adaptive`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_verbs_per_sec: Option<f64>,
    /// Verbs each application may issue back to back after a quiet period
    /// ([`DEFAULT_CONTROL_VERB_BURST`] when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_verb_burst: Option<u32>,
}

/// The burst of control verbs when a scenario gives none: an application that registers
/// a handful of buffers and creates its queue pairs at start-up waits for none of them.
pub const DEFAULT_CONTROL_VERB_BURST: u32 = 16;

/// The largest burst of control verbs a scenario may give.
pub const MAX_CONTROL_VERB_BURST: u32 = 65_536;

fn default_peer_delay_us() -> f64 {
    super::MESSAGE_DELAY as f64 / 1e6
}

fn default_ref_period_us() -> f64 {
    500.0
}

fn default_ref_size() -> ByteSize {
    ByteSize(10)
}

fn default_unattainable_after_ms() -> f64 {
    5_000.0
}

/// The multiple of the idle p99 used when no target is given (the core loop's default).
const DEFAULT_X_IDLE: f64 = 2.0;

impl Default for JustitiaParams {
    fn default() -> Self {
        JustitiaParams {
            target99_us: None,
            target99_x_idle: None,
            ref_period_us: default_ref_period_us(),
            ref_size: default_ref_size(),
            ref_window: None,
            increase: Increase::default(),
            unattainable_after_ms: default_unattainable_after_ms(),
            peer_delay_us: default_peer_delay_us(),
            peer_silent_after_ms: None,
            control_verbs_per_sec: None,
            control_verb_burst: None,
        }
    }
}

impl JustitiaParams {
    /// Checks ranges; the error is (field, reason).
    pub fn validate(&self) -> Result<(), (String, String)> {
        let positive = |field: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err((field.to_string(), format!("must be positive, got {v}")))
            }
        };
        match (self.target99_us, self.target99_x_idle) {
            (Some(_), Some(_)) => {
                return Err((
                    "target99_x_idle".into(),
                    "give target99_us or target99_x_idle, not both".into(),
                ))
            }
            (Some(us), None) => positive("target99_us", us)?,
            (None, Some(x)) if !(x.is_finite() && x >= 1.0) => {
                return Err((
                    "target99_x_idle".into(),
                    format!("must be at least 1, got {x}"),
                ))
            }
            _ => {}
        }
        positive("ref_period_us", self.ref_period_us)?;
        if self.ref_window == Some(0) {
            return Err(("ref_window".into(), "must be at least 1".into()));
        }
        if self.ref_size.bytes() > u64::from(u32::MAX) {
            return Err(("ref_size".into(), "is above 4 GB".into()));
        }
        if !(self.peer_delay_us.is_finite() && self.peer_delay_us >= 0.0) {
            return Err((
                "peer_delay_us".into(),
                format!("must be at least 0, got {}", self.peer_delay_us),
            ));
        }
        if let Some(ms) = self.peer_silent_after_ms {
            positive("peer_silent_after_ms", ms)?;
        }
        if !(self.unattainable_after_ms.is_finite() && self.unattainable_after_ms >= 0.0) {
            return Err((
                "unattainable_after_ms".into(),
                format!(
                    "must be 0 (off) or positive, got {}",
                    self.unattainable_after_ms
                ),
            ));
        }
        if let Some(rate) = self.control_verbs_per_sec {
            if !(rate.is_finite() && rate >= 0.0) {
                return Err((
                    "control_verbs_per_sec".into(),
                    format!("must be 0 (not paced) or a positive number of verbs/s, got {rate}"),
                ));
            }
        }
        if let Some(burst) = self.control_verb_burst {
            if !(1..=MAX_CONTROL_VERB_BURST).contains(&burst) {
                return Err((
                    "control_verb_burst".into(),
                    format!("must be 1 to {MAX_CONTROL_VERB_BURST} verbs, got {burst}"),
                ));
            }
        }
        Ok(())
    }

    /// The host's control-verb budget and each application's burst; `None` when the verbs
    /// are not paced (no budget, or 0).
    pub fn control_verb_budget(&self) -> Option<(f64, u32)> {
        let rate = self.control_verbs_per_sec.filter(|r| *r > 0.0)?;
        Some((
            rate,
            self.control_verb_burst
                .unwrap_or(DEFAULT_CONTROL_VERB_BURST),
        ))
    }

    /// Target99 as the core takes it.
    pub fn target(&self) -> Target99 {
        match (self.target99_us, self.target99_x_idle) {
            (Some(us), _) => Target99::Absolute(Duration::from_nanos(time::from_us(us) / 1_000)),
            (None, x) => Target99::IdleMultiple(x.unwrap_or(DEFAULT_X_IDLE)),
        }
    }

    /// The core loop's settings: the law's own (its increase law and window) with the
    /// parameters given, and a READ guarantee that outlives the channel's refresh (the
    /// default channel's, [`DEFAULT_REFRESH_LOSSES`] of them lost in a row), whatever the
    /// RefPeriod.
    pub fn loop_config(&self) -> LoopConfig {
        let base = match self.increase {
            Increase::Search => LoopConfig::default(),
            Increase::Fixed => LoopConfig::paper(self.target()),
        };
        LoopConfig {
            target: self.target(),
            ref_period: Duration::from_nanos(time::from_us(self.ref_period_us) / 1_000),
            window: self.ref_window.map_or(base.window, |w| w as usize),
            unattainable_after: (self.unattainable_after_ms > 0.0)
                .then(|| Duration::from_nanos(time::from_ms(self.unattainable_after_ms) / 1_000)),
            read_guarantee_lifetime: read_guarantee_lifetime(
                ChannelConfig::default().refresh,
                DEFAULT_REFRESH_LOSSES,
            ),
            ..base
        }
    }

    /// The probe's message size.
    pub(crate) fn probe_bytes(&self) -> u32 {
        u32::try_from(self.ref_size.bytes()).unwrap_or(u32::MAX)
    }
}

/// Why the policy could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum JustitiaError {
    /// The core loop refused its settings.
    #[error("control loop: {0}")]
    Loop(#[from] LoopError),
}

/// The timer tag of the loop's [`ControlLoop::poll_timeout`].
const LOOP_TIMER: u64 = 0;

/// Simulated time as the core takes it.
pub(crate) fn core_time(t: Picos) -> Duration {
    Duration::from_nanos(t / 1_000)
}

/// A core duration in simulated time.
pub(crate) fn picos(d: Duration) -> Picos {
    u64::try_from(d.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_mul(1_000)
}

/// The core loop with the simulator's probe and clock around it: what `justitia` and
/// `adaptive` share.
pub(crate) struct LoopDriver {
    pub(crate) control: ControlLoop,
    probe: ReferenceProbe,
    /// Ids of the probes on the wire, oldest first.
    probes: VecDeque<ProbeId>,
    timer_at: Option<Picos>,
    safe_util_sum: f64,
    updates_seen: u64,
}

impl LoopDriver {
    pub(crate) fn new(profile: &RnicProfile, params: &JustitiaParams) -> Result<Self, LoopError> {
        Ok(LoopDriver {
            control: ControlLoop::new(params.loop_config(), profile, Duration::ZERO)?,
            probe: ReferenceProbe::new(params.probe_bytes()),
            probes: VecDeque::new(),
            timer_at: None,
            safe_util_sum: 0.0,
            updates_seen: 0,
        })
    }

    /// Opens the probe's queue pair (see [`ReferenceProbe::connect`]).
    pub(crate) fn connect(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        self.probe.connect(ctx, flows);
    }

    /// Registers a flow that started, or removes one that stopped. Latency flows have work
    /// while they run.
    pub(crate) fn flow_present(&mut self, ctx: &PolicyContext<'_>, flow: &FlowInfo, present: bool) {
        let now = core_time(ctx.now());
        let id = flow.spec.id;
        // Errors here are a flow registered twice or removed unknown: the loop's state is
        // already what the call asks for.
        if present {
            let registration = FlowRegistration {
                spec: flow.spec,
                qps: u32::try_from(flow.qps.len()).unwrap_or(u32::MAX),
            };
            let _ = self.control.register_flow(now, registration);
            if flow.reads {
                // Its data leaves the peer's RNIC: counted there, not here.
                let _ = self
                    .control
                    .set_flow_reads_from(now, id, Some(u64::from(flow.peer.0)));
            }
            if flow.spec.class == FlowClass::Latency {
                let _ = self.control.set_flow_active(now, id, true);
            }
        } else {
            let _ = self.control.remove_flow(now, id);
        }
    }

    /// Tells the loop what the shaper saw of the flows' work.
    pub(crate) fn activity(&mut self, ctx: &PolicyContext<'_>, changes: Vec<Activity>) {
        let now = core_time(ctx.now());
        for change in changes {
            let (id, active) = match change {
                Activity::HasWork(id) => (id, true),
                Activity::Idle(id) => (id, false),
            };
            // A flow not registered (not started, or stopped) has nothing to tell.
            let _ = self.control.set_flow_active(now, id, active);
        }
    }

    /// Takes a completion if it is the probe's; false otherwise.
    pub(crate) fn on_completion(&mut self, ctx: &PolicyContext<'_>, qp: QpId) -> bool {
        if !self.probe.owns(qp) {
            return false;
        }
        if let Some(id) = self.probes.pop_front() {
            // False for a probe already counted as lost: nothing more to do.
            let _ = self.control.probe_completed(core_time(ctx.now()), id);
        }
        true
    }

    /// Runs the loop's due work and returns its events; keeps the timer set.
    pub(crate) fn drive(&mut self, ctx: &mut PolicyContext<'_>) -> Vec<Event> {
        let now = core_time(ctx.now());
        if self.control.poll_timeout().is_some_and(|t| t <= now) {
            self.control.handle_timeout(now);
        }
        let mut events = Vec::new();
        while let Some(event) = self.control.poll_event() {
            if event == Event::ProbeDue && self.probe.send(ctx) {
                let id = self.control.probe_sent(now);
                self.probes.push_back(id);
            }
            events.push(event);
        }
        let updates = self.control.updates();
        if updates != self.updates_seen {
            self.updates_seen = updates;
            self.safe_util_sum += self.control.safe_util();
        }
        if let Some(due) = self.control.poll_timeout() {
            let at = picos(due).max(ctx.now());
            if self.timer_at != Some(at) {
                self.timer_at = Some(at);
                ctx.set_timer(at, LOOP_TIMER);
            }
        }
        events
    }

    /// Whether a fired loop timer is the one in force (not one replaced since).
    pub(crate) fn timer_is_current(&mut self, ctx: &PolicyContext<'_>) -> bool {
        let current = self.timer_at == Some(ctx.now());
        if current {
            self.timer_at = None;
        }
        current
    }

    pub(crate) fn control_state(&self) -> ControlState {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        ControlState {
            safe_util_gbps: self.control.safe_util() * 8.0 / 1e9,
            current99_us: self.control.current_p99().map(us),
            target99_us: self.control.target().value.map(us),
            mode: match self.control.mode() {
                ControlMode::Normal => Mode::Normal,
                ControlMode::Unattainable { .. } => Mode::Unattainable,
            },
        }
    }

    pub(crate) fn figures(&self) -> PolicyFigures {
        let mut f = PolicyFigures::new();
        let gbps = |bytes_per_sec: f64| bytes_per_sec * 8.0 / 1e9;
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        f.insert("safe_util_gbps".into(), gbps(self.control.safe_util()));
        if self.updates_seen > 0 {
            f.insert(
                "mean_safe_util_gbps".into(),
                gbps(self.safe_util_sum / self.updates_seen as f64),
            );
        }
        if let Some(p99) = self.control.current_p99() {
            f.insert("current99_us".into(), us(p99));
        }
        let target = self.control.target();
        if let Some(t) = target.value {
            f.insert("target99_us".into(), us(t));
        }
        if let Some(idle) = target.idle_p99 {
            f.insert("idle_p99_us".into(), us(idle));
        }
        f.insert("decreases".into(), self.control.decreases() as f64);
        f.insert("chunk_bytes".into(), f64::from(self.control.chunk_bytes()));
        f
    }
}

/// Justitia's daemon and shapers on one host.
pub struct JustitiaPolicy {
    driver: LoopDriver,
    shaper: Option<PacedShaper>,
    /// The side channel of split SENDs, and this host's receiving halves.
    side: SideChannel,
    /// The resource-hungry flows of this host.
    hungry: Vec<FlowId>,
    /// This host's flows that load another host: READ flows (with the host they read from)
    /// and flows into another host (incast: the receiver counts them, and paces the
    /// bandwidth ones), each with its role; and where each is in that list.
    loads: Vec<(FlowSpec, HostId, Role)>,
    load_index: HashMap<FlowId, usize>,
    /// Those of them that have work.
    loading: BTreeMap<FlowId, (FlowSpec, HostId, Role)>,
    /// Of those, the incast flows, counted per receiver, tenant and class: a tenant's
    /// share into a receiver is split among them. Kept with `loading`, so that pacing a
    /// flow costs a look-up, not a pass over the flows (which made an update and every
    /// change of activity quadratic in the flows).
    incast_loading: HashMap<(HostId, TenantId, FlowClass), u32>,
    /// Of those, all, per host they load, by tenant, class and role: what this host
    /// declares to that host. Kept with `loading`, so that a change of activity does not
    /// count every loading flow again (which made starting a thousand flows quadratic).
    demand: BTreeMap<HostId, BTreeMap<(TenantId, FlowClass, Role), DemandUnit>>,
    /// Scratch list of the entries declared to a host.
    entries: Vec<DemandEntry>,
    /// The places in `loads` of the incast flows a share caps, by receiver, tenant and
    /// class, in order.
    incast_flows: HashMap<(HostId, TenantId, FlowClass), Vec<usize>>,
    /// The shares the receivers of this host's incast flows grant (§6.7).
    incast: IncastLimits,
    /// The READ part of this host's grant to incast senders before its loop announces a
    /// READ guarantee: the whole RNIC (it counts no remote READ).
    whole: ReadGuarantee,
    /// The peer channel (made at the start, when the host is known).
    peer: Option<Channel>,
    peer_delay: Picos,
    peer_silent_after: Option<Picos>,
    peer_timer_at: Option<Picos>,
    /// The channel's figures: datagrams sent, refused; when the first guarantee was taken,
    /// and when the last lapsed (ms).
    peer_sent: u64,
    peer_refused: u64,
    first_guarantee_ms: Option<f64>,
    lapsed_ms: Option<f64>,
    /// When this host first took a receiver's incast share, and when one last lapsed (ms).
    first_incast_ms: Option<f64>,
    incast_lapsed_ms: Option<f64>,
    /// When the channel was last driven.
    peer_now: Duration,
    /// The applications' control verbs, paced when the scenario gives a host budget.
    control_verbs: Option<ControlVerbShaper>,
}

/// Whether a load is one a receiver's incast share caps: a bandwidth flow into another
/// host (a throughput flow's share keeps room in the receiver's link; only bandwidth flows
/// fill it).
fn is_capped_incast(load: &(FlowSpec, HostId, Role)) -> bool {
    load.2 == Role::Incast && load.0.class == FlowClass::Bandwidth
}

/// The loading flows of one tenant, class and role into one host.
#[derive(Debug, Default)]
struct DemandUnit {
    /// How many.
    flows: u32,
    /// How many of them have each weight (the unit declares the largest).
    weights: BTreeMap<u32, u32>,
}

impl DemandUnit {
    /// Counts a flow of weight `weight` in, or out.
    fn count(&mut self, weight: u32, add: bool) {
        if add {
            self.flows += 1;
            *self.weights.entry(weight).or_insert(0) += 1;
        } else {
            self.flows -= 1;
            if let Some(n) = self.weights.get_mut(&weight) {
                *n -= 1;
                if *n == 0 {
                    self.weights.remove(&weight);
                }
            }
        }
    }

    /// The largest weight of its flows.
    fn weight(&self) -> u32 {
        self.weights.last_key_value().map_or(0, |(&w, _)| w)
    }
}

/// The simulated cluster's possible members: hosts 0 to 63 (the channel's default
/// `max_peers` less this host), each with a fixed key so that runs repeat. A host outside
/// it is no member: its datagrams are refused and counted. A run's channels list those of
/// its topology only (the others never send): each member costs a pair key, three X25519
/// multiplications, at every host's start.
const SIM_MEMBERS: u16 = 64;

/// Host `host`'s daemon's private key: fixed bytes made from its id.
fn sim_key(host: u16) -> Option<PrivateKey> {
    let mut bytes = *b"justitia simulated host key ....";
    bytes[28..30].copy_from_slice(&host.to_be_bytes());
    PrivateKey::from_bytes(bytes).ok()
}

/// Member `host` with its public key, derived once per process (an X25519
/// multiplication), and only for the hosts some run has: every host of every run lists the
/// members of its topology.
fn sim_member(host: u16) -> Option<Member> {
    static MEMBERS: [OnceLock<Option<Member>>; SIM_MEMBERS as usize] =
        [const { OnceLock::new() }; SIM_MEMBERS as usize];
    *MEMBERS.get(usize::from(host))?.get_or_init(|| {
        Some(Member {
            node: node_of(HostId(host)),
            public: sim_key(host)?.public(),
        })
    })
}
/// The timer tag of the peer channel's [`Channel::poll_timeout`].
const PEER_TIMER: u64 = 1;

/// A host's node id on the peer channel: its host index in the last two bytes.
fn node_of(host: HostId) -> NodeId {
    let mut id = [0u8; 16];
    id[14..].copy_from_slice(&host.0.to_be_bytes());
    NodeId(id)
}

fn host_of(node: NodeId) -> HostId {
    HostId(u16::from_be_bytes([node.0[14], node.0[15]]))
}

impl JustitiaPolicy {
    /// A policy for a host with this RNIC.
    pub fn new(profile: &ModelProfile, params: &JustitiaParams) -> Result<Self, JustitiaError> {
        Ok(JustitiaPolicy {
            driver: LoopDriver::new(&profile.policy, params)?,
            shaper: None,
            side: SideChannel::new(profile.link.header_bytes),
            hungry: Vec::new(),
            loads: Vec::new(),
            load_index: HashMap::new(),
            loading: BTreeMap::new(),
            incast_loading: HashMap::new(),
            demand: BTreeMap::new(),
            entries: Vec::new(),
            incast_flows: HashMap::new(),
            incast: IncastLimits::new(ChannelConfig::default().silence),
            whole: ReadGuaranteeSender::new(0).announce(0, false, &profile.policy),
            peer: None,
            peer_delay: (params.peer_delay_us * 1e6).round() as Picos,
            peer_silent_after: params
                .peer_silent_after_ms
                .map(|ms| (ms * 1e9).round() as Picos),
            peer_timer_at: None,
            peer_sent: 0,
            peer_refused: 0,
            first_guarantee_ms: None,
            lapsed_ms: None,
            first_incast_ms: None,
            incast_lapsed_ms: None,
            peer_now: Duration::ZERO,
            control_verbs: ControlVerbShaper::new(params),
        })
    }

    /// Declares this host's loading flows (READs, bandwidth flows into another host) that
    /// started or stopped having work to the hosts they load.
    fn tell_loads(&mut self, ctx: &mut PolicyContext<'_>, changes: &[Activity]) {
        let mut peers = Vec::new();
        // The (receiver, tenant, class) whose count of incast flows changed: only their
        // flows' caps move.
        let mut recount = Vec::new();
        for change in changes {
            let (id, active) = match *change {
                Activity::HasWork(id) => (id, true),
                Activity::Idle(id) => (id, false),
            };
            if let Some(&(spec, peer, role)) = self.load(id) {
                let changed = if active {
                    self.loading.insert(id, (spec, peer, role)).is_none()
                } else {
                    self.loading.remove(&id).is_some()
                };
                if changed && role == Role::Incast {
                    let key = (peer, spec.tenant, spec.class);
                    recount.push(key);
                    let count = self.incast_loading.entry(key).or_insert(0);
                    if active {
                        *count += 1;
                    } else {
                        *count -= 1;
                        if *count == 0 {
                            self.incast_loading.remove(&key);
                        }
                    }
                }
                if changed {
                    let units = self.demand.entry(peer).or_default();
                    let key = (spec.tenant, spec.class, role);
                    let unit = units.entry(key).or_default();
                    unit.count(spec.weight.get(), active);
                    if unit.flows == 0 {
                        units.remove(&key);
                    }
                    peers.push(peer);
                }
            }
        }
        if peers.is_empty() {
            return;
        }
        peers.sort_unstable();
        peers.dedup();
        let now = core_time(ctx.now());
        for peer in peers {
            self.entries.clear();
            // A list longer than the wire carries is refused whole, however long: one entry
            // past the limit is as good as all of them (a thousand tenants each declared a
            // thousand entries at every change of activity).
            let units = self.demand.get(&peer).into_iter().flatten();
            self.entries.extend(units.take(MAX_DEMAND_ENTRIES + 1).map(
                |(&(tenant, class, role), unit)| DemandEntry {
                    tenant,
                    class,
                    role,
                    flows: u16::try_from(unit.flows).unwrap_or(u16::MAX),
                    weight: unit.weight(),
                },
            ));
            if let Some(channel) = &mut self.peer {
                // Refused beyond the channel's caps, which only runs of many tenants reach:
                // their demand goes undeclared.
                let _ = channel.set_demand(now, node_of(peer), &self.entries);
            }
        }
        if !recount.is_empty() {
            // A tenant's share into a host is split among its active flows there.
            recount.sort_unstable();
            recount.dedup();
            self.pace_incast_of(ctx, &recount);
        }
        self.flush_peer(ctx);
    }

    /// A flow's allotment as its shaper paces it: the loop's, lowered for a bandwidth flow
    /// into another host to what that host's incast share gives it (§6.7).
    fn paced_allotment(&self, now: Duration, id: FlowId) -> Option<Allotment> {
        let allotment = self.driver.control.allotment(id)?;
        let Some(&(spec, peer, _)) = self.load(id).filter(|l| is_capped_incast(l)) else {
            return Some(allotment);
        };
        let flows = self
            .incast_loading
            .get(&(peer, spec.tenant, spec.class))
            .copied()
            .unwrap_or(0);
        let cap = self.incast.cap(now, u64::from(peer.0), spec.weight, flows);
        Some(paced(allotment, cap))
    }

    /// A flow of this host that loads another host, if it is one.
    fn load(&self, id: FlowId) -> Option<&(FlowSpec, HostId, Role)> {
        self.load_index.get(&id).map(|&i| &self.loads[i])
    }

    /// This host's flows a receiver's incast share caps: bandwidth flows into another
    /// host (a throughput flow's share keeps room in the receiver's link; only bandwidth
    /// flows fill it).
    fn capped_incast(&self) -> impl Iterator<Item = &(FlowSpec, HostId, Role)> {
        self.loads.iter().filter(|l| is_capped_incast(l))
    }

    /// The largest cap a receiver's share puts on one of this host's bandwidth flows now,
    /// bytes/s; `None` when none is capped.
    fn incast_cap(&self, now: Duration) -> Option<f64> {
        self.capped_incast()
            .filter_map(|&(spec, peer, _)| self.incast.cap(now, u64::from(peer.0), spec.weight, 1))
            .reduce(f64::max)
    }

    /// Gives the shaper the allotments of the incast flows of these (receiver, tenant,
    /// class) again (their count changed), in the order of `loads` as
    /// [`pace_incast`](Self::pace_incast) does.
    fn pace_incast_of(
        &mut self,
        ctx: &mut PolicyContext<'_>,
        keys: &[(HostId, TenantId, FlowClass)],
    ) {
        let now = core_time(ctx.now());
        let mut ids: Vec<usize> = keys
            .iter()
            .filter_map(|k| self.incast_flows.get(k))
            .flatten()
            .copied()
            .collect();
        ids.sort_unstable();
        let allotments: Vec<(FlowId, Allotment)> = ids
            .into_iter()
            .filter_map(|i| {
                let id = self.loads[i].0.id;
                Some((id, self.paced_allotment(now, id)?))
            })
            .collect();
        if let Some(shaper) = &mut self.shaper {
            for (id, allotment) in allotments {
                shaper.set_allotment(ctx, id, Some(allotment));
            }
        }
    }

    /// Gives the shaper every incast flow's allotment again (a share changed).
    fn pace_incast(&mut self, ctx: &mut PolicyContext<'_>) {
        let now = core_time(ctx.now());
        let allotments: Vec<(FlowId, Allotment)> = self
            .capped_incast()
            .filter_map(|l| Some((l.0.id, self.paced_allotment(now, l.0.id)?)))
            .collect();
        if let Some(shaper) = &mut self.shaper {
            for (id, allotment) in allotments {
                shaper.set_allotment(ctx, id, Some(allotment));
            }
        }
    }

    /// Hands each guarantee of this host's loop to the channel, for every host whose READ
    /// flows it serves.
    fn announce(&mut self, ctx: &mut PolicyContext<'_>, events: &[Event]) {
        let link = self.driver.control.max_rate();
        let now = core_time(ctx.now());
        let mut any = false;
        for event in events {
            if let (Event::ReadGuarantee(guarantee), Some(channel)) = (event, &mut self.peer) {
                channel.set_grant(now, guarantee, link);
                any = true;
            }
        }
        if any {
            self.flush_peer(ctx);
        }
    }

    /// Sends what the channel has due (nothing once this host's daemon is silent), acts on
    /// its events, and keeps its timer.
    fn flush_peer(&mut self, ctx: &mut PolicyContext<'_>) {
        let now = core_time(ctx.now());
        let silent = self.peer_silent_after.is_some_and(|t| ctx.now() >= t);
        let Some(channel) = &mut self.peer else {
            return;
        };
        channel.handle_timeout(now);
        self.peer_now = now;
        let expired = self.incast.expire(now);
        while let Some(t) = channel.poll_transmit(now) {
            if !silent {
                self.peer_sent += 1;
                ctx.send(host_of(t.to), PolicyMessage::Peer(t.bytes), self.peer_delay);
            }
        }
        if expired {
            self.incast_lapsed_ms = Some(now.as_secs_f64() * 1e3);
            self.pace_incast(ctx);
        }
        self.peer_events(ctx);
        let due = self.peer.as_ref().and_then(Channel::poll_timeout);
        if let Some(due) = due.into_iter().chain(self.incast.poll_timeout()).min() {
            let at = picos(due).max(ctx.now());
            if self.peer_timer_at != Some(at) {
                self.peer_timer_at = Some(at);
                ctx.set_timer(at, PEER_TIMER);
            }
        }
    }

    /// Acts on the channel's events: the READ units peers hold against this host go to the
    /// loop; a peer's guarantee to every READ flow of this host against it.
    fn peer_events(&mut self, ctx: &mut PolicyContext<'_>) {
        let now = core_time(ctx.now());
        let Some(channel) = &mut self.peer else {
            return;
        };
        let mut served_changed = false;
        let mut incast_changed = false;
        while let Some(event) = channel.poll_event() {
            match event {
                ChannelEvent::ServedChanged => served_changed = true,
                // The simulated reference flow's queue pair is opened by the model
                // ([`ReferenceProbe::connect`]), towards a latency flow's peer: no
                // policy here offers one over the channel.
                ChannelEvent::ProbeOffer { .. } | ChannelEvent::ProbeAnswer { .. } => {}
                // The simulated hosts' shapers know each other's side channels from the
                // scenario (`split.rs`): no policy here sends pairings over the channel.
                ChannelEvent::Pairings { .. } => {}
                ChannelEvent::Guarantee {
                    peer,
                    guarantee,
                    incast_bytes_per_sec,
                } => {
                    let from = host_of(peer);
                    // The wire admits only rates in range: never refused.
                    incast_changed |= self
                        .incast
                        .grant_received(now, u64::from(from.0), incast_bytes_per_sec)
                        .unwrap_or(false);
                    if incast_bytes_per_sec > 0.0 {
                        self.first_incast_ms.get_or_insert(now.as_secs_f64() * 1e3);
                    }
                    for &(spec, p, _) in self.loads.iter().filter(|l| l.2 == Role::Read) {
                        if p == from {
                            // Refused only for a flow not registered now (stopped).
                            let _ = self
                                .driver
                                .control
                                .read_guarantee_received(now, spec.id, guarantee);
                        }
                    }
                    // An incast receiver that counts no remote READ grants its whole
                    // RNIC, which constrains nothing: the first guarantee is the first
                    // below it.
                    if guarantee.fraction < 1.0 {
                        self.first_guarantee_ms
                            .get_or_insert(now.as_secs_f64() * 1e3);
                    }
                }
                ChannelEvent::GuaranteeLapsed { peer } => {
                    self.lapsed_ms = Some(now.as_secs_f64() * 1e3);
                    if self.incast.lapsed(u64::from(host_of(peer).0)) {
                        self.incast_lapsed_ms = Some(now.as_secs_f64() * 1e3);
                        incast_changed = true;
                    }
                }
            }
        }
        if served_changed {
            let units: Vec<RemoteReadUnit> = channel
                .served()
                .filter(|(_, e)| e.role == Role::Read)
                .map(|(_, e)| RemoteReadUnit {
                    class: e.class,
                    weight: Weight::new(e.weight).unwrap_or(Weight::ONE),
                })
                .collect();
            self.driver.control.set_remote_reads(now, &units);
        }
        if incast_changed {
            self.pace_incast(ctx);
        }
    }

    /// Runs the loop and carries out its allotments.
    fn drive(&mut self, ctx: &mut PolicyContext<'_>) {
        let events = self.driver.drive(ctx);
        self.announce(ctx, &events);
        if self.shaper.is_none() {
            return;
        }
        if events
            .iter()
            .any(|e| matches!(e, Event::AllotmentsChanged { .. }))
        {
            let now = core_time(ctx.now());
            let allotments: Vec<(FlowId, Allotment)> = self
                .hungry
                .iter()
                .filter_map(|&id| Some((id, self.paced_allotment(now, id)?)))
                .collect();
            let Some(shaper) = &mut self.shaper else {
                return;
            };
            for (id, allotment) in allotments {
                shaper.set_allotment(ctx, id, Some(allotment));
            }
            let changes = shaper.take_activity();
            self.tell_loads(ctx, &changes);
            self.driver.activity(ctx, changes);
        }
    }

    /// Tells the loop, and the hosts this host's READ flows read from, of the shaper's
    /// changes of activity. Called after every post, completion and pacing timer, and
    /// inlined there: changes are rare.
    #[inline]
    fn forward_activity(&mut self, ctx: &mut PolicyContext<'_>) {
        if let Some(shaper) = self.shaper.as_mut().filter(|s| s.has_activity()) {
            let changes = shaper.take_activity();
            self.tell_loads(ctx, &changes);
            self.driver.activity(ctx, changes);
        }
    }
}

impl Policy for JustitiaPolicy {
    fn name(&self) -> &str {
        "justitia"
    }

    fn on_start(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        self.shaper = Some(PacedShaper::new(flows).with_split_sends());
        self.hungry = flows
            .iter()
            .filter(|f| f.spec.class.is_resource_hungry())
            .map(|f| f.spec.id)
            .collect();
        let host = ctx.host;
        self.loads = flows
            .iter()
            .filter_map(|f| {
                if f.reads {
                    Some((f.spec, f.peer, Role::Read))
                } else if f.peer != host {
                    Some((f.spec, f.peer, Role::Incast))
                } else {
                    None
                }
            })
            .collect();
        self.load_index = self
            .loads
            .iter()
            .enumerate()
            .map(|(i, l)| (l.0.id, i))
            .collect();
        self.incast_flows.clear();
        for (i, l) in self
            .loads
            .iter()
            .enumerate()
            .filter(|(_, l)| is_capped_incast(l))
        {
            self.incast_flows
                .entry((l.1, l.0.tenant, l.0.class))
                .or_default()
                .push(i);
        }
        let hosts = u16::try_from(ctx.fabric.topology().host_count()).unwrap_or(u16::MAX);
        let members: Vec<Member> = (0..hosts.min(SIM_MEMBERS)).filter_map(sim_member).collect();
        self.peer = sim_key(ctx.host.0).and_then(|key| {
            // The seed is the host's id: the handshakes repeat from run to run.
            let mut seed = [0u8; 32];
            seed[..2].copy_from_slice(&ctx.host.0.to_be_bytes());
            Channel::new(
                ChannelConfig::default(),
                node_of(ctx.host),
                key,
                &members,
                seed,
                core_time(ctx.now()),
            )
            .ok()
        });
        if let Some(channel) = &mut self.peer {
            channel.set_link(
                core_time(ctx.now()),
                self.driver.control.max_rate(),
                &self.whole,
            );
        }
        self.driver.connect(ctx, flows);
        self.drive(ctx);
    }

    fn on_flow_active(&mut self, ctx: &mut PolicyContext<'_>, flow: &FlowInfo, active: bool) {
        self.driver.flow_present(ctx, flow, active);
        let id = flow.spec.id;
        if !active && self.load(id).is_some() {
            self.tell_loads(ctx, &[Activity::Idle(id)]);
        }
        if active && flow.spec.class == FlowClass::Latency && !flow.reads {
            // A latency flow has work while it runs (the shaper does not see it): the host
            // it goes to counts it from its start.
            self.tell_loads(ctx, &[Activity::HasWork(id)]);
        }
        let allotment = self.paced_allotment(core_time(ctx.now()), id);
        if let (true, Some(shaper)) = (active, &mut self.shaper) {
            // A registered flow is held to its allotment from the start: zero until the
            // loop's next update counts it.
            if let Some(allotment) = allotment {
                shaper.set_allotment(ctx, id, Some(allotment));
            }
            if shaper.has_work(id) {
                let _ = self
                    .driver
                    .control
                    .set_flow_active(core_time(ctx.now()), id, true);
            }
        }
    }

    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        match &mut self.shaper {
            Some(shaper) => {
                shaper.on_post(ctx, qp, wr);
                shaper.flush_side(ctx, &mut self.side);
            }
            None => ctx.post(qp, wr),
        }
        self.forward_activity(ctx);
    }

    fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        if SideChannel::owns_tag(tag) || self.driver.on_completion(ctx, qp) {
            return;
        }
        match &mut self.shaper {
            Some(shaper) => shaper.on_completion(ctx, qp, tag),
            None => ctx.complete(qp, tag),
        }
        self.forward_activity(ctx);
    }

    fn on_timer(&mut self, ctx: &mut PolicyContext<'_>, tag: u64) {
        if tag >= PACE_TIMER {
            if let Some(shaper) = &mut self.shaper {
                shaper.on_timer(ctx, tag);
            }
            self.forward_activity(ctx);
        } else if tag == LOOP_TIMER && self.driver.timer_is_current(ctx) {
            self.drive(ctx);
        } else if tag == PEER_TIMER && self.peer_timer_at == Some(ctx.now()) {
            self.peer_timer_at = None;
            self.flush_peer(ctx);
        }
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
        let datagram = match message {
            PolicyMessage::Peer(datagram) => datagram,
            PolicyMessage::Side(bytes) => {
                let credit = self.side.on_message(ctx, from, &bytes);
                if let (Some((qp, seq, posting)), Some(shaper)) = (credit, &mut self.shaper) {
                    shaper.on_credit(ctx, qp, seq, posting);
                }
                self.forward_activity(ctx);
                return;
            }
        };
        let now = core_time(ctx.now());
        if let Some(channel) = &mut self.peer {
            if channel.receive(now, &datagram).is_err() {
                self.peer_refused += 1;
            }
        }
        self.peer_events(ctx);
        self.flush_peer(ctx);
    }

    fn control_state(&self) -> Option<ControlState> {
        (!self.hungry.is_empty()).then(|| self.driver.control_state())
    }

    fn figures(&self) -> PolicyFigures {
        let mut f = self.driver.figures();
        self.side.figures(&mut f);
        if self.peer_sent > 0 || self.peer_refused > 0 {
            f.insert("peer_datagrams_sent".into(), self.peer_sent as f64);
            f.insert("peer_datagrams_refused".into(), self.peer_refused as f64);
        }
        if let Some(ms) = self.first_guarantee_ms {
            f.insert("peer_first_guarantee_ms".into(), ms);
        }
        if let Some(ms) = self.lapsed_ms {
            f.insert("peer_guarantee_lapsed_ms".into(), ms);
        }
        if let Some(ms) = self.first_incast_ms {
            f.insert("peer_first_incast_share_ms".into(), ms);
        }
        if let Some(ms) = self.incast_lapsed_ms {
            f.insert("peer_incast_share_lapsed_ms".into(), ms);
        }
        if let Some(cap) = self.incast_cap(self.peer_now) {
            f.insert("incast_cap_gbps".into(), cap * 8.0 / 1e9);
        }
        if let Some(share) = self.peer.as_ref().map(Channel::incast_share) {
            if share > 0.0 {
                f.insert("peer_incast_share_gbps".into(), share * 8.0 / 1e9);
            }
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

    use justitia_core::controller::IncreaseLaw;

    use super::*;
    use crate::policy::test_host::{write, TestHost};
    use crate::rnic::Opcode;

    /// The field a refusal blames.
    fn refused(params: JustitiaParams) -> String {
        params.validate().unwrap_err().0
    }

    /// The defaults are the paper's (RefPeriod 500 us and 10 B reference messages,
    /// §4.2.1; delta 5 s, §6.5.2) and the channel's 10 us datagram delay; they validate,
    /// and the loop gets them with a target of twice the idle p99.
    #[test]
    fn defaults_are_the_papers() {
        let params = JustitiaParams::default();
        assert_eq!(params.ref_period_us, 500.0);
        assert_eq!(params.ref_size, ByteSize(10));
        assert_eq!(params.unattainable_after_ms, 5_000.0);
        assert_eq!(params.peer_delay_us, 10.0);
        assert_eq!(params.validate(), Ok(()));
        let config = params.loop_config();
        assert_eq!(config.ref_period, Duration::from_micros(500));
        assert_eq!(config.unattainable_after, Some(Duration::from_secs(5)));
        assert_eq!(config.target, Target99::IdleMultiple(2.0));
        assert_eq!(params.probe_bytes(), 10);
    }

    /// Each range is checked at its edge, and the refusal names the field.
    #[test]
    fn each_range_is_checked_at_its_edge() {
        let base = JustitiaParams::default;
        let with = |f: &dyn Fn(&mut JustitiaParams)| {
            let mut p = base();
            f(&mut p);
            p
        };
        let both = with(&|p| {
            p.target99_us = Some(20.0);
            p.target99_x_idle = Some(2.0);
        });
        assert_eq!(refused(both), "target99_x_idle");
        for us in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(refused(with(&|p| p.target99_us = Some(us))), "target99_us");
        }
        assert_eq!(with(&|p| p.target99_us = Some(0.5)).validate(), Ok(()));
        for x in [0.99, f64::NAN, f64::INFINITY] {
            let p = with(&|p| p.target99_x_idle = Some(x));
            assert_eq!(refused(p), "target99_x_idle");
        }
        assert_eq!(with(&|p| p.target99_x_idle = Some(1.0)).validate(), Ok(()));
        assert_eq!(refused(with(&|p| p.ref_period_us = 0.0)), "ref_period_us");
        assert_eq!(refused(with(&|p| p.ref_window = Some(0))), "ref_window");
        assert_eq!(with(&|p| p.ref_window = Some(1)).validate(), Ok(()));
        let huge = ByteSize(u64::from(u32::MAX) + 1);
        assert_eq!(refused(with(&|p| p.ref_size = huge)), "ref_size");
        let largest = with(&|p| p.ref_size = ByteSize(u64::from(u32::MAX)));
        assert_eq!(largest.validate(), Ok(()));
        for us in [-0.001, f64::NAN] {
            assert_eq!(refused(with(&|p| p.peer_delay_us = us)), "peer_delay_us");
        }
        assert_eq!(with(&|p| p.peer_delay_us = 0.0).validate(), Ok(()));
        let silent = with(&|p| p.peer_silent_after_ms = Some(0.0));
        assert_eq!(refused(silent), "peer_silent_after_ms");
        for ms in [-1.0, f64::NAN] {
            let p = with(&|p| p.unattainable_after_ms = ms);
            assert_eq!(refused(p), "unattainable_after_ms");
        }
        assert_eq!(with(&|p| p.unattainable_after_ms = 0.0).validate(), Ok(()));
        for rate in [-1.0, f64::NAN, f64::INFINITY] {
            let p = with(&|p| p.control_verbs_per_sec = Some(rate));
            assert_eq!(refused(p), "control_verbs_per_sec");
        }
        for burst in [0, MAX_CONTROL_VERB_BURST + 1] {
            let p = with(&|p| p.control_verb_burst = Some(burst));
            assert_eq!(refused(p), "control_verb_burst");
        }
        for burst in [1, MAX_CONTROL_VERB_BURST] {
            let p = with(&|p| p.control_verb_burst = Some(burst));
            assert_eq!(p.validate(), Ok(()));
        }
    }

    /// No control-verb budget unless a positive one is given; the burst defaults to 16.
    #[test]
    fn control_verbs_are_paced_only_with_a_positive_budget() {
        let with = |rate: Option<f64>, burst: Option<u32>| JustitiaParams {
            control_verbs_per_sec: rate,
            control_verb_burst: burst,
            ..JustitiaParams::default()
        };
        assert_eq!(with(None, Some(4)).control_verb_budget(), None);
        let off = with(Some(0.0), None);
        assert_eq!(off.validate(), Ok(()));
        assert_eq!(off.control_verb_budget(), None);
        assert_eq!(
            with(Some(1000.0), None).control_verb_budget(),
            Some((1000.0, DEFAULT_CONTROL_VERB_BURST))
        );
        assert_eq!(
            with(Some(1000.0), Some(1)).control_verb_budget(),
            Some((1000.0, 1))
        );
    }

    /// What the loop is given: an absolute target as given, delta 0 as the option off,
    /// and the fixed law with the paper's 10 000-sample window (RefCount, §4.2.1) unless
    /// a window is given.
    #[test]
    fn the_loop_gets_what_was_asked() {
        let params = JustitiaParams {
            target99_us: Some(25.0),
            unattainable_after_ms: 0.0,
            increase: Increase::Fixed,
            ..JustitiaParams::default()
        };
        let config = params.loop_config();
        assert_eq!(config.target, Target99::Absolute(Duration::from_micros(25)));
        assert_eq!(config.unattainable_after, None);
        assert_eq!(config.increase, IncreaseLaw::Fixed);
        assert_eq!(config.window, 10_000);
        let windowed = JustitiaParams {
            ref_window: Some(300),
            ref_period_us: 250.0,
            ..params
        };
        assert_eq!(windowed.loop_config().window, 300);
        assert_eq!(
            windowed.loop_config().ref_period,
            Duration::from_micros(250)
        );
        let x = JustitiaParams {
            target99_x_idle: Some(3.0),
            ..JustitiaParams::default()
        };
        assert_eq!(x.loop_config().target, Target99::IdleMultiple(3.0));
        assert_eq!(x.loop_config().increase, IncreaseLaw::SEARCH);
        // The channel resends an unchanged grant every 5 ms: a guarantee holds four of them
        // (three lost in a row), 20 ms, at a RefPeriod of 100 us as at 500 us.
        let fast = JustitiaParams {
            ref_period_us: 100.0,
            ..JustitiaParams::default()
        };
        let config = fast.loop_config();
        assert_eq!(config.read_guarantee_lifetime, Duration::from_millis(20));
        assert_eq!(
            config.check_grant_refresh(ChannelConfig::default().refresh, DEFAULT_REFRESH_LOSSES),
            Ok(())
        );
    }

    /// Feeds `driver` `probes` reference probes that each take `rtt_us`, running its timers
    /// between them.
    fn probe(host: &mut TestHost, driver: &mut LoopDriver, qp: QpId, probes: usize, rtt_us: u64) {
        for _ in 0..probes {
            loop {
                let sent = host.posted(qp).len();
                driver.drive(&mut host.ctx());
                if host.posted(qp).len() > sent {
                    break;
                }
                let (_, tag) = host.next_timer().unwrap();
                assert_eq!(tag, LOOP_TIMER);
                assert!(driver.timer_is_current(&host.ctx()));
            }
            host.advance_to(host.now() + rtt_us * 1_000_000);
            assert!(driver.on_completion(&host.ctx(), qp));
        }
    }

    /// The driver sends the probe the loop asks for, times it from post to completion and
    /// reports in Gb/s and us: every probe taking 10 us against a 25 us target leaves
    /// SafeUtil at MaxRate with no decrease; every probe then taking 50 us cuts it, and the
    /// mean over the run lies between the two.
    #[test]
    fn the_driver_times_probes_and_reports_them() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let max_gbps = profile.policy.max_rate_gbps;
        let params = JustitiaParams {
            target99_us: Some(25.0),
            ref_window: Some(100),
            ..JustitiaParams::default()
        };
        let mut host = TestHost::new();
        let latency = host.flow(1, FlowClass::Latency);
        let mut driver = LoopDriver::new(&profile.policy, &params).unwrap();
        // No update yet: no mean to report.
        assert_eq!(driver.figures().get("mean_safe_util_gbps"), None);
        driver.connect(&mut host.ctx(), std::slice::from_ref(&latency));
        driver.flow_present(&host.ctx(), &latency, true);
        let qp = (0..64).map(QpId).find(|&qp| driver.probe.owns(qp)).unwrap();
        assert!(!driver.on_completion(&host.ctx(), latency.qps[0]));

        probe(&mut host, &mut driver, qp, 150, 10);
        let f = driver.figures();
        assert_eq!(f["current99_us"], 10.0);
        assert_eq!(f["target99_us"], 25.0);
        assert_eq!(f["safe_util_gbps"], max_gbps);
        assert!((f["mean_safe_util_gbps"] - max_gbps).abs() < 1e-9 * max_gbps);
        assert_eq!(f["decreases"], 0.0);
        assert_eq!(f.get("idle_p99_us"), None);
        let chunk = profile.policy.chunk_bytes_with_latency;
        assert_eq!(f["chunk_bytes"], f64::from(chunk));
        let state = driver.control_state();
        assert_eq!(state.safe_util_gbps, max_gbps);
        assert_eq!(state.current99_us, Some(10.0));
        assert_eq!(state.target99_us, Some(25.0));
        assert_eq!(state.mode, Mode::Normal);

        probe(&mut host, &mut driver, qp, 150, 50);
        let f = driver.figures();
        // The estimator's histogram keeps three significant digits.
        assert!((f["current99_us"] - 50.0).abs() <= 0.05, "{f:?}");
        assert!(f["decreases"] >= 1.0, "{f:?}");
        let (now, mean) = (f["safe_util_gbps"], f["mean_safe_util_gbps"]);
        assert!(now < mean && mean < max_gbps, "{f:?}");
        assert_eq!(driver.control_state().safe_util_gbps, now);
    }

    /// A bandwidth flow beside a latency flow is held at zero until the loop's first update
    /// counts it, then cut to the profile's chunk for latency flows being present and paced;
    /// the application hears once, when its last chunk completes.
    #[test]
    fn a_bandwidth_flow_waits_for_its_allotment_then_goes_in_chunks() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let params = JustitiaParams {
            target99_us: Some(50.0),
            ..JustitiaParams::default()
        };
        let mut policy = JustitiaPolicy::new(&profile, &params).unwrap();
        let mut host = TestHost::new();
        let flows = [
            host.flow(1, FlowClass::Latency),
            host.flow(2, FlowClass::Bandwidth),
        ];
        policy.on_start(&mut host.ctx(), &flows);
        for f in &flows {
            policy.on_flow_active(&mut host.ctx(), f, true);
        }
        assert!(policy.control_state().is_some());
        let qp = flows[1].qps[0];
        policy.on_post(&mut host.ctx(), qp, write(9, 1 << 20));
        assert!(
            host.posted(qp).is_empty(),
            "no allotment before the first update"
        );
        while host.posted(qp).is_empty() {
            let (at, tag) = host.next_timer().unwrap();
            assert!(at < 2 * 500_000_000, "an update within two RefPeriods");
            policy.on_timer(&mut host.ctx(), tag);
        }
        let chunk = profile.policy.chunk_bytes_with_latency;
        let posted = host.posted(qp);
        assert!(posted.iter().all(|w| w.bytes == chunk), "{chunk}");
        assert_eq!(policy.figures()["chunk_bytes"], f64::from(chunk));
        let chunks = (1u32 << 20).div_ceil(chunk) as usize;
        assert!(posted.len() < chunks, "paced: not all at once");
        let mut done = 0;
        while done < chunks {
            while done < host.posted(qp).len() {
                let tag = host.posted(qp)[done].tag;
                policy.on_completion(&mut host.ctx(), qp, tag);
                done += 1;
                let last = done == chunks;
                assert_eq!(host.completed(), if last { vec![9] } else { vec![] });
            }
            if done < chunks {
                let (_, tag) = host.next_timer().unwrap();
                policy.on_timer(&mut host.ctx(), tag);
            }
        }
    }

    /// A receiver's incast share per unit of weight caps each of this host's bandwidth
    /// flows into it at its tenant's share divided among the tenant's bandwidth flows into
    /// that receiver; flows into another host, throughput flows and READs are not capped,
    /// and when one of two flows leaves the other's cap doubles at once.
    #[test]
    fn an_incast_share_is_split_among_a_tenants_bandwidth_flows_into_the_receiver() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let mut policy = JustitiaPolicy::new(&profile, &JustitiaParams::default()).unwrap();
        let mut host = TestHost::new();
        let to_one = |host: &mut TestHost, id, class| host.flow_to(id, class, HostId(1));
        let a = to_one(&mut host, 1, FlowClass::Bandwidth);
        let mut b = to_one(&mut host, 2, FlowClass::Bandwidth);
        let c = to_one(&mut host, 3, FlowClass::Bandwidth);
        let mut d = host.flow_to(4, FlowClass::Bandwidth, HostId(2));
        let mut e = to_one(&mut host, 5, FlowClass::Throughput);
        let mut f = to_one(&mut host, 6, FlowClass::Bandwidth);
        f.reads = true;
        // Tenant 1 owns all but c and e; e's tenant weighs 3.
        for flow in [&mut b, &mut d, &mut f] {
            flow.spec.tenant = TenantId(1);
        }
        e.spec.weight = Weight::new(3).unwrap();
        let flows = [a, b, c, d, e, f];
        policy.on_start(&mut host.ctx(), &flows);
        for flow in &flows {
            policy.on_flow_active(&mut host.ctx(), flow, true);
            let wr = WorkRequest {
                opcode: if flow.reads {
                    Opcode::Read
                } else {
                    Opcode::Write
                },
                ..write(flow.spec.id.0, 1 << 30)
            };
            policy.on_post(&mut host.ctx(), flow.qps[0], wr);
        }
        let share = 2e8;
        let now = core_time(host.now());
        assert_eq!(policy.incast.grant_received(now, 1, share), Ok(true));
        // Run to the loop's first allotments.
        while policy
            .driver
            .control
            .allotment(flows[0].spec.id)
            .is_none_or(|a| a.bytes_per_sec == 0.0)
        {
            let (_, tag) = host.next_timer().unwrap();
            policy.on_timer(&mut host.ctx(), tag);
        }
        let pace = |policy: &JustitiaPolicy, flow: &FlowInfo| {
            let shaper = policy.shaper.as_ref().unwrap();
            shaper.pace_of(flow.spec.id).unwrap().bytes_per_sec as f64
        };
        let allotted = |policy: &JustitiaPolicy, flow: &FlowInfo| {
            policy
                .driver
                .control
                .allotment(flow.spec.id)
                .unwrap()
                .bytes_per_sec
        };
        for flow in &flows {
            assert!(allotted(&policy, flow) > share, "the caps bind: {flow:?}");
        }
        assert_eq!(pace(&policy, &flows[0]), share / 2.0);
        assert_eq!(pace(&policy, &flows[1]), share / 2.0);
        assert_eq!(pace(&policy, &flows[2]), share);
        for uncapped in &flows[3..5] {
            assert_eq!(pace(&policy, uncapped), allotted(&policy, uncapped).trunc());
        }
        let now = core_time(host.now());
        assert_eq!(
            policy
                .paced_allotment(now, flows[5].spec.id)
                .unwrap()
                .bytes_per_sec,
            allotted(&policy, &flows[5])
        );
        // The largest cap on one bandwidth flow: weight 1 times the share.
        assert_eq!(policy.figures()["incast_cap_gbps"], share * 8.0 / 1e9);
        policy.on_flow_active(&mut host.ctx(), &flows[1], false);
        assert_eq!(pace(&policy, &flows[0]), share);
    }

    /// A latency flow into another host is declared to it from its start (the shaper never
    /// sees its work); a bandwidth flow only once it has work, a latency READ as its READs
    /// are, and a flow that stops is withdrawn. A datagram the channel refuses is counted.
    #[test]
    fn a_latency_flow_is_declared_to_its_receiver_from_its_start() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let mut policy = JustitiaPolicy::new(&profile, &JustitiaParams::default()).unwrap();
        let mut host = TestHost::new();
        let latency = host.flow(1, FlowClass::Latency);
        let bandwidth = host.flow(2, FlowClass::Bandwidth);
        let mut read = host.flow(3, FlowClass::Latency);
        read.reads = true;
        let flows = [latency, bandwidth, read];
        policy.on_start(&mut host.ctx(), &flows);
        for flow in &flows {
            policy.on_flow_active(&mut host.ctx(), flow, true);
        }
        let loading =
            |policy: &JustitiaPolicy| policy.loading.keys().map(|id| id.0).collect::<Vec<_>>();
        assert_eq!(loading(&policy), [1]);
        policy.on_post(&mut host.ctx(), flows[1].qps[0], write(7, 4096));
        assert_eq!(loading(&policy), [1, 2]);
        policy.on_flow_active(&mut host.ctx(), &flows[0], false);
        assert_eq!(loading(&policy), [2]);
        // A host's only declared flow is withdrawn too when it stops.
        let mut alone = JustitiaPolicy::new(&profile, &JustitiaParams::default()).unwrap();
        alone.on_start(&mut host.ctx(), &flows[..1]);
        alone.on_flow_active(&mut host.ctx(), &flows[0], true);
        assert_eq!(loading(&alone), [1]);
        alone.on_flow_active(&mut host.ctx(), &flows[0], false);
        assert_eq!(loading(&alone), Vec::<u64>::new());
        // A datagram the channel cannot take is refused and counted, once each.
        for refused in 1..=2 {
            let junk = PolicyMessage::Peer(vec![0; 10]);
            policy.on_message(&mut host.ctx(), HostId(1), junk);
            assert_eq!(
                policy.figures()["peer_datagrams_refused"],
                f64::from(refused)
            );
        }
    }

    /// A host that has sent no datagram and refused none reports no channel figures, and
    /// no incast share it grants none; one refused datagram is reported with none sent.
    #[test]
    fn a_quiet_channel_reports_nothing() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let mut policy = JustitiaPolicy::new(&profile, &JustitiaParams::default()).unwrap();
        let mut host = TestHost::new();
        policy.on_start(&mut host.ctx(), &[]);
        let channel_figures = |policy: &JustitiaPolicy| {
            let figures = policy.figures();
            let keys = figures.keys().filter(|k| k.starts_with("peer_"));
            keys.cloned().collect::<Vec<_>>()
        };
        assert_eq!(channel_figures(&policy), Vec::<String>::new());
        policy.on_message(&mut host.ctx(), HostId(1), PolicyMessage::Peer(vec![0; 10]));
        assert_eq!(
            channel_figures(&policy),
            ["peer_datagrams_refused", "peer_datagrams_sent"]
        );
        assert_eq!(policy.figures()["peer_datagrams_sent"], 0.0);
    }

    /// A peer timer due at the instant the loop's timer is due flushes the channel, and
    /// leaves the loop's timer to its own event.
    #[test]
    fn a_peer_timer_beside_the_loop_timer_flushes_the_channel() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let mut policy = JustitiaPolicy::new(&profile, &JustitiaParams::default()).unwrap();
        let mut host = TestHost::new();
        let flows = [host.flow(1, FlowClass::Bandwidth)];
        policy.on_start(&mut host.ctx(), &flows);
        policy.on_flow_active(&mut host.ctx(), &flows[0], true);
        let due = policy.driver.timer_at.unwrap();
        while let Some((_, tag)) = host.next_timer_before(due) {
            policy.on_timer(&mut host.ctx(), tag);
        }
        assert_eq!(policy.driver.timer_at, Some(due));
        policy.peer_timer_at = Some(due);
        policy.on_timer(&mut host.ctx(), PEER_TIMER);
        assert_ne!(policy.peer_timer_at, Some(due), "the channel was flushed");
        assert_eq!(
            policy.driver.timer_at,
            Some(due),
            "the loop's timer is still to come"
        );
    }
}
