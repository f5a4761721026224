//! The send side of one shaped queue pair.
//!
//! The application's requests are *accepted* into a FIFO; their work queue entries (WQEs:
//! whole requests, chunks, yields) are *posted* to the hardware queue in order as slots and
//! tokens allow; completions are *translated* back into what the application would have
//! seen without the shaper.
//!
//! Queue depth is kept in two currencies. The application may have at most `capacity`
//! requests outstanding (accepted and not yet retired), exactly as its `max_send_wr`
//! promised, and gets `ENOMEM` for the one past that. The hardware queue may hold at most
//! `capacity` WQEs; the rest wait here. A request retires when its last WQE has been
//! completed, as the application learns from a completion of it or of a later request.
//!
//! Completions are matched by order: RC send completions of one QP arrive in the order the
//! WQEs were posted, so the shaper keeps a FIFO of posted WQEs and a completion belongs to
//! the first signaled one (unsignaled WQEs before it completed silently). Nothing relies on
//! `wr_id` values, which remain the application's: every WQE of a request carries the
//! request's own `wr_id`, so an error on any chunk is already reported on the original
//! request; the shaper only hides the extra completions. To keep slots flowing when the
//! application signals rarely, the shaper signals an internal WQE at least every half queue
//! and hides its completion; the hidden completions never exceed the WQEs in flight, so the
//! completion queue the application sized for its own requests does not overflow.
//!
//! Errors: the first error completion marks the QP failed; every request gets exactly one
//! error completion (the hardware flushes what was posted; requests never posted get a
//! synthesized `IBV_WC_WR_FLUSH_ERR` once the hardware queue is empty).

use std::collections::VecDeque;
use std::ffi::c_int;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Duration;

use justitia_core::chunk::{Chunk, ChunkPlan, Opcode, Sge, WorkRequest};
use justitia_core::yield_plan::{yield_request, YieldPlanner};
use justitia_verbs::sys::*;

use crate::bucket::TokenBucket;
use crate::stats::Counters;

/// How the shaper treats one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Treatment {
    /// Posted whole, unpaced (latency flows, and requests the planner cannot describe).
    Whole,
    /// Posted whole, paced by the token bucket (throughput flows).
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

    /// True when the application asked for a completion.
    pub fn signaled(&self) -> bool {
        self.wr.send_flags & IBV_SEND_SIGNALED != 0
    }

    /// The request in the chunk planner's terms, or `None` for what it does not describe
    /// (invalidations, memory-window binds, TSO, driver opcodes, too many SGEs).
    fn to_work_request(&self) -> Option<WorkRequest> {
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
#[derive(Debug)]
struct SplitBody {
    plan: ChunkPlan,
    /// The next chunk to post, taken from the plan ahead of time.
    next: Option<Chunk>,
    /// Yields still to post before `next` (`preempt`).
    yields_due: u32,
    planner: Option<YieldPlanner>,
}

#[derive(Debug)]
enum Body {
    Whole(OwnedWr),
    Split(Box<SplitBody>),
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
}

/// A WQE on the hardware queue.
#[derive(Clone, Copy, Debug)]
struct Posted {
    seq: u64,
    wr_id: u64,
    signaled: bool,
    /// Its completion is the application's (the last WQE of a visible request).
    visible: bool,
}

/// Why posting stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocked {
    /// Nothing is waiting.
    Idle,
    /// The hardware queue is full; completions will free slots.
    Slots,
    /// The token bucket is empty for this long.
    Tokens(Duration),
    /// The QP has failed; nothing more is posted.
    Failed,
}

/// What became of one completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not from this QP's send queue: leave it alone.
    NotOurs,
    /// The application's completion (possibly rewritten): deliver it.
    Deliver,
    /// Internal or duplicate: hide it.
    Hide,
}

/// What a drain needs from outside: the real post verb, the bucket, the counters, and a
/// place for synthesized completions.
pub struct DrainEnv<'a> {
    /// Posts one WQE to the hardware queue; returns 0 or an errno.
    pub post: &'a mut dyn FnMut(&mut ibv_send_wr) -> c_int,
    /// The process's token bucket, when pacing is configured.
    pub bucket: Option<&'a Mutex<TokenBucket>>,
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
}

