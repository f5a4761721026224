//! Turns among one process's queue pairs: at most a budget of them post at a time.
//!
//! An RNIC caches a bounded number of queue-pair contexts (Husky, NSDI'23; the
//! `qp_cache_entries` of a profile). A process that keeps hundreds of queue pairs busy at
//! once makes the RNIC fetch contexts over PCIe for nearly every message, and evicts the
//! contexts every other tenant depends on. [`crate::adaptive::TenantRoundRobin`] bounds
//! the queues a tenant is served from in the model; [`QueueTurns`] is the same bound where
//! a shaper enforces it, among the queue pairs of its process: a queue pair posts only
//! while it holds one of `open` turns, gives its turn back when it has nothing left to
//! post, and after `turn_bytes` in one turn yields it to the first queue pair waiting, then
//! waits at the back itself. The RNIC then holds about `open` of the process's contexts
//! at a time, and they change once per turn, not once per message.
//!
//! Invariants:
//! - at most `open` queues hold a turn, also after the budget changed;
//! - a queue is either holding, or waiting, or neither; never both, never twice;
//! - waiters are let in in the order they asked (first in, first out), and every turn
//!   that frees while some queue waits goes to the first waiter, which the caller is told
//!   to wake: a waiter never stays behind a free turn.

use std::collections::VecDeque;

/// How many queues may hold a turn at once, and how long a turn lasts while others wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnBudget {
    /// Queues that may post at once (at least one).
    pub open: usize,
    /// Bytes a queue may post in one turn while another waits (at least one).
    pub turn_bytes: u64,
}

/// One process's share of the host's `host_open` turns (set to the RNIC's QP-context
/// cache entries, so that the queue pairs all tenants post on at once fit in it): its
/// tenant's weighted share (its `weight` of the `total_weight` of the tenants connected),
/// split evenly among the tenant's `processes`, rounded down and at least one, each turn
/// `turn_bytes` long (at least one).
///
/// `None` when there is nothing to enforce: no host budget (0) or no weight.
pub fn tenant_turn_budget(
    host_open: u32,
    turn_bytes: u64,
    weight: u32,
    total_weight: u64,
    processes: u32,
) -> Option<TurnBudget> {
    if host_open == 0 || weight == 0 {
        return None;
    }
    // A total below the tenant's own weight is a caller's slip; the tenant is then alone.
    let total = u128::from(total_weight.max(u64::from(weight)));
    let share = u128::from(host_open) * u128::from(weight) / total / u128::from(processes.max(1));
    Some(TurnBudget {
        // At most `host_open`, which fits.
        open: usize::try_from(share).unwrap_or(usize::MAX).max(1),
        turn_bytes: turn_bytes.max(1),
    })
}

/// One holder of a turn.
#[derive(Clone, Debug)]
struct Holder<Q> {
    queue: Q,
    /// Bytes posted since its turn began.
    spent: u64,
}

/// The turns of one process's queues `Q` (compared with `==`: a queue's identity).
#[derive(Clone, Debug)]
pub struct QueueTurns<Q> {
    budget: TurnBudget,
    holders: Vec<Holder<Q>>,
    waiting: VecDeque<Q>,
}

/// What [`QueueTurns::request`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn<Q> {
    /// The queue holds a turn: it may post.
    Held,
    /// The queue was put in line now; it is woken when its turn comes.
    Queued,
    /// The queue was in line already.
    Waiting,
    /// The queue had spent its turn while another waited: it yielded it to that one (to
    /// be woken) and is at the back of the line now.
    Yielded(Q),
}

impl<Q: Clone + PartialEq> QueueTurns<Q> {
    /// No queue holding or waiting, under `budget` (zeros count as one).
    pub fn new(budget: TurnBudget) -> Self {
        QueueTurns {
            budget: Self::floor(budget),
            holders: Vec::new(),
            waiting: VecDeque::new(),
        }
    }

    fn floor(b: TurnBudget) -> TurnBudget {
        TurnBudget {
            open: b.open.max(1),
            turn_bytes: b.turn_bytes.max(1),
        }
    }

    /// The budget in force.
    pub fn budget(&self) -> TurnBudget {
        self.budget
    }

    /// Queues holding a turn.
    pub fn holding(&self) -> usize {
        self.holders.len()
    }

    /// Queues waiting for one.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// `queue` has something to post: [`Turn::Held`] if it holds a turn it has not spent
    /// (or nobody waits), or one is free and nobody waits for it; else it waits in line
    /// (put there once), after yielding a spent turn to the first waiter.
    pub fn request(&mut self, queue: &Q) -> Turn<Q> {
        if let Some(at) = self.holders.iter().position(|h| h.queue == *queue) {
            if self.holders[at].spent < self.budget.turn_bytes || self.waiting.is_empty() {
                return Turn::Held;
            }
            let yielded = self.holders.swap_remove(at).queue;
            let woken = self.admit_first();
            self.waiting.push_back(yielded);
            return woken.map_or(Turn::Waiting, Turn::Yielded);
        }
        if self.waiting.is_empty() && self.holders.len() < self.budget.open {
            self.holders.push(Holder {
                queue: queue.clone(),
                spent: 0,
            });
            return Turn::Held;
        }
        if self.waiting.contains(queue) {
            return Turn::Waiting;
        }
        self.waiting.push_back(queue.clone());
        Turn::Queued
    }

