//! The admin socket's requests and answers: one JSON object per line each way.
//!
//! Shared by `justitiad` and `justitia status | flows | set target`, so both sides agree on
//! the fields by construction. A field added to an answer carries `#[serde(default)]`, and
//! a new request is a new command, so that either side may be the older one: an older
//! daemon refuses a command it does not know (`bad request`), which the CLI says and
//! carries on.

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
    /// Every connected tenant: its weight, processes and control verbs.
    Tenants,
    /// The processes holding RDMA queue pairs with no shaper registered, as the daemon's
    /// last scan found them.
    Unshaped,
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
    /// Where the probes go: `loopback`, or `wire to <peer>` once the reference peer's
    /// daemon answered (`peer.probe_to`). Empty from a daemon that does not say.
    #[serde(default)]
    pub probe_path: String,
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
    /// The latency flows' tail the law read at the last update, ns (`None`: none).
    #[serde(default)]
    pub tail_ns: Option<u64>,
    /// Where that tail came from.
    #[serde(default)]
    pub tail_source: TailSource,
    /// Round trips the latency flows' shapers reported so far.
    #[serde(default)]
    pub round_trips: u64,
    /// Updates so far at which the law read the applications' round trips.
    #[serde(default)]
    pub applications_tail_updates: u64,
}

/// Where the adaptive law's tail came from at an update.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TailSource {
    /// No tail: no latency flow reported enough round trips and no probe estimate.
    #[default]
    None,
    /// The latency applications' own round trips, reported by their shapers.
    Applications,
    /// The reference flow's, for want of the applications'.
    Probe,
}

impl TailSource {
    /// Its name in the JSON and the text report.
    pub fn name(self) -> &'static str {
        match self {
            TailSource::None => "none",
            TailSource::Applications => "applications",
            TailSource::Probe => "probe",
        }
    }
}

/// One registered flow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowReport {
    /// The daemon's flow id.
    pub flow: u64,
    /// The owner's uid.
    pub uid: u32,
    /// The tenant it counts under: the uid, the cgroup path with `tenant = "cgroup"`,
    /// `pod/<namespace>/<pod>` (or `pod/<UID>`) with `"pod"`, `namespace/<namespace>` with
    /// `"namespace"` (empty from a daemon that does not report it).
    #[serde(default)]
    pub tenant: String,
    /// Its share weight (its pod's, namespace's or uid's; 0 from a daemon that does not
    /// report it).
    #[serde(default)]
    pub weight: u32,
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

/// One connected tenant, as `justitia flows` lists it after the flows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantReport {
    /// The tenant, spelt as [`FlowReport::tenant`] spells it.
    pub tenant: String,
    /// Its share weight.
    pub weight: u32,
    /// Its processes connected to the daemon.
    pub processes: u32,
    /// Its control-verb budget in verbs/s, shared by its processes (`None`: not paced).
    pub control_verbs_per_sec: Option<f64>,
    /// Control verbs its processes reported issuing.
    pub control_verbs: u64,
    /// Of them, those that waited for the budget.
    pub control_verbs_delayed: u64,
    /// The time they waited, in seconds.
    pub control_verb_wait_seconds: f64,
    /// How many shaped QPs each of its processes may post on at once (`None`: no turns);
    /// absent from a daemon that does not report it.
    #[serde(default)]
    pub qp_turns: Option<u32>,
    /// Times one of its QPs waited in line for a turn, as its shapers reported.
    #[serde(default)]
    pub qp_turn_waits: u64,
    /// Times one of its QPs gave a spent turn up to a waiting one.
    #[serde(default)]
    pub qp_turn_yields: u64,
}

/// Where the daemon's scan for unshaped processes stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScanState {
    /// No scan has completed yet.
    Starting,
    /// The last scan completed.
    Scanning,
    /// The last scan failed (see [`UnshapedReport::error`]); the table is the last
    /// completed scan's, if any.
    Unavailable,
    /// Not looked for (`unshaped_scan_ms = 0`).
    Off,
    /// A state this side does not know (from a newer daemon).
    #[serde(other)]
    Unknown,
}

