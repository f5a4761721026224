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
//!   ([`ControlLoop::read_guarantee_received`](justitia_core::control_loop::ControlLoop::read_guarantee_received)).

use std::time::Duration;

use justitia_core::flow::{FlowId, TenantId, Weight};
use justitia_core::remote_read::ReadGuarantee;
use justitia_peer::channel::ChannelEvent;
use justitia_peer::wire::Role;
use justitia_peer::NodeId;
use tracing::warn;

use justitia_agent::proto::RemoteEnd;
use justitia_core::flow::FlowClass;

use super::{now_ns, Daemon};
use crate::limits::LogKind;
use crate::peer::{demands, LoadingFlow, PeerLink};

/// The loop's key for the host a READ flow reads from: the flows of one tenant and class
/// with one key share that host's guarantee. Folded from the GID; two GIDs that fold alike
/// only make their flows share a guarantee they would each have had.
pub(super) fn responder_key(peer: NodeId) -> u64 {
    let (hi, lo) = peer.0.split_at(8);
    let word = |b: &[u8]| b.iter().fold(0u64, |acc, &x| acc << 8 | u64::from(x));
    word(hi).rotate_left(32) ^ word(lo)
}

/// A flow's remote end as `justitia flows` shows it.
pub(super) fn describe_remote(peer: NodeId, role: Role) -> String {
    let v6 = std::net::Ipv6Addr::from(peer.0);
    let host = v6
        .to_ipv4_mapped()
        .map_or_else(|| v6.to_string(), |v4| v4.to_string());
    match role {
        Role::Read => format!("reads from {host}"),
        Role::Incast => format!("sends to {host}"),
    }
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
        while let Some(event) = link.poll_event() {
            match event {
                ChannelEvent::ServedChanged => served_changed = true,
                ChannelEvent::Guarantee {
                    peer, guarantee, ..
                } => guarantees.push((peer, guarantee)),
                // The loop lets a guarantee not renewed lapse by itself.
                ChannelEvent::GuaranteeLapsed { peer } => lapsed.push(peer),
            }
        }
        let units = served_changed.then(|| link.served_reads());
        let now = Duration::from_nanos(now_ns());
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
    }

    /// A shaper told where a flow's QP goes. A READ requester's flow leaves this host's
    /// L, B, T (its data leaves the peer's RNIC) whether or not the peer channel is on; a
    /// bandwidth flow into a peer is declared to it for incast. Only a peer the channel can
    /// name is recorded.
    pub(super) fn remote_end(&mut self, now: Duration, r: RemoteEnd) {
        let end = if r.gid == [0; 16] {
            crate::peer::RemoteEnd::Lid(r.lid)
        } else {
            crate::peer::RemoteEnd::Gid(NodeId(r.gid))
        };
        let peer = match &self.peer {
            Some(link) => link.peer_of(end),
            None => match end {
                crate::peer::RemoteEnd::Gid(g) => Some(g),
                crate::peer::RemoteEnd::Lid(_) => None,
            },
        };
        let Some(f) = self.flows.get_mut(&r.flow) else {
            return;
        };
        let role = if r.reads {
            Some(Role::Read)
        } else if f.class == FlowClass::Bandwidth {
            Some(Role::Incast)
        } else {
            None
        };
        f.remote = peer.zip(role);
        let reads_from = r
            .reads
            .then(|| peer.map_or(u64::from(r.lid), responder_key));
        let _ = self.lp.set_flow_reads_from(now, FlowId(r.flow), reads_from);
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
        let weights = &self.config.weights;
        let loading = self.flows.values().filter(|f| f.active).filter_map(|f| {
            let (peer, role) = f.remote?;
            Some(LoadingFlow {
                peer,
                tenant: TenantId(f.tenant),
                class: f.class,
                role,
                weight: weights
                    .get(&f.uid)
                    .and_then(|&w| Weight::new(w).ok())
                    .unwrap_or(Weight::ONE),
            })
        });
        let now = Duration::from_nanos(now_ns());
        link.set_demands(now, demands(loading));
        link.flush(now);
        self.peer_events();
    }

    /// The guarantee a flow of this host holds now, if it READs from a peer that gave one.
    pub(super) fn flow_guarantee(&self, id: u64) -> Option<ReadGuarantee> {
        self.lp.read_cap(FlowId(id))
    }

    /// The link, if the channel is on.
    pub fn peer_link(&self) -> Option<&PeerLink> {
        self.peer.as_ref()
    }
}
