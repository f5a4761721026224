//! The daemon's Prometheus metrics and the small HTTP server that exposes them.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A label of one value.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Label {
    /// The class, verdict, reason or uid.
    pub value: String,
}

/// A tenant's label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Tenant {
    /// The tenant's uid.
    pub uid: String,
}

/// A tenant's label and a reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantReason {
    /// The tenant's uid.
    pub uid: String,
    /// Why.
    pub reason: String,
}

/// A tenant's label by its key: the uid, or the cgroup with `tenant = "cgroup"`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantKey {
    /// The tenant's key (see [`crate::unshaped::tenant_series`] for the summed ones).
    pub tenant: String,
}

/// The policy's label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    /// `justitia` or `adaptive`.
    pub policy: String,
}

/// Every metric the daemon exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// SafeUtil, bytes/s.
    pub safe_util: Gauge<f64, AtomicU64>,
    /// The loop's updates that cut SafeUtil (the justitia policy's decreases).
    pub safe_util_decreases: Counter,
    /// MaxRate, bytes/s.
    pub max_rate: Gauge<f64, AtomicU64>,
    /// Current99, seconds; NaN while there is no estimate (see [`Metrics::registry`]).
    pub current_p99: Gauge<f64, AtomicU64>,
    /// Target99, seconds.
    pub target_p99: Gauge<f64, AtomicU64>,
    /// 1 for the policy in effect.
    pub policy: Family<PolicyLabel, Gauge>,
    /// `adaptive`: the rate the bandwidth flows are paced at together, bytes/s (NaN: not
    /// paced, or another policy).
    pub adaptive_pace: Gauge<f64, AtomicU64>,
    /// `adaptive`: the chunk size, bytes (0 under another policy).
    pub adaptive_chunk: Gauge,
    /// `adaptive`: the pacing fraction (NaN under another policy).
    pub adaptive_fraction: Gauge<f64, AtomicU64>,
    /// `adaptive`: violations that shrank the chunk or the rate.
    pub adaptive_decreases: Counter,
    /// `adaptive`: the latency and throughput flows' load at the last update, bytes/s.
    pub adaptive_other_load: Gauge<f64, AtomicU64>,
    /// `adaptive`: the latency flows' tail the law read at the last update, seconds (NaN:
    /// none, or another policy).
    pub adaptive_tail: Gauge<f64, AtomicU64>,
    /// `adaptive`: updates at which the law read the latency applications' own round
    /// trips (the others read the probe's).
    pub adaptive_applications_tail_updates: Counter,
    /// Round trips the latency flows' shapers reported (under `adaptive`).
    pub round_trips_reported: Counter,
    /// L, B, T by class.
    pub flows_counted: Family<Label, Gauge>,
    /// Registered flows.
    pub flows_registered: Gauge,
    /// Per-tenant allotment, bytes/s.
    pub tenant_allotment: Family<Tenant, Gauge<f64, AtomicU64>>,
    /// Per-tenant reported usage, bytes.
    pub tenant_usage: Family<Tenant, Counter>,
    /// Probe latency.
    pub probe_latency: Histogram,
    /// Probes lost.
    pub probes_lost: Counter,
    /// 1 once the reference flow crosses the wire to its peer's daemon, 0 in loopback.
    pub probe_across_wire: Gauge,
    /// Queue pairs whose pairing is held for the rendezvous of side channels.
    pub pairings_held: Gauge,
    /// Side channels found for local queue pairs and told to their shapers.
    pub pairings_found: Counter,
    /// Registrations by verdict.
    pub registrations: Family<Label, Counter>,
    /// Flows reclaimed after their process went away.
    pub reclaims: Counter,
    /// Messages refused, by reason.
    pub refused: Family<Label, Counter>,
    /// Shapers the daemon cannot serve, by reason (`layout`: they cannot read its control
    /// block, after an upgrade of one side), each connection attempt once.
    pub shapers_unserved: Family<Label, Counter>,
    /// Remote ends shapers reported that were refused (not a member of the peer channel,
    /// or past the tenant's cap), by the flow's uid and the reason.
    pub tenant_remote_ends_refused: Family<TenantReason, Counter>,
    /// Times the daemon could not keep the reference flow running.
    pub fail_open: Counter,
    /// The daemon's CPU time.
    pub cpu_seconds: Gauge<f64, AtomicU64>,
    /// Log lines dropped because the log's reader (the journal, a terminal, a file on a
    /// busy disk) fell behind: the loop hands lines to a writer thread through a bounded
    /// buffer and never waits for them to be written.
    pub log_lines_dropped: Counter,
    /// Where [`Metrics::log_lines_dropped`] is read from at each scrape, once logging is
    /// set up.
    log_drops: std::sync::Arc<std::sync::OnceLock<tracing_appender::non_blocking::ErrorCounter>>,
    /// Peer datagrams sent.
    pub peer_sent: Counter,
    /// Bytes of peer datagrams sent.
    pub peer_sent_bytes: Counter,
    /// Peer datagrams that could not be sent (no address, or the kernel refused).
    pub peer_send_failed: Counter,
    /// Peer datagrams accepted.
    pub peer_received: Counter,
    /// Peer datagrams refused, by reason.
    pub peer_refused: Family<Label, Counter>,
    /// 1 while the peer channel's socket is bound; 0 while its port cannot be (taken), and
    /// the daemon tries again.
    pub peer_socket_up: Gauge,
    /// Hosts the peer channel lists (this one included, if listed), as in effect.
    pub peer_members: Gauge,
    /// Member lists refused (a `members_file` that did not read or parse): the running
    /// members were kept.
    pub peer_member_lists_refused: Counter,
    /// Processes holding RDMA queue pairs with no shaper registered, as of the last
    /// completed scan (see [`crate::unshaped`]).
    pub unshaped_processes: Gauge,
    /// Their queue pairs.
    pub unshaped_qps: Gauge,
    /// Unshaped processes per tenant.
    pub tenant_unshaped_processes: Family<TenantKey, Gauge>,
    /// Their queue pairs per tenant.
    pub tenant_unshaped_qps: Family<TenantKey, Gauge>,
    /// Scans for unshaped processes, by result (`completed`, `failed`).
    pub unshaped_scans: Family<Label, Counter>,
    /// Control verbs (memory registrations, QP creations) a tenant's shapers reported.
    pub tenant_control_verbs: Family<TenantKey, Counter>,
    /// Of them, those that waited for the tenant's budget.
    pub tenant_control_verbs_delayed: Family<TenantKey, Counter>,
    /// The time they waited, seconds.
    pub tenant_control_verb_wait: Family<TenantKey, Counter<f64, AtomicU64>>,
    /// A tenant's control-verb budget, verbs/s (0: unpaced).
    pub tenant_control_verb_budget: Family<TenantKey, Gauge<f64, AtomicU64>>,
    /// How many shaped QPs each of a tenant's processes may post on at once (0: no turns).
    pub tenant_qp_turns: Family<TenantKey, Gauge>,
    /// Times one of a tenant's QPs waited in line for a turn, as its shapers reported.
    pub tenant_qp_turn_waits: Family<TenantKey, Counter>,
    /// Times one of a tenant's QPs gave a spent turn up to a waiting one.
    pub tenant_qp_turn_yields: Family<TenantKey, Counter>,
    /// The last completed scan's duration (the kernel's dump, the `/proc` reads and the
    /// decision), in seconds: the next waits at least 50 times as long.
    pub unshaped_scan_seconds: Gauge<f64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Fresh metrics (the probe histogram spans 1 us to about 16 s).
    pub fn new() -> Self {
        Metrics {
            safe_util: Gauge::default(),
            safe_util_decreases: Counter::default(),
            max_rate: Gauge::default(),
            current_p99: Gauge::default(),
            target_p99: Gauge::default(),
            policy: Family::default(),
            adaptive_pace: Gauge::default(),
            adaptive_chunk: Gauge::default(),
            adaptive_fraction: Gauge::default(),
            adaptive_decreases: Counter::default(),
            adaptive_other_load: Gauge::default(),
            adaptive_tail: Gauge::default(),
            adaptive_applications_tail_updates: Counter::default(),
            round_trips_reported: Counter::default(),
            flows_counted: Family::default(),
            flows_registered: Gauge::default(),
            tenant_allotment: Family::default(),
            tenant_usage: Family::default(),
            probe_latency: Histogram::new(exponential_buckets(1e-6, 2.0, 24)),
            probes_lost: Counter::default(),
            probe_across_wire: Gauge::default(),
            pairings_held: Gauge::default(),
            pairings_found: Counter::default(),
            registrations: Family::default(),
            reclaims: Counter::default(),
            refused: Family::default(),
            shapers_unserved: Family::default(),
            tenant_remote_ends_refused: Family::default(),
            fail_open: Counter::default(),
            cpu_seconds: Gauge::default(),
            log_lines_dropped: Counter::default(),
            log_drops: Default::default(),
            peer_sent: Counter::default(),
            peer_sent_bytes: Counter::default(),
            peer_send_failed: Counter::default(),
            peer_received: Counter::default(),
            peer_refused: Family::default(),
            peer_socket_up: Gauge::default(),
            peer_members: Gauge::default(),
            peer_member_lists_refused: Counter::default(),
            unshaped_processes: Gauge::default(),
            unshaped_qps: Gauge::default(),
            tenant_unshaped_processes: Family::default(),
            tenant_unshaped_qps: Family::default(),
            unshaped_scans: Family::default(),
            tenant_control_verbs: Family::default(),
            tenant_control_verbs_delayed: Family::default(),
            tenant_control_verb_wait: Family::default(),
            tenant_control_verb_budget: Family::default(),
            tenant_qp_turns: Family::default(),
            tenant_qp_turn_waits: Family::default(),
            tenant_qp_turn_yields: Family::default(),
            unshaped_scan_seconds: Gauge::default(),
        }
    }

    /// A registry holding them.
    ///
    /// Current99 and Target99 can be undefined: Current99 before the first probe sample
    /// and from the update at which the last latency flow leaves (its window restarts and
    /// no probe runs without a latency flow) until a probe completes again, Target99 while
    /// an idle multiple waits for its measurement. Their samples are then NaN, as
    /// Prometheus' own client libraries expose a summary quantile without observations and
    /// as PromQL's `histogram_quantile` answers over no observations: the series stays
    /// present (a missing series reads as a scrape or target problem), a comparison with
    /// NaN is false so no alert fires on it, and dashboards show it as no value.
    /// `justitia status` shows the same absence as `-` (`null` with `--json`).
    pub fn registry(&self) -> Registry {
        self.registry_with(true)
    }

    /// A registry holding them, the per-tenant series (labelled by uid, or by tenant for
    /// the unshaped processes) only if `per_tenant`.
    pub fn registry_with(&self, per_tenant: bool) -> Registry {
        let mut r = Registry::with_prefix("justitia");
        r.register(
            "safe_util_bytes_per_second",
            "SafeUtil",
            self.safe_util.clone(),
        );
        r.register(
            "safe_util_decreases",
            "the control loop's updates that cut SafeUtil",
            self.safe_util_decreases.clone(),
        );
        r.register(
            "max_rate_bytes_per_second",
            "MaxRate of the profile",
            self.max_rate.clone(),
        );
        r.register(
            "current_p99_seconds",
            "Current99: p99 of the reference flow's post-to-completion time (NaN: no estimate)",
            self.current_p99.clone(),
        );
        r.register(
            "target_p99_seconds",
            "Target99 in effect (NaN: an idle multiple not yet measured)",
            self.target_p99.clone(),
        );
        r.register(
            "policy",
            "The shaping policy in effect (1 for its label)",
            self.policy.clone(),
        );
        r.register(
            "adaptive_pace_bytes_per_second",
            "adaptive: the rate the bandwidth flows are paced at together (NaN: not paced, or another policy)",
            self.adaptive_pace.clone(),
        );
        r.register(
            "adaptive_chunk_bytes",
            "adaptive: the chunk size bandwidth requests are cut to (0 under another policy)",
            self.adaptive_chunk.clone(),
        );
        r.register(
            "adaptive_pace_fraction",
            "adaptive: the pacing fraction, 1 until a violation at the smallest chunk (NaN under another policy)",
            self.adaptive_fraction.clone(),
        );
        r.register(
            "adaptive_decreases",
            "adaptive: violations that shrank the chunk or the rate",
            self.adaptive_decreases.clone(),
        );
        r.register(
            "adaptive_other_load_bytes_per_second",
            "adaptive: the latency and throughput flows' reported load at the last update",
            self.adaptive_other_load.clone(),
        );
        r.register(
            "adaptive_tail_seconds",
            "adaptive: the latency flows' tail the law read at the last update (NaN: none, or another policy)",
            self.adaptive_tail.clone(),
        );
        r.register(
            "adaptive_applications_tail_updates",
            "adaptive: updates at which the law read the latency applications' own round trips (the others read the probe's)",
            self.adaptive_applications_tail_updates.clone(),
        );
        r.register(
            "round_trips_reported",
            "Round trips the latency flows' shapers reported (under adaptive)",
            self.round_trips_reported.clone(),
        );
        r.register(
            "flows_counted",
            "Active flows counted by class (L, B, T)",
            self.flows_counted.clone(),
        );
        r.register(
            "flows_registered",
            "Flows registered",
            self.flows_registered.clone(),
        );
        if per_tenant {
            r.register(
                "tenant_allotment_bytes_per_second",
                "Sum of a tenant's allotments",
                self.tenant_allotment.clone(),
            );
            r.register(
                "tenant_usage_bytes",
                "Bytes a tenant's shapers reported posting",
                self.tenant_usage.clone(),
            );
            r.register(
                "tenant_remote_ends_refused",
                "Remote ends a tenant's shapers reported that were refused (remote_not_a_member, too_many_remote_ends): its flows count as local flows",
                self.tenant_remote_ends_refused.clone(),
            );
            r.register(
                "tenant_unshaped_processes",
                "A tenant's processes holding RDMA queue pairs with no shaper registered",
                self.tenant_unshaped_processes.clone(),
            );
            r.register(
                "tenant_unshaped_qps",
                "The queue pairs of a tenant's unshaped processes",
                self.tenant_unshaped_qps.clone(),
            );
            r.register(
                "tenant_control_verbs",
                "Control verbs (memory registrations and QP creations) a tenant's shapers reported",
                self.tenant_control_verbs.clone(),
            );
            r.register(
                "tenant_control_verbs_delayed",
                "Of a tenant's control verbs, those that waited for its budget",
                self.tenant_control_verbs_delayed.clone(),
            );
            r.register(
                "tenant_control_verb_wait_seconds",
                "The time a tenant's control verbs waited for its budget",
                self.tenant_control_verb_wait.clone(),
            );
            r.register(
                "tenant_control_verb_budget",
                "A tenant's control-verb budget in verbs per second, shared by its processes (0: unpaced)",
                self.tenant_control_verb_budget.clone(),
            );
            r.register(
                "tenant_qp_turns",
                "How many shaped queue pairs each of a tenant's processes may post on at once (0: no turns)",
                self.tenant_qp_turns.clone(),
            );
            r.register(
                "tenant_qp_turn_waits",
                "Times one of a tenant's queue pairs waited in line for a turn",
                self.tenant_qp_turn_waits.clone(),
            );
            r.register(
                "tenant_qp_turn_yields",
                "Times one of a tenant's queue pairs gave a spent turn up to a waiting one",
                self.tenant_qp_turn_yields.clone(),
            );
        }
        r.register(
            "unshaped_processes",
            "Processes holding RDMA queue pairs (RC, UC, UD) on the daemon's devices with no shaper registered, as of the last completed scan",
            self.unshaped_processes.clone(),
        );
        r.register(
            "unshaped_qps",
            "The queue pairs of the unshaped processes",
            self.unshaped_qps.clone(),
        );
        r.register(
            "unshaped_scans",
            "Scans for unshaped processes, by result (completed, failed)",
            self.unshaped_scans.clone(),
        );
        r.register(
            "unshaped_scan_seconds",
            "The last completed scan for unshaped processes: its duration (the next waits at least 50 times as long)",
            self.unshaped_scan_seconds.clone(),
        );
        r.register(
            "probe_latency_seconds",
            "Reference flow post-to-completion time",
            self.probe_latency.clone(),
        );
        r.register(
            "probes_lost",
            "Probes lost (timed out or failed)",
            self.probes_lost.clone(),
        );
        r.register(
            "probe_across_wire",
            "1 once the reference flow crosses the wire to its peer daemon's queue pair (peer.probe_to), 0 while it runs in loopback",
            self.probe_across_wire.clone(),
        );
        r.register(
            "pairings_held",
            "Queue pairs whose pairing (queue pair, remote queue pair, side channel) this host holds for the rendezvous of side channels",
            self.pairings_held.clone(),
        );
        r.register(
            "pairings_found",
            "Side channels found for this host's queue pairs (a member's pairing matched one exactly, or both ends are here) and told to their shapers",
            self.pairings_found.clone(),
        );
        r.register(
            "registrations",
            "Flow registrations by verdict",
            self.registrations.clone(),
        );
        r.register(
            "reclaims",
            "Flows reclaimed after their process hung up or exited",
            self.reclaims.clone(),
        );
        r.register(
            "messages_refused",
            "Registration-socket messages refused, by reason",
            self.refused.clone(),
        );
        r.register(
            "shapers_unserved",
            "Shaper connection attempts the daemon cannot serve, by reason (layout: the shaper cannot read its control block, after an upgrade of one side; its flows run on static settings)",
            self.shapers_unserved.clone(),
        );
        r.register("fail_open_events", "Times the reference flow could not be run (shapers keep their last allotment until the heartbeat goes stale)", self.fail_open.clone());
        r.register(
            "process_cpu_seconds",
            "CPU time (user + system) the daemon has used",
            self.cpu_seconds.clone(),
        );
        r.register(
            "log_lines_dropped",
            "Log lines dropped because the log's reader fell behind (the loop never waits on it)",
            self.log_lines_dropped.clone(),
        );
        r.register(
            "peer_messages_sent",
            "Peer-channel datagrams sent",
            self.peer_sent.clone(),
        );
        r.register(
            "peer_sent_bytes",
            "Bytes of peer-channel datagrams sent",
            self.peer_sent_bytes.clone(),
        );
        r.register(
            "peer_send_failures",
            "Peer-channel datagrams not sent (no address for the peer, or the kernel refused)",
            self.peer_send_failed.clone(),
        );
        r.register(
            "peer_messages_received",
            "Peer-channel datagrams accepted",
            self.peer_received.clone(),
        );
        r.register(
            "peer_messages_refused",
            "Peer-channel datagrams refused, by reason",
            self.peer_refused.clone(),
        );
        r.register(
            "peer_socket_up",
            "1 while the peer channel's UDP socket is bound; 0 while its port is taken (retried every second)",
            self.peer_socket_up.clone(),
        );
        r.register(
            "peer_members",
            "Hosts the peer channel's member list in effect names (this one too, if listed)",
            self.peer_members.clone(),
        );
        r.register(
            "peer_member_lists_refused",
            "Peer member lists refused (a members_file that did not read or parse); the running members are kept",
            self.peer_member_lists_refused.clone(),
        );
        r
    }

    /// Reports, from now on, the lines `counter` counts as dropped.
    pub fn watch_log_drops(&self, counter: tracing_appender::non_blocking::ErrorCounter) {
        let _ = self.log_drops.set(counter);
    }

    /// Brings the figures read at scrape time up to date.
    fn refresh(&self) {
        self.cpu_seconds.set(cpu_seconds());
        if let Some(c) = self.log_drops.get() {
            let dropped = c.dropped_lines() as u64;
            let seen = self.log_lines_dropped.get();
            self.log_lines_dropped.inc_by(dropped.saturating_sub(seen));
        }
    }
}

