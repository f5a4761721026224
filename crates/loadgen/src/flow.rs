//! The two ends of one flow on real verbs.
//!
//! The **requester** posts the flow's requests and measures; it is the process a shaper
//! loaded with `LD_PRELOAD` sees as the application. The **responder** is the far end: it
//! connects its queue pairs, posts receive buffers where the requests are SENDs, answers
//! ping-pongs, and otherwise stays out of the way until the requester hangs up the
//! out-of-band channel.
//!
//! Buffers: each side registers one region of three `size`-byte areas: `[0]` where the
//! peer's WRITEs and SENDs land, `[1]` the source of this side's own requests, `[2]` where
//! RPerf's loopback SENDs land. Many requests in flight share an area, as in perftest:
//! the figures are about moving bytes, not about their contents.
//!
//! Invariants: every request posted is signaled and its completion is polled before the
//! queue pairs are destroyed (a stream stops posting at its stop time and drains, within
//! [`DRAIN_DEADLINE`]); a completion with an error status ends the flow with an error that
//! names the flow, the operation and the status.

/// The ACK timeouts a queue pair may be given (the verbs crate's).
pub use justitia_verbs::{DEFAULT_ACK_TIMEOUT, MAX_ACK_TIMEOUT};
use std::io::BufRead;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use hdrhistogram::Histogram;
use justitia_verbs::sys::{
    ibv_wc, IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE,
    IBV_SEND_INLINE, IBV_WC_SUCCESS,
};
use justitia_verbs::{
    CompletionChannel, CompletionQueue, Context, Ibverbs, MemoryRegion, ProtectionDomain, QpCaps,
    QueuePair, RecvRequest, SendRequest,
};

use crate::clock::Timer;
use crate::oob::{self, Side};
use crate::plan::{FlowOutcome, FlowPlan, LatencyMethod, Op, Percentiles, Polling, Workload};

/// How long a stream may take to see the completions of what it posted before it stopped.
pub const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

/// How long one latency sample may take before the flow gives up.
const SAMPLE_DEADLINE: Duration = Duration::from_secs(10);

/// Receive buffers a responder keeps posted per queue pair beyond the plan's depth.
const RECV_SLACK: u32 = 16;

/// Empty polls in a row after which a loop that may yield does, at every further empty
/// poll. On an RNIC a completion comes within a few microseconds, mostly inside this many
/// polls; on a software RNIC the "NIC" is kernel work that needs the very CPUs the pollers
/// spin on (Soft-RoCE's tasks run in softirq context, or in ksoftirqd when it falls
/// behind), and a poller that never yields holds it off until the next scheduler tick:
/// ping-pongs took 10 to 50 ms instead of 15 us under emulation.
pub const SPINS_BEFORE_YIELD: u32 = 256;

/// What a loop waiting for a timed sample's completion does when a poll finds nothing.
///
/// A yield inside a timed sample puts the scheduler in the sample: with another runnable
/// task on the core (another flow's process, in a run of many) the poller gets the CPU
/// back a time slice later, milliseconds into a microseconds sample. So timed waits spin
/// unless told otherwise, and a yield taken while a sample is timed is counted in the
/// outcome (`yielded_samples`). Loops where nothing is timed (a stream's completions, a
/// stream responder's receives, collecting ping acknowledgements between samples) yield
/// after [`SPINS_BEFORE_YIELD`] empty polls whatever this says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Idle {
    /// Poll again at once: only the poll itself lies between a completion and its time
    /// stamp. For RNICs.
    #[default]
    Spin,
    /// After [`SPINS_BEFORE_YIELD`] empty polls, yield the CPU at each further one: for
    /// software RNICs (Soft-RoCE, siw), whose work needs the CPUs the pollers spin on.
    Yield,
}

/// The patience of one busy-polling loop (see [`Idle`]).
struct Patience {
    idle: Idle,
    empty: u32,
    yields: u64,
}

impl Patience {
    fn new(idle: Idle) -> Self {
        Patience {
            idle,
            empty: 0,
            yields: 0,
        }
    }

    /// A poll found nothing.
    fn idle(&mut self) {
        self.empty = self.empty.saturating_add(1);
        if self.idle == Idle::Yield && self.empty > SPINS_BEFORE_YIELD {
            self.yields += 1;
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }

    /// A poll found something.
    fn busy(&mut self) {
        self.empty = 0;
    }

    /// Whether the loop has yielded the CPU.
    fn yielded(&self) -> bool {
        self.yields > 0
    }
}

/// Which device, port and GID both ends use.
#[derive(Clone, Debug)]
pub struct DeviceOptions {
    /// The device's name; the first device when `None`.
    pub device: Option<String>,
    /// Its port.
    pub port: u8,
    /// The GID index (0 is the link-local GID on Soft-RoCE).
    pub gid_index: u8,
    /// The queue pairs' local ACK timeout (4.096 us x 2^n): above the longest time a
    /// request may wait in the path's queues, or the sender resends what was never lost.
    pub ack_timeout: u8,
}

/// The verbs objects of one end.
struct Rig {
    verbs: Arc<Ibverbs>,
    ctx: Context,
    pd: ProtectionDomain,
    mr: MemoryRegion,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    channel: Option<CompletionChannel>,
    qps: Vec<QueuePair>,
    psns: Vec<u32>,
    size: usize,
    /// The NIC's completion clock, kHz, when `send_cq` carries its time stamps.
    stamps_khz: Option<u64>,
}

fn psn_for(i: usize) -> u32 {
    (std::process::id()
        .wrapping_mul(4099)
        .wrapping_add(i as u32 * 7919))
        & 0xff_ffff
}

fn recvs_per_qp(plan: &FlowPlan) -> u32 {
    match &plan.workload {
        Workload::Latency { .. } => 1 + RECV_SLACK,
        Workload::Stream { depth, .. } => depth + RECV_SLACK,
    }
}

fn sends_per_qp(plan: &FlowPlan) -> u32 {
    match &plan.workload {
        Workload::Latency { .. } => 2,
        Workload::Stream { depth, .. } => *depth,
    }
}

fn message_size(plan: &FlowPlan) -> u64 {
    match &plan.workload {
        Workload::Latency { size, .. } | Workload::Stream { size, .. } => *size,
    }
}

fn inline_wanted(plan: &FlowPlan) -> bool {
    match &plan.workload {
        Workload::Latency { inline, .. } | Workload::Stream { inline, .. } => *inline,
    }
}

impl Rig {
    /// Opens the device and makes the flow's objects. With `nic_stamps`, the send CQ
    /// carries the NIC's completion time stamps when the device offers them (a device
    /// that offers them and refuses the CQ is said once, and the host's clock times the
    /// samples).
    fn open(
        options: &DeviceOptions,
        plan: &FlowPlan,
        event_channel: bool,
        nic_stamps: bool,
    ) -> Result<Rig> {
        let verbs = Arc::new(Ibverbs::load().context("loading libibverbs")?);
        let ctx = Context::open(verbs, options.device.as_deref()).with_context(|| {
            format!(
                "opening device {}",
                options.device.as_deref().unwrap_or("(first)")
            )
        })?;
        let attr = ctx.query_device().context("ibv_query_device")?;
        let pd = ProtectionDomain::new(&ctx).context("allocating a protection domain")?;
        let size = usize::try_from(message_size(plan)).context("message size")?;
        let mr = MemoryRegion::new(
            &pd,
            3 * size,
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
        )
        .with_context(|| format!("registering {} bytes", 3 * size))?;
        let qps = plan.wire_qps();
        let cq_entries = qps * (sends_per_qp(plan).max(recvs_per_qp(plan))) + 8;
        let max_cqe = u32::try_from(attr.max_cqe).unwrap_or(0);
        if cq_entries > max_cqe {
            bail!(
                "{qps} queue pairs x {} requests need a completion queue of {cq_entries} entries; the device allows {max_cqe}",
                sends_per_qp(plan)
            );
        }
        // Non-blocking: the waits are bounded (see `wait_for_event`).
        let channel = if event_channel {
            let channel = CompletionChannel::new(&ctx).context("creating a completion channel")?;
            channel
                .set_nonblocking()
                .context("making the completion channel non-blocking")?;
            Some(channel)
        } else {
            None
        };
        let offered = nic_stamps.then(|| ctx.completion_clock_khz()).flatten();
        let stamped = offered.and_then(|khz| {
            match CompletionQueue::new_timestamped(&ctx, cq_entries, channel.as_ref()) {
                Ok(cq) => Some((cq, khz)),
                Err(e) => {
                    eprintln!(
                        "justitia-loadgen: the device offers completion time stamps but refused a CQ with them ({e}); the host's clock times the samples"
                    );
                    None
                }
            }
        });
        let (send_cq, stamps_khz) = match stamped {
            Some((cq, khz)) => (cq, Some(khz)),
            None => (
                CompletionQueue::new(&ctx, cq_entries, channel.as_ref())
                    .context("creating the send completion queue")?,
                None,
            ),
        };
        // On the same channel: a stream responder sleeps on its receives' events (see
        // `keep_receiving`); a requester arms only its send CQ.
        let recv_cq = CompletionQueue::new(&ctx, cq_entries, channel.as_ref())
            .context("creating the receive completion queue")?;
        let inline = if inline_wanted(plan) && size <= 128 {
            size as u32
        } else {
            0
        };
        let caps = QpCaps {
            max_send_wr: sends_per_qp(plan) + 1,
            max_recv_wr: recvs_per_qp(plan),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: inline,
        };
        let mut rig = Rig {
            verbs: Arc::clone(ctx.verbs()),
            ctx,
            pd,
            mr,
            send_cq,
            recv_cq,
            channel,
            qps: Vec::new(),
            psns: Vec::new(),
            size,
            stamps_khz,
        };
        for i in 0..qps as usize {
            let qp = QueuePair::create_rc(&rig.pd, &rig.send_cq, &rig.recv_cq, caps)
                .with_context(|| format!("creating queue pair {i}"))?;
            rig.qps.push(qp);
            rig.psns.push(psn_for(i));
        }
        Ok(rig)
    }

