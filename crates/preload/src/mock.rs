//! An in-process mock verbs provider, for the shaper's tests and benchmarks.
//!
//! A [`MockDevice`] is an extended device context whose function pointers (`post_send`,
//! `poll_cq`, `create_qp_ex`, the `ibv_wr_*` and extended-CQ poll pointers of its objects)
//! are this module's. It records every work request that reaches it, keeps each QP's send
//! queue with its depth (refusing the request past it with `ENOMEM`, as a provider does),
//! and executes queued requests on demand in order: WRITE copies the local bytes to the
//! remote address and READ copies back (both in this process's memory), and completions
//! are generated as an RC QP would generate them (for signaled requests, and for every
//! request once the QP has failed). No libibverbs is involved.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::ffi::c_int;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Condvar, Mutex};

use justitia_verbs::sys::*;
use justitia_verbs::VERBS_ABI_IS_EXTENDED;

/// The size of a mock CQ unless a test sets another ([`MockDevice::set_cq_size`]):
/// room for any test's QPs.
pub const MOCK_CQE: c_int = 1 << 16;

/// A work request as it reached the mock provider.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostedWr {
    /// The QP it was posted on.
    pub qp_num: u32,
    /// Its `wr_id`.
    pub wr_id: u64,
    /// `IBV_WR_*`.
    pub opcode: ibv_wr_opcode,
    /// `IBV_SEND_*` flags.
    pub send_flags: u32,
    /// Its SGEs.
    pub sges: Vec<ibv_sge>,
    /// Remote address (RDMA and atomics).
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Immediate data as posted.
    pub imm_data: u32,
}

impl PostedWr {
    /// True when it asked for a completion.
    pub fn signaled(&self) -> bool {
        self.send_flags & IBV_SEND_SIGNALED != 0
    }

    /// Sum of its SGE lengths.
    pub fn len(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.length)).sum()
    }

    /// True when it carries no payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct MockQp {
    qpx: Box<UnsafeCell<ibv_qp_ex>>,
    depth: u32,
    send_cq: *mut ibv_cq,
    sig_all: bool,
    sq: VecDeque<PostedWr>,
    failed: bool,
    fail_next: Option<ibv_wc_status>,
    /// Refuse the WQE at this position of the next post call's list, with this error.
    refuse_next: Option<(usize, c_int)>,
    batch: Vec<PostedWr>,
    /// Destroyed: a post reaching it is a use after destroy.
    destroyed: bool,
    recv_cq: *mut ibv_cq,
    /// Its receive queue: each receive's `wr_id` and SGEs.
    rq: VecDeque<(u64, Vec<ibv_sge>)>,
    rq_depth: u32,
    /// The QP at its other end ([`MockDevice::connect`]): its SENDs and WRITEs with
    /// immediate consume that QP's receives.
    peer: Option<usize>,
}

struct MockCq {
    cqx: Box<UnsafeCell<ibv_cq_ex>>,
    entries: VecDeque<ibv_wc>,
    current: Option<ibv_wc>,
}

#[derive(Default)]
struct MockState {
    qps: Vec<MockQp>,
    cqs: Vec<MockCq>,
    log: Vec<PostedWr>,
    next_qp_num: u32,
    notify_calls: u32,
    /// Each `ibv_req_notify_cq` call's CQ and `solicited_only`, in order.
    arms: Vec<(usize, c_int)>,
    post_calls: u32,
    end_polls: u32,
    /// `ibv_create_cq_ex` refuses to report QP numbers.
    refuse_qp_num: bool,
    /// Post calls that reached a destroyed QP.
    posts_after_destroy: u32,
    /// A destroyed QP's completions stay in its CQ (rxe-like) instead of being purged.
    keeps_stale: bool,
    /// Receive-consuming requests that found no receive posted at the peer (each an RNR
    /// the application would not have had natively, if it had posted its receives).
    rnr: u32,
}

struct MockInner {
    vctx: UnsafeCell<verbs_context>,
    state: Mutex<MockState>,
    /// The next post on this QP stops inside the provider (holding none of the mock's
    /// locks) until the test lets it go (see [`MockDevice::hold_next_post`]).
    gate: Mutex<Option<PostGate>>,
    /// The extended CQ (its address) whose poll is in progress, from `start_poll` to
    /// `end_poll`: as a provider holds the CQ's lock across one, every other poll of it
    /// waits (`ibv_poll_cq` included).
    session: Mutex<Option<usize>>,
    session_ended: Condvar,
    /// Told when a poll starts waiting for another one to end (see
    /// [`MockDevice::tell_when_a_poll_waits`]).
    poll_waits: Mutex<Option<Sender<()>>>,
    /// The next `poll_cq` of this CQ (its address) stops inside the provider, before it
    /// takes any completion, until the test lets it go (see [`MockDevice::hold_next_poll`]).
    poll_gate: Mutex<Option<PollGate>>,
}

/// A poll held inside the provider: the CQ (its address), where it says it got there, and
/// where it waits to be let go.
struct PollGate {
    cq: usize,
    entered: Sender<()>,
    go: Receiver<()>,
}

