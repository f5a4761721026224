//! `justitia-integrity`: runs seeded random RDMA WRITE, READ and WRITE_WITH_IMM transfers
//! between two RC queue pairs of one device and verifies every byte and every completion.
//! Run it plainly, or under the shaper (`LD_PRELOAD=.../libjustitia.so` with `JUSTITIA_*`
//! settings) to prove that splitting and pacing are invisible to the application.
//! `--post-api wr` posts through the extended `ibv_wr_*` interface of a QP created with
//! `ibv_create_qp_ex` instead of `ibv_post_send`; the same seed gives the same transfers.
//! `--threads N` runs N rigs at once, one thread each, whose requesters share one send CQ
//! polled by one more thread that hands every completion to its QP's thread and checks
//! that every signaled request completes exactly once.
//! `--serve ADDR:PORT` and `--connect ADDR:PORT` run across two hosts: by default the
//! client READs from the server's regions; with `--two-sided send` or `--two-sided
//! write-imm` it sends SENDs (some with immediate) or RDMA WRITEs with immediate, and the
//! server checks every receive completion and every byte it received.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};
use clap::Parser;
use justitia_integrity::across::{self, AcrossOptions, Served};
use justitia_integrity::checker::{CheckError, Report, Rig, RigOptions, SharedSendCq};
use justitia_integrity::ledger::Ledger;
use justitia_integrity::plan::{PlanConfig, Planner};
use justitia_integrity::post_api::PostApi;
use justitia_integrity::two_sided::{MessageConfig, MessagePlanner, MessageReport, TwoSided};
use justitia_verbs::sys::ibv_wc;
use justitia_verbs::CompletionQueue;

