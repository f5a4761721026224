//! The shaper's state for one queue pair: its send queue behind the QP's lock, the shaped
//! post paths (`ibv_post_send`, the `ibv_wr_*` batch), and its registration, destroy and
//! reset.
//!
//! Locks, in the order they are taken: the QP's state lock (`QpShared::state`), held
//! across the provider's post and across a drain, never across a poll of the provider's
//! CQ; under it only leaves: the rate gate's pacer lock, the send CQ's held queue (what a
//! drain or a move to the error state synthesizes is queued there before the queue posts
//! more), the pacer's queue lock. A CQ's poll lock is never taken under it; registration
//! and destroy take the send CQ's poll lock first (to add or remove the QP) and the QP's
//! lock alone otherwise. Nothing is logged under it.

use std::cell::Cell;
use std::ffi::c_int;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use justitia_core::classifier::FlowClassifier;
use justitia_verbs::sys::*;

use super::ex_state::{QpExOps, WrBatch};
use super::pacer::SLOT_POLL_DELAY;
use super::{CqShared, CtxShared, Engine, Held, PostRecvFn, PostSendFn, CQS, QPS};
use crate::config::ClassSetting;
use crate::log::log;
use crate::registry::PtrMap;
use crate::send_queue::{Blocked, DrainEnv, FastLane, OwnedWr, QuickRing, SendQueue, Treatment};
use crate::stats::Counters;

/// One request in this many of a latency process is a candidate for timing: enough round
/// trips for the daemon's p99 (a flow of 10 us round trips gives 12 in a RefPeriod of
/// 500 us), at a quarter of the clock reads.
pub const TIMED_STRIDE: u64 = 4;

/// What registration needs to know about a new QP.
#[derive(Clone, Copy, Debug)]
pub struct QpInit {
    /// Its send CQ.
    pub send_cq: *mut ibv_cq,
    /// Its receive CQ.
    pub recv_cq: *mut ibv_cq,
    /// `IBV_QPT_*`.
    pub qp_type: ibv_qp_type,
    /// Every request generates a completion.
    pub sig_all: bool,
    /// The capacities the provider granted.
    pub cap: ibv_qp_cap,
    /// False when the QP uses verbs the shaper does not know (see
    /// [`shapable_send_ops`]): it is then only observed.
    pub shapable: bool,
    /// It takes its receives from a shared receive queue.
    pub has_srq: bool,
}

/// The `ibv_wr_*` send operations the shaper collects and reposts: what an application may
/// ask for in `send_ops_flags` on a shaped QP.
const SHAPED_SEND_OPS: u64 = (IBV_QP_EX_WITH_RDMA_WRITE
    | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | IBV_QP_EX_WITH_SEND
    | IBV_QP_EX_WITH_SEND_WITH_IMM
    | IBV_QP_EX_WITH_RDMA_READ
    | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
    | IBV_QP_EX_WITH_LOCAL_INV
    | IBV_QP_EX_WITH_BIND_MW
    | IBV_QP_EX_WITH_SEND_WITH_INV) as u64;

/// Whether a QP asking for the `ibv_wr_*` operations `send_ops_flags` can be shaped.
///
/// The shaper replaces every `ibv_wr_*` pointer it knows, those of the rdma-core its
/// bindings describe. An operation it does not know (one a later rdma-core added, such as
/// `ibv_wr_flush` in rdma-core 45, whose pointer lies past the end of the bindings'
/// `ibv_qp_ex` and would stay the provider's) would reach the provider between the shaper's
/// own `ibv_wr_start` and `ibv_wr_complete`, and never be posted; one it knows but cannot
/// express as a send request (atomic write, TSO) would be refused. Either way the QP passes
/// through whole instead, said once with the running rdma-core's release.
pub fn shapable_send_ops(send_ops_flags: u64) -> bool {
    if send_ops_flags & !SHAPED_SEND_OPS == 0 {
        return true;
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        let running = justitia_verbs::loader::loaded_rdma_core_release()
            .map_or_else(|| "unknown".to_string(), |r| r.to_string());
        log!(
            Warn,
            "a QP asks for ibv_wr_* operations the shaper does not handle (send_ops_flags {send_ops_flags:#x}; bindings of rdma-core {}, running rdma-core {running}); such QPs pass through unshaped",
            justitia_verbs::BINDINGS_RDMA_CORE_RELEASE
        );
    }
    false
}

/// The shaper's state for one QP.
pub struct QpShared {
    pub(super) me: Weak<QpShared>,
    pub(crate) qp: *mut ibv_qp,
    pub(crate) qp_num: u32,
    /// Its send queue's tags and quick requests, which polls settle without its lock.
    pub(crate) ring: Arc<QuickRing>,
    pub(crate) engine: Arc<Engine>,
    pub(crate) post_send: PostSendFn,
    pub(crate) post_recv: Option<PostRecvFn>,
    pub(crate) shaped: bool,
    /// Its `max_send_wr`: the most completions it can have waiting in its send CQ.
    pub(super) send_depth: u32,
    pub(super) send_cq: Option<Arc<CqShared>>,
    /// Its receive CQ, if registered, and its `max_recv_wr`: counted in that CQ's
    /// `recv_entries` while `recv_counted` (from registration to destroy).
    pub(super) recv_cq: Option<Arc<CqShared>>,
    pub(super) recv_depth: u32,
    pub(super) recv_counted: AtomicBool,
    /// Counted among the users of the CQs it names (see `CqShared::add_user`), from
    /// registration to destroy.
    pub(super) uses_counted: AtomicBool,
    pub(crate) state: parking_lot::Mutex<QpState>,
    pub(super) in_pacer: AtomicBool,
    pub(crate) ex: Option<QpExOps>,
    /// The shaper failed (panicked) on this QP's post path: its posts pass through.
    pub(super) failed_open: AtomicBool,
    /// Its posts are shaped: it is shaped, the shaper has not failed on it, and this is not
    /// a child forked after it was registered (see [`pass_through_in_child`]). What the
    /// post hook reads.
    pub(super) posts_shaped: AtomicBool,
    /// An RC QP on an engine with a class set: part of the daemon's flow.
    pub(super) member: bool,
    /// Counted in [`Engine::members`] (from registration to destroy).
    pub(super) counted: AtomicBool,
    /// It has been moved to ready-to-receive: a later move there (after a reset or an
    /// error) loads its context into the RNIC again (see [`Self::rebrings_up`]).
    pub(super) been_ready: AtomicBool,
    /// An observed RC QP of a process that times its round trips for the daemon
    /// ([`crate::round_trips`]): its single requests go through [`Self::post_timed`].
    pub(crate) timed: bool,
    /// Every request it posts is signaled (`sq_sig_all`).
    sig_all: bool,
    /// Its receiver half, when its receives may be owned for a peer that splits its
    /// sends (see [`super::two_sided`]).
    pub(crate) receiver: Option<super::two_sided::ReceiverShared>,
}

