//! The enforcement algorithm: turning an allotment into release decisions.
//!
//! The control loop hands every resource-hungry flow a rate in bytes/s and, optionally,
//! operations/s ([`crate::control_loop::Allotment`]); a [`Pacer`] per flow turns it into a
//! yes or a "come back in `d`" for each chunk or operation the flow wants to post. The
//! simulator and the shaper use this one algorithm, so both pace alike.
//!
//! It is a token bucket per resource, kept in *time*: a balance is how long the flow has
//! been owed its rate. Time accrues at one tick per tick; a request costs its bytes (or
//! operations) times the cost of one unit at the rate. A request goes when no balance is
//! negative, and then takes its whole cost, which may drive a balance below zero: the next
//! request waits until the debt is repaid. A chunk larger than the burst needs no special
//! case, and a request is never split.
//!
//! **Burst.** A balance holds at most the larger of [`BURST_CHUNKS`] chunks and the *burst
//! window* at the rate. The window is the enforcer's release granularity: how late, or how
//! coarsely, whoever calls [`Pacer::try_release`] comes back. A caller that releases every
//! 10 us earns 10 us of rate between two visits and must be able to spend it at once, or
//! the cap throws the rest away: with a 2-chunk burst, 5 KB chunks at 3 GB/s released every
//! 10 us got 51 % of the rate, every 50 us 10 %. So the enforcer names its window
//! ([`Pacer::with_burst_window`], [`Pacer::set_burst_window`]), and the rate holds for any
//! caller that comes back within the window of the time it was told, or that visits at
//! least once per window, and releases what is due when it does: what it earned in between
//! fits in the balance. [`Pacer::new`] takes [`BURST_WINDOW`], 1 us, which fits an enforcer
//! that releases at exact times, like the simulator or an application that busy-polls; a
//! pacer thread that sleeps with a timed wait (Linux timer slack is 50 us by default, and
//! the scheduler adds to it) needs that lateness as its window, and pays for it with a
//! burst of that length (150 KB for 50 us at 3 GB/s).
//!
//! The window is a burst, so it should be no longer than the enforcer needs. At the paper's
//! rates with latency flows present (5 KB chunks, 48 to 97 Gb/s, i.e. 6 to 12.1 KB per
//! microsecond) the default gives 2 to 2.4 chunks, so a flow that was idle releases at most
//! 3.4 chunks back to back, about 3 us at the line rate of a co-located latency flow's
//! queue: the 5 KB chunk of §5.1 exists to keep that queue short, and a burst of many chunks
//! would undo it. Two chunks rather than one let a flow post its next chunk while the
//! previous one is still on the wire, so it does not starve the RNIC between two decisions.
//! Without latency flows (1 MB chunks) the burst is 2 MB: nobody is hurt by it then. The
//! bound: over any interval, bytes released <= rate x interval + max(2 chunks, window x
//! rate) + one request, plus the lateness credit below when the caller came back later than
//! the burst allows for.
//!
//! **Lateness.** A refused request is told when to come back, and is brought back then,
//! give or take the scheduler. Lateness the burst absorbs costs nothing: the balance had
//! room for what accrued. Beyond it, a pacer thread or a polling application may run
//! milliseconds late on a busy or emulated host. Losing those milliseconds loses rate
//! (under Soft-RoCE at 5 MB/s with 64 KiB chunks the rate fell to 70 %); crediting them at
//! once turns every late return into a burst as long as the lateness (a co-located latency
//! flow's p99 rose from under 0.2 ms to several). So what the burst cap takes from a request
//! kept waiting past its time, up to [`MAX_LATENESS_CREDIT`], is *owed*, and repaid by
//! refilling at twice the rate until made good: the rate holds while returns are late beyond
//! the burst less than half the time, and no return releases more than the burst and one
//! request at once. A balance that reaches its cap with nobody late forgives what is owed:
//! nothing was waiting. A caller late beyond the burst at every return loses rate; its
//! window is too short.
//!
//! **Cost.** The shaper calls [`Pacer::try_release`] on every request, so it uses integer
//! arithmetic only: time in ticks of 2^-30 ns, the cost of a unit and the burst precomputed
//! when the rate or the window is set (the only divisions), shifts to convert nanoseconds.
//! The cost of a unit is rounded up, so the enforced rate is at most the given one and short
//! of it by less than one part in 10^7 for rates up to 10^11 units/s.
//!
//! Invariants: the pacer reads no clock (`now` is passed in, and a `now` earlier than a
//! previous one counts as no time passing); a zero rate pauses the flow (every request is
//! refused with [`MAX_WAIT`] until a positive rate is set); changing the rate keeps what is
//! owed and what is credited in bytes, not in time; so does changing the window, which never
//! adds credit.

use std::time::Duration;

/// The default burst window, for an enforcer that releases at the times it is told: how
/// much time at the rate a full balance holds, at least (see the module documentation for
/// the choice and for longer windows).
pub const BURST_WINDOW: Duration = Duration::from_micros(1);

/// How many chunks (or operations) a full balance holds, at least.
pub const BURST_CHUNKS: u64 = 2;

/// The most lateness of a refused request's return that is owed back: a return later than
/// this is a stall, not scheduling latency.
pub const MAX_LATENESS_CREDIT: Duration = Duration::from_millis(50);

/// The longest wait [`Pacer::try_release`] names. A longer debt (a huge request at a tiny
/// rate) is repaid over several waits; a paused flow is told this and should also come
/// back when its rate changes.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// Ticks per nanosecond, as a shift: time is kept in units of 2^-30 ns so that a unit's
/// cost keeps seven significant digits at 10^11 units/s without any division per request.
const TICK_SHIFT: u32 = 30;

/// Nanoseconds per second.
const NANOS_PER_SEC: u128 = 1_000_000_000;

/// The rate a [`Pacer`] enforces, with the chunk size that sets its burst.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PaceRate {
    /// Bytes per second; zero pauses the flow.
    pub bytes_per_sec: u64,
    /// Operations per second, or `None` to pace by bytes alone; zero pauses the flow.
    pub ops_per_sec: Option<u64>,
    /// The chunk size the flow's requests are cut to (bytes): the burst holds at least
    /// [`BURST_CHUNKS`] of them.
    pub chunk_bytes: u32,
}

impl PaceRate {
    /// The most bytes a full balance lets through before the next request waits, not
    /// counting the request that overdraws it, with the default window: max([`BURST_CHUNKS`]
    /// chunks, [`BURST_WINDOW`] x rate). [`Pacer::burst_bytes`] gives it for the pacer's
    /// window.
    pub fn burst_bytes(&self) -> u64 {
        self.burst_bytes_within(BURST_WINDOW)
    }

    /// The most operations a full balance lets through, likewise: max([`BURST_CHUNKS`],
    /// [`BURST_WINDOW`] x rate); `None` when operations are not paced.
    pub fn burst_ops(&self) -> Option<u64> {
        self.burst_ops_within(BURST_WINDOW)
    }

    fn burst_bytes_within(&self, window: Duration) -> u64 {
        burst_units(self.bytes_per_sec, u64::from(self.chunk_bytes), window)
    }

    fn burst_ops_within(&self, window: Duration) -> Option<u64> {
        self.ops_per_sec.map(|ops| burst_units(ops, 1, window))
    }

    fn is_paused(&self) -> bool {
        self.bytes_per_sec == 0 || self.ops_per_sec == Some(0)
    }
}

/// max(BURST_CHUNKS x chunk, window x rate) in units, saturating.
fn burst_units(rate: u64, chunk: u64, window: Duration) -> u64 {
    let window = u128::from(rate).saturating_mul(window.as_nanos()) / NANOS_PER_SEC;
    let window = u64::try_from(window).unwrap_or(u64::MAX);
    window.max(BURST_CHUNKS.saturating_mul(chunk))
}

/// Ticks one unit costs at `rate` units/s, rounded up; at least one tick.
fn ticks_per_unit(rate: u64) -> u64 {
    let per_sec = NANOS_PER_SEC << TICK_SHIFT;
    let ticks = per_sec.div_ceil(u128::from(rate.max(1)));
    u64::try_from(ticks).unwrap_or(u64::MAX).max(1)
}

/// Nanoseconds since the caller's epoch, saturating (584 years).
fn nanos(t: Duration) -> u64 {
    t.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(t.subsec_nanos()))
}

/// Where a flow's releases fall in its host's release schedule, for
/// [`Pacer::set_rate_in_phase`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReleasePhase {
    /// The flow's place in one release interval, as a fraction in [0, 1).
    pub offset: f64,
    /// Which assignment of phases this is: a pacer moves its flow only on an epoch it has not
    /// applied yet, so that changes of rate in between keep the spacing.
    pub epoch: u64,
}

