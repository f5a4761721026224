//! `justitia`: Justitia (NSDI'22) as its paper describes it, built on the policy core.
//!
//! One instance per host plays the daemon and the shapers of that host's flows:
//!
//! - **Reference flow** (§4.2.1): while a latency-sensitive flow of this host is active, the
//!   [`ReferenceProbe`] sends a `ref_size` message to the peer every `ref_period`; its
//!   post-to-completion times give Current99 over the last RefCount samples.
//! - **SafeUtil** (§4.2.2, Pseudocode 1): every RefPeriod the core's
//!   [`SafeUtilController`] is updated with the active L, B, T (flows of one tenant count
//!   once) and Current99.
//! - **Tokens** (§4.2.3): the core's [`TokenStream`] issues one token every
//!   tau = TokenBytes / SafeUtil, round-robin over the active resource-hungry flows (from
//!   their start to their end, as the paper's daemon tracks them by join and exit).
//!   TokenBytes is the chunk size of §5.1: the profile's chunk with latency flows present
//!   (5 KB), the one without otherwise (1 MB); the controller and stream are rebuilt, and
//!   the unsent rest of every message re-cut, when latency flows appear or all leave.
//! - **Shapers** (§4.3): latency flows pass untouched. A bandwidth flow's messages are split
//!   by the core's [`ChunkPlan`] into TokenBytes chunks, sent as tokens arrive (a token's
//!   bytes may be overdrawn by the last chunk and are repaid by the next); the application
//!   hears of a message only when its last chunk completes. A throughput flow posts at most
//!   TokenOps requests per token.
//!
//! Not modelled: the remote-READ guarantee of §4.4 (a READ flow is shaped by its
//! requester like a local bandwidth flow) and the flow-control messages of split SENDs
//! (the peer is assumed to cooperate).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use justitia_core::allotment::TokenStream;
use justitia_core::chunk::{self, ChunkLimits, ChunkPlan, RemoteAddr, SendFlags, Sge, SgeList};
use justitia_core::controller::{
    ControlMode, ControllerConfig, ControllerError, SafeUtilController,
};
use justitia_core::estimator::EstimatorError;
use justitia_core::flow::{FlowClass, FlowCounts, FlowSpec};
use justitia_core::profile::RnicProfile;
use serde::{Deserialize, Serialize};

use super::reference::{active_counts, ReferenceProbe};
use super::{FlowInfo, Policy, PolicyContext, PolicyFigures};
use crate::model_profile::ModelProfile;
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::series::{ControlState, Mode};
use crate::time::{self, Picos};
use crate::units::ByteSize;

/// Parameters of the `justitia` policy; the defaults are the paper's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JustitiaParams {
    /// Target99: the tail latency the controller defends, in us (§6: 2 us).
    #[serde(default = "default_target99_us")]
    pub target99_us: f64,
    /// RefPeriod: time between two reference messages and controller updates, in us
    /// (§4.2.1: 500 us).
    #[serde(default = "default_ref_period_us")]
    pub ref_period_us: f64,
    /// Size of a reference message (§4.2.1: 10 B).
    #[serde(default = "default_ref_size")]
    pub ref_size: ByteSize,
    /// RefCount: samples in the estimator's sliding window (§4.2.1: 10000).
    #[serde(default = "default_ref_window")]
    pub ref_window: u32,
    /// delta: after Current99 has stayed above Target99 this long, share the RNIC among
    /// resource-hungry flows only (§4.5, §6.5.2: 5 s), in ms; 0 turns the option off.
    #[serde(default = "default_unattainable_after_ms")]
    pub unattainable_after_ms: f64,
}

fn default_target99_us() -> f64 {
    2.0
}

fn default_ref_period_us() -> f64 {
    500.0
}

fn default_ref_size() -> ByteSize {
    ByteSize(10)
}

fn default_ref_window() -> u32 {
    10_000
}

fn default_unattainable_after_ms() -> f64 {
    5_000.0
}