    fn side(&self, options: &DeviceOptions) -> Result<Side> {
        let qps = self
            .qps
            .iter()
            .zip(&self.psns)
            .map(|(qp, &psn)| qp.endpoint(options.port, options.gid_index, psn))
            .collect::<Result<Vec<_>, _>>()
            .context("querying the port and GID")?;
        Ok(Side {
            qps,
            addr: self.mr.addr(),
            rkey: self.mr.rkey(),
        })
    }

    fn connect(&self, options: &DeviceOptions, peer: &Side) -> Result<()> {
        for (i, ((qp, &psn), remote)) in self.qps.iter().zip(&self.psns).zip(&peer.qps).enumerate()
        {
            qp.connect_with_ack_timeout(
                options.port,
                options.gid_index,
                psn,
                remote,
                options.ack_timeout,
            )
            .with_context(|| format!("connecting queue pair {i}"))?;
        }
        Ok(())
    }

    fn area(&self, index: usize) -> Result<justitia_verbs::sys::ibv_sge> {
        let len = u32::try_from(self.size).context("message size")?;
        self.mr
            .sge(index * self.size, len)
            .context("describing a buffer area")
    }

    fn post_receives(&self, qp: usize, count: u32, area: usize) -> Result<()> {
        let sge = self.area(area)?;
        let requests: Vec<RecvRequest> = (0..count)
            .map(|_| RecvRequest {
                wr_id: qp as u64,
                sges: vec![sge],
            })
            .collect();
        self.qps[qp]
            .post_recv(&requests)
            .with_context(|| format!("posting {count} receives on queue pair {qp}"))
    }

