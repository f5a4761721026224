//! `adaptive`: Justitia's latency controller steering PeRF's yields, with pacing as the
//! last resort.
//!
//! The sensing half is Justitia's, and is the core's per-host loop
//! ([`justitia_core::control_loop::ControlLoop`], driven as `justitia` drives it): the
//! reference flow, Current99, SafeUtil (halved on a violation, never below the sharing
//! floor (B+T)/(L+B+T) x MaxRate, raised by the loop's increase law otherwise), the counts
//! and the mode. Unlike `justitia`, a flow counts as active from its start to its end (the
//! yield shaper does not report work), and the loop's per-flow allotments are not used.
//! The acting half is PeRF's: bandwidth flows are cut into sub-messages with zero-length
//! yields between them ([`YieldShaper`]). SafeUtil is read not as a rate to enforce but as
//! how hard the latency flows need protecting.
//!
//! Control law, the policy's own (the core has no yield law), applied after every update of
//! the loop,
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

use justitia_core::controller::ControlMode;

use super::justitia::{JustitiaError, JustitiaParams, LoopDriver};
use super::preempt::PreemptParams;
use super::yielding::{YieldShaper, PACING_TIMER};
use super::{FlowInfo, Policy, PolicyContext, PolicyFigures};
use crate::model_profile::ModelProfile;
use crate::rnic::{QpId, WorkRequest};
use crate::series::ControlState;
use justitia_core::yield_plan::{YieldConfigError, YieldPlanner};

/// Ymax / Y0: the most the law raises the yield density above PeRF's before pacing.
pub const MAX_YIELD_FACTOR: u32 = 2;

/// Why the `adaptive` policy could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AdaptiveError {
    /// The control loop refused its settings.
    #[error(transparent)]
    Justitia(#[from] JustitiaError),
    /// The yield settings are out of range.
    #[error(transparent)]
    Yield(#[from] YieldConfigError),
}

/// The `adaptive` policy on one host.
pub struct AdaptivePolicy {
    driver: LoopDriver,
    planner: YieldPlanner,
    base_yields: u32,
    window: u32,
    shaper: Option<YieldShaper>,
    steers: bool,
    yield_sum: f64,
    paced_updates: u64,
    updates: u64,
}

impl AdaptivePolicy {
    /// A policy for a host with this RNIC: the core loop from `justitia`'s parameters, the
    /// yield baseline from `preempt`.
    pub fn new(
        profile: &ModelProfile,
        justitia: &JustitiaParams,
        preempt: &PreemptParams,
    ) -> Result<Self, AdaptiveError> {
        let driver = LoopDriver::new(&profile.policy, justitia)
            .map_err(|e| AdaptiveError::Justitia(e.into()))?;
        let planner = YieldPlanner::new(preempt.yield_config()?)?;
        Ok(AdaptivePolicy {
            driver,
            base_yields: planner.yields_per_sub_message(),
            planner,
            window: preempt.window,
            shaper: None,
            steers: false,
            yield_sum: 0.0,
            paced_updates: 0,
            updates: 0,
        })
    }

    fn max_yields(&self) -> u32 {
        self.base_yields.saturating_mul(MAX_YIELD_FACTOR)
    }

    /// Step 2 of the law: the yield density for the loop's SafeUtil.
    fn yields_for_safe_util(&self) -> u32 {
        let control = &self.driver.control;
        let max = control.max_rate();
        let floor = control.sharing_floor();
        let span = (max / floor).ln();
        let q = if span > 0.0 {
            ((max / control.safe_util()).ln() / span).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let y = f64::from(self.base_yields) * f64::from(MAX_YIELD_FACTOR).powf(q);
        (y.round() as u32).clamp(self.base_yields, self.max_yields())
    }

    /// Applies the law after a loop update; `violated` is whether Current99 exceeds
    /// Target99.
    fn steer(&mut self, ctx: &mut PolicyContext<'_>, violated: bool) {
        let control = &self.driver.control;
        let counts = control.counts();
        let unattainable = matches!(control.mode(), ControlMode::Unattainable { .. });
        let yields = if counts.latency == 0 && counts.throughput == 0 {
            0
        } else if counts.latency == 0 || unattainable {
            self.base_yields
        } else {
            self.yields_for_safe_util()
        };
        let max_yields = self.max_yields();
        let base_yields = self.base_yields;
        let safe_util = control.safe_util();
        let Some(shaper) = &mut self.shaper else {
            return;
        };
        let pacing = if counts.latency == 0 || unattainable {
            None
        } else if violated
            && (shaper.yields_per_sub_message() >= max_yields || shaper.pacing().is_some())
        {
            Some(safe_util)
        } else {
            None
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

    fn drive(&mut self, ctx: &mut PolicyContext<'_>) {
        let before = self.driver.control.updates();
        self.driver.drive(ctx);
        if self.driver.control.updates() == before {
            return;
        }
        let control = &self.driver.control;
        let violated = control.counts().latency > 0
            && matches!(
                (control.current_p99(), control.target().value),
                (Some(p99), Some(target)) if p99 > target
            );
        self.steer(ctx, violated);
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
        let mut planner = self.planner;
        planner.set_yields_per_sub_message(0);
        self.shaper = Some(YieldShaper::new(planner, self.window, flows));
        self.steers = flows.iter().any(|f| f.spec.class.is_resource_hungry());
        self.driver.connect(ctx, flows);
        self.drive(ctx);
    }

    fn on_flow_active(&mut self, ctx: &mut PolicyContext<'_>, flow: &FlowInfo, active: bool) {
        // The yield shaper does not report work, so a flow counts while it runs.
        self.driver.flow_present(ctx, flow, active);
        if active {
            let _ = self.driver.control.set_flow_active(
                super::justitia::core_time(ctx.now()),
                flow.spec.id,
                true,
            );
        }
    }

    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        match &mut self.shaper {
            Some(shaper) => shaper.on_post(ctx, qp, wr),
            None => ctx.post(qp, wr),
        }
    }

    fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        if self.driver.on_completion(ctx, qp) {
            return;
        }
        match &mut self.shaper {
            Some(shaper) => shaper.on_completion(ctx, qp, tag),
            None => ctx.complete(qp, tag),
        }
    }

    fn on_timer(&mut self, ctx: &mut PolicyContext<'_>, tag: u64) {
        if tag >= PACING_TIMER {
            if let Some(shaper) = &mut self.shaper {
                shaper.on_pacing_timer(ctx, (tag - PACING_TIMER) as usize);
            }
        } else if self.driver.timer_is_current(ctx) {
            self.drive(ctx);
        }
    }

    fn control_state(&self) -> Option<ControlState> {
        self.steers.then(|| self.driver.control_state())
    }

    fn figures(&self) -> PolicyFigures {
        let mut f = self.driver.figures();
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
