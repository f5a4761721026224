//! `justitia run`: a scenario file on real verbs. Each flow of each run becomes two
//! processes of `justitia-loadgen` on the local device (a responder, and a requester that
//! runs under the shaper when the run has a policy, with its class in `JUSTITIA_CLASS`, so
//! that it follows `justitiad` when one runs; a SEND stream's responder too, both ends
//! with `JUSTITIA_TWO_SIDED=split`, see [`shaper_env`]), connected over TCP on loopback. Runs go
//! one after another as in the simulator (with `--repeat N`, the whole scenario N times
//! over, each figure the median of the N); the report is the simulator's, its heading
//! naming the device. Before any process starts, a run is refused if it needs more
//! processes than `--max-processes` or the host has no RDMA device.
//!
//! With `--host NAME=ADDR:PORT`, the ends of flows that a two-host scenario places on
//! host NAME (requesters on their `from` host, responders on their `to` host) run on the
//! `justitia run-server` at ADDR:PORT instead ([`server`], over the protocol of `wire`),
//! and the responder listens where the requester's host can reach it.

mod compare;
mod daemon_loop;
#[cfg(test)]
mod fixtures;
mod host_timing;
mod hosts;
mod plan;
mod procs;
mod remote;
mod samples;
pub mod server;
mod spread;
mod verdict;
mod wire;

use std::collections::BTreeMap;
use std::fs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use justitia_core::flow::FlowClass;
use justitia_loadgen::clock::ClockChoice;
use justitia_loadgen::flow::{Idle, DEFAULT_ACK_TIMEOUT, MAX_ACK_TIMEOUT};
use justitia_loadgen::plan::{FlowOutcome, FlowPlan, LatencyMethod, Op, Percentiles, Workload};
use justitia_sim::report::jain_index;
use justitia_sim::{FlowReport, LatencyReport, RunReport, ScenarioReport};

use crate::backend::Backend;
use crate::{control_plot, export, plot, simulate, table};
use host_timing::{idle_name, IdleChoice, RequesterClock};
use hosts::Place;
use plan::{RealFlow, RealRun, Timing};
use procs::{Group, Said};
use remote::Link;
use wire::{Role, ToServer};

/// How long a flow's processes may take to connect before the run gives up.
const CONNECT_DEADLINE: Duration = Duration::from_secs(60);

/// What the requester's plan may take beyond the run's duration (draining, reporting).
const FINISH_SLACK: Duration = Duration::from_secs(30);

/// Where the kernel lists the host's RDMA devices.
const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// The default of `--max-processes` (and of run-server's): room for 32 flows in one run. The scenarios in
/// `scenarios/` that real verbs can run need at most 16 processes in a run, apart from
/// perf-p5-1000-bapps-roce100 (2002); that one, like a slip such as `copies = 300` (602
/// processes, each polling a queue pair), is refused instead of swamping the host.
pub(crate) const DEFAULT_MAX_PROCESSES: u32 = 64;

