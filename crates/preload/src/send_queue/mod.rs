//! The send side of one shaped queue pair.
//!
//! The application's requests are *accepted* into a FIFO; their work queue entries (WQEs:
//! whole requests, chunks, yields) are *posted* to the hardware queue in order as slots and
//! tokens allow, as many as are ready in one provider call (one doorbell); completions are
//! *translated* back into what the application would have seen without the shaper.
//!
//! Queue depth is kept in two currencies. The application may have at most `capacity`
//! requests outstanding (accepted and not yet retired), exactly as its `max_send_wr`
//! promised, and gets `ENOMEM` for the one past that. The hardware queue may hold at most
//! `capacity` WQEs; the rest wait here. A request retires when its last WQE has been
//! completed, as the application learns from a completion of it or of a later request.
//!
//! Which WQE a completion belongs to: every WQE carries a tag the shaper owns (see
//! [`QuickRing`]) as its `wr_id`, and the completion the application sees gets its own
//! `wr_id` back. So an error completion names exactly the WQE that failed even when the
//! application gives many requests one `wr_id`, and a completion that carries no tag is
//! never this send queue's: a receive flush with the same `wr_id` as a send (whose opcode
//! is undefined, as for any error completion) is left alone. Successful
//! completions arrive in posting order (RC), so the unsignaled WQEs before a signaled one
//! completed silently. To keep slots flowing when the application signals rarely, the
//! shaper signals an internal WQE at least every half queue and hides its completion; the
//! completions of one QP waiting in its completion queue never outnumber its WQEs in
//! flight, which never outnumber its `max_send_wr`.
//!
//! Errors: the first error completion marks the QP failed; every request gets exactly one
//! error completion, in order: the first of its WQEs to report one, or a synthesized
//! `IBV_WC_WR_FLUSH_ERR` for a request whose own completion cannot come from the hardware.
//! Only a request's last, signaled WQE is sure to produce a completion once the QP has
//! failed (flushed if not done); its unsignaled chunks may have finished silently before
//! the failure and then produce nothing. So a request is flushed by the shaper as soon as
//! every request before it has had its completion and its own last WQE is not in flight.
//!
//! A single request that nothing holds back is posted straight from the application's
//! request and kept as a two-word record on the [`QuickRing`], whose completion a poll
//! settles without the QP's lock; everything else is the general queue's, under the lock.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use justitia_core::chunk::{Chunk, ChunkPlan, Opcode, Sge, WorkRequest};
use justitia_core::two_sided::Posting;
use justitia_core::yield_plan::{yield_request, YieldPlanner};
use justitia_verbs::sys::*;

use crate::stats::Counters;

mod rate_gate;
mod ring;

pub use rate_gate::RateGate;
pub use ring::{QuickRing, Verdict};
use ring::{QUICK_SIGNALED, QUICK_VISIBLE};

/// How the shaper treats one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Treatment {
    /// Posted whole, unpaced (latency flows, and requests the planner cannot describe).
    Whole,
    /// Posted whole, paced by the rate pacer (throughput flows).
    WholePaced,
    /// Split into chunks of at most `chunk_bytes`, paced if `paced` (bandwidth, `justitia`).
    Split {
        /// Largest chunk.
        chunk_bytes: u32,
        /// Take tokens for every chunk.
        paced: bool,
    },
    /// Split into sub-messages with yields between them, unpaced (bandwidth, `preempt`).
    Preempt(YieldPlanner),
    /// A two-sided request announced to the peer's shaper as message `seq` of the QP
    /// (`justitia_core::two_sided`): held until the peer's credit says how its receives
    /// are posted ([`SendQueue::credit`]), then posted whole or cut into chunks of
    /// `chunk_bytes`, paced if `paced`. Nothing behind it on the QP goes before it.
    Announced {
        /// Its number among the QP's announced messages.
        seq: u64,
        /// The chunk size it was announced with.
        chunk_bytes: u32,
        /// Take tokens for every WQE.
        paced: bool,
    },
}

/// What the shaper does with a request of a QP whose treatment needs no clock and no
/// history (a fixed class): requests up to `whole_up_to` bytes are posted whole, paced when
/// `paced`. Derived once per QP from the settings and the QP's path MTU, and derived again
/// when the MTU changes, so that a post does not work the treatment out again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastLane {
    /// The largest payload posted whole; a larger request takes the general path (which
    /// may still post it whole: this bound is never larger than the real one).
    pub whole_up_to: u64,
    /// Such a request takes tokens from the rate pacer.
    pub paced: bool,
}

/// A copy of one application send request that outlives the post call.
#[derive(Clone)]
pub struct OwnedWr {
    wr: ibv_send_wr,
    sges: Vec<ibv_sge>,
    /// The payload of an inline request, copied at post time as verbs promises.
    inline: Option<Box<[u8]>>,
}

// SAFETY: the raw pointers inside `wr` are rewritten before every use (see `as_wr`); the
// SGE addresses are the application's registered memory, which the device reads anyway.
unsafe impl Send for OwnedWr {}

impl std::fmt::Debug for OwnedWr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedWr")
            .field("wr_id", &self.wr.wr_id)
            .field("opcode", &self.wr.opcode)
            .field("send_flags", &self.wr.send_flags)
            .field("sges", &self.sges)
            .finish()
    }
}

impl OwnedWr {
    /// Copies `wr` (without its `next` link), its SGE list and, for an inline request,
    /// its payload.
    ///
    /// # Safety
    /// `wr` must be a valid send request whose SGE list (and inline payload) is readable.
    pub unsafe fn copy_from(wr: &ibv_send_wr) -> OwnedWr {
        let n = usize::try_from(wr.num_sge).unwrap_or(0);
        let sges: Vec<ibv_sge> = if n == 0 || wr.sg_list.is_null() {
            Vec::new()
        } else {
            // SAFETY: the caller guarantees num_sge readable entries.
            unsafe { std::slice::from_raw_parts(wr.sg_list, n) }.to_vec()
        };
        let mut owned = OwnedWr {
            wr: *wr,
            sges,
            inline: None,
        };
        owned.wr.next = std::ptr::null_mut();
        if wr.send_flags & IBV_SEND_INLINE != 0 && !owned.sges.is_empty() {
            let mut data = Vec::with_capacity(owned.payload_len() as usize);
            for sge in &owned.sges {
                // SAFETY: inline payloads must be readable at post time; this is that time.
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(sge.addr as *const u8, sge.length as usize)
                });
            }
            let data = data.into_boxed_slice();
            owned.sges = vec![ibv_sge {
                addr: data.as_ptr() as u64,
                length: u32::try_from(data.len()).unwrap_or(u32::MAX),
                lkey: 0,
            }];
            owned.inline = Some(data);
        }
        owned
    }

    /// Builds an owned request from parts (the `ibv_wr_*` interface collects these).
    pub fn from_parts(wr: ibv_send_wr, sges: Vec<ibv_sge>, inline: Option<Box<[u8]>>) -> Self {
        let mut owned = OwnedWr { wr, sges, inline };
        if let Some(data) = &owned.inline {
            owned.sges = vec![ibv_sge {
                addr: data.as_ptr() as u64,
                length: u32::try_from(data.len()).unwrap_or(u32::MAX),
                lkey: 0,
            }];
        }
        owned.wr.next = std::ptr::null_mut();
        owned
    }

    /// The request, pointing at this copy's SGEs, ready to post.
    fn as_wr(&mut self) -> ibv_send_wr {
        let mut wr = self.wr;
        wr.next = std::ptr::null_mut();
        wr.num_sge = c_int::try_from(self.sges.len()).unwrap_or(c_int::MAX);
        wr.sg_list = if self.sges.is_empty() {
            std::ptr::null_mut()
        } else {
            self.sges.as_mut_ptr()
        };
        wr
    }

    /// Sum of the SGE lengths.
    pub fn payload_len(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.length)).sum()
    }

    /// The request's `wr_id`.
    pub fn wr_id(&self) -> u64 {
        self.wr.wr_id
    }

    /// The request's opcode (`IBV_WR_*`).
    pub fn opcode(&self) -> ibv_wr_opcode {
        self.wr.opcode
    }

    /// True when the payload is inline (copied at post time).
    pub fn inline(&self) -> bool {
        self.wr.send_flags & IBV_SEND_INLINE != 0
    }

    /// True when it asked for a completion.
    pub fn signaled(&self) -> bool {
        self.wr.send_flags & IBV_SEND_SIGNALED != 0
    }

    /// The request in the chunk planner's terms, or `None` for what it does not describe
    /// (invalidations, memory-window binds, TSO, driver opcodes, too many SGEs).
    pub(crate) fn to_work_request(&self) -> Option<WorkRequest> {
        let wr = &self.wr;
        // SAFETY: reading plain-data union fields; which one is meaningful depends on the
        // opcode, and only that one is used below.
        let (rdma, atomic, imm) =
            unsafe { (wr.wr.rdma, wr.wr.atomic, wr.__bindgen_anon_1.imm_data) };
        let opcode = match wr.opcode {
            IBV_WR_RDMA_WRITE => Opcode::Write,
            IBV_WR_RDMA_WRITE_WITH_IMM => Opcode::WriteWithImm { imm },
            IBV_WR_RDMA_READ => Opcode::Read,
            IBV_WR_SEND => Opcode::Send,
            IBV_WR_SEND_WITH_IMM => Opcode::SendWithImm { imm },
            IBV_WR_ATOMIC_CMP_AND_SWP => Opcode::AtomicCmpAndSwp {
                compare: atomic.compare_add,
                swap: atomic.swap,
            },
            IBV_WR_ATOMIC_FETCH_AND_ADD => Opcode::AtomicFetchAndAdd {
                add: atomic.compare_add,
            },
            _ => return None,
        };
        let sges: Vec<Sge> = self
            .sges
            .iter()
            .map(|s| Sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            })
            .collect();
        let remote = if opcode.is_atomic() {
            Some(justitia_core::chunk::RemoteAddr {
                addr: atomic.remote_addr,
                rkey: atomic.rkey,
            })
        } else {
            Some(justitia_core::chunk::RemoteAddr {
                addr: rdma.remote_addr,
                rkey: rdma.rkey,
            })
        };
        Some(WorkRequest {
            wr_id: wr.wr_id,
            opcode,
            sges: sges.as_slice().try_into().ok()?,
            remote,
            flags: justitia_core::chunk::SendFlags {
                signaled: wr.send_flags & IBV_SEND_SIGNALED != 0,
                fence: wr.send_flags & IBV_SEND_FENCE != 0,
                solicited: wr.send_flags & IBV_SEND_SOLICITED != 0,
                inline: wr.send_flags & IBV_SEND_INLINE != 0,
            },
        })
    }
}

