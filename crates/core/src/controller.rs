//! The SafeUtil controller: how much of the RNIC resource-hungry flows may use.
//!
//! Justitia caps the total rate of all bandwidth- and throughput-sensitive flows at SafeUtil
//! and moves that cap with an AIMD rule driven by Current99, the tail latency of its
//! reference flow (§4.2.2, Pseudocode 1). Once per RefPeriod the host calls
//! [`SafeUtilController::update`] with the flow counts L, B, T and Current99:
//!
//! - no latency-sensitive flow (L = 0): SafeUtil = MaxRate;
//! - Current99 > Target99: SafeUtil = max(SafeUtil / 2, (B+T)/(L+B+T) x MaxRate), the floor
//!   being the sharing incentive: n flows get at least 1/n of the RNIC between them (§4.1);
//! - otherwise: SafeUtil grows by the increase law ([`IncreaseLaw`]): the paper's fixed
//!   step ([`ControllerConfig::increase_step`]), or a search that returns quickly to the
//!   last rate that violated the target and settles just below it;
//! - and the token interval is tau = TokenBytes / SafeUtil (§4.2.3).
//!
//! Two companions from the paper live here too. *Soft admission control* (§4.1, §4.2.1):
//! asking to admit a latency-sensitive flow while Current99 exceeds Target99 returns a
//! warning carrying both figures ([`Admission::TargetAtRisk`]). *Unattainable-target mode*
//! (§4.5), an operator option that is on by default: once Current99 has been observed above
//! Target99 for delta ([`ControllerConfig::unattainable_after`], 5 s as in §6.5.2), latency
//! flows are ignored and SafeUtil = MaxRate is shared among the resource-hungry flows.
//! Delta counts observed time only: each violating update adds the time since the previous
//! one, at most [`OBSERVED_GAP_PERIODS`] RefPeriods (5 ms), so a caller that stalled for seconds between two updates
//! does not give the target up on what it never measured. The mode is left when the
//! latency flows are all gone (the next latency flow is judged afresh) or when L/(B+T)
//! grows beyond its value on entry; while it stays equal or shrinks (fewer latency flows
//! or more resource-hungry ones) the target is no more attainable than before.
//!
//! Invariants after every update: 0 < SafeUtil <= MaxRate; SafeUtil = MaxRate when L = 0
//! or in unattainable mode; otherwise SafeUtil >= the sharing floor of the current counts.
//! The pseudocode enforces the floor only when decreasing; here it is also kept when
//! increasing or holding, so a flow that arrives while SafeUtil is low gets its share at
//! the next update. When B+T = 0 the floor is computed as if one resource-hungry flow were
//! present: the guarantee a newcomer would get, and it keeps SafeUtil (and tau) finite.

use std::time::Duration;

use crate::allotment::Token;
use crate::flow::FlowCounts;
use crate::profile::RnicProfile;

/// How SafeUtil grows while Current99 meets Target99.
///
/// The paper's law adds a fixed step every RefPeriod: from a floor of one half it takes
/// 500 updates (0.25 s) to climb back, and it climbs past the rate that violated the target
/// again and again, one halving each time. [`IncreaseLaw::Search`] is BIC-like:
///
/// - each decrease remembers the rate that violated the target (the *ceiling*), unless
///   SafeUtil was already at the sharing floor (a violation there says nothing about rates);
/// - below a ceiling, SafeUtil moves half-way to it every update (binary search), and
///   once within `resolution` x MaxRate of it, holds ([`ControlAction::Settle`]): the rate
///   just below the last violation is the highest known to be safe;
/// - with no ceiling (none seen since latency flows appeared), SafeUtil moves half-way to
///   MaxRate every update and to MaxRate itself once within `resolution`: from the
///   one-half floor that is 95 % of MaxRate after 5 updates (2.5 ms at RefPeriod 0.5 ms);
/// - a ceiling older than `ceiling_lifetime` is probed beyond with an additive step that
///   starts at `resolution` x MaxRate and doubles every update, so a load that went away is
///   found again, at the price of one violating update per lifetime when it has not;
/// - a change in the number of latency flows (the plant changed) forgets the ceiling.
///
/// While the flows and the plant stay the same, the search crosses the threshold only a
/// bounded number of times (each crossing lowers the ceiling towards it), then settles
/// within `resolution` below it until the ceiling expires.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IncreaseLaw {
    /// Pseudocode 1: + [`ControllerConfig::increase_step`] x MaxRate every update. Kept for
    /// reproducing the paper's figures.
    Fixed,
    /// Binary search toward the last violating rate, settling below it (see above).
    Search {
        /// How close to the ceiling (as a fraction of MaxRate) the search settles, in
        /// (0, 1).
        resolution: f64,
        /// How long a ceiling is believed before the search probes beyond it.
        ceiling_lifetime: Duration,
    },
}

impl IncreaseLaw {
    /// The search law with a resolution of 1 % of MaxRate and ceilings believed for 1 s: a
    /// violating update at most once a second (2000 probes at RefPeriod 0.5 ms, 0.05 %,
    /// far inside the 1 % a p99 target allows).
    pub const SEARCH: IncreaseLaw = IncreaseLaw::Search {
        resolution: 0.01,
        ceiling_lifetime: Duration::from_secs(1),
    };
}

/// Operator settings of the controller. [`Default`] gives the paper's evaluation values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ControllerConfig {
    /// Target99: the tail latency latency-sensitive flows should see. Default 2 us, the
    /// target of the paper's evaluation (§6).
    pub target_p99: Duration,
    /// RefPeriod: how often the reference flow sends and [`SafeUtilController::update`] is
    /// expected to be called. Default 0.5 ms (§4.2.1).
    pub ref_period: Duration,
    /// TokenBytes: the bytes one multi-resource token is worth. Default 1 MB (10^6 bytes),
    /// the §4.2.3 example: 48 Gb/s and 30 M ops/s give 5000 ops per token and tau = 167 us.
    pub token_bytes: u64,
    /// Additive increase per update, as a fraction of MaxRate, in (0, 1]. The paper says
    /// "+1" without a unit; the default 0.001 (0.1% of MaxRate) recovers from a floor of
    /// f x MaxRate to MaxRate in ceil((1 - f) / 0.001) updates: 0.25 s from the one-half
    /// floor of one latency and one bandwidth flow at RefPeriod 0.5 ms, and at most 0.5 s
    /// from any floor. That is slow next to the halving (a few RefPeriods), as the paper
    /// intends: latency flows are hurt by overshoot, bandwidth flows only by slow recovery.
    pub increase_step: f64,
    /// How SafeUtil grows while the target is met. Default [`IncreaseLaw::Fixed`], the
    /// paper's.
    pub increase: IncreaseLaw,
    /// delta: how long Current99 must stay above Target99 before the target is deemed
    /// unattainable (§4.5). Default 5 s (§6.5.2); `None` turns the mode off.
    pub unattainable_after: Option<Duration>,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            target_p99: Duration::from_micros(2),
            ref_period: Duration::from_micros(500),
            token_bytes: 1_000_000,
            increase_step: 0.001,
            increase: IncreaseLaw::Fixed,
            unattainable_after: Some(Duration::from_secs(5)),
        }
    }
}