/// Arguments of `justitia run`.
#[derive(Args, Debug)]
#[command(after_help = "\
Each flow of each run is two processes of justitia-loadgen on the device: the responder,
and the requester, which runs under the shaper (LD_PRELOAD=libjustitia.so, JUSTITIA_CLASS
from the flow's class) in runs with a policy, and so follows justitiad when one runs. A
SEND stream's two ends both run under it then, with JUSTITIA_TWO_SIDED=split, so that
their shapers split its SENDs when their daemons pair them.
Connection set-up is over TCP on loopback. Scenarios with service levels, rpc or storage
flows, pauses or a simulator-only policy are refused by name before anything starts; a
scenario's topology is the model's (on real verbs the hosts' own network joins them).

Across two hosts: start `justitia run-server` on the other host and map the scenario's
host name to it with --host (or a --hosts file: `[hosts]` then b = \"10.77.0.2:7771\").
Each flow's requester runs on its `from` host and its responder on its `to` host; hosts
not mapped run here, and a flow whose two ends land on one device runs there as without
--host. The run-server uses its own device, load generator, shaper, clock and idle mode.

Examples:
  justitia run lat-vs-1mb-bw-ib56 -d rxe0 --duration-ms 2000 --warmup-ms 200
  justitia run lat-vs-1mb-bw-ib56 -d rxe0 --compare --max-p99-ratio 1.2 --min-rate-ratio 0.8
  justitia run lat-vs-1mb-bw-ib56 -d rxe0 --repeat 5 --max-p99-ratio 1.2 --min-rate-ratio 0.8
  justitia run-server --listen 10.77.0.2:7771 -d rxe0            (on host B)
  justitia run lat-vs-1mb-bw-ib56 -d rxe0 --host b=10.77.0.2:7771 (on host A)")]
pub struct RunArgs {
    /// The scenario file; a bare name stands for `scenarios/<name>.toml`.
    #[arg(value_name = "FILE")]
    file: PathBuf,
    /// This host's device, port, GID index and ACK timeout.
    #[command(flatten)]
    on: DeviceArgs,
    /// Each run's duration on the device, ms (default: the scenario's); flows' start and
    /// stop times scale with it.
    #[arg(long)]
    duration_ms: Option<f64>,
    /// Each run's unmeasured start, ms (default: the scenario's, scaled like the duration).
    #[arg(long)]
    warmup_ms: Option<f64>,
    /// Time every latency flow this way instead of as the scenario says: `post-poll`,
    /// `ping-pong` (perftest's half round trip) or `rperf` (T_W - T_L).
    #[arg(long, value_enum)]
    latency_method: Option<MethodArg>,
    /// The clock of latency samples: the TSC calibrated against CLOCK_MONOTONIC when it is
    /// invariant (`auto` falls back to the monotonic clock where it is not, saying so).
    #[arg(long, value_enum, default_value_t = ClockChoice::Auto)]
    clock: ClockChoice,
    /// What a load generator waiting for a timed sample does when a poll finds nothing:
    /// `spin` polls again at once; `yield` gives up the CPU after 256 empty polls and
    /// counts the samples that yielded; `auto` yields on a software RNIC (Soft-RoCE, siw),
    /// whose work runs on the CPUs the pollers would spin on, and spins on any other.
    #[arg(long, value_enum, default_value_t = IdleChoice::Auto)]
    idle: IdleChoice,
    /// The shaper (default: libjustitia.so beside this program).
    #[arg(long)]
    shaper: Option<PathBuf>,
    /// The load generator (default: justitia-loadgen beside this program).
    #[arg(long)]
    loadgen: Option<PathBuf>,
    /// Also simulate the scenario and print model vs measured for every figure.
    #[arg(long)]
    compare: bool,
    /// Verdict: fail a victim with latency samples whose p99 under competition exceeds this
    /// multiple of its p99 alone (a p99 of fewer than 100 samples is not judged).
    #[arg(long)]
    max_p99_ratio: Option<f64>,
    /// Verdict: fail a victim whose rate under competition is below this fraction of its
    /// rate alone (goodput for bandwidth flows, messages/s for the others).
    #[arg(long)]
    min_rate_ratio: Option<f64>,
    /// The victims of the verdict (default: every flow with an alone run).
    #[arg(long)]
    victim: Vec<String>,
    /// justitiad's metrics endpoint on this host (`metrics` in its configuration): read
    /// every 100 ms while a run with a policy measures, so that the report says how often
    /// the loop cut SafeUtil, `--out` keeps SafeUtil, Current99 and Target99 over time in
    /// each run's series and `--plot` draws them (`<scenario>-control.svg`).
    #[arg(long, value_name = "ADDR:PORT")]
    daemon_metrics: Option<SocketAddr>,
    /// Run only these of the scenario's runs (its variants, by name; repeat the flag or
    /// separate names with commas), in the scenario's order: a scenario's native and
    /// policy runs measured, and judged, apart.
    #[arg(long, value_name = "RUN", value_delimiter = ',')]
    only: Vec<String>,
    /// Measure every run of the scenario N times (the whole scenario over, N rounds); each
    /// figure is the median of the N, shown with its smallest and largest, and the verdict
    /// is taken on the medians.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeat: u32,
    /// The most processes one run may start (two per flow); a scenario needing more is
    /// refused before anything starts.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_PROCESSES,
          value_parser = clap::value_parser!(u32).range(2..=100_000))]
    max_processes: u32,
    /// Write `<scenario>.json`, `.csv`, `-series.csv` and `-outcomes.json` into DIR.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Write the SVG figures into DIR.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Run the flow ends that the scenario places on host NAME on the `justitia
    /// run-server` at ADDR:PORT (repeatable); hosts not named run here.
    #[arg(long = "host", value_name = "NAME=ADDR:PORT")]
    host: Vec<String>,
    /// A TOML file of host mappings (`[hosts]` then `b = "10.77.0.2:7771"`); --host wins
    /// over it for the same name.
    #[arg(long, value_name = "FILE")]
    hosts: Option<PathBuf>,
    /// Where the kernel lists RDMA devices (for hosts and tests that mount it elsewhere).
    #[arg(long, value_name = "DIR", default_value = SYSFS_INFINIBAND, hide = true)]
    sysfs_infiniband: PathBuf,
}

/// A host's device options, which every load generator started there is given:
/// `justitia run`'s for this host, `justitia run-server`'s for its own.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// RDMA device (default: the first one).
    #[arg(long, short = 'd')]
    pub device: Option<String>,
    /// Port number.
    #[arg(long, default_value_t = 1)]
    pub port: u8,
    /// GID index (0 is the IPv6 link-local GID on Soft-RoCE).
    #[arg(long, short = 'x', default_value_t = 0)]
    pub gid_index: u8,
    /// The load generators' local ACK timeout, n in 4.096 us x 2^n (14: 67 ms, perftest's):
    /// above the longest a request waits in the path's queues (a rate-limited wire's), or
    /// the sender resends what was never lost.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_ACK_TIMEOUT,
          value_parser = clap::value_parser!(u8).range(1..=MAX_ACK_TIMEOUT as i64))]
    pub ack_timeout: u8,
}

impl DeviceArgs {
    /// Adds them to a load generator's command line.
    pub fn add_to(&self, c: &mut Command) {
        if let Some(d) = &self.device {
            c.args(["--device", d]);
        }
        c.args(["--port", &self.port.to_string()]);
        c.args(["--gid-index", &self.gid_index.to_string()]);
        c.args(["--ack-timeout", &self.ack_timeout.to_string()]);
    }
}

/// `--latency-method`'s values.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum MethodArg {
    PostPoll,
    PingPong,
    Rperf,
}

impl MethodArg {
    fn method(self) -> LatencyMethod {
        match self {
            MethodArg::PostPoll => LatencyMethod::PostPoll,
            MethodArg::PingPong => LatencyMethod::PingPong,
            MethodArg::Rperf => LatencyMethod::Rperf,
        }
    }
}