/// A post held inside the provider: it says when it got there, and waits to be let go.
struct PostGate {
    qp: usize,
    /// Post calls on the QP to let through first.
    skip: u32,
    /// Held once the call took its requests (else before it takes any).
    after: bool,
    entered: Sender<()>,
    go: Receiver<()>,
}

/// The test's end of a post held inside the provider.
pub struct HeldPost {
    /// Receives once the post is inside the provider.
    pub entered: Receiver<()>,
    /// Lets the post go on (a send, or dropping it).
    pub go: Sender<()>,
}

/// One mock device context and everything created on it.
pub struct MockDevice {
    inner: Box<MockInner>,
}

// SAFETY: all mutable state is behind the mutex; the context is only written at creation.
unsafe impl Send for MockDevice {}
// SAFETY: as above.
unsafe impl Sync for MockDevice {}

impl Drop for MockDevice {
    fn drop(&mut self) {
        // The context's address may be reused by the next mock: the shaper must not take
        // it for this one (a test that fails before forgetting its context would otherwise
        // fail every test after it).
        crate::engine::detach_context(self.context());
    }
}

impl Default for MockDevice {
    fn default() -> Self {
        Self::new()
    }
}

fn inner_of(ctx: *mut ibv_context) -> &'static MockInner {
    // SAFETY: every object of a mock device points to the mock's context, whose extended
    // part holds the address of its MockInner; devices outlive their objects' use in tests.
    unsafe {
        let vctx = justitia_verbs::ops::verbs_get_ctx(ctx);
        &*(*vctx).priv_.cast::<MockInner>()
    }
}

impl MockDevice {
    /// A device context with the mock's operations installed.
    pub fn new() -> Self {
        let inner = Box::new(MockInner {
            vctx: UnsafeCell::new(verbs_context::default()),
            state: Mutex::new(MockState {
                next_qp_num: 0x100,
                ..Default::default()
            }),
            gate: Mutex::new(None),
            session: Mutex::new(None),
            session_ended: Condvar::new(),
            poll_waits: Mutex::new(None),
            poll_gate: Mutex::new(None),
        });
        let me = (&*inner as *const MockInner).cast_mut();
        // SAFETY: nobody else sees the context yet.
        unsafe {
            let v = &mut *inner.vctx.get();
            v.sz = std::mem::size_of::<verbs_context>();
            v.priv_ = me.cast();
            v.create_qp_ex = Some(mock_create_qp_ex);
            v.create_cq_ex = Some(mock_create_cq_ex);
            v.context.abi_compat = VERBS_ABI_IS_EXTENDED;
            v.context.ops.post_send = Some(mock_post_send);
            v.context.ops.post_recv = Some(mock_post_recv);
            v.context.ops.poll_cq = Some(mock_poll_cq);
            v.context.ops.req_notify_cq = Some(mock_req_notify_cq);
        }
        MockDevice { inner }
    }