/// A split request's progress.
#[derive(Clone, Debug)]
struct SplitBody {
    plan: ChunkPlan,
    /// The next chunk to post, taken from the plan ahead of time.
    next: Option<Chunk>,
    /// Yields still to post before `next` (`preempt`).
    yields_due: u32,
    planner: Option<YieldPlanner>,
    /// A split SEND whose receives the peer posts in parts: the number it was announced
    /// with, and how many of its chunks are credited; only those may go (see
    /// [`SendQueue::credit`]). `None`: no such limit.
    credited: Option<(u64, u32)>,
    /// The credit before its last growth: chunks from there to `credited` are the part
    /// the last credit let go.
    credit_from: u32,
}

impl SplitBody {
    /// Whether `chunk` goes marked solicited, so that its receive completion at the peer
    /// raises an event there even when the peer's shaper armed the CQ for solicited
    /// completions only (`CqShared::arm_for_application`): a chunk that consumes a
    /// receive and ends its message, or ends or halves the part of the receives the last
    /// credit let go. The peer's application then wakes once per message and twice per
    /// credited part, in time to post the next part while the sender still has half of
    /// this one to send, rather than once per chunk.
    fn marks_solicited(&self, chunk: &Chunk) -> bool {
        if !matches!(
            chunk.request.opcode,
            Opcode::Send | Opcode::SendWithImm { .. } | Opcode::WriteWithImm { .. }
        ) {
            return false;
        }
        if chunk.is_last {
            return true;
        }
        let Some((_, to)) = self.credited else {
            return false;
        };
        let from = self.credit_from.min(to);
        let done = chunk.index + 1;
        done == to || done == from + (to - from).div_ceil(2)
    }

    /// Whether the next chunk waits for more of the peer's credit.
    fn waits_for_credit(&self) -> bool {
        match (self.credited, &self.next) {
            (Some((_, credited)), Some(chunk)) => self.yields_due == 0 && chunk.index >= credited,
            _ => false,
        }
    }

    /// What the next WQE is (a yield or not), and its payload, without taking it.
    fn peek(&self) -> Option<(bool, u32)> {
        if self.yields_due > 0 {
            return Some((true, 0));
        }
        let chunk = self.next.as_ref()?;
        Some((
            false,
            u32::try_from(chunk.request.sges.total_bytes()).unwrap_or(u32::MAX),
        ))
    }

    /// Takes the next WQE, which [`Self::peek`] said is a yield.
    fn take_yield(&mut self) {
        self.yields_due = self.yields_due.saturating_sub(1);
    }

    /// Takes the next WQE, which [`Self::peek`] said is a chunk.
    fn take_chunk(&mut self) -> Option<Chunk> {
        let chunk = self.next.take()?;
        self.yields_due = self.planner.map_or(0, |p| p.yields_after(&chunk));
        self.next = self.plan.next();
        Some(chunk)
    }
}

/// A two-sided request waiting for the peer's credit.
#[derive(Debug)]
struct Awaiting {
    wr: OwnedWr,
    seq: u64,
    chunk_bytes: u32,
}

#[derive(Debug)]
enum Body {
    /// Boxed, so that a request record stays small: every request, posted at once or
    /// not, is moved into the queue and out of it.
    Whole(Box<OwnedWr>),
    Split(Box<SplitBody>),
    /// Announced to the peer's shaper, waiting for its credit (see
    /// [`Treatment::Announced`]).
    AwaitingCredit(Box<Awaiting>),
    /// Posted straight from the application's request by [`SendQueue::post_now`]: nothing
    /// of it is kept but the bookkeeping of its completion.
    Sent,
}

/// One accepted application request.
#[derive(Debug)]
struct Request {
    wr_id: u64,
    /// The completion opcode the application expects (`IBV_WC_*`).
    wc_opcode: ibv_wc_opcode,
    len: u32,
    split: bool,
    /// The application will see a completion for it (signaled, or the QP signals all).
    visible: bool,
    paced: bool,
    body: Body,
    /// Position in the list of the post call that accepted it, while that call runs.
    call_index: Option<usize>,
    posted_any: bool,
    done_posting: bool,
    /// WQEs posted and not yet known complete.
    inflight: u32,
    /// Its one completion (success or error) has been delivered.
    reported: bool,
    /// When the WQE at the head of this request first found no tokens.
    blocked_since: Option<Duration>,
    /// A request that consumes a receive at the peer, going whole and unannounced:
    /// counted in [`SendQueue::whole_two_sided`].
    whole_two_sided: bool,
    /// The status its completion gets when the queue fails before it is posted, instead
    /// of a flush ([`SendQueue::give_up_waiting`]).
    fail_status: Option<ibv_wc_status>,
}

/// A WQE on the hardware queue.
#[derive(Clone, Copy, Debug)]
struct Posted {
    /// The request it belongs to.
    seq: u64,
    /// The `wr_id` it carries: the application's for a visible WQE, else a tag.
    wr_id: u64,
    signaled: bool,
    /// Its completion is the application's (the last WQE of a visible request).
    visible: bool,
}

/// What kind of WQE a built entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WqeKind {
    Whole,
    Chunk,
    Yield,
}

/// A WQE built for the next post call, with what committing it changes.
#[derive(Clone, Copy, Debug)]
struct Built {
    /// Index of its request in the queue.
    request: usize,
    kind: WqeKind,
    /// Where its SGEs are in the batch's SGE buffer (chunks only).
    sges: (usize, usize),
    is_last: bool,
    posted: Posted,
}

/// Why posting stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocked {
    /// Nothing is waiting.
    Idle,
    /// The hardware queue is full; completions will free slots.
    Slots,
    /// The rate pacer holds the next WQE for this long.
    Tokens(Duration),
    /// The next request waits for the peer's credit; its arrival drains the queue.
    Credit,
    /// The QP has failed; nothing more is posted.
    Failed,
}

/// Posts a list of WQEs (linked through `next`, first to last) to the hardware queue.
/// On failure it reports the index of the first WQE not posted, and the error.
pub type PostList<'a> = dyn FnMut(&mut [ibv_send_wr]) -> Result<(), (usize, c_int)> + 'a;

/// What a drain needs from outside: the real post verb, the rate pacer, the counters, and a
/// place for synthesized completions.
pub struct DrainEnv<'a> {
    /// Posts a list of WQEs.
    pub post: &'a mut PostList<'a>,
    /// The process's rate pacer, when pacing is configured.
    pub pacer: Option<&'a RateGate>,
    /// The process's counters.
    pub counters: &'a Counters,
    /// Completions to deliver that the hardware will not produce.
    pub synthesized: &'a mut Vec<ibv_wc>,
}

/// The result of draining.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainOutcome {
    /// Why posting stopped.
    pub blocked: Blocked,
    /// A request of the running post call whose first WQE the provider refused: its
    /// position in the call's list and the error. It and every later request of the call
    /// were taken back, as the provider would have done.
    pub refused: Option<(usize, c_int)>,
    /// The drain stopped after settling a request the provider refused part of: the error
    /// completion it synthesized must be queued for the application before anything
    /// later of the queue is posted (a later request's completion must not overtake it);
    /// then drain again.
    pub more: bool,
}

/// Most WQEs handed to the provider in one call: enough that a split request's chunks and
/// yields go with one doorbell, few enough that the list stays in cache.
pub const MAX_WQES_PER_POST: usize = 256;

/// The send side of one shaped QP.
pub struct SendQueue {
    qp_num: u32,
    capacity: u32,
    max_sge: usize,
    sig_all: bool,
    /// `IBV_SEND_SIGNALED` when `sig_all`, else 0: or-ed into a request's flags.
    sig_flag: u32,
    signal_every: u32,
    unsignaled_run: u32,
    requests: VecDeque<Request>,
    first_seq: u64,
    /// The first request with WQEs not yet posted.
    cursor: usize,
    posted: VecDeque<Posted>,
    /// The WQEs' tags and sequence numbers, and the records of the requests posted by
    /// [`Self::post_now`] (quick requests), shared with the polls of the QP's send CQ. Quick
    /// requests come after every request of `requests`, all of which are then fully posted:
    /// `post_now` adds one only when nothing waits, and every other change of the queue
    /// first moves them into `requests` and `posted` ([`Self::materialize`]).
    ring: Arc<QuickRing>,
    failed: bool,
    /// The QP is being destroyed: nothing more reaches the provider.
    destroyed: bool,
    /// The failure came as an error completion: every WQE after it reports (flushed).
    hardware_flushes: bool,
    /// The list being built for one post call, and its SGEs (kept to reuse the memory).
    batch: Vec<Built>,
    batch_wrs: Vec<ibv_send_wr>,
    batch_sges: Vec<ibv_sge>,
    /// Payload bytes of the WQEs posted so far (what a QP spends of its turn).
    posted_bytes: u64,
    /// Requests consuming a receive at the peer (SEND, SEND with immediate, WRITE with
    /// immediate) accepted to go whole and unannounced, and not taken back: what the
    /// peer's receive queue has consumed or will, before the first announced message.
    whole_two_sided: u64,
    /// Announced messages taken back with the running call's tail, newest first, for the
    /// caller to withdraw ([`SendQueue::take_withdrawn`]).
    withdrawn: Vec<u64>,
}

impl std::fmt::Debug for SendQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendQueue")
            .field("qp_num", &self.qp_num)
            .field("capacity", &self.capacity)
            .field("requests", &self.requests.len())
            .field("cursor", &self.cursor)
            .field("posted", &self.posted.len())
            .field("ring", &self.ring)
            .field("failed", &self.failed)
            .finish()
    }
}

// SAFETY: the raw pointers in the batch buffers are only meaningful during a drain, which
// holds the queue exclusively; between drains they are stale and never followed.
unsafe impl Send for SendQueue {}

fn add(counter: &AtomicU64, n: u64) {
    Counters::add(counter, n);
}

impl SendQueue {
    /// The send side of a QP with `capacity` send slots (its `max_send_wr`), `max_sge`
    /// SGEs per request, and `sig_all` when every request is signaled.
    pub fn new(qp_num: u32, capacity: u32, max_sge: u32, sig_all: bool) -> Self {
        let capacity = capacity.max(1);
        SendQueue {
            qp_num,
            capacity,
            max_sge: usize::try_from(max_sge.max(1)).unwrap_or(1),
            sig_all,
            sig_flag: if sig_all { IBV_SEND_SIGNALED } else { 0 },
            signal_every: (capacity / 2).max(1),
            unsignaled_run: 0,
            requests: VecDeque::new(),
            first_seq: 0,
            cursor: 0,
            posted: VecDeque::new(),
            ring: Arc::new(QuickRing::new(capacity, qp_num)),
            failed: false,
            destroyed: false,
            hardware_flushes: false,
            batch: Vec::new(),
            batch_wrs: Vec::new(),
            batch_sges: Vec::new(),
            posted_bytes: 0,
            whole_two_sided: 0,
            withdrawn: Vec::new(),
        }
    }

