//! The reference probe's bookkeeping: probes sent and outstanding, their completions and
//! losses as samples of Current99's window (and of the idle baseline while it is
//! measured), and what the window gives the controller to compare with Target99.
//!
//! Inputs: [`ControlLoop::probe_sent`], [`ControlLoop::probe_completed`] (or
//! [`ControlLoop::probe_completed_at`]) and [`ControlLoop::probe_lost`] from the driver,
//! and [`ControlLoop::reference_path_changed`] when the probe moves to another path;
//! the loop's clock, and its activity epoch for the idle baseline.
//!
//! Invariants: outstanding probes are kept in the order they were sent, which is the order
//! of their ids and of their deadlines; a probe is counted once (completed or lost); a
//! sample of a probe sent before the window restarted is not counted; a probe counts in the
//! idle baseline only if it was sent and completed with no resource-hungry flow active in
//! the same activity epoch.

use super::*;

#[derive(Debug, Clone, Copy)]
pub(super) struct Outstanding {
    pub(super) sent_at: Duration,
    /// Sent while no resource-hungry flow was active, in this activity epoch.
    pub(super) idle_epoch: Option<u64>,
}

/// Target99 for an idle multiple: `multiple` times the idle p99, at least 1 ns, saturating.
pub(super) fn idle_target(idle_p99: Duration, multiple: f64) -> Duration {
    Duration::try_from_secs_f64(idle_p99.as_secs_f64() * multiple)
        .unwrap_or(Duration::MAX)
        .max(Duration::from_nanos(1))
}

/// For every window length n from 0 to `window`, the rank of the sample a violation is
/// decided on (0 where none can be).
///
/// With `None`, the nearest-rank p99, from [`MIN_P99_SAMPLES`] samples on. With
/// `Some(alpha)`, the rank n + 1 - k, where k is the fewest samples above Target99 that a
/// window of probes exceeding it exactly 1 % of the time shows with probability at most
/// `alpha` (k is the smallest with P(Binomial(n, 0.01) >= k) <= alpha): the sample of that
/// rank exceeds Target99 exactly when k samples or more do. It is a distribution-free
/// lower confidence bound of the p99, and needs no minimum window: three slow probes of
/// three already decide (P = 10^-6), one of one does not (P = 10^-2).
pub(super) fn decision_ranks(window: usize, alpha: Option<f64>) -> Vec<usize> {
    (0..=window).map(|n| decision_rank(n, alpha)).collect()
}

/// The rank [`decision_ranks`] gives a window of `n` samples.
pub(super) fn decision_rank(n: usize, alpha: Option<f64>) -> usize {
    let Some(alpha) = alpha else {
        return if n >= MIN_P99_SAMPLES {
            Quantile::P99.rank(n)
        } else {
            0
        };
    };
    let p = 1.0 - Quantile::P99.get();
    // Walk the binomial's probabilities up from k = 0 until what is left of the tail,
    // P(X >= k), is at most alpha.
    let mut pmf = (1.0 - p).powi(i32::try_from(n).unwrap_or(i32::MAX));
    let mut tail = 1.0;
    let mut k = 0;
    while k <= n && tail > alpha {
        tail -= pmf;
        pmf *= (n - k) as f64 / (k + 1) as f64 * p / (1.0 - p);
        k += 1;
    }
    if tail > alpha || k == 0 {
        0
    } else {
        n + 1 - k
    }
}

impl ControlLoop {
    /// Records that a probe was posted at `now`; returns its id, to be given back on its
    /// completion or loss.
    pub fn probe_sent(&mut self, now: Duration) -> ProbeId {
        let now = self.advance(now);
        let id = ProbeId(self.next_probe);
        self.next_probe += 1;
        let idle = self.baseline.is_some() && self.hungry_active == 0;
        self.probes.push_back((
            id,
            Outstanding {
                sent_at: now,
                idle_epoch: idle.then_some(self.hungry_epoch),
            },
        ));
        id
    }

    /// Takes an outstanding probe out.
    pub(super) fn take_probe(&mut self, id: ProbeId) -> Option<Outstanding> {
        let index = self.probes.binary_search_by_key(&id, |&(id, _)| id).ok()?;
        self.probes.remove(index).map(|(_, probe)| probe)
    }

    /// Records a probe's completion at `now`. Returns false (and records nothing) for a
    /// probe that is unknown or already counted as lost.
    pub fn probe_completed(&mut self, now: Duration, id: ProbeId) -> bool {
        self.probe_completed_at(now, id, now)
    }

