//! How the simulator's speed scales with flows and queue pairs (a benchmark, not a test:
//! it prints, it never fails on time).
//!
//! One 16 B latency flow beside 10, 100 and 1000 bandwidth flows of 8 queue pairs each
//! (1 MB WRITEs, 8 outstanding per queue pair) on RoCE-100, for 20 simulated ms, natively
//! and under Justitia, then 1000 flows for 100 simulated ms, so that building the run
//! weighs less. Prints, per run, the events handled, the wall time spent outside the event
//! loop (building the run and computing its report), the wall time of the event loop, the
//! events per wall-clock second of the event loop alone (the cost of an event, which
//! should not grow with the number of flows: it should stay level across the rows), and
//! the wall time one simulated second takes, all included.
//!
//! `cargo bench -p justitia-sim --bench scale` runs every row; `-- 1000` only the rows of
//! 1000 flows (for a profiler), `-- 1000 native` only their native runs.

use std::error::Error;
use std::time::Instant;

use justitia_sim::Experiment;

#[path = "../tests/support/scale.rs"]
mod scale;
use scale::{scenario, QPS_PER_FLOW};

fn main() -> Result<(), Box<dyn Error>> {
    // Cargo passes `--bench`; numbers choose flow counts, words choose runs.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted_flows: Vec<u32> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let wanted_runs: Vec<&str> = args
        .iter()
        .filter(|a| a.parse::<u32>().is_err())
        .map(String::as_str)
        .collect();
    println!(
        "{:>6} {:>6} {:>6} {:<9} {:>10} {:>9} {:>9} {:>12} {:>15} {:>10} {:>9}",
        "flows",
        "QPs",
        "sim ms",
        "run",
        "events",
        "set-up s",
        "loop s",
        "events/s",
        "wall s / sim s",
        "lat p50 us",
        "bw Gb/s"
    );
    // The new user's report ran 20 ms; 100 ms at 1000 flows amortises building the run.
    for (flows, simulated_ms) in [(10, 20.0), (100, 20.0), (1000, 20.0), (1000, 100.0)] {
        if !wanted_flows.is_empty() && !wanted_flows.contains(&flows) {
            continue;
        }
        let base = Experiment::from_toml(
            "scale",
            &scenario(flows, simulated_ms, &["native", "justitia"]),
            None,
        )?;
        for variant in ["native", "justitia"] {
            if !wanted_runs.is_empty() && !wanted_runs.contains(&variant) {
                continue;
            }
            let mut experiment = base.clone();
            experiment.scenario.variants.retain(|v| v.name == variant);
            let started = Instant::now();
            let report = experiment.run()?;
            let wall = started.elapsed().as_secs_f64();
            let events = report.events();
            let run = report.runs.first().ok_or("the scenario has no such run")?;
            // A run's `wall_seconds` is its event loop alone; the rest of `wall` is
            // building the run and computing its report.
            let event_loop = run.wall_seconds;
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
                "{:>6} {:>6} {:>6} {:<9} {:>10} {:>9.3} {:>9.3} {:>12.0} {:>15.2} {:>10.3} {:>9.2}",
                flows,
                flows * QPS_PER_FLOW + 1,
                simulated_ms,
                variant,
                events,
                wall - event_loop,
                event_loop,
                events as f64 / event_loop,
                wall / (simulated_ms / 1e3),
                latency,
                gbps
            );
        }
    }
    Ok(())
}