    /// Payload bytes of the WQEs posted from the queue so far (quick requests not
    /// included: a QP with turns has none).
    pub fn posted_bytes(&self) -> u64 {
        self.posted_bytes
    }

    /// Application requests outstanding (accepted, not retired).
    pub fn outstanding(&self) -> usize {
        self.requests.len() + self.ring.quick_len()
    }

    /// True when requests wait in software and the hardware queue is full: only polled
    /// completions will let them go. Never for a destroyed QP: nothing of it may reach the
    /// provider, its send CQ's poll included (the application may have destroyed that CQ
    /// too).
    pub fn blocked_on_slots(&self) -> bool {
        !self.destroyed && self.queued() > 0 && self.in_flight() >= self.capacity as usize
    }

    /// True when a drain may post or settle something: requests wait in software.
    /// (A completion settles a failed queue itself, see [`Self::complete`].)
    pub fn needs_drain(&self) -> bool {
        self.queued() > 0
    }

    /// Requests waiting in software (not fully posted).
    pub fn queued(&self) -> usize {
        self.requests.len() - self.cursor
    }

    /// WQEs on the hardware queue.
    fn in_flight(&self) -> usize {
        self.posted.len() + self.ring.quick_len()
    }

    /// The ring of tags and quick requests, for the polls of the QP's send CQ.
    pub fn ring(&self) -> &Arc<QuickRing> {
        &self.ring
    }

    /// Whether a poll may settle quick requests without the QP's lock: nothing else is in
    /// the queue, it has not failed, and the QP is not being destroyed.
    fn may_open(&self) -> bool {
        self.requests.is_empty() && self.posted.is_empty() && !self.failed && !self.destroyed
    }

    /// Marks the QP destroyed (nothing more is posted; the ring closes) or, when the
    /// provider refused the destroy, live again.
    pub fn set_destroyed(&mut self, destroyed: bool) {
        self.destroyed = destroyed;
        if destroyed {
            self.ring.close();
        }
    }

    /// True once the QP is being destroyed.
    pub fn destroyed(&self) -> bool {
        self.destroyed
    }

    /// Closes the ring and moves the quick requests into `requests` and `posted`, as the
    /// general path records a request posted whole, so that it sees the whole queue.
    fn materialize(&mut self) {
        let from = self.ring.close();
        let head = self.ring.head();
        if from == head {
            return;
        }
        for wqe in from..head {
            let (wr_id, meta) = self.ring.read_record(wqe);
            let visible = meta & QUICK_VISIBLE != 0;
            let seq = self.first_seq + self.requests.len() as u64;
            self.posted.push_back(Posted {
                seq,
                wr_id: self.ring.tag(wqe),
                signaled: meta & QUICK_SIGNALED != 0,
                visible,
            });
            self.requests.push_back(Request {
                wr_id,
                wc_opcode: wc_opcode_for((meta >> 32) as u32),
                // Read only for the pacer and split requests, neither of which this is.
                len: 0,
                split: false,
                visible,
                paced: false,
                body: Body::Sent,
                call_index: None,
                posted_any: true,
                done_posting: true,
                inflight: 1,
                reported: false,
                blocked_since: None,
                whole_two_sided: false,
                fail_status: None,
            });
        }
        self.ring.set_tail(head, true);
        self.cursor = self.requests.len();
    }

    /// The most SGEs one of its WQEs carries (the QP's `max_send_sge`).
    pub fn max_sge(&self) -> usize {
        self.max_sge
    }

    /// The application's send capacity.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Accepts one request, or refuses it with `ENOMEM` when the application already has
    /// `capacity` requests outstanding. `call_index` is its position in the running post
    /// call's list.
    pub fn accept(
        &mut self,
        wr: OwnedWr,
        treatment: Treatment,
        call_index: usize,
    ) -> Result<(), c_int> {
        self.materialize();
        if self.requests.len() >= self.capacity as usize {
            return Err(libc::ENOMEM);
        }
        let len = u32::try_from(wr.payload_len()).unwrap_or(u32::MAX);
        let wr_id = wr.wr_id();
        let visible = self.sig_all || wr.signaled();
        let wc_opcode = wc_opcode_for(wr.opcode());
        let whole_two_sided =
            consumes_receive(wr.opcode()) && !matches!(treatment, Treatment::Announced { .. });
        let (body, split, paced) = match treatment {
            Treatment::Announced {
                seq,
                chunk_bytes,
                paced,
            } => (
                Body::AwaitingCredit(Box::new(Awaiting {
                    wr,
                    seq,
                    chunk_bytes,
                })),
                false,
                paced,
            ),
            Treatment::Whole => (Body::Whole(Box::new(wr)), false, false),
            Treatment::WholePaced => (Body::Whole(Box::new(wr)), false, true),
            Treatment::Split { chunk_bytes, paced } => {
                self.plan_body(wr, chunk_bytes, None, paced, false)
            }
            Treatment::Preempt(planner) => {
                let bytes = planner.sub_message_bytes();
                self.plan_body(wr, bytes, Some(planner), false, false)
            }
        };
        self.requests.push_back(Request {
            wr_id,
            wc_opcode,
            len,
            split,
            visible,
            paced,
            body,
            call_index: Some(call_index),
            posted_any: false,
            done_posting: false,
            inflight: 0,
            reported: false,
            blocked_since: None,
            whole_two_sided,
            fail_status: None,
        });
        self.whole_two_sided += u64::from(whole_two_sided);
        Ok(())
    }

    /// Whether [`Self::accept`] would refuse the next request with `ENOMEM`: the
    /// application has `capacity` requests outstanding. Asked before a request is
    /// announced to the peer, which must never hear of one that is then refused.
    pub fn is_full(&mut self) -> bool {
        self.materialize();
        self.requests.len() >= self.capacity as usize
    }

    /// Whether the next request to post waits for the peer's credit: an announced message
    /// not credited yet, or a split SEND whose credited chunks have all gone.
    pub fn waits_for_credit(&self) -> bool {
        match self.requests.get(self.cursor).map(|r| &r.body) {
            Some(Body::AwaitingCredit(_)) => true,
            Some(Body::Split(s)) => s.waits_for_credit(),
            _ => false,
        }
    }

    /// Requests consuming a receive at the peer accepted to go whole and unannounced,
    /// and not taken back: every one has gone or will go to the NIC, where it consumes
    /// one of the receives the peer posted whole. What the sending shaper tells the
    /// core's agreement before it answers the peer's offer.
    pub fn whole_two_sided(&self) -> u64 {
        self.whole_two_sided
    }

    /// The peer's credit for the announced message `seq` came or grew
    /// ([`Treatment::Announced`]): it goes whole ([`Posting::Whole`]) or in chunks of the
    /// size it was announced with, cut as the peer cut its receives
    /// (`justitia_core::two_sided`'s invariant: chunk `i` is the bytes
    /// `[i * chunk, (i + 1) * chunk)`). A split SEND goes no further than the receives
    /// credited: the peer posts those of a message longer than its queue in parts, and
    /// each later credit lets more chunks go. Returns false when no request waits for
    /// that credit (it was flushed or taken back).
    pub fn credit(&mut self, seq: u64, posting: Posting) -> bool {
        let Some(at) = self.requests.iter().position(|r| match &r.body {
            Body::AwaitingCredit(a) => a.seq == seq,
            Body::Split(s) => s.credited.is_some_and(|(announced, _)| announced == seq),
            _ => false,
        }) else {
            return false;
        };
        let req = &mut self.requests[at];
        let limit = match posting {
            Posting::Split { posted } if req.wc_opcode == IBV_WC_SEND => Some((seq, posted)),
            _ => None,
        };
        if let Body::Split(s) = &mut req.body {
            // A later part of the credit: more chunks may go.
            s.credited = match (s.credited, limit) {
                (Some((_, old)), Some((_, new))) => {
                    if new > old {
                        s.credit_from = old;
                    }
                    Some((seq, old.max(new)))
                }
                _ => None,
            };
            return true;
        }
        let body = std::mem::replace(&mut req.body, Body::Sent);
        let Body::AwaitingCredit(a) = body else {
            return false;
        };
        let Awaiting {
            mut wr,
            chunk_bytes,
            ..
        } = *a;
        // Announced, so the peer's shaper owns the receive it lands in: marked as its
        // split chunks' last is (see `SplitBody::marks_solicited`).
        wr.wr.send_flags |= IBV_SEND_SOLICITED;
        // Cut as the peer cut its receives, when it posted them split (a WRITE with
        // immediate included: its chunks are WRITEs, the last with the immediate).
        let (mut body, is_split, _) = match posting {
            Posting::Split { .. } => self.plan_body(wr, chunk_bytes, None, false, true),
            Posting::Whole => (Body::Whole(Box::new(wr)), false, false),
        };
        if let Body::Split(s) = &mut body {
            s.credited = limit;
        }
        let req = &mut self.requests[at];
        req.body = body;
        req.split = is_split;
        true
    }

    /// The announced messages among the requests from position `from` on, newest first:
    /// taken back with them, their announcements must be withdrawn too.
    fn announced_from(&self, from: usize) -> Vec<u64> {
        self.requests
            .range(from.min(self.requests.len())..)
            .rev()
            .filter_map(|r| match &r.body {
                Body::AwaitingCredit(a) => Some(a.seq),
                _ => None,
            })
            .collect()
    }

    /// Drops the requests from position `from` on (taken back), uncounting those that
    /// were to go whole and unannounced.
    fn truncate_requests(&mut self, from: usize) {
        let gone = self
            .requests
            .range(from.min(self.requests.len())..)
            .filter(|r| r.whole_two_sided)
            .count();
        self.whole_two_sided -= gone as u64;
        self.requests.truncate(from);
    }

