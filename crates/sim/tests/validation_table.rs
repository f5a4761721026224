//! The validation table (`crates/sim/validation/targets.toml`) as a whole: every target has
//! its checks, and every check is within tolerance or on the explicit known-gap list
//! (`common/gaps.rs`) with the model's figure.

mod common;

use justitia_sim::validation::{builtin_table, Status, Tag, Validation};

/// The targets of `validation-targets.md`, and the applications of Justitia §2.2 and §6.2
/// (A1: FaSST, A2: eRPC, each against the storage service).
const TARGETS: [&str; 35] = [
    "N1", "N2", "N3", "N4", "N5", "N6", "N7", "N8", "N9", "N10", "N11", "J1", "J2", "J3", "J4",
    "J5", "J6", "J7", "J8", "P1", "P2", "P3", "P4", "P5", "P6", "R1", "R2", "R3", "R4", "R5", "R6",
    "R7", "R8", "A1", "A2",
];

/// Targets the simulator has no scenario for yet.
const NO_SCENARIO: [&str; 0] = [];

#[test]
fn every_target_has_checks_and_a_scenario_unless_listed() {
    let checks = builtin_table().unwrap_or_else(|e| panic!("{e}"));
    for target in TARGETS {
        let of: Vec<_> = checks.iter().filter(|c| c.target == target).collect();
        assert!(!of.is_empty(), "no check for {target}");
        let missing = NO_SCENARIO.contains(&target);
        for c in of {
            assert_eq!(
                c.scenario.is_none(),
                missing,
                "{}: scenario {:?}",
                c.id,
                c.scenario
            );
            if missing {
                assert_eq!(c.tag, Tag::Validate, "{}: nothing was fitted to it", c.id);
            }
        }
    }
    for c in &checks {
        assert!(
            TARGETS.contains(&c.target.as_str()),
            "{}: unknown target",
            c.id
        );
    }
}

/// A fitted figure says which parameter was set to it, and that parameter's comment in the
/// profiles says `fit:`; a figure no profile comment cites as fitted is not tagged `fit`.
#[test]
fn fit_tags_name_a_fitted_parameter() {
    let profiles = std::fs::read_dir(common::scenarios_dir().join("../profiles"))
        .unwrap_or_else(|e| panic!("{e}"))
        .filter_map(Result::ok)
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    for c in builtin_table().unwrap_or_else(|e| panic!("{e}")) {
        let named = c.basis.split("fit: ").nth(1);
        match c.tag {
            Tag::Fit => {
                let params = named.unwrap_or_else(|| panic!("{}: fit without a parameter", c.id));
                let first = params
                    .split([' ', ','])
                    .next()
                    .and_then(|p| p.split('.').nth(1))
                    .unwrap_or_else(|| panic!("{}: `{params}` names no table.key", c.id));
                assert!(
                    profiles
                        .lines()
                        .any(|l| l.trim_start().starts_with(first) && l.contains("fit:")),
                    "{}: no profile marks `{first}` as fitted",
                    c.id
                );
            }
            Tag::Validate => assert!(named.is_none(), "{}: validate but cites a fit", c.id),
        }
    }
}

/// Every check within tolerance, except the known gaps, each still a gap with the model's
/// figure where the list says. Runs every scenario the table names once.
#[test]
fn every_check_within_tolerance_or_a_known_gap() {
    let checks = builtin_table().unwrap_or_else(|e| panic!("{e}"));
    let v = Validation::run(checks, &common::scenarios_dir(), &mut |_| {})
        .unwrap_or_else(|e| panic!("{e}"));
    let mut problems = Vec::new();
    for o in &v.outcomes {
        let id = &o.check.id;
        let listed = common::known_gap(id);
        let model = o.model.unwrap_or(f64::NAN);
        let said = format!(
            "{id}: paper {} {}, model {model:.3}, tolerance {}",
            o.check.paper,
            o.check.unit,
            o.check.tolerance_text()
        );
        match (o.status, listed) {
            (Status::NoScenario, None) => {}
            (Status::NoScenario, Some(_)) => problems.push(format!("{said}: listed but unrun")),
            (Status::Pass, None) => {}
            (Status::Pass, Some(_)) => {
                problems.push(format!("{said}: the gap has closed, remove it from the list"))
            }
            (Status::Fail, None) => problems.push(format!(
                "{said}: outside tolerance and not a known gap (fix the model, or list it with its numbers)"
            )),
            (Status::Fail, Some(at)) if (model - at).abs() > 0.10 * at.abs().max(0.01) => {
                problems.push(format!("{said}: the gap moved from {at}, update the list"))
            }
            (Status::Fail, Some(_)) => {}
        }
    }
    for (id, _) in common::gaps::KNOWN_GAPS {
        if !v.outcomes.iter().any(|o| o.check.id == *id) {
            problems.push(format!("{id}: listed as a gap but not in the table"));
        }
    }
    eprintln!("{}", v.summary_text(Tag::Validate));
    eprintln!("{}", v.summary_text(Tag::Fit));
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}
