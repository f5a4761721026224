//! What a shaper calls to follow the daemon.
//!
//! [`AgentClient`] keeps one `SOCK_SEQPACKET` connection to `justitiad` and read-only
//! mappings of the two blocks its greeting carries: the shared control block (heartbeat,
//! status) and the page of the connection's tenant (its flows' slots; see
//! [`crate::block`]). Every call that a verb path may make
//! ([`allotment`](AgentClient::allotment), [`report_usage`](AgentClient::report_usage))
//! is a handful of atomic loads or one non-blocking send: it never waits for the daemon.
//! The blocking parts (connecting, receiving replies, reconnecting) happen in
//! [`tick`](AgentClient::tick), which the shaper calls from wherever it already wakes up
//! (a timer, a completion poll), and which itself never waits longer than one
//! `connect(2)` on a local socket.
//!
//! Fail-open: [`allotment`](AgentClient::allotment) returns `None` as soon as the block's
//! heartbeat has not moved for longer than the block's staleness limit (measured on this
//! process's clock, whatever the daemon's clock reads), or the connection has hung up;
//! the caller then falls back to its static settings. A stale heartbeat alone keeps the
//! connection: the allotments are used again as soon as the heartbeat moves. A hang-up
//! makes `tick` reconnect with exponential backoff and register every flow again; the
//! [`FlowHandle`]s the caller holds stay valid across that.
//!
//! Invariants: the flow list holds only the caller's live flows and those the daemon
//! still owes an answer or an unregister (a vacant entry is reused, under a new
//! generation so that an old handle or a late answer never names the new flow); every
//! flow registered with the daemon is unregistered once the caller unregisters it, even
//! when that came before the daemon's answer; a registration refused for room is sent
//! again with backoff.

use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use justitia_core::control_verbs::ControlVerbBudget;
use justitia_core::flow::FlowClass;
use justitia_core::pacer::ReleasePhase;
use justitia_core::queue_turns::TurnBudget;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendFlags, SocketAddrUnix,
    SocketFlags, SocketType,
};

use crate::block::{
    monotonic_ns, phase_from_fixed, BlockError, BlockReader, SlotState, KIND_SHARED, KIND_TENANT,
};
use crate::proto::{
    AdmissionReply, ControlVerbReport, Paired, QpPairing, QpTurnReport, RefuseReason, Register,
    Reply, Request, Usage, MAX_MESSAGE,
};

/// Registrations sent and not yet answered, at most: the daemon's answers to them fit
/// in the socket's receive queue.
pub const MAX_IN_FLIGHT: usize = 32;

/// The registration socket's default path.
pub const DEFAULT_SOCKET: &str = "/run/justitia/justitiad.sock";

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// A socket call failed.
    #[error("{what} {path}: {source}")]
    Sys {
        /// The call.
        what: &'static str,
        /// The socket path.
        path: PathBuf,
        /// The error.
        source: rustix::io::Errno,
    },
    /// The daemon's greeting was not what this client understands.
    #[error("daemon at {path} sent no usable greeting: {reason}")]
    Greeting {
        /// The socket path.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// The control block could not be mapped.
    #[error("control block from {path}: {source}")]
    Block {
        /// The socket path.
        path: PathBuf,
        /// The error.
        source: BlockError,
    },
}

/// A flow's allotment as the shaper should enforce it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allotment {
    /// Bytes per second.
    pub bytes_per_sec: u64,
    /// Operations per second.
    pub ops_per_sec: u64,
    /// The chunk size to cut bandwidth requests to.
    pub chunk_bytes: u64,
    /// The multi-resource token's size in bytes.
    pub token_bytes: u64,
    /// The control loop generation that set it.
    pub generation: u64,
    /// The release phase's offset in units of 1/[`PHASE_ONE`](crate::block::PHASE_ONE).
    pub phase_offset: u64,
    /// The release phase's epoch.
    pub phase_epoch: u64,
    /// What each of the flow's requests is charged in its pace.
    pub charge: justitia_core::message_charge::MessageCharge,
}

impl Allotment {
    /// The release phase to give the flow's pacer
    /// ([`Pacer::set_rate_in_phase`](justitia_core::pacer::Pacer::set_rate_in_phase)).
    pub fn phase(&self) -> ReleasePhase {
        ReleasePhase {
            offset: phase_from_fixed(self.phase_offset),
            epoch: self.phase_epoch,
        }
    }
}

/// The caller's name for a flow; stable across reconnections. A handle of a flow that
/// was unregistered names no flow, even once its place in the list is reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowHandle {
    index: u32,
    generation: u32,
}

impl FlowHandle {
    /// The registration's `client_ref` on the wire: the generation above the index.
    fn client_ref(self) -> u64 {
        u64::from(self.generation) << 32 | u64::from(self.index)
    }

    fn from_client_ref(r: u64) -> Self {
        FlowHandle {
            index: r as u32,
            generation: (r >> 32) as u32,
        }
    }
}

/// Where a flow's registration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowState {
    /// Not (yet) registered with the running daemon: follow static settings.
    Pending,
    /// Registered.
    Registered {
        /// The daemon's flow id.
        flow: u64,
        /// Soft admission's verdict (never [`AdmissionReply::NotAdmitted`] here).
        admission: AdmissionReply,
    },
    /// The daemon declined to steer it: leave it as it is.
    NotAdmitted,
    /// The daemon refused the registration.
    Refused(RefuseReason),
    /// The flow was unregistered by the caller.
    Gone,
}

