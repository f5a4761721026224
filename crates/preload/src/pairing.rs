//! The process's connected RC queue pairs that `justitiad` is to pair with the side
//! channel of the process at their other end (`JUSTITIA_TWO_SIDED=split`).
//!
//! Splitting a SEND or a WRITE with immediate needs the two shapers of a queue pair to
//! talk (`justitia_core::two_sided`), over a UD side channel whose number the queue pair's
//! remote end does not give. The daemons find it: the shaper reports each RC queue pair
//! that reaches RTR with its remote end and the process's side channel on that port, and
//! withdraws it when the queue pair is destroyed or reset; the daemon answers with the
//! peer's side channel once the other end reported the matching pairing
//! (`justitia_daemon`'s `pairing` module). This module is the shaper's record of that: the
//! verb hooks note connections and departures here, and the follower thread reads what is
//! due, opens side channels and talks to the daemon. It does no I/O itself.
//!
//! Invariants:
//! - at most [`MAX_PAIRED_QPS`] queue pairs are held; one beyond is not paired (its
//!   requests go whole, as natively) and counted;
//! - a queue pair's pairing is reported at most once per daemon registration of the flow,
//!   and withdrawn only if it was reported;
//! - a side channel learnt for a queue pair is kept only while that queue pair is
//!   connected to the end it was reported with (a QP number reused after a destroy starts
//!   afresh);
//! - the hooks' part ([`on_modify`], [`on_destroy`]) never fails a verb and holds the
//!   record's lock only for a map update; nothing is said under that lock (a write to
//!   stderr may block): what is to be said is queued ([`Pairings::take_notices`]).

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

use justitia_core::two_sided::Greeting;
use justitia_verbs::sys::*;

use crate::remote::End;

/// The most queue pairs a process has paired at once: the daemon's cap per tenant
/// (`justitia_daemon`'s `MAX_PAIRINGS_PER_TENANT`), which it would refuse beyond.
pub const MAX_PAIRED_QPS: usize = 4096;

/// Lines said at once by [`Pairings::take_notices`].
pub const NOTICES_SAID: usize = 16;

/// How long after its report a queue pair that was not paired is taken as having an
/// unshaped peer (no shaper there reported the other end, or its daemon is not a member)
/// and said so, once. Both daemons answer within a rotation of their pairings (8 s).
pub const UNPAIRED_AFTER_NS: u64 = 10_000_000_000;

/// A device port: a side channel serves the queue pairs of one port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Port {
    /// The device's name (`ibv_get_device_name`).
    pub device: String,
    /// The port number, from 1.
    pub number: u8,
}

/// One RC queue pair connected to a remote end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connection {
    /// The queue pair's own number.
    pub qpn: u32,
    /// Its remote end.
    pub end: End,
    /// The port it goes out of.
    pub port: Port,
    /// The source GID index its route uses (0 when routed by LID), which datagrams to the
    /// peer's side channel use too.
    pub sgid_index: u8,
}

/// The peer process's side channel, as the daemon found it: reached at the connection's
/// remote GID or LID.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerSide {
    /// Its UD queue pair's number.
    pub qpn: u32,
    /// Its Q_Key.
    pub qkey: u32,
}

/// Where one queue pair's pairing stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Report {
    /// To be reported to the daemon.
    Due,
    /// Reported under the current registration.
    Sent,
    /// Its port has no side channel (it could not be made): never reported.
    NoSideChannel,
}

#[derive(Debug)]
struct Entry {
    connection: Connection,
    report: Report,
    peer: Option<PeerSide>,
    /// The exchange of hellos with the peer's side channel, from the pairing on.
    greeting: Greeting,
    /// Its giving up was said.
    said_unanswered: bool,
    /// When its pairing was reported (under the current registration).
    reported_ns: Option<u64>,
    /// That it was never paired was said.
    said_unpaired: bool,
}