    /// Posts one application request straight to the provider when nothing would hold it
    /// back, without copying it: the queue holds no request waiting, the QP has not failed,
    /// the hardware queue has a slot, the request is no larger than what `lane` posts whole
    /// (a split or preempt treatment of a request no larger than one chunk or sub-message
    /// posts it whole), and `gate` (the rate pacer's verdict, asked last and only for a
    /// paced lane, which reads the time with `now` only when its allowance is short) lets
    /// it go. The WQE carries a tag like every other, and the request is
    /// recorded fully posted: the provider's verdict (`post`, handed the one WQE) is final,
    /// so the call has nothing left to take back.
    ///
    /// Returns `None` when the request must take the general path ([`Self::accept`] and
    /// [`Self::drain`]), which then decides exactly as it would have; else the provider's
    /// verdict: `Err(rc)` when it refused the request, which is then not accepted (as a
    /// refusal of the first WQE of a request of the running call is handled there).
    ///
    /// # Safety
    /// `wr` must be a valid send request whose SGE list (and inline payload) is readable.
    #[inline(always)]
    pub unsafe fn post_now(
        &mut self,
        wr: &ibv_send_wr,
        lane: FastLane,
        gate: &RateGate,
        now: impl FnOnce() -> Duration,
        post: impl FnOnce(&mut ibv_send_wr) -> c_int,
        counters: &Counters,
    ) -> Option<Result<(), c_int>> {
        let ring = &*self.ring;
        let head = ring.head();
        let tail = ring.tail_word();
        // Open and with a free slot, in one test: a closed ring's tail carries CLOSED, which
        // makes the difference wrap past any capacity.
        if head.wrapping_sub(tail) >= u64::from(self.capacity) && !self.quick_room_closed(head) {
            return None;
        }
        // SAFETY: guaranteed by the caller.
        let len = unsafe { payload_of(wr) };
        if len > lane.whole_up_to || (lane.paced && !gate.take(len, now)) {
            return None;
        }
        // IBV_SEND_SIGNALED or 0: the application sees its completion, the WQE is signaled
        // (it is, or the queue needs a signal to recycle its slots).
        let visible = (wr.send_flags | self.sig_flag) & IBV_SEND_SIGNALED;
        let run = self.unsignaled_run;
        let signal = if run + 1 >= self.signal_every {
            IBV_SEND_SIGNALED
        } else {
            visible
        };
        // The record of this WQE, at its tag: no WQE in flight has it (they never
        // outnumber the slots), and no poll reads it before `head` is published past it.
        let tag = ring.write_record(
            head,
            wr.wr_id,
            u64::from(wr.opcode) << 32 | u64::from(visible) << 8 | u64::from(signal),
        );
        let mut wqe = *wr;
        wqe.wr_id = tag;
        wqe.send_flags = (wr.send_flags & !IBV_SEND_SIGNALED) | signal;
        // Counted before the provider's call, and taken back if it refuses the request, so
        // that the call keeps fewer values alive across it.
        self.unsignaled_run = if signal != 0 { 0 } else { run + 1 };
        add(&counters.requests, 1);
        add(&counters.bytes, len);
        let rc = post(&mut wqe);
        if rc != 0 {
            self.unsignaled_run = run;
            counters.requests.fetch_sub(1, Ordering::Relaxed);
            counters.bytes.fetch_sub(len, Ordering::Relaxed);
            return Some(Err(rc));
        }
        self.ring.publish_head(head + 1);
        Some(Ok(()))
    }

    /// Whether [`Self::post_now`] may add a quick request to a ring that is closed, or open
    /// and full (`head` its next sequence number): reopens the ring if the queue is empty
    /// again; else there must be nothing waiting, no failure, and a free slot both in the
    /// application's queue and on the hardware's. Out of line: only a queue that has had
    /// split, held or failed requests gets here.
    #[inline(never)]
    fn quick_room_closed(&self, head: u64) -> bool {
        let (tail, closed) = self.ring.tail();
        if !closed {
            return false;
        }
        let room = |used: usize| used + ((head - tail) as usize) < self.capacity as usize;
        if self.may_open() {
            if !room(0) {
                return false;
            }
            self.ring.set_tail(tail, false);
            return true;
        }
        !self.failed
            && !self.destroyed
            && self.cursor == self.requests.len()
            && room(self.requests.len().max(self.posted.len()))
    }

    /// The body for a request to split: the chunk plan when the planner splits it, else
    /// the request whole. Returns the body, whether it is split, and whether it is paced.
    ///
    /// Requests that consume a receive at the peer are split only when the peer's shaper
    /// agreed and posted its receives for the chunks (`two_sided`). Without that, an RDMA
    /// WRITE with immediate stays whole too: the peer's completion reports the length of
    /// the message that carried the immediate, so a split would show the peer the last
    /// chunk's length instead of the request's.
    fn plan_body(
        &self,
        wr: OwnedWr,
        chunk_bytes: u32,
        planner: Option<YieldPlanner>,
        paced: bool,
        two_sided: bool,
    ) -> (Body, bool, bool) {
        let limits = justitia_core::chunk::ChunkLimits {
            chunk_bytes,
            max_sge: self.max_sge,
            split_two_sided: two_sided,
        };
        let plan = Some(&wr)
            .filter(|w| w.payload_len() > u64::from(chunk_bytes))
            .filter(|w| two_sided || w.opcode() != IBV_WR_RDMA_WRITE_WITH_IMM)
            .and_then(OwnedWr::to_work_request)
            .and_then(|req| ChunkPlan::new(req, limits).ok())
            .filter(ChunkPlan::is_split);
        match plan {
            Some(mut plan) => {
                let next = plan.next();
                let body = SplitBody {
                    plan,
                    next,
                    yields_due: 0,
                    planner,
                    credited: None,
                    credit_from: 0,
                };
                (Body::Split(Box::new(body)), true, paced)
            }
            None => (Body::Whole(Box::new(wr)), false, paced),
        }
    }