    /// Polls `cq` until it yields one completion or [`SAMPLE_DEADLINE`] passes, idling as
    /// `patience` says.
    fn poll_one(
        &self,
        cq: &CompletionQueue,
        what: &str,
        patience: &mut Patience,
    ) -> Result<ibv_wc> {
        let mut wc = [ibv_wc::default()];
        let started = Instant::now();
        loop {
            if cq.poll(&mut wc).context("ibv_poll_cq")? == 1 {
                check_status(&self.verbs, &wc[0], what)?;
                return Ok(wc[0]);
            }
            patience.idle();
            if started.elapsed() > SAMPLE_DEADLINE {
                bail!(
                    "no completion for {what} within {} s",
                    SAMPLE_DEADLINE.as_secs()
                );
            }
        }
    }
}

fn check_status(verbs: &Ibverbs, wc: &ibv_wc, what: &str) -> Result<()> {
    if wc.status == IBV_WC_SUCCESS {
        return Ok(());
    }
    bail!(
        "{what} completed with an error: {} (status {}, vendor error {:#x})",
        verbs.status_str(wc.status),
        wc.status,
        wc.vendor_err
    )
}

fn request(
    op: Op,
    wr_id: u64,
    sge: justitia_verbs::sys::ibv_sge,
    peer: &Side,
    inline: bool,
) -> SendRequest {
    let mut r = match op {
        Op::Write => SendRequest::write(wr_id, vec![sge], peer.addr, peer.rkey),
        Op::Read => SendRequest::read(wr_id, vec![sge], peer.addr, peer.rkey),
        Op::Send => SendRequest::send(wr_id, vec![sge]),
    };
    if inline && op != Op::Read {
        r.extra_flags |= IBV_SEND_INLINE;
    }
    r
}

/// Whether the plan's requests land in the responder's receive buffers.
fn responder_receives(plan: &FlowPlan) -> bool {
    match &plan.workload {
        Workload::Stream { op, .. } => *op == Op::Send,
        Workload::Latency { op, method, .. } => match method {
            LatencyMethod::Rperf => true,
            LatencyMethod::PostPoll | LatencyMethod::PingPong => *op == Op::Send,
        },
    }
}

/// Runs the responder of `plan` on `stream` (already accepted) until the requester hangs
/// up or `interrupted` is set. `idle` is for its waits that lie inside the requester's
/// samples: a ping-pong's wait for the ping, and a latency flow's receive reposting.
pub fn respond(
    options: &DeviceOptions,
    plan: &FlowPlan,
    mut stream: TcpStream,
    idle: Idle,
    interrupted: &AtomicBool,
) -> Result<()> {
    let receives = responder_receives(plan);
    let stream_receives = receives && matches!(plan.workload, Workload::Stream { .. });
    let mut rig = Rig::open(options, plan, stream_receives, false)?;
    let peer = oob::exchange(&mut stream, &rig.side(options)?, plan.wire_qps())
        .context("exchanging endpoints with the requester")?;
    // Receives can be posted only once a queue pair has left RESET; a SEND that arrives
    // before them waits in the requester's RNR retries (unlimited).
    rig.connect(options, &peer)?;
    if receives {
        for qp in 0..rig.qps.len() {
            rig.post_receives(qp, recvs_per_qp(plan), 0)?;
        }
    }
    // The requester hangs up when it is done; a thread watches for that so that the loops
    // below only read a flag.
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let done = Arc::clone(&done);
        let mut stream = stream
            .try_clone()
            .context("cloning the out-of-band socket")?;
        std::thread::spawn(move || {
            oob::wait_for_hang_up(&mut stream, || false);
            done.store(true, Ordering::Release);
        })
    };
    let stop = || done.load(Ordering::Acquire) || interrupted.load(Ordering::Relaxed);
    let result = match &plan.workload {
        Workload::Latency {
            method: LatencyMethod::PingPong,
            op,
            inline,
            ..
        } => answer_pings(&mut rig, &peer, *op, *inline, idle, &stop).map(|yielded| {
            if yielded > 0 {
                eprintln!(
                    "justitia-loadgen: flow {} (responder): {yielded} answers waited through a \
                     yield of the CPU (--idle yield)",
                    plan.name
                );
            }
        }),
        // A latency flow's SENDs wait on RNR if the receives run out, so its responder
        // polls as the timed loops do. A stream's sleeps on completion events, as a
        // server of many connections does: it only slows down if late, and a poller
        // spinning beside a software RNIC takes the CPU the RNIC's own work needs (a
        // stream of WRITEs has no responder work at all).
        Workload::Latency { .. } if receives => {
            keep_receiving(&rig, Patience::new(idle), None, &stop)
        }
        _ if receives => keep_receiving(
            &rig,
            Patience::new(Idle::Yield),
            rig.channel.as_ref(),
            &stop,
        ),
        _ => {
            while !stop() {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        }
    };
    drop(stream);
    let _ = watcher.join();
    result
}

/// Reposts a receive for every one consumed, until `stop`; with `events`, the receive
/// CQ's completion channel, sleeps on it while the CQ is empty.
fn keep_receiving(
    rig: &Rig,
    mut patience: Patience,
    events: Option<&CompletionChannel>,
    stop: &dyn Fn() -> bool,
) -> Result<()> {
    let mut wcs = vec![ibv_wc::default(); 64];
    while !stop() {
        let mut n = rig
            .recv_cq
            .poll(&mut wcs)
            .context("ibv_poll_cq (receives)")?;
        match (n, events) {
            (0, Some(channel)) => n = poll_or_sleep(&rig.recv_cq, channel, &mut wcs)?,
            (0, None) => patience.idle(),
            _ => patience.busy(),
        }
        for wc in &wcs[..n] {
            check_status(&rig.verbs, wc, "a receive")?;
            let qp = usize::try_from(wc.wr_id).unwrap_or(usize::MAX);
            if qp >= rig.qps.len() {
                bail!("a receive completion for unknown queue pair {}", wc.wr_id);
            }
            rig.post_receives(qp, 1, 0)?;
        }
    }
    Ok(())
}

/// The last byte of area 0, where the peer's ping-pong WRITEs land.
fn landed_mark(rig: &Rig) -> u8 {
    let slice = rig.mr.as_slice();
    // SAFETY: in bounds (area 0 ends at size - 1 < len); read volatile because the RNIC
    // writes it behind the compiler's back.
    unsafe { std::ptr::read_volatile(slice.as_ptr().add(rig.size - 1)) }
}

/// Puts `mark` in the last byte of area 1, the source of this side's requests.
fn set_send_mark(rig: &mut Rig, mark: u8) {
    let at = 2 * rig.size - 1;
    let area = rig.mr.as_mut_slice();
    // SAFETY: in bounds; volatile because the RNIC reads it behind the compiler's back.
    unsafe { std::ptr::write_volatile(area.as_mut_ptr().add(at), mark) };
}

/// perftest's latency responder: answers each ping as soon as it lands. Its wait is inside
/// the requester's round trip, so it idles as `idle` says; returns how many answers
/// followed a wait that yielded the CPU.
fn answer_pings(
    rig: &mut Rig,
    peer: &Side,
    op: Op,
    inline: bool,
    idle: Idle,
    stop: &dyn Fn() -> bool,
) -> Result<u64> {
    let inline = inline && rig.qps[0].caps().max_inline_data as usize >= rig.size;
    let mut expected: u8 = 1;
    let mut wcs = [ibv_wc::default(); 4];
    let sge = rig.area(1)?;
    // Answers are signaled so that the send queue never fills; their completions are
    // polled while waiting for the next ping.
    let mut unacknowledged = 0u32;
    let mut patience = Patience::new(idle);
    let mut yielded = 0u64;
    while !stop() {
        let landed = match op {
            Op::Send => {
                let n = rig
                    .recv_cq
                    .poll(&mut wcs[..1])
                    .context("ibv_poll_cq (receives)")?;
                if n == 1 {
                    check_status(&rig.verbs, &wcs[0], "a ping")?;
                    rig.post_receives(0, 1, 0)?;
                }
                n == 1
            }
            _ => landed_mark(rig) == expected,
        };
        if unacknowledged > 0 {
            let n = rig
                .send_cq
                .poll(&mut wcs)
                .context("ibv_poll_cq (answers)")?;
            for wc in &wcs[..n] {
                check_status(&rig.verbs, wc, "an answer")?;
            }
            unacknowledged -= n as u32;
        }
        if !landed {
            patience.idle();
            continue;
        }
        if patience.yielded() {
            yielded += 1;
        }
        patience = Patience::new(idle);
        // The answer carries the same mark back (the source area's last byte).
        set_send_mark(rig, expected);
        expected = next_mark(expected);
        while unacknowledged >= sends_per_qp_latency() {
            let n = rig
                .send_cq
                .poll(&mut wcs)
                .context("ibv_poll_cq (answers)")?;
            for wc in &wcs[..n] {
                check_status(&rig.verbs, wc, "an answer")?;
            }
            unacknowledged -= n as u32;
        }
        let r = request(
            if op == Op::Send { Op::Send } else { Op::Write },
            0,
            sge,
            peer,
            inline,
        );
        rig.qps[0].post_send(&[r]).context("posting an answer")?;
        unacknowledged += 1;
    }
    Ok(yielded)
}

fn sends_per_qp_latency() -> u32 {
    2
}

/// Ping-pong marks run 1..=255 and wrap, never 0 (the buffer's initial value).
fn next_mark(mark: u8) -> u8 {
    if mark == u8::MAX {
        1
    } else {
        mark + 1
    }
}

/// The start signal: the runner writes a line on the requester's stdin once every flow of
/// the run is connected, so that all begin together.
pub trait StartSignal {
    /// Blocks until the start.
    fn wait(&mut self) -> Result<()>;
}

/// A start signal read as one line from a reader (the runner's pipe).
pub struct LineSignal<R: BufRead>(pub R);

impl<R: BufRead> StartSignal for LineSignal<R> {
    fn wait(&mut self) -> Result<()> {
        let mut line = String::new();
        let n = std::io::Read::take(&mut self.0, 64)
            .read_line(&mut line)
            .context("waiting for the start signal")?;
        if n == 0 {
            bail!("the runner closed the start signal without starting");
        }
        Ok(())
    }
}

/// Runs the requester of `plan` against the responder at the other end of `stream`:
/// connects, says `ready` through `ready`, waits for `start`, runs and measures, timing
/// latency samples with `timer` and waiting for their completions as `idle` says.
#[allow(clippy::too_many_arguments)]
pub fn request_flow(
    options: &DeviceOptions,
    plan: &FlowPlan,
    mut stream: TcpStream,
    timer: &Timer,
    idle: Idle,
    ready: &mut dyn FnMut() -> Result<()>,
    start: &mut dyn StartSignal,
    interrupted: &AtomicBool,
) -> Result<FlowOutcome> {
    let event = matches!(
        plan.workload,
        Workload::Stream {
            polling: Polling::Event,
            ..
        }
    );
    let rperf = matches!(
        plan.workload,
        Workload::Latency {
            method: LatencyMethod::Rperf,
            ..
        }
    );
    let mut rig = Rig::open(options, plan, event, rperf)?;
    let peer = oob::exchange(&mut stream, &rig.side(options)?, plan.wire_qps())
        .context("exchanging endpoints with the responder")?;
    let ping_pong_sends = matches!(
        plan.workload,
        Workload::Latency {
            method: LatencyMethod::PingPong,
            op: Op::Send,
            ..
        }
    );
    rig.connect(options, &peer)?;
    if ping_pong_sends {
        rig.post_receives(0, recvs_per_qp(plan), 0)?;
    }
    let loopback = match &plan.workload {
        Workload::Latency {
            method: LatencyMethod::Rperf,
            ..
        } => Some(Loopback::open(&rig, options)?),
        _ => None,
    };
    ready()?;
    start.wait()?;
    let outcome = match plan.workload.clone() {
        Workload::Stream {
            qps: _,
            depth,
            batch,
            op,
            polling,
            ..
        } => run_stream(&rig, &peer, plan, depth, batch, op, polling, interrupted)?,
        Workload::Latency {
            op,
            method,
            inline,
            interval_us,
            ..
        } => {
            let mut run = LatencyRun {
                plan,
                timer,
                idle,
                interval: Duration::from_secs_f64(interval_us / 1e6),
                interrupted,
            };
            match method {
                LatencyMethod::PostPoll => run.post_poll(&rig, &peer, op, inline)?,
                LatencyMethod::PingPong => run.ping_pong(&mut rig, &peer, op, inline)?,
                LatencyMethod::Rperf => match &loopback {
                    Some(lb) => run.rperf(&rig, &peer, lb, inline)?,
                    None => bail!("RPerf needs its loopback queue pairs"),
                },
            }
        }
    };
    // Hanging up tells the responder to finish.
    drop(stream);
    Ok(FlowOutcome {
        path_mtu: rig.ctx.active_mtu_bytes(options.port).ok(),
        nic_clock_khz: rig.ctx.completion_clock_khz(),
        nic_stamps_read: rig.stamps_khz.is_some(),
        ..outcome
    })
}

/// RPerf's loopback: a second queue pair of the requester connected to a third one of its
/// own, on the same device and port, whose SENDs never leave the RNIC.
struct Loopback {
    out: QueuePair,
    back: QueuePair,
}

impl Loopback {
    fn open(rig: &Rig, options: &DeviceOptions) -> Result<Loopback> {
        let caps = QpCaps {
            max_send_wr: 4,
            max_recv_wr: LOOPBACK_RECEIVES,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: rig.qps[0].caps().max_inline_data,
        };
        let out = QueuePair::create_rc(&rig.pd, &rig.send_cq, &rig.recv_cq, caps)
            .context("creating the loopback queue pair")?;
        let back = QueuePair::create_rc(&rig.pd, &rig.send_cq, &rig.recv_cq, caps)
            .context("creating the loopback's far queue pair")?;
        let (p_out, p_back) = (psn_for(1000), psn_for(1001));
        let e_out = out
            .endpoint(options.port, options.gid_index, p_out)
            .context("querying the loopback's endpoint")?;
        let e_back = back
            .endpoint(options.port, options.gid_index, p_back)
            .context("querying the loopback's endpoint")?;
        let sge = rig.area(2)?;
        let recvs: Vec<RecvRequest> = (0..LOOPBACK_RECEIVES)
            .map(|_| RecvRequest {
                wr_id: LOOPBACK_RECV,
                sges: vec![sge],
            })
            .collect();
        out.connect_with_ack_timeout(
            options.port,
            options.gid_index,
            p_out,
            &e_back,
            options.ack_timeout,
        )
        .context("connecting the loopback queue pair")?;
        back.connect_with_ack_timeout(
            options.port,
            options.gid_index,
            p_back,
            &e_out,
            options.ack_timeout,
        )
        .context("connecting the loopback's far queue pair")?;
        back.post_recv(&recvs)
            .context("posting the loopback's receives")?;
        Ok(Loopback { out, back })
    }
}

/// Receives kept posted on the loopback's far queue pair: one per sample in flight, and
/// the slack a responder keeps.
const LOOPBACK_RECEIVES: u32 = 1 + RECV_SLACK;

/// The loopback's receive completions (on the requester's receive CQ, where only they
/// land during RPerf) and its far queue pair's receives.
struct LoopbackPort<'a> {
    rig: &'a Rig,
    back: &'a QueuePair,
    wcs: [ibv_wc; RECV_BATCH],
    /// Built once: reposting takes a prefix.
    recvs: Vec<RecvRequest>,
}

