//! Helpers shared by the simulator's regression tests.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use justitia_sim::validation::{builtin_table, Check, Outcome, Status, Validation};
use justitia_sim::{Experiment, FlowReport, LatencyReport, RunReport, ScenarioReport};

pub mod gaps;

/// The repository's `scenarios/` folder.
pub fn scenarios_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scenarios")
}

/// Loads `scenarios/<name>.toml`.
pub fn experiment(name: &str) -> Experiment {
    let path = scenarios_dir().join(format!("{name}.toml"));
    Experiment::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs `scenarios/<name>.toml` once per test binary; later calls get the same report.
pub fn report(name: &str) -> ScenarioReport {
    static CACHE: OnceLock<Mutex<BTreeMap<String, ScenarioReport>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(BTreeMap::new()));
    if let Some(r) = cache.lock().unwrap().get(name) {
        return r.clone();
    }
    let r = experiment(name).run().unwrap();
    cache.lock().unwrap().insert(name.to_string(), r.clone());
    r
}

/// A run of a report, by variant name.
pub fn run<'a>(report: &'a ScenarioReport, variant: &str) -> &'a RunReport {
    report
        .run(variant)
        .unwrap_or_else(|| panic!("{}: no run `{variant}`", report.scenario))
}

/// A flow of a run, by name.
pub fn flow<'a>(run: &'a RunReport, name: &str) -> &'a FlowReport {
    run.flow(name)
        .unwrap_or_else(|| panic!("run `{}`: no flow `{name}`", run.variant))
}

/// The latency percentiles of a flow.
pub fn latency(run: &RunReport, name: &str) -> LatencyReport {
    flow(run, name)
        .latency
        .unwrap_or_else(|| panic!("run `{}`: flow `{name}` has no samples", run.variant))
}

/// Asserts `actual` is within `tolerance` (a fraction) of `expected` (a paper's figure, or
/// what the model gives in a reference run).
pub fn assert_near(what: &str, actual: f64, expected: f64, tolerance: f64) {
    let error = (actual - expected) / expected;
    assert!(
        error.abs() <= tolerance,
        "{what}: model {actual:.3}, expected {expected:.3}: off by {:+.1}% (tolerance {:.0}%)",
        error * 100.0,
        tolerance * 100.0
    );
    eprintln!(
        "{what}: model {actual:.3}, expected {expected:.3} ({:+.1}%)",
        error * 100.0
    );
}

/// Asserts `actual` lies in `[low, high]`.
pub fn assert_between(what: &str, actual: f64, low: f64, high: f64) {
    assert!(
        (low..=high).contains(&actual),
        "{what}: model {actual:.3}, expected in [{low:.3}, {high:.3}]"
    );
    eprintln!("{what}: model {actual:.3} in [{low:.3}, {high:.3}]");
}

/// A check of the validation table (`crates/sim/validation/targets.toml`), by id.
pub fn table_check(id: &str) -> Check {
    builtin_table()
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no check `{id}` in the validation table"))
}

/// A check of the validation table evaluated against its scenarios' reports (each run
/// once per test binary).
pub fn evaluate(id: &str) -> Outcome {
    let check = table_check(id);
    let reports: BTreeMap<String, ScenarioReport> = check
        .scenarios()
        .into_iter()
        .map(|name| {
            let r = report(&name);
            (name, r)
        })
        .collect();
    Validation::evaluate(vec![check], &reports)
        .unwrap_or_else(|e| panic!("{e}"))
        .outcomes
        .remove(0)
}

/// Asserts a check of the validation table: within tolerance, or, if it is on the
/// known-gap list, still outside it with the model where the list says.
pub fn assert_target(id: &str) {
    let o = evaluate(id);
    let model = o.model.unwrap_or_else(|| panic!("{id}: no scenario"));
    let said = format!(
        "{id} ({}): paper {} {}, model {model:.3}, tolerance {}",
        o.check.what,
        o.check.paper,
        o.check.unit,
        o.check.tolerance_text()
    );
    match known_gap(id) {
        None => assert!(
            o.status == Status::Pass,
            "{said}: outside tolerance; fix the model, or add it to gaps::KNOWN_GAPS with its numbers"
        ),
        Some(listed) => {
            assert!(
                o.status == Status::Fail,
                "{said}: the known gap has closed; remove it from gaps::KNOWN_GAPS"
            );
            assert!(
                (model - listed).abs() <= 0.10 * listed.abs().max(0.01),
                "{said}: the known gap moved from the listed model figure {listed}; update gaps::KNOWN_GAPS"
            );
        }
    }
    eprintln!("{said}: {}", o.status);
}

/// The model's figure listed for a known gap.
pub fn known_gap(id: &str) -> Option<f64> {
    gaps::KNOWN_GAPS
        .iter()
        .find(|(gap, _)| *gap == id)
        .map(|(_, model)| *model)
}

/// Asserts every check of a target (`N3`) that has a scenario, as [`assert_target`] does.
pub fn assert_targets(target: &str) {
    let ids: Vec<String> = builtin_table()
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .filter(|c| c.target == target && c.scenario.is_some())
        .map(|c| c.id)
        .collect();
    assert!(!ids.is_empty(), "no check of {target} has a scenario");
    for id in ids {
        assert_target(&id);
    }
}

/// A bandwidth flow served `served` times a reference flow's rates (10 Gb/s, 1 M msgs/s),
/// for checks that compare flows with each other.
pub fn synthetic_flow(name: &str, served: f64) -> FlowReport {
    FlowReport {
        name: name.into(),
        class: justitia_core::flow::FlowClass::Bandwidth,
        app: "bandwidth".into(),
        messages: 1,
        msgs_per_sec: 1e6 * served,
        gbps: 10.0 * served,
        latency: None,
    }
}

/// Reports of one scenario with one run of these flows, as [`Validation::evaluate`] reads
/// them.
pub fn synthetic_report(
    scenario: &str,
    variant: &str,
    flows: Vec<FlowReport>,
) -> BTreeMap<String, ScenarioReport> {
    let run = RunReport {
        variant: variant.into(),
        policy: "native".into(),
        flows,
        utilisation: 1.0,
        jain_bandwidth: None,
        policy_figures: BTreeMap::new(),
        fabric_figures: BTreeMap::new(),
        events: 0,
        series: Default::default(),
        wall_seconds: 0.0,
    };
    let report = ScenarioReport {
        scenario: scenario.into(),
        description: String::new(),
        profile: "IB-56".into(),
        seed: 1,
        duration_ms: 1.0,
        warmup_ms: 0.0,
        runs: vec![run],
    };
    BTreeMap::from([(scenario.to_string(), report)])
}
