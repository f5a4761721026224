//! `justitia sim`: runs scenario files through the simulator and reports, exports and plots
//! what they measured.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use justitia_sim::{list_scenarios, Experiment, ScenarioReport};

use crate::backend::Backend;
use crate::progress::ScenarioProgress;
use crate::{control_plot, export, plot, table};

/// Where scenarios live, relative to the working directory.
const SCENARIO_DIR: &str = "scenarios";

/// Arguments of `justitia sim`.
#[derive(Args, Debug)]
#[command(after_help = "\
Output:
  stdout       one table per run: per flow its class, latency percentiles (us), message rate
               (msgs/s) and goodput (Gb/s); per run its policy, utilisation, Jain's index
               among the bandwidth flows and events. Same scenario and seed, same bytes.
  stderr       the wall time of each scenario, a progress bar on a terminal, the files written.
  --out DIR    DIR/<scenario>.json: the whole report (every field the simulator measured);
               DIR/<scenario>.csv: one row per flow and run, for spreadsheets and plotting tools;
               DIR/<scenario>-series.csv: the time series, one row per run, sample and flow or
               host (each flow's Gb/s and M msgs/s; each control loop's SafeUtil, Current99,
               Target99 and mode).
  --plot DIR   DIR/<scenario>-latency.svg: p50 and p99 latency per flow, one bar per run;
               DIR/<scenario>-throughput.svg: Gb/s of bandwidth flows, M msgs/s of throughput flows;
               DIR/<scenario>-control.svg (runs with a control loop): SafeUtil and flow rates,
               Current99 and Target99 over simulated time.

Examples:
  justitia sim --list
  justitia sim lat-vs-1mb-bw-ib56 --plot out
  justitia sim scenarios/*.toml --out out")]
pub struct SimArgs {
    /// Scenario files to run, one after another. A bare name such as `lat-vs-1mb-bw-ib56`
    /// stands for `scenarios/<name>.toml`.
    #[arg(value_name = "FILE", required_unless_present = "list")]
    files: Vec<PathBuf>,

    /// List the scenarios in DIR (default `scenarios`) with their descriptions; run nothing.
    #[arg(
        long,
        value_name = "DIR",
        num_args = 0..=1,
        default_missing_value = SCENARIO_DIR,
        conflicts_with_all = ["files", "out", "plot"],
    )]
    list: Option<PathBuf>,

    /// Write `<scenario>.json`, `<scenario>.csv` and `<scenario>-series.csv` for each
    /// scenario into DIR (created if missing).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,

    /// Write SVG figures `<scenario>-latency.svg`, `<scenario>-throughput.svg` and, for
    /// scenarios with a control loop, `<scenario>-control.svg` into DIR (created if missing).
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
}

/// Runs `justitia sim`.
pub fn run(args: &SimArgs) -> Result<()> {
    if let Some(dir) = &args.list {
        return list(dir);
    }
    // Every file is loaded before anything runs, so a typo in the last file does not wait
    // for the first ones to finish.
    let experiments = args
        .files
        .iter()
        .map(|file| load(file))
        .collect::<Result<Vec<_>>>()?;
    if args.out.is_some() || args.plot.is_some() {
        refuse_clashing_names(&experiments)?;
    }
    for dir in [&args.out, &args.plot].into_iter().flatten() {
        fs::create_dir_all(dir)
            .with_context(|| format!("creating output folder {}", dir.display()))?;
    }
    for (i, (path, experiment)) in experiments.iter().enumerate() {
        let report = simulate(path, experiment)?;
        if i > 0 {
            println!();
        }
        print!("{}", table::render(&report));
        let mut written = Vec::new();
        if let Some(dir) = &args.out {
            written.push(export::write_json(&report, dir)?);
            written.push(export::write_csv(&report, dir)?);
            written.push(export::write_series_csv(&report, dir)?);
        }
        if let Some(dir) = &args.plot {
            written.extend(plot::write_figures(&report, dir)?);
            written.extend(control_plot::write_control_figure(
                &report,
                dir,
                &Backend::Simulator,
            )?);
        }
        for file in written {
            eprintln!("wrote {}", file.display());
        }
        let wall: f64 = report.runs.iter().map(|r| r.wall_seconds).sum();
        eprintln!(
            "{}: {} runs in {wall:.2} s wall time",
            experiment.name,
            report.runs.len()
        );
    }
    Ok(())
}

fn list(dir: &Path) -> Result<()> {
    let scenarios = list_scenarios(dir)
        .with_context(|| format!("listing the scenarios in {}", dir.display()))?;
    if scenarios.is_empty() {
        bail!("no scenario files (*.toml) in {}", dir.display());
    }
    let width = scenarios.iter().map(|s| s.name.len()).max().unwrap_or(0);
    for s in &scenarios {
        println!("{:<width$}  {}", s.name, s.description);
    }
    Ok(())
}

/// The file a command-line argument names: itself if it exists, else the scenario of that
/// name in `scenarios/` when the argument is a bare name.
fn resolve(arg: &Path) -> PathBuf {
    let bare = arg.components().count() == 1 && arg.extension().is_none();
    if !arg.exists() && bare {
        let named = Path::new(SCENARIO_DIR).join(arg).with_extension("toml");
        if named.is_file() {
            return named;
        }
    }
    arg.to_path_buf()
}

pub(crate) fn load(arg: &Path) -> Result<(PathBuf, Experiment)> {
    let path = resolve(arg);
    let experiment = Experiment::load(&path)
        .with_context(|| format!("loading scenario file {}", path.display()))?;
    Ok((path, experiment))
}

/// Output files are named after scenarios, so two scenarios of one name from different
/// folders would overwrite each other's results.
fn refuse_clashing_names(experiments: &[(PathBuf, Experiment)]) -> Result<()> {
    let mut seen: BTreeMap<&str, &Path> = BTreeMap::new();
    for (path, experiment) in experiments {
        if let Some(first) = seen.insert(&experiment.name, path) {
            if first != path {
                bail!(
                    "scenarios {} and {} share the name `{}`, so their output files would clash",
                    first.display(),
                    path.display(),
                    experiment.name
                );
            }
        }
    }
    Ok(())
}

pub(crate) fn simulate(path: &Path, experiment: &Experiment) -> Result<ScenarioReport> {
    let mut progress = ScenarioProgress::new(&experiment.name);
    let report = experiment
        .run_with_progress(&mut |p| progress.update(p))
        .with_context(|| format!("running scenario file {}", path.display()));
    progress.finish();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_paths_and_non_bare_names_are_kept() {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        assert_eq!(resolve(&manifest), manifest);
        let nested = Path::new("somewhere/missing");
        assert_eq!(resolve(nested), nested);
        let with_extension = Path::new("missing.toml");
        assert_eq!(resolve(with_extension), with_extension);
    }
}
