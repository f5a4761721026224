//! `justitia suite`: the comparison suite, the same workloads under every policy, side by
//! side in one table and one figure.
//!
//! Each scenario file of a suite is one workload on one RNIC profile. Its runs whose
//! variant name starts with `alone` are the references (each class of flow with nothing
//! else); every other run is one policy column, named by its variant. Per workload and
//! policy the table gives:
//!
//! - **p99 x alone**: the worst latency flow's p99 over its own p99 in the alone run;
//! - **bandwidth % of alone**: the bandwidth flows' goodput together over the most the
//!   class reached in one reference run (with one reference run holding every bandwidth
//!   flow, over theirs alone; with tenants alone one at a time, over one tenant's: the
//!   link's utilisation);
//! - **throughput % of alone**: the throughput flows' message rate, likewise;
//! - **tenants % of fair**: the lowest, over the run's tenants, of a tenant's rate over its
//!   tenant-fair share (`justitia_sim::fairness`: its weighted equal split of its class's
//!   capacity among the run's tenants, a tenant's flows of one class counted once, or its
//!   alone figure when smaller; a bandwidth tenant's rate is the Gb/s of MaxRate its use of
//!   the RNIC amounts to, its goodput unless its messages' headers or message rate take
//!   more, `justitia_sim::fairness::rnic_gbps`); a tenant is a flow of its own unless the
//!   scenario says;
//! - **extra WQEs per GB**: work requests the policy posts beyond the applications' own,
//!   per GB of payload all flows moved (a sub-message, a chunk, a yield or a probe is a
//!   WQE the host posts). Counted from the policy's own figures where it reports them
//!   (sub-messages and yields of `preempt` and `adaptive`); `justitia` reports only its
//!   chunk size in force, so its chunks are estimated as the bandwidth flows' bytes over
//!   that size; probes from the policy's `probes` figure where it reports one, else as
//!   one per RefPeriod on each host with a reference flow;
//! - **host CPU per GB**: those extra WQEs times the profile's `host.post_ns`, the
//!   modelled CPU cost of building and posting one WQE (pacing timers and polling are not
//!   counted).
//!
//! A cell is marked `ok` when the run meets the goal: every latency flow's p99 within
//! x[`LATENCY_BAND`] of alone, the bandwidth flows together at [`BANDWIDTH_FLOOR`] of
//! alone or more, and every tenant at or above its tenant-fair share (its sharing-incentive
//! floor: what a weighted equal split of the RNIC among the run's tenants leaves it, or its
//! alone figure when smaller; with a tenant per flow, the flow's alone rate times the flows
//! of its class over all flows of the run, when its reference run holds its class).

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use justitia_core::flow::FlowClass;
use justitia_sim::fairness::{self, rate, TenantMap};
use justitia_sim::series::RunSeries;
use justitia_sim::{Experiment, ModelProfile, RunReport, ScenarioReport};

use crate::plot::{self, Figure, Panel};
use crate::progress::ScenarioProgress;

/// The goal's latency band: p99 within this multiple of alone.
pub const LATENCY_BAND: f64 = 1.2;
/// The goal's bandwidth floor: the bandwidth flows together keep this fraction of alone.
pub const BANDWIDTH_FLOOR: f64 = 0.95;
/// Husky's rule (NSDI'23): a victim passes when it keeps this fraction of what it is due.
pub const VICTIM_SHARE: f64 = 0.8;
/// Flows whose name starts with this attack the others; every other flow of a workload
/// with an attacker is a victim, reported on its own in the victims' table.
pub const ATTACKER_PREFIX: &str = "attacker";
/// Slack on the sharing-incentive floor: a flow within 2% of it counts as keeping it
/// (a run's rates are measured over a finite window).
const FLOOR_SLACK: f64 = 0.98;

/// Arguments of `justitia suite`.
#[derive(Args, Debug)]
pub struct SuiteArgs {
    /// Scenario files of the suite, one workload on one profile each.
    #[arg(value_name = "FILE", required = true)]
    files: Vec<PathBuf>,