impl<'a> LoopbackPort<'a> {
    fn new(rig: &'a Rig, back: &'a QueuePair) -> Result<Self> {
        let sge = rig.area(2)?;
        Ok(LoopbackPort {
            rig,
            back,
            wcs: [ibv_wc::default(); RECV_BATCH],
            recvs: (0..RECV_BATCH)
                .map(|_| RecvRequest {
                    wr_id: LOOPBACK_RECV,
                    sges: vec![sge],
                })
                .collect(),
        })
    }
}

impl ReceivePort for LoopbackPort<'_> {
    fn poll(&mut self, max: usize) -> Result<usize> {
        let max = max.min(RECV_BATCH);
        let n = self
            .rig
            .recv_cq
            .poll(&mut self.wcs[..max])
            .context("ibv_poll_cq (loopback receives)")?;
        for wc in &self.wcs[..n] {
            check_status(&self.rig.verbs, wc, "a loopback receive")?;
            if wc.wr_id != LOOPBACK_RECV {
                bail!(
                    "an unexpected receive completion (work request {})",
                    wc.wr_id
                );
            }
        }
        Ok(n)
    }

    fn repost(&mut self, n: u32) -> Result<()> {
        let mut left = usize::try_from(n).context("receives to repost")?;
        while left > 0 {
            let k = left.min(self.recvs.len());
            self.back
                .post_recv(&self.recvs[..k])
                .with_context(|| format!("reposting {k} loopback receives"))?;
            left -= k;
        }
        Ok(())
    }
}

/// The loopback's receive side as RPerf's loop drives it: a trait so that the accounting
/// in [`ReceiveLedger`] is tested without an RNIC.
trait ReceivePort {
    /// Takes up to `max` receive completions (their status checked); how many.
    fn poll(&mut self, max: usize) -> Result<usize>;
    /// Posts `n` receives again.
    fn repost(&mut self, n: u32) -> Result<()>;
}