impl Default for JustitiaParams {
    fn default() -> Self {
        JustitiaParams {
            target99_us: default_target99_us(),
            ref_period_us: default_ref_period_us(),
            ref_size: default_ref_size(),
            ref_window: default_ref_window(),
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
        positive("target99_us", self.target99_us)?;
        positive("ref_period_us", self.ref_period_us)?;
        if self.ref_window == 0 {
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

    pub(crate) fn controller_config(&self, token_bytes: u32) -> ControllerConfig {
        ControllerConfig {
            target_p99: Duration::from_nanos(time::from_us(self.target99_us) / 1_000),
            ref_period: Duration::from_nanos(time::from_us(self.ref_period_us) / 1_000),
            token_bytes: u64::from(token_bytes),
            unattainable_after: (self.unattainable_after_ms > 0.0)
                .then(|| Duration::from_nanos(time::from_ms(self.unattainable_after_ms) / 1_000)),
            ..ControllerConfig::default()
        }
    }

    /// The reference flow these parameters describe.
    pub(crate) fn reference_probe(&self) -> Result<ReferenceProbe, EstimatorError> {
        let size = u32::try_from(self.ref_size.bytes()).unwrap_or(u32::MAX);
        ReferenceProbe::new(size, self.ref_window)
    }
}

/// Why the policy could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum JustitiaError {
    /// The controller refused its settings.
    #[error("SafeUtil controller: {0}")]
    Controller(#[from] ControllerError),
    /// The estimator refused its settings.
    #[error("tail estimator: {0}")]
    Estimator(#[from] EstimatorError),
}

/// Timer tags: the reference tick, and token ticks numbered by generation so that a
/// rescheduled tick makes the old one stale.
const REFERENCE_TICK: u64 = 0;
const TOKEN_TICK: u64 = 1 << 63;

/// A message an application posted that has not been fully handed to the RNIC.
struct Pending {
    qp: QpId,
    app_tag: u64,
    opcode: Opcode,
    inline: bool,
    plan: ChunkPlan,
}

struct ShapedFlow {
    info: FlowInfo,
    active: bool,
    pending: VecDeque<Pending>,
    /// Bytes (bandwidth) or operations (throughput) the flow may still send on its latest
    /// token; negative after a chunk overdrew it.
    credit: i64,
}

/// A request handed to the RNIC: whose it is and whether it ends an application message.
#[derive(Clone, Copy)]
struct InFlight {
    app_tag: u64,
    last: bool,
}

/// Justitia's daemon and shapers on one host.
pub struct JustitiaPolicy {
    profile: RnicProfile,
    params: JustitiaParams,
    ref_period: Picos,
    flows: Vec<ShapedFlow>,
    by_qp: BTreeMap<QpId, usize>,
    /// The active resource-hungry flows, recomputed when a flow starts or stops.
    active_hungry: Vec<FlowSpec>,
    controller: SafeUtilController,
    /// The controller's tau, kept from its last update (it is asked for every token).
    tau: Duration,
    probe: ReferenceProbe,
    stream: TokenStream,
    token_bytes: u32,
    latency_present: bool,
    /// Requests handed to the RNIC, by tag: entry `i` is tag `first_tag + i`. Tags are
    /// handed out in order and mostly complete in order, so this stays short.
    in_flight: VecDeque<Option<InFlight>>,
    first_tag: u64,
    token_generation: u64,
    token_due: Option<Picos>,
    tokens_issued: u64,
    safe_util_sum: f64,
    updates: u64,
}

fn duration(t: Picos) -> Duration {
    Duration::from_nanos(t / 1_000)
}

impl JustitiaPolicy {
    /// A policy for a host with this RNIC.
    pub fn new(profile: &ModelProfile, params: &JustitiaParams) -> Result<Self, JustitiaError> {
        let policy_profile = profile.policy.clone();
        let token_bytes = policy_profile.chunk_bytes(false);
        let controller =
            SafeUtilController::new(params.controller_config(token_bytes), &policy_profile)?;
        let probe = params.reference_probe()?;
        let stream = TokenStream::new(controller.token(), Duration::ZERO);
        Ok(JustitiaPolicy {
            profile: policy_profile,
            params: params.clone(),
            ref_period: time::from_us(params.ref_period_us),
            flows: Vec::new(),
            by_qp: BTreeMap::new(),
            active_hungry: Vec::new(),
            tau: controller.tau(),
            controller,
            probe,
            stream,
            token_bytes,
            latency_present: false,
            in_flight: VecDeque::new(),
            first_tag: 1,
            token_generation: 0,
            token_due: None,
            tokens_issued: 0,
            safe_util_sum: 0.0,
            updates: 0,
        })
    }

    /// L, B, T of the active flows, a tenant's flows of one class counting once.
    fn counts(&self) -> FlowCounts {
        active_counts(self.flows.iter().filter(|f| f.active).map(|f| &f.info.spec))
    }

    /// Rebuilds controller and token stream when latency flows appear or all leave: the
    /// token (and chunk) size follows their presence (§5.1).
    fn follow_latency_presence(&mut self, ctx: &PolicyContext<'_>) {
        let present = self.counts().latency > 0;
        if present == self.latency_present {
            return;
        }
        self.latency_present = present;
        self.token_bytes = self.profile.chunk_bytes(present);
        let config = self.params.controller_config(self.token_bytes);
        if let Ok(controller) = SafeUtilController::new(config, &self.profile) {
            self.controller = controller;
            self.tau = self.controller.tau();
        }
        self.stream = TokenStream::new(self.controller.token(), duration(ctx.now()));
        self.probe.clear();
        // What bandwidth flows have not sent yet is cut to the new chunk size.
        let limits = self.bandwidth_limits();
        for flow in &mut self.flows {
            if flow.info.spec.class != FlowClass::Bandwidth {
                continue;
            }
            for pending in &mut flow.pending {
                let rest = WorkRequest {
                    tag: pending.app_tag,
                    opcode: pending.opcode,
                    bytes: pending.plan.remaining_bytes(),
                    inline: pending.inline,
                };
                if rest.bytes > 0 {
                    if let Ok(plan) = ChunkPlan::new(core_request(&rest), limits) {
                        pending.plan = plan;
                    }
                }
            }
        }
    }

    /// How bandwidth flows' messages are cut: TokenBytes chunks, SENDs included (the peer
    /// is assumed to cooperate, see the module documentation).
    fn bandwidth_limits(&self) -> ChunkLimits {
        ChunkLimits {
            chunk_bytes: self.token_bytes,
            max_sge: 1,
            split_two_sided: true,
        }
    }

    /// Recomputes the active resource-hungry flows: those that have joined (started) and
    /// not left, whether or not they have a chunk waiting at this instant, as the daemon of
    /// the paper tracks flows from their first message to their end. A token a flow cannot
    /// use at once waits for its next message.
    fn update_active_hungry(&mut self) {
        self.active_hungry = self
            .flows
            .iter()
            .filter(|f| f.info.spec.class.is_resource_hungry() && f.active)
            .map(|f| f.info.spec)
            .collect();
    }

    /// Makes sure a token tick is scheduled for when the stream's next token falls due.
    fn schedule_token(&mut self, ctx: &mut PolicyContext<'_>) {
        if self.active_hungry.is_empty() {
            self.token_due = None;
            return;
        }
        let due_ns = self.stream.next_token_due(self.tau);
        let due = u64::try_from(due_ns.as_nanos())
            .unwrap_or(u64::MAX / 1_000)
            .saturating_mul(1_000)
            .max(ctx.now());
        if self.token_due == Some(due) {
            return;
        }
        self.token_generation += 1;
        self.token_due = Some(due);
        ctx.set_timer(due, TOKEN_TICK | self.token_generation);
    }

    fn on_token_tick(&mut self, ctx: &mut PolicyContext<'_>) {
        self.token_due = None;
        let grant = self
            .stream
            .issue(duration(ctx.now()), self.tau, &self.active_hungry);
        if let Some(grant) = grant {
            self.tokens_issued += 1;
            if let Some(index) = self.flows.iter().position(|f| f.info.spec.id == grant.flow) {
                let flow = &mut self.flows[index];
                let amount = match flow.info.spec.class {
                    FlowClass::Throughput => grant.ops,
                    _ => grant.bytes,
                };
                // A token tops the flow up to its worth: an overdraft is repaid, but what
                // an earlier token left unused is not hoarded (tokens do not accumulate).
                flow.credit = flow
                    .credit
                    .min(0)
                    .saturating_add(i64::try_from(amount).unwrap_or(i64::MAX));
                self.pump(ctx, index);
            }
        }
        self.schedule_token(ctx);
    }

    /// Sends what the flow's credit allows.
    fn pump(&mut self, ctx: &mut PolicyContext<'_>, index: usize) {
        let class = self.flows[index].info.spec.class;
        while self.flows[index].credit > 0 {
            let flow = &mut self.flows[index];
            let Some(head) = flow.pending.front_mut() else {
                break;
            };
            let Some(chunk) = head.plan.next() else {
                flow.pending.pop_front();
                continue;
            };
            let bytes = chunk.request.sges.total_bytes();
            let (qp, app_tag, opcode, inline) = (head.qp, head.app_tag, head.opcode, head.inline);
            if chunk.is_last {
                flow.pending.pop_front();
            }
            let cost = match class {
                FlowClass::Throughput => 1,
                _ => i64::try_from(bytes).unwrap_or(i64::MAX),
            };
            flow.credit -= cost;
            let tag = self.track(InFlight {
                app_tag,
                last: chunk.is_last,
            });
            ctx.post(
                qp,
                WorkRequest {
                    tag,
                    opcode,
                    bytes: u32::try_from(bytes).unwrap_or(u32::MAX),
                    inline,
                },
            );
        }
    }

    /// Hands a request to the RNIC as it is (under a tag of the policy's, like every
    /// request, so that tags never collide).
    fn pass_through(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        let tag = self.track(InFlight {
            app_tag: wr.tag,
            last: true,
        });
        ctx.post(qp, WorkRequest { tag, ..wr });
    }

    /// Records a request about to be handed to the RNIC; returns its tag.
    fn track(&mut self, request: InFlight) -> u64 {
        self.in_flight.push_back(Some(request));
        self.first_tag + self.in_flight.len() as u64 - 1
    }

    /// Forgets a completed request.
    fn untrack(&mut self, tag: u64) -> Option<InFlight> {
        let index = usize::try_from(tag.checked_sub(self.first_tag)?).ok()?;
        let request = self.in_flight.get_mut(index)?.take();
        while let Some(None) = self.in_flight.front() {
            self.in_flight.pop_front();
            self.first_tag += 1;
        }
        request
    }

    fn on_reference_tick(&mut self, ctx: &mut PolicyContext<'_>) {
        let now = ctx.now();
        ctx.set_timer(now + self.ref_period, REFERENCE_TICK);
        self.follow_latency_presence(ctx);
        let counts = self.counts();
        if counts.latency > 0 {
            self.probe.send(ctx);
        }
        self.controller
            .update(duration(now), counts, self.probe.current99());
        self.tau = self.controller.tau();
        self.safe_util_sum += self.controller.safe_util();
        self.updates += 1;
        self.schedule_token(ctx);
    }
}

/// A core work request standing for a simulated one: one SGE of the message's length at a
/// made-up address, which is all the chunk planner needs to cut it.
fn core_request(wr: &WorkRequest) -> chunk::WorkRequest {
    let mut sges = SgeList::new();
    if wr.bytes > 0 {
        // One SGE always fits an empty list.
        let _ = sges.push(Sge {
            addr: 0x1000,
            length: wr.bytes,
            lkey: 1,
        });
    }
    chunk::WorkRequest {
        wr_id: wr.tag,
        opcode: match wr.opcode {
            Opcode::Write => chunk::Opcode::Write,
            Opcode::Send => chunk::Opcode::Send,
            Opcode::Read => chunk::Opcode::Read,
        },
        sges,
        remote: Some(RemoteAddr {
            addr: 0x1_0000_0000,
            rkey: 1,
        }),
        flags: SendFlags {
            signaled: true,
            inline: wr.inline,
            ..SendFlags::default()
        },
    }
}

impl Policy for JustitiaPolicy {
    fn name(&self) -> &str {
        "justitia"
    }

    fn on_start(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        for info in flows {
            let index = self.flows.len();
            for &qp in &info.qps {
                self.by_qp.insert(qp, index);
            }
            self.flows.push(ShapedFlow {
                info: info.clone(),
                active: false,
                pending: VecDeque::new(),
                credit: 0,
            });
        }
        self.probe.connect(ctx, flows);
        let first = ctx.now() + self.ref_period;
        ctx.set_timer(first, REFERENCE_TICK);
    }

    fn on_flow_active(&mut self, ctx: &mut PolicyContext<'_>, flow: &FlowInfo, active: bool) {
        if let Some(f) = self
            .flows
            .iter_mut()
            .find(|f| f.info.spec.id == flow.spec.id)
        {
            f.active = active;
        }
        self.update_active_hungry();
        self.follow_latency_presence(ctx);
        self.schedule_token(ctx);
    }

    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        let Some(&index) = self.by_qp.get(&qp) else {
            self.pass_through(ctx, qp, wr);
            return;
        };
        let class = self.flows[index].info.spec.class;
        if class == FlowClass::Latency {
            self.pass_through(ctx, qp, wr);
            return;
        }
        let limits = match class {
            FlowClass::Bandwidth => self.bandwidth_limits(),
            _ => ChunkLimits {
                chunk_bytes: u32::MAX,
                ..self.bandwidth_limits()
            },
        };
        let Ok(plan) = ChunkPlan::new(core_request(&wr), limits) else {
            // A request the planner refuses is passed through unshaped, never dropped.
            self.pass_through(ctx, qp, wr);
            return;
        };
        self.flows[index].pending.push_back(Pending {
            qp,
            app_tag: wr.tag,
            opcode: wr.opcode,
            inline: wr.inline,
            plan,
        });
        self.pump(ctx, index);
    }

    fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        if self.probe.on_completion(ctx, qp) {
            return;
        }
        if let Some(InFlight {
            app_tag,
            last: true,
        }) = self.untrack(tag)
        {
            ctx.complete(qp, app_tag);
        }
    }

    fn on_timer(&mut self, ctx: &mut PolicyContext<'_>, tag: u64) {
        if tag == REFERENCE_TICK {
            self.on_reference_tick(ctx);
        } else if tag == TOKEN_TICK | self.token_generation && self.token_due.is_some() {
            self.on_token_tick(ctx);
        }
    }

    fn control_state(&self) -> Option<ControlState> {
        let steers = self
            .flows
            .iter()
            .any(|f| f.info.spec.class.is_resource_hungry());
        steers.then(|| ControlState {
            safe_util_gbps: self.controller.safe_util() * 8.0 / 1e9,
            current99_us: self.probe.current99().map(|p| p.as_secs_f64() * 1e6),
            target99_us: Some(self.params.target99_us),
            mode: match self.controller.mode() {
                ControlMode::Normal => Mode::Normal,
                ControlMode::Unattainable { .. } => Mode::Unattainable,
            },
        })
    }

    fn figures(&self) -> PolicyFigures {
        let mut f = PolicyFigures::new();
        let gbps = |bytes_per_sec: f64| bytes_per_sec * 8.0 / 1e9;
        f.insert("safe_util_gbps".into(), gbps(self.controller.safe_util()));
        if self.updates > 0 {
            f.insert(
                "mean_safe_util_gbps".into(),
                gbps(self.safe_util_sum / self.updates as f64),
            );
        }
        if let Some(p99) = self.probe.current99() {
            f.insert("current99_us".into(), p99.as_secs_f64() * 1e6);
        }
        f.insert("token_bytes".into(), f64::from(self.token_bytes));
        f.insert("tokens".into(), self.tokens_issued as f64);
        f
    }
}
