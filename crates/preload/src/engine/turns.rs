//! Turns among the process's shaped QPs (`JUSTITIA_QP_TURNS`): the core's
//! [`QueueTurns`] keyed by QP, asked by every drain.
//!
//! A QP posts only while it holds a turn (see [`QueueTurns`]); one in line keeps its
//! requests queued in software and is woken through the pacer, due at once, when a turn
//! comes to it. With turns the QPs have no fast lane: every request is queued and drained,
//! so that no post goes around them.
//!
//! Locks: the turns' lock is a leaf, taken under a QP's lock by its drain and by its
//! destroy, never while waiting; a QP let in is woken after the caller has released the
//! QP's lock.

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
    turns: parking_lot::Mutex<QueueTurns<TurnQp>>,
}

impl Turns {
    /// Turns under `budget`, nobody holding or waiting.
    pub(super) fn new(budget: TurnBudget) -> Self {
        Turns {
            turns: parking_lot::Mutex::new(QueueTurns::new(budget)),
        }
    }

    /// Whether `qp`, which has requests to post, holds a turn: `Ok`. If not it waits in
    /// line (counted in `counters` the first time, or as a yield when it gave a spent
    /// turn up now), and `Err` carries the QP let in, to be woken.
    pub(super) fn may_post(
        &self,
        qp: &QpShared,
        counters: &Counters,
    ) -> Result<(), Option<Arc<QpShared>>> {
        let mut turns = self.turns.lock();
        match turns.request(&TurnQp(qp.me.clone())) {
            Turn::Held => Ok(()),
            Turn::Queued => {
                Counters::add(&counters.turn_waits, 1);
                Err(None)
            }
            Turn::Waiting => Err(None),
            Turn::Yielded(next) => {
                Counters::add(&counters.turn_yields, 1);
                Err(Self::live(&mut turns, Some(next)))
            }
        }
    }

    /// The first live QP from `woken` on: a QP let in that is gone passes its turn on.
    fn live(turns: &mut QueueTurns<TurnQp>, mut woken: Option<TurnQp>) -> Option<Arc<QpShared>> {
        loop {
            let next = woken.take()?;
            match next.0.upgrade() {
                Some(qp) => return Some(qp),
                None => woken = turns.leave(&next),
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
        let mut turns = self.turns.lock();
        let woken = turns.posted(&me, bytes, more);
        if more && woken.is_some() {
            Counters::add(&counters.turn_yields, 1);
        }
        Self::live(&mut turns, woken)
    }

    /// `qp` is being destroyed: it leaves the line or gives its turn back. Returns the QP
    /// let in, to be woken.
    pub(super) fn leave(&self, qp: &QpShared) -> Option<Arc<QpShared>> {
        let mut turns = self.turns.lock();
        let woken = turns.leave(&TurnQp(qp.me.clone()));
        Self::live(&mut turns, woken)
    }
}
