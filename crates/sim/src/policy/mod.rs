//! The policy boundary: what a host runs between its applications and its RNIC.
//!
//! A [`Policy`] sees every work request that an application on its host posts, decides
//! when (and in what pieces) it reaches the RNIC, sees every completion of what it posted,
//! and decides what the application is told. It may own queue pairs of its own (a probe)
//! and timers. This is the position of Justitia's shaper and daemon (§4), and of PeRF's
//! interposed library: a new policy (preemption, hardware priority, an adaptive one)
//! implements this trait and needs no change to the RNIC model. Hardware priority is
//! reached through [`PolicyContext::set_priority`], which stands for the operator's
//! configuration of the RNIC's and switches' traffic classes.
//!
//! | policy | what it does |
//! | --- | --- |
//! | [`native`] | nothing: requests reach the RNIC as posted |
//! | [`justitia`] | Justitia (NSDI'22): reference flow, SafeUtil, tokens, paced chunks |
//! | [`preempt`] | PeRF (ATC'24): sub-messages with zero-length yield writes, not paced |
//! | [`adaptive`] | the core's adaptive law: bandwidth flows paced as one chunk stream under the transmitter's drain rate, chunks sized from the latency flows' tail |
//! | [`priority`] | hardware strict priority: latency, then throughput flows on higher lanes |
//!
//! A policy also sees every control verb an application on its host issues
//! ([`Policy::on_control`]) and decides when it reaches the RNIC: `justitia` and
//! `adaptive` pace them by the core's [`ControlVerbPacer`](justitia_core::control_verbs::ControlVerbPacer)
//! when the scenario gives a host budget ([`control_verbs`]); the others pass them on at once.
//!
//! One instance runs per host, built by [`PolicySpec::build`] from the name a scenario
//! gives and the run's parameters.

pub mod adaptive;
pub mod control_verbs;
pub mod justitia;
pub mod native;
pub mod paced;
pub mod preempt;
pub mod priority;
pub mod reference;
pub mod split;
#[cfg(test)]
mod test_host;
pub mod translation;
pub mod yielding;

use std::collections::{BTreeMap, VecDeque};

use justitia_core::adaptive::Access;
use justitia_core::flow::FlowSpec;
use serde::{Deserialize, Serialize};

use crate::engine::EventQueue;
use crate::event::{Event, Notice};
use crate::model_profile::ModelProfile;
use crate::rnic::{ControlVerb, Endpoint, Fabric, QpId, QpOwner, WorkRequest};
use crate::series::ControlState;
use crate::time::Picos;
use crate::topology::HostId;

/// A flow as a host's policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct FlowInfo {
    /// Identity, tenant, class and weight, as the policy core's allotment wants them.
    pub spec: FlowSpec,
    /// The scenario's name for it.
    pub name: String,
    /// The queue pairs on this host on which the flow posts.
    pub qps: Vec<QpId>,
    /// The host at the other end.
    pub peer: HostId,
    /// Its requests are READs (on the requester's side): their data leaves `peer`'s RNIC.
    pub reads: bool,
}

/// A control verb an application issued, as its host's policy sees it: the verb, who
/// issued it, and what the host's control-verb budget is shared by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlCall {
    /// The application that issued it (one process).
    pub app: u32,
    /// The verb.
    pub verb: ControlVerb,
    /// For a region registered: its pages.
    pub pages: u32,
    /// When the application issued it (its issue-to-completion time, a latency sample,
    /// counts any wait the policy adds).
    pub issued: Picos,
    /// The application's tenant on this host.
    pub tenant: TenantOnHost,
}

/// A tenant on a host, as the host's daemon knows it from the processes registered with
/// it: what the budget of control verbs is shared by (`tenant_budget`'s arguments).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantOnHost {
    /// The tenant's weight (the largest among its running applications on the host).
    pub weight: u32,
    /// The sum of the weights of the tenants with an application running on the host (this
    /// one included).
    pub total_weight: u64,
    /// The tenant's applications running on the host: its processes, among which its share
    /// is split.
    pub processes: u32,
}

/// How long a message between two hosts' policies takes (the daemons' control traffic over
/// the network, a small message each way through their hosts' stacks): 10 us, an assumed
/// figure a few round trips long.
pub const MESSAGE_DELAY: Picos = 10_000_000;

/// A message between two hosts' policies.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyMessage {
    /// A datagram of the peer channel between two hosts' daemons (`justitia-peer`: the
    /// sender's READ flows against the receiver, or the receiver's guarantee back).
    Peer(Vec<u8>),
    /// A message of the shapers' side channel for split two-sided requests
    /// (`justitia_core::two_sided`), carried over the wire ([`PolicyContext::send_on_wire`]).
    Side(Vec<u8>),
}