/// The send side of one shaped QP.
#[derive(Debug)]
pub struct SendQueue {
    qp_num: u32,
    capacity: u32,
    max_sge: usize,
    sig_all: bool,
    signal_every: u32,
    unsignaled_run: u32,
    requests: VecDeque<Request>,
    first_seq: u64,
    cursor: usize,
    posted: VecDeque<Posted>,
    failed: bool,
    /// After the first error: the failed request's wr_id and how many more of its WQEs
    /// may still report a flush.
    stray: Option<(u64, u32)>,
}

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
            signal_every: (capacity / 2).max(1),
            unsignaled_run: 0,
            requests: VecDeque::new(),
            first_seq: 0,
            cursor: 0,
            posted: VecDeque::new(),
            failed: false,
            stray: None,
        }
    }

    /// Application requests outstanding (accepted, not retired).
    pub fn outstanding(&self) -> usize {
        self.requests.len()
    }

    /// Requests waiting in software (not fully posted).
    pub fn queued(&self) -> usize {
        self.requests.len() - self.cursor
    }

    /// WQEs on the hardware queue.
    pub fn in_hardware(&self) -> usize {
        self.posted.len()
    }

    /// The application's send capacity.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// True once an error completion was seen (until the QP is reset).
    pub fn failed(&self) -> bool {
        self.failed
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
        if self.requests.len() >= self.capacity as usize {
            return Err(libc::ENOMEM);
        }
        let len = u32::try_from(wr.payload_len()).unwrap_or(u32::MAX);
        let wr_id = wr.wr_id();
        let visible = self.sig_all || wr.signaled();
        let wc_opcode = wc_opcode_for(wr.opcode());
        let (body, split, paced) = match treatment {
            Treatment::Whole => (Body::Whole(wr), false, false),
            Treatment::WholePaced => (Body::Whole(wr), false, true),
            Treatment::Split { chunk_bytes, paced } => {
                self.split_body(wr, chunk_bytes, None, paced)
            }
            Treatment::Preempt(planner) => {
                let bytes = planner.sub_message_bytes();
                self.split_body(wr, bytes, Some(planner), false)
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
        });
        Ok(())
    }

    /// The body for a request to split: the chunk plan when the planner splits it, else
    /// the request whole. Returns the body, whether it is split, and whether it is paced.
    fn split_body(
        &self,
        wr: OwnedWr,
        chunk_bytes: u32,
        planner: Option<YieldPlanner>,
        paced: bool,
    ) -> (Body, bool, bool) {
        let limits = justitia_core::chunk::ChunkLimits {
            chunk_bytes,
            max_sge: self.max_sge,
            split_two_sided: false,
        };
        let plan = wr
            .to_work_request()
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
                };
                (Body::Split(Box::new(body)), true, paced)
            }
            None => (Body::Whole(wr), false, paced),
        }
    }

    /// Ends the running post call: its requests can no longer be taken back.
    pub fn end_call(&mut self) {
        for r in self.requests.iter_mut().rev() {
            if r.call_index.take().is_none() {
                break;
            }
        }
    }

    /// Posts what slots and tokens allow, in order.
    pub fn drain(&mut self, now: Duration, env: &mut DrainEnv<'_>) -> DrainOutcome {
        let mut outcome = DrainOutcome {
            blocked: Blocked::Idle,
            refused: None,
        };
        loop {
            if self.failed {
                self.flush_if_idle(env.counters, env.synthesized);
                outcome.blocked = Blocked::Failed;
                return outcome;
            }
            if self.cursor >= self.requests.len() {
                return outcome;
            }
            if self.posted.len() >= self.capacity as usize {
                outcome.blocked = Blocked::Slots;
                return outcome;
            }
            let seq = self.first_seq + self.cursor as u64;
            let Some(req) = self.requests.get_mut(self.cursor) else {
                return outcome;
            };

            // The next WQE of the request, and what it is.
            let mut yield_wr;
            let mut chunk_wr;
            let (wr, payload, is_last, is_yield): (&mut ibv_send_wr, u32, bool, bool) =
                match &mut req.body {
                    Body::Whole(w) => {
                        chunk_wr = w.as_wr();
                        (&mut chunk_wr, req.len, true, false)
                    }
                    Body::Split(s) => {
                        if s.yields_due > 0 {
                            yield_wr = yield_wr_for(s.plan.request(), req.wr_id);
                            (&mut yield_wr, 0, false, true)
                        } else if let Some(chunk) = s.next.as_mut() {
                            let bytes =
                                u32::try_from(chunk.request.sges.total_bytes()).unwrap_or(u32::MAX);
                            chunk_wr = chunk_to_wr(chunk, req.wr_id);
                            (&mut chunk_wr, bytes, chunk.is_last, false)
                        } else {
                            // A plan that ran dry early; never expected.
                            req.done_posting = true;
                            self.cursor += 1;
                            self.retire_front();
                            continue;
                        }
                    }
                };

            if req.paced && !is_yield {
                if let Some(bucket) = env.bucket {
                    let taken = bucket
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .try_take(now, payload);
                    if let Err(wait) = taken {
                        req.blocked_since.get_or_insert(now);
                        outcome.blocked = Blocked::Tokens(wait);
                        return outcome;
                    }
                }
            }

            let visible = is_last && req.visible;
            let signaled = self.sig_all || visible || self.unsignaled_run + 1 >= self.signal_every;
            if signaled {
                wr.send_flags |= IBV_SEND_SIGNALED;
            } else {
                wr.send_flags &= !IBV_SEND_SIGNALED;
            }
            let rc = (env.post)(wr);
            if rc != 0 {
                if !req.posted_any {
                    if let Some(index) = req.call_index {
                        // Refused before anything of it reached the queue: take it and the
                        // rest of the call back, as the provider does with a list.
                        self.requests.truncate(self.cursor);
                        outcome.refused = Some((index, rc));
                        return outcome;
                    }
                }
                self.abandon_cursor(seq, env);
                continue;
            }

            // Posted: account for it and move the request on.
            if let Some(t) = req.blocked_since.take() {
                add(
                    &env.counters.pacing_delay_ns,
                    u64::try_from(now.saturating_sub(t).as_nanos()).unwrap_or(u64::MAX),
                );
            }
            if !req.posted_any {
                req.posted_any = true;
                add(&env.counters.requests, 1);
                add(&env.counters.bytes, u64::from(req.len));
                if req.split {
                    add(&env.counters.split_requests, 1);
                }
            }
            req.inflight += 1;
            self.unsignaled_run = if signaled { 0 } else { self.unsignaled_run + 1 };
            self.posted.push_back(Posted {
                seq,
                wr_id: req.wr_id,
                signaled,
                visible,
            });
            match &mut req.body {
                Body::Whole(_) => {}
                Body::Split(s) => {
                    if is_yield {
                        s.yields_due -= 1;
                        add(&env.counters.yields, 1);
                    } else {
                        add(&env.counters.chunks, 1);
                        if let Some(chunk) = s.next.take() {
                            s.yields_due = s.planner.map_or(0, |p| p.yields_after(&chunk));
                        }
                        s.next = s.plan.next();
                    }
                }
            }
            if is_last {
                req.done_posting = true;
                self.cursor += 1;
            }
        }
    }

    /// Gives up on the request at the cursor after the provider refused one of its WQEs:
    /// it gets one error completion, and what was not posted of it is dropped.
    fn abandon_cursor(&mut self, seq: u64, env: &mut DrainEnv<'_>) {
        let qp_num = self.qp_num;
        if let Some(req) = self.requests.get_mut(self.cursor) {
            if !req.reported {
                req.reported = true;
                add(&env.counters.errors, 1);
                env.synthesized.push(error_wc(
                    req.wr_id,
                    IBV_WC_GENERAL_ERR,
                    req.wc_opcode,
                    qp_num,
                ));
            }
            req.done_posting = true;
            req.call_index = None;
            self.cursor += 1;
        }
        crate::log::log!(
            Warn,
            "QP {qp_num}: the provider refused a work request of request #{seq}; it completes with an error"
        );
        self.retire_front();
    }

    /// Retires requests at the front that are fully posted and complete.
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
            if let Some(r) = self
                .requests
                .get_mut(usize::try_from(p.seq - self.first_seq).unwrap_or(usize::MAX))
            {
                r.inflight = r.inflight.saturating_sub(1);
            }
        }
    }

    /// Translates one completion of this QP (`wc.qp_num` matched).
    pub fn complete(
        &mut self,
        wc: &mut ibv_wc,
        counters: &Counters,
        synthesized: &mut Vec<ibv_wc>,
    ) -> Verdict {
        if wc.status == IBV_WC_SUCCESS {
            if wc.opcode & IBV_WC_RECV != 0 {
                return Verdict::NotOurs;
            }
            let Some(index) = self.posted.iter().position(|p| p.signaled) else {
                return Verdict::NotOurs;
            };
            let entry = self.posted[index];
            let info = self.request_info(entry.seq);
            self.pop_posted_through(index);
            self.retire_front();
            return match info {
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
        }

        // An error. Every WQE of a request carries the request's wr_id, so the completion
        // names the request but not which of its WQEs failed: unsignaled ones ahead of the
        // failed one completed silently. The whole request is taken off the FIFO, and up
        // to its remaining WQE count of flushes with its wr_id that follow are its own.
        // From then on every posted WQE completes (flushed), in order.
        if self.failed {
            if let Some((wr_id, left)) = self.stray.as_mut() {
                if *wr_id == wc.wr_id && *left > 0 {
                    *left -= 1;
                    return Verdict::Hide;
                }
                self.stray = None;
            }
        }
        let window = if self.failed {
            1
        } else {
            self.posted
                .iter()
                .position(|p| p.signaled)
                .map_or(self.posted.len(), |i| i + 1)
        };
        let Some(index) = self
            .posted
            .iter()
            .take(window)
            .position(|p| p.wr_id == wc.wr_id)
        else {
            return Verdict::NotOurs;
        };
        let entry = self.posted[index];
        let last = self
            .posted
            .iter()
            .rposition(|p| p.seq == entry.seq)
            .unwrap_or(index);
        let through = if self.failed {
            index
        } else {
            self.stray = Some((entry.wr_id, u32::try_from(last - index).unwrap_or(u32::MAX)));
            last
        };
        let info = self.request_info(entry.seq);
        self.failed = true;
        self.pop_posted_through(through);
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
        self.flush_if_idle(counters, synthesized);
        verdict
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

    /// After a failure, once the hardware has flushed everything posted: one flush error
    /// for every request that has not had its completion, and an empty queue.
    fn flush_if_idle(&mut self, counters: &Counters, synthesized: &mut Vec<ibv_wc>) {
        if !self.failed || !self.posted.is_empty() {
            return;
        }
        self.first_seq += self.requests.len() as u64;
        for r in self.requests.drain(..) {
            if !r.reported {
                Counters::add(&counters.errors, 1);
                synthesized.push(error_wc(
                    r.wr_id,
                    IBV_WC_WR_FLUSH_ERR,
                    r.wc_opcode,
                    self.qp_num,
                ));
            }
        }
        self.cursor = 0;
    }

    /// The QP was reset: the hardware forgot its queue, so does the shaper.
    pub fn reset(&mut self) {
        self.first_seq += self.requests.len() as u64;
        self.requests.clear();
        self.posted.clear();
        self.cursor = 0;
        self.unsignaled_run = 0;
        self.failed = false;
        self.stray = None;
    }

    /// The QP was moved to the error state: what is posted will be flushed.
    pub fn set_failed(&mut self) {
        self.failed = true;
    }
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

/// The work request for one chunk, carrying the original request's `wr_id` (the planner
/// leaves intermediate chunks at 0; the shaper wants an error on any chunk to name the
/// application's request).
fn chunk_to_wr(chunk: &mut Chunk, wr_id: u64) -> ibv_send_wr {
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
    let sges = req.sges.as_slice();
    let mut wr = ibv_send_wr {
        wr_id,
        next: std::ptr::null_mut(),
        // Sge has the layout of ibv_sge (checked in the core); the provider copies the list
        // during the post call, while the chunk is borrowed.
        sg_list: if sges.is_empty() {
            std::ptr::null_mut()
        } else {
            sges.as_ptr().cast::<ibv_sge>().cast_mut()
        },
        num_sge: c_int::try_from(sges.len()).unwrap_or(0),
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

/// A yield: the core's zero-length unsignaled WRITE, aimed at the request's own remote
/// address and key (a responder need not check them for a zero-length write, but this
/// keeps even a strict one content), carrying the request's `wr_id`.
fn yield_wr_for(original: &WorkRequest, wr_id: u64) -> ibv_send_wr {
    let mut y = yield_request();
    y.remote = original.remote.or(y.remote);
    let mut wr = ibv_send_wr {
        wr_id,
        opcode: IBV_WR_RDMA_WRITE,
        ..Default::default()
    };
    if let Some(remote) = y.remote {
        wr.wr.rdma.remote_addr = remote.addr;
        wr.wr.rdma.rkey = remote.rkey;
    }
    wr
}