/// Reconnection settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientConfig {
    /// The first retry's delay after the daemon is found gone (10 ms).
    pub backoff_min: Duration,
    /// The longest delay between retries (1 s).
    pub backoff_max: Duration,
    /// How long `connect` waits for the greeting (1 s).
    pub greeting_timeout: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            backoff_min: Duration::from_millis(10),
            backoff_max: Duration::from_secs(1),
            greeting_timeout: Duration::from_secs(1),
        }
    }
}

#[derive(Debug)]
struct Entry {
    register: Register,
    /// Bumped each time the entry is reused: a handle or a late reply of an earlier flow
    /// in the same place matches no longer.
    generation: u32,
    state: FlowState,
    slot: u32,
    /// The registration has been sent on the current connection.
    sent: bool,
    /// The caller unregistered the flow while its registration was unanswered: the
    /// answer's flow is unregistered when it arrives.
    cancelled: bool,
    /// An unregister not yet sent (the socket was full).
    unregister: Option<u64>,
    /// A registration refused for room (`Full`, `TooManyFlows`) is sent again then (ns).
    retry_at: u64,
    retry_backoff: Duration,
    /// The allotment read at the latest tick, kept for a read that finds the slot torn.
    last: Option<Allotment>,
}

impl Entry {
    /// Whether the entry may be reused: the caller is done with it and the daemon owes
    /// it nothing.
    fn vacant(&self) -> bool {
        matches!(self.state, FlowState::Gone) && !self.cancelled && self.unregister.is_none()
    }
}

#[derive(Debug)]
struct Connection {
    sock: OwnedFd,
    /// The shared block: heartbeat, boot id, daemon-wide status.
    block: BlockReader,
    /// This tenant's page: the slots of its flows.
    page: BlockReader,
    /// The least (reader's clock - heartbeat) seen, ns: the clocks' offset plus the
    /// freshest heartbeat's age. See [`AgentClient::allotment`].
    offset_ns: AtomicI64,
}

impl Connection {
    /// Whether the heartbeat is older than the block's limit at `now_ns` on this
    /// process's clock. The daemon's clock may be offset from the reader's (a time
    /// namespace), so ages are measured against the least offset seen: a heartbeat that
    /// does not move ages as the reader's clock advances, whatever the offset.
    fn stale(&self, now_ns: u64) -> bool {
        let seen = now_ns as i64 - self.block.heartbeat_ns() as i64;
        let least = self.offset_ns.fetch_min(seen, Ordering::Relaxed).min(seen);
        seen.saturating_sub(least) > self.block.stale_after_ns() as i64
    }
}

/// Counters a shaper may report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClientStats {
    /// Connections made (the first and every reconnection).
    pub connections: u64,
    /// Times the daemon was found gone.
    pub fail_opens: u64,
    /// Registrations sent.
    pub registrations: u64,
}

/// A shaper's connection to `justitiad`. See the module documentation.
#[derive(Debug)]
pub struct AgentClient {
    path: PathBuf,
    config: ClientConfig,
    conn: Option<Connection>,
    /// Flows by index; a vacant entry is reused, so the list holds the caller's live
    /// flows and those the daemon still owes an answer for.
    flows: Vec<Entry>,
    backoff: Duration,
    next_attempt_ns: u64,
    boot_id: u64,
    uid: u32,
    stats: ClientStats,
    /// Why the latest connection attempt failed; `None` once connected.
    last_error: Option<ClientError>,
    /// Side channels the daemon found and the caller has not taken yet, at most
    /// [`MAX_PAIRED_HELD`].
    paired: std::collections::VecDeque<Paired>,
}

/// Found side channels a client holds for its caller, at most: the daemon's per-tenant
/// cap of pairings, so a caller that takes them on every tick never loses one.
pub const MAX_PAIRED_HELD: usize = 4096;

impl AgentClient {
    /// Connects to the daemon at `path` now; fails if none answers.
    pub fn connect(path: impl AsRef<Path>) -> Result<Self, ClientError> {
        let mut c = Self::disconnected(path, ClientConfig::default());
        let conn = c.open()?;
        c.adopt(conn);
        Ok(c)
    }

    /// A client that is not connected yet: [`tick`](Self::tick) connects when the daemon
    /// appears. For shapers that start before (or without) the daemon.
    pub fn disconnected(path: impl AsRef<Path>, config: ClientConfig) -> Self {
        AgentClient {
            path: path.as_ref().to_path_buf(),
            config,
            conn: None,
            flows: Vec::new(),
            backoff: config.backoff_min,
            next_attempt_ns: 0,
            boot_id: 0,
            uid: rustix::process::getuid().as_raw(),
            stats: ClientStats::default(),
            last_error: None,
            paired: std::collections::VecDeque::new(),
        }
    }

