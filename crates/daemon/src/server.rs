//! The daemon's event loop: sockets, the control loop, the probe, the control block.
//!
//! One thread serves everything, sleeping in epoll between wake-ups. It makes no policy
//! decision of its own: registrations, activity and probe samples go into the
//! [`ControlLoop`], and whatever allotments it hands out are published into the tenants'
//! pages. This module holds the daemon's state ([`Daemon`]) and its construction; each
//! concern is a module of its own, every one an `impl Daemon` over that state:
//!
//! | module | its one job |
//! | --- | --- |
//! | `pass.rs` | one wake-up: the sleep, the sockets found ready within the pass budget, the probe, the loop's update and events, the heartbeat |
//! | `registration.rs` | shapers: accepting them (identity, caps, pages), their messages, the reclaim of their flows |
//! | `publication.rs` | the allotments into the tenants' pages, the status into the control block and the metrics |
//! | `peering.rs` | the loop's remote-READ and incast inputs and outputs carried to and from [`PeerLink`] |
//! | `admin.rs` | the admin socket: status, flows, unshaped processes, a new target |
//! | `reload.rs` | SIGHUP: the configuration applied to the running daemon |
//!
//! Two kinds of sealed memfd go to a connection with its greeting: the shared control
//! block (heartbeat, boot id, SafeUtil, Current99, Target99: what every tenant may see),
//! and the private page of the connection's tenant, which holds the slots of that tenant's
//! flows (allotments and counted usage).
//!
//! Every local user can reach the registration socket and every peer host the peer
//! channel's, so nothing they send may hold the loop: each module states the caps and
//! deadlines it keeps (see [`crate::limits`] for the caps themselves); the peer channel's
//! UDP socket is read in the same pass, at most [`crate::peer::DATAGRAMS_PER_PASS`]
//! datagrams and never past the pass's deadline, and written without blocking.
//!
//! Unshaped processes (holding RDMA queue pairs with no shaper connected) are looked for by a
//! thread of their own ([`crate::unshaped`]): the loop only hands it the pids of its
//! connections when they change, and copies a reference to its last answer when `justitia
//! flows` asks, each through a lock it never waits for.
//!
//! `READY=1` goes to systemd once the sockets are bound, and when the unit sets
//! `WatchdogSec=` the loop sends `WATCHDOG=1` at half that interval: a loop that stops
//! turning is restarted.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use justitia_agent::block::{monotonic_ns, random_boot_id, BlockWriter};
use justitia_agent::proto::AdmissionReply;
use justitia_core::control_loop::{
    ControlLoop, LoopConfig, DEFAULT_READ_GUARANTEE_LIFETIME, QUIET_PERIODS,
};
use justitia_core::flow::FlowClass;
use justitia_core::profile::RnicProfile;
use prometheus_client::metrics::gauge::Gauge;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use tracing::{info, warn};

use crate::adaptive::AdaptiveDriver;
use crate::config::{group_id, Config, PolicyKind, ProbeKind};
use crate::kubepods::{PodDirectory, PodName};
use crate::limits::{CapOwner, LogKind, LogLimiter};
use crate::metrics::{Label, Metrics};
use crate::peer::PeerLink;
use crate::probe::Probe;
use crate::rdma_netlink::DeviceFilter;
use crate::unshaped::{ScanSettings, Scanner};

mod admin;
mod pass;
mod peering;
mod publication;
mod registration;
mod reload;
mod tenant_budgets;

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A socket could not be set up.
    #[error("{what} {path}: {source}")]
    Socket {
        /// What.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Something else.
    #[error("{0}")]
    Other(String),
}

struct Client {
    sock: OwnedFd,
    uid: u32,
    /// 0 when the peer is in a pid namespace the daemon cannot see.
    pid: i32,
    /// The tenant its flows belong to, and its name in reports.
    tenant: u64,
    tenant_name: String,
    /// Whose caps it counts against.
    owner: CapOwner,
    /// The Kubernetes pod it runs in, when known by name (for weights).
    pod: Option<PodName>,
    /// Held open while the client is: epoll watches it for the process's exit.
    _pidfd: Option<OwnedFd>,
    flows: BTreeSet<u64>,
}