// SAFETY: the QP pointer is only passed to the provider, which allows any thread.
unsafe impl Send for QpShared {}
// SAFETY: as above; mutable state is behind the mutex.
unsafe impl Sync for QpShared {}

/// Mutable state of a shaped QP.
pub struct QpState {
    pub(crate) sq: SendQueue,
    /// Its path MTU in bytes (the smallest, 256, until `ibv_modify_qp` sets it).
    pub(super) path_mtu: u32,
    /// RDMA READs it may have outstanding as initiator (`max_rd_atomic`; 0: not set yet).
    pub(super) max_rd_atomic: u32,
    pub(super) classifier: Option<FlowClassifier>,
    /// The treatment of a small request when the class is fixed (see [`FastLane`]), valid
    /// while `fast_epoch` is the engine's settings epoch.
    pub(super) fast: FastLane,
    /// The engine's settings epoch `fast` was derived at, or [`NO_LANE`] when the QP has
    /// none (the automatic class): one comparison says whether `fast` may be used.
    pub(super) fast_epoch: u64,
    pub(crate) batch: WrBatch,
    /// Its device is Soft-RoCE (rxe); see [`Self::chunk_bytes_for`].
    pub(super) soft_roce: bool,
    /// Its sender half, when its sends may be split for a peer that owns its receives
    /// (see [`super::two_sided`]). Such a QP has no fast lane: every receive-consuming
    /// request is counted or announced on the general path.
    pub(super) sender: Option<Box<super::two_sided::SenderHalf>>,
}

/// [`QpState::fast_epoch`] of a QP without a fast lane (no settings epoch reaches it).
const NO_LANE: u64 = u64::MAX;

/// The smallest path MTU (`IBV_MTU_256`), the floor of a chunk until the QP's own is set.
const MIN_PATH_MTU: u32 = 256;

impl QpState {
    /// The fast lane in effect, if the QP has one.
    #[inline(always)]
    fn lane(&mut self, engine: &Engine) -> Option<FastLane> {
        if self.fast_epoch == u64::from(engine.settings_epoch.load(Ordering::Relaxed)) {
            return Some(self.fast);
        }
        // The daemon changed the pacing or the chunk size since the lane was derived, the
        // MTU changed, or the QP has no lane.
        self.refresh_fast(engine)
    }

    /// Derives the fast lane again from the engine's settings in effect.
    #[cold]
    #[inline(never)]
    fn refresh_fast(&mut self, engine: &Engine) -> Option<FastLane> {
        let epoch = engine.settings_epoch.load(Ordering::Acquire);
        let lane = engine
            .fast_lane(self.path_mtu, self.soft_roce)
            .filter(|_| self.sender.is_none());
        self.fast_epoch = lane.map_or(NO_LANE, |_| u64::from(epoch));
        self.fast = lane.unwrap_or(FastLane {
            whole_up_to: 0,
            paced: false,
        });
        lane
    }

    /// The chunk size for a request with `opcode` of `bytes` on this QP, from the
    /// configured `chunk`.
    ///
    /// A chunk is never smaller than the path MTU: smaller WQEs only add per-WQE cost (a
    /// 1-byte setting would turn 1 MiB into a million WQEs) and the wire carries an MTU per
    /// packet anyway. An RDMA READ is never cut into more pieces than the QP's
    /// `max_rd_atomic`: the NIC holds back READs beyond that many until one has returned,
    /// so each further piece costs a round trip without freeing the link any sooner.
    ///
    /// On Soft-RoCE an RDMA WRITE goes one path MTU a WQE. rxe's retransmission of a
    /// multi-packet WRITE can desynchronise the connection: when its retransmission timer
    /// fires while a WRITE's acknowledgement is still on its way (a busy responder answers
    /// late, and paced WRITEs leave the send queue idle between releases), the
    /// acknowledgement of the WRITE's last packet may arrive while rxe is resending the
    /// WRITE; rxe then moves its acknowledged PSN past the WRITE without completing it,
    /// and its next retry replays the WRITE as a zero-length WRITE ONLY one PSN past the
    /// WRITE's end. Every later packet is one PSN late, and the responder, which had the
    /// next WRITE's first packets, gets one packet more than that WRITE's length and
    /// answers "invalid request": the application sees `IBV_WC_REM_INV_REQ_ERR`. Unshaped
    /// WRITEs meet it too, under load, but paced ones met it all the time (across two
    /// hosts, in every round of two 2 MB/s paced `ib_write_bw` of 64 KiB), and a flow
    /// whose daemon is slow falls back to unpaced. A single-packet WRITE is never half
    /// resent, so rxe's acknowledged PSN never passes one it has not completed.
    pub(super) fn chunk_bytes_for(&self, chunk: u32, opcode: ibv_wr_opcode, bytes: u64) -> u32 {
        // A WRITE with immediate, split, goes as WRITEs too.
        if self.soft_roce && matches!(opcode, IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM) {
            return self.path_mtu;
        }
        let mut chunk = chunk.max(self.path_mtu);
        if opcode == IBV_WR_RDMA_READ && self.max_rd_atomic > 0 {
            let per_read = bytes.div_ceil(u64::from(self.max_rd_atomic));
            chunk = chunk.max(u32::try_from(per_read).unwrap_or(u32::MAX));
        }
        chunk
    }
}

/// Said once per process when [`QPS`] is full.
static QPS_FULL_SAID: AtomicBool = AtomicBool::new(false);

/// Registers a QP created on an attached context. `qpx` is its extended form when it was
/// created with `ibv_wr_*` send operations, whose pointers are saved (the caller installs
/// the shaper's, see [`crate::install`]).
///
/// # Safety
/// `qp` must be a live QP of `ctx`, just created; `qpx` its extended form or null.
pub unsafe fn register_qp(
    ctx: &CtxShared,
    qp: *mut ibv_qp,
    init: QpInit,
    qpx: *mut ibv_qp_ex,
) -> bool {
    // SAFETY: guaranteed by the caller.
    unsafe { register_qp_in(&QPS, ctx, qp, init, qpx) }
}