    /// The announced messages the last post call took back (newest first), which were
    /// never sent: the caller withdraws their announcements.
    pub fn take_withdrawn(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.withdrawn)
    }

    /// Ends the running post call: its requests can no longer be taken back.
    pub fn end_call(&mut self) {
        // Requests of a running call are never quick ones (accepting one moves those into
        // the queue), so the quick ones have ended theirs.
        for r in self.requests.iter_mut().rev() {
            if r.call_index.take().is_none() {
                break;
            }
        }
    }

    /// Ends a post call that was cut short (the shaper panicked inside it): its requests
    /// with nothing posted are taken back, as a provider refusing them would have; the
    /// ones with WQEs on the hardware queue stay. Returns how many of the call's list
    /// stay: the call's requests are the last ones of the queue, in list order, and WQEs
    /// are posted in order, so the ones that stay are the first of the list.
    pub fn take_back_call(&mut self) -> usize {
        self.materialize();
        let start = self
            .requests
            .iter()
            .position(|r| r.call_index.is_some())
            .unwrap_or(self.requests.len());
        let kept = self
            .requests
            .range(start..)
            .take_while(|r| r.posted_any)
            .count();
        self.withdrawn = self.announced_from(start + kept);
        self.truncate_requests(start + kept);
        self.cursor = self.cursor.min(self.requests.len());
        self.end_call();
        kept
    }

    /// Posts what slots and tokens allow, in order, as few provider calls as possible.
    pub fn drain(&mut self, now: Duration, env: &mut DrainEnv<'_>) -> DrainOutcome {
        let mut outcome = DrainOutcome {
            blocked: Blocked::Idle,
            refused: None,
            more: false,
        };
        self.materialize();
        loop {
            if self.failed {
                self.flush_settled(env.counters, env.synthesized);
                outcome.blocked = Blocked::Failed;
                return outcome;
            }
            let mut snapshots = Vec::new();
            let (stop, waiting) = self.build(now, env.pacer, &mut snapshots);
            // The request that found no tokens starts waiting now (after the WQEs built
            // before it are committed, which must not count its wait).
            let mark_waiting = |q: &mut SendQueue| {
                if let Some(req) = waiting.and_then(|i| q.requests.get_mut(i)) {
                    req.blocked_since.get_or_insert(now);
                }
            };
            if self.batch.is_empty() {
                mark_waiting(self);
                outcome.blocked = stop;
                return outcome;
            }
            match self.post_batch(env) {
                Ok(()) => {
                    let built = std::mem::take(&mut self.batch);
                    for b in &built {
                        self.commit(b, now, env.counters);
                    }
                    self.batch = built;
                    self.batch.clear();
                    mark_waiting(self);
                    if stop != Blocked::Idle {
                        outcome.blocked = stop;
                        return outcome;
                    }
                }
                Err((index, rc)) => {
                    let synthesized = env.synthesized.len();
                    if let Some(refused) = self.refused_at(index, rc, now, env, snapshots) {
                        outcome.refused = Some(refused);
                        return outcome;
                    }
                    if env.synthesized.len() > synthesized {
                        outcome.more = true;
                        return outcome;
                    }
                }
            }
        }
    }

    /// Builds the next list of WQEs into the batch, in order, taking tokens for paced
    /// ones (each what the gate charges it); returns why it stopped, and the request that
    /// found no tokens if that was why.
    /// Split requests it takes WQEs from are saved in `snapshots` first, so a list the
    /// provider refuses in part can be rolled back.
    fn build(
        &mut self,
        now: Duration,
        pacer: Option<&RateGate>,
        snapshots: &mut Vec<(usize, Box<SplitBody>)>,
    ) -> (Blocked, Option<usize>) {
        self.batch.clear();
        self.batch_wrs.clear();
        self.batch_sges.clear();
        let room = (self.capacity as usize).saturating_sub(self.posted.len());
        let limit = room.min(MAX_WQES_PER_POST);
        let mut run = self.unsignaled_run;
        let mut index = self.cursor;
        while let Some(req) = self.requests.get_mut(index) {
            if self.batch.len() >= limit {
                let why = if limit == room {
                    Blocked::Slots
                } else {
                    Blocked::Idle
                };
                return (why, None);
            }
            let (is_yield, payload) = match &req.body {
                // Nothing behind it goes before it.
                Body::AwaitingCredit(_) => return (Blocked::Credit, None),
                Body::Split(s) if s.waits_for_credit() => return (Blocked::Credit, None),
                Body::Whole(_) => (false, req.len),
                Body::Split(s) => match s.peek() {
                    Some(next) => next,
                    None => {
                        // A plan that ran dry early; never expected. Nothing is left to post.
                        req.done_posting = true;
                        if index == self.cursor {
                            self.cursor += 1;
                        }
                        index += 1;
                        continue;
                    }
                },
                // Posted whole already (never behind the cursor's first unposted request).
                Body::Sent => {
                    req.done_posting = true;
                    if index == self.cursor {
                        self.cursor += 1;
                    }
                    index += 1;
                    continue;
                }
            };
            if req.paced && !is_yield {
                if let Some(pacer) = pacer {
                    let cost = pacer.charged(u64::from(payload));
                    let taken = pacer.lock().try_release(now, cost, 1);
                    if let Err(wait) = taken {
                        return (Blocked::Tokens(wait), Some(index));
                    }
                }
            }
            let seq = self.first_seq + index as u64;
            let (kind, sges, is_last, mut wr) = match &mut req.body {
                Body::Whole(w) => (WqeKind::Whole, (0, 0), true, w.as_wr()),
                Body::Sent | Body::AwaitingCredit(_) => {
                    index += 1;
                    continue;
                }
                Body::Split(s) => {
                    if !snapshots.iter().any(|(i, _)| *i == index) {
                        snapshots.push((index, s.clone()));
                    }
                    if is_yield {
                        s.take_yield();
                        (
                            WqeKind::Yield,
                            (0, 0),
                            false,
                            yield_wr_for(s.plan.request()),
                        )
                    } else {
                        let Some(chunk) = s.take_chunk() else {
                            continue;
                        };
                        let start = self.batch_sges.len();
                        self.batch_sges
                            .extend(chunk.request.sges.iter().map(|s| ibv_sge {
                                addr: s.addr,
                                length: s.length,
                                lkey: s.lkey,
                            }));
                        let range = (start, self.batch_sges.len());
                        let mut wr = chunk_to_wr(&chunk);
                        if s.marks_solicited(&chunk) {
                            wr.send_flags |= IBV_SEND_SOLICITED;
                        }
                        (WqeKind::Chunk, range, chunk.is_last, wr)
                    }
                }
            };
            let visible = is_last && req.visible;
            let signaled = self.sig_all || visible || run + 1 >= self.signal_every;
            run = if signaled { 0 } else { run + 1 };
            wr.send_flags = if signaled {
                wr.send_flags | IBV_SEND_SIGNALED
            } else {
                wr.send_flags & !IBV_SEND_SIGNALED
            };
            let wqe = self.ring.head() + self.batch.len() as u64;
            wr.wr_id = self.ring.tag(wqe);
            self.batch_wrs.push(wr);
            self.batch.push(Built {
                request: index,
                kind,
                sges,
                is_last,
                posted: Posted {
                    seq,
                    wr_id: wr.wr_id,
                    signaled,
                    visible,
                },
            });
            if is_last {
                index += 1;
            }
        }
        (Blocked::Idle, None)
    }

    /// Hands the batch to the provider as one list.
    fn post_batch(&mut self, env: &mut DrainEnv<'_>) -> Result<(), (usize, c_int)> {
        let n = self.batch.len();
        self.batch_wrs.truncate(n);
        let sge_base = self.batch_sges.as_mut_ptr();
        let wr_base = self.batch_wrs.as_mut_ptr();
        for (i, b) in self.batch.iter().enumerate() {
            let wr = &mut self.batch_wrs[i];
            if b.kind == WqeKind::Chunk {
                let (start, end) = b.sges;
                // SAFETY: start is within the SGE buffer, which is not resized until the
                // list has been posted.
                wr.sg_list = unsafe { sge_base.add(start) };
                wr.num_sge = c_int::try_from(end - start).unwrap_or(0);
            }
            wr.next = if i + 1 < n {
                // SAFETY: i + 1 < n, within the list.
                unsafe { wr_base.add(i + 1) }
            } else {
                std::ptr::null_mut()
            };
        }
        (env.post)(&mut self.batch_wrs[..n])
    }

    /// Accounts for one WQE the provider accepted.
    fn commit(&mut self, b: &Built, now: Duration, counters: &Counters) {
        // The ring is closed and holds no quick request (a drain materializes first): it
        // stays empty, quick requests being the newest WQEs.
        let head = self.ring.head() + 1;
        self.ring.publish_head(head);
        self.ring.set_tail(head, true);
        self.unsignaled_run = if b.posted.signaled {
            0
        } else {
            self.unsignaled_run + 1
        };
        self.posted.push_back(b.posted);
        let Some(req) = self.requests.get_mut(b.request) else {
            return;
        };
        if let Some(t) = req.blocked_since.take() {
            add(
                &counters.pacing_delay_ns,
                u64::try_from(now.saturating_sub(t).as_nanos()).unwrap_or(u64::MAX),
            );
        }
        if !req.posted_any {
            req.posted_any = true;
            add(&counters.requests, 1);
            add(&counters.bytes, u64::from(req.len));
            if req.split {
                add(&counters.split_requests, 1);
            }
        }
        req.inflight += 1;
        let bytes = match b.kind {
            WqeKind::Whole => u64::from(req.len),
            WqeKind::Chunk => {
                add(&counters.chunks, 1);
                self.batch_sges
                    .get(b.sges.0..b.sges.1)
                    .map_or(0, |s| s.iter().map(|g| u64::from(g.length)).sum())
            }
            WqeKind::Yield => {
                add(&counters.yields, 1);
                0
            }
        };
        self.posted_bytes = self.posted_bytes.saturating_add(bytes);
        if b.is_last {
            req.done_posting = true;
            self.cursor = self.cursor.max(b.request + 1);
        }
    }

    /// The provider took the batch up to `index` and refused the WQE there with `rc`.
    /// Commits what it took. A request of the running post call that had nothing posted
    /// is taken back with the rest of the call (returned, for the caller's `bad_wr`);
    /// any other request gets one error completion and loses its unposted WQEs, and the
    /// requests after it are rolled back to be built again.
    fn refused_at(
        &mut self,
        index: usize,
        rc: c_int,
        now: Duration,
        env: &mut DrainEnv<'_>,
        snapshots: Vec<(usize, Box<SplitBody>)>,
    ) -> Option<(usize, c_int)> {
        let built = std::mem::take(&mut self.batch);
        let index = index.min(built.len().saturating_sub(1));
        for b in &built[..index] {
            self.commit(b, now, env.counters);
        }
        let failed = built[index].request;
        self.batch = built;
        self.batch.clear();
        for (i, body) in snapshots {
            if i > failed {
                if let Some(req) = self.requests.get_mut(i) {
                    req.body = Body::Split(body);
                }
            }
        }
        let req = self.requests.get_mut(failed)?;
        if !req.posted_any {
            if let Some(call_index) = req.call_index {
                self.withdrawn = self.announced_from(failed);
                self.truncate_requests(failed);
                return Some((call_index, rc));
            }
        }
        // Said on stderr by the QP once its lock is released (a write to stderr may block),
        // from the error completion synthesized here.
        if !req.reported {
            req.reported = true;
            add(&env.counters.errors, 1);
            env.synthesized.push(error_wc(
                req.wr_id,
                IBV_WC_GENERAL_ERR,
                req.wc_opcode,
                self.qp_num,
            ));
        }
        req.done_posting = true;
        self.cursor = failed + 1;
        self.retire_front();
        None
    }

    /// Retires requests at the front that are fully posted and complete.
    #[inline]
    fn retire_front(&mut self) {
        while let Some(front) = self.requests.front() {
            if !(front.done_posting && front.inflight == 0) {
                break;
            }
            self.requests.pop_front();
            self.first_seq += 1;
            self.cursor = self.cursor.saturating_sub(1);
        }
    }

    /// Pops posted WQEs up to and including `index`, which all completed.
    fn pop_posted_through(&mut self, index: usize) {
        for _ in 0..=index {
            let Some(p) = self.posted.pop_front() else {
                break;
            };
            // A WQE of a request already flushed and dropped has no request left.
            if let Some(r) = p
                .seq
                .checked_sub(self.first_seq)
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| self.requests.get_mut(i))
            {
                r.inflight = r.inflight.saturating_sub(1);
            }
        }
    }

    /// Translates one completion of this QP (matched by `wc.qp_num` or by its tag).
    ///
    /// A completion names its WQE exactly, by tag (RC completes WQEs in order, so the
    /// unsignaled ones before a successful one completed silently). A completion without
    /// a tag is not this send queue's. The first error marks the QP failed: every request
    /// then gets exactly one error completion, from the first of its WQEs to report one,
    /// or synthesized (see [`Self::set_failed`]).
    pub fn complete(
        &mut self,
        wc: &mut ibv_wc,
        counters: &Counters,
        synthesized: &mut Vec<ibv_wc>,
    ) -> Verdict {
        if let Some(verdict) = self.complete_fast(wc) {
            return verdict;
        }
        if !self.ring.contains(wc.wr_id) {
            return Verdict::NotOurs;
        }
        self.materialize();
        // A tag no WQE in flight carries: a stale completion of the shaper's own.
        let ours = Verdict::Hide;
        if wc.status == IBV_WC_SUCCESS {
            if wc.opcode & IBV_WC_RECV != 0 {
                return Verdict::NotOurs;
            }
            let Some(index) = self
                .posted
                .iter()
                .position(|p| p.signaled && p.wr_id == wc.wr_id)
            else {
                return ours;
            };
            let entry = self.posted[index];
            let info = self.request_info(entry.seq);
            self.pop_posted_through(index);
            let verdict = match info {
                Some((wr_id, len, split, reported)) if entry.visible && !reported => {
                    wc.wr_id = wr_id;
                    if split {
                        wc.byte_len = len;
                    }
                    self.mark_reported(entry.seq);
                    Verdict::Deliver
                }
                _ => Verdict::Hide,
            };
            self.retire_front();
            self.flush_settled(counters, synthesized);
            return verdict;
        }

        let Some(index) = self.posted.iter().position(|p| p.wr_id == wc.wr_id) else {
            return ours;
        };
        let entry = self.posted[index];
        let info = self.request_info(entry.seq);
        self.failed = true;
        self.hardware_flushes = true;
        self.pop_posted_through(index);
        let verdict = match info {
            Some((wr_id, _, _, false)) => {
                wc.wr_id = wr_id;
                self.mark_reported(entry.seq);
                Counters::add(&counters.errors, 1);
                Verdict::Deliver
            }
            _ => Verdict::Hide,
        };
        self.retire_front();
        self.flush_settled(counters, synthesized);
        verdict
    }

    /// The usual completion, settled without [`Self::complete`]'s searches, under the QP's
    /// lock: one the ring settles ([`QuickRing::settle`], the ring opened first if the
    /// queue allows it: a poll that found it closed, or the record not yet published,
    /// comes here), or a success of the oldest WQE in flight, the last of the oldest
    /// request, on a queue that has not failed. Settles it as the general path would (the
    /// WQEs up to it completed, unsignaled ones silently; deliver the request's completion
    /// once, retire it); `None` for anything else, left untouched for [`Self::complete`].
    /// (Matching a tag in flight implies the tests that [`Self::complete`] makes first.)
    #[inline]
    pub fn complete_fast(&mut self, wc: &mut ibv_wc) -> Option<Verdict> {
        if self.posted.is_empty() {
            if self.may_open() {
                let (tail, closed) = self.ring.tail();
                if closed {
                    self.ring.set_tail(tail, false);
                }
            }
            return self.ring.settle(wc);
        }
        if wc.status != IBV_WC_SUCCESS || wc.opcode & IBV_WC_RECV != 0 || self.failed {
            return None;
        }
        let front = self.posted.front()?;
        if !front.signaled || front.wr_id != wc.wr_id || front.seq != self.first_seq {
            return None;
        }
        let visible = front.visible;
        let req = self.requests.front_mut()?;
        if req.inflight != 1 || !req.done_posting {
            return None;
        }
        self.posted.pop_front();
        let verdict = if visible && !req.reported {
            wc.wr_id = req.wr_id;
            if req.split {
                wc.byte_len = req.len;
            }
            Verdict::Deliver
        } else {
            Verdict::Hide
        };
        if let Some(done) = self.requests.pop_front() {
            if matches!(done.body, Body::Sent) {
                // It owns nothing: no need for the general (out-of-line) drop.
                std::mem::forget(done);
            }
        }
        self.first_seq += 1;
        self.cursor = self.cursor.saturating_sub(1);
        if self
            .requests
            .front()
            .is_some_and(|r| r.done_posting && r.inflight == 0)
        {
            self.retire_front();
        }
        Some(verdict)
    }

    fn request_info(&self, seq: u64) -> Option<(u64, u32, bool, bool)> {
        let r = self
            .requests
            .get(usize::try_from(seq.checked_sub(self.first_seq)?).ok()?)?;
        Some((r.wr_id, r.len, r.split, r.reported))
    }

    fn mark_reported(&mut self, seq: u64) {
        if let Some(r) = seq
            .checked_sub(self.first_seq)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.requests.get_mut(i))
        {
            r.reported = true;
        }
    }

    /// After a failure, settles in order every request that has not had its completion.
    ///
    /// When the failure came as an error completion, the hardware reports every WQE after
    /// that one (flushed): a request with a WQE in flight has its completion coming, and
    /// settling stops there, to keep the QP's completions in order; the others get a
    /// flush error now. When the application moved the QP to the error state, WQEs in
    /// flight may instead have finished silently before it (unsignaled ones then never
    /// report, which kept the queue from ever emptying), so:
    /// - one whose last, signaled WQE is in flight will have it from the hardware (done or
    ///   flushed): settling stops there;
    /// - one never fully posted cannot have completed: it gets a flush error now;
    /// - one fully posted and unsignaled may have finished silently before the failure (its
    ///   WQEs then never report, which is what kept the queue from ever emptying): it
    ///   counts as done, as it may have natively; a flush of its WQEs, if any comes, carries
    ///   tags and is hidden.
    ///
    /// Once every request is settled, the queue is emptied.
    fn flush_settled(&mut self, counters: &Counters, synthesized: &mut Vec<ibv_wc>) {
        if !self.failed {
            return;
        }
        for (i, r) in self.requests.iter_mut().enumerate() {
            if r.reported {
                continue;
            }
            let seq = self.first_seq + i as u64;
            let all = self.hardware_flushes;
            if self
                .posted
                .iter()
                .any(|p| p.seq == seq && (all || p.visible))
            {
                return;
            }
            r.reported = true;
            if !all && r.done_posting && !r.visible {
                continue;
            }
            r.done_posting = true;
            Counters::add(&counters.errors, 1);
            synthesized.push(error_wc(
                r.wr_id,
                r.fail_status.unwrap_or(IBV_WC_WR_FLUSH_ERR),
                r.wc_opcode,
                self.qp_num,
            ));
        }
        self.first_seq += self.requests.len() as u64;
        self.requests.clear();
        self.cursor = 0;
    }

    /// The QP was reset: the hardware forgot its queue, so does the shaper.
    pub fn reset(&mut self) {
        self.materialize();
        self.whole_two_sided = 0;
        self.first_seq += self.requests.len() as u64;
        self.requests.clear();
        self.posted.clear();
        self.cursor = 0;
        self.unsignaled_run = 0;
        self.failed = false;
        self.hardware_flushes = false;
    }

    /// The peer's shaper stopped answering: the oldest request waiting for its credit
    /// completes with `status` (what the NIC gives a request to a peer that is gone,
    /// `IBV_WC_RETRY_EXC_ERR`), in its place after the requests before it, and the queue
    /// fails as in [`Self::set_failed`] (everything behind it flushed).
    pub fn give_up_waiting(
        &mut self,
        status: ibv_wc_status,
        counters: &Counters,
        synthesized: &mut Vec<ibv_wc>,
    ) {
        self.materialize();
        if let Some(r) = self.requests.iter_mut().find(|r| match &r.body {
            Body::AwaitingCredit(_) => true,
            Body::Split(s) => s.waits_for_credit(),
            _ => false,
        }) {
            r.fail_status = Some(status);
        }
        self.set_failed(counters, synthesized);
    }

    /// The QP was moved to the error state (as `rdma_disconnect` does): requests whose
    /// completion the hardware will not deliver get their flush errors now, in order (see
    /// `Self::flush_settled`).
    pub fn set_failed(&mut self, counters: &Counters, synthesized: &mut Vec<ibv_wc>) {
        self.materialize();
        self.failed = true;
        self.flush_settled(counters, synthesized);
    }
}

