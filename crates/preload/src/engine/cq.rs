//! The shaper's state for one completion queue: the shaped QPs that send their
//! completions to it, the completions the shaper holds for the application, and the shaped
//! polls (`ibv_poll_cq`; the extended poll is [`crate::cq_ex`]'s).
//!
//! Locks, in the order they are taken:
//! 1. `CqShared::qps`, the CQ's poll lock: held by every shaped poll of the CQ, by the
//!    pacer's, the side thread's and the shaper's own polls of it
//!    (`CqShared::poll_for_pacer`, `CqShared::poll_for_receiver`, `CqShared::drop_stale`,
//!    one batch per turn), and by whatever changes the CQ's QP list (registration,
//!    detach, destroy).
//! 2. A QP's state lock (`QpShared::state`): only *tried* under the poll lock, to settle a
//!    completion the quick ring cannot (`CqShared::translate`). A poster holds that lock
//!    across the provider's post, so a poll never waits for it: a completion whose QP's
//!    lock is busy is held, as the provider gave it, for a later poll to settle (see
//!    `Held`).
//! 3. The held completions' queue (`held`), a leaf: nothing is taken under it.
//!
//! No QP's lock is held when the poll lock is taken, and what a poll lets a QP post (a
//! drain into freed slots, paced requests that are due) runs after the poll lock is
//! released, with the QP's lock tried, never waited for: a QP whose lock is busy is left to
//! the pacer thread (see `QpShared::drain_or_defer`).
//!
//! Order: the completions of one QP's send queue reach the application in the order the
//! provider gave them, synthesized ones where the shaper settled them. Once one of a QP's
//! completions is held, every later one of that QP is held behind it (the polls track the
//! QPs they hold back), and the held queue is delivered in order, before the provider's
//! next completions of those QPs.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use justitia_verbs::sys::*;

use super::{
    channels, ex_state, nanos, CtxShared, Engine, PollCqFn, QpShared, ReqNotifyFn, CQS, SHAPED_QP,
};
use crate::log::log;
use crate::send_queue::{QuickRing, Verdict};
use crate::stats::Counters;

/// Destroys a CQ with `real` (the provider's destroy), the shaper's hold on it first: the
/// CQ is marked destroyed under its poll lock, which waits for a poll of the pacer's in
/// progress and keeps the pacer from polling it again (it may still hold a destroyed QP of
/// this CQ), then destroyed, then its state freed. If the provider refuses the destroy
/// (QPs still use the CQ), the mark is taken back.
pub fn destroy_cq(cq: *mut ibv_cq, real: impl FnOnce() -> c_int) -> c_int {
    let Some(token) = cq_token(cq) else {
        return real();
    };
    let Some(shared) = CQS.get_arc(cq.cast()) else {
        return real();
    };
    {
        let _polls = shared.qps.lock();
        shared.dead.store(true, Ordering::Release);
    }
    let rc = real();
    if rc == 0 {
        unregister_cq(cq, token);
    } else {
        shared.dead.store(false, Ordering::Release);
    }
    rc
}

/// The shaper's state for one CQ.
pub struct CqShared {
    pub(crate) poll_cq: PollCqFn,
    pub(crate) req_notify_cq: Option<ReqNotifyFn>,
    pub(crate) engine: Arc<Engine>,
    /// Shaped QPs that send their completions here.
    pub(crate) shaped: AtomicU32,
    /// Those QPs; also the lock the polls of the CQ hold (see [`Self::poll_shaped`]).
    pub(crate) qps: parking_lot::Mutex<CqQps>,
    /// Its size (`ibv_cq.cqe`, what the provider granted).
    cqe: u32,
    /// The receive queues' depths (`max_recv_wr`) of the registered QPs whose receive CQ
    /// this is: entries their receives may take, beside the send queues'.
    pub(super) recv_entries: AtomicU64,
    /// Completions held for the application's next poll, in order (see [`Held`]).
    held: Mutex<VecDeque<Held>>,
    /// Shaped QPs (in units of [`SHAPED_QP`]) plus held completions: zero means a poll
    /// passes straight through, with one load to find out.
    pub(super) work: AtomicU64,
    /// The earliest time, in nanoseconds of the engine's clock, at which a QP sending its
    /// completions here is due in the pacer's queue (`u64::MAX`: none), so that a poll
    /// finds out with one load whether it has paced requests to release. Lowered under the
    /// pacer's queue lock when a QP is queued, recomputed there by the polls that release;
    /// it may be early (a QP released by the pacer thread), which costs one look.
    pub(super) pacer_due_ns: AtomicU64,
    /// When a poll of this CQ last released paced requests, in nanoseconds (0: never):
    /// while its polls do, the pacer thread only stands behind them for its QPs.
    pub(super) polls_released_ns: AtomicU64,
    pub(crate) ex: Option<ex_state::CqExOps>,
    pub(crate) ex_current: Mutex<ex_state::Current>,
    /// The CQ itself (what an event names).
    pub(crate) cq: *mut ibv_cq,
    /// Its completion channel, or null.
    pub(crate) channel: *mut ibv_comp_channel,
    /// The application asked for an event on the next completion and has not had it.
    pub(crate) armed: AtomicBool,
    /// The application's request for an event on the next completion went to the provider
    /// as one for the next solicited completion (see [`Self::arm_for_application`]), and
    /// no event has come since.
    solicited_armed: AtomicBool,
    /// Bumped by every change that may end the CQ's quiet (see [`Self::unquiet`]), so that
    /// an arm racing one finds out.
    quiet_epoch: AtomicU64,
    /// Events the shaper delivered for synthesized completions, not yet acknowledged.
    pub(crate) synthetic_events: AtomicU32,
    /// The application is destroying the CQ: the shaper polls it no more (see
    /// [`destroy_cq`]). Set and read under [`Self::qps`]'s lock.
    pub(crate) dead: AtomicBool,
    /// Polls of the application's on this extended CQ begun (`ibv_start_poll` entered)
    /// and not ended: while there is one, the shaper does not poll the CQ itself (see
    /// [`crate::cq_ex`]).
    pub(crate) sessions: AtomicU32,
}

// SAFETY: function pointers are the provider's; mutable state is behind mutexes.
unsafe impl Send for CqShared {}
// SAFETY: as above.
unsafe impl Sync for CqShared {}

