//! The checker on real verbs: two connected RC queue pairs in one process, the memory
//! regions the plans place data in, and the checks of every completion and every byte.

use std::ptr::NonNull;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use justitia_verbs::sys::*;
use justitia_verbs::{
    CompletionQueue, Context, Ibverbs, MemoryRegion, ProtectionDomain, QpCaps, QueuePair,
    RecvRequest, SendRequest, VerbsError,
};

use crate::ledger::Ledger;
use crate::pattern;
use crate::plan::{Batch, Operation, Placement, PlanConfig, Transfer, GUARD};
use crate::post_api::{create_wr_requester, post_wr, send_ops_flags, send_ops_names, PostApi};

/// Why a run stopped. Data mismatches do not stop a run; they are counted in [`Report`].
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// Setting up or using the verbs failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// `--post-api wr` was asked for, but no QP with the extended send interface could be
    /// had. The checker does not fall back to `ibv_post_send`.
    #[error(
        "--post-api wr needs an RC QP from ibv_create_qp_ex with send ops {ops} on {device}, \
         and it is not available there (no fallback to ibv_post_send; use --post-api \
         post-send to check the classic path): {reason}"
    )]
    ExtendedApiUnsupported {
        /// The device.
        device: String,
        /// The send-ops flags asked for, by name.
        ops: String,
        /// What failed.
        reason: String,
    },
    /// A completion was wrong (status, identity, order, opcode, length, immediate).
    #[error("bad completion on the {queue} queue: {detail}")]
    Completion {
        /// Which completion queue (`send` or `receive`).
        queue: &'static str,
        /// What was expected and what came.
        detail: String,
    },
    /// Expected completions did not arrive in time.
    #[error("timed out after {waited:?} waiting for {missing} completion(s) on the {queue} queue (next expected wr_id {next_wr_id:#x})")]
    Timeout {
        /// Which completion queue.
        queue: &'static str,
        /// How long the checker waited.
        waited: Duration,
        /// How many were still missing.
        missing: usize,
        /// The `wr_id` of the first missing one.
        next_wr_id: u64,
    },
}

/// How to set the checker up.
#[derive(Clone, Debug)]
pub struct RigOptions {
    /// Device name (`None`: the first device).
    pub device: Option<String>,
    /// Port number.
    pub port: u8,
    /// GID index (0 is the IPv6 link-local GID on Soft-RoCE).
    pub gid_index: u8,
    /// How long to wait for the completions of one batch.
    pub completion_timeout: Duration,
    /// How the requester posts: `ibv_post_send`, or `ibv_wr_*` on a QP from
    /// `ibv_create_qp_ex`.
    pub post_api: PostApi,
}

/// Counts of what a run checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Requests posted and checked.
    pub transfers: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// RDMA WRITEs.
    pub writes: u64,
    /// RDMA READs.
    pub reads: u64,
    /// RDMA WRITE_WITH_IMMs.
    pub writes_with_imm: u64,
    /// Requests posted without `IBV_SEND_SIGNALED`.
    pub unsignaled: u64,
    /// Send completions checked.
    pub send_completions: u64,
    /// Receive completions checked.
    pub recv_completions: u64,
    /// Transfers whose destination differed from the source.
    pub mismatched_transfers: u64,
    /// Transfers that changed guard bytes outside their destination.
    pub overruns: u64,
    /// Completions that arrived in order with the right `wr_id` and status but carried a
    /// wrong detail (opcode, byte count, immediate, queue pair).
    pub bad_completions: u64,
    /// The first few mismatches, described.
    pub problems: Vec<String>,
}

impl Report {
    /// Problems kept in [`Report::problems`]; later ones are only counted.
    const KEEP: usize = 20;

    /// True when every byte and every completion matched and nothing was overwritten.
    pub fn clean(&self) -> bool {
        self.mismatched_transfers == 0 && self.overruns == 0 && self.bad_completions == 0
    }