/// Why a controller could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ControllerError {
    /// A duration or size that must be positive was zero.
    #[error("controller setting `{0}` must be positive")]
    NotPositive(&'static str),
    /// The increase step is not a fraction in (0, 1].
    #[error("controller setting `increase_step` must be in (0, 1], got {0}")]
    IncreaseStep(f64),
    /// The search law's resolution is not a fraction in (0, 1).
    #[error("controller setting `increase.resolution` must be in (0, 1), got {0}")]
    SearchResolution(f64),
    /// The RNIC profile's MaxRate is not a positive, finite rate.
    #[error("RNIC profile `{profile}` has no usable MaxRate ({bytes_per_sec} bytes/s)")]
    MaxRate {
        /// The profile's name.
        profile: String,
        /// Its MaxRate in bytes/s.
        bytes_per_sec: f64,
    },
}

impl ControllerConfig {
    /// Checks every setting, naming the first one out of range.
    pub fn validate(&self) -> Result<(), ControllerError> {
        if self.target_p99.is_zero() {
            return Err(ControllerError::NotPositive("target_p99"));
        }
        if self.ref_period.is_zero() {
            return Err(ControllerError::NotPositive("ref_period"));
        }
        if self.token_bytes == 0 {
            return Err(ControllerError::NotPositive("token_bytes"));
        }
        if !(self.increase_step > 0.0 && self.increase_step <= 1.0) {
            return Err(ControllerError::IncreaseStep(self.increase_step));
        }
        if let IncreaseLaw::Search {
            resolution,
            ceiling_lifetime,
        } = self.increase
        {
            if !(resolution > 0.0 && resolution < 1.0) {
                return Err(ControllerError::SearchResolution(resolution));
            }
            if ceiling_lifetime.is_zero() {
                return Err(ControllerError::NotPositive("increase.ceiling_lifetime"));
            }
        }
        if self.unattainable_after.is_some_and(|d| d.is_zero()) {
            return Err(ControllerError::NotPositive("unattainable_after"));
        }
        Ok(())
    }
}

/// What one [`SafeUtilController::update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlAction {
    /// No latency-sensitive flow: SafeUtil reset to MaxRate.
    Reset,
    /// No Current99 yet (the reference window is empty): SafeUtil kept, raised to the
    /// sharing floor if the counts raised it.
    Hold,
    /// Current99 above Target99: SafeUtil halved, but not below the sharing floor.
    Decrease,
    /// Current99 at or below Target99: SafeUtil increased by the increase law, up to
    /// MaxRate.
    Increase,
    /// Current99 at or below Target99, and the search law holds SafeUtil just below the
    /// last rate that violated the target.
    Settle,
    /// In unattainable-target mode (entered now or earlier): SafeUtil = MaxRate.
    Unattainable,
}

/// Whether the controller is pursuing Target99.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlMode {
    /// Pseudocode 1: pursue Target99.
    Normal,
    /// Target99 deemed unattainable (§4.5): latency flows ignored.
    Unattainable {
        /// When the mode was entered.
        entered_at: Duration,
        /// The flow counts at entry; the mode lasts while L/(B+T) does not exceed theirs.
        entry_counts: FlowCounts,
    },
}

/// The answer of soft admission control to a new latency-sensitive flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Current99 is within Target99 (or not yet known): no warning.
    Admitted,
    /// Current99 already exceeds Target99, so the new flow will likely miss it too. The
    /// flow is still admitted; this is a warning, not a refusal.
    TargetAtRisk {
        /// The latest Current99.
        current_p99: Duration,
        /// Target99.
        target_p99: Duration,
    },
}

/// Justitia's SafeUtil controller (Pseudocode 1 with soft admission and §4.5).
#[derive(Debug, Clone)]
pub struct SafeUtilController {
    config: ControllerConfig,
    max_rate: f64,
    token: Token,
    safe_util: f64,
    /// The latest Current99 measured while latency flows were counted; kept across updates
    /// whose window is empty (the window restarts after a decrease, and at a RefPeriod
    /// shorter than a probe's round trip the next update may find no sample yet).
    last_p99: Option<Duration>,
    /// The current unbroken run of updates with Current99 > Target99: when its latest
    /// violating update ran, and how long violations have been observed in it.
    violation_run: Option<ViolationRun>,
    mode: ControlMode,
    /// The search law's state.
    search: SearchState,
}

/// The longest gap between two violating updates, in RefPeriods, that counts in full
/// toward delta: 5 ms at RefPeriod 0.5 ms, the control loop's probe timeout. Updates that
/// had no estimate in between (a window refilling after a decrease) are part of the run;
/// a longer gap is a stall of the caller, and counts as this much.
pub const OBSERVED_GAP_PERIODS: u32 = 10;

/// A run of violating updates, for delta (§4.5).
#[derive(Debug, Clone, Copy)]
struct ViolationRun {
    /// The latest update that observed a violation.
    last: Duration,
    /// Time observed in violation: the time from each violating update to the next, at
    /// most [`OBSERVED_GAP_PERIODS`] RefPeriods each, so that a driver that stalled (and could not observe
    /// anything) does not count the stall.
    observed: Duration,
}

/// What the search law remembers between updates.
#[derive(Debug, Clone, Copy, Default)]
struct SearchState {
    /// The latest rate that violated the target, and when.
    ceiling: Option<(f64, Duration)>,
    /// The step of the probing beyond an expired ceiling (0 when not probing).
    probe_step: f64,
    /// L at the previous update: a change forgets the ceiling.
    latency: u32,
}

