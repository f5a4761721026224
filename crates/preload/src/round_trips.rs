//! A latency flow's round trips, as the shaper times them for the daemon's adaptive law.
//!
//! Under `adaptive` the daemon's law steers by the latency applications' own tail, as the
//! simulator's does: the p99 of their requests' round trips, from the post of a request to
//! the poll that returns its completion. A process of the latency class that follows a
//! daemon times one request at a time: a signaled single request posted while none is
//! timed ([`RoundTrips::posted`]), until a poll returns the completion of its queue pair
//! and `wr_id` ([`RoundTrips::polled`]). Its QPs are not shaped (latency flows pass
//! untouched), so the post hook only counts them, and its polls pass through the hook
//! that looks for the timed completion. Each round trip goes into a window; at each tick
//! the follower sends the window to the daemon as one report (its count and its
//! [`LATENCY_LONGEST`] longest, from which the daemon takes the p99 exactly up to 1 199
//! round trips a tick: see `justitia_core::adaptive::latency_tail`) and starts a new one.
//!
//! A request started with `ibv_wr_*` is timed from its start (its `wr_id` and flags read
//! where the application put them), whether or not its batch is then posted. What is not
//! timed: requests posted with `ibv_post_send` in a list, or unsignaled, and completions
//! read with `ibv_start_poll` (a timed request whose completion is not seen, read that way
//! or never posted, is given up after [`GIVE_UP_AFTER_NS`]). An application with two signaled requests of
//! one `wr_id` in flight on one QP has the second timed to the first's completion, short
//! of its round trip (the first is already on its way).
//!
//! Cost: a timed request reads the clock at its post and at its completion; every poll of
//! the process loads one word while a request is timed and scans what it returned. A round
//! trip takes the window's lock once (tried, never waited for: one that finds it taken by
//! another thread is dropped, which a p99 over hundreds does not miss). Timing is off
//! until the follower turns it on ([`RoundTrips::set_wanted`]), so a process with no
//! daemon to report to reads no clock for it.
//!
//! Invariants: at most one request is timed at once (`timed_qp` 0: none, `CLAIMED`:
//! being set up, else its QP's number + 2); only [`RoundTrips::posted`] takes it from 0,
//! only the completion that matches, a refused post or a give-up takes it back. The window
//! holds its count of round trips since the last take and the longest of them, longest
//! first, at most [`LATENCY_LONGEST`], zeros after.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use justitia_agent::proto::LATENCY_LONGEST;
use justitia_verbs::sys::{ibv_wc, IBV_WC_SUCCESS};

/// How long a timed request may go without its completion before it is given up (its
/// completion read where the shaper does not look, or its QP destroyed with it in flight).
pub const GIVE_UP_AFTER_NS: u64 = 1_000_000_000;

/// [`RoundTrips::timed_qp`] while a post sets the timed request up.
const CLAIMED: u64 = 1;

/// The round trips since the last report.
#[derive(Debug, Default)]
struct Window {
    count: u32,
    /// The longest, longest first; the first `min(count, LATENCY_LONGEST)` are set.
    longest_ns: [u32; LATENCY_LONGEST],
}

impl Window {
    fn add(&mut self, ns: u32) {
        let named = (self.count as usize).min(LATENCY_LONGEST);
        self.count = self.count.saturating_add(1);
        // The usual round trip, once the window is full: not among the longest.
        if named == LATENCY_LONGEST && ns <= self.longest_ns[LATENCY_LONGEST - 1] {
            return;
        }
        // Where it goes among the longest: after every one at least as long.
        let at = self.longest_ns[..named].partition_point(|&l| l >= ns);
        if at == LATENCY_LONGEST {
            return;
        }
        let end = (named + 1).min(LATENCY_LONGEST);
        self.longest_ns.copy_within(at..end - 1, at + 1);
        self.longest_ns[at] = ns;
    }
}

/// One process's latency round trips for the daemon. See the module documentation.
#[derive(Debug, Default)]
pub struct RoundTrips {
    wanted: AtomicBool,
    /// The timed request's QP number + 2 (0: none, [`CLAIMED`]: being set up).
    timed_qp: AtomicU64,
    /// Its `wr_id`.
    timed_wr_id: AtomicU64,
    /// When it was posted, `CLOCK_MONOTONIC` ns.
    timed_at: AtomicU64,
    window: parking_lot::Mutex<Window>,
}

impl RoundTrips {
    /// An empty window, timing off.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether timing is on.
    pub fn wanted(&self) -> bool {
        self.wanted.load(Ordering::Relaxed)
    }

    /// Turns timing on (a latency flow is registered with a daemon) or off.
    pub fn set_wanted(&self, wanted: bool) {
        self.wanted.store(wanted, Ordering::Relaxed);
    }