    /// Adds the counts of `other` (another rig's run) to these, keeping the first
    /// problems of both up to the limit.
    pub fn absorb(&mut self, other: Report) {
        self.transfers += other.transfers;
        self.bytes += other.bytes;
        self.writes += other.writes;
        self.reads += other.reads;
        self.writes_with_imm += other.writes_with_imm;
        self.unsignaled += other.unsignaled;
        self.send_completions += other.send_completions;
        self.recv_completions += other.recv_completions;
        self.mismatched_transfers += other.mismatched_transfers;
        self.overruns += other.overruns;
        self.bad_completions += other.bad_completions;
        for p in other.problems {
            self.problem(p);
        }
    }

    pub(crate) fn problem(&mut self, text: String) {
        if self.problems.len() < Self::KEEP {
            self.problems.push(text);
        }
    }
}

/// One destination range and the guard bytes around it, as they were before posting.
struct Guarded {
    remote: bool,
    at: Placement,
    before: Vec<u8>,
    after: Vec<u8>,
}

/// The queue pair that posts every request, and its extended send interface when the
/// chosen [`PostApi`] is `wr`.
struct Requester {
    qp: QueuePair,
    wr: Option<NonNull<ibv_qp_ex>>,
}

// SAFETY: `wr` points into the QP that `qp` keeps alive, and verbs objects may be used from
// any thread (as justitia-verbs' own are); the requester is not `Sync`, so one thread at a
// time drives its extended send interface.
unsafe impl Send for Requester {}

impl Requester {
    /// Posts `requests` with one `ibv_post_send` call, or between one `ibv_wr_start` and
    /// one `ibv_wr_complete`.
    fn post(&self, requests: &[SendRequest]) -> Result<(), VerbsError> {
        match self.wr {
            // SAFETY: the extended form of self.qp, which is live; the rig, and so the QP,
            // is driven by one thread.
            Some(qpx) => unsafe { post_wr(qpx.as_ptr(), requests) },
            None => self.qp.post_send(requests),
        }
    }
}

/// Two connected RC queue pairs on one device and the memory the plans use: the
/// *requester* posts every request; the *responder* only posts receives for
/// WRITE_WITH_IMM. Both live in this process, so on Soft-RoCE the traffic loops back
/// inside rxe.
pub struct Rig {
    verbs: Arc<Ibverbs>,
    ctx: Context,
    send: SendCompletions,
    recv_cq: CompletionQueue,
    requester: Requester,
    responder: QueuePair,
    local: Vec<MemoryRegion>,
    remote: Vec<MemoryRegion>,
    timeout: Duration,
    /// Where signaled requests are entered before posting, when several rigs share one
    /// send CQ.
    ledger: Option<Arc<Mutex<Ledger>>>,
    // Kept alive for the objects above.
    _pd: ProtectionDomain,
    _unused_cq: CompletionQueue,
}

/// Where a rig's send completions come from: its own CQ, or the thread that polls a send
/// CQ several rigs share, which hands each rig the completions of its requester's QP.
enum SendCompletions {
    Own(CompletionQueue),
    Routed(Receiver<ibv_wc>),
}

impl SendCompletions {
    /// Up to `wc.len()` completions. A routed rig waits up to 2 ms for the first one, so
    /// that a thread waiting on the router sleeps instead of spinning.
    fn poll(&self, wc: &mut [ibv_wc]) -> Result<usize, VerbsError> {
        let rx = match self {
            SendCompletions::Own(cq) => return cq.poll(wc),
            SendCompletions::Routed(rx) => rx,
        };
        let stopped =
            || VerbsError::InvalidArgument("the thread polling the shared send CQ stopped".into());
        let mut n = 0;
        while n < wc.len() {
            let next = if n == 0 {
                match rx.recv_timeout(Duration::from_millis(2)) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return Err(stopped()),
                }
            } else {
                match rx.try_recv() {
                    Ok(c) => Some(c),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return Err(stopped()),
                }
            };
            let Some(c) = next else { break };
            wc[n] = c;
            n += 1;
        }
        Ok(n)
    }
}

/// An open device and its protection domain.
struct Opened {
    verbs: Arc<Ibverbs>,
    ctx: Context,
    pd: ProtectionDomain,
}

/// The objects several rigs share: the device, a protection domain and one send CQ that
/// all their requesters complete into.
pub struct SharedSendCq {
    verbs: Arc<Ibverbs>,
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
}