    /// The suite's title, in the table's heading and the figure.
    #[arg(long, default_value = "comparison suite")]
    name: String,

    /// Write the suite's figure, `<name>.svg` (spaces as dashes), into DIR.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
}

/// What one policy did on one workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Cell {
    /// The run's variant: the policy column.
    pub policy: String,
    /// The worst latency flow's p99 over its alone p99.
    pub latency_x: Option<f64>,
    /// The bandwidth flows' goodput together over theirs alone.
    pub bandwidth: Option<f64>,
    /// The throughput flows' message rate together over theirs alone.
    pub throughput: Option<f64>,
    /// The lowest tenant's rate over its tenant-fair share.
    pub tenants: Option<f64>,
    /// Extra work requests per GB of payload moved.
    pub extra_wqes_per_gb: f64,
    /// Host CPU for them, ms per GB.
    pub cpu_ms_per_gb: f64,
    /// Every tenant at or above its tenant-fair share (within [`FLOOR_SLACK`]).
    pub floors_kept: bool,
    /// In a workload with an attacker, each victim's shares, in the run's flow order.
    pub victims: Vec<VictimShare>,
}

/// What one victim kept in a run with an attacker.
#[derive(Clone, Debug, PartialEq)]
pub struct VictimShare {
    /// The victim flow.
    pub flow: String,
    /// Its tenant's rate over its tenant-fair share (its tenant's flows of its class).
    pub of_fair: f64,
    /// Its rate over its alone rate, in its class's measure (messages per second, or Gb/s
    /// for a bandwidth flow).
    pub of_alone: f64,
}

impl VictimShare {
    /// Whether it keeps [`VICTIM_SHARE`] of its tenant-fair share.
    pub fn passes(&self) -> bool {
        self.of_fair >= VICTIM_SHARE
    }
}

impl Cell {
    /// Whether the run meets the goal (see the module documentation).
    pub fn meets_goal(&self) -> bool {
        self.latency_x.is_none_or(|x| x <= LATENCY_BAND)
            && self.bandwidth.is_none_or(|b| b >= BANDWIDTH_FLOOR)
            && self.floors_kept
    }
}

/// One workload on one profile: a row of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The workload (the scenario's name without `suite-` and the profile).
    pub workload: String,
    /// The RNIC profile.
    pub profile: String,
    /// One cell per policy run, in the scenario's order.
    pub cells: Vec<Cell>,
}

