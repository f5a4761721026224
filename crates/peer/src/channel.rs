//! One host's end of the peer channel: what it tells each peer, what each peer told it.
//!
//! [`Channel`] is fed datagrams ([`receive`](Channel::receive)), this host's demands
//! against each peer ([`set_demand`](Channel::set_demand)), its current grant
//! ([`set_grant`](Channel::set_grant)), the ends of its reference probe's queue pairs
//! ([`set_probe_offer`](Channel::set_probe_offer),
//! [`set_probe_answer`](Channel::set_probe_answer)), the side channels of its shapers'
//! queue pairs connected to each peer ([`set_pairings`](Channel::set_pairings)), and the
//! time; it hands out datagrams to send ([`poll_transmit`](Channel::poll_transmit)) and
//! [`ChannelEvent`]s, and says when it next needs the time
//! ([`poll_timeout`](Channel::poll_timeout)).
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
//! cap; changes in between coalesce. A peer whose flows this host counts but that it
//! grants nothing (one host's incast) gets a keepalive every half [`UNANSWERED`], so that
//! it never takes its session for lost.
//!
//! The reference probe's endpoints ride the same channel. A host that probes a peer sends
//! it a probe offer (its requester queue pair's end); the peer makes a responder queue
//! pair for it and sends back a probe answer (that queue pair's end, the memory the
//! prober WRITEs into, and the offer's queue pair number it answers). Each goes when it
//! changes and again every [`PROBE_REFRESH`] while it is set (they change only when a
//! queue pair is made, so a lost one need not be made good within a demand's refresh);
//! setting `None` stops it, with no message. They go within the same per-peer cap and
//! burst, after any demand or grant due at the same moment, so that they never hold
//! those back by more than one message. A probe offer or answer to send makes a session
//! as a demand does; a new session is confirmed by a demand, a grant or a keepalive,
//! never by a probe message (a host of version 3 that predates the probe refuses those
//! kinds, and would never take the session).
//!
//! Pairings (kind 5) ride the same channel. A shaper splits SENDs and WRITEs with
//! immediate only when the shaper at the other end of the RC queue pair takes part, and
//! reaches it over that process's side channel (a UD queue pair), whose number the RC
//! queue pair's remote end does not give. So this host tells each peer, for every one of
//! its shapers' bandwidth-classed RC queue pairs connected to that peer, the two queue
//! pair numbers and the side channel ([`Pairing`]); the peer's daemon matches them
//! against what its own shapers reported. The caller sets the whole set toward a peer at
//! once ([`Channel::set_pairings`]). Pairings the last set did not hold are new: they go
//! first, as soon as the send cap allows, up to [`wire::MAX_PAIRINGS`] a message. Besides,
//! the whole set goes again in rotation, one message of up to [`wire::MAX_PAIRINGS`]
//! entries every [`PAIRING_REFRESH`], so that a lost message is made good within one
//! rotation (at most [`MAX_PAIRINGS_PER_PEER`] / [`wire::MAX_PAIRINGS`] = 32 messages,
//! 8 s). An empty set sends nothing, and a pairing dropped from the set is not withdrawn
//! (the peer is not told, as of a probe offer set to `None`). A new session makes the
//! whole set new again and restarts the rotation from its beginning. Pairings go within
//! the same per-peer cap and burst, after any demand, grant or probe message due at the
//! same moment: they are the least urgent (a queue pair whose pairing is late only goes
//! unsplit a while longer), and a large set never holds the others back by more than one
//! message. Like a probe message, a pairings message makes a session but never confirms
//! one.
//!
//! A peer that sends this host probe or pairings messages (the rendezvous of queue pairs)
//! gets a keepalive every half [`UNANSWERED`] while they keep coming, as one whose flows
//! it counts does: one end may have nothing to send back (an offer not answered yet, an
//! answer to a prober that stopped, pairings toward a host with no shaper of its own),
//! and would otherwise take its session for lost and handshake every [`UNANSWERED`].
//!
//! # Sessions
//! Every pair of members talks over a Noise session (`Noise_KK_25519_ChaChaPoly_BLAKE2s`
//! through snow: both ends know each other's static key from the member list), made by a
//! two-message handshake and used with explicit counters (snow's stateless transport).
//! The peer a transport message comes from is the member whose session decrypts it; no
//! header field is trusted for identity. A host that has something to send a member and no
//! session with it initiates; the initiator's first transport message (a keepalive when
//! nothing else is due) confirms the session to the responder, which until then keeps
//! its confirmed session, so that a replayed initiation makes at most a pending session
//! and never breaks a live one. A session is replaced by a new handshake after
//! [`REKEY_AFTER`] (its initiator rekeys; its responder [`RESPONDER_REKEY_DELAY`] later if
//! the initiator has not) or [`REKEY_AFTER_MESSAGES`] messages, or when this host has sent
//! on it for [`UNANSWERED`] without hearing from the peer (the peer restarted and lost the
//! session); it is never used past [`REJECT_AFTER`] or [`REJECT_AFTER_MESSAGES`]. The
//! session it replaces is kept [`OVERLAP`] for messages in flight. There are no clocks
//! in any message: a restarted host handshakes again ([`Channel::greet`] at start).
//! When both ends initiate at once, the end with the lower static public key goes on as
//! initiator and the other answers (a deterministic tie-break).
//!
//! # Receiving
//! A datagram's framing is checked ([`crate::wire::parse`]). An initiation must name a
//! member ([`Refusal::NotMember`] otherwise, before any computation), must not repeat an
//! ephemeral key recently authenticated from that member ([`Refusal::Replayed`]), and must
//! carry the MAC of the pair key this host shares with that member
//! ([`crate::keys::PairKey`], computed once per member and key; [`Refusal::Authentication`]
//! otherwise): all before any DH or bucket, at the cost of one keyed hash. Only then does
//! it take a token of that member's handshake bucket ([`HANDSHAKES_PER_SEC`]: the DH is the
//! work to bound) and must complete the handshake's DH with that member's static key. A
//! flood without one of the pair's keys never reaches the bucket, so the member it names
//! handshakes as if there were none; the member's own flood, or the replay of more of its
//! past initiations than [`SEEN_EPHEMERALS`] holds, spends that member's budget alone and
//! leaves its live sessions alone. A response must match an initiation in flight and carry
//! the pair key's MAC (a forged one leaves the initiation in flight). A transport message
//! must name a live session ([`Refusal::UnknownSession`]), carry a counter the session's
//! replay window ([`crate::replay`]) has not seen, and decrypt. Only then is the member's
//! message bucket (a token bucket of [`ChannelConfig::max_messages_per_sec`], a tenth of a
//! second deep) charged, and a demand must hold at most
//! [`ChannelConfig::max_flows_per_peer`] flows. So nothing a host without a member's key
//! sends touches a table, a bucket or a log, and a member's flood costs only its own
//! budget.
//!
//! A probe offer or answer that passes those checks is kept as that member's latest
//! ([`Channel::probe_offer_from`], [`Channel::probe_answer_from`]), and one that differs
//! from the one kept before raises [`ChannelEvent::ProbeOffer`] or
//! [`ChannelEvent::ProbeAnswer`]; a refresh of the same raises nothing. They do not lapse
//! with the peer's silence, as demands and grants do: the prober learns that its target
//! is gone from its queue pair (its WRITEs fail), and what a host keeps of a member goes
//! only with the member ([`Channel::set_members`]).
//!
//! A pairings message that passes those checks raises [`ChannelEvent::Pairings`] every
//! time, its refreshes too, and the channel keeps nothing of it: the daemon's match is
//! idempotent, and a set that goes over several messages has no one message that holds
//! it all.

use std::collections::VecDeque;
use std::time::Duration;

use justitia_core::flow::Weight;
use justitia_core::incast::{incast_share, IncastUnit};
use justitia_core::remote_read::ReadGuarantee;
use rand_chacha::ChaCha20Rng;
use rand_core::{RngCore, SeedableRng};
use snow::params::NoiseParams;
use snow::{HandshakeState, StatelessTransportState};

use crate::keys::{PairKey, PrivateKey, PublicKey, KEY_LEN};
use crate::replay::ReplayWindow;
use crate::wire::{
    self, Body, DemandEntry, Grant, Message, Pairing, ProbeEndpoint, Role, MAX_DEMAND_ENTRIES,
    MAX_PAIRINGS,
};
use crate::{NodeId, Refusal};

/// The Noise protocol every session runs.
pub const NOISE_PATTERN: &str = "Noise_KK_25519_ChaChaPoly_BLAKE2s";
/// Bound into every handshake: a peer of another protocol version cannot complete one.
const PROLOGUE: &[u8] = b"justitia-peer v3";
/// A session's initiator starts a new handshake after this long (WireGuard's figure).
pub const REKEY_AFTER: Duration = Duration::from_secs(120);
/// Its responder does, if the initiator has not, this much later: so both rarely start one.
pub const RESPONDER_REKEY_DELAY: Duration = Duration::from_secs(10);
/// A session is never used past this age.
pub const REJECT_AFTER: Duration = Duration::from_secs(180);
/// A session's sender starts a new handshake after this many messages.
pub const REKEY_AFTER_MESSAGES: u64 = 1 << 60;
/// No counter at or above this is sent or accepted (WireGuard's figure, far below the
/// nonce's 2^64 - 1, which snow reserves).
pub const REJECT_AFTER_MESSAGES: u64 = u64::MAX - (1 << 13);
/// A host that sent on a session this long after it last heard anything from the peer
/// starts a new handshake: the peer may have restarted and lost the session.
pub const UNANSWERED: Duration = Duration::from_secs(1);
/// An initiation not answered within this is sent again (while there is something to send).
pub const HANDSHAKE_RETRY: Duration = Duration::from_millis(100);
/// A replaced session, and a replaced private key, still serve messages in flight this long.
pub const OVERLAP: Duration = Duration::from_secs(10);
/// Initiations naming a member this host computes per second (a member retries at most
/// every [`HANDSHAKE_RETRY`], so 10 a second): the CPU a flood naming one member takes is
/// bounded by it, whoever sends the flood.
pub const HANDSHAKES_PER_SEC: f64 = 10.0;
/// Initiations naming a member computed back to back.
pub const HANDSHAKE_BURST: f64 = 5.0;
/// Authenticated initiator ephemeral keys remembered per member, to drop exact replays
/// before any DH.
pub const SEEN_EPHEMERALS: usize = 64;

/// The channel's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChannelConfig {
    /// Members held at most (the member list is refused when longer).
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

/// How often a probe offer or answer that has not changed is sent again: its queue pair
/// is made once per probe, so a lost one is made good within a quarter second, and the
/// refreshes cost four messages a second per peer and kind.
pub const PROBE_REFRESH: Duration = Duration::from_millis(250);

/// How often the rotation of the pairings this host sends a peer sends its next message
/// (up to [`wire::MAX_PAIRINGS`] of them): a new pairing goes at once, so the rotation
/// only makes lost messages good, and costs at most four messages a second per peer.
pub const PAIRING_REFRESH: Duration = Duration::from_millis(250);

/// The most pairings this host sends one peer ([`Channel::set_pairings`]): 4,096
/// bandwidth-classed RC queue pairs between two hosts is far above what shaped
/// applications open (one per connection, a few per core), and bounds both what the
/// channel keeps per peer (64 KiB) and the rotation that makes a lost message good (32
/// messages of [`wire::MAX_PAIRINGS`], 8 s at [`PAIRING_REFRESH`]).
pub const MAX_PAIRINGS_PER_PEER: usize = 4096;

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
    /// More members than `max_peers`.
    #[error("{members} members listed; max_peers is {max}")]
    TooManyMembers {
        /// Members listed.
        members: usize,
        /// The cap.
        max: usize,
    },
    /// Two members share a public key: one could speak for the other.
    #[error("members {0} and {1} share a public key")]
    SharedKey(NodeId, NodeId),
    /// A member listed twice.
    #[error("member {0} is listed twice")]
    Duplicate(NodeId),
    /// A member's public key of small order: anyone could compute its pair key.
    #[error("member {0}'s public key is of small order (not one `justitiad pubkey` writes)")]
    SmallOrderKey(NodeId),
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

/// A member of the cluster: a host this one talks to, and the static key it proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Its node id.
    pub node: NodeId,
    /// Its static public key.
    pub public: PublicKey,
}

/// A datagram to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// The member it is for (the driver finds its address; never the source of a datagram).
    pub to: NodeId,
    /// The datagram.
    pub bytes: Vec<u8>,
}

