//! Flow classification: the class of a queue pair from what it posts.
//!
//! Applications do not say what they are, so the class is inferred from traffic with PeRF's
//! rule (PeRF §3.3, the application classifier): an average message size of at least 1 KB
//! makes a *bandwidth* flow; otherwise the flow is a *throughput* flow when the highest
//! count of outstanding requests, sampled every 5 ms over the last 1000 ms, exceeds 5, and a
//! *latency* flow when it does not. The class decides how the shaper treats the flow
//! (Justitia §2.1, §4.3; see [`FlowClass`]).
//!
//! Two additions keep a class honest over time:
//! - **decay**: the average message size weighs each message by its age, halving the
//!   weight every `size_half_life`, so old traffic fades and one large message cannot
//!   decide a class forever;
//! - **hysteresis**: once a flow has a class, a different class is adopted only after the
//!   rule has indicated it at every evaluation for `dwell`, so traffic hovering around a
//!   threshold does not flip the class back and forth. Evaluations further apart than
//!   `dwell`, or one without evidence, break that run: an indication seen before a long idle
//!   time and again after it is evidence of one moment, not of a whole dwell.
//!
//! The first evidence (the first evaluation after a message was posted) decides the class at
//! once, so a new bandwidth flow is not passed through unshaped for a dwell time. An
//! explicit class set by the operator always wins; the inferred class keeps being tracked
//! underneath it.
//!
//! The caller drives everything: it reports posts ([`FlowClassifier::on_post`]) and depth
//! samples ([`FlowClassifier::on_depth_sample`]) and asks for the class
//! ([`FlowClassifier::class`]), passing `now` each time. Invariants: after the first
//! decision, two changes of the inferred class are at least `dwell` apart; recording a post
//! is a few additions and never allocates; memory is fixed at construction (one slot per
//! sample period of the depth window); time that goes backwards is treated as the latest
//! time seen.

use std::time::Duration;

use crate::flow::FlowClass;

/// The most depth slots (depth window / sample period) a classifier keeps, to bound memory.
pub const MAX_DEPTH_SLOTS: u64 = 100_000;

/// A class the rule keeps indicating while the flow has another.
#[derive(Clone, Copy, Debug)]
struct PendingClass {
    class: FlowClass,
    /// The first evaluation of the unbroken run that indicated `class`.
    since: Duration,
    /// The latest evaluation that indicated it.
    last_seen: Duration,
}

/// Thresholds and periods of the classification rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassifierConfig {
    /// An average message size at or above this many bytes means bandwidth (PeRF: 1 KB).
    pub bandwidth_min_avg_bytes: u32,
    /// A peak outstanding count above this means throughput (PeRF's Th_M_App: 5).
    pub throughput_min_depth_exceeded: u32,
    /// How often the caller samples the outstanding count (PeRF: 5 ms). Also the
    /// granularity of the depth window and of the size decay, and the shortest interval
    /// between two evaluations of the rule.
    pub depth_sample_period: Duration,
    /// How far back the peak outstanding count looks (PeRF: 1000 ms).
    pub depth_window: Duration,
    /// Age at which a message counts half as much in the average size.
    pub size_half_life: Duration,
    /// How long a new class must be indicated before it is adopted; zero disables
    /// hysteresis.
    pub dwell: Duration,
}

impl Default for ClassifierConfig {
    /// PeRF's thresholds and periods; a 250 ms half-life (the size average forgets most of
    /// its past within the depth window) and a 100 ms dwell (20 samples).
    fn default() -> Self {
        ClassifierConfig {
            bandwidth_min_avg_bytes: 1024,
            throughput_min_depth_exceeded: 5,
            depth_sample_period: Duration::from_millis(5),
            depth_window: Duration::from_millis(1000),
            size_half_life: Duration::from_millis(250),
            dwell: Duration::from_millis(100),
        }
    }
}

/// A classifier configuration value out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("classifier config: `{field}` {reason}")]
pub struct ClassifierConfigError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl ClassifierConfig {
    /// Checks that thresholds and periods are usable: the size threshold and the periods
    /// are positive, and the depth window spans between 1 and [`MAX_DEPTH_SLOTS`] sample
    /// periods.
    pub fn validate(&self) -> Result<(), ClassifierConfigError> {
        let invalid = |field: &'static str, reason: String| ClassifierConfigError { field, reason };
        if self.bandwidth_min_avg_bytes == 0 {
            return Err(invalid(
                "bandwidth_min_avg_bytes",
                "must be positive".into(),
            ));
        }
        if self.depth_sample_period.is_zero() {
            return Err(invalid("depth_sample_period", "must be positive".into()));
        }
        if self.size_half_life.is_zero() {
            return Err(invalid("size_half_life", "must be positive".into()));
        }
        let slots = self.depth_window.as_nanos() / self.depth_sample_period.as_nanos();
        if slots == 0 || slots > u128::from(MAX_DEPTH_SLOTS) {
            return Err(invalid(
                "depth_window",
                format!(
                    "({:?}) must span 1 to {MAX_DEPTH_SLOTS} sample periods of {:?}",
                    self.depth_window, self.depth_sample_period
                ),
            ));
        }
        Ok(())
    }