    fn sys(&self, what: &'static str) -> impl FnOnce(rustix::io::Errno) -> ClientError + '_ {
        move |source| ClientError::Sys {
            what,
            path: self.path.clone(),
            source,
        }
    }
    fn open(&self) -> Result<(Connection, u64), ClientError> {
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(self.sys("socket"))?;
        let addr = SocketAddrUnix::new(&self.path).map_err(self.sys("socket path"))?;
        // A local connect waits while the daemon's listen queue is full (a daemon that
        // stopped accepting): the send timeout bounds that wait as the greeting's is.
        rustix::net::sockopt::set_socket_timeout(
            &sock,
            rustix::net::sockopt::Timeout::Send,
            Some(self.config.greeting_timeout),
        )
        .map_err(self.sys("SO_SNDTIMEO"))?;
        rustix::net::connect(&sock, &addr).map_err(self.sys("connect"))?;
        rustix::net::sockopt::set_socket_timeout(
            &sock,
            rustix::net::sockopt::Timeout::Recv,
            Some(self.config.greeting_timeout),
        )
        .map_err(self.sys("SO_RCVTIMEO"))?;
        let mut buf = [0u8; MAX_MESSAGE + 1];
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = rustix::net::recvmsg(
            &sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(self.sys("receiving the greeting from"))?;
        // The shared block, then this tenant's page; any others are closed as the
        // iterator drops them.
        let mut fds = Vec::with_capacity(2);
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = m {
                for f in received {
                    if fds.len() < 2 {
                        fds.push(f);
                    }
                }
            }
        }
        let greeting = |reason: String| ClientError::Greeting {
            path: self.path.clone(),
            reason,
        };
        let boot_id = match Reply::parse(&buf[..msg.bytes.min(buf.len())]) {
            Ok(Reply::Hello { boot_id }) => boot_id,
            Ok(other) => return Err(greeting(format!("{other:?} instead of a greeting"))),
            Err(e) => return Err(greeting(e.to_string())),
        };
        let mut fds = fds.into_iter();
        let map = |fd: Option<OwnedFd>, what: &str, kind: u64| {
            let fd = fd.ok_or_else(|| greeting(format!("no {what} descriptor attached")))?;
            let block = BlockReader::map(fd.as_fd()).map_err(|source| ClientError::Block {
                path: self.path.clone(),
                source,
            })?;
            if block.kind() != kind {
                return Err(greeting(format!("the {what} is of kind {}", block.kind())));
            }
            if block.boot_id() != boot_id {
                return Err(greeting(format!(
                    "boot id {boot_id:#x} but the {what} says {:#x}",
                    block.boot_id()
                )));
            }
            Ok(block)
        };
        // A block of a layout this shaper cannot read (an upgrade on one side) is said to
        // the daemon, which tells its operator; the shaper runs on its static settings.
        let say_layout = |e: &ClientError| {
            if let ClientError::Block {
                source: BlockError::Version { found, known },
                ..
            } = e
            {
                let msg = Request::UnknownLayout {
                    found: *found,
                    known: *known,
                };
                let _ = rustix::net::send(&sock, &msg.encode(), SendFlags::DONTWAIT);
            }
        };
        let block = map(fds.next(), "control block", KIND_SHARED).inspect_err(say_layout)?;
        let page = map(fds.next(), "tenant page", KIND_TENANT).inspect_err(say_layout)?;
        let offset_ns = AtomicI64::new(monotonic_ns() as i64 - block.heartbeat_ns() as i64);
        Ok((
            Connection {
                sock,
                block,
                page,
                offset_ns,
            },
            boot_id,
        ))
    }

    fn adopt(&mut self, (conn, boot_id): (Connection, u64)) {
        self.conn = Some(conn);
        self.last_error = None;
        self.boot_id = boot_id;
        self.backoff = self.config.backoff_min;
        self.stats.connections += 1;
        for e in &mut self.flows {
            // The daemon reclaimed everything of the old connection.
            e.sent = false;
            e.cancelled = false;
            e.unregister = None;
            e.last = None;
            if !matches!(e.state, FlowState::Gone) {
                e.state = FlowState::Pending;
                e.retry_at = 0;
            }
        }
        self.send_pending(monotonic_ns());
    }

    /// Whether a live daemon is connected (heartbeat fresh).
    pub fn is_connected(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| !c.stale(monotonic_ns()))
    }

    /// Whether the connection is open, fresh or not: a daemon that is only slow keeps
    /// its connection, and its shapers their registrations.
    pub fn has_connection(&self) -> bool {
        self.conn.is_some()
    }

    /// The daemon's latest heartbeat (`CLOCK_MONOTONIC` ns), `None` when not connected.
    pub fn heartbeat_ns(&self) -> Option<u64> {
        self.conn.as_ref().map(|c| c.block.heartbeat_ns())
    }

    /// When [`tick`](Self::tick) next tries to connect (`CLOCK_MONOTONIC` ns), `None`
    /// while connected: a caller without a daemon need not tick before then.
    pub fn next_attempt_ns(&self) -> Option<u64> {
        self.conn.is_none().then_some(self.next_attempt_ns)
    }

    /// Why the latest connection attempt failed (no daemon listening, a greeting not
    /// understood, a control block of another layout version); `None` while connected
    /// and before the first attempt.
    pub fn last_error(&self) -> Option<&ClientError> {
        self.last_error.as_ref()
    }

    /// The daemon's boot id of the current connection (0 before the first).
    pub fn boot_id(&self) -> u64 {
        self.boot_id
    }

    /// Counters.
    pub fn stats(&self) -> ClientStats {
        self.stats
    }

    /// Entries in the flow list: the caller's live flows and those whose registration
    /// the daemon has not answered yet (for tests of its bound).
    pub fn entries(&self) -> usize {
        self.flows.iter().filter(|e| !e.vacant()).count()
    }

