//! The admin socket's requests and answers: one JSON object per line each way.
//!
//! Shared by `justitiad` and `justitia status | flows | set target`, so both sides agree on
//! the fields by construction.

use serde::{Deserialize, Serialize};

/// The longest admin request the daemon reads.
pub const MAX_ADMIN_REQUEST: usize = 4096;

/// A request on the admin socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum AdminRequest {
    /// The daemon-wide status.
    Status,
    /// Every registered flow.
    Flows,
    /// Change Target99.
    SetTarget {
        /// `150us`, `2ms`, `800ns` (absolute) or `2.5x` (a multiple of the idle p99).
        target: String,
    },
}

/// The daemon-wide status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The daemon's boot id.
    pub boot_id: u64,
    /// The RDMA device probed (or `synthetic`).
    pub device: String,
    /// The profile in use.
    pub profile: String,
    /// MaxRate, bytes/s.
    pub max_rate: f64,
    /// SafeUtil, bytes/s.
    pub safe_util: f64,
    /// Current99, ns.
    pub current_p99_ns: Option<u64>,
    /// Target99 in effect, ns.
    pub target_p99_ns: Option<u64>,
    /// The probe's idle p99, ns, once measured.
    pub idle_p99_ns: Option<u64>,
    /// Probes completed.
    pub probes: u64,
    /// Probes lost.
    pub probes_lost: u64,
    /// Active latency flows counted.
    pub latency: u32,
    /// Active bandwidth flows counted.
    pub bandwidth: u32,
    /// Active throughput flows counted.
    pub throughput: u32,
    /// Registered flows.
    pub flows: usize,
    /// Tenants the daemon holds a page for: those with a connection or a flow. Bounded by
    /// the connections; it falls back as tenants leave.
    #[serde(default)]
    pub tenants: usize,
    /// Cgroups known as tenants (`tenant = "cgroup"`; 0 otherwise): only those with a
    /// connection or a flow, so a host that churns through containers does not grow it.
    #[serde(default)]
    pub cgroups: usize,
    /// The controller's mode.
    pub mode: String,
    /// The adaptive law's state under `policy = "adaptive"`; absent under `justitia` (and
    /// from a daemon that does not report it). Boxed: the status stays small beside the
    /// other answers.
    #[serde(default)]
    pub adaptive: Option<Box<AdaptiveStatus>>,
}

/// The adaptive law's state on the host.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveStatus {
    /// The rate the bandwidth flows are paced at together, bytes/s; `None`: not paced.
    pub pace_bytes_per_sec: Option<f64>,
    /// The chunk size bandwidth requests are cut to, bytes.
    pub chunk_bytes: u32,
    /// The pacing fraction (1 until a violation at the smallest chunk).
    pub fraction: f64,
    /// The headroom below the drain rate.
    pub headroom: f64,
    /// Violations that shrank the chunk or the rate so far.
    pub decreases: u64,
    /// The latency and throughput flows' load at the last update, bytes/s.
    pub other_bytes_per_sec: f64,
}

/// One registered flow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowReport {
    /// The daemon's flow id.
    pub flow: u64,
    /// The owner's uid.
    pub uid: u32,
    /// The tenant it counts under: the uid, or the cgroup path with `tenant = "cgroup"`
    /// (empty from a daemon that does not report it).
    #[serde(default)]
    pub tenant: String,
    /// The owner's pid.
    pub pid: i32,
    /// The flow's class.
    pub class: String,
    /// Queue pairs.
    pub qps: u32,
    /// Whether the flow reported work.
    pub active: bool,
    /// Soft admission's verdict: `admitted`, `admitted_with_warning` or `not_admitted`,
    /// spelt as the `justitia_registrations_total` metric labels it.
    pub admission: String,
    /// Allotted bytes/s (resource-hungry flows).
    pub allot_bytes_per_sec: Option<f64>,
    /// Bytes reported sent.
    pub bytes: u64,
    /// Where the flow goes when it loads another host (`reads from 10.0.0.2`, `sends to
    /// 10.0.0.2`); absent from a daemon that does not report it.
    #[serde(default)]
    pub remote: Option<String>,
    /// The guarantee its peer gave a READ flow, bytes/s, while one holds.
    #[serde(default)]
    pub read_guarantee_bytes_per_sec: Option<f64>,
}

/// An answer on the admin socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdminReply {
    /// For [`AdminRequest::Status`].
    Status(StatusReport),
    /// For [`AdminRequest::Flows`].
    Flows(Vec<FlowReport>),
    /// The request was carried out.
    Done(String),
    /// The request was refused.
    Error(String),
}