    /// Number of sample periods in the depth window.
    fn depth_slots(&self) -> usize {
        let slots = self.depth_window.as_nanos() / self.depth_sample_period.as_nanos();
        usize::try_from(slots).unwrap_or(usize::MAX)
    }
}

/// The peak outstanding count seen during one sample period.
#[derive(Clone, Copy, Debug)]
struct DepthSlot {
    period: u64,
    peak: u32,
}

/// Infers one flow's class from its posts and queue depth; see the module documentation.
#[derive(Clone, Debug)]
pub struct FlowClassifier {
    config: ClassifierConfig,
    /// Weight a message keeps after one sample period: 2^(-period / half-life).
    decay_per_period: f64,
    /// Decayed sums of bytes and messages, as weighed at the start of `period`.
    decayed_bytes: f64,
    decayed_messages: f64,
    /// Bytes and messages posted during `period`, not yet decayed.
    period_bytes: u64,
    period_messages: u64,
    /// The sample period the undecayed sums belong to.
    period: u64,
    period_end: Duration,
    /// Ring of per-period depth peaks covering the depth window.
    depth: Vec<Option<DepthSlot>>,
    inferred: Option<FlowClass>,
    /// A class the rule indicates, different from `inferred`.
    pending: Option<PendingClass>,
    explicit: Option<FlowClass>,
    next_evaluation: Duration,
    latest: Duration,
}

impl FlowClassifier {
    /// A classifier with no traffic seen yet.
    pub fn new(config: ClassifierConfig) -> Result<Self, ClassifierConfigError> {
        config.validate()?;
        let decay_per_period = (-config.depth_sample_period.as_secs_f64()
            / config.size_half_life.as_secs_f64())
        .exp2();
        Ok(FlowClassifier {
            decay_per_period,
            decayed_bytes: 0.0,
            decayed_messages: 0.0,
            period_bytes: 0,
            period_messages: 0,
            period: 0,
            period_end: config.depth_sample_period,
            depth: vec![None; config.depth_slots()],
            inferred: None,
            pending: None,
            explicit: None,
            next_evaluation: Duration::ZERO,
            latest: Duration::ZERO,
            config,
        })
    }

    /// Records one posted message of `bytes` bytes.
    pub fn on_post(&mut self, now: Duration, bytes: u32) {
        self.advance(now);
        self.period_bytes = self.period_bytes.saturating_add(u64::from(bytes));
        self.period_messages = self.period_messages.saturating_add(1);
    }

    /// Records a sample of the flow's outstanding (posted, not yet completed) requests.
    /// The rule expects one sample per `depth_sample_period`; more are harmless, since
    /// only the peak of each period is kept.
    pub fn on_depth_sample(&mut self, now: Duration, outstanding: u32) {
        let now = self.advance(now);
        let period = self.period_of(now);
        let len = self.depth.len() as u64;
        let Some(slot) = usize::try_from(period % len)
            .ok()
            .and_then(|i| self.depth.get_mut(i))
        else {
            return;
        };
        match slot {
            Some(s) if s.period == period => s.peak = s.peak.max(outstanding),
            _ => {
                *slot = Some(DepthSlot {
                    period,
                    peak: outstanding,
                })
            }
        }
    }

    /// The flow's class at `now`: the explicit class if one is set, otherwise the inferred
    /// class, re-evaluated at most once per sample period. A flow with no traffic yet is a
    /// latency flow, which the shaper leaves alone.
    pub fn class(&mut self, now: Duration) -> FlowClass {
        let now = self.advance(now);
        if now >= self.next_evaluation {
            self.evaluate(now);
            self.next_evaluation = now.saturating_add(self.config.depth_sample_period);
        }
        self.explicit
            .or(self.inferred)
            .unwrap_or(FlowClass::Latency)
    }

    /// Sets (or with `None` clears) the operator's explicit class, which overrides the
    /// inferred one.
    pub fn set_explicit(&mut self, class: Option<FlowClass>) {
        self.explicit = class;
    }