    fn entry(&self, h: FlowHandle) -> Option<&Entry> {
        self.flows
            .get(h.index as usize)
            .filter(|e| e.generation == h.generation)
    }

    /// Registers a flow; the registration is sent now if connected, else on reconnection.
    /// The handle is the caller's for the flow's lifetime.
    pub fn register(
        &mut self,
        class: FlowClass,
        qps: u32,
        demand_bytes_per_sec: u64,
    ) -> FlowHandle {
        let index = match self.flows.iter().position(Entry::vacant) {
            Some(i) => i,
            None => {
                self.flows.push(Entry {
                    register: Register {
                        client_ref: 0,
                        class,
                        qps: 1,
                        demand_bytes_per_sec: 0,
                        claimed_uid: self.uid,
                    },
                    generation: 0,
                    state: FlowState::Gone,
                    slot: 0,
                    sent: false,
                    cancelled: false,
                    unregister: None,
                    retry_at: 0,
                    retry_backoff: Duration::ZERO,
                    last: None,
                });
                self.flows.len() - 1
            }
        };
        let e = &mut self.flows[index];
        e.generation = e.generation.wrapping_add(1);
        let handle = FlowHandle {
            index: index as u32,
            generation: e.generation,
        };
        e.register = Register {
            client_ref: handle.client_ref(),
            class,
            qps: qps.max(1),
            demand_bytes_per_sec,
            claimed_uid: self.uid,
        };
        e.state = FlowState::Pending;
        e.slot = 0;
        e.sent = false;
        e.retry_at = 0;
        e.retry_backoff = self.config.backoff_min;
        e.last = None;
        self.send_pending(monotonic_ns());
        handle
    }

    /// Sends what is owed: registrations not yet sent (and those refused for room whose
    /// retry time has come), unregisters the socket could not take before.
    fn send_pending(&mut self, now_ns: u64) {
        let Some(conn) = &self.conn else { return };
        // The daemon drops an answer its peer's socket has no room for: registrations
        // are kept few enough in flight that every answer fits.
        let mut in_flight = self
            .flows
            .iter()
            .filter(|e| e.sent && (e.cancelled || matches!(e.state, FlowState::Pending)))
            .count();
        let send = |wire: &[u8]| {
            rustix::net::send(&conn.sock, wire, SendFlags::DONTWAIT | SendFlags::NOSIGNAL).is_ok()
        };
        for e in &mut self.flows {
            if let Some(flow) = e.unregister {
                if send(&Request::Unregister { flow }.encode()) {
                    e.unregister = None;
                }
            }
            if let FlowState::Refused(RefuseReason::Full | RefuseReason::TooManyFlows) = e.state {
                if now_ns >= e.retry_at {
                    e.state = FlowState::Pending;
                    e.sent = false;
                }
            }
            if e.sent || !matches!(e.state, FlowState::Pending) || in_flight >= MAX_IN_FLIGHT {
                continue;
            }
            if send(&Request::Register(e.register).encode()) {
                e.sent = true;
                in_flight += 1;
                self.stats.registrations += 1;
            }
        }
    }

    /// Where a flow's registration stands. A registration refused for room
    /// ([`RefuseReason::Full`], [`RefuseReason::TooManyFlows`]) is sent again by
    /// [`tick`](Self::tick) with a backoff from `backoff_min` doubling to `backoff_max`:
    /// the flow's state is `Refused` until then.
    pub fn state(&self, h: FlowHandle) -> FlowState {
        self.entry(h).map_or(FlowState::Gone, |e| e.state)
    }

    /// The allotment to enforce now, or `None`: daemon gone or stale, flow not (yet)
    /// registered or given no share yet (idle until it reports work), not admitted, or a
    /// latency flow (never shaped). A read that finds the slot torn on every attempt (the
    /// daemon writing it) gives the allotment of the latest [`tick`](Self::tick), not
    /// `None`. Never blocks.
    ///
    /// Stale means the heartbeat has not moved for longer than the block's limit as this
    /// process's clock measures it; the daemon's clock may be offset from this one (a
    /// time namespace) without making it look fresh or stale.
    pub fn allotment(&self, h: FlowHandle) -> Option<Allotment> {
        let conn = self.conn.as_ref()?;
        let e = self.entry(h)?;
        let FlowState::Registered { flow, .. } = e.state else {
            return None;
        };
        if conn.stale(monotonic_ns()) {
            return None;
        }
        match conn.page.slot(e.slot) {
            Some(slot) => Self::allotment_of(flow, slot),
            None if e.slot < conn.page.slots() => e.last,
            None => None,
        }
    }

    fn allotment_of(flow: u64, slot: crate::block::SlotAllotment) -> Option<Allotment> {
        // A zero rate is an idle flow's (no share until it reports work): the caller keeps
        // its static settings rather than stall.
        (slot.flow == flow && slot.state == SlotState::Allotted && slot.bytes_per_sec > 0)
            .then_some(Allotment {
                bytes_per_sec: slot.bytes_per_sec,
                ops_per_sec: slot.ops_per_sec,
                chunk_bytes: slot.chunk_bytes,
                token_bytes: slot.token_bytes,
                generation: slot.generation,
                phase_offset: slot.phase_offset,
                phase_epoch: slot.phase_epoch,
                charge: slot.charge,
            })
    }

