//! The reference flow across the wire: Justitia's probes go to another host (§4.2.1), so
//! that Current99 sees the queues of the link and of the far RNIC as a latency flow does,
//! not only this RNIC's loopback.
//!
//! Two halves, both on the probe's device, port, GID and protection domain:
//! - [`Requester`]: this host's probe queue pair towards the one peer `probe_peer` names.
//!   It is offered to that peer's daemon over the peer channel (its GID, LID, queue pair
//!   number and first PSN), and connected when the peer answers with its responder's end
//!   and the 64 B it may WRITE into. A requester whose probe fails on the NIC (the peer
//!   went away, retries ran out) or whose peer answers anew (its daemon restarted) is
//!   made again, with a new offer, at most once per [`REMAKE_INTERVAL`].
//! - [`Responders`]: a responder queue pair for each member that offers one, at most
//!   [`MAX_RESPONDERS`], each made (or made again for a new offer) at most once per
//!   [`REMAKE_INTERVAL`] per member, so that a member's offers cost this daemon at most
//!   one queue pair's creation a second. Their completions go to a CQ nobody polls: a
//!   WRITE raises none at the responder.
//!
//! The peer channel carries the ends ([`justitia_peer::wire::ProbeEndpoint`]); only
//! authenticated members reach this module. What they can make it do is bounded: one
//! queue pair each, remade at most once a second, and WRITEs into one 64 B buffer that
//! holds nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use justitia_peer::wire::ProbeEndpoint;
use justitia_peer::NodeId;
use justitia_verbs::{
    CompletionQueue, Endpoint, MemoryRegion, ProtectionDomain, QpCaps, QueuePair,
};

/// The local ACK timeout of the probe's queue pairs across the wire (4.096 us x 2^18,
/// about 1.07 s): a probe queued behind a loaded link must never be sent again for a
/// slowness that is what the probe measures; a probe that really is lost counts as lost
/// at the loop's `probe_timeout` whatever the transport does.
pub const WIRE_ACK_TIMEOUT: u8 = 18;

/// A requester or a member's responder is made at most this often.
pub const REMAKE_INTERVAL: Duration = Duration::from_secs(1);

/// A reference peer that has not answered this long after the first offer is said to
/// be silent, once: the probe stays in loopback meanwhile.
pub const UNANSWERED_WARNING: Duration = Duration::from_secs(10);

/// Responder queue pairs held at most (one per member; the peer channel's default
/// member cap).
pub const MAX_RESPONDERS: usize = 64;

/// Probes a requester holds on the NIC at most: more wait as lost ones (the CQ holds 256
/// completions, and a probe queued this long behind a loaded link is past any timeout
/// worth setting at RefPeriods of 500 us).
pub const MAX_OUTSTANDING: usize = 192;

/// Posts refused in a row after which a requester is taken for broken and made again.
pub const REFUSED_POSTS_BREAK: u32 = 64;

/// Where the probe's WRITEs land in its buffer; the loopback probe's target offset too.
pub const TARGET_OFFSET: u64 = 32;

/// The port, GID index and verbs objects the probe's queue pairs are made on.
pub struct Site {
    /// The protection domain.
    pub pd: ProtectionDomain,
    /// The requester's CQ (the probe's, with its completion channel).
    pub cq: CompletionQueue,
    /// The responders' CQ (never polled: WRITEs raise no completion there).
    pub quiet_cq: CompletionQueue,
    /// The buffer WRITEs go from and into.
    pub mr: MemoryRegion,
    /// The port.
    pub port: u8,
    /// The GID index.
    pub gid_index: u8,
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: MAX_OUTSTANDING as u32,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

/// A first PSN from the clock: a queue pair made again starts elsewhere in the sequence,
/// so a packet of its predecessor still on the wire is not taken for one of its own.
fn psn_from(now_ns: u64) -> u32 {
    ((now_ns >> 10) as u32) & 0xff_ffff
}

fn end_of(qp: &QueuePair, site: &Site, psn: u32) -> Result<ProbeEndpoint, String> {
    let e = qp
        .endpoint(site.port, site.gid_index, psn)
        .map_err(|e| format!("reading the probe queue pair's end: {e}"))?;
    Ok(ProbeEndpoint {
        gid: e.gid,
        lid: e.lid,
        qpn: e.qp_num,
        psn: e.psn,
        rkey: 0,
        addr: 0,
        answers_qpn: 0,
    })
}

fn verbs_end(p: &ProbeEndpoint) -> Endpoint {
    Endpoint {
        qp_num: p.qpn,
        psn: p.psn,
        lid: p.lid,
        gid: p.gid,
    }
}

/// What a peer's answer did to the requester's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    /// Nothing: an answer to another offer, or the one already taken.
    Unchanged,
    /// Connected, and the reference flow crosses the wire for the first time: the loop
    /// must measure the new path.
    First,
    /// Connected again, after the queue pair was made again.
    Again,
    /// A new answer to the offer already connected: the peer made its responder again,
    /// so this queue pair is made again too.
    Broken,
}