/// Runs `justitia suite`.
pub fn run(args: &SuiteArgs) -> Result<()> {
    let experiments = args
        .files
        .iter()
        .map(|file| {
            Experiment::load(file)
                .with_context(|| format!("loading scenario file {}", file.display()))
                .map(|e| (file.clone(), e))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut rows = Vec::new();
    let mut meta = (0.0, 0.0, 0);
    for (path, experiment) in &experiments {
        let mut progress = ScenarioProgress::new(&experiment.name);
        let report = experiment
            .run_with_progress(&mut |p| progress.update(p))
            .with_context(|| format!("running scenario file {}", path.display()));
        progress.finish();
        let report = report?;
        meta = (report.duration_ms, report.warmup_ms, report.seed);
        let wall: f64 = report.runs.iter().map(|r| r.wall_seconds).sum();
        eprintln!(
            "{}: {} runs in {wall:.2} s wall time",
            report.scenario,
            report.runs.len()
        );
        rows.push(
            summarise(
                &report,
                &fairness::tenants(&experiment.scenario),
                &experiment.profile,
            )
            .with_context(|| format!("summarising {}", path.display()))?,
        );
    }
    print!("{}", render(&args.name, &rows));
    if let Some(dir) = &args.plot {
        fs::create_dir_all(dir)
            .with_context(|| format!("creating output folder {}", dir.display()))?;
        let path = figure_path(dir, &args.name);
        let (report, figure) = figure(&args.name, &rows, meta);
        let svg = plot::render_svg(&report, &figure)
            .with_context(|| format!("drawing {}", path.display()))?;
        fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The workload's name: the scenario's without the `suite-` prefix and the profile suffix.
fn workload_name(scenario: &str) -> String {
    let name = scenario.strip_prefix("suite-").unwrap_or(scenario);
    match name.rsplit_once('-') {
        Some((workload, _profile)) => workload.to_string(),
        None => name.to_string(),
    }
}

/// The table row of one scenario's report on `profile`; `tenants` maps its flows to their
/// tenants.
pub fn summarise(
    report: &ScenarioReport,
    tenants: &TenantMap,
    profile: &ModelProfile,
) -> Result<Row> {
    let post_ns = profile.host.post_ns;
    let (alone, runs): (Vec<&RunReport>, Vec<&RunReport>) = report
        .runs
        .iter()
        .partition(|r| r.variant.starts_with("alone"));
    if alone.is_empty() {
        bail!(
            "scenario {} has no reference run (a variant named `alone ...`)",
            report.scenario
        );
    }
    let reference = |name: &str| alone.iter().find_map(|r| r.flow(name));
    let window_s = (report.duration_ms - report.warmup_ms) / 1e3;
    let capacity = fairness::capacity(report);
    let mut cells = Vec::new();
    for run in runs {
        let mut latency_x: Option<f64> = None;
        let mut sums = [(0.0, 0.0); 2];
        for flow in &run.flows {
            let Some(base) = reference(&flow.name) else {
                bail!(
                    "flow {} of run `{}` has no alone run in {}",
                    flow.name,
                    run.variant,
                    report.scenario
                );
            };
            if flow.class == FlowClass::Latency {
                if let (Some(now), Some(then)) = (flow.latency, base.latency) {
                    let x = now.p99_us / then.p99_us;
                    latency_x = Some(latency_x.map_or(x, |w| w.max(x)));
                }
            }
            let here = rate(flow.class, flow.gbps, flow.msgs_per_sec);
            let slot = match flow.class {
                FlowClass::Bandwidth => Some(0),
                FlowClass::Throughput => Some(1),
                FlowClass::Latency => None,
            };
            if let Some(s) = slot {
                sums[s].0 += here;
                sums[s].1 = capacity.get(&flow.class).copied().unwrap_or(0.0);
            }
        }
        let share = |(now, then): (f64, f64)| (then > 0.0).then(|| now / then);
        let shares = fairness::tenant_shares(report, run, tenants, profile);
        let attacked = run
            .flows
            .iter()
            .any(|f| f.name.starts_with(ATTACKER_PREFIX));
        let victims = run
            .flows
            .iter()
            .filter(|f| attacked && !f.name.starts_with(ATTACKER_PREFIX))
            .filter_map(|f| {
                let base = reference(&f.name)?;
                let tenant = tenants.get(&f.name).map_or(f.name.as_str(), |t| &t.0);
                let unit = shares
                    .iter()
                    .find(|t| t.tenant == tenant && t.class == f.class)?;
                let alone = rate(f.class, base.gbps, base.msgs_per_sec);
                Some(VictimShare {
                    flow: f.name.clone(),
                    of_fair: unit.ratio(),
                    of_alone: if alone > 0.0 {
                        rate(f.class, f.gbps, f.msgs_per_sec) / alone
                    } else {
                        f64::INFINITY
                    },
                })
            })
            .collect();
        let tenant_fair = shares
            .iter()
            .map(|t| t.ratio())
            .fold(None, |low: Option<f64>, r| {
                Some(low.map_or(r, |l| l.min(r)))
            });
        let moved_gb: f64 = run.flows.iter().map(|f| f.gbps).sum::<f64>() * window_s / 8.0;
        let extra = extra_wqes(report, run) * window_s / (report.duration_ms / 1e3);
        let per_gb = if moved_gb > 0.0 {
            extra / moved_gb
        } else {
            0.0
        };
        cells.push(Cell {
            policy: run.variant.clone(),
            latency_x,
            bandwidth: share(sums[0]),
            throughput: share(sums[1]),
            tenants: tenant_fair,
            extra_wqes_per_gb: per_gb,
            cpu_ms_per_gb: per_gb * post_ns / 1e6,
            floors_kept: tenant_fair.is_none_or(|t| t >= FLOOR_SLACK),
            victims,
        });
    }
    Ok(Row {
        workload: workload_name(&report.scenario),
        profile: report.profile.clone(),
        cells,
    })
}

/// Work requests a run's policy posted beyond the applications' own, over the whole run.
fn extra_wqes(report: &ScenarioReport, run: &RunReport) -> f64 {
    let figure = |host: &str, name: &str| run.policy_figures.get(&format!("{host}.{name}"));
    let hosts: Vec<&str> = {
        let mut h: Vec<&str> = run
            .policy_figures
            .keys()
            .filter_map(|k| k.split_once('.').map(|(host, _)| host))
            .collect();
        h.dedup();
        h
    };
    let scale = report.duration_ms / (report.duration_ms - report.warmup_ms).max(1e-9);
    // Application bandwidth messages over the whole run, from the window's count.
    let bw_messages: f64 = run
        .flows
        .iter()
        .filter(|f| f.class == FlowClass::Bandwidth)
        .map(|f| f.messages as f64 * scale)
        .sum();
    let bw_bytes: f64 = run
        .flows
        .iter()
        .filter(|f| f.class == FlowClass::Bandwidth)
        .map(|f| f.gbps / 8.0 * 1e9 * report.duration_ms / 1e3)
        .sum();
    let mut posted = 0.0;
    let mut splits = false;
    // justitia reports only the chunk size in force; the host that sends the bandwidth
    // flows holds the smallest one (a host without them keeps the 1 MB default).
    let chunk = hosts
        .iter()
        .filter(|h| figure(h, "sub_messages").is_none())
        .filter_map(|h| figure(h, "chunk_bytes").copied())
        .filter(|c| *c > 0.0)
        .fold(None, |least: Option<f64>, c| {
            Some(least.map_or(c, |l| l.min(c)))
        });
    if let Some(chunk) = chunk {
        posted += bw_bytes / chunk;
        splits = true;
    }
    for host in &hosts {
        if let Some(sub) = figure(host, "sub_messages") {
            posted += sub + figure(host, "yields").copied().unwrap_or(0.0);
            splits |= *sub > 0.0;
        }
        if let Some(probes) = figure(host, "probes") {
            posted += probes;
        } else if figure(host, "current99_us").is_some() {
            let period_ms = figure(host, "ref_period_us").map_or(0.5, |us| us / 1e3);
            posted += report.duration_ms / period_ms;
        }
    }
    if splits {
        posted -= bw_messages;
    }
    posted.max(0.0)
}

fn ratio(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| format!("x{x:.2}"))
}

fn percent(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| format!("{:.0}%", 100.0 * x))
}

fn count(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.1}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.0}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// The suite's table, as Markdown: one row per workload and profile, one column per policy,
/// each cell `p99 x alone / bandwidth % / throughput % / tenants % of fair / extra WQEs per
/// GB / CPU ms per GB`
/// and `ok` when the goal holds.
pub fn render(name: &str, rows: &[Row]) -> String {
    let mut out = String::new();
    let mut columns: Vec<&str> = Vec::new();
    for cell in rows.iter().flat_map(|r| &r.cells) {
        if !columns.contains(&cell.policy.as_str()) {
            columns.push(&cell.policy);
        }
    }
    let _ = writeln!(out, "{name}: each cell is latency p99 x alone / bandwidth % of alone / throughput % of alone / lowest tenant % of its tenant-fair share / extra WQEs per GB / host CPU ms per GB; `ok`: p99 within x{LATENCY_BAND}, bandwidth at {:.0}% or more, every sharing-incentive floor kept", 100.0 * BANDWIDTH_FLOOR);
    let _ = writeln!(out);
    let _ = writeln!(out, "| workload | profile | {} |", columns.join(" | "));
    let _ = writeln!(out, "| --- | --- |{}", " --- |".repeat(columns.len()));
    for row in rows {
        let cells: Vec<String> = columns
            .iter()
            .map(|&c| {
                row.cells
                    .iter()
                    .find(|cell| cell.policy == c)
                    .map_or("".into(), |cell| {
                        format!(
                            "{} / {} / {} / {} / {} / {:.2}{}",
                            ratio(cell.latency_x),
                            percent(cell.bandwidth),
                            percent(cell.throughput),
                            percent(cell.tenants),
                            count(cell.extra_wqes_per_gb),
                            cell.cpu_ms_per_gb,
                            if cell.meets_goal() { " ok" } else { "" }
                        )
                    })
            })
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} |",
            row.workload,
            row.profile,
            cells.join(" | ")
        );
    }
    render_victims(&mut out, rows, &columns);
    out
}

