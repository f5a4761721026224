//! Splitting two-sided requests on a queue pair whose two shapers agree
//! (`JUSTITIA_TWO_SIDED=split`; the protocol is `justitia_core::two_sided`'s, the design
//! in `docs/architecture.md`, "Splitting two-sided requests").
//!
//! Each end of a connected RC queue pair has two halves here: the *sender half* (in the
//! QP's state, under its lock, beside the send queue it feeds) announces each SEND, SEND
//! with immediate and WRITE with immediate once the peer accepted, and hands the send
//! queue the peer's credits; the *receiver half* (its own lock) owns the QP's receive
//! queue once the peer has agreed: it holds the application's receives, posts the
//! receives the peer's announcements call for (each with a tag of its own as `wr_id`),
//! and turns their completions back into the application's, one per message. The
//! process's side channels carry the messages; a thread of the shaper's
//! (`justitia-side`) reads them, so that credits never wait for an application's poll.
//!
//! Who splits: a QP whose send side is shaped with a class that may split (bandwidth, or
//! the automatic class) under `justitia` or `adaptive` says so in its hellos; its peer's
//! receiver half offers to own its receives only then, so a peer that never splits never
//! has its receives held. A receive queue is owned only where its completions can be
//! translated: an RC QP without a shared receive queue, whose receive CQ the shaper knows
//! and is polled with `ibv_poll_cq` (not an extended CQ), and whose send completions on
//! that CQ carry the shaper's tags (it is shaped, or its send CQ is another).
//!
//! Locks, in the order they are taken: a CQ's poll lock, a QP's state lock, a receiver
//! half's lock (held across the provider's `post_recv` on its own QP, as natively two
//! verbs on one QP take turns), the outbox's (a leaf). The verbs' paths never take the
//! side channels' lock, which the side thread holds across its provider calls on the side
//! channels' own objects: what they send (announcements, credits) goes through the
//! outbox, and the side thread sends it. The poll lock is never taken under the others
//! (the side thread takes it, to poll a receive CQ aside, holding none of them); the
//! pairing record's lock is taken alone.
//!
//! Invariants:
//! - messages are numbered alike at both ends: the sender counts every receive-consuming
//!   request its send queue accepted to go whole (`SendQueue::whole_two_sided`), the
//!   receiver every receive it posted whole, and the agreement starts announcing from the
//!   larger count (the difference goes whole first);
//! - an internal receive carries a tag from its receiver half's tag range and nothing
//!   else does, so its completion is found whatever the application's `wr_id`s are; the
//!   application's own receives posted whole keep their `wr_id` and pass untouched;
//! - the application never has more receives outstanding than its `max_recv_wr`, held
//!   ones included, and internal receives never exceed what the queue has room for.
//! - a receive CQ stands armed for solicited completions only (for an event-driven
//!   application, see `CqShared::arm_for_application`) only while every completion its
//!   application would see there is one the peer's shaper marked solicited: a receiver
//!   half that leaves the agreed protocol re-arms it for the next completion.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use justitia_core::chunk::{Sge, SgeList};
use justitia_core::two_sided::{
    Announce, Announced, Posting, ReceiverAgreement, RecvSide, SendSide, SenderAgreement,
    SideMessage, ANNOUNCE_RETRY_MAX_NS, ANNOUNCE_RETRY_NS, VERSION,
};
use justitia_verbs::sys::*;
use justitia_verbs::DatagramDest;

use super::{CqShared, Engine, QpShared, QpState};
use crate::log::log;
use crate::pairing::{self, HelloOutcome, Port};
use crate::send_queue::{consumes_receive, OwnedWr, Treatment};
use crate::side_channel::{Datagram, SharedSideChannels};
use crate::stats::Counters;

/// Datagrams read, and hellos sent, in one turn of the side thread.
const PER_TURN: usize = 256;

/// How often the side thread looks for announcements and offers to repeat.
const TIMER_PERIOD_NS: u64 = 10_000_000;

/// The longest the side thread sleeps with nothing due.
const IDLE_WAIT: Duration = Duration::from_millis(100);

/// Refused datagrams said at debug level; the rest are only counted.
const REFUSALS_SAID: u64 = 8;

/// The process's side of splitting two-sided requests: its side channels, the QPs with a
/// half, and the thread that reads the side channels.
pub struct SideLink {
    sides: SharedSideChannels,
    /// QPs with a sender or receiver half, by number (at most
    /// [`pairing::MAX_PAIRED_QPS`]; one beyond gets no half and goes whole).
    qps: Mutex<HashMap<u32, Weak<QpShared>>>,
    /// The side thread and the process that started it.
    thread: Mutex<Option<u32>>,
    /// When the timers last ran ([`TIMER_PERIOD_NS`]).
    timers_ns: AtomicU64,
    /// The QP map was full once (said once).
    full_said: AtomicBool,
    /// Messages the verbs' paths (a post's announcements, a poll's credits) leave for the
    /// side thread to send: a verb never waits for the side channels' lock, which the side
    /// thread holds across its provider calls on the side channels' objects. A leaf; at
    /// most [`MAX_OUTBOX`] (beyond, a message is dropped, and the protocol repeats it).
    outbox: Mutex<VecDeque<(Route, SideMessage)>>,
    /// An eventfd written when the outbox turns non-empty, which the side thread's poll(2)
    /// waits on too (-1: none could be made; the thread then finds the outbox within its
    /// 10 ms timer).
    wake_fd: c_int,
}

/// The most messages waiting in the outbox.
const MAX_OUTBOX: usize = 1 << 16;

impl Drop for SideLink {
    fn drop(&mut self) {
        if self.wake_fd >= 0 {
            // SAFETY: the link's own descriptor, closed once.
            unsafe { libc::close(self.wake_fd) };
        }
    }
}

impl std::fmt::Debug for SideLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SideLink").finish_non_exhaustive()
    }
}