    /// The device context.
    pub fn context(&self) -> *mut ibv_context {
        // SAFETY: a field pointer of the live context.
        unsafe { &mut (*self.inner.vctx.get()).context }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MockState> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates a CQ the way `ibv_create_cq` would (the shaper is not involved).
    pub fn create_cq(&self) -> *mut ibv_cq {
        create_cq(self.context(), u64::from(IBV_WC_EX_WITH_QP_NUM)).cast()
    }

    /// Sets the size a CQ reports (`ibv_cq.cqe`), before the shaper registers it.
    pub fn set_cq_size(&self, cq: *mut ibv_cq, cqe: c_int) {
        if let Some(c) = self
            .state()
            .cqs
            .iter()
            .find(|c| c.cqx.get().cast::<ibv_cq>() == cq)
        {
            // SAFETY: the mock's own CQ object, not yet shared with another thread.
            unsafe { (*c.cqx.get()).cqe = cqe };
        }
    }

    /// Creates a QP the way `ibv_create_qp` would, writing the granted capacities back
    /// into `attr` (the shaper is not involved).
    pub fn create_qp(&self, attr: &mut ibv_qp_init_attr) -> *mut ibv_qp {
        create_qp(
            self.context(),
            attr.send_cq,
            attr.recv_cq,
            attr.qp_type,
            attr.sq_sig_all != 0,
            &mut attr.cap,
        )
        .cast()
    }

    /// Every work request that reached the provider, in order.
    pub fn log(&self) -> Vec<PostedWr> {
        self.state().log.clone()
    }

    /// Work requests queued (posted, not executed) on `qp`.
    pub fn queued(&self, qp: *mut ibv_qp) -> usize {
        let st = self.state();
        st.qps
            .iter()
            .find(|q| q.qpx.get().cast::<ibv_qp>() == qp)
            .map_or(0, |q| q.sq.len())
    }

    /// Completions waiting in `cq`.
    pub fn cq_entries(&self, cq: *mut ibv_cq) -> usize {
        let st = self.state();
        st.cqs
            .iter()
            .find(|c| c.cqx.get().cast::<ibv_cq>() == cq)
            .map_or(0, |c| c.entries.len())
    }

    /// `end_poll` calls that reached the provider.
    pub fn end_polls(&self) -> u32 {
        self.state().end_polls
    }

    /// The next `post_send` call on `qp` stops inside the provider, before it takes any
    /// request and holding none of the mock's locks, until the test lets it go: a provider
    /// post that takes long (a doorbell stuck behind a busy PCIe link, a preempted thread).
    pub fn hold_next_post(&self, qp: *mut ibv_qp) -> HeldPost {
        self.hold_post(qp, 0, false)
    }

    /// The post call on `qp` after the next `skip` ones stops inside the provider, as
    /// [`Self::hold_next_post`]; with `after`, once it took its requests (they can be
    /// executed and their completions polled before the call returns).
    pub fn hold_post(&self, qp: *mut ibv_qp, skip: u32, after: bool) -> HeldPost {
        let (entered_tx, entered) = channel();
        let (go, go_rx) = channel();
        *self.inner.gate.lock().unwrap_or_else(|e| e.into_inner()) = Some(PostGate {
            qp: qp as usize,
            skip,
            after,
            entered: entered_tx,
            go: go_rx,
        });
        HeldPost { entered, go }
    }

    /// The next `poll_cq` of `cq` stops inside the provider, before it takes any
    /// completion and holding none of the mock's locks, until the test lets it go: a
    /// polling thread preempted between the shaper's look at the CQ and the provider's
    /// poll. [`HeldPost`]'s two ends serve it too.
    pub fn hold_next_poll(&self, cq: *mut ibv_cq) -> HeldPost {
        let (entered_tx, entered) = channel();
        let (go, go_rx) = channel();
        *self
            .inner
            .poll_gate
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(PollGate {
            cq: cq as usize,
            entered: entered_tx,
            go: go_rx,
        });
        HeldPost { entered, go }
    }

    /// From now on, every poll of a CQ (plain or extended) that waits for an extended poll
    /// of it in progress to end says so on the channel returned.
    pub fn tell_when_a_poll_waits(&self) -> Receiver<()> {
        let (tx, rx) = channel();
        *self
            .inner
            .poll_waits
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(tx);
        rx
    }

    /// `post_send` calls that reached the provider (one per list).
    pub fn post_calls(&self) -> u32 {
        self.state().post_calls
    }

    /// From now on `ibv_create_cq_ex` fails when asked for QP numbers (as a provider that
    /// does not support them would).
    pub fn refuse_qp_numbers(&self) {
        self.state().refuse_qp_num = true;
    }

    /// Creates a CQ bound to `channel` (the shaper is not involved).
    pub fn create_cq_on(&self, channel: *mut ibv_comp_channel) -> *mut ibv_cq {
        let cqx = create_cq(self.context(), u64::from(IBV_WC_EX_WITH_QP_NUM));
        // SAFETY: the CQ was just created and is not shared yet.
        unsafe { (*cqx).channel = channel };
        cqx.cast()
    }

    /// `ibv_req_notify_cq` calls that reached the provider.
    pub fn notify_calls(&self) -> u32 {
        self.state().notify_calls
    }

    /// The `solicited_only` argument of each `ibv_req_notify_cq` call on `cq` that reached
    /// the provider, in order.
    pub fn arms_of(&self, cq: *mut ibv_cq) -> Vec<c_int> {
        self.state()
            .arms
            .iter()
            .filter(|(c, _)| *c == cq as usize)
            .map(|(_, solicited)| *solicited)
            .collect()
    }

    /// The next executed request of `qp` fails with `status`; the QP then flushes.
    pub fn fail_next(&self, qp: *mut ibv_qp, status: ibv_wc_status) {
        if let Some(q) = self
            .state()
            .qps
            .iter_mut()
            .find(|q| q.qpx.get().cast::<ibv_qp>() == qp)
        {
            q.fail_next = Some(status);
        }
    }

    /// The next post on `qp` is refused with `errno`.
    pub fn refuse_next_post(&self, qp: *mut ibv_qp, errno: c_int) {
        self.refuse_in_next_post(qp, 0, errno);
    }

    /// The next post call on `qp` takes the WQEs before `position` of its list and
    /// refuses the one there with `errno`, as a provider does with a bad WQE in a list.
    pub fn refuse_in_next_post(&self, qp: *mut ibv_qp, position: usize, errno: c_int) {
        if let Some(q) = self
            .state()
            .qps
            .iter_mut()
            .find(|q| q.qpx.get().cast::<ibv_qp>() == qp)
        {
            q.refuse_next = Some((position, errno));
        }
    }

    /// Connects `a` and `b` as the two ends of an RC connection: a SEND, SEND with
    /// immediate or WRITE with immediate executed on one consumes the other's next
    /// receive (its bytes scattered into it, its completion on that QP's receive CQ);
    /// with none posted it fails with `IBV_WC_RNR_RETRY_EXC_ERR` and is counted
    /// ([`Self::rnr`]), as a strict peer with `rnr_retry` 0 would.
    pub fn connect(&self, a: *mut ibv_qp, b: *mut ibv_qp) {
        let mut st = self.state();
        let at = |qp| {
            st.qps
                .iter()
                .position(|q| q.qpx.get().cast::<ibv_qp>() == qp)
        };
        if let (Some(i), Some(j)) = (at(a), at(b)) {
            st.qps[i].peer = Some(j);
            st.qps[j].peer = Some(i);
        }
    }

    /// Numbers the QPs created from now on from `first` on (tests that share the
    /// process's pairing record keep their QP numbers apart).
    pub fn number_qps_from(&self, first: u32) {
        self.state().next_qp_num = first.saturating_sub(1);
    }

    /// Receive-consuming requests that found no receive at the peer.
    pub fn rnr(&self) -> u32 {
        self.state().rnr
    }

    /// Receives posted on `qp` and not consumed.
    pub fn receives_posted(&self, qp: *mut ibv_qp) -> usize {
        self.state()
            .qps
            .iter()
            .find(|q| q.qpx.get().cast::<ibv_qp>() == qp)
            .map_or(0, |q| q.rq.len())
    }

    /// Executes up to `n` queued requests of `qp` in order; returns how many ran.
    pub fn execute(&self, qp: *mut ibv_qp, n: usize) -> usize {
        let mut st = self.state();
        let MockState { qps, cqs, rnr, .. } = &mut *st;
        let Some(index) = qps.iter().position(|q| q.qpx.get().cast::<ibv_qp>() == qp) else {
            return 0;
        };
        let mut completions = Vec::new();
        let mut received: Vec<(*mut ibv_cq, ibv_wc)> = Vec::new();
        let mut ran = 0;
        while ran < n {
            let Some(wr) = qps[index].sq.pop_front() else {
                break;
            };
            ran += 1;
            let consumes = matches!(
                wr.opcode,
                IBV_WR_SEND | IBV_WR_SEND_WITH_IMM | IBV_WR_RDMA_WRITE_WITH_IMM
            );
            let peer = qps[index].peer.filter(|_| consumes);
            let q = &mut qps[index];
            let status = if q.failed {
                IBV_WC_WR_FLUSH_ERR
            } else if let Some(s) = q.fail_next.take() {
                q.failed = true;
                s
            } else if let Some(p) = peer {
                let len = u32::try_from(wr.len()).unwrap_or(u32::MAX);
                let peer_qp = &mut qps[p];
                let peer_num = peer_qp.qpx.get().cast::<ibv_qp>();
                // SAFETY: the mock's own QP object.
                let peer_num = unsafe { (*peer_num).qp_num };
                match peer_qp.rq.pop_front() {
                    None => {
                        *rnr += 1;
                        qps[index].failed = true;
                        IBV_WC_RNR_RETRY_EXC_ERR
                    }
                    Some((wr_id, sges)) => {
                        let room: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
                        let write = wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
                        let fits = write || u64::from(len) <= room;
                        if fits {
                            // SAFETY: tests post requests over their own live buffers.
                            unsafe {
                                if write {
                                    move_data(&wr);
                                } else {
                                    scatter(&wr.sges, &sges);
                                }
                            }
                        }
                        let imm = wr.opcode != IBV_WR_SEND;
                        let mut wc = ibv_wc {
                            wr_id,
                            status: if fits {
                                IBV_WC_SUCCESS
                            } else {
                                IBV_WC_LOC_LEN_ERR
                            },
                            opcode: if write {
                                IBV_WC_RECV_RDMA_WITH_IMM
                            } else {
                                IBV_WC_RECV
                            },
                            byte_len: len,
                            qp_num: peer_num,
                            wc_flags: if imm { IBV_WC_WITH_IMM } else { 0 },
                            ..Default::default()
                        };
                        wc.__bindgen_anon_1.imm_data = wr.imm_data;
                        received.push((qps[p].recv_cq, wc));
                        if fits {
                            IBV_WC_SUCCESS
                        } else {
                            qps[index].failed = true;
                            IBV_WC_REM_INV_REQ_ERR
                        }
                    }
                }
            } else {
                // SAFETY: tests post requests over their own live buffers.
                unsafe { move_data(&wr) };
                IBV_WC_SUCCESS
            };
            let q = &mut qps[index];
            if status != IBV_WC_SUCCESS || wr.signaled() || q.sig_all {
                completions.push(ibv_wc {
                    wr_id: wr.wr_id,
                    status,
                    opcode: if status == IBV_WC_SUCCESS {
                        match wr.opcode {
                            IBV_WR_RDMA_READ => IBV_WC_RDMA_READ,
                            IBV_WR_SEND | IBV_WR_SEND_WITH_IMM => IBV_WC_SEND,
                            IBV_WR_ATOMIC_FETCH_AND_ADD => IBV_WC_FETCH_ADD,
                            IBV_WR_ATOMIC_CMP_AND_SWP => IBV_WC_COMP_SWAP,
                            _ => IBV_WC_RDMA_WRITE,
                        }
                    } else {
                        0
                    },
                    byte_len: u32::try_from(wr.len()).unwrap_or(u32::MAX),
                    qp_num: wr.qp_num,
                    ..Default::default()
                });
            }
        }
        let send_cq = qps[index].send_cq;
        if let Some(cq) = cqs
            .iter_mut()
            .find(|c| c.cqx.get().cast::<ibv_cq>() == send_cq)
        {
            cq.entries.extend(completions);
        }
        for (recv_cq, wc) in received {
            if let Some(cq) = cqs
                .iter_mut()
                .find(|c| c.cqx.get().cast::<ibv_cq>() == recv_cq)
            {
                cq.entries.push_back(wc);
            }
        }
        ran
    }

    /// Destroys `qp` as a provider would: its queued requests are dropped, its completions
    /// purged from its CQ (unless [`Self::keep_stale_completions`] said otherwise), and any
    /// later post on it is counted as a use after destroy.
    pub fn destroy_qp(&self, qp: *mut ibv_qp) {
        let mut st = self.state();
        let keeps_stale = st.keeps_stale;
        let MockState { qps, cqs, .. } = &mut *st;
        if let Some(q) = qps.iter_mut().find(|q| q.qpx.get().cast::<ibv_qp>() == qp) {
            q.destroyed = true;
            q.sq.clear();
            // SAFETY: the mock's own QP object, alive as long as the device.
            let qp_num = unsafe { (*q.qpx.get()).qp_base.qp_num };
            if !keeps_stale {
                for c in cqs.iter_mut() {
                    c.entries.retain(|e| e.qp_num != qp_num);
                }
            }
        }
    }

    /// Moves `qp` to the error state as `ibv_modify_qp` does: every WQE it still has, and
    /// every one posted later, completes with `IBV_WC_WR_FLUSH_ERR`; the receives it has
    /// posted flush into its receive CQ at once.
    pub fn set_error(&self, qp: *mut ibv_qp) {
        let mut st = self.state();
        let MockState { qps, cqs, .. } = &mut *st;
        let Some(q) = qps.iter_mut().find(|q| q.qpx.get().cast::<ibv_qp>() == qp) else {
            return;
        };
        q.failed = true;
        // SAFETY: the mock's own QP object.
        let qp_num = unsafe { (*q.qpx.get()).qp_base.qp_num };
        let flushed: Vec<ibv_wc> =
            q.rq.drain(..)
                .map(|(wr_id, _)| ibv_wc {
                    wr_id,
                    status: IBV_WC_WR_FLUSH_ERR,
                    qp_num,
                    ..Default::default()
                })
                .collect();
        if let Some(cq) = cqs
            .iter_mut()
            .find(|c| c.cqx.get().cast::<ibv_cq>() == q.recv_cq)
        {
            cq.entries.extend(flushed);
        }
    }

    /// From now on, a destroyed QP's completions stay in its CQ, as some providers leave
    /// them (rxe does not purge the CQ at destroy).
    pub fn keep_stale_completions(&self) {
        self.state().keeps_stale = true;
    }

    /// Moves `qp` to RESET as a provider may: its queue is forgotten (nothing queued runs,
    /// the error state is cleared) while the completions it already made stay in its CQ.
    pub fn reset_qp(&self, qp: *mut ibv_qp) {
        if let Some(q) = self
            .state()
            .qps
            .iter_mut()
            .find(|q| q.qpx.get().cast::<ibv_qp>() == qp)
        {
            q.sq.clear();
            q.failed = false;
            q.fail_next = None;
        }
    }

    /// Post calls that reached a destroyed QP (each one a use after destroy).
    pub fn posts_after_destroy(&self) -> u32 {
        self.state().posts_after_destroy
    }

    /// Queues `wc` on `cq` as if the hardware had produced it.
    pub fn push_completion(&self, cq: *mut ibv_cq, wc: ibv_wc) {
        if let Some(c) = self
            .state()
            .cqs
            .iter_mut()
            .find(|c| c.cqx.get().cast::<ibv_cq>() == cq)
        {
            c.entries.push_back(wc);
        }
    }

    /// Executes everything queued on `qp`.
    pub fn execute_all(&self, qp: *mut ibv_qp) -> usize {
        self.execute(qp, usize::MAX)
    }
}

/// Performs a WRITE or READ between this process's buffers.
///
/// # Safety
/// The request's local and remote ranges must be live memory of this process.
unsafe fn move_data(wr: &PostedWr) {
    let mut remote = wr.remote_addr as *mut u8;
    for s in &wr.sges {
        let local = s.addr as *mut u8;
        let len = s.length as usize;
        // SAFETY: guaranteed by the caller.
        unsafe {
            match wr.opcode {
                IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM if len > 0 => {
                    std::ptr::copy(local, remote, len);
                }
                IBV_WR_RDMA_READ if len > 0 => std::ptr::copy(remote, local, len),
                _ => {}
            }
            remote = remote.add(len);
        }
    }
}

/// A CQ whose extended form reports what `wc_flags` asks for (QP numbers only if asked).
fn create_cq(ctx: *mut ibv_context, wc_flags: u64) -> *mut ibv_cq_ex {
    let inner = inner_of(ctx);
    let mut cqx = ibv_cq_ex {
        context: ctx,
        cqe: MOCK_CQE,
        ..Default::default()
    };
    cqx.start_poll = Some(mock_start_poll);
    cqx.next_poll = Some(mock_next_poll);
    cqx.end_poll = Some(mock_end_poll);
    cqx.read_opcode = Some(mock_read_opcode);
    cqx.read_byte_len = Some(mock_read_byte_len);
    if wc_flags & u64::from(IBV_WC_EX_WITH_QP_NUM) != 0 {
        cqx.read_qp_num = Some(mock_read_qp_num);
    }
    let cell = Box::new(UnsafeCell::new(cqx));
    let p = cell.get();
    inner
        .state
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .cqs
        .push(MockCq {
            cqx: cell,
            entries: VecDeque::new(),
            current: None,
        });
    p
}

fn create_qp(
    ctx: *mut ibv_context,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    qp_type: ibv_qp_type,
    sig_all: bool,
    cap: &mut ibv_qp_cap,
) -> *mut ibv_qp_ex {
    let inner = inner_of(ctx);
    let mut st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
    st.next_qp_num += 1;
    let mut qpx = ibv_qp_ex::default();
    qpx.qp_base.context = ctx;
    qpx.qp_base.send_cq = send_cq;
    qpx.qp_base.recv_cq = recv_cq;
    qpx.qp_base.qp_type = qp_type;
    qpx.qp_base.qp_num = st.next_qp_num;
    qpx.wr_start = Some(mock_wr_start);
    qpx.wr_complete = Some(mock_wr_complete);
    qpx.wr_abort = Some(mock_wr_abort);
    qpx.wr_rdma_write = Some(mock_wr_rdma_write);
    qpx.wr_rdma_read = Some(mock_wr_rdma_read);
    qpx.wr_set_sge = Some(mock_wr_set_sge);
    cap.max_send_wr = cap.max_send_wr.max(1);
    cap.max_send_sge = cap.max_send_sge.max(1);
    let cell = Box::new(UnsafeCell::new(qpx));
    let p = cell.get();
    st.qps.push(MockQp {
        qpx: cell,
        depth: cap.max_send_wr,
        send_cq,
        sig_all,
        sq: VecDeque::new(),
        failed: false,
        fail_next: None,
        refuse_next: None,
        batch: Vec::new(),
        destroyed: false,
        recv_cq,
        rq: VecDeque::new(),
        rq_depth: cap.max_recv_wr,
        peer: None,
    });
    p
}

fn with_qp<R>(qp: *mut ibv_qp, f: impl FnOnce(&mut MockQp, &mut Vec<PostedWr>) -> R) -> Option<R> {
    // SAFETY: a mock QP points to its mock context.
    let inner = inner_of(unsafe { (*qp).context });
    let mut st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
    let MockState { qps, log, .. } = &mut *st;
    qps.iter_mut()
        .find(|q| q.qpx.get().cast::<ibv_qp>() == qp)
        .map(|q| f(q, log))
}

fn with_cq<R>(cq: *mut ibv_cq, f: impl FnOnce(&mut MockCq) -> R) -> Option<R> {
    // SAFETY: a mock CQ points to its mock context.
    let inner = inner_of(unsafe { (*cq).context });
    let mut st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
    st.cqs
        .iter_mut()
        .find(|c| c.cqx.get().cast::<ibv_cq>() == cq)
        .map(f)
}

unsafe extern "C" fn mock_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: the caller passes a live QP.
    let qp_num = unsafe { (*qp).qp_num };
    // SAFETY: a mock QP points to its mock context.
    let inner = inner_of(unsafe { (*qp).context });
    let gate = {
        let mut gate = inner.gate.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *gate {
            Some(g) if g.qp == qp as usize && g.skip > 0 => {
                g.skip -= 1;
                None
            }
            Some(g) if g.qp == qp as usize => gate.take(),
            _ => None,
        }
    };
    // The test may have gone: then the post just goes on.
    let wait = |g: PostGate| {
        let _ = g.entered.send(());
        let _ = g.go.recv();
    };
    let (before, after) = match gate {
        Some(g) if g.after => (None, Some(g)),
        g => (g, None),
    };
    if let Some(g) = before {
        wait(g);
    }
    // SAFETY: as the caller's.
    let rc = unsafe { post_send_now(inner, qp, qp_num, wr, bad_wr) };
    if let Some(g) = after {
        wait(g);
    }
    rc
}