/// The daemon's CPU time so far (user + system, all threads), seconds.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// The request head read at most; a longer one is answered 431 and closed.
pub const MAX_HEAD: usize = 8192;
/// Scrape connections held at once (see [`serve`] for which one a new one displaces).
pub const MAX_CONNECTIONS: usize = 16;
/// Connections one source (a TCP peer's address, a Unix peer's uid) holds at once; a newer
/// one from it displaces its oldest still waiting for its request.
pub const MAX_PER_SOURCE: usize = 4;
/// Connections accepted per wake-up of the endpoint's thread at most.
pub const ACCEPTS_PER_TURN: usize = 256;
/// A scrape connection's whole life: request head read and answer written.
pub const CONNECTION_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);
/// The first retry of a failed bind; retries double to [`BIND_RETRY_MAX`].
pub const BIND_RETRY_MIN: std::time::Duration = std::time::Duration::from_secs(1);
/// The longest wait between bind retries.
pub const BIND_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// Where the metrics are served: a TCP address, or a Unix socket (`unix:/path`), which
/// alone carries the per-tenant series (see [`serve`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `address:port`.
    Tcp(std::net::SocketAddr),
    /// A Unix socket path (mode 0660).
    Unix(std::path::PathBuf),
}

impl Endpoint {
    /// Parses `address:port` or `unix:/absolute/path`.
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        if let Some(path) = text.strip_prefix("unix:") {
            if !path.starts_with('/') || path.len() > 100 {
                return Err(format!(
                    "`{path}` must be an absolute path of at most 100 bytes"
                ));
            }
            return Ok(Endpoint::Unix(path.into()));
        }
        text.parse()
            .map(Endpoint::Tcp)
            .map_err(|e| format!("`{text}`: {e} (write address:port or unix:/path)"))
    }
}

