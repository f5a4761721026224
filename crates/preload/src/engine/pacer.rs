//! The pacer: the queue of QPs waiting for tokens (or for send-queue slots), and who
//! releases them when they are due: the application's own polls of a QP's send CQ while
//! it polls, else a thread of the engine (or, in tests, the caller of
//! [`Engine::pacer_tick`]).
//!
//! Locks: the queue's lock (`Pacer::queue`) is a leaf: nothing is taken under it, and no
//! QP is drained while it is held (the due QPs are taken out first). The thread drains a
//! QP under that QP's lock, waiting for it (it is no verb); a poll releasing QPs only tries
//! their locks (see `QpShared::drain_or_defer`). The thread holds no CQ's poll lock across
//! its loop: a QP blocked on slots has its send CQ polled one batch per turn of that lock.
//! The thread is started from a drain's aftermath, with no QP's or CQ's lock held.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::{nanos, CqShared, Engine, QpShared};
use crate::log::log;

/// Who drives the pacer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacerMode {
    /// A background thread, started when something first waits for tokens.
    Thread,
    /// The caller, through [`Engine::pacer_tick`] (tests with a virtual clock).
    Manual,
}

/// How long after a poll drained the pacer's queue the application counts as polling:
/// while it does, its polls release paced requests on time and the pacer thread only
/// stands behind them.
pub(super) const POLLS_DRIVE_FOR: Duration = Duration::from_millis(20);

/// How late behind the deadline the pacer thread wakes while polls drive pacing. Every
/// thread wake-up costs the host a context switch, and on a busy or emulated host it can
/// cost a co-located latency flow a scheduler tick, so a polling application should see
/// few of them; the tokens a request loses by waiting longer are owed back (see
/// [`justitia_core::pacer`]).
pub(super) const BACKSTOP_DELAY: Duration = Duration::from_millis(10);

/// How long a QP blocked on send-queue slots waits before the pacer polls its send CQ on
/// the application's behalf (see [`QpShared::progress`]).
pub(super) const SLOT_POLL_DELAY: Duration = Duration::from_millis(1);

/// The rate pacer's burst window: the release granularity of the pacer thread, which is
/// what releases paced requests when the application does not poll. Its timed wait returns
/// up to the thread's timer slack after the deadline (50 us by default on Linux), and the
/// wake-up itself takes some more; what accrues in between must fit in the burst, or the
/// cap throws it away and the flow loses rate (at 1 GB/s with 5 KiB chunks a burst of two
/// chunks let a late wake-up release about a quarter of the rate). 100 us covers the
/// default slack and an ordinary wake-up; a later one is paid back by the pacer's lateness
/// credit. The burst it costs is 100 us at the rate (300 kB at 24 Gb/s, less than two
/// chunks below 100 MB/s with 5 KiB chunks), released at most once per idle period.
pub const RELEASE_WINDOW: Duration = Duration::from_micros(100);

/// How long an idle pacer thread sleeps before checking whether its engine is gone.
pub(super) const IDLE_SLEEP: Duration = Duration::from_millis(100);

/// QPs waiting for tokens, with the time each may go, and when the thread will look.
#[derive(Default)]
pub(super) struct PacerQueue {
    pub(super) waiting: Vec<(Arc<QpShared>, Duration)>,
    /// When the sleeping pacer thread wakes; `None` while it runs or before it starts.
    pub(super) thread_wakes_at: Option<Duration>,
}

/// Releases paced requests when their tokens are due: from the application's own polls of
/// the QP's send CQ when it polls (exact, and free of extra wake-ups), else from a thread.
/// A poll releases only the QPs that send their completions to the CQ it polls, and only
/// if it gets their locks without waiting (see [`Engine::release_for`]).
pub(super) struct Pacer {
    pub(super) mode: PacerMode,
    pub(super) queue: Mutex<PacerQueue>,
    pub(super) wake: Condvar,
    /// The earliest deadline in the queue, in nanoseconds of the engine's clock
    /// (`u64::MAX` when empty; it may be early after a poll released QPs).
    pub(super) next_due_ns: AtomicU64,
    /// The process that started the thread (a forked child must start its own).
    pub(super) thread_pid: Mutex<Option<u32>>,
}

impl Engine {
    pub(super) fn pacer_queue(&self) -> MutexGuard<'_, PacerQueue> {
        self.pacer.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the pacer thread should wake for `qp` due at `at`: later while the polls of
    /// its send CQ release its requests themselves.
    pub(super) fn thread_deadline(&self, qp: &QpShared, at: Duration, now: Duration) -> Duration {
        if qp.send_cq.as_ref().is_some_and(|c| c.polls_drive(now)) {
            at + BACKSTOP_DELAY
        } else {
            at
        }
    }

