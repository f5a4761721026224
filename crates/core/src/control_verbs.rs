//! Control verbs: how many memory registrations and queue-pair creations a tenant may
//! issue, and when each may go.
//!
//! Husky (NSDI'23) shows one tenant's storm of control verbs (`ibv_reg_mr`,
//! `ibv_create_qp`) hurting every other tenant of the RNIC: each one runs on the RNIC's
//! one control path and puts its entries into the caches of memory translations and
//! queue-pair contexts that every tenant's data verbs depend on, evicting theirs. No
//! bandwidth share sees it, since a storm moves no data. So a host has a budget of control
//! verbs per second, shared among its tenants by weight like the link ([`tenant_budget`]),
//! and each process's share of its tenant's budget is enforced where the verb is called
//! ([`ControlVerbPacer`]): a storm waits for its own budget, while a tenant that registers
//! now and then finds its budget full and waits for nothing.
//!
//! The budget is not work-conserving on purpose: what a storm wears out (cache entries)
//! is not visible as idle capacity, so a tenant alone on the host still gets only its
//! share of the host's budget, and the host's budget is the rate the operator states the
//! RNIC tolerates.
//!
//! Invariants: over any interval `d`, a pacer admits at most `per_sec x d + burst` verbs;
//! a verb is never refused, only told how long to wait, and the waits of verbs issued
//! together (by several threads) are handed out in order of arrival, one interval apart.

use std::time::Duration;

/// The verbs a budget covers: what allocates an RNIC object with cache entries. Releasing
/// one (`ibv_dereg_mr`, `ibv_destroy_qp`) is never paced: it frees what the storm took, and
/// an application tearing down must not wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ControlVerb {
    /// `ibv_reg_mr` and its variants: one MPT entry and the region's MTT entries.
    RegMr,
    /// `ibv_create_qp` and `ibv_create_qp_ex`: one queue-pair context.
    CreateQp,
}

/// A rate of control verbs and the burst that may go at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ControlVerbBudget {
    /// Verbs per second (positive and finite).
    pub per_sec: f64,
    /// Verbs that may go back to back after a quiet period (at least 1).
    pub burst: u32,
}

impl ControlVerbBudget {
    /// The time between two verbs at this rate, at least 1 ns.
    pub fn interval(&self) -> Duration {
        let ns = 1e9 / self.per_sec;
        if ns.is_finite() && ns >= 1.0 {
            Duration::from_nanos(ns.min(u64::MAX as f64) as u64)
        } else {
            Duration::from_nanos(1)
        }
    }
}

/// One process's share of the host's control-verb budget: the tenant's weighted share of
/// `host_per_sec` (its `weight` of the `total_weight` of the tenants connected), split
/// evenly among the tenant's `processes`, each with `burst` (the burst is per process:
/// a process that registers its buffers at start-up does not wait for another's).
///
/// `None` when there is nothing to enforce: no host budget (0, negative or not finite), or
/// no weight.
pub fn tenant_budget(
    host_per_sec: f64,
    burst: u32,
    weight: u32,
    total_weight: u64,
    processes: u32,
) -> Option<ControlVerbBudget> {
    if !(host_per_sec.is_finite() && host_per_sec > 0.0) || weight == 0 {
        return None;
    }
    // A total below the tenant's own weight is a caller's slip; the tenant is then alone.
    let total = total_weight.max(u64::from(weight)) as f64;
    let per_sec = host_per_sec * f64::from(weight) / total / f64::from(processes.max(1));
    Some(ControlVerbBudget {
        per_sec,
        burst: burst.max(1),
    })
}

/// When a verb may go: a virtual-scheduling token bucket (the generic cell rate
/// algorithm). It keeps the time the next verb would be due at the rate if none were
/// early; a verb arriving at `now` goes at `max(now, due - (burst - 1) x interval)` and
/// moves `due` one interval on. Waits are reserved at arrival, so verbs issued together
/// each get their own turn.
#[derive(Debug, Clone)]
pub struct ControlVerbPacer {
    budget: Option<ControlVerbBudget>,
    /// When the next verb would be due at the rate (`None`: nothing admitted yet).
    due: Option<Duration>,
    admitted: u64,
    delayed: u64,
    waited: Duration,
}

/// What [`ControlVerbPacer::admit`] decided for one verb.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// How long the caller waits before issuing the verb (zero: at once).
    pub wait: Duration,
}

/// Running counts of a pacer's decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ControlVerbCounts {
    /// Verbs admitted, at once or after a wait.
    pub admitted: u64,
    /// Verbs told to wait.
    pub delayed: u64,
    /// The sum of the waits handed out.
    pub waited: Duration,
}

impl ControlVerbPacer {
    /// A pacer enforcing `budget` (`None`: admits everything at once).
    pub fn new(budget: Option<ControlVerbBudget>) -> Self {
        ControlVerbPacer {
            budget,
            due: None,
            admitted: 0,
            delayed: 0,
            waited: Duration::ZERO,
        }
    }

    /// The budget in force.
    pub fn budget(&self) -> Option<ControlVerbBudget> {
        self.budget
    }

    /// Changes the budget. Verbs already told to wait keep their turns; the next verb is
    /// due by the new rate from the old one's due time, so a lower rate holds from the next
    /// verb on and a higher one does not release a burst beyond its own. A budget taken
    /// away and given back (a daemon briefly stale) keeps the due time too, so the flap
    /// releases no burst.
    pub fn set_budget(&mut self, budget: Option<ControlVerbBudget>) {
        self.budget = budget;
    }

