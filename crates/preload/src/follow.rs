//! Following `justitiad`: the shaper's side of the daemon.
//!
//! A [`Follower`] registers the process's flow with the daemon, reports whether it has work,
//! and turns the allotment it reads back into the [`Settings`] the engine enforces: the
//! core pacer's rate and the chunk size. It is driven by [`Follower::tick`], which the
//! engine calls from its own thread every [`FOLLOW_PERIOD`] (never from a verb: connecting
//! and reconnecting may wait on the daemon's greeting), and it only describes what to do;
//! the engine carries it out. So this module names no hook and no engine state.
//!
//! One flow per process. The process's RC queue pairs share one pacer, and the daemon
//! gives a flow's queue pairs one allotment between them, so the process's queue pairs are
//! one flow, of the class `JUSTITIA_CLASS` gives them (with `auto`, the most
//! resource-hungry class the classifier has given any of them). It is registered when the
//! first such queue pair is created and unregistered when the last is destroyed.
//!
//! Fail-open: without an allotment (no daemon, a daemon gone or stale, the flow not
//! registered yet, idle, or of the latency class) the settings are the static ones, from
//! the environment: `JUSTITIA_RATE` if given, else unpaced. The client's `tick` reconnects
//! with backoff and registers the flow again.

use std::path::PathBuf;
use std::time::Duration;

use justitia_agent::block::BlockError;
use justitia_agent::client::ClientError;
use justitia_agent::client::{AgentClient, Allotment, ClientConfig, FlowHandle, FlowState};
use justitia_agent::proto::{ControlVerbReport, QpPairing, QpTurnReport, LATENCY_LONGEST};
use justitia_core::control_verbs::{ControlVerbBudget, ControlVerbCounts};
use justitia_core::flow::FlowClass;
use justitia_core::message_charge::MessageCharge;
use justitia_core::pacer::{PaceRate, ReleasePhase};
use justitia_core::queue_turns::TurnBudget;

use crate::config::{Config, DaemonSetting};
use crate::log::log;
use crate::pairing::{self, PairingCounts, PeerSide};
use crate::side_channel::SharedSideChannels;
#[cfg(test)]
use crate::side_channel::SideChannels;

/// How often the engine ticks the follower. A daemon that dies hangs up its socket, which
/// the next tick sees, so the shaper is back on its static settings within this period (and
/// the daemon's staleness limit, 5 ms by default, for a daemon that hangs); allotments
/// change at most once per RefPeriod (500 us), and a few RefPeriods late is still within
/// the controller's reaction time.
pub const FOLLOW_PERIOD: Duration = Duration::from_millis(2);

/// Ticks without a post, a chunk, a paced request waiting or a request at the NIC before
/// the flow is reported idle (its share then goes to the others).
const IDLE_TICKS: u32 = 2;

/// The same for a latency flow: 200 ms. A latency flow posts one message per round trip
/// and has nothing at the NIC while it waits for the answer or thinks, so on a slow path
/// (a round trip of milliseconds: an RPC client's think time, an emulated wire) it is
/// quiet for more than two ticks between messages. Reported idle there, it loses its
/// protection just before its next message: the daemon counts no latency flow, stops the
/// reference flow and lets the bandwidth flows' chunks grow to the size without latency
/// flows, and each such chunk is a burst the next message waits behind. Idle latency flows
/// cost the others nothing but a smaller chunk, so the long linger is cheap.
const LATENCY_IDLE_TICKS: u32 = 100;

/// How often an active flow's usage is reported when its activity does not change.
const REPORT_EVERY_NS: u64 = 10_000_000;

/// The most pairings reported in one tick: a process that connects thousands of queue
/// pairs at once reports them over a few ticks rather than filling the daemon's socket.
const PAIRINGS_PER_TICK: usize = 256;

/// How long a connection attempt waits for the daemon's greeting, on the follower's
/// thread: a daemon that accepts but does not answer delays the next tick by this much.
const GREETING_TIMEOUT: Duration = Duration::from_millis(100);