/// Receives posted on the loopback's far queue pair that no loopback SEND has been posted
/// against yet.
///
/// Invariant: a loopback SEND is posted only against a free receive, so the receives
/// outstanding are never fewer than the SENDs the near queue pair may have in flight, and
/// no SEND waits on RNR retries. The count goes down when a SEND is posted, not when its
/// receive completion is polled, and up only when a completion is polled and its receive
/// posted again; every completion polled is given back, whenever it is polled. (Taking at
/// most one completion, in one poll after each pair, never caught up: one SEND lands per
/// sample, so a completion not yet there at its poll stayed behind for good, one receive
/// fewer, and a stretch of 17 such left the loopback waiting on RNR until the sample's
/// 10 s deadline.)
struct ReceiveLedger {
    free: u32,
}

/// Receive completions taken per poll of the loopback's receive queue.
const RECV_BATCH: usize = 16;

impl ReceiveLedger {
    fn new(posted: u32) -> Self {
        ReceiveLedger { free: posted }
    }

    /// Before a loopback SEND is posted: gives back what has completed, and while no
    /// receive is free, waits for one to complete (until `deadline`) rather than let the
    /// SEND wait on RNR.
    fn make_room(&mut self, port: &mut impl ReceivePort, deadline: Instant) -> Result<()> {
        self.settle(port)?;
        while self.free == 0 {
            if Instant::now() > deadline {
                bail!(
                    "no loopback receive completed before the sample's deadline: all \
                     {} are consumed and none has been given back",
                    LOOPBACK_RECEIVES
                );
            }
            std::hint::spin_loop();
            self.settle(port)?;
        }
        Ok(())
    }

    /// A loopback SEND is about to be posted: it will consume a free receive.
    fn claim(&mut self) -> Result<()> {
        if self.free == 0 {
            bail!("no loopback receive left: the loopback SEND would wait on RNR");
        }
        self.free -= 1;
        Ok(())
    }

    /// Takes every receive completion the port has now and posts as many receives again.
    fn settle(&mut self, port: &mut impl ReceivePort) -> Result<()> {
        loop {
            let n = port.poll(RECV_BATCH)?;
            if n == 0 {
                return Ok(());
            }
            let n = u32::try_from(n).context("receive completions polled")?;
            port.repost(n)?;
            self.free += n;
        }
    }
}

const WIRE: u64 = 1;
const LOOP: u64 = 2;
const LOOPBACK_RECV: u64 = u64::MAX;

/// Samples of one latency flow.
struct Samples {
    latency: Histogram<u64>,
    loopback: Option<Histogram<u64>>,
    wire: Option<Histogram<u64>>,
    negative: u64,
    /// Samples whose wait yielded the CPU.
    yielded: u64,
}

fn histogram() -> Result<Histogram<u64>> {
    Histogram::new(3).context("creating a latency histogram")
}

/// Records a sample of `ns`, at least 1 ns and at most an hour. `record` grows the
/// histogram to the value; only if growing failed does the sample count at the largest
/// value tracked (`saturating_record` never grows, so alone it would pin every sample
/// to the histogram's first range).
fn record(h: &mut Histogram<u64>, ns: f64) {
    let v = (ns.max(1.0) as u64).min(3_600_000_000_000);
    if h.record(v).is_err() {
        h.saturating_record(v);
    }
}

fn percentiles(h: &Histogram<u64>) -> Option<Percentiles> {
    if h.is_empty() {
        return None;
    }
    let us = |ns: u64| ns as f64 / 1e3;
    Some(Percentiles {
        samples: h.len(),
        p50_us: us(h.value_at_quantile(0.5)),
        p99_us: us(h.value_at_quantile(0.99)),
        p999_us: us(h.value_at_quantile(0.999)),
        mean_us: h.mean() / 1e3,
        max_us: us(h.max()),
    })
}

/// `h` as [`FlowOutcome::latency_histogram`] gives it: `[ns, count]` for each bucket that
/// holds samples, named by the largest value the bucket holds.
fn histogram_export(h: &Histogram<u64>) -> Vec<[u64; 2]> {
    h.iter_recorded()
        .map(|v| [v.value_iterated_to(), v.count_at_value()])
        .collect()
}

struct LatencyRun<'a> {
    plan: &'a FlowPlan,
    timer: &'a Timer,
    idle: Idle,
    interval: Duration,
    interrupted: &'a AtomicBool,
}