enum Listener {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

fn bind(endpoint: &Endpoint, group: Option<u32>) -> std::io::Result<Listener> {
    match endpoint {
        Endpoint::Tcp(addr) => {
            let l = std::net::TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            defer_accept(&l)?;
            Ok(Listener::Tcp(l))
        }
        Endpoint::Unix(path) => {
            if std::os::unix::net::UnixStream::connect(path).is_err() {
                let _ = std::fs::remove_file(path);
            }
            let l = std::os::unix::net::UnixListener::bind(path)?;
            l.set_nonblocking(true)?;
            rustix::fs::chmod(path, rustix::fs::Mode::from_raw_mode(0o660))?;
            if let Some(g) = group {
                rustix::fs::chown(path, None, Some(rustix::fs::Gid::from_raw(g)))?;
            }
            Ok(Listener::Unix(l))
        }
    }
}

/// How long the kernel holds a TCP connection that has sent nothing before handing it to
/// `accept` (`TCP_DEFER_ACCEPT`): a scraper's connection comes with its request, so it is
/// accepted and answered at once, while connections that send nothing wait in the kernel
/// meanwhile instead of in the endpoint's places.
pub const DEFER_ACCEPT_SECS: i32 = 1;

/// Sets [`DEFER_ACCEPT_SECS`] on a listening TCP socket.
fn defer_accept(l: &std::net::TcpListener) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let secs: libc::c_int = DEFER_ACCEPT_SECS;
    // SAFETY: an int option of its size on a live socket descriptor.
    let rc = unsafe {
        libc::setsockopt(
            l.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&secs as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

struct Scrape {
    sock: std::os::fd::OwnedFd,
    source: Source,
    head: Vec<u8>,
    out: Vec<u8>,
    sent: usize,
    deadline: std::time::Instant,
}

fn response(status: &str, content_type: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The answer to a request head.
fn answer(head: &[u8], metrics: &Metrics, registry: &Registry) -> Vec<u8> {
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, target) = (
        words.next().unwrap_or_default(),
        words.next().unwrap_or_default(),
    );
    if method != b"GET" {
        return response(
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics only\n",
        );
    }
    if target != b"/metrics" {
        return response("404 Not Found", "text/plain", "not found: try /metrics\n");
    }
    metrics.refresh();
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, registry) {
        Ok(()) => response(
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            &body,
        ),
        Err(e) => response(
            "500 Internal Server Error",
            "text/plain",
            &format!("encoding: {e}\n"),
        ),
    }
}

/// Serves `GET /metrics` at `endpoint` from a thread of its own, bounded so that no
/// local user can knock it over or crowd scrapes out: a connection is read as soon as it
/// is accepted and, its request there (as a scraper's is by then), answered at once
/// without taking a place; one that cannot be finished then is held, at most
/// [`MAX_CONNECTIONS`] in all and [`MAX_PER_SOURCE`] per source, a newer one displacing
/// the oldest of its source (or, all places taken, of the source holding most) still
/// waiting for its request, never one being answered. A request head is read to at most
/// [`MAX_HEAD`] bytes (a body is never read), each connection is done within
/// [`CONNECTION_DEADLINE`], at most [`ACCEPTS_PER_TURN`] are accepted per wake-up, all
/// without blocking; out of descriptors, the listener rests 100 ms while the connections
/// held are served. A bind that
/// fails (the port taken) is a warning, retried with backoff from [`BIND_RETRY_MIN`] to
/// [`BIND_RETRY_MAX`]: the daemon serves shapers meanwhile.
///
/// The per-tenant series (allotment and usage labelled by uid, unshaped processes by
/// tenant) are served only on a Unix socket, mode 0660 and group `group` (the admin
/// group): on TCP anyone on the host could read every tenant's usage, and a cgroup path
/// names a container.
pub fn serve(
    endpoint: Endpoint,
    metrics: Metrics,
    group: Option<u32>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let per_tenant = matches!(endpoint, Endpoint::Unix(_));
    let registry = metrics.registry_with(per_tenant);
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let mut retry = BIND_RETRY_MIN;
            let listener = loop {
                match bind(&endpoint, group) {
                    Ok(l) => break l,
                    Err(e) => {
                        tracing::warn!(error = %e, endpoint = ?endpoint, retry_s = retry.as_secs(),
                                       "metrics endpoint not bound; retrying");
                        std::thread::sleep(retry);
                        retry = (retry * 2).min(BIND_RETRY_MAX);
                    }
                }
            };
            tracing::info!(endpoint = ?endpoint, "metrics endpoint bound");
            run(&listener, &metrics, &registry);
        })
        .map_err(|e| format!("starting the metrics thread: {e}"))
}

