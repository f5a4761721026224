//! The daemon's event loop: sockets, the control loop, the probe, the control block.
//!
//! One thread sleeping in epoll on every descriptor it serves (registered once, not per
//! wake-up) and on an absolute CLOCK_MONOTONIC timerfd armed for the earlier of
//! [`ControlLoop::poll_timeout`] (the next update or a probe's timeout) and the heartbeat.
//! The timer has nanosecond resolution and no timer slack (a sleep with a timeout under
//! the normal policy may end 50 us late), so an update runs when it is due, and the daemon
//! sleeps between updates instead of spinning a core. While a latency flow is counted it
//! wakes once per RefPeriod, as the paper's reference flow requires; without one the loop
//! runs at its quiet cadence ([`QUIET_PERIODS`] RefPeriods, see the core's "Quiet
//! cadence") and the daemon wakes for that or for the heartbeat (every third of
//! `stale_after_ms`), whichever comes first. Registrations, usage reports and hang-ups
//! wake it through their sockets, and the loop's deadline is read again before every
//! sleep, so an input is acted on at the next RefPeriod tick whatever the cadence: a flow
//! that starts, or a removed or reclaimed flow's share, within one RefPeriod; a flow that
//! reports no work gives its share away within its idle grace and one RefPeriod (1.5 ms
//! by default). An update's wake-up posts the probe and polls briefly for its completion
//! ([`crate::probe::Probe::await_completion`]); a completion not
//! seen then is collected on the next wake-up (or one the completion channel causes), and
//! every completion carries the time it happened, so a probe's latency runs from a
//! timestamp taken just before its post to its completion, whenever the loop collects it.
//! A wake-up allocates nothing (under `policy = "adaptive"`, except one that plans: see
//! [`crate::adaptive`]), and the status is published only when an update ran or the flows
//! changed. It makes no policy decision of its own: registrations, activity and
//! probe samples go into the [`ControlLoop`], and whatever allotments it hands out are
//! published into the tenants' pages.
//!
//! Two kinds of sealed memfd go to a connection with its greeting: the shared control
//! block (heartbeat, boot id, SafeUtil, Current99, Target99: what every tenant may see),
//! and the private page of the connection's tenant, created at the tenant's first
//! connection and dropped after its last, which holds the slots of that tenant's flows
//! (allotments and counted usage). No connection is ever given another tenant's page.
//!
//! Identity is the kernel's: a connection's uid and pid come from `SO_PEERCRED` when it is
//! accepted, and a pidfd of its process (see [`crate::tenant`]) tells when the process is
//! gone even if a child inherited its socket. A connection that hangs up, or whose
//! process exits, has its flows reclaimed on that wake-up, so their share goes to the
//! others at the next update (within one RefPeriod).
//!
//! Every local user can reach the registration socket, so nothing a peer sends may hold
//! the loop (see [`crate::limits`] for the caps):
//! - a pass serves sockets for at most [`PASS_BUDGET_DIVISOR`]th of `stale_after_ms`
//!   (and a connection at most [`MESSAGES_PER_TURN`] messages per pass); what is left
//!   stays readable and is served on the next pass, after the update and the heartbeat,
//!   so the heartbeat is written on time whatever arrives; a pass that spent its budget
//!   is followed by a rest as long, so serving never takes more than half the loop's
//!   time (at SCHED_FIFO, a loop busy all the time is stopped by real-time throttling);
//! - `accept` at the descriptor limit (EMFILE, ENFILE) or at the connection cap pauses
//!   the listener for [`LISTEN_PAUSE`] instead of spinning on a readable listener;
//! - the admin socket is served without blocking, each connection within
//!   [`ADMIN_DEADLINE`] overall and at most [`MAX_ADMIN_CONNECTIONS`] at once;
//! - a log line a peer can cause is rate-limited;
//! - the peer channel's UDP socket (when `[peer]` is configured) is read in the same
//!   pass, at most [`crate::peer::DATAGRAMS_PER_PASS`] datagrams and never past the pass's
//!   deadline, and written without blocking (`server/peering.rs`: the loop's remote-READ inputs
//!   and outputs carried to and from [`PeerLink`]).
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
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use justitia_agent::admin::{
    AdminReply, AdminRequest, FlowReport, StatusReport, MAX_ADMIN_REQUEST,
};
use justitia_agent::block::{
    monotonic_ns, phase_to_fixed, random_boot_id, BlockStatus, BlockWriter, SlotAllotment,
    SlotState,
};
use justitia_agent::proto::{
    AdmissionReply, ParseError, RefuseReason, Register, Reply, Request, MAX_MESSAGE, NO_UID,
};
use justitia_core::control_loop::{
    ControlLoop, Event, FlowRegistration, LoopConfig, ProbeId, Target99, QUIET_PERIODS,
};
use justitia_core::controller::{Admission, ControlMode};
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId};
use justitia_core::incast::paced_plan;
use justitia_core::profile::RnicProfile;
use prometheus_client::metrics::gauge::Gauge;
use rustix::net::{
    AddressFamily, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix,
    SocketFlags, SocketType,
};
use tracing::{debug, error, info, warn};

use crate::adaptive::{AdaptiveDriver, DriverFlow};
use crate::config::{
    group_id, parse_target, AdmissionPolicy, Config, PolicyKind, ProbeKind, TenantBy,
};
use crate::limits::{LogKind, LogLimiter, SlotCounts};
use crate::metrics::{Label, Metrics, Tenant};
use crate::peer::PeerLink;
use crate::probe::Probe;
use crate::rdma_netlink::DeviceFilter;
use crate::unshaped::{ScanSettings, Scanner};
use justitia_core::adaptive::allotments::{ChargedFlow, HostFlow};
use justitia_core::adaptive::Resource;

mod peering;

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
    /// Held open while the client is: epoll watches it for the process's exit.
    _pidfd: Option<OwnedFd>,
    flows: BTreeSet<u64>,
}

struct Flow {
    uid: u32,
    pid: i32,
    tenant: u64,
    tenant_name: String,
    class: FlowClass,
    qps: u32,
    slot: u32,
    active: bool,
    bytes: u64,
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
    profile: RnicProfile,
    lp: ControlLoop,
    probe: Box<dyn Probe>,
    /// Probe ids of the current loop are offset by this in work request ids, so that a
    /// completion of a probe sent by a loop since replaced is never taken for a new one.
    probe_base: u64,
    probes_in_flight: HashMap<u64, u64>,
    probes_ok: u64,
    probes_lost: u64,
    block: BlockWriter,
    boot_id: u64,
    listener: OwnedFd,
    admin: OwnedFd,
    clients: BTreeMap<u64, Client>,
    next_client: u64,
    flows: BTreeMap<u64, Flow>,
    next_flow: u64,
    /// Tenant ids of the cgroups seen (with `tenant = "cgroup"`), in order of first
    /// connection: ids are exact, never hashes that could collide.
    cgroups: HashMap<String, u64>,
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
    /// Flows by uid, for the per-uid cap.
    uid_flows: HashMap<u32, usize>,
    /// Connections by uid, for the per-uid cap.
    uid_clients: HashMap<u32, usize>,
    /// Connections served at most (from the descriptor limit).
    max_clients: usize,
    /// The listener is paused (EMFILE or the connection cap) until then (ns; 0: not).
    listen_paused_until: u64,
    /// The next tenant id of a cgroup.
    next_cgroup: u64,
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
/// Tenant ids of cgroups start here, above every uid (a peer of unseen pid is its uid's
/// tenant even with `tenant = "cgroup"`).
const CGROUP_TENANT_BASE: u64 = 1 << 40;

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
        ..LoopConfig::default()
    }
}

