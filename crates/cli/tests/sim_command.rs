//! `justitia sim` as a user runs it: listing, running, exporting, plotting and refusing bad
//! scenarios. The scenarios run here are a few simulated milliseconds long.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use justitia_sim::{Experiment, ScenarioReport};

fn justitia(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_justitia"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the justitia binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn workspace_dir() -> PathBuf {
    crate_dir().join("../..")
}

fn data(name: &str) -> String {
    crate_dir()
        .join("tests/data")
        .join(name)
        .display()
        .to_string()
}

/// The text of every `<text>` element of an SVG.
fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            let body = &t[t.find('>')? + 1..];
            Some(body[..body.find("</text>")?].trim().to_string())
        })
        .collect()
}

#[test]
fn list_names_every_scenario_with_its_description() {
    let root = workspace_dir();
    let out = justitia(&["sim", "--list"], &root);
    assert!(out.status.success(), "{}", stderr(&out));
    let listing = stdout(&out);
    let mut files: Vec<PathBuf> = fs::read_dir(root.join("scenarios"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    assert_eq!(listing.lines().count(), files.len(), "{listing}");
    for (file, line) in files.iter().zip(listing.lines()) {
        let experiment = Experiment::load(file).unwrap();
        let (name, description) = line.split_once(' ').unwrap();
        assert_eq!(name, experiment.name);
        assert_eq!(description.trim(), experiment.scenario.description);
        assert!(!description.trim().is_empty());
    }
    // An explicit folder lists the same.
    let explicit = justitia(&["sim", "--list", "scenarios"], &root);
    assert_eq!(stdout(&explicit), listing);
}

#[test]
fn a_scenario_runs_prints_its_table_and_exports_json_and_csv() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = justitia(
        &[
            "sim",
            &data("tiny.toml"),
            "--out",
            &out_dir.path().display().to_string(),
        ],
        &crate_dir(),
    );
    assert!(out.status.success(), "{}", stderr(&out));

    let table = stdout(&out);
    assert!(
        table.starts_with("tiny: Tiny test: 16 B latency flow"),
        "{table}"
    );
    for text in [
        "[1/3] alone: policy native",
        "[2/3] with bw: policy native",
        "[3/3] with bw + justitia: policy justitia",
        "Jain index (bandwidth flows)",
        "p50 (us)",
        "p99 (us)",
        "p99.9 (us)",
        "rate (msgs/s)",
        "goodput (Gb/s)",
    ] {
        assert!(table.contains(text), "{text} missing from\n{table}");
    }

    let json = fs::read_to_string(out_dir.path().join("tiny.json")).unwrap();
    let report: ScenarioReport = serde_json::from_str(&json).unwrap();
    assert_eq!(report.scenario, "tiny");
    let variants: Vec<&str> = report.runs.iter().map(|r| r.variant.as_str()).collect();
    assert_eq!(variants, ["alone", "with bw", "with bw + justitia"]);
    let flows = |run: usize| -> Vec<&str> {
        report.runs[run]
            .flows
            .iter()
            .map(|f| f.name.as_str())
            .collect()
    };
    assert_eq!(flows(0), ["lat"]);
    assert_eq!(flows(1), ["lat", "bw"]);
    assert_eq!(flows(2), ["lat", "bw"]);
    let lat = report.runs[0].flow("lat").unwrap();
    assert!(lat.latency.is_some_and(|l| l.p50_us > 0.0 && l.samples > 0));
    assert!(report.runs[1].flow("bw").unwrap().gbps > 1.0);

    let csv = fs::read_to_string(out_dir.path().join("tiny.csv")).unwrap();
    let mut lines = csv.lines();
    let header = lines.next().unwrap();
    assert!(header.starts_with("scenario,variant,policy,flow,class,"));
    assert!(header.contains(",p99_us,"));
    // One row per flow and run: 1 + 2 + 2.
    assert_eq!(lines.count(), 5);

    // The time series: 2 ms sampled every 0.05 ms (the default floor) is 40 samples; a row
    // per flow at each, plus one per control loop in the Justitia run.
    let series = fs::read_to_string(out_dir.path().join("tiny-series.csv")).unwrap();
    let mut lines = series.lines();
    assert_eq!(
        lines.next().unwrap(),
        "scenario,variant,t_ms,kind,name,gbps,mops,safe_util_gbps,current99_us,target99_us,mode"
    );
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), 40 * (1 + 2 + 2 + 1), "{series}");
    let control: Vec<&str> = rows
        .iter()
        .copied()
        .filter(|r| r.contains(",control,"))
        .collect();
    assert_eq!(control.len(), 40);
    assert!(control
        .iter()
        .all(|r| r.starts_with("tiny,with bw + justitia,") && r.ends_with(",normal")));

    // Machine output goes to files; stderr only says which, and how long the scenario
    // took (no progress bar off a terminal).
    let said = stderr(&out);
    let lines: Vec<&str> = said.lines().collect();
    assert_eq!(lines.len(), 4, "{said}");
    assert!(lines[..3].iter().all(|l| l.starts_with("wrote ")), "{said}");
    assert!(
        lines[3].starts_with("tiny: 3 runs in ") && lines[3].ends_with(" s wall time"),
        "{said}"
    );
}

