//! # justitia-agent
//!
//! The contract between `justitiad` and the shapers on its host.
//!
//! | module | what it owns |
//! | --- | --- |
//! | [`block`] | the control block: a sealed memfd of atomics the daemon writes and shapers map read-only, a seqlock per slot, the heartbeat and the boot id |
//! | [`proto`] | the registration socket's messages and their bounded parser |
//! | [`admin`] | the admin socket's JSON requests and answers |
//! | [`client`] | what a shaper calls: connect, register, read an allotment without blocking, report usage, notice the daemon gone and re-register with backoff |

pub mod admin;
pub mod block;
pub mod client;
pub mod proto;