impl SideLink {
    /// The link over `sides`.
    pub fn new(sides: SharedSideChannels) -> Self {
        SideLink {
            sides,
            qps: Mutex::new(HashMap::new()),
            thread: Mutex::new(None),
            timers_ns: AtomicU64::new(0),
            full_said: AtomicBool::new(false),
            outbox: Mutex::new(VecDeque::new()),
            // SAFETY: eventfd has no preconditions.
            wake_fd: unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) },
        }
    }

    fn qps(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Weak<QpShared>>> {
        self.qps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `qp` in; false when the map is full (the QP then has no half).
    pub(super) fn join(&self, qp_num: u32, qp: Weak<QpShared>) -> bool {
        let mut qps = self.qps();
        if qps.len() >= pairing::MAX_PAIRED_QPS && !qps.contains_key(&qp_num) {
            qps.retain(|_, q| q.strong_count() > 0);
            if qps.len() >= pairing::MAX_PAIRED_QPS {
                drop(qps);
                if !self.full_said.swap(true, Ordering::Relaxed) {
                    log!(
                        Warn,
                        "more than {} queue pairs could split two-sided requests; the others' go whole",
                        pairing::MAX_PAIRED_QPS
                    );
                }
                return false;
            }
        }
        qps.insert(qp_num, qp);
        true
    }

    /// Lets `qp` go (destroyed).
    pub(super) fn leave(&self, qp_num: u32, qp: &Weak<QpShared>) {
        let mut qps = self.qps();
        if qps.get(&qp_num).is_some_and(|q| q.ptr_eq(qp)) {
            qps.remove(&qp_num);
        }
    }

    fn qp(&self, qp_num: u32) -> Option<Arc<QpShared>> {
        self.qps().get(&qp_num).and_then(Weak::upgrade)
    }

    fn all(&self) -> Vec<Arc<QpShared>> {
        self.qps().values().filter_map(Weak::upgrade).collect()
    }

    /// Leaves `message` along `route` for the side thread to send, and wakes it.
    fn queue(&self, route: &Route, message: SideMessage) {
        let mut outbox = self.outbox.lock().unwrap_or_else(|e| e.into_inner());
        if outbox.len() >= MAX_OUTBOX {
            return;
        }
        let was_empty = outbox.is_empty();
        outbox.push_back((route.clone(), message));
        drop(outbox);
        if was_empty && self.wake_fd >= 0 {
            let one = 1u64;
            // SAFETY: an 8-byte write from a live u64 to the link's eventfd.
            unsafe { libc::write(self.wake_fd, (&one as *const u64).cast(), 8) };
        }
    }

    /// Sends what the outbox holds (the side thread's part); a datagram lost here (every
    /// send slot busy) is made good by the protocol's repeats.
    fn flush_outbox(&self) {
        let out = std::mem::take(&mut *self.outbox.lock().unwrap_or_else(|e| e.into_inner()));
        if out.is_empty() {
            return;
        }
        let mut sides = self.sides.lock();
        for (route, message) in out {
            let (bytes, len) = message.encode();
            let _ = sides.send(&route.port, route.sgid_index, &route.to, &bytes[..len]);
        }
    }

    /// Clears the eventfd after a wake-up.
    fn take_wake(&self) {
        if self.wake_fd >= 0 {
            let mut count = 0u64;
            // SAFETY: an 8-byte read into a live u64 from the link's (non-blocking) eventfd.
            unsafe { libc::read(self.wake_fd, (&mut count as *mut u64).cast(), 8) };
        }
    }
}

/// Where a QP's side-channel messages go: its peer's side channel, out of the QP's port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    port: Port,
    sgid_index: u8,
    to: DatagramDest,
    /// The QP's number at the other end, which the messages name.
    peer_qpn: u32,
}

/// The sending half of a QP (see the module's documentation), in its state.
#[derive(Debug, Default)]
pub struct SenderHalf {
    agreement: SenderAgreement,
    side: Option<SendSide>,
    /// Receive-consuming requests still to go whole before the first announced one (the
    /// peer had posted that many more receives whole than this end had sent).
    whole_left: u64,
    route: Option<Route>,
    /// The QP went to the error state: nothing more is announced.
    failed: bool,
    /// The QP's transport timeout (`timeout`, 0: none) and `retry_cnt`, as the
    /// application set them: how long its NIC waits for a peer that is gone.
    timeout: u8,
    retry_cnt: u8,
    /// The application set `rnr_retry` to 0: its sends are never split (a message racing
    /// the agreement may meet one RNR retry).
    rnr_retry_zero: bool,
}

/// The shortest wait for a credit before the sender gives up on its peer, whatever the
/// transport timeout: three of the longest waits between repeats of an announcement, so
/// that a peer that is there (it answers each repeat, [`SideMessage::Waiting`]) is never
/// taken for gone.
const GIVE_UP_FLOOR_NS: u64 = 3 * ANNOUNCE_RETRY_MAX_NS;

impl SenderHalf {
    /// Notes the transport timeout, retry count and RNR retry count an `ibv_modify_qp`
    /// sets.
    pub(super) fn note_transport(&mut self, attr: &ibv_qp_attr, mask: u32) {
        if mask & IBV_QP_RNR_RETRY != 0 {
            self.rnr_retry_zero = attr.rnr_retry == 0;
        }
        if mask & IBV_QP_TIMEOUT != 0 {
            self.timeout = attr.timeout;
        }
        if mask & IBV_QP_RETRY_CNT != 0 {
            self.retry_cnt = attr.retry_cnt;
        }
    }

    /// How long a message may wait for its credit, with no word from the peer, before
    /// the peer is taken for gone: the QP's own transport timeout (4.096 us times 2 to
    /// the `timeout`, for each of `retry_cnt` + 1 tries), at least [`GIVE_UP_FLOOR_NS`];
    /// `None` with no transport timeout (the NIC would wait for ever too).
    fn give_up_after_ns(&self) -> Option<u64> {
        if self.timeout == 0 {
            return None;
        }
        let one = 4096u64 << self.timeout.min(31);
        Some(
            one.saturating_mul(u64::from(self.retry_cnt) + 1)
                .max(GIVE_UP_FLOOR_NS),
        )
    }
}

/// Where a receiver half stands.
#[derive(Debug)]
enum RecvMode {
    /// Receives go to the NIC as the application posts them.
    Whole,
    /// The offer is out: receives are held until the accept.
    Offered {
        held: VecDeque<(u64, SgeList)>,
        next_ns: u64,
        wait_ns: u64,
    },
    /// Owned: receives are posted as the announcements call for.
    Owned(RecvSide),
    /// The QP failed: receives go to the NIC (and flush there); internal receives still
    /// in the queue are hidden as they flush.
    Failed,
}