/// Where a connection came from, for [`MAX_PER_SOURCE`]: a TCP peer's address, a Unix
/// peer's uid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Ip(std::net::IpAddr),
    Uid(u32),
    /// A Unix peer whose credentials could not be read: all such count as one source.
    Unknown,
}

fn accept(listener: &Listener) -> std::io::Result<(std::os::fd::OwnedFd, Source)> {
    use std::os::fd::AsFd;
    let (fd, source): (std::os::fd::OwnedFd, Source) = match listener {
        Listener::Tcp(l) => {
            let (s, from) = l.accept()?;
            (s.into(), Source::Ip(from.ip()))
        }
        Listener::Unix(l) => {
            let fd: std::os::fd::OwnedFd = l.accept()?.0.into();
            let source = crate::tenant::peer_cred(fd.as_fd())
                .map_or(Source::Unknown, |c| Source::Uid(c.uid));
            (fd, source)
        }
    };
    rustix::io::ioctl_fionbio(&fd, true)?;
    Ok((fd, source))
}

/// What becomes of a new connection that could not be answered at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// Kept beside the others.
    Add,
    /// Kept in the place of the connection at this index, which is closed.
    Replace(usize),
    /// Closed: every place holds a connection being answered.
    Refuse,
}

/// Where a new connection from `source` goes, given the connections held (their source,
/// their deadline, and whether they still wait for their request). A source holding
/// [`MAX_PER_SOURCE`] connections has its oldest waiting one replaced; with every place
/// taken, the oldest waiting connection of the source holding the most is. So a user
/// opening connections as fast as it can only ever displaces its own (or, when it holds
/// no more than others, the oldest idle one), and a connection being answered is never
/// displaced.
fn place(held: &[(Source, std::time::Instant, bool)], source: Source) -> Placement {
    let oldest_waiting = |from: Source| {
        held.iter()
            .enumerate()
            .filter(|(_, &(s, _, waiting))| s == from && waiting)
            .min_by_key(|(_, &(_, deadline, _))| deadline)
            .map(|(i, _)| i)
    };
    let of = |from: Source| held.iter().filter(|&&(s, _, _)| s == from).count();
    if of(source) >= MAX_PER_SOURCE {
        // Its places may all be answering: then it waits its turn like any other.
        if let Some(i) = oldest_waiting(source) {
            return Placement::Replace(i);
        }
    }
    if held.len() < MAX_CONNECTIONS {
        return Placement::Add;
    }
    let busiest = held
        .iter()
        .filter(|&&(_, _, waiting)| waiting)
        .map(|&(s, _, _)| s)
        .max_by_key(|&s| of(s));
    match busiest.and_then(oldest_waiting) {
        Some(i) => Placement::Replace(i),
        None => Placement::Refuse,
    }
}

