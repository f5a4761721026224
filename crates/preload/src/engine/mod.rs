//! The shaper's state for each device context, queue pair and completion queue, the shaped
//! post and poll paths, and the pacer. The completion queue's state and its polls are
//! [`cq`]'s, the queue pair's state and its posts [`qp`]'s, the pacer's queue and thread
//! [`pacer`]'s (each states the locks it takes, and in what order); the engine (settings,
//! counters, the rate pacer, following the daemon), the device contexts and the registries
//! are here.
//!
//! Locks, in the order they are taken (a lock is never taken while a later one is held):
//! a CQ's poll lock (`CqShared::qps`); a QP's state lock (`QpShared::state`, held
//! across the provider's post, never across a poll of the provider's CQ, and under a poll
//! lock only tried, never waited for); the rate gate's pacer lock ([`RateGate`]); the
//! QPs' turns (`turns`), the pacer's queue lock and the CQ's held completions, leaves. A
//! verb never waits for a QP's lock held by another thread for another object (see the
//! crate's README, "Locks"):
//! polls and the shaper's own polls in destroy and reset try it (`QpShared::drain_or_defer`).
//! Threads (the pacer, the follower) are started with none of the first two held.
//!
//! An [`Engine`] holds one process's settings, clock, counters and rate pacer. In the
//! preloaded library there is one, made from the environment on first use; tests make
//! their own with a virtual clock and a manual pacer. Device contexts are attached to an
//! engine ([`attach_context`], which saves the provider's function pointers); QPs and CQs
//! are registered as they are created. This module never names a hook: which functions
//! replace the provider's, and where, is [`crate::install`]'s business. The state of every
//! object lives in lock-free maps keyed by the object's address, so the pass-through path
//! costs one lookup. A lookup borrows the state without a reference count; that is sound
//! because only the application's own calls on an object borrow it that way, and verbs
//! forbid destroying an object while another call uses it. Everything else that reaches
//! an object's state from elsewhere (the pacer, another CQ's poll, a completion channel)
//! holds an `Arc`. So the state of a destroyed QP or CQ is freed at its destroy call: a
//! long-running rdma_cm server, whose contexts are never closed, keeps no state (and no
//! descriptor) per connection it has dropped.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use justitia_core::classifier::ClassifierConfig;
use justitia_core::control_verbs::{ControlVerb, ControlVerbPacer};
use justitia_core::flow::FlowClass;
use justitia_core::message_charge::MessageCharge;
use justitia_core::pacer::{PaceRate, Pacer as RatePacer, ReleasePhase};
use justitia_core::queue_turns::TurnBudget;
use justitia_core::yield_plan::YieldPlanner;
use justitia_verbs::sys::*;

use crate::clock::Clock;
use crate::config::{ClassSetting, Config, DaemonSetting, Policy};
use crate::follow::{FollowStatus, Follower, Group, Settings, TurnCounts};
use crate::log::log;
use crate::registry::PtrMap;
use crate::round_trips::RoundTrips;

pub mod channels;
pub mod cq;
pub mod ex_state;
pub mod pacer;
pub mod qp;
mod turns;
pub mod two_sided;
use crate::send_queue::{FastLane, RateGate, Treatment};
use crate::stats::{Counters, StatsSnapshot};
pub(crate) use cq::{cq, note_touched, Held};
pub use cq::{cq_token, destroy_cq, register_cq, unregister_cq, CqQps, CqShared};
use pacer::{Pacer, PacerQueue, IDLE_SLEEP};
pub use pacer::{PacerMode, RELEASE_WINDOW};
#[cfg(test)]
pub(crate) use qp::fault;
pub use qp::{
    destroy_qp, qp_token, register_qp, shapable_send_ops, unregister_qp, QpInit, QpShared, QpState,
};
pub(crate) use qp::{qp, qp_fast, register_qp_in, Settled};

/// `ibv_context.ops.post_send`.
pub type PostSendFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
/// `ibv_context.ops.post_recv`.
pub type PostRecvFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
/// `ibv_context.ops.poll_cq`.
pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
/// `ibv_context.ops.req_notify_cq`.
pub type ReqNotifyFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
/// `verbs_context.create_qp_ex`.
pub type CreateQpExFn =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_qp_init_attr_ex) -> *mut ibv_qp;
/// `verbs_context.create_cq_ex`.
pub type CreateCqExFn =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex;

/// Attached device contexts.
pub(crate) static CONTEXTS: PtrMap<CtxShared, 256> = PtrMap::new();
/// Registered queue pairs.
pub(crate) static QPS: PtrMap<QpShared, 16384> = PtrMap::new();
/// What one shaped QP adds to [`CqShared`]'s work count (synthesized completions add 1).
const SHAPED_QP: u64 = 1 << 32;

