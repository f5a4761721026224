//! The server's side of the peer channel: what the loop tells the [`PeerLink`] and what
//! it takes from it. One job: carry the control loop's remote-READ inputs and outputs
//! between the loop and the link, on the loop's own thread.
//!
//! - After every pass: this host's flows that load a peer (a READ requester's flow, with
//!   work, against the host its QP goes to) become the demands the link sends; the loop's
//!   [`Event::ReadGuarantee`](justitia_core::control_loop::Event::ReadGuarantee) becomes
//!   the grant it sends the hosts that READ from this one.
//! - From the link: the READ units peers hold against this host go to the loop
//!   ([`ControlLoop::set_remote_reads`](justitia_core::control_loop::ControlLoop::set_remote_reads));
//!   a peer's guarantee goes to every READ flow of this host against that peer
//!   ([`ControlLoop::read_guarantee_received`](justitia_core::control_loop::ControlLoop::read_guarantee_received)),
//!   and its incast share to the [`IncastLimits`](justitia_core::incast::IncastLimits): a bandwidth flow into that peer is
//!   published to its shaper at the lower of its allotment and the share's cap, under
//!   either policy ([`justitia_core::incast::paced`] for Justitia's,
//!   [`justitia_core::incast::paced_plan`] for `adaptive`'s), until the share lapses
//!   (fail-open). The caps are made once per publication ([`IncastCaps`]: the clock read
//!   once, the flows counted once), and `justitia flows` shows the allotment so capped.
//!   A flow that starts or stops going into a peer changes its tenant's other flows' caps
//!   there, so the allotments are published again then.
//!
//! The incast side (§6.7): every flow of this host into a peer (not a READ) is declared
//! to it as an incast unit; the peer counts them by (host, tenant, class) and grants a
//! share of its link per unit of weight, which the channel carries back.
//!
//! A flow's remote end counts only when it names a member ([`PeerLink::peer_of`]): a
//! local tenant cannot make this daemon send to an address it chose. The socket, if its
//! port was taken at start, is bound (and watched) when a later flush finds it free; on
//! SIGHUP the key and member list are read again ([`Daemon::reload_peer`]).

use std::time::Duration;

use justitia_core::control_loop::Allotment;
use justitia_core::flow::{FlowId, TenantId};
use justitia_core::incast::paced;
use justitia_core::profile::RnicProfile;
use justitia_core::remote_read::{ReadGuarantee, ReadGuaranteeSender};
use justitia_peer::channel::ChannelEvent;
use justitia_peer::wire::Role;
use justitia_peer::NodeId;
use tracing::warn;

use justitia_agent::proto::RemoteEnd;

use super::{now_ns, Daemon, Flow, TAG_PEER};
use crate::limits::LogKind;
use crate::peer::{
    demands, responder_key, IncastCaps, IncastFlow, LoadingFlow, PeerLink, PeerSettings,
};
use tracing::{error, info};

/// A flow's remote end as `justitia flows` shows it.
pub(super) fn describe_remote(peer: NodeId, role: Role) -> String {
    let host = crate::peer::host_name(peer);
    match role {
        Role::Read => format!("reads from {host}"),
        Role::Incast => format!("sends to {host}"),
    }
}

/// Readies a new link: until the loop announces a READ guarantee, the grant this host gives
/// incast senders carries its whole RNIC for READs (which constrains none), and its link
/// is theirs to share.
pub(super) fn open(link: &mut PeerLink, profile: &RnicProfile) {
    let whole = ReadGuaranteeSender::new(0).announce(0, false, profile);
    link.set_link(
        Duration::from_nanos(now_ns()),
        profile.max_rate_bytes_per_sec(),
        &whole,
    );
}

impl Daemon {
    /// Reads the peer socket within the pass's deadline and acts on what came.
    pub(super) fn serve_peer(&mut self) {
        let Some(link) = self.peer.as_mut() else {
            return;
        };
        let now = Duration::from_nanos(now_ns());
        link.receive(now, self.pass_deadline, now_ns);
        self.peer_events();
    }

