//! The daemon's end of the peer channel: a non-blocking UDP socket that carries
//! `justitia-peer` datagrams between this host's daemon and the daemons of the hosts its
//! flows load (remote READs, incast) or that load it.
//!
//! [`PeerLink`] owns the socket, the protocol state ([`Channel`]), peer discovery and the
//! channel's metrics and log lines. The server polls it from its one loop: the socket is
//! registered in the loop's epoll, [`PeerLink::receive`] reads at most
//! [`DATAGRAMS_PER_PASS`] datagrams per pass and stops at the pass's deadline, and
//! [`PeerLink::flush`] sends what is due without blocking (a datagram the kernel will not
//! take now is dropped and counted: the next refresh makes it good). So nothing a peer
//! sends can hold the loop or a verb.
//!
//! Discovery: a peer is named by its RDMA port's GID (the remote end of a QP). On RoCE
//! the GID holds the peer's IP address: an IPv4-mapped GID (`::ffff:a.b.c.d`, RoCE v2 over
//! IPv4) gives `a.b.c.d`, a global IPv6 GID gives itself, and the peer's daemon listens on
//! the configured `port`. On InfiniBand (and for link-local GIDs) the address comes from
//! the configured map `[peer.hosts]`, GID to `address:port`, and a QP addressed by LID
//! alone finds its peer's GID in `[peer.lids]`. A datagram is always answered at the
//! address discovery gives for its (authenticated) sender, never at the address it came
//! from, so a forged source cannot turn the daemon into a reflector.
//!
//! Membership: only the hosts of `[peer.members]` (node id and public key) are peers. A
//! flow's remote end that names no member counts as a local flow: no demand is made for
//! it and no datagram goes to an address a local tenant chose ([`PeerLink::is_member`]).
//!
//! Keys: the host's private key is read from `key_file`, or else from the systemd
//! credential `key_credential` (`$CREDENTIALS_DIRECTORY/peer.key` by default, which
//! `LoadCredential=` provides to a `DynamicUser=` service). The read is bounded
//! ([`MAX_KEY_FILE`]), and a file group or others may read or write is refused, as ssh
//! refuses such a private key. SIGHUP reads the key and the member list again
//! ([`PeerLink::reload`]): the channel handshakes anew and keeps the old sessions and key
//! for its overlap.
//!
//! The socket: if the port is taken (by anyone, for instance a local user who bound it
//! first) the daemon runs on without the channel, says so (rate-limited) and in the
//! `peer_socket_up` gauge, and tries again every [`BIND_RETRY`]: local shapers are served
//! throughout.
//!
//! Invariants: the socket never blocks (it is opened non-blocking); a pass reads at most
//! [`DATAGRAMS_PER_PASS`] datagrams; every refusal is counted under its reason and logged
//! at most [`crate::limits::LOG_BURST`] times a second; a refused datagram changes no
//! state (the channel's guarantee).

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use justitia_core::flow::{FlowClass, TenantId, Weight};
use justitia_core::incast::IncastLimits;
use justitia_core::remote_read::{ReadGuarantee, RemoteReadUnit};
use justitia_peer::channel::{Channel, ChannelConfig, ChannelEvent, Member};
use justitia_peer::keys::{KeyError, PrivateKey, PublicKey};
use justitia_peer::wire::{DemandEntry, Pairing, ProbeEndpoint, Role, MAX_DATAGRAM};
use justitia_peer::{NodeId, Refusal};
use tracing::{error, info, warn};

use crate::limits::{LogKind, LogLimiter};
use crate::metrics::{Label, Metrics};

/// Datagrams read per pass of the loop at most; more wait for the next pass.
pub const DATAGRAMS_PER_PASS: usize = 64;

/// The port a peer daemon listens on by default.
pub const DEFAULT_PORT: u16 = 7471;

/// The largest key file read: a key is 44 characters of base64; anything much larger is
/// not one.
pub const MAX_KEY_FILE: u64 = 4096;

/// The systemd credential the key is read from when `key_file` is not set.
pub const DEFAULT_CREDENTIAL: &str = "peer.key";

/// How often a socket that could not be bound is tried again.
pub const BIND_RETRY: Duration = Duration::from_secs(1);

/// Where the host's private key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A file (`peer.key_file`).
    File(PathBuf),
    /// A systemd credential of this name, in `$CREDENTIALS_DIRECTORY` (`LoadCredential=`).
    Credential(String),
}

/// The `[peer]` settings (see `packaging/justitiad.toml`).
#[derive(Debug, Clone, PartialEq)]
pub struct PeerSettings {
    /// This host's node id: its RDMA port's GID.
    pub node: NodeId,
    /// The member the reference flow crosses the wire to (`probe_to`), if any.
    pub probe_to: Option<NodeId>,
    /// The address the socket binds.
    pub listen: SocketAddr,
    /// The port peer daemons listen on (RoCE discovery).
    pub port: u16,
    /// Where this host's private key comes from.
    pub key: KeySource,
    /// The cluster's members: node id to static public key.
    pub members: BTreeMap<NodeId, PublicKey>,
    /// InfiniBand (or link-local) peers: GID to address.
    pub hosts: BTreeMap<NodeId, SocketAddr>,
    /// InfiniBand peers addressed by LID alone: LID to GID.
    pub lids: BTreeMap<u16, NodeId>,
    /// The channel's caps and timers.
    pub channel: ChannelConfig,
    /// Where the members are read from instead of `[peer.members]` (re-read when it
    /// changes, see [`crate::members_file`]).
    pub members_file: Option<PathBuf>,
    /// `[peer.hosts]` alone: `hosts` is these and the members' own `address`es.
    pub table_hosts: BTreeMap<NodeId, SocketAddr>,
}

impl PeerSettings {
    /// Takes `listed` as the members, and their addresses beside `[peer.hosts]`.
    pub fn apply_members(&mut self, listed: crate::members_file::Members) {
        self.members = listed.members;
        self.hosts = self.table_hosts.clone();
        self.hosts.extend(listed.hosts);
    }
}