/// This host's probe queue pair towards its reference peer.
pub struct Requester {
    peer: NodeId,
    qp: QueuePair,
    offer: ProbeEndpoint,
    /// The peer's answer the queue pair is connected to.
    connected: Option<ProbeEndpoint>,
    /// The queue pair failed or its peer answered anew: it is made again when due.
    broken: bool,
    made_at: u64,
    /// Probes posted on this queue pair and not yet completed.
    outstanding: usize,
    /// Posts the queue pair refused in a row.
    refused_posts: u32,
    /// The reference flow has crossed the wire at least once: from then on it stays
    /// there (a broken requester's probes count as lost, not as loopback samples).
    adopted: bool,
    /// When the first offer was made, until the warning that no answer came is said.
    unanswered_since: Option<u64>,
}

impl Requester {
    /// A requester towards `peer`, offered and not yet answered.
    pub fn new(peer: NodeId, site: &Site, now_ns: u64) -> Result<Self, String> {
        let (qp, offer) = Self::make(site, now_ns)?;
        Ok(Requester {
            peer,
            qp,
            offer,
            connected: None,
            broken: false,
            made_at: now_ns,
            outstanding: 0,
            refused_posts: 0,
            adopted: false,
            unanswered_since: Some(now_ns),
        })
    }

    fn make(site: &Site, now_ns: u64) -> Result<(QueuePair, ProbeEndpoint), String> {
        let qp = QueuePair::create_rc(&site.pd, &site.cq, &site.cq, caps())
            .map_err(|e| format!("creating the wire probe's queue pair: {e}"))?;
        let offer = end_of(&qp, site, psn_from(now_ns))?;
        Ok((qp, offer))
    }

    /// The peer.
    pub fn peer(&self) -> NodeId {
        self.peer
    }

    /// The offer to keep before the peer: the current queue pair's end. A broken
    /// requester is made again here once [`REMAKE_INTERVAL`] has passed since it was
    /// made; the probes outstanding on the old queue pair go with it (the loop counts
    /// them lost at their timeout), and their number is returned beside the offer.
    pub fn offer(&mut self, site: &Site, now_ns: u64) -> (ProbeEndpoint, usize) {
        if let Some(since) = self.unanswered_since.filter(|_| !self.adopted) {
            if now_ns >= since.saturating_add(UNANSWERED_WARNING.as_nanos() as u64) {
                tracing::warn!(
                    peer = %crate::peer::host_name(self.peer),
                    "the reference peer's justitiad has not answered the probe's offer in 10 s \
                     (not running, not peered with this host, or too old): the reference flow \
                     stays in loopback until it does"
                );
                self.unanswered_since = None;
            }
        }
        let mut dropped = 0;
        if self.broken
            && now_ns
                >= self
                    .made_at
                    .saturating_add(REMAKE_INTERVAL.as_nanos() as u64)
        {
            match Self::make(site, now_ns) {
                Ok((qp, offer)) => {
                    dropped = self.outstanding;
                    self.qp = qp;
                    self.offer = offer;
                    self.connected = None;
                    self.broken = false;
                    self.outstanding = 0;
                    self.refused_posts = 0;
                }
                Err(e) => tracing::warn!(error = %e, "the wire probe's queue pair not made again"),
            }
            self.made_at = now_ns;
        }
        (self.offer, dropped)
    }

    /// The peer's answer, and what it did to the connection. An answer to another offer
    /// is ignored; a new answer to this one (the peer made its responder again) breaks
    /// the connection, to be made again.
    pub fn answered(&mut self, site: &Site, answer: ProbeEndpoint) -> Result<Answered, String> {
        if answer.answers_qpn != self.offer.qpn || self.broken {
            return Ok(Answered::Unchanged);
        }
        match self.connected {
            Some(current) if current == answer => return Ok(Answered::Unchanged),
            Some(_) => {
                self.broken = true;
                return Ok(Answered::Broken);
            }
            None => {}
        }
        if let Err(e) = self.qp.connect_with_ack_timeout(
            site.port,
            site.gid_index,
            self.offer.psn,
            &verbs_end(&answer),
            WIRE_ACK_TIMEOUT,
        ) {
            self.broken = true;
            return Err(format!("connecting the wire probe: {e}"));
        }
        self.connected = Some(answer);
        let first = !self.adopted;
        self.adopted = true;
        Ok(if first {
            Answered::First
        } else {
            Answered::Again
        })
    }

    /// Probes go across the wire (and stay there).
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// Connected and not broken: a probe can be posted.
    pub fn ready(&self) -> bool {
        self.connected.is_some() && !self.broken
    }