impl LatencyRun<'_> {
    /// Runs `sample` once per message from the plan's start to its stop, each returning
    /// its figures in ns; counts those that end inside the window.
    fn each(
        &mut self,
        samples: &mut Samples,
        mut sample: impl FnMut() -> Result<Sample>,
    ) -> Result<FlowOutcome> {
        let begun = Instant::now();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        while ms(begun.elapsed()) < self.plan.start_ms {
            std::hint::spin_loop();
        }
        let mut next = Instant::now();
        let mut messages = 0u64;
        loop {
            if self.interrupted.load(Ordering::Relaxed) {
                bail!("interrupted");
            }
            let now = Instant::now();
            if ms(now - begun) >= self.plan.stop_ms {
                break;
            }
            if now < next {
                continue;
            }
            next = now + self.interval;
            let s = sample()?;
            let at = ms(begun.elapsed());
            if at >= self.plan.window_from_ms && at < self.plan.window_to_ms {
                messages += 1;
                record(&mut samples.latency, s.latency_ns);
                if let (Some(h), Some(v)) = (samples.loopback.as_mut(), s.loopback_ns) {
                    record(h, v);
                }
                if let (Some(h), Some(v)) = (samples.wire.as_mut(), s.wire_ns) {
                    record(h, v);
                }
                if s.negative {
                    samples.negative += 1;
                }
                if s.yielded {
                    samples.yielded += 1;
                }
            }
        }
        let size = message_size(self.plan);
        Ok(FlowOutcome {
            name: self.plan.name.clone(),
            messages,
            bytes: messages * size,
            window_s: (self.plan.window_to_ms - self.plan.window_from_ms) / 1e3,
            latency: percentiles(&samples.latency),
            loopback: samples.loopback.as_ref().and_then(percentiles),
            wire: samples.wire.as_ref().and_then(percentiles),
            negative_samples: samples.negative,
            clock: self.timer.describe(),
            yielded_samples: samples.yielded,
            latency_histogram: histogram_export(&samples.latency),
            path_mtu: None,
            nic_clock_khz: None,
            nic_stamps_read: false,
        })
    }

    fn post_poll(&mut self, rig: &Rig, peer: &Side, op: Op, inline: bool) -> Result<FlowOutcome> {
        let inline = inline && rig.qps[0].caps().max_inline_data as usize >= rig.size;
        let sge = rig.area(1)?;
        let r = request(op, WIRE, sge, peer, inline);
        let timer = self.timer;
        let idle = self.idle;
        let what = format!("a {} request", op.as_str().to_uppercase());
        let mut samples = Samples {
            latency: histogram()?,
            loopback: None,
            wire: None,
            negative: 0,
            yielded: 0,
        };
        self.each(&mut samples, || {
            let mut patience = Patience::new(idle);
            let t0 = timer.now();
            rig.qps[0]
                .post_send(std::slice::from_ref(&r))
                .with_context(|| format!("posting {what}"))?;
            rig.poll_one(&rig.send_cq, &what, &mut patience)?;
            let t1 = timer.now();
            Ok(Sample::plain(
                timer.ns(t1.wrapping_sub(t0)),
                patience.yielded(),
            ))
        })
    }

    fn ping_pong(
        &mut self,
        rig: &mut Rig,
        peer: &Side,
        op: Op,
        inline: bool,
    ) -> Result<FlowOutcome> {
        let inline = inline && rig.qps[0].caps().max_inline_data as usize >= rig.size;
        let op = if op == Op::Send { Op::Send } else { Op::Write };
        let sge = rig.area(1)?;
        let timer = self.timer;
        let idle = self.idle;
        let mut mark: u8 = 1;
        let mut unacknowledged = 0u32;
        let mut samples = Samples {
            latency: histogram()?,
            loopback: None,
            wire: None,
            negative: 0,
            yielded: 0,
        };
        let mut wcs = [ibv_wc::default(); 2];
        self.each(&mut samples, || {
            set_send_mark(rig, mark);
            let r = request(op, WIRE, sge, peer, inline);
            let t0 = timer.now();
            rig.qps[0].post_send(&[r]).context("posting a ping")?;
            let started = Instant::now();
            let mut patience = Patience::new(idle);
            // The answer: a receive completion (SEND) or the mark in area 0 (WRITE).
            loop {
                let answered = match op {
                    Op::Send => {
                        let n = rig
                            .recv_cq
                            .poll(&mut wcs[..1])
                            .context("ibv_poll_cq (answers)")?;
                        if n == 1 {
                            check_status(&rig.verbs, &wcs[0], "an answer")?;
                        }
                        n == 1
                    }
                    _ => landed_mark(rig) == mark,
                };
                if answered {
                    break;
                }
                patience.idle();
                if started.elapsed() > SAMPLE_DEADLINE {
                    bail!(
                        "no answer to ping {mark} within {} s",
                        SAMPLE_DEADLINE.as_secs()
                    );
                }
            }
            let t1 = timer.now();
            // The pings' own completions (their ACKs) are collected without waiting, as
            // perftest does; only a full send queue waits for one.
            unacknowledged += 1;
            let n = rig.send_cq.poll(&mut wcs).context("ibv_poll_cq (pings)")?;
            for wc in &wcs[..n] {
                check_status(&rig.verbs, wc, "a ping")?;
            }
            unacknowledged -= n as u32;
            if unacknowledged >= sends_per_qp_latency() {
                // Between samples: nothing is timed, so this wait may yield.
                rig.poll_one(&rig.send_cq, "a ping", &mut Patience::new(Idle::Yield))?;
                unacknowledged -= 1;
            }
            if op == Op::Send {
                rig.post_receives(0, 1, 0)?;
            }
            mark = next_mark(mark);
            Ok(Sample::plain(
                timer.ns(t1.wrapping_sub(t0)) / 2.0,
                patience.yielded(),
            ))
        })
    }

    /// RPerf: the wire SEND posted first and the loopback SEND second, each timed from its
    /// own post to its own completion (so T_W holds the wire SEND's post, not the
    /// loopback's too), both completions polled by this one pinned thread.
    ///
    /// T_W and T_L are the host's: a read of the timer when the poll returns the
    /// completion, so each includes up to one empty poll. Where the device offers NIC
    /// completion time stamps (the send CQ then carries them), T_W - T_L is taken without
    /// the polls: (C_W - C_L) from the NIC's clock plus (P_L - P_W) from the host's, the
    /// two posts' times; the completions' own times never meet the host's clock, so no
    /// offset between the two is needed, only the NIC clock's rate.
    fn rperf(
        &mut self,
        rig: &Rig,
        peer: &Side,
        lb: &Loopback,
        inline: bool,
    ) -> Result<FlowOutcome> {
        let inline = inline && rig.qps[0].caps().max_inline_data as usize >= rig.size;
        let sge = rig.area(1)?;
        let wire = request(Op::Send, WIRE, sge, peer, inline);
        let looped = request(Op::Send, LOOP, sge, peer, inline);
        let timer = self.timer;
        let idle = self.idle;
        let mut samples = Samples {
            latency: histogram()?,
            loopback: Some(histogram()?),
            wire: Some(histogram()?),
            negative: 0,
            yielded: 0,
        };
        let mut wcs = [ibv_wc::default(); 1];
        let mut ledger = ReceiveLedger::new(LOOPBACK_RECEIVES);
        let mut port = LoopbackPort::new(rig, &lb.back)?;
        // RPerf pins its measuring thread (the other methods leave placement to the
        // scheduler, as perftest does).
        pin_to_current_cpu();
        self.each(&mut samples, || {
            // Receive bookkeeping stays outside the timed span: before the posts and after
            // both completions.
            ledger.make_room(&mut port, Instant::now() + SAMPLE_DEADLINE)?;
            ledger.claim()?;
            let wire_posted = timer.now();
            rig.qps[0]
                .post_send(std::slice::from_ref(&wire))
                .context("posting the wire SEND")?;
            let loop_posted = timer.now();
            lb.out
                .post_send(std::slice::from_ref(&looped))
                .context("posting the loopback SEND")?;
            // Completions are polled one at a time, so each gets its own time stamp.
            let (mut t_wire, mut t_loop) = (None, None);
            let (mut nic_wire, mut nic_loop) = (None, None);
            let started = Instant::now();
            let mut patience = Patience::new(idle);
            loop {
                let (n, nic) = match rig.stamps_khz {
                    Some(_) => match rig.send_cq.poll_timestamped().context("ibv_start_poll")? {
                        Some(done) => {
                            wcs[0].wr_id = done.wr_id;
                            wcs[0].status = done.status;
                            (1, Some(done.nic_ticks))
                        }
                        None => (0, None),
                    },
                    None => (rig.send_cq.poll(&mut wcs).context("ibv_poll_cq")?, None),
                };
                let now = timer.now();
                if n == 0 {
                    patience.idle();
                }
                for wc in &wcs[..n] {
                    check_status(&rig.verbs, wc, "an RPerf SEND")?;
                    match wc.wr_id {
                        WIRE => (t_wire, nic_wire) = (Some(now), nic),
                        LOOP => (t_loop, nic_loop) = (Some(now), nic),
                        other => bail!("an unexpected completion (work request {other})"),
                    }
                }
                if let (Some(w), Some(l)) = (t_wire, t_loop) {
                    ledger.settle(&mut port)?;
                    let mut sample = Sample::rperf(
                        timer,
                        (wire_posted, w),
                        (loop_posted, l),
                        patience.yielded(),
                    );
                    if let (Some(khz), Some(cw), Some(cl)) = (rig.stamps_khz, nic_wire, nic_loop) {
                        sample.take_nic_difference(
                            nic_difference_ns(cw, cl, khz),
                            timer.ns(loop_posted.wrapping_sub(wire_posted)),
                        );
                    }
                    return Ok(sample);
                }
                if started.elapsed() > SAMPLE_DEADLINE {
                    bail!(
                        "no completion of the RPerf SEND pair within {} s",
                        SAMPLE_DEADLINE.as_secs()
                    );
                }
            }
        })
    }
}

/// One latency sample: what the flow reports, and RPerf's parts.
#[derive(Debug, PartialEq)]
struct Sample {
    latency_ns: f64,
    loopback_ns: Option<f64>,
    wire_ns: Option<f64>,
    negative: bool,
    /// Its wait yielded the CPU.
    yielded: bool,
}

impl Sample {
    fn plain(ns: f64, yielded: bool) -> Sample {
        Sample {
            latency_ns: ns,
            loopback_ns: None,
            wire_ns: None,
            negative: false,
            yielded,
        }
    }

