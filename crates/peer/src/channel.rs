//! One host's end of the peer channel: what it tells each peer, what each peer told it.
//!
//! [`Channel`] is fed datagrams ([`receive`](Channel::receive)), this host's demands
//! against each peer ([`set_demand`](Channel::set_demand)) and its current grant
//! ([`set_grant`](Channel::set_grant)), and the time; it hands out datagrams to send
//! ([`poll_transmit`](Channel::poll_transmit)) and [`ChannelEvent`]s, and says when it next
//! needs the time ([`poll_timeout`](Channel::poll_timeout)).
//!
//! # Sending
//! A demand goes to a peer when it changes and again every [`ChannelConfig::refresh`]
//! while it is not empty (one empty demand tells the peer the flows are gone). The grant
//! goes to every peer that holds flows against this host when it changes and every
//! refresh. Its incast share is the core's ([`justitia_core::incast::incast_share`]) over
//! the incast units the peers declare, one per (peer, tenant, class) at its weight, and is
//! rebuilt whenever what they declare changes. No peer is sent more than
//! `max_messages_per_sec / 2` messages a second, in bursts of at most [`SEND_BURST`] (a
//! demand and a grant due together both go at once), so a sender stays at half its peer's
//! cap; changes in between coalesce.
//!
//! # Receiving
//! A datagram is decoded ([`crate::wire::decode`]: framing, tag, ranges), must be for this
//! host and not from it, must find room in the peer table, must be within the peer's rate
//! (a token bucket of [`ChannelConfig::max_messages_per_sec`], a tenth of a second deep),
//! must be newer by (epoch, sequence) than the newest accepted from that peer, and a
//! demand must hold at most [`ChannelConfig::max_flows_per_peer`] flows. Only then does it
//! change anything. A peer that restarted sends a larger epoch, so it is believed at once.
//!
//! # Fail-open
//! A peer not heard from for [`ChannelConfig::silence`] stops counting here (its demands
//! are dropped) and stops constraining here (its grant lapses). Its (epoch, sequence) is
//! kept, so that its old messages cannot be replayed; only when the table is full is the
//! entry of a peer that holds nothing in either direction given up for a new peer, the one
//! heard from longest ago.
//!
//! Invariants: a refused datagram changes no state; the peer table never holds more than
//! [`ChannelConfig::max_peers`] entries, nor a peer's demand more than
//! `max_flows_per_peer` flows; a peer's accepted (epoch, sequence) only grows; this host's
//! sequence grows with every message it sends.

use std::time::Duration;

use justitia_core::flow::Weight;
use justitia_core::incast::{incast_share, IncastUnit};
use justitia_core::remote_read::ReadGuarantee;

use crate::wire::{self, Body, ClusterKey, DemandEntry, Grant, Header, Role, MAX_DEMAND_ENTRIES};
use crate::{NodeId, Refusal};

/// The channel's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChannelConfig {
    /// Peers held at once (each one this host loads or is loaded by).
    pub max_peers: usize,
    /// Flows one peer may hold against this host, summed over its demand's entries.
    pub max_flows_per_peer: u32,
    /// Messages a peer may send per second; a sender keeps to half of it.
    pub max_messages_per_sec: u32,
    /// A peer not heard from this long no longer counts or constrains here.
    pub silence: Duration,
    /// How often an unchanged demand or grant is sent again.
    pub refresh: Duration,
}

/// Messages a host may send one peer back to back: a demand and a grant due at the same
/// moment both go at once (the receiver's bucket takes at least four).
pub const SEND_BURST: f64 = 2.0;

/// [`ChannelConfig::silence`] by default: 20 ms, the core's own lapse of a READ guarantee
/// at the paper's RefPeriod (40 x 500 us), four refreshes.
pub const DEFAULT_SILENCE: Duration = Duration::from_millis(20);
/// [`ChannelConfig::refresh`] by default: 5 ms, so that one or two lost datagrams in a row
/// never let a live peer lapse.
pub const DEFAULT_REFRESH: Duration = Duration::from_millis(5);

impl Default for ChannelConfig {
    fn default() -> Self {
        ChannelConfig {
            max_peers: 64,
            max_flows_per_peer: 1024,
            max_messages_per_sec: 2000,
            silence: DEFAULT_SILENCE,
            refresh: DEFAULT_REFRESH,
        }
    }
}

/// A setting the channel cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A cap of zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// Refreshes too rare for the silence: a live peer would lapse.
    #[error("silence ({silence:?}) must be at least twice refresh ({refresh:?})")]
    SilenceShort {
        /// The silence.
        silence: Duration,
        /// The refresh.
        refresh: Duration,
    },
    /// Refreshing faster than the rate cap lets a sender send.
    #[error("refresh ({refresh:?}) is shorter than 2 / max_messages_per_sec")]
    RefreshFast {
        /// The refresh.
        refresh: Duration,
    },
}