/// Registers a CQ created on an attached context; `cqx` is its extended form (from
/// `ibv_create_cq_ex`) or null. Returns true when the extended CQ's poll verbs are to be
/// the shaper's (it may shape, and the provider has them).
///
/// # Safety
/// `cq` must be a live CQ of `ctx`, just created.
pub unsafe fn register_cq(
    ctx: &CtxShared,
    cq: *mut ibv_cq,
    cqx: *mut ibv_cq_ex,
    wc_flags: u64,
) -> bool {
    let Some(poll_cq) = ctx.poll_cq else {
        return false;
    };
    // SAFETY: cqx is null or the live extended CQ.
    let ex = unsafe { cqx.as_ref() }.and_then(|x| ex_state::CqExOps::save(x, wc_flags));
    let shared = Arc::new(CqShared {
        poll_cq,
        req_notify_cq: ctx.req_notify_cq,
        engine: Arc::clone(&ctx.engine),
        shaped: AtomicU32::new(0),
        qps: parking_lot::Mutex::new(CqQps::default()),
        // SAFETY: the caller guarantees cq is live.
        cqe: u32::try_from(unsafe { (*cq).cqe }).unwrap_or(0),
        held: Mutex::new(VecDeque::new()),
        work: AtomicU64::new(0),
        recv_entries: AtomicU64::new(0),
        pacer_due_ns: AtomicU64::new(u64::MAX),
        polls_released_ns: AtomicU64::new(0),
        ex,
        ex_current: Mutex::new(ex_state::Current::default()),
        cq,
        // SAFETY: the caller guarantees cq is live.
        channel: unsafe { (*cq).channel },
        armed: AtomicBool::new(false),
        solicited_armed: AtomicBool::new(false),
        quiet_epoch: AtomicU64::new(0),
        synthetic_events: AtomicU32::new(0),
        dead: AtomicBool::new(false),
        sessions: AtomicU32::new(0),
    });
    if ctx.engine.config.class.is_some() {
        channels::attach(&shared);
    }
    if let Ok(Some(old)) = CQS.insert(cq.cast(), shared) {
        // A CQ destroyed behind the shaper's back, whose address was reused.
        drop(channels::detach(&old));
    }
    !cqx.is_null() && ex.is_some() && ctx.engine.config.class.is_some()
}

/// The registration of a CQ, to pass to [`unregister_cq`] once it is destroyed.
pub fn cq_token(cq: *mut ibv_cq) -> Option<NonNull<CqShared>> {
    CQS.get(cq.cast())
}

/// Forgets a destroyed CQ, if its registration is still `token`; its state (and its
/// channel's, when it was the channel's last CQ) is freed here.
pub fn unregister_cq(cq: *mut ibv_cq, token: NonNull<CqShared>) {
    if let Some(shared) = CQS.remove(cq.cast(), token) {
        drop(channels::detach(&shared));
    }
}

/// The state of a registered CQ.
#[inline(always)]
pub(crate) fn cq(cq: *mut ibv_cq) -> Option<&'static CqShared> {
    // SAFETY: CQ state is freed at the CQ's destroy, which verbs forbid while a call on the
    // CQ runs (see the module's documentation).
    CQS.get(cq.cast()).map(|p| unsafe { &*p.as_ptr() })
}

impl CqShared {
    /// True when a poll must look at the completions. Acquire: read after a provider's poll,
    /// it sees the registration of any QP whose completion that poll returned (see
    /// `hooks::settle_passed_through`); on x86-64 a plain load all the same.
    #[inline(always)]
    pub(crate) fn needs_shaping(&self) -> bool {
        self.work.load(Ordering::Acquire) != 0
    }

    fn held(&self) -> std::sync::MutexGuard<'_, VecDeque<Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues completions the hardware will not produce, and wakes an application that
    /// waits for an event on this CQ.
    pub(crate) fn push_synthesized(&self, wcs: Vec<ibv_wc>) {
        self.push_held(wcs.into_iter().map(Held::settled).collect());
    }

    /// Queues held completions behind those held already, and wakes an application that
    /// waits for an event on this CQ.
    pub(crate) fn push_held(&self, entries: Vec<Held>) {
        if entries.is_empty() {
            return;
        }
        {
            let mut q = self.held();
            self.work.fetch_add(entries.len() as u64, Ordering::AcqRel);
            q.extend(entries);
        }
        if self.armed.load(Ordering::Acquire) {
            channels::notify(self);
        }
    }