impl SharedSendCq {
    /// Opens the device and creates a send CQ deep enough for `rigs` rigs of `plan`.
    pub fn open(options: &RigOptions, plan: &PlanConfig, rigs: usize) -> Result<Self, CheckError> {
        let verbs = Arc::new(Ibverbs::load()?);
        let ctx = Context::open(Arc::clone(&verbs), options.device.as_deref())?;
        let pd = ProtectionDomain::new(&ctx)?;
        let depth = u32::try_from(rigs.max(1))
            .unwrap_or(u32::MAX)
            .saturating_mul(queue_depth(plan));
        let cq = CompletionQueue::new(&ctx, depth, None)?;
        Ok(SharedSendCq { verbs, ctx, pd, cq })
    }

    /// The shared CQ, for the thread that polls it.
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        self.ctx.name()
    }

    /// A rig whose requester completes into the shared CQ. The completions of its QP
    /// ([`Rig::requester_qp_num`]) must be handed to it through `routed`; it enters each
    /// signaled request in `ledger` before posting it.
    pub fn rig(
        &self,
        options: &RigOptions,
        plan: &PlanConfig,
        routed: Receiver<ibv_wc>,
        ledger: Arc<Mutex<Ledger>>,
    ) -> Result<Rig, CheckError> {
        let dev = Opened {
            verbs: Arc::clone(&self.verbs),
            ctx: self.ctx.clone(),
            pd: self.pd.clone(),
        };
        let mut rig = Rig::build(
            dev,
            &self.cq,
            SendCompletions::Routed(routed),
            options,
            plan,
        )?;
        rig.ledger = Some(ledger);
        Ok(rig)
    }
}

/// Send and receive queue depth (and per-rig CQ depth) for batches of `plan`.
pub(crate) fn queue_depth(plan: &PlanConfig) -> u32 {
    batch_queue_depth(plan.max_batch)
}

/// Queue depth for batches of up to `max_batch` requests: room for four batches and more.
pub(crate) fn batch_queue_depth(max_batch: usize) -> u32 {
    4 * u32::try_from(max_batch.max(1)).unwrap_or(u32::MAX / 8) + 16
}

impl Rig {
    /// Loads libibverbs, opens the device and connects the two queue pairs, with regions
    /// large enough for any batch of `plan`.
    pub fn open(options: &RigOptions, plan: &PlanConfig) -> Result<Self, CheckError> {
        let verbs = Arc::new(Ibverbs::load()?);
        let ctx = Context::open(Arc::clone(&verbs), options.device.as_deref())?;
        let pd = ProtectionDomain::new(&ctx)?;
        let send_cq = CompletionQueue::new(&ctx, queue_depth(plan), None)?;
        let own = SendCompletions::Own(send_cq.clone());
        Self::build(Opened { verbs, ctx, pd }, &send_cq, own, options, plan)
    }