/// The receiving half of a QP, behind its own lock.
#[derive(Debug)]
pub struct ReceiverHalf {
    agreement: ReceiverAgreement,
    mode: RecvMode,
    route: Option<Route>,
    /// Receives posted as the application's own.
    raw_posted: u64,
    /// Internal receives posted and not completed.
    internal: u64,
    /// Application receives to post whole before any is held for an announcement (the
    /// accept asked for more than were held).
    whole_due: u64,
    next_tag: u64,
}

impl ReceiverHalf {
    /// Nothing offered, nothing posted; internal receives' tags start at `next_tag`.
    fn new(next_tag: u64) -> Self {
        ReceiverHalf {
            agreement: ReceiverAgreement::new(),
            mode: RecvMode::Whole,
            route: None,
            raw_posted: 0,
            internal: 0,
            whole_due: 0,
            next_tag,
        }
    }
}

/// A QP's receiver half with what its receive CQ's polls read without its lock.
pub struct ReceiverShared {
    pub(crate) half: parking_lot::Mutex<ReceiverHalf>,
    /// Receives posted as the application's own whose completion the polls saw.
    raw_done: AtomicU64,
    /// The tag range of internal receives: one byte per receive of the queue, so no
    /// `wr_id` of the application's (its own pointers or numbers) can fall in it.
    tags: Box<[u8]>,
    /// The QP's `max_recv_wr` and `max_recv_sge`.
    depth: u32,
    max_sge: usize,
}

impl std::fmt::Debug for ReceiverShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverShared")
            .field("depth", &self.depth)
            .finish_non_exhaustive()
    }
}

impl ReceiverShared {
    /// A receiver half for a receive queue of `depth` receives of `max_sge` SGEs.
    pub(crate) fn new(depth: u32, max_sge: u32) -> Self {
        ReceiverShared {
            half: parking_lot::Mutex::new(ReceiverHalf::new(0)),
            raw_done: AtomicU64::new(0),
            tags: vec![0u8; depth.max(1) as usize].into_boxed_slice(),
            depth: depth.max(1),
            max_sge: usize::try_from(max_sge).unwrap_or(1).max(1),
        }
    }

    fn base(&self) -> u64 {
        self.tags.as_ptr() as u64
    }

    /// Whether `wr_id` is one of this half's internal receives' tags.
    #[inline]
    pub(super) fn is_tag(&self, wr_id: u64) -> bool {
        wr_id.wrapping_sub(self.base()) < self.tags.len() as u64
    }

    /// Receives in the queue now, or due there: the application's own not completed and
    /// the internal ones.
    fn in_queue(&self, half: &ReceiverHalf) -> u64 {
        half.raw_posted
            .saturating_sub(self.raw_done.load(Ordering::Acquire))
            + half.internal
    }

    /// The application's receives not completed: in the queue as its own, held, or
    /// paired with a message.
    fn app_outstanding(&self, half: &ReceiverHalf) -> u64 {
        let raw = half
            .raw_posted
            .saturating_sub(self.raw_done.load(Ordering::Acquire));
        raw + match &half.mode {
            RecvMode::Offered { held, .. } => held.len() as u64,
            RecvMode::Owned(side) => (side.held() + side.landing()) as u64,
            RecvMode::Whole | RecvMode::Failed => 0,
        }
    }
}

