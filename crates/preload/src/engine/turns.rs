//! Turns among the process's shaped QPs (`JUSTITIA_QP_TURNS`, or the daemon's share for
//! the process, the fewer of the two): the core's [`QueueTurns`] keyed by QP, asked by
//! every drain while turns are in force.
//!
//! A QP posts only while it holds a turn (see [`QueueTurns`]); one in line keeps its
//! requests queued in software and is woken through the pacer, due at once, when a turn
//! comes to it. With turns in force the QPs have no fast lane: every request is queued and
//! drained, so that no post goes around them. The budget may change at a follower's tick
//! (the daemon's share moves as tenants and processes come and go); the QPs that gains let
//! in, or all that waited when the turns end, are woken.
//!
//! Locks: the turns' lock is a leaf, taken under a QP's lock by its drain and by its
//! destroy, never while waiting; a QP let in is woken after the caller has released the
//! QP's lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use justitia_core::queue_turns::{QueueTurns, Turn, TurnBudget};

use super::QpShared;
use crate::stats::Counters;

/// A QP in the turns, by identity.
#[derive(Clone)]
struct TurnQp(Weak<QpShared>);

impl PartialEq for TurnQp {
    fn eq(&self, other: &Self) -> bool {
        Weak::ptr_eq(&self.0, &other.0)
    }
}

/// The turns of one process's shaped QPs.
pub(super) struct Turns {
    /// `None` while there are no turns.
    turns: parking_lot::Mutex<Option<QueueTurns<TurnQp>>>,
    /// Turns are in force: read without the lock by the drains and fast lanes, which take
    /// the lock only when set. A drain that read it just before a change posts as it would
    /// have a moment earlier; what it then tells the turns is checked under the lock.
    in_force: AtomicBool,
}

impl Turns {
    /// Turns under `budget` (`None`: none yet), nobody holding or waiting.
    pub(super) fn new(budget: Option<TurnBudget>) -> Self {
        Turns {
            in_force: AtomicBool::new(budget.is_some()),
            turns: parking_lot::Mutex::new(budget.map(QueueTurns::new)),
        }
    }

    /// Whether turns are in force now.
    #[inline(always)]
    pub(super) fn in_force(&self) -> bool {
        self.in_force.load(Ordering::Relaxed)
    }

    /// The budget in force, `None` with no turns.
    pub(super) fn budget(&self) -> Option<TurnBudget> {
        self.turns.lock().as_ref().map(QueueTurns::budget)
    }

    /// Puts `budget` in force (`None`: no turns). Returns the QPs let in, to be woken: the
    /// first waiters when turns are added, every waiter when the turns end.
    pub(super) fn set_budget(&self, budget: Option<TurnBudget>) -> Vec<Arc<QpShared>> {
        let mut turns = self.turns.lock();
        self.in_force.store(budget.is_some(), Ordering::Relaxed);
        let woken = match (turns.as_mut(), budget) {
            (Some(t), Some(b)) => t.set_budget(b),
            (Some(t), None) => t.release_all(),
            (None, b) => {
                *turns = b.map(QueueTurns::new);
                Vec::new()
            }
        };
        if budget.is_none() {
            *turns = None;
        }
        let mut live = Vec::new();
        for q in woken {
            live.extend(Self::live(turns.as_mut(), Some(q)));
        }
        live
    }

    /// Whether `qp`, which has requests to post, holds a turn: `Ok`. If not it waits in
    /// line (counted in `counters` the first time, or as a yield when it gave a spent
    /// turn up now), and `Err` carries the QP let in, to be woken.
    pub(super) fn may_post(
        &self,
        qp: &QpShared,
        counters: &Counters,
    ) -> Result<(), Option<Arc<QpShared>>> {
        let mut guard = self.turns.lock();
        let Some(turns) = guard.as_mut() else {
            return Ok(());
        };
        match turns.request(&TurnQp(qp.me.clone())) {
            Turn::Held => Ok(()),
            Turn::Queued => {
                Counters::add(&counters.turn_waits, 1);
                Err(None)
            }
            Turn::Waiting => Err(None),
            Turn::Yielded(next) => {
                Counters::add(&counters.turn_yields, 1);
                Err(Self::live(Some(turns), Some(next)))
            }
        }
    }

    /// The first live QP from `woken` on: a QP let in that is gone passes its turn on
    /// (when there are turns still).
    fn live(
        mut turns: Option<&mut QueueTurns<TurnQp>>,
        mut woken: Option<TurnQp>,
    ) -> Option<Arc<QpShared>> {
        loop {
            let next = woken.take()?;
            match next.0.upgrade() {
                Some(qp) => return Some(qp),
                None => woken = turns.as_deref_mut().and_then(|t| t.leave(&next)),
            }
        }
    }

    /// `qp` posted `bytes` in a drain and has `more` requests left: it gives its turn back
    /// when it has none, or yields it to a waiter when its turn is spent (counted in
    /// `counters`). Returns the QP let in, to be woken.
    pub(super) fn posted(
        &self,
        qp: &QpShared,
        bytes: u64,
        more: bool,
        counters: &Counters,
    ) -> Option<Arc<QpShared>> {
        let me = TurnQp(qp.me.clone());
        let mut guard = self.turns.lock();
        let turns = guard.as_mut()?;
        let woken = turns.posted(&me, bytes, more);
        if more && woken.is_some() {
            Counters::add(&counters.turn_yields, 1);
        }
        Self::live(Some(turns), woken)
    }

    /// `qp` is being destroyed: it leaves the line or gives its turn back. Returns the QP
    /// let in, to be woken.
    pub(super) fn leave(&self, qp: &QpShared) -> Option<Arc<QpShared>> {
        let mut guard = self.turns.lock();
        let turns = guard.as_mut()?;
        let woken = turns.leave(&TurnQp(qp.me.clone()));
        Self::live(Some(turns), woken)
    }
}