impl Entry {
    /// Whether `source` is `peer`, the side channel paired with this queue pair: its
    /// queue pair, at the connection's remote GID (or LID), on the connection's port.
    fn from(&self, peer: &PeerSide, source: &Source) -> bool {
        let end = self.connection.end;
        peer.qpn == source.qpn
            && source.port == self.connection.port
            && if end.gid == [0; 16] {
                source.lid == end.lid
            } else {
                source.gid == Some(end.gid)
            }
    }
}

/// Where a datagram on a side channel came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// The side channel's port it arrived on.
    pub port: Port,
    /// The sender's GID, from the datagram's network header (`None` without one).
    pub gid: Option<[u8; 16]>,
    /// The sender's LID (InfiniBand).
    pub lid: u16,
    /// The sender's queue pair.
    pub qpn: u32,
}

/// What a hello did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelloOutcome {
    /// From the queue pair's paired peer; true when it is the first (the two ends agree).
    Heard(bool),
    /// For a queue pair of this process whose peer the daemon has not told yet: the peer's
    /// daemon answered first. It cannot be checked, so it is dropped; the peer sends it
    /// again.
    Early,
    /// Not from the side channel paired with the queue pair it names (or it names none of
    /// this process's): dropped.
    Refused,
}

/// Running counts, for the statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairingCounts {
    /// Pairings reported to a daemon (again after each registration).
    pub reported: u64,
    /// Peer side channels learnt.
    pub paired: u64,
    /// Connected queue pairs not held: beyond [`MAX_PAIRED_QPS`].
    pub over_cap: u64,
    /// Queue pairs whose peer's hello came: the two shapers agree on the version.
    pub agreed: u64,
    /// Queue pairs whose peer never answered a hello.
    pub unanswered: u64,
    /// Queue pairs never paired within [`UNPAIRED_AFTER_NS`] of their report.
    pub unpaired: u64,
    /// Datagrams dropped: not a message, or not from the side channel they claim.
    pub refused: u64,
}

/// The record. See the module documentation.
#[derive(Debug, Default)]
pub struct Pairings {
    entries: HashMap<u32, Entry>,
    /// Queue pairs gone whose pairing was reported: to withdraw.
    withdrawals: Vec<u32>,
    /// Some pairing may be due: set when one becomes due or a report could not go, cleared
    /// when [`Pairings::due`] returned every one, so that the follower's ticks do not walk
    /// every queue pair every 2 ms to find none.
    maybe_due: bool,
    counts: PairingCounts,
    /// Before this time [`Pairings::hellos_due`] has nothing to do: the earliest hello
    /// or notice due, so that the follower's ticks do not walk thousands of settled queue
    /// pairs every 2 ms.
    wake_ns: u64,
    /// What is to be said, taken by [`Pairings::take_notices`]: said by the caller after
    /// the record's lock is released, as a write to stderr may block and the verb hooks
    /// take that lock.
    notices: Vec<String>,
}

impl Pairings {
    /// Nothing connected.
    pub fn new() -> Self {
        Self::default()
    }

    /// `connection` reached RTR. A queue pair connected again (to another end) is
    /// reported afresh; false when it is not held (over the cap).
    pub fn connected(&mut self, connection: Connection) -> bool {
        let qpn = connection.qpn;
        if let Some(old) = self.entries.get(&qpn) {
            if old.connection == connection {
                return true;
            }
            self.gone(qpn);
        }
        if self.entries.len() >= MAX_PAIRED_QPS {
            self.counts.over_cap += 1;
            return false;
        }
        self.maybe_due = true;
        self.entries.insert(
            qpn,
            Entry {
                connection,
                report: Report::Due,
                peer: None,
                greeting: Greeting::new(),
                said_unanswered: false,
                reported_ns: None,
                said_unpaired: false,
            },
        );
        true
    }