    /// `queue` posted `bytes` in its turn and has `more` left to post. A queue with nothing
    /// left gives its turn back; one that has spent its turn while another waits yields
    /// it and goes to the back of the line. Returns the waiter let in, to be woken.
    pub fn posted(&mut self, queue: &Q, bytes: u64, more: bool) -> Option<Q> {
        let at = self.holders.iter().position(|h| h.queue == *queue)?;
        let h = &mut self.holders[at];
        h.spent = h.spent.saturating_add(bytes);
        if !more {
            self.holders.swap_remove(at);
            return self.admit_first();
        }
        if h.spent < self.budget.turn_bytes || self.waiting.is_empty() {
            return None;
        }
        let yielded = self.holders.swap_remove(at).queue;
        let woken = self.admit_first();
        self.waiting.push_back(yielded);
        woken
    }

    /// `queue` is gone (destroyed): it leaves the line or gives its turn back. Returns the
    /// waiter let in, to be woken.
    pub fn leave(&mut self, queue: &Q) -> Option<Q> {
        self.waiting.retain(|q| q != queue);
        let at = self.holders.iter().position(|h| h.queue == *queue)?;
        self.holders.swap_remove(at);
        self.admit_first()
    }

    /// Puts `budget` in force (zeros count as one). More turns let the first waiters in,
    /// who are returned, to be woken. Fewer turns take them from the latest holders, which
    /// go to the front of the line in the order they held (so that at most `open` hold,
    /// and those that lost a turn are the first to get one back); a holder posting when it
    /// loses its turn finds out at its next [`Self::request`].
    pub fn set_budget(&mut self, budget: TurnBudget) -> Vec<Q> {
        self.budget = Self::floor(budget);
        if self.holders.len() > self.budget.open {
            for h in self.holders.drain(self.budget.open..).rev() {
                self.waiting.push_front(h.queue);
            }
        }
        std::iter::from_fn(|| self.admit_first()).collect()
    }

    /// Ends the turns: every waiter is returned, to be woken, and nobody holds a turn.
    pub fn release_all(&mut self) -> Vec<Q> {
        self.holders.clear();
        self.waiting.drain(..).collect()
    }