/// What the driver acts on.
#[derive(Debug, Clone, PartialEq)]
pub enum ChannelEvent {
    /// The flows peers hold against this host changed: read [`Channel::served`] again and
    /// tell the control loop.
    ServedChanged,
    /// A peer's newer guarantee: this host's READ flows against it are capped at it, and
    /// its bandwidth flows into it paced at `incast_bytes_per_sec` per unit of weight.
    Guarantee {
        /// The peer.
        peer: NodeId,
        /// Its READ guarantee, numbered by (the session's place among this channel's
        /// sessions, the message's counter): newer sessions and messages number higher.
        guarantee: ReadGuarantee,
        /// Its incast share per unit of weight; 0 when it gives none.
        incast_bytes_per_sec: f64,
    },
    /// A peer went silent: its guarantee no longer constrains (fail-open).
    GuaranteeLapsed {
        /// The peer.
        peer: NodeId,
    },
    /// A peer's new probe offer: make a responder queue pair for its requester `offer`
    /// and answer with [`Channel::set_probe_answer`]. Raised when the offer differs from
    /// the last one the peer sent, not at its refreshes.
    ProbeOffer {
        /// The peer (the prober).
        peer: NodeId,
        /// Its requester queue pair's end.
        offer: ProbeEndpoint,
    },
    /// A peer's new probe answer: connect the requester queue pair whose number is
    /// `answer.answers_qpn` to it (an answer to an offer since replaced names the old
    /// number). Raised when the answer differs from the last one the peer sent.
    ProbeAnswer {
        /// The peer (the probe's target).
        peer: NodeId,
        /// Its responder queue pair's end and the memory to WRITE into.
        answer: ProbeEndpoint,
    },
    /// Some of a peer's pairings toward this host: the side channels of the processes at
    /// its end of RC queue pairs connected to this host. Match each exactly against the
    /// queue pairs this host's shapers reported (`that_qpn` here, connected to the peer's
    /// `this_qpn`) and tell the shaper its side channel. Raised for every message, new
    /// pairings and refreshes alike (a set larger than [`wire::MAX_PAIRINGS`] comes over
    /// several); nothing says a pairing is gone.
    Pairings {
        /// The peer.
        peer: NodeId,
        /// One message's pairings (1 ..= [`wire::MAX_PAIRINGS`], no two with the same
        /// queue pairs; see [`Pairing`]'s invariants).
        pairings: Vec<Pairing>,
    },
}

/// A token bucket.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Duration,
}

impl Bucket {
    fn full(burst: f64, now: Duration) -> Self {
        Bucket {
            tokens: burst,
            at: now,
        }
    }

    /// Takes a token at `rate`/s up to `burst`, or refuses.
    fn take(&mut self, now: Duration, rate: f64, burst: f64) -> Result<(), Refusal> {
        let elapsed = now.saturating_sub(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(burst);
        self.at = now;
        if self.tokens < 1.0 {
            return Err(Refusal::RateLimited);
        }
        self.tokens -= 1.0;
        Ok(())
    }
}

/// One session with a member: its keys (snow's stateless transport, nonces explicit), the
/// indices each end knows it by, and its counters.
struct Session {
    local: u32,
    remote: u32,
    transport: StatelessTransportState,
    /// The next counter to send.
    sent: u64,
    window: ReplayWindow,
    created: Duration,
    initiator: bool,
    /// Its place among this channel's sessions: numbers the guarantees it carries.
    generation: u64,
    /// Set when the session was replaced or the key rotated: dropped then.
    expires: Option<Duration>,
    /// A new handshake is wanted (the private key changed).
    rekey: bool,
    last_sent: Option<Duration>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("local", &self.local)
            .field("remote", &self.remote)
            .field("sent", &self.sent)
            .field("created", &self.created)
            .field("initiator", &self.initiator)
            .finish_non_exhaustive()
    }
}

impl Session {
    fn live(&self, now: Duration) -> bool {
        self.created.saturating_add(REJECT_AFTER) > now
            && self.expires.is_none_or(|t| t > now)
            && self.sent < REJECT_AFTER_MESSAGES
    }

    fn wants_rekey(&self, now: Duration, last_heard: Option<Duration>) -> bool {
        let age = now.saturating_sub(self.created);
        let limit = if self.initiator {
            REKEY_AFTER
        } else {
            REKEY_AFTER + RESPONDER_REKEY_DELAY
        };
        let unanswered = self.last_sent.is_some_and(|sent| {
            sent.saturating_sub(last_heard.unwrap_or(self.created)) >= UNANSWERED
        });
        self.rekey || age >= limit || self.sent >= REKEY_AFTER_MESSAGES || unanswered
    }
}

/// This host's handshake in flight with a member.
struct Initiating {
    state: HandshakeState,
    index: u32,
    sent_at: Duration,
}

impl std::fmt::Debug for Initiating {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Initiating")
            .field("index", &self.index)
            .field("sent_at", &self.sent_at)
            .finish_non_exhaustive()
    }
}

/// Which of a peer's sessions a transport message named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Pending,
    Current,
    Previous,
}

#[derive(Debug)]
struct Peer {
    node: NodeId,
    public: PublicKey,
    /// The key its handshake messages are MACed with, under this host's current key.
    pair: PairKey,
    /// The same under this host's previous key, while that key still answers.
    pair_previous: Option<PairKey>,
    /// Initiator ephemeral keys that authenticated lately, oldest first.
    seen: VecDeque<[u8; KEY_LEN]>,
    handshakes: Bucket,
    initiating: Option<Initiating>,
    /// A session this host answered and the initiator has not confirmed yet.
    pending: Option<Session>,
    current: Option<Session>,
    previous: Option<Session>,
    /// A handshake message to send it.
    out: Option<Vec<u8>>,
    /// This host completed a handshake as initiator: its first message is due.
    confirm_due: bool,
    /// When anything last authenticated from it.
    last_heard: Option<Duration>,
    /// When a transport message from it was last accepted (for the silence).
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
    /// This host's probe offer to it, and its probe answer to it.
    probe_offer: ProbeSending,
    probe_answer: ProbeSending,
    /// Its latest probe offer and answer to this host (kept through silence).
    offer_from: Option<ProbeEndpoint>,
    answer_from: Option<ProbeEndpoint>,
    /// This host's pairings toward it.
    pairings: PairingSending,
    /// When a probe or pairings message from it was last accepted: it is owed keepalives
    /// a while, since it may have nothing to hear back.
    rendezvous_heard: Option<Duration>,
    /// The sender's token bucket for messages to it: tokens at `send_at`.
    send_tokens: f64,
    send_at: Duration,
}

impl Peer {
    fn new(member: Member, pair: PairKey, now: Duration, burst: f64) -> Self {
        Peer {
            node: member.node,
            public: member.public,
            pair,
            pair_previous: None,
            seen: VecDeque::new(),
            handshakes: Bucket::full(HANDSHAKE_BURST, now),
            initiating: None,
            pending: None,
            current: None,
            previous: None,
            out: None,
            confirm_due: false,
            last_heard: None,
            heard_at: now,
            bucket: Bucket::full(burst, now),
            served: Vec::new(),
            grant: None,
            demand: Vec::new(),
            demand_dirty: false,
            demand_sent: None,
            granted: None,
            grant_sent: None,
            probe_offer: ProbeSending::default(),
            probe_answer: ProbeSending::default(),
            offer_from: None,
            answer_from: None,
            pairings: PairingSending::default(),
            rendezvous_heard: None,
            send_tokens: SEND_BURST,
            send_at: now,
        }
    }

    fn session(&self, slot: Slot) -> Option<&Session> {
        match slot {
            Slot::Pending => self.pending.as_ref(),
            Slot::Current => self.current.as_ref(),
            Slot::Previous => self.previous.as_ref(),
        }
    }

    fn session_mut(&mut self, slot: Slot) -> Option<&mut Session> {
        match slot {
            Slot::Pending => self.pending.as_mut(),
            Slot::Current => self.current.as_mut(),
            Slot::Previous => self.previous.as_mut(),
        }
    }

    fn indices(&self) -> impl Iterator<Item = u32> + '_ {
        [&self.pending, &self.current, &self.previous]
            .into_iter()
            .flatten()
            .map(|s| s.local)
            .chain(self.initiating.as_ref().map(|i| i.index))
    }

    /// Makes `session` the current one; the one it replaces serves messages in flight for
    /// [`OVERLAP`]. What this host tells the peer goes again at once on the new session:
    /// a new session often means the peer restarted and knows nothing.
    fn install(&mut self, session: Session, now: Duration) {
        self.demand_dirty |= !self.demand.is_empty();
        self.granted = None;
        self.probe_offer.resend();
        self.probe_answer.resend();
        self.pairings.resend(now);
        if let Some(mut old) = self.current.replace(session) {
            let until = now.saturating_add(OVERLAP);
            old.expires = Some(old.expires.map_or(until, |t| t.min(until)));
            self.previous = Some(old);
        }
    }

    /// When the handshake in flight started: this host's initiation, or the peer's that
    /// this host answered and that awaits the peer's confirmation (answering one, this host
    /// waits for it rather than start its own).
    fn handshake_started(&self) -> Option<Duration> {
        let initiated = self.initiating.as_ref().map(|h| h.sent_at);
        let answered = self.pending.as_ref().map(|s| s.created);
        initiated.into_iter().chain(answered).max()
    }

    fn send_session(&self, now: Duration) -> Option<&Session> {
        self.current.as_ref().filter(|s| s.live(now))
    }

    /// Drops the sessions and handshakes (its key changed).
    fn forget_sessions(&mut self) {
        self.seen.clear();
        self.initiating = None;
        self.pending = None;
        self.current = None;
        self.previous = None;
        self.out = None;
        self.confirm_due = false;
    }
}

/// A snow resolver whose randomness is a ChaCha20 stream from a seed the channel draws
/// from its own seeded generator: the simulator's runs repeat exactly, the daemon's seed
/// comes from the kernel. The primitives are snow's own.
struct SeededResolver {
    seed: [u8; 32],
}

struct SeededRandom(ChaCha20Rng);

impl snow::types::Random for SeededRandom {
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), snow::Error> {
        self.0.fill_bytes(dest);
        Ok(())
    }
}

impl snow::resolvers::CryptoResolver for SeededResolver {
    fn resolve_rng(&self) -> Option<Box<dyn snow::types::Random>> {
        Some(Box::new(SeededRandom(ChaCha20Rng::from_seed(self.seed))))
    }

    fn resolve_dh(&self, choice: &snow::params::DHChoice) -> Option<Box<dyn snow::types::Dh>> {
        snow::resolvers::DefaultResolver.resolve_dh(choice)
    }

    fn resolve_hash(
        &self,
        choice: &snow::params::HashChoice,
    ) -> Option<Box<dyn snow::types::Hash>> {
        snow::resolvers::DefaultResolver.resolve_hash(choice)
    }

    fn resolve_cipher(
        &self,
        choice: &snow::params::CipherChoice,
    ) -> Option<Box<dyn snow::types::Cipher>> {
        snow::resolvers::DefaultResolver.resolve_cipher(choice)
    }
}

/// One host's end of the channel (see the module documentation).
pub struct Channel {
    config: ChannelConfig,
    own: NodeId,
    key: PrivateKey,
    public: PublicKey,
    /// The key before the last rotation, still answering initiations until its time.
    previous_key: Option<(PrivateKey, Duration)>,
    params: NoiseParams,
    rng: ChaCha20Rng,
    next_generation: u64,
    /// One entry per member, in the member list's order.
    peers: Vec<Peer>,
    /// The grant this host gives now, once it has one to give.
    grant: Option<Grant>,
    /// What the grant is built from: the loop's READ guarantee, the whole RNIC's for
    /// incast-only grants, and the link's rate.
    read_grant: Option<ReadGuarantee>,
    unconstrained: Option<ReadGuarantee>,
    link: f64,
    events: VecDeque<ChannelEvent>,
    now: Duration,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("own", &self.own)
            .field("public", &self.public)
            .field("peers", &self.peers)
            .finish_non_exhaustive()
    }
}

/// Why a channel could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// The settings or the member list.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// snow does not know the Noise pattern (a build without its primitives).
    #[error("the Noise pattern {NOISE_PATTERN} is not available: {0}")]
    Noise(String),
}

impl Channel {
    /// A channel for host `own` with its private `key`, talking to `members` (this host
    /// among them is skipped). `seed` is the only randomness it uses (the daemon draws it
    /// from the kernel, the simulator fixes it).
    pub fn new(
        config: ChannelConfig,
        own: NodeId,
        key: PrivateKey,
        members: &[Member],
        seed: [u8; 32],
        now: Duration,
    ) -> Result<Self, StartError> {
        config.validate()?;
        let params: NoiseParams = NOISE_PATTERN
            .parse()
            .map_err(|e: snow::Error| StartError::Noise(e.to_string()))?;
        let public = key.public();
        let mut channel = Channel {
            config,
            own,
            key,
            public,
            previous_key: None,
            params,
            rng: ChaCha20Rng::from_seed(seed),
            next_generation: 0,
            peers: Vec::new(),
            grant: None,
            read_grant: None,
            unconstrained: None,
            link: 0.0,
            events: VecDeque::new(),
            now,
            buf: vec![0; wire::MAX_DATAGRAM],
        };
        channel.set_members(now, members)?;
        Ok(channel)
    }