    /// Queue pair `qpn` was destroyed or reset.
    pub fn gone(&mut self, qpn: u32) {
        if let Some(e) = self.entries.remove(&qpn) {
            if e.report == Report::Sent && !self.withdrawals.contains(&qpn) {
                // Bounded even if queue pairs churn while the daemon's socket takes
                // nothing: the oldest is dropped (its pairing stays at the daemon until
                // the flow goes, where it matches nothing of this process's).
                if self.withdrawals.len() >= MAX_PAIRED_QPS {
                    self.withdrawals.remove(0);
                }
                self.withdrawals.push(qpn);
            }
        }
    }

    /// Up to `max` connections whose pairing is due, in no particular order. The caller
    /// marks each one it reported ([`Pairings::reported`]), and calls
    /// [`Pairings::due_again`] if it could not report them all.
    pub fn due(&mut self, max: usize) -> Vec<Connection> {
        if !self.maybe_due {
            return Vec::new();
        }
        let due: Vec<Connection> = self
            .entries
            .values()
            .filter(|e| e.report == Report::Due)
            .take(max)
            .map(|e| e.connection.clone())
            .collect();
        if due.len() < max {
            self.maybe_due = false;
        }
        due
    }

    /// Some of what [`Pairings::due`] returned was not reported: look again next time.
    pub fn due_again(&mut self) {
        self.maybe_due = true;
    }

    /// The pairing of `connection` was reported at `now_ns`. Ignored when the queue pair
    /// has gone or was connected elsewhere since (its new pairing stays due).
    pub fn reported(&mut self, connection: &Connection, now_ns: u64) {
        if let Some(e) = self.entries.get_mut(&connection.qpn) {
            if e.connection == *connection && e.report == Report::Due {
                e.report = Report::Sent;
                e.reported_ns = Some(now_ns);
                self.wake_ns = self.wake_ns.min(now_ns.saturating_add(UNPAIRED_AFTER_NS));
                self.counts.reported += 1;
            }
        }
    }

    /// `connection`'s port has no side channel: it is not reported (its requests go
    /// whole).
    pub fn no_side_channel(&mut self, connection: &Connection) {
        if let Some(e) = self.entries.get_mut(&connection.qpn) {
            if e.connection == *connection {
                e.report = Report::NoSideChannel;
            }
        }
    }

    /// The flow was registered again (a new daemon, or a new registration): the daemon
    /// holds none of the pairings, so every one is due again and nothing is to withdraw.
    pub fn registered_again(&mut self) {
        for e in self.entries.values_mut() {
            if e.report == Report::Sent {
                e.report = Report::Due;
                self.maybe_due = true;
            }
            e.peer = None;
            e.greeting = Greeting::new();
            e.reported_ns = None;
        }
        self.wake_ns = 0;
        self.withdrawals.clear();
    }

    /// The queue pairs to withdraw, oldest first.
    pub fn withdrawals(&self) -> &[u32] {
        &self.withdrawals
    }

    /// The first `n` withdrawals were sent.
    pub fn withdrawn(&mut self, n: usize) {
        self.withdrawals.drain(..n.min(self.withdrawals.len()));
    }

    /// The daemon found `peer` for queue pair `qpn`: kept when the queue pair's pairing
    /// was reported and is still held (an answer to a withdrawn one is dropped). Returns
    /// whether it was kept.
    pub fn paired(&mut self, qpn: u32, peer: PeerSide) -> bool {
        match self.entries.get_mut(&qpn) {
            Some(e) if e.report == Report::Sent => {
                if e.peer != Some(peer) {
                    e.peer = Some(peer);
                    e.greeting = Greeting::new();
                    self.counts.paired += 1;
                    self.wake_ns = 0;
                }
                true
            }
            _ => false,
        }
    }