/// [`mock_post_send`] past its gate.
///
/// # Safety
/// As `mock_post_send`'s.
unsafe fn post_send_now(
    inner: &MockInner,
    qp: *mut ibv_qp,
    qp_num: u32,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    inner
        .state
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .post_calls += 1;
    let dead = with_qp(qp, |q, _| q.destroyed).unwrap_or(false);
    if dead {
        // SAFETY: a mock QP points to its mock context.
        inner_of(unsafe { (*qp).context })
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .posts_after_destroy += 1;
        return libc::EINVAL;
    }
    with_qp(qp, |q, log| {
        let refuse = q.refuse_next.take();
        let mut cur = wr;
        let mut position = 0;
        // SAFETY: the caller passes a valid list.
        while let Some(w) = unsafe { cur.as_ref() } {
            if let Some((_, e)) = refuse.filter(|(at, _)| *at == position) {
                // SAFETY: bad_wr is writable.
                unsafe { *bad_wr = cur };
                return e;
            }
            position += 1;
            if q.sq.len() >= q.depth as usize {
                // SAFETY: bad_wr is writable.
                unsafe { *bad_wr = cur };
                return libc::ENOMEM;
            }
            // SAFETY: a request of the caller's valid list.
            let sges = unsafe { sge_list(w.sg_list, w.num_sge) };
            // SAFETY: plain-data union fields.
            let (remote_addr, rkey, imm_data) = unsafe {
                (
                    w.wr.rdma.remote_addr,
                    w.wr.rdma.rkey,
                    w.__bindgen_anon_1.imm_data,
                )
            };
            let posted = PostedWr {
                qp_num,
                wr_id: w.wr_id,
                opcode: w.opcode,
                send_flags: w.send_flags,
                sges,
                remote_addr,
                rkey,
                imm_data,
            };
            log.push(posted.clone());
            q.sq.push_back(posted);
            cur = w.next;
        }
        0
    })
    .unwrap_or(libc::EINVAL)
}