/// Registered completion queues.
pub(crate) static CQS: PtrMap<CqShared, 4096> = PtrMap::new();

/// In a child forked after the shaper started, every call passes through (see
/// [`crate::ffi`]). The verbs most called find that out from the state they look up
/// anyway, instead of asking [`crate::ffi::in_forked_child`] every time: at the fork, the
/// child marks every registered QP's posts and every registered CQ's polls as passing
/// through. (Nothing registers in a child, and nothing there undoes the marks: the verbs
/// that would pass through.)
extern "C" fn pass_through_in_child() {
    // SAFETY: the child's only thread runs this, so no value is freed meanwhile.
    unsafe {
        QPS.for_each(|q| q.posts_shaped.store(false, Ordering::Relaxed));
        CQS.for_each(|c| c.work.store(0, Ordering::Relaxed));
    }
}

/// Registers [`pass_through_in_child`] (once per process).
fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a handler that only stores to atomics of live state.
        unsafe { libc::pthread_atfork(None, None, Some(pass_through_in_child)) };
    });
}

/// `JUSTITIA_RATE` in the core pacer's terms: whole bytes and operations per second
/// (rounded; the configuration admits nothing below 1000 B/s and 1 op/s), and the
/// configured chunk, which sets the burst (two chunks, or [`RELEASE_WINDOW`] at the rate if
/// more).
pub fn pace_rate(rate: crate::config::Rate, chunk_bytes: u32) -> PaceRate {
    // `as` saturates: a rate past u64::MAX units/s is as good as unpaced.
    let whole = |per_sec: f64| (per_sec.round() as u64).max(1);
    PaceRate {
        bytes_per_sec: whole(rate.bytes_per_sec),
        ops_per_sec: rate.ops_per_sec.map(whole),
        chunk_bytes,
    }
}

fn nanos(t: Duration) -> u64 {
    u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)
}

/// The rate and release phase the rate pacer was last given. Invariant: `rate` is the
/// pacer's rate (also while unpaced, when nothing asks the pacer).
#[derive(Clone, Copy, Debug)]
struct AppliedPacing {
    rate: PaceRate,
    /// `None`: set without a phase, so only a new epoch from the daemon moves the flow.
    phase: Option<ReleasePhase>,
}

/// One process's shaper: settings, clock, counters, rate pacer and pacer queue.
pub struct Engine {
    config: Config,
    clock: Arc<dyn Clock>,
    counters: Counters,
    /// The enforcement algorithm the simulator uses too: one per process, shared by every
    /// paced QP (see [`pace_rate`]), asked only while [`Self::paced`] is set. Its rate is
    /// `JUSTITIA_RATE`, or the daemon's allotment. Behind a gate whose allowance lets the
    /// fast lane release paced requests without its lock or the clock.
    rate: RateGate,
    /// What [`Self::rate`] was last given: a copy kept outside the gate, so that settings
    /// that change nothing (most of the follower's ticks) and reports of them leave the
    /// gate alone; locking it takes back the allowance of the lock-free fast lane, whose
    /// next paced post would then take the slow path. Touched only where settings are
    /// applied or reported, never on a verb.
    applied: Mutex<AppliedPacing>,
    /// Requests of paced classes take tokens from [`Self::rate`].
    paced: AtomicBool,
    /// The chunk size in effect: `JUSTITIA_CHUNK`, or the daemon's.
    chunk_bytes: AtomicU32,
    /// Bumped after every change of [`Self::paced`] or [`Self::chunk_bytes`], so that a QP
    /// derives its [`FastLane`] again at its next post.
    settings_epoch: AtomicU32,
    planner: YieldPlanner,
    classifier: ClassifierConfig,
    pacer: Pacer,
    /// RC QPs alive on an engine with a class set: the flow the daemon knows.
    members: AtomicU32,
    /// The same QPs (weak: each leaves at its destroy), to see whether any has requests at
    /// the NIC ([`Group::in_flight`]).
    member_qps: Mutex<Vec<Weak<QpShared>>>,
    /// With `JUSTITIA_CLASS=auto`: 1 + the most resource-hungry class the classifier has
    /// given a QP (0: none yet).
    auto_class: AtomicU8,
    /// The daemon's side, `None` with `JUSTITIA_DAEMON=off`.
    follower: Option<Mutex<Follower>>,
    /// The follower thread and the process that started it (a forked child passes
    /// through and starts none).
    follow_thread: Mutex<Option<(u32, std::thread::Thread)>>,
    /// When each control verb may go ([`Self::before_control_verb`]): its budget is
    /// `JUSTITIA_CONTROL_RATE`, or the daemon's share for the process. Its lock is a leaf,
    /// held only to decide, never while waiting.
    control: parking_lot::Mutex<ControlVerbPacer>,
    /// A control verb was issued: the follower thread runs (to connect and learn the
    /// daemon's budget) even without a flow.
    control_seen: AtomicBool,
    /// The follower has ticked at least once (connected and read the daemon's budget, or
    /// found no daemon); the first control verb waits for it ([`FIRST_TICK_WAIT`]).
    ticked: Mutex<bool>,
    /// Signalled with [`Self::ticked`].
    ticked_cv: Condvar,
    /// Which shaped QPs may post now: `JUSTITIA_QP_TURNS`, or the daemon's share for the
    /// process, the fewer of the two (none: all of them).
    turns: turns::Turns,
    /// The round trips of a latency-class process that may follow a daemon, which its
    /// observed RC QPs time (through the timing hooks) and the follower reports (`None`
    /// in any other process).
    round_trips: Option<Arc<RoundTrips>>,
    /// Splitting two-sided requests: the side channels and the QPs with a half, with
    /// `JUSTITIA_TWO_SIDED=split` under a daemon (`None` otherwise).
    side: Option<two_sided::SideLink>,
}