    /// Up to `max` hellos due at `now_ns`: the connection, its peer's side channel and the
    /// hello's `heard` flag. A queue pair never paired, and a peer that never answered,
    /// are said once per queue pair.
    pub fn hellos_due(&mut self, now_ns: u64, max: usize) -> Vec<(Connection, PeerSide, bool)> {
        let mut due = Vec::new();
        if now_ns < self.wake_ns {
            return due;
        }
        let mut wake = u64::MAX;
        for e in self.entries.values_mut() {
            let Some(peer) = e.peer else {
                let Some(at) = e.reported_ns.filter(|_| !e.said_unpaired) else {
                    continue;
                };
                let late_at = at.saturating_add(UNPAIRED_AFTER_NS);
                if now_ns < late_at {
                    wake = wake.min(late_at);
                    continue;
                }
                e.said_unpaired = true;
                self.counts.unpaired += 1;
                self.notices.push(format!(
                    "queue pair {:#x}: no shaper at its other end was paired with it; its SENDs and WRITEs with immediate go whole",
                    e.connection.qpn
                ));
                continue;
            };
            if due.len() < max {
                if let Some(heard) = e.greeting.due(now_ns) {
                    due.push((e.connection.clone(), peer, heard));
                }
            } else {
                // Over this call's share: the rest go at the next one.
                wake = now_ns;
            }
            if !e.said_unanswered && e.greeting.gave_up(now_ns) {
                e.said_unanswered = true;
                self.counts.unanswered += 1;
                self.notices.push(format!(
                    "queue pair {:#x}: the side channel at its other end never answered; its SENDs and WRITEs with immediate go whole",
                    e.connection.qpn
                ));
            }
            if !e.said_unanswered {
                if let Some(at) = e.greeting.next_event_ns() {
                    wake = wake.min(at);
                }
            }
        }
        self.wake_ns = wake;
        due
    }

    /// A hello naming this process's queue pair `qpn` arrived from `source`, with the
    /// flag `heard`. Taken only from the side channel the daemon paired with that queue
    /// pair, on its port, at its remote end.
    pub fn on_hello(&mut self, qpn: u32, source: &Source, heard: bool) -> HelloOutcome {
        let Some(e) = self.entries.get_mut(&qpn) else {
            self.counts.refused += 1;
            return HelloOutcome::Refused;
        };
        let Some(peer) = e.peer else {
            return HelloOutcome::Early;
        };
        if !e.from(&peer, source) {
            self.counts.refused += 1;
            return HelloOutcome::Refused;
        }
        let first = e.greeting.on_hello(heard);
        if first {
            self.counts.agreed += 1;
        }
        // An answer may be due at once.
        self.wake_ns = 0;
        HelloOutcome::Heard(first)
    }

    /// What is to be said since the last call, at most [`NOTICES_SAID`] lines (one more
    /// counts the rest): each queue pair is said once, and thousands of them at once make
    /// one line beyond that.
    pub fn take_notices(&mut self) -> Vec<String> {
        let mut notices = std::mem::take(&mut self.notices);
        if notices.len() > NOTICES_SAID {
            let more = notices.len() - NOTICES_SAID;
            notices.truncate(NOTICES_SAID);
            notices.push(format!(
                "and {more} more queue pairs whose SENDs and WRITEs with immediate go whole"
            ));
        }
        notices
    }

    /// A datagram that is not a message this end takes was dropped.
    pub fn refused(&mut self) {
        self.counts.refused += 1;
    }

    /// Whether a datagram from `source` comes from the side channel paired with queue
    /// pair `qpn` (its peer's), what every message but a hello must come from: `None`
    /// when it does but the peer's hello has not come yet (the message overtook it; the
    /// peer repeats it), so that it is dropped without being counted as refused.
    pub fn from_peer(&self, qpn: u32, source: &Source) -> Option<bool> {
        let Some(e) = self.entries.get(&qpn) else {
            return Some(false);
        };
        let from = e.peer.is_some_and(|peer| e.from(&peer, source));
        match (from, e.greeting.agreed()) {
            (true, false) => None,
            (from, _) => Some(from),
        }
    }

    /// Queue pair `qpn`'s connection and its peer's side channel, once paired.
    pub fn connection(&self, qpn: u32) -> Option<(Connection, PeerSide)> {
        let e = self.entries.get(&qpn)?;
        Some((e.connection.clone(), e.peer?))
    }