/// Whether a request with `opcode` consumes a receive at the peer.
pub fn consumes_receive(opcode: ibv_wr_opcode) -> bool {
    matches!(
        opcode,
        IBV_WR_SEND | IBV_WR_SEND_WITH_IMM | IBV_WR_RDMA_WRITE_WITH_IMM
    )
}

/// Sum of the SGE lengths of `wr` (its payload, inline or not).
///
/// # Safety
/// `wr`'s SGE list must be readable.
#[inline(always)]
pub unsafe fn payload_of(wr: &ibv_send_wr) -> u64 {
    if wr.num_sge == 1 && !wr.sg_list.is_null() {
        // SAFETY: guaranteed by the caller; the usual request has one SGE.
        return u64::from(unsafe { (*wr.sg_list).length });
    }
    let n = usize::try_from(wr.num_sge).unwrap_or(0);
    if n == 0 || wr.sg_list.is_null() {
        return 0;
    }
    // SAFETY: guaranteed by the caller.
    let sges = unsafe { std::slice::from_raw_parts(wr.sg_list, n) };
    sges.iter().map(|s| u64::from(s.length)).sum()
}

/// The completion opcode of a send opcode.
fn wc_opcode_for(op: ibv_wr_opcode) -> ibv_wc_opcode {
    match op {
        IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM => IBV_WC_RDMA_WRITE,
        IBV_WR_RDMA_READ => IBV_WC_RDMA_READ,
        IBV_WR_ATOMIC_CMP_AND_SWP => IBV_WC_COMP_SWAP,
        IBV_WR_ATOMIC_FETCH_AND_ADD => IBV_WC_FETCH_ADD,
        IBV_WR_LOCAL_INV => IBV_WC_LOCAL_INV,
        IBV_WR_BIND_MW => IBV_WC_BIND_MW,
        IBV_WR_TSO => IBV_WC_TSO,
        _ => IBV_WC_SEND,
    }
}

/// An error completion for a request.
fn error_wc(wr_id: u64, status: ibv_wc_status, opcode: ibv_wc_opcode, qp_num: u32) -> ibv_wc {
    ibv_wc {
        wr_id,
        status,
        opcode,
        qp_num,
        ..Default::default()
    }
}

/// The work request for one chunk, without its SGE list (the batch points it at its own
/// copy) and `wr_id` (set by the batch).
fn chunk_to_wr(chunk: &Chunk) -> ibv_send_wr {
    let req = &chunk.request;
    let (opcode, imm) = match req.opcode {
        Opcode::Write => (IBV_WR_RDMA_WRITE, 0),
        Opcode::WriteWithImm { imm } => (IBV_WR_RDMA_WRITE_WITH_IMM, imm),
        Opcode::Read => (IBV_WR_RDMA_READ, 0),
        Opcode::Send => (IBV_WR_SEND, 0),
        Opcode::SendWithImm { imm } => (IBV_WR_SEND_WITH_IMM, imm),
        Opcode::AtomicCmpAndSwp { .. } => (IBV_WR_ATOMIC_CMP_AND_SWP, 0),
        Opcode::AtomicFetchAndAdd { .. } => (IBV_WR_ATOMIC_FETCH_AND_ADD, 0),
    };
    let mut flags = 0;
    if req.flags.fence {
        flags |= IBV_SEND_FENCE;
    }
    if req.flags.solicited {
        flags |= IBV_SEND_SOLICITED;
    }
    let mut wr = ibv_send_wr {
        opcode,
        send_flags: flags,
        ..Default::default()
    };
    wr.__bindgen_anon_1.imm_data = imm;
    if let Some(remote) = req.remote {
        wr.wr.rdma.remote_addr = remote.addr;
        wr.wr.rdma.rkey = remote.rkey;
    }
    wr
}

/// A yield: the core's zero-length request, aimed at the split request's own remote
/// address and key (a responder checks neither for a zero-length operation, but this keeps
/// even a strict one content). It is an RDMA WRITE, except between the pieces of an RDMA
/// READ, where it is a zero-length READ: the peer may grant this QP remote reads only
/// (perftest's `ib_read_bw` does), and would refuse a write, failing the QP.
fn yield_wr_for(original: &WorkRequest) -> ibv_send_wr {
    let mut y = yield_request();
    y.remote = original.remote.or(y.remote);
    let opcode = match original.opcode {
        Opcode::Read => IBV_WR_RDMA_READ,
        _ => IBV_WR_RDMA_WRITE,
    };
    let mut wr = ibv_send_wr {
        opcode,
        ..Default::default()
    };
    if let Some(remote) = y.remote {
        wr.wr.rdma.remote_addr = remote.addr;
        wr.wr.rdma.rkey = remote.rkey;
    }
    wr
}

#[cfg(test)]
mod tests {
    //! The send queue alone, with a closure as the provider.
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use justitia_core::pacer::Pacer;

    /// A send queue and what its provider (a closure) was handed.
    struct Harness {
        sq: SendQueue,
        counters: Counters,
        /// `(wr_id, signaled, payload)` of every WQE posted, in order.
        wire: Vec<(u64, bool, u32)>,
        synthesized: Vec<ibv_wc>,
    }

    impl Harness {
        fn new(capacity: u32) -> Self {
            Harness {
                sq: SendQueue::new(7, capacity, 4, false),
                counters: Counters::default(),
                wire: Vec::new(),
                synthesized: Vec::new(),
            }
        }