    /// The held queue's lock, held: a test holds it across a `fork()`, as a thread of the
    /// parent could.
    #[cfg(test)]
    pub(crate) fn lock_held(&self) -> std::sync::MutexGuard<'_, VecDeque<Held>> {
        self.held()
    }

    /// True when completions are held for the application.
    pub(crate) fn has_held(&self) -> bool {
        !self.held().is_empty()
    }

    /// True when completions of the QP `qp_num` are held.
    fn holds_for(&self, qp_num: u32) -> bool {
        self.held().iter().any(|h| h.wc.qp_num == qp_num)
    }

    /// True when completions may be held (one load).
    #[inline(always)]
    fn may_hold(&self) -> bool {
        !self.work.load(Ordering::Acquire).is_multiple_of(SHAPED_QP)
    }

    /// The QPs with completions held: their next ones go behind those.
    pub(crate) fn held_qps(&self) -> Vec<u32> {
        self.held_back().0
    }

    /// [`Self::held_qps`], and whether a completion whose QP is not known yet is held
    /// (then every next completion goes behind it).
    pub(crate) fn held_back(&self) -> (Vec<u32>, bool) {
        if !self.may_hold() {
            return (Vec::new(), false);
        }
        let held = self.held();
        let mut qps: Vec<u32> = held.iter().map(|h| h.wc.qp_num).collect();
        let all = held.iter().any(Held::unattributed);
        drop(held);
        qps.sort_unstable();
        qps.dedup();
        (qps, all)
    }

    /// Delivers held completions in order, at most `room` of them, through `out`; returns
    /// how many. Called with the poll lock held (`qps`). A completion held as the provider
    /// gave it is translated now if its QP's lock is free (what that settles is delivered
    /// right behind it); if not, it and every later completion of its QP stay held, in
    /// order (every later completion at all, for one whose QP is not known yet). (A
    /// destroyed QP's are not here: its destroy purged them.) The QPs whose requests may
    /// now post are added to `touched`.
    pub(crate) fn take_held(
        &self,
        qps: &CqQps,
        room: usize,
        touched: &mut Vec<Arc<QpShared>>,
        out: impl FnMut(ibv_wc),
    ) -> usize {
        if room == 0 || !self.may_hold() {
            return 0;
        }
        self.work_through_held(qps, Some(room), touched, out)
    }

    /// Settles the completions held as the provider gave them whose QPs' locks are free,
    /// in order, delivering none: internal ones are dropped, the application's stay held,
    /// settled, where they were. For the shaper's own polls ([`Self::poll_for_pacer`]): a
    /// completion it held because its QP's lock was busy (a poster's, across the
    /// provider's post) holds every later one of that QP behind it, and an application
    /// that does not poll this CQ would never settle them, so the QP would never get its
    /// slots back. Called with the poll lock held (`qps`).
    fn settle_held(&self, qps: &CqQps, touched: &mut Vec<Arc<QpShared>>) {
        if self.may_hold() {
            self.work_through_held(qps, None, touched, |_| {});
        }
    }

    /// [`Self::take_held`] (`room`: `Some`) or [`Self::settle_held`] (`None`).
    fn work_through_held(
        &self,
        qps: &CqQps,
        room: Option<usize>,
        touched: &mut Vec<Arc<QpShared>>,
        mut out: impl FnMut(ibv_wc),
    ) -> usize {
        // Taken out whole, so that no QP lock is tried under the queue's lock (a leaf);
        // completions queued meanwhile (a poster's, outside the poll lock) go behind what
        // is put back.
        let mut pending = std::mem::take(&mut *self.held());
        let mut kept = VecDeque::new();
        let mut held_back: Vec<u32> = Vec::new();
        let mut given = 0usize;
        let mut added = 0u64;
        let mut removed = 0u64;
        while let Some(h) = pending.pop_front() {
            // Kept: behind one of its QP's that stays, past the room, or (settling only)
            // settled already.
            let keep = match room {
                Some(room) => given == room,
                None => h.settled,
            };
            if keep || held_back.contains(&h.wc.qp_num) {
                kept.push_back(h);
                continue;
            }
            if h.settled {
                out(h.wc);
                given += 1;
                removed += 1;
                continue;
            }
            let mut wc = h.wc;
            let mut synthesized = Vec::new();
            match self.translate(
                qps,
                &mut wc,
                h.qp_known,
                &mut synthesized,
                &mut held_back,
                false,
            ) {
                // Attributed by translate (it found the QP, whose lock is busy).
                None => kept.push_back(Held::raw(wc, true)),
                Some((deliver, q)) => {
                    removed += 1;
                    if let Some(q) = q {
                        note_touched(touched, q);
                    }
                    added += synthesized.len() as u64;
                    for s in synthesized.into_iter().rev() {
                        pending.push_front(Held::settled(s));
                    }
                    match (deliver, room) {
                        (false, _) => {}
                        (true, Some(_)) => {
                            out(wc);
                            given += 1;
                        }
                        // Settled, still the application's to take, in its place.
                        (true, None) => {
                            kept.push_back(Held::settled(wc));
                            removed -= 1;
                        }
                    }
                }
            }
        }
        let mut q = self.held();
        kept.extend(q.drain(..));
        *q = kept;
        self.work.fetch_add(added, Ordering::AcqRel);
        self.work.fetch_sub(removed, Ordering::AcqRel);
        given
    }

    /// Whether the CQ can hold every completion of its shaped QPs' send queues (`qps`),
    /// every receive of the QPs whose receive CQ it is, and one more send queue of `depth`
    /// slots with `recv_depth` receives here: `None` if it can, else the entries needed. A
    /// shaped QP has at most its `max_send_wr` completions waiting, but may have more than
    /// the application's own signaling would leave (the shaper signals internal WQEs to
    /// recycle slots), so a CQ the application sized to its own pattern could overflow:
    /// such a QP is only observed (said once, by [`Self::say_too_small`], outside the CQ's
    /// lock).
    pub(super) fn room_needed(
        &self,
        qps: &[Arc<QpShared>],
        depth: u32,
        recv_depth: u32,
    ) -> Option<u64> {
        let needed: u64 = qps.iter().map(|q| u64::from(q.send_depth)).sum::<u64>()
            + u64::from(depth)
            + self.recv_entries.load(Ordering::Acquire)
            + u64::from(recv_depth);
        (needed > u64::from(self.cqe)).then_some(needed)
    }

    /// Says once that a QP needing `needed` entries of this CQ passes through.
    pub(super) fn say_too_small(&self, needed: u64) {
        static SAID: AtomicBool = AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            log!(
                Warn,
                "a CQ of {} entries is too small for the send queues of its shaped QPs ({needed}); QPs past its size pass through unshaped",
                self.cqe
            );
        }
    }

    /// Adds a shaped QP that sends its completions here, in QP-number order (so that a
    /// completion finds its QP by binary search, not by a scan of every QP).
    pub(super) fn add_qp(&self, qp: &Arc<QpShared>) {
        let mut qps = self.qps.lock();
        self.add_qp_locked(&mut qps, qp);
    }

    /// [`Self::add_qp`] with the QP list already locked.
    pub(super) fn add_qp_locked(&self, qps: &mut CqQps, qp: &Arc<QpShared>) {
        let at = qps.list.partition_point(|q| q.qp_num < qp.qp_num);
        qps.list.insert(at, Arc::clone(qp));
        qps.find_sole();
        self.shaped.fetch_add(1, Ordering::AcqRel);
        self.work.fetch_add(SHAPED_QP, Ordering::AcqRel);
    }

    /// Removes a QP added with [`Self::add_qp`], which is being destroyed: its tags stay
    /// known as departed until [`Self::forget_departed`].
    pub(super) fn remove_qp(&self, qp: &Arc<QpShared>) {
        let mut qps = self.qps.lock();
        let before = qps.list.len();
        qps.list.retain(|q| !Arc::ptr_eq(q, qp));
        if qps.list.len() < before {
            qps.departed.push((qp.qp_num, Arc::clone(&qp.ring)));
        }
        qps.find_sole();
    }

    /// Drops the held completions `stale` picks, under the poll lock.
    fn drop_held(&self, stale: impl Fn(&Held) -> bool) {
        let _polls = self.qps.lock();
        let mut q = self.held();
        let before = q.len();
        q.retain(|h| !stale(h));
        self.work
            .fetch_sub((before - q.len()) as u64, Ordering::AcqRel);
    }

    /// The QP `qp`, which has a receiver half and was destroyed, leaves this CQ's receivers
    /// once the CQ has been polled clean of its internal receives' completions (a provider
    /// that does not purge a destroyed QP's completions, as rxe, leaves their flushes
    /// here, and they carry the shaper's tags): those are dropped, the rest held for the
    /// application. An extended CQ never has receivers.
    pub(crate) fn drop_stale_receives(&self, qp: &Arc<QpShared>, now: Duration) {
        let Some(r) = &qp.receiver else {
            return;
        };
        let qp_num = qp.qp_num;
        let touched = self.poll_aside(
            None,
            Some(&|e: &ibv_wc| e.qp_num == qp_num && r.is_tag(e.wr_id)),
        );
        self.drop_held(|h| h.wc.qp_num == qp_num && r.is_tag(h.wc.wr_id));
        self.remove_receiver(qp);
        for q in touched {
            q.drain_or_defer(now);
        }
    }

    /// Adds a QP with a receiver half whose receive CQ this is: its receive completions
    /// are translated from now on, so its polls take the shaped path.
    pub(super) fn add_receiver(&self, qp: &Arc<QpShared>) {
        let mut qps = self.qps.lock();
        self.add_receiver_locked(&mut qps, qp);
    }

    /// [`Self::add_receiver`] with the QP list already locked.
    pub(super) fn add_receiver_locked(&self, qps: &mut CqQps, qp: &Arc<QpShared>) {
        let at = qps.receivers.partition_point(|q| q.qp_num < qp.qp_num);
        qps.receivers.insert(at, Arc::clone(qp));
        qps.find_sole();
        self.work.fetch_add(SHAPED_QP, Ordering::AcqRel);
    }

    /// Removes a QP added with [`Self::add_receiver`], which is being destroyed.
    pub(super) fn remove_receiver(&self, qp: &Arc<QpShared>) {
        let mut qps = self.qps.lock();
        let before = qps.receivers.len();
        qps.receivers.retain(|q| !Arc::ptr_eq(q, qp));
        if qps.receivers.len() < before {
            self.work.fetch_sub(SHAPED_QP, Ordering::AcqRel);
        }
        qps.find_sole();
    }

    /// Forgets a departed QP (see [`CqQps::departed`]) once the provider's CQ has been
    /// polled clean of its completions, or when the provider refused its destroy.
    pub(crate) fn forget_departed(&self, ring: &Arc<QuickRing>) {
        let mut qps = self.qps.lock();
        let before = qps.departed.len();
        qps.departed.retain(|(_, r)| !Arc::ptr_eq(r, ring));
        if qps.departed.len() < before {
            self.shaped.fetch_sub(1, Ordering::AcqRel);
            self.work.fetch_sub(SHAPED_QP, Ordering::AcqRel);
        }
        qps.find_sole();
    }

    /// Takes out the completions held for the QP `qp_num`, which is being destroyed.
    pub(crate) fn purge_qp(&self, qp_num: u32) -> Vec<Held> {
        let mut q = self.held();
        let (purged, kept): (VecDeque<Held>, VecDeque<Held>) =
            q.drain(..).partition(|h| h.wc.qp_num == qp_num);
        *q = kept;
        self.work.fetch_sub(purged.len() as u64, Ordering::AcqRel);
        purged.into()
    }

    /// Arms the CQ for the application's `ibv_req_notify_cq(cq, 0)` with the provider's
    /// `arm`: for the next solicited completion when the CQ is quiet, else for the next
    /// completion, as asked.
    ///
    /// A CQ is *quiet* when every QP that names it is a receiver half that owns its
    /// receives under the agreed protocol, sends its completions elsewhere, and has no
    /// receive of the application's own at the NIC (see
    /// `QpShared::receives_are_marked`): then every completion the application would see
    /// is the last of a message (or of a credited part) that the peer's shaper marked
    /// solicited, and the internal receives' completions, which the polls hide, raise no
    /// event. An event-driven receiver thus wakes once per message and credit, not once per
    /// chunk. A change that ends the quiet while the arm stands ([`Self::unquiet`]) arms
    /// the CQ again for the next completion; one that races this arm is seen by its second
    /// look at [`Self::quiet_epoch`].
    ///
    /// # Safety
    /// `arm` must be the provider's `req_notify_cq` for this live CQ.
    pub(crate) unsafe fn arm_for_application(&self, arm: ReqNotifyFn) -> c_int {
        let epoch = self.quiet_epoch.load(Ordering::SeqCst);
        if !self.quiet() {
            // SAFETY: guaranteed by the caller.
            return unsafe { arm(self.cq, 0) };
        }
        // SAFETY: guaranteed by the caller.
        if unsafe { arm(self.cq, 1) } != 0 {
            // SAFETY: as above.
            return unsafe { arm(self.cq, 0) };
        }
        self.solicited_armed.store(true, Ordering::SeqCst);
        if self.quiet_epoch.load(Ordering::SeqCst) != epoch
            && self.solicited_armed.swap(false, Ordering::SeqCst)
        {
            // SAFETY: as above.
            return unsafe { arm(self.cq, 0) };
        }
        Counters::add(&self.engine.counters.cq_arms_solicited, 1);
        0
    }

    /// Whether the CQ is quiet (see [`Self::arm_for_application`]).
    fn quiet(&self) -> bool {
        let qps = self.qps.lock();
        !qps.unobserved
            && !qps.receivers.is_empty()
            && qps.users == qps.receivers.len()
            && qps.receivers.iter().all(|q| q.receives_are_marked(self))
    }

    /// Something changed that may end the CQ's quiet (a QP names it, a receiver half
    /// failed or was reset): an arm for the next solicited completion standing for the
    /// application becomes one for the next completion.
    pub(crate) fn unquiet(&self) {
        self.quiet_epoch.fetch_add(1, Ordering::SeqCst);
        if self.solicited_armed.swap(false, Ordering::SeqCst) {
            if let Some(arm) = self.req_notify_cq {
                // SAFETY: the provider's own req_notify_cq, on this live CQ (a QP that
                // names it or a receiver half of one holds its state).
                unsafe { arm(self.cq, 0) };
            }
        }
    }

    /// Whether the application's arm stands as one for the next solicited completion.
    pub(crate) fn armed_solicited(&self) -> bool {
        self.solicited_armed.load(Ordering::Acquire)
    }

    /// The CQ's event came: the arm, whatever it was, is spent.
    pub(crate) fn on_event(&self) {
        self.armed.store(false, Ordering::Release);
        self.solicited_armed.store(false, Ordering::SeqCst);
    }

    /// A QP that names this CQ (as its send or receive CQ, once per QP) was registered
    /// (`observed`) or could not be (the shaper knows nothing of its completions).
    pub(super) fn add_user(&self, observed: bool) {
        let mut qps = self.qps.lock();
        qps.users += 1;
        qps.unobserved |= !observed;
        drop(qps);
        self.unquiet();
    }

    /// A QP added with [`Self::add_user`] was destroyed.
    pub(super) fn remove_user(&self) {
        let mut qps = self.qps.lock();
        qps.users = qps.users.saturating_sub(1);
    }

    /// The application armed the CQ: an event is due now if synthesized completions wait.
    pub(crate) fn on_armed(&self) {
        self.armed.store(true, Ordering::Release);
        if self.has_held() {
            channels::notify(self);
        }
    }

    /// Translates one completion; returns whether to deliver it, and its QP when requests
    /// wait there (the caller lets it post into the freed slot). `None`: the completion is
    /// its QP's send queue's and must be held, as it is, behind what is held of that QP:
    /// its QP is in `held_back`, or its lock is busy (then it is added to `held_back`).
    /// A QP whose settling synthesized completions (into `synthesized`, to be held right
    /// behind this one) is added to `held_back` too. With `behind_held`, so is a QP with
    /// completions in the held queue (queued since the caller looked, outside its lock);
    /// [`Self::take_held`], which works through that queue itself, passes false.
    ///
    /// `qp_num_known` is false for an extended CQ created without QP numbers, whose
    /// completions are then attributed by their tags (every WQE the shaper posts carries
    /// one).
    #[inline(always)]
    pub(crate) fn translate(
        &self,
        qps: &CqQps,
        wc: &mut ibv_wc,
        qp_num_known: bool,
        synthesized: &mut Vec<ibv_wc>,
        held_back: &mut Vec<u32>,
        behind_held: bool,
    ) -> Option<(bool, Option<Arc<QpShared>>)> {
        // A receive of a QP whose receives the shaper may own (see `super::two_sided`).
        if let Some(q) = qps.receiver(wc.qp_num).filter(|_| qp_num_known) {
            if let Some(r) = &q.receiver {
                let before = synthesized.len();
                if let Some(deliver) = q.translate_receive(r, wc, synthesized) {
                    if synthesized.len() > before {
                        held_back.push(q.qp_num);
                    }
                    return Some((deliver, None));
                }
            }
        }
        let owner = if qp_num_known {
            qps.binary_search_by_key(&wc.qp_num, |q| q.qp_num)
                .ok()
                .and_then(|i| qps.get(i))
        } else {
            qps.iter().find(|q| q.ring.contains(wc.wr_id))
        };
        let Some(q) = owner.filter(|q| q.ring.contains(wc.wr_id)) else {
            // Not a live QP's tag: one of a departed QP's is dropped, anything else (a
            // receive's, a QP's the shaper does not shape) delivered untouched.
            return Some((!qps.departed_tag(wc, qp_num_known), None));
        };
        if !qp_num_known {
            wc.qp_num = q.qp_num;
        }
        // A receive's completion is never the send queue's: delivered untouched, whatever
        // is held.
        if wc.status == IBV_WC_SUCCESS && wc.opcode & IBV_WC_RECV != 0 {
            return Some((true, None));
        }
        if held_back.contains(&q.qp_num) {
            return None;
        }
        // Completions of the QP queued meanwhile (synthesized under its lock, by a drain
        // or a move to the error state on another thread) are older than this one.
        if behind_held && self.may_hold() && self.holds_for(q.qp_num) {
            held_back.push(q.qp_num);
            return None;
        }
        // Settled on the ring: a quick request's on an open ring, behind which nothing
        // waits to be posted.
        if let Some(verdict) = q.ring.settle(wc) {
            return Some((verdict != Verdict::Hide, None));
        }
        let Some(mut st) = q.state.try_lock() else {
            held_back.push(q.qp_num);
            return None;
        };
        let before = synthesized.len();
        let verdict = st.sq.complete(wc, &self.engine.counters, synthesized);
        let drain = st.sq.needs_drain();
        drop(st);
        if synthesized.len() > before {
            held_back.push(q.qp_num);
        }
        // A QP with nothing waiting has nothing to post for the slot the completion freed.
        Some((verdict != Verdict::Hide, drain.then(|| Arc::clone(q))))
    }

    /// Polls the provider's CQ for the pacer on behalf of `qp` (see
    /// [`QpShared::progress`]): internal completions are hidden and the QPs they came from
    /// post more; the application's are held, queued before any completion the shaper makes
    /// later, for its next poll. Nothing is polled once `qp` has left the CQ (destroyed) or
    /// the CQ is being destroyed.
    ///
    /// Only a CQ polled with `ibv_poll_cq`: an extended CQ's provider keeps its own lock
    /// from `ibv_start_poll` to `ibv_end_poll`, across calls the shaper cannot join, so a
    /// QP on one still depends on its application polling.
    pub(crate) fn poll_for_pacer(&self, qp: &QpShared, now: Duration) {
        let mut touched = Vec::new();
        {
            let qps = self.qps.lock();
            if qps.lists(qp) {
                self.settle_held(&qps, &mut touched);
            }
        }
        for q in self.poll_aside(Some(qp), None) {
            note_touched(&mut touched, q);
        }
        for q in touched {
            q.drain(now);
        }
    }

    /// Polls the provider's CQ aside for the side thread on behalf of `qp`, a QP whose
    /// receives the shaper owns and whose peer's message waits for room in its receive
    /// queue (`RecvSide::waits_for_room`): the completed internal receives free that room
    /// and the next ones are posted and credited, as the application's own poll would do;
    /// the application's completions are held for its next poll. An application may poll
    /// its receive CQ only once something sent behind the message has come (a flag
    /// written after it): natively nothing holds the message back until then, so nothing
    /// of the shaper's may either.
    ///
    /// Nothing is polled once `qp` has left the CQ or the CQ is being destroyed (see
    /// [`Self::poll_aside`]); the QPs the completions let post more are drained only if
    /// their lock is free, else left to the pacer.
    pub(crate) fn poll_for_receiver(&self, qp: &QpShared, now: Duration) {
        for q in self.poll_aside(Some(qp), None) {
            q.drain_or_defer(now);
        }
    }

    /// Drops the completions the provider left in the CQ that carry the tags of `ring`,
    /// the send queue of the QP `qp_num`, which was destroyed or reset (see
    /// [`destroy_qp`]); the other completions are held for the application. An extended
    /// CQ is polled with its own verbs, when no poll of the application's is in progress,
    /// else by the one in progress as it goes and when it ends (see [`crate::cq_ex`]).
    pub(crate) fn drop_stale(&self, qp_num: u32, ring: &Arc<QuickRing>, now: Duration) {
        let touched = match self.ex {
            Some(ops) => self.drop_stale_ex(ops, qp_num, ring),
            None => self.poll_aside(
                None,
                Some(&|e: &ibv_wc| e.qp_num == qp_num && ring.contains(e.wr_id)),
            ),
        };
        // Held as the provider gave them, under the poll lock (which holds them).
        self.drop_held(|h| h.stale_of(qp_num, ring));
        // Called from the application's verbs (modify, destroy): never waits for another
        // QP's lock.
        for q in touched {
            q.drain_or_defer(now);
        }
    }

    /// Polls the provider's CQ empty for the shaper, one batch of 16 per turn of its poll
    /// lock (so an application poll waits for one provider call at most), holding what is
    /// the application's; returns the QPs that completions freed slots of.
    ///
    /// Each turn first checks, under the lock, that the CQ is not being destroyed and that
    /// `on_behalf` (if any) is still one of its QPs: [`QpShared::detach`] and
    /// [`destroy_cq`] take the same lock, so a destroy waits for a turn in progress and no
    /// turn starts after it. Completions `stale` says are a destroyed QP's internal ones
    /// are dropped.
    fn poll_aside(
        &self,
        on_behalf: Option<&QpShared>,
        stale: Option<&dyn Fn(&ibv_wc) -> bool>,
    ) -> Vec<Arc<QpShared>> {
        let mut touched: Vec<Arc<QpShared>> = Vec::new();
        if self.ex.is_some() {
            return touched;
        }
        let mut buf = [ibv_wc::default(); 16];
        loop {
            let qps = self.qps.lock();
            if self.dead.load(Ordering::Acquire) || on_behalf.is_some_and(|me| !qps.holds(me)) {
                break;
            }
            // SAFETY: this CQ is live (not being destroyed, checked under the lock its
            // destroy takes first); room for 16 entries.
            let got = unsafe { (self.poll_cq)(self.cq, 16, buf.as_mut_ptr()) };
            let got = usize::try_from(got).unwrap_or(0);
            let mut held = Vec::new();
            let mut synthesized = Vec::new();
            let mut held_back = self.held_qps();
            for e in buf.iter_mut().take(got) {
                if stale.is_some_and(|is| is(e)) {
                    continue;
                }
                match self.translate(&qps, e, true, &mut synthesized, &mut held_back, true) {
                    None => held.push(Held::raw(*e, true)),
                    Some((deliver, q)) => {
                        if deliver {
                            held.push(Held::settled(*e));
                        }
                        held.extend(synthesized.drain(..).map(Held::settled));
                        if let Some(q) = q {
                            note_touched(&mut touched, q);
                        }
                    }
                }
            }
            // Queued under the poll lock: an application poll waiting for it finds them
            // before what the provider has next.
            self.push_held(held);
            drop(qps);
            if got < buf.len() {
                break;
            }
        }
        touched
    }

    /// Translates `got` completions the provider wrote into `wc` outside the poll lock (see
    /// `hooks::settle_passed_through`), as [`Self::poll_shaped`] translates a batch it
    /// could not settle on the rings; returns how many of them the application gets. The
    /// batch is the buffer's room (the application's `n` need not outlive its call): what
    /// the translation holds back waits for the next poll.
    ///
    /// # Safety
    /// `wc` holds `got` (> 0) of the provider's completions of this CQ.
    pub(crate) unsafe fn settle_provider_batch(&self, wc: *mut ibv_wc, got: c_int) -> c_int {
        let n = got;
        let qps = self.qps.lock();
        let got = usize::try_from(got).unwrap_or(0);
        let resume = Resume {
            kept: 0,
            next: 0,
            got,
            full: false,
        };
        // SAFETY: guaranteed by the caller.
        unsafe { self.poll_general(qps, n, wc, resume) }
    }

    /// The shaped `ibv_poll_cq`: first the completions the shaper holds (the pacer's, and
    /// synthesized ones, which are older than anything the provider has left for their
    /// QP), then the provider's until `n` completions are kept or the CQ is empty, hiding
    /// internal ones and rewriting split requests' ones; then lets the QPs it heard from
    /// post more.
    ///
    /// The usual poll is settled here, in line: nothing is held, one call to the provider
    /// fills what the application asked for or empties the CQ, and every completion is
    /// settled by [`SendQueue::complete_fast`] on a QP with nothing waiting. Anything else
    /// continues in [`Self::poll_general`] from where this stopped.
    ///
    /// # Safety
    /// `cq` is this CQ and `wc` has room for `n` entries.
    #[inline(always)]
    pub(crate) unsafe fn poll_shaped(&self, n: c_int, wc: *mut ibv_wc) -> c_int {
        let qps = self.qps.lock();
        // Checked under the lock the pacer's own polls hold while they queue what they
        // took: with nothing queued, the provider's next completions are the oldest. While
        // a QP is departing, its completions may still come, and only the general path
        // knows them.
        if self.may_hold() || qps.general {
            // SAFETY: guaranteed by the caller.
            return unsafe { self.poll_general(qps, n, wc, Resume::default()) };
        }
        // SAFETY: wc has room for n entries.
        let got = unsafe { (self.poll_cq)(self.cq, n, wc) };
        if got < 0 {
            return got;
        }
        let got = got as usize;
        // A CQ of one shaped QP (the usual case) needs no search: a completion carrying one
        // of its tags is its, and one without is not the send queue's of any shaped QP.
        let sole = qps.sole.as_deref();
        let mut kept = 0usize;
        // Where the ring could not settle a completion (the general path goes on from
        // there), or `got`.
        let mut next = got;
        for i in 0..got {
            // SAFETY: i < got <= n, written by the provider.
            let e = unsafe { &mut *wc.add(i) };
            let verdict = match sole {
                Some(ring) => ring.settle(e),
                None => ring_of(&qps, e.qp_num).map_or(Some(Verdict::NotOurs), |r| r.settle(e)),
            };
            match verdict {
                Some(Verdict::Hide) => continue,
                Some(_) => {}
                None => {
                    next = i;
                    break;
                }
            }
            if kept != i {
                // SAFETY: kept < i, both within the buffer.
                unsafe { *wc.add(kept) = *wc.add(i) };
            }
            kept += 1;
        }
        // Stopped early (then kept <= next < got), or completions were hidden: if the batch
        // was full, the provider may have more.
        if kept != got {
            let resume = Resume {
                kept,
                next,
                got,
                full: got == n as usize,
            };
            // SAFETY: guaranteed by the caller.
            return unsafe { self.poll_general(qps, n, wc, resume) };
        }
        drop(qps);
        if self.pacer_due_ns.load(Ordering::Relaxed) != u64::MAX {
            self.release_on_poll();
        }
        kept as c_int
    }

    /// Releases the paced requests that are due of the QPs sending their completions
    /// here, for a poll that found one of them queued. Out of line: the poll of a flow
    /// that is not held back never gets here.
    #[cold]
    #[inline(never)]
    fn release_on_poll(&self) {
        self.engine.release_for(self, self.engine.now());
    }

    /// Whether this CQ's polls have been releasing paced requests lately.
    pub(super) fn polls_drive(&self, now: Duration) -> bool {
        let last = self.polls_released_ns.load(Ordering::Relaxed);
        last != 0 && nanos(now).saturating_sub(last) < nanos(super::pacer::POLLS_DRIVE_FOR)
    }

    /// [`Self::poll_shaped`] of what its usual case does not cover, resuming after what
    /// it did (`resume`), with the QP list still locked.
    ///
    /// # Safety
    /// As [`Self::poll_shaped`].
    #[inline(never)]
    unsafe fn poll_general(
        &self,
        qps: parking_lot::MutexGuard<'_, CqQps>,
        n: c_int,
        wc: *mut ibv_wc,
        resume: Resume,
    ) -> c_int {
        let want_total = usize::try_from(n).unwrap_or(0);
        let mut out;
        let mut touched: Vec<Arc<QpShared>> = Vec::new();
        // What this poll holds, in order: completions whose QP's lock is busy or whose QP
        // has completions held before them, and synthesized ones.
        let mut held: Vec<Held> = Vec::new();
        let mut failed = None;
        {
            // Compacts the provider's entries `range` of the buffer to `out..`, translated;
            // returns the new `out`.
            let mut translate = |out: usize,
                                 range: std::ops::Range<usize>,
                                 held_back: &mut Vec<u32>,
                                 touched: &mut Vec<Arc<QpShared>>| {
                let mut kept = out;
                let mut synthesized = Vec::new();
                for i in range {
                    // SAFETY: i is within the entries the provider wrote.
                    let e = unsafe { &mut *wc.add(i) };
                    match self.translate(&qps, e, true, &mut synthesized, held_back, true) {
                        None => held.push(Held::raw(*e, true)),
                        Some((deliver, q)) => {
                            if let Some(q) = q {
                                note_touched(touched, q);
                            }
                            held.extend(synthesized.drain(..).map(Held::settled));
                            if deliver {
                                if kept != i {
                                    // SAFETY: kept < i, both within the buffer.
                                    unsafe { *wc.add(kept) = *wc.add(i) };
                                }
                                kept += 1;
                            }
                        }
                    }
                }
                kept
            };
            let mut held_back = Vec::new();
            let mut poll_more = true;
            if resume.got > 0 {
                out = translate(
                    resume.kept,
                    resume.next..resume.got,
                    &mut held_back,
                    &mut touched,
                );
                poll_more = resume.full;
            } else {
                // What is held is older than anything the provider has of the same QPs.
                let mut given = 0;
                self.take_held(&qps, want_total, &mut touched, |e| {
                    // SAFETY: take_held gives at most want_total entries.
                    unsafe { *wc.add(given) = e };
                    given += 1;
                });
                out = given;
                held_back = self.held_qps();
            }
            while poll_more && out < want_total {
                let want = want_total - out;
                // SAFETY: wc has room for want_total entries, out of which `out` are used.
                let got = unsafe {
                    (self.poll_cq)(
                        self.cq,
                        c_int::try_from(want).unwrap_or(c_int::MAX),
                        wc.add(out),
                    )
                };
                if got < 0 {
                    failed = Some(got);
                    break;
                }
                let got = usize::try_from(got).unwrap_or(0);
                out = translate(out, out..out + got, &mut held_back, &mut touched);
                poll_more = got == want;
            }
        }
        // Held under the poll lock, behind what was held before, and delivered now as far
        // as the buffer has room and their QPs' locks allow.
        self.push_held(held);
        let room = want_total - out;
        let mut given = 0;
        self.take_held(&qps, room, &mut touched, |e| {
            // SAFETY: take_held gives at most `room` entries, after the `out` used.
            unsafe { *wc.add(out + given) = e };
            given += 1;
        });
        out += given;
        drop(qps);
        // The clock is read only when something may be due: most polls of a flow that is
        // not held back find neither a QP with requests waiting nor a paced one queued.
        if !touched.is_empty() || self.pacer_due_ns.load(Ordering::Relaxed) != u64::MAX {
            let now = self.engine.clock.now();
            for q in touched {
                q.drain_or_defer(now);
            }
            self.engine.release_for(self, now);
        }
        match failed {
            Some(rc) if out == 0 => rc,
            _ => c_int::try_from(out).unwrap_or(c_int::MAX),
        }
    }
}