/// The victims' table, for workloads with an attacker: one row per victim, one column per
/// policy, each cell its share of its tenant-fair share / of its alone figure, and `pass`
/// when the first is at least [`VICTIM_SHARE`] (Husky's rule).
fn render_victims(out: &mut String, rows: &[Row], columns: &[&str]) {
    let attacked: Vec<&Row> = rows
        .iter()
        .filter(|r| r.cells.iter().any(|c| !c.victims.is_empty()))
        .collect();
    if attacked.is_empty() {
        return;
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "victims: each cell is the victim's share of its tenant-fair share / of its alone figure; `pass`: {:.0}% of tenant-fair or more (Husky's rule)",
        100.0 * VICTIM_SHARE
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "| workload | victim | {} |", columns.join(" | "));
    let _ = writeln!(out, "| --- | --- |{}", " --- |".repeat(columns.len()));
    for row in attacked {
        let mut names: Vec<&str> = Vec::new();
        for v in row.cells.iter().flat_map(|c| &c.victims) {
            if !names.contains(&v.flow.as_str()) {
                names.push(&v.flow);
            }
        }
        for name in names {
            let cells: Vec<String> = columns
                .iter()
                .map(|&c| {
                    row.cells
                        .iter()
                        .find(|cell| cell.policy == c)
                        .and_then(|cell| cell.victims.iter().find(|v| v.flow == name))
                        .map_or("".into(), |v| {
                            format!(
                                "{} / {}{}",
                                percent(Some(v.of_fair)),
                                percent(Some(v.of_alone)),
                                if v.passes() { " pass" } else { "" }
                            )
                        })
                })
                .collect();
            let _ = writeln!(out, "| {} | {name} | {} |", row.workload, cells.join(" | "));
        }
    }
}