    /// The rig on an open device: the requester completes into `send_cq`, whose
    /// completions reach the rig through `send`.
    fn build(
        dev: Opened,
        send_cq: &CompletionQueue,
        send: SendCompletions,
        options: &RigOptions,
        plan: &PlanConfig,
    ) -> Result<Self, CheckError> {
        let Opened { verbs, ctx, pd } = dev;
        let depth = queue_depth(plan);
        let recv_cq = CompletionQueue::new(&ctx, depth, None)?;
        let unused_cq = CompletionQueue::new(&ctx, 16, None)?;
        let sges = u32::try_from(plan.max_sges.max(1)).unwrap_or(u32::MAX);
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: sges,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let requester = match options.post_api {
            PostApi::PostSend => Requester {
                qp: QueuePair::create_rc(&pd, send_cq, &unused_cq, caps)?,
                wr: None,
            },
            PostApi::Wr => {
                let (qp, qpx) = create_wr_requester(&pd, send_cq, &unused_cq, caps, plan.with_imm)
                    .map_err(|reason| CheckError::ExtendedApiUnsupported {
                        device: ctx.name().to_string(),
                        ops: send_ops_names(send_ops_flags(plan.with_imm)),
                        reason,
                    })?;
                Requester { qp, wr: Some(qpx) }
            }
        };
        let responder = QueuePair::create_rc(&pd, &unused_cq, &recv_cq, caps)?;
        let (port, gid) = (options.port, options.gid_index);
        let psn_a = 0x1234;
        let psn_b = 0x5678;
        let a = requester.qp.endpoint(port, gid, psn_a)?;
        let b = responder.endpoint(port, gid, psn_b)?;
        requester.qp.connect(port, gid, psn_a, &b)?;
        responder.connect(port, gid, psn_b, &a)?;
        let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
        let region = |_| MemoryRegion::new(&pd, plan.region_len(), access);
        let local = (0..plan.local_regions.max(1))
            .map(region)
            .collect::<Result<Vec<_>, _>>()?;
        let remote = (0..plan.remote_regions.max(1))
            .map(region)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Rig {
            verbs,
            ctx,
            send,
            recv_cq,
            requester,
            responder,
            local,
            remote,
            timeout: options.completion_timeout,
            ledger: None,
            _pd: pd,
            _unused_cq: unused_cq,
        })
    }

    /// The requester's queue pair number (the one its send completions carry).
    pub fn requester_qp_num(&self) -> u32 {
        self.requester.qp.qp_num()
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        self.ctx.name()
    }

    fn bytes_mut(&mut self, remote: bool, at: &Placement) -> &mut [u8] {
        let regions = if remote {
            &mut self.remote
        } else {
            &mut self.local
        };
        &mut regions[at.region].as_mut_slice()[at.offset..at.offset + at.len]
    }

    fn bytes(&self, remote: bool, at: &Placement) -> &[u8] {
        let regions = if remote { &self.remote } else { &self.local };
        &regions[at.region].as_slice()[at.offset..at.offset + at.len]
    }

    /// Posts one batch, checks its completions and then its data, adding to `report`.
    pub fn run_batch(&mut self, batch: &Batch, report: &mut Report) -> Result<(), CheckError> {
        let guards = self.prepare(batch);

        let mut receives = Vec::new();
        for t in batch
            .transfers
            .iter()
            .filter(|t| t.op == Operation::WriteWithImm)
        {
            // The receive's own wr_id mirrors the request's; its SGE list stays empty
            // because a write with immediate places no data through the receive.
            let rr = RecvRequest {
                wr_id: !t.wr_id,
                sges: Vec::new(),
            };
            self.responder.post_recv(std::slice::from_ref(&rr))?;
            receives.push(t);
        }

        let requests = batch
            .transfers
            .iter()
            .map(|t| self.request(t))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(ledger) = &self.ledger {
            let qpn = self.requester.qp.qp_num();
            let mut l = ledger.lock().unwrap_or_else(PoisonError::into_inner);
            for t in batch.transfers.iter().filter(|t| t.signaled) {
                l.expect(qpn, t.wr_id);
            }
        }
        // One ibv_post_send call, or one ibv_wr_start ... ibv_wr_complete, per list.
        if batch.post_as_list {
            self.requester.post(&requests)?;
        } else {
            for r in &requests {
                self.requester.post(std::slice::from_ref(r))?;
            }
        }

        let signaled: Vec<&Transfer> = batch.transfers.iter().filter(|t| t.signaled).collect();
        let requester_qpn = self.requester.qp.qp_num();
        let responder_qpn = self.responder.qp_num();
        let verbs = Arc::clone(&self.verbs);
        wait_for(
            |wc| self.send.poll(wc),
            "send",
            &signaled,
            self.timeout,
            report,
            |wc, t| check_send_completion(&verbs, wc, t, requester_qpn),
        )?;
        wait_for(
            |wc| self.recv_cq.poll(wc),
            "receive",
            &receives,
            self.timeout,
            report,
            |wc, t| check_recv_completion(&verbs, wc, t, responder_qpn),
        )?;
        // Exactly one completion per signaled request: nothing may follow.
        self.expect_no_completion()?;
        report.send_completions += signaled.len() as u64;
        report.recv_completions += receives.len() as u64;

        for t in &batch.transfers {
            self.verify(t, report);
            report.transfers += 1;
            report.bytes += t.len() as u64;
            report.unsignaled += u64::from(!t.signaled);
            match t.op {
                Operation::Write => report.writes += 1,
                Operation::Read => report.reads += 1,
                Operation::WriteWithImm => report.writes_with_imm += 1,
            }
        }
        for g in guards {
            let (start, end) = (g.at.offset - GUARD, g.at.offset + g.at.len);
            let regions = if g.remote { &self.remote } else { &self.local };
            let mem = regions[g.at.region].as_slice();
            if mem[start..g.at.offset] != g.before[..] || mem[end..end + GUARD] != g.after[..] {
                report.overruns += 1;
                report.problem(format!(
                    "bytes next to the {} range {:?} changed",
                    if g.remote { "remote" } else { "local" },
                    g.at
                ));
            }
        }
        Ok(())
    }

    /// Fails if either completion queue holds a completion nobody asked for.
    fn expect_no_completion(&self) -> Result<(), CheckError> {
        for queue in ["send", "receive"] {
            let mut wc = [ibv_wc::default(); 4];
            let extra = if queue == "send" {
                self.send.poll(&mut wc)?
            } else {
                self.recv_cq.poll(&mut wc)?
            };
            if extra > 0 {
                return Err(CheckError::Completion {
                    queue,
                    detail: format!(
                        "{extra} completion(s) beyond one per signaled request, first wr_id {:#x} status {}",
                        wc[0].wr_id,
                        self.verbs.status_str(wc[0].status)
                    ),
                });
            }
        }
        Ok(())
    }

    /// Ends a run: after a pause long enough for any stray completion of the last batch
    /// (an intermediate chunk wrongly signaled, say) to arrive, none may have.
    pub fn finish(&self) -> Result<(), CheckError> {
        std::thread::sleep(Duration::from_millis(200));
        self.expect_no_completion()
    }

    /// Fills sources with the pattern and destinations with its complement, and returns
    /// the guard bytes around every destination as they are now.
    fn prepare(&mut self, batch: &Batch) -> Vec<Guarded> {
        let mut destinations = Vec::new();
        for t in &batch.transfers {
            let seed = t.pattern_seed;
            let into_remote = t.op != Operation::Read;
            let mut offset = 0;
            for p in &t.local {
                let mem = self.bytes_mut(false, p);
                if into_remote {
                    pattern::fill(seed, offset, mem);
                } else {
                    pattern::fill_complement(seed, offset, mem);
                    destinations.push((false, *p));
                }
                offset += p.len;
            }
            let mem = self.bytes_mut(true, &t.remote);
            if into_remote {
                pattern::fill_complement(seed, 0, mem);
                destinations.push((true, t.remote));
            } else {
                pattern::fill(seed, 0, mem);
            }
        }
        destinations
            .into_iter()
            .map(|(remote, at)| {
                let regions = if remote { &self.remote } else { &self.local };
                let mem = regions[at.region].as_slice();
                let end = at.offset + at.len;
                Guarded {
                    remote,
                    at,
                    before: mem[at.offset - GUARD..at.offset].to_vec(),
                    after: mem[end..end + GUARD].to_vec(),
                }
            })
            .collect()
    }

    fn request(&self, t: &Transfer) -> Result<SendRequest, VerbsError> {
        let sges = local_sges(&self.local, t)?;
        let region = &self.remote[t.remote.region];
        let addr = region.addr() + t.remote.offset as u64;
        let mut r = match t.op {
            Operation::Read => SendRequest::read(t.wr_id, sges, addr, region.rkey()),
            Operation::Write | Operation::WriteWithImm => {
                SendRequest::write(t.wr_id, sges, addr, region.rkey())
            }
        };
        if t.op == Operation::WriteWithImm {
            r.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
            r.imm_data = t.imm;
        }
        r.signaled = t.signaled;
        Ok(r)
    }

    /// Compares the destination of `t` with the pattern, SGE by SGE.
    fn verify(&self, t: &Transfer, report: &mut Report) {
        let mut places: Vec<(bool, Placement, usize)> = Vec::new();
        if t.op == Operation::Read {
            let mut offset = 0;
            for p in &t.local {
                places.push((false, *p, offset));
                offset += p.len;
            }
        } else {
            places.push((true, t.remote, 0));
        }
        let mut bad = Vec::new();
        for (remote, p, start) in places {
            if let Some(m) = pattern::check(t.pattern_seed, start, self.bytes(remote, &p)) {
                bad.push(format!(
                    "{} bytes differ from message offset {} (expected {:#04x}, found {:#04x})",
                    m.bytes, m.first_offset, m.expected, m.found
                ));
            }
        }
        if !bad.is_empty() {
            report.mismatched_transfers += 1;
            report.problem(format!(
                "{} of {} bytes in {} SGE(s), wr_id {:#x}{}: {}",
                t.op.as_str(),
                t.len(),
                t.local.len(),
                t.wr_id,
                if t.signaled { "" } else { " (unsignaled)" },
                bad.join("; ")
            ));
        }
    }
}