/// One resource's balance, in ticks.
#[derive(Debug, Clone, Copy)]
struct Lane {
    /// Ticks one unit costs.
    cost: u64,
    /// Credit (positive) or debt (negative).
    balance: i128,
    /// The most credit the lane holds.
    cap: i128,
    /// Time lost to the cap while a request was kept waiting, repaid on top of the rate.
    owed: i128,
    /// Charges of requests released without a clock reading
    /// ([`Pacer::try_release_unclocked`]), taken from the balance at the next refill,
    /// after it: as if those requests had gone at that later time.
    pending: i128,
}

impl Lane {
    /// A full lane for `rate` units/s and a burst of `burst` units.
    fn full(rate: u64, burst: u64) -> Lane {
        let cost = ticks_per_unit(rate);
        let cap = i128::from(burst) * i128::from(cost);
        Lane {
            cost,
            balance: cap,
            cap,
            owed: 0,
            pending: 0,
        }
    }

    /// Accrues `dt` ticks, the last `late` of which a waiting request was kept waiting past
    /// its time.
    #[inline(always)]
    fn refill(&mut self, dt: i128, late: i128) {
        // The usual case, on every request of a flow that is not held back: nothing owed and
        // nobody late, so the balance only grows up to its cap. What `refill_owing` computes
        // then, in two operations instead of its branches.
        if self.owed == 0 && late == 0 {
            self.balance = (self.balance + dt).min(self.cap);
            return;
        }
        self.refill_owing(dt, late);
    }

    /// [`Self::refill`] while something is owed or a waiting request came back late.
    #[inline(never)]
    fn refill_owing(&mut self, dt: i128, late: i128) {
        let repaid = self.owed.min(dt);
        self.owed -= repaid;
        let total = self.balance + dt + repaid;
        if total <= self.cap {
            self.balance = total;
            return;
        }
        self.balance = self.cap;
        self.owed = if late > 0 {
            let lost = (total - self.cap).min(late);
            (self.owed + lost).min(max_lateness_ticks())
        } else {
            0
        };
    }

    /// Ticks until the balance is no longer negative: twice the rate while something is
    /// owed, the rate after.
    fn wait(&self) -> i128 {
        let debt = (-self.balance).max(0);
        debt - self.owed.min(debt / 2)
    }

    /// A new cap of `burst` units: credit beyond it is dropped, none is added.
    fn set_burst(&mut self, burst: u64) {
        self.cap = i128::from(burst) * i128::from(self.cost);
        self.balance = self.balance.min(self.cap);
    }

    fn charge(&mut self, units: u64) {
        self.balance -= i128::from(units) * i128::from(self.cost);
    }

    /// Whether the balance of the last refill still covers the charges made since without
    /// a clock reading: then it covers them at any later time too (a balance at or below
    /// its cap never shrinks by refilling).
    #[inline(always)]
    fn ready_unclocked(&self) -> bool {
        self.balance >= self.pending
    }

    /// Takes the charges made without a clock reading from the balance.
    #[inline(always)]
    fn settle(&mut self) {
        self.balance -= self.pending;
        self.pending = 0;
    }

    /// Moves a lane in debt onto the release schedule `phase` of a `period` (ticks) from now:
    /// its debt becomes the next one that is `phase x period` modulo `period`, so it is
    /// moved later by less than a period, never earlier (moving earlier would hand out
    /// credit, and an assignment at every release would add it up past the burst). A lane
    /// with credit is left alone (its flow
    /// is not releasing on any schedule) unless `from_rest`, when it gives the credit up and
    /// waits `phase x period`. Returns whether the balance changed.
    fn rephase(&mut self, phase: f64, period: i128, from_rest: bool) -> bool {
        if period <= 0 {
            return false;
        }
        // `as` saturates; the clamp keeps the slot inside the period.
        let slot = ((phase * period as f64) as i128).clamp(0, period - 1);
        let before = self.balance;
        if self.balance >= 0 {
            if !from_rest {
                return false;
            }
            self.balance = -slot;
        } else {
            let debt = -self.balance;
            let shift = (slot - debt).rem_euclid(period);
            self.balance = -(debt + shift);
        }
        self.balance != before
    }

    /// The same credit, debt and lateness in units, re-expressed at a new rate and burst.
    fn rerated(&self, rate: u64, burst: u64) -> Lane {
        let mut lane = Lane::full(rate, burst);
        let old = i128::from(self.cost);
        let new = i128::from(lane.cost);
        lane.balance = (self.balance / old * new).min(lane.cap);
        lane.owed = (self.owed / old * new).min(max_lateness_ticks());
        lane
    }
}

fn max_lateness_ticks() -> i128 {
    i128::from(nanos(MAX_LATENESS_CREDIT)) << TICK_SHIFT
}

/// A flow's pacer: bytes and, optionally, operations per second, with a bounded burst.
#[derive(Debug, Clone)]
pub struct Pacer {
    rate: PaceRate,
    /// The enforcer's release granularity; the burst is at least this long at the rate.
    window: Duration,
    bytes: Lane,
    ops: Option<Lane>,
    /// The latest `now` seen, in nanoseconds.
    last: u64,
    /// When the last refused request was told it could go, in nanoseconds.
    promised: Option<u64>,
    /// The last release phase assignment applied.
    phase_epoch: Option<u64>,
}

impl Pacer {
    /// A pacer at `rate` with the default [`BURST_WINDOW`], full (a burst's worth of
    /// credit) at `now`: for an enforcer that comes back when it is told.
    pub fn new(rate: PaceRate, now: Duration) -> Pacer {
        Pacer::with_burst_window(rate, BURST_WINDOW, now)
    }

    /// A pacer at `rate` whose burst is max([`BURST_CHUNKS`] chunks, `window` x rate), full
    /// at `now`. `window` is the enforcer's release granularity: the longest it may come back
    /// after the time a refused request was told, or between two releases of a flow with
    /// requests waiting. Within it the rate holds; the burst it adds is the price.
    pub fn with_burst_window(rate: PaceRate, window: Duration, now: Duration) -> Pacer {
        Pacer {
            rate,
            window,
            bytes: Lane::full(rate.bytes_per_sec, rate.burst_bytes_within(window)),
            ops: rate
                .ops_per_sec
                .map(|ops| Lane::full(ops, burst_units(ops, 1, window))),
            last: nanos(now),
            promised: None,
            phase_epoch: None,
        }
    }

    /// The rate in effect.
    pub fn rate(&self) -> PaceRate {
        self.rate
    }

    /// The burst window in effect.
    pub fn burst_window(&self) -> Duration {
        self.window
    }

    /// The most bytes a full balance lets through before the next request waits, not
    /// counting the request that overdraws it: max([`BURST_CHUNKS`] chunks, window x rate).
    pub fn burst_bytes(&self) -> u64 {
        self.rate.burst_bytes_within(self.window)
    }

    /// The most operations a full balance lets through, likewise; `None` when operations are
    /// not paced.
    pub fn burst_ops(&self) -> Option<u64> {
        self.rate.burst_ops_within(self.window)
    }

    /// Changes the burst window at `now`, for an enforcer whose release granularity changed
    /// (say, from an application's polls to a sleeping thread). What accrued so far accrues
    /// under the old window; credit beyond the new burst is dropped, none is added, and debt
    /// and lateness owed carry over.
    pub fn set_burst_window(&mut self, now: Duration, window: Duration) {
        self.refill(nanos(now));
        self.window = window;
        if self.rate.is_paused() {
            // The lanes keep the last positive rate's costs; the next positive rate sets
            // their caps from this window (see `set_rate`).
            return;
        }
        self.bytes.set_burst(self.rate.burst_bytes_within(window));
        if let (Some(lane), Some(burst)) = (&mut self.ops, self.rate.burst_ops_within(window)) {
            lane.set_burst(burst);
        }
    }

    /// Brings the balances up to `now`, then takes the charges of the requests released
    /// without a clock reading since the last refill (see [`Self::try_release_unclocked`]).
    #[inline(always)]
    fn refill(&mut self, now: u64) {
        self.accrue(now);
        self.bytes.settle();
        if let Some(ops) = &mut self.ops {
            ops.settle();
        }
    }

    /// Accrues the time from the last `now` seen to `now`.
    #[inline(always)]
    fn accrue(&mut self, now: u64) {
        if now <= self.last {
            return;
        }
        let late = match self.promised {
            Some(at) if now >= at => {
                self.promised = None;
                i128::from(now - at) << TICK_SHIFT
            }
            _ => 0,
        };
        let dt = i128::from(now - self.last) << TICK_SHIFT;
        self.last = now;
        if self.rate.is_paused() {
            return;
        }
        self.bytes.refill(dt, late);
        if let Some(ops) = &mut self.ops {
            ops.refill(dt, late);
        }
    }

