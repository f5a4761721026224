//! # libjustitia.so: the transparent shaper
//!
//! Loaded into an unmodified RDMA application with `LD_PRELOAD`.

pub mod channel;
pub mod clock;
pub mod config;
pub mod cq_ex;
pub mod dl;
pub mod engine;
pub mod exports;
pub mod ffi;
pub mod follow;
pub mod hooks;
pub mod install;
pub mod log;
pub mod mock;
pub mod qp_ex;
pub mod registry;
pub mod send_queue;
pub mod stats;

#[cfg(test)]
mod tests;