/// Runs `justitia run`.
pub fn run(args: &RunArgs) -> Result<()> {
    let (path, experiment) = simulate::load(&args.file)?;
    let refused = plan::refusals(&experiment);
    if !refused.is_empty() {
        bail!(
            "scenario {} cannot run on real verbs:\n  {}",
            path.display(),
            refused.join("\n  ")
        );
    }
    let s = &experiment.scenario;
    let duration_ms = args.duration_ms.unwrap_or(s.duration_ms);
    if !(duration_ms.is_finite() && duration_ms > 0.0 && duration_ms <= 600_000.0) {
        bail!("--duration-ms must be above 0 and at most 600000, got {duration_ms}");
    }
    let warmup_ms = args
        .warmup_ms
        .unwrap_or(s.warmup_ms * duration_ms / s.duration_ms);
    if !(warmup_ms.is_finite() && warmup_ms >= 0.0 && warmup_ms < duration_ms) {
        bail!("--warmup-ms must be at least 0 and below the duration ({duration_ms}), got {warmup_ms}");
    }
    let limits = verdict::Limits {
        max_p99_ratio: args.max_p99_ratio,
        min_rate_ratio: args.min_rate_ratio,
    };
    let timing = Timing {
        duration_ms,
        warmup_ms,
    };
    let runs = plan::only(
        plan::runs(
            &experiment,
            timing,
            args.latency_method.map(MethodArg::method),
        ),
        &args.only,
    )?;
    for flow in runs.iter().flat_map(|r| &r.flows) {
        flow.plan.validate()?;
    }
    plan::check_processes(&runs, args.max_processes as usize)?;
    let map = hosts::host_map(&args.host, args.hosts.as_deref(), &s.topology.hosts)?;
    let (places, servers) = hosts::places(&s.topology.hosts, &map);
    let place_of = |host: &str| places.get(host).copied().unwrap_or(Place::Here);
    let one_device = |f: &RealFlow| place_of(&f.from) == place_of(&f.to);
    plan::check_rperf_verdict(&runs, args.max_p99_ratio, &one_device)?;
    if !map.is_empty() {
        let mut said = std::collections::BTreeSet::new();
        for f in runs.iter().flat_map(|r| &r.flows) {
            if f.from != f.to && one_device(f) && said.insert((&f.from, &f.to)) {
                eprintln!(
                    "hosts {} and {} both run {}: the flows between them have both ends on one device, as without --host",
                    f.from,
                    f.to,
                    match place_of(&f.from) {
                        Place::Here => "here".to_string(),
                        Place::Server(n) => format!("on the run-server at {}", servers[n].0),
                    }
                );
            }
        }
    }
    let flows = || runs.iter().flat_map(|r| &r.flows);
    let is_latency = |f: &RealFlow| matches!(f.plan.workload, Workload::Latency { .. });
    let here = flows().any(|f| place_of(&f.from) == Place::Here || place_of(&f.to) == Place::Here);
    if here {
        plan::check_device(&args.sysfs_infiniband, args.on.device.as_deref())?;
    }
    // This host's requesters' clock and idle mode, decided here once, before anything
    // starts (a run-server decides its own host's by the same rules).
    let has_latency = flows().any(|f| place_of(&f.from) == Place::Here && is_latency(f));
    let clock = RequesterClock::decide(has_latency, args.clock)?;
    let idle = if here {
        args.idle
            .decide(&args.sysfs_infiniband, args.on.device.as_deref())?
    } else {
        Idle::Spin
    };
    let loadgen = if here {
        beside_me(args.loadgen.as_deref(), "justitia-loadgen")?
    } else {
        PathBuf::new()
    };
    // Whether a requester placed by `place` runs under the shaper in some run.
    let shaped_at = |place: Place| {
        runs.iter().any(|r| {
            plan::shaper_policy(r.variant.policy) != Some(None)
                && r.flows.iter().any(|f| place_of(&f.from) == place)
        })
    };
    let shaper = if shaped_at(Place::Here) {
        Some(beside_me(args.shaper.as_deref(), "libjustitia.so")?)
    } else {
        None
    };
    let links = connect(args, &servers, &|n| {
        (
            flows().any(|f| place_of(&f.from) == Place::Server(n) && is_latency(f)),
            shaped_at(Place::Server(n)),
        )
    })?;
    for dir in [&args.out, &args.plot].into_iter().flatten() {
        fs::create_dir_all(dir)
            .with_context(|| format!("creating output folder {}", dir.display()))?;
    }
    let model = if args.compare {
        eprintln!("{}: simulating the model first", experiment.name);
        Some(simulate::simulate(&path, &experiment)?)
    } else {
        None
    };
    let device = args
        .on
        .device
        .clone()
        .unwrap_or_else(|| "(first device)".to_string());
    procs::catch_interrupts();
    let runner = Runner {
        args,
        loadgen,
        shaper,
        clock,
        idle,
        places: places.clone(),
        links,
    };
    let rounds = args.repeat as usize;
    let mut repeats: Vec<ScenarioReport> = Vec::with_capacity(rounds);
    let mut outcomes = Vec::new();
    // Whole rounds rather than each run N times in a row: whatever drifts on the host
    // over the minutes of a measurement then falls on every run alike.
    let mut loop_lines = Vec::new();
    for round in 0..rounds {
        let mut reports = Vec::new();
        for (i, run) in runs.iter().enumerate() {
            let label = if rounds > 1 {
                format!(
                    "[repeat {}/{rounds}, run {}/{}] `{}`",
                    round + 1,
                    i + 1,
                    runs.len(),
                    run.variant.name
                )
            } else {
                format!("[{}/{}] `{}`", i + 1, runs.len(), run.variant.name)
            };
            let started = Instant::now();
            let (got, readings) = runner.run_one(run, &label, timing).with_context(|| {
                if rounds > 1 {
                    format!("run `{}` (repeat {}/{rounds})", run.variant.name, round + 1)
                } else {
                    format!("run `{}`", run.variant.name)
                }
            })?;
            let mut report =
                run_report(run, &got, started.elapsed().as_secs_f64(), link_gbps(args));
            if let Some(readings) = readings {
                loop_lines.push(loop_line(&readings, &run.variant.name, round, rounds));
                report.series = daemon_loop::series(&readings.readings, "this host");
            }
            reports.push(report);
            outcomes.push(Measured {
                repeat: round + 1,
                run: run.variant.name.clone(),
                plans: run.flows.iter().map(|f| f.plan.clone()).collect(),
                ends: run.flows.iter().map(|f| runner.ends(f)).collect(),
                flows: got,
            });
        }
        repeats.push(ScenarioReport {
            scenario: experiment.name.clone(),
            description: s.description.clone(),
            profile: experiment.profile.name().to_string(),
            seed: s.seed,
            duration_ms,
            warmup_ms,
            runs: reports,
        });
    }
    let mut report = spread::median_report(&repeats).context("no run was measured")?;
    // Medians have no time series: each run's is its last repeat's.
    if let Some(last) = repeats.last() {
        for (run, measured) in report.runs.iter_mut().zip(&last.runs) {
            run.series = measured.series.clone();
        }
    }
    // The heading names every host's device: this one's, and each run-server's.
    let mut devices = vec![device.clone()];
    devices.extend(runner.links.iter().map(|l| {
        format!(
            "{} at {}",
            l.welcome().device.as_deref().unwrap_or("(first device)"),
            l.addr()
        )
    }));
    let backend = Backend::Verbs {
        device: devices.join(" and "),
    };
    if rounds > 1 {
        println!("every figure below is the median of {rounds} repeats of each run");
    }
    print!("{}", table::render_on(&report, &backend));
    if rounds > 1 {
        println!();
        print!("{}", spread::render(&repeats));
    }
    let notes = samples::notes(&report);
    if !notes.is_empty() {
        println!();
        println!("too few latency samples for a tail:");
        for note in notes {
            println!("  {note}");
        }
    }
    for line in timing_lines(&outcomes) {
        println!("{line}");
    }
    for line in rperf_lines(&outcomes, rounds) {
        println!("{line}");
    }
    for line in &loop_lines {
        println!("{line}");
    }
    if !runner.links.is_empty() {
        println!("where each flow's ends ran:");
        let mut said = std::collections::BTreeSet::new();
        for f in runs.iter().flat_map(|r| &r.flows) {
            if said.insert(&f.plan.name) {
                println!(
                    "  {}: requester on {}, responder on {}",
                    f.plan.name,
                    runner.shown_at(&f.from),
                    runner.shown_at(&f.to)
                );
            }
        }
    }
    let mut written = Vec::new();
    if let Some(dir) = &args.out {
        written.push(export::write_json(&report, dir)?);
        written.push(export::write_csv(&report, dir)?);
        written.push(export::write_series_csv(&report, dir)?);
        let path = dir.join(format!("{}-outcomes.json", report.scenario));
        let text = serde_json::to_string_pretty(&outcomes_json(
            &outcomes,
            &device,
            clock,
            idle,
            &runner.servers_json(),
        ))?;
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
        if rounds > 1 {
            let path = dir.join(format!("{}-repeats.json", report.scenario));
            let text = serde_json::to_string_pretty(&repeats)?;
            fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
        }
    }
    if let Some(dir) = &args.plot {
        written.extend(plot::write_figures_on(&report, dir, &backend)?);
        written.extend(control_plot::write_control_figure(&report, dir, &backend)?);
    }
    for file in written {
        eprintln!("wrote {}", file.display());
    }
    if let Some(model) = &model {
        println!();
        let rows = compare::rows(model, &report);
        print!(
            "{}",
            compare::render(&rows, &report.scenario, &report.profile, &device)
        );
    }
    if limits.max_p99_ratio.is_some() || limits.min_rate_ratio.is_some() {
        let verdict = verdict::judge(&repeats, limits, &args.victim)?;
        println!();
        if rounds > 1 {
            println!("isolation verdict, on the medians of {rounds} repeats:");
        } else {
            println!("isolation verdict:");
        }
        for line in verdict.lines() {
            println!("  {line}");
        }
        if let Some(why) = verdict.failure() {
            bail!("isolation verdict: {why}");
        }
        println!("  {}", verdict.summary());
    }
    Ok(())
}

