//! `justitia-loadgen`: one end of one flow on real verbs (see the library's docs for the
//! protocol with `justitia run`).

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};
use justitia_loadgen::clock::{calibrate_tsc, ClockChoice, Timer, TscHz, CALIBRATION_WINDOW_NS};
use justitia_loadgen::flow::{
    self, DeviceOptions, Idle, LineSignal, DEFAULT_ACK_TIMEOUT, MAX_ACK_TIMEOUT,
};
use justitia_loadgen::plan::FlowPlan;

/// One end of one flow of a scenario, on real verbs.
#[derive(Parser, Debug)]
#[command(name = "justitia-loadgen", version)]
struct Args {
    /// RDMA device (default: the first one).
    #[arg(long, short = 'd', global = true)]
    device: Option<String>,
    /// Port number.
    #[arg(long, default_value_t = 1, global = true)]
    port: u8,
    /// GID index (0 is the IPv6 link-local GID on Soft-RoCE).
    #[arg(long, short = 'x', default_value_t = 0, global = true)]
    gid_index: u8,
    /// The queue pairs' local ACK timeout, n in 4.096 us x 2^n (14: 67 ms, perftest's);
    /// raise it where a path's queue holds a request longer (a rate-limited wire).
    #[arg(long, default_value_t = DEFAULT_ACK_TIMEOUT, global = true,
          value_parser = clap::value_parser!(u8).range(1..=MAX_ACK_TIMEOUT as i64))]
    ack_timeout: u8,
    /// The flow's plan, as JSON.
    #[arg(long, global = true)]
    plan: Option<String>,
    /// What a wait for a timed sample's completion does when a poll finds nothing: `spin`
    /// polls again at once (for RNICs); `yield` gives up the CPU after 256 empty polls,
    /// for software RNICs (Soft-RoCE, siw) whose work needs the CPUs the pollers spin on,
    /// and the requester counts the samples that yielded (`yielded_samples`).
    #[arg(long, value_enum, default_value_t = Idle::Spin, global = true)]
    idle: Idle,
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// The far end: listen on ADDR (port 0: any), say `listening PORT`, serve one requester.
    Respond {
        /// Where to listen for the requester.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
    },
    /// The end that posts and measures: connect to the responder at ADDR, say `ready`,
    /// wait for a line on stdin, run, say `outcome {JSON}`.
    Request {
        /// The responder's out-of-band address.
        #[arg(long)]
        connect: SocketAddr,
        /// The clock of latency samples.
        #[arg(long, value_enum, default_value_t = ClockChoice::Auto)]
        clock: ClockChoice,
        /// The TSC's rate in Hz, fitted once for the whole run (`justitia-loadgen
        /// calibrate` prints it): used instead of calibrating here when the TSC times the
        /// samples; the TSC's invariance and the kernel's clocksource are still checked.
        #[arg(long, value_name = "HZ")]
        tsc_hz: Option<TscHz>,
    },
    /// Fit the TSC's rate against CLOCK_MONOTONIC and print `tsc-hz HZ` on stdout (the
    /// fit's figures on stderr), for `request --tsc-hz`; fails where the TSC is unusable
    /// or no fit is good enough.
    Calibrate,
}

/// How long a responder waits for its requester to connect.
const ACCEPT_DEADLINE: Duration = Duration::from_secs(60);

/// Set by SIGTERM and SIGINT: the loops stop at their next check.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

fn install_signal_handlers() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    // Die with the runner: a runner killed outright must not leave flows behind.
    // SAFETY: prctl with PR_SET_PDEATHSIG and a signal number has no other effect.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
}

fn main() -> ExitCode {
    let args = Args::parse();
    install_signal_handlers();
    let name = args
        .plan
        .as_deref()
        .and_then(|p| serde_json::from_str::<FlowPlan>(p).ok())
        .map_or_else(|| "?".to_string(), |p| p.name);
    let role = match args.role {
        Role::Respond { .. } => "responder",
        Role::Request { .. } => "requester",
        Role::Calibrate => "calibration",
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let causes: Vec<String> = err.chain().map(|c| c.to_string()).collect();
            eprintln!(
                "justitia-loadgen: flow {name} ({role}): {}",
                causes.join(": ")
            );
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    let plan = || -> Result<FlowPlan> {
        let text = args.plan.as_deref().context("--plan is required")?;
        let plan: FlowPlan = serde_json::from_str(text).context("reading --plan")?;
        plan.validate()?;
        Ok(plan)
    };
    let options = DeviceOptions {
        device: args.device.clone(),
        port: args.port,
        gid_index: args.gid_index,
        ack_timeout: args.ack_timeout,
    };
    match args.role {
        Role::Calibrate => {
            let c = calibrate_tsc().map_err(anyhow::Error::msg)?;
            eprintln!(
                "justitia-loadgen: {} readings over {} ms, r^2 {:.12}, relative error at most {:.1e}",
                c.pairs,
                CALIBRATION_WINDOW_NS / 1_000_000,
                c.r_squared,
                c.relative_error
            );
            say(&format!("tsc-hz {:.0}", c.hz()))
        }
        Role::Respond { listen } => {
            let plan = plan()?;
            let listener =
                TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
            let port = listener
                .local_addr()
                .context("reading the bound port")?
                .port();
            say(&format!("listening {port}"))?;
            let stream = accept(&listener)?;
            flow::respond(&options, &plan, stream, args.idle, &INTERRUPTED)
        }
        Role::Request {
            connect,
            clock,
            tsc_hz,
        } => {
            let plan = plan()?;
            let (timer, note) = Timer::choose(clock, tsc_hz).map_err(anyhow::Error::msg)?;
            if let Some(note) = note {
                eprintln!("justitia-loadgen: {note}");
            }
            let stream = TcpStream::connect_timeout(&connect, Duration::from_secs(10))
                .with_context(|| format!("connecting to the responder at {connect}"))?;
            let mut ready = || say("ready");
            let mut start = LineSignal(BufReader::new(std::io::stdin()));
            let outcome = flow::request_flow(
                &options,
                &plan,
                stream,
                &timer,
                args.idle,
                &mut ready,
                &mut start,
                &INTERRUPTED,
            )?;
            say(&format!("outcome {}", serde_json::to_string(&outcome)?))
        }
    }
}

fn say(line: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .context("writing to stdout")
}

/// Accepts one connection within [`ACCEPT_DEADLINE`], or stops when interrupted.
fn accept(listener: &TcpListener) -> Result<TcpStream> {
    listener.set_nonblocking(true).context("listening socket")?;
    let started = Instant::now();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).context("accepted socket")?;
                return Ok(stream);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e).context("accepting the requester"),
        }
        if INTERRUPTED.load(Ordering::Relaxed) {
            bail!("interrupted before the requester connected");
        }
        if started.elapsed() > ACCEPT_DEADLINE {
            bail!(
                "no requester connected within {} s",
                ACCEPT_DEADLINE.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