/// What the engine enforces.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    /// The pacer's rate; `None`: unpaced.
    pub rate: Option<PaceRate>,
    /// The chunk size bandwidth requests are cut to.
    pub chunk_bytes: u32,
    /// The flow's place in the host's release schedule, from the daemon's allotment
    /// ([`Pacer::set_rate_in_phase`](justitia_core::pacer::Pacer::set_rate_in_phase));
    /// `None` on static settings, which pace the flow alone
    /// ([`Pacer::set_rate`](justitia_core::pacer::Pacer::set_rate)).
    pub phase: Option<ReleasePhase>,
    /// The process's control-verb budget: the lower of `JUSTITIA_CONTROL_RATE` and the
    /// daemon's share for the process; `None`: unpaced.
    pub control: Option<ControlVerbBudget>,
    /// The turns among the process's shaped QPs: the fewer of `JUSTITIA_QP_TURNS` and
    /// the daemon's share for the process; `None`: no turns.
    pub turns: Option<TurnBudget>,
    /// What each paced request is charged in the pace: the daemon's price for the flow
    /// under `adaptive` ([`MessageCharge`]), the payload otherwise (and under a rate of the
    /// environment's own, which prices nothing).
    pub charge: MessageCharge,
    /// The process's latency flow is registered with a daemon, which reads its round
    /// trips: its requests are timed ([`crate::round_trips`]).
    pub time_round_trips: bool,
}

/// The process's QP turns so far (running counts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TurnCounts {
    /// Times one of its QPs waited in line for a turn.
    pub waits: u64,
    /// Times one of its QPs gave a spent turn up to a waiting one.
    pub yields: u64,
}

/// The process's queue pairs as the follower sees them at a tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    /// Their class; `None` when none is known yet (no class set, or `auto` before the
    /// classifier's first verdict).
    pub class: Option<FlowClass>,
    /// RC queue pairs alive.
    pub qps: u32,
    /// Requests posted so far (a running count).
    pub requests: u64,
    /// Chunks posted so far (a running count).
    pub chunks: u64,
    /// Payload bytes posted so far (a running count).
    pub bytes: u64,
    /// Requests split into chunks so far (a running count).
    pub split_requests: u64,
    /// Paced requests wait for tokens now.
    pub waiting: bool,
    /// The process's control verbs so far (running counts).
    pub control_verbs: ControlVerbCounts,
    /// The process is about to issue its first control verb, or has issued one: it
    /// connects to the daemon to learn its budget.
    pub control_seen: bool,
    /// Requests posted and not yet completed on its queue pairs: work at the NIC.
    pub in_flight: bool,
    /// Its QPs' turns so far.
    pub turns: TurnCounts,
    /// The round trips its latency requests took since the previous tick: how many, and
    /// the longest, longest first (see [`crate::round_trips`]).
    pub round_trips: Option<(u32, [u32; LATENCY_LONGEST])>,
}

/// Where the follower stands, for logs and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FollowStatus {
    /// A live daemon is connected.
    pub connected: bool,
    /// The flow's registration, `None` when no flow is registered.
    pub flow: Option<FlowState>,
    /// The allotment in effect; `None`: static settings.
    pub allotment: Option<Allotment>,
    /// The flow was reported active at the latest report.
    pub active: bool,
    /// Times the daemon was found gone while connected.
    pub fallbacks: u64,
    /// Times the daemon's heartbeat went stale while its connection stayed open (a slow
    /// daemon, not a gone one).
    pub stale_periods: u64,
    /// Connections made to a daemon.
    pub connections: u64,
    /// Requests split while a daemon this process had followed was gone: from the tick
    /// that found it gone to the tick that connected again (counted at ticks, so to
    /// within one tick). The shaper's own static settings did that splitting.
    pub split_while_gone: u64,
    /// Side channels open (`JUSTITIA_TWO_SIDED=split`).
    pub side_channels: u32,
    /// The queue pairs' pairings so far.
    pub pairing: PairingCounts,
}

