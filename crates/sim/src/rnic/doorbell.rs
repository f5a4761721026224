//! The RNIC's doorbell engine (step 1's shared resource): one engine per RNIC takes every
//! queue pair's doorbells in the order they arrive, spends `rnic.doorbell_process_ns` on
//! each, and `rnic.wqe_fetch_ns` on each WQE it must fetch (one not posted inline). WQEs
//! posted to a queue pair together, a post list, ring one doorbell. Husky (NSDI'23, §4)
//! finds the WQE and doorbell processing shared among tenants: one that rings a doorbell
//! per small fetched WQE keeps the engine busy and delays everyone's WQEs.
//!
//! Invariant: `free` is when the engine finished the last doorbell or WQE it took, and
//! never decreases; an engine with both costs 0 is not modelled, and then `take` returns
//! the arrival unchanged without keeping anything.

use crate::time::Picos;

/// One RNIC's doorbell engine.
#[derive(Clone, Copy, Debug)]
pub(super) struct DoorbellEngine {
    /// Time per doorbell.
    doorbell: Picos,
    /// Time per fetched WQE.
    fetch: Picos,
    /// When it finished the last work it took.
    free: Picos,
}

impl DoorbellEngine {
    /// An engine spending `doorbell` per doorbell and `fetch` per fetched WQE.
    pub(super) fn new(doorbell: Picos, fetch: Picos) -> Self {
        DoorbellEngine {
            doorbell,
            fetch,
            free: 0,
        }
    }

    /// A WQE reaches the RNIC at `arrives`, with a doorbell of its own (`rings`, false for
    /// the later WQEs of a post list) and to be fetched unless inline (`fetched`): returns
    /// when the engine is through with it.
    pub(super) fn take(&mut self, arrives: Picos, rings: bool, fetched: bool) -> Picos {
        let work = if rings { self.doorbell } else { 0 } + if fetched { self.fetch } else { 0 };
        if self.doorbell == 0 && self.fetch == 0 {
            return arrives;
        }
        let done = self.free.max(arrives) + work;
        self.free = done;
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time;

    /// 20 ns a doorbell, 30 ns a fetched WQE. At 0: a fetched WQE with its doorbell, done
    /// at 50 ns; at 10 ns an inline one with its doorbell waits for it: 50 + 20 = 70 ns;
    /// at 10 ns a fetched WQE of the same post list: 70 + 30 = 100 ns; at 500 ns an inline
    /// WQE of a list finds the engine idle and costs nothing: 500 ns.
    #[test]
    fn the_engine_serves_doorbells_and_fetches_in_turn() {
        let ns = time::from_ns;
        let mut e = DoorbellEngine::new(ns(20.0), ns(30.0));
        assert_eq!(e.take(0, true, true), ns(50.0));
        assert_eq!(e.take(ns(10.0), true, false), ns(70.0));
        assert_eq!(e.take(ns(10.0), false, true), ns(100.0));
        assert_eq!(e.take(ns(500.0), false, false), ns(500.0));
    }

    #[test]
    fn an_engine_without_costs_changes_nothing() {
        let mut e = DoorbellEngine::new(0, 0);
        assert_eq!(e.take(7, true, true), 7);
        assert_eq!(e.take(3, true, true), 3);
    }
}