/// The outcomes of one run of one repeat, as the load generators said them.
struct Measured {
    /// The repeat, from 1.
    repeat: usize,
    /// The run's name.
    run: String,
    /// What each flow's load generator was told to do (method, operation, size, depth).
    plans: Vec<FlowPlan>,
    /// Where each flow's ends ran.
    ends: Vec<serde_json::Value>,
    /// Its flows' outcomes.
    flows: Vec<FlowOutcome>,
}

/// `-outcomes.json`: every run of every repeat as measured, with what a reader needs to
/// redo it (perftest prints the same in its header): the device, the requesters' clock
/// and its rate, the idle mode of timed waits (each of these for this host, and in
/// `servers` for each run-server's), each flow's plan and where its two ends ran.
fn outcomes_json(
    outcomes: &[Measured],
    device: &str,
    clock: RequesterClock,
    idle: Idle,
    servers: &serde_json::Value,
) -> serde_json::Value {
    let clock = clock.to_json();
    serde_json::Value::Array(
        outcomes
            .iter()
            .map(|m| {
                serde_json::json!({
                    "repeat": m.repeat,
                    "run": m.run,
                    "device": device,
                    "clock": clock,
                    "idle": idle_name(idle),
                    "plans": m.plans,
                    "ends": m.ends,
                    "servers": servers,
                    "flows": m.flows,
                })
            })
            .collect(),
    )
}

/// How the flows were measured, as perftest's header says it: the clocks that timed the
/// latency samples, whether the devices offer NIC completion time stamps and whether
/// they were read (RPerf's T_W - T_L only; every other figure is the host's), and the
/// path MTUs the queue pairs were connected with. Each line lists the distinct values
/// over every host's flows.
fn timing_lines(outcomes: &[Measured]) -> Vec<String> {
    use std::collections::BTreeSet;
    let flows = || outcomes.iter().flat_map(|m| &m.flows);
    let timed = || flows().filter(|f| f.latency.is_some());
    let mut out = Vec::new();
    let clocks: BTreeSet<&str> = timed().map(|f| f.clock.as_str()).collect();
    if !clocks.is_empty() {
        let clocks: Vec<&str> = clocks.into_iter().collect();
        out.push(format!("latency samples timed by: {}", clocks.join(", ")));
        let nic: BTreeSet<String> = timed()
            .map(|f| match (f.nic_clock_khz, f.nic_stamps_read) {
                (Some(khz), true) => format!("offered at {khz} kHz, read for RPerf's T_W - T_L"),
                (Some(khz), false) => format!("offered at {khz} kHz, not read"),
                (None, _) => "none offered by the device".to_string(),
            })
            .collect();
        let nic: Vec<String> = nic.into_iter().collect();
        let whose = if timed().any(|f| f.nic_stamps_read) {
            "RPerf's T_W - T_L from the NIC's completion times and the host's between the two posts, every other figure the host's"
        } else {
            "every sample is the host's"
        };
        out.push(format!(
            "NIC completion time stamps: {}; {whose}",
            nic.join(", ")
        ));
    }
    let mtus: BTreeSet<u32> = flows().filter_map(|f| f.path_mtu).collect();
    if !mtus.is_empty() {
        let mtus: Vec<String> = mtus.iter().map(|m| format!("{m} B")).collect();
        out.push(format!("path MTU: {}", mtus.join(", ")));
    }
    out
}

/// RPerf's parts for each flow timed by it: T_W - T_L beside T_W and the loopback's own T_L;
/// each repeat its own line when there are `rounds` > 1.
fn rperf_lines(outcomes: &[Measured], rounds: usize) -> Vec<String> {
    let mut out = Vec::new();
    for m in outcomes {
        let at = if rounds > 1 {
            format!("`{}` (repeat {}/{rounds})", m.run, m.repeat)
        } else {
            format!("`{}`", m.run)
        };
        for f in &m.flows {
            if let (Some(rtt), Some(w), Some(l)) = (&f.latency, &f.wire, &f.loopback) {
                out.push(format!(
                    "rperf {} in {at}: T_W - T_L median {:.2} us (p99 {:.2}); T_W median {:.2} us; loopback T_L median {:.2} us; {} of {} pairs had T_L > T_W; clock {}",
                    f.name, rtt.p50_us, rtt.p99_us, w.p50_us, l.p50_us, f.negative_samples, rtt.samples, f.clock
                ));
            }
        }
    }
    out
}