    /// The operator's explicit class, if any.
    pub fn explicit(&self) -> Option<FlowClass> {
        self.explicit
    }

    /// The class inferred from traffic so far (`None` before the first evidence), whatever
    /// the explicit class.
    pub fn inferred(&self) -> Option<FlowClass> {
        self.inferred
    }

    /// The decayed average message size in bytes, `None` before any message (or after so
    /// long an idle time that every message's weight has vanished).
    pub fn average_message_bytes(&self) -> Option<f64> {
        let messages = self.decayed_messages + self.period_messages as f64;
        (messages > 0.0).then(|| (self.decayed_bytes + self.period_bytes as f64) / messages)
    }

    /// The highest outstanding count sampled within the depth window ending at `now`.
    pub fn peak_depth(&self, now: Duration) -> u32 {
        let current = self.period_of(now.max(self.latest));
        let window = self.depth.len() as u64;
        self.depth
            .iter()
            .flatten()
            .filter(|s| s.period <= current && current - s.period < window)
            .map(|s| s.peak)
            .max()
            .unwrap_or(0)
    }

    /// The class the rule indicates from the current evidence, before hysteresis.
    pub fn indicated(&self, now: Duration) -> Option<FlowClass> {
        let avg = self.average_message_bytes()?;
        Some(if avg >= f64::from(self.config.bandwidth_min_avg_bytes) {
            FlowClass::Bandwidth
        } else if self.peak_depth(now) > self.config.throughput_min_depth_exceeded {
            FlowClass::Throughput
        } else {
            FlowClass::Latency
        })
    }

    /// Applies the rule and the hysteresis at `now`.
    fn evaluate(&mut self, now: Duration) {
        let Some(indicated) = self.indicated(now) else {
            self.pending = None;
            return;
        };
        let Some(current) = self.inferred else {
            self.inferred = Some(indicated);
            return;
        };
        if indicated == current {
            self.pending = None;
            return;
        }
        let dwell = self.config.dwell;
        let since = match self.pending {
            Some(p) if p.class == indicated && now.saturating_sub(p.last_seen) <= dwell => p.since,
            _ => now,
        };
        if now.saturating_sub(since) >= dwell {
            self.inferred = Some(indicated);
            self.pending = None;
        } else {
            self.pending = Some(PendingClass {
                class: indicated,
                since,
                last_seen: now,
            });
        }
    }

    /// Clamps `now` to the latest time seen and folds the sums of finished sample periods
    /// into the decayed average. Returns the clamped time.
    fn advance(&mut self, now: Duration) -> Duration {
        let now = now.max(self.latest);
        self.latest = now;
        if now >= self.period_end {
            let period = self.period_of(now);
            let elapsed = i32::try_from(period.saturating_sub(self.period)).unwrap_or(i32::MAX);
            let weight = self.decay_per_period.powi(elapsed);
            self.decayed_bytes = (self.decayed_bytes + self.period_bytes as f64) * weight;
            self.decayed_messages = (self.decayed_messages + self.period_messages as f64) * weight;
            self.period_bytes = 0;
            self.period_messages = 0;
            self.period = period;
            let end = (u128::from(period) + 1) * self.config.depth_sample_period.as_nanos();
            self.period_end = Duration::from_nanos(u64::try_from(end).unwrap_or(u64::MAX));
        }
        now
    }