    /// The control-verb budget the daemon gives each of this tenant's processes, from the
    /// tenant page; `None` when not paced, not connected, or the daemon is stale (a
    /// process then keeps its own setting, if any). Never blocks.
    pub fn control_budget(&self) -> Option<ControlVerbBudget> {
        let conn = self.conn.as_ref()?;
        if conn.stale(monotonic_ns()) {
            return None;
        }
        conn.page.control_budget()
    }

    /// The QP turns the daemon gives each of this tenant's processes, from the tenant
    /// page; `None` when there are none, not connected, or the daemon is stale. Never
    /// blocks.
    pub fn turn_budget(&self) -> Option<TurnBudget> {
        let conn = self.conn.as_ref()?;
        if conn.stale(monotonic_ns()) {
            return None;
        }
        conn.page.turn_budget()
    }

    /// Reports the process's QP turns since its previous report. One non-blocking send;
    /// false when not sent: the caller keeps counting and reports later.
    pub fn report_qp_turns(&mut self, report: QpTurnReport) -> bool {
        let Some(conn) = &self.conn else { return false };
        let wire = Request::QpTurns(report).encode();
        rustix::net::send(&conn.sock, &wire, SendFlags::DONTWAIT | SendFlags::NOSIGNAL).is_ok()
    }

    /// Reports the process's control verbs since its previous report. One non-blocking
    /// send; false when not sent (not connected, or the socket buffer full): the caller
    /// keeps counting and reports later.
    pub fn report_control_verbs(&mut self, report: ControlVerbReport) -> bool {
        let Some(conn) = &self.conn else { return false };
        let wire = Request::ControlVerbs(report).encode();
        rustix::net::send(&conn.sock, &wire, SendFlags::DONTWAIT | SendFlags::NOSIGNAL).is_ok()
    }

    /// The bytes the daemon has counted for a registered flow, from its tenant page;
    /// `None` when not connected or not registered.
    pub fn counted_bytes(&self, h: FlowHandle) -> Option<u64> {
        let conn = self.conn.as_ref()?;
        let e = self.entry(h)?;
        let FlowState::Registered { flow, .. } = e.state else {
            return None;
        };
        let slot = conn.page.slot(e.slot)?;
        (slot.flow == flow).then(|| conn.page.usage(e.slot))?
    }

    /// Reports a flow's activity and what it posted since the last report. One
    /// non-blocking send; returns false when not sent (not registered, daemon gone, or the
    /// socket buffer full), in which case the caller keeps counting and reports later.
    pub fn report_usage(&mut self, h: FlowHandle, active: bool, bytes: u64, ops: u64) -> bool {
        self.send_for_flow(h, |flow| {
            Request::Usage(Usage {
                flow,
                active,
                bytes,
                ops,
            })
        })
    }

    /// Reports a latency flow's round trips since the last report: `count` of them, whose
    /// longest are `longest_ns` (longest first; see
    /// [`LatencyReport`](crate::proto::LatencyReport)). One non-blocking send; false when
    /// not sent (nothing to report, not registered, daemon gone, or the socket buffer
    /// full): the round trips are then dropped, the next report carries newer ones.
    pub fn report_latency(
        &mut self,
        h: FlowHandle,
        count: u32,
        longest_ns: [u32; crate::proto::LATENCY_LONGEST],
    ) -> bool {
        count > 0
            && self.send_for_flow(h, |flow| {
                Request::Latency(crate::proto::LatencyReport {
                    flow,
                    count,
                    longest_ns,
                })
            })
    }

    /// Tells the daemon where a registered flow's QP goes (`gid`, or `lid` when addressed
    /// by LID alone, and the remote QP number) and whether it posts READs. False when not
    /// registered yet or the socket would not take it now: the caller tries again.
    pub fn report_remote(
        &mut self,
        h: FlowHandle,
        gid: [u8; 16],
        lid: u16,
        qpn: u32,
        reads: bool,
    ) -> bool {
        self.send_for_flow(h, |flow| {
            Request::Remote(crate::proto::RemoteEnd {
                flow,
                gid,
                lid,
                qpn: qpn & 0xff_ffff,
                reads,
            })
        })
    }

    /// Tells the daemon that one of a registered flow's RC queue pairs reached RTR, with
    /// its process's side channel (see [`QpPairing`]; the flow id is filled in here).
    /// False when not registered yet or the socket would not take it now: the caller
    /// tries again. The daemon's answer, when the other end's is found, comes through
    /// [`take_paired`](Self::take_paired).
    pub fn report_pairing(&mut self, h: FlowHandle, pairing: QpPairing) -> bool {
        self.send_for_flow(h, |flow| Request::Pairing(QpPairing { flow, ..pairing }))
    }

    /// Tells the daemon that a queue pair's pairing is gone (destroyed or reset). False
    /// as for [`report_pairing`](Self::report_pairing).
    pub fn withdraw_pairing(&mut self, h: FlowHandle, local_qpn: u32) -> bool {
        self.send_for_flow(h, |flow| Request::Unpairing { flow, local_qpn })
    }

    /// Sends the message `request` makes of flow `h`'s daemon id, without waiting. False
    /// when not connected, the flow is not registered (yet), or the socket would not take
    /// it now: the caller tries again.
    fn send_for_flow(&self, h: FlowHandle, request: impl FnOnce(u64) -> Request) -> bool {
        let Some(conn) = &self.conn else { return false };
        let Some(FlowState::Registered { flow, .. }) = self.entry(h).map(|e| e.state) else {
            return false;
        };
        let wire = request(flow).encode();
        rustix::net::send(&conn.sock, &wire, SendFlags::DONTWAIT | SendFlags::NOSIGNAL).is_ok()
    }