    /// Acts on the link's events.
    pub(super) fn peer_events(&mut self) {
        let Some(link) = self.peer.as_mut() else {
            return;
        };
        let mut served_changed = false;
        let mut guarantees: Vec<(NodeId, ReadGuarantee)> = Vec::new();
        let mut lapsed: Vec<NodeId> = Vec::new();
        let now = Duration::from_nanos(now_ns());
        let mut incast_changed = false;
        let mut answers = Vec::new();
        let mut found = Vec::new();
        while let Some(event) = link.poll_event() {
            match event {
                ChannelEvent::Pairings { peer, pairings } => {
                    found.extend(self.pairings.matched(peer, &pairings));
                }
                ChannelEvent::ServedChanged => served_changed = true,
                // Members only: the channel raises nothing for anyone else.
                ChannelEvent::ProbeOffer { peer, offer } => self.probe.serve_offer(peer, offer),
                ChannelEvent::ProbeAnswer { peer, answer } => answers.push((peer, answer)),
                ChannelEvent::Guarantee {
                    peer,
                    guarantee,
                    incast_bytes_per_sec,
                } => {
                    // The wire admits only rates in range: never refused.
                    incast_changed |= self
                        .incast
                        .grant_received(now, responder_key(peer), incast_bytes_per_sec)
                        .unwrap_or(false);
                    guarantees.push((peer, guarantee));
                }
                // The loop lets a guarantee not renewed lapse by itself.
                ChannelEvent::GuaranteeLapsed { peer } => {
                    incast_changed |= self.incast.lapsed(responder_key(peer));
                    lapsed.push(peer);
                }
            }
        }
        self.tell_found(&found);
        for (peer, answer) in answers {
            if self.probe.answered(peer, answer) {
                // Its samples so far measured the loopback: the loop measures anew.
                if let Err(e) = self.lp.reference_path_changed(now) {
                    error!(error = %e, "the loop kept its target across the probe's move");
                }
                self.metrics.probe_across_wire.set(1);
                info!(peer = %crate::peer::host_name(peer), "reference flow crosses the wire to its peer");
            }
        }
        let Some(link) = self.peer.as_mut() else {
            return;
        };
        let units = served_changed.then(|| link.served_reads());
        if let Some(units) = units {
            self.lp.set_remote_reads(now, &units);
        }
        for peer in lapsed {
            // A peer's silence is its to cause: rate-limited.
            if self.log_ok(LogKind::Flows, now_ns()) {
                warn!(%peer, "peer silent: its guarantee no longer constrains (fail-open)");
            }
        }
        for (peer, guarantee) in guarantees {
            let readers: Vec<u64> = self
                .flows
                .iter()
                .filter(|(_, f)| f.remote == Some((peer, Role::Read)))
                .map(|(&id, _)| id)
                .collect();
            for id in readers {
                // Refused only for a flow gone since, or figures out of range, which the
                // wire already refused.
                let _ = self.lp.read_guarantee_received(now, FlowId(id), guarantee);
            }
        }
        if incast_changed {
            self.publish_allotments();
        }
    }