/// Parses a GID as written in the configuration: eight groups of four hex digits
/// separated by colons (as `ibv_devinfo -v` and `show_gids` print it), any IPv6 text
/// form, or an IPv4 address (its IPv4-mapped GID, as RoCE v2 forms it).
pub fn parse_gid(text: &str) -> Result<NodeId, String> {
    let t = text.trim();
    if let Ok(v4) = t.parse::<Ipv4Addr>() {
        return Ok(NodeId(v4.to_ipv6_mapped().octets()));
    }
    t.parse::<Ipv6Addr>()
        .map(|v6| NodeId(v6.octets()))
        .map_err(|_| format!("`{text}` is neither a GID (IPv6 form) nor an IPv4 address"))
}

/// A peer as logs and the admin socket name it: its IPv4 address when its GID is
/// IPv4-mapped (RoCE v2 over IPv4), else the GID's IPv6 form.
pub fn host_name(node: NodeId) -> String {
    let v6 = Ipv6Addr::from(node.0);
    v6.to_ipv4_mapped()
        .map_or_else(|| v6.to_string(), |v4| v4.to_string())
}

/// Where a peer's daemon listens, from its GID (see the module documentation).
pub fn discover(settings: &PeerSettings, node: NodeId) -> Option<SocketAddr> {
    if let Some(&addr) = settings.hosts.get(&node) {
        return Some(addr);
    }
    let v6 = Ipv6Addr::from(node.0);
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(SocketAddr::new(IpAddr::V4(v4), settings.port));
    }
    // A link-local GID (RoCE v1, or InfiniBand's fe80::GUID) has no route: map it.
    let link_local = node.0[0] == 0xfe && node.0[1] & 0xc0 == 0x80;
    (!link_local && !v6.is_unspecified()).then(|| SocketAddr::new(IpAddr::V6(v6), settings.port))
}

/// The key the control loop and the incast limits know a peer host by: the flows of one
/// tenant and class with one key share that host's guarantee or incast share. Folded from
/// the GID; two GIDs that fold alike only make their flows share a guarantee they would
/// each have had.
pub fn responder_key(peer: NodeId) -> u64 {
    let (hi, lo) = peer.0.split_at(8);
    let word = |b: &[u8]| b.iter().fold(0u64, |acc, &x| acc << 8 | u64::from(x));
    word(hi).rotate_left(32) ^ word(lo)
}

/// One of this host's flows as the incast caps see it (see [`IncastCaps`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IncastFlow {
    /// Its tenant.
    pub tenant: TenantId,
    /// Its class.
    pub class: FlowClass,
    /// The peer its QP goes to and how it loads it, if known.
    pub remote: Option<(NodeId, Role)>,
    /// It reported work.
    pub active: bool,
}

/// The incast caps of one publication of the allotments (§6.7, [`IncastLimits::cap`]): a
/// bandwidth flow into a peer that granted a share is capped at its tenant's weight times
/// the share, divided among the tenant's active bandwidth flows into that peer.
///
/// Cost: the clock is read once by the caller (`now`) and the flows are counted once when
/// the caps are made (their (tenant, peer) keys gathered and sorted: one allocation, none
/// while no flow goes into a peer); each flow's cap is then a binary search, so a
/// publication is O(n log n) in n flows where counting again for every flow was O(n²).
/// The `incast_publish` bench, one publication's caps and slot writes (medians, one run):
/// 1000 flows 517 us counted per flow, 87 us counted once; 100 flows 6.6 and 6.0 us; 10
/// flows 0.38 and 0.46 us, where the one allocation costs more than the scans it saves.
#[derive(Debug)]
pub struct IncastCaps<'a> {
    limits: &'a IncastLimits,
    now: Duration,
    /// The (tenant, peer) of every active bandwidth flow into a peer, sorted: a tenant's
    /// flows into a peer are the run of its key.
    flows: Vec<(TenantId, NodeId)>,
}

impl<'a> IncastCaps<'a> {
    /// The caps at `now` under `limits`, for this host's `flows` (all of them).
    pub fn new(
        limits: &'a IncastLimits,
        now: Duration,
        flows: impl IntoIterator<Item = IncastFlow>,
    ) -> Self {
        let mut keys: Vec<(TenantId, NodeId)> = flows
            .into_iter()
            .filter(|f| f.active)
            .filter_map(|f| Some((f.tenant, incast_peer(&f)?)))
            .collect();
        keys.sort_unstable();
        IncastCaps {
            limits,
            now,
            flows: keys,
        }
    }

    /// The most `f` (of a tenant of weight `weight`) may send, bytes/s; `None` for a flow
    /// that is not a bandwidth flow into a peer, or into one that grants no share now.
    pub fn cap(&self, f: &IncastFlow, weight: Weight) -> Option<f64> {
        let peer = incast_peer(f)?;
        let key = (f.tenant, peer);
        let first = self.flows.partition_point(|k| *k < key);
        let past = self.flows.partition_point(|k| *k <= key);
        let flows = u32::try_from(past - first).unwrap_or(u32::MAX);
        self.limits
            .cap(self.now, responder_key(peer), weight, flows)
    }
}

/// The peer a bandwidth flow sends into (not READs from), if it is one.
fn incast_peer(f: &IncastFlow) -> Option<NodeId> {
    match f.remote {
        Some((peer, Role::Incast)) if f.class == FlowClass::Bandwidth => Some(peer),
        _ => None,
    }
}

/// Where one of this host's flows goes, as its shaper reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteEnd {
    /// The destination GID of its QP.
    Gid(NodeId),
    /// The destination LID of its QP (InfiniBand without a global route header).
    Lid(u16),
}