    /// This host's node id.
    pub fn own(&self) -> NodeId {
        self.own
    }

    /// This host's public key.
    pub fn public_key(&self) -> PublicKey {
        self.public
    }

    /// The settings.
    pub fn config(&self) -> &ChannelConfig {
        &self.config
    }

    /// Whether `node` is a member (this host is not its own member).
    pub fn is_member(&self, node: NodeId) -> bool {
        self.find(node).is_some()
    }

    /// Replaces the member list (a configuration reload). A member kept with the same key
    /// keeps its state; one whose key changed starts afresh (its sessions are dropped); one
    /// no longer listed is forgotten (its flows stop counting here, its grant lapses, and
    /// the probe offers and answers to and from it and the pairings toward it go with no
    /// event: the caller removed it).
    pub fn set_members(&mut self, now: Duration, members: &[Member]) -> Result<(), ConfigError> {
        let now = self.advance(now);
        let listed: Vec<Member> = members
            .iter()
            .copied()
            .filter(|m| m.node != self.own)
            .collect();
        if listed.len() > self.config.max_peers {
            return Err(ConfigError::TooManyMembers {
                members: listed.len(),
                max: self.config.max_peers,
            });
        }
        let mut pairs = Vec::with_capacity(listed.len());
        for (i, m) in listed.iter().enumerate() {
            if let Some(other) = listed[..i].iter().find(|o| o.node == m.node) {
                return Err(ConfigError::Duplicate(other.node));
            }
            if let Some(other) = listed[..i].iter().find(|o| o.public == m.public) {
                return Err(ConfigError::SharedKey(other.node, m.node));
            }
            // One X25519 per member at a reload: never per datagram.
            let kept = self
                .peers
                .iter()
                .find(|p| p.node == m.node && p.public == m.public)
                .map(|p| p.pair.clone());
            let pair = match kept {
                Some(pair) => pair,
                None => self
                    .key
                    .pair_key(&m.public)
                    .ok_or(ConfigError::SmallOrderKey(m.node))?,
            };
            pairs.push(pair);
        }
        let burst = self.burst();
        let mut old = std::mem::take(&mut self.peers);
        let mut served_changed = false;
        for p in &old {
            if !listed.iter().any(|m| m.node == p.node) {
                served_changed |= !p.served.is_empty();
                if p.grant.is_some() {
                    self.events
                        .push_back(ChannelEvent::GuaranteeLapsed { peer: p.node });
                }
            }
        }
        for (m, pair) in listed.into_iter().zip(pairs) {
            let peer = match old.iter().position(|p| p.node == m.node) {
                Some(i) => {
                    let mut p = old.swap_remove(i);
                    if p.public != m.public {
                        p.public = m.public;
                        p.pair = pair;
                        p.pair_previous = None;
                        p.forget_sessions();
                    }
                    p
                }
                None => Peer::new(m, pair, now, burst),
            };
            self.peers.push(peer);
        }
        if served_changed {
            self.regrant();
            self.events.push_back(ChannelEvent::ServedChanged);
        }
        Ok(())
    }

    /// Replaces this host's private key (a rotation): new handshakes use it at once, every
    /// session is renewed by one, and until then (at most [`OVERLAP`]) the old sessions
    /// and the old key still serve.
    pub fn set_key(&mut self, now: Duration, key: PrivateKey) {
        let now = self.advance(now);
        if key == self.key {
            return;
        }
        let until = now.saturating_add(OVERLAP);
        let old = std::mem::replace(&mut self.key, key);
        self.public = self.key.public();
        self.previous_key = Some((old, until));
        for p in &mut self.peers {
            // Small order was refused when the member was listed, whatever this host's key:
            // the new pair key exists. Were it missing, the old one would only fail to verify.
            if let Some(pair) = self.key.pair_key(&p.public) {
                p.pair_previous = Some(std::mem::replace(&mut p.pair, pair));
            }
            p.initiating = None;
            for s in [&mut p.current, &mut p.pending].into_iter().flatten() {
                s.rekey = true;
                s.expires = Some(s.expires.map_or(until, |t| t.min(until)));
            }
        }
        self.greet(now);
    }

    /// Starts a handshake with every member that has no session and none in flight: at
    /// start, so that a peer holding a session this host lost learns of the restart at once.
    pub fn greet(&mut self, now: Duration) {
        let now = self.advance(now);
        for i in 0..self.peers.len() {
            let p = &self.peers[i];
            let fresh = p.send_session(now).is_some_and(|s| !s.rekey);
            if !fresh && p.initiating.is_none() && p.out.is_none() {
                self.initiate(i, now);
            }
        }
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

    fn builder(&mut self) -> snow::Builder<'_> {
        let mut seed = [0; 32];
        self.rng.fill_bytes(&mut seed);
        snow::Builder::with_resolver(self.params.clone(), Box::new(SeededResolver { seed }))
    }

    /// A session index no live session or handshake of this host uses.
    fn new_index(&mut self) -> u32 {
        loop {
            let index = self.rng.next_u32();
            if !self.peers.iter().any(|p| p.indices().any(|i| i == index)) {
                return index;
            }
        }
    }

    /// Queues an initiation to peer `i`. A failure of snow (none is expected with keys
    /// that passed [`PrivateKey::from_bytes`]) leaves nothing queued: retried later.
    fn initiate(&mut self, i: usize, now: Duration) {
        let index = self.new_index();
        let key = self.key.clone();
        let remote = self.peers[i].public;
        let mut noise = [0; wire::NOISE_HANDSHAKE_LEN];
        let state = self
            .builder()
            .prologue(PROLOGUE)
            .and_then(|b| b.local_private_key(key.bytes()))
            .and_then(|b| b.remote_public_key(&remote.0))
            .and_then(|b| b.build_initiator());
        let Ok(mut state) = state else { return };
        if state.write_message(&[], &mut noise).is_err() {
            return;
        }
        let own = self.own;
        let p = &mut self.peers[i];
        let mut datagram = wire::initiation(own, index, &noise);
        datagram.extend_from_slice(&p.pair.mac(&datagram));
        p.out = Some(datagram);
        p.initiating = Some(Initiating {
            state,
            index,
            sent_at: now,
        });
    }

    /// This host's flows against `peer` now (all of them: the demand replaces the last).
    /// Refused if `peer` is not a member, or the demand holds more entries than a message
    /// carries or more flows than a peer may hold.
    pub fn set_demand(
        &mut self,
        now: Duration,
        peer: NodeId,
        demand: &[DemandEntry],
    ) -> Result<(), Refusal> {
        self.advance(now);
        if demand.len() > MAX_DEMAND_ENTRIES
            || demand.iter().map(|e| u32::from(e.flows)).sum::<u32>()
                > self.config.max_flows_per_peer
        {
            return Err(Refusal::TooManyFlows);
        }
        let i = self.find(peer).ok_or(Refusal::NotMember)?;
        let p = &mut self.peers[i];
        if p.demand != demand {
            p.demand = demand.to_vec();
            p.demand_dirty = true;
        }
        Ok(())
    }

    /// The probe offer this host sends `peer` (its requester queue pair's end), or `None`
    /// to stop sending one (the peer is not told: it keeps the last it took). A changed
    /// offer goes as soon as the send cap allows, a set one again every
    /// [`PROBE_REFRESH`]. Refused if `peer` is not a member, or the offer is not one the
    /// wire carries ([`ProbeEndpoint::check_offer`]: the peer would refuse it).
    pub fn set_probe_offer(
        &mut self,
        now: Duration,
        peer: NodeId,
        offer: Option<ProbeEndpoint>,
    ) -> Result<(), Refusal> {
        self.advance(now);
        if let Some(o) = &offer {
            o.check_offer()?;
        }
        let i = self.find(peer).ok_or(Refusal::NotMember)?;
        self.peers[i].probe_offer.set(offer);
        Ok(())
    }

    /// The probe answer this host sends `peer` (its responder queue pair's end for the
    /// peer's offer, and the memory the peer WRITEs into), or `None` to stop sending one.
    /// Sent as [`set_probe_offer`](Self::set_probe_offer)'s offer is; refused if `peer` is
    /// not a member or the answer is not one the wire carries
    /// ([`ProbeEndpoint::check_answer`]).
    pub fn set_probe_answer(
        &mut self,
        now: Duration,
        peer: NodeId,
        answer: Option<ProbeEndpoint>,
    ) -> Result<(), Refusal> {
        self.advance(now);
        if let Some(a) = &answer {
            a.check_answer()?;
        }
        let i = self.find(peer).ok_or(Refusal::NotMember)?;
        self.peers[i].probe_answer.set(answer);
        Ok(())
    }

    /// Every pairing this host sends `peer` now (the set replaces the last one; its order
    /// does not matter, and an entry listed twice is taken once). Pairings not in the last
    /// set go as soon as the send cap allows; the whole set goes again in rotation, one
    /// message every [`PAIRING_REFRESH`]; an empty set sends nothing (the peer is not
    /// told). Refused, changing nothing, if a pairing is not one the wire carries
    /// ([`Pairing::check`]), two share (`this_qpn`, `that_qpn`) with different side
    /// channels, there are more than [`MAX_PAIRINGS_PER_PEER`] entries, or `peer` is not a
    /// member: so the peer never refuses what this host sends.
    pub fn set_pairings(
        &mut self,
        now: Duration,
        peer: NodeId,
        pairings: &[Pairing],
    ) -> Result<(), Refusal> {
        let now = self.advance(now);
        // Counted before the copy and sort: a caller's error costs nothing.
        if pairings.len() > MAX_PAIRINGS_PER_PEER {
            return Err(Refusal::OutOfRange("pairing count"));
        }
        for e in pairings {
            e.check()?;
        }
        let mut set = pairings.to_vec();
        set.sort_unstable();
        set.dedup();
        // Sorted, the entries with one key are adjacent.
        if set.windows(2).any(|w| w[0].key() == w[1].key()) {
            return Err(Refusal::OutOfRange("duplicate pairing"));
        }
        let i = self.find(peer).ok_or(Refusal::NotMember)?;
        self.peers[i].pairings.set(now, set);
        Ok(())
    }

    /// The grant this host gives now: its READ guarantee (from the control loop's
    /// [`ReadGuarantee`] event, or the whole RNIC while it counts no remote READ; its own
    /// epoch and sequence are not sent) and its link `link_bytes_per_sec`, shared among
    /// the incast flows it receives. The incast share is the core's ([`incast_share`]: one
    /// unit per sending host and tenant, at its weight) and follows the peers' demands as
    /// they change, without another call.
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

    /// The latest probe offer `peer` sent this host. It does not lapse when the peer goes
    /// silent (a dead prober is seen at its queue pair); it goes with the member.
    pub fn probe_offer_from(&self, peer: NodeId) -> Option<ProbeEndpoint> {
        self.find(peer).and_then(|i| self.peers[i].offer_from)
    }

    /// The latest probe answer `peer` sent this host; kept as
    /// [`probe_offer_from`](Self::probe_offer_from)'s offer is.
    pub fn probe_answer_from(&self, peer: NodeId) -> Option<ProbeEndpoint> {
        self.find(peer).and_then(|i| self.peers[i].answer_from)
    }

    /// Takes a datagram from the network. A refused one changes no demand, grant or
    /// bucket (see the module documentation for the order of the checks).
    pub fn receive(&mut self, now: Duration, datagram: &[u8]) -> Result<(), Refusal> {
        let now = self.advance(now);
        match wire::parse(datagram)? {
            Message::Initiation {
                from,
                sender_index,
                noise,
                covered,
                mac,
            } => self.initiation(now, from, sender_index, noise, (covered, mac)),
            Message::Response {
                sender_index,
                receiver_index,
                noise,
                covered,
                mac,
            } => self.response(now, sender_index, receiver_index, noise, (covered, mac)),
            Message::Transport {
                receiver_index,
                counter,
                ciphertext,
            } => self.transport(now, receiver_index, counter, ciphertext),
        }
    }

    /// Runs the responder's half of a handshake with peer `i` under `key`.
    fn respond(&mut self, i: usize, key: &PrivateKey, noise: &[u8]) -> Option<HandshakeState> {
        let remote = self.peers[i].public;
        let mut state = self
            .builder()
            .prologue(PROLOGUE)
            .and_then(|b| b.local_private_key(key.bytes()))
            .and_then(|b| b.remote_public_key(&remote.0))
            .and_then(|b| b.build_responder())
            .ok()?;
        let mut payload = [0; wire::NOISE_HANDSHAKE_LEN];
        match state.read_message(noise, &mut payload) {
            Ok(0) => Some(state),
            _ => None,
        }
    }