fn run(listener: &Listener, metrics: &Metrics, registry: &Registry) {
    use rustix::event::{PollFd, PollFlags};
    use std::os::fd::AsFd;
    let lfd = match listener {
        Listener::Tcp(l) => l.as_fd(),
        Listener::Unix(l) => l.as_fd(),
    };
    let mut conns: Vec<Scrape> = Vec::new();
    // Out of descriptors: the listener is not watched until then (it stays readable).
    let mut paused_until: Option<std::time::Instant> = None;
    loop {
        let now = std::time::Instant::now();
        conns.retain(|c| c.deadline > now);
        if paused_until.is_some_and(|t| t <= now) {
            paused_until = None;
        }
        let wait = conns
            .iter()
            .map(|c| c.deadline)
            .chain(paused_until)
            .min()
            .map_or(std::time::Duration::from_secs(60), |t| {
                t.saturating_duration_since(now)
            });
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(conns.len() + 1);
        let listen = if paused_until.is_some() {
            PollFlags::empty()
        } else {
            PollFlags::IN
        };
        fds.push(PollFd::new(&lfd, listen));
        for c in &conns {
            let want = if c.out.is_empty() {
                PollFlags::IN
            } else {
                PollFlags::OUT
            };
            fds.push(PollFd::new(&c.sock, want));
        }
        let ts = rustix::time::Timespec {
            tv_sec: wait.as_secs() as i64,
            tv_nsec: i64::from(wait.subsec_nanos()) as _,
        };
        if rustix::event::poll(&mut fds, Some(&ts)).is_err() {
            continue;
        }
        let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        let mut done = vec![false; conns.len()];
        for (i, c) in conns.iter_mut().enumerate() {
            if !ready[i + 1] {
                continue;
            }
            done[i] = step(c, metrics, registry);
        }
        let mut i = 0;
        conns.retain(|_| {
            i += 1;
            !done[i - 1]
        });
        if ready[0] && paused_until.is_none() {
            paused_until = accept_all(listener, &mut conns, metrics, registry);
        }
    }
}

