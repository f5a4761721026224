//! Every scenario file loads, lists with a description, and names the targets it covers;
//! broken files are refused with the offending field named.

mod common;

use justitia_sim::{list_scenarios, Experiment};

#[test]
fn every_scenario_loads_and_describes_itself() {
    let list = list_scenarios(&common::scenarios_dir()).unwrap_or_else(|e| panic!("{e}"));
    assert!(list.len() >= 15, "only {} scenarios", list.len());
    for s in &list {
        assert!(!s.description.trim().is_empty(), "{}", s.name);
        assert!(!s.description.contains('\n'), "{}: one line", s.name);
        let e = Experiment::load(&s.path).unwrap_or_else(|e| panic!("{e}"));
        assert!(!e.scenario.variants().is_empty(), "{}", s.name);
    }
}

#[test]
fn every_validation_target_has_a_scenario() {
    let list = list_scenarios(&common::scenarios_dir()).unwrap_or_else(|e| panic!("{e}"));
    let all: String = list.iter().map(|s| s.description.as_str()).collect();
    for target in [
        "N1", "N2", "N3", "N4", "N5", "N6", "N7", "N8", "N9", "N10", "N11", "J1", "J2", "J3", "J4",
        "J5", "J6", "J7", "J8", "R1", "R2", "R3", "R4", "R5", "R6", "R7", "R8", "P1", "P2",
    ] {
        assert!(
            all.contains(&format!("{target},")) || all.contains(&format!("{target})")),
            "no scenario names {target}"
        );
    }
}

#[test]
fn bad_files_name_the_field() {
    let good = std::fs::read_to_string(common::scenarios_dir().join("lat-vs-1mb-bw-ib56.toml"))
        .unwrap_or_else(|e| panic!("{e}"));
    let cases = [
        (good.replace("depth = 8", "depht = 8"), "depht"),
        (good.replace("depth = 8", "depth = 0"), "bandwidth.depth"),
        (
            good.replace("duration_ms = 30", "duration_ms = \"long\""),
            "duration_ms",
        ),
        (
            good.replace("policy = \"justitia\"", "policy = \"fair\""),
            "fair",
        ),
        (
            good.replace("target99_us = 1.73", "target99_us = -1"),
            "target99_us",
        ),
        (
            good.replace(
                "target99_us = 1.73",
                "target99_us = 1.73\ntarget99_x_idle = 2",
            ),
            "not both",
        ),
        (
            good.replace("target99_us = 1.73", "target99_x_idle = 0.5"),
            "target99_x_idle",
        ),
        (
            good.replace("profile = \"IB-56\"", "profile = \"nope.toml\""),
            "nope.toml",
        ),
    ];
    for (text, field) in cases {
        let err = Experiment::from_toml("bad", &text, Some(&common::scenarios_dir()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(field), "error `{err}` should name `{field}`");
    }
}