struct Flow {
    uid: u32,
    pid: i32,
    tenant: u64,
    tenant_name: String,
    owner: CapOwner,
    pod: Option<PodName>,
    class: FlowClass,
    qps: u32,
    slot: u32,
    active: bool,
    bytes: u64,
    /// Work requests its shaper reported posting (a running count).
    ops: u64,
    admission: AdmissionReply,
    /// The peer host its QP goes to and how it loads it (READ requester, or bandwidth
    /// into it), once its shaper said so and the host is one the peer channel reaches.
    remote: Option<(justitia_peer::NodeId, justitia_peer::wire::Role)>,
}

/// A tenant's private page and the slots free in it.
struct TenantPage {
    page: BlockWriter,
    /// Slot indices not in use, the lowest last (taken first).
    free: Vec<u32>,
    /// Connections of the tenant: the page is dropped when the last one goes.
    clients: usize,
    /// The tenant's name in reports.
    name: String,
    /// The largest weight among its connections (its share of the host's budgets).
    weight: u32,
    /// The budgets of each of its processes, as published in the page.
    budgets: tenant_budgets::ProcessBudgets,
}

impl TenantPage {
    /// Writes `budgets` in the page, each only if it changed.
    fn publish(&mut self, budgets: tenant_budgets::ProcessBudgets) {
        if budgets.control != self.budgets.control {
            self.page.set_control_budget(budgets.control);
        }
        if budgets.turns != self.budgets.turns {
            self.page.set_turn_budget(budgets.turns);
        }
        self.budgets = budgets;
    }
}

/// An admin connection being served: its request read, then its answer written, without
/// blocking, before its deadline.
struct AdminConn {
    sock: OwnedFd,
    /// Refused by identity: the answer is the refusal, no request is read.
    allowed: bool,
    input: Vec<u8>,
    /// The answer, once made (shared with the scanning thread for `unshaped`, whose answer
    /// can be megabytes: never copied).
    output: Arc<[u8]>,
    sent: usize,
    deadline: u64,
}

/// Flags the signal handlers raise.
#[derive(Debug, Default)]
pub struct Signals {
    /// SIGTERM or SIGINT.
    pub stop: AtomicBool,
    /// SIGHUP.
    pub reload: AtomicBool,
}

