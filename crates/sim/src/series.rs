//! Time series of a run: what each flow got and what each host's control loop decided,
//! sampled at a fixed simulated interval from the start of the run (warm-up included, as
//! the controller's start is often what one wants to see).
//!
//! Samples are taken between events, never by events of their own, so recording changes
//! nothing in the run: a sample at `t` sees the state after every event before `t`. Each
//! series is a column (one value per sample), which keeps the JSON compact; the number of
//! samples is bounded by [`MAX_SAMPLES`], the interval widened when a scenario asks for more.

use serde::{Deserialize, Serialize};

use justitia_core::flow::FlowClass;

/// Most samples a run keeps; a finer interval is widened to fit.
pub const MAX_SAMPLES: usize = 20_000;

/// Samples a run takes when its scenario does not set `series_ms`.
pub const DEFAULT_SAMPLES: usize = 1_000;

/// The finest default interval, ms: finer than RefPeriod (0.5 ms) so that each controller
/// update shows, coarse enough that a sample holds many packets.
pub const MIN_DEFAULT_INTERVAL_MS: f64 = 0.05;

/// The sampling interval of a run of `duration_ms`: `requested` if given, else
/// `duration_ms / DEFAULT_SAMPLES` (not under [`MIN_DEFAULT_INTERVAL_MS`]); widened so that
/// the run takes at most [`MAX_SAMPLES`] samples.
pub fn interval_ms(duration_ms: f64, requested: Option<f64>) -> f64 {
    let wanted = requested
        .unwrap_or_else(|| (duration_ms / DEFAULT_SAMPLES as f64).max(MIN_DEFAULT_INTERVAL_MS));
    wanted.max(duration_ms / MAX_SAMPLES as f64)
}

/// Whether a controller pursues Target99 or has given up on it (Justitia §4.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Pursuing Target99.
    Normal,
    /// Target99 deemed unattainable: resource-hungry flows share the whole RNIC.
    Unattainable,
}

/// What a host's control loop says about itself at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct ControlState {
    /// SafeUtil, Gb/s.
    pub safe_util_gbps: f64,
    /// Current99: the reference probe's p99 over its window, us; `None` before a sample.
    pub current99_us: Option<f64>,
    /// Target99 in effect, us (in the probe's units); `None` while it is not yet known
    /// (a target relative to the idle probe before the idle p99 is measured).
    pub target99_us: Option<f64>,
    /// The mode.
    pub mode: Mode,
}

/// The time series of one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSeries {
    /// Time between two samples, ms.
    pub interval_ms: f64,
    /// The end of each sampling interval, ms from the start of the run.
    pub t_ms: Vec<f64>,
    /// One series per flow that ran, in the run's flow order.
    pub flows: Vec<FlowSeries>,
    /// One series per host whose policy runs a control loop with flows to steer.
    pub controls: Vec<ControlSeries>,
}

/// What one flow got over time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowSeries {
    /// The flow's name.
    pub name: String,
    /// Its class.
    pub class: FlowClass,
    /// Payload that arrived at the far end during each interval, Gb/s.
    pub gbps: Vec<f64>,
    /// Application messages completed during each interval, millions per second.
    pub mops: Vec<f64>,
}

/// What one host's control loop decided over time (its state at each sample).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ControlSeries {
    /// The host.
    pub host: String,
    /// SafeUtil, Gb/s.
    pub safe_util_gbps: Vec<f64>,
    /// Current99, us (`null` before the probe's first sample).
    pub current99_us: Vec<Option<f64>>,
    /// Target99 in effect, us (`null` while not yet known).
    pub target99_us: Vec<Option<f64>>,
    /// The mode.
    pub mode: Vec<Mode>,
}

impl ControlSeries {
    /// An empty series for `host`.
    pub fn new(host: &str) -> Self {
        ControlSeries {
            host: host.to_string(),
            safe_util_gbps: Vec::new(),
            current99_us: Vec::new(),
            target99_us: Vec::new(),
            mode: Vec::new(),
        }
    }

    /// Appends one sample.
    pub fn push(&mut self, state: &ControlState) {
        self.safe_util_gbps.push(state.safe_util_gbps);
        self.current99_us.push(state.current99_us);
        self.target99_us.push(state.target99_us);
        self.mode.push(state.mode);
    }
}

impl RunSeries {
    /// A flow's series, by name.
    pub fn flow(&self, name: &str) -> Option<&FlowSeries> {
        self.flows.iter().find(|f| f.name == name)
    }

    /// A host's control series, by host name.
    pub fn control(&self, host: &str) -> Option<&ControlSeries> {
        self.controls.iter().find(|c| c.host == host)
    }

    /// Index of the first sample at or after `t_ms` (the number of samples if none).
    pub fn index_at(&self, t_ms: f64) -> usize {
        self.t_ms.partition_point(|&t| t < t_ms - 1e-9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_interval_scales_with_duration_and_stays_bounded() {
        assert!((interval_ms(1_000.0, None) - 1.0).abs() < 1e-12);
        assert!((interval_ms(10.0, None) - MIN_DEFAULT_INTERVAL_MS).abs() < 1e-12);
        assert!((interval_ms(10.0, Some(0.01)) - 0.01).abs() < 1e-12);
        // 1 us over 1 s would be a million samples: widened to 20 000.
        assert!((interval_ms(1_000.0, Some(0.001)) - 0.05).abs() < 1e-12);
    }

    #[test]
    fn index_at_finds_the_first_sample_at_or_after() {
        let s = RunSeries {
            interval_ms: 0.5,
            t_ms: vec![0.5, 1.0, 1.5, 2.0],
            ..RunSeries::default()
        };
        assert_eq!(s.index_at(0.0), 0);
        assert_eq!(s.index_at(1.0), 1);
        assert_eq!(s.index_at(1.2), 2);
        assert_eq!(s.index_at(9.0), 4);
    }
}