    /// How long before `now_ns` queue pair `qpn`'s pairing was reported, if it was.
    pub fn since_report_ns(&self, qpn: u32, now_ns: u64) -> Option<u64> {
        let at = self.entries.get(&qpn)?.reported_ns?;
        Some(now_ns.saturating_sub(at))
    }

    /// Whether the two shapers of queue pair `qpn` agree on the version.
    pub fn agreed(&self, qpn: u32) -> bool {
        self.entries.get(&qpn).is_some_and(|e| e.greeting.agreed())
    }

    /// The remote end and peer side channel of queue pair `qpn`, once paired.
    pub fn peer(&self, qpn: u32) -> Option<(End, PeerSide)> {
        let e = self.entries.get(&qpn)?;
        Some((e.connection.end, e.peer?))
    }

    /// The running counts.
    pub fn counts(&self) -> PairingCounts {
        self.counts
    }
}

/// Whether connections are recorded at all: set once when the engine is made with
/// `JUSTITIA_TWO_SIDED=split` under a daemon.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The process's record.
static RECORD: LazyLock<Mutex<Pairings>> = LazyLock::new(|| Mutex::new(Pairings::new()));

/// Turns recording on for the life of the process.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// The process's record, locked.
pub fn record() -> MutexGuard<'static, Pairings> {
    RECORD.lock().unwrap_or_else(|e| e.into_inner())
}

/// The connection an RC queue pair's successful move to RTR with `attr` and `mask`
/// makes, if any (the remote end as [`crate::remote`] reads it, and the port).
pub fn connection_of(qp: &ibv_qp, attr: &ibv_qp_attr, mask: u32) -> Option<Connection> {
    let end = crate::remote::end_of(qp, attr, mask)?;
    let ah = &attr.ah_attr;
    // The route's source GID, which datagrams to the peer's side channel use too.
    let sgid_index = if ah.is_global != 0 {
        ah.grh.sgid_index
    } else {
        0
    };
    // SAFETY: a live QP's context and its device are live; the device's name is a
    // NUL-terminated array of its own.
    let device = unsafe {
        let ctx = qp.context.as_ref()?;
        let dev = ctx.device.as_ref()?;
        CStr::from_bytes_until_nul(std::slice::from_raw_parts(
            dev.name.as_ptr().cast::<u8>(),
            dev.name.len(),
        ))
        .ok()?
        .to_string_lossy()
        .into_owned()
    };
    Some(Connection {
        qpn: qp.qp_num,
        end,
        port: Port {
            device,
            number: if ah.port_num == 0 { 1 } else { ah.port_num },
        },
        sgid_index,
    })
}

/// A successful `ibv_modify_qp` of `qp`: records a connection at RTR, and a departure at
/// a reset.
pub fn on_modify(qp: &ibv_qp, attr: &ibv_qp_attr, mask: u32) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    if mask & IBV_QP_STATE != 0 && attr.qp_state == IBV_QPS_RESET {
        record().gone(qp.qp_num);
    } else if let Some(c) = connection_of(qp, attr, mask) {
        record().connected(c);
    }
}

