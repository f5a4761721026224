//! The cost of an event must not grow with the number of flows under a policy more than
//! it does natively: a pass over the flows on every event (as the `justitia` policy's
//! search for a flow's incast cap was) makes a run quadratic in its flows and cannot land
//! unseen.
//!
//! Not a timed test: it compares, within one run of the test, the wall-clock cost of an
//! event at 1000 flows with that at 10, under `justitia` and natively, as ratios. The
//! simulator's own cost per event grows with flows (the event queue's heap and the caches
//! of 100 times the queue pairs: natively x2 to x5 from 10 to 1000 flows); a policy whose
//! work per event does not depend on the flows grows no faster, but for its work per
//! update, linear in the flows (every allotment given to the shaper once per RefPeriod:
//! 1000 flows x 40 updates over the 328 128 events of the 20 ms run, 0.12 pacer settings
//! per event, about one event's work). So justitia's growth is at most about twice
//! native's; the bound allows four, a factor two for the noise of a shared machine. The
//! per-flow pass made it 28 here (x33.4 against x1.18) and 24 in the release build
//! (`benches/scale.rs`: x108 against x4.5); without it, x1.5 (x2.72 against x1.79).

#![allow(clippy::expect_used)]

use justitia_sim::Experiment;

#[path = "support/scale.rs"]
mod scale;
use scale::scenario;

/// Wall-clock seconds per event of the run's event loop, the least of three runs (the
/// others are the machine's noise, not the simulator's cost).
fn cost_per_event(flows: u32, simulated_ms: f64, variant: &str) -> f64 {
    let experiment = Experiment::from_toml(
        "event-cost",
        &scenario(flows, simulated_ms, &[variant]),
        None,
    )
    .expect("scenario");
    (0..3)
        .map(|_| {
            let report = experiment.run().expect("run");
            let run = &report.runs[0];
            assert!(
                run.events > 10_000,
                "{flows} flows, {variant}: {} events",
                run.events
            );
            run.wall_seconds / run.events as f64
        })
        .fold(f64::INFINITY, f64::min)
}

#[test]
fn justitias_cost_per_event_grows_with_flows_at_most_4_times_as_much_as_natively() {
    let growth = |variant: &str| {
        // 10 flows run longer, so that both runs take a measurable time.
        let few = cost_per_event(10, 100.0, variant);
        let many = cost_per_event(1000, 20.0, variant);
        eprintln!(
            "{variant}: {:.0} events/s at 10 flows, {:.0} at 1000 (cost x{:.2})",
            1.0 / few,
            1.0 / many,
            many / few
        );
        many / few
    };
    let native = growth("native");
    let justitia = growth("justitia");
    assert!(
        justitia <= 4.0 * native,
        "the cost of an event grew x{justitia:.2} from 10 to 1000 flows under justitia, \
         x{native:.2} natively: x{:.1} more, above 4",
        justitia / native
    );
}
