//! Speed of the simulator (a benchmark, not a test: it prints, it never fails on time).
//!
//! Runs the headline scenario (a 16 B latency flow against a 1 MB bandwidth flow on
//! RoCE-100) for one simulated second, natively and under Justitia, on the profile as
//! calibrated (4 KB MTU) and with a 1 KB MTU (four times the packets), and prints the
//! simulated events per wall-clock second and the simulated seconds per wall-clock second.
//!
//! `cargo bench -p justitia-sim --bench headline`

use std::error::Error;
use std::time::Instant;

use justitia_sim::Experiment;

const SCENARIO: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../scenarios/lat-vs-1mb-bw-roce100.toml"
);
const SIMULATED_MS: f64 = 1_000.0;

fn main() -> Result<(), Box<dyn Error>> {
    let base = Experiment::load(SCENARIO)?;
    println!(
        "{:<26} {:<20} {:>12} {:>10} {:>14} {:>12} {:>11} {:>9}",
        "profile", "run", "events", "wall s", "events/s", "sim s/wall s", "lat p50 us", "bw Gb/s"
    );
    for (label, mtu) in [
        ("RoCE-100 (4 KB MTU)", None),
        ("RoCE-100, 1 KB MTU", Some(1024)),
    ] {
        for variant in ["with bw", "with bw + justitia"] {
            let mut experiment = base.clone();
            experiment.scenario.duration_ms = SIMULATED_MS;
            experiment.scenario.variants.retain(|v| v.name == variant);
            if let Some(mtu) = mtu {
                experiment.profile.policy.mtu = mtu;
            }
            let started = Instant::now();
            let report = experiment.run()?;
            let wall = started.elapsed().as_secs_f64();
            let events = report.events();
            let run = report.runs.first().ok_or("the scenario has no such run")?;
            let latency = run
                .flow("lat")
                .and_then(|f| f.latency)
                .map_or(f64::NAN, |l| l.p50_us);
            let gbps = run.flow("bw").map_or(f64::NAN, |f| f.gbps);
            println!(
                "{:<26} {:<20} {:>12} {:>10.3} {:>14.0} {:>12.3} {:>11.3} {:>9.2}",
                label,
                variant,
                events,
                wall,
                events as f64 / wall,
                SIMULATED_MS / 1e3 / wall,
                latency,
                gbps
            );
        }
    }
    Ok(())
}