/// Verify RDMA transfers byte by byte and completion by completion.
#[derive(Parser, Debug)]
#[command(name = "justitia-integrity", version)]
struct Args {
    /// RDMA device (default: the first one).
    #[arg(long, short = 'd')]
    device: Option<String>,
    /// Port number.
    #[arg(long, default_value_t = 1)]
    port: u8,
    /// GID index (0 is the IPv6 link-local GID on Soft-RoCE).
    #[arg(long, short = 'x', default_value_t = 0)]
    gid_index: u8,
    /// Transfers (work requests) to run at least; with --two-sided, messages.
    #[arg(long, short = 'n', default_value_t = 300)]
    transfers: u64,
    /// Seed of the random plan (default: from the clock); printed so a run can be replayed.
    #[arg(long)]
    seed: Option<u64>,
    /// Largest transfer, in bytes (suffixes K and M are binary).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    max_size: usize,
    /// Most SGEs per request.
    #[arg(long, default_value_t = 6)]
    max_sges: usize,
    /// Most requests per batch (all but the last may be unsignaled).
    #[arg(long, default_value_t = 4)]
    max_batch: usize,
    /// Draw a quarter of the sizes within a byte of multiples of this (the shaper's chunk).
    #[arg(long, value_parser = parse_size)]
    boundary: Option<usize>,
    /// Draw no RDMA WRITE_WITH_IMM requests.
    #[arg(long)]
    no_imm: bool,
    /// Seconds to wait for the completions of one batch.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// How requests are posted: `post-send` (ibv_post_send on a QP from ibv_create_qp) or
    /// `wr` (a QP from ibv_create_qp_ex with send-ops flags, each batch posted between
    /// ibv_wr_start and ibv_wr_complete, as perftest does on Soft-RoCE). The same seed draws
    /// the same transfers with either; `wr` fails if the device cannot create such a QP.
    /// (rxe in rdma-core 44 miscounts multi-SGE requests in ibv_wr_set_sge_list: there, use
    /// --max-sges 1 unless a shaping LD_PRELOAD reposts the requests.)
    #[arg(long, value_enum, default_value_t = PostApi::PostSend)]
    post_api: PostApi,
    /// Posting threads (1 to 16). Above 1, each thread drives its own pair of QPs and
    /// memory, all requesters share one send CQ, and one more thread polls it and hands
    /// each completion to its QP's thread; every signaled request must complete exactly
    /// once. --transfers is then shared among the threads, each with its own seed (the
    /// printed seed plus the thread's index).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=16))]
    threads: u8,
    /// Across two hosts, this end: serve one client, listening for its TCP connection on
    /// ADDR:PORT (the mode and the plan's settings come from the client). In READ mode,
    /// hold the remote regions while it READs and print whether they were left intact;
    /// with a `--two-sided` client, post the receives of each batch, check every receive
    /// completion and every byte received, and print the verdict.
    #[arg(long, value_name = "ADDR:PORT", conflicts_with_all = ["connect", "threads"])]
    serve: Option<SocketAddr>,
    /// Across two hosts, the other end: connect to a `--serve` process at ADDR:PORT and
    /// post every transfer of the plan as an RDMA READ from its regions (`--post-api
    /// post-send`), checking every byte against the pattern the server filled them with;
    /// or, with `--two-sided`, send it two-sided messages.
    #[arg(long, value_name = "ADDR:PORT", conflicts_with = "threads")]
    connect: Option<SocketAddr>,
    /// With --connect: send two-sided messages instead of READing, and let the server
    /// check them. `send`: SENDs, about half of them SENDs with immediate, each into a
    /// receive the server posted with a random scatter list; `write-imm`: RDMA WRITEs
    /// with immediate into the server's region, each consuming a receive. Sizes run from
    /// 1 byte to --max-size, scatter lists up to --max-sges (at most 32) on both ends,
    /// batches up to --max-batch messages (at most 64); --transfers counts messages. The
    /// server needs no flag: the client's hello carries the mode.
    #[arg(
        long,
        value_enum,
        value_name = "MODE",
        requires = "connect",
        conflicts_with_all = ["serve", "no_imm"]
    )]
    two_sided: Option<TwoSided>,
    /// With --two-sided: the server polls its receive CQ for a batch only once this client
    /// says that every send of the batch completed, as an application does that looks for
    /// its messages only after a later word from the sender (natively the sends complete
    /// all the same; under a shaper they must too).
    #[arg(long, requires = "two_sided")]
    late_polling: bool,
    /// With --two-sided: the server sleeps until its receive CQ's completion events
    /// instead of polling, its sends on a CQ of their own (as an event-driven server
    /// does), and names a completion that arrived without its event.
    #[arg(long, requires = "two_sided")]
    events: bool,
}

/// Bytes with an optional binary suffix: `4096`, `64K`, `16M`.
fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let (digits, scale) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1usize << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("`{text}` is not a positive size (bytes, or with K, M or G)"))
}

fn clock_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32)
}

/// The shaper settings in effect, for the log (a run without them is a baseline).
fn shaper_environment() -> String {
    let mut vars: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("JUSTITIA_") || k == "LD_PRELOAD")
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    vars.sort();
    if vars.is_empty() {
        "none (no LD_PRELOAD, no JUSTITIA_* variables)".to_string()
    } else {
        vars.join(" ")
    }
}

fn summary(r: &Report) -> String {
    format!(
        "{} transfers ({} WRITE, {} READ, {} WRITE_WITH_IMM; {} unsignaled), {} bytes, {} send + {} receive completions checked, {} mismatched, {} overruns, {} bad completions",
        r.transfers,
        r.writes,
        r.reads,
        r.writes_with_imm,
        r.unsignaled,
        r.bytes,
        r.send_completions,
        r.recv_completions,
        r.mismatched_transfers,
        r.overruns,
        r.bad_completions
    )
}

/// The shape of the random batches. It does not depend on `--post-api`: a seed draws the
/// same transfers whichever interface posts them.
fn plan_config(args: &Args) -> PlanConfig {
    PlanConfig {
        max_size: args.max_size,
        max_sges: args.max_sges,
        max_batch: args.max_batch,
        local_regions: 3,
        remote_regions: 2,
        boundary: args.boundary,
        with_imm: !args.no_imm,
    }
}