impl ChannelConfig {
    /// Checks the settings against each other.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_peers == 0 {
            return Err(ConfigError::Zero("max_peers"));
        }
        if self.max_flows_per_peer == 0 {
            return Err(ConfigError::Zero("max_flows_per_peer"));
        }
        if self.max_messages_per_sec == 0 {
            return Err(ConfigError::Zero("max_messages_per_sec"));
        }
        if self.refresh.is_zero() {
            return Err(ConfigError::Zero("refresh"));
        }
        if self.silence < self.refresh.saturating_mul(2) {
            return Err(ConfigError::SilenceShort {
                silence: self.silence,
                refresh: self.refresh,
            });
        }
        if self.refresh < self.gap() {
            return Err(ConfigError::RefreshFast {
                refresh: self.refresh,
            });
        }
        Ok(())
    }

    /// The least time between two messages to one peer.
    fn gap(&self) -> Duration {
        Duration::from_secs(2) / self.max_messages_per_sec.max(1)
    }
}

/// A datagram to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// The peer it is for (the driver finds its address).
    pub to: NodeId,
    /// The datagram.
    pub bytes: Vec<u8>,
}

/// What the driver acts on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ChannelEvent {
    /// The flows peers hold against this host changed: read [`Channel::served`] again and
    /// tell the control loop.
    ServedChanged,
    /// A peer's newer guarantee: this host's READ flows against it are capped at it, and
    /// its bandwidth flows into it paced at `incast_bytes_per_sec` per unit of weight.
    Guarantee {
        /// The peer.
        peer: NodeId,
        /// Its READ guarantee, numbered by the grant's (epoch, sequence).
        guarantee: ReadGuarantee,
        /// Its incast share per unit of weight; 0 when it gives none.
        incast_bytes_per_sec: f64,
    },
    /// A peer went silent: its guarantee no longer constrains (fail-open).
    GuaranteeLapsed {
        /// The peer.
        peer: NodeId,
    },
}

/// A token bucket for a peer's messages.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Duration,
}

#[derive(Debug, Clone)]
struct Peer {
    node: NodeId,
    /// The newest (epoch, sequence) accepted from it.
    newest: Option<(u64, u64)>,
    heard_at: Duration,
    bucket: Bucket,
    /// Its flows against this host, from its latest demand.
    served: Vec<DemandEntry>,
    /// Its latest grant to this host.
    grant: Option<Grant>,
    /// This host's flows against it.
    demand: Vec<DemandEntry>,
    demand_dirty: bool,
    demand_sent: Option<Duration>,
    /// The grant last sent to it.
    granted: Option<Grant>,
    grant_sent: Option<Duration>,
    /// The sender's token bucket for messages to it: tokens at `send_at`.
    send_tokens: f64,
    send_at: Duration,
}

impl Peer {
    fn new(node: NodeId, now: Duration, burst: f64) -> Self {
        Peer {
            node,
            newest: None,
            heard_at: now,
            bucket: Bucket {
                tokens: burst,
                at: now,
            },
            served: Vec::new(),
            grant: None,
            demand: Vec::new(),
            demand_dirty: false,
            demand_sent: None,
            granted: None,
            grant_sent: None,
            send_tokens: SEND_BURST,
            send_at: now,
        }
    }

    /// Holds nothing in either direction: only its replay record would be lost.
    fn holds_nothing(&self) -> bool {
        self.served.is_empty() && self.grant.is_none() && self.demand.is_empty()
    }
}

/// One host's end of the channel (see the module documentation).
#[derive(Debug, Clone)]
pub struct Channel {
    config: ChannelConfig,
    key: ClusterKey,
    own: NodeId,
    epoch: u64,
    next_sequence: u64,
    peers: Vec<Peer>,
    /// The grant this host gives now, once it has one to give.
    grant: Option<Grant>,
    /// What the grant is built from: the loop's READ guarantee, the whole RNIC's for
    /// incast-only grants, and the link's rate.
    read_grant: Option<ReadGuarantee>,
    unconstrained: Option<ReadGuarantee>,
    link: f64,
    events: Vec<ChannelEvent>,
    now: Duration,
}