/// A completion the shaper holds for the application's next poll: settled (delivered as
/// it is: an application completion the pacer's poll took, or one the shaper synthesized),
/// or as the provider gave it, to be translated under its QP's lock, which another thread
/// held when it was polled (see [`CqShared::take_held`]).
#[derive(Clone, Copy)]
pub(crate) struct Held {
    pub(crate) wc: ibv_wc,
    settled: bool,
    /// Its `qp_num` is the provider's (false: an extended CQ without QP numbers, whose
    /// completion is attributed by its tag when it is translated).
    qp_known: bool,
}

impl Held {
    /// A completion to deliver as it is.
    pub(crate) fn settled(wc: ibv_wc) -> Held {
        Held {
            wc,
            settled: true,
            qp_known: true,
        }
    }

    /// A completion still to translate; `qp_known` as for [`CqShared::translate`].
    pub(crate) fn raw(wc: ibv_wc, qp_known: bool) -> Held {
        Held {
            wc,
            settled: false,
            qp_known,
        }
    }

    /// Whether this is a completion of the QP `qp_num` carrying a tag of its `ring` (see
    /// [`CqShared::drop_stale`]).
    pub(crate) fn stale_of(&self, qp_num: u32, ring: &QuickRing) -> bool {
        !self.settled
            && (!self.qp_known || self.wc.qp_num == qp_num)
            && ring.contains(self.wc.wr_id)
    }