/// How long the receiving shaper takes to see a side-channel message once the RNIC has
/// delivered it: its thread polls the side channel's completion queue, assumed every
/// microsecond.
pub const SIDE_CHANNEL_POLL: Picos = 1_000_000;

/// Messages on their way between policies, by slot (an event names the slot, so that
/// events stay small).
#[derive(Default)]
pub(crate) struct Mailbox {
    slots: Vec<Option<(HostId, PolicyMessage)>>,
    free: Vec<u32>,
    /// Messages sent on the wire, by the queue pair that will receive them, in order (a
    /// connection delivers in order, so the next delivery on that queue pair is the front).
    wire: BTreeMap<QpId, VecDeque<(HostId, PolicyMessage)>>,
}

impl Mailbox {
    fn put(&mut self, from: HostId, message: PolicyMessage) -> u32 {
        match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some((from, message));
                slot
            }
            None => {
                self.slots.push(Some((from, message)));
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// The next message sent on the wire to `qp`, when the RNIC delivers on it: queued for
    /// the receiving policy `delay` later.
    pub(crate) fn delivered(
        &mut self,
        qp: QpId,
        delay: Picos,
        queue: &mut EventQueue<Event>,
        host: HostId,
    ) {
        let Some((from, message)) = self.wire.get_mut(&qp).and_then(VecDeque::pop_front) else {
            return;
        };
        let slot = self.put(from, message);
        let at = queue.now().saturating_add(delay);
        queue.schedule(at, Event::PolicyMessage { host, slot });
    }

    /// Takes the message of `slot`: who sent it, and what.
    pub(crate) fn take(&mut self, slot: u32) -> Option<(HostId, PolicyMessage)> {
        let message = self.slots.get_mut(slot as usize)?.take()?;
        self.free.push(slot);
        Some(message)
    }
}

/// What a policy may do while handling a call.
pub struct PolicyContext<'a> {
    pub(crate) host: HostId,
    pub(crate) fabric: &'a mut Fabric,
    pub(crate) queue: &'a mut EventQueue<Event>,
    pub(crate) notices: &'a mut VecDeque<Notice>,
    pub(crate) mailbox: &'a mut Mailbox,
}