impl Channel {
    /// A channel for host `own` in its incarnation `epoch`, which must exceed that of any
    /// earlier incarnation (the daemon's wall-clock start in nanoseconds).
    pub fn new(
        config: ChannelConfig,
        key: ClusterKey,
        own: NodeId,
        epoch: u64,
        now: Duration,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Channel {
            config,
            key,
            own,
            epoch,
            next_sequence: 0,
            peers: Vec::new(),
            grant: None,
            read_grant: None,
            unconstrained: None,
            link: 0.0,
            events: Vec::new(),
            now,
        })
    }

    /// This host's node id.
    pub fn own(&self) -> NodeId {
        self.own
    }

    /// The settings.
    pub fn config(&self) -> &ChannelConfig {
        &self.config
    }

    fn advance(&mut self, now: Duration) -> Duration {
        self.now = self.now.max(now);
        self.now
    }

    fn burst(&self) -> f64 {
        (f64::from(self.config.max_messages_per_sec) / 10.0).max(4.0)
    }

    fn find(&self, node: NodeId) -> Option<usize> {
        self.peers.iter().position(|p| p.node == node)
    }

    /// The index of `node`'s entry, making one (evicting a peer that holds nothing, the one
    /// heard from longest ago) if there is none.
    fn slot(&mut self, node: NodeId, now: Duration) -> Result<usize, Refusal> {
        if let Some(i) = self.find(node) {
            return Ok(i);
        }
        if self.peers.len() >= self.config.max_peers {
            let victim = self
                .peers
                .iter()
                .enumerate()
                .filter(|(_, p)| p.holds_nothing())
                .min_by_key(|(_, p)| p.heard_at)
                .map(|(i, _)| i)
                .ok_or(Refusal::TooManyPeers)?;
            self.peers.swap_remove(victim);
        }
        let burst = self.burst();
        self.peers.push(Peer::new(node, now, burst));
        Ok(self.peers.len() - 1)
    }

    /// This host's flows against `peer` now (all of them: the demand replaces the last).
    /// Refused if the peer table is full, or the demand holds more entries than a message
    /// carries or more flows than a peer may hold.
    pub fn set_demand(
        &mut self,
        now: Duration,
        peer: NodeId,
        demand: &[DemandEntry],
    ) -> Result<(), Refusal> {
        let now = self.advance(now);
        if demand.len() > MAX_DEMAND_ENTRIES
            || demand.iter().map(|e| u32::from(e.flows)).sum::<u32>()
                > self.config.max_flows_per_peer
        {
            return Err(Refusal::TooManyFlows);
        }
        if demand.is_empty() && self.find(peer).is_none() {
            return Ok(());
        }
        let i = self.slot(peer, now)?;
        let p = &mut self.peers[i];
        if p.demand != demand {
            p.demand = demand.to_vec();
            p.demand_dirty = true;
        }
        Ok(())
    }

    /// The grant this host gives now: its READ guarantee (from the control loop's
    /// [`ReadGuarantee`] event, or the whole RNIC while it counts no remote READ; its own
    /// epoch and sequence are not sent, the message's are) and its link
    /// `link_bytes_per_sec`, shared among the incast flows it receives. The incast share is
    /// the core's ([`incast_share`]: one unit per sending host and tenant, at its weight)
    /// and follows the peers' demands as they change, without another call.
    pub fn set_grant(&mut self, now: Duration, guarantee: &ReadGuarantee, link_bytes_per_sec: f64) {
        self.advance(now);
        self.read_grant = Some(*guarantee);
        self.link = link_bytes_per_sec;
        self.regrant();
    }

    /// This host's link `link_bytes_per_sec`, to be shared among the incast flows it
    /// receives, before its loop has announced a READ guarantee: the grant then carries
    /// `unconstrained` (the whole RNIC, which constrains no READ) and is given only once
    /// some peer declares an incast flow, so that a READ requester's first grant is the
    /// loop's.
    pub fn set_link(
        &mut self,
        now: Duration,
        link_bytes_per_sec: f64,
        unconstrained: &ReadGuarantee,
    ) {
        self.advance(now);
        self.link = link_bytes_per_sec;
        self.unconstrained = Some(*unconstrained);
        self.regrant();
    }

    /// Rebuilds the grant from the READ guarantee and the incast units served now.
    fn regrant(&mut self) {
        let link = self.link;
        let units: Vec<IncastUnit> = self
            .peers
            .iter()
            .enumerate()
            .flat_map(|(i, p)| {
                p.served
                    .iter()
                    .filter(|e| e.role == Role::Incast)
                    .map(move |e| IncastUnit {
                        // The peer's place in the table: unique, so that two hosts never
                        // merge into one unit.
                        host: i as u64,
                        tenant: e.tenant,
                        class: e.class,
                        // The wire guarantees 1 <= weight.
                        weight: Weight::new(e.weight).unwrap_or(Weight::ONE),
                    })
            })
            .collect();
        let incast = incast_share(link, &units).map_or(0.0, |s| s.min(wire::MAX_BYTES_PER_SEC));
        let guarantee = match (self.read_grant, self.unconstrained) {
            (Some(g), _) => g,
            // Once given, a grant goes on (with no share when the incast is over), so
            // that its senders stop pacing at once rather than at the silence.
            (None, Some(g)) if incast > 0.0 || self.grant.is_some() => g,
            _ => return,
        };
        self.grant = Some(Grant {
            fraction: guarantee.fraction,
            bytes_per_sec: guarantee.bytes_per_sec,
            ops_per_sec: guarantee.ops_per_sec,
            chunk_bytes: guarantee.chunk_bytes,
            incast_bytes_per_sec: incast,
        });
    }

    /// The incast share this host grants now per unit of weight, bytes/s (0: none).
    pub fn incast_share(&self) -> f64 {
        self.grant.map_or(0.0, |g| g.incast_bytes_per_sec)
    }

    /// The flows peers hold against this host, with the peer that holds each.
    pub fn served(&self) -> impl Iterator<Item = (NodeId, &DemandEntry)> + '_ {
        self.peers
            .iter()
            .flat_map(|p| p.served.iter().map(move |e| (p.node, e)))
    }

    /// The newest grant `peer` gave this host, while it holds.
    pub fn grant_from(&self, peer: NodeId) -> Option<Grant> {
        self.find(peer).and_then(|i| self.peers[i].grant)
    }

    /// Takes a datagram from the network. A refused one changes nothing.
    pub fn receive(&mut self, now: Duration, datagram: &[u8]) -> Result<(), Refusal> {
        let now = self.advance(now);
        let (header, body) = wire::decode(&self.key, datagram)?;
        if header.to != self.own {
            return Err(Refusal::NotForUs);
        }
        if header.from == self.own {
            return Err(Refusal::FromSelf);
        }
        if let Body::Demand(entries) = &body {
            let flows: u32 = entries.iter().map(|e| u32::from(e.flows)).sum();
            if flows > self.config.max_flows_per_peer {
                return Err(Refusal::TooManyFlows);
            }
        }
        let known = self.find(header.from);
        if known.is_none() {
            match &body {
                // Nothing to keep: an unknown peer saying it holds nothing.
                Body::Demand(entries) if entries.is_empty() => return Ok(()),
                Body::Grant(_) => return Err(Refusal::Unsolicited),
                Body::Demand(_) => {}
            }
        }
        // Checks that need the peer's entry, on a copy, so that a refusal changes nothing.
        let mut peer = match known {
            Some(i) => self.peers[i].clone(),
            None => {
                if self.peers.len() >= self.config.max_peers
                    && !self.peers.iter().any(Peer::holds_nothing)
                {
                    return Err(Refusal::TooManyPeers);
                }
                Peer::new(header.from, now, self.burst())
            }
        };
        self.take_token(&mut peer.bucket, now)?;
        if peer
            .newest
            .is_some_and(|newest| (header.epoch, header.sequence) <= newest)
        {
            // The token stays spent: replays count against the rate too.
            if let Some(i) = known {
                self.peers[i].bucket = peer.bucket;
            }
            return Err(Refusal::Replayed);
        }
        if matches!(body, Body::Grant(_)) && !self.grant_expected(&peer, now) {
            return Err(Refusal::Unsolicited);
        }
        peer.newest = Some((header.epoch, header.sequence));
        peer.heard_at = now;
        let mut served_changed = false;
        match body {
            Body::Demand(mut entries) => {
                entries.sort_unstable();
                if entries != peer.served {
                    peer.served = entries;
                    served_changed = true;
                }
            }
            Body::Grant(grant) => {
                peer.grant = Some(grant);
                self.events.push(ChannelEvent::Guarantee {
                    peer: header.from,
                    guarantee: ReadGuarantee {
                        epoch: header.epoch,
                        sequence: header.sequence,
                        fraction: grant.fraction,
                        bytes_per_sec: grant.bytes_per_sec,
                        ops_per_sec: grant.ops_per_sec,
                        chunk_bytes: grant.chunk_bytes,
                    },
                    incast_bytes_per_sec: grant.incast_bytes_per_sec,
                });
            }
        }
        match known {
            Some(i) => self.peers[i] = peer,
            None => {
                let i = self.slot(header.from, now)?;
                self.peers[i] = peer;
            }
        }
        if served_changed {
            self.regrant();
            self.events.push(ChannelEvent::ServedChanged);
        }
        Ok(())
    }

    /// Whether a grant from `p` is one this host asked for: it holds flows against `p`, or
    /// withdrew the last of them less than `silence` ago. The peer grants until the empty
    /// demand reaches it, and refreshes its grant meanwhile: a flow that goes idle (or
    /// ends) has those grants in flight, which are no one's forgery. The peer stops
    /// within `silence` of the withdrawal whether or not the empty demand arrives (it
    /// lets this host's demands lapse), so after that a grant is unsolicited again.
    fn grant_expected(&self, p: &Peer, now: Duration) -> bool {
        !p.demand.is_empty()
            || p.demand_dirty
            || p.demand_sent
                .is_some_and(|t| t.saturating_add(self.config.silence) >= now)
    }

    fn take_token(&self, bucket: &mut Bucket, now: Duration) -> Result<(), Refusal> {
        let rate = f64::from(self.config.max_messages_per_sec);
        let elapsed = now.saturating_sub(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * rate).min(self.burst());
        bucket.at = now;
        if bucket.tokens < 1.0 {
            return Err(Refusal::RateLimited);
        }
        bucket.tokens -= 1.0;
        Ok(())
    }

    /// The next event, oldest first.
    pub fn poll_event(&mut self) -> Option<ChannelEvent> {
        if self.events.is_empty() {
            None
        } else {
            Some(self.events.remove(0))
        }
    }

    /// Lets peers that have been silent too long go (fail-open).
    pub fn handle_timeout(&mut self, now: Duration) {
        let now = self.advance(now);
        let silence = self.config.silence;
        let mut served_changed = false;
        for p in &mut self.peers {
            if p.heard_at.saturating_add(silence) > now {
                continue;
            }
            if !p.served.is_empty() {
                p.served.clear();
                served_changed = true;
            }
            if p.grant.take().is_some() {
                self.events
                    .push(ChannelEvent::GuaranteeLapsed { peer: p.node });
            }
        }
        if served_changed {
            self.regrant();
            self.events.push(ChannelEvent::ServedChanged);
        }
    }

    /// When the channel next needs [`handle_timeout`](Self::handle_timeout) or has a
    /// message to send.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let silence = self.config.silence;
        self.peers
            .iter()
            .flat_map(|p| {
                let lapse = (!p.served.is_empty() || p.grant.is_some())
                    .then(|| p.heard_at.saturating_add(silence));
                [lapse, self.send_due(p)]
            })
            .flatten()
            .min()
    }

    /// When the next message to `p` is due, if any.
    fn send_due(&self, p: &Peer) -> Option<Duration> {
        let refresh = self.config.refresh;
        let demand = if p.demand_dirty {
            Some(Duration::ZERO)
        } else if !p.demand.is_empty() {
            Some(
                p.demand_sent
                    .map_or(Duration::ZERO, |t| t.saturating_add(refresh)),
            )
        } else {
            None
        };
        let grant = match (self.grant, p.served.is_empty()) {
            (Some(g), false) if p.granted != Some(g) => Some(Duration::ZERO),
            (Some(_), false) => Some(p.grant_sent.map_or(Duration::ZERO, |t| t + refresh)),
            _ => None,
        };
        let due = demand.into_iter().chain(grant).min()?;
        let allowed = if p.send_tokens >= 1.0 {
            Duration::ZERO
        } else {
            p.send_at + Duration::from_secs_f64((1.0 - p.send_tokens) / self.send_rate())
        };
        Some(due.max(allowed))
    }

    /// Messages a second this host sends one peer at most: half the peer's cap.
    fn send_rate(&self) -> f64 {
        f64::from(self.config.max_messages_per_sec) / 2.0
    }

    /// The next datagram due by `now`, if any: call until `None`.
    pub fn poll_transmit(&mut self, now: Duration) -> Option<Transmit> {
        let now = self.advance(now);
        let i = (0..self.peers.len())
            .find(|&i| self.send_due(&self.peers[i]).is_some_and(|due| due <= now))?;
        let refresh = self.config.refresh;
        let p = &self.peers[i];
        let demand_due = p.demand_dirty
            || (!p.demand.is_empty()
                && p.demand_sent
                    .is_none_or(|t| t.saturating_add(refresh) <= now));
        let body = if demand_due {
            Body::Demand(p.demand.clone())
        } else {
            Body::Grant(self.grant?)
        };
        let header = Header {
            from: self.own,
            to: p.node,
            epoch: self.epoch,
            sequence: self.next_sequence,
        };
        self.next_sequence = self.next_sequence.saturating_add(1);
        let bytes = wire::encode(&self.key, &header, &body);
        let rate = self.send_rate();
        let p = &mut self.peers[i];
        let elapsed = now.saturating_sub(p.send_at).as_secs_f64();
        p.send_tokens = (p.send_tokens + elapsed * rate).min(SEND_BURST) - 1.0;
        p.send_at = now;
        match body {
            Body::Demand(_) => {
                p.demand_dirty = false;
                p.demand_sent = Some(now);
            }
            Body::Grant(g) => {
                p.granted = Some(g);
                p.grant_sent = Some(now);
            }
        }
        Some(Transmit { to: p.node, bytes })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use justitia_core::flow::{FlowClass, TenantId};
    use proptest::prelude::*;

    const A: NodeId = NodeId([0xa; 16]);
    const B: NodeId = NodeId([0xb; 16]);

    fn key() -> ClusterKey {
        ClusterKey::from_file_contents(&[7; 32]).unwrap()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn channel(own: NodeId, epoch: u64) -> Channel {
        Channel::new(ChannelConfig::default(), key(), own, epoch, Duration::ZERO).unwrap()
    }

    fn read(tenant: u64, flows: u16) -> DemandEntry {
        DemandEntry {
            tenant: TenantId(tenant),
            class: FlowClass::Bandwidth,
            role: Role::Read,
            flows,
            weight: 1,
        }
    }

    fn guarantee(fraction: f64) -> ReadGuarantee {
        ReadGuarantee {
            epoch: 99,
            sequence: 99,
            fraction,
            bytes_per_sec: fraction * 12.5e9,
            ops_per_sec: fraction * 1e8,
            chunk_bytes: 5120,
        }
    }

    /// Delivers everything `from` has to send at `now` to `to`; returns how many.
    fn deliver(from: &mut Channel, to: &mut Channel, now: Duration) -> usize {
        let mut n = 0;
        while let Some(t) = from.poll_transmit(now) {
            assert_eq!(t.to, to.own());
            to.receive(now, &t.bytes).unwrap();
            n += 1;
        }
        n
    }

    fn events(c: &mut Channel) -> Vec<ChannelEvent> {
        std::iter::from_fn(|| c.poll_event()).collect()
    }

    #[test]
    fn a_demand_reaches_the_peer_and_its_grant_comes_back_numbered_by_the_message() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_demand(ms(0), B, &[read(5, 3)]).unwrap();
        assert_eq!(deliver(&mut a, &mut b, ms(0)), 1);
        assert_eq!(events(&mut b), vec![ChannelEvent::ServedChanged]);
        let served: Vec<_> = b.served().map(|(n, e)| (n, *e)).collect();
        assert_eq!(served, vec![(A, read(5, 3))]);

        b.set_grant(ms(1), &guarantee(0.25), 12.5e9);
        assert_eq!(deliver(&mut b, &mut a, ms(1)), 1);
        match events(&mut a).as_slice() {
            [ChannelEvent::Guarantee {
                peer,
                guarantee: g,
                incast_bytes_per_sec,
            }] => {
                assert_eq!(*peer, B);
                assert_eq!((g.epoch, g.sequence), (2, 0), "the message's numbering");
                assert_eq!(g.fraction, 0.25);
                assert_eq!(g.bytes_per_sec, 0.25 * 12.5e9);
                assert_eq!(*incast_bytes_per_sec, 0.0, "no incast flows");
            }
            other => panic!("{other:?}"),
        }
        // Nothing new: nothing sent until the refresh.
        assert_eq!(deliver(&mut b, &mut a, ms(2)), 0);
        assert_eq!(deliver(&mut a, &mut b, ms(2)), 0);
        assert_eq!(a.poll_timeout(), Some(ms(5)), "A's demand refresh");
        assert_eq!(deliver(&mut a, &mut b, ms(5)), 1);
        assert_eq!(deliver(&mut b, &mut a, ms(6)), 1);
    }

    #[test]
    fn incast_senders_get_the_receivers_link_by_weight() {
        let mut a = channel(A, 1);
        let c_node = NodeId([0xc; 16]);
        let mut c = channel(c_node, 1);
        let mut r = channel(B, 2);
        let incast = |tenant, weight| DemandEntry {
            tenant: TenantId(tenant),
            class: FlowClass::Bandwidth,
            role: Role::Incast,
            flows: 1,
            weight,
        };
        a.set_demand(ms(0), B, &[incast(1, 1)]).unwrap();
        c.set_demand(ms(0), B, &[incast(1, 3)]).unwrap();
        deliver(&mut a, &mut r, ms(0));
        deliver(&mut c, &mut r, ms(0));
        r.set_grant(ms(1), &guarantee(1.0), 12.5e9);
        let mut to_a = None;
        while let Some(t) = r.poll_transmit(ms(1)) {
            if t.to == A {
                to_a = Some(t);
            }
        }
        a.receive(ms(1), &to_a.unwrap().bytes).unwrap();
        // Weights 1 and 3: 12.5e9 / 4 per unit of weight.
        assert_eq!(a.grant_from(B).unwrap().incast_bytes_per_sec, 12.5e9 / 4.0);
    }

    /// The receiver's share follows the senders it counts, with no new grant from the
    /// loop: one host is no incast (0: nothing to pace), a second sending host makes it
    /// half the link, and when that one goes silent there is no incast again after the
    /// silence.
    #[test]
    fn the_incast_share_follows_the_senders_as_they_come_and_go() {
        let link = 10e9;
        let mut r = channel(B, 2);
        r.set_grant(ms(0), &guarantee(1.0), link);
        assert_eq!(r.incast_share(), 0.0);
        let incast = DemandEntry {
            tenant: TenantId(1),
            class: FlowClass::Bandwidth,
            role: Role::Incast,
            flows: 2,
            weight: 1,
        };
        let mut a = channel(A, 1);
        a.set_demand(ms(0), B, &[incast]).unwrap();
        deliver(&mut a, &mut r, ms(0));
        assert_eq!(r.incast_share(), 0.0, "one host: no incast");
        let mut c = channel(NodeId([0xc; 16]), 1);
        c.set_demand(ms(1), B, &[incast]).unwrap();
        deliver(&mut c, &mut r, ms(1));
        assert_eq!(r.incast_share(), link / 2.0, "same tenant id, another host");
        // A keeps refreshing; C goes silent from 1 ms.
        for t in (5..=20).step_by(5) {
            deliver(&mut a, &mut r, ms(t));
            r.handle_timeout(ms(t));
        }
        assert_eq!(r.incast_share(), link / 2.0, "C still counted at 20 ms");
        r.handle_timeout(ms(21));
        assert_eq!(r.incast_share(), 0.0, "C lapsed at 1 + 20 ms: no incast");
    }

    #[test]
    fn replayed_and_reordered_messages_are_refused_and_change_nothing() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        let first = a.poll_transmit(ms(0)).unwrap();
        a.set_demand(ms(1), B, &[read(5, 2)]).unwrap();
        let second = a.poll_transmit(ms(1)).unwrap();
        b.receive(ms(1), &second.bytes).unwrap();
        assert_eq!(b.receive(ms(1), &second.bytes), Err(Refusal::Replayed));
        assert_eq!(b.receive(ms(1), &first.bytes), Err(Refusal::Replayed));
        let served: Vec<_> = b.served().map(|(_, e)| e.flows).collect();
        assert_eq!(served, vec![2]);
    }

    #[test]
    fn a_restarted_peer_is_believed_at_once_and_its_old_incarnation_is_not() {
        let mut b = channel(B, 2);
        let mut old = channel(A, 10);
        old.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        for _ in 0..3 {
            old.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        }
        let old_msg = old.poll_transmit(ms(0)).unwrap();
        b.receive(ms(0), &old_msg.bytes).unwrap();
        // The restarted daemon starts its sequence at 0 with a larger epoch.
        let mut new = channel(A, 11);
        new.set_demand(ms(1), B, &[read(6, 4)]).unwrap();
        b.receive(ms(1), &new.poll_transmit(ms(1)).unwrap().bytes)
            .unwrap();
        let served: Vec<_> = b.served().map(|(_, e)| (e.tenant, e.flows)).collect();
        assert_eq!(served, vec![(TenantId(6), 4)]);
        assert_eq!(b.receive(ms(1), &old_msg.bytes), Err(Refusal::Replayed));
    }

    #[test]
    fn a_silent_peer_stops_counting_and_constraining_after_the_silence_not_before() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        deliver(&mut a, &mut b, ms(0));
        b.set_grant(ms(0), &guarantee(0.5), 12.5e9);
        deliver(&mut b, &mut a, ms(0));
        events(&mut a);
        events(&mut b);
        // Both go silent. One tick before the silence both still hold.
        let silence = DEFAULT_SILENCE;
        a.handle_timeout(silence - Duration::from_nanos(1));
        b.handle_timeout(silence - Duration::from_nanos(1));
        assert!(a.grant_from(B).is_some());
        assert_eq!(b.served().count(), 1);
        assert_eq!(
            b.poll_timeout(),
            Some(ms(5)),
            "B's refresh of its grant to A"
        );
        a.handle_timeout(silence);
        b.handle_timeout(silence);
        assert_eq!(
            events(&mut a),
            vec![ChannelEvent::GuaranteeLapsed { peer: B }]
        );
        assert_eq!(events(&mut b), vec![ChannelEvent::ServedChanged]);
        assert_eq!(a.grant_from(B), None);
        assert_eq!(b.served().count(), 0);
        // Nothing left to send B for A's flows, and no lapse to wait for.
        assert_eq!(b.poll_transmit(silence), None);
    }

    #[test]
    fn a_message_for_another_host_or_from_itself_is_refused() {
        let mut a = channel(A, 1);
        let mut c = channel(NodeId([0xc; 16]), 1);
        a.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        let to_b = a.poll_transmit(ms(0)).unwrap();
        assert_eq!(c.receive(ms(0), &to_b.bytes), Err(Refusal::NotForUs));
        let mut b_self = channel(B, 1);
        let mut b = channel(B, 1);
        b_self.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        let looped = b_self.poll_transmit(ms(0)).unwrap();
        assert_eq!(b.receive(ms(0), &looped.bytes), Err(Refusal::FromSelf));
    }

    #[test]
    fn an_unsolicited_grant_is_refused() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
        deliver(&mut a, &mut b, ms(0));
        b.set_grant(ms(1), &guarantee(0.5), 12.5e9);
        let grant = b.poll_transmit(ms(1)).unwrap();
        // A host that holds no flow against B takes no grant from it.
        let mut fresh_a = channel(A, 3);
        assert_eq!(
            fresh_a.receive(ms(2), &grant.bytes),
            Err(Refusal::Unsolicited)
        );
        assert_eq!(fresh_a.grant_from(B), None);
        assert_eq!(a.receive(ms(2), &grant.bytes), Ok(()));
    }

    /// A flow that goes idle withdraws its demand; B's grants already on their way (and
    /// B's refreshes until the empty demand reaches it) are expected, not refused: in a
    /// run across two emulated hosts A refused 74 of B's grants as unsolicited while its
    /// READ flow went idle and active again. Once `silence` has passed since the
    /// withdrawal was sent, B has stopped whatever became of it: a grant then is refused.
    #[test]
    fn grants_in_flight_when_the_demand_is_withdrawn_are_taken_until_silence() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
        deliver(&mut a, &mut b, ms(0));
        b.set_grant(ms(1), &guarantee(0.5), 12.5e9);
        let first = b.poll_transmit(ms(1)).unwrap();
        a.receive(ms(1), &first.bytes).unwrap();
        // A's flow goes idle: its empty demand leaves at 2 ms, and B's refresh crosses it.
        a.set_demand(ms(2), B, &[]).unwrap();
        let withdrawal = a.poll_transmit(ms(2)).unwrap();
        let refresh = b.poll_transmit(ms(7)).unwrap();
        assert_eq!(a.receive(ms(8), &refresh.bytes), Ok(()));
        b.receive(ms(9), &withdrawal.bytes).unwrap();
        // B no longer serves A and grants nothing more. A grant of B's (a newer
        // incarnation's, so not a replay) arriving after A's window is refused.
        assert!(b.poll_transmit(ms(20)).is_none());
        let silence = ChannelConfig::default().silence;
        let mut late_b = channel(B, 3);
        let mut other_a = channel(A, 4);
        other_a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
        deliver(&mut other_a, &mut late_b, ms(0));
        late_b.set_grant(ms(1), &guarantee(0.5), 12.5e9);
        let late = late_b.poll_transmit(ms(1)).unwrap();
        let past = ms(2) + silence + ms(1);
        assert_eq!(a.receive(past, &late.bytes), Err(Refusal::Unsolicited));
    }

    #[test]
    fn caps_on_peers_flows_and_rate_refuse_with_their_reason() {
        let config = ChannelConfig {
            max_peers: 2,
            max_flows_per_peer: 4,
            max_messages_per_sec: 100,
            silence: ms(200),
            refresh: ms(50),
        };
        let mut b = Channel::new(config, key(), B, 1, Duration::ZERO).unwrap();
        let sender = |n: u8| channel(NodeId([n; 16]), 1);
        for n in [1, 2] {
            let mut s = sender(n);
            s.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
            b.receive(ms(0), &s.poll_transmit(ms(0)).unwrap().bytes)
                .unwrap();
        }
        let mut third = sender(3);
        third.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
        let m = third.poll_transmit(ms(0)).unwrap();
        assert_eq!(b.receive(ms(0), &m.bytes), Err(Refusal::TooManyPeers));
        assert!(b.served().all(|(n, _)| n != NodeId([3; 16])));

        let mut big = sender(1);
        big.set_demand(ms(0), B, &[read(1, 3), read(2, 2)]).unwrap();
        let m = big.poll_transmit(ms(0)).unwrap();
        assert_eq!(b.receive(ms(1), &m.bytes), Err(Refusal::TooManyFlows));
        assert_eq!(
            channel(A, 1).set_demand(ms(0), B, &vec![read(1, 1); 129]),
            Err(Refusal::TooManyFlows)
        );

        // Rate: a burst of a tenth of a second's messages (at least 4), then refused; the
        // bucket refills at 100/s.
        let mut flood = channel(NodeId([2; 16]), 2);
        let mut accepted = 0;
        let mut limited = 0;
        for i in 0..20u64 {
            flood.set_demand(ms(0), B, &[read(i, 1)]).unwrap();
            let m = flood.poll_transmit(ms(1_000)).unwrap();
            match b.receive(ms(1), &m.bytes) {
                Ok(()) => accepted += 1,
                Err(Refusal::RateLimited) => limited += 1,
                Err(e) => panic!("{e}"),
            }
            flood.peers[0].send_tokens = SEND_BURST;
        }
        assert_eq!(
            (accepted, limited),
            (9, 11),
            "burst of 10 less the first message"
        );
    }

    #[test]
    fn a_sender_keeps_to_half_its_peers_cap_and_coalesces_changes() {
        let mut a = channel(A, 1);
        let mut sent = 0;
        let mut t = Duration::ZERO;
        // A demand that changes every 100 us for a second.
        for i in 0..10_000u64 {
            t = Duration::from_micros(100 * i);
            a.set_demand(t, B, &[read(i % 7, 1)]).unwrap();
            while a.poll_transmit(t).is_some() {
                sent += 1;
            }
        }
        assert!(t >= Duration::from_millis(999));
        // A burst of two at the start, then one a millisecond: 1000/s, half the 2000/s cap.
        assert_eq!(sent, 2 + 999);
    }

    /// A host that both loads a peer and is loaded by it sends its demand and its grant at
    /// once, not a send gap apart: the grant is not held back by the demand before it.
    #[test]
    fn a_demand_and_a_grant_due_together_both_go_at_once() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        b.set_demand(ms(0), A, &[read(1, 1)]).unwrap();
        deliver(&mut b, &mut a, ms(0));
        a.set_demand(ms(1), B, &[read(2, 1)]).unwrap();
        a.set_grant(ms(1), &guarantee(0.5), 12.5e9);
        assert_eq!(deliver(&mut a, &mut b, ms(1)), 2);
        // The bucket is spent: a third message waits for a token (1 ms at 1000/s).
        a.set_demand(ms(1), B, &[read(3, 1)]).unwrap();
        assert_eq!(a.poll_transmit(ms(1)), None);
        assert_eq!(a.poll_timeout(), Some(ms(2)));
        assert_eq!(deliver(&mut a, &mut b, ms(2)), 1);
    }

    #[test]
    fn settings_that_cannot_work_are_refused() {
        let bad = |f: fn(&mut ChannelConfig)| {
            let mut c = ChannelConfig::default();
            f(&mut c);
            c.validate().err()
        };
        assert_eq!(ChannelConfig::default().validate(), Ok(()));
        assert!(bad(|c| c.max_peers = 0).is_some());
        assert!(bad(|c| c.silence = ms(9)).is_some());
        assert!(bad(|c| c.max_messages_per_sec = 100).is_some());
    }

    proptest! {
        /// Whatever order, duplication and loss the network brings, a peer's accepted
        /// (epoch, sequence) only grows, and what B serves is one of the demands A sent.
        #[test]
        fn any_delivery_order_keeps_the_newest_demand_only(
            order in proptest::collection::vec(0usize..12, 0..40),
        ) {
            let mut a = channel(A, 5);
            let mut b = channel(B, 6);
            let mut sent = Vec::new();
            for i in 0..12u64 {
                let t = ms(i * 2);
                a.set_demand(t, B, &[read(1, (i + 1) as u16)]).unwrap();
                sent.push(a.poll_transmit(t).unwrap().bytes);
            }
            let mut newest: Option<usize> = None;
            for i in order {
                let result = b.receive(ms(30), &sent[i]);
                if newest.is_none_or(|n| i > n) {
                    prop_assert_eq!(result, Ok(()));
                    newest = Some(i);
                } else {
                    prop_assert_eq!(result, Err(Refusal::Replayed));
                }
                let flows: Vec<_> = b.served().map(|(_, e)| e.flows).collect();
                prop_assert_eq!(flows, newest.map(|n| n as u16 + 1).into_iter().collect::<Vec<_>>());
            }
        }

        /// No sequence of datagrams from a host without the key changes B's state.
        #[test]
        fn forged_datagrams_change_nothing(
            datagrams in proptest::collection::vec(
                proptest::collection::vec(any::<u8>(), 0..200), 0..20),
        ) {
            let mut b = channel(B, 1);
            for d in &datagrams {
                prop_assert!(b.receive(ms(1), d).is_err());
            }
            prop_assert_eq!(b.served().count(), 0);
            prop_assert!(b.peers.is_empty());
            prop_assert_eq!(b.poll_event(), None);
        }
    }
}