/// The shaper's side of `justitiad`. See the module documentation.
#[derive(Debug)]
pub struct Follower {
    client: AgentClient,
    path: PathBuf,
    explicit: bool,
    /// The environment's rate (`JUSTITIA_RATE`), kept also under a daemon.
    static_rate: Option<PaceRate>,
    /// The environment's chunk size.
    static_chunk: u32,
    /// The environment's control-verb budget (`JUSTITIA_CONTROL_RATE`).
    static_control: Option<ControlVerbBudget>,
    /// [`Group::control_verbs`] as last reported to the daemon.
    control_reported: ControlVerbCounts,
    /// The environment's QP turns (`JUSTITIA_QP_TURNS`).
    static_turns: Option<TurnBudget>,
    /// [`Group::turns`] as last reported to the daemon.
    turns_reported: TurnCounts,
    /// The process has issued control verbs: the daemon's budget applies to it, so it
    /// connects even without a flow.
    control_seen: bool,
    /// `JUSTITIA_CHUNK` was given: kept also under a daemon.
    chunk_set: bool,
    flow: Option<(FlowHandle, FlowClass)>,
    allotment: Option<Allotment>,
    connected: bool,
    /// The connection was open at the previous tick, fresh or stale.
    open: bool,
    said_missing: bool,
    fallbacks: u64,
    stale_periods: u64,
    /// [`Group::split_requests`] at the previous tick.
    seen_split: u64,
    /// See [`FollowStatus::split_while_gone`].
    split_while_gone: u64,
    /// Counts at the previous tick, and what has not been reported yet.
    seen: (u64, u64, u64),
    unreported: (u64, u64),
    quiet_ticks: u32,
    /// What the daemon was last told about activity; `None` after (re)registration.
    reported_active: Option<bool>,
    last_report_ns: u64,
    /// The remote end last reported (see [`crate::remote`]); `None` after (re)registration.
    remote_sent: Option<(crate::remote::End, bool)>,
    /// The process's side channels, with `JUSTITIA_TWO_SIDED=split`; `None`: queue pairs
    /// are not paired.
    sides: Option<SharedSideChannels>,
    /// The daemon's id of the flow the pairings were reported under: another one (a new
    /// registration, or a new daemon) holds none of them.
    paired_under: Option<u64>,
}

impl Follower {
    /// A follower for `config`, whose static settings (what the environment asks for) are
    /// `fallback`; `None` when `JUSTITIA_DAEMON=off`. Connects on the first tick that has a
    /// flow to register. With `sides`, it pairs the process's queue pairs, opening a side
    /// channel per port as its first connection is to be reported.
    pub fn new(
        config: &Config,
        fallback: Settings,
        sides: Option<SharedSideChannels>,
    ) -> Option<Follower> {
        if config.daemon == DaemonSetting::Off {
            return None;
        }
        let client = AgentClient::disconnected(
            &config.socket,
            ClientConfig {
                greeting_timeout: GREETING_TIMEOUT,
                ..ClientConfig::default()
            },
        );
        Some(Follower {
            client,
            path: config.socket.clone(),
            explicit: config.daemon == DaemonSetting::On,
            static_rate: fallback.rate,
            static_chunk: fallback.chunk_bytes,
            static_control: fallback.control,
            control_reported: ControlVerbCounts::default(),
            static_turns: fallback.turns,
            turns_reported: TurnCounts::default(),
            control_seen: false,
            chunk_set: config.chunk_set,
            flow: None,
            allotment: None,
            connected: false,
            open: false,
            said_missing: false,
            fallbacks: 0,
            stale_periods: 0,
            seen_split: 0,
            split_while_gone: 0,
            seen: (0, 0, 0),
            unreported: (0, 0),
            quiet_ticks: IDLE_TICKS,
            reported_active: None,
            last_report_ns: 0,
            remote_sent: None,
            sides,
            paired_under: None,
        })
    }

    /// Pairs the queue pairs through `sides` instead of the real verbs' side channels,
    /// with `JUSTITIA_TWO_SIDED=split` (they replace what the follower shares with the
    /// engine, which reads them).
    #[cfg(test)]
    pub(crate) fn set_side_channels(&mut self, sides: Box<dyn SideChannels>) {
        if let Some(shared) = &self.sides {
            *shared.lock() = sides;
        }
    }

    /// Where the follower stands.
    pub fn status(&self) -> FollowStatus {
        FollowStatus {
            connected: self.connected,
            flow: self.flow.map(|(h, _)| self.client.state(h)),
            allotment: self.allotment,
            active: self.reported_active == Some(true),
            fallbacks: self.fallbacks,
            stale_periods: self.stale_periods,
            connections: self.client.stats().connections,
            split_while_gone: self.split_while_gone,
            side_channels: self.sides.as_ref().map_or(0, |s| s.lock().count()),
            pairing: if self.sides.is_some() {
                pairing::record().counts()
            } else {
                PairingCounts::default()
            },
        }
    }