impl SafeUtilController {
    /// A controller for an RNIC, starting at SafeUtil = MaxRate in normal mode.
    pub fn new(config: ControllerConfig, profile: &RnicProfile) -> Result<Self, ControllerError> {
        config.validate()?;
        let max_rate = profile.max_rate_bytes_per_sec();
        if !(max_rate.is_finite() && max_rate > 0.0) {
            return Err(ControllerError::MaxRate {
                profile: profile.name.clone(),
                bytes_per_sec: max_rate,
            });
        }
        Ok(SafeUtilController {
            config,
            max_rate,
            token: Token::for_profile(config.token_bytes, profile),
            safe_util: max_rate,
            last_p99: None,
            violation_run: None,
            mode: ControlMode::Normal,
            search: SearchState::default(),
        })
    }

    /// One step of the controller, to be called every RefPeriod (and may be called when the
    /// counts change). `counts` are the active L, B, T; `current_p99` is the estimator's
    /// Current99, `None` while its window is empty. `now` only needs to be monotonic.
    pub fn update(
        &mut self,
        now: Duration,
        counts: FlowCounts,
        current_p99: Option<Duration>,
    ) -> ControlAction {
        self.last_p99 = current_p99.or(self.last_p99);
        let violated =
            counts.latency > 0 && current_p99.is_some_and(|p99| p99 > self.config.target_p99);
        // No estimate says nothing either way: a run of violations is broken only by a
        // Current99 that meets the target (or by no latency flow at all).
        self.violation_run = if violated {
            Some(match self.violation_run {
                Some(run) => ViolationRun {
                    last: now,
                    observed: run
                        .observed
                        .saturating_add(now.saturating_sub(run.last).min(self.observed_gap())),
                },
                None => ViolationRun {
                    last: now,
                    observed: Duration::ZERO,
                },
            })
        } else if current_p99.is_none() && counts.latency > 0 {
            self.violation_run
        } else {
            None
        };
        if counts.latency != self.search.latency {
            self.search = SearchState {
                latency: counts.latency,
                ..SearchState::default()
            };
        }

        if let ControlMode::Unattainable { entry_counts, .. } = self.mode {
            if counts.latency == 0 || latency_ratio_exceeds(counts, entry_counts) {
                // Back to pursuing the target (no latency flow is left to give up on, or
                // there are more of them); a new violation run starts from scratch.
                self.mode = ControlMode::Normal;
                self.violation_run = violated.then_some(ViolationRun {
                    last: now,
                    observed: Duration::ZERO,
                });
            } else {
                self.safe_util = self.max_rate;
                return ControlAction::Unattainable;
            }
        }

        if counts.latency == 0 {
            self.safe_util = self.max_rate;
            return ControlAction::Reset;
        }
        let floor = self.sharing_floor(counts);
        if current_p99.is_none() {
            self.safe_util = self.safe_util.max(floor).min(self.max_rate);
            return ControlAction::Hold;
        }
        if violated {
            if self.unattainable_for_long_enough(counts) {
                self.mode = ControlMode::Unattainable {
                    entered_at: now,
                    entry_counts: counts,
                };
                self.safe_util = self.max_rate;
                return ControlAction::Unattainable;
            }
            if self.safe_util > floor {
                self.search.ceiling = Some((self.safe_util, now));
            }
            self.search.probe_step = 0.0;
            self.safe_util = (self.safe_util / 2.0).max(floor);
            ControlAction::Decrease
        } else {
            let (next, action) = self.increased(now);
            self.safe_util = next.max(floor).min(self.max_rate);
            action
        }
    }

    /// The SafeUtil the increase law proposes at `now`, before the floor and MaxRate.
    fn increased(&mut self, now: Duration) -> (f64, ControlAction) {
        let (resolution, lifetime) = match self.config.increase {
            IncreaseLaw::Fixed => {
                let step = self.config.increase_step * self.max_rate;
                return (self.safe_util + step, ControlAction::Increase);
            }
            IncreaseLaw::Search {
                resolution,
                ceiling_lifetime,
            } => (resolution * self.max_rate, ceiling_lifetime),
        };
        match self.search.ceiling {
            Some((ceiling, since)) if now.saturating_sub(since) < lifetime => {
                let gap = ceiling - self.safe_util;
                if gap > resolution {
                    (self.safe_util + gap / 2.0, ControlAction::Increase)
                } else {
                    (self.safe_util, ControlAction::Settle)
                }
            }
            Some(_) => {
                self.search.probe_step = (self.search.probe_step * 2.0).max(resolution);
                (
                    self.safe_util + self.search.probe_step,
                    ControlAction::Increase,
                )
            }
            None => {
                let gap = self.max_rate - self.safe_util;
                let next = if gap > resolution {
                    self.safe_util + gap / 2.0
                } else {
                    self.max_rate
                };
                (next, ControlAction::Increase)
            }
        }
    }

    /// Lowers the ceiling the update at `now` recorded to `rate`, if that is lower and
    /// above SafeUtil now: the violation that decrease acted on was measured by probes
    /// sent at `rate`, so the rates above it are no safer than the one the decrease found
    /// (a loop that needs several probes to show a violation lets SafeUtil climb past
    /// where it began). A ceiling recorded earlier, or a rate at or below SafeUtil (the
    /// probes went at the floor, which says nothing about rates), is left alone.
    pub fn lower_ceiling(&mut self, now: Duration, rate: f64) {
        if let Some((ceiling, since)) = &mut self.search.ceiling {
            if *since == now && rate > self.safe_util {
                *ceiling = ceiling.min(rate);
            }
        }
    }

    /// Sets Target99 (e.g. once an idle baseline has been measured); the next update
    /// compares Current99 with it.
    pub fn set_target_p99(&mut self, target: Duration) {
        if !target.is_zero() {
            self.config.target_p99 = target;
        }
    }

    /// Sets TokenBytes (the token follows the chunk size, §5.1), keeping SafeUtil, the
    /// mode and the search state.
    pub fn set_token(&mut self, token: Token) {
        if token.bytes > 0 {
            self.config.token_bytes = token.bytes;
            self.token = token;
        }
    }

    /// The most one update's gap adds to the time observed in violation:
    /// [`OBSERVED_GAP_PERIODS`] RefPeriods.
    fn observed_gap(&self) -> Duration {
        self.config.ref_period.saturating_mul(OBSERVED_GAP_PERIODS)
    }

    /// True when the violation run has lasted delta and giving up on the target would help
    /// someone (there are resource-hungry flows to give the RNIC to).
    fn unattainable_for_long_enough(&self, counts: FlowCounts) -> bool {
        match (self.config.unattainable_after, self.violation_run) {
            (Some(delta), Some(run)) => counts.resource_hungry() > 0 && run.observed >= delta,
            _ => false,
        }
    }