    /// A completion held before its QP is known: everything after it waits behind it.
    pub(crate) fn unattributed(&self) -> bool {
        !self.settled && !self.qp_known
    }
}

/// Adds `q` to `touched` once.
pub(crate) fn note_touched(touched: &mut Vec<Arc<QpShared>>, q: Arc<QpShared>) {
    if !touched.iter().any(|t| Arc::ptr_eq(t, &q)) {
        touched.push(q);
    }
}

/// The shaped QPs of a CQ, in QP-number order (so that a completion finds its QP by binary
/// search, not by a scan of every QP), and the ring of the only one when there is one.
#[derive(Default)]
pub struct CqQps {
    list: Vec<Arc<QpShared>>,
    /// The QP numbers and rings of QPs taken out of `list` for their destroy, kept until
    /// the provider's CQ has been polled clean of their completions
    /// ([`CqShared::forget_departed`]): a poll in between (the application's, on another
    /// thread) may find one of theirs, which carries a tag that must never reach the
    /// application, or a QP created since may have taken the QP number. Counted in the
    /// CQ's `shaped` and `work` until forgotten, so that such a poll translates.
    departed: Vec<(u32, Arc<QuickRing>)>,
    /// The ring of the only QP, so that a poll of a CQ of one shaped QP (the usual case)
    /// reaches it with one load and no search.
    sole: Option<Arc<QuickRing>>,
    /// QPs with a receiver half whose receive CQ this is, in QP-number order: their
    /// receive completions are translated (see `super::two_sided`).
    receivers: Vec<Arc<QpShared>>,
    /// Polls take the general path: a QP is departing, or QPs have receiver halves.
    general: bool,
    /// Registered QPs that name this CQ, as their send or receive CQ (once per QP).
    users: usize,
    /// A QP names this CQ that the shaper could not register: the CQ is never quiet
    /// (see [`CqShared::arm_for_application`]).
    unobserved: bool,
}