/// One of this host's flows that loads a peer, for [`demands`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadingFlow {
    /// The peer.
    pub peer: NodeId,
    /// Its tenant.
    pub tenant: TenantId,
    /// Its class.
    pub class: FlowClass,
    /// READ requester, or bandwidth flow into the peer.
    pub role: Role,
    /// Its tenant's weight.
    pub weight: Weight,
}

/// The demands of this host's active loading flows, by peer: one entry per (tenant,
/// class, role) with its count of flows (saturating at `u16::MAX`).
pub fn demands(flows: impl IntoIterator<Item = LoadingFlow>) -> BTreeMap<NodeId, Vec<DemandEntry>> {
    let mut by_peer: BTreeMap<NodeId, BTreeMap<(TenantId, FlowClass, Role), DemandEntry>> =
        BTreeMap::new();
    for f in flows {
        let entry = by_peer
            .entry(f.peer)
            .or_default()
            .entry((f.tenant, f.class, f.role))
            .or_insert(DemandEntry {
                tenant: f.tenant,
                class: f.class,
                role: f.role,
                flows: 0,
                weight: f.weight.get(),
            });
        entry.flows = entry.flows.saturating_add(1);
        entry.weight = entry.weight.max(f.weight.get());
    }
    by_peer
        .into_iter()
        .map(|(peer, entries)| (peer, entries.into_values().collect()))
        .collect()
}