/// Accepts what the listener holds, at most [`ACCEPTS_PER_TURN`]: each connection is
/// served at once (a scraper's request is there by the time its connection is accepted,
/// so it is answered without taking a place), and one that cannot be finished now is
/// placed by [`place`]. Returns until when the listener is to rest, out of descriptors.
fn accept_all(
    listener: &Listener,
    conns: &mut Vec<Scrape>,
    metrics: &Metrics,
    registry: &Registry,
) -> Option<std::time::Instant> {
    for _ in 0..ACCEPTS_PER_TURN {
        let (sock, source) = match accept(listener) {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return None,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // The peer left before it was accepted, or its credentials could not be set.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
            Err(e) => {
                // Out of descriptors: the listener stays readable; rest it rather than
                // spin, and keep serving the connections held.
                tracing::warn!(error = %e, "metrics accept failed; the endpoint rests 100 ms");
                return Some(std::time::Instant::now() + std::time::Duration::from_millis(100));
            }
        };
        let mut c = Scrape {
            sock,
            source,
            head: Vec::new(),
            out: Vec::new(),
            sent: 0,
            deadline: std::time::Instant::now() + CONNECTION_DEADLINE,
        };
        if step(&mut c, metrics, registry) {
            continue;
        }
        // At most every connection held is looked at once before one is displaced.
        for _ in 0..=MAX_CONNECTIONS {
            let held: Vec<(Source, std::time::Instant, bool)> = conns
                .iter()
                .map(|c| (c.source, c.deadline, c.out.is_empty()))
                .collect();
            match place(&held, source) {
                Placement::Add => conns.push(c),
                // Its request may have come since it was last read: served now, it is not
                // displaced (and its place may be free).
                Placement::Replace(i) => match step(&mut conns[i], metrics, registry) {
                    true => {
                        conns.swap_remove(i);
                        continue;
                    }
                    false if !conns[i].out.is_empty() => continue,
                    false => conns[i] = c,
                },
                Placement::Refuse => {}
            }
            break;
        }
    }
    None
}