    /// The next side channel the daemon found for one of this client's pairings, oldest
    /// first; received by [`tick`](Self::tick).
    pub fn take_paired(&mut self) -> Option<Paired> {
        self.paired.pop_front()
    }

    /// The flow is gone (its QPs destroyed): tells the daemon, and forgets it. A flow
    /// whose registration is not answered yet is unregistered when the answer arrives;
    /// an unregister the socket cannot take now is sent by a later tick.
    pub fn unregister(&mut self, h: FlowHandle) {
        if self.entry(h).is_none() {
            return;
        }
        let Some(e) = self.flows.get_mut(h.index as usize) else {
            return;
        };
        let old = std::mem::replace(&mut e.state, FlowState::Gone);
        e.last = None;
        match old {
            FlowState::Registered { flow, .. } if self.conn.is_some() => {
                e.unregister = Some(flow);
            }
            FlowState::Pending if e.sent && self.conn.is_some() => e.cancelled = true,
            _ => {}
        }
        self.send_pending(monotonic_ns());
    }

    /// The connection's socket, for callers that want to poll for replies.
    pub fn socket(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.conn.as_ref().map(|c| c.sock.as_fd())
    }

    /// Receives replies, notices a gone daemon (its socket hung up), reconnects with
    /// backoff, sends what is owed. `now_ns` is `CLOCK_MONOTONIC` in ns
    /// ([`monotonic_ns`]). A stale heartbeat is not a gone daemon: the connection and
    /// the registrations stay, and [`allotment`](Self::allotment) gives `None` (static
    /// settings) until the heartbeat moves again, so one slow pass of the daemon does not
    /// make every shaper register again. Never waits on a live daemon; a reconnection
    /// attempt costs one local `connect(2)` and, if it is accepted, the daemon's greeting
    /// (sent at once on accept).
    pub fn tick(&mut self, now_ns: u64) {
        if let Some(conn) = &self.conn {
            let mut gone = false;
            let mut buf = [0u8; MAX_MESSAGE + 1];
            loop {
                match rustix::net::recv(&conn.sock, &mut buf, RecvFlags::DONTWAIT) {
                    Ok((0, _)) => {
                        gone = true;
                        break;
                    }
                    Ok((n, _)) => match Reply::parse(&buf[..n.min(buf.len())]) {
                        Ok(Reply::Paired(p)) => {
                            if self.paired.len() < MAX_PAIRED_HELD {
                                self.paired.push_back(p);
                            }
                        }
                        Ok(reply) => Self::apply(&mut self.flows, reply, now_ns, &self.config),
                        Err(_) => {}
                    },
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(_) => {
                        gone = true;
                        break;
                    }
                }
            }
            if gone {
                self.conn = None;
                self.stats.fail_opens += 1;
                for e in &mut self.flows {
                    e.cancelled = false;
                    e.unregister = None;
                    e.last = None;
                    if !matches!(e.state, FlowState::Gone) {
                        e.state = FlowState::Pending;
                    }
                }
                self.backoff = self.config.backoff_min;
                self.next_attempt_ns =
                    now_ns.saturating_add(self.config.backoff_min.as_nanos() as u64);
            } else {
                // Keep what the slots say now, for a later read that finds one torn.
                for e in &mut self.flows {
                    if let FlowState::Registered { flow, .. } = e.state {
                        if let Some(slot) = conn.page.slot(e.slot) {
                            e.last = Self::allotment_of(flow, slot);
                        }
                    }
                }
                self.send_pending(now_ns);
            }
            return;
        }
        if now_ns < self.next_attempt_ns {
            return;
        }
        match self.open() {
            Ok(conn) => self.adopt(conn),
            Err(e) => {
                self.last_error = Some(e);
                self.next_attempt_ns = now_ns.saturating_add(self.backoff.as_nanos() as u64);
                self.backoff = (self.backoff * 2).min(self.config.backoff_max);
            }
        }
    }

    fn apply(flows: &mut [Entry], reply: Reply, now_ns: u64, config: &ClientConfig) {
        let (client_ref, state, slot) = match reply {
            Reply::Registered {
                client_ref,
                flow,
                slot,
                admission,
            } => (
                client_ref,
                if admission == AdmissionReply::NotAdmitted {
                    FlowState::NotAdmitted
                } else {
                    FlowState::Registered { flow, admission }
                },
                slot,
            ),
            Reply::Refused { client_ref, reason } => (client_ref, FlowState::Refused(reason), 0),
            Reply::Hello { .. } | Reply::Paired(_) => return,
        };
        let handle = FlowHandle::from_client_ref(client_ref);
        let Some(e) = flows
            .get_mut(handle.index as usize)
            .filter(|e| e.generation == handle.generation)
        else {
            return;
        };
        if e.cancelled {
            // Unregistered before this answer: the daemon's flow goes too.
            e.cancelled = false;
            if let FlowState::Registered { flow, .. } = state {
                e.unregister = Some(flow);
            }
            return;
        }
        if !matches!(e.state, FlowState::Pending) {
            return;
        }
        e.state = state;
        e.slot = slot;
        if let FlowState::Refused(RefuseReason::Full | RefuseReason::TooManyFlows) = state {
            e.retry_at = now_ns.saturating_add(e.retry_backoff.as_nanos() as u64);
            e.retry_backoff = (e.retry_backoff * 2).min(config.backoff_max);
        } else {
            e.retry_backoff = config.backoff_min;
        }
    }