    /// The sharing-incentive floor (B+T)/(L+B+T) x MaxRate, with B+T counted as at least 1
    /// (see the module documentation).
    pub fn sharing_floor(&self, counts: FlowCounts) -> f64 {
        let hungry = f64::from(counts.resource_hungry().max(1));
        let total = hungry + f64::from(counts.latency);
        hungry / total * self.max_rate
    }

    /// Answers a request to admit a new latency-sensitive flow, from the latest Current99
    /// measured (see [`last_p99`](Self::last_p99)).
    pub fn admit_latency_flow(&self) -> Admission {
        self.admit_latency_flow_at(None)
    }

    /// As [`admit_latency_flow`](Self::admit_latency_flow), from `current_p99`, the
    /// estimator's Current99 now, when it has one: what an operator sees at that moment.
    pub fn admit_latency_flow_at(&self, current_p99: Option<Duration>) -> Admission {
        match current_p99.or(self.last_p99) {
            Some(current_p99) if current_p99 > self.config.target_p99 => Admission::TargetAtRisk {
                current_p99,
                target_p99: self.config.target_p99,
            },
            _ => Admission::Admitted,
        }
    }

    /// SafeUtil in bytes/s: the total rate resource-hungry flows may use now.
    pub fn safe_util(&self) -> f64 {
        self.safe_util
    }

    /// SafeUtil as a fraction of MaxRate, in (0, 1].
    pub fn safe_util_fraction(&self) -> f64 {
        self.safe_util / self.max_rate
    }

    /// tau = TokenBytes / SafeUtil: the interval between two multi-resource tokens.
    /// Saturates at [`Duration::MAX`] for absurd settings rather than panicking.
    pub fn tau(&self) -> Duration {
        Duration::try_from_secs_f64(self.config.token_bytes as f64 / self.safe_util)
            .unwrap_or(Duration::MAX)
    }

    /// The size of one multi-resource token: TokenBytes, and TokenOps from the profile's
    /// MaxTput/MaxRate.
    pub fn token(&self) -> Token {
        self.token
    }

    /// MaxRate in bytes/s.
    pub fn max_rate(&self) -> f64 {
        self.max_rate
    }

    /// The latest Current99 given to an update: an update with an empty window (restarted
    /// after a decrease, with the next probe still in flight, or after the flows changed)
    /// keeps the one before.
    pub fn last_p99(&self) -> Option<Duration> {
        self.last_p99
    }

    /// Whether the controller pursues Target99 or has given up on it.
    pub fn mode(&self) -> ControlMode {
        self.mode
    }

    /// The settings the controller runs with.
    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }
}