        fn accept(&mut self, wr_id: u64, len: u32, signaled: bool, treatment: Treatment) {
            let mut wr = ibv_send_wr {
                wr_id,
                opcode: IBV_WR_RDMA_WRITE,
                send_flags: if signaled { IBV_SEND_SIGNALED } else { 0 },
                ..Default::default()
            };
            wr.wr.rdma.remote_addr = 0x10_0000;
            wr.wr.rdma.rkey = 5;
            let sge = ibv_sge {
                addr: 0x20_0000,
                length: len,
                lkey: 1,
            };
            let owned = OwnedWr::from_parts(wr, vec![sge], None);
            self.sq.accept(owned, treatment, 0).unwrap();
            self.sq.end_call();
        }

        fn drain(&mut self) -> DrainOutcome {
            let wire = &mut self.wire;
            let mut post = |wrs: &mut [ibv_send_wr]| -> Result<(), (usize, c_int)> {
                for w in wrs.iter() {
                    // SAFETY: the queue hands over WQEs with their SGE lists live.
                    let len = unsafe { (*w.sg_list).length };
                    wire.push((w.wr_id, w.send_flags & IBV_SEND_SIGNALED != 0, len));
                }
                Ok(())
            };
            self.sq.drain(
                Duration::ZERO,
                &mut DrainEnv {
                    post: &mut post,
                    pacer: None,
                    counters: &self.counters,
                    synthesized: &mut self.synthesized,
                },
            )
        }

        /// The hardware's completion of the posted WQE `index`, as the application's poll
        /// would translate it.
        fn complete(&mut self, index: usize, status: ibv_wc_status) -> (Verdict, ibv_wc) {
            let mut wc = ibv_wc {
                wr_id: self.wire[index].0,
                status,
                opcode: IBV_WC_RDMA_WRITE,
                qp_num: 7,
                ..Default::default()
            };
            let v = self
                .sq
                .complete(&mut wc, &self.counters, &mut self.synthesized);
            (v, wc)
        }
    }

    /// A gate pacing `bytes_per_sec` in chunks of `chunk_bytes`, from time 0.
    fn gate(bytes_per_sec: u64, chunk_bytes: u32) -> RateGate {
        let rate = justitia_core::pacer::PaceRate {
            bytes_per_sec,
            ops_per_sec: None,
            chunk_bytes,
        };
        RateGate::new(Pacer::new(rate, Duration::ZERO))
    }

    /// A post that finds no allowance asks the pacer and hands out what its balance still
    /// covers (2000 B of burst, less the 1000 B request: 1000 B); posts take from it
    /// without the pacer until it is short, and whatever locks the pacer next charges it
    /// exactly what they took.
    #[test]
    fn the_rate_gate_hands_out_the_pacers_spare_credit_and_charges_what_was_taken() {
        let gate = gate(1_000_000, 1_000);
        assert!(!gate.try_take(1), "nothing handed out yet");
        assert!(gate.release(1_000, || Duration::ZERO));
        assert!(gate.try_take(600));
        assert!(!gate.try_take(600), "400 B left");
        assert!(gate.try_take(400));
        assert!(!gate.try_take(1));
        let pacer = gate.lock();
        assert_eq!(pacer.unclocked_allowance(), (0, None), "1000 B charged");
        drop(pacer);
        assert!(!gate.try_take(1), "the lock took the allowance back");
        // 2000 B released at time zero: a zero balance still releases one request, which
        // leaves 1000 B of debt, repaid at 1 MB/s from the next reading on.
        assert!(gate.release(1_000, || Duration::from_micros(999)));
        assert!(!gate.release(1, || Duration::from_micros(999)));
        assert!(!gate.release(1, || Duration::from_micros(1_998)));
        assert!(gate.release(1, || Duration::from_micros(1_999)));
    }

