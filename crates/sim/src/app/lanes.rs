//! Queue pairs that each keep copies of one request outstanding: the common engine of the
//! bandwidth and throughput flows, which differ only in how many they post at a time and
//! how they learn of completions.

use std::collections::VecDeque;

use super::{AppIo, Connection};
use crate::rnic::{QpId, WorkRequest};
use crate::time::Picos;

/// One queue pair of the flow.
struct Lane {
    conn: Connection,
    /// When each outstanding request was posted, oldest first (they complete in order).
    posted_at: VecDeque<Picos>,
    /// A refill timer is already set for this lane.
    refill_pending: bool,
}

/// A flow's queue pairs, each keeping up to `depth` copies of one request outstanding and
/// posting them `batch` at a time (one post list) whenever a whole batch fits. Tags count
/// up over all lanes, so that every request of the flow has its own.
pub(crate) struct Lanes {
    lanes: Vec<Lane>,
    /// Each lane's requester queue pair with the lane's index, sorted by queue pair: a
    /// completion finds its lane in log time among thousands of queue pairs.
    by_qp: Vec<(QpId, usize)>,
    wr: WorkRequest,
    batch: usize,
    depth: usize,
    next_tag: u64,
    stopped: bool,
}

impl Lanes {
    /// One lane per connection; `depth` is raised to `batch` if below it.
    pub(crate) fn new(conns: Vec<Connection>, wr: WorkRequest, batch: usize, depth: usize) -> Self {
        let mut by_qp: Vec<(QpId, usize)> = conns
            .iter()
            .enumerate()
            .map(|(lane, conn)| (conn.client, lane))
            .collect();
        by_qp.sort_unstable();
        Lanes {
            by_qp,
            lanes: conns
                .into_iter()
                .map(|conn| Lane {
                    conn,
                    posted_at: VecDeque::new(),
                    refill_pending: false,
                })
                .collect(),
            wr,
            batch,
            depth: depth.max(batch),
            next_tag: 0,
            stopped: false,
        }
    }

    /// The lane whose requester queue pair is `qp`.
    pub(crate) fn of_qp(&self, qp: QpId) -> Option<usize> {
        let at = self.by_qp.binary_search_by_key(&qp, |e| e.0).ok()?;
        Some(self.by_qp[at].1)
    }

    /// Posts nothing more from now on.
    pub(crate) fn stop(&mut self) {
        self.stopped = true;
    }

    /// Posts again after [`Lanes::stop`] (a pause ends).
    pub(crate) fn resume(&mut self) {
        self.stopped = false;
    }

    /// Posts whole batches on `lane` while they fit under the depth.
    pub(crate) fn refill(&mut self, io: &mut AppIo<'_>, lane: usize) {
        if self.stopped {
            return;
        }
        let now = io.now();
        let Some(l) = self.lanes.get_mut(lane) else {
            return;
        };
        while l.posted_at.len() + self.batch <= self.depth {
            for _ in 0..self.batch {
                self.next_tag += 1;
                io.post(
                    l.conn.client,
                    WorkRequest {
                        tag: self.next_tag,
                        ..self.wr
                    },
                );
                l.posted_at.push_back(now);
            }
        }
    }

    /// Refills every lane.
    pub(crate) fn refill_all(&mut self, io: &mut AppIo<'_>) {
        for lane in 0..self.lanes.len() {
            self.refill(io, lane);
        }
    }

    /// The refill timer of `lane` (tag: the lane's index) fired: refills it.
    pub(crate) fn on_refill_timer(&mut self, io: &mut AppIo<'_>, lane: usize) {
        if let Some(l) = self.lanes.get_mut(lane) {
            l.refill_pending = false;
            self.refill(io, lane);
        }
    }

    /// Sets the refill timer of `lane` for `at`, unless one is set already or a whole batch
    /// would not fit yet.
    pub(crate) fn schedule_refill(&mut self, io: &mut AppIo<'_>, lane: usize, at: Picos) {
        let (batch, depth) = (self.batch, self.depth);
        let Some(l) = self.lanes.get_mut(lane) else {
            return;
        };
        if !l.refill_pending && l.posted_at.len() + batch <= depth {
            l.refill_pending = true;
            io.timer(at, lane as u64);
        }
    }

    /// The oldest outstanding request of `lane` was seen complete at `seen`: records its
    /// post-to-completion time and the message.
    pub(crate) fn complete_oldest(&mut self, io: &mut AppIo<'_>, lane: usize, seen: Picos) {
        if let Some(posted) = self
            .lanes
            .get_mut(lane)
            .and_then(|l| l.posted_at.pop_front())
        {
            io.record_latency(seen, seen - posted);
            io.record_message(seen);
        }
    }
}