    /// The index of the sample period containing `now`.
    fn period_of(&self, now: Duration) -> u64 {
        let period = now.as_nanos() / self.config.depth_sample_period.as_nanos();
        u64::try_from(period).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn classifier() -> FlowClassifier {
        FlowClassifier::new(ClassifierConfig::default()).unwrap()
    }

    /// Each sample period has its own slot: a deep period followed by a shallow one keeps
    /// the deep peak in the window (periods 10 and 11 of 5 ms, in a window of 200).
    #[test]
    fn each_sample_period_keeps_its_own_peak() {
        let mut c = classifier();
        c.on_depth_sample(ms(50), 6);
        c.on_depth_sample(ms(55), 1);
        assert_eq!(c.peak_depth(ms(55)), 6);
        // A window of exactly MAX_DEPTH_SLOTS periods is the largest accepted.
        let most = ClassifierConfig {
            depth_sample_period: Duration::from_micros(10),
            depth_window: Duration::from_micros(10) * MAX_DEPTH_SLOTS as u32,
            ..ClassifierConfig::default()
        };
        assert!(most.validate().is_ok());
        let too_many = ClassifierConfig {
            depth_window: most.depth_window + Duration::from_micros(10),
            ..most
        };
        assert!(too_many.validate().is_err());
    }

    /// The explicit class is kept as set, and cleared with `None`.
    #[test]
    fn the_explicit_class_is_kept_until_cleared() {
        let mut c = classifier();
        c.set_explicit(Some(FlowClass::Throughput));
        assert_eq!(c.explicit(), Some(FlowClass::Throughput));
        c.set_explicit(None);
        assert_eq!(c.explicit(), None);
    }

    /// Finished periods decay by the half-life, bytes and messages alike: four 1000 B
    /// messages in the first 5 ms period and one of 100 B in the next average
    /// (4000 w + 100) / (4 w + 1) with w = 2^(-5/250), 817.995 B; undecayed it would be 820.
    #[test]
    fn finished_periods_decay_by_the_half_life() {
        let mut c = classifier();
        for _ in 0..4 {
            c.on_post(ms(0), 1000);
        }
        c.on_post(ms(5), 100);
        let avg = c.average_message_bytes().unwrap();
        assert!((avg - 817.9954).abs() < 1e-3, "{avg}");
    }

    #[test]
    fn no_traffic_is_latency_and_undecided() {
        let mut c = classifier();
        assert_eq!(c.class(ms(0)), FlowClass::Latency);
        assert_eq!(c.inferred(), None);
        assert_eq!(c.average_message_bytes(), None);
    }

    #[test]
    fn average_of_one_kib_or_more_is_bandwidth() {
        let mut c = classifier();
        c.on_post(ms(0), 1024);
        assert_eq!(c.class(ms(0)), FlowClass::Bandwidth);

        let mut c = classifier();
        c.on_post(ms(0), 1023);
        assert_eq!(c.class(ms(0)), FlowClass::Latency);
    }

    #[test]
    fn small_messages_with_deep_queue_are_throughput() {
        let mut c = classifier();
        c.on_post(ms(0), 16);
        c.on_depth_sample(ms(0), 6);
        assert_eq!(c.class(ms(0)), FlowClass::Throughput);
    }

    #[test]
    fn depth_of_exactly_the_threshold_is_still_latency() {
        let mut c = classifier();
        c.on_post(ms(0), 16);
        c.on_depth_sample(ms(0), 5);
        assert_eq!(c.class(ms(0)), FlowClass::Latency);
    }

    #[test]
    fn large_average_wins_over_deep_queue() {
        let mut c = classifier();
        c.on_post(ms(0), 1 << 20);
        c.on_depth_sample(ms(0), 64);
        assert_eq!(c.class(ms(0)), FlowClass::Bandwidth);
    }

    #[test]
    fn depth_peak_is_forgotten_after_the_window() {
        let mut c = classifier();
        c.on_depth_sample(ms(0), 32);
        assert_eq!(c.peak_depth(ms(999)), 32);
        assert_eq!(c.peak_depth(ms(1000)), 0);
        // Sampling faster than the period keeps the peak of each period.
        c.on_depth_sample(ms(1001), 7);
        c.on_depth_sample(ms(1002), 3);
        assert_eq!(c.peak_depth(ms(1003)), 7);
    }

    #[test]
    fn average_size_decays_with_the_half_life() {
        let mut c = classifier();
        // One 1 MB message, then 16 B messages a half-life later: the old message's
        // weight halves, so 2 newer ones weigh as much as it does.
        c.on_post(ms(0), 1 << 20);
        c.on_post(ms(250), 16);
        c.on_post(ms(250), 16);
        let avg = c.average_message_bytes().unwrap();
        let expected = (0.5 * f64::from(1 << 20) + 32.0) / 2.5;
        assert!(
            (avg - expected).abs() < 1e-6 * expected,
            "{avg} vs {expected}"
        );
    }

    #[test]
    fn bandwidth_flow_turned_small_becomes_latency_after_decay_and_dwell() {
        let mut c = classifier();
        c.on_post(ms(0), 1 << 20);
        assert_eq!(c.class(ms(0)), FlowClass::Bandwidth);
        let mut changed_at = None;
        for t in (5..5000).step_by(5) {
            c.on_post(ms(t), 16);
            c.on_depth_sample(ms(t), 1);
            if c.class(ms(t)) == FlowClass::Latency {
                changed_at = Some(t);
                break;
            }
        }
        // With a 16 B message every 5 ms, about 73 recent messages carry weight; the
        // average drops under 1 KB once the 1 MB message weighs less than about 7% of
        // them (3.8 half-lives, ~960 ms), and the change is adopted a dwell later.
        let t = changed_at.unwrap();
        assert!((1050..1120).contains(&t), "changed at {t} ms");
    }

    #[test]
    fn alternating_indications_do_not_flap() {
        // A short half-life makes the average follow each 50 ms burst, so the rule's
        // indication alternates; the 100 ms dwell must keep the class still.
        let mut c = FlowClassifier::new(ClassifierConfig {
            size_half_life: ms(5),
            ..ClassifierConfig::default()
        })
        .unwrap();
        let mut indication_changes = 0;
        let mut last_indication = None;
        for step in 0..400u64 {
            let t = ms(step * 5);
            let bytes = if (step / 10) % 2 == 0 { 16 } else { 4096 };
            c.on_post(t, bytes);
            assert_eq!(c.class(t), FlowClass::Latency, "at {t:?}");
            let indication = c.indicated(t);
            if last_indication.is_some() && indication != last_indication {
                indication_changes += 1;
            }
            last_indication = indication;
        }
        assert!(indication_changes >= 30, "{indication_changes}");
    }

    #[test]
    fn an_indication_before_and_after_a_long_idle_time_does_not_skip_the_dwell() {
        // A 1 ms half-life forgets the small messages within the idle time, so one large
        // message afterwards indicates bandwidth at once; it must still wait out the dwell.
        let mut c = FlowClassifier::new(ClassifierConfig {
            size_half_life: ms(1),
            ..ClassifierConfig::default()
        })
        .unwrap();
        c.on_post(ms(0), 16);
        assert_eq!(c.class(ms(0)), FlowClass::Latency);
        c.on_post(ms(5), 1 << 20);
        assert_eq!(c.class(ms(5)), FlowClass::Latency, "dwell not yet over");
        c.on_post(ms(20_000), 1 << 20);
        assert_eq!(
            c.class(ms(20_000)),
            FlowClass::Latency,
            "idle time broke the run"
        );
        for t in (20_005..20_100).step_by(5) {
            c.on_post(ms(t), 1 << 20);
            assert_eq!(c.class(ms(t)), FlowClass::Latency, "at {t} ms");
        }
        c.on_post(ms(20_100), 1 << 20);
        assert_eq!(c.class(ms(20_100)), FlowClass::Bandwidth);
    }

    #[test]
    fn new_class_is_adopted_after_the_dwell_time() {
        let mut c = classifier();
        c.on_post(ms(0), 16);
        assert_eq!(c.class(ms(0)), FlowClass::Latency);
        for t in (5..=95).step_by(5) {
            c.on_depth_sample(ms(t), 10);
            assert_eq!(c.class(ms(t)), FlowClass::Latency, "at {t} ms");
        }
        c.on_depth_sample(ms(105), 10);
        assert_eq!(c.class(ms(105)), FlowClass::Throughput);
    }

    #[test]
    fn explicit_class_always_wins_and_inference_continues_underneath() {
        let mut c = classifier();
        c.set_explicit(Some(FlowClass::Bandwidth));
        c.on_post(ms(0), 16);
        assert_eq!(c.class(ms(0)), FlowClass::Bandwidth);
        assert_eq!(c.inferred(), Some(FlowClass::Latency));
        c.set_explicit(None);
        assert_eq!(c.class(ms(1)), FlowClass::Latency);
        assert_eq!(c.explicit(), None);
    }

    #[test]
    fn time_going_backwards_is_treated_as_latest() {
        let mut c = classifier();
        c.on_post(ms(500), 2048);
        c.on_post(ms(100), 2048);
        assert_eq!(c.class(ms(0)), FlowClass::Bandwidth);
        assert_eq!(c.average_message_bytes(), Some(2048.0));
    }

    #[test]
    fn invalid_configs_name_the_field() {
        let base = ClassifierConfig::default();
        let cases = [
            (
                ClassifierConfig {
                    bandwidth_min_avg_bytes: 0,
                    ..base
                },
                "bandwidth_min_avg_bytes",
            ),
            (
                ClassifierConfig {
                    depth_sample_period: Duration::ZERO,
                    ..base
                },
                "depth_sample_period",
            ),
            (
                ClassifierConfig {
                    size_half_life: Duration::ZERO,
                    ..base
                },
                "size_half_life",
            ),
            (
                ClassifierConfig {
                    depth_window: ms(1),
                    ..base
                },
                "depth_window",
            ),
            (
                ClassifierConfig {
                    depth_window: Duration::from_secs(10_000),
                    ..base
                },
                "depth_window",
            ),
        ];
        for (config, field) in cases {
            assert_eq!(
                FlowClassifier::new(config).err().map(|e| e.field),
                Some(field)
            );
        }
        assert_eq!(base.validate(), Ok(()));
    }
}
