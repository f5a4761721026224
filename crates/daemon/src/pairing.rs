//! The rendezvous of side channels: which of this host's RC queue pairs take part in
//! splitting two-sided requests, and the matching of a member's pairings against them.
//!
//! A shaper reports each bandwidth RC queue pair that reached RTR with its process's side
//! channel (a UD queue pair and its Q_Key). The daemon sends every such pairing to the
//! daemon of the queue pair's remote host, a member of the peer channel, as (this queue
//! pair, that queue pair, this side channel); the daemon there matches what it receives
//! against its own shapers' pairings and tells the shaper it matched the side channel it
//! found. Both daemons do so, so each shaper learns the other's side channel; the two
//! shapers then agree on the protocol version over the side channels themselves (see
//! `docs/architecture.md`, "Splitting two-sided requests").
//!
//! [`PairingTable`] holds this host's pairings, pure: no I/O, no clock. Its inputs are
//! what local shapers report ([`PairingTable::insert`], [`PairingTable::remove`],
//! [`PairingTable::remove_flow`]) and what members send ([`PairingTable::matched`]); its
//! outputs are the sets to send each member ([`PairingTable::outbound`]) and the side
//! channels to tell local shapers.
//!
//! Invariants:
//! - a pairing is held only for a queue pair whose remote end names a member (the caller
//!   checks), at most [`MAX_PAIRINGS_PER_TENANT`] per tenant and
//!   [`MAX_PAIRINGS_PER_PEER`] toward one member, so neither a local tenant nor a member
//!   grows the table or the datagrams past a cap; and one tenant holds at most
//!   [`MAX_PAIRINGS_PER_TENANT_PEER`] toward one member, so it cannot take a member's whole
//!   budget from the others;
//! - a member's pairing matches only a queue pair whose own number, remote host and remote
//!   queue pair are exactly the pairing's, and only when exactly one does: no guess by
//!   host alone, so a member can reach only a queue pair connected to one of its own;
//! - a shaper is told a side channel once for each one found: a member's refreshes of the
//!   same pairing tell it nothing more (unless the telling did not reach it,
//!   [`PairingTable::untell`]), and a changed one (the remote process's side channel made
//!   again) tells it the new one.

use std::collections::{BTreeMap, HashMap};

use justitia_peer::channel::MAX_PAIRINGS_PER_PEER;
use justitia_peer::wire::Pairing;
use justitia_peer::NodeId;

/// Pairings one tenant may hold: a tenant with more bandwidth queue pairs than this to
/// other members has the rest sent whole (their peers never find them).
pub const MAX_PAIRINGS_PER_TENANT: usize = 4096;

/// Pairings held toward one member, at most: what the peer channel sends one member.
pub const MAX_PAIRINGS_PER_PEER_HELD: usize = MAX_PAIRINGS_PER_PEER;

/// Pairings one tenant holds toward one member, at most: half the member's budget, so a
/// tenant with thousands of queue pairs to one host leaves the other half to the other
/// tenants (its queue pairs beyond go whole, as natively).
pub const MAX_PAIRINGS_PER_TENANT_PEER: usize = MAX_PAIRINGS_PER_PEER_HELD / 2;

/// Why a pairing was not held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PairingRefusal {
    /// The tenant holds [`MAX_PAIRINGS_PER_TENANT`] already.
    #[error("its tenant holds {MAX_PAIRINGS_PER_TENANT} pairings already")]
    TenantFull,
    /// [`MAX_PAIRINGS_PER_PEER_HELD`] pairings go to that member already.
    #[error("{MAX_PAIRINGS_PER_PEER_HELD} pairings go to that member already")]
    PeerFull,
    /// The tenant holds [`MAX_PAIRINGS_PER_TENANT_PEER`] toward that member already.
    #[error("its tenant holds {MAX_PAIRINGS_PER_TENANT_PEER} pairings toward that member already")]
    TenantPeerFull,
}

impl PairingRefusal {
    /// The refusal's one spelling in the metrics and the log.
    pub fn as_str(self) -> &'static str {
        match self {
            PairingRefusal::TenantFull => "too_many_pairings_tenant",
            PairingRefusal::PeerFull => "too_many_pairings_peer",
            PairingRefusal::TenantPeerFull => "too_many_pairings_tenant_peer",
        }
    }
}