/// The options that replay a run with `seed` (the posting interface when not the default).
fn replay_options(seed: u64, post_api: PostApi) -> String {
    match post_api {
        PostApi::PostSend => format!("--seed {seed}"),
        other => format!("--seed {seed} --post-api {}", other.as_str()),
    }
}

/// A hint for a completion error in `wr` mode with several SGEs per request, where a known
/// provider bug is the likeliest cause; empty otherwise.
fn provider_hint(post_api: PostApi, max_sges: usize, error: &CheckError) -> &'static str {
    let completion = matches!(error, CheckError::Completion { .. });
    if post_api == PostApi::Wr && max_sges > 1 && completion {
        " (note: rxe's ibv_wr_set_sge_list in rdma-core before PR #1744, e.g. Debian's 44, \
         miscounts requests of several SGEs; if the same --seed passes with --post-api \
         post-send, that is the cause: use --max-sges 1 with rxe's own ibv_wr_* verbs)"
    } else {
        ""
    }
}

/// The error for a rig that cannot be set up: the verbs error's text already names its
/// cause, so a chained context would repeat it.
fn setup_error(e: CheckError) -> anyhow::Error {
    match e {
        CheckError::Verbs(v) => anyhow::anyhow!(
            "cannot set up two connected RC queue pairs; this needs an RDMA device \
             (hardware, or Soft-RoCE: `rdma link add rxe0 type rxe netdev <if>`): {v}"
        ),
        other => other.into(),
    }
}