/// A peer link that could not be set up, or a key that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The key file could not be read.
    #[error("peer key {path}: {source}")]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Group or others may read or write the key file.
    #[error("peer key {path}: mode {mode:04o} lets group or others read or write it; `chmod 600` it (or give it to systemd's LoadCredential=)")]
    KeyMode {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The key file is not a regular file, or larger than a key.
    #[error("peer key {path}: {why}")]
    KeyShape {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The key is malformed or degenerate.
    #[error("peer key {path}: {source}")]
    Key {
        /// The file.
        path: PathBuf,
        /// Why.
        source: KeyError,
    },
    /// No `key_file`, and no credentials directory to find the credential in.
    #[error("peer key: key_file is not set and $CREDENTIALS_DIRECTORY is not (the unit's LoadCredential={0}:/etc/justitia/peer.key provides it)")]
    NoCredentials(String),
    /// The kernel gave no randomness.
    #[error("peer channel: no randomness from the kernel: {0}")]
    Entropy(std::io::Error),
    /// The channel could not start (settings, members).
    #[error("peer settings: {0}")]
    Start(#[from] justitia_peer::channel::StartError),
    /// The member list contradicts the settings.
    #[error("peer members: {0}")]
    Members(#[from] justitia_peer::channel::ConfigError),
}

/// The path a key source names (a credential's in `$CREDENTIALS_DIRECTORY`).
pub fn key_path(source: &KeySource) -> Result<PathBuf, PeerError> {
    match source {
        KeySource::File(path) => Ok(path.clone()),
        KeySource::Credential(name) => std::env::var_os("CREDENTIALS_DIRECTORY")
            .map(|dir| Path::new(&dir).join(name))
            .ok_or_else(|| PeerError::NoCredentials(name.clone())),
    }
}

/// Reads a private key file: a regular file, mode 0600 or stricter (as ssh insists), at
/// most [`MAX_KEY_FILE`] bytes, holding one base64 key that is not degenerate.
pub fn read_key_file(path: &Path) -> Result<PrivateKey, PeerError> {
    let io = |source| PeerError::KeyFile {
        path: path.to_path_buf(),
        source,
    };
    // A link is followed (Kubernetes mounts a Secret's files as links), and the mode
    // checked is the file's itself (fstat of what was opened). O_NONBLOCK: a FIFO there
    // does not hold the daemon.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    let shape = |why: String| PeerError::KeyShape {
        path: path.to_path_buf(),
        why,
    };
    if !meta.is_file() {
        return Err(shape("not a regular file".into()));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(PeerError::KeyMode {
            path: path.to_path_buf(),
            mode,
        });
    }
    let mut text = String::new();
    let read = file
        .take(MAX_KEY_FILE + 1)
        .read_to_string(&mut text)
        .map_err(io)?;
    if read as u64 > MAX_KEY_FILE {
        return Err(shape(format!(
            "larger than {MAX_KEY_FILE} bytes: not a key (`justitiad genkey` writes one)"
        )));
    }
    PrivateKey::parse(&text).map_err(|source| PeerError::Key {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads the private key from its source.
pub fn load_key(source: &KeySource) -> Result<PrivateKey, PeerError> {
    read_key_file(&key_path(source)?)
}

/// 32 bytes from the kernel's random source.
pub fn random_bytes() -> Result<[u8; 32], PeerError> {
    let mut out = [0u8; 32];
    let mut filled = 0;
    while filled < out.len() {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(PeerError::Entropy(e.into())),
        }
    }
    Ok(out)
}

/// A new private key (`justitiad genkey`).
pub fn generate_key() -> Result<PrivateKey, PeerError> {
    loop {
        // A degenerate draw (2^-248 or so) is drawn again.
        if let Ok(key) = PrivateKey::from_bytes(random_bytes()?) {
            return Ok(key);
        }
    }
}

fn member_list(settings: &PeerSettings) -> Vec<Member> {
    settings
        .members
        .iter()
        .map(|(&node, &public)| Member { node, public })
        .collect()
}

/// Binds the channel's socket, non-blocking.
fn open_socket(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = UdpSocket::bind(addr)?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}

/// The daemon's end of the peer channel (see the module documentation).
pub struct PeerLink {
    settings: PeerSettings,
    /// `None` while the port cannot be bound (tried again at `next_bind`).
    socket: Option<UdpSocket>,
    next_bind: Duration,
    channel: Channel,
    metrics: Metrics,
    logs: LogLimiter,
    buf: Vec<u8>,
    /// The demands last handed to the channel, by peer, so that only changes go to it.
    demanded: BTreeMap<NodeId, Vec<DemandEntry>>,
    /// `members_file`, watched for changes.
    members_watch: Option<crate::members_file::MembersWatch>,
}

impl PeerLink {
    /// Reads the key, starts the channel (seeded from the kernel's randomness), binds the
    /// socket (non-blocking; if the port is taken, the link runs without it and tries
    /// again every [`BIND_RETRY`]) and greets every member.
    pub fn bind(
        settings: PeerSettings,
        now: Duration,
        metrics: Metrics,
    ) -> Result<Self, PeerError> {
        let key = load_key(&settings.key)?;
        let mut channel = Channel::new(
            settings.channel,
            settings.node,
            key,
            &member_list(&settings),
            random_bytes()?,
            now,
        )?;
        for reason in Refusal::LABELS {
            let _ = metrics.peer_refused.get_or_create(&Label {
                value: reason.into(),
            });
        }
        channel.greet(now);
        metrics.peer_members.set(settings.members.len() as i64);
        let members_watch = settings.members_file.clone().map(|path| {
            crate::members_file::MembersWatch::new(path, settings.node, settings.channel.max_peers)
        });
        let mut link = PeerLink {
            settings,
            socket: None,
            next_bind: now,
            channel,
            metrics,
            logs: LogLimiter::default(),
            buf: vec![0; MAX_DATAGRAM + 1],
            demanded: BTreeMap::new(),
            members_watch,
        };
        link.retry_bind(now);
        Ok(link)
    }

    /// Tries to bind the socket if it is not bound and the retry is due; returns whether it
    /// was bound now (the caller then watches [`socket`](Self::socket)).
    pub fn retry_bind(&mut self, now: Duration) -> bool {
        if self.socket.is_some() || now < self.next_bind {
            return false;
        }
        self.next_bind = now.saturating_add(BIND_RETRY);
        match open_socket(self.settings.listen) {
            Ok(socket) => {
                self.socket = Some(socket);
                self.metrics.peer_socket_up.set(1);
                // The greeting at start went nowhere if the port was taken then.
                self.channel.greet(now);
                true
            }
            Err(e) => {
                self.metrics.peer_socket_up.set(0);
                if self.logs.allow(LogKind::Refused, now.as_nanos() as u64).0 {
                    warn!(
                        listen = %self.settings.listen,
                        error = %e,
                        retry_ms = BIND_RETRY.as_millis() as u64,
                        "peer socket not bound (the port is taken?): the channel is down, local shapers are served; trying again"
                    );
                }
                false
            }
        }
    }

    /// The socket, for the loop's epoll, once bound.
    pub fn socket(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.socket.as_ref().map(|s| s.as_fd())
    }

    /// The address the socket is bound to.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match &self.socket {
            Some(s) => s.local_addr(),
            None => Err(std::io::Error::new(
                ErrorKind::NotConnected,
                "the peer socket is not bound",
            )),
        }
    }

    /// Whether `node` is a member of the cluster (listed in `[peer.members]`, not this
    /// host): only a member's flows are declared to it, and a shaper's remote end counts
    /// only when it names a member (see `server/registration.rs`), so a local tenant
    /// cannot make this daemon hold state for, or send datagrams to, a node of its choosing.
    pub fn is_member(&self, node: NodeId) -> bool {
        self.channel.is_member(node)
    }

    /// SIGHUP: reads the private key again and takes the new member list and addresses.
    /// A new key starts new handshakes (the old sessions and key serve for the channel's
    /// overlap); members gone are dropped, new ones greeted. On an error nothing changes.
    pub fn reload(&mut self, now: Duration, new: &PeerSettings) -> Result<(), PeerError> {
        let key = load_key(&new.key)?;
        self.channel.set_members(now, &member_list(new))?;
        self.channel.set_key(now, key);
        self.channel.greet(now);
        self.settings.key = new.key.clone();
        self.settings.members = new.members.clone();
        self.settings.hosts = new.hosts.clone();
        self.settings.table_hosts = new.table_hosts.clone();
        self.settings.lids = new.lids.clone();
        self.demanded
            .retain(|node, _| new.members.contains_key(node));
        self.metrics.peer_members.set(new.members.len() as i64);
        Ok(())
    }

    /// Reads `members_file` again if it changed (looked at once a second at most, see
    /// [`crate::members_file`]) and takes its list; a file refused is logged and counted,
    /// and the running members kept. Returns whether the members changed.
    pub fn poll_members_file(&mut self, now: Duration) -> bool {
        let Some(result) = self.members_watch.as_mut().and_then(|w| w.poll(now)) else {
            return false;
        };
        let listed = match result {
            Ok(listed) => listed,
            Err(e) => {
                self.metrics.peer_member_lists_refused.inc();
                error!(error = %e, "peer members file refused, keeping the running members");
                return false;
            }
        };
        let mut new = self.settings.clone();
        new.apply_members(listed);
        if new.members == self.settings.members && new.hosts == self.settings.hosts {
            return false;
        }
        if let Err(e) = self.channel.set_members(now, &member_list(&new)) {
            self.metrics.peer_member_lists_refused.inc();
            error!(error = %e, "peer members file refused, keeping the running members");
            return false;
        }
        self.channel.greet(now);
        self.demanded
            .retain(|node, _| new.members.contains_key(node));
        self.metrics.peer_members.set(new.members.len() as i64);
        info!(
            members = new.members.len(),
            file = %self.members_watch.as_ref().map_or(Path::new(""), |w| w.path()).display(),
            "peer members file read: members changed"
        );
        self.settings = new;
        true
    }

    /// This host's public key (what the other hosts list for it).
    pub fn public_key(&self) -> PublicKey {
        self.channel.public_key()
    }

    /// The settings.
    pub fn settings(&self) -> &PeerSettings {
        &self.settings
    }

    /// The peer a flow's remote end names, if it names a member.
    pub fn peer_of(&self, end: RemoteEnd) -> Option<NodeId> {
        let node = match end {
            RemoteEnd::Gid(gid) => gid,
            RemoteEnd::Lid(lid) => *self.settings.lids.get(&lid)?,
        };
        self.is_member(node).then_some(node)
    }

    /// Reads datagrams until none is left, [`DATAGRAMS_PER_PASS`] were read, or `deadline`
    /// (ns on the loop's clock, checked against `clock`) has passed. Returns how many.
    pub fn receive(&mut self, now: Duration, deadline: u64, clock: impl Fn() -> u64) -> usize {
        let mut read = 0;
        let Some(socket) = &self.socket else {
            return 0;
        };
        while read < DATAGRAMS_PER_PASS && clock() <= deadline {
            let n = match socket.recv_from(&mut self.buf) {
                Ok((n, _from)) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ICMP errors from an earlier send surface here (ECONNREFUSED): the
                    // peer's daemon is not running; the datagram is gone either way.
                    if self.logs.allow(LogKind::Refused, clock()).0 {
                        warn!(error = %e, "peer socket");
                    }
                    self.metrics.peer_send_failed.inc();
                    read += 1;
                    continue;
                }
            };
            read += 1;
            let datagram = &self.buf[..n];
            match self.channel.receive(now, datagram) {
                Ok(()) => {
                    self.metrics.peer_received.inc();
                }
                Err(reason) => {
                    self.metrics
                        .peer_refused
                        .get_or_create(&Label {
                            value: reason.label().into(),
                        })
                        .inc();
                    let (ok, dropped) = self.logs.allow(LogKind::Refused, clock());
                    if dropped > 0 {
                        warn!(dropped, "peer refusals not logged in the last second");
                    }
                    if ok {
                        warn!(%reason, "peer datagram refused");
                    }
                }
            }
        }
        read
    }

    fn refused(&mut self, reason: Refusal, now_ns: u64) {
        self.metrics
            .peer_refused
            .get_or_create(&Label {
                value: reason.label().into(),
            })
            .inc();
        let (ok, dropped) = self.logs.allow(LogKind::Refused, now_ns);
        if dropped > 0 {
            warn!(dropped, "peer refusals not logged in the last second");
        }
        if ok {
            warn!(%reason, "peer datagram refused");
        }
    }

    /// Hands the channel this host's current demands (only those that changed) and its
    /// grant, lets silent peers lapse, and sends what is due.
    pub fn flush(&mut self, now: Duration) {
        self.channel.handle_timeout(now);
        while let Some(t) = self.channel.poll_transmit(now) {
            let Some(addr) = discover(&self.settings, t.to) else {
                self.refused_send(t.to, "no address (map its GID in [peer.hosts])");
                continue;
            };
            let Some(socket) = &self.socket else {
                // The channel is down until the port binds: the refresh makes this good.
                self.metrics.peer_send_failed.inc();
                continue;
            };
            match socket.send_to(&t.bytes, addr) {
                Ok(_) => {
                    self.metrics.peer_sent.inc();
                    self.metrics.peer_sent_bytes.inc_by(t.bytes.len() as u64);
                }
                Err(e) => {
                    self.metrics.peer_send_failed.inc();
                    if self.logs.allow(LogKind::Refused, now.as_nanos() as u64).0 {
                        warn!(peer = %t.to, %addr, error = %e, "peer datagram not sent");
                    }
                }
            }
        }
    }

    fn refused_send(&mut self, peer: NodeId, why: &str) {
        self.metrics.peer_send_failed.inc();
        if self.logs.allow(LogKind::Refused, 0).0 {
            warn!(%peer, why, "peer datagram not sent");
        }
    }

    /// This host's demands now, all peers at once: peers missing from `demands` hold
    /// nothing any more.
    pub fn set_demands(&mut self, now: Duration, demands: BTreeMap<NodeId, Vec<DemandEntry>>) {
        let gone: Vec<NodeId> = self
            .demanded
            .keys()
            .filter(|p| !demands.contains_key(p))
            .copied()
            .collect();
        for peer in gone {
            if self.channel.set_demand(now, peer, &[]).is_ok() {
                self.demanded.remove(&peer);
            }
        }
        for (peer, entries) in demands {
            if self.demanded.get(&peer) == Some(&entries) {
                continue;
            }
            match self.channel.set_demand(now, peer, &entries) {
                Ok(()) => {
                    self.demanded.insert(peer, entries);
                }
                Err(reason) => self.refused(reason, now.as_nanos() as u64),
            }
        }
    }

    /// This host's grant after an update of its loop (its READ guarantee; its link for
    /// incast).
    pub fn set_grant(&mut self, now: Duration, guarantee: &ReadGuarantee, link_bytes_per_sec: f64) {
        self.channel.set_grant(now, guarantee, link_bytes_per_sec);
    }

    /// This host's link, for the incast share it grants before its loop has announced a
    /// READ guarantee (see [`Channel::set_link`]).
    pub fn set_link(&mut self, now: Duration, link_bytes_per_sec: f64, whole: &ReadGuarantee) {
        self.channel.set_link(now, link_bytes_per_sec, whole);
    }

    /// The offer of this host's reference probe to its reference peer (see
    /// [`crate::wire_probe`]); sent while it stands, again every
    /// [`justitia_peer::channel::PROBE_REFRESH`].
    pub fn set_probe_offer(&mut self, now: Duration, peer: NodeId, offer: Option<ProbeEndpoint>) {
        if let Err(reason) = self.channel.set_probe_offer(now, peer, offer) {
            if self.logs.allow(LogKind::Refused, now.as_nanos() as u64).0 {
                warn!(peer = %host_name(peer), %reason, "no probe offer to the reference peer: the probe stays in loopback");
            }
        }
    }

    /// The answer to a member's probe offer: the responder made for it.
    pub fn set_probe_answer(&mut self, now: Duration, peer: NodeId, answer: Option<ProbeEndpoint>) {
        if let Err(reason) = self.channel.set_probe_answer(now, peer, answer) {
            if self.logs.allow(LogKind::Refused, now.as_nanos() as u64).0 {
                warn!(peer = %host_name(peer), %reason, "a member's probe not answered");
            }
        }
    }

    /// The pairings of this host's queue pairs connected to `peer` (see
    /// [`crate::pairing`]); sent when they change and again in rotation (see
    /// [`Channel::set_pairings`](justitia_peer::channel::Channel::set_pairings)).
    pub fn set_pairings(&mut self, now: Duration, peer: NodeId, pairings: &[Pairing]) {
        if let Err(reason) = self.channel.set_pairings(now, peer, pairings) {
            if self.logs.allow(LogKind::Refused, now.as_nanos() as u64).0 {
                warn!(peer = %host_name(peer), %reason, "pairings not sent: their queue pairs' requests go whole");
            }
        }
    }

    /// The remote READ units this host serves: one per (peer, tenant, class).
    pub fn served_reads(&self) -> Vec<RemoteReadUnit> {
        self.channel
            .served()
            .filter(|(_, e)| e.role == Role::Read)
            .map(|(_, e)| RemoteReadUnit {
                class: e.class,
                // The wire guarantees 1 <= weight.
                weight: Weight::new(e.weight).unwrap_or(Weight::ONE),
            })
            .collect()
    }

    /// The next event for the server.
    pub fn poll_event(&mut self) -> Option<ChannelEvent> {
        self.channel.poll_event()
    }

    /// When the link next needs [`flush`](Self::flush).
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.channel.poll_timeout()
    }

    /// The newest grant a peer gave this host, while it holds.
    pub fn grant_from(&self, peer: NodeId) -> Option<justitia_peer::wire::Grant> {
        self.channel.grant_from(peer)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    use std::os::unix::fs::PermissionsExt;

    /// Host `n`'s key: fixed bytes.
    fn key(n: u8) -> PrivateKey {
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = n.wrapping_mul(13).wrapping_add(i as u8);
        }
        PrivateKey::from_bytes(bytes).unwrap()
    }

    /// Hosts 10.0.0.1 and 10.0.0.2 (keys 1 and 2) are the members.
    fn settings(node: &str, key_file: PathBuf) -> PeerSettings {
        PeerSettings {
            node: parse_gid(node).unwrap(),
            probe_to: None,
            listen: "127.0.0.1:0".parse().unwrap(),
            port: DEFAULT_PORT,
            key: KeySource::File(key_file),
            members: [
                (parse_gid("10.0.0.1").unwrap(), key(1).public()),
                (parse_gid("10.0.0.2").unwrap(), key(2).public()),
            ]
            .into_iter()
            .collect(),
            hosts: BTreeMap::new(),
            lids: BTreeMap::new(),
            channel: ChannelConfig::default(),
            members_file: None,
            table_hosts: BTreeMap::new(),
        }
    }

    fn write_key(dir: &tempfile::TempDir, name: &str, text: &[u8], mode: u32) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    fn key_file(dir: &tempfile::TempDir, n: u8) -> PathBuf {
        write_key(
            dir,
            &format!("key{n}"),
            key(n).to_base64().as_bytes(),
            0o600,
        )
    }

    fn ns() -> u64 {
        0
    }

    #[test]
    fn gids_parse_in_every_written_form_and_roce_gids_give_the_address() {
        let v4 = parse_gid("10.0.0.2").unwrap();
        assert_eq!(
            v4,
            parse_gid("0000:0000:0000:0000:0000:ffff:0a00:0002").unwrap()
        );
        assert_eq!(v4, parse_gid("::ffff:10.0.0.2").unwrap());
        assert!(parse_gid("10.0.0").is_err());
        let dir = tempfile::tempdir().unwrap();
        let mut s = settings("10.0.0.1", key_file(&dir, 1));
        assert_eq!(discover(&s, v4), Some("10.0.0.2:7471".parse().unwrap()));
        let global = parse_gid("2001:db8::5").unwrap();
        assert_eq!(
            discover(&s, global),
            Some("[2001:db8::5]:7471".parse().unwrap())
        );
        // InfiniBand's (and RoCE v1's) link-local GIDs need the map.
        let ib = parse_gid("fe80::0002:c903:0001:2345").unwrap();
        assert_eq!(discover(&s, ib), None);
        s.hosts.insert(ib, "192.168.1.7:9000".parse().unwrap());
        assert_eq!(discover(&s, ib), Some("192.168.1.7:9000".parse().unwrap()));
    }

    /// Receivers B (share 6e9 per unit of weight) and C (2e9). Tenant 1 (weight 2) has
    /// two active bandwidth flows into B, an idle one into B, one into C, a READ flow
    /// against B, a latency flow into B and one going nowhere; tenant 2 (weight 1) one
    /// into B. Into B, tenant 1's 2 x 6e9 is split between its two active bandwidth flows
    /// (6e9 each; the idle one, were it to send, gets the same), its flow into C has
    /// 2 x 2e9 alone, tenant 2's has 6e9; nothing else is capped. Past the lapse, nothing.
    #[test]
    fn incast_caps_split_a_tenants_share_among_its_active_bandwidth_flows_into_the_peer() {
        let b = parse_gid("10.0.0.2").unwrap();
        let c = parse_gid("10.0.0.3").unwrap();
        let mut limits = IncastLimits::new(Duration::from_millis(20));
        let now = Duration::from_millis(1);
        limits.grant_received(now, responder_key(b), 6e9).unwrap();
        limits.grant_received(now, responder_key(c), 2e9).unwrap();
        let flow = |tenant: u64, class: FlowClass, remote: Option<(NodeId, Role)>, active: bool| {
            IncastFlow {
                tenant: TenantId(tenant),
                class,
                remote,
                active,
            }
        };
        let bw = FlowClass::Bandwidth;
        let into_b = flow(1, bw, Some((b, Role::Incast)), true);
        let idle_into_b = flow(1, bw, Some((b, Role::Incast)), false);
        let into_c = flow(1, bw, Some((c, Role::Incast)), true);
        let reads_b = flow(1, bw, Some((b, Role::Read)), true);
        let latency_into_b = flow(1, FlowClass::Latency, Some((b, Role::Incast)), true);
        let nowhere = flow(1, bw, None, true);
        let other_tenant = flow(2, bw, Some((b, Role::Incast)), true);
        let flows = [
            into_b,
            into_b,
            idle_into_b,
            into_c,
            reads_b,
            latency_into_b,
            nowhere,
            other_tenant,
        ];
        let two = Weight::new(2).unwrap();
        let caps = IncastCaps::new(&limits, now, flows);
        assert_eq!(caps.cap(&into_b, two), Some(6e9));
        assert_eq!(caps.cap(&idle_into_b, two), Some(6e9));
        assert_eq!(caps.cap(&into_c, two), Some(4e9));
        assert_eq!(caps.cap(&other_tenant, Weight::ONE), Some(6e9));
        for f in [reads_b, latency_into_b, nowhere] {
            assert_eq!(caps.cap(&f, two), None, "{f:?}");
        }
        let later = IncastCaps::new(&limits, Duration::from_millis(21), flows);
        assert_eq!(later.cap(&into_b, two), None, "lapsed");
    }

    #[test]
    fn demands_count_flows_per_tenant_class_and_role() {
        let b = parse_gid("10.0.0.2").unwrap();
        let f = |tenant, class, role| LoadingFlow {
            peer: b,
            tenant: TenantId(tenant),
            class,
            role,
            weight: Weight::ONE,
        };
        let d = demands([
            f(1, FlowClass::Bandwidth, Role::Read),
            f(1, FlowClass::Bandwidth, Role::Read),
            f(1, FlowClass::Bandwidth, Role::Incast),
            f(2, FlowClass::Latency, Role::Read),
        ]);
        let entries = &d[&b];
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0].flows + entries[1].flows + entries[2].flows, 4);
    }

    /// Two daemons' links on loopback: A's READ demand reaches B, B counts one READ unit
    /// and its grant comes back; a datagram signed with another key is refused, counted
    /// under `authentication`, and changes nothing.
    #[test]
    fn two_links_exchange_a_demand_and_a_grant_and_refuse_a_forgery() {
        let dir = tempfile::tempdir().unwrap();
        let (ma, mb) = (Metrics::new(), Metrics::new());
        let mut b = PeerLink::bind(
            settings("10.0.0.2", key_file(&dir, 2)),
            Duration::ZERO,
            mb.clone(),
        )
        .unwrap();
        let b_addr = b.local_addr().unwrap();
        let b_node = parse_gid("10.0.0.2").unwrap();
        let mut sa = settings("10.0.0.1", key_file(&dir, 1));
        sa.hosts.insert(b_node, b_addr);
        let mut a = PeerLink::bind(sa, Duration::ZERO, ma.clone()).unwrap();
        let a_node = parse_gid("10.0.0.1").unwrap();
        b.settings.hosts.insert(a_node, a.local_addr().unwrap());
        // B's greeting went nowhere (A's address was not known yet): A's own makes the
        // session.
        let exchange = |a: &mut PeerLink, b: &mut PeerLink, t: Duration| {
            for _ in 0..4 {
                a.flush(t);
                b.flush(t);
                std::thread::sleep(Duration::from_millis(2));
                a.receive(t, u64::MAX, ns);
                b.receive(t, u64::MAX, ns);
            }
        };

        let t = Duration::from_millis(1);
        a.set_demands(
            t,
            demands([LoadingFlow {
                peer: b_node,
                tenant: TenantId(1000),
                class: FlowClass::Bandwidth,
                role: Role::Read,
                weight: Weight::ONE,
            }]),
        );
        exchange(&mut a, &mut b, t);
        assert!(ma.peer_sent.get() >= 2, "A's initiation and its demand");
        assert!(mb.peer_received.get() >= 2, "A's initiation and its demand");
        assert_eq!(b.poll_event(), Some(ChannelEvent::ServedChanged));
        assert_eq!(
            b.served_reads(),
            vec![RemoteReadUnit {
                class: FlowClass::Bandwidth,
                weight: Weight::ONE
            }]
        );
        let g = ReadGuarantee {
            epoch: 0,
            sequence: 0,
            fraction: 0.5,
            bytes_per_sec: 6.25e9,
            ops_per_sec: 5e7,
            chunk_bytes: 5120,
        };
        b.set_grant(t, &g, 12.5e9);
        exchange(&mut a, &mut b, t);
        match a.poll_event() {
            Some(ChannelEvent::Guarantee {
                peer, guarantee, ..
            }) => {
                assert_eq!(peer, b_node);
                assert_eq!(guarantee.bytes_per_sec, 6.25e9);
            }
            other => panic!("{other:?}"),
        }

        // A forger claiming A's node without A's key: refused as unauthenticated, counted,
        // nothing changes.
        let mut forger_settings = settings("10.0.0.1", key_file(&dir, 3));
        forger_settings.hosts.insert(b_node, b_addr);
        let mut forger = PeerLink::bind(forger_settings, Duration::ZERO, Metrics::new()).unwrap();
        forger.set_demands(
            t,
            demands([LoadingFlow {
                peer: b_node,
                tenant: TenantId(1),
                class: FlowClass::Bandwidth,
                role: Role::Read,
                weight: Weight::new(1000).unwrap(),
            }]),
        );
        forger.flush(t);
        for _ in 0..100 {
            if b.receive(t, u64::MAX, ns) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let refused = |reason: &str| {
            mb.peer_refused
                .get_or_create(&Label {
                    value: reason.into(),
                })
                .get()
        };
        assert_eq!(refused("authentication"), 1);
        assert_eq!(b.poll_event(), None);
        assert_eq!(b.served_reads().len(), 1, "still A's one unit");
    }

    /// Issue 36: keys at 0644 and 0666, an all-zero key and a key of newlines were
    /// accepted without a word, and the key was read with no size bound.
    #[test]
    fn bad_key_files_are_refused_naming_the_file_and_the_fault() {
        let dir = tempfile::tempdir().unwrap();
        let good = key(1).to_base64();
        let fault = |path: PathBuf| read_key_file(&path).err().unwrap().to_string();
        for mode in [0o644, 0o666, 0o640, 0o602] {
            let path = write_key(&dir, &format!("m{mode:o}"), good.as_bytes(), mode);
            let e = fault(path);
            assert!(
                e.contains(&format!("m{mode:o}")) && e.contains(&format!("mode 0{mode:o}")),
                "{e}"
            );
        }
        let zero = STANDARD_ZERO.to_string();
        let e = fault(write_key(&dir, "zero", zero.as_bytes(), 0o600));
        assert!(e.contains("zero") && e.contains("degenerate"), "{e}");
        let e = fault(write_key(&dir, "newlines", b"\n\n\n\n", 0o600));
        assert!(e.contains("newlines") && e.contains("not a key"), "{e}");
        let big = vec![b'A'; 5000];
        let e = fault(write_key(&dir, "big", &big, 0o600));
        assert!(e.contains("big") && e.contains("larger than 4096"), "{e}");
        let e = fault(dir.path().join("absent"));
        assert!(e.contains("absent"), "{e}");
        let fifo = dir.path().join("fifo");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let e = fault(fifo);
        assert!(e.contains("not a regular file"), "{e}");
        // 0600 and 0400 are taken, with the newline `genkey` writes.
        for mode in [0o600, 0o400] {
            let path = write_key(
                &dir,
                &format!("ok{mode:o}"),
                format!("{good}\n").as_bytes(),
                mode,
            );
            assert_eq!(read_key_file(&path).unwrap(), key(1));
        }
    }

    /// The base64 of 32 zero bytes.
    const STANDARD_ZERO: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

    #[test]
    fn a_credential_is_read_from_the_credentials_directory() {
        let dir = tempfile::tempdir().unwrap();
        let source = KeySource::Credential("peer.key".into());
        // The variable is the process's; this is the only test that reads it.
        std::env::remove_var("CREDENTIALS_DIRECTORY");
        let e = load_key(&source).err().unwrap().to_string();
        assert!(
            e.contains("CREDENTIALS_DIRECTORY") && e.contains("LoadCredential"),
            "{e}"
        );
        write_key(&dir, "peer.key", key(2).to_base64().as_bytes(), 0o400);
        std::env::set_var("CREDENTIALS_DIRECTORY", dir.path());
        assert_eq!(load_key(&source).unwrap(), key(2));
        std::env::remove_var("CREDENTIALS_DIRECTORY");
    }

    #[test]
    fn only_members_are_peers() {
        let dir = tempfile::tempdir().unwrap();
        let link = PeerLink::bind(
            settings("10.0.0.1", key_file(&dir, 1)),
            Duration::ZERO,
            Metrics::new(),
        )
        .unwrap();
        let b = parse_gid("10.0.0.2").unwrap();
        let stranger = parse_gid("127.1.0.5").unwrap();
        assert!(link.is_member(b));
        assert!(!link.is_member(stranger));
        assert!(
            !link.is_member(parse_gid("10.0.0.1").unwrap()),
            "not itself"
        );
        assert_eq!(link.peer_of(RemoteEnd::Gid(b)), Some(b));
        assert_eq!(link.peer_of(RemoteEnd::Gid(stranger)), None);
    }

    #[test]
    fn a_changed_members_file_is_taken_and_a_bad_one_refused_with_the_members_kept() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("members.toml");
        // As kubelet updates a ConfigMap volume: a new file renamed over the old.
        let publish = |text: String| {
            let tmp = dir.path().join(".members.new");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &file).unwrap();
        };
        let line = |ip: &str, n: u8| format!("\"{ip}\" = \"{}\"\n", key(n).public());
        publish(line("10.0.0.1", 1) + &line("10.0.0.2", 2));
        let mut s = settings("10.0.0.1", key_file(&dir, 1));
        s.members_file = Some(file.clone());
        let metrics = Metrics::new();
        let mut link = PeerLink::bind(s, Duration::ZERO, metrics.clone()).unwrap();
        let (b, c) = (
            parse_gid("10.0.0.2").unwrap(),
            parse_gid("10.0.0.3").unwrap(),
        );
        let secs = Duration::from_secs;
        assert!(
            !link.poll_members_file(secs(0)),
            "the same list as at start"
        );
        assert!(link.is_member(b) && !link.is_member(c));
        // A node added: taken at the next look (at most a second later).
        publish(line("10.0.0.1", 1) + &line("10.0.0.2", 2) + &line("10.0.0.3", 3));
        assert!(!link.poll_members_file(secs(0) + Duration::from_millis(300)));
        assert!(link.poll_members_file(secs(1)));
        assert!(link.is_member(b) && link.is_member(c));
        assert_eq!(metrics.peer_members.get(), 3);
        // A bad list (two hosts with one key): refused, counted, the members kept.
        publish(line("10.0.0.1", 1) + &line("10.0.0.2", 2) + &line("10.0.0.3", 2));
        assert!(!link.poll_members_file(secs(2)));
        assert!(link.is_member(b) && link.is_member(c));
        assert_eq!(metrics.peer_member_lists_refused.get(), 1);
        // Unparsable: the same.
        publish("\"10.0.0.2\" = ".into());
        assert!(!link.poll_members_file(secs(3)));
        assert!(link.is_member(c));
        assert_eq!(metrics.peer_member_lists_refused.get(), 2);
        // A node removed.
        publish(line("10.0.0.1", 1) + &line("10.0.0.3", 3));
        assert!(link.poll_members_file(secs(4)));
        assert!(!link.is_member(b) && link.is_member(c));
        assert_eq!(metrics.peer_members.get(), 2);
    }
}
