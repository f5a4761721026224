//! `adaptive`: Justitia's latency controller steering PeRF's yields, with pacing as the
//! last resort.
//!
//! The sensing half is Justitia's: the reference flow ([`ReferenceProbe`], §4.2.1) and the
//! core's [`SafeUtilController`] (Pseudocode 1: halve SafeUtil when Current99 exceeds
//! Target99, never below the sharing floor (B+T)/(L+B+T) x MaxRate, add a step otherwise).
//! The acting half is PeRF's: bandwidth flows are cut into sub-messages with zero-length
//! yields between them ([`YieldShaper`]). SafeUtil is read not as a rate to enforce but as
//! how hard the latency flows need protecting.
//!
//! Control law, applied on every RefPeriod update and whenever a flow starts or stops,
//! with Y0 the baseline yield count (PeRF's ceil(SUB_MSG_SIZE / 0_WAIT_UNIT), 16) and
//! Ymax = [`MAX_YIELD_FACTOR`] x Y0:
//!
//! 1. No active latency flow: never paced. With no throughput flow either, no yields
//!    (sub-messages back to back; the bandwidth flows take the whole RNIC). With a
//!    throughput flow, PeRF's Y0: the controller has nothing to defend, but without yields
//!    the throughput flow's message rate collapses (PeRF §2.3.1), and yields cost the
//!    bandwidth flow no pacing gap.
//! 2. Otherwise the yield density follows SafeUtil geometrically between MaxRate and the
//!    floor: y = Y0 x (Ymax / Y0)^q with q = ln(MaxRate / SafeUtil) / ln(MaxRate / floor),
//!    so y = Y0 while the target holds at full rate and y = Ymax once the controller has
//!    pushed SafeUtil down to the floor. Yields cost the bandwidth flow only header-only
//!    packets and processing slots, and they leave the arbiter to whoever has work, so this
//!    stage stays work-conserving.
//! 3. Pacing starts only when an update finds Target99 violated while the yields were
//!    already at Ymax (yields alone cannot meet the target): the bandwidth flows are then
//!    paced at SafeUtil in total, as `justitia` would pace them. It stops at the first update
//!    that finds Current99 at or below Target99.
//!
//! The controller's unattainable-target mode (§4.5) resets SafeUtil to MaxRate, which here
//! means baseline yields and no pacing.

use std::time::Duration;

use justitia_core::controller::{ControlMode, SafeUtilController};
use justitia_core::flow::FlowClass;
use justitia_core::profile::RnicProfile;
use justitia_core::yield_plan::{YieldConfigError, YieldPlanner};

use super::justitia::{JustitiaError, JustitiaParams};
use super::preempt::PreemptParams;
use super::reference::{active_counts, ReferenceProbe};
use super::yielding::{YieldShaper, PACING_TIMER};
use super::{FlowInfo, Policy, PolicyContext, PolicyFigures};
use crate::model_profile::ModelProfile;
use crate::rnic::{QpId, WorkRequest};
use crate::series::{ControlState, Mode};
use crate::time::{self, Picos};

/// Ymax / Y0: the most the law raises the yield density above PeRF's before pacing.
pub const MAX_YIELD_FACTOR: u32 = 2;

