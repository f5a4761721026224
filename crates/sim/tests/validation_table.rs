//! The validation table (`crates/sim/validation/targets.toml`) as a whole: every target has
//! its checks, and every check is within tolerance or on the explicit known-gap list
//! (`common/gaps.rs`) with the model's figure.

mod common;

use justitia_sim::validation::{builtin_table, Published, Status, Tag, Validation};

/// The targets of `validation-targets.md`, Justitia's incast (J9: §6.7, Fig. 25, which gives
/// only a direction), and the applications of Justitia §2.2 and §6.2 (A1: FaSST, A2: eRPC,
/// each against the storage service).
const TARGETS: [&str; 36] = [
    "N1", "N2", "N3", "N4", "N5", "N6", "N7", "N8", "N9", "N10", "N11", "J1", "J2", "J3", "J4",
    "J5", "J6", "J7", "J8", "J9", "P1", "P2", "P3", "P4", "P5", "P6", "R1", "R2", "R3", "R4", "R5",
    "R6", "R7", "R8", "A1", "A2",
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
            Tag::Identity => {
                assert!(named.is_none(), "{}: identity but cites a fit", c.id);
                assert!(
                    c.basis.starts_with("identity: "),
                    "{}: an identity says why it holds by construction",
                    c.id
                );
            }
            Tag::Validate => {
                assert!(named.is_none(), "{}: validate but cites a fit", c.id);
                assert!(
                    !c.basis.contains("identity: "),
                    "{}: validate but says it holds by construction",
                    c.id
                );
            }
        }
    }
}

/// How far the model is from the paper: |model - paper| / |paper| for a value, from the
/// nearer end for a range, beyond the bound for a direction (in the unit where the bound is
/// 0). Measured against the paper's figure, never against the model's, so a model figure
/// near zero (P6.mapp, P4.read.dapp) has the same slack as any other.
fn gap(paper: Published, model: f64) -> f64 {
    let scaled = |distance: f64, by: f64| {
        if by == 0.0 {
            distance
        } else {
            distance / by.abs()
        }
    };
    match paper {
        Published::Value(_) | Published::Range(..) => {
            paper.relative_error(model).unwrap_or(f64::INFINITY).abs()
        }
        Published::Above(b) => scaled((b - model).max(0.0), b),
        Published::Below(b) => scaled((model - b).max(0.0), b),
    }
}

/// How much further from the paper than its listed figure a known gap may move before the
/// ratchet fails: one per cent of the paper's figure (the simulator is deterministic, so
/// any move is a change of the model or the scenario).
const GAP_SLACK: f64 = 0.01;