/// Seconds for a gauge; NaN for an absent value (see [`Metrics::registry`]).
fn secs(d: Option<Duration>) -> f64 {
    d.map_or(f64::NAN, |d| d.as_secs_f64())
}

impl Daemon {
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
                AdaptiveDriver::new(&profile)
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
                info!(node = %settings.node, listen = %settings.listen, "peer channel open");
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
        Ok(Daemon {
            pages: HashMap::new(),
            config,
            config_path,
            profile,
            lp,
            probe,
            probe_base: 0,
            probes_in_flight: HashMap::new(),
            probes_ok: 0,
            probes_lost: 0,
            block,
            boot_id,
            listener,
            admin,
            clients: BTreeMap::new(),
            next_client: 1,
            flows: BTreeMap::new(),
            next_flow: 1,
            cgroups: HashMap::new(),
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
            uid_flows: HashMap::new(),
            uid_clients: HashMap::new(),
            max_clients: crate::limits::max_clients(crate::limits::nofile_limit()),
            listen_paused_until: 0,
            next_cgroup: CGROUP_TENANT_BASE,
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
        })
    }

    /// Runs until `signals.stop` is raised.
    pub fn run(&mut self, signals: &Signals) {
        // The sockets are bound: shapers can connect from now on.
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        let mut usec = 0;
        if sd_notify::watchdog_enabled(false, &mut usec) {
            self.watchdog_ns = Some(usec.saturating_mul(1000) / 2);
        }
        let mut probe_ready = false;
        while !signals.stop.load(Ordering::Relaxed) {
            if signals.reload.swap(false, Ordering::Relaxed) {
                self.reload();
            }
            self.turn(probe_ready);
            probe_ready = self.wait();
        }
        let _ = std::fs::remove_file(&self.config.socket);
        let _ = std::fs::remove_file(&self.config.admin_socket);
        info!("justitiad stopped");
    }

    /// One pass of the loop after a wake-up: probe completions, the sockets found ready
    /// (within the pass budget), the control loop's update, the heartbeat, the status.
    pub fn turn(&mut self, probe_ready: bool) {
        // Completions first, so that the update on this wake-up counts them; each is
        // stamped with the time it completed, not the time it is collected.
        let now = now_ns();
        self.block.beat(now);
        if probe_ready || self.probe.outstanding() > 0 {
            self.completions.clear();
            self.probe.collect(now, probe_ready, &mut self.completions);
            self.take_completions();
        }
        self.serve_ready(now);
        self.expire(now_ns());
        self.hand_known_pids();
        let now_d = Duration::from_nanos(now_ns());
        if self.lp.poll_timeout().is_some_and(|t| t <= now_d) {
            self.lp.handle_timeout(now_d);
        }
        self.drain_events();
        self.drive_adaptive();
        self.flush_peer();
        let now = now_ns();
        self.block.beat(now);
        self.last_beat = now;
        if let Some(every) = self.watchdog_ns {
            if now.saturating_sub(self.last_watchdog) >= every {
                self.last_watchdog = now;
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
            }
        }
        self.publish_status();
    }

    /// Hands the pids of the connections to the scan for unshaped processes when they
    /// changed (allocating then only); tried again on the next pass if the scan held them.
    fn hand_known_pids(&mut self) {
        if !self.known_changed {
            return;
        }
        let Some(scanner) = &self.unshaped else {
            self.known_changed = false;
            return;
        };
        let pids: Arc<[i32]> = self
            .clients
            .values()
            .map(|c| c.pid)
            .filter(|&p| p > 0)
            .collect();
        if scanner.set_known(pids) {
            self.known_changed = false;
        }
    }

    /// Resumes a paused listener when its pause is over, and closes admin connections
    /// past their deadline.
    fn expire(&mut self, now: u64) {
        if self.listen_paused_until != 0 && now >= self.listen_paused_until {
            self.listen_paused_until = 0;
            self.listen_interest(rustix::event::epoll::EventFlags::IN);
        }
        let late: Vec<u64> = self
            .admins
            .iter()
            .filter(|(_, a)| a.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            self.admins.remove(&id);
            if self.log_ok(LogKind::Admin, now) {
                warn!(
                    deadline_ms = ADMIN_DEADLINE.as_millis() as u64,
                    "admin connection closed: not done by its deadline"
                );
            }
        }
    }

    fn listen_interest(&self, flags: rustix::event::epoll::EventFlags) {
        if let Err(e) = rustix::event::epoll::modify(
            &self.epoll,
            &self.listener,
            rustix::event::epoll::EventData::new_u64(TAG_LISTEN),
            flags,
        ) {
            error!(error = %e, "changing the registration socket's watch");
        }
    }

    fn pause_listener(&mut self, now: u64) {
        if self.listen_paused_until == 0 {
            self.listen_interest(rustix::event::epoll::EventFlags::empty());
        }
        self.listen_paused_until = now.saturating_add(LISTEN_PAUSE.as_nanos() as u64);
    }

    /// Whether a line of `kind` may be logged now; says once how many were dropped.
    fn log_ok(&mut self, kind: LogKind, now: u64) -> bool {
        let (ok, dropped) = self.logs.allow(kind, now);
        if dropped > 0 {
            warn!(kind = ?kind, dropped, "log lines dropped by the rate limit in the last second");
        }
        ok
    }

    /// The pass budget: sockets are served for at most this long per pass.
    fn pass_budget_ns(&self) -> u64 {
        (self.config.stale_after.as_nanos() as u64 / PASS_BUDGET_DIVISOR).max(100_000)
    }

    /// Hands the collected completions to the control loop.
    fn take_completions(&mut self) {
        for i in 0..self.completions.len() {
            let c = self.completions[i];
            self.probe_done(c.at_ns, c.id, c.ok);
        }
        self.completions.clear();
    }

    /// The next time the loop must run without any descriptor waking it: the control
    /// loop's deadline (the next update, which also collects the last probe, or a probe's
    /// timeout) or the heartbeat. A probe's completion is not one: it is collected on
    /// the wake-up that posted it or on the next, stamped with the time it happened.
    fn next_wake(&self) -> u64 {
        let mut wake = self
            .last_beat
            .saturating_add((self.config.stale_after.as_nanos() as u64 / 3).max(100_000));
        if let Some(t) = self.lp.poll_timeout() {
            wake = wake.min(t.as_nanos() as u64);
        }
        if self.listen_paused_until != 0 {
            wake = wake.min(self.listen_paused_until);
        }
        if let Some(a) = self.admins.values().map(|a| a.deadline).min() {
            wake = wake.min(a);
        }
        if let Some(every) = self.watchdog_ns {
            wake = wake.min(self.last_watchdog.saturating_add(every));
        }
        if let Some(t) = self.peer.as_ref().and_then(PeerLink::poll_timeout) {
            wake = wake.min(t.as_nanos() as u64);
        }
        wake
    }

    /// Arms the timer for the next wake-up and sleeps in epoll until it fires or a
    /// descriptor is ready. The timer is absolute on CLOCK_MONOTONIC with nanosecond
    /// resolution, and only re-armed when the deadline moves (a timer left expired keeps
    /// its descriptor readable, which is right: its deadline has passed). Returns whether
    /// the probe's descriptor was ready (for [`Self::turn`]); socket events are kept for
    /// the pass. [`Self::run`] alternates the two; a benchmark may drive them itself.
    pub fn wait(&mut self) -> bool {
        let wake = self.next_wake();
        if wake != self.armed {
            let spec = rustix::time::Itimerspec {
                it_interval: rustix::time::Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                },
                it_value: rustix::time::Timespec {
                    tv_sec: (wake / 1_000_000_000) as i64,
                    // A zero it_value would disarm the timer; 1 ns is already past.
                    tv_nsec: ((wake % 1_000_000_000) as i64).max(i64::from(wake == 0)) as _,
                },
            };
            match rustix::time::timerfd_settime(
                &self.timer,
                rustix::time::TimerfdTimerFlags::ABSTIME,
                &spec,
            ) {
                Ok(_) => self.armed = wake,
                Err(e) => {
                    error!(error = %e, "arming the loop timer");
                    self.armed = 0;
                }
            }
        }
        // A pass that spent its budget left sockets readable, so epoll would return at
        // once: rest first. Serving then takes at most half of the loop's time however
        // much arrives, so a daemon at SCHED_FIFO never holds its core long enough for
        // the kernel's real-time throttling (950 ms of every second) to stop it, which
        // under a flood left the heartbeat 40-50 ms old.
        let rest = std::mem::take(&mut self.rest_until).min(wake);
        let now = now_ns();
        if rest > now {
            std::thread::sleep(Duration::from_nanos(rest - now));
        }
        self.ready.clear();
        let n = match rustix::event::epoll::wait(&self.epoll, &mut self.events[..], None) {
            Ok(n) => n,
            Err(_) => return false, // EINTR: a signal; the loop looks at its flags.
        };
        let mut probe_ready = false;
        for ev in &self.events[..n] {
            match ev.data.u64() {
                TAG_TIMER => {}
                TAG_PROBE => probe_ready = true,
                tag => self.ready.push(tag),
            }
        }
        probe_ready
    }

    fn watch(&self, fd: &OwnedFd, tag: u64) -> rustix::io::Result<()> {
        rustix::event::epoll::add(
            &self.epoll,
            fd,
            rustix::event::epoll::EventData::new_u64(tag),
            rustix::event::epoll::EventFlags::IN,
        )
    }

    /// Serves the sockets the last wait found ready, until the pass budget is spent: the
    /// rest stay readable (epoll is level-triggered and puts a descriptor it reported at
    /// the back of its ready list) and are served on the next pass.
    fn serve_ready(&mut self, start: u64) {
        self.pass_deadline = start.saturating_add(self.pass_budget_ns());
        for i in 0..self.ready.len() {
            let now = now_ns();
            if now > self.pass_deadline {
                break;
            }
            match self.ready[i] {
                TAG_LISTEN => self.accept(now),
                TAG_ADMIN => self.accept_admin(now),
                TAG_PEER => self.serve_peer(),
                tag if tag & TAG_ADMIN_CONN != 0 => self.serve_admin(tag & !TAG_ADMIN_CONN),
                tag if tag & 1 == 1 => self.reclaim(now, tag >> 1, "process exited"),
                tag => self.read_client(now, tag >> 1),
            }
        }
        self.ready.clear();
        let end = now_ns();
        if end > self.pass_deadline {
            self.rest_until = end.saturating_add(self.pass_budget_ns());
        }
    }

    /// A probe completed (or failed) at `at` (ns).
    fn probe_done(&mut self, at: u64, wr_id: u64, ok: bool) {
        let Some(sent) = self.probes_in_flight.remove(&wr_id) else {
            return;
        };
        let id = ProbeId(wr_id - self.probe_base);
        let now_d = Duration::from_nanos(now_ns());
        let at = at.max(sent);
        if ok {
            if self
                .lp
                .probe_completed_at(now_d, id, Duration::from_nanos(at))
            {
                self.probes_ok += 1;
                self.metrics
                    .probe_latency
                    .observe(at.saturating_sub(sent) as f64 * 1e-9);
                if !self.probe_running {
                    self.probe_running = true;
                    info!(
                        latency_us = at.saturating_sub(sent) as f64 / 1e3,
                        "reference flow running"
                    );
                }
            }
        } else if self.lp.probe_lost(now_d, id) {
            self.probes_lost += 1;
            self.metrics.probes_lost.inc();
        }
    }

    fn drain_events(&mut self) {
        while let Some(ev) = self.lp.poll_event() {
            match ev {
                Event::ProbeDue => {
                    // Stamped just before the post, so the time the update took is not
                    // counted in the probe's latency.
                    let now = now_ns();
                    let now_d = Duration::from_nanos(now);
                    let id = self.lp.probe_sent(now_d);
                    let wr_id = self.probe_base + id.0;
                    match self.probe.send(wr_id, now) {
                        Ok(()) => {
                            self.probes_in_flight.insert(wr_id, now);
                            // A probe that completes within microseconds is taken on
                            // this wake-up instead of costing another.
                            self.completions.clear();
                            self.probe.await_completion(
                                now.saturating_add(crate::probe::AWAIT_LIMIT.as_nanos() as u64),
                                &mut self.completions,
                            );
                            self.take_completions();
                        }
                        Err(e) => {
                            self.metrics.fail_open.inc();
                            warn!(error = %e, "probe not sent");
                            self.lp.probe_lost(now_d, id);
                            self.probes_lost += 1;
                            self.metrics.probes_lost.inc();
                        }
                    }
                }
                Event::ProbeLost(id) => {
                    self.probes_in_flight.remove(&(self.probe_base + id.0));
                    self.probes_lost += 1;
                    self.metrics.probes_lost.inc();
                }
                // Under `adaptive` the driver publishes its own allotments.
                Event::AllotmentsChanged { .. } if self.adaptive.is_none() => {
                    self.publish_allotments()
                }
                Event::AllotmentsChanged { .. } => {}
                Event::TargetMeasured { idle_p99, target } => {
                    info!(
                        idle_p99_us = idle_p99.as_secs_f64() * 1e6,
                        target_us = target.as_secs_f64() * 1e6,
                        "Target99 measured"
                    );
                }
                Event::ModeChanged(mode) => warn!(?mode, "control mode changed"),
                // Announced only while peers' READ flows are counted: to them.
                Event::ReadGuarantee(g) => self.peer_grant(&g),
            }
        }
    }

    /// Publishes the status into the block and the metrics when an update ran or the
    /// flows changed since the last publication; otherwise there is nothing new.
    fn publish_status(&mut self) {
        let key = (
            self.lp.updates(),
            self.flows.len(),
            self.lp.generation() ^ self.adaptive.as_ref().map_or(0, |d| d.generation() << 32),
        );
        if self.published == Some(key) {
            return;
        }
        self.published = Some(key);
        let t = self.lp.target();
        let cur = self.lp.current_p99();
        self.block.set_status(BlockStatus {
            safe_util: self.lp.safe_util() as u64,
            current_p99_ns: cur.map_or(0, |d| d.as_nanos() as u64),
            target_p99_ns: t.value.map_or(0, |d| d.as_nanos() as u64),
            generation: self.lp.generation(),
        });
        self.metrics.safe_util.set(self.lp.safe_util());
        self.metrics.current_p99.set(secs(cur));
        self.metrics.target_p99.set(secs(t.value));
        let c = self.lp.counts();
        for (gauge, n) in self
            .class_gauges
            .iter()
            .zip([c.latency, c.bandwidth, c.throughput])
        {
            gauge.set(i64::from(n));
        }
        self.metrics.flows_registered.set(self.flows.len() as i64);
        if let Some(a) = self.adaptive.as_ref().map(AdaptiveDriver::state) {
            self.metrics
                .adaptive_pace
                .set(a.pace_bytes_per_sec.unwrap_or(f64::NAN));
            self.metrics.adaptive_chunk.set(i64::from(a.chunk_bytes));
            self.metrics.adaptive_fraction.set(a.fraction);
            self.metrics.adaptive_other_load.set(a.other_bytes_per_sec);
            let counted = self.metrics.adaptive_decreases.get();
            self.metrics
                .adaptive_decreases
                .inc_by(a.decreases.saturating_sub(counted));
        }
    }

    /// With `policy = "adaptive"`, after the loop's update or a change of flows: the law
    /// takes feedback or plans for the new counts, and the allotments are published when
    /// they changed. Nothing is done (nor allocated) when neither happened.
    fn drive_adaptive(&mut self) {
        let Some(driver) = &mut self.adaptive else {
            return;
        };
        let seen = (
            self.lp.updates(),
            self.lp.generation(),
            self.flows.len(),
            self.flows.values().filter(|f| f.active).count(),
            self.remote_ends,
        );
        if seen == self.adaptive_seen {
            return;
        }
        let updated = seen.0 != self.adaptive_seen.0;
        self.adaptive_seen = seen;
        let config = &self.config;
        let flows = self.flows.iter().map(|(&id, f)| DriverFlow {
            flow: ChargedFlow {
                flow: HostFlow {
                    spec: FlowSpec {
                        id: FlowId(id),
                        tenant: TenantId(f.tenant),
                        class: f.class,
                        weight: config.weight_of(f.uid),
                    },
                    qps: f.qps,
                },
                charged: f.remote.map_or(Resource::SendPath, |(peer, role)| {
                    Resource::of(role == justitia_peer::wire::Role::Read, peer)
                }),
                peer: f.remote.map(|(peer, _)| peer),
            },
            active: f.active,
            bytes: f.bytes,
        });
        let target = self.lp.target().value;
        let changed = if updated {
            let now = Duration::from_nanos(now_ns());
            driver.update(now, flows, target, self.lp.current_p99())
        } else {
            driver.flows_changed(flows, target)
        };
        if changed {
            self.publish_allotments();
        }
    }

    /// Flow `id`'s slot under the policy in effect, lowered to its incast `cap` (see
    /// [`Self::incast_cap`]) under either policy.
    fn slot_of(&self, id: u64, f: &Flow, cap: Option<f64>) -> SlotAllotment {
        if let Some(driver) = &self.adaptive {
            return match driver.allotment(id).map(|a| paced_plan(a, cap)) {
                Some(a) => SlotAllotment {
                    flow: id,
                    state: SlotState::Allotted,
                    bytes_per_sec: (a.bytes_per_sec as u64).max(1),
                    ops_per_sec: a.ops_per_sec.map_or(0, |o| (o as u64).max(1)),
                    chunk_bytes: u64::from(a.chunk_bytes),
                    token_bytes: u64::from(a.chunk_bytes),
                    generation: driver.generation(),
                    // One phase for all: each flow's pacer on its own schedule.
                    phase_offset: 0,
                    phase_epoch: 0,
                },
                None => unpaced_slot(id, f, driver.generation()),
            };
        }
        match self.paced_allotment(id, cap) {
            Some(a) => SlotAllotment {
                flow: id,
                state: SlotState::Allotted,
                bytes_per_sec: a.bytes_per_sec as u64,
                ops_per_sec: a.ops_per_sec as u64,
                chunk_bytes: u64::from(a.chunk_bytes),
                token_bytes: a.token.bytes,
                generation: a.generation,
                // The shaper's pacer puts the flow at this place in the release interval
                // when the epoch is new, so flows sharing the NIC do not release together.
                phase_offset: phase_to_fixed(a.phase.offset),
                phase_epoch: a.phase.epoch,
            },
            None => unpaced_slot(id, f, 0),
        }
    }

    fn publish_allotments(&mut self) {
        let mut per_uid: BTreeMap<u32, f64> = BTreeMap::new();
        let caps = self.incast_caps();
        for (&id, f) in &self.flows {
            let s = self.slot_of(id, f, self.incast_cap(&caps, f));
            if let Some(p) = self.pages.get(&f.tenant) {
                p.page.set_slot(f.slot, s);
            }
            *per_uid.entry(f.uid).or_default() += s.bytes_per_sec as f64;
        }
        self.metrics.tenant_allotment.clear();
        for (uid, v) in per_uid {
            self.metrics
                .tenant_allotment
                .get_or_create(&Tenant {
                    uid: uid.to_string(),
                })
                .set(v);
        }
    }

    /// Accepts the pending connections (at most [`EVENTS`] per pass): caps per uid and in
    /// all, the peer's identity and pidfd, its tenant, and the greeting with the shared
    /// block and the tenant's page.
    fn accept(&mut self, now: u64) {
        for _ in 0..EVENTS {
            if self.clients.len() >= self.max_clients {
                if self.log_ok(LogKind::Accept, now) {
                    warn!(
                        connections = self.clients.len(),
                        "connection cap reached: registration socket paused"
                    );
                }
                self.pause_listener(now);
                return;
            }
            let sock = match rustix::net::accept_with(
                &self.listener,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(s) => s,
                Err(rustix::io::Errno::AGAIN) => return,
                Err(rustix::io::Errno::INTR) => continue,
                Err(
                    e @ (rustix::io::Errno::MFILE
                    | rustix::io::Errno::NFILE
                    | rustix::io::Errno::NOBUFS
                    | rustix::io::Errno::NOMEM),
                ) => {
                    // The listener stays readable: waiting on it again would spin.
                    if self.log_ok(LogKind::Accept, now) {
                        warn!(error = %e, pause_ms = LISTEN_PAUSE.as_millis() as u64,
                              "accept on the registration socket: out of descriptors, paused");
                    }
                    self.pause_listener(now);
                    return;
                }
                Err(e) => {
                    if self.log_ok(LogKind::Accept, now) {
                        warn!(error = %e, "accept on the registration socket");
                    }
                    continue;
                }
            };
            self.admit(now, sock);
        }
    }

    fn refuse_connection(&mut self, now: u64, reason: &str, detail: std::fmt::Arguments<'_>) {
        self.metrics
            .refused
            .get_or_create(&Label {
                value: reason.into(),
            })
            .inc();
        if self.log_ok(LogKind::Accept, now) {
            warn!(reason, detail = %detail, "connection dropped");
        }
    }

    fn admit(&mut self, now: u64, sock: OwnedFd) {
        let cred = match crate::tenant::peer_cred(sock.as_fd()) {
            Ok(c) => c,
            Err(e) => {
                return self.refuse_connection(
                    now,
                    "no_credentials",
                    format_args!("SO_PEERCRED: {e}"),
                )
            }
        };
        let (uid, pid) = (cred.uid, cred.pid);
        let held = self.uid_clients.get(&uid).copied().unwrap_or(0);
        if held >= self.config.max_connections_per_uid {
            return self.refuse_connection(
                now,
                "too_many_connections",
                format_args!("uid {uid} holds {held} connections"),
            );
        }
        let (pidfd, _kernel) = crate::tenant::peer_pidfd(sock.as_fd(), pid);
        let (tenant, tenant_name) = match self.config.tenant {
            // A peer whose pid the daemon cannot see (another pid namespace) has no cgroup
            // to read: it is its uid's tenant.
            TenantBy::Uid => (u64::from(uid), uid.to_string()),
            TenantBy::Cgroup if pid == 0 => (u64::from(uid), uid.to_string()),
            TenantBy::Cgroup => match crate::tenant::peer_cgroup(pid, pidfd.as_ref()) {
                Ok(path) => {
                    let id = match self.cgroups.get(&path) {
                        Some(&id) => id,
                        None => {
                            let id = self.next_cgroup;
                            self.next_cgroup += 1;
                            self.cgroups.insert(path.clone(), id);
                            id
                        }
                    };
                    (id, path)
                }
                Err(e) => {
                    return self.refuse_connection(
                        now,
                        "no_cgroup",
                        format_args!("uid {uid} pid {pid}: {e}"),
                    )
                }
            },
        };
        let hello = Reply::Hello {
            boot_id: self.boot_id,
        }
        .encode();
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        // The tenant's page is created with its first connection and handed only to
        // its connections.
        let page = match self.pages.entry(tenant) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                match BlockWriter::create_tenant_page(self.config.slots, self.boot_id) {
                    Ok(page) => e.insert(TenantPage {
                        page,
                        free: (0..self.config.slots).rev().collect(),
                        clients: 0,
                    }),
                    Err(err) => {
                        self.release_page(tenant);
                        return self.refuse_connection(
                            now,
                            "no_page",
                            format_args!("uid {uid} pid {pid}: tenant page not created: {err}"),
                        );
                    }
                }
            }
        };
        let fds = [self.block.fd(), page.page.fd()];
        control.push(SendAncillaryMessage::ScmRights(&fds));
        if let Err(e) = rustix::net::sendmsg(
            &sock,
            &[IoSlice::new(&hello)],
            &mut control,
            SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
        ) {
            self.release_page(tenant);
            return self.refuse_connection(
                now,
                "greeting_not_sent",
                format_args!("uid {uid} pid {pid}: {e}"),
            );
        }
        let id = self.next_client;
        self.next_client += 1;
        if let Err(e) = self.watch(&sock, id << 1) {
            self.release_page(tenant);
            return self.refuse_connection(
                now,
                "not_watched",
                format_args!("uid {uid} pid {pid}: {e}"),
            );
        }
        if let Some(p) = &pidfd {
            // Without it the hang-up of the socket still reclaims the flows.
            if let Err(e) = self.watch(p, (id << 1) | 1) {
                debug!(error = %e, pid, "process exit not watched");
            }
        }
        if self.log_ok(LogKind::Flows, now) {
            debug!(
                client = id,
                uid,
                pid,
                pidfd = pidfd.is_some(),
                "shaper connected"
            );
        }
        if let Some(p) = self.pages.get_mut(&tenant) {
            p.clients += 1;
        }
        *self.uid_clients.entry(uid).or_default() += 1;
        self.known_changed = true;
        self.clients.insert(
            id,
            Client {
                sock,
                uid,
                pid,
                tenant,
                tenant_name,
                _pidfd: pidfd,
                flows: BTreeSet::new(),
            },
        );
    }

    fn refuse_message(&mut self, client: u64, reason: &str, detail: &str) {
        let (uid, pid) = self.clients.get(&client).map_or((0, 0), |c| (c.uid, c.pid));
        if self.log_ok(LogKind::Refused, now_ns()) {
            warn!(uid, pid, reason, detail, "message refused");
        }
        self.metrics
            .refused
            .get_or_create(&Label {
                value: reason.into(),
            })
            .inc();
    }

    fn send_reply(&self, client: u64, reply: Reply) {
        if let Some(c) = self.clients.get(&client) {
            let _ = rustix::net::send(
                &c.sock,
                &reply.encode(),
                SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
            );
        }
    }

    fn read_client(&mut self, now: u64, client: u64) {
        let mut buf = [0u8; MAX_MESSAGE + 1];
        // Bounded so that one busy client cannot starve the others, and by the pass's
        // budget (a message costs microseconds: a ready list of 64 connections of 16
        // messages each would take milliseconds).
        for _ in 0..MESSAGES_PER_TURN {
            if now_ns() > self.pass_deadline {
                return;
            }
            let Some(c) = self.clients.get(&client) else {
                return;
            };
            match rustix::net::recv(&c.sock, &mut buf, RecvFlags::DONTWAIT | RecvFlags::TRUNC) {
                Ok((_, 0)) => {
                    self.reclaim(now, client, "socket hang-up");
                    return;
                }
                Ok((n, total)) => {
                    let msg = &buf[..n.min(buf.len())];
                    let parsed = if total > MAX_MESSAGE {
                        Err(ParseError::Oversized { got: total })
                    } else {
                        Request::parse(msg)
                    };
                    match parsed {
                        Ok(req) => self.handle(now, client, req),
                        Err(e) => {
                            let kind = match e {
                                ParseError::Oversized { .. } => "oversized",
                                ParseError::NoHeader { .. } | ParseError::BadLength { .. } => {
                                    "truncated_or_bad_length"
                                }
                                _ => "malformed",
                            };
                            self.refuse_message(client, kind, &e.to_string());
                            self.send_reply(
                                client,
                                Reply::Refused {
                                    client_ref: 0,
                                    reason: RefuseReason::Malformed,
                                },
                            );
                        }
                    }
                }
                Err(rustix::io::Errno::AGAIN) => return,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    self.reclaim(now, client, &format!("socket error {e}"));
                    return;
                }
            }
        }
    }

    fn handle(&mut self, now: u64, client: u64, req: Request) {
        let now_d = Duration::from_nanos(now);
        match req {
            Request::Register(r) => self.register(now_d, client, r),
            Request::Usage(u) => {
                let owned = self
                    .clients
                    .get(&client)
                    .is_some_and(|c| c.flows.contains(&u.flow));
                if !owned {
                    self.refuse_message(
                        client,
                        "not_owner",
                        &format!("usage for flow {} it does not own", u.flow),
                    );
                    return;
                }
                if let Some(f) = self.flows.get_mut(&u.flow) {
                    f.active = u.active;
                    f.bytes = f.bytes.saturating_add(u.bytes);
                    if let Some(p) = self.pages.get(&f.tenant) {
                        p.page.set_usage(f.slot, f.bytes);
                    }
                    self.metrics
                        .tenant_usage
                        .get_or_create(&Tenant {
                            uid: f.uid.to_string(),
                        })
                        .inc_by(u.bytes);
                    if f.admission != AdmissionReply::NotAdmitted {
                        let _ = self.lp.set_flow_active(now_d, FlowId(u.flow), u.active);
                    }
                }
            }
            Request::Unregister { flow } => {
                let owned = self
                    .clients
                    .get_mut(&client)
                    .is_some_and(|c| c.flows.remove(&flow));
                if owned {
                    self.drop_flow(now_d, flow);
                } else {
                    self.refuse_message(
                        client,
                        "not_owner",
                        &format!("unregister of flow {flow} it does not own"),
                    );
                }
            }
            Request::Remote(r) => {
                let owned = self
                    .clients
                    .get(&client)
                    .is_some_and(|c| c.flows.contains(&r.flow));
                if owned {
                    self.remote_end(now_d, r);
                } else {
                    self.refuse_message(
                        client,
                        "not_owner",
                        &format!("remote end of flow {} it does not own", r.flow),
                    );
                }
            }
        }
    }

    fn register(&mut self, now: Duration, client: u64, r: Register) {
        let Some((uid, pid, tenant, tenant_name)) = self
            .clients
            .get(&client)
            .map(|c| (c.uid, c.pid, c.tenant, c.tenant_name.clone()))
        else {
            return;
        };
        let counts = SlotCounts {
            total: self.flows.len(),
            of_uid: self.uid_flows.get(&uid).copied().unwrap_or(0),
            of_tenant: self
                .pages
                .get(&tenant)
                .map_or(0, |p| self.config.slots as usize - p.free.len()),
        };
        let refuse = |this: &mut Self, reason: RefuseReason, why: &str, detail: String| {
            this.refuse_message(client, why, &detail);
            this.metrics
                .registrations
                .get_or_create(&Label {
                    value: "refused".into(),
                })
                .inc();
            this.send_reply(
                client,
                Reply::Refused {
                    client_ref: r.client_ref,
                    reason,
                },
            );
        };
        if r.claimed_uid != NO_UID && r.claimed_uid != uid {
            return refuse(
                self,
                RefuseReason::WrongUid,
                "wrong_uid",
                format!("claims uid {} but the kernel says {uid}", r.claimed_uid),
            );
        }
        match crate::limits::slot_verdict(
            counts,
            r.class,
            self.config.slots as usize,
            self.config.max_flows_per_uid,
        ) {
            Ok(()) => {}
            Err(RefuseReason::TooManyFlows) => {
                return refuse(
                    self,
                    RefuseReason::TooManyFlows,
                    "too_many_flows",
                    format!("uid {uid} holds {} flows already", counts.of_uid),
                )
            }
            Err(reason) => {
                return refuse(
                    self,
                    reason,
                    "full",
                    format!(
                        "{} flows of {} slots, {} of this tenant",
                        counts.total, self.config.slots, counts.of_tenant
                    ),
                )
            }
        }
        let Some(slot) = self.pages.get_mut(&tenant).and_then(|p| p.free.pop()) else {
            return refuse(
                self,
                RefuseReason::Full,
                "full",
                format!("the tenant's page is full ({} slots)", self.config.slots),
            );
        };
        let id = self.next_flow;
        self.next_flow += 1;
        let weight = self.config.weight_of(uid);
        let spec = FlowSpec {
            id: FlowId(id),
            tenant: TenantId(tenant),
            class: r.class,
            weight,
        };
        let verdict = match self
            .lp
            .register_flow(now, FlowRegistration { spec, qps: r.qps })
        {
            Ok(v) => v,
            Err(e) => {
                self.free_slot(tenant, slot);
                error!(error = %e, "control loop refused a registration");
                return refuse(self, RefuseReason::Malformed, "loop_refused", e.to_string());
            }
        };
        let admission = match verdict {
            Admission::Admitted => AdmissionReply::Admitted,
            Admission::TargetAtRisk {
                current_p99,
                target_p99,
            } => {
                let refuse_it = self.config.admission == AdmissionPolicy::Refuse;
                warn!(
                    uid,
                    pid,
                    flow = id,
                    current_p99_us = current_p99.as_secs_f64() * 1e6,
                    target_p99_us = target_p99.as_secs_f64() * 1e6,
                    admitted = !refuse_it,
                    "latency flow registered while Current99 exceeds Target99"
                );
                if refuse_it {
                    let _ = self.lp.remove_flow(now, FlowId(id));
                    AdmissionReply::NotAdmitted
                } else {
                    AdmissionReply::AdmittedWithWarning
                }
            }
        };
        let verdict_label = admission.as_str();
        self.metrics
            .registrations
            .get_or_create(&Label {
                value: verdict_label.into(),
            })
            .inc();
        if admission == AdmissionReply::NotAdmitted {
            self.free_slot(tenant, slot);
            self.send_reply(
                client,
                Reply::Registered {
                    client_ref: r.client_ref,
                    flow: id,
                    slot: 0,
                    admission,
                },
            );
            return;
        }
        let flow = Flow {
            uid,
            pid,
            tenant,
            tenant_name,
            class: r.class,
            qps: r.qps,
            slot,
            active: false,
            bytes: 0,
            admission,
            remote: None,
        };
        if let Some(p) = self.pages.get(&tenant) {
            // No remote end is known yet: no incast cap.
            p.page.set_slot(slot, self.slot_of(id, &flow, None));
        }
        self.flows.insert(id, flow);
        *self.uid_flows.entry(uid).or_default() += 1;
        if let Some(c) = self.clients.get_mut(&client) {
            c.flows.insert(id);
        }
        if self.log_ok(LogKind::Flows, now_ns()) {
            info!(uid, pid, flow = id, class = %r.class, qps = r.qps, verdict = verdict_label, "flow registered");
        }
        self.send_reply(
            client,
            Reply::Registered {
                client_ref: r.client_ref,
                flow: id,
                slot,
                admission,
            },
        );
    }

    fn drop_flow(&mut self, now: Duration, id: u64) {
        if let Some(f) = self.flows.remove(&id) {
            if let std::collections::hash_map::Entry::Occupied(mut e) = self.uid_flows.entry(f.uid)
            {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
            let _ = self.lp.remove_flow(now, FlowId(id));
            if let Some(p) = self.pages.get(&f.tenant) {
                p.page.clear_slot(f.slot);
            }
            self.free_slot(f.tenant, f.slot);
        }
    }

    fn free_slot(&mut self, tenant: u64, slot: u32) {
        if let Some(p) = self.pages.get_mut(&tenant) {
            p.free.push(slot);
        }
    }

    /// Drops a tenant's page once it has no connection and no flow left: its next
    /// connection gets a new one. A cgroup's tenant id goes with it, so the map of
    /// cgroups holds only tenants that are connected.
    fn release_page(&mut self, tenant: u64) {
        let slots = self.config.slots as usize;
        let unused = self
            .pages
            .get(&tenant)
            .is_none_or(|p| p.clients == 0 && p.free.len() == slots);
        if unused {
            self.pages.remove(&tenant);
            if tenant >= CGROUP_TENANT_BASE {
                self.cgroups.retain(|_, &mut id| id != tenant);
            }
        }
    }

    fn own_admin_socket(&self) {
        own_admin_socket(&self.config);
    }

    fn reclaim(&mut self, now: u64, client: u64, why: &str) {
        let Some(c) = self.clients.remove(&client) else {
            return;
        };
        self.known_changed = true;
        let n = c.flows.len();
        for id in c.flows {
            self.drop_flow(Duration::from_nanos(now), id);
        }
        if let Some(p) = self.pages.get_mut(&c.tenant) {
            p.clients = p.clients.saturating_sub(1);
        }
        self.release_page(c.tenant);
        if let std::collections::hash_map::Entry::Occupied(mut e) = self.uid_clients.entry(c.uid) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
        self.metrics.reclaims.inc_by(n as u64);
        if self.log_ok(LogKind::Flows, now) {
            if n > 0 {
                info!(uid = c.uid, pid = c.pid, flows = n, why, "flows reclaimed");
            } else {
                debug!(uid = c.uid, pid = c.pid, why, "shaper disconnected");
            }
        }
    }

    /// Replaces the control loop (new weights, RefPeriod or probe timeout), registering
    /// every flow again with its activity. The controller starts afresh.
    fn rebuild_loop(&mut self) -> Result<(), String> {
        let now = Duration::from_nanos(now_ns());
        let mut lp = ControlLoop::new(loop_config(&self.config), &self.profile, now)
            .map_err(|e| e.to_string())?;
        for (&id, f) in &self.flows {
            if f.admission == AdmissionReply::NotAdmitted {
                continue;
            }
            let weight = self.config.weight_of(f.uid);
            let spec = FlowSpec {
                id: FlowId(id),
                tenant: TenantId(f.tenant),
                class: f.class,
                weight,
            };
            lp.register_flow(now, FlowRegistration { spec, qps: f.qps })
                .map_err(|e| e.to_string())?;
            if let Some((peer, justitia_peer::wire::Role::Read)) = f.remote {
                lp.set_flow_reads_from(now, FlowId(id), Some(crate::peer::responder_key(peer)))
                    .map_err(|e| e.to_string())?;
            }
            lp.set_flow_active(now, FlowId(id), f.active)
                .map_err(|e| e.to_string())?;
        }
        self.lp = lp;
        self.probe_base += 1 << 40;
        self.probes_in_flight.clear();
        Ok(())
    }

    fn reload(&mut self) {
        let Some(path) = self.config_path.clone() else {
            warn!("SIGHUP: no configuration file to reload");
            return;
        };
        let new = match Config::load(&path, true) {
            Ok(c) => c,
            Err(e) => {
                error!(error = %e, "SIGHUP: configuration refused, keeping the running one");
                return;
            }
        };
        let old = self.config.clone();
        let peer_taken = self.reload_peer(new.peer.as_ref());
        let new_peer = new.peer.clone();
        let restart_only = [
            ("device", new.device != old.device),
            ("port", new.port != old.port),
            ("gid_index", new.gid_index != old.gid_index),
            ("profile", new.profile != old.profile),
            ("probe", new.probe != old.probe),
            ("socket", new.socket != old.socket),
            ("admin_socket", new.admin_socket != old.admin_socket),
            ("metrics", new.metrics != old.metrics),
            ("slots", new.slots != old.slots),
            ("stale_after_ms", new.stale_after != old.stale_after),
            ("tenant", new.tenant != old.tenant),
            ("policy", new.policy != old.policy),
            ("peer", !peer_taken),
            ("unshaped_scan_ms", new.unshaped_scan != old.unshaped_scan),
        ];
        for (key, changed) in restart_only {
            if changed {
                warn!(key, "SIGHUP: this key takes effect at the next start");
            }
        }
        // A new target alone is set on the running loop; the other loop settings need a
        // new loop.
        let retargeted = new.target != old.target;
        let relooped = new.weights != old.weights
            || new.ref_period != old.ref_period
            || new.probe_timeout != old.probe_timeout;
        self.config = Config {
            device: old.device,
            port: old.port,
            gid_index: old.gid_index,
            profile: old.profile,
            probe: old.probe,
            socket: old.socket,
            admin_socket: old.admin_socket,
            metrics: old.metrics,
            slots: old.slots,
            stale_after: old.stale_after,
            tenant: old.tenant,
            policy: old.policy,
            peer: if peer_taken { new_peer } else { old.peer },
            unshaped_scan: old.unshaped_scan,
            ..new
        };
        if relooped {
            if let Err(e) = self.rebuild_loop() {
                error!(error = %e, "SIGHUP: control loop not rebuilt");
            }
        } else if retargeted {
            if let Err(e) = self
                .lp
                .set_target(Duration::from_nanos(now_ns()), self.config.target)
            {
                error!(error = %e, "SIGHUP: Target99 not changed");
                self.config.target = old.target;
            }
        }
        if self.config.admin_group != old.admin_group {
            self.own_admin_socket();
        }
        info!(path = %path.display(), "configuration reloaded");
    }

    /// Root, the daemon's own user, the admin group as primary group, or (for a peer whose
    /// pid the daemon can see) as a supplementary group.
    fn admin_allowed(&self, uid: u32, gid: u32, pid: i32) -> bool {
        if uid == 0 || uid == rustix::process::geteuid().as_raw() {
            return true;
        }
        let Some(admin) = self.config.admin_group.as_deref().and_then(group_id) else {
            return false;
        };
        if gid == admin {
            return true;
        }
        if pid <= 0 {
            return false;
        }
        // Supplementary groups are not in SO_PEERCRED; /proc has them for a live pid.
        std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Groups:"))
                .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(admin)))
        })
    }

    /// Accepts admin connections, at most [`MAX_ADMIN_CONNECTIONS`] at once: each is
    /// then served as its socket becomes ready, never waited on.
    fn accept_admin(&mut self, now: u64) {
        for _ in 0..MAX_ADMIN_CONNECTIONS {
            let sock = match rustix::net::accept_with(
                &self.admin,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(s) => s,
                Err(rustix::io::Errno::AGAIN) => return,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    if self.log_ok(LogKind::Admin, now) {
                        warn!(error = %e, "accept on the admin socket");
                    }
                    return;
                }
            };
            if self.admins.len() >= MAX_ADMIN_CONNECTIONS {
                if self.log_ok(LogKind::Admin, now) {
                    warn!(
                        open = self.admins.len(),
                        "admin connection closed: too many at once"
                    );
                }
                continue;
            }
            let Ok(cred) = crate::tenant::peer_cred(sock.as_fd()) else {
                continue;
            };
            let allowed = self.admin_allowed(cred.uid, cred.gid, cred.pid);
            let id = self.next_admin;
            self.next_admin += 1;
            let tag = TAG_ADMIN_CONN | id;
            if self.watch(&sock, tag).is_err() {
                continue;
            }
            let mut conn = AdminConn {
                sock,
                allowed,
                input: Vec::new(),
                output: Arc::from(Vec::new()),
                sent: 0,
                deadline: now.saturating_add(ADMIN_DEADLINE.as_nanos() as u64),
            };
            if !allowed {
                if self.log_ok(LogKind::Admin, now) {
                    warn!(
                        uid = cred.uid,
                        "admin request refused: not root nor in the admin group"
                    );
                }
                conn.output = Self::encode_admin(&AdminReply::Error(
                    "permission denied: root or the admin group only".into(),
                ))
                .into();
            }
            self.admins.insert(id, conn);
            // The refusal is written at once; a request is read when it arrives.
            if !allowed {
                self.serve_admin(id);
            }
        }
    }

    fn encode_admin(reply: &AdminReply) -> Vec<u8> {
        let mut text = serde_json::to_string(reply)
            .unwrap_or_else(|e| format!("{{\"error\":\"answer not encoded: {e}\"}}"));
        text.push('\n');
        text.into_bytes()
    }

    /// Reads what an admin connection has sent without waiting, answers once its line is
    /// complete, and writes what the socket takes; closes it when the answer is out.
    fn serve_admin(&mut self, id: u64) {
        let Some(mut conn) = self.admins.remove(&id) else {
            return;
        };
        if conn.allowed && conn.output.is_empty() {
            let mut chunk = [0u8; 512];
            let mut ended = false;
            while !conn.input.contains(&b'\n') && conn.input.len() <= MAX_ADMIN_REQUEST {
                match rustix::net::recv(&conn.sock, &mut chunk, RecvFlags::DONTWAIT) {
                    Ok((0, _)) => {
                        ended = true;
                        break;
                    }
                    Ok((n, _)) => conn.input.extend_from_slice(&chunk[..n]),
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(_) => return,
                }
            }
            let complete = conn.input.contains(&b'\n') || conn.input.len() > MAX_ADMIN_REQUEST;
            if !complete && !ended {
                self.admins.insert(id, conn);
                return;
            }
            let line = conn.input.split(|&b| b == b'\n').next().unwrap_or_default();
            conn.output = if conn.input.len() > MAX_ADMIN_REQUEST && !conn.input.contains(&b'\n') {
                Self::encode_admin(&AdminReply::Error(format!(
                    "request longer than {MAX_ADMIN_REQUEST} bytes"
                )))
                .into()
            } else {
                match serde_json::from_slice::<AdminRequest>(line) {
                    Ok(req) => self.admin_request(req),
                    Err(e) => {
                        Self::encode_admin(&AdminReply::Error(format!("bad request: {e}"))).into()
                    }
                }
            };
        }
        while conn.sent < conn.output.len() {
            match rustix::net::send(
                &conn.sock,
                &conn.output[conn.sent..],
                SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
            ) {
                Ok(n) => conn.sent += n,
                Err(rustix::io::Errno::AGAIN) => {
                    let _ = rustix::event::epoll::modify(
                        &self.epoll,
                        &conn.sock,
                        rustix::event::epoll::EventData::new_u64(TAG_ADMIN_CONN | id),
                        rustix::event::epoll::EventFlags::OUT,
                    );
                    self.admins.insert(id, conn);
                    return;
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return,
            }
        }
    }

    /// The encoded answer to `req`.
    fn admin_request(&mut self, req: AdminRequest) -> Arc<[u8]> {
        let reply = match req {
            // Encoded by the scanning thread: the loop only takes a reference.
            AdminRequest::Unshaped => {
                return match &self.unshaped {
                    None => crate::unshaped::off_answer(),
                    Some(scanner) => scanner.answer().unwrap_or_else(|| {
                        Self::encode_admin(&AdminReply::Error(
                            "the table of unshaped processes was being replaced: ask again".into(),
                        ))
                        .into()
                    }),
                }
            }
            AdminRequest::Status => AdminReply::Status(self.status()),
            AdminRequest::Flows => {
                let caps = self.incast_caps();
                AdminReply::Flows(
                    self.flows
                        .iter()
                        .map(|(&id, f)| FlowReport {
                            flow: id,
                            uid: f.uid,
                            tenant: f.tenant_name.clone(),
                            pid: f.pid,
                            class: f.class.to_string(),
                            qps: f.qps,
                            active: f.active,
                            admission: f.admission.as_str().into(),
                            allot_bytes_per_sec: self.allotted_bytes(id, self.incast_cap(&caps, f)),
                            remote: f
                                .remote
                                .map(|(peer, role)| peering::describe_remote(peer, role)),
                            read_guarantee_bytes_per_sec: self
                                .flow_guarantee(id)
                                .map(|g| g.bytes_per_sec),
                            bytes: f.bytes,
                        })
                        .collect(),
                )
            }
            AdminRequest::SetTarget { target } => match parse_target(&target) {
                // The running loop keeps SafeUtil, the flows and the probe window: a
                // new target must not throw away what the controller has learnt.
                Ok(t) => match self.lp.set_target(Duration::from_nanos(now_ns()), t) {
                    Ok(()) => {
                        self.config.target = t;
                        info!(?t, "Target99 set over the admin socket");
                        AdminReply::Done(format!("target set to {}", describe_target(t)))
                    }
                    Err(e) => AdminReply::Error(format!("target refused: {e}")),
                },
                Err(e) => AdminReply::Error(e),
            },
        };
        Self::encode_admin(&reply).into()
    }

    /// A flow's allotted bytes/s under the policy in effect, lowered to its incast `cap`,
    /// as its slot holds it.
    fn allotted_bytes(&self, id: u64, cap: Option<f64>) -> Option<f64> {
        match &self.adaptive {
            Some(driver) => driver
                .allotment(id)
                .map(|a| paced_plan(a, cap).bytes_per_sec),
            None => self.paced_allotment(id, cap).map(|a| a.bytes_per_sec),
        }
    }

    /// The status as the admin socket reports it.
    pub fn status(&self) -> StatusReport {
        let t = self.lp.target();
        let c = self.lp.counts();
        let info = self.probe.info();
        StatusReport {
            boot_id: self.boot_id,
            device: format!("{}:{}", info.device, info.port),
            profile: self.profile.name.clone(),
            max_rate: self.lp.max_rate(),
            safe_util: self.lp.safe_util(),
            current_p99_ns: self.lp.current_p99().map(|d| d.as_nanos() as u64),
            target_p99_ns: t.value.map(|d| d.as_nanos() as u64),
            idle_p99_ns: t.idle_p99.map(|d| d.as_nanos() as u64),
            probes: self.probes_ok,
            probes_lost: self.probes_lost,
            latency: c.latency,
            bandwidth: c.bandwidth,
            throughput: c.throughput,
            flows: self.flows.len(),
            tenants: self.pages.len(),
            cgroups: self.cgroups.len(),
            mode: match self.lp.mode() {
                ControlMode::Normal => "normal".into(),
                ControlMode::Unattainable { .. } => "unattainable".into(),
            },
            adaptive: self.adaptive.as_ref().map(|d| Box::new(d.state())),
        }
    }
}

/// A flow's slot while the policy gives it no allotment: a resource-hungry flow's slot is
/// marked for one with no rate yet (its shaper reads no allotment from it), any other
/// flow's is unshaped.
fn unpaced_slot(id: u64, f: &Flow, generation: u64) -> SlotAllotment {
    SlotAllotment {
        flow: id,
        state: if f.class.is_resource_hungry() {
            SlotState::Allotted
        } else {
            SlotState::Unshaped
        },
        bytes_per_sec: 0,
        ops_per_sec: 0,
        chunk_bytes: 0,
        token_bytes: 0,
        generation,
        phase_offset: 0,
        phase_epoch: 0,
    }
}

fn describe_target(t: Target99) -> String {
    match t {
        Target99::Absolute(d) => format!("{} us", d.as_secs_f64() * 1e6),
        Target99::IdleMultiple(m) => format!("{m} x the idle p99"),
    }
}
