//! Reports for the tests of the run's modules: a flow, a run of flows, a scenario of runs,
//! with every figure a test does not set at a neutral value.

use justitia_core::flow::FlowClass;
use justitia_sim::{FlowReport, LatencyReport, RunReport, ScenarioReport};

/// A flow of `class` at `rate` messages/s and no goodput; with `p99`, 1000 latency samples
/// whose p99, p99.9 and maximum are `p99` us and whose median and mean are half of it.
pub fn flow(name: &str, class: FlowClass, p99: Option<f64>, rate: f64) -> FlowReport {
    FlowReport {
        name: name.into(),
        class,
        app: match class {
            FlowClass::Latency => "latency",
            FlowClass::Throughput => "throughput",
            FlowClass::Bandwidth => "bandwidth",
        }
        .into(),
        messages: 1,
        msgs_per_sec: rate,
        gbps: 0.0,
        latency: p99.map(|p99_us| LatencyReport {
            samples: 1000,
            p50_us: p99_us / 2.0,
            p99_us,
            p999_us: p99_us,
            mean_us: p99_us / 2.0,
            max_us: p99_us,
        }),
    }
}

/// A run named `variant` under `policy` of `flows`, with no utilisation or series.
pub fn run(variant: &str, policy: &str, flows: Vec<FlowReport>) -> RunReport {
    RunReport {
        variant: variant.into(),
        policy: policy.into(),
        flows,
        utilisation: 0.0,
        jain_bandwidth: None,
        policy_figures: Default::default(),
        fabric_figures: Default::default(),
        events: 0,
        series: Default::default(),
        wall_seconds: 0.0,
    }
}

/// A scenario of `runs`.
pub fn scenario(runs: Vec<RunReport>) -> ScenarioReport {
    ScenarioReport {
        scenario: "s".into(),
        description: "d".into(),
        profile: "p".into(),
        seed: 1,
        duration_ms: 1.0,
        warmup_ms: 0.0,
        runs,
    }
}