    /// Records, at `now`, a probe's completion that happened at `completed_at` (a driver
    /// that collects completions after the fact, stamped when they happened, and so
    /// need not wake up at each one). The latency is `completed_at` less the time the
    /// probe was sent; a `completed_at` after `now` counts as `now`. Returns false (and
    /// records nothing) for a probe that is unknown or already counted as lost.
    pub fn probe_completed_at(
        &mut self,
        now: Duration,
        id: ProbeId,
        completed_at: Duration,
    ) -> bool {
        let now = self.advance(now);
        let Some(probe) = self.take_probe(id) else {
            return false;
        };
        let latency = completed_at.min(now).saturating_sub(probe.sent_at);
        let uncontended = probe.idle_epoch == Some(self.hungry_epoch) && self.hungry_active == 0;
        if uncontended {
            self.record_idle_sample(latency);
        }
        self.record(probe.sent_at, latency);
        true
    }

    /// Records that a probe failed (e.g. an error completion): counted as lost at once.
    /// Returns false for a probe that is unknown or already counted.
    pub fn probe_lost(&mut self, now: Duration, id: ProbeId) -> bool {
        self.advance(now);
        match self.take_probe(id) {
            Some(probe) => {
                self.record_lost(id, probe);
                true
            }
            None => false,
        }
    }

    pub(super) fn record_lost(&mut self, id: ProbeId, probe: Outstanding) {
        let floor = self.target_value().map_or(Duration::ZERO, |t| {
            t.saturating_add(Duration::from_nanos(1))
        });
        self.record(probe.sent_at, self.config.probe_timeout.max(floor));
        self.events.push_back(Event::ProbeLost(id));
    }

    /// Adds a sample to Current99's window unless its probe predates the window's restart.
    pub(super) fn record(&mut self, sent_at: Duration, latency: Duration) {
        if sent_at >= self.forget_before {
            self.estimator.record(latency);
        }
    }

    pub(super) fn record_idle_sample(&mut self, latency: Duration) {
        let Target99::IdleMultiple(multiple) = self.config.target else {
            return;
        };
        let Some(baseline) = &mut self.baseline else {
            return;
        };
        baseline.record(latency);
        if baseline.len() < self.config.idle_samples {
            return;
        }
        let Some(idle_p99) = baseline.estimate() else {
            return;
        };
        let target = idle_target(idle_p99, multiple);
        self.baseline = None;
        self.idle_p99 = Some(idle_p99);
        self.controller.set_target_p99(target);
        self.events
            .push_back(Event::TargetMeasured { idle_p99, target });
    }

    /// What the controller is given to compare with `target` (see the module
    /// documentation's "Target99 and the estimator window"): the least of the newest
    /// [`VIOLATION_RUN`] samples when all of them exceed the target; otherwise the sample
    /// of the decision rank ([`decision_ranks`]) of a window that can hold a p99. A window
    /// too short for one gives the largest of its newest [`VIOLATION_RUN`] samples when all
    /// of them meet the target, and nothing otherwise (the controller holds).
    pub(super) fn decision_p99(&self, target: Duration) -> Option<Duration> {
        if self.config.violation == ViolationRule::Current99 {
            return self.estimator.estimate();
        }
        let newest = self.estimator.newest_range(VIOLATION_RUN);
        if let Some((least, _)) = newest.filter(|&(least, _)| least > target) {
            return Some(least);
        }
        match self.decision_ranks.get(self.estimator.len()).copied() {
            Some(rank) if rank > 0 => self.estimator.at_rank(rank),
            _ => newest
                .map(|(_, greatest)| greatest)
                .filter(|&greatest| greatest <= target),
        }
    }

    /// The reference flow runs on another path from `now` on (the daemon's probe moved
    /// from loopback to a peer daemon's queue pair, across the wire): what its earlier
    /// probes measured is another quantity. Current99's window restarts (probes sent
    /// before `now` are not counted, nor taken for idle samples), and an idle multiple's
    /// idle p99 is measured again on the new path, the controller holding SafeUtil until
    /// it is, as at start; an absolute Target99 stays.
    pub fn reference_path_changed(&mut self, now: Duration) -> Result<(), LoopError> {
        let now = self.advance(now);
        self.restart_window(now);
        for (_, probe) in &mut self.probes {
            probe.idle_epoch = None;
        }
        if let Target99::IdleMultiple(_) = self.config.target {
            self.idle_p99 = None;
            self.baseline = None;
            self.set_target(now, self.config.target)?;
        }
        Ok(())
    }

    pub(super) fn restart_window(&mut self, now: Duration) {
        self.estimator.clear();
        self.forget_before = now;
    }
}