/// Queue pair `qpn` is being destroyed.
pub fn on_destroy(qpn: u32) {
    if ENABLED.load(Ordering::Relaxed) {
        record().gone(qpn);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn connection(qpn: u32, remote_qpn: u32) -> Connection {
        Connection {
            qpn,
            end: End {
                gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
                lid: 0,
                qpn: remote_qpn,
            },
            port: Port {
                device: "rxe0".into(),
                number: 1,
            },
            sgid_index: 1,
        }
    }

    const PEER: PeerSide = PeerSide {
        qpn: 0x99,
        qkey: 0x1234,
    };

    #[test]
    fn a_connection_is_due_once_and_its_peer_kept_only_after_the_report() {
        let mut p = Pairings::new();
        let c = connection(0x11, 0x22);
        assert!(p.connected(c.clone()));
        assert!(
            p.connected(c.clone()),
            "the same connection again is one entry"
        );
        assert_eq!(p.due(8), vec![c.clone()]);
        assert!(
            !p.paired(0x11, PEER),
            "no answer is taken before the report"
        );
        p.reported(&c, 0);
        assert!(p.due(8).is_empty());
        assert!(p.paired(0x11, PEER));
        assert!(
            p.paired(0x11, PEER),
            "a repeated answer is kept, counted once"
        );
        assert_eq!(p.peer(0x11), Some((c.end, PEER)));
        assert_eq!(p.counts().paired, 1);
        assert_eq!(p.counts().reported, 1);
    }

    #[test]
    fn a_reported_queue_pair_that_goes_is_withdrawn_and_an_unreported_one_is_not() {
        let mut p = Pairings::new();
        let (a, b) = (connection(1, 2), connection(3, 4));
        p.connected(a.clone());
        p.connected(b.clone());
        p.reported(&a, 0);
        p.gone(1);
        p.gone(3);
        p.gone(1);
        assert_eq!(p.withdrawals(), &[1]);
        assert!(
            !p.paired(1, PEER),
            "an answer for a gone queue pair is dropped"
        );
        p.withdrawn(5);
        assert!(p.withdrawals().is_empty());
        assert!(p.due(8).is_empty());
    }

    #[test]
    fn a_queue_pair_connected_elsewhere_is_reported_afresh_and_loses_its_old_peer() {
        let mut p = Pairings::new();
        let first = connection(7, 8);
        p.connected(first.clone());
        p.reported(&first, 0);
        p.paired(7, PEER);
        let second = connection(7, 9);
        p.connected(second.clone());
        assert_eq!(p.withdrawals(), &[7], "the old pairing is withdrawn");
        assert_eq!(p.peer(7), None);
        // A late report of the first connection does not mark the second as sent.
        p.reported(&first, 0);
        assert_eq!(p.due(8), vec![second]);
    }

    #[test]
    fn a_new_registration_makes_every_pairing_due_again() {
        let mut p = Pairings::new();
        let c = connection(5, 6);
        p.connected(c.clone());
        p.reported(&c, 0);
        p.paired(5, PEER);
        p.gone(99);
        p.registered_again();
        assert_eq!(p.due(8), vec![c]);
        assert_eq!(p.peer(5), None, "the new daemon answers again");
        assert!(p.withdrawals().is_empty());
    }

    #[test]
    fn no_more_than_the_cap_are_held_and_a_port_without_side_channel_is_never_due() {
        let mut p = Pairings::new();
        for q in 0..MAX_PAIRED_QPS as u32 {
            assert!(p.connected(connection(q + 1, 1)));
        }
        assert!(!p.connected(connection(u32::MAX, 1)));
        assert_eq!(p.counts().over_cap, 1);
        let c = connection(1, 1);
        p.no_side_channel(&c);
        assert_eq!(p.due(10).len(), 10, "due is bounded by its argument");
        let all = p.due(MAX_PAIRED_QPS);
        assert_eq!(all.len(), MAX_PAIRED_QPS - 1);
        assert!(all.iter().all(|d| d.qpn != 1));
    }

    fn source(qpn: u32) -> Source {
        Source {
            port: Port {
                device: "rxe0".into(),
                number: 1,
            },
            gid: Some(connection(0, 0).end.gid),
            lid: 0,
            qpn,
        }
    }

    #[test]
    fn a_paired_queue_pair_says_hello_and_takes_one_only_from_its_peers_side_channel() {
        let mut p = Pairings::new();
        let c = connection(0x11, 0x22);
        p.connected(c.clone());
        assert!(p.hellos_due(0, 8).is_empty(), "no hello before the pairing");
        p.reported(&c, 0);
        assert_eq!(
            p.on_hello(0x11, &source(PEER.qpn), false),
            HelloOutcome::Early,
            "the peer's daemon told it first: not checked, not refused"
        );
        assert_eq!(p.counts().refused, 0);
        p.paired(0x11, PEER);
        assert_eq!(p.hellos_due(0, 8), vec![(c.clone(), PEER, false)]);
        assert!(
            p.hellos_due(1, 8).is_empty(),
            "the next waits for the retry"
        );
        // Each field of the source changed alone: refused.
        let good = source(PEER.qpn);
        let mut wrong_qpn = good.clone();
        wrong_qpn.qpn += 1;
        let mut wrong_gid = good.clone();
        wrong_gid.gid = Some([9; 16]);
        let mut no_gid = good.clone();
        no_gid.gid = None;
        let mut wrong_port = good.clone();
        wrong_port.port.number = 2;
        let mut wrong_device = good.clone();
        wrong_device.port.device = "rxe1".into();
        for bad in [wrong_qpn, wrong_gid, no_gid, wrong_port, wrong_device] {
            assert_eq!(
                p.on_hello(0x11, &bad, false),
                HelloOutcome::Refused,
                "{bad:?}"
            );
        }
        assert_eq!(
            p.on_hello(0x12, &good, false),
            HelloOutcome::Refused,
            "no such QP"
        );
        assert!(!p.agreed(0x11));
        assert_eq!(p.counts().refused, 6);
        assert_eq!(p.on_hello(0x11, &good, false), HelloOutcome::Heard(true));
        assert!(p.agreed(0x11));
        assert_eq!(p.counts().agreed, 1);
        assert_eq!(
            p.hellos_due(2, 8),
            vec![(c, PEER, true)],
            "answered at once, saying it heard"
        );
        assert_eq!(p.on_hello(0x11, &good, true), HelloOutcome::Heard(false));
        assert!(p.hellos_due(u64::MAX, 8).is_empty(), "both heard: silence");
    }

    #[test]
    fn a_report_that_could_not_go_is_due_again_and_nothing_due_is_found_at_once() {
        let mut p = Pairings::new();
        let c = connection(0x11, 0x22);
        p.connected(c.clone());
        assert_eq!(p.due(8), vec![c.clone()]);
        assert!(p.due(8).is_empty(), "returned once; not reported");
        p.due_again();
        assert_eq!(
            p.due(8),
            vec![c.clone()],
            "the report could not go: due again"
        );
        p.reported(&c, 0);
        p.due_again();
        assert!(p.due(8).is_empty());
        p.registered_again();
        assert_eq!(p.due(8), vec![c]);
    }

    #[test]
    fn withdrawals_stay_bounded_while_none_can_go() {
        let mut p = Pairings::new();
        for q in 1..=(MAX_PAIRED_QPS as u32 + 10) {
            let c = connection(q, q);
            p.connected(c.clone());
            p.reported(&c, 0);
            p.gone(q);
        }
        assert_eq!(p.withdrawals().len(), MAX_PAIRED_QPS);
        assert_eq!(p.withdrawals()[0], 11, "the oldest dropped");
    }

    #[test]
    fn a_queue_pair_never_paired_is_said_once() {
        let mut p = Pairings::new();
        let c = connection(0x11, 0x22);
        p.connected(c.clone());
        p.reported(&c, 5);
        p.hellos_due(UNPAIRED_AFTER_NS + 4, 8);
        assert_eq!(p.counts().unpaired, 0);
        p.hellos_due(UNPAIRED_AFTER_NS + 5, 8);
        p.hellos_due(UNPAIRED_AFTER_NS * 3, 8);
        assert_eq!(p.counts().unpaired, 1);
        assert_eq!(p.take_notices().len(), 1);
        assert!(p.take_notices().is_empty(), "said once");
    }

    #[test]
    fn thousands_of_notices_at_once_make_a_bounded_number_of_lines() {
        let mut p = Pairings::new();
        for q in 1..=1000 {
            let c = connection(q, q);
            p.connected(c.clone());
            p.reported(&c, 0);
        }
        p.hellos_due(UNPAIRED_AFTER_NS, 8);
        assert_eq!(p.counts().unpaired, 1000);
        let lines = p.take_notices();
        assert_eq!(lines.len(), NOTICES_SAID + 1);
        assert!(
            lines[NOTICES_SAID].contains("984 more"),
            "{}",
            lines[NOTICES_SAID]
        );
    }

    #[test]
    fn between_hellos_a_call_walks_nothing_and_settled_queue_pairs_never_wake_it() {
        let mut p = Pairings::new();
        let c = connection(0x11, 0x22);
        p.connected(c.clone());
        p.reported(&c, 0);
        p.paired(0x11, PEER);
        assert_eq!(p.hellos_due(0, 8).len(), 1);
        let retry = justitia_core::two_sided::HELLO_RETRY_NS;
        assert_eq!(p.wake_ns, retry, "next: the retry");
        assert!(p.hellos_due(retry - 1, 8).is_empty());
        p.on_hello(0x11, &source(PEER.qpn), false);
        assert_eq!(p.hellos_due(1, 8).len(), 1, "the answer goes at once");
        p.on_hello(0x11, &source(PEER.qpn), true);
        p.hellos_due(2, 8);
        assert_eq!(p.wake_ns, u64::MAX, "agreed both ways: nothing to wake for");
        // A queue pair reported and not paired wakes the walk for its notice only.
        let d = connection(0x33, 0x44);
        p.connected(d.clone());
        p.reported(&d, 10);
        assert_eq!(p.wake_ns, 10 + UNPAIRED_AFTER_NS);
    }

    #[test]
    fn a_peer_that_never_answers_is_counted_once() {
        let mut p = Pairings::new();
        let c = connection(0x11, 0x22);
        p.connected(c.clone());
        p.reported(&c, 0);
        p.paired(0x11, PEER);
        let mut now = 0;
        for _ in 0..2 * justitia_core::two_sided::HELLO_TRIES {
            p.hellos_due(now, 8);
            now += justitia_core::two_sided::HELLO_RETRY_NS;
        }
        assert_eq!(p.counts().unanswered, 1);
        assert!(!p.agreed(0x11));
    }

    #[test]
    fn an_rc_queue_pair_at_rtr_makes_a_connection_on_its_device_and_port() {
        // SAFETY: plain C structs, all zero is valid.
        let mut dev: ibv_device = unsafe { std::mem::zeroed() };
        for (i, b) in b"rxe0\0".iter().enumerate() {
            dev.name[i] = *b as std::ffi::c_char;
        }
        // SAFETY: as above.
        let mut ctx: ibv_context = unsafe { std::mem::zeroed() };
        ctx.device = &mut dev;
        // SAFETY: as above.
        let mut qp: ibv_qp = unsafe { std::mem::zeroed() };
        qp.context = &mut ctx;
        qp.qp_type = IBV_QPT_RC;
        qp.qp_num = 0x33;
        // SAFETY: as above.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = IBV_QPS_RTR;
        attr.dest_qp_num = 0x44;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.port_num = 1;
        attr.ah_attr.grh.sgid_index = 3;
        attr.ah_attr.grh.dgid.raw = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2];
        let mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_DEST_QPN;
        let c = connection_of(&qp, &attr, mask).unwrap();
        assert_eq!((c.qpn, c.end.qpn, c.sgid_index), (0x33, 0x44, 3));
        assert_eq!(c.port.device, "rxe0");
        assert_eq!(c.port.number, 1);
        assert_eq!(connection_of(&qp, &attr, IBV_QP_STATE | IBV_QP_AV), None);
        attr.qp_state = IBV_QPS_RTS;
        assert_eq!(
            connection_of(&qp, &attr, mask),
            None,
            "only the move to RTR"
        );
        attr.qp_state = IBV_QPS_RTR;
        qp.qp_type = IBV_QPT_UD;
        assert_eq!(connection_of(&qp, &attr, mask), None, "RC only");
    }
}