/// What is wrong with one completion.
pub(crate) enum Fault {
    /// The completion stream can no longer be trusted (wrong `wr_id`, order or status):
    /// the run stops.
    Fatal(String),
    /// The right completion with a wrong detail: counted, and the run goes on.
    Detail(String),
}

/// What a completion is awaited for: a request known by the `wr_id` it was posted with.
pub(crate) trait Awaited {
    /// The `wr_id` its completion must carry.
    fn awaited_wr_id(&self) -> u64;
}

impl Awaited for Transfer {
    fn awaited_wr_id(&self) -> u64 {
        self.wr_id
    }
}

/// Polls with `poll` until one completion per entry of `expected` has arrived, in order,
/// each accepted by `check`; wrong details are counted in `report`.
pub(crate) fn wait_for<T: Awaited>(
    mut poll: impl FnMut(&mut [ibv_wc]) -> Result<usize, VerbsError>,
    queue: &'static str,
    expected: &[&T],
    timeout: Duration,
    report: &mut Report,
    check: impl Fn(&ibv_wc, &T) -> Result<(), Fault>,
) -> Result<(), CheckError> {
    let start = Instant::now();
    let mut next = 0;
    let mut wc = [ibv_wc::default(); 8];
    while next < expected.len() {
        let n = poll(&mut wc)?;
        for c in &wc[..n] {
            let Some(t) = expected.get(next) else {
                return Err(CheckError::Completion {
                    queue,
                    detail: format!("unexpected extra completion, wr_id {:#x}", c.wr_id),
                });
            };
            match check(c, t) {
                Ok(()) => {}
                Err(Fault::Fatal(detail)) => return Err(CheckError::Completion { queue, detail }),
                Err(Fault::Detail(detail)) => {
                    report.bad_completions += 1;
                    report.problem(format!("{queue} completion: {detail}"));
                }
            }
            next += 1;
        }
        if n == 0 {
            if start.elapsed() > timeout {
                return Err(CheckError::Timeout {
                    queue,
                    waited: timeout,
                    missing: expected.len() - next,
                    next_wr_id: expected[next].awaited_wr_id(),
                });
            }
            // Soft-RoCE does its work in kernel threads; leave them the CPU.
            std::thread::yield_now();
        }
    }
    Ok(())
}