/// The thread that polls the shared send CQ until `stop`: enters every completion in the
/// ledger and hands it to the thread whose QP it names. Returns what did not fit the
/// ledger (the first few), or the polling error that ended it.
fn route_completions(
    cq: &CompletionQueue,
    routes: HashMap<u32, Sender<ibv_wc>>,
    ledger: &Mutex<Ledger>,
    stop: &AtomicBool,
) -> Vec<String> {
    let mut faults = Vec::new();
    let mut wc = [ibv_wc::default(); 16];
    loop {
        // Read before polling, so that the last completions are drained after the stop.
        let stopping = stop.load(Ordering::Acquire);
        let n = match cq.poll(&mut wc) {
            Ok(n) => n,
            Err(e) => {
                faults.push(format!("polling the shared send CQ: {e}"));
                return faults;
            }
        };
        for c in &wc[..n] {
            let fit = ledger
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .complete(c.qp_num, c.wr_id);
            if let Err(f) = fit {
                if faults.len() < 20 {
                    faults.push(f.to_string());
                }
            }
            // A thread that has stopped takes nothing more; the ledger has it anyway.
            if let Some(tx) = routes.get(&c.qp_num) {
                let _ = tx.send(*c);
            }
        }
        if n == 0 {
            if stopping {
                return faults;
            }
            // Soft-RoCE does its work in kernel threads; leave them the CPU.
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// `--threads` above 1: the rigs share one send CQ polled by a routing thread.
fn run_threads(args: &Args, seed: u64, plan: &PlanConfig, options: &RigOptions) -> Result<bool> {
    let threads = usize::from(args.threads);
    let shared = SharedSendCq::open(options, plan, threads).map_err(setup_error)?;
    let ledger = Arc::new(Mutex::new(Ledger::new()));
    let mut routes = HashMap::new();
    let mut rigs = Vec::with_capacity(threads);
    for _ in 0..threads {
        let (tx, rx) = mpsc::channel();
        let rig = shared
            .rig(options, plan, rx, Arc::clone(&ledger))
            .map_err(setup_error)?;
        routes.insert(rig.requester_qp_num(), tx);
        rigs.push(rig);
    }
    println!(
        "justitia-integrity: device {}, {threads} threads on {threads} QPs sharing one send CQ, \
         polled by one more thread; up to {} bytes per transfer",
        shared.device(),
        args.max_size
    );
    let per_thread = args.transfers.div_ceil(threads as u64);
    let stop = AtomicBool::new(false);
    let (results, faults) = std::thread::scope(|s| {
        let router = s.spawn(|| route_completions(shared.cq(), routes, &ledger, &stop));
        let workers: Vec<_> = rigs
            .into_iter()
            .enumerate()
            .map(|(k, mut rig)| {
                let thread_seed = seed.wrapping_add(k as u64);
                s.spawn(move || {
                    let mut planner = Planner::new(thread_seed, plan.clone());
                    let mut report = Report::default();
                    while report.transfers < per_thread {
                        rig.run_batch(&planner.next_batch(), &mut report)
                            .map_err(|e| (report.transfers, e))?;
                    }
                    rig.finish().map_err(|e| (report.transfers, e))?;
                    Ok::<_, (u64, CheckError)>(report)
                })
            })
            .collect();
        let results: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        stop.store(true, Ordering::Release);
        let faults = router
            .join()
            .unwrap_or_else(|_| vec!["the routing thread panicked".to_string()]);
        (results, faults)
    });
    let mut report = Report::default();
    let mut errors = Vec::new();
    for (k, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(part)) => report.absorb(part),
            Ok(Err((done, e))) => errors.push(format!(
                "thread {k} (seed {}) after {done} good transfers: {e}",
                seed.wrapping_add(k as u64)
            )),
            Err(_) => errors.push(format!("thread {k} panicked")),
        }
    }
    let books = ledger
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .summary();
    for p in report.problems.iter().chain(&faults) {
        println!("justitia-integrity: PROBLEM {p}");
    }
    if !errors.is_empty() {
        bail!("{}; so far: {}", errors.join("; "), summary(&report));
    }
    let once = books.exactly_once() && faults.is_empty();
    let verdict = if report.clean() && once {
        "PASS"
    } else {
        "FAIL"
    };
    println!(
        "justitia-integrity: {verdict}: {}; {threads} threads sharing one send CQ: {} signaled \
         requests, {} completed exactly once, {} missing, {} duplicated, {} unknown; seed {seed}",
        summary(&report),
        books.expected,
        books.exact,
        books.missing,
        books.duplicates,
        books.unknown
    );
    Ok(report.clean() && once)
}

fn across_options(options: &RigOptions) -> AcrossOptions {
    AcrossOptions {
        device: options.device.clone(),
        port: options.port,
        gid_index: options.gid_index,
        timeout: options.completion_timeout,
    }
}

/// The counts of a two-sided run, for summary lines.
fn message_summary(r: &MessageReport) -> String {
    format!(
        "{} messages ({}), {} bytes in {} batches, {} send + {} receive completions checked, \
         {} mismatches",
        r.messages,
        r.kinds(),
        r.bytes,
        r.batches,
        r.send_completions,
        r.recv_completions,
        r.mismatches
    )
}

/// The end of a two-sided summary line: whether the server stopped the run, and the
/// first mismatch.
fn message_outcome(r: &MessageReport) -> String {
    let mut out = String::new();
    if r.stopped {
        out.push_str("; the server stopped the run");
    }
    if let Some(first) = r.problems.first() {
        out.push_str("; first mismatch: ");
        out.push_str(first);
    }
    out
}

/// `--serve`: one client's regions, until it is done.
fn run_server(listen: SocketAddr, options: &AcrossOptions) -> Result<bool> {
    let served = across::serve(listen, options).context("serving a client across hosts")?;
    let r = match served {
        Served::Reads(r) => r,
        Served::Messages { mode, seed, report } => {
            for p in &report.problems {
                println!("justitia-integrity: PROBLEM {p}");
            }
            println!(
                "justitia-integrity: {}: two-sided {}: received {}; every completion, byte \
                 and guard judged here{}; seed {seed}",
                if report.clean() { "PASS" } else { "FAIL" },
                mode.as_str(),
                message_summary(&report),
                message_outcome(&report)
            );
            return Ok(report.clean());
        }
    };
    let intact = r.done && r.changed_regions == 0;
    println!(
        "justitia-integrity: {}: the client ran {} batches{}; {} of its regions changed",
        if intact { "PASS" } else { "FAIL" },
        r.batches,
        if r.done {
            " and said it was done"
        } else {
            " and went away midway"
        },
        r.changed_regions
    );
    Ok(intact)
}

/// `--connect`: every transfer of the plan as a READ across the link.
fn run_client(
    args: &Args,
    server: SocketAddr,
    seed: u64,
    plan: PlanConfig,
    options: &RigOptions,
) -> Result<bool> {
    if args.post_api != PostApi::PostSend {
        bail!("--connect posts with ibv_post_send only (--post-api post-send)");
    }
    if let Some(mode) = args.two_sided {
        return run_messages_client(args, server, seed, message_config(args, mode), options);
    }
    let mut client = across::Client::connect(server, &across_options(options), &plan, seed)
        .with_context(|| format!("connecting to the checker serving at {server}"))?;
    println!(
        "justitia-integrity: device {}, READs from the regions of {server}, up to {} bytes per transfer",
        client.device(),
        args.max_size
    );
    let mut planner = Planner::new(seed, plan);
    let mut report = Report::default();
    while report.transfers < args.transfers {
        if let Err(e) = client.run_batch(&planner.next_batch(), &mut report) {
            return Err(anyhow::Error::new(e).context(format!(
                "after {} good transfers (seed {seed}): {}",
                report.transfers,
                summary(&report)
            )));
        }
    }
    let intact = client
        .finish()
        .with_context(|| format!("after the last batch (seed {seed})"))?;
    for p in &report.problems {
        println!("justitia-integrity: PROBLEM {p}");
    }
    let clean = report.clean() && intact;
    println!(
        "justitia-integrity: {}: {}; the server's regions {}; seed {seed}",
        if clean { "PASS" } else { "FAIL" },
        summary(&report),
        if intact { "intact" } else { "CHANGED" }
    );
    Ok(clean)
}

/// The shape of a two-sided run's batches.
fn message_config(args: &Args, mode: TwoSided) -> MessageConfig {
    MessageConfig {
        mode,
        max_size: args.max_size,
        max_sges: args.max_sges,
        max_batch: args.max_batch,
        boundary: args.boundary,
        late_polling: args.late_polling,
        events: args.events,
    }
}

/// `--connect` with `--two-sided`: every message of the plan sent to the server, which
/// judges each and answers per batch.
fn run_messages_client(
    args: &Args,
    server: SocketAddr,
    seed: u64,
    config: MessageConfig,
    options: &RigOptions,
) -> Result<bool> {
    let mode = config.mode;
    if let Err(e) = config.validate() {
        bail!("--two-sided {}: {e}", mode.as_str());
    }
    let mut client =
        across::MessageClient::connect(server, &across_options(options), &config, seed)
            .with_context(|| format!("connecting to the checker serving at {server}"))?;
    println!(
        "justitia-integrity: device {}, two-sided {} to {server}, up to {} bytes per message, \
         up to {} SGEs per request and per receive",
        client.device(),
        mode.as_str(),
        args.max_size,
        args.max_sges
    );
    let mut planner = MessagePlanner::new(seed, config);
    let mut report = MessageReport::default();
    while report.messages < args.transfers && !report.stopped {
        if let Err(e) = client.run_batch(&planner.next_batch(), &mut report) {
            return Err(anyhow::Error::new(e).context(format!(
                "after {} messages (seed {seed}): {}",
                report.messages,
                message_summary(&report)
            )));
        }
    }
    if !report.stopped {
        client
            .finish(&mut report)
            .with_context(|| format!("after the last batch (seed {seed})"))?;
    }
    for p in &report.problems {
        println!("justitia-integrity: PROBLEM {p}");
    }
    println!(
        "justitia-integrity: {}: {}{}; seed {seed}",
        if report.clean() { "PASS" } else { "FAIL" },
        message_summary(&report),
        message_outcome(&report)
    );
    Ok(report.clean())
}

fn run(args: &Args) -> Result<bool> {
    if let Some(listen) = args.serve {
        let options = AcrossOptions {
            device: args.device.clone(),
            port: args.port,
            gid_index: args.gid_index,
            timeout: Duration::from_secs(args.timeout),
        };
        return run_server(listen, &options);
    }
    if args.max_sges == 0 || args.max_batch == 0 {
        bail!("--max-sges and --max-batch must be at least 1");
    }
    // Every region holds a whole batch, and an SGE's length is a 32-bit field.
    if args.max_size > 1 << 30 {
        bail!(
            "--max-size {} is above the checker's limit of 1G",
            args.max_size
        );
    }
    let seed = args.seed.unwrap_or_else(clock_seed);
    println!(
        "justitia-integrity: seed {seed} (replay with {})",
        replay_options(seed, args.post_api)
    );
    println!(
        "justitia-integrity: shaper settings: {}",
        shaper_environment()
    );
    let plan = plan_config(args);
    let options = RigOptions {
        device: args.device.clone(),
        port: args.port,
        gid_index: args.gid_index,
        completion_timeout: Duration::from_secs(args.timeout),
        post_api: args.post_api,
    };
    if args.threads > 1 {
        return run_threads(args, seed, &plan, &options);
    }
    if let Some(server) = args.connect {
        return run_client(args, server, seed, plan, &options);
    }
    let mut rig = Rig::open(&options, &plan).map_err(setup_error)?;
    println!(
        "justitia-integrity: device {}, port {}, GID index {}, up to {} bytes per transfer",
        rig.device(),
        args.port,
        args.gid_index,
        args.max_size
    );
    println!(
        "justitia-integrity: posting with {} (--post-api {})",
        args.post_api.describe(),
        args.post_api.as_str()
    );
    let mut planner = Planner::new(seed, plan);
    let mut report = Report::default();
    while report.transfers < args.transfers {
        let batch = planner.next_batch();
        if let Err(e) = rig.run_batch(&batch, &mut report) {
            let hint = provider_hint(args.post_api, args.max_sges, &e);
            return Err(anyhow::Error::new(e).context(format!(
                "after {} good transfers (seed {seed}): {}{hint}",
                report.transfers,
                summary(&report)
            )));
        }
    }
    rig.finish()
        .with_context(|| format!("after the last batch (seed {seed})"))?;
    for p in &report.problems {
        println!("justitia-integrity: PROBLEM {p}");
    }
    let verdict = if report.clean() { "PASS" } else { "FAIL" };
    println!(
        "justitia-integrity: {verdict}: {}; seed {seed}",
        summary(&report)
    );
    Ok(report.clean())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("justitia-integrity: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_size("1"), Ok(1));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("16m"), Ok(16 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("12Q").is_err());
    }

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("justitia-integrity").chain(extra.iter().copied()))
    }

    #[test]
    fn the_post_api_defaults_to_post_send_and_takes_wr() {
        assert_eq!(parse(&[]).map(|a| a.post_api).ok(), Some(PostApi::PostSend));
        for (words, api) in [
            (&["--post-api", "post-send"][..], PostApi::PostSend),
            (&["--post-api", "wr"][..], PostApi::Wr),
            (&["--post-api=wr"][..], PostApi::Wr),
        ] {
            assert_eq!(
                parse(words).map(|a| a.post_api).ok(),
                Some(api),
                "{words:?}"
            );
        }
        for bad in [
            &["--post-api", "ex"][..],
            &["--post-api"][..],
            &["--post-api", ""][..],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn threads_default_to_one_and_stay_within_sixteen() {
        assert_eq!(parse(&[]).map(|a| a.threads).ok(), Some(1));
        assert_eq!(parse(&["--threads", "4"]).map(|a| a.threads).ok(), Some(4));
        assert_eq!(parse(&["--threads=16"]).map(|a| a.threads).ok(), Some(16));
        for bad in ["0", "17", "-1", "four"] {
            assert!(
                parse(&["--threads", bad]).is_err(),
                "--threads {bad} accepted"
            );
        }
    }

    #[test]
    fn the_help_names_both_post_apis() {
        use clap::CommandFactory;
        let help = Args::command().render_long_help().to_string();
        assert!(help.contains("--post-api"), "{help}");
        assert!(help.contains("post-send") && help.contains("wr"), "{help}");
        assert!(help.contains("ibv_create_qp_ex"), "{help}");
    }

    #[test]
    fn the_post_api_does_not_change_the_plan() {
        let words = [
            "--seed",
            "7",
            "--max-size",
            "1M",
            "--boundary",
            "12345",
            "-n",
            "50",
        ];
        let classic = parse(&words).map_err(|e| e.to_string());
        let wr = parse(&[&words[..], &["--post-api", "wr"]].concat()).map_err(|e| e.to_string());
        let (Ok(classic), Ok(wr)) = (classic, wr) else {
            panic!("the test's arguments were refused");
        };
        assert_eq!(wr.post_api, PostApi::Wr);
        assert_eq!(plan_config(&classic), plan_config(&wr));
        let mut a = Planner::new(7, plan_config(&classic));
        let mut b = Planner::new(7, plan_config(&wr));
        for _ in 0..200 {
            assert_eq!(a.next_batch(), b.next_batch());
        }
    }

    #[test]
    fn two_sided_takes_send_and_write_imm_with_connect_only() {
        let connect = ["--connect", "10.0.0.2:18515"];
        assert_eq!(parse(&connect).map(|a| a.two_sided).ok(), Some(None));
        for (word, mode) in [("send", TwoSided::Send), ("write-imm", TwoSided::WriteImm)] {
            let words = [&connect[..], &["--two-sided", word]].concat();
            assert_eq!(
                parse(&words).map(|a| a.two_sided).ok(),
                Some(Some(mode)),
                "{word}"
            );
        }
        for bad in [
            &["--connect", "10.0.0.2:18515", "--two-sided", "read"][..],
            &["--connect", "10.0.0.2:18515", "--two-sided"][..],
            &[
                "--connect",
                "10.0.0.2:18515",
                "--two-sided",
                "send",
                "--no-imm",
            ][..],
            // The server takes the mode from the client's hello.
            &["--serve", "0.0.0.0:18515", "--two-sided", "send"][..],
            &["--connect", "10.0.0.2:18515", "--late-polling"][..],
            &["--connect", "10.0.0.2:18515", "--events"][..],
            &["--two-sided", "send"][..],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn two_sided_settings_come_from_the_plan_options() {
        let Ok(args) = parse(&[
            "--connect",
            "10.0.0.2:18515",
            "--two-sided",
            "write-imm",
            "--max-size",
            "1M",
            "--max-sges",
            "3",
            "--max-batch",
            "8",
            "--boundary",
            "64K",
            "--late-polling",
            "--events",
        ]) else {
            panic!("the test's arguments were refused");
        };
        let c = message_config(&args, TwoSided::WriteImm);
        assert_eq!(
            c,
            MessageConfig {
                mode: TwoSided::WriteImm,
                max_size: 1 << 20,
                max_sges: 3,
                max_batch: 8,
                boundary: Some(65536),
                late_polling: true,
                events: true,
            }
        );
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn the_provider_hint_shows_only_for_wr_completions_with_several_sges() {
        let completion = || CheckError::Completion {
            queue: "send",
            detail: "local protection error".into(),
        };
        assert!(provider_hint(PostApi::Wr, 6, &completion()).contains("--max-sges 1"));
        assert_eq!(provider_hint(PostApi::Wr, 1, &completion()), "");
        assert_eq!(provider_hint(PostApi::PostSend, 6, &completion()), "");
        let timeout = CheckError::Timeout {
            queue: "send",
            waited: Duration::from_secs(1),
            missing: 1,
            next_wr_id: 0,
        };
        assert_eq!(provider_hint(PostApi::Wr, 6, &timeout), "");
    }

    #[test]
    fn the_replay_hint_names_a_non_default_post_api() {
        assert_eq!(replay_options(5, PostApi::PostSend), "--seed 5");
        assert_eq!(replay_options(5, PostApi::Wr), "--seed 5 --post-api wr");
    }
}