/// One local queue pair's pairing, as its shaper reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalPairing {
    /// The registration connection that reported it (and is told what is found).
    pub client: u64,
    /// The daemon's flow id of the flow that posts on it.
    pub flow: u64,
    /// The flow's tenant.
    pub tenant: u64,
    /// The queue pair's own number.
    pub local_qpn: u32,
    /// The member its remote end is on.
    pub peer: NodeId,
    /// The remote queue pair's number.
    pub remote_qpn: u32,
    /// The shaper's side channel: UD queue pair number and Q_Key.
    pub side: (u32, u32),
}

/// A side channel found for a local queue pair: tell the flow's shaper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// The connection to tell.
    pub client: u64,
    /// The flow the pairing was reported for.
    pub flow: u64,
    /// The local queue pair.
    pub local_qpn: u32,
    /// The remote process's side channel: UD queue pair number and Q_Key.
    pub side: (u32, u32),
}

#[derive(Debug, Clone, Copy)]
struct Held {
    pairing: LocalPairing,
    /// The side channel its shaper was last told.
    told: Option<(u32, u32)>,
}

/// This host's pairings (see the module's invariants).
#[derive(Debug, Default)]
pub struct PairingTable {
    /// By (flow, local queue pair): a flow's queue pairs are its own, and a flow id is
    /// never reused, so a report about another connection's flow cannot reach one.
    held: BTreeMap<(u64, u32), Held>,
    /// The same by (member, local queue pair, remote queue pair), what a member's pairing
    /// names: a match costs a lookup, not a scan of the table.
    by_end: HashMap<(NodeId, u32, u32), Vec<(u64, u32)>>,
    per_tenant: HashMap<u64, usize>,
    per_peer: HashMap<NodeId, usize>,
    per_tenant_peer: HashMap<(u64, NodeId), usize>,
    /// Set when what goes to some member changed since [`PairingTable::take_changed`].
    changed: bool,
}