/// The SGEs of a receive request, in the core's terms.
///
/// # Safety
/// `wr`'s SGE list must be readable.
unsafe fn sges_of(wr: &ibv_recv_wr) -> Vec<Sge> {
    let n = usize::try_from(wr.num_sge).unwrap_or(0);
    if n == 0 || wr.sg_list.is_null() {
        return Vec::new();
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(wr.sg_list, n) }
        .iter()
        .map(|s| Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect()
}

impl QpShared {
    /// Whether every completion this QP puts on `cq` that its application would see is
    /// one the peer's shaper marked solicited (see `CqShared::arm_for_application`): it
    /// sends its completions to another CQ, its receiver half owns the receives under the
    /// agreed protocol (the peer's shaper marks the last chunk of each message and of each
    /// credited part), and no receive of the application's own is at the NIC, for a
    /// message sent whole before the agreement.
    pub(super) fn receives_are_marked(&self, cq: &CqShared) -> bool {
        if self.send_cq.as_deref().is_some_and(|s| std::ptr::eq(s, cq)) {
            return false;
        }
        let Some(r) = &self.receiver else {
            return false;
        };
        let half = r.half.lock();
        matches!(half.mode, RecvMode::Owned(_))
            && half.whole_due == 0
            && half.raw_posted == r.raw_done.load(Ordering::Acquire)
    }

    /// The receiver half left the agreed protocol (it failed, or the QP was reset): its
    /// receive CQ's application arm, if it stands for solicited completions only, goes
    /// back to the next completion.
    fn receives_unmarked(&self) {
        if let Some(cq) = &self.recv_cq {
            cq.unquiet();
        }
    }

    /// Whether this QP's sends may be split (what its hellos say): its sender half exists
    /// and the application did not set `rnr_retry` to 0 (a message racing the agreement
    /// may meet one RNR retry).
    fn splits(&self) -> bool {
        self.lock()
            .sender
            .as_ref()
            .is_some_and(|s| !s.rnr_retry_zero)
    }

    /// Posts the application's receive list `wr` on a QP with a receiver half `r`: whole
    /// to the NIC before the offer and after a failure, held after it.
    ///
    /// # Safety
    /// As `ibv_post_recv`.
    pub(crate) unsafe fn post_recv_owned(
        &self,
        r: &ReceiverShared,
        wr: *mut ibv_recv_wr,
        bad_wr: *mut *mut ibv_recv_wr,
    ) -> c_int {
        let mut half = r.half.lock();
        if matches!(half.mode, RecvMode::Whole | RecvMode::Failed) {
            // SAFETY: guaranteed by the caller.
            let (rc, posted) = unsafe { self.post_raw(wr, bad_wr) };
            half.raw_posted += posted;
            if matches!(half.mode, RecvMode::Whole) {
                for _ in 0..posted {
                    half.agreement.posted_whole();
                }
            }
            return rc;
        }
        let mut cur = wr;
        let mut rc = 0;
        // SAFETY: guaranteed by the caller.
        while let Some(w) = unsafe { cur.as_ref() } {
            let refuse = if r.app_outstanding(&half) >= u64::from(r.depth) {
                Some(libc::ENOMEM)
            } else if usize::try_from(w.num_sge).map_or(true, |n| n > r.max_sge) {
                Some(libc::EINVAL)
            } else {
                None
            };
            if let Some(e) = refuse {
                rc = e;
                break;
            }
            // SAFETY: guaranteed by the caller.
            let sges = unsafe { sges_of(w) };
            if half.whole_due > 0 {
                let mut one = *w;
                one.next = std::ptr::null_mut();
                let mut bad = std::ptr::null_mut();
                // SAFETY: one request, the application's, with its readable SGE list.
                let (e, posted) = unsafe { self.post_raw(&mut one, &mut bad) };
                half.raw_posted += posted;
                if e != 0 {
                    rc = e;
                    break;
                }
                half.whole_due -= 1;
                cur = w.next;
                continue;
            }
            let held = match &mut half.mode {
                RecvMode::Offered { held, .. } => match SgeList::try_from(sges.as_slice()) {
                    Ok(list) => {
                        held.push_back((w.wr_id, list));
                        true
                    }
                    Err(_) => false,
                },
                RecvMode::Owned(side) => side.post_recv(w.wr_id, &sges).is_ok(),
                RecvMode::Whole | RecvMode::Failed => false,
            };
            if !held {
                rc = libc::EINVAL;
                break;
            }
            cur = w.next;
        }
        if rc != 0 && !bad_wr.is_null() {
            // SAFETY: guaranteed writable by the caller.
            unsafe { *bad_wr = cur };
        }
        self.pump(r, &mut half);
        rc
    }

    /// Posts `wr` to the NIC as the application's own; returns the provider's answer and
    /// how many of the list it took.
    ///
    /// # Safety
    /// As `ibv_post_recv`.
    unsafe fn post_raw(&self, wr: *mut ibv_recv_wr, bad_wr: *mut *mut ibv_recv_wr) -> (c_int, u64) {
        let Some(post) = self.post_recv else {
            return (libc::EOPNOTSUPP, 0);
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the provider's own post_recv with the caller's list.
        let rc = unsafe { post(self.qp, wr, &mut bad) };
        let mut posted = 0u64;
        let mut cur = wr;
        // SAFETY: guaranteed by the caller: a valid list, `bad` one of its entries.
        while let Some(w) = unsafe { cur.as_ref() } {
            if rc != 0 && (cur == bad || bad.is_null()) {
                break;
            }
            posted += 1;
            cur = w.next;
        }
        if rc != 0 && !bad_wr.is_null() {
            // SAFETY: guaranteed writable by the caller.
            unsafe { *bad_wr = if bad.is_null() { wr } else { bad } };
        }
        (rc, posted)
    }

    /// Posts the receives the announcements call for, as far as the queue has room, and
    /// credits each message to the peer.
    fn pump(&self, r: &ReceiverShared, half: &mut ReceiverHalf) {
        let Some(route) = half.route.clone() else {
            return;
        };
        loop {
            let room = u64::from(r.depth).saturating_sub(r.in_queue(half));
            let RecvMode::Owned(side) = &mut half.mode else {
                return;
            };
            let Some((recvs, posting, seq)) =
                side.next_posting(u32::try_from(room).unwrap_or(u32::MAX))
            else {
                return;
            };
            let mut sges: Vec<Vec<ibv_sge>> = Vec::with_capacity(recvs.len());
            let mut wrs: Vec<ibv_recv_wr> = Vec::with_capacity(recvs.len());
            for recv in &recvs {
                sges.push(
                    recv.sges
                        .iter()
                        .map(|s| ibv_sge {
                            addr: s.addr,
                            length: s.length,
                            lkey: s.lkey,
                        })
                        .collect(),
                );
            }
            for list in &mut sges {
                let tag = r.base() + half.next_tag % r.tags.len() as u64;
                half.next_tag += 1;
                wrs.push(ibv_recv_wr {
                    wr_id: tag,
                    next: std::ptr::null_mut(),
                    sg_list: list.as_mut_ptr(),
                    num_sge: c_int::try_from(list.len()).unwrap_or(0),
                });
            }
            let n = wrs.len();
            let base = wrs.as_mut_ptr();
            for i in 1..n {
                // SAFETY: i < n: both entries within the list, written through the one
                // pointer the provider is handed.
                unsafe { (*base.add(i - 1)).next = base.add(i) };
            }
            // SAFETY: a valid list whose SGEs live for the call.
            let (rc, posted) = unsafe { self.post_raw(base, std::ptr::null_mut()) };
            half.internal += posted;
            if rc != 0 {
                // The room was counted, so the provider refused something else: the QP is
                // failing. Its receives go whole from now on; what the peer waits for
                // fails there when it gives up.
                log!(
                    Warn,
                    "QP {}: the provider refused the receives for a split message ({rc}); its receives go whole from now on",
                    self.qp_num
                );
                half.mode = RecvMode::Failed;
                self.receives_unmarked();
                return;
            }
            self.engine.side_link_send(
                &route,
                SideMessage::Credit {
                    qp_num: route.peer_qpn,
                    seq,
                    posting,
                },
            );
        }
    }

    /// Translates a completion `wc` of this QP found on its receive CQ: an internal
    /// receive's is hidden or becomes the application's completion of its message (what
    /// a failure leaves of the others is pushed to `synthesized`, flushed, behind it); an
    /// application receive posted whole is counted and delivered untouched. `None`: not a
    /// receive of this QP's (a send completion carrying its send queue's tag).
    pub(super) fn translate_receive(
        &self,
        r: &ReceiverShared,
        wc: &mut ibv_wc,
        synthesized: &mut Vec<ibv_wc>,
    ) -> Option<bool> {
        if !r.is_tag(wc.wr_id) {
            if self.ring.contains(wc.wr_id) {
                return None;
            }
            r.raw_done.fetch_add(1, Ordering::AcqRel);
            return Some(true);
        }
        let mut half = r.half.lock();
        half.internal = half.internal.saturating_sub(1);
        let RecvMode::Owned(side) = &mut half.mode else {
            // Flushed after a failure: the application had its completions then.
            return Some(false);
        };
        // SAFETY: reading the plain-data union as the immediate.
        let carried = unsafe { wc.__bindgen_anon_1.imm_data };
        let imm = (wc.wc_flags & IBV_WC_WITH_IMM != 0).then_some(carried);
        let Some(app) = side.on_recv_done(wc.status, wc.byte_len, imm) else {
            self.pump(r, &mut half);
            return Some(false);
        };
        wc.wr_id = app.wr_id;
        wc.status = app.status;
        wc.byte_len = app.byte_len;
        if let Some(imm) = app.imm {
            wc.__bindgen_anon_1.imm_data = imm;
            wc.wc_flags |= IBV_WC_WITH_IMM;
        }
        if app.status != IBV_WC_SUCCESS {
            let rest = side.teardown();
            half.mode = RecvMode::Failed;
            self.receives_unmarked();
            synthesized.extend(rest.iter().map(|c| flushed_receive(c.wr_id, self.qp_num)));
            return Some(true);
        }
        self.pump(r, &mut half);
        Some(true)
    }

    /// The peer is gone (see [`SenderHalf::give_up_after_ns`]): the oldest request waiting
    /// for its credit fails with `IBV_WC_RETRY_EXC_ERR` and everything behind it flushes,
    /// as the NIC fails requests to a peer that is gone, and the QP is moved to the error
    /// state at the provider (under its lock, which its destroy waits for), where the
    /// NIC would have put it.
    fn give_up(&self, st: &mut QpState) {
        let mut synthesized = Vec::new();
        st.sq.give_up_waiting(
            IBV_WC_RETRY_EXC_ERR,
            &self.engine.counters,
            &mut synthesized,
        );
        if let Some(s) = st.sender.as_mut() {
            s.side = None;
        }
        self.two_sided_failed(st);
        if let Some(cq) = &self.send_cq {
            cq.push_synthesized(synthesized);
        }
        let modify = MODIFY_QP.load(Ordering::Acquire);
        if !modify.is_null() && !st.sq.destroyed() {
            // SAFETY: MODIFY_QP holds only the real `ibv_modify_qp` (see
            // `set_modify_qp`); the QP is live (not destroyed, and its destroy waits for
            // the lock held here).
            unsafe {
                let modify: ModifyQp = std::mem::transmute::<*mut (), ModifyQp>(modify);
                let _inside = crate::ffi::Reentry::enter();
                let mut attr = ibv_qp_attr {
                    qp_state: IBV_QPS_ERR,
                    ..Default::default()
                };
                modify(self.qp, &mut attr, IBV_QP_STATE as c_int);
            }
        }
    }

    /// The QP moved to the error state: every application receive the receiver half holds
    /// or has paired flushes now (the internal receives in the queue flush at the NIC and
    /// are hidden), and the sender half announces nothing more.
    pub(super) fn two_sided_failed(&self, st: &mut QpState) {
        if let Some(s) = st.sender.as_mut() {
            s.failed = true;
        }
        let Some(r) = &self.receiver else {
            return;
        };
        let mut half = r.half.lock();
        let flushed: Vec<u64> = match std::mem::replace(&mut half.mode, RecvMode::Failed) {
            RecvMode::Owned(mut side) => side.teardown().iter().map(|c| c.wr_id).collect(),
            RecvMode::Offered { held, .. } => held.iter().map(|(id, _)| *id).collect(),
            RecvMode::Whole | RecvMode::Failed => Vec::new(),
        };
        drop(half);
        self.receives_unmarked();
        if let (false, Some(cq)) = (flushed.is_empty(), &self.recv_cq) {
            cq.push_synthesized(
                flushed
                    .into_iter()
                    .map(|id| flushed_receive(id, self.qp_num))
                    .collect(),
            );
        }
    }

    /// The QP was reset: both halves start afresh (the NIC forgot its queues; a new
    /// connection is paired and agreed anew).
    pub(super) fn two_sided_reset(&self, st: &mut QpState) {
        if let Some(s) = st.sender.as_mut() {
            **s = SenderHalf::default();
        }
        if let Some(r) = &self.receiver {
            let mut half = r.half.lock();
            *half = ReceiverHalf::new(half.next_tag);
            r.raw_done.store(0, Ordering::Release);
            drop(half);
            self.receives_unmarked();
        }
    }

    /// The peer's hello came (`splits`: it splits its sends on this QP), along `route`:
    /// both halves learn where to send; the receiver half offers to own the receives if
    /// the peer splits.
    fn on_peer_hello(&self, route: Route, splits: bool, now_ns: u64) {
        if let Some(s) = self.lock().sender.as_mut() {
            s.route = Some(route.clone());
        }
        let Some(r) = &self.receiver else {
            return;
        };
        let mut half = r.half.lock();
        half.route = Some(route.clone());
        if !splits || !matches!(half.mode, RecvMode::Whole) {
            return;
        }
        let offer = half.agreement.offer(route.peer_qpn);
        half.mode = RecvMode::Offered {
            held: VecDeque::new(),
            next_ns: now_ns.saturating_add(ANNOUNCE_RETRY_NS),
            wait_ns: ANNOUNCE_RETRY_NS,
        };
        drop(half);
        log!(
            Debug,
            "QP {}: its peer splits its sends; offering to own the receives",
            self.qp_num
        );
        self.engine.side_link_send(&route, offer);
    }

    /// The peer's offer ("I posted `first` receives whole"): answered with the accept;
    /// from the agreed message on, receive-consuming requests are announced.
    fn on_offer(&self, first: u64) {
        let mut st = self.lock();
        let whole = st.sq.whole_two_sided();
        let max_sge = st.sq.max_sge();
        let Some(s) = st.sender.as_mut().filter(|s| !s.failed) else {
            return;
        };
        let Some(route) = s.route.clone() else {
            return;
        };
        s.agreement.sent_whole_to(whole);
        let (accept, agreed) = s.agreement.on_offer(route.peer_qpn, first);
        if s.side.is_none() {
            s.whole_left = agreed.saturating_sub(whole);
            s.side = Some(SendSide::new(agreed, max_sge));
            log!(
                Debug,
                "QP {}: its peer owns its receives; announcing from message {agreed}",
                self.qp_num
            );
        }
        drop(st);
        self.engine.side_link_send(&route, accept);
    }

    /// The peer's accept: the receives it still needs whole go first, the rest are held
    /// for the announcements.
    fn on_accept(&self, first: u64) -> bool {
        let Some(r) = &self.receiver else {
            return false;
        };
        let mut half = r.half.lock();
        if !matches!(half.mode, RecvMode::Offered { .. }) {
            // A repeated accept, or one after a failure.
            return matches!(half.mode, RecvMode::Owned(_) | RecvMode::Failed);
        }
        let Ok(whole) = half.agreement.on_accept(first) else {
            return false;
        };
        let RecvMode::Offered { held, .. } = &mut half.mode else {
            return false;
        };
        let mut held = std::mem::take(held);
        let mut side = RecvSide::new(first, r.max_sge, r.depth);
        let mut left = whole;
        while left > 0 {
            let Some((wr_id, sges)) = held.pop_front() else {
                break;
            };
            let mut list: Vec<ibv_sge> = sges
                .iter()
                .map(|s| ibv_sge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                })
                .collect();
            let mut one = ibv_recv_wr {
                wr_id,
                next: std::ptr::null_mut(),
                sg_list: list.as_mut_ptr(),
                num_sge: c_int::try_from(list.len()).unwrap_or(0),
            };
            // SAFETY: one request with its SGE list, living for the call.
            let (_, posted) = unsafe { self.post_raw(&mut one, std::ptr::null_mut()) };
            half.raw_posted += posted;
            left -= 1;
        }
        for (wr_id, sges) in held {
            // Checked when it was held.
            let _ = side.post_recv(wr_id, sges.as_slice());
        }
        half.whole_due = left;
        half.mode = RecvMode::Owned(side);
        Counters::add(&self.engine.counters.qps_owning_receives, 1);
        self.pump(r, &mut half);
        true
    }

    /// An announcement from the peer.
    fn on_announce(&self, message: Announce) -> bool {
        let Some(r) = &self.receiver else {
            return false;
        };
        let mut half = r.half.lock();
        let route = half.route.clone();
        let RecvMode::Owned(side) = &mut half.mode else {
            // Before the accept came (the sender repeats it), or after a failure.
            return true;
        };
        match side.on_announce(message) {
            Ok(Announced::Taken) => self.pump(r, &mut half),
            Ok(Announced::Repeated(Some(posting))) => {
                if let Some(route) = route {
                    drop(half);
                    self.engine.side_link_send(
                        &route,
                        SideMessage::Credit {
                            qp_num: route.peer_qpn,
                            seq: message.seq,
                            posting,
                        },
                    );
                }
            }
            // Taken, and no application receive for it yet: the peer hears that this end
            // is there, and does not give up on it.
            Ok(Announced::Repeated(None)) if side.waiting(message.seq) => {
                if let Some(route) = route {
                    drop(half);
                    self.engine.side_link_send(
                        &route,
                        SideMessage::Waiting {
                            qp_num: route.peer_qpn,
                            seq: message.seq,
                        },
                    );
                }
            }
            Ok(Announced::Repeated(None) | Announced::Ahead) => {}
            Err(_) => return false,
        }
        true
    }

    /// The peer says message `seq` waits for an application receive there: it is alive.
    fn on_waiting(&self, seq: u64, now_ns: u64) -> bool {
        let mut st = self.lock();
        match st.sender.as_mut().and_then(|s| s.side.as_mut()) {
            Some(side) => {
                side.on_waiting(seq, now_ns);
                true
            }
            None => false,
        }
    }

    /// A credit from the peer: the messages it completes may go.
    fn on_credit(&self, seq: u64, posting: Posting, now: Duration) -> bool {
        let mut st = self.lock();
        let QpState { sender, sq, .. } = &mut *st;
        let Some(side) = sender.as_mut().and_then(|s| s.side.as_mut()) else {
            return false;
        };
        if side.on_credit(seq, posting).is_err() {
            return false;
        }
        let held = sq.waits_for_credit();
        let mut moved = false;
        while let Some((seq, posting)) = side.take_credited() {
            moved |= sq.credit(seq, posting);
        }
        if held && !sq.waits_for_credit() {
            // The peer held the flow; it goes on at the rate, not with the burst it would
            // have after idling (see `Pacer::resume_after_hold`).
            Counters::add(&self.engine.counters.credit_holds, 1);
            if self.engine.paced() {
                self.engine.rate.lock().resume_after_hold(now);
            }
        }
        if moved {
            let drained = self.drain_locked(&mut st, now);
            drop(st);
            self.after_drain(drained, now);
        }
        true
    }

    /// The treatment of the request `owned`, accepted now with `treatment`, on a QP with
    /// a sender half: a receive-consuming request after the agreement is announced (the
    /// announcement is pushed to `out`, to be sent once the call is settled). Refused
    /// (`EINVAL`) only when the core cannot describe it, as the provider would refuse it.
    pub(super) fn announce(
        &self,
        st: &mut QpState,
        owned: &OwnedWr,
        treatment: Treatment,
        out: &mut Vec<Announce>,
    ) -> Result<Treatment, c_int> {
        if st.sender.is_none() || !consumes_receive(owned.opcode()) {
            return Ok(treatment);
        }
        // Refused as the send queue would refuse it, before the peer hears of it.
        if st.sq.is_full() {
            return Err(libc::ENOMEM);
        }
        let Some(s) = st.sender.as_mut() else {
            return Ok(treatment);
        };
        if s.failed {
            return Ok(treatment);
        }
        let Some(side) = s.side.as_mut() else {
            return Ok(treatment);
        };
        if s.whole_left > 0 {
            s.whole_left -= 1;
            return Ok(treatment);
        }
        let len = u32::try_from(owned.payload_len())
            .unwrap_or(u32::MAX)
            .max(1);
        let (chunk_bytes, paced) = match treatment {
            Treatment::Split { chunk_bytes, paced } if !owned.inline() => (chunk_bytes, paced),
            Treatment::WholePaced => (len, true),
            _ => (len, false),
        };
        let request = owned.to_work_request().ok_or(libc::EINVAL)?;
        let announce = side.post(request, chunk_bytes).map_err(|_| libc::EINVAL)?;
        out.push(announce);
        Ok(Treatment::Announced {
            seq: announce.seq,
            chunk_bytes: announce.chunk_bytes,
            paced,
        })
    }

    /// After a post call: withdraws the announcements of the requests it took back, and
    /// sends the others.
    pub(super) fn send_announcements(&self, st: &mut QpState, mut out: Vec<Announce>) {
        let withdrawn = st.sq.take_withdrawn();
        let Some(s) = st.sender.as_mut() else {
            return;
        };
        if let Some(side) = s.side.as_mut() {
            for seq in withdrawn {
                side.withdraw(seq);
                out.retain(|a| a.seq != seq);
            }
        }
        let Some(route) = s.route.clone() else {
            return;
        };
        Counters::add(&self.engine.counters.announced, out.len() as u64);
        for message in out {
            self.engine.side_link_send(
                &route,
                SideMessage::Announce {
                    qp_num: route.peer_qpn,
                    message,
                },
            );
        }
    }

    /// The timers at `now_ns`: announcements without credit repeat, and so does an offer
    /// without accept; a receiver whose peer's message waits for room in its receive queue
    /// has its receive CQ polled aside ([`CqShared::poll_for_receiver`]). Skipped, for
    /// this turn, while another thread holds the QP or the receiver half.
    fn two_sided_timers(&self, now_ns: u64) {
        let mut again = Vec::new();
        let mut sender_route = None;
        let mut gave_up = None;
        if let Some(mut st) = self.state.try_lock() {
            if let Some(s) = st.sender.as_mut() {
                let limit = s.give_up_after_ns();
                if let Some(side) = s.side.as_mut() {
                    again = side.reannounce(now_ns);
                    let since = side.uncredited_since();
                    if let (Some(since), Some(limit)) = (since, limit) {
                        if now_ns.saturating_sub(since) >= limit {
                            gave_up = Some(limit);
                        }
                    }
                }
                sender_route = s.route.clone();
            }
            if let Some(limit) = gave_up {
                again.clear();
                self.give_up(&mut st);
                drop(st);
                log!(
                    Warn,
                    "QP {}: the shaper at its other end has not answered for {} ms; its requests waiting for a credit fail (retries exceeded) and the QP moves to the error state, as toward a peer that is gone",
                    self.qp_num,
                    limit / 1_000_000
                );
            }
        }
        if let Some(route) = sender_route {
            for message in again {
                self.engine.side_link_send(
                    &route,
                    SideMessage::Announce {
                        qp_num: route.peer_qpn,
                        message,
                    },
                );
            }
        }
        let Some(r) = &self.receiver else {
            return;
        };
        let Some(mut half) = r.half.try_lock() else {
            return;
        };
        if let RecvMode::Owned(side) = &half.mode {
            let waits = side.waits_for_room();
            // A CQ armed for solicited completions only raises no event for a message's
            // chunks: a chunk that failed (an RNIC need not report that as solicited)
            // is found here within a timer period, and its error held for the
            // application, whose arm the holding wakes.
            let unwatched =
                side.landing() > 0 && self.recv_cq.as_ref().is_some_and(|cq| cq.armed_solicited());
            drop(half);
            if let (true, Some(cq)) = (waits || unwatched, &self.recv_cq) {
                if waits {
                    Counters::add(&self.engine.counters.receiver_polls_aside, 1);
                }
                cq.poll_for_receiver(self, Duration::from_nanos(now_ns));
            }
            return;
        }
        let Some(route) = half.route.clone() else {
            return;
        };
        let RecvMode::Offered {
            next_ns, wait_ns, ..
        } = &mut half.mode
        else {
            return;
        };
        if now_ns < *next_ns {
            return;
        }
        // Repeated with a doubling wait, as announcements are, until the accept comes.
        *wait_ns = (*wait_ns * 2).min(ANNOUNCE_RETRY_MAX_NS);
        *next_ns = now_ns.saturating_add(*wait_ns);
        let offer = half.agreement.offer(route.peer_qpn);
        drop(half);
        self.engine.side_link_send(&route, offer);
    }
}

/// `ibv_modify_qp`.
pub type ModifyQp = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;

/// The real `ibv_modify_qp`, once the application's first call found it: what moves a QP
/// whose peer is gone to the error state ([`QpShared::give_up`]).
static MODIFY_QP: std::sync::atomic::AtomicPtr<()> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// Keeps `real`, the real `ibv_modify_qp`.
pub fn set_modify_qp(real: ModifyQp) {
    MODIFY_QP.store(real as *mut (), Ordering::Release);
}

/// A flushed completion of the application's receive `wr_id` on QP `qp_num`.
fn flushed_receive(wr_id: u64, qp_num: u32) -> ibv_wc {
    ibv_wc {
        wr_id,
        status: IBV_WC_WR_FLUSH_ERR,
        opcode: IBV_WC_RECV,
        qp_num,
        ..ibv_wc::default()
    }
}

impl Engine {
    /// Sends `message` along `route` on the process's side channels.
    fn side_link_send(&self, route: &Route, message: SideMessage) {
        if let Some(link) = &self.side {
            link.queue(route, message);
        }
    }

    /// One turn of the side thread at `now_ns` (`CLOCK_MONOTONIC`): the datagrams that
    /// arrived, the hellos due, and every 10 ms the repeats due. Returns
    /// whether datagrams may be left (the turn read its share).
    pub fn side_turn(self: &Arc<Self>, now_ns: u64) -> bool {
        let Some(link) = &self.side else {
            return false;
        };
        link.take_wake();
        link.flush_outbox();
        let datagrams = link.sides.lock().receive(PER_TURN);
        let more = datagrams.len() >= PER_TURN;
        let mut said = Vec::new();
        for d in datagrams {
            self.on_datagram(link, d, now_ns, &mut said);
        }
        for line in said {
            log!(Debug, "{line}");
        }
        self.send_hellos(link, now_ns);
        let last = link.timers_ns.load(Ordering::Relaxed);
        if now_ns.saturating_sub(last) >= TIMER_PERIOD_NS {
            link.timers_ns.store(now_ns, Ordering::Relaxed);
            for q in link.all() {
                q.two_sided_timers(now_ns);
            }
        }
        link.flush_outbox();
        more
    }

    /// One datagram from a side channel: a hello goes to the pairing record; any other
    /// message is taken only from the side channel paired with the QP it names, and
    /// handed to that QP's half.
    fn on_datagram(&self, link: &SideLink, d: Datagram, now_ns: u64, said: &mut Vec<String>) {
        let message = match SideMessage::decode(&d.bytes) {
            Ok(m) => m,
            Err(e) => {
                refuse(said, || {
                    format!(
                        "a datagram from queue pair {:#x} is no side-channel message ({e}): dropped",
                        d.source.qpn
                    )
                });
                return;
            }
        };
        let qp_num = match message {
            SideMessage::Hello {
                qp_num,
                heard,
                splits,
            } => {
                let (outcome, route, since) = {
                    let mut record = pairing::record();
                    let outcome = record.on_hello(qp_num, &d.source, heard);
                    let since = record.since_report_ns(qp_num, now_ns);
                    let refused = record.counts().refused;
                    let route = matches!(outcome, HelloOutcome::Heard(_))
                        .then(|| route_of(&record, qp_num))
                        .flatten();
                    if matches!(outcome, HelloOutcome::Refused) && refused <= REFUSALS_SAID {
                        said.push(format!(
                            "a hello for queue pair {qp_num:#x} from queue pair {:#x} is not from its peer's side channel: dropped",
                            d.source.qpn
                        ));
                    }
                    (outcome, route, since)
                };
                if outcome == HelloOutcome::Heard(true) {
                    said.push(format!(
                        "queue pair {qp_num:#x}: the shaper at its other end speaks side-channel version {VERSION} ({} ms after its pairing was reported)",
                        since.unwrap_or(0) / 1_000_000
                    ));
                }
                if let (Some(route), Some(q)) = (route, link.qp(qp_num)) {
                    q.on_peer_hello(route, splits, now_ns);
                }
                return;
            }
            SideMessage::Offer { qp_num, .. }
            | SideMessage::Accept { qp_num, .. }
            | SideMessage::Announce { qp_num, .. }
            | SideMessage::Waiting { qp_num, .. }
            | SideMessage::Credit { qp_num, .. } => qp_num,
        };
        let from_peer = match pairing::record().from_peer(qp_num, &d.source) {
            Some(from_peer) => from_peer,
            // From the peer, before its hello came here: dropped uncounted (the peer
            // repeats what is not answered).
            None => return,
        };
        let taken = from_peer
            && link.qp(qp_num).is_some_and(|q| match message {
                SideMessage::Offer { first, .. } => {
                    q.on_offer(first);
                    true
                }
                SideMessage::Accept { first, .. } => q.on_accept(first),
                SideMessage::Announce { message, .. } => q.on_announce(message),
                SideMessage::Credit { seq, posting, .. } => {
                    q.on_credit(seq, posting, self.clock.now())
                }
                SideMessage::Waiting { seq, .. } => q.on_waiting(seq, now_ns),
                SideMessage::Hello { .. } => false,
            });
        if !taken {
            refuse(said, || {
                format!(
                    "{message:?} from queue pair {:#x} {}: dropped",
                    d.source.qpn,
                    if from_peer {
                        "does not fit where its queue pair stands"
                    } else {
                        "is not from the side channel paired with its queue pair"
                    }
                )
            });
        }
    }

    /// Sends the hellos due, each saying whether its QP splits its sends.
    fn send_hellos(&self, link: &SideLink, now_ns: u64) {
        let (due, notices) = {
            let mut record = pairing::record();
            (record.hellos_due(now_ns, PER_TURN), record.take_notices())
        };
        for line in notices {
            log!(Info, "{line}");
        }
        for (c, peer, heard) in due {
            let splits = link.qp(c.qpn).is_some_and(|q| q.splits());
            let route = Route {
                port: c.port.clone(),
                sgid_index: c.sgid_index,
                to: DatagramDest {
                    gid: c.end.gid,
                    lid: c.end.lid,
                    qpn: peer.qpn,
                    qkey: peer.qkey,
                },
                peer_qpn: c.end.qpn,
            };
            // A hello lost here is sent again on the greeting's timer.
            link.queue(
                &route,
                SideMessage::Hello {
                    qp_num: c.end.qpn,
                    heard,
                    splits,
                },
            );
        }
    }

    /// Starts the side thread once the process has a side channel (or wakes nothing: it
    /// runs on its own from then on).
    pub(super) fn start_side_thread(self: &Arc<Self>) {
        let Some(link) = &self.side else {
            return;
        };
        if self.pacer.mode != super::PacerMode::Thread || link.sides.lock().count() == 0 {
            return;
        }
        let pid = std::process::id();
        let mut thread = link.thread.lock().unwrap_or_else(|e| e.into_inner());
        if *thread == Some(pid) {
            return;
        }
        let engine = Arc::downgrade(self);
        match std::thread::Builder::new()
            .name("justitia-side".into())
            .spawn(move || side_loop(engine))
        {
            Ok(_) => *thread = Some(pid),
            Err(e) => log!(
                Warn,
                "cannot start the thread that reads the side channels ({e}); SENDs and WRITEs with immediate go whole"
            ),
        }
    }
}

/// Counts a refused datagram, and says the first [`REFUSALS_SAID`] (at debug level, once
/// the record's lock is released): anyone on the fabric can send them.
fn refuse(said: &mut Vec<String>, line: impl FnOnce() -> String) {
    let mut record = pairing::record();
    record.refused();
    if record.counts().refused <= REFUSALS_SAID {
        said.push(line());
    }
}

/// The route to the peer side channel of queue pair `qp_num`, once paired.
fn route_of(record: &pairing::Pairings, qp_num: u32) -> Option<Route> {
    let (connection, peer) = record.connection(qp_num)?;
    Some(Route {
        to: DatagramDest {
            gid: connection.end.gid,
            lid: connection.end.lid,
            qpn: peer.qpn,
            qkey: peer.qkey,
        },
        peer_qpn: connection.end.qpn,
        port: connection.port,
        sgid_index: connection.sgid_index,
    })
}

/// The side thread: waits for a datagram on the side channels' completion channels (or a
/// millisecond, for side channels without one), at most until the next timer, and takes
/// a turn.
fn side_loop(engine: Weak<Engine>) {
    loop {
        let Some(e) = engine.upgrade() else {
            return;
        };
        let now_ns = justitia_agent::block::monotonic_ns();
        let more = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.side_turn(now_ns)))
            .unwrap_or(false);
        let fds = e
            .side
            .as_ref()
            .map(|l| {
                let mut fds = l.sides.lock().event_fds();
                if l.wake_fd >= 0 {
                    fds.push(l.wake_fd);
                }
                fds
            })
            .unwrap_or_default();
        drop(e);
        if more {
            continue;
        }
        let wait = Duration::from_nanos(TIMER_PERIOD_NS).min(IDLE_WAIT);
        if fds.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let mut polled: Vec<libc::pollfd> = fds
            .iter()
            .map(|&fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: a valid array of pollfds of the side channels' descriptors, which live
        // as long as the process's side channels (never closed before exit).
        unsafe {
            libc::poll(
                polled.as_mut_ptr(),
                polled.len() as libc::nfds_t,
                i32::try_from(wait.as_millis()).unwrap_or(i32::MAX),
            )
        };
    }
}

/// Whether `cq` can carry an owned receive queue's completions: known, and polled with
/// `ibv_poll_cq` (an extended CQ's polls do not translate receives).
pub(super) fn translates_receives(cq: &CqShared) -> bool {
    cq.ex.is_none()
}