    /// How long the follower may sleep after a tick at `now_ns`: [`FOLLOW_PERIOD`] while
    /// connected, else until the client's next connection attempt (its backoff reaches
    /// 1 s, so a process on a host without a daemon wakes about once a second), and `None`
    /// with no flow, no control verb and no connection (nothing to follow until a QP is
    /// created or a region registered).
    pub fn sleep_after(&self, now_ns: u64) -> Option<Duration> {
        if self.flow.is_none() && !self.control_seen && self.client.socket().is_none() {
            return None;
        }
        let Some(at) = self.client.next_attempt_ns() else {
            return Some(FOLLOW_PERIOD);
        };
        Some(Duration::from_nanos(at.saturating_sub(now_ns)).max(FOLLOW_PERIOD))
    }

    /// A descriptor of the daemon connection's socket (a duplicate, to wait on without
    /// holding the follower), `None` while not connected.
    pub fn connection(&self) -> Option<std::os::fd::OwnedFd> {
        self.client
            .socket()
            .and_then(|s| s.try_clone_to_owned().ok())
    }

    /// The settings without an allotment.
    fn fallback(&self) -> Settings {
        Settings {
            rate: self.static_rate,
            chunk_bytes: self.static_chunk,
            phase: None,
            control: self.control_budget(),
            turns: self.turn_budget(),
            charge: MessageCharge::NONE,
            time_round_trips: self.times_round_trips(),
        }
    }

    /// Whether the process's latency flow is registered with a connected daemon: its
    /// round trips are then timed and reported.
    fn times_round_trips(&self) -> bool {
        self.connected
            && self.flow.is_some_and(|(h, class)| {
                class == FlowClass::Latency
                    && matches!(self.client.state(h), FlowState::Registered { .. })
            })
    }

    /// Sends the latency flow's round trips timed since the previous tick, if any.
    fn report_round_trips(&mut self, group: Group) {
        let (Some((count, longest_ns)), Some((h, FlowClass::Latency))) =
            (group.round_trips, self.flow)
        else {
            return;
        };
        if self.connected {
            self.client.report_latency(h, count, longest_ns);
        }
    }

    /// The QP turns in force: the environment's, each bound lowered to the daemon's when
    /// the daemon's is lower (a process may ask for fewer or shorter turns, never more).
    fn turn_budget(&self) -> Option<TurnBudget> {
        let daemon = if self.connected {
            self.client.turn_budget()
        } else {
            None
        };
        match (self.static_turns, daemon) {
            (Some(s), Some(d)) => Some(TurnBudget {
                open: s.open.min(d.open),
                turn_bytes: s.turn_bytes.min(d.turn_bytes),
            }),
            (s, d) => s.or(d),
        }
    }

    /// Tells the daemon the QP turns waited for and yielded since the previous report, at
    /// most once per tick and only when there are new ones.
    fn report_qp_turns(&mut self, group: Group) {
        let (now, last) = (group.turns, self.turns_reported);
        if now == last || !self.connected {
            return;
        }
        let report = QpTurnReport {
            waits: now.waits.saturating_sub(last.waits),
            yields: now.yields.saturating_sub(last.yields),
        };
        if self.client.report_qp_turns(report) {
            self.turns_reported = now;
        }
    }

    /// The control-verb budget in force: the environment's, lowered to the daemon's
    /// share when the daemon's is lower (a process may ask to be slower, never faster).
    fn control_budget(&self) -> Option<ControlVerbBudget> {
        let daemon = if self.connected {
            self.client.control_budget()
        } else {
            None
        };
        match (self.static_control, daemon) {
            (Some(s), Some(d)) => Some(if d.per_sec < s.per_sec { d } else { s }),
            (s, d) => s.or(d),
        }
    }

    /// Tells the daemon the control verbs issued since the previous report, at most once
    /// per tick and only when there are new ones.
    fn report_control_verbs(&mut self, group: Group) {
        let now = group.control_verbs;
        let last = self.control_reported;
        if now.admitted == last.admitted || !self.connected {
            return;
        }
        let report = ControlVerbReport {
            verbs: now.admitted.saturating_sub(last.admitted),
            delayed: now.delayed.saturating_sub(last.delayed),
            waited_ns: u64::try_from(now.waited.saturating_sub(last.waited).as_nanos())
                .unwrap_or(u64::MAX),
        };
        if self.client.report_control_verbs(report) {
            self.control_reported = now;
        }
    }

