//! The shaper's state for each device context, queue pair and completion queue, the shaped
//! post and poll paths, and the pacer. The completion queue's state and its polls are
//! [`cq`]'s (which states its locks); the rest is here.
//!
//! Locks, in the order they are taken (a lock is never taken while a later one is held):
//! a CQ's poll lock (`CqShared::qps`); a QP's state lock (`QpShared::state`, held
//! across the provider's post, never across a poll of the provider's CQ, and under a poll
//! lock only tried, never waited for); the rate gate's pacer lock ([`RateGate`]); the
//! pacer's queue lock and the CQ's held completions, leaves. A verb never waits for a QP's
//! lock held by another thread for another object (see the crate's README, "Locks"):
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

use std::cell::Cell;
use std::ffi::c_int;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use justitia_core::classifier::{ClassifierConfig, FlowClassifier};
use justitia_core::flow::FlowClass;
use justitia_core::pacer::{PaceRate, Pacer as RatePacer, ReleasePhase};
use justitia_core::yield_plan::YieldPlanner;
use justitia_verbs::sys::*;

use crate::clock::Clock;
use crate::config::{ClassSetting, Config, Policy};
use crate::follow::{FollowStatus, Follower, Group, Settings};
use crate::log::log;
use crate::registry::PtrMap;
use ex_state::{QpExOps, WrBatch};

pub mod channels;
pub mod cq;
pub mod ex_state;
use crate::send_queue::{
    Blocked, DrainEnv, FastLane, OwnedWr, QuickRing, RateGate, SendQueue, Treatment,
};
use crate::stats::{Counters, StatsSnapshot};
pub(crate) use cq::{cq, note_touched, Held};
pub use cq::{cq_token, destroy_cq, register_cq, unregister_cq, CqQps, CqShared};

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

/// Who drives the pacer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacerMode {
    /// A background thread, started when something first waits for tokens.
    Thread,
    /// The caller, through [`Engine::pacer_tick`] (tests with a virtual clock).
    Manual,
}

/// How long after a poll drained the pacer's queue the application counts as polling:
/// while it does, its polls release paced requests on time and the pacer thread only
/// stands behind them.
const POLLS_DRIVE_FOR: Duration = Duration::from_millis(20);

/// How late behind the deadline the pacer thread wakes while polls drive pacing. Every
/// thread wake-up costs the host a context switch, and on a busy or emulated host it can
/// cost a co-located latency flow a scheduler tick, so a polling application should see
/// few of them; the tokens a request loses by waiting longer are owed back (see
/// [`justitia_core::pacer`]).
const BACKSTOP_DELAY: Duration = Duration::from_millis(10);

/// How long a QP blocked on send-queue slots waits before the pacer polls its send CQ on
/// the application's behalf (see [`QpShared::progress`]).
const SLOT_POLL_DELAY: Duration = Duration::from_millis(1);

/// The rate pacer's burst window: the release granularity of the pacer thread, which is
/// what releases paced requests when the application does not poll. Its timed wait returns
/// up to the thread's timer slack after the deadline (50 us by default on Linux), and the
/// wake-up itself takes some more; what accrues in between must fit in the burst, or the
/// cap throws it away and the flow loses rate (at 1 GB/s with 5 KiB chunks a burst of two
/// chunks let a late wake-up release about a quarter of the rate). 100 us covers the
/// default slack and an ordinary wake-up; a later one is paid back by the pacer's lateness
/// credit. The burst it costs is 100 us at the rate (300 kB at 24 Gb/s, less than two
/// chunks below 100 MB/s with 5 KiB chunks), released at most once per idle period.
pub const RELEASE_WINDOW: Duration = Duration::from_micros(100);

/// How long an idle pacer thread sleeps before checking whether its engine is gone.
const IDLE_SLEEP: Duration = Duration::from_millis(100);

/// QPs waiting for tokens, with the time each may go, and when the thread will look.
#[derive(Default)]
struct PacerQueue {
    waiting: Vec<(Arc<QpShared>, Duration)>,
    /// When the sleeping pacer thread wakes; `None` while it runs or before it starts.
    thread_wakes_at: Option<Duration>,
}