/// The running daemon.
pub struct Daemon {
    config: Config,
    config_path: Option<PathBuf>,
    /// The command line's values over the file's, applied again on SIGHUP.
    overrides: crate::config::Overrides,
    profile: RnicProfile,
    lp: ControlLoop,
    probe: Box<dyn Probe>,
    /// Probe ids of the current loop are offset by this in work request ids, so that a
    /// completion of a probe sent by a loop since replaced is never taken for a new one.
    probe_base: u64,
    probes_in_flight: HashMap<u64, u64>,
    probes_ok: u64,
    probes_lost: u64,
    /// The answers to members' probe offers made in a pass, kept to reuse its memory.
    probe_answers: Vec<(justitia_peer::NodeId, justitia_peer::wire::ProbeEndpoint)>,
    /// This host's queue pairs that take part in splitting two-sided requests, for the
    /// rendezvous of side channels with members (`peering.rs`).
    pairings: crate::pairing::PairingTable,
    /// Members this host's pairings went to at the last change: one whose last pairing
    /// went is sent an empty set once.
    pairing_sent_to: BTreeSet<justitia_peer::NodeId>,
    block: BlockWriter,
    boot_id: u64,
    listener: OwnedFd,
    admin: OwnedFd,
    clients: BTreeMap<u64, Client>,
    next_client: u64,
    flows: BTreeMap<u64, Flow>,
    next_flow: u64,
    /// Tenant ids of the cgroups (by path), pods (`pod:<UID>`) and namespaces
    /// (`namespace:<name>`) seen, in order of first connection: ids are exact, never
    /// hashes that could collide.
    named_tenants: HashMap<String, u64>,
    /// kubelet's pod log directory, which names pods by UID.
    pods: PodDirectory,
    /// Each tenant's private page, by tenant id.
    pages: HashMap<u64, TenantPage>,
    metrics: Metrics,
    /// The per-class gauges of L, B and T, looked up once so that publishing allocates
    /// nothing.
    class_gauges: [Gauge; 3],
    /// The loop's descriptors: sockets, pidfds, the probe's channel, the timer.
    epoll: OwnedFd,
    /// CLOCK_MONOTONIC timer for the loop's deadlines, absolute, in nanoseconds.
    timer: OwnedFd,
    /// The deadline the timer is armed for (0: none).
    armed: u64,
    events: Vec<rustix::event::epoll::Event>,
    /// Socket tags found ready by the last wait, served on the next turn.
    ready: Vec<u64>,
    completions: Vec<crate::probe::Completion>,
    last_beat: u64,
    /// What the last status publication reflected: (updates, flows, generation).
    published: Option<(u64, usize, u64)>,
    /// The reference flow's first completion was logged.
    probe_running: bool,
    /// Flows by cap owner, for `max_flows_per_tenant`.
    owner_flows: HashMap<CapOwner, usize>,
    /// Connections by cap owner, for `max_connections_per_tenant`.
    owner_clients: HashMap<CapOwner, usize>,
    /// Connections served at most (from the descriptor limit).
    max_clients: usize,
    /// The listener is paused (EMFILE or the connection cap) until then (ns; 0: not).
    listen_paused_until: u64,
    /// The next tenant id of a cgroup, pod or namespace.
    next_named_tenant: u64,
    admins: BTreeMap<u64, AdminConn>,
    next_admin: u64,
    logs: LogLimiter,
    /// When the current pass stops serving sockets (ns).
    pass_deadline: u64,
    /// After a pass that spent its whole budget, the loop does not serve sockets again
    /// before this time (ns; 0: no rest owed).
    rest_until: u64,
    /// The systemd watchdog's ping interval (ns; half of `WatchdogSec=`), if asked for.
    watchdog_ns: Option<u64>,
    last_watchdog: u64,
    /// The peer channel, when configured.
    peer: Option<PeerLink>,
    /// With `policy = "adaptive"`: the adaptive law's driver, whose allotments are
    /// published instead of the loop's.
    adaptive: Option<AdaptiveDriver>,
    /// The loop's updates and generation, the flows, the active flows and the remote ends
    /// told the adaptive driver last planned for.
    adaptive_seen: (u64, u64, usize, usize, u64),
    /// Remote ends the shapers told so far: a READ requester's moves its bytes to its
    /// responder's send path.
    remote_ends: u64,
    /// The incast shares the peers this host's flows go into grant (§6.7).
    incast: justitia_core::incast::IncastLimits,
    /// The scan for unshaped processes, unless `unshaped_scan_ms = 0`.
    unshaped: Option<Scanner>,
    /// The connections changed since their pids were last handed to the scan.
    known_changed: bool,
    /// The connections or the configuration changed since the tenants' control-verb
    /// budgets were last published.
    tenant_budgets_stale: bool,
    /// Each tenant's control verbs as its shapers reported them, by tenant name; kept
    /// after its last connection goes (counters must not vanish), up to a cap.
    tenant_tallies: BTreeMap<String, tenant_budgets::TenantTally>,
}

/// Epoll tags of the fixed descriptors; a client's socket is `id << 1`, its pidfd
/// `id << 1 | 1`, so client ids stay far below these.
const TAG_LISTEN: u64 = u64::MAX - 1;
const TAG_ADMIN: u64 = u64::MAX - 3;
const TAG_TIMER: u64 = u64::MAX - 5;
const TAG_PROBE: u64 = u64::MAX - 7;
const TAG_PEER: u64 = u64::MAX - 9;
/// Epoll tags of admin connections: this bit and the connection's id.
const TAG_ADMIN_CONN: u64 = 1 << 62;
/// Events taken per wait; more stay pending for the next.
const EVENTS: usize = 64;
/// A pass of the loop serves sockets for at most `stale_after_ms` divided by this.
pub const PASS_BUDGET_DIVISOR: u64 = 5;
/// Messages read from one connection per pass.
pub const MESSAGES_PER_TURN: usize = 16;
/// How long the listener stays paused at the descriptor limit or the connection cap.
pub const LISTEN_PAUSE: Duration = Duration::from_millis(100);
/// An admin connection's whole life: request read and answer written.
pub const ADMIN_DEADLINE: Duration = Duration::from_secs(1);
/// Admin connections served at once; more are closed at accept.
pub const MAX_ADMIN_CONNECTIONS: usize = 8;
// Tenant ids of cgroups, pods and namespaces start here, above every uid (a peer of unseen
// pid is its uid's tenant whatever `tenant` says).
const NAMED_TENANT_BASE: u64 = 1 << 40;