/// A workload's code in the figure, where bar groups are narrow: `L1`, `L4` (a latency
/// flow against 1 or 4 bandwidth flows), `T` (a throughput flow), `D`, `M` (PeRF's D_App
/// and M_App), `X` (the 8 + 8 + 8 mix); other workloads keep their name.
fn code(workload: &str) -> String {
    match workload {
        "lat-vs-1bw" => "L1",
        "lat-vs-4bw" => "L4",
        "tput-vs-bw" => "T",
        "dapp-vs-bapp" => "D",
        "mapp-vs-bapp" => "M",
        "mix-8-8-8" => "X",
        other => other,
    }
    .to_string()
}

/// The suite's figure: per profile a panel of the latency flows' p99 (x alone) and one of
/// the bandwidth flows' goodput (% of alone), one bar group per workload and one bar per
/// policy. The plot module draws figures of a report's runs, so the policies are given to
/// it as runs.
fn figure(name: &str, rows: &[Row], meta: (f64, f64, u64)) -> (ScenarioReport, Figure) {
    let mut columns: Vec<String> = Vec::new();
    for cell in rows.iter().flat_map(|r| &r.cells) {
        if !columns.contains(&cell.policy) {
            columns.push(cell.policy.clone());
        }
    }
    let mut profiles: Vec<&str> = Vec::new();
    for row in rows {
        if !profiles.contains(&row.profile.as_str()) {
            profiles.push(&row.profile);
        }
    }
    let panel =
        |profile: &str, title: &str, y_label: &str, value: &dyn Fn(&Cell) -> Option<f64>| {
            let of_profile: Vec<&Row> = rows.iter().filter(|r| r.profile == profile).collect();
            Panel {
                title: format!("{profile}: {title}"),
                y_label: y_label.into(),
                groups: of_profile.iter().map(|r| code(&r.workload)).collect(),
                values: of_profile
                    .iter()
                    .map(|row| {
                        columns
                            .iter()
                            .map(|c| {
                                row.cells
                                    .iter()
                                    .find(|cell| &cell.policy == c)
                                    .and_then(value)
                            })
                            .collect()
                    })
                    .collect(),
            }
        };
    let mut panels: Vec<Panel> = profiles
        .iter()
        .map(|p| panel(p, "p99 (x alone)", "x alone", &|c| c.latency_x))
        .collect();
    panels.extend(profiles.iter().map(|p| {
        panel(p, "bandwidth %", "% of alone", &|c| {
            c.bandwidth.map(|b| 100.0 * b)
        })
    }));
    let figure = Figure {
        kind: "suite",
        panels,
    };
    let report = ScenarioReport {
        scenario: name.to_string(),
        description: format!(
            "{name}, goal p99 within x{LATENCY_BAND} of alone and bandwidth {:.0}% of alone. L1, L4: a 16 B latency flow against 1 or 4 1 MB flows; T: a 64 x 16 B throughput flow against one; D, M: PeRF's D_App, M_App against the B_App; X: 8 latency + 8 bandwidth + 8 throughput flows",
            100.0 * BANDWIDTH_FLOOR
        ),
        profile: profiles.join(", "),
        seed: meta.2,
        duration_ms: meta.0,
        warmup_ms: meta.1,
        runs: columns
            .iter()
            .map(|c| RunReport {
                variant: c.clone(),
                policy: c.clone(),
                flows: Vec::new(),
                utilisation: 0.0,
                jain_bandwidth: None,
                policy_figures: Default::default(),
                fabric_figures: Default::default(),
                events: 0,
                series: RunSeries::default(),
                wall_seconds: 0.0,
            })
            .collect(),
    };
    (report, figure)
}

