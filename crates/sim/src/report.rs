//! Reports: what a run measured, ready for tables, JSON, CSV and plots.

use std::collections::BTreeMap;

use justitia_core::flow::FlowClass;
use serde::{Deserialize, Serialize};

use crate::series::RunSeries;

/// All runs of one scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScenarioReport {
    /// The scenario's name (file name without `.toml`).
    pub scenario: String,
    /// Its one-line description.
    pub description: String,
    /// The RNIC model profile's name.
    pub profile: String,
    /// The seed.
    pub seed: u64,
    /// Simulated time per run, ms.
    pub duration_ms: f64,
    /// Unmeasured start of each run, ms.
    pub warmup_ms: f64,
    /// One report per variant, in scenario order.
    pub runs: Vec<RunReport>,
}

/// One run (variant) of a scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// The variant's name (e.g. `alone`, `with bw`, `with bw + justitia`).
    pub variant: String,
    /// The policy on every host.
    pub policy: String,
    /// One entry per flow that ran, in scenario order.
    pub flows: Vec<FlowReport>,
    /// Payload rate of the busiest host's transmitter over the profile's MaxRate.
    pub utilisation: f64,
    /// Jain's fairness index of the bandwidth flows' Gb/s; `None` without bandwidth flows.
    pub jain_bandwidth: Option<f64>,
    /// Figures the policy reports about itself, as `host.figure`.
    pub policy_figures: BTreeMap<String, f64>,
    /// Figures of the fabric's flow control: with PFC switches, `pfc_pauses` (pause frames
    /// sent) and `pfc_peak_held_bytes` (the fullest an input buffer lane got, counted from
    /// when a packet is eligible); empty otherwise.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fabric_figures: BTreeMap<String, f64>,
    /// Events the run handled.
    pub events: u64,
    /// Each flow's rate and each control loop's state over time.
    #[serde(default)]
    pub series: RunSeries,
    /// Wall-clock time the run took, in seconds. The only field that differs between two
    /// runs with the same seed, so it is not serialized: a written report depends on the
    /// scenario and its seed alone.
    #[serde(skip)]
    pub wall_seconds: f64,
}

/// What one flow got.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowReport {
    /// The flow's name.
    pub name: String,
    /// Its class.
    pub class: FlowClass,
    /// Its application model (`latency`, `throughput`, `bandwidth`, `rpc`, `storage`).
    pub app: String,
    /// Application-level messages completed in the window (requests for RPC, objects for
    /// storage).
    pub messages: u64,
    /// Messages per second.
    pub msgs_per_sec: f64,
    /// Payload that arrived at its destination in the window, in Gb/s.
    pub gbps: f64,
    /// Latency percentiles of its samples, if it took any.
    pub latency: Option<LatencyReport>,
}

/// Percentiles of a flow's latency samples, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatencyReport {
    /// Samples.
    pub samples: u64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Mean.
    pub mean_us: f64,
    /// Largest.
    pub max_us: f64,
}

impl ScenarioReport {
    /// The run of a variant, by name.
    pub fn run(&self, variant: &str) -> Option<&RunReport> {
        self.runs.iter().find(|r| r.variant == variant)
    }

    /// The same report with every wall-clock time set to zero: what two runs with the same
    /// seed must agree on byte for byte.
    pub fn without_wall_time(mut self) -> Self {
        for r in &mut self.runs {
            r.wall_seconds = 0.0;
        }
        self
    }

    /// Total events over all runs.
    pub fn events(&self) -> u64 {
        self.runs.iter().map(|r| r.events).sum()
    }
}

impl RunReport {
    /// A flow's report, by name.
    pub fn flow(&self, name: &str) -> Option<&FlowReport> {
        self.flows.iter().find(|f| f.name == name)
    }
}

/// Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all get the same, 1/n when one
/// gets everything. `None` for no values; 1 when every value is zero.
pub fn jain_index(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let sum: f64 = values.iter().sum();
    let squares: f64 = values.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        return Some(1.0);
    }
    Some(sum * sum / (values.len() as f64 * squares))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_index_bounds() {
        assert_eq!(jain_index(&[]), None);
        assert_eq!(jain_index(&[5.0, 5.0, 5.0]), Some(1.0));
        let one_takes_all = jain_index(&[10.0, 0.0, 0.0, 0.0]).unwrap_or(0.0);
        assert!((one_takes_all - 0.25).abs() < 1e-12);
        let skew = jain_index(&[1.0, 2.0]).unwrap_or(0.0);
        assert!((skew - 0.9).abs() < 1e-12);
    }
}
