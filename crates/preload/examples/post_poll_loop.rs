//! One 16-byte RDMA WRITE posted and its completion polled, `N` times, against the mock
//! provider: either straight to the provider (`direct`), through the shaper's pass-through
//! path (`shaper`, class unset: observe and count), through its shaped path (`shaped`,
//! bandwidth class: the request is too small to split, but is posted with the shaper's tag
//! and its completion translated), or through the shaped path of a throughput flow paced by
//! operations (`paced`: `JUSTITIA_RATE` of 100 GB/s and 1 G ops/s, far above what the loop
//! reaches, so the pacer is asked about every request and never holds one back), or
//! through the shaped path of a bandwidth flow that follows the daemon (`follow`: the rate
//! is the allotment a stand-in for `justitiad` publishes in a control block, 100 GB/s and
//! 1 G ops/s with a release phase, read by the shaper's follower before the loop starts),
//! or the same under `JUSTITIA_POLICY=adaptive` (`follow-adaptive`: the allotment as a
//! daemon running `policy = "adaptive"` publishes it, 100 GB/s by bytes only, no release
//! phase), or in a bandwidth-class process on a CQ too small to shape its QP
//! (`unshaped-cq`: the QP is only observed, and the poll passes through with the shaper's
//! look at the CQ after the provider returns, which a process that shapes nothing skips).
//! `direct-send` and `shaped-send` are `direct` and `shaped` with a 16-byte SEND instead
//! of the WRITE: a request that consumes a receive at the peer, which the shaper sends
//! whole unless the two shapers agreed to split, on the same shaped path (the baseline
//! of what splitting two-sided requests may add to an unsplit one).
//! Run by `crates/preload/bench/callgrind.sh`, which counts the instructions spent inside
//! `justitia_bench_post` and `justitia_bench_poll` under callgrind.
//!
//! Usage: `post_poll_loop direct|shaper|shaped|paced|follow|follow-adaptive|unshaped-cq|latency|latency-timed|direct-send|shaped-send N`

use std::ffi::c_int;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia::clock::MonotonicClock;
use justitia::engine::PacerMode;
use justitia::exports::{engine_from, on_create_cq, on_create_qp};
use justitia::mock::MockDevice;
use justitia_agent::block::{monotonic_ns, phase_to_fixed, BlockWriter, SlotAllotment, SlotState};
use justitia_agent::proto::{AdmissionReply, Reply, Request, MAX_MESSAGE};
use justitia_verbs::ops;
use justitia_verbs::sys::*;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

/// One post, as the application's inline `ibv_post_send` makes it.
#[no_mangle]
#[inline(never)]
extern "C" fn justitia_bench_post(qp: *mut ibv_qp, wr: *mut ibv_send_wr) -> c_int {
    let mut bad = std::ptr::null_mut();
    // SAFETY: a live mock QP and a valid request.
    unsafe { ops::post_send(qp, wr, &mut bad) }
}