impl PolicyContext<'_> {
    /// Now.
    pub fn now(&self) -> Picos {
        self.queue.now()
    }

    /// The host this policy runs on.
    pub fn host(&self) -> HostId {
        self.host
    }

    /// Hands a work request to the RNIC (the host CPU's post and doorbell costs apply).
    pub fn post(&mut self, qp: QpId, wr: WorkRequest) {
        self.fabric.post(qp, wr, self.queue);
    }

    /// Tells the application that owns `qp` that its request `tag` completed.
    pub fn complete(&mut self, qp: QpId, tag: u64) {
        if let QpOwner::App(app) = self.fabric.owner(qp) {
            self.notices.push_back(Notice { app, qp, tag });
        }
    }

    /// Hands a control verb to the RNIC now: it queues on the host's control path.
    pub fn control(&mut self, call: ControlCall) {
        self.fabric.control(
            self.host,
            call.app,
            call.verb,
            call.pages,
            call.issued,
            self.queue,
        );
    }

    /// Hands a control verb to the RNIC at `at` (now if `at` is not later): the shaper
    /// holds the application in the verb until then.
    pub fn control_at(&mut self, at: Picos, call: ControlCall) {
        if at <= self.queue.now() {
            self.control(call);
            return;
        }
        self.queue.schedule(
            at,
            Event::ControlIssue {
                host: self.host,
                app: call.app,
                verb: call.verb,
                pages: call.pages,
                issued: call.issued,
            },
        );
    }

    /// Calls [`Policy::on_timer`] with `tag` at `at`.
    pub fn set_timer(&mut self, at: Picos, tag: u64) {
        self.queue.schedule(
            at,
            Event::PolicyTimer {
                host: self.host,
                tag,
            },
        );
    }

    /// Opens a connection of the policy's own from this host to `peer` (e.g. the reference
    /// flow's); returns the local queue pair. Its completions come to
    /// [`Policy::on_completion`] and are never shown to applications.
    pub fn connect_probe(&mut self, peer: HostId) -> QpId {
        self.connect_own(peer, false)
    }

    /// Opens the policy's side channel from this host to `peer`: a connection of its own
    /// whose messages ([`PolicyContext::send_on_wire`]) reach the peer's policy when the
    /// RNIC delivers them. Returns the local queue pair.
    pub fn connect_side_channel(&mut self, peer: HostId) -> QpId {
        self.connect_own(peer, true)
    }

    /// A connection of the policy's own to `peer`, whose deliveries reach the peer's
    /// policy when `deliver`; the local queue pair.
    fn connect_own(&mut self, peer: HostId, deliver: bool) -> QpId {
        let end = |host| Endpoint {
            host,
            owner: QpOwner::Policy,
            deliver,
        };
        let (local, _) = self.fabric.connect(end(self.host), end(peer), None);
        local
    }

    /// Sends `message`, `bytes` long, as a SEND on the side channel `qp` (under `tag`, whose
    /// completion comes back to [`Policy::on_completion`]); the peer's policy gets it in
    /// [`Policy::on_message`] [`SIDE_CHANNEL_POLL`] after the RNIC delivered it.
    pub fn send_on_wire(&mut self, qp: QpId, message: PolicyMessage, bytes: u32, tag: u64) {
        let to = self.fabric.peer_of(qp);
        self.mailbox
            .wire
            .entry(to)
            .or_default()
            .push_back((self.host, message));
        let wr = WorkRequest {
            tag,
            opcode: crate::rnic::Opcode::Send,
            bytes,
            inline: true,
        };
        self.fabric.post(qp, wr, self.queue);
    }

    /// The memory request `wr` reads its payload from if it is the next one posted on `qp`,
    /// as the core's translation charge counts it: what a shaper knows from the request
    /// itself (its region, address and length, and the region's page size); `None` when the
    /// RNIC reads no payload for it (inline, empty, or a READ).
    pub fn payload_pages(&self, qp: QpId, wr: &WorkRequest) -> Option<Access> {
        let (mr, first_page, pages) = self.fabric.next_payload_pages(qp, wr)?;
        Some(Access {
            region: u64::from(mr),
            first_page,
            pages,
        })
    }

    /// The queue pair at the other end of `qp`'s connection.
    pub fn peer_of(&self, qp: QpId) -> QpId {
        self.fabric.peer_of(qp)
    }

    /// Puts the connection of `qp` (both of its ends) on virtual lane `lane`, its service
    /// level. Lanes run from 0, the lowest, where every connection starts, to
    /// [`VIRTUAL_LANES`](crate::model_profile::VIRTUAL_LANES) - 1; a higher `lane` is
    /// clamped to that. Every RNIC's arbiter serves ready queue pairs of a higher lane
    /// strictly before those of a lower one (round-robin within a lane), and switches
    /// buffer and arbitrate the connection's packets on that lane, as the scenario's `sl`
    /// would (this replaces it). Meant for [`Policy::on_start`], as a real queue pair's
    /// service level is fixed when it is connected; a later change takes effect from each
    /// end's next packet.
    pub fn set_priority(&mut self, qp: QpId, lane: u8) {
        self.fabric.set_lane(qp, lane);
    }

    /// Sends `message` to the policy of host `to`, which gets it `delay` later in
    /// [`Policy::on_message`] ([`MESSAGE_DELAY`] unless a scenario says otherwise).
    pub fn send(&mut self, to: HostId, message: PolicyMessage, delay: Picos) {
        let slot = self.mailbox.put(self.host, message);
        let at = self.queue.now().saturating_add(delay);
        self.queue
            .schedule(at, Event::PolicyMessage { host: to, slot });
    }
}

/// A policy by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicySpec {
    /// No isolation.
    #[default]
    Native,
    /// Justitia (NSDI'22).
    Justitia,
    /// PeRF's preemption (ATC'24): sub-messages and zero-length yields, not paced.
    Preempt,
    /// The core's adaptive law: bandwidth flows paced as one chunk stream under the
    /// transmitter's drain rate, chunks sized from the latency flows' tail.
    Adaptive,
    /// Hardware strict priority: latency and throughput flows on higher lanes.
    Priority,
}