unsafe extern "C" fn mock_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    with_qp(qp, |q, _| {
        let mut cur = wr;
        // SAFETY: the caller's valid list.
        while let Some(w) = unsafe { cur.as_ref() } {
            if q.rq.len() >= q.rq_depth as usize {
                if !bad_wr.is_null() {
                    // SAFETY: writable by the caller's contract.
                    unsafe { *bad_wr = cur };
                }
                return libc::ENOMEM;
            }
            // SAFETY: a request of the caller's valid list.
            let sges = unsafe { sge_list(w.sg_list, w.num_sge) };
            q.rq.push_back((w.wr_id, sges));
            cur = w.next;
        }
        0
    })
    .unwrap_or(libc::EINVAL)
}

/// A copy of the `n` SGEs at `list`.
///
/// # Safety
/// `list` holds `n` readable SGEs (or `n` is 0, or `list` null).
unsafe fn sge_list(list: *const ibv_sge, n: c_int) -> Vec<ibv_sge> {
    let n = usize::try_from(n).unwrap_or(0);
    if n == 0 || list.is_null() {
        return Vec::new();
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(list, n) }.to_vec()
}

/// Copies the bytes of `from` (a gather list) into `to` (a scatter list), which holds
/// them; this process's memory on both sides.
///
/// # Safety
/// Both lists must be live memory of this process.
unsafe fn scatter(from: &[ibv_sge], to: &[ibv_sge]) {
    let mut to = to.iter().map(|s| (s.addr as *mut u8, s.length as usize));
    let mut cur = to.next();
    let mut at = 0usize;
    for s in from {
        let mut src = s.addr as *const u8;
        let mut left = s.length as usize;
        while left > 0 {
            let Some((dst, len)) = cur else {
                return;
            };
            let take = left.min(len - at);
            // SAFETY: guaranteed by the caller; within both SGEs.
            unsafe {
                std::ptr::copy(src, dst.add(at), take);
                src = src.add(take);
            }
            left -= take;
            at += take;
            if at == len {
                cur = to.next();
                at = 0;
            }
        }
    }
}