/// Reads or writes what a connection allows now; true when it is finished.
fn step(c: &mut Scrape, metrics: &Metrics, registry: &Registry) -> bool {
    if c.out.is_empty() {
        let mut buf = [0u8; 2048];
        loop {
            match rustix::net::recv(&c.sock, &mut buf, rustix::net::RecvFlags::DONTWAIT) {
                Ok((0, _)) => return true,
                Ok((n, _)) => {
                    c.head.extend_from_slice(&buf[..n]);
                    if let Some(end) = c.head.windows(4).position(|w| w == b"\r\n\r\n") {
                        c.out = answer(&c.head[..end], metrics, registry);
                        break;
                    }
                    if c.head.len() > MAX_HEAD {
                        c.out = response(
                            "431 Request Header Fields Too Large",
                            "text/plain",
                            "request head too long\n",
                        );
                        break;
                    }
                }
                Err(rustix::io::Errno::AGAIN) => return false,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return true,
            }
        }
        c.head = Vec::new();
    }
    while c.sent < c.out.len() {
        match rustix::net::send(
            &c.sock,
            &c.out[c.sent..],
            rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
        ) {
            Ok(n) => c.sent += n,
            Err(rustix::io::Errno::AGAIN) => return false,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return true,
        }
    }
    // Whatever the peer sent after the head (a body) is left unread.
    let _ = rustix::net::shutdown(&c.sock, rustix::net::Shutdown::Write);
    true
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A source at its cap displaces its own oldest waiting connection, never another's
    /// nor one being answered; with every place taken, the source holding most gives up
    /// its oldest waiting one; with every place being answered, the new one is closed.
    #[test]
    fn a_new_connection_displaces_the_oldest_waiting_one_of_its_own_or_the_busiest_source() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let a = Source::Ip("127.0.0.1".parse().unwrap());
        let b = Source::Ip("10.0.0.9".parse().unwrap());
        let c = Source::Uid(1000);
        // b's oldest (index 0) is being answered: its oldest waiting one is index 2.
        let mut held = vec![(b, at(1), false), (a, at(2), true), (b, at(3), true)];
        held.extend([(b, at(4), true), (b, at(5), true)]);
        assert_eq!(place(&held, b), Placement::Replace(2));
        assert_eq!(place(&held, a), Placement::Add);
        // Every place taken: c (holding none) displaces the oldest waiting one of b.
        let mut full = held.clone();
        while full.len() < MAX_CONNECTIONS {
            full.push((
                Source::Uid(full.len() as u32),
                at(10 + full.len() as u64),
                true,
            ));
        }
        assert_eq!(place(&full, c), Placement::Replace(2));
        // Every place being answered: nothing is displaced.
        let answering: Vec<_> = full.iter().map(|&(s, d, _)| (s, d, false)).collect();
        assert_eq!(place(&answering, c), Placement::Refuse);
        assert_eq!(place(&answering, b), Placement::Refuse);
    }
}