fn describe(t: &Transfer) -> String {
    format!(
        "{} of {} bytes, wr_id {:#x}",
        t.op.as_str(),
        t.len(),
        t.wr_id
    )
}

pub(crate) fn check_send_completion(
    verbs: &Ibverbs,
    wc: &ibv_wc,
    t: &Transfer,
    qp_num: u32,
) -> Result<(), Fault> {
    if wc.wr_id != t.wr_id {
        return Err(Fault::Fatal(format!(
            "expected the completion of {} next, got wr_id {:#x} (status {})",
            describe(t),
            wc.wr_id,
            verbs.status_str(wc.status)
        )));
    }
    if wc.status != IBV_WC_SUCCESS {
        return Err(Fault::Fatal(format!(
            "{} completed with status {} (vendor error {:#x})",
            describe(t),
            verbs.status_str(wc.status),
            wc.vendor_err
        )));
    }
    let opcode = match t.op {
        Operation::Read => IBV_WC_RDMA_READ,
        Operation::Write | Operation::WriteWithImm => IBV_WC_RDMA_WRITE,
    };
    if wc.opcode != opcode {
        return Err(Fault::Detail(format!(
            "{} completed with opcode {} instead of {opcode}",
            describe(t),
            wc.opcode
        )));
    }
    if wc.qp_num != qp_num {
        return Err(Fault::Detail(format!(
            "{} completed for QP {:#x} instead of {qp_num:#x}",
            describe(t),
            wc.qp_num
        )));
    }
    // The byte count of a send-side completion is defined for READs: the bytes placed in
    // local memory, i.e. the whole request even when it travelled in chunks.
    if t.op == Operation::Read && wc.byte_len as usize != t.len() {
        return Err(Fault::Detail(format!(
            "{} completed with byte_len {}",
            describe(t),
            wc.byte_len
        )));
    }
    Ok(())
}

