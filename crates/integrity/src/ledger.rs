//! Exactly-once accounting of completions when several queue pairs share one send CQ.
//! Pure: no verbs, so the accounting itself is unit-tested.
//!
//! Every signaled request is entered before it is posted ([`Ledger::expect`]), keyed by
//! its queue pair and `wr_id`; the thread that polls the shared CQ enters every completion
//! ([`Ledger::complete`]). At the end each expected request must have completed exactly
//! once, and no completion may name a request that was never posted.

use std::collections::HashMap;

/// Why a completion does not fit the ledger.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LedgerFault {
    /// The request completed more often than it was posted.
    #[error("wr_id {wr_id:#x} on QP {qp:#x} completed {times} times, posted {posted}")]
    Duplicate {
        /// The queue pair number.
        qp: u32,
        /// The request.
        wr_id: u64,
        /// Completions so far, this one included.
        times: u32,
        /// Times it was posted.
        posted: u32,
    },
    /// No request with this identity was ever posted.
    #[error("a completion for wr_id {wr_id:#x} on QP {qp:#x}, which was never posted")]
    Unknown {
        /// The queue pair number.
        qp: u32,
        /// The `wr_id` the completion carries.
        wr_id: u64,
    },
}

/// What the ledger holds at the end of a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerSummary {
    /// Signaled requests posted.
    pub expected: u64,
    /// Requests that completed exactly as often as they were posted.
    pub exact: u64,
    /// Requests that completed fewer times than posted (each missing completion counts).
    pub missing: u64,
    /// Completions beyond the number of posts.
    pub duplicates: u64,
    /// Completions of requests never posted.
    pub unknown: u64,
}

impl LedgerSummary {
    /// True when every posted request completed exactly once and nothing else completed.
    pub fn exactly_once(&self) -> bool {
        self.missing == 0
            && self.duplicates == 0
            && self.unknown == 0
            && self.exact == self.expected
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    posted: u32,
    completed: u32,
}

/// Posted and completed counts per `(queue pair, wr_id)`.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: HashMap<(u32, u64), Entry>,
    unknown: u64,
    duplicates: u64,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// A signaled request is about to be posted on `qp`.
    pub fn expect(&mut self, qp: u32, wr_id: u64) {
        self.entries.entry((qp, wr_id)).or_default().posted += 1;
    }

    /// A completion for `wr_id` on `qp` arrived. It is counted whatever it is; a duplicate
    /// or unknown one is also returned as a fault.
    pub fn complete(&mut self, qp: u32, wr_id: u64) -> Result<(), LedgerFault> {
        let Some(e) = self.entries.get_mut(&(qp, wr_id)) else {
            self.unknown += 1;
            return Err(LedgerFault::Unknown { qp, wr_id });
        };
        e.completed += 1;
        if e.completed > e.posted {
            self.duplicates += 1;
            return Err(LedgerFault::Duplicate {
                qp,
                wr_id,
                times: e.completed,
                posted: e.posted,
            });
        }
        Ok(())
    }

    /// The counts so far.
    pub fn summary(&self) -> LedgerSummary {
        let mut s = LedgerSummary {
            duplicates: self.duplicates,
            unknown: self.unknown,
            ..LedgerSummary::default()
        };
        for e in self.entries.values() {
            s.expected += u64::from(e.posted);
            if e.completed == e.posted {
                s.exact += u64::from(e.posted);
            } else {
                s.exact += u64::from(e.completed.min(e.posted));
                s.missing += u64::from(e.posted.saturating_sub(e.completed));
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_request_completed_once_is_exact() {
        let mut l = Ledger::new();
        for qp in [1, 2] {
            for id in 0..10 {
                l.expect(qp, id);
            }
        }
        for id in (0..10).rev() {
            assert_eq!(l.complete(2, id), Ok(()));
            assert_eq!(l.complete(1, id), Ok(()));
        }
        let s = l.summary();
        assert_eq!(
            s,
            LedgerSummary {
                expected: 20,
                exact: 20,
                ..LedgerSummary::default()
            }
        );
        assert!(s.exactly_once());
    }

    #[test]
    fn the_same_wr_id_on_two_qps_is_two_requests() {
        let mut l = Ledger::new();
        l.expect(7, 42);
        l.expect(8, 42);
        assert_eq!(l.complete(7, 42), Ok(()));
        // The second QP's completion is not a duplicate of the first's ...
        assert_eq!(l.complete(8, 42), Ok(()));
        // ... but a third one is.
        assert!(matches!(
            l.complete(8, 42),
            Err(LedgerFault::Duplicate {
                qp: 8,
                times: 2,
                posted: 1,
                ..
            })
        ));
        let s = l.summary();
        assert_eq!((s.expected, s.duplicates, s.missing), (2, 1, 0));
        assert!(!s.exactly_once());
    }

    #[test]
    fn missing_and_unknown_completions_are_counted() {
        let mut l = Ledger::new();
        l.expect(1, 5);
        l.expect(1, 6);
        l.expect(1, 6); // the same wr_id posted twice: two completions owed
        assert_eq!(l.complete(1, 6), Ok(()));
        assert_eq!(
            l.complete(1, 9),
            Err(LedgerFault::Unknown { qp: 1, wr_id: 9 })
        );
        assert_eq!(
            l.complete(2, 5),
            Err(LedgerFault::Unknown { qp: 2, wr_id: 5 })
        );
        let s = l.summary();
        assert_eq!(
            s,
            LedgerSummary {
                expected: 3,
                exact: 1,
                missing: 2,
                duplicates: 0,
                unknown: 2,
            }
        );
        assert!(!s.exactly_once());
        assert_eq!(l.complete(1, 6), Ok(()));
        assert_eq!(l.complete(1, 5), Ok(()));
        // Nothing is missing any more, but the unknown completions stay on the books.
        let s = l.summary();
        assert_eq!((s.exact, s.missing, s.unknown), (3, 0, 2));
        assert!(!s.exactly_once());
    }

    #[test]
    fn an_empty_ledger_is_exact_and_a_lone_completion_is_not() {
        let mut l = Ledger::new();
        assert!(l.summary().exactly_once());
        assert!(l.complete(3, 3).is_err());
        assert!(!l.summary().exactly_once());
    }
}
