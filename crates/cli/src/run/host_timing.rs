//! How a host's requesters take their time stamps and wait: the clock of latency samples
//! and the idle mode of timed waits. Each is decided once per host, before anything
//! starts, by whoever starts that host's load generators: `justitia run` for its own host,
//! `justitia run-server` for its. Both decide with the functions here, so a run across
//! hosts times its samples on every host by the same rules.
//!
//! The TSC is calibrated once per host and its rate handed to every requester there:
//! processes calibrating at once disturb each other's fits (43% off with three on a 2-core
//! VM).

use std::fmt;
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Result};
use justitia_loadgen::clock::{calibrate_tsc, ClockChoice};
use justitia_loadgen::flow::Idle;
use serde::{Deserialize, Serialize};

use super::plan;

/// The clock every requester on one host times its samples with.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum RequesterClock {
    /// The TSC at this rate, calibrated once for the host.
    Tsc {
        /// Hz.
        hz: f64,
    },
    /// `CLOCK_MONOTONIC`.
    Monotonic {},
}

impl RequesterClock {
    /// The clock for a host whose requesters time latency samples when `times_latency`:
    /// the TSC if it is invariant, the clocksource vouches for it and its calibration
    /// fits, else `CLOCK_MONOTONIC` (said once on stderr); `choice` may insist on either.
    /// A host without latency samples needs no calibration and gets the monotonic clock.
    ///
    /// # Errors
    /// `--clock tsc` on a host whose TSC does not qualify.
    pub fn decide(times_latency: bool, choice: ClockChoice) -> Result<Self> {
        if !times_latency || choice == ClockChoice::Monotonic {
            return Ok(RequesterClock::Monotonic {});
        }
        match calibrate_tsc() {
            Ok(c) => {
                eprintln!(
                    "TSC calibrated once for this host's requesters: {:.0} Hz (bound {:.1e}, r^2 {:.6})",
                    c.hz(),
                    c.relative_error,
                    c.r_squared
                );
                Ok(RequesterClock::Tsc { hz: c.hz() })
            }
            Err(why) if choice == ClockChoice::Tsc => bail!("--clock tsc: {why}"),
            Err(why) => {
                eprintln!("{why}: latency samples are timed with CLOCK_MONOTONIC");
                Ok(RequesterClock::Monotonic {})
            }
        }
    }

    /// Adds the requester's clock arguments to a `justitia-loadgen request` command.
    pub fn add_to(self, cmd: &mut Command) {
        match self {
            RequesterClock::Tsc { hz } => {
                cmd.args(["--clock", "tsc", "--tsc-hz", &format!("{hz:.0}")]);
            }
            RequesterClock::Monotonic {} => {
                cmd.args(["--clock", "monotonic"]);
            }
        }
    }

    /// The clock as `-outcomes.json` records it: `{"kind": "tsc", "hz": ...}` or
    /// `{"kind": "monotonic"}`.
    pub fn to_json(self) -> serde_json::Value {
        match self {
            RequesterClock::Tsc { hz } => serde_json::json!({ "kind": "tsc", "hz": hz }),
            RequesterClock::Monotonic {} => serde_json::json!({ "kind": "monotonic" }),
        }
    }
}

impl fmt::Display for RequesterClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequesterClock::Tsc { hz } => write!(f, "tsc at {hz:.0} Hz"),
            RequesterClock::Monotonic {} => f.write_str("monotonic"),
        }
    }
}

/// `--idle`: the load generators' own choice, or `auto`, made by the host that starts them
/// from its device. Also the client's wish in a run-server's hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IdleChoice {
    /// Yield on a software RNIC, spin on any other.
    Auto,
    /// Always poll again at once.
    Spin,
    /// Always yield after 256 empty polls.
    Yield,
}

impl IdleChoice {
    /// The idle mode for the load generators of `device` (the first device when `None`),
    /// whose host lists its RDMA devices under `sysfs`: `auto` yields on a software RNIC
    /// (said once on stderr), whose work runs on the CPUs the pollers would spin on.
    ///
    /// # Errors
    /// `auto` and a device the host does not have.
    pub fn decide(self, sysfs: &Path, device: Option<&str>) -> Result<Idle> {
        Ok(match self {
            IdleChoice::Spin => Idle::Spin,
            IdleChoice::Yield => Idle::Yield,
            IdleChoice::Auto if plan::software_rnic(sysfs, device)? => {
                eprintln!("a software RNIC: the load generators yield after 256 empty polls (--idle spin to spin)");
                Idle::Yield
            }
            IdleChoice::Auto => Idle::Spin,
        })
    }
}

/// The name of an idle mode, as `--idle` takes it.
pub fn idle_name(i: Idle) -> &'static str {
    match i {
        Idle::Spin => "spin",
        Idle::Yield => "yield",
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_host_without_latency_samples_is_not_calibrated() {
        for choice in [ClockChoice::Auto, ClockChoice::Tsc, ClockChoice::Monotonic] {
            assert_eq!(
                RequesterClock::decide(false, choice).unwrap(),
                RequesterClock::Monotonic {}
            );
        }
        assert_eq!(
            RequesterClock::decide(true, ClockChoice::Monotonic).unwrap(),
            RequesterClock::Monotonic {}
        );
    }

    #[test]
    fn the_clock_reaches_the_requester_as_arguments() {
        let mut c = Command::new("justitia-loadgen");
        RequesterClock::Tsc { hz: 2.1e9 }.add_to(&mut c);
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(args, ["--clock", "tsc", "--tsc-hz", "2100000000"]);
        let mut c = Command::new("justitia-loadgen");
        RequesterClock::Monotonic {}.add_to(&mut c);
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(args, ["--clock", "monotonic"]);
    }

    #[test]
    fn the_wire_form_of_a_clock_is_unchanged() {
        // A run-server of the protocol's first version reads these.
        assert_eq!(
            serde_json::to_string(&RequesterClock::Tsc { hz: 2.0e9 }).unwrap(),
            r#"{"tsc":{"hz":2000000000.0}}"#
        );
        assert_eq!(
            serde_json::to_string(&RequesterClock::Monotonic {}).unwrap(),
            r#"{"monotonic":{}}"#
        );
        assert_eq!(
            serde_json::to_string(&IdleChoice::Auto).unwrap(),
            r#""auto""#
        );
    }

    #[test]
    fn explicit_idle_modes_need_no_device() {
        let none = Path::new("/nonexistent");
        assert_eq!(IdleChoice::Spin.decide(none, None).unwrap(), Idle::Spin);
        assert_eq!(IdleChoice::Yield.decide(none, None).unwrap(), Idle::Yield);
    }
}