/// True when L/(B+T) of `now` exceeds that of `entry` (whose B+T is positive). With B+T = 0
/// the ratio is infinite if L > 0 and zero otherwise.
fn latency_ratio_exceeds(now: FlowCounts, entry: FlowCounts) -> bool {
    let (latency, hungry) = (u64::from(now.latency), u64::from(now.resource_hungry()));
    let (entry_latency, entry_hungry) =
        (u64::from(entry.latency), u64::from(entry.resource_hungry()));
    if hungry == 0 {
        return latency > 0;
    }
    latency * entry_hungry > entry_latency * hungry
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const TARGET: Duration = Duration::from_micros(2);
    const HIGH: Option<Duration> = Some(Duration::from_micros(5));
    const LOW: Option<Duration> = Some(Duration::from_micros(1));

    fn ib56() -> RnicProfile {
        RnicProfile::builtin("IB-56").unwrap()
    }

    fn controller(config: ControllerConfig) -> SafeUtilController {
        SafeUtilController::new(config, &ib56()).unwrap()
    }

    fn counts(latency: u32, bandwidth: u32, throughput: u32) -> FlowCounts {
        FlowCounts {
            latency,
            bandwidth,
            throughput,
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn defaults_match_the_paper() {
        let config = ControllerConfig::default();
        assert_eq!(config.target_p99, TARGET);
        assert_eq!(config.ref_period, Duration::from_micros(500));
        assert_eq!(config.token_bytes, 1_000_000);
        assert_eq!(config.unattainable_after, Some(Duration::from_secs(5)));
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn bad_settings_are_refused_with_their_name() {
        let bad = [
            (
                ControllerConfig {
                    target_p99: Duration::ZERO,
                    ..Default::default()
                },
                ControllerError::NotPositive("target_p99"),
            ),
            (
                ControllerConfig {
                    ref_period: Duration::ZERO,
                    ..Default::default()
                },
                ControllerError::NotPositive("ref_period"),
            ),
            (
                ControllerConfig {
                    token_bytes: 0,
                    ..Default::default()
                },
                ControllerError::NotPositive("token_bytes"),
            ),
            (
                ControllerConfig {
                    unattainable_after: Some(Duration::ZERO),
                    ..Default::default()
                },
                ControllerError::NotPositive("unattainable_after"),
            ),
        ];
        for (config, error) in bad {
            assert_eq!(SafeUtilController::new(config, &ib56()).err(), Some(error));
        }
        for step in [0.0, -0.1, 1.5, f64::NAN] {
            let config = ControllerConfig {
                increase_step: step,
                ..Default::default()
            };
            assert!(matches!(
                config.validate(),
                Err(ControllerError::IncreaseStep(_))
            ));
        }
        let mut broken = ib56();
        broken.max_rate_gbps = 0.0;
        assert!(matches!(
            SafeUtilController::new(ControllerConfig::default(), &broken),
            Err(ControllerError::MaxRate { .. })
        ));
    }

    #[test]
    fn starts_at_max_rate() {
        let c = controller(ControllerConfig::default());
        assert_eq!(c.safe_util(), c.max_rate());
        assert_eq!(c.mode(), ControlMode::Normal);
        assert_eq!(c.last_p99(), None);
    }

    #[test]
    fn no_latency_flows_resets_to_max_rate() {
        let mut c = controller(ControllerConfig::default());
        c.update(ms(0), counts(1, 1, 0), HIGH);
        assert!(c.safe_util() < c.max_rate());
        assert_eq!(c.update(ms(1), counts(0, 3, 1), HIGH), ControlAction::Reset);
        assert_eq!(c.safe_util(), c.max_rate());
    }

    #[test]
    fn violation_halves_safe_util() {
        let mut c = controller(ControllerConfig::default());
        // Three latency flows and one bandwidth flow: the floor is 1/4, two halvings away.
        let n = counts(3, 1, 0);
        assert_eq!(c.update(ms(0), n, HIGH), ControlAction::Decrease);
        assert!(close(c.safe_util(), c.max_rate() / 2.0));
        assert_eq!(c.update(ms(1), n, HIGH), ControlAction::Decrease);
        assert!(close(c.safe_util(), c.max_rate() / 4.0));
    }

    #[test]
    fn halving_stops_at_the_sharing_floor() {
        let mut c = controller(ControllerConfig::default());
        let n = counts(1, 2, 1);
        for i in 0..10 {
            c.update(ms(i), n, HIGH);
        }
        assert!(close(c.safe_util(), 0.75 * c.max_rate()));
        assert!(close(c.sharing_floor(n), 0.75 * c.max_rate()));
    }

    #[test]
    fn floor_counts_at_least_one_resource_hungry_flow() {
        let c = controller(ControllerConfig::default());
        assert!(close(c.sharing_floor(counts(3, 0, 0)), c.max_rate() / 4.0));
        assert!(close(c.sharing_floor(counts(0, 0, 0)), c.max_rate()));
    }

    #[test]
    fn meeting_the_target_increases_by_the_step() {
        let mut c = controller(ControllerConfig::default());
        let n = counts(3, 1, 0);
        c.update(ms(0), n, HIGH);
        let before = c.safe_util();
        assert_eq!(c.update(ms(1), n, LOW), ControlAction::Increase);
        assert!(close(c.safe_util(), before + 0.001 * c.max_rate()));
        // Current99 exactly at Target99 is not a violation.
        assert_eq!(c.update(ms(2), n, Some(TARGET)), ControlAction::Increase);
    }

    #[test]
    fn increase_is_capped_at_max_rate() {
        let mut c = controller(ControllerConfig::default());
        let n = counts(1, 1, 0);
        for i in 0..5 {
            assert_eq!(c.update(ms(i), n, LOW), ControlAction::Increase);
            assert_eq!(c.safe_util(), c.max_rate());
        }
    }

    #[test]
    fn recovery_from_the_floor_takes_the_documented_number_of_updates() {
        let mut c = controller(ControllerConfig::default());
        let n = counts(1, 1, 0);
        c.update(ms(0), n, HIGH);
        assert!(close(c.safe_util_fraction(), 0.5));
        let mut updates = 0;
        while c.safe_util() < c.max_rate() {
            c.update(ms(1 + updates), n, LOW);
            updates += 1;
        }
        // ceil(0.5 / 0.001) = 500 updates, i.e. 0.25 s at RefPeriod 0.5 ms (allow one
        // update of floating-point slack).
        assert!((500..=501).contains(&updates), "{updates} updates");
    }

    #[test]
    fn increase_keeps_the_floor_when_flows_arrive() {
        let mut c = controller(ControllerConfig::default());
        for i in 0..20 {
            c.update(ms(i), counts(7, 1, 0), HIGH);
        }
        assert!(close(c.safe_util_fraction(), 1.0 / 8.0));
        c.update(ms(20), counts(1, 3, 0), LOW);
        assert!(close(c.safe_util_fraction(), 0.75));
    }

    #[test]
    fn missing_estimate_holds_but_keeps_the_floor() {
        let mut c = controller(ControllerConfig::default());
        c.update(ms(0), counts(3, 1, 0), HIGH);
        let before = c.safe_util();
        assert_eq!(c.update(ms(1), counts(3, 1, 0), None), ControlAction::Hold);
        assert_eq!(c.safe_util(), before);
        assert_eq!(c.update(ms(2), counts(1, 3, 0), None), ControlAction::Hold);
        assert!(close(c.safe_util_fraction(), 0.75));
    }

    #[test]
    fn tau_is_token_bytes_over_safe_util() {
        let mut c = controller(ControllerConfig::default());
        // 10^6 bytes at 6 * 10^9 bytes/s: 166.7 us.
        assert!((166_666..=166_667).contains(&c.tau().as_nanos()));
        c.update(ms(0), counts(3, 1, 0), HIGH);
        assert!((333_333..=333_334).contains(&c.tau().as_nanos()));
        assert_eq!(c.token().bytes, 1_000_000);
        assert_eq!(c.token().ops, 5_000);
    }

    #[test]
    fn admission_warns_only_while_the_target_is_missed() {
        let mut c = controller(ControllerConfig::default());
        assert_eq!(c.admit_latency_flow(), Admission::Admitted);
        c.update(ms(0), counts(1, 1, 0), LOW);
        assert_eq!(c.admit_latency_flow(), Admission::Admitted);
        c.update(ms(1), counts(1, 1, 0), HIGH);
        assert_eq!(
            c.admit_latency_flow(),
            Admission::TargetAtRisk {
                current_p99: Duration::from_micros(5),
                target_p99: TARGET,
            }
        );
    }

    #[test]
    fn admission_keeps_the_latest_measurement_across_empty_windows_and_prefers_a_live_one() {
        let mut c = controller(ControllerConfig::default());
        c.update(ms(0), counts(1, 1, 0), HIGH);
        let at_risk = Admission::TargetAtRisk {
            current_p99: Duration::from_micros(5),
            target_p99: TARGET,
        };
        // The window restarted after the decrease and no probe has completed since.
        c.update(ms(1), counts(1, 1, 0), None);
        assert_eq!(c.last_p99(), Some(Duration::from_micros(5)));
        assert_eq!(c.admit_latency_flow(), at_risk);
        // The latency flows left: nothing newer was measured, the latest still stands.
        c.update(ms(2), counts(0, 1, 0), None);
        assert_eq!(c.admit_latency_flow(), at_risk);
        // A Current99 in hand now decides.
        assert_eq!(c.admit_latency_flow_at(LOW), Admission::Admitted);
    }

    /// Runs updates every millisecond from `from` to `to` (exclusive) with the same inputs.
    fn run(
        c: &mut SafeUtilController,
        from: u64,
        to: u64,
        n: FlowCounts,
        p99: Option<Duration>,
    ) -> ControlAction {
        let mut last = ControlAction::Hold;
        for t in from..to {
            last = c.update(ms(t), n, p99);
        }
        last
    }

    #[test]
    fn unattainable_mode_entered_after_delta_of_violation() {
        let mut c = controller(ControllerConfig::default());
        let n = counts(4, 4, 0);
        assert_eq!(run(&mut c, 0, 5_000, n, HIGH), ControlAction::Decrease);
        assert_eq!(c.mode(), ControlMode::Normal);
        assert!(close(c.safe_util_fraction(), 0.5));
        assert_eq!(c.update(ms(5_000), n, HIGH), ControlAction::Unattainable);
        assert_eq!(
            c.mode(),
            ControlMode::Unattainable {
                entered_at: ms(5_000),
                entry_counts: n
            }
        );
        assert_eq!(c.safe_util(), c.max_rate());
    }

    #[test]
    fn interrupted_violation_restarts_the_delta_clock() {
        let mut c = controller(ControllerConfig::default());
        let n = counts(4, 4, 0);
        run(&mut c, 0, 4_000, n, HIGH);
        c.update(ms(4_000), n, LOW);
        assert_eq!(run(&mut c, 4_001, 9_001, n, HIGH), ControlAction::Decrease);
        assert_eq!(c.mode(), ControlMode::Normal);
        assert_eq!(c.update(ms(9_001), n, HIGH), ControlAction::Unattainable);
    }

    #[test]
    fn unattainable_mode_can_be_turned_off() {
        let mut c = controller(ControllerConfig {
            unattainable_after: None,
            ..Default::default()
        });
        let n = counts(4, 4, 0);
        assert_eq!(run(&mut c, 0, 20_000, n, HIGH), ControlAction::Decrease);
        assert_eq!(c.mode(), ControlMode::Normal);
    }

    /// Twice delta in violation, but no resource-hungry flow to give the RNIC to: no
    /// update gives up on the target. (Checked at every update: one that entered the mode
    /// at delta would leave it at the next, as the ratio test then finds no hungry flow.)
    #[test]
    fn no_unattainable_mode_without_resource_hungry_flows() {
        let mut c = controller(ControllerConfig::default());
        for t in 0..10_000 {
            let action = c.update(ms(t), counts(2, 0, 0), HIGH);
            assert_eq!(action, ControlAction::Decrease, "at {t} ms");
            assert_eq!(c.mode(), ControlMode::Normal, "at {t} ms");
        }
    }

    fn unattainable_with(entry: FlowCounts) -> SafeUtilController {
        let mut c = controller(ControllerConfig::default());
        run(&mut c, 0, 5_001, entry, HIGH);
        assert!(matches!(c.mode(), ControlMode::Unattainable { .. }));
        c
    }

    #[test]
    fn unattainable_mode_stays_while_ratio_is_equal_or_smaller() {
        let mut c = unattainable_with(counts(2, 2, 0));
        let stays = [
            counts(2, 2, 0), // same
            counts(4, 2, 2), // equal ratio, more flows
            counts(1, 2, 0), // fewer latency flows
            counts(2, 3, 1), // more resource-hungry flows
        ];
        for (i, n) in stays.into_iter().enumerate() {
            assert_eq!(
                c.update(ms(6_000 + i as u64), n, HIGH),
                ControlAction::Unattainable,
                "{n:?}"
            );
            assert_eq!(c.safe_util(), c.max_rate());
        }
        // Even once the target is met the mode persists: only the ratio ends it.
        assert_eq!(
            c.update(ms(7_000), counts(2, 2, 0), LOW),
            ControlAction::Unattainable
        );
    }

    #[test]
    fn unattainable_mode_ends_when_the_latency_flows_do() {
        let mut c = unattainable_with(counts(2, 2, 0));
        // The latency flows leave: the mode ends with them (L = 0 makes the ratio test
        // false, which kept the mode for ever).
        assert_eq!(
            c.update(ms(6_000), counts(0, 2, 0), None),
            ControlAction::Reset
        );
        assert_eq!(c.mode(), ControlMode::Normal);
        // A later latency flow that meets its target is regulated, not ignored.
        let later = counts(1, 2, 0);
        assert_eq!(c.update(ms(7_000), later, LOW), ControlAction::Increase);
        assert_eq!(c.mode(), ControlMode::Normal);
        assert_eq!(c.update(ms(7_001), later, HIGH), ControlAction::Decrease);
    }

    #[test]
    fn a_stall_between_updates_does_not_count_toward_delta() {
        // Every RefPeriod (0.5 ms) for 1 s in violation, then the caller stalls 4.5 s and
        // the next update still sees the violation: 1 s observed, not 5.5 s.
        let mut c = controller(ControllerConfig::default());
        let n = counts(1, 1, 0);
        let half_ms = |k: u64| Duration::from_micros(500 * k);
        for k in 0..=2_000 {
            c.update(half_ms(k), n, HIGH);
        }
        assert_eq!(c.update(ms(5_500), n, HIGH), ControlAction::Decrease);
        assert_eq!(c.mode(), ControlMode::Normal);
        // Delta is reached once 3.995 s more are observed: 1 s + 5 ms (the stall, ten
        // RefPeriods at most) + 3.995 s.
        for k in 1..7_990 {
            let action = c.update(ms(5_500) + half_ms(k), n, HIGH);
            assert_eq!(action, ControlAction::Decrease, "at {k}");
        }
        assert_eq!(
            c.update(ms(5_500) + half_ms(7_990), n, HIGH),
            ControlAction::Unattainable
        );
    }

    #[test]
    fn unattainable_mode_left_when_latency_flows_grow() {
        let mut c = unattainable_with(counts(2, 2, 0));
        assert_eq!(
            c.update(ms(6_000), counts(3, 2, 0), HIGH),
            ControlAction::Decrease
        );
        assert_eq!(c.mode(), ControlMode::Normal);
        assert!(close(c.safe_util_fraction(), 0.5));
        // The delta clock restarted at the exit.
        run(&mut c, 6_001, 11_000, counts(3, 2, 0), HIGH);
        assert_eq!(c.mode(), ControlMode::Normal);
        assert_eq!(
            c.update(ms(11_000), counts(3, 2, 0), HIGH),
            ControlAction::Unattainable
        );
    }

    #[test]
    fn unattainable_mode_left_when_resource_hungry_flows_shrink() {
        let mut c = unattainable_with(counts(2, 2, 1));
        assert_eq!(
            c.update(ms(6_000), counts(2, 2, 0), LOW),
            ControlAction::Increase
        );
        assert_eq!(c.mode(), ControlMode::Normal);
        let mut c = unattainable_with(counts(2, 2, 1));
        c.update(ms(6_000), counts(2, 0, 0), LOW);
        assert_eq!(c.mode(), ControlMode::Normal);
    }

    #[test]
    fn search_law_climbs_to_just_below_the_last_violating_rate_and_settles() {
        let mut c = controller(ControllerConfig {
            increase: IncreaseLaw::SEARCH,
            ..Default::default()
        });
        let n = counts(1, 1, 0);
        // Violation at MaxRate: halved to the floor, ceiling MaxRate.
        assert_eq!(c.update(ms(0), n, HIGH), ControlAction::Decrease);
        // Half-way to the ceiling each update: 0.75, 0.875, 0.9375, 0.96875, 0.984375,
        // 0.9921875 (within 1 % of it: settled).
        let mut seen = Vec::new();
        for t in 1..=7 {
            let action = c.update(ms(t), n, LOW);
            seen.push((action, c.safe_util_fraction()));
        }
        let expected = [0.75, 0.875, 0.9375, 0.96875, 0.984375, 0.9921875, 0.9921875];
        for ((action, got), want) in seen.iter().zip(expected) {
            assert!(close(*got, want), "{got} != {want}");
            let settled = want == 0.9921875 && *action == ControlAction::Settle;
            assert!(*action == ControlAction::Increase || settled, "{action:?}");
        }
        assert_eq!(seen[6].0, ControlAction::Settle);
        // A violation at the floor sets no ceiling: after it the search aims at the old one.
        c.update(ms(8), n, HIGH);
        c.update(ms(9), n, HIGH);
        assert!(close(c.safe_util_fraction(), 0.5));
        c.update(ms(10), n, LOW);
        assert!(close(c.safe_util_fraction(), 0.5 + (0.9921875 - 0.5) / 2.0));
    }

    #[test]
    fn search_law_probes_beyond_an_expired_ceiling_with_a_doubling_step() {
        let mut c = controller(ControllerConfig {
            increase: IncreaseLaw::Search {
                resolution: 0.01,
                ceiling_lifetime: ms(100),
            },
            ..Default::default()
        });
        let n = counts(1, 1, 0);
        c.update(ms(0), n, HIGH);
        for t in 1..100 {
            c.update(ms(t), n, LOW);
        }
        let settled = c.safe_util_fraction();
        assert!(settled > 0.99 && settled < 1.0);
        assert_eq!(c.update(ms(100), n, LOW), ControlAction::Increase);
        assert!(close(c.safe_util_fraction(), (settled + 0.01).min(1.0)));
    }

    #[test]
    fn lower_ceiling_lowers_only_the_ceiling_just_recorded_and_only_above_safe_util() {
        let search = |c: &mut SafeUtilController| {
            for t in 1..40 {
                c.update(ms(t), counts(1, 1, 0), LOW);
            }
            c.safe_util_fraction()
        };
        let config = ControllerConfig {
            increase: IncreaseLaw::SEARCH,
            ..Default::default()
        };
        let n = counts(1, 1, 0);
        // A decrease from MaxRate records the ceiling MaxRate; lowered to 0.8, the search
        // settles within its 1 % resolution below 0.8 instead of below 1.
        let mut c = controller(config);
        c.update(Duration::ZERO, n, HIGH);
        c.lower_ceiling(Duration::ZERO, 0.8 * c.max_rate());
        let settled = search(&mut c);
        assert!((0.79..0.8).contains(&settled), "{settled}");
        // A ceiling recorded at another time is not lowered.
        let mut c = controller(config);
        c.update(Duration::ZERO, n, HIGH);
        c.lower_ceiling(ms(1), 0.8 * c.max_rate());
        let settled = search(&mut c);
        assert!((0.99..1.0).contains(&settled), "{settled}");
        // Nor to a rate at or below SafeUtil after the decrease (0.5).
        let mut c = controller(config);
        c.update(Duration::ZERO, n, HIGH);
        c.lower_ceiling(Duration::ZERO, 0.5 * c.max_rate());
        let settled = search(&mut c);
        assert!((0.99..1.0).contains(&settled), "{settled}");
    }

    #[test]
    fn a_change_in_the_latency_flows_forgets_the_search_ceiling() {
        let mut c = controller(ControllerConfig {
            increase: IncreaseLaw::SEARCH,
            ..Default::default()
        });
        let one = counts(1, 1, 0);
        // 1 -> 0.5 (ceiling 1), -> 0.75, then a violation there: ceiling 0.75, back to 0.5.
        c.update(ms(0), one, HIGH);
        c.update(ms(1), one, LOW);
        c.update(ms(2), one, HIGH);
        assert!(close(c.safe_util_fraction(), 0.5));
        // A second latency flow (same floor, 2/4): the plant changed, so the search climbs
        // half-way to MaxRate each update, past 0.75, instead of settling below it.
        let two = counts(2, 2, 0);
        for t in 3..13 {
            c.update(ms(t), two, LOW);
        }
        assert!(c.safe_util_fraction() > 0.99, "{}", c.safe_util_fraction());
        // With L unchanged the ceiling holds: the same history settles below 0.75.
        let mut c = controller(ControllerConfig {
            increase: IncreaseLaw::SEARCH,
            ..Default::default()
        });
        c.update(ms(0), one, HIGH);
        c.update(ms(1), one, LOW);
        c.update(ms(2), one, HIGH);
        for t in 3..13 {
            c.update(ms(t), one, LOW);
        }
        let settled = c.safe_util_fraction();
        assert!((0.74..0.75).contains(&settled), "{settled}");
    }

    #[test]
    fn the_search_resolution_must_lie_strictly_between_0_and_1() {
        for resolution in [0.0, 1.0, 2.0, -0.5] {
            let config = ControllerConfig {
                increase: IncreaseLaw::Search {
                    resolution,
                    ceiling_lifetime: ms(1_000),
                },
                ..Default::default()
            };
            assert_eq!(
                config.validate(),
                Err(ControllerError::SearchResolution(resolution))
            );
        }
    }

    #[test]
    fn without_latency_flows_no_violation_run_starts_or_lasts() {
        // 4.9 s of violation with a latency flow, one update without any (and without an
        // estimate), then the flow is back and violated: a new run, far from delta.
        let mut c = controller(ControllerConfig::default());
        let one = counts(1, 1, 0);
        run(&mut c, 0, 4_900, one, HIGH);
        assert_eq!(
            c.update(ms(4_900), counts(0, 1, 0), None),
            ControlAction::Reset
        );
        assert_eq!(
            run(&mut c, 4_901, 5_200, one, HIGH),
            ControlAction::Decrease
        );
        // 6 s of a high Current99 with no latency flow counted start no run either.
        let mut c = controller(ControllerConfig::default());
        run(&mut c, 0, 6_000, counts(0, 1, 0), HIGH);
        assert_eq!(c.update(ms(6_000), one, HIGH), ControlAction::Decrease);
    }

    #[test]
    fn a_missing_estimate_does_not_break_a_violation_run() {
        let mut c = controller(ControllerConfig::default());
        let n = counts(4, 4, 0);
        run(&mut c, 0, 2_500, n, HIGH);
        run(&mut c, 2_500, 2_600, n, None);
        // ... nor counts in full toward delta: 2.499 s observed before the gap, 5 ms (ten
        // RefPeriods) for the 101 ms gap, 2.496 s after it.
        assert_eq!(run(&mut c, 2_600, 5_096, n, HIGH), ControlAction::Decrease);
        assert_eq!(c.update(ms(5_096), n, HIGH), ControlAction::Unattainable);
    }

    #[test]
    fn latency_ratio_comparison() {
        let entry = counts(2, 3, 0);
        assert!(!latency_ratio_exceeds(counts(2, 3, 0), entry));
        assert!(!latency_ratio_exceeds(counts(4, 6, 0), entry));
        assert!(latency_ratio_exceeds(counts(3, 3, 0), entry));
        assert!(latency_ratio_exceeds(counts(2, 1, 1), entry));
        assert!(latency_ratio_exceeds(counts(1, 0, 0), entry));
        assert!(!latency_ratio_exceeds(counts(0, 0, 0), entry));
    }

    /// A search law whose resolution, 1/64, is a power of two, as are the steps of the
    /// binary search from the one-half floor: on IB-56 (MaxRate 6 x 10^9 bytes/s) every
    /// rate of the search is exact, so the gap reaches the resolution exactly.
    fn dyadic_search(ceiling_lifetime: Duration) -> SafeUtilController {
        controller(ControllerConfig {
            increase: IncreaseLaw::Search {
                resolution: 1.0 / 64.0,
                ceiling_lifetime,
            },
            ..Default::default()
        })
    }

    /// "Once within `resolution` x MaxRate of it, holds": a gap to the ceiling equal to
    /// the resolution is within it.
    #[test]
    fn the_search_holds_once_the_gap_to_the_ceiling_is_at_most_its_resolution() {
        let mut c = dyadic_search(ms(1_000));
        let n = counts(1, 1, 0);
        assert_eq!(c.update(ms(0), n, HIGH), ControlAction::Decrease);
        for (t, want) in [
            (1, 0.75),
            (2, 0.875),
            (3, 0.9375),
            (4, 0.96875),
            (5, 0.984375),
        ] {
            assert_eq!(
                c.update(ms(t), n, LOW),
                ControlAction::Increase,
                "at {t} ms"
            );
            assert_eq!(c.safe_util_fraction(), want, "at {t} ms");
        }
        // 1 - 0.984375 = 1/64: within the resolution.
        assert_eq!(c.update(ms(6), n, LOW), ControlAction::Settle);
        assert_eq!(c.safe_util_fraction(), 0.984375);
    }

    /// With no ceiling (a change in L forgot it), SafeUtil moves half-way to MaxRate every
    /// update, and to MaxRate itself once within the resolution of it (a gap equal to the
    /// resolution is within it).
    #[test]
    fn without_a_ceiling_the_search_climbs_half_way_to_max_rate_then_to_it() {
        let mut c = dyadic_search(ms(1_000));
        assert_eq!(
            c.update(ms(0), counts(1, 1, 0), HIGH),
            ControlAction::Decrease
        );
        assert_eq!(c.safe_util_fraction(), 0.5);
        // A second latency flow: the ceiling (MaxRate) is forgotten.
        let n = counts(2, 1, 0);
        for (t, want) in [
            (1, 0.75),
            (2, 0.875),
            (3, 0.9375),
            (4, 0.96875),
            (5, 0.984375),
            (6, 1.0),
            (7, 1.0),
        ] {
            assert_eq!(
                c.update(ms(t), n, LOW),
                ControlAction::Increase,
                "at {t} ms"
            );
            assert_eq!(c.safe_util_fraction(), want, "at {t} ms");
        }
    }

    /// Beyond an expired ceiling the additive step starts at the resolution and doubles
    /// every update: from 0.609375 (settled below a ceiling of 0.625), + 1/64, 1/32, 1/16,
    /// 1/8, then MaxRate caps it.
    #[test]
    fn beyond_an_expired_ceiling_the_step_doubles_every_update() {
        let mut c = dyadic_search(ms(100));
        let n = counts(1, 1, 0);
        c.update(ms(0), n, HIGH);
        c.lower_ceiling(ms(0), 0.625 * c.max_rate());
        for t in 1..100 {
            c.update(ms(t), n, LOW);
        }
        // 0.5 + 1/16 + 1/32 + 1/64: the next half-gap, 1/128, is within the resolution.
        assert_eq!(c.safe_util_fraction(), 0.609375);
        let mut rate = 0.609375;
        for (t, step) in [
            (100, 1.0 / 64.0),
            (101, 1.0 / 32.0),
            (102, 1.0 / 16.0),
            (103, 0.125),
        ] {
            assert_eq!(
                c.update(ms(t), n, LOW),
                ControlAction::Increase,
                "at {t} ms"
            );
            rate += step;
            assert_eq!(c.safe_util_fraction(), rate, "at {t} ms");
        }
        assert_eq!(rate, 0.84375);
        c.update(ms(104), n, LOW);
        assert_eq!(
            c.safe_util_fraction(),
            1.0,
            "0.84375 + 1/4 is beyond MaxRate"
        );
    }

    /// The token follows the chunk size: a new token sets tau (TokenBytes / SafeUtil), and
    /// a token of no bytes, which would make tau 0, is ignored.
    #[test]
    fn a_new_token_sets_tau_and_an_empty_one_is_ignored() {
        let mut c = controller(ControllerConfig::default());
        let token = Token {
            bytes: 60_000,
            ops: 300,
        };
        c.set_token(token);
        assert_eq!(c.token(), token);
        // 6 x 10^4 bytes at 6 x 10^9 bytes/s: 10 us.
        assert!(c.tau().as_nanos().abs_diff(10_000) <= 1, "{:?}", c.tau());
        c.set_token(Token { bytes: 0, ops: 1 });
        assert_eq!(c.token(), token);
        assert!(c.tau().as_nanos().abs_diff(10_000) <= 1, "{:?}", c.tau());
    }

    /// A Current99 equal to Target99 meets it: a new latency flow is admitted without a
    /// warning; a nanosecond more is at risk.
    #[test]
    fn admission_at_exactly_the_target_is_not_at_risk() {
        let c = controller(ControllerConfig::default());
        assert_eq!(c.admit_latency_flow_at(Some(TARGET)), Admission::Admitted);
        let above = TARGET + Duration::from_nanos(1);
        assert_eq!(
            c.admit_latency_flow_at(Some(above)),
            Admission::TargetAtRisk {
                current_p99: above,
                target_p99: TARGET,
            }
        );
    }
}