/// What the daemon's loop did during one run: its decreases per second, SafeUtil's range,
/// Current99's largest and Target99.
fn loop_line(recorded: &daemon_loop::Recorded, run: &str, round: usize, rounds: usize) -> String {
    let at = if rounds > 1 {
        format!("`{run}` (repeat {}/{rounds})", round + 1)
    } else {
        format!("`{run}`")
    };
    let (readings, missed) = (&recorded.readings, recorded.failed);
    let Some((cuts, seconds)) = daemon_loop::decreases(readings) else {
        return format!(
            "justitiad's loop in {at}: no reading of its metrics ({missed} reads failed)"
        );
    };
    let safe = readings
        .iter()
        .map(|r| r.safe_util_bytes_per_sec * 8.0 / 1e9);
    let (low, high) = safe.fold((f64::INFINITY, 0.0f64), |(l, h), v| (l.min(v), h.max(v)));
    let current = readings
        .iter()
        .filter_map(|r| r.current99_s)
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    let target = readings.iter().rev().find_map(|r| r.target99_s);
    let us = |v: Option<f64>| v.map_or("-".to_string(), |s| format!("{:.0} us", s * 1e6));
    format!(
        "justitiad's loop in {at}: {cuts:.0} decreases in {seconds:.1} s ({:.1}/s), SafeUtil {low:.4}..{high:.4} Gb/s, Current99 up to {}, Target99 {} ({} readings{})",
        if seconds > 0.0 { cuts / seconds } else { 0.0 },
        us(current),
        us(target),
        readings.len(),
        if missed > 0 { format!(", {missed} failed") } else { String::new() }
    )
}

/// `explicit`, or `name` in the folder of the running program.
pub(crate) fn beside_me(explicit: Option<&Path>, name: &str) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let me = std::env::current_exe().context("locating this program")?;
    let path = me.with_file_name(name);
    if !path.exists() {
        bail!(
            "{} not found beside {} (build it, e.g. `cargo build --release -p {}`, or name it on the command line)",
            name,
            me.display(),
            if name.ends_with(".so") { "justitia-preload" } else { "justitia-loadgen" }
        );
    }
    Ok(path)
}

/// The device port's rate from sysfs (`40 Gb/sec (4X QDR)`), for the utilisation figure.
fn link_gbps(args: &RunArgs) -> Option<f64> {
    let device = args.on.device.as_deref()?;
    let text = fs::read_to_string(format!(
        "/sys/class/infiniband/{device}/ports/{}/rate",
        args.on.port
    ))
    .ok()?;
    text.split_whitespace()
        .next()?
        .parse()
        .ok()
        .filter(|g: &f64| *g > 0.0)
}

fn latency_report(p: &Percentiles) -> LatencyReport {
    LatencyReport {
        samples: p.samples,
        p50_us: p.p50_us,
        p99_us: p.p99_us,
        p999_us: p.p999_us,
        mean_us: p.mean_us,
        max_us: p.max_us,
    }
}

fn run_report(run: &RealRun, outcomes: &[FlowOutcome], wall: f64, link: Option<f64>) -> RunReport {
    let flows: Vec<FlowReport> = run
        .flows
        .iter()
        .zip(outcomes)
        .map(|(f, o)| FlowReport {
            name: o.name.clone(),
            class: f.class,
            app: f.app.to_string(),
            messages: o.messages,
            msgs_per_sec: o.msgs_per_sec(),
            gbps: o.gbps(),
            latency: o.latency.as_ref().map(latency_report),
        })
        .collect();
    let total: f64 = flows.iter().map(|f| f.gbps).sum();
    let bandwidth: Vec<f64> = flows
        .iter()
        .filter(|f| f.class == FlowClass::Bandwidth)
        .map(|f| f.gbps)
        .collect();
    RunReport {
        variant: run.variant.name.clone(),
        policy: run.variant.policy.as_str().to_string(),
        utilisation: link.map_or(0.0, |l| total / l),
        jain_bandwidth: jain_index(&bandwidth),
        flows,
        policy_figures: Default::default(),
        fabric_figures: Default::default(),
        events: 0,
        series: Default::default(),
        wall_seconds: wall,
    }
}

/// Connects to every run-server in `servers` (address and the scenario hosts it serves),
/// before anything starts: `needs(n)` says whether server `n` has requesters that time
/// latency and whether it has shaped ones. A server unreachable, refusing, or without a
/// shaper it needs stops the command here.
fn connect(
    args: &RunArgs,
    servers: &[(SocketAddr, Vec<String>)],
    needs: &dyn Fn(usize) -> (bool, bool),
) -> Result<Vec<Arc<Link>>> {
    let mut links = Vec::with_capacity(servers.len());
    for (n, (addr, names)) in servers.iter().enumerate() {
        let (latency, shaped) = needs(n);
        let hello = ToServer::Hello {
            version: wire::VERSION,
            latency,
            clock: args.clock,
            idle: args.idle,
        };
        let link = Link::connect(&names.join(", "), *addr, &hello)?;
        let w = link.welcome();
        if shaped && !w.shaper {
            bail!(
                "run-server for host {} at {addr} has no shaper, and runs with a policy place requesters there (start it with --shaper)",
                names.join(", ")
            );
        }
        eprintln!(
            "host {}: run-server {addr}, device {}, clock {}, idle {}",
            names.join(", "),
            w.device.as_deref().unwrap_or("(first device)"),
            w.clock,
            w.idle
        );
        links.push(link);
    }
    Ok(links)
}

struct Runner<'a> {
    args: &'a RunArgs,
    /// The load generator here (unused when nothing runs here).
    loadgen: PathBuf,
    shaper: Option<PathBuf>,
    /// How every requester here times its samples.
    clock: RequesterClock,
    /// What every load generator's timed waits here do on an empty poll.
    idle: Idle,
    /// Where each scenario host's processes run.
    places: BTreeMap<String, Place>,
    /// The run-servers, by [`Place::Server`]'s index.
    links: Vec<Arc<Link>>,
}

/// The unspecified address of `ip`'s family: where a responder listens for a requester on
/// another host that reaches it at `ip`.
fn any_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