    /// One step at `now_ns` (`CLOCK_MONOTONIC`): registers or unregisters the flow as
    /// `group` needs, talks to the daemon, reports activity, and returns the settings to
    /// enforce now. Waits only while connecting (at most the greeting timeout).
    pub fn tick(&mut self, now_ns: u64, group: Group) -> Settings {
        self.count_splits_while_gone(group);
        self.track_registration(group);
        self.control_seen |= group.control_seen;
        if self.flow.is_some() || self.control_seen || self.client.socket().is_some() {
            self.client.tick(now_ns);
        }
        self.track_connection();
        self.report(now_ns, group);
        self.report_remote();
        self.report_pairings(now_ns);
        self.report_control_verbs(group);
        self.report_qp_turns(group);
        self.report_round_trips(group);
        self.allotment = match self.flow {
            Some((h, _)) if self.connected => self.client.allotment(h),
            _ => None,
        };
        let Some(a) = self.allotment else {
            return self.fallback();
        };
        let chunk_bytes = if self.chunk_set {
            self.static_chunk
        } else {
            u32::try_from(a.chunk_bytes).unwrap_or(u32::MAX).max(1)
        };
        // The phase places the flow among the others the daemon divides among at their
        // rates; a rate of the environment's own is not part of that schedule.
        let (rate, phase, charge) = match self.static_rate {
            Some(r) => (PaceRate { chunk_bytes, ..r }, None, MessageCharge::NONE),
            None => (
                PaceRate {
                    bytes_per_sec: a.bytes_per_sec,
                    ops_per_sec: (a.ops_per_sec > 0).then_some(a.ops_per_sec),
                    chunk_bytes,
                },
                Some(a.phase()),
                a.charge,
            ),
        };
        Settings {
            rate: Some(rate),
            chunk_bytes,
            phase,
            control: self.control_budget(),
            turns: self.turn_budget(),
            charge,
            time_round_trips: self.times_round_trips(),
        }
    }

    /// Counts the requests split since the previous tick as split while the daemon was gone
    /// when, at the end of that tick, a daemon this process had followed was found gone and
    /// none was connected yet.
    fn count_splits_while_gone(&mut self, group: Group) {
        let since = group.split_requests.wrapping_sub(self.seen_split);
        self.seen_split = group.split_requests;
        if self.fallbacks > 0 && !self.open {
            self.split_while_gone = self.split_while_gone.saturating_add(since);
        }
    }

    /// Registers the flow when the group has queue pairs of a known class, again when its
    /// class changes, and unregisters it when the last queue pair is gone.
    fn track_registration(&mut self, group: Group) {
        let want = group.class.filter(|_| group.qps > 0);
        if self.flow.map(|(_, c)| c) == want {
            return;
        }
        if let Some((h, _)) = self.flow.take() {
            self.client.unregister(h);
            log!(Debug, "flow unregistered from justitiad");
        }
        if let Some(class) = want {
            let h = self.client.register(class, group.qps, 0);
            self.flow = Some((h, class));
            self.reported_active = None;
            self.remote_sent = None;
            log!(Debug, "flow of class {class} registering with justitiad");
        }
    }

    /// Tells the daemon where the flow goes once it is registered, and again when that
    /// changes (another peer, or its first READ).
    fn report_remote(&mut self) {
        let (Some((h, _)), true) = (self.flow, self.connected) else {
            return;
        };
        let Some(now) = crate::remote::snapshot() else {
            return;
        };
        if self.remote_sent == Some(now) {
            return;
        }
        let (end, reads) = now;
        if self
            .client
            .report_remote(h, end.gid, end.lid, end.qpn, reads)
        {
            self.remote_sent = Some(now);
        }
    }