    /// Posts probe `id`: 10 B from the buffer into the peer's. Refused with
    /// [`MAX_OUTSTANDING`] on the NIC; [`REFUSED_POSTS_BREAK`] posts refused in a row by
    /// the queue pair break it.
    pub fn post(&mut self, site: &Site, id: u64) -> Result<(), String> {
        let answer = self
            .connected
            .ok_or("the reference peer has not answered")?;
        if self.outstanding >= MAX_OUTSTANDING {
            return Err(format!("{MAX_OUTSTANDING} probes already on the wire"));
        }
        let sge = site.mr.sge(0, 10).map_err(|e| e.to_string())?;
        let wr = justitia_verbs::SendRequest::write(id, vec![sge], answer.addr, answer.rkey);
        if let Err(e) = self.qp.post_send(&[wr]) {
            self.refused_posts += 1;
            if self.refused_posts >= REFUSED_POSTS_BREAK {
                self.broken = true;
            }
            return Err(format!("posting a probe across the wire: {e}"));
        }
        self.refused_posts = 0;
        self.outstanding += 1;
        Ok(())
    }

    /// A completion of this requester's queue pair (`ok`: its status was success); a
    /// failed one breaks it. Returns false for another queue pair's completion.
    pub fn completed(&mut self, qp_num: u32, ok: bool) -> bool {
        if qp_num != self.qp.qp_num() {
            return false;
        }
        self.outstanding = self.outstanding.saturating_sub(1);
        if !ok && !self.broken {
            self.broken = true;
            tracing::warn!(peer = %crate::peer::host_name(self.peer), "a probe across the wire failed: its queue pair is made again");
        }
        true
    }
}

/// A member's responder.
struct Responder {
    _qp: QueuePair,
    offer: ProbeEndpoint,
    made_at: u64,
}

/// The responder queue pairs this host keeps for members that probe it.
#[derive(Default)]
pub struct Responders {
    held: BTreeMap<NodeId, Responder>,
    /// Offers not yet served (the member's responder was made less than
    /// [`REMAKE_INTERVAL`] ago): the newest per member.
    pending: BTreeMap<NodeId, ProbeEndpoint>,
    /// An offer was refused because [`MAX_RESPONDERS`] were held (said once: members
    /// choose how often they offer).
    refusal_said: bool,
}

impl Responders {
    /// A member's offer; served by [`Responders::answers`].
    pub fn offered(&mut self, peer: NodeId, offer: ProbeEndpoint) {
        if self.held.get(&peer).is_some_and(|r| r.offer == offer) {
            return;
        }
        if !self.held.contains_key(&peer) && self.held.len() >= MAX_RESPONDERS {
            if !self.refusal_said {
                tracing::warn!(
                    peer = %crate::peer::host_name(peer),
                    "a member's probe offer not served: {MAX_RESPONDERS} responders held"
                );
                self.refusal_said = true;
            }
            return;
        }
        self.pending.insert(peer, offer);
    }

    /// Serves the offers that are due: a responder connected to each, and the answer
    /// to send its member.
    pub fn answers(&mut self, site: &Site, now_ns: u64, out: &mut Vec<(NodeId, ProbeEndpoint)>) {
        let due: Vec<NodeId> = self
            .pending
            .keys()
            .filter(|peer| {
                self.held.get(peer).is_none_or(|r| {
                    now_ns >= r.made_at.saturating_add(REMAKE_INTERVAL.as_nanos() as u64)
                })
            })
            .copied()
            .collect();
        for peer in due {
            let Some(offer) = self.pending.remove(&peer) else {
                continue;
            };
            match Self::make(site, offer, now_ns) {
                Ok((qp, answer)) => {
                    self.held.insert(
                        peer,
                        Responder {
                            _qp: qp,
                            offer,
                            made_at: now_ns,
                        },
                    );
                    out.push((peer, answer));
                }
                Err(e) => tracing::warn!(%peer, error = %e, "a peer's probe not served"),
            }
        }
    }

    fn make(
        site: &Site,
        offer: ProbeEndpoint,
        now_ns: u64,
    ) -> Result<(QueuePair, ProbeEndpoint), String> {
        let qp = QueuePair::create_rc(&site.pd, &site.quiet_cq, &site.quiet_cq, caps())
            .map_err(|e| format!("creating a responder queue pair: {e}"))?;
        let psn = psn_from(now_ns);
        qp.connect_with_ack_timeout(
            site.port,
            site.gid_index,
            psn,
            &verbs_end(&offer),
            WIRE_ACK_TIMEOUT,
        )
        .map_err(|e| format!("connecting a responder queue pair: {e}"))?;
        let mut answer = end_of(&qp, site, psn)?;
        answer.rkey = site.mr.rkey();
        answer.addr = site.mr.addr() + TARGET_OFFSET;
        answer.answers_qpn = offer.qpn;
        Ok((qp, answer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psns_fit_24_bits_and_move_with_the_clock() {
        assert!(psn_from(u64::MAX) <= 0xff_ffff);
        assert_ne!(psn_from(0), psn_from(1 << 20));
    }
}