/// Waits until no extended poll of `cq` is in progress, and begins one if `begin`.
fn enter_cq(cq: *mut ibv_cq, begin: bool) {
    // SAFETY: a mock CQ points to its mock context.
    let inner = inner_of(unsafe { (*cq).context });
    let mut session = inner.session.lock().unwrap_or_else(|e| e.into_inner());
    let mut told = false;
    while *session == Some(cq as usize) {
        if !told {
            told = true;
            if let Some(tx) = &*inner.poll_waits.lock().unwrap_or_else(|e| e.into_inner()) {
                let _ = tx.send(());
            }
        }
        session = inner
            .session_ended
            .wait(session)
            .unwrap_or_else(|e| e.into_inner());
    }
    if begin {
        *session = Some(cq as usize);
    }
}

/// Ends the extended poll of `cq` in progress.
fn leave_cq(cq: *mut ibv_cq) {
    // SAFETY: a mock CQ points to its mock context.
    let inner = inner_of(unsafe { (*cq).context });
    let mut session = inner.session.lock().unwrap_or_else(|e| e.into_inner());
    if *session == Some(cq as usize) {
        *session = None;
        inner.session_ended.notify_all();
    }
}

unsafe extern "C" fn mock_poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: a mock CQ points to its mock context.
    let inner = inner_of(unsafe { (*cq).context });
    let gate = {
        let mut gate = inner.poll_gate.lock().unwrap_or_else(|e| e.into_inner());
        match gate.take() {
            Some(held) if held.cq == cq as usize => Some(held),
            other => {
                *gate = other;
                None
            }
        }
    };
    if let Some(held) = gate {
        let _ = held.entered.send(());
        let _ = held.go.recv();
    }
    enter_cq(cq, false);
    with_cq(cq, |c| {
        let mut got = 0;
        while got < n {
            let Some(e) = c.entries.pop_front() else {
                break;
            };
            // SAFETY: wc has room for n entries.
            unsafe { *wc.add(usize::try_from(got).unwrap_or(0)) = e };
            got += 1;
        }
        got
    })
    .unwrap_or(-libc::EINVAL)
}