/// How long the process's first control verb waits for the follower's first tick, so that
/// a storm starting at once is paced by the daemon's budget from its first verbs: the
/// tick's connection attempt waits at most its greeting timeout (100 ms) for a daemon that
/// accepts and does not answer, and fails at once without one.
const FIRST_TICK_WAIT: Duration = Duration::from_millis(250);

impl Engine {
    /// An engine with `config`, reading time from `clock`.
    pub fn new(config: Config, clock: Arc<dyn Clock>, pacer: PacerMode) -> Arc<Engine> {
        crate::ffi::watch_forks();
        watch_forks();
        let now = clock.now();
        let planner = YieldPlanner::new(config.yields).unwrap_or_default();
        let fallback = Settings {
            rate: config.rate.map(|r| pace_rate(r, config.chunk_bytes)),
            chunk_bytes: config.chunk_bytes,
            phase: None,
            control: config.control_rate,
            turns: config.qp_turns,
            charge: MessageCharge::NONE,
            time_round_trips: false,
        };
        let sides: Option<crate::side_channel::SharedSideChannels> = (config.two_sided
            == crate::config::TwoSided::Split
            && config.daemon != DaemonSetting::Off)
            .then(|| {
                crate::pairing::enable();
                Arc::new(parking_lot::Mutex::new(Box::new(
                    crate::side_channel::VerbsSideChannels::new(),
                )
                    as Box<dyn crate::side_channel::SideChannels>))
            });
        // Unpaced, the pacer holds a paused rate that nothing asks.
        let initial = fallback.rate.unwrap_or(PaceRate {
            bytes_per_sec: 0,
            ops_per_sec: None,
            chunk_bytes: config.chunk_bytes,
        });
        Arc::new(Engine {
            rate: RateGate::new(RatePacer::with_burst_window(initial, RELEASE_WINDOW, now)),
            applied: Mutex::new(AppliedPacing {
                rate: initial,
                phase: None,
            }),
            paced: AtomicBool::new(fallback.rate.is_some()),
            chunk_bytes: AtomicU32::new(config.chunk_bytes),
            settings_epoch: AtomicU32::new(0),
            members: AtomicU32::new(0),
            member_qps: Mutex::new(Vec::new()),
            auto_class: AtomicU8::new(0),
            follower: Follower::new(&config, fallback, sides.clone()).map(Mutex::new),
            side: sides.map(two_sided::SideLink::new),
            follow_thread: Mutex::new(None),
            control: parking_lot::Mutex::new(ControlVerbPacer::new(config.control_rate)),
            control_seen: AtomicBool::new(false),
            ticked: Mutex::new(false),
            ticked_cv: Condvar::new(),
            turns: turns::Turns::new(config.qp_turns),
            round_trips: (config.class == Some(ClassSetting::Fixed(FlowClass::Latency))
                && config.daemon != DaemonSetting::Off)
                .then(|| Arc::new(RoundTrips::new())),
            planner,
            classifier: ClassifierConfig::default(),
            pacer: Pacer {
                mode: pacer,
                queue: Mutex::new(PacerQueue::default()),
                wake: Condvar::new(),
                next_due_ns: AtomicU64::new(u64::MAX),
                thread_pid: Mutex::new(None),
            },
            config,
            clock,
            counters: Counters::default(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The live counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The counters now, with the control-verb pacer's.
    pub fn stats(&self) -> StatsSnapshot {
        let control = self.control.lock().counts();
        StatsSnapshot {
            control_verbs: control.admitted,
            control_verbs_delayed: control.delayed,
            control_wait_ns: u64::try_from(control.waited.as_nanos()).unwrap_or(u64::MAX),
            ..self.counters.snapshot()
        }
    }

    /// The current time of the engine's clock.
    pub fn now(&self) -> Duration {
        self.clock.now()
    }

    /// Requests of paced classes take tokens from the rate pacer now.
    #[inline(always)]
    fn paced(&self) -> bool {
        self.paced.load(Ordering::Relaxed)
    }

    /// The chunk size in effect.
    #[inline(always)]
    fn chunk_bytes(&self) -> u32 {
        self.chunk_bytes.load(Ordering::Relaxed)
    }

    /// The round trips this process times for the daemon: a latency-class process that
    /// may follow one (see [`crate::round_trips`]).
    #[inline(always)]
    pub fn round_trips(&self) -> Option<&RoundTrips> {
        self.round_trips.as_deref()
    }

    /// The settings in effect: the pacer's rate (`None`: unpaced), the chunk size, and the
    /// release phase the pacer was given last (`None` on static settings).
    pub fn settings(&self) -> Settings {
        let applied = *self.applied();
        Settings {
            rate: self.paced().then_some(applied.rate),
            chunk_bytes: self.chunk_bytes(),
            phase: applied.phase,
            control: self.control.lock().budget(),
            turns: self.turns.budget(),
            charge: self.rate.charge(),
            time_round_trips: self.round_trips.as_ref().is_some_and(|r| r.wanted()),
        }
    }

    fn applied(&self) -> MutexGuard<'_, AppliedPacing> {
        self.applied.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn rate_pacer(&self) -> parking_lot::MutexGuard<'_, RatePacer> {
        self.rate.lock()
    }

    /// Puts `settings` in effect at `now`: the pacer takes the new rate (what accrued so
    /// far accrues at the old one, see [`RatePacer::set_rate`]), QPs derive their fast
    /// lanes again, and every QP waiting for tokens is drained now, so that a request held
    /// under the old rate goes when the new one allows. Nothing happens when nothing changed.
    pub fn apply(self: &Arc<Self>, settings: Settings, now: Duration) {
        {
            let mut control = self.control.lock();
            if control.budget() != settings.control {
                log!(
                    Debug,
                    "control verbs {}",
                    settings.control.map_or_else(
                        || "unpaced".to_string(),
                        |b| format!("at {:.3}/s, burst {}", b.per_sec, b.burst)
                    )
                );
                control.set_budget(settings.control);
            }
        }
        if let Some(r) = &self.round_trips {
            r.set_wanted(settings.time_round_trips);
        }
        let mut changed = self.apply_turns(settings.turns, now);
        match settings.rate {
            Some(r) => {
                // Lock order: the record, then the gate.
                let mut applied = self.applied();
                // A new epoch moves the flow even at an unchanged rate: the set of flows
                // sharing the NIC changed, and with it this flow's place among them.
                let rephase = settings
                    .phase
                    .is_some_and(|p| applied.phase.map(|a| a.epoch) != Some(p.epoch));
                if !self.paced() || applied.rate != r || rephase {
                    let mut pacer = self.rate_pacer();
                    match settings.phase {
                        Some(phase) => pacer.set_rate_in_phase(now, r, phase),
                        None => pacer.set_rate(now, r),
                    }
                    applied.rate = r;
                    self.paced.store(true, Ordering::Relaxed);
                    changed = true;
                }
                applied.phase = settings.phase;
            }
            None => {
                self.applied().phase = None;
                changed |= self.paced.swap(false, Ordering::Relaxed);
            }
        }
        changed |= self
            .chunk_bytes
            .swap(settings.chunk_bytes, Ordering::Relaxed)
            != settings.chunk_bytes;
        if self.rate.charge() != settings.charge {
            self.rate.set_charge(settings.charge);
            changed = true;
        }
        if !changed {
            return;
        }
        self.settings_epoch.fetch_add(1, Ordering::Release);
        log!(
            Debug,
            "pacing {}, chunk {} B",
            settings.rate.map_or_else(
                || "off".to_string(),
                |r| format!("at {} B/s", r.bytes_per_sec)
            ),
            settings.chunk_bytes
        );
        let waiting: Vec<Arc<QpShared>> = self
            .pacer_queue()
            .waiting
            .iter()
            .map(|(qp, _)| Arc::clone(qp))
            .collect();
        for qp in waiting {
            qp.drain(now);
        }
    }

    /// Puts the QP turns `budget` in force (see [`turns`]), waking the QPs it lets in;
    /// returns whether turns began or ended, which the QPs' fast lanes depend on.
    fn apply_turns(self: &Arc<Self>, budget: Option<TurnBudget>, now: Duration) -> bool {
        if self.turns.budget() == budget {
            return false;
        }
        log!(
            Debug,
            "QP turns {}",
            budget.map_or_else(
                || "off".to_string(),
                |b| format!("{} at once, {} B a turn", b.open, b.turn_bytes)
            )
        );
        let was = self.turns.in_force();
        for qp in self.turns.set_budget(budget) {
            self.schedule(qp, now, now);
        }
        was != budget.is_some()
    }

    /// The process's QPs as the daemon's flow.
    fn group(&self) -> Group {
        let class = match self.config.class {
            None => None,
            Some(ClassSetting::Fixed(c)) => Some(c),
            Some(ClassSetting::Auto) => match self.auto_class.load(Ordering::Relaxed) {
                0 => None,
                n => FlowClass::ALL.get(usize::from(n - 1)).copied(),
            },
        };
        let c = &self.counters;
        Group {
            class,
            qps: self.members.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            chunks: c.chunks.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            split_requests: c.split_requests.load(Ordering::Relaxed),
            waiting: self.pacer_has_waiting(),
            control_verbs: self.control.lock().counts(),
            control_seen: self.control_seen.load(Ordering::Relaxed),
            in_flight: self.members_in_flight(),
            turns: TurnCounts {
                waits: c.turn_waits.load(Ordering::Relaxed),
                yields: c.turn_yields.load(Ordering::Relaxed),
            },
            round_trips: self.round_trips.as_ref().and_then(|r| r.take()),
        }
    }

    /// Whether a member QP has requests posted and not completed. A QP whose lock is held
    /// now is being posted to or polled: busy as well, and not waited for.
    fn members_in_flight(&self) -> bool {
        let qps = self.member_qps.lock().unwrap_or_else(|e| e.into_inner());
        qps.iter()
            .filter_map(Weak::upgrade)
            .any(|q| q.state.try_lock().is_none_or(|st| st.sq.outstanding() > 0))
    }

    /// One step of following the daemon at `now_ns` (`CLOCK_MONOTONIC`), and the settings
    /// it asks for put in effect. The follower thread calls it (every
    /// [`FOLLOW_PERIOD`](crate::follow::FOLLOW_PERIOD) while a daemon is connected); tests
    /// with a manual pacer may call it themselves. Never called from a verb: a connection
    /// attempt may wait for the daemon's greeting.
    pub fn follow_tick(self: &Arc<Self>, now_ns: u64) {
        let Some(follower) = &self.follower else {
            return;
        };
        if let Some(r) = &self.round_trips {
            r.give_up_stale(now_ns);
        }
        let group = self.group();
        let (settings, status) = {
            let mut f = follower.lock().unwrap_or_else(|e| e.into_inner());
            let settings = f.tick(now_ns, group);
            (settings, f.status())
        };
        // Published where the statistics read them without the follower's lock, which the
        // exit handler that writes them must never wait for.
        self.counters.note_follow(&status);
        if status.side_channels > 0 {
            self.start_side_thread();
        }
        self.apply(settings, self.clock.now());
        let mut ticked = self.ticked.lock().unwrap_or_else(|e| e.into_inner());
        if !*ticked {
            *ticked = true;
            self.ticked_cv.notify_all();
        }
    }

    /// The follower's lock, held: a test stands in for a follower thread stuck in a
    /// connection attempt (its lock held for as long as the test likes).
    #[cfg(test)]
    pub(crate) fn hold_follower(&self) -> Option<MutexGuard<'_, Follower>> {
        self.follower
            .as_ref()
            .map(|f| f.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Where following the daemon stands; `None` with `JUSTITIA_DAEMON=off`.
    pub fn follow_status(&self) -> Option<FollowStatus> {
        self.follower
            .as_ref()
            .map(|f| f.lock().unwrap_or_else(|e| e.into_inner()).status())
    }

    /// A control verb (`verb`) is about to be issued: waits for the process's turn under
    /// its control-verb budget, if any (see [`justitia_core::control_verbs`]), and counts
    /// it. The first one starts the follower thread, which connects to the daemon to learn
    /// the budget and report the counts, and waits for its first tick (at most 250 ms), so
    /// that it already goes at the daemon's budget. The wait is a sleep of the calling
    /// thread: control verbs block anyway, and an application issuing them from several
    /// threads gets one turn per thread, in order.
    pub fn before_control_verb(self: &Arc<Self>, verb: ControlVerb) {
        if !self.control_seen.swap(true, Ordering::Relaxed) {
            log!(Debug, "first control verb ({verb:?}) of the process");
            self.wake_follower();
            self.await_first_tick();
        }
        let wait = self.control.lock().admit(self.clock.now()).wait;
        if !wait.is_zero() {
            self.clock.sleep(wait);
        }
    }

    /// Waits up to [`FIRST_TICK_WAIT`] for the follower thread's first tick; at once
    /// without a follower thread.
    fn await_first_tick(&self) {
        if self.follower.is_none() || self.pacer.mode != PacerMode::Thread {
            return;
        }
        let deadline = std::time::Instant::now() + FIRST_TICK_WAIT;
        let mut ticked = self.ticked.lock().unwrap_or_else(|e| e.into_inner());
        while !*ticked {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return;
            }
            ticked = self
                .ticked_cv
                .wait_timeout(ticked, left)
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// A QP joined or left the daemon's flow: the follower thread registers or unregisters
    /// it at once instead of at its next tick.
    fn members_changed(self: &Arc<Self>, qp: &Weak<QpShared>, joined: bool) {
        {
            let mut qps = self.member_qps.lock().unwrap_or_else(|e| e.into_inner());
            qps.retain(|q| !q.ptr_eq(qp) && q.strong_count() > 0);
            if joined {
                qps.push(qp.clone());
            }
        }
        if joined {
            self.members.fetch_add(1, Ordering::Relaxed);
        } else {
            self.members.fetch_sub(1, Ordering::Relaxed);
        }
        self.wake_follower();
    }

    /// Starts the follower thread, or wakes it for a tick now.
    fn wake_follower(self: &Arc<Self>) {
        if self.follower.is_none() || self.pacer.mode != PacerMode::Thread {
            return;
        }
        let pid = std::process::id();
        let mut thread = self.follow_thread.lock().unwrap_or_else(|e| e.into_inner());
        match &*thread {
            Some((started, t)) if *started == pid => t.unpark(),
            _ => {
                let engine = Arc::downgrade(self);
                let spawned = std::thread::Builder::new()
                    .name("justitia-follow".into())
                    .spawn(move || follow_loop(engine));
                match spawned {
                    Ok(handle) => *thread = Some((pid, handle.thread().clone())),
                    Err(e) => log!(
                        Warn,
                        "cannot start the thread that follows justitiad ({e}); static settings"
                    ),
                }
            }
        }
    }

    /// True when some QP of this process may be shaped: its class shapes RC QPs. When it
    /// does not, no QP's completion ever carries the shaper's tag and no completion is
    /// ever held or synthesized, so a poll has nothing to translate.
    pub(crate) fn shapes_any(&self) -> bool {
        self.shapes(IBV_QPT_RC)
    }

    /// Whether a shaped QP's two-sided requests may be split: its class may be bandwidth
    /// (fixed, or the automatic class) under a policy that splits.
    fn may_split_sends(&self) -> bool {
        matches!(
            self.config.class,
            Some(ClassSetting::Auto) | Some(ClassSetting::Fixed(FlowClass::Bandwidth))
        ) && matches!(self.config.policy, Policy::Justitia | Policy::Adaptive)
    }

    /// Whether a new QP of `qp_type` is shaped (else it is only observed).
    fn shapes(&self, qp_type: ibv_qp_type) -> bool {
        qp_type == IBV_QPT_RC
            && matches!(
                self.config.class,
                Some(ClassSetting::Auto)
                    | Some(ClassSetting::Fixed(
                        FlowClass::Throughput | FlowClass::Bandwidth
                    ))
            )
    }

    /// The treatment of one request of `bytes` with `opcode` on a QP.
    fn treatment(
        &self,
        state: &mut QpState,
        now: Duration,
        opcode: ibv_wr_opcode,
        bytes: u64,
    ) -> Treatment {
        let class = match (self.config.class, state.classifier.as_mut()) {
            (Some(ClassSetting::Fixed(c)), _) => c,
            (Some(ClassSetting::Auto), Some(cl)) => {
                cl.on_post(now, u32::try_from(bytes).unwrap_or(u32::MAX));
                cl.on_depth_sample(
                    now,
                    u32::try_from(state.sq.outstanding()).unwrap_or(u32::MAX),
                );
                cl.class(now)
            }
            _ => FlowClass::Latency,
        };
        if self.config.class == Some(ClassSetting::Auto) {
            self.auto_class
                .fetch_max(class as u8 + 1, Ordering::Relaxed);
        }
        let paced = self.paced();
        match class {
            FlowClass::Latency => Treatment::Whole,
            FlowClass::Throughput if paced => Treatment::WholePaced,
            FlowClass::Throughput => Treatment::Whole,
            FlowClass::Bandwidth => match self.config.policy {
                Policy::Justitia | Policy::Adaptive => Treatment::Split {
                    chunk_bytes: state.chunk_bytes_for(self.chunk_bytes(), opcode, bytes),
                    paced,
                },
                Policy::Preempt => Treatment::Preempt(self.planner),
            },
        }
    }

    /// What [`Self::treatment`] gives a small request on a QP with path MTU `path_mtu`,
    /// when that needs neither the clock nor the QP's history (a fixed class): requests up
    /// to the chunk (never below the MTU; a READ's may be larger still, which the general
    /// path then finds) or the sub-message are posted whole, paced as their class is. On a
    /// Soft-RoCE QP (`soft_roce`) a bandwidth flow posts only single-packet requests whole,
    /// as [`QpState::chunk_bytes_for`](qp::QpState::chunk_bytes_for) cuts its WRITEs.
    fn fast_lane(&self, path_mtu: u32, soft_roce: bool) -> Option<FastLane> {
        let Some(ClassSetting::Fixed(class)) = self.config.class else {
            return None;
        };
        // With turns every request is queued, so that a QP out of turn posts nothing.
        if self.turns.in_force() {
            return None;
        }
        let paced = self.paced();
        let whole = |paced| FastLane {
            whole_up_to: u64::MAX,
            paced,
        };
        Some(match class {
            FlowClass::Latency => whole(false),
            FlowClass::Throughput => whole(paced),
            FlowClass::Bandwidth => match self.config.policy {
                Policy::Justitia | Policy::Adaptive => FastLane {
                    whole_up_to: if soft_roce {
                        u64::from(path_mtu)
                    } else {
                        u64::from(self.chunk_bytes().max(path_mtu))
                    },
                    paced,
                },
                Policy::Preempt => FastLane {
                    whole_up_to: u64::from(self.planner.sub_message_bytes()),
                    paced: false,
                },
            },
        })
    }
}

/// The follower thread: ticks the follower every
/// [`FOLLOW_PERIOD`](crate::follow::FOLLOW_PERIOD) while a daemon is connected, at the
/// client's connection attempts while none is, and sleeps until a QP joins (which unparks
/// it) while there is nothing to follow. Every wake-up costs the host
/// a context switch, so a process on a host without a daemon wakes about once a second.
fn follow_loop(engine: Weak<Engine>) {
    loop {
        let Some(engine) = engine.upgrade() else {
            return;
        };
        let now_ns = justitia_agent::block::monotonic_ns();
        // A panic here loses one tick, never the thread.
        let _ =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.follow_tick(now_ns)));
        let (sleep, sock) = match &engine.follower {
            Some(f) => {
                let f = f.lock().unwrap_or_else(|e| e.into_inner());
                (
                    f.sleep_after(justitia_agent::block::monotonic_ns()),
                    f.connection(),
                )
            }
            None => (None, None),
        };
        drop(engine);
        // With nothing to follow, the engine is looked at now and then only to notice that
        // it is gone.
        let sleep = sleep.unwrap_or(IDLE_SLEEP).min(FOLLOW_LONGEST_SLEEP);
        match sock {
            // Connected: a reply or a hang-up ends the wait at once.
            Some(sock) => crate::follow::wait_on(&sock, sleep),
            None => std::thread::park_timeout(sleep),
        }
    }
}

/// The longest the follower thread sleeps: the client's longest backoff.
const FOLLOW_LONGEST_SLEEP: Duration = Duration::from_secs(1);

/// The shaper's state for one device context: the provider's own function pointers, which
/// the shaper's replace and forward to.
pub struct CtxShared {
    pub(crate) engine: Arc<Engine>,
    pub(crate) post_send: Option<PostSendFn>,
    pub(crate) post_recv: Option<PostRecvFn>,
    pub(crate) poll_cq: Option<PollCqFn>,
    pub(crate) req_notify_cq: Option<ReqNotifyFn>,
    pub(crate) create_qp_ex: Option<CreateQpExFn>,
    pub(crate) create_cq_ex: Option<CreateCqExFn>,
    /// The device is Soft-RoCE (rxe): its bandwidth flows post an RDMA WRITE one path MTU a WQE
    /// (see [`QpState::chunk_bytes_for`](qp::QpState::chunk_bytes_for)). Set by
    /// [`mark_soft_roce`] right after the context is attached, before it has QPs.
    pub(crate) soft_roce: AtomicBool,
}

// SAFETY: the function pointers are the provider's, callable from any thread.
unsafe impl Send for CtxShared {}
// SAFETY: as above.
unsafe impl Sync for CtxShared {}

/// Attaches `ctx` to `engine`: saves the provider's function pointers, for the shaper's to
/// forward to. Returns false when it was attached already (or cannot be); the caller then
/// leaves the context's pointers alone.
///
/// # Safety
/// `ctx` must be a live, just-opened context that no other thread uses yet.
pub unsafe fn attach_context(ctx: *mut ibv_context, engine: Arc<Engine>) -> bool {
    if CONTEXTS.get(ctx.cast()).is_some() {
        return false;
    }
    // SAFETY: guaranteed by the caller.
    unsafe {
        let ops = &mut (*ctx).ops;
        let vctx = justitia_verbs::ops::verbs_get_ctx(ctx);
        let has = |off| !vctx.is_null() && justitia_verbs::ops::verbs_ctx_has(vctx, off);
        let create_qp_ex = if has(std::mem::offset_of!(verbs_context, create_qp_ex)) {
            (*vctx).create_qp_ex
        } else {
            None
        };
        let create_cq_ex = if has(std::mem::offset_of!(verbs_context, create_cq_ex)) {
            (*vctx).create_cq_ex
        } else {
            None
        };
        let shared = Arc::new(CtxShared {
            engine,
            post_send: ops.post_send,
            post_recv: ops.post_recv,
            poll_cq: ops.poll_cq,
            req_notify_cq: ops.req_notify_cq,
            create_qp_ex,
            create_cq_ex,
            soft_roce: AtomicBool::new(false),
        });
        if CONTEXTS.insert(ctx.cast(), shared).is_err() {
            log!(
                Warn,
                "too many open devices; this one passes through unobserved"
            );
            return false;
        }
    }
    true
}

/// Notes that the attached `ctx` is a Soft-RoCE (rxe) device; its QPs created from now on
/// post a bandwidth flow's RDMA WRITEs one path MTU a WQE.
pub fn mark_soft_roce(ctx: *mut ibv_context) {
    if let Some(c) = context(ctx) {
        c.soft_roce.store(true, Ordering::Relaxed);
    }
}

/// Forgets `ctx` (it is about to be closed).
pub fn detach_context(ctx: *mut ibv_context) {
    if let Some(p) = CONTEXTS.get(ctx.cast()) {
        drop(CONTEXTS.remove(ctx.cast(), p));
    }
}

/// The state of an attached context.
pub(crate) fn context(ctx: *mut ibv_context) -> Option<&'static CtxShared> {
    // SAFETY: context state is freed only by detach_context, when the context closes and no
    // verb of it can be running.
    CONTEXTS.get(ctx.cast()).map(|p| unsafe { &*p.as_ptr() })
}

/// The state of a registered CQ if it is found without probing.
#[inline(always)]
pub(crate) fn cq_fast(cq: *mut ibv_cq) -> Option<&'static CqShared> {
    // SAFETY: as in `cq`.
    CQS.get_at_home(cq.cast()).map(|p| unsafe { &*p.as_ptr() })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::clock::VirtualClock;

    /// The follower applies the daemon's settings every tick, mostly unchanged. Such a
    /// tick must leave the rate gate's lock-free allowance in place (locking the gate takes
    /// it back, and the next paced post would take the slow path); a new rate takes it back
    /// and re-rates the pacer.
    #[test]
    fn unchanged_settings_leave_the_fast_lanes_allowance_alone() {
        let config = Config::from_lookup(|name| match name {
            "JUSTITIA_RATE" => Some("1G".to_string()),
            "JUSTITIA_DAEMON" => Some("off".to_string()),
            _ => None,
        })
        .unwrap();
        let clock = Arc::new(VirtualClock::new());
        let engine = Engine::new(config, clock.clone(), PacerMode::Manual);
        clock.advance(Duration::from_millis(1));
        assert!(
            engine.rate.release(100, || clock.now()),
            "the first post goes"
        );
        assert!(engine.rate.try_take(100), "and leaves an allowance");
        let settings = engine.settings();
        assert!(settings.rate.is_some(), "paced by JUSTITIA_RATE");
        engine.apply(settings, clock.now());
        assert!(
            engine.rate.try_take(100),
            "an unchanged tick keeps the allowance"
        );
        let mut slower = settings;
        if let Some(r) = slower.rate.as_mut() {
            r.bytes_per_sec /= 2;
        }
        engine.apply(slower, clock.now());
        assert!(!engine.rate.try_take(100), "a new rate takes it back");
        assert_eq!(engine.settings().rate, slower.rate);
        assert_eq!(engine.rate_pacer().rate(), slower.rate.unwrap());
    }
}