impl Runner<'_> {
    fn place(&self, host: &str) -> Place {
        self.places.get(host).copied().unwrap_or(Place::Here)
    }

    /// `a (here)` or `b (run-server 10.77.0.2:7771)`.
    fn shown_at(&self, host: &str) -> String {
        match self.place(host) {
            Place::Here => format!("{host} (here)"),
            Place::Server(n) => format!("{host} (run-server {})", self.links[n].addr()),
        }
    }

    /// Where flow `f`'s two ends run, for `-outcomes.json`.
    fn ends(&self, f: &RealFlow) -> serde_json::Value {
        let end = |host: &str| match self.place(host) {
            Place::Here => serde_json::json!({ "host": host, "on": "here" }),
            Place::Server(n) => serde_json::json!({
                "host": host,
                "on": self.links[n].addr().to_string(),
            }),
        };
        serde_json::json!({
            "flow": f.plan.name,
            "requester": end(&f.from),
            "responder": end(&f.to),
        })
    }

    /// Each run-server's address, hosts, device, requesters' clock and idle mode.
    fn servers_json(&self) -> serde_json::Value {
        let servers = self
            .links
            .iter()
            .enumerate()
            .map(|(n, link)| {
                let w = link.welcome();
                let hosts: Vec<&String> = self
                    .places
                    .iter()
                    .filter(|(_, p)| **p == Place::Server(n))
                    .map(|(h, _)| h)
                    .collect();
                serde_json::json!({
                    "address": link.addr().to_string(),
                    "hosts": hosts,
                    "device": w.device.as_deref().unwrap_or("(first device)"),
                    "clock": w.clock.to_json(),
                    "idle": w.idle,
                })
            })
            .collect();
        serde_json::Value::Array(servers)
    }

    fn base_command(&self, plan_json: &str) -> Command {
        let mut c = Command::new(&self.loadgen);
        self.args.on.add_to(&mut c);
        c.args(["--idle", idle_name(self.idle)]);
        c.args(["--plan", plan_json]);
        c
    }

    /// Starts flow `f`'s end `role` where its host runs (the `to` host's responder,
    /// listening on `addr`; the `from` host's requester, connecting to `addr`), under the
    /// shaper when [`shaper_env`] says so for `policy`.
    fn spawn_end(
        &self,
        group: &mut Group,
        f: &RealFlow,
        role: Role,
        addr: SocketAddr,
        policy: Option<&str>,
    ) -> Result<usize> {
        let env = shaper_env(f, policy, role);
        let (host, what) = match role {
            Role::Respond => (&f.to, "responder"),
            Role::Request => (&f.from, "requester"),
        };
        match self.place(host) {
            Place::Here => {
                let mut c = self.base_command(&serde_json::to_string(&f.plan)?);
                match role {
                    Role::Respond => {
                        c.args(["respond", "--listen", &addr.to_string()]);
                    }
                    Role::Request => {
                        c.args(["request", "--connect", &addr.to_string()]);
                        self.clock.add_to(&mut c);
                    }
                }
                self.shape(&mut c, &env);
                group.spawn(format!("flow {} ({what})", f.plan.name), c)
            }
            Place::Server(n) => group.spawn_remote(
                format!("flow {} ({what} on {host})", f.plan.name),
                &self.links[n],
                wire::Spawn::of_end(role, f.plan.clone(), addr, env),
            ),
        }
    }

    /// Puts a local kid under the shaper with `env`, when there is any (and a shaper).
    fn shape(&self, c: &mut Command, env: &BTreeMap<String, String>) {
        if let (false, Some(lib)) = (env.is_empty(), &self.shaper) {
            c.env("LD_PRELOAD", lib).envs(env);
        }
    }

    /// Where flow `f`'s responder listens, and the address its requester connects to
    /// once the responder says `port`: loopback when both ends share a host, else any
    /// address there and the responder's host as the requester's host reaches it.
    fn addresses(&self, f: &RealFlow) -> (SocketAddr, impl Fn(u16) -> SocketAddr) {
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let (from, to) = (self.place(&f.from), self.place(&f.to));
        let reach = match (from, to) {
            _ if from == to => loopback,
            (_, Place::Server(n)) => self.links[n].addr().ip(),
            (Place::Server(n), Place::Here) => self.links[n].local_ip(),
            (Place::Here, Place::Here) => loopback,
        };
        let listen = if from == to { loopback } else { any_of(reach) };
        (SocketAddr::new(listen, 0), move |port| {
            SocketAddr::new(reach, port)
        })
    }

    /// Runs one variant: starts every flow's responder, then its requester, waits for all
    /// to be connected, starts them together, shows progress, collects their outcomes.
    /// Each end runs on its scenario host, here or on its run-server, alike.
    /// The outcomes, and with `--daemon-metrics` in a run with a policy what the daemon's
    /// endpoint said while the flows ran (and how many reads found nothing).
    fn run_one(
        &self,
        run: &RealRun,
        label: &str,
        timing: Timing,
    ) -> Result<(Vec<FlowOutcome>, Option<daemon_loop::Recorded>)> {
        let mut group = Group::new();
        let policy = plan::shaper_policy(run.variant.policy).flatten();
        let n = run.flows.len();
        let mut responders = Vec::with_capacity(n);
        for f in &run.flows {
            let (listen, _) = self.addresses(f);
            responders.push(self.spawn_end(&mut group, f, Role::Respond, listen, policy)?);
        }
        // Each responder says its port.
        let mut ports = vec![None; n];
        let deadline = Instant::now() + CONNECT_DEADLINE;
        while ports.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let late = ports.iter().position(Option::is_none).unwrap_or(0);
                bail!(
                    "{} did not listen within {} s",
                    group.kid(responders[late]).label,
                    CONNECT_DEADLINE.as_secs()
                );
            }
            if let Some((kid, said)) = group.next(left.min(Duration::from_millis(200)))? {
                let Some(flow) = responders.iter().position(|&r| r == kid) else {
                    continue;
                };
                match said {
                    Said::Line(line) => {
                        if let Some(port) = line.strip_prefix("listening ") {
                            ports[flow] =
                                Some(port.trim().parse::<u16>().with_context(|| {
                                    format!("{}: `{line}`", group.kid(kid).label)
                                })?);
                        }
                    }
                    Said::Closed => bail!("{}", group.failure(kid, Duration::from_secs(2))),
                }
            }
        }
        let mut requesters = Vec::with_capacity(n);
        for (f, port) in run.flows.iter().zip(&ports) {
            let (_, reach) = self.addresses(f);
            let connect = reach(port.unwrap_or(0));
            requesters.push(self.spawn_end(&mut group, f, Role::Request, connect, policy)?);
        }
        let mut ready = vec![false; n];
        let mut outcomes: Vec<Option<FlowOutcome>> = vec![None; n];
        while ready.iter().any(|r| !r) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let late = ready.iter().position(|r| !r).unwrap_or(0);
                bail!(
                    "{} was not connected within {} s",
                    group.kid(requesters[late]).label,
                    CONNECT_DEADLINE.as_secs()
                );
            }
            if let Some((kid, said)) = group.next(left.min(Duration::from_millis(200)))? {
                match (requesters.iter().position(|&r| r == kid), said) {
                    (Some(flow), Said::Line(line)) if line == "ready" => ready[flow] = true,
                    (_, Said::Closed) => bail!("{}", group.failure(kid, Duration::from_secs(2))),
                    _ => {}
                }
            }
        }
        for &kid in &requesters {
            group.tell(kid, "go")?;
        }
        let recorder = match (self.args.daemon_metrics, policy) {
            (Some(addr), Some(_)) => Some(daemon_loop::Recorder::start(addr)),
            _ => None,
        };
        let begun = Instant::now();
        let total = Duration::from_secs_f64(timing.duration_ms / 1e3);
        let mut shown = Instant::now();
        eprintln!(
            "{label}: {n} flows running for {:.1} s",
            total.as_secs_f64()
        );
        while outcomes.iter().any(Option::is_none) {
            if begun.elapsed() > total + FINISH_SLACK {
                let late = outcomes.iter().position(Option::is_none).unwrap_or(0);
                bail!(
                    "{} gave no outcome within {} s of the run's end",
                    group.kid(requesters[late]).label,
                    FINISH_SLACK.as_secs()
                );
            }
            if shown.elapsed() >= Duration::from_secs(1) {
                shown = Instant::now();
                let done = outcomes.iter().filter(|o| o.is_some()).count();
                eprintln!(
                    "{label}: {:.1} s of {:.1} s, {done}/{n} flows done",
                    begun.elapsed().as_secs_f64().min(total.as_secs_f64()),
                    total.as_secs_f64()
                );
            }
            let Some((kid, said)) = group.next(Duration::from_millis(200))? else {
                continue;
            };
            match (requesters.iter().position(|&r| r == kid), said) {
                (Some(flow), Said::Line(line)) => {
                    if let Some(json) = line.strip_prefix("outcome ") {
                        let o: FlowOutcome = serde_json::from_str(json).with_context(|| {
                            format!("{}: reading its outcome", group.kid(kid).label)
                        })?;
                        outcomes[flow] = Some(o);
                    }
                }
                (Some(flow), Said::Closed) if outcomes[flow].is_none() => {
                    bail!("{}", group.failure(kid, Duration::from_secs(2)))
                }
                // A responder ends well when its requester hangs up, which may be just
                // before the requester says its outcome; any other end is a failure.
                (None, Said::Closed) if !group.exited_ok(kid, Duration::from_secs(2)) => {
                    bail!("{}", group.failure(kid, Duration::from_secs(2)));
                }
                _ => {}
            }
        }
        let readings = recorder.map(daemon_loop::Recorder::finish);
        let failed = group.finish(Duration::from_secs(15));
        if !failed.is_empty() {
            bail!("{}", failed.join("; "));
        }
        Ok((outcomes.into_iter().flatten().collect(), readings))
    }
}