    /// One verb arrives at `now`: how long it waits.
    pub fn admit(&mut self, now: Duration) -> Admission {
        self.admitted += 1;
        let Some(b) = self.budget else {
            return Admission {
                wait: Duration::ZERO,
            };
        };
        let interval = b.interval();
        let tolerance = interval.saturating_mul(b.burst.max(1) - 1);
        let due = self.due.map_or(now, |d| d.max(now));
        let go = due.saturating_sub(tolerance).max(now);
        self.due = Some(due.saturating_add(interval));
        let wait = go - now;
        if !wait.is_zero() {
            self.delayed += 1;
            self.waited = self.waited.saturating_add(wait);
        }
        Admission { wait }
    }

    /// The decisions so far.
    pub fn counts(&self) -> ControlVerbCounts {
        ControlVerbCounts {
            admitted: self.admitted,
            delayed: self.delayed,
            waited: self.waited,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn budget(per_sec: f64, burst: u32) -> Option<ControlVerbBudget> {
        Some(ControlVerbBudget { per_sec, burst })
    }

    #[test]
    fn without_a_budget_nothing_waits() {
        let mut p = ControlVerbPacer::new(None);
        for _ in 0..10_000 {
            assert_eq!(p.admit(ms(1)).wait, Duration::ZERO);
        }
        assert_eq!(p.counts().admitted, 10_000);
        assert_eq!(p.counts().delayed, 0);
    }

    #[test]
    fn a_burst_goes_at_once_then_one_per_interval() {
        // 1000 verbs/s, burst 4: four at t=0, then 1 ms apart: the 5th waits 1 ms, the
        // 6th 2 ms, all issued at t=0.
        let mut p = ControlVerbPacer::new(budget(1000.0, 4));
        let waits: Vec<_> = (0..7).map(|_| p.admit(ms(0)).wait).collect();
        assert_eq!(
            waits,
            [ms(0), ms(0), ms(0), ms(0), ms(1), ms(2), ms(3)].to_vec()
        );
        let c = p.counts();
        assert_eq!((c.admitted, c.delayed, c.waited), (7, 3, ms(6)));
    }

    #[test]
    fn a_storm_is_held_to_the_rate_plus_the_burst() {
        // A storm at 500 verbs/s, burst 8, each verb issued 10 us after the previous one
        // went (the application blocks in the verb): the 8 of the burst go at once, then
        // verb k goes when it is due, at (k - 7) x 2 ms. Over [0, 1 s]: 8 + 500 verbs.
        let mut p = ControlVerbPacer::new(budget(500.0, 8));
        let mut now = Duration::ZERO;
        let mut went = 0u64;
        loop {
            let go = now + p.admit(now).wait;
            if go > ms(1000) {
                break;
            }
            went += 1;
            now = go + Duration::from_micros(10);
        }
        assert_eq!(went, 508);
    }

    #[test]
    fn a_quiet_tenant_waits_for_nothing() {
        // One verb every 100 ms at 100 verbs/s: far below the rate, never delayed.
        let mut p = ControlVerbPacer::new(budget(100.0, 1));
        for k in 0..50 {
            assert_eq!(p.admit(ms(100 * k)).wait, Duration::ZERO);
        }
        assert_eq!(p.counts().delayed, 0);
    }

    #[test]
    fn a_lower_rate_holds_from_the_next_verb() {
        let mut p = ControlVerbPacer::new(budget(1000.0, 1));
        assert_eq!(p.admit(ms(0)).wait, ms(0));
        p.set_budget(budget(100.0, 1));
        // Due at 1 ms (the old interval), then 10 ms apart.
        assert_eq!(p.admit(ms(0)).wait, ms(1));
        assert_eq!(p.admit(ms(0)).wait, ms(11));
        p.set_budget(None);
        assert_eq!(p.admit(ms(0)).wait, ms(0));
        // Given back, the budget goes on from where it was: the verb is due at 21 ms.
        p.set_budget(budget(100.0, 1));
        assert_eq!(p.admit(ms(0)).wait, ms(21));
    }

    #[test]
    fn the_host_budget_is_shared_by_weight_then_by_process() {
        // 3000 verbs/s, tenants of weight 1 and 2: the second gets 2000, its 4 processes
        // 500 each.
        let b = tenant_budget(3000.0, 16, 2, 3, 4).unwrap();
        assert_eq!(b.per_sec, 500.0);
        assert_eq!(b.burst, 16);
        assert_eq!(b.interval(), ms(2));
        let alone = tenant_budget(3000.0, 0, 1, 1, 0).unwrap();
        assert_eq!((alone.per_sec, alone.burst), (3000.0, 1));
        // A total below the tenant's weight counts the tenant alone.
        assert_eq!(tenant_budget(3000.0, 4, 5, 1, 1).unwrap().per_sec, 3000.0);
    }

    #[test]
    fn no_budget_without_a_host_rate_or_a_weight() {
        assert_eq!(tenant_budget(0.0, 4, 1, 1, 1), None);
        assert_eq!(tenant_budget(-5.0, 4, 1, 1, 1), None);
        assert_eq!(tenant_budget(f64::NAN, 4, 1, 1, 1), None);
        assert_eq!(tenant_budget(f64::INFINITY, 4, 1, 1, 1), None);
        assert_eq!(tenant_budget(1000.0, 4, 0, 1, 1), None);
    }

    #[test]
    fn extreme_rates_keep_a_positive_interval() {
        let fast = ControlVerbBudget {
            per_sec: 1e12,
            burst: 1,
        };
        assert_eq!(fast.interval(), Duration::from_nanos(1));
        let slow = ControlVerbBudget {
            per_sec: 1e-30,
            burst: 1,
        };
        assert!(slow.interval() > Duration::from_secs(1 << 30));
        let mut p = ControlVerbPacer::new(Some(slow));
        assert_eq!(p.admit(ms(0)).wait, ms(0));
        assert!(p.admit(ms(0)).wait > Duration::from_secs(1 << 30));
    }
}
