//! Same seed, same output, byte for byte; another seed, another output.

mod common;

use justitia_sim::Experiment;

/// A short run of every application model and both policies.
fn short(name: &str, seed: u64, ms: f64) -> String {
    let mut experiment: Experiment = common::experiment(name);
    experiment.scenario.seed = seed;
    experiment.scenario.duration_ms = ms;
    experiment.scenario.warmup_ms = ms / 10.0;
    let report = experiment
        .run()
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .without_wall_time();
    serde_json::to_string(&report).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn same_seed_same_report() {
    for (name, ms) in [
        ("lat-vs-1mb-bw-ib56", 6.0),
        ("fasst-vs-storage-ib56", 4.0),
        ("many-latency-vs-arriving-bw-ib56", 12.0),
    ] {
        let first = short(name, 7, ms);
        let second = short(name, 7, ms);
        assert!(first == second, "{name}: two runs with seed 7 differ");
        assert!(first.len() > 200, "{name}: suspiciously small report");
    }
}

#[test]
fn another_seed_another_report() {
    let a = short("lat-vs-1mb-bw-ib56", 1, 6.0);
    let b = short("lat-vs-1mb-bw-ib56", 2, 6.0);
    assert_ne!(a, b, "the seed must drive the randomness");
}