    /// Posts on many threads never take more than was handed out.
    #[test]
    fn the_rate_gate_never_hands_out_more_than_once_under_contention() {
        let gate = gate(1_000_000, 1_000);
        assert!(gate.release(0, || Duration::ZERO));
        let taken = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1_000 {
                        if gate.try_take(3) {
                            taken.fetch_add(3, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        // 2000 B of burst: 666 requests of 3 B fit.
        assert_eq!(taken.load(Ordering::Relaxed), 1_998);
        assert_eq!(gate.lock().unclocked_allowance(), (2, None));
    }

    impl Harness {
        /// Posts one request by [`SendQueue::post_now`], unpaced, as the fast lane does.
        fn post_now(&mut self, wr_id: u64, len: u32, signaled: bool) {
            let mut sge = ibv_sge {
                addr: 0x20_0000,
                length: len,
                lkey: 1,
            };
            let wr = ibv_send_wr {
                wr_id,
                opcode: IBV_WR_RDMA_WRITE,
                send_flags: if signaled { IBV_SEND_SIGNALED } else { 0 },
                sg_list: &mut sge,
                num_sge: 1,
                ..Default::default()
            };
            let lane = FastLane {
                whole_up_to: u64::MAX,
                paced: false,
            };
            let gate = gate(0, 4096);
            let wire = &mut self.wire;
            let post = |w: &mut ibv_send_wr| {
                wire.push((w.wr_id, w.send_flags & IBV_SEND_SIGNALED != 0, len));
                0
            };
            // SAFETY: wr and its one SGE live for the call.
            let posted = unsafe {
                self.sq
                    .post_now(&wr, lane, &gate, || Duration::ZERO, post, &self.counters)
            };
            assert_eq!(posted, Some(Ok(())));
        }
    }

    /// Requests posted straight (kept as 16-byte records) and a split request behind them
    /// (which moves those records into the general queue) complete as the application
    /// posted them: each signaled one once with its own `wr_id`, the unsignaled ones
    /// silently, the split one with its whole length; a stale tag is hidden.
    #[test]
    fn requests_posted_straight_and_split_ones_behind_them_complete_in_order() {
        let mut h = Harness::new(8);
        h.post_now(1, 100, false);
        h.post_now(2, 100, true);
        h.post_now(3, 100, false);
        assert_eq!(h.sq.outstanding(), 3);
        assert!(h.wire.iter().all(|w| h.sq.ring.contains(w.0)), "tags only");
        assert_eq!(
            h.wire.iter().map(|w| w.1).collect::<Vec<_>>(),
            [false, true, false]
        );
        h.accept(4, 16384, true, SPLIT_4K);
        h.drain();
        assert_eq!(h.wire.len(), 7, "three whole, four chunks");
        let (v, wc) = h.complete(1, IBV_WC_SUCCESS);
        assert_eq!((v, wc.wr_id), (Verdict::Deliver, 2));
        assert_eq!(h.sq.outstanding(), 2, "1 and 2 retired, 3 and 4 in flight");
        let (v, wc) = h.complete(6, IBV_WC_SUCCESS);
        assert_eq!((v, wc.wr_id, wc.byte_len), (Verdict::Deliver, 4, 16384));
        assert_eq!(h.sq.outstanding(), 0);
        // Straight again once the queue is empty, and settled from its record.
        h.post_now(5, 100, true);
        let (v, wc) = h.complete(7, IBV_WC_SUCCESS);
        assert_eq!((v, wc.wr_id), (Verdict::Deliver, 5));
        assert_eq!(h.sq.outstanding(), 0);
        assert_eq!(h.complete(7, IBV_WC_SUCCESS).0, Verdict::Hide, "stale");
    }

    const SPLIT_4K: Treatment = Treatment::Split {
        chunk_bytes: 4096,
        paced: false,
    };

    /// The completion of the WQE tagged `tag`, a success.
    fn success(tag: u64) -> ibv_wc {
        ibv_wc {
            wr_id: tag,
            status: IBV_WC_SUCCESS,
            opcode: IBV_WC_RDMA_WRITE,
            qp_num: 7,
            ..Default::default()
        }
    }

    /// A poll settles a quick request on the ring alone, without the QP's lock, while the
    /// ring is open; a split request closes it, and the poll then leaves the completion to
    /// the lock; the next post on the emptied queue opens it again. What is not the send
    /// queue's is told apart on the ring too; an error or a tag no longer in flight is left
    /// to the lock.
    #[test]
    fn a_poll_settles_quick_requests_without_the_lock_only_on_an_open_ring() {
        let mut h = Harness::new(8);
        let ring = Arc::clone(h.sq.ring());
        h.post_now(1, 100, true);
        h.post_now(2, 100, true);
        let mut first = success(h.wire[0].0);
        assert_eq!(ring.settle(&mut first), Some(Verdict::Deliver));
        assert_eq!((first.wr_id, h.sq.outstanding()), (1, 1));
        assert_eq!(ring.settle(&mut success(h.wire[0].0)), None, "stale");
        let mut recv = ibv_wc {
            opcode: IBV_WC_RECV,
            ..success(h.wire[1].0)
        };
        assert_eq!(ring.settle(&mut recv), Some(Verdict::NotOurs));
        assert_eq!(ring.settle(&mut success(2)), Some(Verdict::NotOurs));
        let mut error = ibv_wc {
            status: IBV_WC_REM_ACCESS_ERR,
            ..success(h.wire[1].0)
        };
        assert_eq!(ring.settle(&mut error), None);
        h.accept(3, 16384, true, SPLIT_4K);
        h.drain();
        assert_eq!(ring.settle(&mut success(h.wire[1].0)), None, "closed");
        let (v, wc) = h.complete(1, IBV_WC_SUCCESS);
        assert_eq!((v, wc.wr_id), (Verdict::Deliver, 2));
        let (v, wc) = h.complete(5, IBV_WC_SUCCESS);
        assert_eq!((v, wc.wr_id), (Verdict::Deliver, 3));
        assert_eq!(h.sq.outstanding(), 0);
        h.post_now(4, 100, true);
        let mut fourth = success(h.wire[6].0);
        assert_eq!(ring.settle(&mut fourth), Some(Verdict::Deliver));
        assert_eq!((fourth.wr_id, h.sq.outstanding()), (4, 0));
    }

    /// Polls on one thread settle quick requests without the QP's lock while posts on
    /// another close the ring (a split request every eight, a request posted through the
    /// general queue whenever the quick one is full) and reopen it: every completion the
    /// application asked for is delivered once and in order, and the queue ends empty. A
    /// poll that moved the ring's tail with a plain store instead of its compare-and-swap
    /// undoes closes: it reopens the ring under requests the general queue has taken over,
    /// and completions are lost (the polls give way to the poster between reading the ring
    /// and moving its tail, so that the test hits that window often). No clock: the
    /// poller stops when the poster is done and the wire is empty, or when the two are
    /// stuck (the wire empty, everything on it settled, and two of the poster's attempts
    /// since then refused for want of a slot with the wire still empty: completions were
    /// lost), however slowly a loaded host runs them.
    #[test]
    fn polls_without_the_lock_race_posts_that_close_the_ring() {
        const REQUESTS: u64 = 20_000;
        let visible = |id: u64| id % 8 == 7 || !id.is_multiple_of(3);
        assert!(
            visible(REQUESTS - 1),
            "the last request retires the ones before it"
        );
        let sq = std::sync::Mutex::new(SendQueue::new(7, 8, 4, false));
        let ring = Arc::clone(sq.lock().unwrap().ring());
        let counters = Counters::default();
        // The hardware: WQEs in posting order (tag, signaled), completing in that order.
        let wire = std::sync::Mutex::new(VecDeque::<(u64, bool)>::new());
        let put_on_wire = |wrs: &[ibv_send_wr]| {
            let mut wire = wire.lock().unwrap();
            for w in wrs {
                wire.push_back((w.wr_id, w.send_flags & IBV_SEND_SIGNALED != 0));
            }
        };
        let drain = |sq: &mut SendQueue| {
            let mut post = |wrs: &mut [ibv_send_wr]| -> Result<(), (usize, c_int)> {
                put_on_wire(wrs);
                Ok(())
            };
            let mut synthesized = Vec::new();
            sq.drain(
                Duration::ZERO,
                &mut DrainEnv {
                    post: &mut post,
                    pacer: None,
                    counters: &counters,
                    synthesized: &mut synthesized,
                },
            );
            assert!(synthesized.is_empty());
        };
        let gate = gate(0, 4096);
        let lane = FastLane {
            whole_up_to: 4096,
            paced: false,
        };
        // Set when the poller gives up, so that a poster stuck on a queue that never
        // frees a slot stops too.
        let gave_up = std::sync::atomic::AtomicBool::new(false);
        // The poster's attempts refused for want of a slot, and whether it is done.
        let refused = std::sync::atomic::AtomicU64::new(0);
        let posted_all = std::sync::atomic::AtomicBool::new(false);
        let poster = || {
            let mut sge = ibv_sge {
                addr: 0x20_0000,
                length: 100,
                lkey: 1,
            };
            for id in 0..REQUESTS {
                let split = id % 8 == 7;
                sge.length = if split { 8192 } else { 100 };
                let mut wr = ibv_send_wr {
                    wr_id: id,
                    opcode: IBV_WR_RDMA_WRITE,
                    send_flags: if visible(id) { IBV_SEND_SIGNALED } else { 0 },
                    sg_list: &mut sge,
                    num_sge: 1,
                    ..Default::default()
                };
                wr.wr.rdma.remote_addr = 0x10_0000;
                loop {
                    let mut q = sq.lock().unwrap();
                    let post = |w: &mut ibv_send_wr| {
                        put_on_wire(std::slice::from_ref(w));
                        0
                    };
                    // SAFETY: wr and its one SGE live for the call.
                    let quick =
                        unsafe { q.post_now(&wr, lane, &gate, || Duration::ZERO, post, &counters) };
                    if quick == Some(Ok(())) {
                        break;
                    }
                    // SAFETY: as above.
                    let owned = unsafe { OwnedWr::copy_from(&wr) };
                    if q.accept(owned, SPLIT_4K, 0).is_ok() {
                        drain(&mut q);
                        q.end_call();
                        break;
                    }
                    drop(q);
                    refused.fetch_add(1, Ordering::SeqCst);
                    if gave_up.load(Ordering::SeqCst) {
                        return;
                    }
                    std::thread::yield_now();
                }
            }
            posted_all.store(true, Ordering::SeqCst);
        };
        let poller = || {
            ring::race::WIDE.set(true);
            let mut delivered = Vec::new();
            let want = (0..REQUESTS).filter(|&id| visible(id)).count();
            // Refused attempts counted when the wire was last found empty (`None`: it was
            // not).
            let mut empty_since: Option<u64> = None;
            while delivered.len() < want {
                let next = wire.lock().unwrap().pop_front();
                let Some((tag, signaled)) = next else {
                    // Read before the refusals: a poster done now put everything on the
                    // wire before, which is empty.
                    if posted_all.load(Ordering::SeqCst) && wire.lock().unwrap().is_empty() {
                        break;
                    }
                    let now_refused = refused.load(Ordering::SeqCst);
                    match empty_since {
                        // Two attempts ended since the wire was found empty with everything
                        // on it settled, so one began after that, and both were refused;
                        // and the wire is still empty, so neither they nor any attempt
                        // between put a WQE on it (only this thread takes from it): no
                        // slot will ever come back. Without that second look, a poller
                        // descheduled between finding the wire empty and reading the
                        // refusals would count ones that followed fresh posts.
                        Some(since)
                            if now_refused >= since + 2 && wire.lock().unwrap().is_empty() =>
                        {
                            break
                        }
                        Some(_) => {}
                        None => empty_since = Some(now_refused),
                    }
                    std::thread::yield_now();
                    continue;
                };
                empty_since = None;
                if !signaled {
                    continue;
                }
                let mut wc = success(tag);
                let verdict = match ring.settle(&mut wc) {
                    Some(v) => v,
                    None => {
                        let mut q = sq.lock().unwrap();
                        let v = q.complete(&mut wc, &counters, &mut Vec::new());
                        if q.needs_drain() {
                            drain(&mut q);
                        }
                        v
                    }
                };
                assert_ne!(verdict, Verdict::NotOurs);
                if verdict == Verdict::Deliver {
                    delivered.push(wc.wr_id);
                }
            }
            gave_up.store(true, Ordering::SeqCst);
            delivered
        };
        let delivered = std::thread::scope(|s| {
            s.spawn(poster);
            poller()
        });
        let want: Vec<u64> = (0..REQUESTS).filter(|&id| visible(id)).collect();
        assert_eq!(delivered.len(), want.len(), "every completion, once");
        assert_eq!(delivered, want, "in order");
        assert_eq!(sq.lock().unwrap().outstanding(), 0);
        assert!(wire.lock().unwrap().is_empty());
    }

    #[test]
    fn a_split_request_goes_out_in_chunks_each_with_a_tag_and_completes_once() {
        let mut h = Harness::new(16);
        h.accept(42, 16384, true, SPLIT_4K);
        assert_eq!(h.drain().blocked, Blocked::Idle);
        assert_eq!(h.wire.len(), 4);
        assert!(h.wire.iter().all(|&(id, _, len)| id != 42 && len == 4096));
        assert_eq!(
            h.wire.iter().map(|w| w.1).collect::<Vec<_>>(),
            [false, false, false, true],
            "only the last chunk is signaled"
        );
        let (v, wc) = h.complete(3, IBV_WC_SUCCESS);
        assert_eq!((v, wc.wr_id, wc.byte_len), (Verdict::Deliver, 42, 16384));
        assert_eq!(h.sq.outstanding(), 0, "retired");
    }

    #[test]
    fn a_full_hardware_queue_blocks_on_slots_and_completions_free_them() {
        let mut h = Harness::new(4);
        h.accept(1, 32768, true, SPLIT_4K);
        assert_eq!(h.drain().blocked, Blocked::Slots);
        assert_eq!(h.wire.len(), 4);
        // The shaper signals an internal WQE every half queue, so slots come back.
        assert!(h.wire[1].1, "internal signal at half the queue");
        assert_eq!(h.complete(1, IBV_WC_SUCCESS).0, Verdict::Hide);
        h.drain();
        assert_eq!(h.wire.len(), 6);
    }

    /// Issue 10, item 2: the QP is moved to the error state (as `rdma_disconnect` does)
    /// after an unsignaled request's last chunk finished silently, while a signaled request
    /// is held (for tokens). The flush used to wait for the WQEs in flight to report, which
    /// an unsignaled WQE that already finished never does: the held request never had its
    /// completion.
    #[test]
    fn moving_to_error_flushes_held_requests_behind_silently_finished_chunks() {
        let mut h = Harness::new(4);
        h.accept(1, 12288, false, SPLIT_4K);
        h.drain();
        assert_eq!(
            h.wire.iter().map(|w| w.1).collect::<Vec<_>>(),
            [false, true, false],
            "an internal signal at half the queue"
        );
        assert_eq!(h.complete(1, IBV_WC_SUCCESS).0, Verdict::Hide);
        // Request 2 is accepted and held (not drained: its tokens are not due).
        h.accept(2, 4096, true, Treatment::Whole);
        // The last chunk finishes silently; then the application moves the QP to error.
        h.sq.set_failed(&h.counters, &mut h.synthesized);
        assert_eq!(
            h.synthesized
                .iter()
                .map(|w| (w.wr_id, w.status))
                .collect::<Vec<_>>(),
            [(2, IBV_WC_WR_FLUSH_ERR)],
            "the held request is flushed, the silent one stays silent"
        );
        assert_eq!(h.sq.outstanding(), 0);
    }

    /// After an error completion the hardware flushes every later WQE, so a request with
    /// WQEs in flight gets its error from them, in order, not a synthesized one first.
    #[test]
    fn after_an_error_completion_requests_in_flight_wait_for_their_own_flush() {
        let mut h = Harness::new(8);
        h.accept(1, 4096, true, Treatment::Whole);
        h.accept(2, 4096, false, Treatment::Whole);
        h.accept(3, 4096, true, Treatment::Whole);
        h.drain();
        let (v, wc) = h.complete(0, IBV_WC_REM_ACCESS_ERR);
        assert_eq!((v, wc.wr_id), (Verdict::Deliver, 1));
        assert!(h.synthesized.is_empty(), "2 and 3 are still to be flushed");
        let (v, wc) = h.complete(1, IBV_WC_WR_FLUSH_ERR);
        assert_eq!((v, wc.wr_id), (Verdict::Deliver, 2));
        let (v, wc) = h.complete(2, IBV_WC_WR_FLUSH_ERR);
        assert_eq!((v, wc.wr_id), (Verdict::Deliver, 3));
        assert!(h.synthesized.is_empty());
    }

    /// Issue 10, item 6: an error completion without one of the queue's tags is never the
    /// queue's (a receive flushed with the same `wr_id` as a send).
    #[test]
    fn an_error_completion_without_a_tag_is_not_the_send_queues() {
        let mut h = Harness::new(8);
        h.accept(7, 4096, true, Treatment::Whole);
        h.drain();
        let mut recv_flush = ibv_wc {
            wr_id: 7,
            status: IBV_WC_WR_FLUSH_ERR,
            qp_num: 7,
            ..Default::default()
        };
        assert_eq!(
            h.sq.complete(&mut recv_flush, &h.counters, &mut h.synthesized),
            Verdict::NotOurs
        );
        let (v, wc) = h.complete(0, IBV_WC_REM_ACCESS_ERR);
        assert_eq!(
            (v, wc.wr_id, wc.status),
            (Verdict::Deliver, 7, IBV_WC_REM_ACCESS_ERR)
        );
    }
}
