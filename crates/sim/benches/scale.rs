//! How the simulator's speed scales with flows and queue pairs (a benchmark, not a test:
//! it prints, it never fails on time).
//!
//! One 16 B latency flow beside 10, 100 and 1000 bandwidth flows of 8 queue pairs each
//! (1 MB WRITEs, 8 outstanding per queue pair) on RoCE-100, for 20 simulated ms, natively
//! and under Justitia. Prints, per run, the events handled, events per wall-clock second,
//! and the wall time one simulated second would take. An event's cost should not grow
//! with the number of flows: the events per second should stay level across the rows.
//!
//! `cargo bench -p justitia-sim --bench scale`

use std::error::Error;
use std::time::Instant;

use justitia_sim::Experiment;

/// Simulated time of each run, ms (the new user's report ran 20 ms).
const SIMULATED_MS: f64 = 20.0;
/// Queue pairs of each bandwidth flow.
const QPS_PER_FLOW: u32 = 8;

/// The scenario with `flows` bandwidth flows, written as a scenario file would be.
fn scenario(flows: u32) -> String {
    format!(
        r#"
description = "one latency flow beside {flows} bandwidth flows of {QPS_PER_FLOW} QPs"
profile = "RoCE-100"
duration_ms = {SIMULATED_MS}
warmup_ms = 2
seed = 1

[justitia]
target99_us = 2.0

[[flows]]
name = "lat"
[flows.latency]
size = 16

[[flows]]
name = "bw"
copies = {flows}
[flows.bandwidth]
size = "1MB"
depth = 8
qps = {QPS_PER_FLOW}

[[variants]]
name = "native"

[[variants]]
name = "justitia"
policy = "justitia"
"#
    )
}

fn main() -> Result<(), Box<dyn Error>> {
    println!(
        "{:>6} {:>6} {:<9} {:>10} {:>9} {:>12} {:>16} {:>10} {:>9}",
        "flows",
        "QPs",
        "run",
        "events",
        "wall s",
        "events/s",
        "wall s / sim s",
        "lat p50 us",
        "bw Gb/s"
    );
    for flows in [10, 100, 1000] {
        let base = Experiment::from_toml("scale", &scenario(flows), None)?;
        for variant in ["native", "justitia"] {
            let mut experiment = base.clone();
            experiment.scenario.variants.retain(|v| v.name == variant);
            let started = Instant::now();
            let report = experiment.run()?;
            let wall = started.elapsed().as_secs_f64();
            let events = report.events();
            let run = report.runs.first().ok_or("the scenario has no such run")?;
            let latency = run
                .flow("lat")
                .and_then(|f| f.latency)
                .map_or(f64::NAN, |l| l.p50_us);
            let gbps: f64 = run
                .flows
                .iter()
                .filter(|f| f.name.starts_with("bw"))
                .map(|f| f.gbps)
                .sum();
            println!(
                "{:>6} {:>6} {:<9} {:>10} {:>9.3} {:>12.0} {:>16.2} {:>10.3} {:>9.2}",
                flows,
                flows * QPS_PER_FLOW + 1,
                variant,
                events,
                wall,
                events as f64 / wall,
                wall / (SIMULATED_MS / 1e3),
                latency,
                gbps
            );
        }
    }
    Ok(())
}