    /// Changes the rate at `now`: what accrued so far accrues at the old rate, and the
    /// credit, debt and lateness owed carry over in bytes and operations (credit clipped to
    /// the new burst, which keeps the window). A lane that appears (operations newly paced)
    /// starts full.
    pub fn set_rate(&mut self, now: Duration, rate: PaceRate) {
        self.refill(nanos(now));
        if rate == self.rate {
            return;
        }
        if rate.is_paused() {
            // The lanes keep their costs, so the balances resume in bytes at the next rate.
            self.rate = rate;
            return;
        }
        let window = self.window;
        self.bytes = self
            .bytes
            .rerated(rate.bytes_per_sec, rate.burst_bytes_within(window));
        self.ops = rate.ops_per_sec.map(|ops| {
            let burst = burst_units(ops, 1, window);
            match &self.ops {
                Some(lane) => lane.rerated(ops, burst),
                None => Lane::full(ops, burst),
            }
        });
        self.rate = rate;
    }

    /// Changes the rate at `now` as [`set_rate`](Self::set_rate) does, and, when `phase` is
    /// a new assignment, puts the flow at its place in the host's release schedule: its next
    /// release `phase.offset` of a release interval from now, moved later by less than an
    /// interval. The interval is one chunk at the new byte rate for the bytes, one operation
    /// at the operation rate for the operations.
    ///
    /// This is how per-flow pacers spread their releases as the paper's single token stream
    /// does (round robin, one token every tau): the control loop gives the n flows it
    /// divides among offsets 0, 1/n, ... with the rates of one update
    /// ([`crate::control_loop::Allotment::phase`]), and flows placed together then release
    /// one after another, and keep doing so while they stay backlogged: a later change of
    /// rate scales every flow's wait alike. Without phases they all release at once: they
    /// were given their rates at the same update, all started with a full burst, and backlog
    /// keeps them in step. The reference is the moment the phase is applied, so no clock is
    /// shared between pacers.
    ///
    /// - Only a new assignment (an `epoch` this pacer has not applied) moves the flow; the
    ///   same phase with a new rate is a plain [`set_rate`](Self::set_rate). Each move is
    ///   less than an interval, so moves at assignments (flows joining or leaving, the chunk
    ///   size changing) cost the rate nothing that matters; moving at every change of rate
    ///   would cost up to an interval per update.
    /// - A lane in debt (the flow waits for its next release) waits on to the interval's
    ///   next phase point: a move never releases anything sooner, so the burst bound holds
    ///   however often the flow is rephased.
    /// - A lane with credit is left alone (the flow had nothing waiting; it is on no
    ///   schedule), except when the pacer was paused: a flow given its first rate, or a rate
    ///   again after a zero one, gives up its credit and starts at its phase, whatever the
    ///   epoch. So flows released together do not all start with a full burst.
    /// - A zero rate pauses the flow as [`set_rate`](Self::set_rate) does; the assignment is
    ///   not applied.
    ///
    /// An offset outside [0, 1) is taken modulo 1 (NaN as 0).
    pub fn set_rate_in_phase(&mut self, now: Duration, rate: PaceRate, phase: ReleasePhase) {
        self.refill(nanos(now));
        let was_paused = self.rate.is_paused();
        self.set_rate(now, rate);
        if rate.is_paused() {
            return;
        }
        let assigned = self.phase_epoch != Some(phase.epoch);
        if !(assigned || was_paused) {
            return;
        }
        self.phase_epoch = Some(phase.epoch);
        let offset = if phase.offset.is_finite() {
            phase.offset.rem_euclid(1.0)
        } else {
            0.0
        };
        let chunk = i128::from(rate.chunk_bytes.max(1));
        let period = chunk.saturating_mul(i128::from(self.bytes.cost));
        let mut moved = self.bytes.rephase(offset, period, was_paused);
        if let Some(lane) = &mut self.ops {
            let period = i128::from(lane.cost);
            moved |= lane.rephase(offset, period, was_paused);
        }
        if moved {
            // The wait told before no longer holds: coming back then is not lateness.
            self.promised = None;
        }
    }

    /// Releases a request of `bytes` and `ops` operations without being told the time, when
    /// that is sure to be right: when the balances as of the latest `now` seen, less what
    /// was released this way since, are not negative. A balance at or below its cap never
    /// shrinks as time passes, so [`Self::try_release`] would release the request at any
    /// later time too. The charge is taken at the next refill, after the time accrued up to
    /// then (as if the request went at that later time, which the cap can only make
    /// stricter): so the pacer never ends up with more credit than an exact token bucket
    /// charged at the true times would have, and may have less by what the cap dropped in
    /// between. Returns false, charging nothing, when the caller must read the clock and
    /// ask [`Self::try_release`]; always false while the rate is zero.
    #[inline]
    pub fn try_release_unclocked(&mut self, bytes: u64, ops: u64) -> bool {
        if self.rate.is_paused() {
            return false;
        }
        let ops_ready = self.ops.as_ref().is_none_or(Lane::ready_unclocked);
        if !(ops_ready && self.bytes.ready_unclocked()) {
            return false;
        }
        self.bytes.pending += i128::from(bytes) * i128::from(self.bytes.cost);
        if let Some(lane) = &mut self.ops {
            lane.pending += i128::from(ops) * i128::from(lane.cost);
        }
        true
    }

    /// How many bytes and operations (`None`: operations not paced) requests may take in
    /// all through [`Self::charge_unclocked`] without a clock reading: what the balances of
    /// the last refill cover beyond the charges already made that way, so that every one
    /// of those requests is one [`Self::try_release_unclocked`] would have released. Zero
    /// while the rate is zero or a balance is short. An enforcer may hand this out ahead,
    /// say as an atomic allowance that posts take from without a lock, and charge what was
    /// taken before anything else asks the pacer.
    pub fn unclocked_allowance(&self) -> (u64, Option<u64>) {
        if self.rate.is_paused() {
            return (0, self.ops.map(|_| 0));
        }
        let units = |lane: &Lane| {
            let spare = (lane.balance - lane.pending).max(0) / i128::from(lane.cost);
            u64::try_from(spare).unwrap_or(u64::MAX)
        };
        (units(&self.bytes), self.ops.as_ref().map(units))
    }

    /// Charges requests of `bytes` and `ops` operations in all released without a clock
    /// reading from an allowance ([`Self::unclocked_allowance`]), as
    /// [`Self::try_release_unclocked`] charges each: at the next refill, after it.
    pub fn charge_unclocked(&mut self, bytes: u64, ops: u64) {
        self.bytes.pending += i128::from(bytes) * i128::from(self.bytes.cost);
        if let Some(lane) = &mut self.ops {
            lane.pending += i128::from(ops) * i128::from(lane.cost);
        }
    }

    /// Charges `bytes` and `ops` more to the request [`Self::try_release`] released last,
    /// once the enforcer knows what it costs beyond what it was first charged (what the
    /// request touched on its way out). The balances may go below zero, as the release's
    /// own charge may take them; the next request waits until they are repaid, so the two
    /// charges together pace as one charge of their sum would.
    pub fn charge(&mut self, bytes: u64, ops: u64) {
        self.bytes.charge(bytes);
        if let Some(lane) = &mut self.ops {
            lane.charge(ops);
        }
    }

    /// The flow's requests were held by something other than this pacer (a split SEND
    /// waiting for its peer's credit) and may go again at `now`: the credit that accrued
    /// while they were held, and what was owed for lateness, is dropped, so they resume at
    /// the rate. The burst is for an enforcer's lateness and a flow coming back from idle;
    /// a hold that recurs every few chunks would turn it into a burst every few chunks
    /// (three chunks back to back, where the flow's paced chunks went one at a time). A
    /// debt stands.
    pub fn resume_after_hold(&mut self, now: Duration) {
        self.refill(nanos(now));
        for lane in std::iter::once(&mut self.bytes).chain(self.ops.as_mut()) {
            lane.balance = lane.balance.min(0);
            lane.owed = 0;
        }
    }

    /// Releases a request of `bytes` and `ops` operations if the balances allow it at
    /// `now`, charging it; otherwise returns how long until they will (at most
    /// [`MAX_WAIT`]), rounded up to the nanosecond so that coming back then succeeds.
    pub fn try_release(&mut self, now: Duration, bytes: u64, ops: u64) -> Result<(), Duration> {
        let now = nanos(now);
        self.refill(now);
        if self.rate.is_paused() {
            return Err(MAX_WAIT);
        }
        let ops_ready = match &self.ops {
            Some(lane) => lane.balance >= 0,
            None => true,
        };
        if self.bytes.balance >= 0 && ops_ready {
            self.bytes.charge(bytes);
            if let Some(lane) = &mut self.ops {
                lane.charge(ops);
            }
            return Ok(());
        }
        Err(self.refuse(now))
    }