    fn initiation(
        &mut self,
        now: Duration,
        from: NodeId,
        sender_index: u32,
        noise: &[u8],
        (covered, mac): (&[u8], &[u8]),
    ) -> Result<(), Refusal> {
        if from == self.own {
            return Err(Refusal::FromSelf);
        }
        let i = self.find(from).ok_or(Refusal::NotMember)?;
        let mut ephemeral = [0; KEY_LEN];
        ephemeral.copy_from_slice(&noise[..KEY_LEN]);
        let p = &self.peers[i];
        if p.seen.contains(&ephemeral) {
            return Err(Refusal::Replayed);
        }
        // The MAC first (one keyed hash): whoever holds neither key of the pair stops
        // here, before the bucket, so a flood naming this member without its key leaves
        // its handshakes to it. The MAC says which of this host's keys the initiator used.
        let (key, pair) = if p.pair.verify(covered, mac) {
            (self.key.clone(), p.pair.clone())
        } else {
            match (&self.previous_key, &p.pair_previous) {
                (Some((old, until)), Some(pair)) if *until > now && pair.verify(covered, mac) => {
                    (old.clone(), pair.clone())
                }
                _ => return Err(Refusal::Authentication),
            }
        };
        // Charged before the DH, which is the work to bound (two X25519 operations, a
        // few hundred microseconds): initiations that carry the pair's MAC (the member's
        // own, or its past ones replayed) spend this member's budget and no other's.
        self.peers[i]
            .handshakes
            .take(now, HANDSHAKES_PER_SEC, HANDSHAKE_BURST)?;
        let mut state = self
            .respond(i, &key, noise)
            .ok_or(Refusal::Authentication)?;
        let p = &mut self.peers[i];
        if p.seen.len() >= SEEN_EPHEMERALS {
            p.seen.pop_front();
        }
        p.seen.push_back(ephemeral);
        p.last_heard = Some(now);
        if p.initiating
            .as_ref()
            .is_some_and(|h| h.sent_at.saturating_add(HANDSHAKE_RETRY) > now)
            && self.public < p.public
        {
            // Both initiated: the lower static key goes on as initiator; the peer answers
            // ours.
            return Ok(());
        }
        let index = self.new_index();
        let mut noise_out = [0; wire::NOISE_HANDSHAKE_LEN];
        state
            .write_message(&[], &mut noise_out)
            .map_err(|_| Refusal::Authentication)?;
        let transport = state
            .into_stateless_transport_mode()
            .map_err(|_| Refusal::Authentication)?;
        let generation = self.next_generation;
        self.next_generation += 1;
        let p = &mut self.peers[i];
        p.initiating = None;
        let mut datagram = wire::response(index, sender_index, &noise_out);
        datagram.extend_from_slice(&pair.mac(&datagram));
        p.pending = Some(Session {
            local: index,
            remote: sender_index,
            transport,
            sent: 0,
            window: ReplayWindow::default(),
            created: now,
            initiator: false,
            generation,
            expires: None,
            rekey: false,
            last_sent: None,
        });
        p.out = Some(datagram);
        Ok(())
    }

    fn response(
        &mut self,
        now: Duration,
        sender_index: u32,
        receiver_index: u32,
        noise: &[u8],
        (covered, mac): (&[u8], &[u8]),
    ) -> Result<(), Refusal> {
        let i = self
            .peers
            .iter()
            .position(|p| {
                p.initiating
                    .as_ref()
                    .is_some_and(|h| h.index == receiver_index)
            })
            .ok_or(Refusal::UnknownSession)?;
        let mut payload = [0; wire::NOISE_HANDSHAKE_LEN];
        let generation = self.next_generation;
        let p = &mut self.peers[i];
        // Checked before the Noise read, whose failure would spend the initiation: a
        // forged response (its index seen on the path) leaves the handshake in flight.
        // A rotation of this host's key drops initiations in flight, so the current pair
        // key is the one the initiation was made under.
        if !p.pair.verify(covered, mac) {
            return Err(Refusal::Authentication);
        }
        let Some(mut h) = p.initiating.take() else {
            return Err(Refusal::UnknownSession);
        };
        // snow's state after a failed read is spent: the initiation is sent again later.
        if !matches!(h.state.read_message(noise, &mut payload), Ok(0)) {
            return Err(Refusal::Authentication);
        }
        let transport = h
            .state
            .into_stateless_transport_mode()
            .map_err(|_| Refusal::Authentication)?;
        self.next_generation += 1;
        p.install(
            Session {
                local: h.index,
                remote: sender_index,
                transport,
                sent: 0,
                window: ReplayWindow::default(),
                created: now,
                initiator: true,
                generation,
                expires: None,
                rekey: false,
                last_sent: None,
            },
            now,
        );
        p.pending = None;
        p.confirm_due = true;
        p.last_heard = Some(now);
        Ok(())
    }

    fn transport(
        &mut self,
        now: Duration,
        receiver_index: u32,
        counter: u64,
        ciphertext: &[u8],
    ) -> Result<(), Refusal> {
        let (i, slot) = self
            .peers
            .iter()
            .enumerate()
            .find_map(|(i, p)| {
                [Slot::Pending, Slot::Current, Slot::Previous]
                    .into_iter()
                    .find(|&slot| p.session(slot).is_some_and(|s| s.local == receiver_index))
                    .map(|slot| (i, slot))
            })
            .ok_or(Refusal::UnknownSession)?;
        let p = &self.peers[i];
        let Some(session) = p.session(slot).filter(|s| s.live(now)) else {
            return Err(Refusal::UnknownSession);
        };
        if counter >= REJECT_AFTER_MESSAGES {
            return Err(Refusal::OutOfRange("counter"));
        }
        if !session.window.check(counter) {
            return Err(Refusal::Replayed);
        }
        let n = session
            .transport
            .read_message(counter, ciphertext, &mut self.buf)
            .map_err(|_| Refusal::Authentication)?;
        let body = wire::decode_body(&self.buf[..n])?;
        if let Body::Demand(entries) = &body {
            let flows: u32 = entries.iter().map(|e| u32::from(e.flows)).sum();
            if flows > self.config.max_flows_per_peer {
                return Err(Refusal::TooManyFlows);
            }
        }
        let rate = f64::from(self.config.max_messages_per_sec);
        let burst = self.burst();
        let silence = self.config.silence;
        let p = &mut self.peers[i];
        p.bucket.take(now, rate, burst)?;
        let generation = match p.session_mut(slot) {
            Some(s) => {
                s.window.accept(counter);
                s.generation
            }
            None => return Err(Refusal::UnknownSession),
        };
        if slot == Slot::Pending {
            // The initiator's first message confirms the session it made.
            if let Some(s) = p.pending.take() {
                p.install(s, now);
            }
        }
        p.last_heard = Some(now);
        if matches!(body, Body::Grant(_)) && !grant_expected(p, now, silence) {
            return Err(Refusal::Unsolicited);
        }
        p.heard_at = now;
        if matches!(
            body,
            Body::ProbeOffer(_) | Body::ProbeAnswer(_) | Body::Pairings(_)
        ) {
            p.rendezvous_heard = Some(now);
        }
        let mut served_changed = false;
        match body {
            Body::Keepalive => {}
            Body::Demand(mut entries) => {
                entries.sort_unstable();
                if entries != p.served {
                    p.served = entries;
                    served_changed = true;
                }
            }
            Body::Grant(grant) => {
                p.grant = Some(grant);
                let peer = p.node;
                self.events.push_back(ChannelEvent::Guarantee {
                    peer,
                    guarantee: ReadGuarantee {
                        epoch: generation,
                        sequence: counter,
                        fraction: grant.fraction,
                        bytes_per_sec: grant.bytes_per_sec,
                        ops_per_sec: grant.ops_per_sec,
                        chunk_bytes: grant.chunk_bytes,
                    },
                    incast_bytes_per_sec: grant.incast_bytes_per_sec,
                });
            }
            Body::ProbeOffer(offer) => {
                if p.offer_from.replace(offer) != Some(offer) {
                    let peer = p.node;
                    self.events
                        .push_back(ChannelEvent::ProbeOffer { peer, offer });
                }
            }
            Body::ProbeAnswer(answer) => {
                if p.answer_from.replace(answer) != Some(answer) {
                    let peer = p.node;
                    self.events
                        .push_back(ChannelEvent::ProbeAnswer { peer, answer });
                }
            }
            Body::Pairings(pairings) => {
                let peer = p.node;
                self.events
                    .push_back(ChannelEvent::Pairings { peer, pairings });
            }
        }
        if served_changed {
            self.regrant();
            self.events.push_back(ChannelEvent::ServedChanged);
        }
        Ok(())
    }

    /// The next event, oldest first.
    pub fn poll_event(&mut self) -> Option<ChannelEvent> {
        self.events.pop_front()
    }

