//! # libjustitia.so: the transparent shaper
//!
//! Loaded into an unmodified RDMA application with `LD_PRELOAD`.
//!
//! Built with `--cfg loom`, the crate is the quick ring alone ([`send_queue`]'s `ring`
//! module against loom's atomics), for its model-checked tests.

#[cfg(not(loom))]
pub mod channel;
#[cfg(not(loom))]
pub mod clock;
#[cfg(not(loom))]
pub mod config;
#[cfg(not(loom))]
pub mod cq_ex;
/// Not in the musl build: musl programs find verbs through handles unshaped (see the
/// module's documentation).
#[cfg(all(not(loom), target_env = "gnu"))]
pub mod dl;
#[cfg(not(loom))]
pub mod engine;
#[cfg(not(loom))]
pub mod exports;
#[cfg(not(loom))]
pub mod ffi;
#[cfg(not(loom))]
pub mod follow;
#[cfg(not(loom))]
pub mod hooks;
#[cfg(not(loom))]
pub mod install;
#[cfg(not(loom))]
pub mod log;
#[cfg(not(loom))]
pub mod mock;
#[cfg(not(loom))]
pub mod pairing;
#[cfg(not(loom))]
pub mod qp_ex;
#[cfg(not(loom))]
pub mod registry;
#[cfg(not(loom))]
pub mod remote;
#[cfg(not(loom))]
pub mod round_trips;
#[cfg(not(loom))]
pub mod send_queue;
#[cfg(not(loom))]
pub mod side_channel;
#[cfg(not(loom))]
pub mod stats;

#[cfg(all(test, not(loom)))]
mod tests;

/// The quick ring alone, for `loom` (see the crate's documentation).
#[cfg(loom)]
#[path = "send_queue/ring.rs"]
pub mod ring;