/// One poll, as the application's inline `ibv_poll_cq` makes it.
#[no_mangle]
#[inline(never)]
extern "C" fn justitia_bench_poll(cq: *mut ibv_cq, wc: *mut ibv_wc) -> c_int {
    // SAFETY: a live mock CQ with room for one completion.
    unsafe { ops::poll_cq(cq, 1, wc) }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "shaper".into());
    let iterations: u64 = args.next().unwrap_or_else(|| "100000".into()).parse()?;
    let (shaped, class, rate) = match mode.as_str() {
        "direct" | "direct-send" => (false, None, None),
        "shaper" => (true, None, None),
        "shaped" | "follow" | "follow-adaptive" | "unshaped-cq" | "shaped-send" => {
            (true, Some("bandwidth"), None)
        }
        "paced" => (true, Some("throughput"), Some("100G:1G")),
        "latency" | "latency-timed" => (true, Some("latency"), None),
        other => {
            anyhow::bail!(
                "mode must be direct, shaper, shaped, paced, follow, follow-adaptive, unshaped-cq, latency, latency-timed, direct-send or shaped-send, not {other}"
            )
        }
    };
    let adaptive = mode == "follow-adaptive";
    let daemon = match mode.as_str() {
        "follow" => Some(StandIn::start(justitia_allotment())?),
        "follow-adaptive" => Some(StandIn::start(adaptive_allotment())?),
        "latency-timed" => Some(StandIn::start(latency_slot())?),
        _ => None,
    };
    let socket = daemon.as_ref().map(|d| d.path.display().to_string());

    let dev = MockDevice::new();
    let ctx = dev.context();
    let mut engine = None;
    if shaped {
        let lookup = |name: &str| {
            match name {
                "JUSTITIA_CLASS" => class,
                "JUSTITIA_RATE" => rate,
                "JUSTITIA_POLICY" => adaptive.then_some("adaptive"),
                "JUSTITIA_DAEMON" => Some(if socket.is_some() { "on" } else { "off" }),
                "JUSTITIA_SOCKET" => socket.as_deref(),
                _ => None,
            }
            .map(str::to_string)
        };
        let e = engine_from(lookup, Arc::new(MonotonicClock::new()), PacerMode::Manual)
            .ok_or_else(|| anyhow::anyhow!("no engine"))?;
        // SAFETY: a fresh mock context.
        unsafe { justitia::install::attach_context(ctx, Arc::clone(&e)) };
        engine = Some(e);
    }
    let cq = dev.create_cq();
    if mode == "unshaped-cq" {
        // Fewer entries than the QP's 16 send requests: the shaper observes the QP only.
        dev.set_cq_size(cq, 8);
    }
    let mut attr = ibv_qp_init_attr {
        send_cq: cq,
        recv_cq: cq,
        qp_type: IBV_QPT_RC,
        cap: ibv_qp_cap {
            max_send_wr: 16,
            max_send_sge: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let qp = dev.create_qp(&mut attr);
    if shaped {
        // SAFETY: cq and qp were just created on ctx.
        unsafe {
            on_create_cq(ctx, cq);
            on_create_qp(qp, &attr);
        }
    }

    if let (Some(daemon), Some(engine)) = (&daemon, &engine) {
        if mode == "latency-timed" {
            daemon.follow(engine, |s| s.time_round_trips)?;
        } else {
            daemon.follow(engine, |s| {
                s.rate.map(|r| r.bytes_per_sec) == Some(ALLOTTED_BYTES_PER_SEC) && s.phase.is_some()
            })?;
        }
    }

    let src = [7u8; 16];
    let mut dst = [0u8; 16];
    let mut sge = ibv_sge {
        addr: src.as_ptr() as u64,
        length: 16,
        lkey: 1,
    };
    let mut wr = ibv_send_wr {
        wr_id: 1,
        sg_list: &mut sge,
        num_sge: 1,
        opcode: if mode.ends_with("-send") {
            IBV_WR_SEND
        } else {
            IBV_WR_RDMA_WRITE
        },
        send_flags: IBV_SEND_SIGNALED,
        ..Default::default()
    };
    wr.wr.rdma.remote_addr = dst.as_mut_ptr() as u64;
    let mut wc = ibv_wc::default();
    let mut completions = 0u64;
    for _ in 0..iterations {
        anyhow::ensure!(justitia_bench_post(qp, &mut wr) == 0, "post failed");
        dev.execute_all(qp);
        completions += u64::try_from(justitia_bench_poll(cq, &mut wc)).unwrap_or(0);
    }
    anyhow::ensure!(
        completions == iterations,
        "{completions} completions for {iterations} posts"
    );
    if mode == "latency-timed" {
        // Every candidate was timed: the previous one's completion came before its post.
        let timed = engine
            .as_ref()
            .and_then(|e| e.round_trips())
            .and_then(|r| r.take())
            .map_or(0, |(count, _)| u64::from(count));
        let want = iterations.div_ceil(justitia::engine::qp::TIMED_STRIDE);
        anyhow::ensure!(timed == want, "{timed} requests timed, {want} expected");
    }
    println!("{mode}: {iterations} posts and polls");
    drop(daemon);
    Ok(())
}

/// The allotment the stand-in publishes: far above what the loop reaches, so that the
/// pacer is asked about every request and never holds one back.
const ALLOTTED_BYTES_PER_SEC: u64 = 100_000_000_000;
const ALLOTTED_OPS_PER_SEC: u64 = 1_000_000_000;

/// The allotment a daemon running `justitia` publishes: bytes and operations, a release
/// phase.
fn justitia_allotment() -> SlotAllotment {
    SlotAllotment {
        flow: 1,
        state: SlotState::Allotted,
        bytes_per_sec: ALLOTTED_BYTES_PER_SEC,
        ops_per_sec: ALLOTTED_OPS_PER_SEC,
        chunk_bytes: 5120,
        token_bytes: 5120,
        generation: 1,
        phase_offset: phase_to_fixed(0.5),
        phase_epoch: 1,
        charge: justitia_core::message_charge::MessageCharge::NONE,
    }
}

/// The allotment a daemon running `adaptive` publishes for a bandwidth flow: bytes only,
/// no release phase, each request charged its price on RoCE-100 at the flow's chunk (so
/// the post evaluates a charge that prices the wire and the message rate).
fn adaptive_allotment() -> SlotAllotment {
    use justitia_core::adaptive::AdaptiveConfig;
    use justitia_core::profile::{RnicFacts, RnicProfile};
    let a = justitia_allotment();
    let charge = RnicProfile::builtin("roce-100")
        .ok()
        .zip(RnicFacts::builtin("roce-100"))
        .map(|(policy, facts)| {
            AdaptiveConfig::for_model(&policy, &facts).message_charge(a.chunk_bytes as u32)
        })
        .unwrap_or_default();
    SlotAllotment {
        ops_per_sec: 0,
        phase_offset: 0,
        phase_epoch: 0,
        charge,
        ..a
    }
}

/// The slot a daemon publishes for a latency flow: never shaped.
fn latency_slot() -> SlotAllotment {
    SlotAllotment {
        state: SlotState::Unshaped,
        bytes_per_sec: 0,
        ops_per_sec: 0,
        phase_offset: 0,
        phase_epoch: 0,
        ..justitia_allotment()
    }
}

/// What `justitiad` does for one flow, and no more: listens on a socket, greets a shaper
/// with a control block, answers its registration with slot 0, and publishes the
/// allotment there. The control loop is not needed to measure a post that follows it.
struct StandIn {
    path: PathBuf,
    _block: Arc<BlockWriter>,
    _page: Arc<BlockWriter>,
}

impl StandIn {
    fn start(slot: SlotAllotment) -> anyhow::Result<StandIn> {
        let path = std::env::temp_dir().join(format!("justitia-bench-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        rustix::net::bind(&listener, &SocketAddrUnix::new(&path)?)?;
        rustix::net::listen(&listener, 4)?;
        // Never stale during a run: the stand-in does not beat. The shared block carries
        // the heartbeat; the flow's slot lives in its tenant's page, as the daemon keeps it.
        let block = Arc::new(BlockWriter::create_shared(7, 3_600_000_000_000)?);
        let page = Arc::new(BlockWriter::create_tenant_page(1, 7)?);
        let (b, w) = (Arc::clone(&block), Arc::clone(&page));
        std::thread::spawn(move || {
            if let Err(e) = serve(&listener, &b, &w, slot) {
                eprintln!("stand-in daemon: {e}");
            }
        });
        Ok(StandIn {
            path,
            _block: block,
            _page: page,
        })
    }

    /// Ticks the engine's follower until its settings are `ready` (the allotment in
    /// effect).
    fn follow(
        &self,
        engine: &Arc<justitia::engine::Engine>,
        ready: impl Fn(&justitia::follow::Settings) -> bool,
    ) -> anyhow::Result<()> {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            engine.follow_tick(monotonic_ns());
            if ready(&engine.settings()) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        anyhow::bail!("the shaper did not take the stand-in's allotment")
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(
    listener: &OwnedFd,
    block: &BlockWriter,
    writer: &BlockWriter,
    slot: SlotAllotment,
) -> anyhow::Result<()> {
    let sock = rustix::net::accept(listener)?;
    let hello = Reply::Hello { boot_id: 7 }.encode();
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [block.fd(), writer.fd()];
    control.push(SendAncillaryMessage::ScmRights(&fds));
    rustix::net::sendmsg(
        &sock,
        &[std::io::IoSlice::new(&hello)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    let mut buf = [0u8; MAX_MESSAGE];
    loop {
        let mut none = RecvAncillaryBuffer::default();
        let got = rustix::net::recvmsg(
            &sock,
            &mut [std::io::IoSliceMut::new(&mut buf)],
            &mut none,
            RecvFlags::empty(),
        )?;
        if got.bytes == 0 {
            return Ok(());
        }
        let Ok(Request::Register(r)) = Request::parse(&buf[..got.bytes]) else {
            continue;
        };
        writer.set_slot(0, slot);
        let reply = Reply::Registered {
            client_ref: r.client_ref,
            flow: 1,
            slot: 0,
            admission: AdmissionReply::Admitted,
        }
        .encode();
        rustix::net::send(sock.as_fd(), &reply, SendFlags::NOSIGNAL)?;
    }
}