impl CqQps {
    /// Whether `wc` carries a tag of a departed QP's send queue (its QP number unknown
    /// when not `qp_num_known`): the shaper's own, dropped as a purging provider would.
    fn departed_tag(&self, wc: &ibv_wc, qp_num_known: bool) -> bool {
        self.departed
            .iter()
            .any(|(n, r)| (!qp_num_known || wc.qp_num == *n) && r.contains(wc.wr_id))
    }

    /// Sets [`Self::sole`] and [`Self::general`] after a change of the lists.
    fn find_sole(&mut self) {
        self.sole = match self.list.as_slice() {
            [q] => Some(Arc::clone(&q.ring)),
            _ => None,
        };
        self.general = !self.departed.is_empty() || !self.receivers.is_empty();
    }

    /// Whether `qp` is one of the CQ's shaped QPs.
    fn lists(&self, qp: &QpShared) -> bool {
        self.list.iter().any(|q| std::ptr::eq(&**q, qp))
    }

    /// Whether `qp` is one of the CQ's shaped QPs or receivers: a QP not (or no longer)
    /// listed has no completions of its own to poll for here.
    fn holds(&self, qp: &QpShared) -> bool {
        self.lists(qp) || self.receivers.iter().any(|q| std::ptr::eq(&**q, qp))
    }