/// [`register_qp`] into `qps` ([`QPS`], or a small map in tests). Returns false when the
/// QP is not registered: it then passes through untouched, and the caller must leave its
/// `ibv_wr_*` pointers the provider's, since the shaper's would find no state to work
/// with.
///
/// # Safety
/// As [`register_qp`].
pub(crate) unsafe fn register_qp_in<const N: usize>(
    qps: &PtrMap<QpShared, N>,
    ctx: &CtxShared,
    qp: *mut ibv_qp,
    init: QpInit,
    qpx: *mut ibv_qp_ex,
) -> bool {
    let engine = Arc::clone(&ctx.engine);
    let Some(post_send) = ctx.post_send else {
        return false;
    };
    // A QP destroyed behind the shaper's back, whose address was reused: its state leaves
    // its CQ before that CQ's QP list is locked below (taking it out locks the list).
    if let Some(stale) = qps.get(qp.cast()) {
        if let Some((gone, _)) = unregister_qp_in(qps, qp, stale) {
            gone.forget_departed();
            gone.forget_receiver();
        }
    }
    let send_cq = CQS.get_arc(init.send_cq.cast());
    let recv_cq = CQS.get_arc(init.recv_cq.cast());
    // Its receives' share of its send CQ, when that is its receive CQ too.
    let recv_here = if init.recv_cq == init.send_cq {
        init.cap.max_recv_wr
    } else {
        0
    };
    // Completions of a shaped QP must be translated, so its send CQ must be one the shaper
    // knows; a QP whose CQ it does not know is only observed. The CQ's QP list stays locked
    // until the QP is in it, so that two QPs created at once cannot both take the CQ's
    // last room.
    let mut cq_qps = send_cq.as_ref().map(|c| c.qps.lock());
    let mut too_small = None;
    let shaped = engine.shapes(init.qp_type)
        && init.shapable
        && match (&send_cq, &cq_qps) {
            (Some(cq), Some(qps)) => {
                too_small = cq.room_needed(qps, init.cap.max_send_wr, recv_here);
                too_small.is_none()
            }
            _ => false,
        };
    // SAFETY: the caller guarantees qp is live.
    let qp_num = unsafe { (*qp).qp_num };
    let classifier = (shaped && engine.config.class == Some(ClassSetting::Auto))
        .then(|| FlowClassifier::new(engine.classifier).ok())
        .flatten();
    // SAFETY: qpx is null or the QP's extended form; its pointers are the provider's.
    let ex = unsafe { qpx.as_mut() }.map(|x| QpExOps::save(x));
    let sq = SendQueue::new(
        qp_num,
        init.cap.max_send_wr,
        init.cap.max_send_sge,
        init.sig_all,
    );
    let ring = Arc::clone(sq.ring());
    let timed = !shaped && init.qp_type == IBV_QPT_RC && engine.round_trips.is_some();
    // Halves for splitting two-sided requests (see `super::two_sided`): a sender half on
    // a QP whose sends may be split, a receiver half on one whose receive completions can
    // be translated.
    let link = ctx.engine.side.as_ref();
    let sends_split = link.is_some() && shaped && engine.may_split_sends();
    let owns_receives = link.is_some()
        && init.qp_type == IBV_QPT_RC
        && !init.has_srq
        && init.cap.max_recv_wr > 0
        && ctx.post_recv.is_some()
        && recv_cq
            .as_deref()
            .is_some_and(super::two_sided::translates_receives)
        && (shaped || init.send_cq != init.recv_cq);
    let shared = Arc::new_cyclic(|me| QpShared {
        me: me.clone(),
        qp,
        qp_num,
        ring,
        post_send,
        post_recv: ctx.post_recv,
        shaped,
        send_depth: init.cap.max_send_wr,
        send_cq: send_cq.clone(),
        recv_cq,
        recv_depth: init.cap.max_recv_wr,
        recv_counted: AtomicBool::new(false),
        uses_counted: AtomicBool::new(false),
        state: parking_lot::Mutex::new(QpState {
            sq,
            path_mtu: MIN_PATH_MTU,
            max_rd_atomic: 0,
            classifier,
            // Derived at the first post.
            fast: FastLane {
                whole_up_to: 0,
                paced: false,
            },
            fast_epoch: NO_LANE,
            batch: WrBatch::default(),
            soft_roce: ctx.soft_roce.load(Ordering::Relaxed),
            sender: (sends_split && link.is_some_and(|l| l.join(qp_num, me.clone())))
                .then(Box::default),
        }),
        in_pacer: AtomicBool::new(false),
        ex,
        member: init.qp_type == IBV_QPT_RC && engine.config.class.is_some(),
        counted: AtomicBool::new(false),
        engine,
        failed_open: AtomicBool::new(false),
        posts_shaped: AtomicBool::new(shaped),
        been_ready: AtomicBool::new(false),
        timed,
        sig_all: init.sig_all,
        receiver: (owns_receives && link.is_some_and(|l| l.join(qp_num, me.clone()))).then(|| {
            super::two_sided::ReceiverShared::new(init.cap.max_recv_wr, init.cap.max_recv_sge)
        }),
    });
    // Registered first: a QP the map has no room for must leave no trace in its CQ either.
    let replaced = match qps.insert(qp.cast(), Arc::clone(&shared)) {
        // Registered at this address meanwhile by another thread: detached below, once the
        // CQ's QP list is unlocked.
        Ok(old) => old,
        Err(_) => {
            drop(cq_qps);
            // Its completions reach its CQs unobserved: they are never quiet.
            for cq in shared.named_cqs() {
                cq.add_user(false);
            }
            if !QPS_FULL_SAID.swap(true, Ordering::Relaxed) {
                log!(
                    Warn,
                    "more than {N} queue pairs; the ones past that pass through unobserved"
                );
            }
            return false;
        }
    };
    Counters::add(&shared.engine.counters.qps, 1);
    if let (true, Some(cq), Some(qps)) = (shaped, &send_cq, cq_qps.as_mut()) {
        cq.add_qp_locked(qps, &shared);
    }
    if let (Some(_), Some(cq)) = (&shared.receiver, &shared.recv_cq) {
        if shared.recv_cq.as_ref().map(Arc::as_ptr) == shared.send_cq.as_ref().map(Arc::as_ptr) {
            match cq_qps.as_mut() {
                Some(qps) => cq.add_receiver_locked(qps, &shared),
                None => cq.add_receiver(&shared),
            }
        } else {
            cq.add_receiver(&shared);
        }
    }
    shared.count_receives();
    drop(cq_qps);
    shared.count_uses();
    // Said outside the CQ's lock.
    if let (Some(needed), Some(cq)) = (too_small, &send_cq) {
        cq.say_too_small(needed);
    }
    // Outside the CQ's lock: joining the flow may start the follower thread.
    shared.count_member();
    if let Some(old) = replaced {
        drop(old.detach());
    }
    log!(
        Info,
        "QP {qp_num}: {} (send queue {} deep)",
        if shaped { "shaped" } else { "observed" },
        init.cap.max_send_wr
    );
    true
}

/// The registration of a QP, to pass to [`unregister_qp`] once it is destroyed.
pub fn qp_token(qp: *mut ibv_qp) -> Option<NonNull<QpShared>> {
    QPS.get(qp.cast())
}