/// Why the `adaptive` policy could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AdaptiveError {
    /// The controller or estimator refused their settings.
    #[error(transparent)]
    Justitia(#[from] JustitiaError),
    /// The yield settings are out of range.
    #[error(transparent)]
    Yield(#[from] YieldConfigError),
}

const REFERENCE_TICK: u64 = 0;

/// The `adaptive` policy on one host.
pub struct AdaptivePolicy {
    profile: RnicProfile,
    params: JustitiaParams,
    ref_period: Picos,
    planner: YieldPlanner,
    base_yields: u32,
    window: u32,
    flows: Vec<(FlowInfo, bool)>,
    controller: SafeUtilController,
    probe: ReferenceProbe,
    shaper: Option<YieldShaper>,
    latency_present: bool,
    yield_sum: f64,
    paced_updates: u64,
    updates: u64,
}

impl AdaptivePolicy {
    /// A policy for a host with this RNIC: controller and probe from `justitia`, the yield
    /// baseline from `preempt`.
    pub fn new(
        profile: &ModelProfile,
        justitia: &JustitiaParams,
        preempt: &PreemptParams,
    ) -> Result<Self, AdaptiveError> {
        let policy_profile = profile.policy.clone();
        let config = justitia.controller_config(policy_profile.chunk_bytes(true));
        let controller = SafeUtilController::new(config, &policy_profile)
            .map_err(|e| AdaptiveError::Justitia(e.into()))?;
        let probe = justitia
            .reference_probe()
            .map_err(|e| AdaptiveError::Justitia(e.into()))?;
        let planner = YieldPlanner::new(preempt.yield_config()?)?;
        Ok(AdaptivePolicy {
            profile: policy_profile,
            params: justitia.clone(),
            ref_period: time::from_us(justitia.ref_period_us),
            base_yields: planner.yields_per_sub_message(),
            planner,
            window: preempt.window,
            flows: Vec::new(),
            controller,
            probe,
            shaper: None,
            latency_present: false,
            yield_sum: 0.0,
            paced_updates: 0,
            updates: 0,
        })
    }

    fn max_yields(&self) -> u32 {
        self.base_yields.saturating_mul(MAX_YIELD_FACTOR)
    }

    /// Step 2 of the law: the yield density for the controller's SafeUtil.
    fn yields_for_safe_util(&self) -> u32 {
        let counts = active_counts(self.flows.iter().filter(|f| f.1).map(|f| &f.0.spec));
        let max = self.controller.max_rate();
        let floor = self.controller.sharing_floor(counts);
        let span = (max / floor).ln();
        let q = if span > 0.0 {
            ((max / self.controller.safe_util()).ln() / span).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let y = f64::from(self.base_yields) * f64::from(MAX_YIELD_FACTOR).powf(q);
        (y.round() as u32).clamp(self.base_yields, self.max_yields())
    }

    /// Applies the law; `violated` is Some(whether Current99 exceeds Target99) after a
    /// controller update, None after a change of flows.
    fn steer(&mut self, ctx: &mut PolicyContext<'_>, violated: Option<bool>) {
        let counts = active_counts(self.flows.iter().filter(|f| f.1).map(|f| &f.0.spec));
        let unattainable = matches!(self.controller.mode(), ControlMode::Unattainable { .. });
        let yields = if counts.latency == 0 && counts.throughput == 0 {
            0
        } else if counts.latency == 0 || unattainable {
            self.base_yields
        } else {
            self.yields_for_safe_util()
        };
        let max_yields = self.max_yields();
        let base_yields = self.base_yields;
        let safe_util = self.controller.safe_util();
        let Some(shaper) = &mut self.shaper else {
            return;
        };
        let pacing = if counts.latency == 0 || unattainable {
            None
        } else {
            match violated {
                Some(true) if shaper.yields_per_sub_message() >= max_yields => Some(safe_util),
                Some(true) if shaper.pacing().is_some() => Some(safe_util),
                Some(_) => None,
                None => shaper.pacing().map(|_| safe_util),
            }
        };
        // Once paced, the pacer keeps the transmit pipeline short; extra yields would only
        // cost processing slots on top of it.
        let yields = if pacing.is_some() {
            yields.min(base_yields)
        } else {
            yields
        };
        shaper.planner_mut().set_yields_per_sub_message(yields);
        shaper.set_pacing(ctx, pacing);
    }

    fn on_reference_tick(&mut self, ctx: &mut PolicyContext<'_>) {
        let now = ctx.now();
        ctx.set_timer(now + self.ref_period, REFERENCE_TICK);
        let counts = active_counts(self.flows.iter().filter(|f| f.1).map(|f| &f.0.spec));
        if counts.latency > 0 {
            self.probe.send(ctx);
        }
        let current99 = self.probe.current99();
        self.controller
            .update(Duration::from_nanos(now / 1_000), counts, current99);
        let target = Duration::from_nanos(time::from_us(self.params.target99_us) / 1_000);
        let violated = counts.latency > 0 && current99.is_some_and(|p99| p99 > target);
        self.steer(ctx, Some(violated));
        if let Some(shaper) = &self.shaper {
            self.yield_sum += f64::from(shaper.yields_per_sub_message());
            if shaper.pacing().is_some() {
                self.paced_updates += 1;
            }
        }
        self.updates += 1;
    }
}

impl Policy for AdaptivePolicy {
    fn name(&self) -> &str {
        "adaptive"
    }

    fn on_start(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        self.flows = flows.iter().map(|f| (f.clone(), false)).collect();
        let mut planner = self.planner;
        planner.set_yields_per_sub_message(0);
        self.shaper = Some(YieldShaper::new(planner, self.window, flows));
        self.probe.connect(ctx, flows);
        ctx.set_timer(ctx.now() + self.ref_period, REFERENCE_TICK);
    }

    fn on_flow_active(&mut self, ctx: &mut PolicyContext<'_>, flow: &FlowInfo, active: bool) {
        if let Some(f) = self.flows.iter_mut().find(|f| f.0.spec.id == flow.spec.id) {
            f.1 = active;
        }
        let present = self
            .flows
            .iter()
            .any(|(f, active)| *active && f.spec.class == FlowClass::Latency);
        if present != self.latency_present {
            // What the probe measured belonged to another mix of flows.
            self.latency_present = present;
            self.probe.clear();
            if let Ok(controller) =
                SafeUtilController::new(*self.controller.config(), &self.profile)
            {
                self.controller = controller;
            }
        }
        self.steer(ctx, None);
    }

    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        match &mut self.shaper {
            Some(shaper) => shaper.on_post(ctx, qp, wr),
            None => ctx.post(qp, wr),
        }
    }

    fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        if self.probe.on_completion(ctx, qp) {
            return;
        }
        match &mut self.shaper {
            Some(shaper) => shaper.on_completion(ctx, qp, tag),
            None => ctx.complete(qp, tag),
        }
    }

    fn on_timer(&mut self, ctx: &mut PolicyContext<'_>, tag: u64) {
        if tag == REFERENCE_TICK {
            self.on_reference_tick(ctx);
        } else if tag >= PACING_TIMER {
            if let Some(shaper) = &mut self.shaper {
                shaper.on_pacing_timer(ctx, (tag - PACING_TIMER) as usize);
            }
        }
    }

    fn control_state(&self) -> Option<ControlState> {
        let steers = self
            .flows
            .iter()
            .any(|(f, _)| f.spec.class.is_resource_hungry());
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
        if let Some(p99) = self.probe.current99() {
            f.insert("current99_us".into(), p99.as_secs_f64() * 1e6);
        }
        if let Some(shaper) = &self.shaper {
            f.insert(
                "yields_per_sub_message".into(),
                f64::from(shaper.yields_per_sub_message()),
            );
            let c = shaper.counters();
            f.insert("sub_messages".into(), c.sub_messages as f64);
            f.insert("yields".into(), c.yields as f64);
        }
        if self.updates > 0 {
            f.insert(
                "mean_yields_per_sub_message".into(),
                self.yield_sum / self.updates as f64,
            );
            f.insert(
                "paced_fraction".into(),
                self.paced_updates as f64 / self.updates as f64,
            );
        }
        f
    }
}