    /// With side channels: takes the side channels the daemon found, withdraws the
    /// pairings of queue pairs gone, and reports those due (opening their port's side
    /// channel first), at most [`PAIRINGS_PER_TICK`] a tick. What the socket does not take
    /// now stays due for the next tick.
    fn report_pairings(&mut self, now_ns: u64) {
        let Some(sides) = self.sides.clone() else {
            return;
        };
        let (Some((h, _)), true) = (self.flow, self.connected) else {
            return;
        };
        let FlowState::Registered { flow, .. } = self.client.state(h) else {
            return;
        };
        // Said once the record's lock is released (the verb hooks take it), at most
        // NOTICES_SAID lines a tick.
        let mut said = Vec::new();
        let due = {
            let mut record = pairing::record();
            if self.paired_under != Some(flow) {
                record.registered_again();
                self.paired_under = Some(flow);
            }
            while let Some(p) = self.client.take_paired() {
                let peer = PeerSide {
                    qpn: p.side_qpn,
                    qkey: p.side_qkey,
                };
                if p.flow == flow
                    && record.paired(p.local_qpn, peer)
                    && said.len() < pairing::NOTICES_SAID
                {
                    said.push(format!(
                        "queue pair {:#x} paired with the side channel {:#x} at its other end ({} ms after its report)",
                        p.local_qpn,
                        p.side_qpn,
                        record.since_report_ns(p.local_qpn, now_ns).unwrap_or(0) / 1_000_000
                    ));
                }
            }
            let sent = record
                .withdrawals()
                .iter()
                .take_while(|&&qpn| self.client.withdraw_pairing(h, qpn))
                .count();
            record.withdrawn(sent);
            record.due(PAIRINGS_PER_TICK)
        };
        for line in said {
            log!(Debug, "{line}");
        }
        // Opening a side channel makes verbs objects: not under the record's lock, which
        // the verb hooks take.
        for c in due {
            let opened = sides.lock().open(&c.port);
            match opened {
                Ok(side) => {
                    let report = QpPairing {
                        flow: 0,
                        local_qpn: c.qpn,
                        remote_gid: c.end.gid,
                        remote_lid: c.end.lid,
                        remote_qpn: c.end.qpn,
                        side_qpn: side.qpn,
                        side_qkey: side.qkey,
                    };
                    if !self.client.report_pairing(h, report) {
                        pairing::record().due_again();
                        break;
                    }
                    pairing::record().reported(&c, now_ns);
                }
                Err(_) => pairing::record().no_side_channel(&c),
            }
        }
    }

    /// Says when the daemon appears, goes, comes back, or (asked for) is not there. A
    /// heartbeat gone stale on an open connection is a slow daemon, not a gone one: the
    /// allotment is not used meanwhile (static settings), nothing registers again, and it
    /// is said once per process (later periods at debug level), so a daemon that is slow
    /// now and then does not fill every application's stderr.
    fn track_connection(&mut self) {
        let open = self.client.has_connection();
        let connected = self.client.is_connected();
        let path = self.path.display();
        match (self.open, open) {
            (false, true) => {
                self.reported_active = None;
                self.remote_sent = None;
                if self.client.stats().connections <= 1 && self.fallbacks == 0 {
                    log!(Info, "following justitiad at {path}");
                } else {
                    log!(
                        Warn,
                        "justitiad at {path} is back; the flow registers again and follows it"
                    );
                }
            }
            (true, false) => {
                self.fallbacks += 1;
                log!(
                    Warn,
                    "justitiad at {path} is gone; static settings ({}) until it returns",
                    self.fallback_name()
                );
            }
            (true, true) if self.connected && !connected => {
                self.stale_periods += 1;
                if self.stale_periods == 1 {
                    log!(
                        Warn,
                        "justitiad at {path} is slow (its heartbeat is older than its limit); static settings ({}) while it is, said once",
                        self.fallback_name()
                    );
                } else {
                    log!(Debug, "justitiad at {path} is slow again; static settings");
                }
            }
            (true, true) if !self.connected && connected => {
                log!(Debug, "justitiad at {path} is fresh again; following it");
            }
            (false, false) if self.flow.is_some() && !self.said_missing => {
                self.said_missing = true;
                if let Some(ClientError::Block {
                    source: BlockError::Version { found, known },
                    ..
                }) = self.client.last_error()
                {
                    // A daemon is there but newer or older than this shaper: following it
                    // would misread its allotments, so say so whatever JUSTITIA_DAEMON is.
                    log!(
                        Warn,
                        "justitiad at {path} publishes control block layout {found}, this shaper reads {known}; static settings"
                    );
                } else if self.explicit {
                    log!(
                        Warn,
                        "no justitiad answers at {path}; static settings until one does"
                    );
                } else {
                    log!(Debug, "no justitiad at {path}; static settings");
                }
            }
            _ => {}
        }
        self.open = open;
        self.connected = connected;
    }