    /// Lets peers that have been silent too long go (fail-open), and sessions past their
    /// time.
    pub fn handle_timeout(&mut self, now: Duration) {
        let now = self.advance(now);
        let silence = self.config.silence;
        let mut served_changed = false;
        if self.previous_key.as_ref().is_some_and(|(_, t)| *t <= now) {
            self.previous_key = None;
        }
        for p in &mut self.peers {
            for s in [&mut p.pending, &mut p.current, &mut p.previous] {
                if s.as_ref().is_some_and(|s| !s.live(now)) {
                    *s = None;
                }
            }
            if p.heard_at.saturating_add(silence) > now {
                continue;
            }
            if !p.served.is_empty() {
                p.served.clear();
                served_changed = true;
            }
            if p.grant.take().is_some() {
                self.events
                    .push_back(ChannelEvent::GuaranteeLapsed { peer: p.node });
            }
        }
        if served_changed {
            self.regrant();
            self.events.push_back(ChannelEvent::ServedChanged);
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

    /// When the next message of the protocol to `p` is due, if any (sessions aside).
    fn message_due(&self, p: &Peer) -> Option<Duration> {
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
        let confirm = p.confirm_due.then_some(Duration::ZERO);
        let offer = p.probe_offer.due();
        let answer = p.probe_answer.due();
        let pairings = p.pairings.due();
        // A peer whose flows this host counts hears from it at least every half
        // UNANSWERED, even when there is no grant to give (one sending host's incast),
        // so that it never takes the session for lost and handshakes again; so does one
        // whose probe or pairings messages keep coming (an offer not answered yet, an
        // answer to a prober that stopped, pairings toward a host with no shaper) while
        // they do.
        let rendezvous = p
            .rendezvous_heard
            .is_some_and(|t| t.saturating_add(UNANSWERED) > self.now);
        let keepalive = p
            .current
            .as_ref()
            .filter(|_| !p.served.is_empty() || rendezvous)
            .map(|s| {
                s.last_sent
                    .unwrap_or(s.created)
                    .saturating_add(UNANSWERED / 2)
            });
        let due = demand
            .into_iter()
            .chain(grant)
            .chain(confirm)
            .chain(keepalive)
            .chain(offer)
            .chain(answer)
            .chain(pairings)
            .min()?;
        let allowed = if p.send_tokens >= 1.0 {
            Duration::ZERO
        } else {
            p.send_at + Duration::from_secs_f64((1.0 - p.send_tokens) / self.send_rate())
        };
        Some(due.max(allowed))
    }

    /// When something is next due to `p`: a handshake message now, a protocol message once
    /// a session carries it (or an initiation is due to make one).
    fn send_due(&self, p: &Peer) -> Option<Duration> {
        if p.out.is_some() {
            return Some(Duration::ZERO);
        }
        let due = self.message_due(p)?;
        if p.send_session(self.now).is_some() {
            return Some(due);
        }
        Some(match p.handshake_started() {
            Some(at) => due.max(at.saturating_add(HANDSHAKE_RETRY)),
            None => due,
        })
    }

    /// Messages a second this host sends one peer at most: half the peer's cap.
    fn send_rate(&self) -> f64 {
        f64::from(self.config.max_messages_per_sec) / 2.0
    }

    /// The next datagram due by `now`, if any: call until `None`.
    pub fn poll_transmit(&mut self, now: Duration) -> Option<Transmit> {
        let now = self.advance(now);
        loop {
            let i = (0..self.peers.len())
                .find(|&i| self.send_due(&self.peers[i]).is_some_and(|due| due <= now))?;
            if let Some(bytes) = self.peers[i].out.take() {
                return Some(Transmit {
                    to: self.peers[i].node,
                    bytes,
                });
            }
            let p = &self.peers[i];
            let needs_handshake = match p.send_session(now) {
                None => true,
                Some(s) => s.wants_rekey(now, p.last_heard),
            };
            let may_initiate = p
                .handshake_started()
                .is_none_or(|at| at.saturating_add(HANDSHAKE_RETRY) <= now);
            if needs_handshake && may_initiate {
                self.initiate(i, now);
                if self.peers[i].out.is_some() {
                    continue;
                }
            }
            // No session: send_due picks a peer without one only when an initiation is due,
            // so this is snow failing to make one (never expected): try at the next call.
            self.peers[i].send_session(now)?;
            return self.send_message(i, now);
        }
    }

    /// Sends peer `i`'s due protocol message on its current session.
    fn send_message(&mut self, i: usize, now: Duration) -> Option<Transmit> {
        let refresh = self.config.refresh;
        let p = &self.peers[i];
        let demand_due = p.demand_dirty
            || (!p.demand.is_empty()
                && p.demand_sent
                    .is_none_or(|t| t.saturating_add(refresh) <= now));
        let grant = self.grant.filter(|_| !p.served.is_empty());
        let grant_due = grant.is_some_and(|g| {
            p.granted != Some(g)
                || p.grant_sent
                    .is_none_or(|t| t.saturating_add(refresh) <= now)
        });
        let due = |at: Option<Duration>| at.is_some_and(|t| t <= now);
        let offer_due = due(p.probe_offer.due());
        let answer_due = due(p.probe_answer.due());
        let pairing_pick = p.pairings.pick(now);
        // Demands and grants first: a probe message takes only a token they leave, and
        // pairings only one the probe messages leave. A grant that is not due still goes
        // where a keepalive would (any message keeps the session), and a new session is
        // confirmed by a kind every host of this version knows, never by a probe or
        // pairings message.
        let body = if demand_due {
            Body::Demand(p.demand.clone())
        } else if let Some(g) = grant.filter(|_| grant_due || p.confirm_due) {
            Body::Grant(g)
        } else if p.confirm_due {
            Body::Keepalive
        } else if let Some(offer) = p.probe_offer.value.filter(|_| offer_due) {
            Body::ProbeOffer(offer)
        } else if let Some(answer) = p.probe_answer.value.filter(|_| answer_due) {
            Body::ProbeAnswer(answer)
        } else if let Some(pick) = pairing_pick {
            Body::Pairings(p.pairings.entries(pick).to_vec())
        } else if let Some(g) = grant {
            Body::Grant(g)
        } else {
            Body::Keepalive
        };
        let plaintext = wire::encode_body(&body);
        let rate = self.send_rate();
        let p = &mut self.peers[i];
        let session = p.current.as_mut()?;
        let mut bytes = wire::transport_header(session.remote, session.sent);
        let at = bytes.len();
        bytes.resize(at + plaintext.len() + wire::TAG_LEN, 0);
        let n = session
            .transport
            .write_message(session.sent, &plaintext, &mut bytes[at..])
            .ok()?;
        bytes.truncate(at + n);
        session.sent += 1;
        session.last_sent = Some(now);
        let elapsed = now.saturating_sub(p.send_at).as_secs_f64();
        p.send_tokens = (p.send_tokens + elapsed * rate).min(SEND_BURST) - 1.0;
        p.send_at = now;
        p.confirm_due = false;
        match body {
            Body::Keepalive => {}
            Body::Demand(_) => {
                p.demand_dirty = false;
                p.demand_sent = Some(now);
            }
            Body::Grant(g) => {
                p.granted = Some(g);
                p.grant_sent = Some(now);
            }
            Body::ProbeOffer(_) => p.probe_offer.sent(now),
            Body::ProbeAnswer(_) => p.probe_answer.sent(now),
            Body::Pairings(_) => {
                // Only a pick makes a pairings body.
                if let Some(pick) = pairing_pick {
                    p.pairings.sent(now, pick);
                }
            }
        }
        Some(Transmit { to: p.node, bytes })
    }
}

/// A probe offer or answer this host sends a peer: the value, whether it changed (or a
/// new session wants it again) since it was last sent, and when that was.
#[derive(Debug, Clone, Copy, Default)]
struct ProbeSending {
    value: Option<ProbeEndpoint>,
    dirty: bool,
    sent: Option<Duration>,
}

impl ProbeSending {
    /// A new value (or none: nothing more is sent); a changed one is due at once.
    fn set(&mut self, value: Option<ProbeEndpoint>) {
        if self.value != value {
            self.value = value;
            self.dirty = value.is_some();
        }
    }

    /// A new session: what is set goes again at once.
    fn resend(&mut self) {
        self.dirty |= self.value.is_some();
    }

    /// It went at `now`.
    fn sent(&mut self, now: Duration) {
        self.dirty = false;
        self.sent = Some(now);
    }

    /// When it is next due: at once when dirty, every [`PROBE_REFRESH`] after it was last
    /// sent, never while unset.
    fn due(&self) -> Option<Duration> {
        self.value?;
        if self.dirty {
            return Some(Duration::ZERO);
        }
        Some(
            self.sent
                .map_or(Duration::ZERO, |t| t.saturating_add(PROBE_REFRESH)),
        )
    }
}

/// The pairings this host sends a peer: the whole set, the entries not sent since they
/// were set (or since a new session), and the rotation that sends the whole set again,
/// one message every [`PAIRING_REFRESH`].
///
/// Invariants: `set` is sorted, and no two of its entries share (`this_qpn`, `that_qpn`);
/// each is one the wire carries ([`Channel::set_pairings`] checks); `fresh` is sorted and
/// a subset of `set`.
#[derive(Debug, Clone, Default)]
struct PairingSending {
    set: Vec<Pairing>,
    fresh: Vec<Pairing>,
    /// The key the rotation's next message starts at (the first entry at or after it, or
    /// the set's first when there is none): a key, not an index, so that a set that
    /// changes under the rotation neither skips nor repeats the entries that stay.
    cursor: (u32, u32),
    /// When the rotation last sent, or (re)started: its next message is due
    /// [`PAIRING_REFRESH`] later.
    rotated: Duration,
}

/// Which of a peer's pairings a message carries (taken and spent in one call: the set
/// cannot change in between).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PairingPick {
    /// The first `n` of the fresh ones.
    Fresh(usize),
    /// The set's entries `start..end`.
    Rotation(usize, usize),
}

impl PairingSending {
    /// A new set (sorted, one entry per key): the entries not in the last set are fresh,
    /// as are those still fresh from it. A set that was empty starts the rotation anew,
    /// its first message a refresh after the fresh ones.
    fn set(&mut self, now: Duration, set: Vec<Pairing>) {
        if set == self.set {
            return;
        }
        if self.set.is_empty() {
            self.cursor = (0, 0);
            self.rotated = now;
        }
        let old = std::mem::replace(&mut self.set, set);
        let fresh = std::mem::take(&mut self.fresh);
        // A changed side channel for a queue pair is a new entry: it goes at once.
        self.fresh = self
            .set
            .iter()
            .copied()
            .filter(|e| old.binary_search(e).is_err() || fresh.binary_search(e).is_ok())
            .collect();
    }

    /// A new session: the whole set goes again at once (the peer may have restarted and
    /// know none of it), and the rotation starts again from its beginning.
    fn resend(&mut self, now: Duration) {
        self.fresh.clone_from(&self.set);
        self.cursor = (0, 0);
        self.rotated = now;
    }

    /// When a message is next due: at once while some are fresh, the rotation's next
    /// otherwise, never while the set is empty.
    fn due(&self) -> Option<Duration> {
        if !self.fresh.is_empty() {
            return Some(Duration::ZERO);
        }
        if self.set.is_empty() {
            return None;
        }
        Some(self.rotated.saturating_add(PAIRING_REFRESH))
    }

    /// What the message due by `now` carries, if one is: fresh entries first.
    fn pick(&self, now: Duration) -> Option<PairingPick> {
        if !self.fresh.is_empty() {
            return Some(PairingPick::Fresh(self.fresh.len().min(MAX_PAIRINGS)));
        }
        if self.due().is_none_or(|t| t > now) {
            return None;
        }
        let start = match self.set.partition_point(|e| e.key() < self.cursor) {
            end if end == self.set.len() => 0,
            start => start,
        };
        // A message ends at the set's end rather than wrap: each entry goes once a
        // rotation.
        let end = self.set.len().min(start + MAX_PAIRINGS);
        Some(PairingPick::Rotation(start, end))
    }

    /// The entries of `pick`.
    fn entries(&self, pick: PairingPick) -> &[Pairing] {
        match pick {
            PairingPick::Fresh(n) => &self.fresh[..n],
            PairingPick::Rotation(start, end) => &self.set[start..end],
        }
    }

    /// `pick` went at `now`.
    fn sent(&mut self, now: Duration, pick: PairingPick) {
        match pick {
            PairingPick::Fresh(n) => {
                self.fresh.drain(..n);
            }
            PairingPick::Rotation(_, end) => {
                self.cursor = self.set.get(end).map_or((0, 0), Pairing::key);
                self.rotated = now;
            }
        }
    }
}

/// Whether a grant from `p` is one this host asked for: it holds flows against `p`, or
/// withdrew the last of them less than `silence` ago. The peer grants until the empty
/// demand reaches it, and refreshes its grant meanwhile: a flow that goes idle (or ends)
/// has those grants in flight, which are no one's forgery. The peer stops within `silence`
/// of the withdrawal whether or not the empty demand arrives (it lets this host's demands
/// lapse), so after that a grant is unsolicited again.
fn grant_expected(p: &Peer, now: Duration, silence: Duration) -> bool {
    !p.demand.is_empty()
        || p.demand_dirty
        || p.demand_sent
            .is_some_and(|t| t.saturating_add(silence) >= now)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use justitia_core::flow::{FlowClass, TenantId};
    use proptest::prelude::*;

    const A: NodeId = NodeId([0xa; 16]);
    const B: NodeId = NodeId([0xb; 16]);
    const C: NodeId = NodeId([0xc; 16]);

    /// Node `n`'s private key: fixed bytes, so that runs repeat.
    fn key_of(node: NodeId) -> PrivateKey {
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = node.0[0].wrapping_mul(31).wrapping_add(i as u8);
        }
        PrivateKey::from_bytes(bytes).unwrap()
    }

    fn members() -> Vec<Member> {
        [A, B, C]
            .into_iter()
            .chain((1..=3).map(|n| NodeId([n; 16])))
            .map(|node| Member {
                node,
                public: key_of(node).public(),
            })
            .collect()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn channel(own: NodeId, seed: u8) -> Channel {
        Channel::new(
            ChannelConfig::default(),
            own,
            key_of(own),
            &members(),
            [seed; 32],
            Duration::ZERO,
        )
        .unwrap()
    }

    /// Passes datagrams between `a` and `b` (dropping those for anyone else) until neither
    /// has one due at `now`; returns how many were delivered.
    fn pump(a: &mut Channel, b: &mut Channel, now: Duration) -> usize {
        fn one_way(from: &mut Channel, to: &mut Channel, now: Duration) -> usize {
            let mut n = 0;
            while let Some(t) = from.poll_transmit(now) {
                if t.to == to.own() {
                    to.receive(now, &t.bytes).unwrap();
                    n += 1;
                }
            }
            n
        }
        let mut n = 0;
        loop {
            let moved = one_way(a, b, now) + one_way(b, a, now);
            if moved == 0 {
                return n;
            }
            n += moved;
        }
    }

    /// A session between `a` (initiator) and `b`, confirmed, at `now`.
    fn session(a: &mut Channel, b: &mut Channel, now: Duration) {
        let i = a.find(b.own()).unwrap();
        a.initiate(i, now);
        assert_eq!(pump(a, b, now), 3, "initiation, response, confirmation");
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

    impl Channel {
        /// Refills the send buckets: a test's handshake spends tokens the old protocol did not.
        fn send_tokens_full(&mut self) {
            for p in &mut self.peers {
                p.send_tokens = SEND_BURST;
            }
        }
    }

    fn events(c: &mut Channel) -> Vec<ChannelEvent> {
        std::iter::from_fn(|| c.poll_event()).collect()
    }

    #[test]
    fn a_demand_reaches_the_peer_and_its_grant_comes_back_numbered_by_the_message() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_demand(ms(0), B, &[read(5, 3)]).unwrap();
        // The initiation, the response, then the demand (which confirms the session).
        assert_eq!(pump(&mut a, &mut b, ms(0)), 3);
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
                assert_eq!(
                    (g.epoch, g.sequence),
                    (0, 0),
                    "the session's and message's numbering"
                );
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
        let mut c = channel(C, 3);
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
        pump(&mut a, &mut r, ms(0));
        pump(&mut c, &mut r, ms(0));
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
        pump(&mut a, &mut r, ms(0));
        assert_eq!(r.incast_share(), 0.0, "one host: no incast");
        let mut c = channel(C, 3);
        c.set_demand(ms(1), B, &[incast]).unwrap();
        pump(&mut c, &mut r, ms(1));
        assert_eq!(r.incast_share(), link / 2.0, "same tenant id, another host");
        // A keeps refreshing; C goes silent from 1 ms.
        for t in (5..=20).step_by(5) {
            deliver(&mut a, &mut r, ms(t));
            r.handle_timeout(ms(t));
            // R's grants to A and C are not this test's matter.
            while r.poll_transmit(ms(t)).is_some() {}
        }
        assert_eq!(r.incast_share(), link / 2.0, "C still counted at 20 ms");
        r.handle_timeout(ms(21));
        assert_eq!(r.incast_share(), 0.0, "C lapsed at 1 + 20 ms: no incast");
    }

    #[test]
    fn replayed_and_reordered_messages_are_refused_and_change_nothing() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        session(&mut a, &mut b, ms(0));
        a.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        let first = a.poll_transmit(ms(0)).unwrap();
        a.set_demand(ms(1), B, &[read(5, 2)]).unwrap();
        let second = a.poll_transmit(ms(1)).unwrap();
        b.receive(ms(1), &second.bytes).unwrap();
        assert_eq!(b.receive(ms(1), &second.bytes), Err(Refusal::Replayed));
        // Reordered within the window: accepted (a whole demand, so the older one counts
        // until the next refresh, as it would had the network delayed it less).
        assert_eq!(b.receive(ms(1), &first.bytes), Ok(()));
        assert_eq!(b.receive(ms(1), &first.bytes), Err(Refusal::Replayed));
        let served: Vec<_> = b.served().map(|(_, e)| e.flows).collect();
        assert_eq!(served, vec![1]);
    }