/// The unshaped processes: those holding RDMA queue pairs (RC, UC, UD) on the daemon's
/// devices whose process has no shaper connected to the daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnshapedReport {
    /// Where the scan stands.
    pub scan: ScanState,
    /// Why the last scan failed, while it does.
    #[serde(default)]
    pub error: Option<String>,
    /// The time between scans, ms (0: off).
    pub interval_ms: u64,
    /// When the last completed scan ended, ms since the Unix epoch.
    #[serde(default)]
    pub scanned_unix_ms: Option<u64>,
    /// The devices the last completed scan read.
    #[serde(default)]
    pub devices: Vec<String>,
    /// The unshaped processes by pid, at most the daemon's cap of them.
    #[serde(default)]
    pub processes: Vec<UnshapedProcess>,
    /// Unshaped processes beyond those listed.
    #[serde(default)]
    pub unlisted_processes: u64,
    /// The queue pairs of every unshaped process, listed or not.
    #[serde(default)]
    pub qps: u64,
    /// The last scan stopped at its cap of queue pairs: there may be more.
    #[serde(default)]
    pub capped: bool,
}

/// A process holding RDMA queue pairs with no shaper registered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnshapedProcess {
    /// Its pid (the thread group's).
    pub pid: i32,
    /// Its effective uid, when it could be read.
    pub uid: Option<u32>,
    /// Its command (`/proc/<pid>/comm`; empty when it could not be read), control
    /// characters replaced.
    pub comm: String,
    /// The tenant it would count under: its uid, or its cgroup with `tenant = "cgroup"`;
    /// `None` when it could not be read.
    pub tenant: Option<String>,
    /// Its queue pairs counted (all of them).
    pub qps: u64,
    /// The first of them, at most the daemon's cap per process.
    pub listed: Vec<UnshapedQp>,
}

/// One queue pair of an unshaped process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnshapedQp {
    /// The device.
    pub device: String,
    /// Its QP number.
    pub qpn: u32,
    /// Its transport (`RC`, `UC`, `UD`).
    pub qp_type: String,
    /// Its state (`RTS`, ...), when the kernel gave it.
    pub state: Option<String>,
}

/// An answer on the admin socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdminReply {
    /// For [`AdminRequest::Status`].
    Status(StatusReport),
    /// For [`AdminRequest::Flows`].
    Flows(Vec<FlowReport>),
    /// For [`AdminRequest::Tenants`].
    Tenants(Vec<TenantReport>),
    /// For [`AdminRequest::Unshaped`].
    Unshaped(UnshapedReport),
    /// The request was carried out.
    Done(String),
    /// The request was refused.
    Error(String),
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_unshaped_request_and_answer_read_across_versions() {
        assert_eq!(
            serde_json::to_string(&AdminRequest::Unshaped).unwrap(),
            r#"{"cmd":"unshaped"}"#
        );
        // From a newer daemon: a state and a field this side does not know.
        let newer = r#"{"unshaped":{"scan":"paused","interval_ms":1000,"qps":2,"later":1,
            "processes":[{"pid":7,"uid":0,"comm":"ib_write_bw","tenant":"0","qps":2,
            "listed":[{"device":"rxe0","qpn":17,"qp_type":"RC","state":"RTS"}]}]}}"#;
        let AdminReply::Unshaped(r) = serde_json::from_str(newer).unwrap() else {
            panic!("not an unshaped answer")
        };
        assert_eq!(
            (r.scan, r.qps, r.error, r.capped),
            (ScanState::Unknown, 2, None, false)
        );
        assert_eq!(r.processes[0].listed[0].qpn, 17);
        let off: AdminReply =
            serde_json::from_str(r#"{"unshaped":{"scan":"off","interval_ms":0}}"#).unwrap();
        assert!(matches!(off, AdminReply::Unshaped(r) if r.scan == ScanState::Off));
    }
}