fn class_name(c: FlowClass) -> &'static str {
    match c {
        FlowClass::Latency => "latency",
        FlowClass::Throughput => "throughput",
        FlowClass::Bandwidth => "bandwidth",
    }
}

/// The shaper's variables for one end of flow `f` in a run with `policy` (empty: the end
/// runs unshaped). A requester runs under the shaper in every run with a policy, told its
/// flow's class and the policy. A SEND stream's two ends both do, with
/// `JUSTITIA_TWO_SIDED=split`: its SENDs are split only between two shapers that agree
/// (`docs/architecture.md`, "Splitting two-sided requests"), as the simulator's policies
/// split them, so its responder's shaper must own the receives. Every other responder
/// runs unshaped, as the applications at the far end of the paper's flows do.
fn shaper_env(f: &RealFlow, policy: Option<&str>, role: Role) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let Some(policy) = policy else {
        return env;
    };
    let two_sided = matches!(f.plan.workload, Workload::Stream { op: Op::Send, .. });
    if role == Role::Respond && !two_sided {
        return env;
    }
    env.insert("JUSTITIA_CLASS".into(), class_name(f.class).into());
    env.insert("JUSTITIA_POLICY".into(), policy.into());
    if two_sided {
        env.insert("JUSTITIA_TWO_SIDED".into(), "split".into());
    }
    env
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Under a policy, a requester runs shaped with its class and the policy; both ends of
    /// a SEND stream run shaped and split its SENDs between them; a WRITE stream's and a
    /// latency flow's responders run unshaped; without a policy nothing is shaped. Every
    /// variable set is one the run-server takes.
    #[test]
    fn a_send_streams_two_ends_run_shaped_and_split_under_a_policy() {
        let text = "description = \"d\"\nprofile = \"IB-56\"\nduration_ms = 10\nwarmup_ms = 1\n\
            [[flows]]\nname = \"lat\"\n[flows.latency]\nsize = 16\n\
            [[flows]]\nname = \"write\"\n[flows.bandwidth]\nsize = \"1MB\"\n\
            [[flows]]\nname = \"send\"\n[flows.bandwidth]\nsize = \"1MB\"\nopcode = \"send\"\n";
        let experiment = justitia_sim::Experiment {
            name: "t".into(),
            scenario: justitia_sim::Scenario::from_toml(text, "test").unwrap(),
            profile: justitia_sim::ModelProfile::builtin("IB-56").unwrap(),
        };
        let timing = Timing {
            duration_ms: 10.0,
            warmup_ms: 1.0,
        };
        let runs = plan::runs(&experiment, timing, None);
        let flow = |name: &str| {
            runs[0]
                .flows
                .iter()
                .find(|f| f.plan.name == name)
                .unwrap()
                .clone()
        };
        let env = |name: &str, policy, role| {
            shaper_env(&flow(name), policy, role)
                .into_iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
        };
        let send = [
            "JUSTITIA_CLASS=bandwidth",
            "JUSTITIA_POLICY=justitia",
            "JUSTITIA_TWO_SIDED=split",
        ];
        assert_eq!(env("send", Some("justitia"), Role::Request), send);
        assert_eq!(env("send", Some("justitia"), Role::Respond), send);
        assert_eq!(
            env("write", Some("justitia"), Role::Request),
            ["JUSTITIA_CLASS=bandwidth", "JUSTITIA_POLICY=justitia"]
        );
        assert!(env("write", Some("justitia"), Role::Respond).is_empty());
        assert_eq!(
            env("lat", Some("adaptive"), Role::Request),
            ["JUSTITIA_CLASS=latency", "JUSTITIA_POLICY=adaptive"]
        );
        assert!(env("lat", Some("adaptive"), Role::Respond).is_empty());
        for name in ["lat", "write", "send"] {
            for role in [Role::Request, Role::Respond] {
                assert!(env(name, None, role).is_empty());
                let spawned = shaper_env(&flow(name), Some("justitia"), role);
                assert!(spawned
                    .keys()
                    .all(|k| wire::ALLOWED_ENV.contains(&k.as_str())));
            }
        }
    }

    /// Each run of `-outcomes.json` says how it was measured: the device, the requesters'
    /// clock with the rate handed to them, the idle mode, and each flow's plan beside its
    /// outcome.
    /// An outcome of flow `name`, with latency samples when `timed`.
    fn outcome(name: &str, timed: bool, mtu: Option<u32>, nic_khz: Option<u64>) -> FlowOutcome {
        FlowOutcome {
            name: name.into(),
            messages: 10,
            bytes: 160,
            window_s: 1.0,
            latency: timed.then_some(Percentiles {
                samples: 10,
                p50_us: 5.0,
                p99_us: 9.0,
                p999_us: 9.0,
                mean_us: 5.0,
                max_us: 9.0,
            }),
            loopback: None,
            wire: None,
            negative_samples: 0,
            clock: if timed {
                "tsc at 2100000000 Hz"
            } else {
                "monotonic"
            }
            .into(),
            yielded_samples: 0,
            latency_histogram: if timed {
                vec![[5000, 9], [9000, 1]]
            } else {
                Vec::new()
            },
            path_mtu: mtu,
            nic_clock_khz: nic_khz,
            nic_stamps_read: false,
        }
    }

    /// The report says what timed the samples, whether the NIC's time stamps were read
    /// (only RPerf's, and only where a device offers them), and the path MTUs; the outcomes file keeps
    /// each flow's MTU and histogram.
    #[test]
    fn the_report_says_the_clock_nic_time_stamps_and_mtu() {
        let measured = |flows| Measured {
            repeat: 1,
            run: "with bw".to_string(),
            plans: Vec::new(),
            ends: Vec::new(),
            flows,
        };
        let on_rxe = [measured(vec![
            outcome("lat", true, Some(1024), None),
            outcome("bw", false, Some(4096), None),
        ])];
        assert_eq!(
            timing_lines(&on_rxe),
            [
                "latency samples timed by: tsc at 2100000000 Hz",
                "NIC completion time stamps: none offered by the device; every sample is the host's",
                "path MTU: 1024 B, 4096 B",
            ]
        );
        let offered = [measured(vec![outcome("lat", true, None, Some(1_000_000))])];
        assert_eq!(
            timing_lines(&offered)[1],
            "NIC completion time stamps: offered at 1000000 kHz, not read; every sample is the host's"
        );
        // An RPerf flow on a device with time stamps reads them; the report says whose
        // clock gave which figure.
        let mut rperf = outcome("lat", true, None, Some(156_250));
        rperf.nic_stamps_read = true;
        assert_eq!(
            timing_lines(&[measured(vec![rperf])])[1],
            "NIC completion time stamps: offered at 156250 kHz, read for RPerf's T_W - T_L; RPerf's T_W - T_L from the NIC's completion times and the host's between the two posts, every other figure the host's"
        );
        assert!(timing_lines(&[measured(vec![outcome("bw", false, None, None)])]).is_empty());
        let json = outcomes_json(
            &on_rxe,
            "rxe0",
            RequesterClock::Monotonic {},
            Idle::Spin,
            &serde_json::json!([]),
        );
        assert_eq!(json[0]["flows"][0]["path_mtu"], 1024);
        assert_eq!(
            json[0]["flows"][0]["latency_histogram"],
            serde_json::json!([[5000, 9], [9000, 1]])
        );
        assert!(json[0]["flows"][1].get("latency_histogram").is_none());
    }

    #[test]
    fn outcomes_say_the_device_clock_idle_mode_and_plans() {
        let plan = FlowPlan {
            name: "lat".to_string(),
            workload: Workload::Latency {
                size: 16,
                op: justitia_loadgen::plan::Op::Send,
                method: LatencyMethod::Rperf,
                inline: true,
                interval_us: 0.0,
            },
            start_ms: 0.0,
            stop_ms: 1000.0,
            window_from_ms: 100.0,
            window_to_ms: 1000.0,
        };
        let measured = Measured {
            repeat: 2,
            run: "alone".to_string(),
            plans: vec![plan],
            ends: vec![serde_json::json!({ "flow": "lat" })],
            flows: Vec::new(),
        };
        let json = outcomes_json(
            &[measured],
            "rxe0",
            RequesterClock::Tsc { hz: 2.1e9 },
            Idle::Yield,
            &serde_json::json!([]),
        );
        let run = &json[0];
        assert_eq!(run["repeat"], 2);
        assert_eq!(run["device"], "rxe0");
        assert_eq!(run["clock"]["kind"], "tsc");
        assert_eq!(run["clock"]["hz"], 2.1e9);
        assert_eq!(run["idle"], "yield");
        assert_eq!(run["plans"][0]["name"], "lat");
        assert_eq!(run["plans"][0]["workload"]["latency"]["method"], "rperf");
        assert_eq!(run["plans"][0]["workload"]["latency"]["size"], 16);
        let monotonic = outcomes_json(
            &[],
            "rxe0",
            RequesterClock::Monotonic {},
            Idle::Spin,
            &serde_json::json!([]),
        );
        assert_eq!(monotonic, serde_json::json!([]));
    }
}