    #[test]
    fn a_restarted_peer_is_believed_at_once_and_its_old_incarnation_is_not() {
        let mut b = channel(B, 2);
        let mut old = channel(A, 10);
        old.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        pump(&mut old, &mut b, ms(0));
        old.set_demand(ms(1), B, &[read(5, 2)]).unwrap();
        let old_msg = old.poll_transmit(ms(1)).unwrap();
        // The restarted daemon has no session: it handshakes, and B takes its demand
        // within that one round trip, with no clock in any message.
        let mut new = channel(A, 11);
        new.set_demand(ms(2), B, &[read(6, 4)]).unwrap();
        assert_eq!(pump(&mut new, &mut b, ms(2)), 3);
        let served: Vec<_> = b.served().map(|(_, e)| (e.tenant, e.flows)).collect();
        assert_eq!(served, vec![(TenantId(6), 4)]);
        // The old incarnation's session is the replaced one: kept for messages in flight
        // (the overlap), and gone after it.
        b.handle_timeout(ms(2) + OVERLAP);
        assert_eq!(
            b.receive(ms(2) + OVERLAP, &old_msg.bytes),
            Err(Refusal::UnknownSession)
        );
    }

    #[test]
    fn a_silent_peer_stops_counting_and_constraining_after_the_silence_not_before() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        pump(&mut a, &mut b, ms(0));
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
    fn a_message_for_another_host_or_from_a_non_member_or_itself_is_refused() {
        let mut a = channel(A, 1);
        let mut c = channel(C, 3);
        a.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        let to_b = a.poll_transmit(ms(0)).unwrap();
        // For B: C cannot complete B's half of the handshake.
        assert_eq!(c.receive(ms(0), &to_b.bytes), Err(Refusal::Authentication));
        let mut b = channel(B, 2);
        let mut b_self = channel(B, 4);
        b_self.set_demand(ms(0), A, &[read(5, 1)]).unwrap();
        let looped = b_self.poll_transmit(ms(0)).unwrap();
        assert_eq!(b.receive(ms(0), &looped.bytes), Err(Refusal::FromSelf));
        let stranger = NodeId([0x77; 16]);
        let mut s = Channel::new(
            ChannelConfig::default(),
            stranger,
            key_of(stranger),
            &members(),
            [9; 32],
            Duration::ZERO,
        )
        .unwrap();
        s.set_demand(ms(0), B, &[read(5, 1)]).unwrap();
        let from_stranger = s.poll_transmit(ms(0)).unwrap();
        assert_eq!(
            b.receive(ms(0), &from_stranger.bytes),
            Err(Refusal::NotMember)
        );
        assert_eq!(
            a.set_demand(ms(0), stranger, &[read(1, 1)]),
            Err(Refusal::NotMember)
        );
    }

