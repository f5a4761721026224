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
//! Invariants: the socket never blocks (it is opened non-blocking); a pass reads at most
//! [`DATAGRAMS_PER_PASS`] datagrams; every refusal is counted under its reason and logged
//! at most [`crate::limits::LOG_BURST`] times a second; a refused datagram changes no
//! state (the channel's guarantee).

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::Duration;

use justitia_core::flow::{FlowClass, TenantId, Weight};
use justitia_core::incast::IncastLimits;
use justitia_core::remote_read::{ReadGuarantee, RemoteReadUnit};
use justitia_peer::channel::{Channel, ChannelConfig, ChannelEvent};
use justitia_peer::wire::{ClusterKey, DemandEntry, Role, MAX_DATAGRAM};
use justitia_peer::{NodeId, Refusal};
use tracing::warn;

use crate::limits::{LogKind, LogLimiter};
use crate::metrics::{Label, Metrics};

/// Datagrams read per pass of the loop at most; more wait for the next pass.
pub const DATAGRAMS_PER_PASS: usize = 64;

/// The port a peer daemon listens on by default.
pub const DEFAULT_PORT: u16 = 7471;

/// The `[peer]` settings (see `packaging/justitiad.toml`).
#[derive(Debug, Clone, PartialEq)]
pub struct PeerSettings {
    /// This host's node id: its RDMA port's GID.
    pub node: NodeId,
    /// The address the socket binds.
    pub listen: SocketAddr,
    /// The port peer daemons listen on (RoCE discovery).
    pub port: u16,
    /// The cluster key file.
    pub key_file: PathBuf,
    /// InfiniBand (or link-local) peers: GID to address.
    pub hosts: BTreeMap<NodeId, SocketAddr>,
    /// InfiniBand peers addressed by LID alone: LID to GID.
    pub lids: BTreeMap<u16, NodeId>,
    /// The channel's caps and timers.
    pub channel: ChannelConfig,
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

/// A peer link that could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The key file could not be read.
    #[error("peer key_file {path}: {source}")]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The key is too short.
    #[error("peer key_file {path}: {source}")]
    Key {
        /// The file.
        path: PathBuf,
        /// Why.
        source: justitia_peer::wire::ShortKey,
    },
    /// The socket could not be bound.
    #[error("peer socket {addr}: {source}")]
    Socket {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The channel's settings contradict each other.
    #[error("peer settings: {0}")]
    Config(#[from] justitia_peer::channel::ConfigError),
}

/// The daemon's end of the peer channel (see the module documentation).
pub struct PeerLink {
    settings: PeerSettings,
    socket: UdpSocket,
    channel: Channel,
    metrics: Metrics,
    logs: LogLimiter,
    buf: Vec<u8>,
    /// The demands last handed to the channel, by peer, so that only changes go to it.
    demanded: BTreeMap<NodeId, Vec<DemandEntry>>,
}

impl PeerLink {
    /// Reads the key, binds the socket (non-blocking) and starts the channel in
    /// incarnation `epoch` (the daemon's wall-clock start in nanoseconds).
    pub fn bind(
        settings: PeerSettings,
        epoch: u64,
        now: Duration,
        metrics: Metrics,
    ) -> Result<Self, PeerError> {
        let bytes = std::fs::read(&settings.key_file).map_err(|source| PeerError::KeyFile {
            path: settings.key_file.clone(),
            source,
        })?;
        let key = ClusterKey::from_file_contents(&bytes).map_err(|source| PeerError::Key {
            path: settings.key_file.clone(),
            source,
        })?;
        let socket_err = |source| PeerError::Socket {
            addr: settings.listen,
            source,
        };
        let socket = UdpSocket::bind(settings.listen).map_err(socket_err)?;
        socket.set_nonblocking(true).map_err(socket_err)?;
        let channel = Channel::new(settings.channel, key, settings.node, epoch, now)?;
        for reason in Refusal::LABELS {
            let _ = metrics.peer_refused.get_or_create(&Label {
                value: reason.into(),
            });
        }
        Ok(PeerLink {
            settings,
            socket,
            channel,
            metrics,
            logs: LogLimiter::default(),
            buf: vec![0; MAX_DATAGRAM + 1],
            demanded: BTreeMap::new(),
        })
    }

    /// The socket, for the loop's epoll.
    pub fn socket(&self) -> std::os::fd::BorrowedFd<'_> {
        self.socket.as_fd()
    }

    /// The address the socket is bound to.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// The settings.
    pub fn settings(&self) -> &PeerSettings {
        &self.settings
    }

    /// The peer a flow's remote end names, if it names one this host can reach.
    pub fn peer_of(&self, end: RemoteEnd) -> Option<NodeId> {
        let node = match end {
            RemoteEnd::Gid(gid) => gid,
            RemoteEnd::Lid(lid) => *self.settings.lids.get(&lid)?,
        };
        (node != self.settings.node).then_some(node)
    }

    /// Whether `node` is a member of the peer channel: a host other than this one that the
    /// channel can address. A shaper's remote end counts only when it names a member (see
    /// `server/registration.rs`), so a local tenant cannot make this daemon hold state
    /// for, or send datagrams to, a node of its choosing.
    pub fn is_member(&self, node: NodeId) -> bool {
        node != self.settings.node && discover(&self.settings, node).is_some()
    }

    /// Reads datagrams until none is left, [`DATAGRAMS_PER_PASS`] were read, or `deadline`
    /// (ns on the loop's clock, checked against `clock`) has passed. Returns how many.
    pub fn receive(&mut self, now: Duration, deadline: u64, clock: impl Fn() -> u64) -> usize {
        let mut read = 0;
        while read < DATAGRAMS_PER_PASS && clock() <= deadline {
            let n = match self.socket.recv_from(&mut self.buf) {
                Ok((n, _from)) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ICMP errors from an earlier send surface here (ECONNREFUSED): the
                    // peer's daemon is not running; the datagram is gone either way.
                    if self.logs.allow(LogKind::Refused, clock()).0 {
                        warn!(error = %e, "peer socket");
                    }
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
                Err(reason) => self.refused(reason, clock()),
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
            match self.socket.send_to(&t.bytes, addr) {
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

    fn settings(node: &str, key_file: PathBuf) -> PeerSettings {
        PeerSettings {
            node: parse_gid(node).unwrap(),
            listen: "127.0.0.1:0".parse().unwrap(),
            port: DEFAULT_PORT,
            key_file,
            hosts: BTreeMap::new(),
            lids: BTreeMap::new(),
            channel: ChannelConfig::default(),
        }
    }

    fn key_file(dir: &tempfile::TempDir, byte: u8) -> PathBuf {
        let path = dir.path().join(format!("key{byte}"));
        std::fs::write(&path, [byte; 32]).unwrap();
        path
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
        let key = key_file(&dir, 1);
        let (ma, mb) = (Metrics::new(), Metrics::new());
        let mut b = PeerLink::bind(
            settings("10.0.0.2", key.clone()),
            2,
            Duration::ZERO,
            mb.clone(),
        )
        .unwrap();
        let b_addr = b.local_addr().unwrap();
        let b_node = parse_gid("10.0.0.2").unwrap();
        let mut sa = settings("10.0.0.1", key.clone());
        sa.hosts.insert(b_node, b_addr);
        let mut a = PeerLink::bind(sa, 1, Duration::ZERO, ma.clone()).unwrap();
        let a_node = parse_gid("10.0.0.1").unwrap();
        b.settings.hosts.insert(a_node, a.local_addr().unwrap());

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
        a.flush(t);
        assert_eq!(ma.peer_sent.get(), 1);
        // Loopback delivers at once, but give the kernel a moment.
        let mut got = 0;
        for _ in 0..100 {
            got += b.receive(t, u64::MAX, ns);
            if got > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(mb.peer_received.get(), 1);
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
        b.flush(t);
        for _ in 0..100 {
            if a.receive(t, u64::MAX, ns) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        match a.poll_event() {
            Some(ChannelEvent::Guarantee {
                peer, guarantee, ..
            }) => {
                assert_eq!(peer, b_node);
                assert_eq!(guarantee.bytes_per_sec, 6.25e9);
            }
            other => panic!("{other:?}"),
        }

        // A forger without the key: refused as unauthenticated, counted, nothing changes.
        let other_key = key_file(&dir, 2);
        let mut forger_settings = settings("10.0.0.1", other_key);
        forger_settings.hosts.insert(b_node, b_addr);
        let mut forger =
            PeerLink::bind(forger_settings, 9, Duration::ZERO, Metrics::new()).unwrap();
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

    #[test]
    fn a_short_or_missing_key_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, b"secret\n").unwrap();
        let e = PeerLink::bind(
            settings("10.0.0.1", short),
            1,
            Duration::ZERO,
            Metrics::new(),
        )
        .err()
        .unwrap();
        assert!(
            e.to_string().contains("short") && e.to_string().contains("32"),
            "{e}"
        );
        let e = PeerLink::bind(
            settings("10.0.0.1", dir.path().join("absent")),
            1,
            Duration::ZERO,
            Metrics::new(),
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("absent"), "{e}");
    }
}