unsafe extern "C" fn mock_req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: a mock CQ points to its mock context.
    let inner = inner_of(unsafe { (*cq).context });
    let mut state = inner.state.lock().unwrap_or_else(|e| e.into_inner());
    state.notify_calls += 1;
    state.arms.push((cq as usize, solicited_only));
    0
}

unsafe extern "C" fn mock_create_qp_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    // SAFETY: the caller passes a valid attribute block.
    let a = unsafe { &mut *attr };
    create_qp(
        ctx,
        a.send_cq,
        a.recv_cq,
        a.qp_type,
        a.sq_sig_all != 0,
        &mut a.cap,
    )
    .cast()
}

unsafe extern "C" fn mock_create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    // SAFETY: the caller passes a valid attribute block.
    let a = unsafe { &*attr };
    let refuse = inner_of(ctx)
        .state
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .refuse_qp_num;
    if refuse && a.wc_flags & u64::from(IBV_WC_EX_WITH_QP_NUM) != 0 {
        justitia_verbs::ops::set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    let cqx = create_cq(ctx, a.wc_flags);
    // SAFETY: just created.
    unsafe { (*cqx).channel = a.channel };
    cqx
}

fn present(cqx: *mut ibv_cq_ex, c: &mut MockCq) -> c_int {
    c.current = c.entries.pop_front();
    match c.current {
        Some(e) => {
            // SAFETY: the live mock CQ.
            unsafe {
                (*cqx).wr_id = e.wr_id;
                (*cqx).status = e.status;
            }
            0
        }
        None => libc::ENOENT,
    }
}