/// Every check within tolerance, except the known gaps, each no further from the paper than
/// the list says (a one-sided ratchet: a gap that widens fails, one that narrows asks for
/// the list to follow). Runs every scenario the table names once.
#[test]
fn every_check_within_tolerance_or_a_known_gap() {
    let checks = builtin_table().unwrap_or_else(|e| panic!("{e}"));
    let v = Validation::run(checks, &common::scenarios_dir(), &mut |_| {})
        .unwrap_or_else(|e| panic!("{e}"));
    let mut problems = Vec::new();
    let mut narrowed = Vec::new();
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
            (Status::Fail, Some(at)) => {
                let (now, was) = (gap(o.check.paper, model), gap(o.check.paper, at));
                if now.is_nan() || now > was + GAP_SLACK {
                    problems.push(format!(
                        "{said}: the gap widened from {:.1}% (model {at}) to {:.1}% of the paper's figure",
                        was * 100.0,
                        now * 100.0
                    ));
                } else if now < was - GAP_SLACK {
                    narrowed.push(format!(
                        "{said}: the gap narrowed from {:.1}% (model {at}) to {:.1}%: list {model:.3}",
                        was * 100.0,
                        now * 100.0
                    ));
                }
            }
        }
    }
    for (id, _) in common::gaps::KNOWN_GAPS {
        if !v.outcomes.iter().any(|o| o.check.id == *id) {
            problems.push(format!("{id}: listed as a gap but not in the table"));
        }
    }
    eprintln!("{}", v.summary_text(Tag::Validate));
    eprintln!("{}", v.summary_text(Tag::Fit));
    eprintln!("{}", v.summary_text(Tag::Identity));
    if !narrowed.is_empty() {
        eprintln!(
            "update common/gaps.rs, so the ratchet holds the new figures:\n{}",
            narrowed.join("\n")
        );
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

/// The ratchet's measure: a gap is the distance from the paper, so moving toward the paper
/// narrows it and moving away widens it, from either side and for a model figure of zero.
#[test]
fn a_gap_is_the_distance_from_the_paper() {
    let value = Published::Value(0.35);
    assert_eq!(gap(value, 0.35), 0.0);
    assert!((gap(value, 0.0) - 1.0).abs() < 1e-12);
    assert!((gap(value, 0.7) - 1.0).abs() < 1e-12);
    assert!(gap(value, 0.01) < gap(value, 0.0));
    let range = Published::Range(6.7, 7.0);
    assert_eq!(gap(range, 6.9), 0.0);
    assert!((gap(range, 7.7) - 0.1).abs() < 1e-12);
    assert!((gap(Published::Below(0.05), 0.085) - 0.7).abs() < 1e-12);
    assert_eq!(gap(Published::Above(1.0), 1.2), 0.0);
}

/// Flow sets a fairness check must reject: every flow the check reads equal but one, served
/// at 60% of the others or not at all.
#[test]
fn jain_and_spread_bands_reject_a_starved_or_a_60_percent_flow() {
    // The checks of shares among equal flows, with the flows they read: (id, scenario,
    // variant, name prefix, how many).
    let fairness = [
        ("N8.tput", "4 throughput flows", "tput#", 4),
        ("J7.bw.jain", "8 bw + justitia", "bw#", 8),
        ("J7.mixed.jain", "mixed sizes + justitia", "bw", 10),
        ("J7.tput.jain", "8 tput + justitia", "tput#", 8),
        ("J8.jain", "justitia, gives up after delta", "bw#", 2),
        ("P5.spread", "preempt", "B_App#", 1000),
    ];
    let checks = builtin_table().unwrap_or_else(|e| panic!("{e}"));
    let listed: Vec<&str> = checks
        .iter()
        .filter(|c| {
            c.model
                .as_deref()
                .is_some_and(|m| m.starts_with("jain(") || c.id.contains("spread"))
        })
        .map(|c| c.id.as_str())
        .collect();
    let covered: Vec<&str> = fairness.iter().map(|f| f.0).collect();
    assert_eq!(listed, covered, "every Jain or spread check is tried here");
    for (id, variant, prefix, n) in fairness {
        let check = checks
            .iter()
            .find(|c| c.id == id)
            .unwrap_or_else(|| panic!("{id}: not in the table"))
            .clone();
        let scenario = check
            .scenario
            .clone()
            .unwrap_or_else(|| panic!("{id}: no scenario"));
        for (what, served) in [("equal", 1.0), ("one at 60%", 0.6), ("one starved", 0.0)] {
            let flows = (0..n)
                .map(|i| {
                    common::synthetic_flow(
                        &format!("{prefix}{i}"),
                        if i == 0 { served } else { 1.0 },
                    )
                })
                .collect();
            let reports = common::synthetic_report(&scenario, variant, flows);
            let v = Validation::evaluate(vec![check.clone()], &reports)
                .unwrap_or_else(|e| panic!("{id}: {e}"));
            let status = v.outcomes[0].status;
            let expected = if served == 1.0 {
                Status::Pass
            } else {
                Status::Fail
            };
            assert_eq!(
                status, expected,
                "{id} with {n} flows, {what}: model {:?}",
                v.outcomes[0].model
            );
        }
    }
}