    /// Ticks until the flow's registration is answered or `timeout` passes, waiting on the
    /// socket in between. For set-up paths and tests, never for a verb.
    pub fn wait_registered(&mut self, h: FlowHandle, timeout: Duration) -> FlowState {
        let deadline = monotonic_ns().saturating_add(timeout.as_nanos() as u64);
        loop {
            let now = monotonic_ns();
            self.tick(now);
            let state = self.state(h);
            if !matches!(state, FlowState::Pending) || now >= deadline {
                return state;
            }
            let wait = Duration::from_nanos((deadline - now).min(5_000_000));
            match &self.conn {
                Some(conn) => {
                    let mut fds = [rustix::event::PollFd::new(
                        &conn.sock,
                        rustix::event::PollFlags::IN,
                    )];
                    let ts = rustix::time::Timespec {
                        tv_sec: 0,
                        tv_nsec: wait.as_nanos() as _,
                    };
                    let _ = rustix::event::poll(&mut fds, Some(&ts));
                }
                None => std::thread::sleep(wait),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A SEQPACKET socket listening at a fresh path in the temporary directory, with
    /// `backlog`: a stand-in for the daemon's socket that accepts only when told to.
    fn listening(name: &str, backlog: i32) -> (PathBuf, OwnedFd) {
        let path =
            std::env::temp_dir().join(format!("justitia-{name}-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::bind(&listener, &SocketAddrUnix::new(&path).unwrap()).unwrap();
        rustix::net::listen(&listener, backlog).unwrap();
        (path, listener)
    }

    /// A daemon that stopped accepting: its listen queue fills, and a blocking local
    /// `connect` then waits until a slot frees, which may be never. The send timeout bounds
    /// it, so `tick` returns and the shaper keeps its static settings.
    #[test]
    fn a_full_listen_queue_delays_a_tick_by_the_greeting_timeout_at_most() {
        let (path, _listener) = listening("full", 0);
        // Fill the queue with connections nobody accepts.
        let mut held = Vec::new();
        for _ in 0..8 {
            let s = rustix::net::socket_with(
                AddressFamily::UNIX,
                SocketType::SEQPACKET,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
                None,
            )
            .unwrap();
            let _ = rustix::net::connect(&s, &SocketAddrUnix::new(&path).unwrap());
            held.push(s);
        }
        let config = ClientConfig {
            greeting_timeout: Duration::from_millis(50),
            ..ClientConfig::default()
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || {
            let mut c = AgentClient::disconnected(&p, config);
            let start = std::time::Instant::now();
            c.tick(monotonic_ns());
            let _ = tx.send((start.elapsed(), c.is_connected()));
        });
        let (took, connected) = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("tick returned");
        assert!(!connected);
        assert!(took < Duration::from_secs(1), "{took:?}");
        drop(held);
        let _ = std::fs::remove_file(&path);
    }

    /// A shaper of layout 2 meeting a daemon of layout 1 (64-byte slots without a phase):
    /// the greeting's block is refused by its version, the client stays disconnected with
    /// no allotment (static settings), the reason is kept for the shaper to say, and the
    /// daemon is told the two layouts.
    #[test]
    fn a_daemon_of_another_layout_is_refused_and_the_reason_kept() {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage};
        let (path, listener) = listening("old", 4);
        // A block as a layout-1 daemon writes it: the magic, version 1, one slot.
        let block = rustix::fs::memfd_create("old-block", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&block, crate::block::block_len(1) as u64).unwrap();
        let mut words = crate::block::MAGIC.to_le_bytes().to_vec();
        words.extend_from_slice(&1u64.to_le_bytes());
        words.extend_from_slice(&1u64.to_le_bytes());
        words.extend_from_slice(&77u64.to_le_bytes());
        rustix::io::pwrite(&block, &words, 0).unwrap();
        let daemon = std::thread::spawn(move || {
            let sock = rustix::net::accept(&listener).unwrap();
            let hello = Reply::Hello { boot_id: 77 }.encode();
            let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [block.as_fd()];
            control.push(SendAncillaryMessage::ScmRights(&fds));
            rustix::net::sendmsg(
                &sock,
                &[std::io::IoSlice::new(&hello)],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .unwrap();
            sock
        });
        let mut c = AgentClient::disconnected(&path, ClientConfig::default());
        let h = c.register(FlowClass::Bandwidth, 1, 0);
        c.tick(monotonic_ns());
        let _sock = daemon.join().unwrap();
        assert!(!c.is_connected());
        assert_eq!(c.allotment(h), None);
        assert_eq!(c.state(h), FlowState::Pending);
        match c.last_error() {
            Some(ClientError::Block {
                source: BlockError::Version { found, known },
                ..
            }) => assert_eq!((*found, *known), (1, crate::block::LAYOUT_VERSION)),
            other => panic!("expected a layout refusal, got {other:?}"),
        }
        assert_eq!(c.stats().connections, 0);
        // The daemon was told, so that it can say which tenants it does not serve.
        let mut buf = [0u8; MAX_MESSAGE];
        let (n, _) = rustix::net::recv(&_sock, &mut buf, RecvFlags::DONTWAIT).unwrap();
        assert_eq!(
            Request::parse(&buf[..n]),
            Ok(Request::UnknownLayout {
                found: 1,
                known: crate::block::LAYOUT_VERSION
            })
        );
        let _ = std::fs::remove_file(&path);
    }

    /// A daemon of the current layout that accepts one connection: greets it with a
    /// shared block whose heartbeat is `heartbeat_ns` and a page, answers its first
    /// registration with flow 7 in slot 0, allotted 1 MB/s. Returns the socket and the
    /// two blocks.
    fn fake_daemon(
        name: &str,
        heartbeat_ns: u64,
        stale_after_ns: u64,
    ) -> (
        PathBuf,
        std::thread::JoinHandle<(
            OwnedFd,
            crate::block::BlockWriter,
            crate::block::BlockWriter,
        )>,
    ) {
        use crate::block::{BlockWriter, SlotAllotment};
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage};
        let (path, listener) = listening(name, 4);
        let daemon = std::thread::spawn(move || {
            let shared = BlockWriter::create_shared(5, stale_after_ns).unwrap();
            shared.beat(heartbeat_ns);
            let page = BlockWriter::create_tenant_page(4, 5).unwrap();
            let sock = rustix::net::accept(&listener).unwrap();
            let hello = Reply::Hello { boot_id: 5 }.encode();
            let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [shared.fd(), page.fd()];
            control.push(SendAncillaryMessage::ScmRights(&fds));
            rustix::net::sendmsg(
                &sock,
                &[std::io::IoSlice::new(&hello)],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .unwrap();
            let mut buf = [0u8; MAX_MESSAGE];
            let (n, _) = rustix::net::recv(&sock, &mut buf, RecvFlags::empty()).unwrap();
            let Ok(Request::Register(r)) = Request::parse(&buf[..n]) else {
                panic!("no registration")
            };
            page.set_slot(
                0,
                SlotAllotment {
                    flow: 7,
                    state: SlotState::Allotted,
                    bytes_per_sec: 1_000_000,
                    ops_per_sec: 0,
                    chunk_bytes: 4096,
                    token_bytes: 4096,
                    generation: 1,
                    phase_offset: 0,
                    phase_epoch: 0,
                    charge: justitia_core::message_charge::MessageCharge::NONE,
                },
            );
            let reply = Reply::Registered {
                client_ref: r.client_ref,
                flow: 7,
                slot: 0,
                admission: AdmissionReply::Admitted,
            };
            rustix::net::send(&sock, &reply.encode(), SendFlags::NOSIGNAL).unwrap();
            (sock, shared, page)
        });
        (path, daemon)
    }

    /// A daemon whose clock is an hour ahead of the shaper's (another time namespace)
    /// and whose heartbeat then stops: the shaper must see it go stale after the limit.
    /// Comparing absolute clocks, the heartbeat would look fresh for an hour.
    #[test]
    fn a_heartbeat_that_stops_goes_stale_whatever_the_daemons_clock_reads() {
        let ahead = monotonic_ns() + 3_600_000_000_000;
        let (path, daemon) = fake_daemon("ahead", ahead, 20_000_000);
        let mut c = AgentClient::connect(&path).unwrap();
        let h = c.register(FlowClass::Bandwidth, 1, 0);
        assert!(matches!(
            c.wait_registered(h, Duration::from_secs(2)),
            FlowState::Registered { flow: 7, .. }
        ));
        let (_sock, shared, _page) = daemon.join().unwrap();
        // Fresh while it moves.
        shared.beat(ahead + 1_000);
        assert!(c.allotment(h).is_some());
        std::thread::sleep(Duration::from_millis(60));
        c.tick(monotonic_ns());
        assert_eq!(
            c.allotment(h),
            None,
            "a heartbeat stopped 60 ms ago is stale"
        );
        assert!(!c.is_connected());
        // Stale is not gone: the connection and the registration stay, and the
        // allotment is used again once the heartbeat moves.
        assert!(c.has_connection());
        assert!(matches!(c.state(h), FlowState::Registered { flow: 7, .. }));
        shared.beat(ahead + 61_000_000);
        c.tick(monotonic_ns());
        assert_eq!(c.allotment(h).map(|a| a.bytes_per_sec), Some(1_000_000));
        assert_eq!(c.stats().connections, 1);
        let _ = std::fs::remove_file(&path);
    }

    /// A read that finds the slot torn (the daemon writing it) keeps the allotment of the
    /// latest tick instead of leaving the flow unpaced.
    #[test]
    fn a_torn_read_keeps_the_last_allotment() {
        let (path, daemon) = fake_daemon("torn", monotonic_ns(), 10_000_000_000);
        let mut c = AgentClient::connect(&path).unwrap();
        let h = c.register(FlowClass::Bandwidth, 1, 0);
        c.wait_registered(h, Duration::from_secs(2));
        let (_sock, _shared, page) = daemon.join().unwrap();
        c.tick(monotonic_ns());
        assert_eq!(c.allotment(h).map(|a| a.bytes_per_sec), Some(1_000_000));
        page.tear_slot(0);
        assert_eq!(c.allotment(h).map(|a| a.bytes_per_sec), Some(1_000_000));
        let _ = std::fs::remove_file(&path);
    }
}
