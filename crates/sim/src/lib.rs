//! # justitia-sim
//!
//! A deterministic discrete-event simulator of RDMA NICs shared by many applications,
//! calibrated to the measurements of the Justitia (NSDI'22), PeRF (ATC'24) and KBNets'17
//! papers, running the same policy code as the daemon (`justitia-core`).
//!
//! Use: load a scenario file, run it, read the report.
//!
//! ```no_run
//! let experiment = justitia_sim::Experiment::load("scenarios/lat-vs-1mb-bw-ib56.toml")?;
//! let report = experiment.run()?;
//! for run in &report.runs {
//!     for flow in &run.flows {
//!         println!("{} {}: {:.2} Gb/s", run.variant, flow.name, flow.gbps);
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! | module | what it models |
//! | --- | --- |
//! | [`engine`] | the event queue: integer picoseconds, (time, sequence) order |
//! | [`topology`], [`ids`], [`link`], [`switch`] | hosts and switches joined by links; input buffers, credits or PFC, FCFS or round-robin arbitration, virtual lanes |
//! | [`rnic`] | queue pairs, PCIe, processing units, strict-priority round-robin arbiter, transmit FIFO, receive side |
//! | [`app`] | latency, throughput and bandwidth flows; an RPC and a storage service |
//! | [`policy`] | the plug-in boundary; `native`, `justitia`, `preempt`, `adaptive` and `priority` |
//! | [`model_profile`] | the calibrated parameters of each RNIC (`profiles/*.toml`) |
//! | [`scenario`] | experiments as TOML (`scenarios/*.toml`) |
//! | [`metrics`], [`report`] | percentiles, rates, utilisation, fairness |
//! | [`fairness`] | each tenant's rate against its tenant-fair share (the comparison suite) |
//! | [`series`] | rates and control-loop state over time |

pub mod app;
pub mod engine;
mod event;
pub mod fairness;
pub mod ids;
pub mod link;
pub mod metrics;
pub mod model_profile;
#[cfg(test)]
mod module_graph;
pub mod policy;
pub mod report;
pub mod rnic;
pub mod scenario;
pub mod series;
pub mod switch;
pub mod time;
pub mod topology;
pub mod units;
pub mod validation;
mod world;

pub use model_profile::{ModelProfile, ModelProfileError};
pub use report::{FlowReport, LatencyReport, RunReport, ScenarioReport};
pub use scenario::{list_scenarios, Experiment, Scenario, ScenarioError, ScenarioSummary};

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A policy refused its parameters.
    #[error("scenario {scenario}, run `{variant}`: {source}")]
    Policy {
        /// The scenario.
        scenario: String,
        /// The run.
        variant: String,
        /// The policy's error.
        source: policy::PolicyBuildError,
    },
}

/// How far a scenario has got, for progress bars.
#[derive(Clone, Debug, PartialEq)]
pub struct Progress {
    /// Index of the run in progress (0-based).
    pub run: usize,
    /// Runs in the scenario.
    pub runs: usize,
    /// The variant being run.
    pub variant: String,
    /// Simulated time reached in this run, ms.
    pub simulated_ms: f64,
    /// Simulated time of each run, ms.
    pub duration_ms: f64,
}

impl Progress {
    /// Fraction of the whole scenario done, in [0, 1].
    pub fn fraction(&self) -> f64 {
        if self.runs == 0 || self.duration_ms <= 0.0 {
            return 1.0;
        }
        let within = (self.simulated_ms / self.duration_ms).clamp(0.0, 1.0);
        ((self.run as f64 + within) / self.runs as f64).clamp(0.0, 1.0)
    }
}

impl Experiment {
    /// Runs every variant of the scenario, one after another.
    pub fn run(&self) -> Result<ScenarioReport, RunError> {
        self.run_with_progress(&mut |_| {})
    }

    /// Runs every variant, telling `progress` how far it got every 65536 events and at the
    /// end of each run.
    pub fn run_with_progress(
        &self,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<ScenarioReport, RunError> {
        let variants = self.scenario.variants();
        let runs = variants.len();
        let reports = variants
            .iter()
            .enumerate()
            .map(|(run, variant)| {
                let world =
                    world::World::build(self, variant).map_err(|source| RunError::Policy {
                        scenario: self.name.clone(),
                        variant: variant.name.clone(),
                        source,
                    })?;
                let mut tell = |now: time::Picos| {
                    progress(&Progress {
                        run,
                        runs,
                        variant: variant.name.clone(),
                        simulated_ms: now as f64 / time::MILLISECOND as f64,
                        duration_ms: self.scenario.duration_ms,
                    })
                };
                Ok(world.run(&mut tell))
            })
            .collect::<Result<Vec<_>, RunError>>()?;
        Ok(ScenarioReport {
            scenario: self.name.clone(),
            description: self.scenario.description.clone(),
            profile: self.profile.name().to_string(),
            seed: self.scenario.seed,
            duration_ms: self.scenario.duration_ms,
            warmup_ms: self.scenario.warmup_ms,
            runs: reports,
        })
    }
}