    /// The wait of a request refused at `now` (nanoseconds), noted as the time it was told.
    /// Out of line: a flow that is not held back never gets here.
    #[cold]
    #[inline(never)]
    fn refuse(&mut self, now: u64) -> Duration {
        let ticks = self
            .bytes
            .wait()
            .max(self.ops.as_ref().map_or(0, Lane::wait));
        // Round up to a whole nanosecond.
        let wait_ns = (ticks + (1 << TICK_SHIFT) - 1) >> TICK_SHIFT;
        let wait_ns = u64::try_from(wait_ns)
            .unwrap_or(u64::MAX)
            .min(nanos(MAX_WAIT));
        self.promised = Some(now.saturating_add(wait_ns));
        Duration::from_nanos(wait_ns)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const KIB: u32 = 1024;

    fn rate(bytes_per_sec: u64, chunk_bytes: u32) -> PaceRate {
        PaceRate {
            bytes_per_sec,
            ops_per_sec: None,
            chunk_bytes,
        }
    }

    fn gbps(g: u64) -> u64 {
        g * 1_000_000_000 / 8
    }

    /// Bytes released at once at `now` by requests of `chunk` bytes.
    fn drain(p: &mut Pacer, now: Duration, chunk: u64) -> u64 {
        let mut sent = 0;
        while p.try_release(now, chunk, 1).is_ok() {
            sent += chunk;
        }
        sent
    }

    #[test]
    fn burst_at_the_papers_rates_is_a_few_chunks() {
        // 48 Gb/s (IB-56) and 97 Gb/s (RoCE-100) with 5 KB chunks: 2 and 2.4 chunks of
        // burst, so 3 chunks back to back after a long idle period.
        for (g, most) in [(48, 3), (97, 3)] {
            let chunk = 5 * KIB;
            let mut p = Pacer::new(rate(gbps(g), chunk), Duration::ZERO);
            let idle = Duration::from_secs(1);
            let at_once = drain(&mut p, idle, u64::from(chunk));
            assert_eq!(at_once / u64::from(chunk), most, "{g} Gb/s");
        }
    }

    #[test]
    fn long_run_rate_matches_the_configured_rate() {
        let mut p = Pacer::new(rate(20_000_000, 64 * KIB), Duration::ZERO);
        let mut now = Duration::ZERO;
        let mut sent = 0u64;
        while now < Duration::from_secs(10) {
            match p.try_release(now, 65_536, 1) {
                Ok(()) => sent += 65_536,
                Err(wait) => now += wait,
            }
        }
        let achieved = sent as f64 / now.as_secs_f64();
        assert!((achieved / 20e6 - 1.0).abs() < 0.002, "{achieved}");
    }

    #[test]
    fn ops_bind_for_small_requests() {
        let r = PaceRate {
            bytes_per_sec: 1_000_000_000,
            ops_per_sec: Some(1_000),
            chunk_bytes: 16,
        };
        let mut p = Pacer::new(r, Duration::ZERO);
        let mut now = Duration::ZERO;
        let mut ops = 0u64;
        while now < Duration::from_secs(2) {
            match p.try_release(now, 16, 1) {
                Ok(()) => ops += 1,
                Err(wait) => now += wait,
            }
        }
        assert!((ops as f64 / now.as_secs_f64() / 1000.0 - 1.0).abs() < 0.002);
    }

    #[test]
    fn a_caller_that_comes_back_late_still_gets_the_rate() {
        // 64 KiB chunks at 5 MB/s, every return 6 ms after the time named (a pacer thread
        // under emulation). Without the lateness rule the rate falls to about 70 %.
        let mut p = Pacer::new(rate(5_000_000, 64 * KIB), Duration::ZERO);
        let late = Duration::from_millis(6);
        let mut now = Duration::ZERO;
        let mut sent = 0u64;
        while now < Duration::from_secs(20) {
            match p.try_release(now, 65_536, 1) {
                Ok(()) => sent += 65_536,
                Err(wait) => now += wait + late,
            }
        }
        let achieved = sent as f64 / now.as_secs_f64();
        assert!((achieved / 5e6 - 1.0).abs() < 0.01, "{achieved}");
    }

    #[test]
    fn a_late_return_is_repaid_over_time_not_at_once() {
        // 5 KiB chunks at 32 MB/s polled every 10 us, one poll in 1000 coming 4 ms late:
        // no poll releases more than the burst and one chunk, yet the rate holds.
        let chunk = 5 * KIB;
        let r = rate(32_000_000, chunk);
        let mut p = Pacer::new(r, Duration::ZERO);
        let mut now = Duration::ZERO;
        let (mut sent, mut largest, mut ticks) = (0u64, 0u64, 0u64);
        while now < Duration::from_secs(2) {
            let at_once = drain(&mut p, now, u64::from(chunk));
            sent += at_once;
            largest = largest.max(at_once);
            ticks += 1;
            now += if ticks.is_multiple_of(1000) {
                Duration::from_millis(4)
            } else {
                Duration::from_micros(10)
            };
        }
        // The burst here is two chunks (32 MB/s x 1 us is 32 bytes).
        assert!(largest <= 3 * u64::from(chunk), "{largest} B at once");
        let achieved = sent as f64 / now.as_secs_f64();
        assert!((achieved / 32e6 - 1.0).abs() < 0.02, "{achieved}");
    }

    #[test]
    fn a_stall_is_not_credited_beyond_the_bound() {
        let chunk = 1_000u32;
        let mut p = Pacer::new(rate(1_000_000, chunk), Duration::ZERO);
        assert!(p.try_release(Duration::ZERO, 1_000_000, 1).is_ok());
        assert!(p.try_release(Duration::ZERO, 1_000, 1).is_err());
        // Back ten seconds late: the burst goes at once, then at most 50 ms of lateness
        // on top of the rate over the next second.
        let mut now = Duration::from_secs(10);
        let mut sent = drain(&mut p, now, 1_000);
        assert!(sent <= 3_000, "{sent}");
        let end = now + Duration::from_secs(1);
        while now < end {
            match p.try_release(now, 1_000, 1) {
                Ok(()) => sent += 1_000,
                Err(wait) => now += wait,
            }
        }
        let bound = 1_000_000 + 50_000 + 2_000 + 2_000;
        assert!(sent <= bound, "{sent} > {bound}");
        assert!(sent >= 1_040_000, "{sent}");
    }

    #[test]
    fn a_request_larger_than_the_burst_goes_and_leaves_a_debt() {
        let mut p = Pacer::new(rate(1_000_000, 1_000), Duration::ZERO);
        assert!(p.try_release(Duration::ZERO, 1_000_000, 1).is_ok());
        let wait = p.try_release(Duration::ZERO, 1, 1).unwrap_err();
        // 1 MB at 1 MB/s less the 2 KB burst that was in the bucket: 0.998 s.
        assert_eq!(wait.as_micros(), 998_000);
        assert!(p.try_release(wait, 1, 1).is_ok());
    }

    /// A release without the time goes only while the balance of the last refill covers
    /// it, and its charge is taken after the time accrued up to the next reading: three
    /// chunks released unclocked out of a full 2-chunk burst and the clock read 10 ms later
    /// leave one chunk of debt, exactly what an exact bucket charged at that reading has.
    /// (Charging at once and refilling later would have refilled the debt away: the cap
    /// would have come after the charges, not before.)
    #[test]
    fn releases_without_the_time_are_charged_as_at_the_next_reading() {
        let mut p = Pacer::new(rate(1_000_000, 1_000), Duration::ZERO);
        assert!(p.try_release_unclocked(1_000, 1));
        assert!(p.try_release_unclocked(1_000, 1));
        assert!(
            p.try_release_unclocked(1_000, 1),
            "a zero balance still releases"
        );
        assert!(!p.try_release_unclocked(1_000, 1), "the burst is spent");
        let wait = p
            .try_release(Duration::from_millis(10), 1_000, 1)
            .unwrap_err();
        assert_eq!(wait.as_micros(), 1_000, "one chunk of debt at 1 MB/s");
        assert!(
            !p.try_release_unclocked(1, 1),
            "in debt: only the clock decides"
        );
        assert!(p.try_release(Duration::from_millis(11), 1_000, 1).is_ok());

        // The operations lane binds as well, and a paused pacer never releases.
        let mut ops = Pacer::new(
            PaceRate {
                bytes_per_sec: 1_000_000_000,
                ops_per_sec: Some(1_000),
                chunk_bytes: 1_000,
            },
            Duration::ZERO,
        );
        assert!(ops.try_release_unclocked(1, 1));
        assert!(ops.try_release_unclocked(1, 1));
        assert!(ops.try_release_unclocked(1, 1));
        assert!(
            !ops.try_release_unclocked(1, 1),
            "two operations of burst, and one over"
        );
        ops.set_rate(Duration::ZERO, rate(0, 1_000));
        assert!(!ops.try_release_unclocked(1, 1));
    }

    /// The allowance is what the balance of the last refill covers, and what is taken from
    /// it is charged as unclocked releases are: 2000 B of a full 2-chunk burst at 1 MB/s,
    /// all of it taken, leaves room for one more unclocked release (a zero balance still
    /// releases) and then a debt of one byte at the next reading.
    #[test]
    fn an_allowance_is_the_credit_of_the_last_refill_and_is_charged_at_the_next() {
        let mut p = Pacer::new(rate(1_000_000, 1_000), Duration::ZERO);
        assert_eq!(p.unclocked_allowance(), (2_000, None));
        p.charge_unclocked(1_500, 3);
        assert_eq!(p.unclocked_allowance(), (500, None));
        p.charge_unclocked(500, 1);
        assert_eq!(p.unclocked_allowance(), (0, None));
        assert!(p.try_release_unclocked(1, 1));
        assert_eq!(p.unclocked_allowance(), (0, None), "never negative");
        let wait = p.try_release(Duration::from_millis(10), 1, 1).unwrap_err();
        assert_eq!(wait.as_nanos(), 1_000, "one byte of debt at 1 MB/s");

        let mut ops = Pacer::new(
            PaceRate {
                bytes_per_sec: 1_000_000_000,
                ops_per_sec: Some(1_000),
                chunk_bytes: 1_000,
            },
            Duration::ZERO,
        );
        assert_eq!(ops.unclocked_allowance(), (2_000, Some(2)));
        ops.set_rate(Duration::ZERO, rate(0, 1_000));
        assert_eq!(ops.unclocked_allowance(), (0, Some(0)), "paused");
    }

    #[test]
    fn an_extreme_debt_waits_in_bounded_steps() {
        let r = PaceRate {
            bytes_per_sec: 1,
            ops_per_sec: Some(1),
            chunk_bytes: 1,
        };
        let mut p = Pacer::new(r, Duration::ZERO);
        assert!(p
            .try_release(Duration::ZERO, u64::from(u32::MAX), 1)
            .is_ok());
        assert_eq!(p.try_release(Duration::ZERO, 1, 1), Err(MAX_WAIT));
        assert_eq!(p.try_release(MAX_WAIT, 1, 1), Err(MAX_WAIT));
    }

    #[test]
    fn a_zero_rate_pauses_and_a_new_rate_resumes_without_a_backlog_of_credit() {
        let mut p = Pacer::new(rate(1_000_000, 1_000), Duration::ZERO);
        drain(&mut p, Duration::ZERO, 1_000);
        p.set_rate(Duration::ZERO, rate(0, 1_000));
        assert_eq!(
            p.try_release(Duration::from_secs(5), 1_000, 1),
            Err(MAX_WAIT)
        );
        p.set_rate(Duration::from_secs(10), rate(1_000_000, 1_000));
        // The ten seconds of pause earned nothing: the debt of the drain is still owed.
        assert!(p.try_release(Duration::from_secs(10), 1_000, 1).is_err());
    }

    #[test]
    fn a_rate_change_keeps_the_debt_in_bytes() {
        let mut p = Pacer::new(rate(1_000_000, 1_000), Duration::ZERO);
        assert!(p.try_release(Duration::ZERO, 102_000, 1).is_ok());
        // 100 KB of debt: 100 ms at 1 MB/s, 200 ms at 500 KB/s.
        p.set_rate(Duration::ZERO, rate(500_000, 1_000));
        let wait = p.try_release(Duration::ZERO, 1, 1).unwrap_err();
        assert_eq!(wait.as_millis(), 200);
    }

    /// Rate held, as a fraction of 3 GB/s, by 5 KiB requests released every `every`
    /// (a caller that visits on a fixed period, whatever it is told), over 0.2 s.
    fn periodic_fraction(window: Duration, every: Duration) -> f64 {
        let chunk = 5 * KIB;
        let mut p = Pacer::with_burst_window(rate(3_000_000_000, chunk), window, Duration::ZERO);
        let mut now = Duration::ZERO;
        let mut sent = 0;
        while now < Duration::from_millis(200) {
            now += every;
            sent += drain(&mut p, now, u64::from(chunk));
        }
        sent as f64 / now.as_secs_f64() / 3e9
    }

    #[test]
    fn a_coarse_enforcer_holds_the_rate_within_its_window() {
        let window = Duration::from_micros(50);
        for every in [10, 50] {
            let got = periodic_fraction(window, Duration::from_micros(every));
            assert!((0.99..=1.0005).contains(&got), "every {every} us: {got}");
        }
    }

    #[test]
    fn the_default_window_fits_only_an_exact_enforcer() {
        // The 2-chunk burst (10 KiB, 3.4 us at 3 GB/s) lets 3 chunks go per visit: 15 KiB
        // per 10 us is 51.2 % of the rate, per 50 us 10.2 %.
        for (every, expected) in [(10, 0.512), (50, 0.1024)] {
            let got = periodic_fraction(BURST_WINDOW, Duration::from_micros(every));
            assert!((got - expected).abs() < 0.002, "every {every} us: {got}");
        }
    }

    /// Rate held, as a fraction of 3 GB/s, by 5 KiB requests whose caller comes back
    /// `late()` after the time each refusal named, over 0.2 s.
    fn late_fraction(window: Duration, mut late: impl FnMut() -> Duration) -> f64 {
        let chunk = 5 * KIB;
        let mut p = Pacer::with_burst_window(rate(3_000_000_000, chunk), window, Duration::ZERO);
        let (mut now, mut sent) = (Duration::ZERO, 0u64);
        while now < Duration::from_millis(200) {
            match p.try_release(now, u64::from(chunk), 1) {
                Ok(()) => sent += u64::from(chunk),
                Err(wait) => now += wait + late(),
            }
        }
        sent as f64 / now.as_secs_f64() / 3e9
    }

    #[test]
    fn returns_late_by_up_to_the_window_keep_the_rate() {
        let window = Duration::from_micros(50);
        for late_us in [10, 25, 50] {
            let got = late_fraction(window, || Duration::from_micros(late_us));
            assert!((0.99..=1.0005).contains(&got), "{late_us} us late: {got}");
        }
        // Uniform lateness in [0, window], from a fixed xorshift sequence.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let got = late_fraction(window, || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            Duration::from_nanos(x % 50_001)
        });
        assert!((0.99..=1.0005).contains(&got), "uniform lateness: {got}");
        // The default window is the 2-chunk burst, 3.4 us here: 50 us late at every return
        // gets about a tenth of the rate.
        let got = late_fraction(BURST_WINDOW, || Duration::from_micros(50));
        assert!(got < 0.11, "default window, 50 us late: {got}");
    }

    #[test]
    fn a_window_burst_is_the_window_at_the_rate_and_one_request() {
        // 50 us at 3 GB/s is 150 000 B: 29 chunks of 5120 B leave 1520 B of credit, so a
        // 30th goes and the 31st waits for its 3600 B of debt, 1.2 us.
        let chunk = 5 * KIB;
        let window = Duration::from_micros(50);
        let mut p = Pacer::with_burst_window(rate(3_000_000_000, chunk), window, Duration::ZERO);
        assert_eq!(p.burst_window(), window);
        assert_eq!(p.burst_bytes(), 150_000);
        let at_once = drain(&mut p, Duration::from_secs(1), u64::from(chunk));
        assert_eq!(at_once, 30 * u64::from(chunk));
        let wait = p
            .try_release(Duration::from_secs(1), u64::from(chunk), 1)
            .unwrap_err();
        // The cost of a byte is rounded up, and the wait to the next nanosecond.
        assert!((1_200..=1_201).contains(&wait.as_nanos()), "{wait:?}");
        // Ops have their own window burst: 50 us at 1 Mop/s is 50 operations.
        let ops = PaceRate {
            ops_per_sec: Some(1_000_000),
            ..rate(3_000_000_000, chunk)
        };
        let mut p = Pacer::with_burst_window(ops, window, Duration::ZERO);
        assert_eq!(p.burst_ops(), Some(50));
        assert_eq!(drain(&mut p, Duration::ZERO, 1), 51);
        // The default is the old burst, the rate's own.
        let p = Pacer::new(rate(3_000_000_000, chunk), Duration::ZERO);
        assert_eq!(p.burst_window(), BURST_WINDOW);
        assert_eq!(p.burst_bytes(), 2 * u64::from(chunk));
        assert_eq!(p.burst_bytes(), p.rate().burst_bytes());
    }

    #[test]
    fn changing_the_window_clips_credit_and_never_adds_it() {
        let chunk = 5 * KIB;
        let r = rate(3_000_000_000, chunk);
        let wide = Duration::from_micros(50);
        // Full at 150 KB, narrowed to the default: the 2-chunk burst and one request go.
        let mut p = Pacer::with_burst_window(r, wide, Duration::ZERO);
        p.set_burst_window(Duration::ZERO, BURST_WINDOW);
        assert_eq!(p.burst_bytes(), 2 * u64::from(chunk));
        assert_eq!(drain(&mut p, Duration::ZERO, u64::from(chunk)), 3 * 5120);
        // Full at 2 chunks, widened: still 3 chunks now, 30 once 50 us have accrued.
        let mut p = Pacer::new(r, Duration::ZERO);
        p.set_burst_window(Duration::ZERO, wide);
        assert_eq!(drain(&mut p, Duration::ZERO, u64::from(chunk)), 3 * 5120);
        let later = Duration::from_millis(1);
        assert_eq!(drain(&mut p, later, u64::from(chunk)), 30 * 5120);
        // The window survives a rate change and a pause.
        p.set_rate(later, rate(0, chunk));
        p.set_burst_window(later, Duration::from_micros(100));
        p.set_rate(later, r);
        assert_eq!(p.burst_bytes(), 300_000);
        let much_later = Duration::from_secs(1);
        assert_eq!(drain(&mut p, much_later, u64::from(chunk)), 59 * 5120);
    }

    #[test]
    fn an_enormous_window_saturates_instead_of_overflowing() {
        let mut p = Pacer::with_burst_window(rate(u64::MAX, 1), Duration::MAX, Duration::ZERO);
        assert_eq!(p.burst_bytes(), u64::MAX);
        assert!(p.try_release(Duration::MAX, u64::MAX, 1).is_ok());
        p.set_burst_window(Duration::MAX, Duration::ZERO);
        assert_eq!(p.burst_bytes(), 2);
    }

    #[test]
    fn time_going_backwards_counts_as_none() {
        let mut p = Pacer::new(rate(1_000_000, 1_000), Duration::from_secs(1));
        drain(&mut p, Duration::from_secs(1), 1_000);
        assert!(p.try_release(Duration::ZERO, 1_000, 1).is_err());
        assert!(p.try_release(Duration::from_secs(1), 1_000, 1).is_err());
    }

    fn phase(offset: f64, epoch: u64) -> ReleasePhase {
        ReleasePhase { offset, epoch }
    }

    /// 5 KiB chunks at 5.12 MB/s: one chunk per millisecond.
    fn one_chunk_per_ms() -> PaceRate {
        rate(5_120_000, 5 * KIB)
    }

    /// A pacer that has just released its burst at t = 0 and waits 1 ms for the next chunk.
    fn waiting_one_ms() -> Pacer {
        let mut p = Pacer::new(one_chunk_per_ms(), Duration::ZERO);
        // The burst is two chunks (2 ms of credit): three chunks go, the third into debt.
        assert_eq!(drain(&mut p, Duration::ZERO, 5_120), 3 * 5_120);
        assert_eq!(
            p.try_release(Duration::ZERO, 5_120, 1),
            Err(Duration::from_millis(1))
        );
        p
    }

    #[test]
    fn a_new_assignment_moves_a_waiting_flow_to_the_next_phase_point() {
        // Waiting 1 ms, i.e. at phase 0 of the 1 ms interval. Phase 0.25: the points are
        // 0.25, 1.25, 2.25 ms; the next from 1 ms is 1.25 ms (0.25 later).
        let mut p = waiting_one_ms();
        p.set_rate_in_phase(Duration::ZERO, one_chunk_per_ms(), phase(0.25, 1));
        assert_eq!(
            p.try_release(Duration::ZERO, 5_120, 1),
            Err(Duration::from_micros(1_250))
        );
        // Phase 0.75: the next point is 1.75 ms (0.75 later; 0.75 ms, earlier, would have
        // handed out a quarter interval of credit).
        let mut p = waiting_one_ms();
        p.set_rate_in_phase(Duration::ZERO, one_chunk_per_ms(), phase(0.75, 1));
        assert_eq!(
            p.try_release(Duration::ZERO, 5_120, 1),
            Err(Duration::from_micros(1_750))
        );
    }

    #[test]
    fn rephasing_at_every_release_keeps_the_burst_bound() {
        // A backlogged flow at one 5 KiB chunk per ms, given a new epoch at offset 0.55 at
        // every release. Bound: over any interval, bytes <= rate x interval + burst (2
        // chunks) + one request. Moving a waiting flow to the nearest phase point moved it
        // 0.45 ms earlier each time: a chunk every 0.55 ms, 1.8 x the bound over 100 ms.
        let rate = one_chunk_per_ms();
        let mut p = Pacer::new(rate, Duration::ZERO);
        let mut now = Duration::ZERO;
        let mut sent = Vec::new();
        let mut epoch = 2;
        while now < Duration::from_millis(300) {
            match p.try_release(now, 5_120, 1) {
                Ok(()) => {
                    sent.push(now);
                    epoch += 1;
                    p.set_rate_in_phase(now, rate, phase(0.55, epoch));
                }
                Err(wait) => now += wait,
            }
        }
        assert!(sent.len() >= 150, "{} releases", sent.len());
        let horizon = Duration::from_millis(100);
        for (i, &from) in sent
            .iter()
            .enumerate()
            .filter(|&(_, &t)| t + horizon <= now)
        {
            let within = sent[i..].iter().filter(|&&t| t < from + horizon).count() as u64;
            let bound = rate.bytes_per_sec / 10 + rate.burst_bytes() + 5_120;
            assert!(
                within * 5_120 <= bound,
                "{within} chunks in 100 ms from {from:?}"
            );
        }
    }

    #[test]
    fn a_lower_rate_clips_the_credit_to_its_burst() {
        // Full at 10 GB/s with a 1 ms window: 10 MB of credit. At 100 MB/s the burst is
        // 2 chunks (100 KB < 2 x 1 MiB): what may go at once is that, and one request.
        let high = rate(10_000_000_000, 1_048_576);
        let low = rate(100_000_000, 1_048_576);
        let mut p = Pacer::with_burst_window(high, Duration::from_millis(1), Duration::ZERO);
        p.set_rate(Duration::ZERO, low);
        let released = drain(&mut p, Duration::ZERO, 65_536);
        let bound = low.burst_bytes_within(Duration::from_millis(1)) + 65_536;
        assert!(released <= bound, "{released} bytes at once, bound {bound}");
    }

    #[test]
    fn only_a_new_epoch_moves_the_flow_and_a_new_rate_keeps_its_place() {
        let mut p = waiting_one_ms();
        p.set_rate_in_phase(Duration::ZERO, one_chunk_per_ms(), phase(0.25, 1));
        // The same epoch with another offset: not a new assignment.
        p.set_rate_in_phase(Duration::ZERO, one_chunk_per_ms(), phase(0.5, 1));
        assert_eq!(
            p.try_release(Duration::ZERO, 5_120, 1),
            Err(Duration::from_micros(1_250))
        );
        // Twice the rate under the same epoch: the debt in bytes is kept, so the wait
        // halves, as every other flow's does.
        let double = rate(10_240_000, 5 * KIB);
        p.set_rate_in_phase(Duration::ZERO, double, phase(0.25, 1));
        assert_eq!(
            p.try_release(Duration::ZERO, 5_120, 1),
            Err(Duration::from_micros(625))
        );
    }

    #[test]
    fn a_flow_with_credit_keeps_its_burst_unless_it_was_paused() {
        let mut p = Pacer::new(one_chunk_per_ms(), Duration::ZERO);
        p.set_rate_in_phase(Duration::ZERO, one_chunk_per_ms(), phase(0.5, 1));
        assert_eq!(drain(&mut p, Duration::ZERO, 5_120), 3 * 5_120);

        // Paused for 10 ms (a full balance), then given its rate at phase 0.5: no burst,
        // its first chunk half an interval later, then one per interval.
        let paused = rate(0, 5 * KIB);
        let mut p = Pacer::new(paused, Duration::ZERO);
        let at = Duration::from_millis(10);
        p.set_rate_in_phase(at, one_chunk_per_ms(), phase(0.5, 1));
        assert_eq!(p.try_release(at, 5_120, 1), Err(Duration::from_micros(500)));
        let first = at + Duration::from_micros(500);
        assert_eq!(drain(&mut p, first, 5_120), 5_120);
        assert_eq!(
            p.try_release(first, 5_120, 1),
            Err(Duration::from_millis(1))
        );
    }

    /// Release times of `n` backlogged flows of 5 KiB chunks from `start` to `end`, given
    /// `rate` at `start` after a pause, at phases i/n (or all at once with `set_rate`).
    fn releases(
        n: u32,
        rate: PaceRate,
        phased: bool,
        start: Duration,
        end: Duration,
    ) -> Vec<Duration> {
        let paused = PaceRate {
            bytes_per_sec: 0,
            ..rate
        };
        let mut flows: Vec<(Pacer, Duration)> = (0..n)
            .map(|i| {
                let mut p = Pacer::new(paused, Duration::ZERO);
                if phased {
                    p.set_rate_in_phase(start, rate, phase(f64::from(i) / f64::from(n), 7));
                } else {
                    p.set_rate(start, rate);
                }
                (p, start)
            })
            .collect();
        let mut out = Vec::new();
        loop {
            let (p, next) = flows.iter_mut().min_by_key(|(_, t)| *t).unwrap();
            let now = *next;
            if now >= end {
                break;
            }
            match p.try_release(now, 5_120, 1) {
                Ok(()) => out.push(now),
                Err(wait) => *next = now + wait,
            }
        }
        out.sort();
        out
    }

    #[test]
    fn flows_placed_together_release_one_after_another() {
        // Eight flows at 3 Gb/s each (the J6 floor: 24 Gb/s among eight): a 5 KiB chunk
        // every 13.65 us per flow, so one every 1.71 us from the eight.
        let r = rate(375_000_000, 5 * KIB);
        let interval = 5_120.0 / 375e6;
        let (start, end) = (Duration::from_millis(1), Duration::from_millis(3));
        let gap = |times: &[Duration]| {
            times
                .windows(2)
                .map(|w| (w[1] - w[0]).as_secs_f64())
                .fold(f64::MAX, f64::min)
        };
        let phased = releases(8, r, true, start, end);
        let smallest = gap(&phased);
        assert!(
            smallest >= interval / 8.0 - 2e-9,
            "{:.3} us between two releases",
            smallest * 1e6
        );
        // Each still gets its rate: 2 ms / 13.65 us = 146.5 chunks.
        assert!(
            (phased.len() as f64 / 8.0 - 146.5).abs() <= 1.0,
            "{}",
            phased.len()
        );
        // Given the same rate at once without phases, they release in step.
        let in_step = releases(8, r, false, start, end);
        assert_eq!(gap(&in_step), 0.0);
    }

    /// An exact token bucket written for the comparison below, independent of the
    /// pacer's ticks: credit in units x 10^9, a nanosecond adds `rate` of it, a unit costs
    /// 10^9, and the cap is the burst's worth.
    struct Bucket {
        rate: i128,
        credit: i128,
        cap: i128,
    }

    impl Bucket {
        fn new(rate: u64, burst: u64) -> Bucket {
            let cap = i128::from(burst) * 1_000_000_000;
            Bucket {
                rate: i128::from(rate),
                credit: cap,
                cap,
            }
        }

        fn advance(&mut self, dt_ns: u64) {
            self.credit = (self.credit + i128::from(dt_ns) * self.rate).min(self.cap);
        }

        /// The balance in nanoseconds at the rate (negative: a debt).
        fn balance_ns(&self) -> f64 {
            self.credit as f64 / self.rate as f64
        }

        fn charge(&mut self, units: u64) {
            self.credit -= i128::from(units) * 1_000_000_000;
        }
    }

    /// The exact buckets of a pacer's lanes (bytes, and operations when paced), with the
    /// units charged so far: the reference both property tests below compare against.
    struct ExactLanes {
        lanes: Vec<(Bucket, u64)>,
        charged: Vec<u64>,
    }

    impl ExactLanes {
        /// The pacer's bursts, max(2 chunks, 1 us at the rate) and max(2 operations, 1 us),
        /// computed here rather than asked.
        fn new(r: PaceRate) -> ExactLanes {
            let byte_burst = (r.bytes_per_sec / 1_000_000).max(2 * u64::from(r.chunk_bytes));
            let mut lanes = vec![(Bucket::new(r.bytes_per_sec, byte_burst), byte_burst)];
            if let Some(ops) = r.ops_per_sec {
                let op_burst = (ops / 1_000_000).max(2);
                lanes.push((Bucket::new(ops, op_burst), op_burst));
            }
            let charged = vec![0; lanes.len()];
            ExactLanes { lanes, charged }
        }

        fn advance(&mut self, dt_ns: u64) {
            for (b, _) in &mut self.lanes {
                b.advance(dt_ns);
            }
        }

        /// How far apart the pacer and the buckets may be, in nanoseconds of each lane: a
        /// tick of 2^-30 ns per unit charged and per unit of burst, and a nanosecond.
        fn eps(&self) -> Vec<f64> {
            self.lanes
                .iter()
                .zip(&self.charged)
                .map(|((_, burst), units)| (units + burst + 1) as f64 / (1u64 << 30) as f64 + 1.0)
                .collect()
        }

        /// Charges a request the pacer released, failing if a bucket was in debt by more
        /// than `eps`.
        fn release(&mut self, eps: &[f64], units: [u64; 2]) -> Result<(), String> {
            for (i, (b, _)) in self.lanes.iter_mut().enumerate() {
                if b.balance_ns() < -eps[i] {
                    return Err(format!(
                        "released with {} ns of debt in lane {i}",
                        -b.balance_ns()
                    ));
                }
                b.charge(units[i]);
                self.charged[i] += units[i];
            }
            Ok(())
        }

        /// How long the exact buckets make a request wait, whole nanoseconds.
        fn wait_ns(&self) -> f64 {
            self.lanes
                .iter()
                .map(|(b, _)| (-b.balance_ns()).max(0.0).ceil())
                .fold(0.0, f64::max)
        }
    }

    proptest::proptest! {
        /// Every decision of the pacer, at random byte and operation rates, request sizes
        /// and times (a caller that comes back no later than it is told), is the one an
        /// exact token bucket makes, up to the rounding the pacer states: a unit's cost is
        /// rounded up to a tick of 2^-30 ns, so the two drift apart by at most a tick per
        /// unit charged (plus one per unit of burst), and a wait is rounded up to the
        /// nanosecond.
        #[test]
        fn decisions_match_an_exact_token_bucket(
            bytes_per_sec in 10_000u64..=100_000_000_000,
            ops_per_sec in proptest::option::of(1_000u64..=2_000_000_000),
            chunk in 64u32..=16_384,
            steps in proptest::collection::vec((0u64..20_000, 1u64..=32_768), 1..400),
        ) {
            let r = PaceRate { bytes_per_sec, ops_per_sec, chunk_bytes: chunk };
            let mut p = Pacer::new(r, Duration::ZERO);
            let mut exact = ExactLanes::new(r);
            let (mut now, mut told) = (0u64, None::<u64>);
            for (dt, size) in steps {
                let size = size.min(2 * u64::from(chunk));
                // Never late: a refused caller comes back at the latest when told.
                let dt = told.map_or(dt, |w| dt.min(w));
                now += dt;
                exact.advance(dt);
                let eps = exact.eps();
                match p.try_release(Duration::from_nanos(now), size, 1) {
                    Ok(()) => {
                        let checked = exact.release(&eps, [size, 1]);
                        proptest::prop_assert!(checked.is_ok(), "{:?}", checked);
                        told = None;
                    }
                    Err(wait) => {
                        let wait = wait.as_nanos() as f64;
                        let reference = exact.wait_ns();
                        let slack = eps.iter().copied().fold(0.0, f64::max) + 1.0;
                        proptest::prop_assert!(
                            (wait - reference).abs() <= slack,
                            "told {wait} ns, the exact bucket {reference} ns"
                        );
                        told = Some(wait as u64);
                    }
                }
            }
        }
    }
    proptest::proptest! {
        /// With releases asked without the time mixed in at random (as the shaper's fast
        /// lane asks, falling back to the clock when refused), every request the pacer
        /// releases is one an exact token bucket charged at the true times would release
        /// too, up to the rounding stated above: charging unclocked releases at the next
        /// reading only ever leaves the pacer with less credit, never more.
        #[test]
        fn releases_without_the_time_never_exceed_an_exact_token_bucket(
            bytes_per_sec in 10_000u64..=100_000_000_000,
            ops_per_sec in proptest::option::of(1_000u64..=2_000_000_000),
            chunk in 64u32..=16_384,
            steps in proptest::collection::vec(
                (0u64..20_000, 1u64..=32_768, proptest::bool::ANY),
                1..400,
            ),
        ) {
            let r = PaceRate { bytes_per_sec, ops_per_sec, chunk_bytes: chunk };
            let mut p = Pacer::new(r, Duration::ZERO);
            let mut exact = ExactLanes::new(r);
            let (mut now, mut told) = (0u64, None::<u64>);
            for (dt, size, unclocked) in steps {
                let size = size.min(2 * u64::from(chunk));
                let dt = told.map_or(dt, |w| dt.min(w));
                now += dt;
                exact.advance(dt);
                let eps = exact.eps();
                let released = if unclocked && p.try_release_unclocked(size, 1) {
                    Ok(())
                } else {
                    p.try_release(Duration::from_nanos(now), size, 1)
                };
                match released {
                    Ok(()) => {
                        let checked = exact.release(&eps, [size, 1]);
                        proptest::prop_assert!(checked.is_ok(), "{:?}", checked);
                        told = None;
                    }
                    Err(wait) => told = Some(wait.as_nanos() as u64),
                }
            }
        }
    }

    /// A rate's own operation burst, with the default window of 1 us: max(2, 1 us x rate)
    /// operations, or none when operations are not paced.
    #[test]
    fn a_rates_operation_burst_is_two_or_a_microsecond_of_operations() {
        let fast = PaceRate {
            ops_per_sec: Some(50_000_000),
            ..rate(1_000_000_000, 4096)
        };
        assert_eq!(fast.burst_ops(), Some(50), "1 us at 5 x 10^7 ops/s");
        let slow = PaceRate {
            ops_per_sec: Some(1_000),
            ..fast
        };
        assert_eq!(slow.burst_ops(), Some(BURST_CHUNKS));
        assert_eq!(rate(1_000_000_000, 4096).burst_ops(), None);
    }

    /// "A balance that reaches its cap with nobody late forgives what is owed": a lane
    /// owing 8 units' time, 9 units of credit of 10, refilled by 3 units' time with nobody
    /// late is full and owes nothing, so an overdraft of 2 units is repaid at the rate
    /// alone (2 units' time), not at twice the rate.
    #[test]
    fn a_full_balance_with_nobody_late_forgives_what_is_owed() {
        let mut lane = Lane::full(1_000_000, 10);
        let unit = i128::from(lane.cost);
        lane.balance = 9 * unit;
        lane.owed = 8 * unit;
        lane.refill(3 * unit, 0);
        assert_eq!(lane.balance, lane.cap);
        assert_eq!(lane.owed, 0);
        lane.charge(12);
        assert_eq!(lane.wait(), 2 * unit);
    }

    /// While something is owed a debt is repaid at twice the rate: 2 units' debt with 8
    /// owed waits 1 unit's time.
    #[test]
    fn while_something_is_owed_a_debt_is_repaid_at_twice_the_rate() {
        let mut lane = Lane::full(1_000_000, 10);
        let unit = i128::from(lane.cost);
        lane.balance = -2 * unit;
        lane.owed = 8 * unit;
        assert_eq!(lane.wait(), unit);
    }

    /// Rephasing moves a debt later by less than a period onto its slot, and says whether
    /// it moved: a debt of 30 ticks onto slot 50 of 100 becomes 50; one already at its slot
    /// stays (false); a lane at rest waits its slot, at most one tick short of the period
    /// even for a phase of 1.
    #[test]
    fn rephasing_moves_a_debt_onto_its_slot_within_a_period() {
        let mut lane = Lane::full(1_000_000, 10);
        lane.balance = -30;
        assert!(lane.rephase(0.5, 100, false));
        assert_eq!(lane.balance, -50);
        assert!(!lane.rephase(0.5, 100, false), "already at its slot");
        assert_eq!(lane.balance, -50);
        let mut rest = Lane::full(1_000_000, 10);
        assert!(rest.rephase(1.0, 100, true));
        assert_eq!(rest.balance, -99);
    }

    /// A new rate keeps what is owed in units: 4 units' time owed at 1 M units/s is 4
    /// units' time at 2 M units/s.
    #[test]
    fn a_new_rate_keeps_what_is_owed_in_units() {
        let mut lane = Lane::full(1_000_000, 10);
        lane.owed = 4 * i128::from(lane.cost);
        let faster = lane.rerated(2_000_000, 10);
        assert_eq!(faster.owed, 4 * i128::from(faster.cost));
        assert_eq!(faster.cost * 2, lane.cost);
    }

    /// Operations taken from an allowance are charged to the operations' balance: a full
    /// pacer at 5 x 10^7 ops/s allows its burst of 50 operations; 3 charged leave 47.
    #[test]
    fn operations_charged_from_an_allowance_leave_the_rest_of_it() {
        let rate = PaceRate {
            ops_per_sec: Some(50_000_000),
            ..rate(1_000_000_000, 4096)
        };
        let mut p = Pacer::new(rate, Duration::ZERO);
        let (bytes, ops) = p.unclocked_allowance();
        assert_eq!(ops, Some(50));
        p.charge_unclocked(0, 3);
        assert_eq!(p.unclocked_allowance(), (bytes, Some(47)));
    }

    /// What a late return is owed is its lateness, not the credit that overflowed the cap:
    /// with 28 ms owed (a first return 30 ms late, into a cap of 2 ms), a return 10 ms past a
    /// wait of 0.5 ms refills 10.5 ms plus 10.5 ms repaid, 18 ms over the cap, of which 10
    /// are owed (27.5 in all). A debt of 78 ms then waits 78 - 27.5 = 50.5 ms: twice the rate
    /// while something is owed.
    #[test]
    fn a_late_return_is_owed_its_lateness_not_the_overflow() {
        let ms = Duration::from_millis;
        let mut p = waiting_one_ms();
        let mut now = ms(31);
        assert_eq!(drain(&mut p, now, 5_120), 3 * 5_120);
        assert_eq!(
            p.try_release(now, 5_120, 1),
            Err(Duration::from_micros(500))
        );
        now += Duration::from_micros(500) + ms(10);
        assert!(p.try_release(now, 80 * 5_120, 80).is_ok());
        assert_eq!(
            p.try_release(now, 5_120, 1),
            Err(Duration::from_micros(50_500))
        );
    }

    /// A new phase that moves only the bytes' debt still cancels the wait told before, when
    /// operations are paced too: a pacer waiting 1 ms moved to the middle of its period (the
    /// operations' lane, 1000 operations of credit, does not move) and back 30 ms later is
    /// not late, so it owes nothing and the next debt of one chunk waits the whole 1 ms.
    #[test]
    fn a_phase_that_moves_only_the_bytes_cancels_the_wait_told() {
        let r = PaceRate {
            bytes_per_sec: 5_120_000,
            ops_per_sec: Some(1_000_000_000),
            chunk_bytes: 5 * KIB,
        };
        let mut p = Pacer::new(r, Duration::ZERO);
        assert_eq!(drain(&mut p, Duration::ZERO, 5_120), 3 * 5_120);
        assert_eq!(
            p.try_release(Duration::ZERO, 5_120, 1),
            Err(Duration::from_millis(1))
        );
        p.set_rate_in_phase(Duration::ZERO, r, phase(0.5, 1));
        let now = Duration::from_millis(30);
        assert_eq!(drain(&mut p, now, 5_120), 3 * 5_120);
        assert_eq!(p.try_release(now, 5_120, 1), Err(Duration::from_millis(1)));
    }

    /// A charge after the release paces as one charge of the sum: a 64 B request released
    /// as one operation and then charged 16 more leaves the next one waiting exactly as
    /// long as one released as 17 operations does (at 1 M operations/s, 17 us less the
    /// burst's credit).
    #[test]
    fn a_charge_after_the_release_paces_as_one_charge_of_the_sum() {
        let r = PaceRate {
            bytes_per_sec: 1_000_000_000_000,
            ops_per_sec: Some(1_000_000),
            chunk_bytes: 64,
        };
        let mut after = Pacer::new(r, Duration::ZERO);
        let mut at_once = Pacer::new(r, Duration::ZERO);
        assert!(after.try_release(Duration::ZERO, 64, 1).is_ok());
        after.charge(0, 16);
        assert!(at_once.try_release(Duration::ZERO, 64, 17).is_ok());
        let wait = after.try_release(Duration::ZERO, 64, 1);
        assert!(wait.is_err(), "{wait:?}");
        assert_eq!(wait, at_once.try_release(Duration::ZERO, 64, 1));
    }

    /// After a hold, one chunk goes at once and the next a chunk's time later, where a
    /// flow back from idle has its burst; a debt from before the hold stands.
    #[test]
    fn a_flow_resuming_after_a_hold_goes_at_the_rate_without_its_burst() {
        let chunk = u64::from(KIB);
        let start = Duration::from_secs(1);
        let mut p = Pacer::new(rate(1_000_000, KIB), start);
        let later = start + Duration::from_millis(50);
        let mut idle = p.clone();
        assert_eq!(
            drain(&mut idle, later, chunk),
            3 * chunk,
            "the burst after idle"
        );
        p.resume_after_hold(later);
        assert_eq!(drain(&mut p, later, chunk), chunk, "one chunk after a hold");
        let wait = p.try_release(later, chunk, 1).unwrap_err();
        assert_eq!(wait, Duration::from_nanos(1_024_000), "then a chunk's time");
        // In debt when held: the debt is not forgiven.
        let mut owing = Pacer::new(rate(1_000_000, KIB), start);
        drain(&mut owing, start, chunk);
        owing.resume_after_hold(start);
        assert!(owing.try_release(start, chunk, 1).is_err());
    }
}
