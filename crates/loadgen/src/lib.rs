//! # justitia-loadgen
//!
//! One flow of a scenario on real verbs, as its own process: `justitia run` starts a
//! responder and a requester per flow, the requester under the shaper when the run has a
//! policy, so that each flow is shaped as its own application.
//!
//! | module | what it holds |
//! | --- | --- |
//! | [`plan`] | what a flow does (latency or perftest-style stream) and what it measured |
//! | [`clock`] | the TSC's rate fitted against `CLOCK_MONOTONIC` (or handed in), or the monotonic clock |
//! | [`oob`] | the out-of-band TCP exchange of queue-pair endpoints, and its hang-up |
//! | [`flow`] | the requester and the responder of a flow |
//!
//! The process protocol (what `justitia run` relies on), one line each on stdout:
//! the responder says `listening PORT` once bound; the requester says `ready` once its
//! queue pairs are connected, waits for a line on stdin, runs, and says
//! `outcome {JSON}` with a [`plan::FlowOutcome`]. Errors go to stderr, naming the flow.
//!
//! A runner that starts many requesters fits the TSC's rate once, with
//! [`clock::calibrate_tsc`] or `justitia-loadgen calibrate` (which prints `tsc-hz HZ`), and
//! hands it to each as `request --tsc-hz HZ`, so that no requester calibrates for itself
//! (see [`clock`]).

pub mod clock;
pub mod flow;
pub mod oob;
pub mod plan;