fn check_recv_completion(
    verbs: &Ibverbs,
    wc: &ibv_wc,
    t: &Transfer,
    qp_num: u32,
) -> Result<(), Fault> {
    if wc.wr_id != !t.wr_id {
        return Err(Fault::Fatal(format!(
            "expected the receive for {} next, got wr_id {:#x}",
            describe(t),
            wc.wr_id
        )));
    }
    if wc.status != IBV_WC_SUCCESS {
        return Err(Fault::Fatal(format!(
            "the receive for {} completed with status {}",
            describe(t),
            verbs.status_str(wc.status)
        )));
    }
    if wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || wc.wc_flags & IBV_WC_WITH_IMM == 0 {
        return Err(Fault::Detail(format!(
            "the receive for {} has opcode {} and flags {:#x}, not a write with immediate",
            describe(t),
            wc.opcode,
            wc.wc_flags
        )));
    }
    // SAFETY: with IBV_WC_WITH_IMM set the union holds the immediate (network order).
    let imm = u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data });
    if imm != t.imm {
        return Err(Fault::Detail(format!(
            "the receive for {} carries immediate {imm:#x} instead of {:#x}",
            describe(t),
            t.imm
        )));
    }
    // The responder learns the length of a write with immediate only from this count.
    if wc.byte_len as usize != t.len() {
        return Err(Fault::Detail(format!(
            "the receive for {} reports byte_len {}",
            describe(t),
            wc.byte_len
        )));
    }
    if wc.qp_num != qp_num {
        return Err(Fault::Detail(format!(
            "the receive for {} arrived on QP {:#x} instead of {qp_num:#x}",
            describe(t),
            wc.qp_num
        )));
    }
    Ok(())
}

/// The scatter/gather list of `t`'s local buffers, in message order, in `local`'s regions.
pub(crate) fn local_sges(local: &[MemoryRegion], t: &Transfer) -> Result<Vec<ibv_sge>, VerbsError> {
    t.local
        .iter()
        .map(|p| {
            let len = u32::try_from(p.len)
                .map_err(|_| VerbsError::InvalidArgument(format!("an SGE of {} bytes", p.len)))?;
            local[p.region].sge(p.offset, len)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absorbing_reports_adds_every_count_and_caps_problems() {
        let one = Report {
            transfers: 3,
            bytes: 300,
            writes: 1,
            reads: 1,
            writes_with_imm: 1,
            unsignaled: 2,
            send_completions: 1,
            recv_completions: 1,
            mismatched_transfers: 1,
            overruns: 0,
            bad_completions: 2,
            problems: vec!["a".into(); 15],
        };
        let mut total = Report::default();
        total.absorb(one.clone());
        total.absorb(one);
        assert_eq!(
            (total.transfers, total.bytes, total.writes, total.reads),
            (6, 600, 2, 2)
        );
        assert_eq!((total.writes_with_imm, total.unsignaled), (2, 4));
        assert_eq!((total.send_completions, total.recv_completions), (2, 2));
        assert_eq!(
            (
                total.mismatched_transfers,
                total.overruns,
                total.bad_completions
            ),
            (2, 0, 4)
        );
        assert_eq!(total.problems.len(), Report::KEEP);
        assert!(!total.clean());
    }

    #[test]
    fn a_rig_can_move_to_another_thread() {
        fn send<T: Send>() {}
        send::<Rig>();
    }
}