    /// The static settings in words, for the logs.
    fn fallback_name(&self) -> String {
        match self.static_rate {
            Some(r) => format!("JUSTITIA_RATE {} B/s", r.bytes_per_sec),
            None => "unpaced".to_string(),
        }
    }

    /// Whether the flow has work at this tick: a post, a chunk, a waiting request or a
    /// request at the NIC in the last [`IDLE_TICKS`] ticks. Counts what was posted since
    /// the last report.
    ///
    /// Posts alone do not tell: an application with a full send queue posts only as
    /// completions free it, so on a slow link (a 64 KiB READ takes 6.5 ms at the 10 MB/s
    /// of an emulated cable) two ticks pass between posts while its queue is full, and a
    /// flow busy all along was reported idle and active again every few milliseconds.
    fn has_work(&mut self, group: Group) -> bool {
        let (requests, chunks, bytes) = (group.requests, group.chunks, group.bytes);
        let moved = requests != self.seen.0 || chunks != self.seen.1;
        self.unreported.0 = self
            .unreported
            .0
            .saturating_add(bytes.wrapping_sub(self.seen.2));
        self.unreported.1 = self
            .unreported
            .1
            .saturating_add(requests.wrapping_sub(self.seen.0));
        self.seen = (requests, chunks, bytes);
        self.quiet_ticks = if moved || group.waiting || group.in_flight {
            0
        } else {
            self.quiet_ticks.saturating_add(1)
        };
        let idle_after = if group.class == Some(FlowClass::Latency) {
            LATENCY_IDLE_TICKS
        } else {
            IDLE_TICKS
        };
        self.quiet_ticks < idle_after
    }

    /// Tells the daemon whether the flow has work ([`Self::has_work`]) and what it posted,
    /// when that changes and every [`REPORT_EVERY_NS`] while active.
    fn report(&mut self, now_ns: u64, group: Group) {
        let active = self.has_work(group);
        let Some((h, _)) = self.flow else { return };
        if !matches!(self.client.state(h), FlowState::Registered { .. }) {
            self.reported_active = None;
            return;
        }
        let due = match self.reported_active {
            Some(was) => was != active || (active && now_ns >= self.next_report_ns()),
            None => true,
        };
        if due
            && self
                .client
                .report_usage(h, active, self.unreported.0, self.unreported.1)
        {
            self.unreported = (0, 0);
            self.reported_active = Some(active);
            self.last_report_ns = now_ns;
        }
    }

    fn next_report_ns(&self) -> u64 {
        self.last_report_ns.saturating_add(REPORT_EVERY_NS)
    }
}