    /// Takes RPerf's T_W - T_L from the NIC: `completions_ns` is C_W - C_L on the NIC's
    /// clock, `posts_ns` P_L - P_W on the host's (see `LatencyRun::rperf`). T_W and T_L
    /// stay the host's.
    fn take_nic_difference(&mut self, completions_ns: f64, posts_ns: f64) {
        let rtt = completions_ns + posts_ns;
        self.latency_ns = rtt.max(0.0);
        self.negative = rtt < 0.0;
    }

    /// RPerf's sample from the two SENDs' (post, completion) times in `timer`'s ticks,
    /// each SEND timed from its own post: T_W and T_L, and T_W - T_L (counted as negative,
    /// and reported as 0, when the loopback took longer).
    fn rperf(timer: &Timer, wire: (u64, u64), looped: (u64, u64), yielded: bool) -> Sample {
        let w = timer.ns(wire.1.wrapping_sub(wire.0));
        let l = timer.ns(looped.1.wrapping_sub(looped.0));
        Sample {
            latency_ns: (w - l).max(0.0),
            loopback_ns: Some(l),
            wire_ns: Some(w),
            negative: w < l,
            yielded,
        }
    }
}

/// C_W - C_L in ns from two NIC completion time stamps in ticks of a `khz` clock
/// (negative when the loopback completed last). The stamps are a free-running counter:
/// the difference is taken wrapping, and read as signed.
fn nic_difference_ns(wire_ticks: u64, loop_ticks: u64, khz: u64) -> f64 {
    let ticks = wire_ticks.wrapping_sub(loop_ticks) as i64;
    ticks as f64 * 1e6 / khz.max(1) as f64
}

/// Pins the calling thread to the CPU it runs on (RPerf pins its measuring thread, so
/// that the TSC it reads and the cache it polls stay the same). Said once if refused.
fn pin_to_current_cpu() {
    // SAFETY: sched_getcpu has no preconditions.
    let cpu = unsafe { libc::sched_getcpu() };
    if cpu < 0 {
        eprintln!("justitia-loadgen: cannot tell the current CPU; the thread is not pinned");
        return;
    }
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: cpu is a valid CPU index (returned by the kernel).
    unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    // SAFETY: set is initialised; 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        eprintln!(
            "justitia-loadgen: cannot pin to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn run_stream(
    rig: &Rig,
    peer: &Side,
    plan: &FlowPlan,
    depth: u32,
    batch: u32,
    op: Op,
    polling: Polling,
    interrupted: &AtomicBool,
) -> Result<FlowOutcome> {
    let inline = inline_wanted(plan) && rig.qps[0].caps().max_inline_data as usize >= rig.size;
    let sge = rig.area(1)?;
    let lists: Vec<Vec<SendRequest>> = (0..rig.qps.len())
        .map(|qp| {
            (0..batch)
                .map(|_| request(op, qp as u64, sge, peer, inline))
                .collect()
        })
        .collect();
    let what = format!("a {} request", op.as_str().to_uppercase());
    let mut outstanding = vec![0u32; rig.qps.len()];
    let mut in_flight = 0u64;
    let mut messages = 0u64;
    let mut wcs = vec![ibv_wc::default(); 64];
    let begun = Instant::now();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut stopped_at = None;
    // Nothing is timed here (the window counts completions), so the loop may yield.
    let mut patience = Patience::new(Idle::Yield);
    loop {
        let now = ms(begun.elapsed());
        if interrupted.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        let posting = now >= plan.start_ms && now < plan.stop_ms;
        if !posting && now >= plan.stop_ms {
            let since = *stopped_at.get_or_insert_with(Instant::now);
            if in_flight == 0 {
                break;
            }
            if since.elapsed() > DRAIN_DEADLINE {
                bail!(
                    "{in_flight} requests still outstanding {} s after the flow stopped",
                    DRAIN_DEADLINE.as_secs()
                );
            }
        }
        if posting {
            for (qp, list) in lists.iter().enumerate() {
                while outstanding[qp] + batch <= depth {
                    rig.qps[qp]
                        .post_send(list)
                        .with_context(|| format!("posting {batch} x {what} on queue pair {qp}"))?;
                    outstanding[qp] += batch;
                    in_flight += u64::from(batch);
                }
            }
        }
        let mut n = rig.send_cq.poll(&mut wcs).context("ibv_poll_cq")?;
        match (n, polling, &rig.channel) {
            (0, Polling::Event, Some(channel)) => {
                n = poll_or_sleep(&rig.send_cq, channel, &mut wcs)?;
            }
            (0, _, _) => patience.idle(),
            _ => patience.busy(),
        }
        let at = ms(begun.elapsed());
        for wc in &wcs[..n] {
            check_status(&rig.verbs, wc, &what)?;
            let qp = usize::try_from(wc.wr_id).unwrap_or(usize::MAX);
            let Some(o) = outstanding.get_mut(qp) else {
                bail!("a completion for unknown queue pair {}", wc.wr_id);
            };
            *o = o.saturating_sub(1);
            in_flight = in_flight.saturating_sub(1);
            if at >= plan.window_from_ms && at < plan.window_to_ms {
                messages += 1;
            }
        }
    }
    Ok(FlowOutcome {
        name: plan.name.clone(),
        messages,
        bytes: messages * rig.size as u64,
        window_s: (plan.window_to_ms - plan.window_from_ms) / 1e3,
        latency: None,
        loopback: None,
        wire: None,
        negative_samples: 0,
        clock: "monotonic".into(),
        yielded_samples: 0,
        latency_histogram: Vec::new(),
        path_mtu: None,
        nic_clock_khz: None,
        nic_stamps_read: false,
    })
}

/// After an empty poll of `cq`: arms it for its next completion event and polls it again,
/// since a completion that came between the empty poll and the arming raised no event;
/// sleeps on `channel` only when that poll is empty too. Returns how many completions the
/// second poll took into `wcs`.
fn poll_or_sleep(
    cq: &CompletionQueue,
    channel: &CompletionChannel,
    wcs: &mut [ibv_wc],
) -> Result<usize> {
    cq.req_notify(false).context("ibv_req_notify_cq")?;
    let n = cq.poll(wcs).context("ibv_poll_cq")?;
    if n == 0 {
        wait_for_event(channel)?;
    }
    Ok(n)
}