    #[test]
    fn an_unsolicited_grant_is_refused() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_demand(ms(0), B, &[read(1, 1)]).unwrap();
        pump(&mut a, &mut b, ms(0));
        b.set_grant(ms(1), &guarantee(0.5), 12.5e9);
        let grant = b.poll_transmit(ms(1)).unwrap();
        // A withdraws (the empty demand is lost); B's grant arrives after the silence.
        a.set_demand(ms(2), B, &[]).unwrap();
        assert!(a.poll_transmit(ms(2)).is_some());
        let past = ms(2) + ChannelConfig::default().silence + ms(1);
        assert_eq!(a.receive(past, &grant.bytes), Err(Refusal::Unsolicited));
        assert_eq!(a.grant_from(B), None);
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
        pump(&mut a, &mut b, ms(0));
        b.set_grant(ms(1), &guarantee(0.5), 12.5e9);
        let first = b.poll_transmit(ms(1)).unwrap();
        a.receive(ms(1), &first.bytes).unwrap();
        // A's flow goes idle: its empty demand leaves at 2 ms, and B's refresh crosses it.
        a.set_demand(ms(2), B, &[]).unwrap();
        let withdrawal = a.poll_transmit(ms(2)).unwrap();
        let refresh = b.poll_transmit(ms(7)).unwrap();
        assert_eq!(a.receive(ms(8), &refresh.bytes), Ok(()));
        b.receive(ms(9), &withdrawal.bytes).unwrap();
        // B no longer serves A and grants nothing more.
        assert!(b.poll_transmit(ms(20)).is_none());
    }

    /// A member list is refused whole, naming the member: one listed twice, two sharing a
    /// key (one could speak for the other), a public key of small order (a point of order
    /// 8: its pair key is the same for every private key, so anyone could MAC as it).
    #[test]
    fn member_lists_that_would_let_one_host_speak_for_another_are_refused() {
        let start = |members: &[Member]| {
            Channel::new(
                ChannelConfig::default(),
                B,
                key_of(B),
                members,
                [2; 32],
                Duration::ZERO,
            )
            .err()
        };
        let mut twice = members();
        twice.push(twice[0]);
        assert_eq!(
            start(&twice),
            Some(StartError::Config(ConfigError::Duplicate(A)))
        );
        let mut shared = members();
        shared[2].public = shared[0].public;
        assert!(matches!(
            start(&shared),
            Some(StartError::Config(ConfigError::SharedKey(..)))
        ));
        let mut small = members();
        let order_8: Vec<u8> = (0..32)
            .map(|i| {
                u8::from_str_radix(
                    &"e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"
                        [2 * i..2 * i + 2],
                    16,
                )
                .unwrap()
            })
            .collect();
        small[0].public = PublicKey(order_8.try_into().unwrap());
        let refused = start(&small);
        assert_eq!(
            refused,
            Some(StartError::Config(ConfigError::SmallOrderKey(A)))
        );
        assert!(refused.unwrap().to_string().contains("small order"));
    }

    #[test]
    fn caps_on_members_flows_and_rate_refuse_with_their_reason() {
        let config = ChannelConfig {
            max_peers: 2,
            max_flows_per_peer: 4,
            max_messages_per_sec: 100,
            silence: ms(200),
            refresh: ms(50),
        };
        let new = |members: &[Member]| {
            Channel::new(config, B, key_of(B), members, [2; 32], Duration::ZERO)
        };
        assert!(matches!(
            new(&members()).err(),
            Some(StartError::Config(ConfigError::TooManyMembers {
                members: 5,
                max: 2
            }))
        ));
        let mut b = new(&members()[..3]).unwrap();
        let mut a = channel(A, 1);
        session(&mut a, &mut b, ms(0));
        a.set_demand(ms(0), B, &[read(1, 3), read(2, 2)]).unwrap();
        let m = a.poll_transmit(ms(0)).unwrap();
        assert_eq!(b.receive(ms(1), &m.bytes), Err(Refusal::TooManyFlows));
        assert_eq!(
            channel(A, 1).set_demand(ms(0), B, &vec![read(1, 1); 129]),
            Err(Refusal::TooManyFlows)
        );

        // Rate: a burst of a tenth of a second's messages (at least 4), then refused; the
        // bucket refills at 100/s.
        let mut accepted = 0;
        let mut limited = 0;
        for i in 0..20u64 {
            a.set_demand(ms(0), B, &[read(i, 1)]).unwrap();
            // (Within UNANSWERED of B's response, so A starts no new handshake.)
            let m = a.poll_transmit(ms(500)).unwrap();
            match b.receive(ms(1), &m.bytes) {
                Ok(()) => accepted += 1,
                Err(Refusal::RateLimited) => limited += 1,
                Err(e) => panic!("{e}"),
            }
            a.peers[0].send_tokens = SEND_BURST;
        }
        assert_eq!(
            (accepted, limited),
            (9, 11),
            "burst of 10 less the session's confirmation"
        );
    }

    #[test]
    fn a_sender_keeps_to_half_its_peers_cap_and_coalesces_changes() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        session(&mut a, &mut b, Duration::ZERO);
        a.send_tokens_full();
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
        pump(&mut b, &mut a, ms(0));
        a.send_tokens_full();
        a.set_demand(ms(1), B, &[read(2, 1)]).unwrap();
        a.set_grant(ms(1), &guarantee(0.5), 12.5e9);
        assert_eq!(deliver(&mut a, &mut b, ms(1)), 2);
        // The bucket is spent: a third message waits for a token (1 ms at 1000/s).
        a.set_demand(ms(1), B, &[read(3, 1)]).unwrap();
        assert_eq!(a.poll_transmit(ms(1)), None);
        assert_eq!(a.poll_timeout(), Some(ms(2)));
        assert_eq!(deliver(&mut a, &mut b, ms(2)), 1);
    }

    fn offer(qpn: u32) -> ProbeEndpoint {
        ProbeEndpoint {
            gid: [0xa; 16],
            lid: 0,
            qpn,
            psn: 0x12_3456,
            rkey: 0,
            addr: 0,
            answers_qpn: 0,
        }
    }

    fn answer(qpn: u32, answers_qpn: u32) -> ProbeEndpoint {
        ProbeEndpoint {
            gid: [0xb; 16],
            lid: 0,
            qpn,
            psn: 0x65_4321,
            rkey: 0x1234,
            addr: 0x7f00_0000_1000,
            answers_qpn,
        }
    }

    /// The bytes of a transport message whose plaintext is a keepalive, and one whose
    /// plaintext is a probe message (each a kind byte, a body and the tag).
    const KEEPALIVE_DATAGRAM: usize = wire::TRANSPORT_HEADER_LEN + 1 + wire::TAG_LEN;
    const PROBE_DATAGRAM: usize =
        wire::TRANSPORT_HEADER_LEN + 1 + wire::PROBE_BODY_LEN + wire::TAG_LEN;

    #[test]
    fn a_probe_offer_reaches_the_peer_once_and_its_answer_comes_back() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_probe_offer(ms(0), B, Some(offer(0x101))).unwrap();
        // An offer makes a session as a demand does. The session is confirmed by a
        // keepalive (a host that predates the probe takes it), the offer follows at once.
        let sent = lengths_sent(&mut a, &mut b, ms(0));
        assert_eq!(
            sent,
            vec![wire::INITIATION_LEN, KEEPALIVE_DATAGRAM, PROBE_DATAGRAM]
        );
        assert_eq!(
            events(&mut b),
            vec![ChannelEvent::ProbeOffer {
                peer: A,
                offer: offer(0x101)
            }]
        );
        assert_eq!(b.probe_offer_from(A), Some(offer(0x101)));
        assert_eq!(b.probe_answer_from(A), None);

        b.set_probe_answer(ms(1), A, Some(answer(0x202, 0x101)))
            .unwrap();
        assert_eq!(deliver(&mut b, &mut a, ms(1)), 1);
        assert_eq!(
            events(&mut a),
            vec![ChannelEvent::ProbeAnswer {
                peer: B,
                answer: answer(0x202, 0x101)
            }]
        );
        assert_eq!(a.probe_answer_from(B), Some(answer(0x202, 0x101)));
        assert_eq!(a.probe_offer_from(B), None);
        // Nothing else: no demand, no grant.
        assert!(events(&mut b).is_empty());
        assert_eq!(a.served().count() + b.served().count(), 0);
        assert_eq!(a.grant_from(B), None);
    }

    /// A set offer goes again every PROBE_REFRESH, and the peer raises no event for the
    /// same offer; a changed one goes at once and raises one; `None` stops it.
    #[test]
    fn an_unchanged_probe_message_is_sent_again_at_its_refresh_with_no_event() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_probe_offer(ms(0), B, Some(offer(0x101))).unwrap();
        pump(&mut a, &mut b, ms(0));
        b.set_probe_answer(ms(1), A, Some(answer(0x202, 0x101)))
            .unwrap();
        pump(&mut a, &mut b, ms(1));
        events(&mut a);
        events(&mut b);
        assert_eq!(a.poll_timeout(), Some(PROBE_REFRESH), "A's offer refresh");
        assert_eq!(deliver(&mut a, &mut b, PROBE_REFRESH - ms(1)), 0);
        // One second, in steps of 10 ms: A's offer at 250, 500, 750 and 1000 ms, B's
        // answer at 260, 510 and 760 (it was sent at 1 ms), and not one event (nor a
        // keepalive: each hears from the other every refresh).
        let (mut offers, mut answers) = (0, 0);
        for t in (1..=100).map(|i| ms(10 * i)) {
            offers += deliver(&mut a, &mut b, t);
            answers += deliver(&mut b, &mut a, t);
        }
        assert_eq!((offers, answers), (4, 3));
        assert!(events(&mut a).is_empty());
        assert!(events(&mut b).is_empty());
        assert_eq!(b.probe_offer_from(A), Some(offer(0x101)));
        // A new requester queue pair: its offer goes at once.
        a.set_probe_offer(ms(1005), B, Some(offer(0x303))).unwrap();
        assert_eq!(deliver(&mut a, &mut b, ms(1005)), 1);
        assert_eq!(
            events(&mut b),
            vec![ChannelEvent::ProbeOffer {
                peer: A,
                offer: offer(0x303)
            }]
        );
        // Stopped: nothing more, and the peer keeps what it took.
        a.set_probe_offer(ms(1006), B, None).unwrap();
        for t in (101..=200).map(|i| ms(10 * i)) {
            assert!(a
                .poll_transmit(t)
                .is_none_or(|m| m.bytes.len() != PROBE_DATAGRAM));
            b.handle_timeout(t);
        }
        assert_eq!(b.probe_offer_from(A), Some(offer(0x303)), "no lapse");
    }

    #[test]
    fn a_lost_probe_offer_is_made_good_by_its_refresh() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        session(&mut a, &mut b, ms(0));
        a.send_tokens_full();
        a.set_probe_offer(ms(0), B, Some(offer(0x101))).unwrap();
        let lost = a.poll_transmit(ms(0)).unwrap();
        assert_eq!(lost.bytes.len(), PROBE_DATAGRAM);
        assert_eq!(a.poll_timeout(), Some(PROBE_REFRESH));
        assert_eq!(deliver(&mut a, &mut b, PROBE_REFRESH), 1);
        assert_eq!(
            events(&mut b),
            vec![ChannelEvent::ProbeOffer {
                peer: A,
                offer: offer(0x101)
            }]
        );
    }

    /// A restarted target handshakes at start; the prober's offer goes on the new session
    /// at once, not at its next refresh.
    #[test]
    fn a_restarted_peer_gets_the_probe_offer_at_once() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_probe_offer(ms(0), B, Some(offer(0x101))).unwrap();
        pump(&mut a, &mut b, ms(0));
        let mut restarted = channel(B, 3);
        restarted.greet(ms(10));
        pump(&mut a, &mut restarted, ms(10));
        assert_eq!(
            events(&mut restarted),
            vec![ChannelEvent::ProbeOffer {
                peer: A,
                offer: offer(0x101)
            }]
        );
    }

    #[test]
    fn probe_messages_to_a_non_member_or_out_of_range_are_refused() {
        let mut a = channel(A, 1);
        let stranger = NodeId([0x77; 16]);
        assert_eq!(
            a.set_probe_offer(ms(0), stranger, Some(offer(0x101))),
            Err(Refusal::NotMember)
        );
        assert_eq!(
            a.set_probe_answer(ms(0), stranger, Some(answer(0x202, 0x101))),
            Err(Refusal::NotMember)
        );
        assert_eq!(
            a.set_probe_offer(ms(0), B, Some(answer(0x202, 0x101))),
            Err(Refusal::OutOfRange("rkey")),
            "an answer is no offer"
        );
        assert_eq!(
            a.set_probe_answer(ms(0), B, Some(answer(0, 0x101))),
            Err(Refusal::OutOfRange("qpn"))
        );
        assert_eq!(
            a.set_probe_answer(ms(0), B, Some(answer(0x202, 0))),
            Err(Refusal::OutOfRange("answers_qpn"))
        );
        // Refused, nothing to send: no handshake started.
        assert_eq!(a.poll_transmit(ms(0)), None);
        assert_eq!(a.poll_timeout(), None);
    }

    /// A probe message takes only the tokens demands and grants leave: with A's offer and
    /// answer to B changing every millisecond (more than the cap lets go), A's demand and
    /// grant still go every refresh, a send gap late at most.
    #[test]
    fn demands_and_grants_keep_their_refresh_while_probe_messages_churn() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        b.set_demand(ms(0), A, &[read(1, 1)]).unwrap();
        pump(&mut b, &mut a, ms(0));
        a.set_grant(ms(0), &guarantee(0.5), 12.5e9);
        a.set_demand(ms(0), B, &[read(2, 1)]).unwrap();
        a.send_tokens_full();
        let refresh = DEFAULT_REFRESH;
        let gap = ms(1);
        let (mut demands, mut grants) = (Vec::new(), Vec::new());
        let mut probes = 0;
        for i in 0..10_000u32 {
            let t = Duration::from_micros(100 * u64::from(i));
            if i % 10 == 0 {
                let qpn = 0x100 + i;
                a.set_probe_offer(t, B, Some(offer(qpn))).unwrap();
                a.set_probe_answer(t, B, Some(answer(qpn, qpn + 1)))
                    .unwrap();
            }
            while let Some(m) = a.poll_transmit(t) {
                b.receive(t, &m.bytes).unwrap();
                let p = &a.peers[a.find(B).unwrap()];
                if p.demand_sent == Some(t) && demands.last() != Some(&t) {
                    demands.push(t);
                } else if p.grant_sent == Some(t) && grants.last() != Some(&t) {
                    grants.push(t);
                } else {
                    assert_eq!(m.bytes.len(), PROBE_DATAGRAM);
                    probes += 1;
                }
            }
            // B's grants and refreshes are not this test's matter.
            while b.poll_transmit(t).is_some() {}
        }
        for (what, sent) in [("demand", &demands), ("grant", &grants)] {
            assert!(sent.len() >= 160, "{what}: {} in a second", sent.len());
            for w in sent.windows(2) {
                assert!(
                    w[1] - w[0] <= refresh + gap,
                    "{what} at {:?} then {:?}",
                    w[0],
                    w[1]
                );
            }
        }
        // The rest of the cap (1000/s) goes to the probe messages.
        assert!(probes >= 500, "{probes} probe messages");
        let offers = events(&mut b)
            .iter()
            .filter(|e| matches!(e, ChannelEvent::ProbeOffer { .. }))
            .count();
        assert!(offers >= 250, "{offers} offers taken");
    }

    /// Probe state with no refresh of demands and grants: the peer whose offer is not
    /// answered yet keeps it informed with keepalives, so the prober's session stays (no
    /// handshake every UNANSWERED).
    #[test]
    fn an_offer_not_answered_yet_keeps_its_session() {
        rendezvous_alone_keeps_its_session(|a, t, on| {
            a.set_probe_offer(t, B, on.then(|| offer(0x101))).unwrap();
        });
    }

    /// A sends B only what `set` sets (`true`: its rendezvous message; `false`: nothing
    /// more) for 3 s, then stops: B, with nothing of its own to send, keeps A's session
    /// with a keepalive every half UNANSWERED (no handshake), and stops within UNANSWERED
    /// of A's last message. Returns B, its events not taken.
    fn rendezvous_alone_keeps_its_session(set: impl Fn(&mut Channel, Duration, bool)) -> Channel {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        set(&mut a, ms(0), true);
        pump(&mut a, &mut b, ms(0));
        let mut initiations = 0;
        let mut keepalives = 0;
        for t in (1..=300).map(|i| ms(10 * i)) {
            while let Some(m) = a.poll_transmit(t) {
                initiations += usize::from(m.bytes.len() == wire::INITIATION_LEN);
                b.receive(t, &m.bytes).unwrap();
            }
            while let Some(m) = b.poll_transmit(t) {
                keepalives += usize::from(m.bytes.len() == KEEPALIVE_DATAGRAM);
                a.receive(t, &m.bytes).unwrap();
            }
        }
        assert_eq!(initiations, 0);
        assert_eq!(keepalives, 6, "every half UNANSWERED for 3 s");
        // A stops: B's keepalives stop within UNANSWERED.
        set(&mut a, ms(3000), false);
        for t in (301..=500).map(|i| ms(10 * i)) {
            deliver(&mut a, &mut b, t);
            b.handle_timeout(t);
            if t > ms(3000) + UNANSWERED {
                assert_eq!(b.poll_transmit(t), None, "at {t:?}");
            } else {
                deliver(&mut b, &mut a, t);
            }
        }
        assert_eq!(b.poll_timeout(), None);
        b
    }

    /// A member dropped from the list takes the probe state with it (no event: the caller
    /// dropped it); listed again, it starts with none.
    #[test]
    fn a_removed_member_takes_its_probe_state_with_it() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_probe_offer(ms(0), B, Some(offer(0x101))).unwrap();
        pump(&mut a, &mut b, ms(0));
        b.set_probe_answer(ms(1), A, Some(answer(0x202, 0x101)))
            .unwrap();
        pump(&mut a, &mut b, ms(1));
        events(&mut b);
        let without_a: Vec<Member> = members().into_iter().filter(|m| m.node != A).collect();
        b.set_members(ms(2), &without_a).unwrap();
        assert_eq!(b.probe_offer_from(A), None);
        assert!(events(&mut b).is_empty());
        b.set_members(ms(3), &members()).unwrap();
        assert_eq!(b.probe_offer_from(A), None);
        // B's answer went too: nothing due to A.
        assert_eq!(b.poll_timeout(), None);
    }

    fn pairing(this_qpn: u32, that_qpn: u32) -> Pairing {
        Pairing {
            this_qpn,
            that_qpn,
            side_qpn: 0x777,
            side_qkey: 0x1234,
        }
    }

    /// `n` pairings, this host's queue pairs 1 ..= n each connected to the peer's 0x500.
    /// Delivers everything A sends B at `now`, and B's answers to each, until A has
    /// nothing more; returns the lengths of A's datagrams, in order.
    fn lengths_sent(a: &mut Channel, b: &mut Channel, now: Duration) -> Vec<usize> {
        let mut sent = Vec::new();
        while let Some(t) = a.poll_transmit(now) {
            b.receive(now, &t.bytes).unwrap();
            sent.push(t.bytes.len());
            while let Some(t) = b.poll_transmit(now) {
                a.receive(now, &t.bytes).unwrap();
            }
        }
        sent
    }

    fn pairings(n: u32) -> Vec<Pairing> {
        (1..=n).map(|q| pairing(q, 0x500)).collect()
    }

    /// The bytes of a transport message whose plaintext is `n` pairings.
    fn pairings_datagram(n: usize) -> usize {
        wire::TRANSPORT_HEADER_LEN + 1 + 4 + n * wire::PAIRING_LEN + wire::TAG_LEN
    }

    /// The pairings messages among `c`'s events.
    fn pairings_taken(c: &mut Channel) -> Vec<Vec<Pairing>> {
        events(c)
            .into_iter()
            .filter_map(|e| match e {
                ChannelEvent::Pairings { peer, pairings } => {
                    assert_eq!(peer, A);
                    Some(pairings)
                }
                _ => None,
            })
            .collect()
    }

    /// Runs A and B in steps of 1 ms (A's send gap) from `from` to `to` ms, delivering
    /// both ways; returns the pairings messages B took and when.
    fn run_pairings(
        a: &mut Channel,
        b: &mut Channel,
        from: u64,
        to: u64,
    ) -> Vec<(Duration, Vec<Pairing>)> {
        let mut taken = Vec::new();
        for t in (from..=to).map(ms) {
            deliver(a, b, t);
            deliver(b, a, t);
            taken.extend(pairings_taken(b).into_iter().map(|m| (t, m)));
        }
        taken
    }

    #[test]
    fn new_pairings_reach_the_peer_at_once_after_a_keepalive_confirms_the_session() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_pairings(ms(0), B, &[pairing(0x102, 0x202), pairing(0x101, 0x201)])
            .unwrap();
        // Pairings make a session as a demand does. The session is confirmed by a keepalive
        // (a host that predates pairings takes it), the pairings follow at once.
        let sent = lengths_sent(&mut a, &mut b, ms(0));
        assert_eq!(
            sent,
            vec![
                wire::INITIATION_LEN,
                KEEPALIVE_DATAGRAM,
                pairings_datagram(2)
            ]
        );
        assert_eq!(
            events(&mut b),
            vec![ChannelEvent::Pairings {
                peer: A,
                pairings: vec![pairing(0x101, 0x201), pairing(0x102, 0x202)],
            }]
        );
        // Nothing else: no demand, no grant; the next is the rotation's.
        assert_eq!(a.served().count() + b.served().count(), 0);
        assert_eq!(b.grant_from(A), None);
        assert_eq!(a.poll_timeout(), Some(PAIRING_REFRESH));
    }

    /// 300 pairings go at once in three messages (128, 128, 44); then the rotation sends
    /// one of those every PAIRING_REFRESH, each raising an event, so that the whole set
    /// goes again within three refreshes, and starts over.
    #[test]
    fn an_unchanged_set_goes_again_in_rotation_a_message_per_refresh() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        session(&mut a, &mut b, ms(0));
        a.send_tokens_full();
        let set = pairings(300);
        a.set_pairings(ms(0), B, &set).unwrap();
        // Two at once (the burst), the third a send gap later.
        assert_eq!(deliver(&mut a, &mut b, ms(0)), 2);
        assert_eq!(deliver(&mut a, &mut b, ms(1)), 1);
        let fresh = pairings_taken(&mut b);
        assert_eq!(
            fresh.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![128, 128, 44]
        );
        assert_eq!(fresh.concat(), set);
        assert_eq!(a.poll_timeout(), Some(PAIRING_REFRESH));
        let rotation = run_pairings(&mut a, &mut b, 2, 1000);
        let at: Vec<_> = rotation.iter().map(|(t, _)| *t).collect();
        assert_eq!(at, vec![ms(250), ms(500), ms(750), ms(1000)]);
        let messages: Vec<_> = rotation.into_iter().map(|(_, m)| m).collect();
        assert_eq!(
            messages[..3].concat(),
            set,
            "every entry within one rotation"
        );
        assert_eq!(messages[3], set[..128], "and again from the start");
    }

    /// A pairing the peer has not had goes at once, alone, not when the rotation reaches
    /// it; so does a queue pair's changed side channel. The rotation goes on where it was.
    #[test]
    fn a_new_pairing_goes_before_the_rotation_reaches_it() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        session(&mut a, &mut b, ms(0));
        let mut set = pairings(1000);
        a.set_pairings(ms(0), B, &set).unwrap();
        let fresh = run_pairings(&mut a, &mut b, 0, 10);
        assert_eq!(fresh.len(), 8, "1,000 pairings: 8 messages");
        let first = run_pairings(&mut a, &mut b, 11, 299);
        assert_eq!(first, vec![(ms(250), set[..128].to_vec())]);
        // Sorted last: the rotation would reach it at its eighth message, 2 s on.
        set.push(pairing(2000, 0x500));
        a.set_pairings(ms(300), B, &set).unwrap();
        assert_eq!(deliver(&mut a, &mut b, ms(300)), 1);
        assert_eq!(pairings_taken(&mut b), vec![vec![pairing(2000, 0x500)]]);
        set[4].side_qpn = 0x778;
        a.set_pairings(ms(301), B, &set).unwrap();
        assert_eq!(deliver(&mut a, &mut b, ms(301)), 1);
        assert_eq!(pairings_taken(&mut b), vec![vec![set[4]]]);
        let next = run_pairings(&mut a, &mut b, 302, 500);
        assert_eq!(next, vec![(ms(500), set[128..256].to_vec())]);
    }

    /// An empty set stops the pairings: no message at all, and after UNANSWERED none
    /// due either way.
    #[test]
    fn an_empty_set_sends_nothing() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_pairings(ms(0), B, &pairings(3)).unwrap();
        pump(&mut a, &mut b, ms(0));
        assert_eq!(pairings_taken(&mut b).len(), 1);
        a.set_pairings(ms(1), B, &[]).unwrap();
        assert_eq!(a.poll_timeout(), None);
        for t in (1..=300).map(|i| ms(10 * i)) {
            assert_eq!(a.poll_transmit(t), None, "at {t:?}");
            // B's keepalives, owed for UNANSWERED after A's pairings.
            deliver(&mut b, &mut a, t);
            b.handle_timeout(t);
        }
        assert!(pairings_taken(&mut b).is_empty());
        assert_eq!(a.poll_timeout(), None);
        assert_eq!(b.poll_timeout(), None);
    }

    #[test]
    fn pairings_the_wire_would_refuse_or_to_a_non_member_are_refused() {
        let mut a = channel(A, 1);
        let stranger = NodeId([0x77; 16]);
        assert_eq!(
            a.set_pairings(ms(0), stranger, &[pairing(1, 2)]),
            Err(Refusal::NotMember)
        );
        let too_many = pairings(MAX_PAIRINGS_PER_PEER as u32 + 1);
        assert_eq!(
            a.set_pairings(ms(0), B, &too_many),
            Err(Refusal::OutOfRange("pairing count"))
        );
        let cases = [
            (
                Pairing {
                    this_qpn: 0,
                    ..pairing(1, 2)
                },
                "this_qpn",
            ),
            (
                Pairing {
                    that_qpn: wire::QPN_LIMIT,
                    ..pairing(1, 2)
                },
                "that_qpn",
            ),
            (
                Pairing {
                    side_qpn: 0,
                    ..pairing(1, 2)
                },
                "side_qpn",
            ),
            (
                Pairing {
                    side_qkey: 0x8000_0000,
                    ..pairing(1, 2)
                },
                "side_qkey",
            ),
        ];
        for (bad, field) in cases {
            assert_eq!(
                a.set_pairings(ms(0), B, &[pairing(3, 4), bad]),
                Err(Refusal::OutOfRange(field)),
                "{field}"
            );
        }
        // One queue pair with two side channels: the caller's error.
        let other_side = Pairing {
            side_qpn: 0x778,
            ..pairing(1, 2)
        };
        assert_eq!(
            a.set_pairings(ms(0), B, &[pairing(1, 2), other_side]),
            Err(Refusal::OutOfRange("duplicate pairing"))
        );
        // Refused, nothing to send: no handshake started.
        assert_eq!(a.poll_transmit(ms(0)), None);
        assert_eq!(a.poll_timeout(), None);
        // The same entry twice is taken once; the most a peer is sent is taken whole.
        let mut b = channel(B, 2);
        a.set_pairings(ms(0), B, &[pairing(1, 2), pairing(1, 2)])
            .unwrap();
        pump(&mut a, &mut b, ms(0));
        assert_eq!(pairings_taken(&mut b), vec![vec![pairing(1, 2)]]);
        // A refused set leaves the one set before: nothing new to send.
        assert!(a
            .set_pairings(ms(1), B, &[pairing(1, 2), other_side])
            .is_err());
        assert_eq!(a.poll_transmit(ms(1)), None);
        let most = &too_many[..MAX_PAIRINGS_PER_PEER];
        a.set_pairings(ms(1), B, most).unwrap();
        // All new: 32 messages, one a send gap.
        let taken: Vec<_> = run_pairings(&mut a, &mut b, 2, 40)
            .into_iter()
            .flat_map(|(_, m)| m)
            .collect();
        assert_eq!(taken, most);
    }

    /// A restarted peer handshakes at start; the whole set goes on the new session at once
    /// (the session confirmed by a keepalive), not over the next rotation.
    #[test]
    fn a_restarted_peer_gets_every_pairing_at_once() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        let set = pairings(200);
        a.set_pairings(ms(0), B, &set).unwrap();
        pump(&mut a, &mut b, ms(0));
        pump(&mut a, &mut b, ms(5));
        assert_eq!(pairings_taken(&mut b).concat(), set);
        let mut restarted = channel(B, 3);
        restarted.greet(ms(10));
        let mut sent = Vec::new();
        while let Some(t) = restarted.poll_transmit(ms(10)) {
            if t.to != A {
                continue;
            }
            a.receive(ms(10), &t.bytes).unwrap();
            sent.push(t.bytes.len());
            while let Some(t) = a.poll_transmit(ms(10)) {
                restarted.receive(ms(10), &t.bytes).unwrap();
            }
        }
        assert_eq!(sent, vec![wire::INITIATION_LEN, KEEPALIVE_DATAGRAM]);
        assert_eq!(pairings_taken(&mut restarted).concat(), set);
    }

    /// Pairings and nothing else: the peer, with nothing to send back (no shaper of its
    /// own), keeps the sender informed with keepalives, so that the sender's session stays
    /// (no handshake every UNANSWERED); the pairings went at once, then every 250 ms.
    #[test]
    fn pairings_alone_keep_their_session() {
        let mut b = rendezvous_alone_keeps_its_session(|a, t, on| {
            let set = if on { pairings(2) } else { Vec::new() };
            a.set_pairings(t, B, &set).unwrap();
        });
        assert_eq!(
            pairings_taken(&mut b).len(),
            1 + 12,
            "at once, then every 250 ms"
        );
    }

    /// A demand, a probe offer and pairings due at the same moment: the demand and the
    /// offer take the burst, the pairings the next token.
    #[test]
    fn pairings_go_after_demands_and_probe_messages_due_with_them() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        session(&mut a, &mut b, ms(0));
        a.send_tokens_full();
        a.set_pairings(ms(1), B, &pairings(1)).unwrap();
        a.set_probe_offer(ms(1), B, Some(offer(0x101))).unwrap();
        a.set_demand(ms(1), B, &[read(1, 1)]).unwrap();
        let first: Vec<_> = std::iter::from_fn(|| a.poll_transmit(ms(1)))
            .map(|t| t.bytes.len())
            .collect();
        let demand = wire::TRANSPORT_HEADER_LEN + 1 + 4 + wire::ENTRY_LEN + wire::TAG_LEN;
        assert_eq!(first, vec![demand, PROBE_DATAGRAM]);
        assert_eq!(a.poll_timeout(), Some(ms(2)));
        let next = a.poll_transmit(ms(2)).unwrap();
        assert_eq!(next.bytes.len(), pairings_datagram(1));
    }

    /// A member dropped from the list takes the pairings toward it (no event, no message);
    /// listed again, it starts with none.
    #[test]
    fn a_removed_member_takes_its_pairings_with_it() {
        let mut a = channel(A, 1);
        let mut b = channel(B, 2);
        a.set_pairings(ms(0), B, &pairings(3)).unwrap();
        pump(&mut a, &mut b, ms(0));
        let without_b: Vec<Member> = members().into_iter().filter(|m| m.node != B).collect();
        a.set_members(ms(1), &without_b).unwrap();
        assert!(events(&mut a).is_empty());
        assert_eq!(
            a.set_pairings(ms(1), B, &pairings(3)),
            Err(Refusal::NotMember)
        );
        a.set_members(ms(2), &members()).unwrap();
        assert_eq!(a.poll_timeout(), None, "nothing due to B");
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
        /// Whatever order, duplication and loss the network brings, each of A's messages is
        /// taken once and only once, and what B serves is the demand it took last.
        #[test]
        fn any_delivery_order_keeps_the_newest_demand_only(
            order in proptest::collection::vec(0usize..12, 0..40),
        ) {
            let mut a = channel(A, 5);
            let mut b = channel(B, 6);
            session(&mut a, &mut b, Duration::ZERO);
            let mut sent = Vec::new();
            for i in 0..12u64 {
                let t = ms(i * 2);
                a.set_demand(t, B, &[read(1, (i + 1) as u16)]).unwrap();
                sent.push(a.poll_transmit(t).unwrap().bytes);
            }
            let mut seen = std::collections::BTreeSet::new();
            for i in order {
                let result = b.receive(ms(30), &sent[i]);
                if seen.insert(i) {
                    prop_assert_eq!(result, Ok(()));
                    let flows: Vec<_> = b.served().map(|(_, e)| e.flows).collect();
                    prop_assert_eq!(flows, vec![i as u16 + 1]);
                } else {
                    prop_assert_eq!(result, Err(Refusal::Replayed));
                }
            }
        }

        /// No sequence of datagrams from a host without a member's key changes B's state.
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
            prop_assert!(b.peers.iter().all(|p| p.seen.is_empty() && p.out.is_none()));
            prop_assert_eq!(b.poll_event(), None);
        }
    }
}