/// Waits up to `timeout` for the daemon's socket to have something to read or to hang
/// up, so that a daemon that dies is seen as soon as the kernel closes its end, not at the
/// next period.
pub fn wait_on(sock: &std::os::fd::OwnedFd, timeout: Duration) {
    use std::os::fd::AsRawFd;
    let mut fds = [libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    let ms = c_int_ms(timeout);
    // SAFETY: one valid pollfd for the call; an error or EINTR only ends the wait early.
    unsafe { libc::poll(fds.as_mut_ptr(), 1, ms) };
}

/// `timeout` in whole milliseconds, rounded up, for `poll(2)`.
fn c_int_ms(timeout: Duration) -> libc::c_int {
    libc::c_int::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn group(qps: u32) -> Group {
        Group {
            class: Some(FlowClass::Bandwidth),
            qps,
            requests: 0,
            chunks: 0,
            bytes: 0,
            split_requests: 0,
            waiting: false,
            control_verbs: ControlVerbCounts::default(),
            control_seen: false,
            in_flight: false,
            turns: TurnCounts::default(),
            round_trips: None,
        }
    }

    /// A follower whose daemon socket does not exist, on the static settings.
    fn follower_without_daemon() -> Follower {
        let config = Config {
            socket: std::env::temp_dir().join("justitia-none.sock"),
            ..Config::default()
        };
        let fallback = Settings {
            rate: None,
            chunk_bytes: 5120,
            phase: None,
            control: None,
            turns: None,
            charge: MessageCharge::NONE,
            time_round_trips: false,
        };
        Follower::new(&config, fallback, None).unwrap()
    }

    /// A flow whose send queue stays full posts only when a completion frees a slot; on a
    /// slow link ticks pass between posts, yet the flow has work all along: it must stay
    /// active while requests are at the NIC, and go idle two ticks after the last one
    /// completes.
    #[test]
    fn a_flow_with_requests_at_the_nic_stays_active_between_posts() {
        let mut f = follower_without_daemon();
        let mut g = Group {
            requests: 128,
            in_flight: true,
            ..group(1)
        };
        assert!(f.has_work(g), "128 posts");
        // 6.5 ms between completions (and so posts): three ticks of 2 ms without a post.
        let mut seen = Vec::new();
        for tick in 0..30 {
            if tick % 3 == 2 {
                g.requests += 1;
            }
            seen.push(f.has_work(g));
        }
        assert!(
            seen.iter().all(|&a| a),
            "reported idle between posts: {seen:?}"
        );
        g.in_flight = false;
        assert!(f.has_work(g), "one tick after the last completion");
        assert!(!f.has_work(g), "two ticks after: idle");
    }

    /// A latency flow that pings every 20 ms (a round trip on a slow path) has nothing at
    /// the NIC for 9 ticks of 10 between its messages: it stays active throughout, and goes
    /// idle 100 ticks (200 ms) after its last message, where a bandwidth flow goes idle
    /// after two.
    #[test]
    fn a_latency_flow_stays_active_between_sparse_messages() {
        let mut f = follower_without_daemon();
        let mut g = Group {
            class: Some(FlowClass::Latency),
            requests: 1,
            ..group(1)
        };
        let mut seen = Vec::new();
        for tick in 0..100 {
            if tick % 10 == 0 {
                g.requests += 1;
            }
            seen.push(f.has_work(g));
        }
        assert!(
            seen.iter().all(|&a| a),
            "reported idle between messages: {seen:?}"
        );
        // The last message at tick 90: quiet for 99 more ticks is still active.
        for _ in 0..90 {
            assert!(f.has_work(g));
        }
        assert!(!f.has_work(g), "idle 100 ticks after its last message");
        let mut bw = follower_without_daemon();
        let mut b = group(1);
        b.requests = 1;
        assert!(bw.has_work(b));
        assert!(bw.has_work(b), "one quiet tick");
        assert!(!bw.has_work(b), "a bandwidth flow is idle after two");
    }

    /// Without a daemon the follower's thread wakes at the client's connection attempts,
    /// whose backoff doubles from 10 ms to 1 s, not every follow period: a shaped process
    /// on a host without a daemon should cost the host about one wake-up a second.
    #[test]
    fn without_a_daemon_the_follower_sleeps_until_the_next_connection_attempt() {
        let dir = std::env::temp_dir().join(format!("justitia-none-{}", std::process::id()));
        let config = Config {
            socket: dir.join("missing.sock"),
            ..Config::default()
        };
        let fallback = Settings {
            rate: None,
            chunk_bytes: 5120,
            phase: None,
            control: None,
            turns: None,
            charge: MessageCharge::NONE,
            time_round_trips: false,
        };
        let mut f = Follower::new(&config, fallback, None).unwrap();
        // Nothing to follow before a QP exists.
        assert_eq!(f.tick(1_000_000_000, group(0)), fallback);
        assert_eq!(f.sleep_after(1_000_000_000), None);
        let mut now = 2_000_000_000u64;
        let mut sleeps = Vec::new();
        for _ in 0..10 {
            assert_eq!(f.tick(now, group(1)), fallback);
            let sleep = f.sleep_after(now).unwrap();
            sleeps.push(sleep);
            now += u64::try_from(sleep.as_nanos()).unwrap();
        }
        assert_eq!(sleeps[0], Duration::from_millis(10), "{sleeps:?}");
        assert_eq!(sleeps[1], Duration::from_millis(20), "{sleeps:?}");
        assert_eq!(sleeps[9], Duration::from_secs(1), "{sleeps:?}");
        assert!(!f.status().connected && f.status().connections == 0);
    }
}