/// Releases paced requests when their tokens are due: from the application's own polls of
/// the QP's send CQ when it polls (exact, and free of extra wake-ups), else from a thread.
/// A poll releases only the QPs that send their completions to the CQ it polls, and only
/// if it gets their locks without waiting (see [`Engine::release_for`]).
struct Pacer {
    mode: PacerMode,
    queue: Mutex<PacerQueue>,
    wake: Condvar,
    /// The earliest deadline in the queue, in nanoseconds of the engine's clock
    /// (`u64::MAX` when empty; it may be early after a poll released QPs).
    next_due_ns: AtomicU64,
    /// The process that started the thread (a forked child must start its own).
    thread_pid: Mutex<Option<u32>>,
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
    /// With `JUSTITIA_CLASS=auto`: 1 + the most resource-hungry class the classifier has
    /// given a QP (0: none yet).
    auto_class: AtomicU8,
    /// The daemon's side, `None` with `JUSTITIA_DAEMON=off`.
    follower: Option<Mutex<Follower>>,
    /// The follower thread and the process that started it (a forked child passes
    /// through and starts none).
    follow_thread: Mutex<Option<(u32, std::thread::Thread)>>,
}

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
        };
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
            auto_class: AtomicU8::new(0),
            follower: Follower::new(&config, fallback).map(Mutex::new),
            follow_thread: Mutex::new(None),
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

    /// The counters now.
    pub fn stats(&self) -> StatsSnapshot {
        self.counters.snapshot()
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

    /// The settings in effect: the pacer's rate (`None`: unpaced), the chunk size, and the
    /// release phase the pacer was given last (`None` on static settings).
    pub fn settings(&self) -> Settings {
        let applied = *self.applied();
        Settings {
            rate: self.paced().then_some(applied.rate),
            chunk_bytes: self.chunk_bytes(),
            phase: applied.phase,
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
        let mut changed = false;
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
            waiting: self.pacer_has_waiting(),
        }
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
        let group = self.group();
        let settings = follower
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .tick(now_ns, group);
        self.apply(settings, self.clock.now());
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

    /// A QP joined or left the daemon's flow: the follower thread registers or unregisters
    /// it at once instead of at its next tick.
    fn members_changed(self: &Arc<Self>, joined: bool) {
        if joined {
            self.members.fetch_add(1, Ordering::Relaxed);
        } else {
            self.members.fetch_sub(1, Ordering::Relaxed);
        }
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
                Policy::Justitia => Treatment::Split {
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
    /// path then finds) or the sub-message are posted whole, paced as their class is.
    fn fast_lane(&self, path_mtu: u32) -> Option<FastLane> {
        let Some(ClassSetting::Fixed(class)) = self.config.class else {
            return None;
        };
        let paced = self.paced();
        let whole = |paced| FastLane {
            whole_up_to: u64::MAX,
            paced,
        };
        Some(match class {
            FlowClass::Latency => whole(false),
            FlowClass::Throughput => whole(paced),
            FlowClass::Bandwidth => match self.config.policy {
                Policy::Justitia => FastLane {
                    whole_up_to: u64::from(self.chunk_bytes().max(path_mtu)),
                    paced,
                },
                Policy::Preempt => FastLane {
                    whole_up_to: u64::from(self.planner.sub_message_bytes()),
                    paced: false,
                },
            },
        })
    }

    fn pacer_queue(&self) -> MutexGuard<'_, PacerQueue> {
        self.pacer.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the pacer thread should wake for `qp` due at `at`: later while the polls of
    /// its send CQ release its requests themselves.
    fn thread_deadline(&self, qp: &QpShared, at: Duration, now: Duration) -> Duration {
        if qp.send_cq.as_ref().is_some_and(|c| c.polls_drive(now)) {
            at + BACKSTOP_DELAY
        } else {
            at
        }
    }

    /// Queues `qp` to be drained at `at`.
    fn schedule(self: &Arc<Self>, qp: Arc<QpShared>, at: Duration, now: Duration) {
        if qp.in_pacer.swap(true, Ordering::AcqRel) {
            return;
        }
        let notify = {
            let mut queue = self.pacer_queue();
            let wakes = self.thread_deadline(&qp, at, now);
            if let Some(cq) = &qp.send_cq {
                cq.pacer_due_ns.fetch_min(nanos(at), Ordering::AcqRel);
            }
            queue.waiting.push((qp, at));
            self.pacer
                .next_due_ns
                .fetch_min(nanos(at), Ordering::AcqRel);
            // A running thread looks at the queue before it sleeps; a sleeping one needs a
            // nudge only when this deadline comes before its own.
            queue.thread_wakes_at.is_some_and(|t| wakes < t)
        };
        if self.pacer.mode == PacerMode::Thread {
            self.ensure_pacer_thread();
            if notify {
                self.pacer.wake.notify_one();
            }
        }
    }

    /// Drains every waiting QP whose time has come; returns when the next one is due.
    pub fn pacer_tick(self: &Arc<Self>, now: Duration) -> Option<Duration> {
        let due: Vec<Arc<QpShared>> = {
            let mut queue = self.pacer_queue();
            let mut due = Vec::new();
            queue.waiting.retain(|(qp, at)| {
                if *at <= now {
                    due.push(Arc::clone(qp));
                    false
                } else {
                    true
                }
            });
            let next = queue.waiting.iter().map(|(_, at)| nanos(*at)).min();
            self.pacer
                .next_due_ns
                .store(next.unwrap_or(u64::MAX), Ordering::Release);
            due
        };
        for qp in due {
            qp.in_pacer.store(false, Ordering::Release);
            qp.progress(now);
        }
        self.pacer_queue().waiting.iter().map(|(_, at)| *at).min()
    }

    /// True when QPs wait in the pacer's queue (one load): only then can a poll have
    /// paced requests to release.
    pub(crate) fn pacer_has_waiting(&self) -> bool {
        self.pacer.next_due_ns.load(Ordering::Acquire) != u64::MAX
    }

    /// Called by the shaped polls of `cq`: releases the paced requests that are due of
    /// the QPs sending their completions to `cq`, each drained only if its lock is free
    /// (else it stays queued, for the next poll or the pacer thread). Costs one load when
    /// none is due. Never another CQ's QPs: a poll does not post for QPs it does not serve.
    pub(crate) fn release_for(self: &Arc<Self>, cq: &CqShared, now: Duration) {
        if nanos(now) < cq.pacer_due_ns.load(Ordering::Acquire) {
            return;
        }
        let due: Vec<Arc<QpShared>> = {
            let mut queue = self.pacer_queue();
            let mut due = Vec::new();
            let mut next_here = u64::MAX;
            queue.waiting.retain(|(qp, at)| {
                if !qp.send_cq.as_deref().is_some_and(|c| std::ptr::eq(c, cq)) {
                    return true;
                }
                if *at <= now {
                    due.push(Arc::clone(qp));
                    false
                } else {
                    next_here = next_here.min(nanos(*at));
                    true
                }
            });
            cq.pacer_due_ns.store(next_here, Ordering::Release);
            let next = queue.waiting.iter().map(|(_, at)| nanos(*at)).min();
            self.pacer
                .next_due_ns
                .store(next.unwrap_or(u64::MAX), Ordering::Release);
            due
        };
        if due.is_empty() {
            return;
        }
        cq.polls_released_ns
            .store(nanos(now).max(1), Ordering::Relaxed);
        for qp in due {
            qp.in_pacer.store(false, Ordering::Release);
            qp.drain_or_defer(now);
        }
    }

    fn ensure_pacer_thread(self: &Arc<Self>) {
        let pid = std::process::id();
        let mut started = self
            .pacer
            .thread_pid
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if *started == Some(pid) {
            return;
        }
        let engine = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("justitia-pacer".into())
            .spawn(move || pacer_loop(engine));
        match spawned {
            Ok(_) => *started = Some(pid),
            Err(e) => log!(
                Warn,
                "cannot start the pacer thread ({e}); paced requests wait for completions"
            ),
        }
    }
}

/// The pacer thread: sleeps until the earliest waiting QP is due (later while the
/// application's polls release requests themselves), drains, repeats.
fn pacer_loop(engine: Weak<Engine>) {
    loop {
        let Some(engine) = engine.upgrade() else {
            return;
        };
        let now = engine.clock.now();
        // A panic here loses one tick, never the thread.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.pacer_tick(now)));
        // The deadline is read under the lock that `schedule` pushes under, so a QP queued
        // after the tick is either seen here or wakes the wait.
        let mut queue = engine.pacer_queue();
        let now = engine.clock.now();
        let wake_at = queue
            .waiting
            .iter()
            .map(|(qp, at)| engine.thread_deadline(qp, *at, now))
            .min()
            .unwrap_or(now + IDLE_SLEEP);
        let sleep = wake_at.saturating_sub(now);
        if !sleep.is_zero() {
            queue.thread_wakes_at = Some(wake_at);
            let (mut queue, _) = engine
                .pacer
                .wake
                .wait_timeout(queue, sleep)
                .unwrap_or_else(|e| e.into_inner());
            queue.thread_wakes_at = None;
        }
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

/// What registration needs to know about a new QP.
#[derive(Clone, Copy, Debug)]
pub struct QpInit {
    /// Its send CQ.
    pub send_cq: *mut ibv_cq,
    /// Its receive CQ.
    pub recv_cq: *mut ibv_cq,
    /// `IBV_QPT_*`.
    pub qp_type: ibv_qp_type,
    /// Every request generates a completion.
    pub sig_all: bool,
    /// The capacities the provider granted.
    pub cap: ibv_qp_cap,
    /// False when the QP uses verbs the shaper does not know (see
    /// [`shapable_send_ops`]): it is then only observed.
    pub shapable: bool,
}

/// The `ibv_wr_*` send operations the shaper collects and reposts: what an application may
/// ask for in `send_ops_flags` on a shaped QP.
const SHAPED_SEND_OPS: u64 = (IBV_QP_EX_WITH_RDMA_WRITE
    | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | IBV_QP_EX_WITH_SEND
    | IBV_QP_EX_WITH_SEND_WITH_IMM
    | IBV_QP_EX_WITH_RDMA_READ
    | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
    | IBV_QP_EX_WITH_LOCAL_INV
    | IBV_QP_EX_WITH_BIND_MW
    | IBV_QP_EX_WITH_SEND_WITH_INV) as u64;

/// Whether a QP asking for the `ibv_wr_*` operations `send_ops_flags` can be shaped.
///
/// The shaper replaces every `ibv_wr_*` pointer it knows, those of the rdma-core its
/// bindings describe. An operation it does not know (one a later rdma-core added, such as
/// `ibv_wr_flush` in rdma-core 45, whose pointer lies past the end of the bindings'
/// `ibv_qp_ex` and would stay the provider's) would reach the provider between the shaper's
/// own `ibv_wr_start` and `ibv_wr_complete`, and never be posted; one it knows but cannot
/// express as a send request (atomic write, TSO) would be refused. Either way the QP passes
/// through whole instead, said once with the running rdma-core's release.
pub fn shapable_send_ops(send_ops_flags: u64) -> bool {
    if send_ops_flags & !SHAPED_SEND_OPS == 0 {
        return true;
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        let running = justitia_verbs::loader::loaded_rdma_core_release()
            .map_or_else(|| "unknown".to_string(), |r| r.to_string());
        log!(
            Warn,
            "a QP asks for ibv_wr_* operations the shaper does not handle (send_ops_flags {send_ops_flags:#x}; bindings of rdma-core {}, running rdma-core {running}); such QPs pass through unshaped",
            justitia_verbs::BINDINGS_RDMA_CORE_RELEASE
        );
    }
    false
}

/// The shaper's state for one QP.
pub struct QpShared {
    me: Weak<QpShared>,
    pub(crate) qp: *mut ibv_qp,
    pub(crate) qp_num: u32,
    /// Its send queue's tags and quick requests, which polls settle without its lock.
    pub(crate) ring: Arc<QuickRing>,
    pub(crate) engine: Arc<Engine>,
    pub(crate) post_send: PostSendFn,
    pub(crate) post_recv: Option<PostRecvFn>,
    pub(crate) shaped: bool,
    /// Its `max_send_wr`: the most completions it can have waiting in its send CQ.
    send_depth: u32,
    send_cq: Option<Arc<CqShared>>,
    /// Its receive CQ, if registered, and its `max_recv_wr`: counted in that CQ's
    /// `recv_entries` while `recv_counted` (from registration to destroy).
    recv_cq: Option<Arc<CqShared>>,
    recv_depth: u32,
    recv_counted: AtomicBool,
    pub(crate) state: parking_lot::Mutex<QpState>,
    in_pacer: AtomicBool,
    pub(crate) ex: Option<QpExOps>,
    /// The shaper failed (panicked) on this QP's post path: its posts pass through.
    failed_open: AtomicBool,
    /// Its posts are shaped: it is shaped, the shaper has not failed on it, and this is not
    /// a child forked after it was registered (see [`pass_through_in_child`]). What the
    /// post hook reads.
    posts_shaped: AtomicBool,
    /// An RC QP on an engine with a class set: part of the daemon's flow.
    member: bool,
    /// Counted in [`Engine::members`] (from registration to destroy).
    counted: AtomicBool,
}

// SAFETY: the QP pointer is only passed to the provider, which allows any thread.
unsafe impl Send for QpShared {}
// SAFETY: as above; mutable state is behind the mutex.
unsafe impl Sync for QpShared {}

/// Mutable state of a shaped QP.
pub struct QpState {
    pub(crate) sq: SendQueue,
    /// Its path MTU in bytes (the smallest, 256, until `ibv_modify_qp` sets it).
    path_mtu: u32,
    /// RDMA READs it may have outstanding as initiator (`max_rd_atomic`; 0: not set yet).
    max_rd_atomic: u32,
    classifier: Option<FlowClassifier>,
    /// The treatment of a small request when the class is fixed (see [`FastLane`]), valid
    /// while `fast_epoch` is the engine's settings epoch.
    fast: FastLane,
    /// The engine's settings epoch `fast` was derived at, or [`NO_LANE`] when the QP has
    /// none (the automatic class): one comparison says whether `fast` may be used.
    fast_epoch: u64,
    pub(crate) batch: WrBatch,
}

/// [`QpState::fast_epoch`] of a QP without a fast lane (no settings epoch reaches it).
const NO_LANE: u64 = u64::MAX;

/// The smallest path MTU (`IBV_MTU_256`), the floor of a chunk until the QP's own is set.
const MIN_PATH_MTU: u32 = 256;

impl QpState {
    /// The fast lane in effect, if the QP has one.
    #[inline(always)]
    fn lane(&mut self, engine: &Engine) -> Option<FastLane> {
        if self.fast_epoch == u64::from(engine.settings_epoch.load(Ordering::Relaxed)) {
            return Some(self.fast);
        }
        // The daemon changed the pacing or the chunk size since the lane was derived, the
        // MTU changed, or the QP has no lane.
        self.refresh_fast(engine)
    }

    /// Derives the fast lane again from the engine's settings in effect.
    #[cold]
    #[inline(never)]
    fn refresh_fast(&mut self, engine: &Engine) -> Option<FastLane> {
        let epoch = engine.settings_epoch.load(Ordering::Acquire);
        let lane = engine.fast_lane(self.path_mtu);
        self.fast_epoch = lane.map_or(NO_LANE, |_| u64::from(epoch));
        self.fast = lane.unwrap_or(FastLane {
            whole_up_to: 0,
            paced: false,
        });
        lane
    }

    /// The chunk size for `wr` of `bytes` on this QP, from the configured `chunk`.
    ///
    /// A chunk is never smaller than the path MTU: smaller WQEs only add per-WQE cost (a
    /// 1-byte setting would turn 1 MiB into a million WQEs) and the wire carries an MTU per
    /// packet anyway. An RDMA READ is never cut into more pieces than the QP's
    /// `max_rd_atomic`: the NIC holds back READs beyond that many until one has returned,
    /// so each further piece costs a round trip without freeing the link any sooner.
    fn chunk_bytes_for(&self, chunk: u32, opcode: ibv_wr_opcode, bytes: u64) -> u32 {
        let mut chunk = chunk.max(self.path_mtu);
        if opcode == IBV_WR_RDMA_READ && self.max_rd_atomic > 0 {
            let per_read = bytes.div_ceil(u64::from(self.max_rd_atomic));
            chunk = chunk.max(u32::try_from(per_read).unwrap_or(u32::MAX));
        }
        chunk
    }
}

/// Said once per process when [`QPS`] is full.
static QPS_FULL_SAID: AtomicBool = AtomicBool::new(false);

/// Registers a QP created on an attached context. `qpx` is its extended form when it was
/// created with `ibv_wr_*` send operations, whose pointers are saved (the caller installs
/// the shaper's, see [`crate::install`]).
///
/// # Safety
/// `qp` must be a live QP of `ctx`, just created; `qpx` its extended form or null.
pub unsafe fn register_qp(
    ctx: &CtxShared,
    qp: *mut ibv_qp,
    init: QpInit,
    qpx: *mut ibv_qp_ex,
) -> bool {
    // SAFETY: guaranteed by the caller.
    unsafe { register_qp_in(&QPS, ctx, qp, init, qpx) }
}

/// [`register_qp`] into `qps` ([`QPS`], or a small map in tests). Returns false when the
/// QP is not registered: it then passes through untouched, and the caller must leave its
/// `ibv_wr_*` pointers the provider's, since the shaper's would find no state to work
/// with.
///
/// # Safety
/// As [`register_qp`].
pub(crate) unsafe fn register_qp_in<const N: usize>(
    qps: &PtrMap<QpShared, N>,
    ctx: &CtxShared,
    qp: *mut ibv_qp,
    init: QpInit,
    qpx: *mut ibv_qp_ex,
) -> bool {
    let engine = Arc::clone(&ctx.engine);
    let Some(post_send) = ctx.post_send else {
        return false;
    };
    // A QP destroyed behind the shaper's back, whose address was reused: its state leaves
    // its CQ before that CQ's QP list is locked below (taking it out locks the list).
    if let Some(stale) = qps.get(qp.cast()) {
        drop(unregister_qp_in(qps, qp, stale));
    }
    let send_cq = CQS.get_arc(init.send_cq.cast());
    let recv_cq = CQS.get_arc(init.recv_cq.cast());
    // Its receives' share of its send CQ, when that is its receive CQ too.
    let recv_here = if init.recv_cq == init.send_cq {
        init.cap.max_recv_wr
    } else {
        0
    };
    // Completions of a shaped QP must be translated, so its send CQ must be one the shaper
    // knows; a QP whose CQ it does not know is only observed. The CQ's QP list stays locked
    // until the QP is in it, so that two QPs created at once cannot both take the CQ's
    // last room.
    let mut cq_qps = send_cq.as_ref().map(|c| c.qps.lock());
    let mut too_small = None;
    let shaped = engine.shapes(init.qp_type)
        && init.shapable
        && match (&send_cq, &cq_qps) {
            (Some(cq), Some(qps)) => {
                too_small = cq.room_needed(qps, init.cap.max_send_wr, recv_here);
                too_small.is_none()
            }
            _ => false,
        };
    // SAFETY: the caller guarantees qp is live.
    let qp_num = unsafe { (*qp).qp_num };
    let classifier = (shaped && engine.config.class == Some(ClassSetting::Auto))
        .then(|| FlowClassifier::new(engine.classifier).ok())
        .flatten();
    // SAFETY: qpx is null or the QP's extended form; its pointers are the provider's.
    let ex = unsafe { qpx.as_mut() }.map(|x| QpExOps::save(x));
    let sq = SendQueue::new(
        qp_num,
        init.cap.max_send_wr,
        init.cap.max_send_sge,
        init.sig_all,
    );
    let ring = Arc::clone(sq.ring());
    let shared = Arc::new_cyclic(|me| QpShared {
        me: me.clone(),
        qp,
        qp_num,
        ring,
        post_send,
        post_recv: ctx.post_recv,
        shaped,
        send_depth: init.cap.max_send_wr,
        send_cq: send_cq.clone(),
        recv_cq,
        recv_depth: init.cap.max_recv_wr,
        recv_counted: AtomicBool::new(false),
        state: parking_lot::Mutex::new(QpState {
            sq,
            path_mtu: MIN_PATH_MTU,
            max_rd_atomic: 0,
            classifier,
            // Derived at the first post.
            fast: FastLane {
                whole_up_to: 0,
                paced: false,
            },
            fast_epoch: NO_LANE,
            batch: WrBatch::default(),
        }),
        in_pacer: AtomicBool::new(false),
        ex,
        member: init.qp_type == IBV_QPT_RC && engine.config.class.is_some(),
        counted: AtomicBool::new(false),
        engine,
        failed_open: AtomicBool::new(false),
        posts_shaped: AtomicBool::new(shaped),
    });
    // Registered first: a QP the map has no room for must leave no trace in its CQ either.
    let replaced = match qps.insert(qp.cast(), Arc::clone(&shared)) {
        // Registered at this address meanwhile by another thread: detached below, once the
        // CQ's QP list is unlocked.
        Ok(old) => old,
        Err(_) => {
            if !QPS_FULL_SAID.swap(true, Ordering::Relaxed) {
                log!(
                    Warn,
                    "more than {N} queue pairs; the ones past that pass through unobserved"
                );
            }
            return false;
        }
    };
    Counters::add(&shared.engine.counters.qps, 1);
    if let (true, Some(cq), Some(qps)) = (shaped, &send_cq, cq_qps.as_mut()) {
        cq.add_qp_locked(qps, &shared);
    }
    shared.count_receives();
    drop(cq_qps);
    // Said outside the CQ's lock.
    if let (Some(needed), Some(cq)) = (too_small, &send_cq) {
        cq.say_too_small(needed);
    }
    // Outside the CQ's lock: joining the flow may start the follower thread.
    shared.count_member();
    if let Some(old) = replaced {
        drop(old.detach());
    }
    log!(
        Info,
        "QP {qp_num}: {} (send queue {} deep)",
        if shaped { "shaped" } else { "observed" },
        init.cap.max_send_wr
    );
    true
}

/// The registration of a QP, to pass to [`unregister_qp`] once it is destroyed.
pub fn qp_token(qp: *mut ibv_qp) -> Option<NonNull<QpShared>> {
    QPS.get(qp.cast())
}

/// Destroys a QP with `real` (the provider's destroy), the shaper's state first.
///
/// The state is detached before the provider destroys the QP, so that nothing the shaper
/// runs on other threads can reach a destroyed QP: the QP is marked destroyed under its
/// lock (which waits for a drain in progress, and keeps the pacer and other CQs' polls
/// from posting its held requests), taken out of the registry, its CQ and the pacer's
/// queue, and the completions the shaper still held for it are purged (a provider purges
/// a destroyed QP's completions). If the provider refuses the destroy, the QP is
/// registered again as it was. Otherwise its state is freed here.
///
/// A provider may leave a destroyed QP's completions in its CQ (rxe does). Those of its send
/// queue carry the shaper's tags, which must never reach the application, and which a QP
/// created later could reuse (its ring may be allocated where this one was): once the
/// provider has destroyed the QP, its send CQ is polled empty under the CQ's poll lock,
/// completions carrying its tags are dropped (as a provider that purges drops them), and
/// every other completion is held for the application's next poll, in order.
pub fn destroy_qp(qp: *mut ibv_qp, real: impl FnOnce() -> c_int) -> c_int {
    let Some(token) = qp_token(qp) else {
        return real();
    };
    let Some((shared, purged)) = unregister_qp_in(&QPS, qp, token) else {
        return real();
    };
    let rc = real();
    if rc != 0 {
        shared.reinstate(&QPS, purged);
    } else if let (true, Some(cq)) = (shared.shaped, &shared.send_cq) {
        cq.drop_stale(shared.qp_num, &shared.ring, shared.engine.clock.now());
    }
    rc
}

/// Forgets a destroyed QP, if its registration is still `token` (taken before the destroy
/// call, so that a new QP at the same address is not forgotten instead).
pub fn unregister_qp(qp: *mut ibv_qp, token: NonNull<QpShared>) {
    drop(unregister_qp_in(&QPS, qp, token));
}

/// [`unregister_qp`] from `qps`; returns the state, detached, and the completions the
/// shaper held for it (put back if the provider refuses the destroy).
pub(crate) fn unregister_qp_in<const N: usize>(
    qps: &PtrMap<QpShared, N>,
    qp: *mut ibv_qp,
    token: NonNull<QpShared>,
) -> Option<(Arc<QpShared>, Vec<Held>)> {
    // SAFETY: the token is the registered state, alive while it is in the map.
    unsafe { token.as_ref() }.lock().sq.set_destroyed(true);
    let shared = qps.remove(qp.cast(), token)?;
    let purged = shared.detach();
    Some((shared, purged))
}

impl QpShared {
    /// Takes this (destroyed) QP out of its CQ and the pacer's queue, and purges the
    /// completions the shaper holds for it, which it returns. Taking it out of its CQ's QP
    /// list waits for a poll of the pacer's in progress for it, and no later one starts
    /// (see `CqShared::poll_for_pacer`): once this returns, nothing the shaper runs on
    /// another thread polls its CQ on its behalf.
    fn detach(self: &Arc<Self>) -> Vec<Held> {
        self.lock().sq.set_destroyed(true);
        if self.counted.swap(false, Ordering::AcqRel) {
            self.engine.members_changed(false);
        }
        if let (true, Some(cq)) = (
            self.recv_counted.swap(false, Ordering::AcqRel),
            &self.recv_cq,
        ) {
            cq.recv_entries
                .fetch_sub(u64::from(self.recv_depth), Ordering::AcqRel);
        }
        let purged = match &self.send_cq {
            Some(cq) => {
                cq.remove_qp(self);
                cq.purge_qp(self.qp_num)
            }
            None => Vec::new(),
        };
        // A stale `next_due_ns` left behind only costs one needless tick.
        let mut queue = self.engine.pacer_queue();
        queue.waiting.retain(|(q, _)| !Arc::ptr_eq(q, self));
        self.in_pacer.store(false, Ordering::Release);
        purged
    }

    /// Counts a registered QP's receive queue in its receive CQ's entries.
    fn count_receives(&self) {
        if let (Some(cq), false) = (
            &self.recv_cq,
            self.recv_counted.swap(true, Ordering::AcqRel),
        ) {
            cq.recv_entries
                .fetch_add(u64::from(self.recv_depth), Ordering::AcqRel);
        }
    }

    /// Counts a registered member QP in the daemon's flow.
    fn count_member(&self) {
        if self.member && !self.counted.swap(true, Ordering::AcqRel) {
            self.engine.members_changed(true);
        }
    }

    /// Registers again a QP whose destroy the provider refused, with the completions the
    /// shaper held for it (`purged`) held again.
    fn reinstate<const N: usize>(self: &Arc<Self>, qps: &PtrMap<QpShared, N>, purged: Vec<Held>) {
        self.lock().sq.set_destroyed(false);
        if qps.insert(self.qp.cast(), Arc::clone(self)).is_err() {
            return;
        }
        self.count_member();
        self.count_receives();
        if let Some(cq) = &self.send_cq {
            if self.shaped {
                cq.add_qp(self);
            }
            cq.push_held(purged);
        }
        self.drain(self.engine.clock.now());
    }
}

/// How far a shaped post call got, for [`QpShared::recover_post`] after a panic: nothing
/// yet, or the call's result and how many requests of its list the shaper holds, both
/// final. One word, so that the single request's path settles with one store.
pub(crate) struct Settled(Cell<u64>);

/// [`Settled`] before the call is settled (a count of `u32::MAX` held requests is never
/// reached: that long a list would not fit in memory).
const UNSETTLED: u64 = u64::MAX;

impl Settled {
    /// Nothing settled yet.
    pub(crate) fn new() -> Self {
        Settled(Cell::new(UNSETTLED))
    }

    /// The call returns `rc`, and the shaper holds the first `held` requests of its list.
    #[inline(always)]
    fn set(&self, rc: c_int, held: usize) {
        let held = u32::try_from(held).unwrap_or(u32::MAX - 1);
        self.0.set(u64::from(held) << 32 | u64::from(rc as u32));
    }

    /// What was settled, if anything.
    pub(crate) fn get(&self) -> Option<(c_int, usize)> {
        let v = self.0.get();
        (v != UNSETTLED).then_some((v as u32 as c_int, (v >> 32) as usize))
    }
}

/// Names the first request of `wr` in `bad_wr` (if writable): the provider refused it.
///
/// # Safety
/// `bad_wr` is null or writable.
#[cold]
#[inline(never)]
unsafe fn refuse_first(wr: *mut ibv_send_wr, bad_wr: *mut *mut ibv_send_wr) {
    if !bad_wr.is_null() {
        // SAFETY: guaranteed by the caller.
        unsafe { *bad_wr = wr };
    }
}

/// Requests and payload bytes of a request list.
///
/// # Safety
/// `wr` must be a valid request list.
unsafe fn count_list(mut wr: *const ibv_send_wr) -> (u64, u64) {
    let mut n = 0u64;
    let mut bytes = 0u64;
    // SAFETY: guaranteed by the caller.
    unsafe {
        while let Some(w) = wr.as_ref() {
            n += 1;
            let sges = usize::try_from(w.num_sge).unwrap_or(0);
            if sges != 0 && !w.sg_list.is_null() {
                for s in std::slice::from_raw_parts(w.sg_list, sges) {
                    bytes += u64::from(s.length);
                }
            }
            wr = w.next;
        }
    }
    (n, bytes)
}

/// The request at position `n` of the list `wr`, or null past its end.
///
/// # Safety
/// `wr` must be a valid request list.
unsafe fn nth(mut wr: *mut ibv_send_wr, n: usize) -> *mut ibv_send_wr {
    for _ in 0..n {
        // SAFETY: guaranteed by the caller.
        match unsafe { wr.as_ref() } {
            Some(w) => wr = w.next,
            None => break,
        }
    }
    wr
}

/// The state of a registered QP if it is found without probing (see
/// [`PtrMap::get_at_home`]).
#[inline(always)]
pub(crate) fn qp_fast(qp: *mut ibv_qp) -> Option<&'static QpShared> {
    // SAFETY: as in `qp`.
    QPS.get_at_home(qp.cast()).map(|p| unsafe { &*p.as_ptr() })
}

/// The state of a registered CQ if it is found without probing.
#[inline(always)]
pub(crate) fn cq_fast(cq: *mut ibv_cq) -> Option<&'static CqShared> {
    // SAFETY: as in `cq`.
    CQS.get_at_home(cq.cast()).map(|p| unsafe { &*p.as_ptr() })
}

/// The state of a registered QP.
#[inline(always)]
pub(crate) fn qp(qp: *mut ibv_qp) -> Option<&'static QpShared> {
    // SAFETY: QP state is freed at the QP's destroy, which verbs forbid while a call on the
    // QP runs (see the module's documentation).
    QPS.get(qp.cast()).map(|p| unsafe { &*p.as_ptr() })
}

impl QpShared {
    #[inline(always)]
    fn lock(&self) -> parking_lot::MutexGuard<'_, QpState> {
        self.state.lock()
    }

    /// Counts a single request with one SGE posted on an observed QP (the usual case,
    /// kept free of calls so the hook stays a leaf that tail-calls the provider).
    #[inline(always)]
    pub(crate) fn observe_one(&self, bytes: u32) {
        let counters = &self.engine.counters;
        counters.requests.fetch_add(1, Ordering::Relaxed);
        counters
            .bytes
            .fetch_add(u64::from(bytes), Ordering::Relaxed);
    }

    /// Counts what an observed QP posts, any list.
    ///
    /// # Safety
    /// `wr` must be a valid request list.
    pub(crate) unsafe fn observe(&self, wr: *const ibv_send_wr) {
        // SAFETY: guaranteed by the caller.
        let (n, bytes) = unsafe { count_list(wr) };
        let counters = &self.engine.counters;
        counters.requests.fetch_add(n, Ordering::Relaxed);
        counters.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// True while the post hook shapes this QP's posts (else it counts them and passes
    /// them through): it is shaped, the shaper has not failed on it, and this is not a
    /// forked child.
    #[inline(always)]
    pub(crate) fn posts_shaped(&self) -> bool {
        self.posts_shaped.load(Ordering::Relaxed)
    }

    /// The shaped `ibv_post_send`. `settled` receives the call's result and how many
    /// requests of the list the shaper holds as soon as both are final, so that a panic
    /// after that point can still report them (see [`Self::recover_post`]).
    ///
    /// # Safety
    /// `wr` must be a valid request list and `bad_wr` writable.
    #[inline(always)]
    pub(crate) unsafe fn post_send_shaped(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: &Settled,
    ) -> c_int {
        // SAFETY: guaranteed by the caller.
        match unsafe { wr.as_ref() } {
            // SAFETY: a single request.
            Some(w) if w.next.is_null() => unsafe { self.post_single(wr, bad_wr, settled) },
            // SAFETY: guaranteed by the caller.
            _ => unsafe { self.post_list(wr, bad_wr, settled) },
        }
    }

    /// [`Self::post_send_shaped`] of a single request.
    ///
    /// # Safety
    /// As [`Self::post_send_shaped`]; `wr` is one request (not null, its `next` null).
    #[inline(always)]
    pub(crate) unsafe fn post_single(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: &Settled,
    ) -> c_int {
        // SAFETY: guaranteed by the caller.
        if let Some(rc) = unsafe { self.post_one_now(wr, bad_wr, settled) } {
            return rc;
        }
        // SAFETY: guaranteed by the caller.
        unsafe { self.post_list(wr, bad_wr, settled) }
    }

    /// [`Self::post_send_shaped`] of what [`Self::post_one_now`] does not post: a list, or
    /// a request held back, split, or of the automatic class. Out of line, so that the
    /// single request's path keeps a small frame.
    ///
    /// # Safety
    /// As [`Self::post_send_shaped`].
    #[inline(never)]
    unsafe fn post_list(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: &Settled,
    ) -> c_int {
        let now = self.engine.clock.now();
        let mut st = self.lock();
        let mut rc = 0;
        let mut index = 0usize;
        let mut cur = wr;
        // SAFETY: guaranteed by the caller.
        while let Some(w) = unsafe { cur.as_ref() } {
            #[cfg(test)]
            fault::hit(fault::PostFault::BeforeAccept(index));
            // SAFETY: as above.
            let owned = unsafe { OwnedWr::copy_from(w) };
            let treatment =
                self.engine
                    .treatment(&mut st, now, owned.opcode(), owned.payload_len());
            if let Err(e) = st.sq.accept(owned, treatment, index) {
                rc = e;
                break;
            }
            index += 1;
            cur = w.next;
        }
        let (refused, synthesized, blocked) = self.drain_locked(&mut st, now);
        #[cfg(test)]
        fault::hit(fault::PostFault::AfterDrain);
        let held = match refused {
            Some((at, e)) => {
                rc = e;
                at
            }
            None => index,
        };
        st.sq.end_call();
        settled.set(rc, held);
        drop(st);
        if rc != 0 && !bad_wr.is_null() {
            // SAFETY: guaranteed writable by the caller; held is within the list.
            unsafe { *bad_wr = nth(wr, held) };
        }
        #[cfg(test)]
        fault::hit(fault::PostFault::AfterSettled);
        self.after_drain(synthesized, blocked, now);
        rc
    }

    /// The shaped `ibv_post_send` of a single request that nothing holds back (see
    /// [`SendQueue::post_now`]): posted straight from the application's request, with no
    /// copy, no batch and no pacer bookkeeping, by the QP's [`FastLane`] (its treatment,
    /// derived once). The clock is read only when the pacer is asked. `None`: the request
    /// takes the general path, untouched.
    ///
    /// # Safety
    /// As [`Self::post_single`].
    #[inline(always)]
    unsafe fn post_one_now(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: &Settled,
    ) -> Option<c_int> {
        // SAFETY: guaranteed by the caller.
        let w = unsafe { &*wr };
        #[cfg(test)]
        fault::hit(fault::PostFault::BeforeAccept(0));
        let engine = &*self.engine;
        let mut st = self.lock();
        // A QP of the automatic class has no lane: the classifier must see every request
        // once, on the general path.
        let lane = st.lane(engine)?;
        // The gate is asked only by a paced lane. Should pacing have stopped since the lane
        // was derived, the request still takes tokens once; a refused one waits in the
        // queue, whose drain no longer paces. The pacer's lock is taken and the clock read
        // only when the allowance handed out at the last such call does not cover the
        // request.
        let now = || engine.clock.now();
        let post = |wqe: &mut ibv_send_wr| {
            let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
            // Settled when the provider answers: a panic from then on must not refuse a
            // request that went out. Set before the call, which cannot unwind, so that the
            // usual answer needs no second store.
            settled.set(0, 1);
            // SAFETY: the QP is live (its state is registered); the one WQE and the
            // application's SGE list live for the call.
            let rc = unsafe { (self.post_send)(self.qp, wqe, &mut bad) };
            if rc != 0 {
                settled.set(rc, 0);
            }
            rc
        };
        // SAFETY: guaranteed by the caller.
        let posted = unsafe {
            st.sq
                .post_now(w, lane, &engine.rate, now, post, &engine.counters)
        }?;
        let rc = posted.err().unwrap_or(0);
        #[cfg(test)]
        fault::hit(fault::PostFault::AfterDrain);
        drop(st);
        if rc != 0 {
            // SAFETY: guaranteed by the caller.
            unsafe { refuse_first(wr, bad_wr) };
        }
        #[cfg(test)]
        fault::hit(fault::PostFault::AfterSettled);
        Some(rc)
    }

    /// Recovers from a panic inside [`Self::post_send_shaped`], given what it had
    /// `settled`. The QP's posts pass through from now on (fail open). Of the list, the
    /// requests the shaper holds (the first ones: accepted with WQEs posted, or all of them
    /// once the call had settled) stay the shaper's, and still go out once; the rest are
    /// refused with `EIO`, `bad_wr` naming the first of them, as `ibv_post_send` refuses a
    /// list's tail. Posting the whole list to the provider instead would send the held
    /// requests twice.
    ///
    /// # Safety
    /// As [`Self::post_send_shaped`], with the same `wr` and `bad_wr`.
    pub(crate) unsafe fn recover_post(
        &self,
        wr: *mut ibv_send_wr,
        bad_wr: *mut *mut ibv_send_wr,
        settled: Option<(c_int, usize)>,
    ) -> c_int {
        self.fail_open();
        let (rc, held) = match settled {
            Some(done) => done,
            None => {
                let held = self.lock().sq.take_back_call();
                // SAFETY: held is within the list (the queue held that many of it).
                let rest = unsafe { nth(wr, held) };
                (if rest.is_null() { 0 } else { libc::EIO }, held)
            }
        };
        // The panic may have cut a drain short or kept the pacer from being told: restart
        // the flow of what the shaper holds.
        let now = self.engine.clock.now();
        crate::ffi::guarded(|| self.drain(now), || ());
        if rc != 0 && !bad_wr.is_null() {
            // SAFETY: guaranteed writable by the caller; held is within the list.
            unsafe { *bad_wr = nth(wr, held) };
        }
        rc
    }

    /// Stops shaping this QP's posts after an internal error; says so once.
    /// Recovers from a panic inside [`Self::post_batch`]: the batch's requests with nothing
    /// posted are taken back and the QP fails open, as after a panic in the shaped
    /// `ibv_post_send`. The batch is refused (`EIO`); requests of it that already had work
    /// at the provider, if any, still complete, since a WQE cannot be recalled.
    pub(crate) fn recover_batch(&self) -> c_int {
        self.fail_open();
        self.lock().sq.take_back_call();
        let now = self.engine.clock.now();
        crate::ffi::guarded(|| self.drain(now), || ());
        libc::EIO
    }

    fn fail_open(&self) {
        self.posts_shaped.store(false, Ordering::Relaxed);
        if !self.failed_open.swap(true, Ordering::AcqRel) {
            log!(
                Warn,
                "QP {}: internal error in the shaper; its requests pass through unshaped from now on",
                self.qp_num
            );
        }
    }

    /// Accepts requests collected by the `ibv_wr_*` interface, all or none. After
    /// [`Self::fail_open`] they are taken whole and unpaced: the interface's pointers stay
    /// the shaper's, so passing through means posting as the application asked.
    pub(crate) fn post_batch(&self, batch: Vec<OwnedWr>) -> c_int {
        let now = self.engine.clock.now();
        let mut st = self.lock();
        if st.sq.outstanding() + batch.len() > st.sq.capacity() as usize {
            return libc::ENOMEM;
        }
        let shaping = self.posts_shaped();
        for (index, owned) in batch.into_iter().enumerate() {
            #[cfg(test)]
            fault::hit(fault::PostFault::BeforeAccept(index));
            let treatment = if shaping {
                self.engine
                    .treatment(&mut st, now, owned.opcode(), owned.payload_len())
            } else {
                Treatment::Whole
            };
            if let Err(e) = st.sq.accept(owned, treatment, index) {
                return e;
            }
        }
        let (refused, synthesized, blocked) = self.drain_locked(&mut st, now);
        st.sq.end_call();
        drop(st);
        self.after_drain(synthesized, blocked, now);
        refused.map_or(0, |(_, e)| e)
    }

    /// Posts what the send queue allows now.
    fn drain_locked(
        &self,
        st: &mut QpState,
        now: Duration,
    ) -> (Option<(usize, c_int)>, Vec<u64>, Blocked) {
        if st.sq.destroyed() {
            return (None, Vec::new(), Blocked::Idle);
        }
        let qp = self.qp;
        let post_send = self.post_send;
        let mut post = |wrs: &mut [ibv_send_wr]| -> Result<(), (usize, c_int)> {
            let base = wrs.as_mut_ptr();
            let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
            // SAFETY: qp is live (its state is registered); the list and its SGEs live for
            // the call.
            let rc = unsafe { post_send(qp, base, &mut bad) };
            if rc == 0 {
                return Ok(());
            }
            // The provider names the first WQE it did not take; one outside the list (or
            // none) means it took nothing.
            let index = (bad as usize)
                .checked_sub(base as usize)
                .map(|bytes| bytes / std::mem::size_of::<ibv_send_wr>())
                .filter(|&i| i < wrs.len())
                .unwrap_or(0);
            Err((index, rc))
        };
        let mut refused_ids = Vec::new();
        let outcome = loop {
            let mut synthesized = Vec::new();
            let outcome = st.sq.drain(
                now,
                &mut DrainEnv {
                    post: &mut post,
                    pacer: self.engine.paced().then_some(&self.engine.rate),
                    counters: &self.engine.counters,
                    synthesized: &mut synthesized,
                },
            );
            // A drain synthesizes IBV_WC_GENERAL_ERR only for a request the provider
            // refused (said on stderr once the lock is released).
            refused_ids.extend(
                synthesized
                    .iter()
                    .filter(|w| w.status == IBV_WC_GENERAL_ERR)
                    .map(|w| w.wr_id),
            );
            // Queued under the QP's lock, before anything later of the queue is posted:
            // a poll settles the QP's later completions under that lock, so they cannot
            // overtake these (see `CqShared::translate`). The held queue is a leaf.
            if let Some(cq) = &self.send_cq {
                cq.push_synthesized(synthesized);
            }
            if !outcome.more {
                break outcome;
            }
        };
        self.engine
            .counters
            .note_queued(u64::try_from(st.sq.queued()).unwrap_or(u64::MAX));
        (outcome.refused, refused_ids, outcome.blocked)
    }

    /// What follows a drain, outside the QP's lock: a refusal by the provider said on
    /// stderr (`refused`: the `wr_id`s of the requests it failed), and the QP handed to
    /// the pacer if blocked.
    fn after_drain(&self, refused: Vec<u64>, blocked: Blocked, now: Duration) {
        for wr_id in refused {
            log!(
                Warn,
                "QP {}: the provider refused a work request of the request with wr_id {wr_id:#x}; it completes with an error",
                self.qp_num,
            );
        }
        let wait = match blocked {
            Blocked::Tokens(wait) => wait,
            Blocked::Slots => SLOT_POLL_DELAY,
            Blocked::Idle | Blocked::Failed => return,
        };
        if let Some(me) = self.me.upgrade() {
            self.engine.schedule(me, now + wait, now);
        }
    }

    /// The pacer's turn for this QP: posts what is due and, when the hardware queue is
    /// full, first polls the send CQ itself.
    ///
    /// Slots come back only when completions are polled. An application may post a large
    /// unsignaled request and a small one, then wait for the peer's reply without polling
    /// its send CQ: natively both are on the wire at once, but the shaper's chunks fill the
    /// queue and the small request would wait for a poll that never comes. So the pacer
    /// polls the provider's CQ on the application's behalf, under the CQ's poll lock,
    /// hides what is internal and holds the rest for the application's next poll, which
    /// delivers held completions before newer ones (see `CqShared::poll_for_pacer`).
    pub(crate) fn progress(&self, now: Duration) {
        let full = self.lock().sq.blocked_on_slots();
        if let (true, Some(cq)) = (full, &self.send_cq) {
            cq.poll_for_pacer(self, now);
        }
        self.drain(now);
    }

    /// [`Self::drain`] if the QP's lock is free; if another thread holds it (a poster,
    /// across the provider's post), the QP is queued for the pacer instead, due now, so
    /// that the caller (a poll, or a verb on another object) never waits for that thread.
    pub(crate) fn drain_or_defer(&self, now: Duration) {
        let Some(mut st) = self.state.try_lock() else {
            if let Some(me) = self.me.upgrade() {
                self.engine.schedule(me, now, now);
            }
            return;
        };
        let (_, synthesized, blocked) = self.drain_locked(&mut st, now);
        drop(st);
        self.after_drain(synthesized, blocked, now);
    }

    /// Posts what slots and tokens allow now (after completions, or when the pacer says).
    pub(crate) fn drain(&self, now: Duration) {
        let mut st = self.lock();
        let (_, synthesized, blocked) = self.drain_locked(&mut st, now);
        drop(st);
        self.after_drain(synthesized, blocked, now);
    }

    /// Notes what an `ibv_modify_qp` with `mask` set: the path MTU, the READ depth, and
    /// the state. Moving to the error state settles the requests whose completion the
    /// hardware will not deliver (see [`SendQueue::set_failed`]).
    pub(crate) fn on_modify(&self, attr: &ibv_qp_attr, mask: u32) {
        let mut synthesized = Vec::new();
        let mut st = self.lock();
        if mask & IBV_QP_PATH_MTU != 0 && (IBV_MTU_256..=IBV_MTU_4096).contains(&attr.path_mtu) {
            st.path_mtu = 128 << attr.path_mtu;
            st.refresh_fast(&self.engine);
        }
        if mask & IBV_QP_MAX_QP_RD_ATOMIC != 0 {
            st.max_rd_atomic = u32::from(attr.max_rd_atomic);
        }
        if mask & IBV_QP_STATE != 0 {
            match attr.qp_state {
                IBV_QPS_RESET => st.sq.reset(),
                IBV_QPS_ERR => st.sq.set_failed(&self.engine.counters, &mut synthesized),
                _ => {}
            }
        }
        // Queued under the lock, as a drain's (see `Self::drain_locked`).
        if let Some(cq) = &self.send_cq {
            cq.push_synthesized(synthesized);
        }
        drop(st);
        // The provider reset the QP and may have left its completions in the CQ: they carry
        // tags the new incarnation reuses, and one could settle a new request that has not
        // run. They are dropped now, before the QP can post again.
        if let (true, true, Some(cq)) = (
            mask & IBV_QP_STATE != 0 && attr.qp_state == IBV_QPS_RESET,
            self.shaped,
            &self.send_cq,
        ) {
            cq.drop_stale(self.qp_num, &self.ring, self.engine.clock.now());
        }
    }
}

/// Panics injected into the shaped post path by tests, to exercise [`QpShared::recover_post`].
#[cfg(test)]
pub(crate) mod fault {
    use std::cell::Cell;

    /// Where the shaped post path panics.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum PostFault {
        /// Before accepting the request at this position of the list.
        BeforeAccept(usize),
        /// After posting what the queue allows, before the call is settled.
        AfterDrain,
        /// After the call is settled, before the pacer is told.
        AfterSettled,
    }

    thread_local! {
        static ARMED: Cell<Option<PostFault>> = const { Cell::new(None) };
    }

    /// The next post on this thread that reaches `at` panics there.
    pub(crate) fn inject(at: PostFault) {
        ARMED.set(Some(at));
    }

    /// Panics if a fault is armed at `at`.
    pub(crate) fn hit(at: PostFault) {
        if ARMED.get() == Some(at) {
            ARMED.set(None);
            panic!("fault injected at {at:?}");
        }
    }
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