#[test]
fn same_scenario_and_seed_give_the_same_bytes_on_stdout_and_in_every_file() {
    let run = || {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().display().to_string();
        let out = justitia(
            &["sim", &data("tiny.toml"), "--out", &path, "--plot", &path],
            &crate_dir(),
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let mut files: Vec<(String, Vec<u8>)> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, fs::read(&p).unwrap())
            })
            .collect();
        files.sort();
        (out.stdout, files)
    };
    let (first_stdout, first_files) = run();
    let (second_stdout, second_files) = run();
    let names: Vec<&str> = first_files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "tiny-control.svg",
            "tiny-latency.svg",
            "tiny-series.csv",
            "tiny-throughput.svg",
            "tiny.csv",
            "tiny.json"
        ]
    );
    assert!(first_stdout == second_stdout, "the tables differ");
    for ((name, a), (_, b)) in first_files.iter().zip(&second_files) {
        assert!(a == b, "{name} differs between two runs of one seed");
    }
}

#[test]
fn plots_are_svg_figures_with_axes_and_legend() {
    let plot_dir = tempfile::tempdir().unwrap();
    let out = justitia(
        &[
            "sim",
            &data("tiny.toml"),
            "--plot",
            &plot_dir.path().display().to_string(),
        ],
        &crate_dir(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let read = |name: &str| {
        let svg = fs::read_to_string(plot_dir.path().join(name)).unwrap();
        assert!(svg.starts_with("<svg"), "{name} is not an SVG");
        svg_texts(&svg)
    };

    let latency = read("tiny-latency.svg");
    for text in [
        "median latency",
        "99th-percentile latency",
        "latency (µs)",
        "flow",
        "lat",
        "alone",
        "with bw",
        "with bw + justitia",
    ] {
        assert!(
            latency.iter().any(|t| t == text),
            "{text} missing: {latency:?}"
        );
    }
    assert!(latency.iter().any(|t| t.starts_with("Tiny test:")));

    let throughput = read("tiny-throughput.svg");
    for text in ["bandwidth flows", "goodput (Gb/s)", "flow", "bw", "with bw"] {
        assert!(
            throughput.iter().any(|t| t == text),
            "{text} missing: {throughput:?}"
        );
    }
    // The latency flow alone has no bandwidth bar, so that run is not in this legend.
    assert!(!throughput.iter().any(|t| t == "alone"), "{throughput:?}");

    // Only the Justitia run has a control loop, so only it has panels in the control figure.
    let control = read("tiny-control.svg");
    for text in [
        "bw goodput",
        "SafeUtil",
        "Current99",
        "Target99",
        "rate (Gb/s)",
        "p99 (µs)",
        "simulated time (ms)",
        "run: with bw + justitia (policy justitia)",
    ] {
        assert!(
            control.iter().any(|t| t == text),
            "{text} missing: {control:?}"
        );
    }
    assert!(!control.iter().any(|t| t.starts_with("run: with bw (")));
}

#[test]
fn a_bare_name_runs_the_scenario_of_that_name() {
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir(dir.path().join("scenarios")).unwrap();
    fs::copy(data("tiny.toml"), dir.path().join("scenarios/tiny.toml")).unwrap();
    let out = justitia(&["sim", "tiny"], dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("tiny: "));
}

#[test]
fn a_bad_field_fails_naming_the_file_and_the_field() {
    let out = justitia(&["sim", &data("bad-depth.toml")], &crate_dir());
    assert!(!out.status.success());
    let said = stderr(&out);
    assert!(said.contains("bad-depth.toml"), "{said}");
    assert!(said.contains("flows[0] (bw): bandwidth.depth"), "{said}");
    assert!(stdout(&out).is_empty());

    let out = justitia(&["sim", &data("bad-field.toml")], &crate_dir());
    assert!(!out.status.success());
    let said = stderr(&out);
    assert!(said.contains("bad-field.toml"), "{said}");
    assert!(said.contains("unknown field `sise`"), "{said}");
}

#[test]
fn a_missing_file_fails_before_anything_runs() {
    // The good scenario comes first, yet nothing runs: every file is checked first.
    let out = justitia(
        &["sim", &data("tiny.toml"), "no-such-scenario.toml"],
        &crate_dir(),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no-such-scenario.toml"));
    assert!(stdout(&out).is_empty());
}