impl PolicySpec {
    /// The name as written in scenarios.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicySpec::Native => "native",
            PolicySpec::Justitia => "justitia",
            PolicySpec::Preempt => "preempt",
            PolicySpec::Adaptive => "adaptive",
            PolicySpec::Priority => "priority",
        }
    }
    /// Builds one host's instance from the run's parameters; each policy checks its own
    /// and says what it refuses. Adding a policy is a module, a variant here and its arm.
    pub fn build(
        self,
        profile: &ModelProfile,
        justitia: &justitia::JustitiaParams,
        preempt: &preempt::PreemptParams,
    ) -> Result<Box<dyn Policy>, PolicyBuildError> {
        Ok(match self {
            PolicySpec::Native => Box::new(native::NativePolicy),
            PolicySpec::Justitia => Box::new(justitia::JustitiaPolicy::new(profile, justitia)?),
            PolicySpec::Preempt => Box::new(preempt::PreemptPolicy::new(preempt)?),
            PolicySpec::Adaptive => {
                Box::new(adaptive::AdaptivePolicy::new(profile, justitia, preempt)?)
            }
            PolicySpec::Priority => Box::new(priority::PriorityPolicy),
        })
    }
}

/// Why a host's policy could not be built for a run.
#[derive(Debug, thiserror::Error)]
pub enum PolicyBuildError {
    /// The `justitia` policy refused its parameters.
    #[error("justitia policy: {0}")]
    Justitia(#[from] justitia::JustitiaError),
    /// The `preempt` policy refused its parameters.
    #[error("preempt policy: {0}")]
    Preempt(#[from] justitia_core::yield_plan::YieldConfigError),
    /// The `adaptive` policy refused its parameters.
    #[error("adaptive policy: {0}")]
    Adaptive(#[from] adaptive::AdaptiveError),
}

/// Figures a policy reports about itself at the end of a run (e.g. the SafeUtil it
/// settled on), by name.
pub type PolicyFigures = BTreeMap<String, f64>;

/// A host's isolation policy.
pub trait Policy {
    /// The policy's name, as written in scenarios.
    fn name(&self) -> &str;

    /// Called once before the first event, with the flows that post from this host.
    fn on_start(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        let _ = (ctx, flows);
    }

    /// A flow of this host started (`true`) or stopped sending (`false`).
    fn on_flow_active(&mut self, ctx: &mut PolicyContext<'_>, flow: &FlowInfo, active: bool) {
        let _ = (ctx, flow, active);
    }

    /// An application posted `wr` on `qp`.
    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest);

    /// An application of this host issued a control verb: hand it to the RNIC
    /// ([`PolicyContext::control`], at once by default) or later
    /// ([`PolicyContext::control_at`]). Its completion goes to the application directly:
    /// it moves no data for the policy to see.
    fn on_control(&mut self, ctx: &mut PolicyContext<'_>, call: ControlCall) {
        ctx.control(call);
    }

    /// A request this policy handed to the RNIC on `qp` completed.
    fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        ctx.complete(qp, tag);
    }

    /// The RNIC delivered a message of `bytes` on the application queue pair `qp` of this
    /// host: how many bytes the application is told of, `None` to tell it nothing (a
    /// split message's receives before its last).
    fn on_delivery(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, bytes: u32) -> Option<u32> {
        let _ = (ctx, qp);
        Some(bytes)
    }

    /// A timer set with [`PolicyContext::set_timer`] fired.
    fn on_timer(&mut self, ctx: &mut PolicyContext<'_>, tag: u64) {
        let _ = (ctx, tag);
    }

    /// A message sent with [`PolicyContext::send`] by the policy of host `from` arrived.
    fn on_message(&mut self, ctx: &mut PolicyContext<'_>, from: HostId, message: PolicyMessage) {
        let _ = (ctx, from, message);
    }

    /// The state of the policy's control loop now, for time series; `None` for a policy
    /// without one, or whose host has no resource-hungry flow to steer. A policy answers
    /// `Some` from [`Policy::on_start`] on or never.
    fn control_state(&self) -> Option<ControlState> {
        None
    }

    /// Figures worth reporting at the end of the run.
    fn figures(&self) -> PolicyFigures {
        PolicyFigures::new()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Each policy answers to the name scenarios give it: the spec's name, what serde reads
    /// and what the built policy reports are one string.
    #[test]
    fn each_policy_is_named_as_scenarios_name_it() {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let (justitia, preempt) = (
            justitia::JustitiaParams::default(),
            preempt::PreemptParams::default(),
        );
        for (spec, name) in [
            (PolicySpec::Native, "native"),
            (PolicySpec::Justitia, "justitia"),
            (PolicySpec::Preempt, "preempt"),
            (PolicySpec::Adaptive, "adaptive"),
            (PolicySpec::Priority, "priority"),
        ] {
            assert_eq!(spec.as_str(), name);
            let read: PolicySpec = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(read, spec);
            let built = spec.build(&profile, &justitia, &preempt).unwrap();
            assert_eq!(built.name(), name);
        }
    }
}