    /// The QP with a receiver half numbered `qp_num`, if any.
    #[inline]
    fn receiver(&self, qp_num: u32) -> Option<&Arc<QpShared>> {
        if self.receivers.is_empty() {
            return None;
        }
        shared_of(&self.receivers, qp_num)
    }
}

impl std::ops::Deref for CqQps {
    type Target = [Arc<QpShared>];

    fn deref(&self) -> &Self::Target {
        &self.list
    }
}

/// The ring of the shaped QP `qp_num` among `qps` (in QP-number order), if it is one.
#[inline(never)]
fn ring_of(qps: &[Arc<QpShared>], qp_num: u32) -> Option<&QuickRing> {
    shared_of(qps, qp_num).map(|q| &*q.ring)
}

/// The QP `qp_num` among `qps` (in QP-number order), if it is there.
#[inline(always)]
fn shared_of(qps: &[Arc<QpShared>], qp_num: u32) -> Option<&Arc<QpShared>> {
    let at = qps.binary_search_by_key(&qp_num, |q| q.qp_num).ok()?;
    qps.get(at)
}

/// Where [`CqShared::poll_general`] takes over from [`CqShared::poll_shaped`]: the
/// completions `..kept` of the buffer are settled, `next..got` are the provider's still to
/// translate, and `full` says whether that call filled what it was asked for (the
/// provider may have more). All zero: nothing was done.
#[derive(Clone, Copy, Debug, Default)]
struct Resume {
    kept: usize,
    next: usize,
    got: usize,
    full: bool,
}