/// Destroys a QP with `real` (the provider's destroy), the shaper's state first.
///
/// The state is detached before the provider destroys the QP, so that nothing the shaper
/// runs on other threads can reach a destroyed QP: the QP is marked destroyed under its
/// lock (which waits for a drain in progress, and keeps the pacer and other CQs' polls
/// from posting its held requests), taken out of the registry, its CQ and the pacer's
/// queue, and the completions the shaper still held for it are purged (a provider purges
/// a destroyed QP's completions). If the provider refuses the destroy, the QP is
/// registered again as it was. Otherwise its state is freed here.
///
/// A provider may leave a destroyed QP's completions in its CQ (rxe does). Those of its send
/// queue carry the shaper's tags, which must never reach the application, and which a QP
/// created later could reuse (its ring may be allocated where this one was): once the
/// provider has destroyed the QP, its send CQ is polled empty under the CQ's poll lock,
/// completions carrying its tags are dropped (as a provider that purges drops them), and
/// every other completion is held for the application's next poll, in order.
pub fn destroy_qp(qp: *mut ibv_qp, real: impl FnOnce() -> c_int) -> c_int {
    let Some(token) = qp_token(qp) else {
        return real();
    };
    let Some((shared, purged)) = unregister_qp_in(&QPS, qp, token) else {
        return real();
    };
    let rc = real();
    if rc != 0 {
        shared.reinstate(&QPS, purged);
    } else {
        if let (true, Some(cq)) = (shared.shaped, &shared.send_cq) {
            cq.drop_stale(shared.qp_num, &shared.ring, shared.engine.clock.now());
        }
        shared.forget_departed();
    }
    shared.forget_receiver();
    rc
}

/// Forgets a destroyed QP, if its registration is still `token` (taken before the destroy
/// call, so that a new QP at the same address is not forgotten instead).
pub fn unregister_qp(qp: *mut ibv_qp, token: NonNull<QpShared>) {
    if let Some((gone, _)) = unregister_qp_in(&QPS, qp, token) {
        gone.forget_departed();
        gone.forget_receiver();
    }
}

/// [`unregister_qp`] from `qps`; returns the state, detached, and the completions the
/// shaper held for it (put back if the provider refuses the destroy).
pub(crate) fn unregister_qp_in<const N: usize>(
    qps: &PtrMap<QpShared, N>,
    qp: *mut ibv_qp,
    token: NonNull<QpShared>,
) -> Option<(Arc<QpShared>, Vec<Held>)> {
    // SAFETY: the token is the registered state, alive while it is in the map.
    unsafe { token.as_ref() }.lock().sq.set_destroyed(true);
    let shared = qps.remove(qp.cast(), token)?;
    let purged = shared.detach();
    Some((shared, purged))
}

impl QpShared {
    /// Takes this (destroyed) QP out of its CQ and the pacer's queue, and purges the
    /// completions the shaper holds for it, which it returns. Taking it out of its CQ's QP
    /// list waits for a poll of the pacer's in progress for it, and no later one starts
    /// (see `CqShared::poll_for_pacer`): once this returns, nothing the shaper runs on
    /// another thread polls its CQ on its behalf.
    fn detach(self: &Arc<Self>) -> Vec<Held> {
        self.lock().sq.set_destroyed(true);
        if self.counted.swap(false, Ordering::AcqRel) {
            self.engine.members_changed(&self.me, false);
        }
        if let (true, Some(cq)) = (
            self.recv_counted.swap(false, Ordering::AcqRel),
            &self.recv_cq,
        ) {
            cq.recv_entries
                .fetch_sub(u64::from(self.recv_depth), Ordering::AcqRel);
        }
        if self.uses_counted.swap(false, Ordering::AcqRel) {
            for cq in self.named_cqs() {
                cq.remove_user();
            }
        }
        if let Some(link) = &self.engine.side {
            link.leave(self.qp_num, &self.me);
        }
        let purged = match &self.send_cq {
            Some(cq) => {
                cq.remove_qp(self);
                cq.purge_qp(self.qp_num)
            }
            None => Vec::new(),
        };
        let woken = self.engine.turns.leave(self);
        // A stale `next_due_ns` left behind only costs one needless tick.
        let mut queue = self.engine.pacer_queue();
        queue.waiting.retain(|(q, _)| !Arc::ptr_eq(q, self));
        self.in_pacer.store(false, Ordering::Release);
        drop(queue);
        if let Some(next) = woken {
            let now = self.engine.clock.now();
            self.engine.schedule(next, now, now);
        }
        purged
    }

    /// Takes this destroyed QP's receiver half (if any) out of its receive CQ, once that CQ
    /// is clean of its internal receives' completions ([`CqShared::drop_stale_receives`]).
    /// A destroy the provider refused keeps it, with the rest of the QP's state.
    fn forget_receiver(self: &Arc<Self>) {
        if !self.lock().sq.destroyed() {
            return;
        }
        if let (Some(_), Some(cq)) = (&self.receiver, &self.recv_cq) {
            cq.drop_stale_receives(self, self.engine.clock.now());
        }
    }

    /// Forgets this QP's tags in its send CQ (see `CqQps::departed`): its completions have
    /// been polled out of the provider's CQ, or nothing will look for them.
    fn forget_departed(&self) {
        if let Some(cq) = &self.send_cq {
            cq.forget_departed(&self.ring);
        }
    }

    /// Counts a registered QP's receive queue in its receive CQ's entries.
    fn count_receives(&self) {
        if let (Some(cq), false) = (
            &self.recv_cq,
            self.recv_counted.swap(true, Ordering::AcqRel),
        ) {
            cq.recv_entries
                .fetch_add(u64::from(self.recv_depth), Ordering::AcqRel);
        }
    }

    /// The registered CQs this QP names, each once: its send CQ and, when another, its
    /// receive CQ.
    fn named_cqs(&self) -> impl Iterator<Item = &Arc<CqShared>> {
        let recv = self
            .recv_cq
            .as_ref()
            .filter(|r| !self.send_cq.as_ref().is_some_and(|s| Arc::ptr_eq(s, r)));
        self.send_cq.iter().chain(recv)
    }

    /// Counts a registered QP among the users of the CQs it names.
    fn count_uses(&self) {
        if !self.uses_counted.swap(true, Ordering::AcqRel) {
            for cq in self.named_cqs() {
                cq.add_user(true);
            }
        }
    }

    /// Counts a registered member QP in the daemon's flow.
    fn count_member(&self) {
        if self.member && !self.counted.swap(true, Ordering::AcqRel) {
            self.engine.members_changed(&self.me, true);
        }
    }