/// Sleeps until an armed CQ of `channel` has a completion event, or 50 ms pass (so that
/// the caller's clock and stop checks still run).
fn wait_for_event(channel: &CompletionChannel) -> Result<()> {
    channel
        .wait_timeout(Duration::from_millis(50))
        .context("ibv_get_cq_event")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loopback whose receive completions show up at the poll after their SEND lands,
    /// or, while held, not before the poll `held_until`.
    #[derive(Default)]
    struct LateReceives {
        /// The poll from which each landed receive's completion is visible, in order.
        visible_from: std::collections::VecDeque<u64>,
        polls: u64,
        held_until: u64,
        reposted: u32,
    }

    impl LateReceives {
        /// A loopback SEND lands on a receive.
        fn land(&mut self) {
            let at = (self.polls + 1).max(self.held_until);
            self.visible_from.push_back(at);
        }
    }

    impl ReceivePort for LateReceives {
        fn poll(&mut self, max: usize) -> Result<usize> {
            self.polls += 1;
            let mut n = 0;
            while n < max && self.visible_from.front().is_some_and(|&v| v <= self.polls) {
                self.visible_from.pop_front();
                n += 1;
            }
            Ok(n)
        }

        fn repost(&mut self, n: u32) -> Result<()> {
            self.reposted += n;
            Ok(())
        }
    }

    #[test]
    fn loopback_receives_outlast_held_back_completions() {
        // 17 receives, one loopback SEND per sample. At sample 100 the RNIC holds its
        // receive completions back for 40 polls. Posting without looking and taking at
        // most one completion per sample, the 17 are gone at sample 117 (100 + 17), and
        // the SEND would wait on RNR until the sample's 10 s deadline.
        let mut ledger = ReceiveLedger::new(17);
        let mut port = LateReceives::default();
        let deadline = Instant::now() + Duration::from_secs(10);
        for sample in 0..1000u32 {
            if sample == 100 {
                port.held_until = port.polls + 40;
            }
            let step = ledger
                .make_room(&mut port, deadline)
                .and_then(|()| ledger.claim());
            step.unwrap_or_else(|e| panic!("sample {sample}: {e}"));
            port.land();
            ledger
                .settle(&mut port)
                .unwrap_or_else(|e| panic!("sample {sample}: {e}"));
        }
        // Every receive consumed was given back, and all 17 are free again.
        assert_eq!(port.reposted, 1000);
        assert_eq!(ledger.free, 17);
    }

    #[test]
    fn a_loopback_whose_receives_never_complete_fails_instead_of_posting() {
        // All 17 receives consumed and no completion ever comes: with the deadline passed,
        // the SEND is not posted and the sample fails, naming the receives.
        let mut ledger = ReceiveLedger::new(17);
        let mut port = LateReceives::default();
        for _ in 0..17 {
            ledger.claim().unwrap_or_else(|e| panic!("{e}"));
        }
        port.held_until = u64::MAX;
        port.land();
        let got = ledger.make_room(&mut port, Instant::now() - Duration::from_millis(1));
        assert!(
            got.as_ref()
                .is_err_and(|e| e.to_string().contains("no loopback receive completed")),
            "{got:?}"
        );
        assert_eq!(port.reposted, 0);
    }

    #[test]
    fn rperf_times_each_send_from_its_own_post() {
        // Monotonic ticks are ns. The wire SEND posted at 1 000 and completed at 9 000; the
        // loopback posted at 1 300 (after the wire SEND's post) and completed at 4 300:
        // T_W = 8 000, T_L = 3 000, T_W - T_L = 5 000 (timed from one stamp before both
        // posts, T_L would have been 3 300 and the difference 4 700).
        let timer = Timer::Monotonic(Instant::now());
        let s = Sample::rperf(&timer, (1_000, 9_000), (1_300, 4_300), false);
        assert_eq!(
            s,
            Sample {
                latency_ns: 5_000.0,
                loopback_ns: Some(3_000.0),
                wire_ns: Some(8_000.0),
                negative: false,
                yielded: false,
            }
        );
        // A loopback slower than the wire: counted, and reported as 0.
        let s = Sample::rperf(&timer, (1_000, 3_000), (1_300, 4_300), true);
        assert_eq!((s.latency_ns, s.negative, s.yielded), (0.0, true, true));
    }

    #[test]
    fn rperf_from_nic_stamps_adds_the_completions_gap_to_the_posts_gap() {
        // A 1 GHz NIC clock (1 000 000 kHz): ticks are ns. The wire SEND completed at NIC
        // tick 50 000, the loopback at 46 200: C_W - C_L = 3 800 ns. The loopback was
        // posted 300 ns after the wire SEND: T_W - T_L = 3 800 + 300 = 4 100 ns, whatever
        // the host's polls added to each completion's host time.
        assert_eq!(nic_difference_ns(50_000, 46_200, 1_000_000), 3_800.0);
        // A 156.25 MHz clock (mlx5's common hca_core_clock): a tick is 6.4 ns.
        assert!((nic_difference_ns(1_000, 0, 156_250) - 6_400.0).abs() < 1e-9);
        // The counter wraps between the two stamps: the difference is still 16 ticks.
        assert_eq!(nic_difference_ns(5, u64::MAX - 10, 1_000_000), 16.0);
        // The loopback completed last: negative.
        assert_eq!(nic_difference_ns(100, 400, 1_000_000), -300.0);

        let timer = Timer::Monotonic(Instant::now());
        let mut s = Sample::rperf(&timer, (1_000, 9_000), (1_300, 4_300), false);
        s.take_nic_difference(nic_difference_ns(50_000, 46_200, 1_000_000), 300.0);
        // T_W and T_L stay the host's; only their difference is the NIC's.
        assert_eq!(
            (s.latency_ns, s.wire_ns, s.loopback_ns, s.negative),
            (4_100.0, Some(8_000.0), Some(3_000.0), false)
        );
        // The loopback's completion 500 ns after the wire's, posted 300 ns after it:
        // T_W - T_L = -200 ns, counted negative and reported as 0.
        s.take_nic_difference(nic_difference_ns(46_000, 46_500, 1_000_000), 300.0);
        assert_eq!((s.latency_ns, s.negative), (0.0, true));
    }

    #[test]
    fn timed_waits_spin_unless_told_to_yield() {
        let mut spin = Patience::new(Idle::Spin);
        for _ in 0..10_000 {
            spin.idle();
        }
        assert!(!spin.yielded());
        assert_eq!(spin.yields, 0);
        // Yielding starts at the 257th empty poll in a row: 300 give 44 yields.
        let mut wait = Patience::new(Idle::Yield);
        for _ in 0..300 {
            wait.idle();
        }
        assert_eq!(wait.yields, 44);
        // A poll that finds something starts the count again: 256 more are free, the
        // 257th yields.
        wait.busy();
        for _ in 0..256 {
            wait.idle();
        }
        assert_eq!(wait.yields, 44);
        wait.idle();
        assert_eq!(wait.yields, 45);
        assert!(wait.yielded());
    }

    #[test]
    fn marks_skip_zero() {
        assert_eq!(next_mark(1), 2);
        assert_eq!(next_mark(255), 1);
    }

    #[test]
    fn percentiles_of_known_samples() {
        let mut h = histogram().unwrap_or_else(|e| panic!("{e}"));
        for ns in 1..=1000 {
            record(&mut h, f64::from(ns) * 1000.0);
        }
        let p = percentiles(&h).unwrap_or_else(|| panic!("no percentiles"));
        assert_eq!(p.samples, 1000);
        assert!((p.p50_us - 500.0).abs() < 0.5, "{p:?}");
        assert!((p.p99_us - 990.0).abs() < 1.0, "{p:?}");
    }

    /// The export holds every sample once, in its bucket, buckets in increasing order and
    /// each named within the histogram's 3 significant figures of what was recorded.
    #[test]
    fn the_histogram_export_holds_every_sample_in_its_bucket() {
        let mut h = histogram().unwrap_or_else(|e| panic!("{e}"));
        for ns in [1000.0, 1000.0, 1000.0, 5000.0, 2_000_000.0] {
            record(&mut h, ns);
        }
        let export = histogram_export(&h);
        let counts: Vec<u64> = export.iter().map(|b| b[1]).collect();
        assert_eq!(counts, [3, 1, 1], "{export:?}");
        assert_eq!(export[0][0], 1000);
        for (bucket, recorded) in export.iter().zip([1000.0, 5000.0, 2_000_000.0]) {
            let value = bucket[0] as f64;
            assert!(
                value >= recorded && value <= recorded * 1.001,
                "{value} for {recorded}"
            );
        }
        assert!(histogram_export(&histogram().unwrap_or_else(|e| panic!("{e}"))).is_empty());
    }
}