fn now_ns() -> u64 {
    monotonic_ns()
}

fn io_err(e: rustix::io::Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.raw_os_error())
}

/// Binds a Unix socket at `path`, replacing a stale one but refusing to replace a live one.
fn bind_socket(
    path: &Path,
    kind: SocketType,
    mode: u32,
    what: &'static str,
) -> Result<OwnedFd, StartError> {
    let err = |source: std::io::Error| StartError::Socket {
        what,
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() || seqpacket_alive(path) {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another daemon is listening there",
            )));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        kind,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| err(io_err(e)))?;
    let addr = SocketAddrUnix::new(path).map_err(|e| err(io_err(e)))?;
    rustix::net::bind(&sock, &addr).map_err(|e| err(io_err(e)))?;
    rustix::fs::chmod(path, rustix::fs::Mode::from_raw_mode(mode)).map_err(|e| err(io_err(e)))?;
    rustix::net::listen(&sock, 128).map_err(|e| err(io_err(e)))?;
    Ok(sock)
}

/// Gives the admin socket to `admin_group` (or back to the daemon's own group without
/// one), so that the group's members may connect (mode 0660).
fn own_admin_socket(config: &Config) {
    let gid = config
        .admin_group
        .as_deref()
        .and_then(group_id)
        .unwrap_or_else(|| rustix::process::getegid().as_raw());
    if let Err(e) = rustix::fs::chown(
        &config.admin_socket,
        None,
        Some(rustix::fs::Gid::from_raw(gid)),
    ) {
        warn!(error = %e, gid, path = %config.admin_socket.display(), "admin socket not given to its group");
    }
}

fn seqpacket_alive(path: &Path) -> bool {
    let Ok(s) = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    ) else {
        return false;
    };
    SocketAddrUnix::new(path).is_ok_and(|a| rustix::net::connect(&s, &a).is_ok())
}

fn loop_config(c: &Config) -> LoopConfig {
    LoopConfig {
        target: c.target,
        ref_period: c.ref_period,
        probe_timeout: c.probe_timeout,
        // The event loop reads the loop's deadline again after every input, which the
        // quiet cadence needs.
        quiet_periods: QUIET_PERIODS,
        // A READ guarantee lasts as long as its responder may be silent (checked at load
        // against the channel's refresh).
        read_guarantee_lifetime: c
            .peer
            .as_ref()
            .map_or(DEFAULT_READ_GUARANTEE_LIFETIME, |p| p.channel.silence),
        ..LoopConfig::default()
    }
}

/// Seconds for a gauge; NaN for an absent value (see [`Metrics::registry`]).
fn secs(d: Option<Duration>) -> f64 {
    d.map_or(f64::NAN, |d| d.as_secs_f64())
}

impl Daemon {
    /// The command line's values over the file's (`--metrics`, `--peer-node`), which
    /// SIGHUP applies again to the file it reads.
    pub fn with_overrides(mut self, overrides: crate::config::Overrides) -> Self {
        self.overrides = overrides;
        self
    }