    /// Registers again a QP whose destroy the provider refused, with the completions the
    /// shaper held for it (`purged`) held again.
    fn reinstate<const N: usize>(self: &Arc<Self>, qps: &PtrMap<QpShared, N>, purged: Vec<Held>) {
        self.lock().sq.set_destroyed(false);
        if qps.insert(self.qp.cast(), Arc::clone(self)).is_err() {
            return;
        }
        self.count_member();
        self.count_receives();
        self.count_uses();
        if let Some(cq) = &self.send_cq {
            if self.shaped {
                self.forget_departed();
                cq.add_qp(self);
            }
            cq.push_held(purged);
        }
        self.drain(self.engine.clock.now());
    }
}

/// What a drain did: the provider's refusal (the index in the running call's list and the
/// error), the `wr_id`s of requests that completed with an error for it, why posting
/// stopped, and the QP a turn went to.
pub(super) struct Drained {
    refused: Option<(usize, c_int)>,
    refused_ids: Vec<u64>,
    blocked: Blocked,
    woken: Option<Arc<QpShared>>,
}

impl Drained {
    /// Nothing posted, nothing to follow up.
    fn nothing() -> Self {
        Drained {
            refused: None,
            refused_ids: Vec::new(),
            blocked: Blocked::Idle,
            woken: None,
        }
    }
}

/// How far a shaped post call got, for [`QpShared::recover_post`] after a panic: nothing
/// yet, or the call's result and how many requests of its list the shaper holds, both
/// final. One word, so that the single request's path settles with one store.
pub(crate) struct Settled(Cell<u64>);

/// [`Settled`] before the call is settled (a count of `u32::MAX` held requests is never
/// reached: that long a list would not fit in memory).
const UNSETTLED: u64 = u64::MAX;

impl Settled {
    /// Nothing settled yet.
    pub(crate) fn new() -> Self {
        Settled(Cell::new(UNSETTLED))
    }

    /// The call returns `rc`, and the shaper holds the first `held` requests of its list.
    #[inline(always)]
    fn set(&self, rc: c_int, held: usize) {
        let held = u32::try_from(held).unwrap_or(u32::MAX - 1);
        self.0.set(u64::from(held) << 32 | u64::from(rc as u32));
    }

    /// What was settled, if anything.
    pub(crate) fn get(&self) -> Option<(c_int, usize)> {
        let v = self.0.get();
        (v != UNSETTLED).then_some((v as u32 as c_int, (v >> 32) as usize))
    }
}

/// Names the first request of `wr` in `bad_wr` (if writable): the provider refused it.
///
/// # Safety
/// `bad_wr` is null or writable.
#[cold]
#[inline(never)]
unsafe fn refuse_first(wr: *mut ibv_send_wr, bad_wr: *mut *mut ibv_send_wr) {
    if !bad_wr.is_null() {
        // SAFETY: guaranteed by the caller.
        unsafe { *bad_wr = wr };
    }
}

/// Requests and payload bytes of a request list.
///
/// # Safety
/// `wr` must be a valid request list.
unsafe fn count_list(mut wr: *const ibv_send_wr) -> (u64, u64) {
    let mut n = 0u64;
    let mut bytes = 0u64;
    // SAFETY: guaranteed by the caller.
    unsafe {
        while let Some(w) = wr.as_ref() {
            n += 1;
            let sges = usize::try_from(w.num_sge).unwrap_or(0);
            if sges != 0 && !w.sg_list.is_null() {
                for s in std::slice::from_raw_parts(w.sg_list, sges) {
                    bytes += u64::from(s.length);
                }
            }
            wr = w.next;
        }
    }
    (n, bytes)
}

/// The request at position `n` of the list `wr`, or null past its end.
///
/// # Safety
/// `wr` must be a valid request list.
unsafe fn nth(mut wr: *mut ibv_send_wr, n: usize) -> *mut ibv_send_wr {
    for _ in 0..n {
        // SAFETY: guaranteed by the caller.
        match unsafe { wr.as_ref() } {
            Some(w) => wr = w.next,
            None => break,
        }
    }
    wr
}

/// The state of a registered QP if it is found without probing (see
/// [`PtrMap::get_at_home`]).
#[inline(always)]
pub(crate) fn qp_fast(qp: *mut ibv_qp) -> Option<&'static QpShared> {
    // SAFETY: as in `qp`.
    QPS.get_at_home(qp.cast()).map(|p| unsafe { &*p.as_ptr() })
}

/// The state of a registered QP.
#[inline(always)]
pub(crate) fn qp(qp: *mut ibv_qp) -> Option<&'static QpShared> {
    // SAFETY: QP state is freed at the QP's destroy, which verbs forbid while a call on the
    // QP runs (see the module's documentation).
    QPS.get(qp.cast()).map(|p| unsafe { &*p.as_ptr() })
}