impl PairingTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Pairings held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Holds a local queue pair's pairing, replacing the one its flow held for the same
    /// queue pair (it was reset and connected again: its shaper is told anew).
    pub fn insert(&mut self, p: LocalPairing) -> Result<(), PairingRefusal> {
        let key = (p.flow, p.local_qpn);
        if let Some(old) = self.held.get(&key).map(|h| h.pairing) {
            if old == p {
                return Ok(());
            }
            self.remove(p.flow, p.local_qpn);
        }
        if self.per_tenant.get(&p.tenant).copied().unwrap_or(0) >= MAX_PAIRINGS_PER_TENANT {
            return Err(PairingRefusal::TenantFull);
        }
        if self.per_peer.get(&p.peer).copied().unwrap_or(0) >= MAX_PAIRINGS_PER_PEER_HELD {
            return Err(PairingRefusal::PeerFull);
        }
        let pair = (p.tenant, p.peer);
        if self.per_tenant_peer.get(&pair).copied().unwrap_or(0) >= MAX_PAIRINGS_PER_TENANT_PEER {
            return Err(PairingRefusal::TenantPeerFull);
        }
        *self.per_tenant.entry(p.tenant).or_insert(0) += 1;
        *self.per_peer.entry(p.peer).or_insert(0) += 1;
        *self.per_tenant_peer.entry(pair).or_insert(0) += 1;
        self.by_end
            .entry((p.peer, p.local_qpn, p.remote_qpn))
            .or_default()
            .push(key);
        self.held.insert(
            key,
            Held {
                pairing: p,
                told: None,
            },
        );
        self.changed = true;
        Ok(())
    }

    /// Forgets a queue pair's pairing (destroyed or reset); nothing if none is held.
    pub fn remove(&mut self, flow: u64, local_qpn: u32) {
        let Some(h) = self.held.remove(&(flow, local_qpn)) else {
            return;
        };
        let p = h.pairing;
        let end = (p.peer, p.local_qpn, p.remote_qpn);
        if let Some(keys) = self.by_end.get_mut(&end) {
            keys.retain(|&k| k != (flow, local_qpn));
            if keys.is_empty() {
                self.by_end.remove(&end);
            }
        }
        decrement(&mut self.per_tenant, &p.tenant);
        decrement(&mut self.per_peer, &p.peer);
        decrement(&mut self.per_tenant_peer, &(p.tenant, p.peer));
        self.changed = true;
    }

    /// Forgets every pairing of a flow (unregistered, or its connection gone).
    pub fn remove_flow(&mut self, flow: u64) {
        let qpns: Vec<u32> = self
            .held
            .range((flow, 0)..=(flow, u32::MAX))
            .map(|(&(_, qpn), _)| qpn)
            .collect();
        for qpn in qpns {
            self.remove(flow, qpn);
        }
    }

    /// Forgets every pairing toward members no longer in `is_member`.
    pub fn retain_members(&mut self, is_member: impl Fn(NodeId) -> bool) {
        let gone: Vec<(u64, u32)> = self
            .held
            .iter()
            .filter(|(_, h)| !is_member(h.pairing.peer))
            .map(|(&k, _)| k)
            .collect();
        for (flow, qpn) in gone {
            self.remove(flow, qpn);
        }
    }

    /// The side channel found for a local queue pair did not reach its shaper: the next
    /// match of the same pairing tells it again.
    pub fn untell(&mut self, flow: u64, local_qpn: u32) {
        if let Some(h) = self.held.get_mut(&(flow, local_qpn)) {
            h.told = None;
        }
    }

    /// Whether what goes to some member changed since the last call (and clears it).
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// The pairings to send each member that some are held toward, as the peer channel
    /// carries them (sorted by this host's queue pair). A member with none is absent: the
    /// caller sends it an empty set.
    pub fn outbound(&self) -> BTreeMap<NodeId, Vec<Pairing>> {
        let mut out: BTreeMap<NodeId, Vec<Pairing>> = BTreeMap::new();
        for h in self.held.values() {
            let p = h.pairing;
            out.entry(p.peer).or_default().push(Pairing {
                this_qpn: p.local_qpn,
                that_qpn: p.remote_qpn,
                side_qpn: p.side.0,
                side_qkey: p.side.1,
            });
        }
        for v in out.values_mut() {
            v.sort_unstable();
        }
        out
    }

    /// Matches `peer`'s pairings against the local ones: each that matches exactly one
    /// local queue pair (its number is the pairing's `that_qpn`, its remote end `peer`'s
    /// `this_qpn`) and carries a side channel its shaper was not told yet is returned, to
    /// be told. The rest match nothing and are dropped: a member cannot name a queue
    /// pair that is not connected to one of its own.
    pub fn matched(&mut self, peer: NodeId, pairings: &[Pairing]) -> Vec<Found> {
        let mut found = Vec::new();
        for m in pairings {
            let Some(&[key]) = self
                .by_end
                .get(&(peer, m.that_qpn, m.this_qpn))
                .map(Vec::as_slice)
            else {
                continue;
            };
            let Some(h) = self.held.get_mut(&key) else {
                continue;
            };
            let side = (m.side_qpn, m.side_qkey);
            if h.told != Some(side) {
                h.told = Some(side);
                found.push(Found {
                    client: h.pairing.client,
                    flow: h.pairing.flow,
                    local_qpn: h.pairing.local_qpn,
                    side,
                });
            }
        }
        found
    }
}

impl PairingTable {
    /// Both ends on this host (`p.peer` is this host's node): matches the local pairing
    /// `p` just inserted against its other end's, both ways, as two members' pairings
    /// would be.
    pub fn matched_here(&mut self, p: &LocalPairing) -> Vec<Found> {
        let mine = Pairing {
            this_qpn: p.local_qpn,
            that_qpn: p.remote_qpn,
            side_qpn: p.side.0,
            side_qkey: p.side.1,
        };
        let mut found = self.matched(p.peer, &[mine]);
        let theirs = match self
            .by_end
            .get(&(p.peer, p.remote_qpn, p.local_qpn))
            .map(Vec::as_slice)
        {
            Some(&[key]) => self.held.get(&key).map(|h| Pairing {
                this_qpn: h.pairing.local_qpn,
                that_qpn: h.pairing.remote_qpn,
                side_qpn: h.pairing.side.0,
                side_qkey: h.pairing.side.1,
            }),
            _ => None,
        };
        if let Some(t) = theirs {
            found.extend(self.matched(p.peer, &[t]));
        }
        found
    }
}