    /// Sets the daemon up: profile, control loop, control block, sockets.
    pub fn new(
        config: Config,
        config_path: Option<PathBuf>,
        probe: Box<dyn Probe>,
        metrics: Metrics,
    ) -> Result<Self, StartError> {
        let info = probe.info();
        let profile_name = config
            .profile
            .clone()
            .or(info.profile_hint.clone())
            .unwrap_or_else(|| "roce-100".into());
        let profile = RnicProfile::builtin(&profile_name)
            .map_err(|e| StartError::Other(format!("profile {profile_name}: {e}")))?;
        let lp = ControlLoop::new(
            loop_config(&config),
            &profile,
            Duration::from_nanos(now_ns()),
        )
        .map_err(|e| StartError::Other(format!("control loop: {e}")))?;
        let adaptive = match config.policy {
            PolicyKind::Justitia => None,
            PolicyKind::Adaptive => Some(
                AdaptiveDriver::new(
                    &profile,
                    justitia_core::profile::RnicFacts::builtin(&profile_name).as_ref(),
                )
                .map_err(|e| StartError::Other(format!("policy adaptive: {e}")))?,
            ),
        };
        let boot_id = random_boot_id();
        let block = BlockWriter::create_shared(boot_id, config.stale_after.as_nanos() as u64)
            .map_err(|e| StartError::Other(format!("control block: {e}")))?;
        let listener = bind_socket(
            &config.socket,
            SocketType::SEQPACKET,
            0o666,
            "registration socket",
        )?;
        let admin = bind_socket(
            &config.admin_socket,
            SocketType::STREAM,
            0o660,
            "admin socket",
        )?;
        own_admin_socket(&config);
        metrics.max_rate.set(profile.max_rate_bytes_per_sec());
        metrics
            .policy
            .get_or_create(&crate::metrics::PolicyLabel {
                policy: config.policy.as_str().into(),
            })
            .set(1);
        if config.policy != PolicyKind::Adaptive {
            metrics.adaptive_pace.set(f64::NAN);
            metrics.adaptive_fraction.set(f64::NAN);
            metrics.adaptive_tail.set(f64::NAN);
        }
        let sys = |what: &'static str| {
            move |e: rustix::io::Errno| StartError::Other(format!("{what}: {e}"))
        };
        let epoll = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)
            .map_err(sys("creating the epoll instance"))?;
        let timer = rustix::time::timerfd_create(
            rustix::time::TimerfdClockId::Monotonic,
            rustix::time::TimerfdFlags::CLOEXEC | rustix::time::TimerfdFlags::NONBLOCK,
        )
        .map_err(sys("creating the loop timer"))?;
        let watch = |fd: BorrowedFd<'_>, tag: u64| {
            rustix::event::epoll::add(
                &epoll,
                fd,
                rustix::event::epoll::EventData::new_u64(tag),
                rustix::event::epoll::EventFlags::IN,
            )
        };
        watch(listener.as_fd(), TAG_LISTEN).map_err(sys("watching the registration socket"))?;
        watch(admin.as_fd(), TAG_ADMIN).map_err(sys("watching the admin socket"))?;
        watch(timer.as_fd(), TAG_TIMER).map_err(sys("watching the loop timer"))?;
        if let Some(fd) = probe.fd() {
            // SAFETY: the probe's descriptor is live while the probe is, and the probe
            // lives as long as the daemon and its epoll instance.
            watch(unsafe { BorrowedFd::borrow_raw(fd) }, TAG_PROBE)
                .map_err(sys("watching the probe's completion channel"))?;
        }
        // A receiver's incast share lapses with the channel's silence, as its grant does.
        let incast_lapse = config
            .peer
            .as_ref()
            .map_or(justitia_peer::channel::DEFAULT_SILENCE, |p| {
                p.channel.silence
            });
        let peer = match &config.peer {
            Some(settings) => {
                let mut link = PeerLink::bind(
                    settings.clone(),
                    Duration::from_nanos(now_ns()),
                    metrics.clone(),
                )
                .map_err(|e| StartError::Other(e.to_string()))?;
                // Not bound (the port taken): bound and watched later (`peering.rs`).
                if let Some(fd) = link.socket() {
                    watch(fd, TAG_PEER).map_err(sys("watching the peer socket"))?;
                }
                peering::open(&mut link, &profile);
                info!(node = %settings.node, listen = %settings.listen, public_key = %link.public_key(),
                      members = settings.members.len(), "peer channel open");
                Some(link)
            }
            None => None,
        };
        let class_gauges = ["latency", "bandwidth", "throughput"].map(|class| {
            metrics
                .flows_counted
                .get_or_create(&Label {
                    value: class.into(),
                })
                .clone()
        });
        let unshaped = match config.unshaped_scan {
            None => None,
            Some(interval) => {
                // The device the daemon shares: the probe's; with the synthetic probe the
                // one named, or every device.
                let devices = match (config.probe, &config.device) {
                    (ProbeKind::Verbs, _) => DeviceFilter::Named(vec![info.device.clone()]),
                    (ProbeKind::Synthetic(_), Some(d)) => DeviceFilter::Named(vec![d.clone()]),
                    (ProbeKind::Synthetic(_), None) => DeviceFilter::All,
                };
                let settings = ScanSettings {
                    interval,
                    devices,
                    tenant: config.tenant,
                };
                Some(Scanner::start(settings, metrics.clone()).map_err(|e| {
                    StartError::Other(format!("starting the scan for unshaped processes: {e}"))
                })?)
            }
        };
        info!(device = %info.device, port = info.port, line_rate_gbps = info.line_rate_bps / 1e9, profile = %profile.name,
              boot_id = format_args!("{boot_id:#x}"), socket = %config.socket.display(), "justitiad started");
        let pods = PodDirectory::new(config.pod_logs_dir.clone());
        Ok(Daemon {
            pages: HashMap::new(),
            config,
            config_path,
            overrides: crate::config::Overrides::default(),
            profile,
            lp,
            probe,
            probe_base: 0,
            probes_in_flight: HashMap::new(),
            probes_ok: 0,
            probes_lost: 0,
            probe_answers: Vec::new(),
            pairings: crate::pairing::PairingTable::new(),
            pairing_sent_to: BTreeSet::new(),
            block,
            boot_id,
            listener,
            admin,
            clients: BTreeMap::new(),
            next_client: 1,
            flows: BTreeMap::new(),
            next_flow: 1,
            named_tenants: HashMap::new(),
            pods,
            metrics,
            class_gauges,
            epoll,
            timer,
            armed: 0,
            events: vec![
                rustix::event::epoll::Event {
                    flags: rustix::event::epoll::EventFlags::empty(),
                    data: rustix::event::epoll::EventData::new_u64(0),
                };
                EVENTS
            ],
            ready: Vec::with_capacity(EVENTS),
            completions: Vec::new(),
            last_beat: now_ns(),
            published: None,
            probe_running: false,
            owner_flows: HashMap::new(),
            owner_clients: HashMap::new(),
            max_clients: crate::limits::max_clients(crate::limits::nofile_limit()),
            listen_paused_until: 0,
            next_named_tenant: NAMED_TENANT_BASE,
            admins: BTreeMap::new(),
            next_admin: 1,
            logs: LogLimiter::default(),
            pass_deadline: 0,
            rest_until: 0,
            watchdog_ns: None,
            last_watchdog: 0,
            incast: justitia_core::incast::IncastLimits::new(incast_lapse),
            peer,
            adaptive,
            adaptive_seen: (0, 0, 0, 0, 0),
            remote_ends: 0,
            unshaped,
            known_changed: false,
            tenant_budgets_stale: false,
            tenant_tallies: BTreeMap::new(),
        })
    }

    /// Whether a line of `kind` may be logged now; says once how many were dropped.
    fn log_ok(&mut self, kind: LogKind, now: u64) -> bool {
        let (ok, dropped) = self.logs.allow(kind, now);
        if dropped > 0 {
            warn!(kind = ?kind, dropped, "log lines dropped by the rate limit in the last second");
        }
        ok
    }

    fn watch(&self, fd: &OwnedFd, tag: u64) -> rustix::io::Result<()> {
        rustix::event::epoll::add(
            &self.epoll,
            fd,
            rustix::event::epoll::EventData::new_u64(tag),
            rustix::event::epoll::EventFlags::IN,
        )
    }
}