/// The figure's file for a suite of this name in `dir`.
fn figure_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{}.svg", name.replace(' ', "-")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::*;
    use justitia_sim::{FlowReport, LatencyReport};

    /// RoCE-100 with this CPU cost of a post.
    fn with_post_ns(post_ns: f64) -> ModelProfile {
        let mut p = ModelProfile::builtin("RoCE-100").expect("built in");
        p.host.post_ns = post_ns;
        p
    }

    fn flow(name: &str, class: FlowClass, gbps: f64, rate: f64, p99: Option<f64>) -> FlowReport {
        FlowReport {
            name: name.into(),
            class,
            app: "x".into(),
            messages: 1000,
            msgs_per_sec: rate,
            gbps,
            latency: p99.map(|p99_us| LatencyReport {
                samples: 100,
                p50_us: p99_us,
                p99_us,
                p999_us: p99_us,
                mean_us: p99_us,
                max_us: p99_us,
            }),
        }
    }

    fn run(variant: &str, flows: Vec<FlowReport>) -> RunReport {
        RunReport {
            variant: variant.into(),
            policy: "native".into(),
            flows,
            utilisation: 0.0,
            jain_bandwidth: None,
            policy_figures: Default::default(),
            fabric_figures: Default::default(),
            events: 0,
            series: RunSeries::default(),
            wall_seconds: 0.0,
        }
    }

    fn report(runs: Vec<RunReport>) -> ScenarioReport {
        ScenarioReport {
            scenario: "suite-lat-vs-1bw-ib56".into(),
            description: String::new(),
            profile: "IB-56".into(),
            seed: 1,
            duration_ms: 10.0,
            warmup_ms: 0.0,
            runs,
        }
    }

    /// Ratios against the alone runs, and the goal's three parts each able to fail it.
    #[test]
    fn cells_compare_with_alone_and_mark_the_goal() {
        let lat = |p99| flow("lat", FlowClass::Latency, 0.1, 500e3, Some(p99));
        let bw = |gbps| flow("bw", FlowClass::Bandwidth, gbps, 5e3, None);
        let r = report(vec![
            run("alone latency", vec![lat(2.0)]),
            run("alone bandwidth", vec![bw(40.0)]),
            run("good", vec![lat(2.3), bw(39.0)]),
            run("slow", vec![lat(2.5), bw(39.0)]),
            run("starved", vec![lat(2.0), bw(37.0)]),
        ]);
        let row = summarise(&r, &TenantMap::new(), &with_post_ns(60.0)).expect("summary");
        assert_eq!(row.workload, "lat-vs-1bw");
        let cell = |name: &str| {
            row.cells
                .iter()
                .find(|c| c.policy == name)
                .cloned()
                .expect("cell")
        };
        let good = cell("good");
        assert!((good.latency_x.unwrap_or(0.0) - 1.15).abs() < 1e-9);
        assert!((good.bandwidth.unwrap_or(0.0) - 0.975).abs() < 1e-9);
        assert_eq!(good.throughput, None);
        assert!(good.meets_goal());
        assert!(!cell("slow").meets_goal(), "x1.25 is outside x1.2");
        assert!(!cell("starved").meets_goal(), "92.5% is below 95%");
        assert_eq!(row.cells.len(), 3, "alone runs are references, not columns");
    }

    /// A flow below its sharing-incentive floor fails the goal even when the latency and
    /// bandwidth parts hold: here the throughput flow, one of two flows, keeps 40% of its
    /// alone rate, below the 50% an equal split leaves it.
    #[test]
    fn a_starved_flow_breaks_the_floor() {
        let tput = |rate| flow("tput", FlowClass::Throughput, 0.1, rate, None);
        let bw = |gbps| flow("bw", FlowClass::Bandwidth, gbps, 5e3, None);
        let r = report(vec![
            run("alone t", vec![tput(10e6)]),
            run("alone b", vec![bw(40.0)]),
            run("fair", vec![tput(5.5e6), bw(39.0)]),
            run("unfair", vec![tput(4e6), bw(39.0)]),
        ]);
        let row = summarise(&r, &TenantMap::new(), &with_post_ns(60.0)).expect("summary");
        assert!(row.cells[0].floors_kept && row.cells[0].meets_goal());
        assert!(!row.cells[1].floors_kept && !row.cells[1].meets_goal());
        assert!((row.cells[1].throughput.unwrap_or(0.0) - 0.4).abs() < 1e-9);
    }

    /// Extra WQEs: sub-messages and yields less the application's messages, per GB moved;
    /// CPU is that times the cost of a post.
    #[test]
    fn extra_work_requests_per_gigabyte() {
        let bw = flow("bw", FlowClass::Bandwidth, 8.0, 1000.0, None);
        let mut split = run("split", vec![bw.clone()]);
        // 8 Gb/s for 10 ms is 10 MB = 0.01 GB; 1000 messages in the run.
        split
            .policy_figures
            .insert("a.sub_messages".into(), 11_000.0);
        split.policy_figures.insert("a.yields".into(), 4_000.0);
        let mut bw_messages = bw;
        bw_messages.messages = 1000;
        let r = report(vec![run("alone b", vec![bw_messages]), split]);
        let row = summarise(&r, &TenantMap::new(), &with_post_ns(50.0)).expect("summary");
        let cell = &row.cells[0];
        // 15000 posted - 1000 the application's = 14000 per 0.01 GB.
        assert!((cell.extra_wqes_per_gb - 1.4e6).abs() < 1.0, "{cell:?}");
        assert!((cell.cpu_ms_per_gb - 70.0).abs() < 1e-6, "{cell:?}");
    }

    /// Two victims and an attacker, each a tenant of its own, in one class (throughput):
    /// alone the victims make 6 and 2 M msgs/s together, the attacker 12 alone, so the
    /// class's capacity is 12 and each of the three tenants is due min(alone, 12 / 3):
    /// 4 for `v1` (alone 6), 2 for `v2` (alone 2). Beside the attacker `v1` makes 3.6
    /// (90% of 4, 60% of 6: passes) and `v2` 1.5 (75% of 2: fails).
    #[test]
    fn victims_are_measured_against_their_tenant_fair_share_and_alone() {
        let tput = |name: &str, rate| flow(name, FlowClass::Throughput, 0.0, rate, None);
        let r = report(vec![
            run("alone victims", vec![tput("v1", 6e6), tput("v2", 2e6)]),
            run("alone attacker", vec![tput("attacker", 12e6)]),
            run(
                "native",
                vec![tput("v1", 3.6e6), tput("v2", 1.5e6), tput("attacker", 6e6)],
            ),
        ]);
        let row = summarise(&r, &TenantMap::new(), &with_post_ns(1.0)).expect("summary");
        let v = &row.cells[0].victims;
        assert_eq!(v.len(), 2, "the attacker is no victim");
        assert_eq!(v[0].flow, "v1");
        assert!((v[0].of_fair - 0.9).abs() < 1e-9 && (v[0].of_alone - 0.6).abs() < 1e-9);
        assert!(v[0].passes());
        assert!((v[1].of_fair - 0.75).abs() < 1e-9 && !v[1].passes());
        let table = render("s", &[row]);
        assert!(
            table.contains("| lat-vs-1bw | v1 | 90% / 60% pass |")
                && table.contains("| lat-vs-1bw | v2 | 75% / 75% |"),
            "{table}"
        );
    }

    #[test]
    fn a_report_without_alone_runs_is_refused() {
        let r = report(vec![run("native", Vec::new())]);
        assert!(summarise(&r, &TenantMap::new(), &with_post_ns(1.0)).is_err());
    }

    #[test]
    fn the_figure_has_a_bar_group_per_row_and_a_run_per_policy() {
        let cell = |policy: &str, x| Cell {
            policy: policy.into(),
            latency_x: Some(x),
            bandwidth: Some(0.9),
            throughput: None,
            tenants: Some(1.0),
            extra_wqes_per_gb: 0.0,
            cpu_ms_per_gb: 0.0,
            floors_kept: true,
            victims: Vec::new(),
        };
        let rows = vec![Row {
            workload: "w".into(),
            profile: "IB-56".into(),
            cells: vec![cell("native", 2.0), cell("adaptive", 1.1)],
        }];
        let (report, figure) = figure("s", &rows, (20.0, 4.0, 1));
        assert_eq!(report.runs.len(), 2);
        assert_eq!(figure.panels.len(), 2, "p99 and bandwidth for one profile");
        assert_eq!(figure.panels[0].values, vec![vec![Some(2.0), Some(1.1)]]);
        assert_eq!(figure.panels[1].values, vec![vec![Some(90.0), Some(90.0)]]);
        let svg = plot::render_svg(&report, &figure).expect("svg");
        assert!(svg.contains("adaptive") && svg.contains("IB-56: p99 (x alone)"));
        assert_eq!(figure_path(Path::new("d"), "a b"), Path::new("d/a-b.svg"));
        let table = render("s", &rows);
        assert!(
            table.contains(
                "| w | IB-56 | x2.00 / 90% / - / 100% / 0 / 0.00 | x1.10 / 90% / - / 100% / 0 / 0.00 |"
            ),
            "{table}"
        );
    }
}