    /// The window's round trips since the last take, if any: how many and their longest
    /// (longest first, zeros after); the window starts again empty.
    pub fn take(&self) -> Option<(u32, [u32; LATENCY_LONGEST])> {
        let w = std::mem::take(&mut *self.window.lock());
        (w.count > 0).then_some((w.count, w.longest_ns))
    }

    /// Adds one round trip of `ns`, unless another thread holds the window.
    pub fn add(&self, ns: u64) {
        if let Some(mut w) = self.window.try_lock() {
            w.add(u32::try_from(ns).unwrap_or(u32::MAX));
        }
    }

    /// A request is about to be posted on the QP `qp_num`: it is timed if it is
    /// `signaled`, timing is on and none is timed. Returns whether it is (the caller then
    /// tells [`Self::refused`] if the provider refuses it).
    #[inline(always)]
    pub fn posted(&self, qp_num: u32, wr_id: u64, signaled: bool) -> bool {
        signaled
            && self.wanted()
            && self.timed_qp.load(Ordering::Relaxed) == 0
            && self.start(qp_num, wr_id)
    }

    #[cold]
    #[inline(never)]
    fn start(&self, qp_num: u32, wr_id: u64) -> bool {
        if self
            .timed_qp
            .compare_exchange(0, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        self.timed_wr_id.store(wr_id, Ordering::Relaxed);
        self.timed_at
            .store(justitia_agent::block::monotonic_ns(), Ordering::Relaxed);
        self.timed_qp
            .store(u64::from(qp_num) + 2, Ordering::Release);
        true
    }

    /// The provider refused the request [`Self::posted`] timed: nothing is timed.
    pub fn refused(&self, qp_num: u32) {
        let _ = self.timed_qp.compare_exchange(
            u64::from(qp_num) + 2,
            0,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    /// A poll returned `wcs`: the timed request's completion among them (its QP and
    /// `wr_id`) ends its timing, a success with a round trip.
    #[inline(always)]
    pub fn polled(&self, wcs: &[ibv_wc]) {
        let qp = self.timed_qp.load(Ordering::Acquire);
        if qp > CLAIMED {
            self.look_for(qp, wcs);
        }
    }

    #[cold]
    #[inline(never)]
    fn look_for(&self, qp: u64, wcs: &[ibv_wc]) {
        let wr_id = self.timed_wr_id.load(Ordering::Relaxed);
        let Some(wc) = wcs
            .iter()
            .find(|wc| u64::from(wc.qp_num) + 2 == qp && wc.wr_id == wr_id)
        else {
            return;
        };
        let posted_ns = self.timed_at.load(Ordering::Relaxed);
        // Claimed by one poll only, should two threads poll the completion's CQ at once.
        if self
            .timed_qp
            .compare_exchange(qp, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
            && wc.status == IBV_WC_SUCCESS
        {
            self.add(justitia_agent::block::monotonic_ns().saturating_sub(posted_ns));
        }
    }

    /// Gives up a request timed for longer than [`GIVE_UP_AFTER_NS`] at `now_ns` (its
    /// completion will not be seen), so that timing goes on. Called by the follower's tick.
    pub fn give_up_stale(&self, now_ns: u64) {
        let qp = self.timed_qp.load(Ordering::Acquire);
        if qp > CLAIMED
            && now_ns.saturating_sub(self.timed_at.load(Ordering::Relaxed)) > GIVE_UP_AFTER_NS
        {
            let _ = self
                .timed_qp
                .compare_exchange(qp, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_window_keeps_its_count_and_its_longest_first() {
        let r = RoundTrips::new();
        assert_eq!(r.take(), None);
        for ns in [5, 1, 9, 9, 3] {
            r.add(ns);
        }
        let (count, longest) = r.take().unwrap();
        assert_eq!(count, 5);
        assert_eq!(longest, [9, 9, 5, 3, 1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(r.take(), None, "taken: a new window");
        // 1000 round trips of 1..=1000 ns, in a scrambled order: the 12 longest kept.
        for i in 0..1000u64 {
            r.add((i * 7919) % 1000 + 1);
        }
        let (count, longest) = r.take().unwrap();
        assert_eq!(count, 1000);
        let want: Vec<u32> = (989..=1000).rev().collect();
        assert_eq!(longest.to_vec(), want);
        // Longer than u32 ns (4.3 s) saturates.
        r.add(u64::MAX);
        assert_eq!(r.take().unwrap().1[0], u32::MAX);
    }

    /// What the window sends is what the daemon's parser accepts: for every count, the
    /// named ones longest first and zeros after.
    #[test]
    fn every_window_is_a_valid_report() {
        use justitia_agent::proto::{LatencyReport, Request};
        let r = RoundTrips::new();
        for n in 1..40u64 {
            for i in 0..n {
                r.add((i * 31) % 17);
            }
            let (count, longest_ns) = r.take().unwrap();
            let report = Request::Latency(LatencyReport {
                flow: 1,
                count,
                longest_ns,
            });
            assert_eq!(Request::parse(&report.encode()), Ok(report), "{n}");
        }
    }
}