    /// The incast caps for one publication of the allotments: the clock read once and the
    /// flows counted once, so that each flow's cap is a look-up ([`IncastCaps`]).
    pub(super) fn incast_caps(&self) -> IncastCaps<'_> {
        IncastCaps::new(
            &self.incast,
            Duration::from_nanos(now_ns()),
            self.flows.values().map(incast_flow),
        )
    }

    /// The cap a peer's incast share puts on flow `f` under `caps`: its tenant's weight
    /// times the share, divided among the tenant's active bandwidth flows into that peer.
    pub(super) fn incast_cap(&self, caps: &IncastCaps<'_>, f: &Flow) -> Option<f64> {
        caps.cap(
            &incast_flow(f),
            self.config.weight_of(f.uid, f.pod.as_ref()),
        )
    }

    /// A flow's allotment under `policy = "justitia"` as its shaper is to pace it: the
    /// loop's, lowered to `cap` (see [`Self::incast_cap`]).
    pub(super) fn paced_allotment(&self, id: u64, cap: Option<f64>) -> Option<Allotment> {
        let allotment = self.lp.allotment(FlowId(id))?;
        Some(paced(allotment, cap))
    }

    /// A shaper told where a flow's QP goes. A READ requester's flow against a peer the
    /// channel can name leaves this host's L, B, T (its data leaves the peer's RNIC) and
    /// is declared to the peer; any other flow into a peer is declared to it for incast
    /// (the peer counts it; a bandwidth flow is paced to the peer's share).
    /// With the channel off, or a QP looped back to this host, nothing is known of the
    /// other end's RNIC: the flow counts here as any other.
    pub(super) fn remote_end(&mut self, now: Duration, r: RemoteEnd) {
        let end = if r.gid == [0; 16] {
            crate::peer::RemoteEnd::Lid(r.lid)
        } else {
            crate::peer::RemoteEnd::Gid(NodeId(r.gid))
        };
        let peer = self.peer.as_ref().and_then(|link| link.peer_of(end));
        let Some(f) = self.flows.get_mut(&r.flow) else {
            return;
        };
        let role = if r.reads { Role::Read } else { Role::Incast };
        let remote = peer.map(|p| (p, role));
        let moved = f.remote != remote;
        f.remote = remote;
        self.remote_ends += 1;
        let reads_from = peer.filter(|_| r.reads).map(responder_key);
        let _ = self.lp.set_flow_reads_from(now, FlowId(r.flow), reads_from);
        if moved {
            // The flows into a peer were counted for its incast cap: a flow that goes
            // there now (or no longer does) changes its tenant's other flows' caps there
            // even when no allotment of the policy changes.
            self.publish_allotments();
        }
    }

    /// The grant after an update of the loop.
    pub(super) fn peer_grant(&mut self, guarantee: &ReadGuarantee) {
        let link_rate = self.profile.max_rate_bytes_per_sec();
        if let Some(link) = self.peer.as_mut() {
            link.set_grant(Duration::from_nanos(now_ns()), guarantee, link_rate);
        }
    }

    /// Hands the link this host's demands and sends what is due.
    pub(super) fn flush_peer(&mut self) {
        let Some(link) = self.peer.as_mut() else {
            return;
        };
        let config = &self.config;
        let loading = self.flows.values().filter(|f| f.active).filter_map(|f| {
            let (peer, role) = f.remote?;
            Some(LoadingFlow {
                peer,
                tenant: TenantId(f.tenant),
                class: f.class,
                role,
                weight: config.weight_of(f.uid, f.pod.as_ref()),
            })
        });
        let now = Duration::from_nanos(now_ns());
        if link.retry_bind(now) {
            let watched = link.socket().map(|fd| {
                rustix::event::epoll::add(
                    &self.epoll,
                    fd,
                    rustix::event::epoll::EventData::new_u64(TAG_PEER),
                    rustix::event::epoll::EventFlags::IN,
                )
            });
            match watched {
                Some(Ok(())) => {
                    info!(listen = %link.settings().listen, "peer socket bound: the channel is up")
                }
                Some(Err(e)) => error!(error = %e, "peer socket bound but not watched"),
                None => {}
            }
        }
        // `members_file`: read again when it changed (once a second at most).
        let members_changed = link.poll_members_file(now);
        link.set_demands(now, demands(loading));
        // The reference flow across the wire: this host's offer to its reference peer,
        // and answers to the members whose offers were served.
        self.probe_answers.clear();
        self.probe
            .take_answers(now.as_nanos() as u64, &mut self.probe_answers);
        for &(peer, answer) in &self.probe_answers {
            link.set_probe_answer(now, peer, Some(answer));
        }
        if let Some((peer, offer)) = self.probe.offer(now.as_nanos() as u64) {
            link.set_probe_offer(now, peer, Some(offer));
        }
        // The rendezvous of side channels: each member is sent the pairings of this
        // host's queue pairs connected to it (none to this host itself: matched at once),
        // and one whose last went an empty set.
        let this_host = link.settings().node;
        if members_changed {
            // Pairings toward a former member go: its queue pairs' requests go whole.
            self.pairings
                .retain_members(|n| n == this_host || link.is_member(n));
        }
        if self.pairings.take_changed() {
            let mut out = self.pairings.outbound();
            out.remove(&this_host);
            for peer in std::mem::take(&mut self.pairing_sent_to) {
                // A former member's state went with it: nothing to stop there.
                if !out.contains_key(&peer) && link.is_member(peer) {
                    link.set_pairings(now, peer, &[]);
                }
            }
            for (&peer, pairings) in &out {
                link.set_pairings(now, peer, pairings);
            }
            self.pairing_sent_to = out.into_keys().collect();
            self.metrics.pairings_held.set(self.pairings.len() as i64);
        }
        link.flush(now);
        self.peer_events();
        if self.incast.expire(now) {
            // Not renewed within the silence: the channel lapses it at the same time.
            self.publish_allotments();
        }
    }

    /// The guarantee a flow of this host holds now, if it READs from a peer that gave one.
    pub(super) fn flow_guarantee(&self, id: u64) -> Option<ReadGuarantee> {
        self.lp.read_cap(FlowId(id))
    }

    /// The link, if the channel is on.
    pub fn peer_link(&self) -> Option<&PeerLink> {
        self.peer.as_ref()
    }

    /// SIGHUP: takes `new` `[peer]` settings if the running link can (the key, the member
    /// list, addresses: re-read and applied, new handshakes started); returns false when
    /// a setting that needs a restart changed (the channel on or off, the node, the
    /// socket, the caps and timers). A key or member list that cannot be read leaves the
    /// running ones, with an error logged.
    pub(super) fn reload_peer(&mut self, new: Option<&PeerSettings>) -> bool {
        let (link, new) = match (self.peer.as_mut(), new) {
            (None, None) => return true,
            (Some(link), Some(new)) => (link, new),
            _ => return false,
        };
        let old = link.settings();
        if old.node != new.node
            || old.probe_to != new.probe_to
            || old.listen != new.listen
            || old.port != new.port
            || old.channel != new.channel
        {
            return false;
        }
        match link.reload(Duration::from_nanos(now_ns()), new) {
            Ok(()) => {
                let this_host = link.settings().node;
                self.pairings
                    .retain_members(|n| n == this_host || link.is_member(n));
                info!(members = new.members.len(), "peer key and members reloaded");
                true
            }
            Err(e) => {
                error!(error = %e, "SIGHUP: peer key or members refused, keeping the running ones");
                true
            }
        }
    }
}

/// A flow as the incast caps count it.
fn incast_flow(f: &Flow) -> IncastFlow {
    IncastFlow {
        tenant: TenantId(f.tenant),
        class: f.class,
        remote: f.remote,
        active: f.active,
    }
}