unsafe extern "C" fn mock_start_poll(cqx: *mut ibv_cq_ex, _attr: *mut ibv_poll_cq_attr) -> c_int {
    enter_cq(cqx.cast(), true);
    let rc = with_cq(cqx.cast(), |c| present(cqx, c)).unwrap_or(libc::EINVAL);
    // A poll that found nothing is over (the application does not end it).
    if rc != 0 {
        leave_cq(cqx.cast());
    }
    rc
}

unsafe extern "C" fn mock_next_poll(cqx: *mut ibv_cq_ex) -> c_int {
    with_cq(cqx.cast(), |c| present(cqx, c)).unwrap_or(libc::EINVAL)
}

unsafe extern "C" fn mock_end_poll(cqx: *mut ibv_cq_ex) {
    with_cq(cqx.cast(), |c| c.current = None);
    leave_cq(cqx.cast());
    // SAFETY: a mock CQ points to its mock context.
    inner_of(unsafe { (*cqx).context })
        .state
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .end_polls += 1;
}

unsafe extern "C" fn mock_read_opcode(cqx: *mut ibv_cq_ex) -> ibv_wc_opcode {
    with_cq(cqx.cast(), |c| c.current.map_or(0, |e| e.opcode)).unwrap_or(0)
}

unsafe extern "C" fn mock_read_byte_len(cqx: *mut ibv_cq_ex) -> u32 {
    with_cq(cqx.cast(), |c| c.current.map_or(0, |e| e.byte_len)).unwrap_or(0)
}

unsafe extern "C" fn mock_read_qp_num(cqx: *mut ibv_cq_ex) -> u32 {
    with_cq(cqx.cast(), |c| c.current.map_or(0, |e| e.qp_num)).unwrap_or(0)
}

unsafe extern "C" fn mock_wr_start(qpx: *mut ibv_qp_ex) {
    with_qp(qpx.cast(), |q, _| q.batch.clear());
}

unsafe extern "C" fn mock_wr_abort(qpx: *mut ibv_qp_ex) {
    with_qp(qpx.cast(), |q, _| q.batch.clear());
}

fn mock_wr_begin(qpx: *mut ibv_qp_ex, opcode: ibv_wr_opcode, rkey: u32, remote_addr: u64) {
    // SAFETY: the live mock QP.
    let (wr_id, flags, qp_num) = unsafe { ((*qpx).wr_id, (*qpx).wr_flags, (*qpx).qp_base.qp_num) };
    with_qp(qpx.cast(), |q, _| {
        q.batch.push(PostedWr {
            qp_num,
            wr_id,
            opcode,
            send_flags: flags,
            sges: Vec::new(),
            remote_addr,
            rkey,
            imm_data: 0,
        })
    });
}

unsafe extern "C" fn mock_wr_rdma_write(qpx: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    mock_wr_begin(qpx, IBV_WR_RDMA_WRITE, rkey, remote_addr);
}

unsafe extern "C" fn mock_wr_rdma_read(qpx: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    mock_wr_begin(qpx, IBV_WR_RDMA_READ, rkey, remote_addr);
}

unsafe extern "C" fn mock_wr_set_sge(qpx: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    with_qp(qpx.cast(), |q, _| {
        if let Some(w) = q.batch.last_mut() {
            w.sges = vec![ibv_sge { addr, length, lkey }];
        }
    });
}

unsafe extern "C" fn mock_wr_complete(qpx: *mut ibv_qp_ex) -> c_int {
    with_qp(qpx.cast(), |q, log| {
        if q.sq.len() + q.batch.len() > q.depth as usize {
            q.batch.clear();
            return libc::ENOMEM;
        }
        for w in q.batch.drain(..) {
            log.push(w.clone());
            q.sq.push_back(w);
        }
        0
    })
    .unwrap_or(libc::EINVAL)
}
