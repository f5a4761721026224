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
//! - **Remote READs** (§4.4). A READ flow's requester tells the host it reads from, by a
//!   [`PolicyMessage`] ([`MESSAGE_DELAY`](super::MESSAGE_DELAY) on its way), whenever the
//!   flow starts or stops having work; that host's loop counts the READ flows it serves
//!   ([`ControlLoop::set_remote_reads`]), and each [`Event::ReadGuarantee`] it emits goes
//!   to every host with such a flow, whose loop caps the flow's allotment at it
//!   ([`ControlLoop::read_guarantee_received`]).
//!
//! Not modelled: the flow-control messages of split SENDs (the peer is assumed to
//! cooperate).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use justitia_core::control_loop::{
    ControlLoop, Event, FlowRegistration, LoopConfig, LoopError, ProbeId, Target99,
};
use justitia_core::controller::{ControlAction, ControlMode, IncreaseLaw};
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;
use justitia_core::remote_read::RemoteReadUnit;
use serde::{Deserialize, Serialize};

use super::paced::{Activity, PacedShaper, PACE_TIMER};
use super::reference::ReferenceProbe;
use super::{FlowInfo, Policy, PolicyContext, PolicyFigures, PolicyMessage};
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
        if !(self.unattainable_after_ms.is_finite() && self.unattainable_after_ms >= 0.0) {
            return Err((
                "unattainable_after_ms".into(),
                format!(
                    "must be 0 (off) or positive, got {}",
                    self.unattainable_after_ms
                ),
            ));
        }
        Ok(())
    }

    /// Target99 as the core takes it.
    pub fn target(&self) -> Target99 {
        match (self.target99_us, self.target99_x_idle) {
            (Some(us), _) => Target99::Absolute(Duration::from_nanos(time::from_us(us) / 1_000)),
            (None, x) => Target99::IdleMultiple(x.unwrap_or(DEFAULT_X_IDLE)),
        }
    }

    /// The core loop's settings.
    pub fn loop_config(&self) -> LoopConfig {
        let base = match self.increase {
            Increase::Search => LoopConfig::default(),
            Increase::Fixed => LoopConfig::paper(self.target()),
        };
        LoopConfig {
            target: self.target(),
            ref_period: Duration::from_nanos(time::from_us(self.ref_period_us) / 1_000),
            window: self.ref_window.map_or(base.window, |w| w as usize),
            increase: match self.increase {
                Increase::Search => IncreaseLaw::SEARCH,
                Increase::Fixed => IncreaseLaw::Fixed,
            },
            unattainable_after: (self.unattainable_after_ms > 0.0)
                .then(|| Duration::from_nanos(time::from_ms(self.unattainable_after_ms) / 1_000)),
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

fn picos(d: Duration) -> Picos {
    u64::try_from(d.as_nanos())
        .unwrap_or(u64::MAX / 1_000)
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
    decreases: u64,
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
            decreases: 0,
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
            if self.control.last_action() == Some(ControlAction::Decrease) {
                self.decreases += 1;
            }
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
        f.insert("decreases".into(), self.decreases as f64);
        f.insert("chunk_bytes".into(), f64::from(self.control.chunk_bytes()));
        f
    }
}

/// Justitia's daemon and shapers on one host.
pub struct JustitiaPolicy {
    driver: LoopDriver,
    shaper: Option<PacedShaper>,
    /// The resource-hungry flows of this host.
    hungry: Vec<FlowId>,
    /// This host's READ flows: each one's spec and the host it reads from.
    reads: Vec<(FlowSpec, HostId)>,
    /// The other hosts' READ flows this host serves that have work, with their hosts.
    served: BTreeMap<(HostId, FlowId), FlowSpec>,
}

impl JustitiaPolicy {
    /// A policy for a host with this RNIC.
    pub fn new(profile: &ModelProfile, params: &JustitiaParams) -> Result<Self, JustitiaError> {
        Ok(JustitiaPolicy {
            driver: LoopDriver::new(&profile.policy, params)?,
            shaper: None,
            hungry: Vec::new(),
            reads: Vec::new(),
            served: BTreeMap::new(),
        })
    }

    /// Tells the hosts this host's READ flows read from which of them started or stopped
    /// having work.
    fn tell_reads(&self, ctx: &mut PolicyContext<'_>, changes: &[Activity]) {
        for change in changes {
            let (id, active) = match *change {
                Activity::HasWork(id) => (id, true),
                Activity::Idle(id) => (id, false),
            };
            if let Some(&(spec, peer)) = self.reads.iter().find(|r| r.0.id == id) {
                ctx.send(
                    peer,
                    PolicyMessage::RemoteRead {
                        flow: spec.id,
                        tenant: spec.tenant,
                        weight: spec.weight,
                        class: spec.class,
                        active,
                    },
                );
            }
        }
    }

    /// Sends a guarantee of this host's loop to every host whose READ flows it serves.
    fn announce(&self, ctx: &mut PolicyContext<'_>, events: &[Event]) {
        for event in events {
            if let Event::ReadGuarantee(guarantee) = *event {
                let mut hosts: Vec<HostId> = self.served.keys().map(|&(h, _)| h).collect();
                hosts.sort_unstable();
                hosts.dedup();
                for host in hosts {
                    ctx.send(host, PolicyMessage::ReadGuarantee(guarantee));
                }
            }
        }
    }

    /// Runs the loop and carries out its allotments.
    fn drive(&mut self, ctx: &mut PolicyContext<'_>) {
        let events = self.driver.drive(ctx);
        self.announce(ctx, &events);
        let Some(shaper) = &mut self.shaper else {
            return;
        };
        if events
            .iter()
            .any(|e| matches!(e, Event::AllotmentsChanged { .. }))
        {
            for &id in &self.hungry {
                if let Some(allotment) = self.driver.control.allotment(id) {
                    shaper.set_allotment(ctx, id, Some(allotment));
                }
            }
            let changes = shaper.take_activity();
            self.tell_reads(ctx, &changes);
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
            self.tell_reads(ctx, &changes);
            self.driver.activity(ctx, changes);
        }
    }
}

impl Policy for JustitiaPolicy {
    fn name(&self) -> &str {
        "justitia"
    }

    fn on_start(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        self.shaper = Some(PacedShaper::new(flows));
        self.hungry = flows
            .iter()
            .filter(|f| f.spec.class.is_resource_hungry())
            .map(|f| f.spec.id)
            .collect();
        self.reads = flows
            .iter()
            .filter(|f| f.reads)
            .map(|f| (f.spec, f.peer))
            .collect();
        self.driver.connect(ctx, flows);
        self.drive(ctx);
    }

    fn on_flow_active(&mut self, ctx: &mut PolicyContext<'_>, flow: &FlowInfo, active: bool) {
        self.driver.flow_present(ctx, flow, active);
        let id = flow.spec.id;
        if !active && flow.reads {
            self.tell_reads(ctx, &[Activity::Idle(id)]);
        }
        if let (true, Some(shaper)) = (active, &mut self.shaper) {
            // A registered flow is held to its allotment from the start: zero until the
            // loop's next update counts it.
            if let Some(allotment) = self.driver.control.allotment(id) {
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
            Some(shaper) => shaper.on_post(ctx, qp, wr),
            None => ctx.post(qp, wr),
        }
        self.forward_activity(ctx);
    }

    fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        if self.driver.on_completion(ctx, qp) {
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
        }
    }

    fn on_message(&mut self, ctx: &mut PolicyContext<'_>, from: HostId, message: PolicyMessage) {
        let now = core_time(ctx.now());
        match message {
            PolicyMessage::RemoteRead {
                flow,
                tenant,
                weight,
                class,
                active,
            } => {
                if active {
                    let spec = FlowSpec {
                        id: flow,
                        tenant,
                        class,
                        weight,
                    };
                    self.served.insert((from, flow), spec);
                } else {
                    self.served.remove(&(from, flow));
                }
                // One unit per (host, tenant, class), at the tenant's largest weight, as
                // the loop counts local tenants.
                let mut units: BTreeMap<(HostId, TenantId, FlowClass), Weight> = BTreeMap::new();
                for (&(host, _), spec) in &self.served {
                    let w = units
                        .entry((host, spec.tenant, spec.class))
                        .or_insert(spec.weight);
                    *w = (*w).max(spec.weight);
                }
                let units: Vec<RemoteReadUnit> = units
                    .into_iter()
                    .map(|((_, _, class), weight)| RemoteReadUnit { class, weight })
                    .collect();
                self.driver.control.set_remote_reads(now, &units);
            }
            PolicyMessage::ReadGuarantee(guarantee) => {
                for &(spec, peer) in &self.reads {
                    let flow = spec.id;
                    if peer == from {
                        // Refused only for a flow not registered now (stopped) or a
                        // malformed guarantee, which this model never sends.
                        let _ = self
                            .driver
                            .control
                            .read_guarantee_received(now, flow, guarantee);
                    }
                }
            }
        }
    }

    fn control_state(&self) -> Option<ControlState> {
        (!self.hungry.is_empty()).then(|| self.driver.control_state())
    }

    fn figures(&self) -> PolicyFigures {
        self.driver.figures()
    }
}