impl QpShared {
    #[inline(always)]
    pub(super) fn lock(&self) -> parking_lot::MutexGuard<'_, QpState> {
        self.state.lock()
    }

    /// Counts a single request with one SGE posted on an observed QP (the usual case,
    /// kept free of calls so the hook stays a leaf that tail-calls the provider).
    #[inline(always)]
    pub(crate) fn observe_one(&self, bytes: u32) {
        let counters = &self.engine.counters;
        counters.requests.fetch_add(1, Ordering::Relaxed);
        counters
            .bytes
            .fetch_add(u64::from(bytes), Ordering::Relaxed);
    }

    /// Counts and posts the single request `wr` of an observed QP that may be timed
    /// ([`Self::timed`]; see [`Self::start_timing`]), untimed again if the provider
    /// refuses it.
    ///
    /// # Safety
    /// As `ibv_post_send`, with a single request.
    #[inline(always)]
    pub(crate) unsafe fn post_timed(
        &self,
        qp: *mut ibv_qp,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
    ) -> c_int {
        // SAFETY: guaranteed by the caller.
        let (n, bytes) = unsafe { count_list(wr) };
        let counters = &self.engine.counters;
        let before = counters.requests.fetch_add(n, Ordering::Relaxed);
        counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        // SAFETY: guaranteed by the caller.
        let timed = unsafe { wr.as_ref() }
            .is_some_and(|w| self.start_timing(before, w.wr_id, w.send_flags));
        // SAFETY: the provider's own post_send, with the caller's arguments.
        let rc = unsafe { (self.post_send)(qp, wr, bad_wr) };
        if let (true, Some(r)) = (timed && rc != 0, self.engine.round_trips()) {
            r.refused(self.qp_num);
        }
        rc
    }

    /// A request of this observed QP starts, the process's request number `before`, with
    /// `wr_id` and `flags` (`IBV_SEND_*`): one request in [`TIMED_STRIDE`] of the
    /// process's is a candidate (by the count the post takes anyway), timed if it is
    /// signaled, the process's round trips want one and none is being timed (see
    /// [`crate::round_trips`]). Returns whether it is.
    #[inline(always)]
    pub(crate) fn start_timing(&self, before: u64, wr_id: u64, flags: u32) -> bool {
        if !self.timed || !before.is_multiple_of(TIMED_STRIDE) {
            return false;
        }
        self.engine.round_trips().is_some_and(|r| {
            r.posted(
                self.qp_num,
                wr_id,
                self.sig_all || flags & IBV_SEND_SIGNALED != 0,
            )
        })
    }

    /// Counts what an observed QP posts, any list.
    ///
    /// # Safety
    /// `wr` must be a valid request list.
    pub(crate) unsafe fn observe(&self, wr: *const ibv_send_wr) {
        // SAFETY: guaranteed by the caller.
        let (n, bytes) = unsafe { count_list(wr) };
        let counters = &self.engine.counters;
        counters.requests.fetch_add(n, Ordering::Relaxed);
        counters.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// True while the post hook shapes this QP's posts (else it counts them and passes
    /// them through): it is shaped, the shaper has not failed on it, and this is not a
    /// forked child.
    #[inline(always)]
    pub(crate) fn posts_shaped(&self) -> bool {
        self.posts_shaped.load(Ordering::Relaxed)
    }

    /// The shaped `ibv_post_send`. `settled` receives the call's result and how many
    /// requests of the list the shaper holds as soon as both are final, so that a panic
    /// after that point can still report them (see [`Self::recover_post`]).
    ///
    /// # Safety
    /// `wr` must be a valid request list and `bad_wr` writable.
    #[inline(always)]
    pub(crate) unsafe fn post_send_shaped(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: &Settled,
    ) -> c_int {
        // SAFETY: guaranteed by the caller.
        match unsafe { wr.as_ref() } {
            // SAFETY: a single request.
            Some(w) if w.next.is_null() => unsafe { self.post_single(wr, bad_wr, settled) },
            // SAFETY: guaranteed by the caller.
            _ => unsafe { self.post_list(wr, bad_wr, settled) },
        }
    }

    /// [`Self::post_send_shaped`] of a single request.
    ///
    /// # Safety
    /// As [`Self::post_send_shaped`]; `wr` is one request (not null, its `next` null).
    #[inline(always)]
    pub(crate) unsafe fn post_single(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: &Settled,
    ) -> c_int {
        // SAFETY: guaranteed by the caller.
        if let Some(rc) = unsafe { self.post_one_now(wr, bad_wr, settled) } {
            return rc;
        }
        // SAFETY: guaranteed by the caller.
        unsafe { self.post_list(wr, bad_wr, settled) }
    }

    /// [`Self::post_send_shaped`] of what [`Self::post_one_now`] does not post: a list, or
    /// a request held back, split, or of the automatic class. Out of line, so that the
    /// single request's path keeps a small frame.
    ///
    /// # Safety
    /// As [`Self::post_send_shaped`].
    #[inline(never)]
    unsafe fn post_list(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: &Settled,
    ) -> c_int {
        let now = self.engine.clock.now();
        let mut st = self.lock();
        let mut rc = 0;
        let mut index = 0usize;
        let mut cur = wr;
        let mut announced = Vec::new();
        // SAFETY: guaranteed by the caller.
        while let Some(w) = unsafe { cur.as_ref() } {
            #[cfg(test)]
            fault::hit(fault::PostFault::BeforeAccept(index));
            // SAFETY: as above.
            let owned = unsafe { OwnedWr::copy_from(w) };
            let treatment =
                self.engine
                    .treatment(&mut st, now, owned.opcode(), owned.payload_len());
            let treatment = match self.announce(&mut st, &owned, treatment, &mut announced) {
                Ok(t) => t,
                Err(e) => {
                    rc = e;
                    break;
                }
            };
            if let Err(e) = st.sq.accept(owned, treatment, index) {
                rc = e;
                break;
            }
            index += 1;
            cur = w.next;
        }
        let drained = self.drain_locked(&mut st, now);
        #[cfg(test)]
        fault::hit(fault::PostFault::AfterDrain);
        let held = match drained.refused {
            Some((at, e)) => {
                rc = e;
                at
            }
            None => index,
        };
        if st.sender.is_some() {
            self.send_announcements(&mut st, announced);
        }
        st.sq.end_call();
        settled.set(rc, held);
        drop(st);
        if rc != 0 && !bad_wr.is_null() {
            // SAFETY: guaranteed writable by the caller; held is within the list.
            unsafe { *bad_wr = nth(wr, held) };
        }
        #[cfg(test)]
        fault::hit(fault::PostFault::AfterSettled);
        self.after_drain(drained, now);
        rc
    }

    /// The shaped `ibv_post_send` of a single request that nothing holds back (see
    /// [`SendQueue::post_now`]): posted straight from the application's request, with no
    /// copy, no batch and no pacer bookkeeping, by the QP's [`FastLane`] (its treatment,
    /// derived once). The clock is read only when the pacer is asked. `None`: the request
    /// takes the general path, untouched.
    ///
    /// # Safety
    /// As [`Self::post_single`].
    #[inline(always)]
    unsafe fn post_one_now(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: &Settled,
    ) -> Option<c_int> {
        // SAFETY: guaranteed by the caller.
        let w = unsafe { &*wr };
        #[cfg(test)]
        fault::hit(fault::PostFault::BeforeAccept(0));
        let engine = &*self.engine;
        let mut st = self.lock();
        // A QP of the automatic class has no lane: the classifier must see every request
        // once, on the general path.
        let lane = st.lane(engine)?;
        // The gate is asked only by a paced lane. Should pacing have stopped since the lane
        // was derived, the request still takes tokens once; a refused one waits in the
        // queue, whose drain no longer paces. The pacer's lock is taken and the clock read
        // only when the allowance handed out at the last such call does not cover the
        // request.
        let now = || engine.clock.now();
        let post = |wqe: &mut ibv_send_wr| {
            let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
            // Settled when the provider answers: a panic from then on must not refuse a
            // request that went out. Set before the call, which cannot unwind, so that the
            // usual answer needs no second store.
            settled.set(0, 1);
            // SAFETY: the QP is live (its state is registered); the one WQE and the
            // application's SGE list live for the call.
            let rc = unsafe { (self.post_send)(self.qp, wqe, &mut bad) };
            if rc != 0 {
                settled.set(rc, 0);
            }
            rc
        };
        // SAFETY: guaranteed by the caller.
        let posted = unsafe {
            st.sq
                .post_now(w, lane, &engine.rate, now, post, &engine.counters)
        }?;
        let rc = posted.err().unwrap_or(0);
        #[cfg(test)]
        fault::hit(fault::PostFault::AfterDrain);
        drop(st);
        if rc != 0 {
            // SAFETY: guaranteed by the caller.
            unsafe { refuse_first(wr, bad_wr) };
        }
        #[cfg(test)]
        fault::hit(fault::PostFault::AfterSettled);
        Some(rc)
    }

    /// Recovers from a panic inside [`Self::post_send_shaped`], given what it had
    /// `settled`. The QP's posts pass through from now on (fail open). Of the list, the
    /// requests the shaper holds (the first ones: accepted with WQEs posted, or all of them
    /// once the call had settled) stay the shaper's, and still go out once; the rest are
    /// refused with `EIO`, `bad_wr` naming the first of them, as `ibv_post_send` refuses a
    /// list's tail. Posting the whole list to the provider instead would send the held
    /// requests twice.
    ///
    /// # Safety
    /// As [`Self::post_send_shaped`], with the same `wr` and `bad_wr`.
    pub(crate) unsafe fn recover_post(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: Option<(c_int, usize)>,
    ) -> c_int {
        self.fail_open();
        let (rc, held) = match settled {
            Some(done) => done,
            None => {
                let held = self.lock().sq.take_back_call();
                // SAFETY: held is within the list (the queue held that many of it).
                let rest = unsafe { nth(wr, held) };
                (if rest.is_null() { 0 } else { libc::EIO }, held)
            }
        };
        // The panic may have cut a drain short or kept the pacer from being told: restart
        // the flow of what the shaper holds.
        let now = self.engine.clock.now();
        crate::ffi::guarded(|| self.drain(now), || ());
        if rc != 0 && !bad_wr.is_null() {
            // SAFETY: guaranteed writable by the caller; held is within the list.
            unsafe { *bad_wr = nth(wr, held) };
        }
        rc
    }

    /// Stops shaping this QP's posts after an internal error; says so once.
    /// Recovers from a panic inside [`Self::post_batch`]: the batch's requests with nothing
    /// posted are taken back and the QP fails open, as after a panic in the shaped
    /// `ibv_post_send`. The batch is refused (`EIO`); requests of it that already had work
    /// at the provider, if any, still complete, since a WQE cannot be recalled.
    pub(crate) fn recover_batch(&self) -> c_int {
        self.fail_open();
        self.lock().sq.take_back_call();
        let now = self.engine.clock.now();
        crate::ffi::guarded(|| self.drain(now), || ());
        libc::EIO
    }

    fn fail_open(&self) {
        self.posts_shaped.store(false, Ordering::Relaxed);
        if !self.failed_open.swap(true, Ordering::AcqRel) {
            log!(
                Warn,
                "QP {}: internal error in the shaper; its requests pass through unshaped from now on",
                self.qp_num
            );
        }
    }

    /// Accepts requests collected by the `ibv_wr_*` interface, all or none. After
    /// [`Self::fail_open`] they are taken whole and unpaced: the interface's pointers stay
    /// the shaper's, so passing through means posting as the application asked.
    pub(crate) fn post_batch(&self, batch: Vec<OwnedWr>) -> c_int {
        let now = self.engine.clock.now();
        let mut st = self.lock();
        if st.sq.outstanding() + batch.len() > st.sq.capacity() as usize {
            return libc::ENOMEM;
        }
        let shaping = self.posts_shaped();
        let mut announced = Vec::new();
        for (index, owned) in batch.into_iter().enumerate() {
            #[cfg(test)]
            fault::hit(fault::PostFault::BeforeAccept(index));
            let treatment = if shaping {
                self.engine
                    .treatment(&mut st, now, owned.opcode(), owned.payload_len())
            } else {
                Treatment::Whole
            };
            let accepted = self
                .announce(&mut st, &owned, treatment, &mut announced)
                .and_then(|t| st.sq.accept(owned, t, index));
            if let Err(e) = accepted {
                // The batch is refused whole: what it announced is withdrawn.
                st.sq.take_back_call();
                self.send_announcements(&mut st, announced);
                return e;
            }
        }
        let drained = self.drain_locked(&mut st, now);
        if st.sender.is_some() {
            self.send_announcements(&mut st, announced);
        }
        st.sq.end_call();
        drop(st);
        let rc = drained.refused.map_or(0, |(_, e)| e);
        self.after_drain(drained, now);
        rc
    }

    /// Posts what the send queue allows now. With turns in force, only while
    /// the QP holds one: a QP in line posts nothing, and is woken when its turn comes; the
    /// QP a drain lets in (this one having nothing left, or its turn spent) is returned, to
    /// be woken once the caller has released this QP's lock ([`Self::after_drain`]).
    pub(super) fn drain_locked(&self, st: &mut QpState, now: Duration) -> Drained {
        if st.sq.destroyed() {
            return Drained::nothing();
        }
        let turns = Some(&self.engine.turns).filter(|t| t.in_force());
        if let Some(t) = turns {
            if st.sq.needs_drain() {
                if let Err(woken) = t.may_post(self, &self.engine.counters) {
                    return Drained {
                        woken,
                        ..Drained::nothing()
                    };
                }
            }
        }
        let posted_before = st.sq.posted_bytes();
        let qp = self.qp;
        let post_send = self.post_send;
        let mut post = |wrs: &mut [ibv_send_wr]| -> Result<(), (usize, c_int)> {
            let base = wrs.as_mut_ptr();
            let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
            // SAFETY: qp is live (its state is registered); the list and its SGEs live for
            // the call.
            let rc = unsafe { post_send(qp, base, &mut bad) };
            if rc == 0 {
                return Ok(());
            }
            // The provider names the first WQE it did not take; one outside the list (or
            // none) means it took nothing.
            let index = (bad as usize)
                .checked_sub(base as usize)
                .map(|bytes| bytes / std::mem::size_of::<ibv_send_wr>())
                .filter(|&i| i < wrs.len())
                .unwrap_or(0);
            Err((index, rc))
        };
        let mut refused_ids = Vec::new();
        let outcome = loop {
            let mut synthesized = Vec::new();
            let outcome = st.sq.drain(
                now,
                &mut DrainEnv {
                    post: &mut post,
                    pacer: self.engine.paced().then_some(&self.engine.rate),
                    counters: &self.engine.counters,
                    synthesized: &mut synthesized,
                },
            );
            // A drain synthesizes IBV_WC_GENERAL_ERR only for a request the provider
            // refused (said on stderr once the lock is released).
            refused_ids.extend(
                synthesized
                    .iter()
                    .filter(|w| w.status == IBV_WC_GENERAL_ERR)
                    .map(|w| w.wr_id),
            );
            // Queued under the QP's lock, before anything later of the queue is posted:
            // a poll settles the QP's later completions under that lock, so they cannot
            // overtake these (see `CqShared::translate`). The held queue is a leaf.
            if let Some(cq) = &self.send_cq {
                cq.push_synthesized(synthesized);
            }
            if !outcome.more {
                break outcome;
            }
        };
        self.engine
            .counters
            .note_queued(u64::try_from(st.sq.queued()).unwrap_or(u64::MAX));
        let woken = turns.and_then(|t| {
            let spent = st.sq.posted_bytes() - posted_before;
            t.posted(self, spent, st.sq.needs_drain(), &self.engine.counters)
        });
        Drained {
            refused: outcome.refused,
            refused_ids,
            blocked: outcome.blocked,
            woken,
        }
    }

    /// What follows a drain, outside the QP's lock: a refusal by the provider said on
    /// stderr (`refused`: the `wr_id`s of the requests it failed), the QP a turn went to
    /// woken, and this QP handed to the pacer if blocked.
    pub(super) fn after_drain(&self, drained: Drained, now: Duration) {
        let Drained {
            refused_ids: refused,
            blocked,
            woken,
            ..
        } = drained;
        if let Some(next) = woken {
            self.engine.schedule(next, now, now);
        }
        for wr_id in refused {
            log!(
                Warn,
                "QP {}: the provider refused a work request of the request with wr_id {wr_id:#x}; it completes with an error",
                self.qp_num,
            );
        }
        let wait = match blocked {
            Blocked::Tokens(wait) => wait,
            Blocked::Slots => SLOT_POLL_DELAY,
            // A credit's arrival drains the QP (see `super::two_sided`).
            Blocked::Idle | Blocked::Failed | Blocked::Credit => return,
        };
        if let Some(me) = self.me.upgrade() {
            self.engine.schedule(me, now + wait, now);
        }
    }

    /// The pacer's turn for this QP: posts what is due and, when the hardware queue is
    /// full, first polls the send CQ itself.
    ///
    /// Slots come back only when completions are polled. An application may post a large
    /// unsignaled request and a small one, then wait for the peer's reply without polling
    /// its send CQ: natively both are on the wire at once, but the shaper's chunks fill the
    /// queue and the small request would wait for a poll that never comes. So the pacer
    /// polls the provider's CQ on the application's behalf, under the CQ's poll lock,
    /// hides what is internal and holds the rest for the application's next poll, which
    /// delivers held completions before newer ones (see `CqShared::poll_for_pacer`).
    pub(crate) fn progress(&self, now: Duration) {
        let full = self.lock().sq.blocked_on_slots();
        if let (true, Some(cq)) = (full, &self.send_cq) {
            cq.poll_for_pacer(self, now);
        }
        self.drain(now);
    }

    /// [`Self::drain`] if the QP's lock is free; if another thread holds it (a poster,
    /// across the provider's post), the QP is queued for the pacer instead, due now, so
    /// that the caller (a poll, or a verb on another object) never waits for that thread.
    pub(crate) fn drain_or_defer(&self, now: Duration) {
        let Some(mut st) = self.state.try_lock() else {
            if let Some(me) = self.me.upgrade() {
                self.engine.schedule(me, now, now);
            }
            return;
        };
        let drained = self.drain_locked(&mut st, now);
        drop(st);
        self.after_drain(drained, now);
    }

    /// Posts what slots and tokens allow now (after completions, or when the pacer says).
    pub(crate) fn drain(&self, now: Duration) {
        let mut st = self.lock();
        let drained = self.drain_locked(&mut st, now);
        drop(st);
        self.after_drain(drained, now);
    }

    /// Whether an `ibv_modify_qp` of `attr` and `mask` brings this QP up again: it moves to
    /// ready-to-receive, where it has been before. Such a move loads the QP's context into
    /// the RNIC as its creation did, and a loop of them (reset, init, ready) is a storm of
    /// control verbs that creates nothing, so it waits for the control-verb budget as a
    /// creation. A QP's first move there is part of its creation, paced at its create.
    pub(crate) fn rebrings_up(&self, attr: &ibv_qp_attr, mask: u32) -> bool {
        mask & IBV_QP_STATE != 0
            && attr.qp_state == IBV_QPS_RTR
            && self.been_ready.load(Ordering::Relaxed)
    }

    /// Notes what an `ibv_modify_qp` with `mask` set: the path MTU, the READ depth, and
    /// the state. Moving to the error state settles the requests whose completion the
    /// hardware will not deliver (see [`SendQueue::set_failed`]).
    pub(crate) fn on_modify(&self, attr: &ibv_qp_attr, mask: u32) {
        let mut synthesized = Vec::new();
        let mut st = self.lock();
        if mask & IBV_QP_PATH_MTU != 0 && (IBV_MTU_256..=IBV_MTU_4096).contains(&attr.path_mtu) {
            st.path_mtu = 128 << attr.path_mtu;
            st.refresh_fast(&self.engine);
        }
        if mask & IBV_QP_MAX_QP_RD_ATOMIC != 0 {
            st.max_rd_atomic = u32::from(attr.max_rd_atomic);
        }
        if let Some(s) = st.sender.as_mut() {
            s.note_transport(attr, mask);
        }
        if mask & IBV_QP_STATE != 0 {
            match attr.qp_state {
                IBV_QPS_RTR => self.been_ready.store(true, Ordering::Relaxed),
                IBV_QPS_RESET => {
                    st.sq.reset();
                    self.two_sided_reset(&mut st);
                }
                IBV_QPS_ERR => {
                    st.sq.set_failed(&self.engine.counters, &mut synthesized);
                    self.two_sided_failed(&mut st);
                }
                _ => {}
            }
        }
        // Queued under the lock, as a drain's (see `Self::drain_locked`).
        if let Some(cq) = &self.send_cq {
            cq.push_synthesized(synthesized);
        }
        drop(st);
        // The provider reset the QP and may have left its completions in the CQ: they carry
        // tags the new incarnation reuses, and one could settle a new request that has not
        // run. They are dropped now, before the QP can post again.
        if let (true, true, Some(cq)) = (
            mask & IBV_QP_STATE != 0 && attr.qp_state == IBV_QPS_RESET,
            self.shaped,
            &self.send_cq,
        ) {
            cq.drop_stale(self.qp_num, &self.ring, self.engine.clock.now());
        }
    }
}

/// Panics injected into the shaped post path by tests, to exercise [`QpShared::recover_post`].
#[cfg(test)]
pub(crate) mod fault {
    use std::cell::Cell;

    /// Where the shaped post path panics.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum PostFault {
        /// Before accepting the request at this position of the list.
        BeforeAccept(usize),
        /// After posting what the queue allows, before the call is settled.
        AfterDrain,
        /// After the call is settled, before the pacer is told.
        AfterSettled,
    }

    thread_local! {
        static ARMED: Cell<Option<PostFault>> = const { Cell::new(None) };
    }

    /// The next post on this thread that reaches `at` panics there.
    pub(crate) fn inject(at: PostFault) {
        ARMED.set(Some(at));
    }

    /// Panics if a fault is armed at `at`.
    pub(crate) fn hit(at: PostFault) {
        if ARMED.get() == Some(at) {
            ARMED.set(None);
            panic!("fault injected at {at:?}");
        }
    }
}
