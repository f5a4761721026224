//! Machine-readable output: the whole report as JSON, and a flat CSV with one row per flow
//! and run (run-wide figures repeated on each row, so every row stands alone in a
//! spreadsheet or a data frame).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use justitia_sim::series::Mode;
use justitia_sim::ScenarioReport;
use serde::Serialize;

/// Writes `<dir>/<scenario>.json` and returns its path.
pub fn write_json(report: &ScenarioReport, dir: &Path) -> Result<PathBuf> {
    let path = dir.join(format!("{}.json", report.scenario));
    let write = || -> Result<()> {
        let mut out = BufWriter::new(File::create(&path)?);
        serde_json::to_writer_pretty(&mut out, report)?;
        writeln!(out)?;
        out.flush()?;
        Ok(())
    };
    write().with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Writes `<dir>/<scenario>.csv` and returns its path.
pub fn write_csv(report: &ScenarioReport, dir: &Path) -> Result<PathBuf> {
    let path = dir.join(format!("{}.csv", report.scenario));
    let write = || -> Result<()> {
        let mut out = csv::Writer::from_path(&path)?;
        for row in csv_rows(report) {
            out.serialize(row)?;
        }
        out.flush()?;
        Ok(())
    };
    write().with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Writes `<dir>/<scenario>-series.csv` (the time series of every run) and returns its
/// path.
pub fn write_series_csv(report: &ScenarioReport, dir: &Path) -> Result<PathBuf> {
    let path = dir.join(format!("{}-series.csv", report.scenario));
    let write = || -> Result<()> {
        let mut out = csv::Writer::from_path(&path)?;
        for row in series_rows(report) {
            out.serialize(row)?;
        }
        out.flush()?;
        Ok(())
    };
    write().with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// One row of the series CSV: a flow's rates, or a host's control state, at one sample.
/// Columns that do not apply to the row's kind are empty.
#[derive(Debug, Serialize)]
pub struct SeriesRow<'a> {
    /// The scenario's name.
    pub scenario: &'a str,
    /// The run's variant.
    pub variant: &'a str,
    /// End of the sampling interval, ms from the start of the run.
    pub t_ms: f64,
    /// `flow` or `control`.
    pub kind: &'static str,
    /// The flow's name, or the host's for a control row.
    pub name: &'a str,
    /// The flow's goodput over the interval, Gb/s.
    pub gbps: Option<f64>,
    /// The flow's completed messages over the interval, M msgs/s.
    pub mops: Option<f64>,
    /// SafeUtil, Gb/s.
    pub safe_util_gbps: Option<f64>,
    /// Current99 (the reference probe's p99), us; empty before its first sample.
    pub current99_us: Option<f64>,
    /// Target99 in effect, us; empty while not yet known.
    pub target99_us: Option<f64>,
    /// `normal` or `unattainable`.
    pub mode: Option<&'static str>,
}

/// The rows of the series CSV: runs in order, samples in time order, and at each sample
/// the flows then the hosts.
pub fn series_rows(report: &ScenarioReport) -> Vec<SeriesRow<'_>> {
    let mut rows = Vec::new();
    for run in &report.runs {
        let s = &run.series;
        for (i, &t_ms) in s.t_ms.iter().enumerate() {
            let base = SeriesRow {
                scenario: &report.scenario,
                variant: &run.variant,
                t_ms,
                kind: "flow",
                name: "",
                gbps: None,
                mops: None,
                safe_util_gbps: None,
                current99_us: None,
                target99_us: None,
                mode: None,
            };
            for f in &s.flows {
                rows.push(SeriesRow {
                    name: &f.name,
                    gbps: f.gbps.get(i).copied(),
                    mops: f.mops.get(i).copied(),
                    ..base
                });
            }
            for c in &s.controls {
                rows.push(SeriesRow {
                    kind: "control",
                    name: &c.host,
                    safe_util_gbps: c.safe_util_gbps.get(i).copied(),
                    current99_us: c.current99_us.get(i).copied().flatten(),
                    target99_us: c.target99_us.get(i).copied().flatten(),
                    mode: c.mode.get(i).map(|m| match m {
                        Mode::Normal => "normal",
                        Mode::Unattainable => "unattainable",
                    }),
                    ..base
                });
            }
        }
    }
    rows
}

/// One CSV row: a flow in a run. Field names are the column headings.
#[derive(Debug, Serialize)]
pub struct CsvRow<'a> {
    /// The scenario's name.
    pub scenario: &'a str,
    /// The run's variant.
    pub variant: &'a str,
    /// The run's policy.
    pub policy: &'a str,
    /// The flow's name.
    pub flow: &'a str,
    /// Its class.
    pub class: &'static str,
    /// Its application model.
    pub app: &'a str,
    /// Messages completed in the measured window.
    pub messages: u64,
    /// Messages per second.
    pub msgs_per_sec: f64,
    /// Goodput, Gb/s.
    pub gbps: f64,
    /// Latency samples (empty without latency samples, as are the other latency columns).
    pub latency_samples: Option<u64>,
    /// Median latency, us.
    pub p50_us: Option<f64>,
    /// 99th-percentile latency, us.
    pub p99_us: Option<f64>,
    /// 99.9th-percentile latency, us.
    pub p999_us: Option<f64>,
    /// Mean latency, us.
    pub mean_us: Option<f64>,
    /// Largest latency, us.
    pub max_us: Option<f64>,
    /// The run's utilisation (fraction of MaxRate).
    pub utilisation: f64,
    /// The run's Jain index among bandwidth flows (empty without bandwidth flows).
    pub jain_bandwidth: Option<f64>,
    /// Events the run handled.
    pub events: u64,
}

/// The rows of a report, runs in order and flows in order within each run.
pub fn csv_rows(report: &ScenarioReport) -> Vec<CsvRow<'_>> {
    report
        .runs
        .iter()
        .flat_map(|run| {
            run.flows.iter().map(move |flow| {
                let latency = flow.latency.as_ref();
                CsvRow {
                    scenario: &report.scenario,
                    variant: &run.variant,
                    policy: &run.policy,
                    flow: &flow.name,
                    class: flow.class.as_str(),
                    app: &flow.app,
                    messages: flow.messages,
                    msgs_per_sec: flow.msgs_per_sec,
                    gbps: flow.gbps,
                    latency_samples: latency.map(|l| l.samples),
                    p50_us: latency.map(|l| l.p50_us),
                    p99_us: latency.map(|l| l.p99_us),
                    p999_us: latency.map(|l| l.p999_us),
                    mean_us: latency.map(|l| l.mean_us),
                    max_us: latency.map(|l| l.max_us),
                    utilisation: run.utilisation,
                    jain_bandwidth: run.jain_bandwidth,
                    events: run.events,
                }
            })
        })
        .collect()
}