fn decrement<K: std::hash::Hash + Eq>(counts: &mut HashMap<K, usize>, key: &K) {
    if let Some(n) = counts.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            counts.remove(key);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn node(last: u8) -> NodeId {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 0, 0, last]);
        NodeId(g)
    }

    fn local(flow: u64, local_qpn: u32, peer: u8, remote_qpn: u32) -> LocalPairing {
        LocalPairing {
            client: 40 + flow,
            flow,
            tenant: 1,
            local_qpn,
            peer: node(peer),
            remote_qpn,
            side: (0x500, 0x77),
        }
    }

    fn theirs(this_qpn: u32, that_qpn: u32, side_qpn: u32) -> Pairing {
        Pairing {
            this_qpn,
            that_qpn,
            side_qpn,
            side_qkey: 0x99,
        }
    }

    #[test]
    fn a_members_pairing_finds_exactly_the_queue_pair_connected_to_its_own() {
        let mut t = PairingTable::new();
        t.insert(local(1, 0x10, 2, 0x20)).unwrap();
        t.insert(local(1, 0x11, 2, 0x21)).unwrap();
        t.insert(local(2, 0x12, 3, 0x20)).unwrap();
        let found = t.matched(node(2), &[theirs(0x20, 0x10, 0x600)]);
        assert_eq!(
            found,
            vec![Found {
                client: 41,
                flow: 1,
                local_qpn: 0x10,
                side: (0x600, 0x99)
            }]
        );
        // The right queue pair of another host, the right host and a wrong queue pair,
        // and a queue pair connected to another one of the host's: nothing.
        assert!(t.matched(node(3), &[theirs(0x20, 0x10, 0x600)]).is_empty());
        assert!(t.matched(node(2), &[theirs(0x21, 0x10, 0x600)]).is_empty());
        assert!(t.matched(node(2), &[theirs(0x20, 0x11, 0x600)]).is_empty());
        // Host 3's pairing reaches only the queue pair connected to it.
        assert_eq!(t.matched(node(3), &[theirs(0x20, 0x12, 0x601)])[0].flow, 2);
    }

    #[test]
    fn a_refresh_tells_nothing_and_a_new_side_channel_is_told() {
        let mut t = PairingTable::new();
        t.insert(local(1, 0x10, 2, 0x20)).unwrap();
        assert_eq!(t.matched(node(2), &[theirs(0x20, 0x10, 0x600)]).len(), 1);
        assert!(t.matched(node(2), &[theirs(0x20, 0x10, 0x600)]).is_empty());
        let again = t.matched(node(2), &[theirs(0x20, 0x10, 0x601)]);
        assert_eq!(again[0].side, (0x601, 0x99));
        // Its shaper's socket would not take it: the next refresh tells it again.
        t.untell(1, 0x10);
        assert_eq!(t.matched(node(2), &[theirs(0x20, 0x10, 0x601)]).len(), 1);
        assert!(t.matched(node(2), &[theirs(0x20, 0x10, 0x601)]).is_empty());
        // The queue pair reset and connected again: its shaper is told anew.
        t.insert(LocalPairing {
            side: (0x501, 0x77),
            ..local(1, 0x10, 2, 0x20)
        })
        .unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t.matched(node(2), &[theirs(0x20, 0x10, 0x601)]).len(), 1);
    }

    #[test]
    fn two_queue_pairs_of_this_host_connected_to_each_other_are_told_each_others_side_channel() {
        let mut t = PairingTable::new();
        let here = node(1);
        let a = LocalPairing {
            peer: here,
            side: (0x500, 0x77),
            ..local(1, 0x10, 1, 0x20)
        };
        let b = LocalPairing {
            client: 50,
            peer: here,
            side: (0x600, 0x88),
            ..local(2, 0x20, 1, 0x10)
        };
        t.insert(a).unwrap();
        assert!(t.matched_here(&a).is_empty());
        t.insert(b).unwrap();
        let mut found = t.matched_here(&b);
        found.sort_by_key(|f| f.flow);
        assert_eq!(
            found,
            vec![
                Found {
                    client: 41,
                    flow: 1,
                    local_qpn: 0x10,
                    side: (0x600, 0x88)
                },
                Found {
                    client: 50,
                    flow: 2,
                    local_qpn: 0x20,
                    side: (0x500, 0x77)
                },
            ]
        );
        assert!(t.matched_here(&b).is_empty());
    }

    #[test]
    fn two_local_queue_pairs_a_pairing_could_name_match_neither() {
        // Two devices may number queue pairs alike; a pairing that fits both is no match.
        let mut t = PairingTable::new();
        t.insert(local(1, 0x10, 2, 0x20)).unwrap();
        t.insert(local(2, 0x10, 2, 0x20)).unwrap();
        assert!(t.matched(node(2), &[theirs(0x20, 0x10, 0x600)]).is_empty());
        t.remove(2, 0x10);
        assert_eq!(t.matched(node(2), &[theirs(0x20, 0x10, 0x600)]).len(), 1);
    }

    #[test]
    fn outbound_sets_are_per_member_and_follow_removals() {
        let mut t = PairingTable::new();
        assert!(!t.take_changed());
        t.insert(local(1, 0x11, 2, 0x21)).unwrap();
        t.insert(local(1, 0x10, 2, 0x20)).unwrap();
        t.insert(local(2, 0x12, 3, 0x22)).unwrap();
        assert!(t.take_changed());
        assert!(!t.take_changed());
        let out = t.outbound();
        assert_eq!(
            out[&node(2)],
            vec![
                Pairing {
                    this_qpn: 0x10,
                    that_qpn: 0x20,
                    side_qpn: 0x500,
                    side_qkey: 0x77
                },
                Pairing {
                    this_qpn: 0x11,
                    that_qpn: 0x21,
                    side_qpn: 0x500,
                    side_qkey: 0x77
                },
            ]
        );
        assert_eq!(out[&node(3)].len(), 1);
        // The same report again changes nothing.
        t.insert(local(1, 0x10, 2, 0x20)).unwrap();
        assert!(!t.take_changed());
        t.remove_flow(1);
        assert!(t.take_changed());
        assert_eq!(t.outbound().keys().copied().collect::<Vec<_>>(), [node(3)]);
        t.retain_members(|n| n != node(3));
        assert!(t.is_empty());
        assert!(t.outbound().is_empty());
    }

    #[test]
    fn a_tenant_and_a_member_are_capped_and_a_removal_makes_room() {
        let mut t = PairingTable::new();
        // Tenant 1 spreads its pairings over two members, half the budget of each.
        for qpn in 1..=MAX_PAIRINGS_PER_TENANT as u32 {
            let member = if qpn % 2 == 0 { node(2) } else { node(3) };
            t.insert(LocalPairing {
                peer: member,
                ..local(1, qpn, 2, qpn)
            })
            .unwrap();
        }
        assert_eq!(
            t.insert(LocalPairing {
                peer: node(4),
                ..local(1, 0xffff, 2, 1)
            }),
            Err(PairingRefusal::TenantFull)
        );
        // Other tenants toward member 2 take its other half, then meet the member's cap.
        for qpn in 1..=MAX_PAIRINGS_PER_TENANT_PEER as u32 {
            let tenant = 2 + u64::from(qpn % 3);
            t.insert(LocalPairing {
                tenant,
                ..local(10 + u64::from(qpn % 3), qpn, 2, qpn)
            })
            .unwrap();
        }
        let other = LocalPairing {
            tenant: 9,
            ..local(9, 1, 2, 1)
        };
        assert_eq!(t.insert(other), Err(PairingRefusal::PeerFull));
        t.remove(1, 2);
        assert_eq!(t.insert(other), Ok(()));
        assert_eq!(
            t.len(),
            MAX_PAIRINGS_PER_TENANT + MAX_PAIRINGS_PER_TENANT_PEER
        );
    }

    #[test]
    fn one_tenant_takes_at_most_half_of_a_members_budget() {
        let mut t = PairingTable::new();
        for qpn in 1..=MAX_PAIRINGS_PER_TENANT_PEER as u32 {
            t.insert(local(1, qpn, 2, qpn)).unwrap();
        }
        assert_eq!(
            t.insert(local(1, 0xffff, 2, 1)),
            Err(PairingRefusal::TenantPeerFull)
        );
        // Toward another member, and another tenant toward this one: room.
        assert_eq!(
            t.insert(LocalPairing {
                peer: node(3),
                ..local(1, 0xffff, 2, 1)
            }),
            Ok(())
        );
        assert_eq!(
            t.insert(LocalPairing {
                tenant: 7,
                ..local(7, 1, 2, 1)
            }),
            Ok(())
        );
        t.remove(1, 1);
        assert_eq!(
            t.insert(local(1, 0xfffe, 2, 1)),
            Ok(()),
            "a removal makes room"
        );
    }
}