    /// Lets the first waiter in when a turn is free.
    fn admit_first(&mut self) -> Option<Q> {
        if self.holders.len() >= self.budget.open {
            return None;
        }
        let q = self.waiting.pop_front()?;
        self.holders.push(Holder {
            queue: q.clone(),
            spent: 0,
        });
        Some(q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turns(open: usize, turn_bytes: u64) -> QueueTurns<u32> {
        QueueTurns::new(TurnBudget { open, turn_bytes })
    }

    #[test]
    fn queues_beyond_the_budget_wait_in_order_and_are_let_in_as_turns_free() {
        let mut t = turns(2, 1000);
        assert_eq!(t.request(&1), Turn::Held);
        assert_eq!(t.request(&2), Turn::Held);
        assert_eq!(t.request(&3), Turn::Queued);
        assert_eq!(t.request(&4), Turn::Queued);
        // Asking again keeps its place.
        assert_eq!(t.request(&3), Turn::Waiting);
        assert_eq!((t.holding(), t.waiting()), (2, 2));
        // 2 runs out of work: 3, the first in line, is let in; 4 still waits.
        assert_eq!(t.posted(&2, 10, false), Some(3));
        assert_eq!(t.request(&3), Turn::Held);
        assert_eq!(t.request(&4), Turn::Waiting);
        assert_eq!(t.leave(&1), Some(4));
        assert_eq!((t.holding(), t.waiting()), (2, 0));
    }

    #[test]
    fn a_spent_turn_is_yielded_only_to_a_waiter() {
        let mut t = turns(1, 1000);
        assert_eq!(t.request(&1), Turn::Held);
        // Nobody waits: the turn lasts past its bytes.
        assert_eq!(t.posted(&1, 5000, true), None);
        assert_eq!(t.request(&2), Turn::Queued);
        // 1 has spent its turn and 2 waits: 2 goes in, 1 to the back of the line.
        assert_eq!(t.posted(&1, 1, true), Some(2));
        assert_eq!(t.request(&1), Turn::Waiting);
        // 2's turn starts from nothing: 999 bytes keep it.
        assert_eq!(t.posted(&2, 999, true), None);
        assert_eq!(t.posted(&2, 1, true), Some(1));
        assert_eq!((t.holding(), t.waiting()), (1, 1));
    }

    #[test]
    fn a_spent_turn_is_yielded_when_its_holder_asks_again() {
        let mut t = turns(1, 1000);
        assert_eq!(t.request(&1), Turn::Held);
        // Spent while nobody waited: kept.
        assert_eq!(t.posted(&1, 1000, true), None);
        assert_eq!(t.request(&1), Turn::Held);
        assert_eq!(t.request(&2), Turn::Queued);
        // Asking again now, 1 yields to 2 without posting.
        assert_eq!(t.request(&1), Turn::Yielded(2));
        assert_eq!(t.request(&1), Turn::Waiting);
        assert_eq!(t.request(&2), Turn::Held);
    }

    #[test]
    fn a_newcomer_does_not_overtake_the_line() {
        let mut t = turns(1, 1000);
        assert_eq!(t.request(&1), Turn::Held);
        assert_eq!(t.request(&2), Turn::Queued);
        assert_eq!(t.posted(&1, 1, false), Some(2));
        assert_eq!(t.request(&2), Turn::Held);
        assert_eq!(t.request(&3), Turn::Queued);
    }

    #[test]
    fn a_queue_that_leaves_the_line_is_never_woken() {
        let mut t = turns(1, 1000);
        t.request(&1);
        t.request(&2);
        t.request(&3);
        assert_eq!(t.leave(&2), None);
        assert_eq!(t.posted(&1, 1, false), Some(3));
        assert_eq!(t.posted(&7, 1, false), None, "not a holder");
    }

    #[test]
    fn more_turns_let_the_first_waiters_in() {
        let mut t = turns(1, 1000);
        for q in 1..=4 {
            t.request(&q);
        }
        assert_eq!(
            t.set_budget(TurnBudget {
                open: 3,
                turn_bytes: 1000
            }),
            vec![2, 3]
        );
        assert_eq!((t.holding(), t.waiting()), (3, 1));
        assert_eq!(t.request(&3), Turn::Held);
        assert_eq!(t.request(&4), Turn::Waiting);
    }

    #[test]
    fn fewer_turns_put_the_latest_holders_first_in_line() {
        let mut t = turns(4, 1000);
        for q in 1..=5 {
            t.request(&q);
        }
        assert_eq!(
            t.set_budget(TurnBudget {
                open: 2,
                turn_bytes: 1000
            }),
            vec![]
        );
        assert_eq!((t.holding(), t.waiting()), (2, 3));
        assert_eq!(t.request(&1), Turn::Held);
        assert_eq!(t.request(&3), Turn::Waiting);
        // Those that lost their turn come back first, in the order they held, before 5.
        assert_eq!(t.posted(&1, 1, false), Some(3));
        assert_eq!(t.posted(&2, 1, false), Some(4));
        assert_eq!(t.leave(&3), Some(5));
    }

    #[test]
    fn releasing_all_returns_every_waiter_and_frees_every_turn() {
        let mut t = turns(1, 1000);
        for q in 1..=3 {
            t.request(&q);
        }
        assert_eq!(t.release_all(), vec![2, 3]);
        assert_eq!((t.holding(), t.waiting()), (0, 0));
        assert_eq!(t.posted(&1, 1, false), None, "1 holds no turn any more");
    }

    #[test]
    fn a_tenant_has_its_weighted_share_of_the_hosts_turns_split_among_its_processes() {
        let b = |open, weight, total, processes| {
            tenant_turn_budget(open, 1 << 20, weight, total, processes).map(|b| b.open)
        };
        // 256 contexts, weights 3 of 4: 192, over 2 processes 96 each.
        assert_eq!(b(256, 3, 4, 2), Some(96));
        // Rounded down, never below one.
        assert_eq!(b(256, 1, 3, 1), Some(85));
        assert_eq!(b(10, 1, 1000, 4), Some(1));
        // A total below the tenant's weight is taken as the tenant alone.
        assert_eq!(b(64, 5, 1, 1), Some(64));
        // Weights near u32::MAX do not overflow.
        assert_eq!(b(100, u32::MAX, 2 * u64::from(u32::MAX), 1), Some(50));
        assert_eq!(b(0, 1, 1, 1), None, "no host budget: no turns");
        assert_eq!(b(64, 0, 1, 1), None, "no weight: no turns");
        assert_eq!(
            tenant_turn_budget(64, 0, 1, 1, 1).map(|b| b.turn_bytes),
            Some(1),
            "a turn is at least one byte"
        );
    }

    #[test]
    fn zeros_count_as_one() {
        let t = turns(0, 0);
        assert_eq!(
            t.budget(),
            TurnBudget {
                open: 1,
                turn_bytes: 1
            }
        );
    }
}