    /// Queues `qp` to be drained at `at`.
    pub(super) fn schedule(self: &Arc<Self>, qp: Arc<QpShared>, at: Duration, now: Duration) {
        if qp.in_pacer.swap(true, Ordering::AcqRel) {
            return;
        }
        let notify = {
            let mut queue = self.pacer_queue();
            let wakes = self.thread_deadline(&qp, at, now);
            if let Some(cq) = &qp.send_cq {
                cq.pacer_due_ns.fetch_min(nanos(at), Ordering::AcqRel);
            }
            queue.waiting.push((qp, at));
            self.pacer
                .next_due_ns
                .fetch_min(nanos(at), Ordering::AcqRel);
            // A running thread looks at the queue before it sleeps; a sleeping one needs a
            // nudge only when this deadline comes before its own.
            queue.thread_wakes_at.is_some_and(|t| wakes < t)
        };
        if self.pacer.mode == PacerMode::Thread {
            self.ensure_pacer_thread();
            if notify {
                self.pacer.wake.notify_one();
            }
        }
    }

    /// Drains every waiting QP whose time has come; returns when the next one is due.
    pub fn pacer_tick(self: &Arc<Self>, now: Duration) -> Option<Duration> {
        let due: Vec<Arc<QpShared>> = {
            let mut queue = self.pacer_queue();
            let mut due = Vec::new();
            queue.waiting.retain(|(qp, at)| {
                if *at <= now {
                    due.push(Arc::clone(qp));
                    false
                } else {
                    true
                }
            });
            let next = queue.waiting.iter().map(|(_, at)| nanos(*at)).min();
            self.pacer
                .next_due_ns
                .store(next.unwrap_or(u64::MAX), Ordering::Release);
            due
        };
        for qp in due {
            qp.in_pacer.store(false, Ordering::Release);
            qp.progress(now);
        }
        self.pacer_queue().waiting.iter().map(|(_, at)| *at).min()
    }

    /// True when QPs wait in the pacer's queue (one load): only then can a poll have
    /// paced requests to release.
    pub(crate) fn pacer_has_waiting(&self) -> bool {
        self.pacer.next_due_ns.load(Ordering::Acquire) != u64::MAX
    }

    /// Called by the shaped polls of `cq`: releases the paced requests that are due of
    /// the QPs sending their completions to `cq`, each drained only if its lock is free
    /// (else it stays queued, for the next poll or the pacer thread). Costs one load when
    /// none is due. Never another CQ's QPs: a poll does not post for QPs it does not serve.
    pub(crate) fn release_for(self: &Arc<Self>, cq: &CqShared, now: Duration) {
        if nanos(now) < cq.pacer_due_ns.load(Ordering::Acquire) {
            return;
        }
        let due: Vec<Arc<QpShared>> = {
            let mut queue = self.pacer_queue();
            let mut due = Vec::new();
            let mut next_here = u64::MAX;
            queue.waiting.retain(|(qp, at)| {
                if !qp.send_cq.as_deref().is_some_and(|c| std::ptr::eq(c, cq)) {
                    return true;
                }
                if *at <= now {
                    due.push(Arc::clone(qp));
                    false
                } else {
                    next_here = next_here.min(nanos(*at));
                    true
                }
            });
            cq.pacer_due_ns.store(next_here, Ordering::Release);
            let next = queue.waiting.iter().map(|(_, at)| nanos(*at)).min();
            self.pacer
                .next_due_ns
                .store(next.unwrap_or(u64::MAX), Ordering::Release);
            due
        };
        if due.is_empty() {
            return;
        }
        cq.polls_released_ns
            .store(nanos(now).max(1), Ordering::Relaxed);
        for qp in due {
            qp.in_pacer.store(false, Ordering::Release);
            qp.drain_or_defer(now);
        }
    }

    fn ensure_pacer_thread(self: &Arc<Self>) {
        let pid = std::process::id();
        let mut started = self
            .pacer
            .thread_pid
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if *started == Some(pid) {
            return;
        }
        let engine = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("justitia-pacer".into())
            .spawn(move || pacer_loop(engine));
        match spawned {
            Ok(_) => *started = Some(pid),
            Err(e) => log!(
                Warn,
                "cannot start the pacer thread ({e}); paced requests wait for completions"
            ),
        }
    }
}

/// The pacer thread: sleeps until the earliest waiting QP is due (later while the
/// application's polls release requests themselves), drains, repeats.
fn pacer_loop(engine: Weak<Engine>) {
    loop {
        let Some(engine) = engine.upgrade() else {
            return;
        };
        let now = engine.clock.now();
        // A panic here loses one tick, never the thread.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.pacer_tick(now)));
        // The deadline is read under the lock that `schedule` pushes under, so a QP queued
        // after the tick is either seen here or wakes the wait.
        let mut queue = engine.pacer_queue();
        let now = engine.clock.now();
        let wake_at = queue
            .waiting
            .iter()
            .map(|(qp, at)| engine.thread_deadline(qp, *at, now))
            .min()
            .unwrap_or(now + IDLE_SLEEP);
        let sleep = wake_at.saturating_sub(now);
        if !sleep.is_zero() {
            queue.thread_wakes_at = Some(wake_at);
            let (mut queue, _) = engine
                .pacer
                .wake
                .wait_timeout(queue, sleep)
                .unwrap_or_else(|e| e.into_inner());
            queue.thread_wakes_at = None;
        }
    }
}
