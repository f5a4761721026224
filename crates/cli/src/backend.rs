//! Where a report's figures come from, named in every table heading and figure title, so
//! that a simulated and a measured report are never mistaken for each other.

use justitia_sim::ScenarioReport;

use crate::table::number;

/// The backend a scenario ran on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The discrete-event simulator, on the scenario's RNIC model profile.
    Simulator,
    /// Real verbs on a local device, each flow its own process.
    Verbs {
        /// The device's name (e.g. `rxe0`).
        device: String,
    },
}

impl Backend {
    /// The second line of a table: what ran, on what, for how long.
    pub fn heading(&self, report: &ScenarioReport) -> String {
        match self {
            Backend::Simulator => format!(
                "RNIC profile {}, {} ms simulated per run (first {} ms not measured), seed {}",
                report.profile,
                number(report.duration_ms),
                number(report.warmup_ms),
                report.seed
            ),
            Backend::Verbs { device } => format!(
                "real verbs on {device} (scenario's model profile {}), {} ms measured per run (first {} ms not measured), one process per flow end",
                report.profile,
                number(report.duration_ms),
                number(report.warmup_ms),
            ),
        }
    }

    /// The subtitle of a figure.
    pub fn subtitle(&self, report: &ScenarioReport) -> String {
        match self {
            Backend::Simulator => format!(
                "simulated: RNIC profile {}, {} ms per run ({} ms warm-up not measured), seed {}",
                report.profile, report.duration_ms, report.warmup_ms, report.seed
            ),
            Backend::Verbs { device } => format!(
                "measured: real verbs on {device}, {} ms per run ({} ms warm-up not measured)",
                report.duration_ms, report.warmup_ms
            ),
        }
    }
}
