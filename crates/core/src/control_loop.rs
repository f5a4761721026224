//! Justitia's per-host control loop as one sans-I/O state machine.
//!
//! [`ControlLoop`] owns everything the daemon of §4.2 decides: which flows are active and
//! how they count (flows of one tenant and class count once), the reference flow's
//! bookkeeping and its tail estimate, the SafeUtil controller, the chunk and token size
//! (5 KB with latency flows present, 1 MB without, §5.1) and the per-flow allotments. It
//! performs no I/O and reads no clock: a driver (the simulator's `justitia` policy, the
//! daemon) feeds it inputs stamped with `now` and carries out its outputs. The design
//! follows quinn-proto's `Connection`.
//!
//! # Inputs
//! - [`register_flow`](ControlLoop::register_flow) / [`remove_flow`](ControlLoop::remove_flow):
//!   a flow (class, tenant, weight, number of QPs) appears or goes. Registering a latency
//!   flow returns the soft admission verdict (§4.1).
//! - [`set_flow_active`](ControlLoop::set_flow_active): the flow has work (chunks to send)
//!   or has none. Only active flows count and receive a share (the paper's "active"); a
//!   flow that reports no work stays active for the idle grace (see below).
//! - [`probe_sent`](ControlLoop::probe_sent) / [`probe_completed`](ControlLoop::probe_completed)
//!   / [`probe_lost`](ControlLoop::probe_lost): the reference flow's 10 B WRITEs, by the
//!   [`ProbeId`] the loop hands out when one is sent.
//! - [`handle_timeout`](ControlLoop::handle_timeout): time has reached
//!   [`poll_timeout`](ControlLoop::poll_timeout).
//! - [`set_remote_reads`](ControlLoop::set_remote_reads) /
//!   [`read_guarantee_received`](ControlLoop::read_guarantee_received): the remote READ
//!   flows this host serves; a guarantee from a host this host's READ flows read from
//!   (see "Remote READs").
//!
//! # Outputs
//! - [`poll_event`](ControlLoop::poll_event): [`Event`]s in the order they happened
//!   (allotments changed, mode changed, probe due, probe lost, target measured).
//! - [`allotment`](ControlLoop::allotment): per resource-hungry flow the rate to enforce
//!   (bytes/s, ops/s), the chunk and token size, and the generation that set it; a
//!   [`Pacer`](crate::pacer::Pacer) enforces it ([`Allotment::pace_rate`], with
//!   [`Allotment::phase`]). Latency flows are never shaped and have no allotment.
//! - [`Event::ReadGuarantee`]: after every update while this host serves remote READ
//!   flows, the guarantee to send their requesters.
//! - [`safe_util`](ControlLoop::safe_util), [`current_p99`](ControlLoop::current_p99),
//!   [`target`](ControlLoop::target), [`mode`](ControlLoop::mode),
//!   [`last_action`](ControlLoop::last_action) for reports.
//!
//! # Call order
//! After any input, and whenever [`poll_timeout`](ControlLoop::poll_timeout) falls due:
//! call [`handle_timeout`](ControlLoop::handle_timeout) with the current time if it is due,
//! then drain [`poll_event`](ControlLoop::poll_event) until `None`, acting on each event
//! (on [`Event::ProbeDue`] send a probe and report it with
//! [`probe_sent`](ControlLoop::probe_sent); on [`Event::AllotmentsChanged`] read the
//! allotments and re-cut pending work if the chunk size changed; on
//! [`Event::ReadGuarantee`] send it to the hosts whose READ flows this one serves), then
//! sleep until the
//! new [`poll_timeout`](ControlLoop::poll_timeout). `now` must not go backwards; an
//! earlier `now` is treated as the latest one seen.
//!
//! # Decisions and their timing
//! Inputs never trigger a decision by themselves: they are recorded, and the *update*
//! that acts on them runs on the RefPeriod clock, in [`handle_timeout`](ControlLoop::handle_timeout).
//! An update takes L, B, T as they are now, steps the controller with Current99,
//! re-divides SafeUtil among the active resource-hungry flows (weighted max-min across
//! tenants, equal within a tenant: exactly what [`crate::allotment::allot_rates`] gives
//! with unbounded demands) and asks for a probe. So a flow that resumes gets its share back
//! at the next update, within one RefPeriod; one that goes idle gives its share to the
//! others at the first update after its idle grace.
//!
//! # Quiet cadence
//! The paper runs the reference flow only "in the presence of at least one
//! latency-sensitive flow" (§4.2), and without one the controller sets SafeUtil to MaxRate
//! at every update. So when the latest update counted no latency flow, had no probe
//! outstanding and none to ask for (no idle baseline to measure), and left no flow within
//! its idle grace, the loop is *quiet*: an update would change nothing, and the next one is
//! due [`LoopConfig::quiet_periods`] RefPeriods later instead of one ([`QUIET_PERIODS`],
//! 10: 5 ms). A driver that sleeps until [`poll_timeout`](ControlLoop::poll_timeout) then
//! wakes a tenth as often.
//!
//! Inputs are still acted on at once: an input that gives the next update something to
//! do (a flow starting or stopping work, a flow with work removed, a new target) *stirs*
//! the loop, and the update falls due at the first RefPeriod tick (a whole number of
//! RefPeriods after the latest update) at or after the input, the very update a loop
//! updating every RefPeriod would have acted on it at. The updates skipped in between
//! would have changed nothing, so a quiet loop takes the same decisions at the same times;
//! the control interval is still one RefPeriod: a flow that starts gets its share, and a
//! removed flow's share goes to the others, within one RefPeriod of the input; a flow that
//! stops gives its share away within its idle grace and one RefPeriod (1.5 ms by default),
//! during which the loop is not quiet. A latency flow that starts brings back an update
//! and a probe every RefPeriod from its first update on. Registering a flow that has no
//! work yet changes no decision and does not stir the loop.
//!
//! This is why a driver that sets `quiet_periods` above 1 must read
//! [`poll_timeout`](ControlLoop::poll_timeout) again after every input, not only after
//! [`handle_timeout`](ControlLoop::handle_timeout): an input can bring the deadline
//! earlier. A driver that sleeps until the deadline it read after the last update, and
//! takes inputs in between without looking again, would act on them only at the quiet
//! deadline, up to the quiet period late. So the default is 1, an update every RefPeriod,
//! which such a driver needs; the daemon, which reads the deadline again before every
//! sleep, runs with [`QUIET_PERIODS`].
//!
//! # Idle grace
//! A flow that reports no work keeps counting, and keeps its allotment, for
//! [`LoopConfig::idle_grace_periods`] RefPeriods (default [`IDLE_GRACE_PERIODS`], 2): it
//! counts as idle only once it has had no work for the whole grace, and gives its share to
//! the others at the first update after that, within the grace and one RefPeriod. A flow
//! that resumes within the grace never lost its share. Without the grace, two flows that
//! wait for each other (an RPC client and its server) each went idle while the other
//! worked, came back to a zero allotment, and waited for the next update to get its share:
//! they settled into about one request per RefPeriod (32 k requests/s instead of 5.4 M in
//! the simulator's RPC scenario). The price is that a flow that really stops holds its share
//! two to three RefPeriods instead of at most one. Removing a flow takes effect at the next
//! update, without grace.
//!
//! # Release phases
//! The paper enforces the allotments with one token stream per host: round robin among the
//! flows, one token every tau, so two flows' chunks never leave together. Here every flow
//! has its own pacer (one per process in the shaper), and pacers given their rates at the
//! same update, each with a full burst, release together and stay in step while backlogged:
//! in the simulator's J6 scenario (eight bandwidth flows, eight latency flows, IB-56) the
//! eight flows' 5 KB chunks reached the RNIC at once and the latency flows' p99 was 4.97 us,
//! above the 3.07 us of no shaping at all; with phases it is 2.25 us. So each allotment carries a
//! [`ReleasePhase`]: at every division that changes the set of flows sharing, and at every
//! change of chunk size, the n sharing flows get offsets 0, 1/n, ... of a release interval
//! (in the order of their ids) under a new epoch, and each pacer puts its flow's next
//! release that far into the interval from when it applies the allotment
//! ([`Pacer::set_rate_in_phase`](crate::pacer::Pacer::set_rate_in_phase)). Changes of
//! SafeUtil alone keep the epoch: they scale every flow's wait alike, so the spacing holds.
//!
//! # Target99 and the estimator window
//! Target99 is in the probe's own units: the p99 of the reference flow's post-to-completion
//! time of its 10 B WRITE (a full round trip; a perftest-style half round trip is another
//! quantity). It is given as [`Target99::Absolute`] or as [`Target99::IdleMultiple`] of
//! the probe's uncontended p99, measured from the first
//! [`LoopConfig::idle_samples`] probes sent and completed while no resource-hungry flow
//! was active; until then the controller holds.
//!
//! Current99 is the p99 of the last [`LoopConfig::window`] samples. The paper's 10000
//! samples at RefPeriod 0.5 ms keep a violation in the p99 for up to 5 s, so the
//! controller keeps halving long after the load that caused it is gone. The default here
//! is 1000 samples (0.5 s), and with the search law the window restarts at every decrease
//! (samples of probes sent before the decrease measured a load that no longer exists), so
//! one violation causes one halving. [`LoopConfig::paper`] keeps the paper's window, law
//! and memory.
//!
//! How the window decides a violation is [`LoopConfig::violation`]. The paper compares
//! Current99 of whatever the window holds ([`ViolationRule::Current99`], which
//! [`LoopConfig::paper`] keeps); but the nearest-rank p99 of fewer than 100 samples is
//! their largest, and the window restarts at every decrease, so one slow probe in a short
//! window halves SafeUtil again: with 0.9 % of probes slow (a true p99 well within the
//! target) that is 4.07 decreases a second and SafeUtil at 0.895 of MaxRate on average.
//!
//! The default is [`ViolationRule::Confident`] at [`FALSE_VIOLATION_RATE`] (10^-3 per
//! update): a violation needs so many samples above Target99 that a window whose probes
//! exceed it exactly 1 % of the time (a p99 at the target) shows as many with that
//! probability at most (see `decision_ranks`): 2 of up to 5 samples, 3 of 6 to 10, 6 of
//! 100, 22 of 1000; one slow probe is never enough. With 0.9 % of probes slow it makes no
//! decrease in 30 s (60 000 updates, SafeUtil at MaxRate throughout), nor at 1.1 %; it
//! still halves at the second of two slow probes in a row, and makes 1.8
//! decreases a second at 2 % slow, 15 at 5 %.
//!
//! What the scenarios' latency figures need is not the halving on one sample but a young
//! window that decides on few samples: after a decrease the search climbs back, and the
//! violation that stops it must be seen within a few probes. [`ViolationRule::HeldP99`]
//! (the newest three samples all above the target, or Current99 of at least 100 samples)
//! and `Confident(1e-4)` (2 of 2 or 3 of 3 in a fresh window) let it climb for tens of
//! milliseconds: the simulator's J6 p99 gain fell from 10.8 (Current99) to 6.2 and 6.3,
//! A2's from 6.34 to 4.38 and 4.39, while 10^-3 and 10^-2 (2 of up to 5) keep 9.85 and
//! 6.26. That 9 % of J6's gain is the price of the default against Current99; J1's
//! bandwidth shares are 0.537 and 0.523 of the link (0.529 and 0.518). The rules compared
//! with 0.9 % of probes slow: Current99 4.07 decreases a second, HeldP99 2.67, 10^-2
//! 0.03, 10^-3 and 10^-4 none. Under all but Current99, the probes of a violation went
//! at the rates of the latest updates, so a decrease caps the search's ceiling at the
//! lowest of them ([`SafeUtilController::lower_ceiling`]).
//!
//! A probe neither completed nor reported lost within [`LoopConfig::probe_timeout`] is
//! lost. A lost probe waited at least that long, so it is recorded as a sample of the
//! larger of the timeout and just above Target99: a violation sample whatever the target,
//! because a reference flow whose messages vanish is a reference flow in trouble.
//!
//! # Remote READs
//! A READ moves data out of the responder's RNIC, where it competes with the responder's
//! own flows, yet it is posted, and can only be paced, on the requester (§4.4). So the
//! responder's loop counts the remote READ flows it serves (the requesters' READ flows
//! that have work, told by the driver as [`RemoteReadUnit`]s: one per requester host,
//! tenant and class, at the tenant's weight, as it counts its own tenants) together with
//! its own active flows, L'+B'+T', and after every update announces the guarantee
//! 1/(L'+B'+T') of its MaxRate and MaxTput per unit of weight ([`crate::remote_read`]),
//! numbered so that a receiver orders them.
//!
//! On the requester a READ flow is marked as such
//! ([`set_flow_reads_from`](ControlLoop::set_flow_reads_from)): its data leaves the
//! responder's RNIC, not this host's, so it is not counted in this host's L, B, T and
//! takes no part in the division of this host's SafeUtil. Its allotment is the newest
//! guarantee heard from the host it reads from, times its tenant's weight, divided among
//! its tenant's active READ flows of its class against that host, from the next update on
//! (capacity may stay idle, as in the paper); with no guarantee (none heard yet, or
//! lapsed) it is MaxRate: nothing here constrains it (fail-open). A flow not so marked
//! that receives a guarantee is capped at it within its local share. A guarantee not renewed for
//! [`LoopConfig::read_guarantee_lifetime`] lapses: a responder that went away stops capping,
//! and one that restarted is believed as soon as its old guarantee has lapsed, whatever
//! its new epoch. The lifetime is a duration, not a count of RefPeriods, because what
//! renews a guarantee is the peer channel's resend of an unchanged grant, on the channel's
//! own clock: it must outlast that refresh times the losses in a row tolerated, plus one
//! ([`read_guarantee_lifetime`], checked by [`LoopConfig::check_grant_refresh`]), whatever
//! the RefPeriod. The guarantee does not change the responder's own division: its flows
//! share SafeUtil as before, and its controller sees the READ responses' effect on its
//! probe like any other load.
//!
//! # Invariants
//! - the controller updates at most once per RefPeriod, however often inputs arrive, and
//!   at least once per RefPeriod while the loop is not quiet;
//! - allotments are given only to active resource-hungry flows (a flow within its idle
//!   grace is active), an idle flow's is zero, and the active flows' rates sum to SafeUtil
//!   (up to rounding) unless a READ flow is capped by its guarantee, which only lowers it;
//!   a flow marked as reading from another host takes no part in L, B, T or the sum;
//! - 0 < SafeUtil <= MaxRate, and SafeUtil >= the sharing floor of the active counts;
//! - the chunk size is the profile's chunk with latency flows when an active latency
//!   flow is counted, the one without otherwise;
//! - every generation number is larger than those before it.
//!
//! # Cost
//! An update runs every RefPeriod while the loop is not quiet, so it allocates nothing once the flows are registered
//! and does no map look-ups. L, B, T are kept up to date as flows change activity (per
//! tenant and class, a count of active flows, and the largest weight of its active
//! resource-hungry flows). A division after a change of flows takes two passes over the
//! tenants (the sum of their weights, then each one's share; tenants of equal weight and
//! flow count share one floating-point division) and hands each flow its tenant's share
//! in the pass that rewrites the allotments; no share waits on another's computation.
//! Only when the heaviest active flow of a tenant of mixed weights goes idle does a pass
//! over the flows find that tenant's new largest weight. The flows are kept in a vector in
//! no particular order, found through a hash map; a removed flow's place is taken by the
//! last one. While some flow is within its idle grace, an update also passes over the
//! flows to find those whose grace ran out (and stops once none is left in it), and while
//! some READ flow holds a guarantee, one to lapse those not renewed. While some flow is
//! marked as a READ requester's, a pass that rewrites the allotments sorts the marked
//! flows' (responder, tenant, class) keys to count each one's siblings: O(m log m) in the
//! m marked flows, and a buffer of m keys (a READ flow's allotment depends on its
//! siblings, not on this host's division). Release
//! phases go in id order, which the vector does not keep: when the set of sharing flows
//! may have changed, a division gathers the sharing flows with their places into a buffer
//! kept from one division to the next (grown as flows register, so it never grows in an
//! update) and sorts it by id, in time linear in the flows when their places are already
//! in id order; a division after a change of a latency flow alone, or an update without a
//! division, does neither.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use crate::allotment::Token;
use crate::controller::{
    Admission, ControlAction, ControlMode, ControllerConfig, ControllerError, IncreaseLaw,
    SafeUtilController,
};
use crate::estimator::{EstimatorError, Quantile, TailEstimator};
use crate::flow::{FlowClass, FlowCounts, FlowId, FlowSpec, TenantId};
use crate::pacer::{PaceRate, ReleasePhase};
use crate::profile::{ProfileError, RnicProfile};
use crate::remote_read::{
    InvalidReadGuarantee, ReadGuarantee, ReadGuaranteeReceiver, ReadGuaranteeSender, Receipt,
    RemoteReadUnit,
};

/// Target99, in the probe's units (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target99 {
    /// This p99 of the probe's post-to-completion time.
    Absolute(Duration),
    /// This multiple (at least 1) of the probe's uncontended p99, measured at start.
    IdleMultiple(f64),
}

/// The target in effect, for reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TargetReport {
    /// How the target was given.
    pub given: Target99,
    /// The probe's uncontended p99, once measured (`None` for a loop that started with an
    /// absolute target and has not been given an idle multiple since).
    pub idle_p99: Option<Duration>,
    /// Target99 in effect, `None` while an idle multiple waits for its measurement.
    pub value: Option<Duration>,
}

/// Settings of the loop. [`Default`] is the regulating configuration described in the
/// module documentation; [`LoopConfig::paper`] the paper's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoopConfig {
    /// Target99.
    pub target: Target99,
    /// RefPeriod: the probe interval and the least time between two updates (0.5 ms).
    pub ref_period: Duration,
    /// Samples in Current99's window (default 1000; the paper's is 10000).
    pub window: usize,
    /// How the window decides a violation (default [`ViolationRule::Confident`] at
    /// [`FALSE_VIOLATION_RATE`]); see the
    /// module documentation's "Target99 and the estimator window".
    pub violation: ViolationRule,
    /// How SafeUtil grows while the target is met (default [`IncreaseLaw::SEARCH`]).
    pub increase: IncreaseLaw,
    /// The paper's fixed step, used by [`IncreaseLaw::Fixed`] (fraction of MaxRate).
    pub increase_step: f64,
    /// delta of the unattainable-target mode (§4.5, 5 s); `None` turns the mode off.
    pub unattainable_after: Option<Duration>,
    /// How long a probe may take before it counts as lost (default 5 ms: ten RefPeriods,
    /// a thousand times a probe's round trip on an idle RNIC).
    pub probe_timeout: Duration,
    /// How many uncontended probe samples measure the idle p99 for
    /// [`Target99::IdleMultiple`] (default 100: a p99 of 100 samples is their second
    /// largest, so one outlier does not set the target).
    pub idle_samples: usize,
    /// RefPeriods a flow that reports no work keeps its share before it counts as idle
    /// (default [`IDLE_GRACE_PERIODS`]; 0 makes it idle at the next update). See the module
    /// documentation's "Idle grace".
    pub idle_grace_periods: u32,
    /// RefPeriods between updates while the loop is quiet: 1 (the default) keeps an update
    /// every RefPeriod; [`QUIET_PERIODS`] is the cadence for a driver that reads
    /// [`ControlLoop::poll_timeout`] again after every input. See the module
    /// documentation's "Quiet cadence".
    pub quiet_periods: u32,
    /// How long a remote-READ guarantee holds without a newer one (default
    /// [`DEFAULT_READ_GUARANTEE_LIFETIME`]). It must outlast the refreshes of the channel
    /// that carries guarantees: see [`read_guarantee_lifetime`] and
    /// [`LoopConfig::check_grant_refresh`].
    pub read_guarantee_lifetime: Duration,
}

/// How the window's samples decide a violation. See the module documentation's "Target99
/// and the estimator window" for what each costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ViolationRule {
    /// Current99 of whatever the window holds against Target99, as the paper compares it:
    /// on a window restarted by a decrease, the largest of its first samples.
    Current99,
    /// Only what a window can show: the newest [`VIOLATION_RUN`] samples all above the
    /// target; Current99 of a window of at least [`MIN_P99_SAMPLES`]; a shorter window
    /// only says the target is met (its newest three within it) or holds.
    HeldP99,
    /// As `HeldP99`, with Current99 replaced by a binomial bound: a violation needs so
    /// many samples above Target99 that a p99 exactly at the target gives as many with
    /// this probability at most, per update (e.g. [`FALSE_VIOLATION_RATE`]).
    Confident(f64),
}

/// A chance, per update, that a window whose probes exceed Target99 exactly 1 % of the
/// time is taken for a violation, for [`ViolationRule::Confident`] and the loop's default:
/// one update in a thousand. With 0.9 % of probes slow the default makes no decrease in
/// 30 s; see the module documentation for what lower and higher rates cost.
pub const FALSE_VIOLATION_RATE: f64 = 1e-3;

/// With a false-violation rate, this many newest samples all above Target99 are a
/// violation whatever the rest of the window shows: a p99 at the target gives such a run
/// with probability 0.01^3 = 10^-6 per update, and a load that has just begun to violate
/// is seen within three probes, not only once it has outweighed the window's older samples.
pub const VIOLATION_RUN: usize = 3;

/// The fewest samples whose nearest-rank p99 is not simply their largest: ceil(0.99 x 100)
/// = 99 < 100. A window of fewer samples cannot hold a p99, so the paper's rule decides
/// nothing on it.
pub const MIN_P99_SAMPLES: usize = 100;

/// The default idle grace, in RefPeriods: long enough that a flow waiting for a peer's reply
/// across one update does not lose its share, short enough that a flow that stops gives its
/// share away within 1.5 ms at the paper's RefPeriod.
pub const IDLE_GRACE_PERIODS: u32 = 2;

/// How often the peer channel resends an unchanged grant by default (`justitia-peer`'s
/// `DEFAULT_REFRESH`, 5 ms): what renews a READ guarantee while nothing changes.
pub const DEFAULT_GRANT_REFRESH: Duration = Duration::from_millis(5);

/// Refreshes in a row that may be lost without a READ guarantee lapsing, by default: three
/// (a loss of 1 % of datagrams loses three in a row once in 10^6 refreshes, 1.4 hours at
/// 5 ms).
pub const DEFAULT_REFRESH_LOSSES: u32 = 3;

/// A READ guarantee's lifetime by default: [`read_guarantee_lifetime`] of
/// [`DEFAULT_GRANT_REFRESH`] and [`DEFAULT_REFRESH_LOSSES`], 20 ms (the channel's default
/// silence, after which it drops a peer's grant itself).
pub const DEFAULT_READ_GUARANTEE_LIFETIME: Duration = Duration::from_millis(20);

/// The shortest lifetime of a READ guarantee renewed every `refresh` that survives
/// `losses_tolerated` lost renewals in a row: `refresh x (losses_tolerated + 1)`
/// (saturating). A lifetime below it lets a live responder's guarantee lapse, and the READ
/// flow run uncapped, between two refreshes.
pub fn read_guarantee_lifetime(refresh: Duration, losses_tolerated: u32) -> Duration {
    refresh.saturating_mul(losses_tolerated.saturating_add(1))
}

/// A READ guarantee's lifetime too short for the refresh of the channel that renews it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "control loop setting `read_guarantee_lifetime` ({lifetime:?}) is shorter than the peer \
     channel's `refresh` ({refresh:?}) x ({losses_tolerated} losses tolerated + 1) = \
     {needed:?}: a READ guarantee would lapse between refreshes and its flow run uncapped"
)]
pub struct GrantRefreshError {
    /// The loop's `read_guarantee_lifetime`.
    pub lifetime: Duration,
    /// The channel's refresh of an unchanged grant.
    pub refresh: Duration,
    /// Renewals in a row that may be lost.
    pub losses_tolerated: u32,
    /// The shortest lifetime that holds: [`read_guarantee_lifetime`] of the two.
    pub needed: Duration,
}

/// The quiet cadence for drivers that read [`ControlLoop::poll_timeout`] after every input,
/// in RefPeriods: 5 ms at the paper's RefPeriod, a tenth of the wake-ups of an update every
/// RefPeriod. A quiet update changes nothing (see the module documentation's "Quiet
/// cadence"), so the cadence only bounds how long the loop goes without one; 5 ms is the
/// default probe timeout, the longest the loop otherwise waits.
pub const QUIET_PERIODS: u32 = 10;

impl Default for LoopConfig {
    fn default() -> Self {
        let controller = ControllerConfig::default();
        LoopConfig {
            target: Target99::IdleMultiple(2.0),
            ref_period: controller.ref_period,
            window: 1_000,
            violation: ViolationRule::Confident(FALSE_VIOLATION_RATE),
            increase: IncreaseLaw::SEARCH,
            increase_step: controller.increase_step,
            unattainable_after: controller.unattainable_after,
            probe_timeout: Duration::from_millis(5),
            idle_samples: 100,
            idle_grace_periods: IDLE_GRACE_PERIODS,
            quiet_periods: 1,
            read_guarantee_lifetime: DEFAULT_READ_GUARANTEE_LIFETIME,
        }
    }
}

impl LoopConfig {
    /// The paper's loop: Pseudocode 1's fixed step and a 10000-sample window that is never
    /// restarted by a decrease, whose p99 is compared with the target, with this target.
    pub fn paper(target: Target99) -> Self {
        LoopConfig {
            target,
            window: TailEstimator::DEFAULT_WINDOW,
            violation: ViolationRule::Current99,
            increase: IncreaseLaw::Fixed,
            ..LoopConfig::default()
        }
    }

    /// How long a flow that reports no work keeps its share: `idle_grace_periods`
    /// RefPeriods (saturating).
    pub fn idle_grace(&self) -> Duration {
        self.ref_period.saturating_mul(self.idle_grace_periods)
    }

    /// The time between two updates while the loop is quiet: `quiet_periods` RefPeriods
    /// (saturating).
    pub fn quiet_period(&self) -> Duration {
        self.ref_period.saturating_mul(self.quiet_periods)
    }

    /// Checks the settings, naming the first one out of range.
    pub fn validate(&self) -> Result<(), LoopError> {
        match self.target {
            Target99::Absolute(d) if d.is_zero() => {
                return Err(LoopError::Setting("target", "must be positive".into()))
            }
            Target99::IdleMultiple(m) if !(m.is_finite() && m >= 1.0) => {
                return Err(LoopError::Setting(
                    "target",
                    format!("an idle multiple must be at least 1, got {m}"),
                ))
            }
            _ => {}
        }
        if self.window == 0 {
            return Err(LoopError::Setting("window", "must be at least 1".into()));
        }
        if let ViolationRule::Confident(alpha) = self.violation {
            if !(alpha > 0.0 && alpha < 1.0) {
                return Err(LoopError::Setting(
                    "violation",
                    format!("a false-violation rate must be in (0, 1), got {alpha}"),
                ));
            }
        }
        if self.violation != ViolationRule::Current99 && self.window < VIOLATION_RUN {
            return Err(LoopError::Setting(
                "window",
                format!(
                    "must hold at least {VIOLATION_RUN} samples to show a violation, got {}",
                    self.window
                ),
            ));
        }
        if self.probe_timeout.is_zero() {
            return Err(LoopError::Setting(
                "probe_timeout",
                "must be positive".into(),
            ));
        }
        if self.idle_samples == 0 {
            return Err(LoopError::Setting(
                "idle_samples",
                "must be at least 1".into(),
            ));
        }
        if self.read_guarantee_lifetime.is_zero() {
            return Err(LoopError::Setting(
                "read_guarantee_lifetime",
                "must be positive".into(),
            ));
        }
        if self.quiet_periods == 0 {
            return Err(LoopError::Setting(
                "quiet_periods",
                "must be at least 1 (1: an update every RefPeriod)".into(),
            ));
        }
        self.controller_config().validate()?;
        Ok(())
    }

    /// Checks the READ guarantee's lifetime against the peer channel that renews
    /// guarantees: it resends an unchanged grant every `refresh`, and up to
    /// `losses_tolerated` of those in a row may be lost. A driver calls it when it loads its
    /// settings, with its channel's refresh and [`DEFAULT_REFRESH_LOSSES`] (or its own).
    pub fn check_grant_refresh(
        &self,
        refresh: Duration,
        losses_tolerated: u32,
    ) -> Result<(), GrantRefreshError> {
        let needed = read_guarantee_lifetime(refresh, losses_tolerated);
        if self.read_guarantee_lifetime < needed {
            return Err(GrantRefreshError {
                lifetime: self.read_guarantee_lifetime,
                refresh,
                losses_tolerated,
                needed,
            });
        }
        Ok(())
    }

    fn controller_config(&self) -> ControllerConfig {
        ControllerConfig {
            // An idle multiple is replaced once measured; until then the controller holds.
            target_p99: match self.target {
                Target99::Absolute(d) => d,
                Target99::IdleMultiple(_) => Duration::MAX,
            },
            ref_period: self.ref_period,
            increase_step: self.increase_step,
            increase: self.increase,
            unattainable_after: self.unattainable_after,
            ..ControllerConfig::default()
        }
    }
}

/// Why the loop refused a setting or an input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoopError {
    /// A loop setting is out of range.
    #[error("control loop setting `{0}` {1}")]
    Setting(&'static str, String),
    /// The controller refused its settings.
    #[error("SafeUtil controller: {0}")]
    Controller(#[from] ControllerError),
    /// The estimator refused its settings.
    #[error("tail estimator: {0}")]
    Estimator(#[from] EstimatorError),
    /// A flow of that id is already registered.
    #[error("flow {0:?} is already registered")]
    DuplicateFlow(FlowId),
    /// No flow of that id is registered.
    #[error("flow {0:?} is not registered")]
    UnknownFlow(FlowId),
    /// The RNIC profile is unusable (a figure out of range).
    #[error(transparent)]
    Profile(#[from] ProfileError),
    /// A remote-READ guarantee from the network had figures out of range.
    #[error(transparent)]
    ReadGuarantee(#[from] InvalidReadGuarantee),
}

/// A flow as registered with the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowRegistration {
    /// Its id, tenant, class and weight.
    pub spec: FlowSpec,
    /// The queue pairs it posts on; they share its one allotment (and pacer), so opening
    /// more queue pairs wins no larger share.
    pub qps: u32,
}

/// What a resource-hungry flow may use, until the next change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Allotment {
    /// Bytes per second (zero while the flow is idle).
    pub bytes_per_sec: f64,
    /// Operations per second: bytes/s x MaxTput / MaxRate.
    pub ops_per_sec: f64,
    /// The size bandwidth flows' requests are cut to (§5.1).
    pub chunk_bytes: u32,
    /// The multi-resource token in effect (TokenBytes = the chunk size), for drivers that
    /// enforce with the paper's token stream.
    pub token: Token,
    /// Where in one release interval the flow's releases go, so that the flows' pacers
    /// release one after another as the paper's single token stream does; give it to
    /// [`Pacer::set_rate_in_phase`](crate::pacer::Pacer::set_rate_in_phase). See the module
    /// documentation's "Release phases".
    pub phase: ReleasePhase,
    /// The generation of the update that last changed this allotment.
    pub generation: u64,
}

impl Allotment {
    /// The allotment as a pacer's rate, paced by bytes and by operations. A positive rate
    /// is at least one unit per second, however small: a pacer takes zero for a pause, and
    /// a flow with a tiny share is paced slowly, not stopped.
    pub fn pace_rate(&self) -> PaceRate {
        PaceRate {
            bytes_per_sec: pace_units(self.bytes_per_sec),
            ops_per_sec: Some(pace_units(self.ops_per_sec)),
            chunk_bytes: self.chunk_bytes,
        }
    }
}

/// A rate in whole units per second for a pacer: truncated (`as` saturates, and maps NaN
/// to zero), and at least 1 when positive.
fn pace_units(rate: f64) -> u64 {
    if rate > 0.0 {
        (rate as u64).max(1)
    } else {
        0
    }
}

/// Identifies one probe (one reference message) between its sending and its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProbeId(pub u64);

/// Something the driver should know or do.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event {
    /// Allotments changed at this generation: read those whose generation equals it.
    AllotmentsChanged {
        /// The generation of the update.
        generation: u64,
    },
    /// The controller entered or left the unattainable-target mode.
    ModeChanged(ControlMode),
    /// Send one reference message now and report it with `probe_sent`.
    ProbeDue,
    /// A probe timed out and was recorded as a violation sample.
    ProbeLost(ProbeId),
    /// The idle p99 was measured and Target99 is now in effect.
    TargetMeasured {
        /// The probe's uncontended p99.
        idle_p99: Duration,
        /// Target99 in effect.
        target: Duration,
    },
    /// Send this guarantee to every host whose remote READ flows this host serves (see
    /// the module documentation's "Remote READs"); one after every update while there
    /// are any.
    ReadGuarantee(ReadGuarantee),
}

/// A registered flow. Its allotment (for a resource-hungry flow) is stored without the
/// chunk size and token: those are the loop's, the same for every allotment, because an
/// update that changes them rewrites them all.
#[derive(Debug, Clone)]
struct FlowState {
    spec: FlowSpec,
    /// Its tenant's index in `ControlLoop::tenants`.
    tenant: usize,
    qps: u32,
    active: bool,
    /// Since when an active flow has reported no work, while within its idle grace.
    idle_since: Option<Duration>,
    /// Fraction of SafeUtil, from the latest division.
    share: f64,
    /// Its release phase offset, from the latest division.
    phase: f64,
    bytes_per_sec: f64,
    ops_per_sec: f64,
    generation: u64,
    /// For a flow that READs from another host: the newest guarantee heard from it, and
    /// when; its allotment is capped at it until it lapses.
    read_cap: Option<(ReadGuaranteeReceiver, Duration)>,
    /// The chunk its requests are cut to when smaller than the loop's (a READ flow's
    /// guarantee's, from the latest allotment); `u32::MAX` otherwise.
    chunk_cap: u32,
    /// For a READ requester's flow: the host it reads from, in the driver's numbering. It
    /// is then not counted here (see "Remote READs").
    reads_from: Option<u64>,
}

impl FlowState {
    /// Whether the flow takes part in the division.
    fn shares(&self) -> bool {
        self.active && self.spec.class.is_resource_hungry() && self.reads_from.is_none()
    }
}

/// A tenant's aggregates, kept up to date by the inputs so that neither counting nor
/// dividing needs a map or a pass over the flows.
#[derive(Debug, Clone)]
struct TenantState {
    id: TenantId,
    /// Registered flows; the slot is freed when the last one goes.
    flows: u32,
    /// Active flows by class (latency, throughput, bandwidth): the tenant counts once in
    /// L, B or T while its count of that class is not zero.
    active: [u32; 3],
    /// The largest weight among its active resource-hungry flows (0 without any), and how
    /// many of them have it. When the last of those goes idle while others remain, the
    /// next largest is unknown: `weight_stale` says so until the next division finds it.
    weight: u32,
    weight_count: u32,
    weight_stale: bool,
    /// Each of its active resource-hungry flows' fraction of SafeUtil, from the latest
    /// division.
    flow_share: f64,
}

impl TenantState {
    /// Its active resource-hungry flows.
    fn hungry(&self) -> u32 {
        self.active[class_index(FlowClass::Throughput)]
            + self.active[class_index(FlowClass::Bandwidth)]
    }

    /// Counts an active resource-hungry flow of weight `weight` in the largest weight.
    fn add_weight(&mut self, weight: u32) {
        if weight > self.weight {
            self.weight = weight;
            self.weight_count = 1;
        } else if weight == self.weight {
            self.weight_count += 1;
        }
    }
}

/// One entry of a division's memo of fractions: tenants of equal weight and flow count get
/// the same fraction, so when many tenants share a few weights most need no division.
#[derive(Debug, Clone, Copy, Default)]
struct ShareMemo {
    /// The division it was computed in (divisions are numbered from 1).
    division: u64,
    weight: u32,
    flows: u32,
    flow_share: f64,
}

impl ShareMemo {
    /// Entries in the memo (direct-mapped: a tenant whose slot holds another key divides).
    const SLOTS: usize = 16;

    /// The memo slot of a tenant of `weight` with `flows` active resource-hungry flows.
    fn slot(weight: u32, flows: u32) -> usize {
        (weight.wrapping_mul(7) ^ flows) as usize % Self::SLOTS
    }
}

/// The index of a class in [`TenantState::active`].
fn class_index(class: FlowClass) -> usize {
    match class {
        FlowClass::Latency => 0,
        FlowClass::Throughput => 1,
        FlowClass::Bandwidth => 2,
    }
}

/// The count of a class in L, B, T.
fn class_count(counts: &mut FlowCounts, class: FlowClass) -> &mut u32 {
    match class {
        FlowClass::Latency => &mut counts.latency,
        FlowClass::Throughput => &mut counts.throughput,
        FlowClass::Bandwidth => &mut counts.bandwidth,
    }
}

#[derive(Debug, Clone, Copy)]
struct Outstanding {
    sent_at: Duration,
    /// Sent while no resource-hungry flow was active, in this activity epoch.
    idle_epoch: Option<u64>,
}

/// Target99 for an idle multiple: `multiple` times the idle p99, at least 1 ns, saturating.
fn idle_target(idle_p99: Duration, multiple: f64) -> Duration {
    Duration::try_from_secs_f64(idle_p99.as_secs_f64() * multiple)
        .unwrap_or(Duration::MAX)
        .max(Duration::from_nanos(1))
}

/// For every window length n from 0 to `window`, the rank of the sample a violation is
/// decided on (0 where none can be).
///
/// With `None`, the nearest-rank p99, from [`MIN_P99_SAMPLES`] samples on. With
/// `Some(alpha)`, the rank n + 1 - k, where k is the fewest samples above Target99 that a
/// window of probes exceeding it exactly 1 % of the time shows with probability at most
/// `alpha` (k is the smallest with P(Binomial(n, 0.01) >= k) <= alpha): the sample of that
/// rank exceeds Target99 exactly when k samples or more do. It is a distribution-free
/// lower confidence bound of the p99, and needs no minimum window: three slow probes of
/// three already decide (P = 10^-6), one of one does not (P = 10^-2).
fn decision_ranks(window: usize, alpha: Option<f64>) -> Vec<usize> {
    (0..=window).map(|n| decision_rank(n, alpha)).collect()
}

/// The rank [`decision_ranks`] gives a window of `n` samples.
fn decision_rank(n: usize, alpha: Option<f64>) -> usize {
    let Some(alpha) = alpha else {
        return if n >= MIN_P99_SAMPLES {
            Quantile::P99.rank(n)
        } else {
            0
        };
    };
    let p = 1.0 - Quantile::P99.get();
    // Walk the binomial's probabilities up from k = 0 until what is left of the tail,
    // P(X >= k), is at most alpha.
    let mut pmf = (1.0 - p).powi(i32::try_from(n).unwrap_or(i32::MAX));
    let mut tail = 1.0;
    let mut k = 0;
    while k <= n && tail > alpha {
        tail -= pmf;
        pmf *= (n - k) as f64 / (k + 1) as f64 * p / (1.0 - p);
        k += 1;
    }
    if tail > alpha || k == 0 {
        0
    } else {
        n + 1 - k
    }
}

/// Justitia's per-host loop. See the module documentation for the protocol.
#[derive(Debug, Clone)]
pub struct ControlLoop {
    config: LoopConfig,
    profile: RnicProfile,
    controller: SafeUtilController,
    estimator: TailEstimator,
    /// SafeUtil after each of the latest [`VIOLATION_RUN`] updates, newest at
    /// `updates % VIOLATION_RUN`: the rates the newest probes were sent at.
    recent_safe_util: [f64; VIOLATION_RUN],
    /// For a window of n samples, the rank of the sample the controller compares with
    /// Target99 (0: the window decides nothing); see [`decision_ranks`].
    decision_ranks: Vec<usize>,
    /// The idle baseline's samples, while it is being measured.
    baseline: Option<TailEstimator>,
    idle_p99: Option<Duration>,
    /// The registered flows, in no particular order (no result depends on it), and where
    /// each is in that vector.
    flows: Vec<FlowState>,
    flow_index: HashMap<FlowId, usize>,
    /// Tenants with registered flows, by slot; `tenant_slots` finds a tenant's slot and
    /// `free_tenants` lists the slots to reuse.
    tenants: Vec<TenantState>,
    tenant_slots: BTreeMap<TenantId, usize>,
    free_tenants: Vec<usize>,
    /// Some tenant's largest weight must be found again (see `TenantState::weight`).
    weights_stale: bool,
    /// The number of the latest division, and its memo of fractions.
    division: u64,
    share_memo: [ShareMemo; ShareMemo::SLOTS],
    /// The flows changed since the last update (counts and shares must be redone).
    flows_changed: bool,
    /// Active flows within their idle grace (`idle_since` set).
    draining: usize,
    /// L, B, T as of the latest update, and as of now.
    counts: FlowCounts,
    active_counts: FlowCounts,
    /// Active resource-hungry flows, and how many times that set has gone from empty to
    /// not empty (a baseline probe must not straddle one).
    hungry_active: usize,
    hungry_epoch: u64,
    chunk_bytes: u32,
    /// Outstanding probes in the order they were sent, which is the order of their ids
    /// and of their deadlines; a few at a time (a RefPeriod apart, lost after a timeout).
    probes: VecDeque<(ProbeId, Outstanding)>,
    next_probe: u64,
    /// Samples of probes sent before this time are not counted (the window restarted).
    forget_before: Duration,
    now: Duration,
    /// When the latest update ran (the loop's start before the first), and when the next
    /// one is due on the RefPeriod clock.
    last_update: Duration,
    next_update: Duration,
    /// The latest update left the loop quiet (see the module documentation's "Quiet
    /// cadence"), and since when an input has given the next update something to do.
    quiet: bool,
    stirred_at: Option<Duration>,
    last_action: Option<ControlAction>,
    generation: u64,
    /// The number of the latest assignment of release phases (counted on its own: an
    /// assignment at an update that changed no allotment must still be a new epoch).
    phase_epoch: u64,
    /// A resource-hungry flow changed activity since the last assignment of phases.
    sharing_changed: bool,
    /// The sharing flows' ids and places, sorted by id when phases are assigned; kept
    /// between divisions, and grown as flows register, so that no update allocates.
    phase_order: Vec<(FlowId, usize)>,
    updates: u64,
    events: VecDeque<Event>,
    /// The remote READ units this host serves, and the numbering of the guarantees it
    /// sends their requesters.
    remote_reads: Vec<RemoteReadUnit>,
    read_sender: ReadGuaranteeSender,
    /// Flows with a guarantee to lapse, and whether a guarantee changed since the last
    /// allotments (they must be rewritten).
    capped: usize,
    caps_changed: bool,
}

impl ControlLoop {
    /// A loop for an RNIC, starting at `now` with no flows; the first update is due one
    /// RefPeriod later.
    pub fn new(
        config: LoopConfig,
        profile: &RnicProfile,
        now: Duration,
    ) -> Result<Self, LoopError> {
        config.validate()?;
        profile.validate()?;
        let mut controller = SafeUtilController::new(config.controller_config(), profile)?;
        let chunk_bytes = profile.chunk_bytes(false);
        controller.set_token(Token::for_profile(u64::from(chunk_bytes), profile));
        let baseline = match config.target {
            Target99::IdleMultiple(_) => {
                Some(TailEstimator::new(config.idle_samples, Quantile::P99)?)
            }
            Target99::Absolute(_) => None,
        };
        Ok(ControlLoop {
            estimator: TailEstimator::new(config.window, Quantile::P99)?,
            decision_ranks: match config.violation {
                ViolationRule::Current99 => Vec::new(),
                ViolationRule::HeldP99 => decision_ranks(config.window, None),
                ViolationRule::Confident(alpha) => decision_ranks(config.window, Some(alpha)),
            },
            recent_safe_util: [profile.max_rate_bytes_per_sec(); VIOLATION_RUN],
            config,
            profile: profile.clone(),
            controller,
            baseline,
            idle_p99: None,
            flows: Vec::new(),
            flow_index: HashMap::new(),
            tenants: Vec::new(),
            tenant_slots: BTreeMap::new(),
            free_tenants: Vec::new(),
            weights_stale: false,
            division: 0,
            share_memo: [ShareMemo::default(); ShareMemo::SLOTS],
            flows_changed: false,
            draining: 0,
            counts: FlowCounts::default(),
            active_counts: FlowCounts::default(),
            hungry_active: 0,
            hungry_epoch: 0,
            chunk_bytes,
            probes: VecDeque::new(),
            next_probe: 0,
            forget_before: now,
            now,
            last_update: now,
            next_update: now.saturating_add(config.ref_period),
            quiet: false,
            stirred_at: None,
            last_action: None,
            generation: 0,
            phase_epoch: 0,
            sharing_changed: false,
            phase_order: Vec::new(),
            updates: 0,
            events: VecDeque::new(),
            remote_reads: Vec::new(),
            // Each loop is an incarnation of its host's sender: a driver's clock at start
            // grows from one to the next (within a boot; across one, lapsing covers it).
            read_sender: ReadGuaranteeSender::new(
                u64::try_from(now.as_nanos()).unwrap_or(u64::MAX),
            ),
            capped: 0,
            caps_changed: false,
        })
    }

    fn advance(&mut self, now: Duration) -> Duration {
        self.now = self.now.max(now);
        self.now
    }

    /// Registers a flow, idle until [`set_flow_active`](Self::set_flow_active) says it has
    /// work. For a latency flow, returns soft admission's verdict from Current99 as
    /// [`current_p99`](Self::current_p99) reports it now, or, while the window is empty,
    /// the latest one measured (a warning, never a refusal); other flows are always [`Admission::Admitted`].
    pub fn register_flow(
        &mut self,
        now: Duration,
        flow: FlowRegistration,
    ) -> Result<Admission, LoopError> {
        self.advance(now);
        let Entry::Vacant(entry) = self.flow_index.entry(flow.spec.id) else {
            return Err(LoopError::DuplicateFlow(flow.spec.id));
        };
        entry.insert(self.flows.len());
        let tenant = self.tenant_slot(flow.spec.tenant);
        self.tenants[tenant].flows += 1;
        self.flows.push(FlowState {
            spec: flow.spec,
            tenant,
            qps: flow.qps,
            active: false,
            idle_since: None,
            share: 0.0,
            phase: 0.0,
            bytes_per_sec: 0.0,
            ops_per_sec: 0.0,
            generation: self.generation,
            read_cap: None,
            chunk_cap: u32::MAX,
            reads_from: None,
        });
        // Room for every flow in the buffer that orders the sharing flows, so that no
        // division has to grow it.
        self.phase_order
            .reserve(self.flows.len().saturating_sub(self.phase_order.len()));
        Ok(match flow.spec.class {
            FlowClass::Latency => self
                .controller
                .admit_latency_flow_at(self.estimator.estimate()),
            _ => Admission::Admitted,
        })
    }

    /// Forgets a flow; its share goes to the others at the next update (no idle grace).
    pub fn remove_flow(&mut self, now: Duration, id: FlowId) -> Result<(), LoopError> {
        self.advance(now);
        let index = self.find(id).ok_or(LoopError::UnknownFlow(id))?;
        self.end_grace(index);
        self.count_activity(index, false);
        if self.flows[index].read_cap.is_some() {
            self.capped -= 1;
        }
        self.flow_index.remove(&id);
        let tenant = self.flows.swap_remove(index).tenant;
        if let Some(moved) = self.flows.get(index) {
            self.flow_index.insert(moved.spec.id, index);
        }
        let state = &mut self.tenants[tenant];
        state.flows -= 1;
        if state.flows == 0 {
            self.tenant_slots.remove(&state.id);
            self.free_tenants.push(tenant);
        }
        Ok(())
    }

    /// The remote READ units this host serves now (the requesters' flows that have work,
    /// one unit per requester host, tenant and class; the driver learns of them from the
    /// requesters). They count with the local flows in the guarantee this host announces
    /// after every update.
    pub fn set_remote_reads(&mut self, now: Duration, units: &[RemoteReadUnit]) {
        self.advance(now);
        let mut units = units.to_vec();
        units.sort_unstable();
        if units != self.remote_reads {
            self.remote_reads = units;
            self.stir();
        }
    }

    /// Marks a flow as a READ requester's flow against host `responder` (in the driver's
    /// numbering), or unmarks it with `None`: see "Remote READs". A marked flow leaves
    /// this host's L, B, T and division from the next update on.
    pub fn set_flow_reads_from(
        &mut self,
        now: Duration,
        id: FlowId,
        responder: Option<u64>,
    ) -> Result<(), LoopError> {
        self.advance(now);
        let index = self.find(id).ok_or(LoopError::UnknownFlow(id))?;
        if self.flows[index].reads_from == responder {
            return Ok(());
        }
        // Uncounted under the old marking, counted again under the new.
        let active = self.flows[index].active;
        self.count_activity(index, false);
        self.flows[index].reads_from = responder;
        self.count_activity(index, active);
        self.caps_changed = true;
        self.stir();
        Ok(())
    }

    /// The weighted count of this host's active units and the remote READ units it
    /// serves: the guarantee is 1 over it (see [`crate::remote_read`]).
    fn weighted_units(&self) -> u64 {
        let local: u64 = self
            .tenants
            .iter()
            .filter(|t| t.flows > 0)
            .map(|t| {
                let latency = u64::from(t.active[class_index(FlowClass::Latency)] > 0);
                let hungry = [FlowClass::Throughput, FlowClass::Bandwidth]
                    .iter()
                    .filter(|&&c| t.active[class_index(c)] > 0)
                    .count() as u64;
                latency + hungry * u64::from(t.weight.max(1))
            })
            .sum();
        let remote: u64 = self.remote_reads.iter().map(RemoteReadUnit::weighted).sum();
        local.saturating_add(remote)
    }

    /// A guarantee from the host a READ flow of this host reads from. A newer one caps the
    /// flow's allotment from the next update on; a stale one (reordered, replayed) is
    /// ignored. Refused, changing nothing, if its figures are out of range.
    pub fn read_guarantee_received(
        &mut self,
        now: Duration,
        id: FlowId,
        guarantee: ReadGuarantee,
    ) -> Result<Receipt, LoopError> {
        let now = self.advance(now);
        let index = self.find(id).ok_or(LoopError::UnknownFlow(id))?;
        let flow = &mut self.flows[index];
        if flow.read_cap.is_none() {
            self.capped += 1;
        }
        let (receiver, heard_at) = flow
            .read_cap
            .get_or_insert_with(|| (ReadGuaranteeReceiver::new(), now));
        let before = receiver
            .current()
            .map(|g| (g.bytes_per_sec, g.ops_per_sec, g.chunk_bytes));
        let receipt = match receiver.accept(guarantee) {
            Ok(receipt) => receipt,
            Err(e) => {
                if receiver.current().is_none() {
                    flow.read_cap = None;
                    self.capped -= 1;
                }
                return Err(e.into());
            }
        };
        if receipt == Receipt::Applied {
            *heard_at = now;
            let after = (
                guarantee.bytes_per_sec,
                guarantee.ops_per_sec,
                guarantee.chunk_bytes,
            );
            if before != Some(after) {
                self.caps_changed = true;
                self.stir();
            }
        }
        Ok(receipt)
    }

    /// The guarantee capping a flow's allotment now, if any.
    pub fn read_cap(&self, id: FlowId) -> Option<ReadGuarantee> {
        let flow = &self.flows[self.find(id)?];
        flow.read_cap
            .as_ref()
            .and_then(|(r, _)| r.current().copied())
    }

    /// Drops the guarantees not renewed for [`LoopConfig::read_guarantee_lifetime`]: a
    /// guarantee that lapses (its sender gone, or restarted in an epoch the receiver cannot
    /// order) stops capping.
    fn lapse_read_caps(&mut self, now: Duration) {
        let hold = self.config.read_guarantee_lifetime;
        for flow in &mut self.flows {
            if let Some((_, heard_at)) = flow.read_cap {
                if heard_at.saturating_add(hold) <= now {
                    flow.read_cap = None;
                    self.capped -= 1;
                    self.caps_changed = true;
                }
            }
        }
    }

    /// Where a flow is in `flows`.
    fn find(&self, id: FlowId) -> Option<usize> {
        self.flow_index.get(&id).copied()
    }

    /// The slot of a tenant, taking a free one for a tenant without flows.
    fn tenant_slot(&mut self, id: TenantId) -> usize {
        if let Some(&slot) = self.tenant_slots.get(&id) {
            return slot;
        }
        let state = TenantState {
            id,
            flows: 0,
            active: [0; 3],
            weight: 0,
            weight_count: 0,
            weight_stale: false,
            flow_share: 0.0,
        };
        let slot = match self.free_tenants.pop() {
            Some(slot) => {
                self.tenants[slot] = state;
                slot
            }
            None => {
                self.tenants.push(state);
                self.tenants.len() - 1
            }
        };
        self.tenant_slots.insert(id, slot);
        slot
    }

    /// Records whether a flow has work. A flow that has work counts from the next update
    /// on; one that has none keeps counting, and keeps its allotment, for the idle grace
    /// ([`LoopConfig::idle_grace`]) and counts as idle from the first update after it,
    /// unless it has work again by then.
    pub fn set_flow_active(
        &mut self,
        now: Duration,
        id: FlowId,
        active: bool,
    ) -> Result<(), LoopError> {
        let now = self.advance(now);
        let index = self.find(id).ok_or(LoopError::UnknownFlow(id))?;
        if active {
            // Back within the grace: it never lost its share.
            self.end_grace(index);
            self.count_activity(index, true);
            return Ok(());
        }
        let flow = &mut self.flows[index];
        if !flow.active || flow.idle_since.is_some() {
            return Ok(());
        }
        if self.config.idle_grace_periods == 0 {
            self.count_activity(index, false);
        } else {
            flow.idle_since = Some(now);
            self.draining += 1;
            self.stir();
        }
        Ok(())
    }

    /// Notes that the next update has something to act on: a quiet loop then runs it at
    /// the first RefPeriod tick from now, as a loop updating every RefPeriod would have.
    fn stir(&mut self) {
        self.stirred_at.get_or_insert(self.now);
    }

    /// Ends a flow's idle grace, if it is in one, without changing whether it counts.
    fn end_grace(&mut self, index: usize) {
        if self.flows[index].idle_since.take().is_some() {
            self.draining -= 1;
        }
    }

    /// Counts every flow whose idle grace has run out by `now` as idle. The flows are in no
    /// particular order, and none is needed: each is counted on its own, and a tenant whose
    /// largest weight goes with one of them has it found again at the division.
    fn expire_grace(&mut self, now: Duration) {
        let grace = self.config.idle_grace();
        for index in 0..self.flows.len() {
            if self.draining == 0 {
                break;
            }
            let expired = self.flows[index]
                .idle_since
                .is_some_and(|since| now >= since.saturating_add(grace));
            if expired {
                self.end_grace(index);
                self.count_activity(index, false);
            }
        }
    }

    /// Counts a flow as active or idle in L, B, T, the tenants' aggregates and the
    /// division of the next update.
    fn count_activity(&mut self, index: usize, active: bool) {
        let flow = &mut self.flows[index];
        if flow.active == active {
            return;
        }
        flow.active = active;
        self.stirred_at.get_or_insert(self.now);
        if flow.reads_from.is_some() {
            // Not counted here: only its own allotment changes.
            self.caps_changed = true;
            return;
        }
        self.flows_changed = true;
        let (class, weight) = (flow.spec.class, flow.spec.weight.get());
        let tenant = &mut self.tenants[flow.tenant];
        let tenant_count = &mut tenant.active[class_index(class)];
        let total = class_count(&mut self.active_counts, class);
        if active {
            if *tenant_count == 0 {
                *total += 1;
            }
            *tenant_count += 1;
        } else {
            *tenant_count -= 1;
            if *tenant_count == 0 {
                *total -= 1;
            }
        }
        if class.is_resource_hungry() && !tenant.weight_stale {
            if active {
                tenant.add_weight(weight);
            } else if tenant.hungry() == 0 {
                tenant.weight = 0;
                tenant.weight_count = 0;
            } else if weight == tenant.weight {
                tenant.weight_count -= 1;
                if tenant.weight_count == 0 {
                    tenant.weight_stale = true;
                    self.weights_stale = true;
                }
            }
        }
        if flow.spec.class.is_resource_hungry() {
            self.sharing_changed = true;
            if active {
                if self.hungry_active == 0 {
                    self.hungry_epoch += 1;
                }
                self.hungry_active += 1;
            } else {
                self.hungry_active -= 1;
            }
        }
    }

    /// Records that a probe was posted at `now`; returns its id, to be given back on its
    /// completion or loss.
    pub fn probe_sent(&mut self, now: Duration) -> ProbeId {
        let now = self.advance(now);
        let id = ProbeId(self.next_probe);
        self.next_probe += 1;
        let idle = self.baseline.is_some() && self.hungry_active == 0;
        self.probes.push_back((
            id,
            Outstanding {
                sent_at: now,
                idle_epoch: idle.then_some(self.hungry_epoch),
            },
        ));
        id
    }

    /// Takes an outstanding probe out.
    fn take_probe(&mut self, id: ProbeId) -> Option<Outstanding> {
        let index = self.probes.binary_search_by_key(&id, |&(id, _)| id).ok()?;
        self.probes.remove(index).map(|(_, probe)| probe)
    }

    /// Records a probe's completion at `now`. Returns false (and records nothing) for a
    /// probe that is unknown or already counted as lost.
    pub fn probe_completed(&mut self, now: Duration, id: ProbeId) -> bool {
        self.probe_completed_at(now, id, now)
    }

    /// Records, at `now`, a probe's completion that happened at `completed_at` (a driver
    /// that collects completions after the fact, stamped when they happened, and so
    /// need not wake up at each one). The latency is `completed_at` less the time the
    /// probe was sent; a `completed_at` after `now` counts as `now`. Returns false (and
    /// records nothing) for a probe that is unknown or already counted as lost.
    pub fn probe_completed_at(
        &mut self,
        now: Duration,
        id: ProbeId,
        completed_at: Duration,
    ) -> bool {
        let now = self.advance(now);
        let Some(probe) = self.take_probe(id) else {
            return false;
        };
        let latency = completed_at.min(now).saturating_sub(probe.sent_at);
        let uncontended = probe.idle_epoch == Some(self.hungry_epoch) && self.hungry_active == 0;
        if uncontended {
            self.record_idle_sample(latency);
        }
        self.record(probe.sent_at, latency);
        true
    }

    /// Records that a probe failed (e.g. an error completion): counted as lost at once.
    /// Returns false for a probe that is unknown or already counted.
    pub fn probe_lost(&mut self, now: Duration, id: ProbeId) -> bool {
        self.advance(now);
        match self.take_probe(id) {
            Some(probe) => {
                self.record_lost(id, probe);
                true
            }
            None => false,
        }
    }

    fn record_lost(&mut self, id: ProbeId, probe: Outstanding) {
        let floor = self.target_value().map_or(Duration::ZERO, |t| {
            t.saturating_add(Duration::from_nanos(1))
        });
        self.record(probe.sent_at, self.config.probe_timeout.max(floor));
        self.events.push_back(Event::ProbeLost(id));
    }

    /// Adds a sample to Current99's window unless its probe predates the window's restart.
    fn record(&mut self, sent_at: Duration, latency: Duration) {
        if sent_at >= self.forget_before {
            self.estimator.record(latency);
        }
    }

    fn record_idle_sample(&mut self, latency: Duration) {
        let Target99::IdleMultiple(multiple) = self.config.target else {
            return;
        };
        let Some(baseline) = &mut self.baseline else {
            return;
        };
        baseline.record(latency);
        if baseline.len() < self.config.idle_samples {
            return;
        }
        let Some(idle_p99) = baseline.estimate() else {
            return;
        };
        let target = idle_target(idle_p99, multiple);
        self.baseline = None;
        self.idle_p99 = Some(idle_p99);
        self.controller.set_target_p99(target);
        self.events
            .push_back(Event::TargetMeasured { idle_p99, target });
    }

    /// Changes Target99 at `now`, keeping everything else: SafeUtil and the controller's
    /// search, the registered flows and their allotments, Current99's window and the
    /// outstanding probes. The next update pursues the new target. An idle multiple
    /// applies at once when the idle p99 is known (measured at start, or for an earlier
    /// idle multiple); otherwise the controller holds SafeUtil until uncontended probes
    /// have measured it, as at start.
    pub fn set_target(&mut self, now: Duration, target: Target99) -> Result<(), LoopError> {
        self.advance(now);
        let config = LoopConfig {
            target,
            ..self.config
        };
        config.validate()?;
        let value = match target {
            Target99::Absolute(d) => Some(d),
            Target99::IdleMultiple(multiple) => {
                self.idle_p99.map(|idle| idle_target(idle, multiple))
            }
        };
        match value {
            Some(v) => {
                self.baseline = None;
                self.controller.set_target_p99(v);
            }
            None => {
                if self.baseline.is_none() {
                    self.baseline = Some(TailEstimator::new(config.idle_samples, Quantile::P99)?);
                }
                self.controller.set_target_p99(Duration::MAX);
            }
        }
        self.config = config;
        // An idle multiple waiting for its measurement wants probes at once.
        self.stir();
        Ok(())
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called: the next update
    /// or the first probe deadline, whichever is earlier. An input can bring it earlier
    /// (see the module documentation's "Quiet cadence"), so a driver reads it again after
    /// every input.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let update = self.update_due();
        let deadline = self
            .probes
            .front()
            .map(|(_, p)| p.sent_at.saturating_add(self.config.probe_timeout));
        Some(deadline.map_or(update, |d| d.min(update)))
    }

    /// When the next update is due: a RefPeriod after the latest one unless the loop is
    /// quiet; a quiet loop waits the quiet period, or, once an input stirred it, until the
    /// first RefPeriod tick at or after that input (the tick a loop updating every
    /// RefPeriod would have acted on it at, so the timing of decisions is the same).
    fn update_due(&self) -> Duration {
        if !self.quiet {
            return self.next_update;
        }
        let quiet_due = self.last_update.saturating_add(self.config.quiet_period());
        let Some(stirred) = self.stirred_at else {
            return quiet_due;
        };
        let Some(late) = stirred.checked_sub(self.next_update) else {
            return self.next_update;
        };
        let period = self.config.ref_period.as_nanos();
        let ticks = late.as_nanos().div_ceil(period);
        let tick = u64::try_from(ticks.saturating_mul(period)).unwrap_or(u64::MAX);
        self.next_update
            .saturating_add(Duration::from_nanos(tick))
            .min(quiet_due)
    }

    /// Whether the loop's state needs no update for a while: no latency flow counted (so
    /// no probe is due, §4.2), no probe outstanding, no baseline probe wanted, no flow in
    /// its idle grace (the update that calls it has just taken the changes of flows). Then
    /// an update would find SafeUtil
    /// at MaxRate, the allotments as they are, and nothing to ask for.
    fn is_quiet(&self) -> bool {
        self.config.quiet_periods > 1
            && self.counts.latency == 0
            && self.probes.is_empty()
            && !(self.baseline.is_some() && self.hungry_active == 0)
            && self.draining == 0
    }

    /// Expires probes past their timeout and runs the update if it is due. A call later
    /// than [`poll_timeout`](Self::poll_timeout) by more than the probe timeout means the
    /// driver stalled: the probes outstanding then are forgotten, not expired (their
    /// completions may be waiting unread, and a sample taken now would measure the stall).
    pub fn handle_timeout(&mut self, now: Duration) {
        let due = self.poll_timeout();
        let now = self.advance(now);
        if due.is_some_and(|due| now.saturating_sub(due) > self.config.probe_timeout) {
            self.probes.clear();
        }
        while let Some(&(id, probe)) = self.probes.front() {
            if probe.sent_at.saturating_add(self.config.probe_timeout) > now {
                break;
            }
            self.probes.pop_front();
            self.record_lost(id, probe);
        }
        if now >= self.update_due() {
            self.update(now);
            self.last_update = now;
            self.next_update = now.saturating_add(self.config.ref_period);
            self.stirred_at = None;
            self.quiet = self.is_quiet();
        }
    }

    /// One update: counts, controller, division, probe.
    fn update(&mut self, now: Duration) {
        self.updates += 1;
        if self.draining > 0 {
            self.expire_grace(now);
        }
        let redivide = std::mem::take(&mut self.flows_changed);
        if redivide {
            self.counts = self.active_counts;
        }
        let mut rechunked = false;
        let latency_present = self.counts.latency > 0;
        let chunk_bytes = self.profile.chunk_bytes(latency_present);
        if chunk_bytes != self.chunk_bytes {
            // Latency flows appeared or all left: the chunk and token follow (§5.1), and
            // the samples measured a mix of flows that is gone.
            self.chunk_bytes = chunk_bytes;
            self.controller
                .set_token(Token::for_profile(u64::from(chunk_bytes), &self.profile));
            self.restart_window(now);
            rechunked = true;
        }
        let before = (self.controller.safe_util(), self.controller.mode());
        let p99 = self
            .target_value()
            .and_then(|target| self.decision_p99(target));
        let action = self.controller.update(now, self.counts, p99);
        self.last_action = Some(action);
        if action == ControlAction::Decrease && self.config.violation != ViolationRule::Current99 {
            // The probes that showed the violation went at the rates of the latest updates:
            // the search's ceiling is the lowest of them, not the rate SafeUtil had climbed
            // to by the time they showed it.
            let began = self
                .recent_safe_util
                .iter()
                .copied()
                .fold(f64::MAX, f64::min);
            self.controller.lower_ceiling(now, began);
        }
        self.recent_safe_util[(self.updates % VIOLATION_RUN as u64) as usize] =
            self.controller.safe_util();
        if action == ControlAction::Decrease && self.config.increase != IncreaseLaw::Fixed {
            self.restart_window(now);
        }
        let mode = self.controller.mode();
        if std::mem::discriminant(&mode) != std::mem::discriminant(&before.1) {
            self.events.push_back(Event::ModeChanged(mode));
        }
        if redivide {
            self.divide();
        }
        if self.capped > 0 {
            self.lapse_read_caps(now);
        }
        // `capped` only decides whether the lapse pass runs; a wrong count would cost a
        // pass per update, or leave a guarantee held past its time. Checked in debug builds.
        debug_assert_eq!(
            self.capped,
            self.flows.iter().filter(|f| f.read_cap.is_some()).count(),
            "flows holding a READ guarantee"
        );
        let recapped = std::mem::take(&mut self.caps_changed);
        if redivide || rechunked || recapped || self.controller.safe_util() != before.0 {
            self.reallot(redivide, rechunked);
        }
        if latency_present || (self.baseline.is_some() && self.hungry_active == 0) {
            self.events.push_back(Event::ProbeDue);
        }
        if !self.remote_reads.is_empty() {
            let guarantee =
                self.read_sender
                    .announce(self.weighted_units(), latency_present, &self.profile);
            self.events.push_back(Event::ReadGuarantee(guarantee));
        }
    }

    /// What the controller is given to compare with `target` (see the module
    /// documentation's "Target99 and the estimator window"): the least of the newest
    /// [`VIOLATION_RUN`] samples when all of them exceed the target; otherwise the sample
    /// of the decision rank ([`decision_ranks`]) of a window that can hold a p99. A window
    /// too short for one gives the largest of its newest [`VIOLATION_RUN`] samples when all
    /// of them meet the target, and nothing otherwise (the controller holds).
    fn decision_p99(&self, target: Duration) -> Option<Duration> {
        if self.config.violation == ViolationRule::Current99 {
            return self.estimator.estimate();
        }
        let newest = self.estimator.newest_range(VIOLATION_RUN);
        if let Some((least, _)) = newest.filter(|&(least, _)| least > target) {
            return Some(least);
        }
        match self.decision_ranks.get(self.estimator.len()).copied() {
            Some(rank) if rank > 0 => self.estimator.at_rank(rank),
            _ => newest
                .map(|(_, greatest)| greatest)
                .filter(|&greatest| greatest <= target),
        }
    }

    fn restart_window(&mut self, now: Duration) {
        self.estimator.clear();
        self.forget_before = now;
    }

    /// Each tenant's fraction of SafeUtil per active resource-hungry flow: what
    /// `allot_rates` gives of SafeUtil 1 with every demand unbounded, computed the same way
    /// so that it is the same to the last bit. With unbounded demands the water level is
    /// reached at once: a tenant of weight w gets 1 x w / (the sum of the weights), and its
    /// n flows each get that divided by n. [`reallot`](Self::reallot) hands the fractions
    /// to the flows.
    fn divide(&mut self) {
        if std::mem::take(&mut self.weights_stale) {
            self.find_stale_weights();
        }
        // Integer weights sum exactly in f64, in any order, as they do in `allot_rates`.
        let total_weight: u64 = self
            .tenants
            .iter()
            .filter(|t| t.hungry() > 0)
            .map(|t| u64::from(t.weight))
            .sum();
        let total_weight = total_weight as f64;
        self.division += 1;
        for tenant in &mut self.tenants {
            let hungry = tenant.hungry();
            if hungry == 0 {
                continue;
            }
            let memo = &mut self.share_memo[ShareMemo::slot(tenant.weight, hungry)];
            if memo.division != self.division
                || memo.weight != tenant.weight
                || memo.flows != hungry
            {
                // `allot_rates` multiplies by the capacity, 1, which is exact; so is dividing
                // by one flow, skipped because a division costs more than the rest.
                let share = f64::from(tenant.weight) / total_weight;
                *memo = ShareMemo {
                    division: self.division,
                    weight: tenant.weight,
                    flows: hungry,
                    flow_share: if hungry == 1 {
                        share
                    } else {
                        share / f64::from(hungry)
                    },
                };
            }
            tenant.flow_share = memo.flow_share;
        }
    }

    /// The largest weight of every tenant marked stale, from its active flows.
    fn find_stale_weights(&mut self) {
        for tenant in self.tenants.iter_mut().filter(|t| t.weight_stale) {
            tenant.weight = 0;
            tenant.weight_count = 0;
        }
        for flow in self.flows.iter().filter(|f| f.shares()) {
            let tenant = &mut self.tenants[flow.tenant];
            if tenant.weight_stale {
                tenant.add_weight(flow.spec.weight.get());
            }
        }
        for tenant in &mut self.tenants {
            tenant.weight_stale = false;
        }
    }

    /// Rewrites the allotments from the shares and SafeUtil, taking each flow's share
    /// from its tenant after a division; all of them change with the chunk size. Emits an
    /// event if any changed.
    fn reallot(&mut self, divided: bool, rechunked: bool) {
        let generation = self.generation + 1;
        // New phases, or a new chunk size (a new release interval), are a new assignment:
        // every pacer moves its flow to its phase. A change of SafeUtil alone is not.
        let rephased = (divided && self.assign_phases()) || rechunked;
        if rephased {
            self.phase_epoch += 1;
        }
        let safe_util = self.controller.safe_util();
        let ops_per_byte = self.profile.ops_per_byte();
        let read_allotments = self.read_allotments();
        // In the order of places, as the pass below goes: each flow's entry, if it has one,
        // is the next.
        let mut read_allotments = read_allotments.iter().peekable();
        let mut changed = false;
        let tenants = &self.tenants;
        for (index, flow) in self.flows.iter_mut().enumerate() {
            if divided {
                flow.share = if flow.shares() {
                    tenants[flow.tenant].flow_share
                } else {
                    0.0
                };
            }
            if !flow.spec.class.is_resource_hungry() {
                continue;
            }
            let mut bytes_per_sec = flow.share * safe_util;
            let mut ops_per_sec = bytes_per_sec * ops_per_byte;
            let mut chunk_cap = u32::MAX;
            if let Some(&(_, allotted)) = read_allotments.next_if(|(i, _)| *i == index) {
                (bytes_per_sec, ops_per_sec, chunk_cap) = allotted;
            } else if let Some(cap) = flow.read_cap.as_ref().and_then(|(r, _)| r.current()) {
                // A READ flow gets no more than the host it reads from guarantees it
                // (§4.4), in that host's chunks.
                bytes_per_sec = bytes_per_sec.min(cap.bytes_per_sec);
                ops_per_sec = ops_per_sec.min(cap.ops_per_sec);
                chunk_cap = cap.chunk_bytes;
            }
            if rephased
                || flow.bytes_per_sec != bytes_per_sec
                || flow.ops_per_sec != ops_per_sec
                || flow.chunk_cap != chunk_cap
            {
                flow.bytes_per_sec = bytes_per_sec;
                flow.ops_per_sec = ops_per_sec;
                flow.chunk_cap = chunk_cap;
                flow.generation = generation;
                changed = true;
            }
        }
        if changed {
            self.generation = generation;
            self.events
                .push_back(Event::AllotmentsChanged { generation });
        }
    }

    /// The allotments of the READ requesters' flows (see "Remote READs"), in increasing
    /// order of place: the guarantee times the tenant's weight, divided among the tenant's
    /// active READ flows of the class against the same host; MaxRate without a guarantee.
    /// Allocates only while some flow is so marked. O(m log m) in the m marked flows: their
    /// (responder, tenant, class) keys are sorted once, and each flow's siblings are the
    /// run of its key, found by two binary searches.
    fn read_allotments(&self) -> Vec<(usize, (f64, f64, u32))> {
        let max = (
            self.profile.max_rate_bytes_per_sec(),
            self.profile.max_ops_per_sec(),
        );
        let marked = |f: &FlowState| f.reads_from.is_some() && f.spec.class.is_resource_hungry();
        let key = |f: &FlowState| (f.reads_from, f.spec.tenant, class_index(f.spec.class));
        let mut active: Vec<_> = self
            .flows
            .iter()
            .filter(|f| marked(f) && f.active)
            .map(key)
            .collect();
        active.sort_unstable();
        let mut out = Vec::new();
        for (index, flow) in self.flows.iter().enumerate().filter(|(_, f)| marked(f)) {
            if !flow.active {
                out.push((index, (0.0, 0.0, u32::MAX)));
                continue;
            }
            let Some(cap) = flow.read_cap.as_ref().and_then(|(r, _)| r.current()) else {
                out.push((index, (max.0, max.1, u32::MAX)));
                continue;
            };
            let own = key(flow);
            let siblings = (active.partition_point(|k| *k <= own)
                - active.partition_point(|k| *k < own))
            .max(1) as f64;
            // The responder's whole RNIC at most: its figures are its fraction of its
            // MaxRate and MaxTput.
            let scale = (cap.fraction * f64::from(flow.spec.weight.get())).min(1.0)
                / cap.fraction
                / siblings;
            out.push((
                index,
                (
                    cap.bytes_per_sec * scale,
                    cap.ops_per_sec * scale,
                    cap.chunk_bytes,
                ),
            ));
        }
        out
    }

    /// Gives the n flows that share offsets 0, 1/n, 2/n, ... in the order of their ids, and
    /// the others 0. Returns whether any offset changed.
    fn assign_phases(&mut self) -> bool {
        if !std::mem::take(&mut self.sharing_changed) {
            // The flows that share are those of the last assignment (a latency flow
            // changed, or a flow went and came back): every offset would stay.
            return false;
        }
        let mut changed = false;
        self.phase_order.clear();
        for (index, flow) in self.flows.iter_mut().enumerate() {
            if flow.shares() {
                self.phase_order.push((flow.spec.id, index));
            } else if flow.phase != 0.0 {
                flow.phase = 0.0;
                changed = true;
            }
        }
        // Ids are unique, so an unstable sort gives the one id order, and it sorts in place.
        self.phase_order.sort_unstable_by_key(|&(id, _)| id);
        let n = self.phase_order.len() as f64;
        for (rank, &(_, index)) in self.phase_order.iter().enumerate() {
            let offset = rank as f64 / n;
            let flow = &mut self.flows[index];
            if flow.phase != offset {
                flow.phase = offset;
                changed = true;
            }
        }
        changed
    }

    fn target_value(&self) -> Option<Duration> {
        match self.config.target {
            Target99::Absolute(d) => Some(d),
            Target99::IdleMultiple(_) => self.idle_p99.map(|_| self.controller.config().target_p99),
        }
    }

    /// The next event, oldest first.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// A resource-hungry flow's allotment; `None` for latency flows and unknown ids.
    pub fn allotment(&self, id: FlowId) -> Option<Allotment> {
        let flow = &self.flows[self.find(id)?];
        flow.spec.class.is_resource_hungry().then(|| Allotment {
            bytes_per_sec: flow.bytes_per_sec,
            ops_per_sec: flow.ops_per_sec,
            chunk_bytes: self.chunk_bytes.min(flow.chunk_cap),
            token: self.controller.token(),
            phase: ReleasePhase {
                offset: flow.phase,
                epoch: self.phase_epoch,
            },
            generation: flow.generation,
        })
    }

    /// The number of queue pairs a flow was registered with.
    pub fn flow_qps(&self, id: FlowId) -> Option<u32> {
        self.find(id).map(|i| self.flows[i].qps)
    }

    /// SafeUtil in bytes/s.
    pub fn safe_util(&self) -> f64 {
        self.controller.safe_util()
    }

    /// MaxRate in bytes/s.
    pub fn max_rate(&self) -> f64 {
        self.controller.max_rate()
    }

    /// The sharing floor of the counts in effect, in bytes/s.
    pub fn sharing_floor(&self) -> f64 {
        self.controller.sharing_floor(self.counts)
    }

    /// Current99: the p99 of the window (see the module documentation), `None` while it is
    /// empty.
    pub fn current_p99(&self) -> Option<Duration> {
        self.estimator.estimate()
    }

    /// The target in effect and how it was given.
    pub fn target(&self) -> TargetReport {
        TargetReport {
            given: self.config.target,
            idle_p99: self.idle_p99,
            value: self.target_value(),
        }
    }

    /// Whether the controller pursues Target99 or has given up on it (§4.5).
    pub fn mode(&self) -> ControlMode {
        self.controller.mode()
    }

    /// What the latest update did, `None` before the first.
    pub fn last_action(&self) -> Option<ControlAction> {
        self.last_action
    }

    /// L, B, T as counted at the latest update.
    pub fn counts(&self) -> FlowCounts {
        self.counts
    }

    /// The chunk size in effect for bandwidth flows.
    pub fn chunk_bytes(&self) -> u32 {
        self.chunk_bytes
    }

    /// The latest generation (0 before any allotment changed).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// How many updates have run.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// The settings the loop runs with.
    pub fn config(&self) -> &LoopConfig {
        &self.config
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::flow::Weight;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    fn flow(id: u64, class: FlowClass) -> FlowRegistration {
        FlowRegistration {
            spec: FlowSpec {
                id: FlowId(id),
                tenant: TenantId(id),
                class,
                weight: Weight::ONE,
            },
            qps: 1,
        }
    }

    /// A loop with a latency flow and an active bandwidth flow (ids 1 and 2).
    fn busy_loop(target: Target99) -> ControlLoop {
        busy_loop_with(target, ViolationRule::Current99)
    }

    /// As [`busy_loop`], deciding violations by `violation`.
    fn busy_loop_with(target: Target99, violation: ViolationRule) -> ControlLoop {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target,
            idle_samples: 10,
            violation,
            ..LoopConfig::default()
        };
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        lp.register_flow(Duration::ZERO, flow(1, FlowClass::Latency))
            .unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(1), true).unwrap();
        lp.register_flow(Duration::ZERO, flow(2, FlowClass::Bandwidth))
            .unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(2), true).unwrap();
        lp
    }

    /// A loop on RoCE-100 without flows, its target twice the idle p99 of 10 probes.
    fn idle_multiple_loop() -> ControlLoop {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::IdleMultiple(2.0),
            idle_samples: 10,
            ..LoopConfig::default()
        };
        ControlLoop::new(config, &profile, Duration::ZERO).unwrap()
    }

    /// Runs `periods` RefPeriods from `*t`, each probe taking `latency`.
    fn drive(lp: &mut ControlLoop, t: &mut Duration, periods: u32, latency: Duration) {
        for _ in 0..periods {
            *t += us(500);
            lp.handle_timeout(*t);
            while let Some(event) = lp.poll_event() {
                if event == Event::ProbeDue {
                    let id = lp.probe_sent(*t);
                    assert!(lp.probe_completed(*t + latency, id));
                }
            }
        }
    }

    /// An input of the quiet-cadence tests, at a time.
    #[derive(Clone, Copy)]
    enum Input {
        Register(u64, FlowClass),
        Active(u64, bool),
        Remove(u64),
    }

    /// What a driver saw: the time of every update, and every allotment change.
    #[derive(Default, Debug, PartialEq)]
    struct Trace {
        updates: Vec<Duration>,
        allotments: Vec<(Duration, u64, u64)>,
        probes: Vec<Duration>,
    }

    /// Drives a loop the way the daemon does until `end`: it sleeps until `poll_timeout`
    /// or the next scripted input, applies the input, and reads `poll_timeout` again.
    /// Probes take 10 us.
    fn follow(lp: &mut ControlLoop, script: &[(Duration, Input)], end: Duration) -> Trace {
        let mut trace = Trace::default();
        let mut script = script.iter().peekable();
        loop {
            let due = lp.poll_timeout().unwrap();
            let input = script.peek().map(|&&(t, _)| t);
            let now = match input {
                Some(t) if t <= due => t,
                _ => due,
            };
            if now > end {
                return trace;
            }
            if input == Some(now) {
                let (_, input) = script.next().unwrap();
                match *input {
                    Input::Register(id, class) => {
                        lp.register_flow(now, flow(id, class)).unwrap();
                    }
                    Input::Active(id, active) => {
                        lp.set_flow_active(now, FlowId(id), active).unwrap()
                    }
                    Input::Remove(id) => lp.remove_flow(now, FlowId(id)).unwrap(),
                }
            }
            let updates = lp.updates();
            if lp.poll_timeout().unwrap() <= now {
                lp.handle_timeout(now);
            }
            if lp.updates() != updates {
                trace.updates.push(now);
            }
            while let Some(event) = lp.poll_event() {
                match event {
                    Event::ProbeDue => {
                        trace.probes.push(now);
                        let id = lp.probe_sent(now);
                        assert!(lp.probe_completed(now + us(10), id));
                    }
                    Event::AllotmentsChanged { generation } => {
                        for id in 1..=8 {
                            if let Some(a) = lp.allotment(FlowId(id)) {
                                if a.generation == generation {
                                    trace.allotments.push((now, id, a.bytes_per_sec as u64));
                                }
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    fn quiet_loop(quiet_periods: u32) -> ControlLoop {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            quiet_periods,
            ..LoopConfig::default()
        };
        ControlLoop::new(config, &profile, Duration::ZERO).unwrap()
    }

    fn gaps(times: &[Duration]) -> Vec<Duration> {
        times.windows(2).map(|w| w[1] - w[0]).collect()
    }

    #[test]
    fn the_papers_loop_is_its_window_rule_and_law_with_the_given_target() {
        let target = Target99::Absolute(us(7));
        let paper = LoopConfig::paper(target);
        assert_eq!(paper.target, target);
        assert_eq!(paper.window, 10_000);
        assert_eq!(paper.violation, ViolationRule::Current99);
        assert_eq!(paper.increase, IncreaseLaw::Fixed);
        // The rest is the default's.
        let default = LoopConfig::default();
        assert_eq!(paper.ref_period, default.ref_period);
        assert_eq!(paper.probe_timeout, default.probe_timeout);
        assert_ne!(default.violation, ViolationRule::Current99);
    }

    /// A loop on RoCE-100 with one latency and one bandwidth flow, driven every RefPeriod of
    /// `config` with probes of `latency`, for `periods` updates; the time of each update.
    fn run_periods(lp: &mut ControlLoop, t: &mut Duration, periods: u32, latency: Duration) {
        for _ in 0..periods {
            *t += lp.config().ref_period;
            lp.handle_timeout(*t);
            while let Some(event) = lp.poll_event() {
                if event == Event::ProbeDue {
                    let id = lp.probe_sent(*t);
                    assert!(lp.probe_completed(*t + latency, id));
                }
            }
        }
    }

    fn loop_of(config: LoopConfig) -> ControlLoop {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        for (id, class) in [(1, FlowClass::Latency), (2, FlowClass::Bandwidth)] {
            lp.register_flow(Duration::ZERO, flow(id, class)).unwrap();
            lp.set_flow_active(Duration::ZERO, FlowId(id), true)
                .unwrap();
        }
        lp
    }

    #[test]
    fn the_controller_runs_on_the_loops_ref_period_delta_step_and_law() {
        // RefPeriod 10 ms, delta 50 ms, every probe slow: the second sample (update 3, at
        // 30 ms) starts the violation run, and each update adds its 10 ms gap to the time
        // observed (a gap counts up to ten RefPeriods), so delta is reached 50 ms later, at
        // 80 ms, and the mode changes then or at the next update. The controller's own default RefPeriod (0.5 ms) would count 5 ms an update
        // (130 ms); its default delta (5 s) would not give up at all.
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            ref_period: Duration::from_millis(10),
            unattainable_after: Some(Duration::from_millis(50)),
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        let mut entered = None;
        for _ in 0..20 {
            run_periods(&mut lp, &mut t, 1, us(100));
            if entered.is_none() && matches!(lp.mode(), ControlMode::Unattainable { .. }) {
                entered = Some(t);
            }
        }
        let entered = entered.unwrap_or_else(|| panic!("never gave up the target"));
        assert!(
            (Duration::from_millis(80)..=Duration::from_millis(90)).contains(&entered),
            "gave up at {entered:?}"
        );
        // The fixed law with a step of a tenth of MaxRate: from the floor (one halving,
        // 1/2), the first increase reaches 6/10 of MaxRate. The default step (1/1000) or the
        // search law would not.
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            increase: IncreaseLaw::Fixed,
            increase_step: 0.1,
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        run_periods(&mut lp, &mut t, 3, us(100));
        assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
        assert!((lp.safe_util() / lp.max_rate() - 0.5).abs() < 1e-9);
        while lp.last_action() != Some(ControlAction::Increase) {
            run_periods(&mut lp, &mut t, 1, us(10));
            assert!(t < Duration::from_millis(100), "no increase");
        }
        let fraction = lp.safe_util() / lp.max_rate();
        assert!(
            (fraction - 0.6).abs() < 1e-9,
            "SafeUtil {fraction} of MaxRate"
        );
        // The loop's default law, the search: the first increase after the halving from
        // MaxRate goes half-way back to it, to 3/4. The controller's own default, the
        // fixed step of 1/1000, would reach 0.501.
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        run_periods(&mut lp, &mut t, 3, us(100));
        assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
        while lp.last_action() != Some(ControlAction::Increase) {
            run_periods(&mut lp, &mut t, 1, us(10));
            assert!(t < Duration::from_millis(100), "no increase");
        }
        assert_eq!(lp.safe_util() / lp.max_rate(), 0.75);
    }

    #[test]
    fn only_active_resource_hungry_flows_share_safe_util() {
        // A latency flow, an active bandwidth flow, and one registered without work: the
        // active one is allotted the whole of SafeUtil.
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        });
        lp.register_flow(Duration::ZERO, flow(3, FlowClass::Bandwidth))
            .unwrap();
        let mut t = Duration::ZERO;
        run_periods(&mut lp, &mut t, 2, us(10));
        let active = lp.allotment(FlowId(2)).unwrap();
        assert!((active.bytes_per_sec / lp.safe_util() - 1.0).abs() < 1e-9);
        assert!(
            lp.allotment(FlowId(1)).is_none(),
            "a latency flow is never shaped"
        );
        assert!(lp
            .allotment(FlowId(3))
            .is_none_or(|a| a.bytes_per_sec == 0.0));
    }

    #[test]
    fn targets_rates_and_windows_out_of_range_are_refused_by_name() {
        let refused = |config: LoopConfig| match config.validate() {
            Err(LoopError::Setting(name, _)) => Some(name),
            _ => None,
        };
        let with = |target, window, violation| LoopConfig {
            target,
            window,
            violation,
            ..LoopConfig::default()
        };
        let (ok_target, rule) = (Target99::Absolute(us(5)), ViolationRule::HeldP99);
        assert_eq!(
            refused(with(Target99::Absolute(Duration::ZERO), 1000, rule)),
            Some("target")
        );
        assert_eq!(
            refused(with(
                Target99::Absolute(Duration::from_nanos(1)),
                1000,
                rule
            )),
            None
        );
        // A false-violation rate lies strictly between 0 and 1.
        for alpha in [0.0, 1.0, -0.1, f64::NAN] {
            let config = with(ok_target, 1000, ViolationRule::Confident(alpha));
            assert_eq!(refused(config), Some("violation"), "alpha {alpha}");
        }
        for alpha in [1e-9, 0.5, 0.999] {
            assert_eq!(
                refused(with(ok_target, 1000, ViolationRule::Confident(alpha))),
                None
            );
        }
        // A rule that needs VIOLATION_RUN samples needs a window that holds them; the
        // paper's rule decides on any window.
        for rule in [ViolationRule::HeldP99, ViolationRule::Confident(1e-3)] {
            assert_eq!(
                refused(with(ok_target, VIOLATION_RUN - 1, rule)),
                Some("window")
            );
            assert_eq!(refused(with(ok_target, VIOLATION_RUN, rule)), None);
        }
        assert_eq!(refused(with(ok_target, 1, ViolationRule::Current99)), None);
    }

    #[test]
    fn quiet_periods_zero_is_refused() {
        let config = LoopConfig {
            quiet_periods: 0,
            ..LoopConfig::default()
        };
        assert!(matches!(
            config.validate(),
            Err(LoopError::Setting("quiet_periods", _))
        ));
        // Off by default; the cadence for drivers that follow every input is 5 ms.
        assert_eq!(LoopConfig::default().quiet_period(), us(500));
        let config = LoopConfig {
            quiet_periods: QUIET_PERIODS,
            ..LoopConfig::default()
        };
        assert_eq!(config.quiet_period(), Duration::from_millis(5));
    }

    #[test]
    fn without_a_latency_flow_the_loop_updates_every_quiet_period() {
        let mut lp = quiet_loop(QUIET_PERIODS);
        let ms = Duration::from_millis;
        let script = [
            (Duration::ZERO, Input::Register(1, FlowClass::Bandwidth)),
            (Duration::ZERO, Input::Active(1, true)),
        ];
        let trace = follow(&mut lp, &script, ms(100));
        // The first update counts the flow; from then on nothing changes, so every update
        // is 5 ms after the one before: 20 in 100 ms instead of 200.
        assert_eq!(trace.updates[0], us(500));
        assert!(
            gaps(&trace.updates[1..]).iter().all(|&g| g == ms(5)),
            "{:?}",
            trace.updates
        );
        assert!(
            (19..=21).contains(&trace.updates.len()),
            "{}",
            trace.updates.len()
        );
        assert!(
            trace.probes.is_empty(),
            "no latency flow, no probe: {:?}",
            trace.probes
        );
        let max = lp.max_rate();
        assert_eq!(lp.allotment(FlowId(1)).unwrap().bytes_per_sec, max);
    }

    #[test]
    fn a_latency_flow_that_starts_brings_back_an_update_and_a_probe_every_ref_period_at_once() {
        let mut lp = quiet_loop(QUIET_PERIODS);
        let ms = Duration::from_millis;
        let start = ms(21) + us(130);
        let script = [
            (Duration::ZERO, Input::Register(1, FlowClass::Bandwidth)),
            (Duration::ZERO, Input::Active(1, true)),
            (start, Input::Register(2, FlowClass::Latency)),
            (start, Input::Active(2, true)),
            (ms(40) + us(70), Input::Active(2, false)),
        ];
        let trace = follow(&mut lp, &script, ms(80));
        // Quiet before: updates 5 ms apart, the last at 20.5 ms. The latency flow starts at
        // 21.13 ms: the next update is at the next RefPeriod tick, 21.5 ms, not 25.5 ms.
        let first = *trace.probes.first().unwrap();
        assert_eq!(first, ms(21) + us(500));
        // Then a probe and an update every RefPeriod while the latency flow is active
        // (its grace runs out at 41.07 ms, counted at the update of 41.5 ms)...
        let busy: Vec<_> = trace
            .updates
            .iter()
            .copied()
            .filter(|&t| t >= first && t <= ms(41) + us(500))
            .collect();
        assert_eq!(busy.len(), 41, "{busy:?}");
        assert!(gaps(&busy).iter().all(|&g| g == us(500)), "{busy:?}");
        assert_eq!(trace.probes.len(), 40, "{:?}", trace.probes);
        assert_eq!(*trace.probes.last().unwrap(), ms(41));
        // ...and quiet again after the update that counted it gone.
        let after: Vec<_> = trace
            .updates
            .iter()
            .copied()
            .filter(|&t| t >= ms(41) + us(500))
            .collect();
        assert!(gaps(&after).iter().all(|&g| g == ms(5)), "{after:?}");
        // The bandwidth flow was cut to 5 KB chunks while it counted, and back after.
        assert_eq!(
            lp.chunk_bytes(),
            RnicProfile::builtin("roce-100").unwrap().chunk_bytes(false)
        );
    }

    #[test]
    fn a_quiet_loop_takes_the_same_decisions_at_the_same_times_as_one_updating_every_ref_period() {
        let ms = Duration::from_millis;
        let script = [
            (Duration::ZERO, Input::Register(1, FlowClass::Bandwidth)),
            (Duration::ZERO, Input::Register(2, FlowClass::Bandwidth)),
            (Duration::ZERO, Input::Register(3, FlowClass::Throughput)),
            (Duration::ZERO, Input::Active(1, true)),
            (ms(12) + us(310), Input::Active(2, true)),
            (ms(30) + us(1), Input::Active(3, true)),
            (ms(30) + us(499), Input::Active(3, false)),
            (ms(30) + us(900), Input::Active(3, true)),
            (ms(47) + us(250), Input::Active(2, false)),
            (ms(63) + us(200), Input::Remove(3)),
            (ms(63) + us(500), Input::Register(4, FlowClass::Bandwidth)),
        ];
        let mut every = quiet_loop(1);
        let mut quiet = quiet_loop(QUIET_PERIODS);
        let reference = follow(&mut every, &script, ms(90));
        let trace = follow(&mut quiet, &script, ms(90));
        assert_eq!(trace.allotments, reference.allotments);
        assert!(
            reference.updates.len() >= 180,
            "{}",
            reference.updates.len()
        );
        assert!(
            trace.updates.len() < reference.updates.len() / 3,
            "{}",
            trace.updates.len()
        );
        // Flow 2 starts at 12.31 ms and has half the NIC at the next RefPeriod tick.
        let half = every.max_rate() / 2.0;
        assert!(trace
            .allotments
            .contains(&(ms(12) + us(500), 2, half as u64)));
        // Flow 2 stops at 47.25 ms: its grace ends at 48.25 ms, and flows 1 and 3 share its
        // third at 48.5 ms, within the grace and one RefPeriod.
        let third = (every.max_rate() / 3.0) as u64;
        let before = trace
            .allotments
            .iter()
            .rfind(|&&(t, id, _)| t < ms(48) && id == 1)
            .unwrap();
        assert_eq!(before.2, third, "{:?}", trace.allotments);
        let back = trace
            .allotments
            .iter()
            .find(|&&(t, id, _)| t > ms(47) + us(500) && id == 1)
            .unwrap();
        assert_eq!(*back, (ms(48) + us(500), 1, half as u64));
        // Flow 3, removed at 63.2 ms while active, leaves its share at 63.5 ms.
        let whole = every.max_rate() as u64;
        assert!(trace.allotments.contains(&(ms(63) + us(500), 1, whole)));
    }

    #[test]
    fn a_completion_collected_late_counts_the_time_it_happened() {
        let mut lp = busy_loop(Target99::Absolute(us(50)));
        let id = lp.probe_sent(us(100));
        // Seen 400 us later, on the next wake-up: the sample is the 20 us it took.
        assert!(lp.probe_completed_at(us(500), id, us(120)));
        let p99 = lp.current_p99().unwrap();
        assert!(p99 >= us(19) && p99 <= us(21), "{p99:?}");
        assert!(
            !lp.probe_completed_at(us(600), id, us(130)),
            "counted twice"
        );
        // A completion time after `now` counts as `now`.
        let id = lp.probe_sent(us(1_000));
        assert!(lp.probe_completed_at(us(1_030), id, us(9_000)));
        let p99 = lp.current_p99().unwrap();
        assert!(p99 >= us(29) && p99 <= us(31), "{p99:?}");
    }

    #[test]
    fn set_target_keeps_safe_util_flows_and_window_and_the_next_update_pursues_it() {
        let mut lp = busy_loop(Target99::Absolute(us(50)));
        let fresh_safe_util = lp.safe_util();
        let mut t = Duration::ZERO;
        // 60 us probes against a 50 us target: SafeUtil falls away from its start.
        drive(&mut lp, &mut t, 40, us(60));
        assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
        let before = lp.safe_util();
        assert!(
            before < 0.9 * fresh_safe_util,
            "SafeUtil {before} did not fall from {fresh_safe_util}"
        );
        let allotment = lp.allotment(FlowId(2)).unwrap();
        let p99 = lp.current_p99();
        let updates = lp.updates();

        lp.set_target(t, Target99::Absolute(us(100))).unwrap();
        assert_eq!(lp.safe_util(), before);
        assert_eq!(lp.allotment(FlowId(2)), Some(allotment));
        assert_eq!(lp.flow_qps(FlowId(1)), Some(1));
        assert_eq!(lp.counts().latency, 1);
        assert_eq!(lp.counts().bandwidth, 1);
        assert_eq!(lp.current_p99(), p99);
        assert_eq!(lp.updates(), updates);
        assert_eq!(lp.target().value, Some(us(100)));

        // The next update measures 60 us against the new 100 us target: no decrease, and
        // SafeUtil goes on from where it was, not from the start.
        drive(&mut lp, &mut t, 1, us(60));
        assert_ne!(lp.last_action(), Some(ControlAction::Decrease));
        assert!(lp.safe_util() >= before, "{} vs {before}", lp.safe_util());
        assert!(lp.safe_util() < fresh_safe_util, "{}", lp.safe_util());
    }

    /// A loop at `start` (the sender's epoch) on RoCE-100 with one active bandwidth flow
    /// (id 1) and the loop's update times.
    fn reading_loop(start: Duration) -> ControlLoop {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        };
        let mut lp = ControlLoop::new(config, &profile, start).unwrap();
        lp.register_flow(start, flow(1, FlowClass::Bandwidth))
            .unwrap();
        lp.set_flow_active(start, FlowId(1), true).unwrap();
        lp
    }

    /// Runs `periods` RefPeriods from `*t` and returns the guarantees announced.
    fn announced(lp: &mut ControlLoop, t: &mut Duration, periods: u32) -> Vec<ReadGuarantee> {
        let mut out = Vec::new();
        for _ in 0..periods {
            *t += us(500);
            lp.handle_timeout(*t);
            while let Some(event) = lp.poll_event() {
                if let Event::ReadGuarantee(g) = event {
                    out.push(g);
                }
            }
        }
        out
    }

    /// The default lifetime of a READ guarantee, 20 ms, in the tests' RefPeriods of 500 us.
    const LIFETIME_PERIODS: u32 = 40;

    fn guarantee(epoch: u64, sequence: u64, fraction: f64, profile: &RnicProfile) -> ReadGuarantee {
        ReadGuarantee {
            epoch,
            sequence,
            fraction,
            bytes_per_sec: fraction * profile.max_rate_bytes_per_sec(),
            ops_per_sec: fraction * profile.max_ops_per_sec(),
            chunk_bytes: 5 * 1024,
        }
    }

    #[test]
    fn a_responder_announces_one_over_its_flows_and_the_reads_it_serves_after_every_update() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let start = Duration::from_secs(7);
        let mut lp = reading_loop(start);
        lp.register_flow(start, flow(2, FlowClass::Latency))
            .unwrap();
        lp.set_flow_active(start, FlowId(2), true).unwrap();
        let mut t = start;
        assert!(
            announced(&mut lp, &mut t, 3).is_empty(),
            "no remote reads, nothing to say"
        );
        // Two remote READ flows: L' + B' + T' = 1 + 1 + 2 = 4.
        let unit = RemoteReadUnit {
            class: FlowClass::Bandwidth,
            weight: Weight::ONE,
        };
        lp.set_remote_reads(t, &[unit, unit]);
        let said = announced(&mut lp, &mut t, 3);
        assert_eq!(said.len(), 3, "one per update");
        for (i, g) in said.iter().enumerate() {
            assert_eq!(g.epoch, 7_000_000_000, "the loop's start");
            assert_eq!(g.sequence, i as u64);
            assert_eq!(g.fraction, 0.25);
            assert_eq!(g.bytes_per_sec, 0.25 * profile.max_rate_bytes_per_sec());
            assert_eq!(g.ops_per_sec, 0.25 * profile.max_ops_per_sec());
            assert_eq!(
                g.chunk_bytes,
                profile.chunk_bytes(true),
                "its latency flow's chunk"
            );
        }
        lp.set_remote_reads(t, &[]);
        assert!(announced(&mut lp, &mut t, 2).is_empty());
    }

    /// The issue's figure: a host that WRITEs to B and READs from B, no latency flow
    /// anywhere. Natively each flow gets the whole of its RNIC (48 + 48 Gb/s on the
    /// paper's 56 Gb/s IB): the WRITE's data leaves A's RNIC, the READ's leaves B's. A
    /// READ requester's flow counted in A's own L/B/T halved the WRITE for READs it never
    /// competes with; now the WRITE keeps A's whole SafeUtil and the READ gets B's
    /// guarantee, 1 of 1 unit at B.
    #[test]
    fn a_host_that_writes_and_reads_gets_its_write_flows_full_rate_not_half() {
        let profile = RnicProfile::builtin("IB-56").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        };
        let mut a = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        let mut b = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        let (write, read) = (FlowId(1), FlowId(2));
        a.register_flow(Duration::ZERO, flow(1, FlowClass::Bandwidth))
            .unwrap();
        a.register_flow(Duration::ZERO, flow(2, FlowClass::Bandwidth))
            .unwrap();
        a.set_flow_reads_from(Duration::ZERO, read, Some(7))
            .unwrap();
        a.set_flow_active(Duration::ZERO, write, true).unwrap();
        a.set_flow_active(Duration::ZERO, read, true).unwrap();
        // B serves A's one READ unit and has no flow of its own.
        b.set_remote_reads(
            Duration::ZERO,
            &[RemoteReadUnit {
                class: FlowClass::Bandwidth,
                weight: Weight::ONE,
            }],
        );
        let mut t = Duration::ZERO;
        let mut tb = Duration::ZERO;
        for _ in 0..4 {
            for g in announced(&mut b, &mut tb, 1) {
                a.read_guarantee_received(t, read, g).unwrap();
            }
            announced(&mut a, &mut t, 1);
        }
        let max = profile.max_rate_bytes_per_sec();
        assert_eq!(a.counts.bandwidth, 1, "the READ is not counted at A");
        assert_eq!(
            a.allotment(write).unwrap().bytes_per_sec,
            max,
            "not max / 2"
        );
        let capped = a.read_cap(read).expect("B's guarantee");
        assert_eq!(capped.fraction, 1.0, "B counts the READ unit alone");
        assert_eq!(a.allotment(read).unwrap().bytes_per_sec, max);
    }

    /// Weights apply across hosts: B holds a local bandwidth tenant of weight 1 and serves
    /// A's READ tenant of weight 3 (two flows): 1/4 of B per unit of weight, 3/4 for A's
    /// tenant, 3/8 of B's MaxRate for each of its two flows.
    #[test]
    fn a_read_tenant_gets_its_weighted_share_of_the_responder_split_among_its_flows() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut b = reading_loop(Duration::ZERO);
        b.set_remote_reads(
            Duration::ZERO,
            &[RemoteReadUnit {
                class: FlowClass::Bandwidth,
                weight: Weight::new(3).unwrap(),
            }],
        );
        let mut tb = Duration::ZERO;
        let g = *announced(&mut b, &mut tb, 2).last().unwrap();
        assert_eq!(g.fraction, 0.25);

        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        };
        let mut a = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        for id in [1, 2] {
            let mut reg = flow(id, FlowClass::Bandwidth);
            reg.spec.tenant = TenantId(9);
            reg.spec.weight = Weight::new(3).unwrap();
            a.register_flow(Duration::ZERO, reg).unwrap();
            a.set_flow_reads_from(Duration::ZERO, FlowId(id), Some(1))
                .unwrap();
            a.set_flow_active(Duration::ZERO, FlowId(id), true).unwrap();
            a.read_guarantee_received(Duration::ZERO, FlowId(id), g)
                .unwrap();
        }
        let mut t = Duration::ZERO;
        announced(&mut a, &mut t, 1);
        let each = 0.375 * profile.max_rate_bytes_per_sec();
        for id in [1, 2] {
            let got = a.allotment(FlowId(id)).unwrap();
            assert!((got.bytes_per_sec - each).abs() < 1.0, "{got:?}");
            assert_eq!(got.chunk_bytes, g.chunk_bytes);
        }
        assert_eq!(a.counts.total(), 0, "READ requesters count at B, not here");
    }

    /// The responder's own tenants count at their weight too: a local bandwidth tenant of
    /// weight 3 and a served READ tenant of weight 1 share its RNIC 3 to 1, so the READ
    /// tenant's guarantee is 1/4.
    #[test]
    fn a_responders_own_tenant_counts_at_its_weight_in_the_guarantee() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        };
        let mut b = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        let mut reg = flow(1, FlowClass::Bandwidth);
        reg.spec.weight = Weight::new(3).unwrap();
        b.register_flow(Duration::ZERO, reg).unwrap();
        b.set_flow_active(Duration::ZERO, FlowId(1), true).unwrap();
        let unit = RemoteReadUnit {
            class: FlowClass::Bandwidth,
            weight: Weight::ONE,
        };
        b.set_remote_reads(Duration::ZERO, &[unit]);
        let mut t = Duration::ZERO;
        let g = *announced(&mut b, &mut t, 2).last().unwrap();
        assert_eq!(g.fraction, 0.25);
    }

    /// Fail-open: a READ requester's flow whose guarantee lapses is no longer constrained
    /// (MaxRate), and one that goes idle gets nothing.
    #[test]
    fn a_read_requesters_flow_runs_unconstrained_once_its_guarantee_lapses() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut a = reading_loop(Duration::ZERO);
        a.set_flow_reads_from(Duration::ZERO, FlowId(1), Some(3))
            .unwrap();
        let mut t = Duration::ZERO;
        announced(&mut a, &mut t, 1);
        let max = profile.max_rate_bytes_per_sec();
        assert_eq!(a.allotment(FlowId(1)).unwrap().bytes_per_sec, max);
        a.read_guarantee_received(t, FlowId(1), guarantee(1, 0, 0.25, &profile))
            .unwrap();
        announced(&mut a, &mut t, 1);
        assert_eq!(a.allotment(FlowId(1)).unwrap().bytes_per_sec, 0.25 * max);
        announced(&mut a, &mut t, LIFETIME_PERIODS);
        assert_eq!(a.read_cap(FlowId(1)), None);
        assert_eq!(a.allotment(FlowId(1)).unwrap().bytes_per_sec, max);
        a.set_flow_active(t, FlowId(1), false).unwrap();
        announced(&mut a, &mut t, 4);
        assert_eq!(a.allotment(FlowId(1)).unwrap().bytes_per_sec, 0.0);
    }

    #[test]
    fn a_read_flow_is_capped_at_its_guarantee_from_the_next_update_and_stale_ones_are_ignored() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut lp = reading_loop(Duration::ZERO);
        let mut t = Duration::ZERO;
        announced(&mut lp, &mut t, 2);
        let alone = lp.allotment(FlowId(1)).unwrap();
        assert_eq!(alone.bytes_per_sec, lp.safe_util());

        let quarter = guarantee(3, 5, 0.25, &profile);
        assert_eq!(
            lp.read_guarantee_received(t, FlowId(1), quarter),
            Ok(Receipt::Applied)
        );
        assert_eq!(
            lp.allotment(FlowId(1)),
            Some(alone),
            "applied at the next update"
        );
        announced(&mut lp, &mut t, 1);
        let capped = lp.allotment(FlowId(1)).unwrap();
        assert_eq!(capped.bytes_per_sec, quarter.bytes_per_sec);
        assert_eq!(
            capped.ops_per_sec,
            quarter.ops_per_sec.min(alone.ops_per_sec)
        );
        assert_eq!(alone.chunk_bytes, profile.chunk_bytes(false));
        assert_eq!(
            capped.chunk_bytes, quarter.chunk_bytes,
            "cut to the responder's chunk"
        );
        assert_eq!(lp.read_cap(FlowId(1)), Some(quarter));

        // Reordered or replayed: an older message never raises the cap again.
        let older = guarantee(3, 4, 1.0, &profile);
        assert_eq!(
            lp.read_guarantee_received(t, FlowId(1), older),
            Ok(Receipt::Stale)
        );
        // Out of range: refused, nothing changes.
        let broken = ReadGuarantee {
            fraction: 2.0,
            ..guarantee(3, 6, 1.0, &profile)
        };
        assert!(matches!(
            lp.read_guarantee_received(t, FlowId(1), broken),
            Err(LoopError::ReadGuarantee(_))
        ));
        announced(&mut lp, &mut t, 1);
        assert_eq!(
            lp.allotment(FlowId(1)).unwrap().bytes_per_sec,
            quarter.bytes_per_sec
        );

        // The responder restarted: a new epoch is believed at once, whatever its sequence.
        let restarted = guarantee(4, 0, 0.5, &profile);
        assert_eq!(
            lp.read_guarantee_received(t, FlowId(1), restarted),
            Ok(Receipt::Applied)
        );
        announced(&mut lp, &mut t, 1);
        assert_eq!(
            lp.allotment(FlowId(1)).unwrap().bytes_per_sec,
            restarted.bytes_per_sec
        );
        assert_eq!(
            lp.read_guarantee_received(t, FlowId(9), restarted),
            Err(LoopError::UnknownFlow(FlowId(9)))
        );
    }

    #[test]
    fn a_guarantee_not_renewed_lapses_and_the_flow_gets_its_share_back() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut lp = reading_loop(Duration::ZERO);
        let mut t = Duration::ZERO;
        announced(&mut lp, &mut t, 1);
        let share = lp.allotment(FlowId(1)).unwrap().bytes_per_sec;
        let heard = t;
        lp.read_guarantee_received(t, FlowId(1), guarantee(1, 0, 0.25, &profile))
            .unwrap();
        announced(&mut lp, &mut t, 1);
        assert!(lp.allotment(FlowId(1)).unwrap().bytes_per_sec < share);
        // Still held one RefPeriod before it lapses, gone at the first update after.
        let hold = DEFAULT_READ_GUARANTEE_LIFETIME;
        while t + us(500) < heard + hold {
            announced(&mut lp, &mut t, 1);
        }
        assert!(lp.read_cap(FlowId(1)).is_some());
        announced(&mut lp, &mut t, 1);
        assert_eq!(lp.read_cap(FlowId(1)), None);
        assert_eq!(lp.allotment(FlowId(1)).unwrap().bytes_per_sec, share);
        // A message from the responder's next incarnation caps it again.
        lp.read_guarantee_received(t, FlowId(1), guarantee(0, 0, 0.5, &profile))
            .unwrap();
        announced(&mut lp, &mut t, 1);
        assert_eq!(
            lp.allotment(FlowId(1)).unwrap().bytes_per_sec,
            0.5 * profile.max_rate_bytes_per_sec()
        );
    }

    /// The count of flows holding a guarantee follows every way a guarantee goes: refused
    /// before any was held, lapsed, and the flow removed (the update's debug check compares
    /// it with the flows).
    #[test]
    fn every_way_a_guarantee_goes_is_counted() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut lp = reading_loop(Duration::ZERO);
        let mut t = Duration::ZERO;
        announced(&mut lp, &mut t, 1);
        let mut bad = guarantee(1, 0, 0.25, &profile);
        bad.fraction = 0.0;
        assert!(lp.read_guarantee_received(t, FlowId(1), bad).is_err());
        assert_eq!(lp.read_cap(FlowId(1)), None);
        announced(&mut lp, &mut t, 1);
        assert_eq!(lp.capped, 0);
        lp.read_guarantee_received(t, FlowId(1), guarantee(1, 0, 0.25, &profile))
            .unwrap();
        announced(&mut lp, &mut t, LIFETIME_PERIODS + 2);
        assert_eq!((lp.read_cap(FlowId(1)), lp.capped), (None, 0), "lapsed");
        lp.read_guarantee_received(t, FlowId(1), guarantee(2, 0, 0.25, &profile))
            .unwrap();
        assert_eq!(lp.capped, 1);
        lp.remove_flow(t, FlowId(1)).unwrap();
        assert_eq!(lp.capped, 0, "removed with its guarantee");
        announced(&mut lp, &mut t, 1);
    }

    /// A tenant's state is freed with its last flow, so a host where tenants come and go
    /// keeps as many as are there at once: 1000 tenants one after another use one state.
    #[test]
    fn tenants_that_come_and_go_leave_no_state_behind() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut lp = ControlLoop::new(LoopConfig::default(), &profile, Duration::ZERO).unwrap();
        for id in 1..=1000 {
            lp.register_flow(Duration::ZERO, flow(id, FlowClass::Bandwidth))
                .unwrap();
            lp.remove_flow(Duration::ZERO, FlowId(id)).unwrap();
        }
        assert_eq!(lp.tenants.len(), 1);
        assert!(lp.tenant_slots.is_empty());
    }

    /// A flow that says again that it is idle while in its grace keeps the grace it began
    /// with: it loses its share one grace after the first report, not after the last.
    #[test]
    fn an_idle_report_repeated_within_the_grace_does_not_restart_it() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut lp = ControlLoop::new(LoopConfig::default(), &profile, Duration::ZERO).unwrap();
        for id in [1, 2] {
            lp.register_flow(Duration::ZERO, flow(id, FlowClass::Bandwidth))
                .unwrap();
            lp.set_flow_active(Duration::ZERO, FlowId(id), true)
                .unwrap();
        }
        let mut t = Duration::ZERO;
        drive(&mut lp, &mut t, 2, us(2));
        let grace = lp.config().idle_grace();
        let idle_at = t;
        lp.set_flow_active(t, FlowId(2), false).unwrap();
        drive(&mut lp, &mut t, 1, us(2));
        lp.set_flow_active(t, FlowId(2), false).unwrap();
        // The first update at or after one grace from the first report.
        while t < idle_at + grace {
            drive(&mut lp, &mut t, 1, us(2));
        }
        assert_eq!(
            lp.counts().bandwidth,
            1,
            "flow 2 idle one grace after its first report"
        );
        assert_eq!(
            lp.allotment(FlowId(1)).unwrap().bytes_per_sec,
            lp.safe_util(),
            "flow 1 has the whole of SafeUtil"
        );
    }

    /// As in the daemon's guest test: the probes of the idle baseline are in the window,
    /// the target is then set below them, and a latency flow registers before any latency
    /// flow is counted. The verdict follows the Current99 an operator sees.
    #[test]
    fn a_latency_flow_is_judged_on_the_current99_shown_even_while_none_is_counted() {
        let mut lp = idle_multiple_loop();
        let mut t = Duration::ZERO;
        drive(&mut lp, &mut t, 20, us(20));
        assert!(lp.target().idle_p99.is_some(), "the baseline was measured");
        lp.set_target(t, Target99::Absolute(us(1))).unwrap();
        let shown = lp.current_p99().expect("the baseline's samples");
        assert_eq!(lp.counts().latency, 0);
        assert_eq!(
            lp.register_flow(t, flow(5, FlowClass::Latency)).unwrap(),
            Admission::TargetAtRisk {
                current_p99: shown,
                target_p99: us(1),
            }
        );
    }

    #[test]
    fn a_latency_flow_registered_while_the_window_is_empty_after_a_decrease_is_warned() {
        let mut lp = busy_loop(Target99::Absolute(us(50)));
        let mut t = Duration::ZERO;
        // 60 us probes against a 50 us target, until the first decrease restarts the window;
        // the probe asked for then is not sent (as when probes take longer than a RefPeriod).
        let measured = loop {
            t += us(500);
            let shown = lp.current_p99();
            lp.handle_timeout(t);
            if lp.last_action() == Some(ControlAction::Decrease) {
                while lp.poll_event().is_some() {}
                break shown.expect("the probes before the decrease completed");
            }
            while let Some(event) = lp.poll_event() {
                if event == Event::ProbeDue {
                    let id = lp.probe_sent(t);
                    assert!(lp.probe_completed(t + us(60), id));
                }
            }
        };
        assert_eq!(lp.current_p99(), None);
        assert_eq!(
            lp.register_flow(t, flow(3, FlowClass::Latency)).unwrap(),
            Admission::TargetAtRisk {
                current_p99: measured,
                target_p99: us(50),
            }
        );
    }

    #[test]
    fn set_target_to_an_idle_multiple_uses_the_measured_idle_p99_at_once() {
        let mut lp = idle_multiple_loop();
        let mut t = Duration::ZERO;
        // No resource-hungry flow: every probe is uncontended and measures the idle p99.
        drive(&mut lp, &mut t, 12, us(10));
        let idle = lp.target().idle_p99.unwrap();
        assert!(idle >= us(9) && idle <= us(11), "{idle:?}");
        lp.set_target(t, Target99::IdleMultiple(3.0)).unwrap();
        let value = lp.target().value.unwrap();
        assert_eq!(value, idle_target(idle, 3.0));
        assert_eq!(lp.controller.config().target_p99, value);
        lp.set_target(t, Target99::Absolute(us(70))).unwrap();
        assert_eq!(lp.target().value, Some(us(70)));
        assert_eq!(lp.target().idle_p99, Some(idle));
        // A bad target is refused and the one in effect stays.
        assert!(lp.set_target(t, Target99::IdleMultiple(0.5)).is_err());
        assert_eq!(lp.target().value, Some(us(70)));
    }

    #[test]
    fn set_target_to_an_idle_multiple_before_any_measurement_holds_until_measured() {
        let mut lp = busy_loop(Target99::Absolute(us(50)));
        let mut t = Duration::ZERO;
        drive(&mut lp, &mut t, 5, us(10));
        lp.set_target(t, Target99::IdleMultiple(2.0)).unwrap();
        assert_eq!(lp.target().value, None);
        // The bandwidth flow stops: probes are uncontended and measure the idle p99.
        lp.set_flow_active(t, FlowId(2), false).unwrap();
        drive(&mut lp, &mut t, 20, us(10));
        let value = lp.target().value.unwrap();
        assert!(value >= us(18) && value <= us(22), "{value:?}");
    }

    /// An idle-multiple loop measuring its baseline from 10 probes, with a bandwidth flow
    /// (id 2, registered idle) that loses its share the moment it reports no work (no
    /// idle grace), so that a busy spell can begin and end between two probe events.
    fn baseline_loop_with_a_bandwidth_flow() -> ControlLoop {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::IdleMultiple(2.0),
            idle_samples: 10,
            idle_grace_periods: 0,
            ..LoopConfig::default()
        };
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        lp.register_flow(Duration::ZERO, flow(2, FlowClass::Bandwidth))
            .unwrap();
        lp
    }

    /// Completes the baseline with 10 probes of 10 us sent and completed while no flow is
    /// active, from `t`, and returns the idle p99 measured. Every uncontended probe took
    /// 10 us, so a baseline of uncontended probes only has a p99 of exactly 10 us, and a
    /// target of twice that.
    fn measure_idle(lp: &mut ControlLoop, mut t: Duration) -> Duration {
        for i in 0..10 {
            assert_eq!(lp.target().idle_p99, None, "{i} samples of 10");
            let id = lp.probe_sent(t);
            t += us(10);
            assert!(lp.probe_completed(t, id));
        }
        let report = lp.target();
        assert_eq!(report.value, report.idle_p99.map(|p| p * 2));
        report
            .idle_p99
            .expect("10 uncontended probes measure the idle p99")
    }

    /// A probe sent while the NIC is idle but outstanding across a busy spell (a bandwidth
    /// flow starts and stops before it completes) saw contention: it is not an idle
    /// sample, although no hungry flow is active at either end. The spell advances the
    /// idle epoch the probe was sent in.
    #[test]
    fn a_probe_outstanding_across_a_busy_spell_is_not_an_idle_sample() {
        let mut lp = baseline_loop_with_a_bandwidth_flow();
        let straddling = lp.probe_sent(Duration::ZERO);
        lp.set_flow_active(us(1), FlowId(2), true).unwrap();
        lp.set_flow_active(us(2), FlowId(2), false).unwrap();
        assert_eq!(lp.counts().bandwidth, 0, "the spell is over");
        assert!(lp.probe_completed(us(1000), straddling));
        assert_eq!(lp.target().idle_p99, None, "1 sample of 10 at most");
        assert_eq!(measure_idle(&mut lp, us(1000)), us(10));
    }

    /// A probe sent while a hungry flow is active is contended even if the flow has
    /// stopped by the time the probe completes.
    #[test]
    fn a_probe_sent_while_busy_is_not_an_idle_sample_though_it_completes_idle() {
        let mut lp = baseline_loop_with_a_bandwidth_flow();
        lp.set_flow_active(Duration::ZERO, FlowId(2), true).unwrap();
        let contended = lp.probe_sent(us(1));
        lp.set_flow_active(us(2), FlowId(2), false).unwrap();
        assert_eq!(lp.counts().bandwidth, 0, "the flow has stopped");
        assert!(lp.probe_completed(us(1000), contended));
        assert_eq!(measure_idle(&mut lp, us(1000)), us(10));
    }

    /// A xorshift64 generator: reproducible noise without a dependency.
    struct Noise(u64);

    impl Noise {
        /// A uniform number in [0, 1).
        fn next(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// Drives `lp` for `periods` RefPeriods with probes of 10 us, a fraction `slow` of them
    /// 100 us; returns the times of the decreases and SafeUtil's mean fraction of MaxRate.
    fn slow_probe_run(lp: &mut ControlLoop, periods: u32, slow: f64) -> (Vec<Duration>, f64) {
        let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
        let mut t = Duration::ZERO;
        let (mut decreases, mut safe_util) = (Vec::new(), 0.0);
        for _ in 0..periods {
            t += us(500);
            lp.handle_timeout(t);
            while let Some(event) = lp.poll_event() {
                if event == Event::ProbeDue {
                    let latency = if noise.next() < slow { us(100) } else { us(10) };
                    let id = lp.probe_sent(t);
                    assert!(lp.probe_completed(t + latency, id));
                }
            }
            if lp.last_action() == Some(ControlAction::Decrease) {
                decreases.push(t);
            }
            safe_util += lp.safe_util() / lp.max_rate();
        }
        (decreases, safe_util / f64::from(periods))
    }

    #[test]
    fn one_slow_probe_in_a_window_too_short_for_a_p99_is_not_a_violation() {
        // 20 fast probes, one slow one, then fast ones: the nearest-rank p99 of fewer than
        // 100 samples is their largest, which halved SafeUtil on that one probe.
        let mut lp = busy_loop_with(Target99::Absolute(us(50)), ViolationRule::HeldP99);
        let mut t = Duration::ZERO;
        drive(&mut lp, &mut t, 20, us(10));
        drive(&mut lp, &mut t, 1, us(100));
        for _ in 0..150 {
            drive(&mut lp, &mut t, 1, us(10));
            assert_ne!(lp.last_action(), Some(ControlAction::Decrease), "at {t:?}");
        }
    }

    #[test]
    fn slow_probes_below_one_percent_are_decided_on_windows_that_hold_a_p99() {
        // 0.9 % of probes above the 50 us target: the true p99 (10 us) meets it. Every
        // decrease restarts the window, and the next one needs a window of 100 samples
        // (50 ms), or three slow probes in a row (p = 7 x 10^-7 per update): so decreases
        // come at least 50 ms apart, at most 20 a second. The old estimator decided on the
        // largest sample of the restarted window and halved again at once.
        let mut lp = busy_loop_with(Target99::Absolute(us(50)), ViolationRule::HeldP99);
        let (decreases, mean) = slow_probe_run(&mut lp, 60_000, 0.009);
        let rate = decreases.len() as f64 / 30.0;
        eprintln!("0.9 % slow probes: {rate:.2} decreases/s, mean SafeUtil {mean:.3} x MaxRate");
        let closest = decreases.windows(2).map(|w| w[1] - w[0]).min();
        assert!(
            closest.is_none_or(|gap| gap >= Duration::from_millis(50)),
            "decreases {closest:?} apart"
        );
    }

    #[test]
    fn the_default_rule_makes_almost_no_false_violations_with_slow_probes_below_one_percent() {
        // 0.9 % of probes above the 50 us target: the true p99 (10 us) meets it, so every
        // decrease is a false violation. The default's binomial rule at 10^-3 per update
        // needs 22 slow of 1000 samples, where 0.9 % gives about Poisson(9): P(>= 22) is
        // 1.4 x 10^-4, and a full window's count moves by at most one sample an update, so
        // runs of such updates are rare too. At most 3 in 30 s (0.1 a second), SafeUtil
        // near MaxRate. The paper's Current99 made 122 (4.07 a second, SafeUtil 0.895),
        // HeldP99 80 (2.67, 0.955).
        let default = LoopConfig::default().violation;
        assert_eq!(default, ViolationRule::Confident(1e-3));
        let mut lp = busy_loop_with(Target99::Absolute(us(50)), default);
        let (decreases, mean) = slow_probe_run(&mut lp, 60_000, 0.009);
        let rate = decreases.len() as f64 / 30.0;
        eprintln!(
            "0.9 % slow probes, default rule: {rate:.2} decreases/s, mean SafeUtil {mean:.3}"
        );
        assert!(rate <= 0.1, "{rate} decreases/s");
        assert!(mean >= 0.99, "mean SafeUtil {mean}");
    }

    #[test]
    fn the_default_rule_reacts_to_a_real_violation_within_two_samples() {
        // Every probe slow: one of one is chance (10^-2 > 10^-3), two of two is not
        // (10^-4). The first update asks for the first probe, so the third halves, one
        // update sooner than HeldP99's three in a row.
        let default = LoopConfig::default().violation;
        let mut lp = busy_loop_with(Target99::Absolute(us(50)), default);
        let mut t = Duration::ZERO;
        drive(&mut lp, &mut t, 2, us(100));
        assert_eq!(lp.last_action(), Some(ControlAction::Hold));
        drive(&mut lp, &mut t, 1, us(100));
        assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
        // The decrease restarted the window with the slow probe it asked for: a violation
        // that goes on halves again at every second update, while one slow probe among
        // fast ones decides nothing.
        drive(&mut lp, &mut t, 1, us(100));
        assert_eq!(lp.last_action(), Some(ControlAction::Hold));
        drive(&mut lp, &mut t, 1, us(10));
        assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
        for _ in 0..200 {
            drive(&mut lp, &mut t, 1, us(10));
            assert_ne!(lp.last_action(), Some(ControlAction::Decrease), "at {t:?}");
        }
        // 5 % slow (the p99 twice the target): a decrease within 200 ms (400 probes), and
        // more than 10 a second over 30 s.
        let mut lp = busy_loop_with(Target99::Absolute(us(50)), default);
        let (decreases, _) = slow_probe_run(&mut lp, 60_000, 0.05);
        assert!(
            decreases
                .first()
                .is_some_and(|&t| t <= Duration::from_millis(200)),
            "first decrease at {:?}",
            decreases.first()
        );
        let rate = decreases.len() as f64 / 30.0;
        assert!(rate >= 10.0, "{rate} decreases/s with 5 % slow probes");
    }

    #[test]
    fn decision_ranks_are_the_binomial_bound_or_the_p99_of_a_full_enough_window() {
        // The default, 10^-3: P(Binomial(5, 0.01) >= 2) = 9.8 x 10^-4, two of five decide;
        // P(Binomial(6, 0.01) >= 2) = 1.46 x 10^-3, three of six; one of one never
        // (10^-2). n = 100: P(>= 6) = 5.3 x 10^-4, P(>= 5) = 3.4 x 10^-3. n = 1000:
        // P(>= 22) = 6.5 x 10^-4, P(>= 21) = 1.2 x 10^-3.
        let ranks = decision_ranks(1000, Some(FALSE_VIOLATION_RATE));
        assert_eq!(&ranks[..7], &[0, 0, 1, 2, 3, 4, 4]);
        assert_eq!(ranks[100], 95);
        assert_eq!(ranks[1000], 979);
        // P(Binomial(3, 0.01) >= 3) = 10^-6 <= 10^-4, P(>= 2) = 3 x 10^-4 > 10^-4.
        let ranks = decision_ranks(1000, Some(1e-4));
        assert_eq!(&ranks[..4], &[0, 0, 0, 1]);
        // n = 100: P(>= 7) = 7.1 x 10^-5, P(>= 6) = 5.3 x 10^-4: 7 slow probes decide.
        assert_eq!(ranks[100], 94);
        // n = 1000: P(>= 25) = 4.2 x 10^-5, P(>= 24) = 1.09 x 10^-4.
        assert_eq!(ranks[1000], 976);
        let paper = decision_ranks(10_000, None);
        assert_eq!(paper[99], 0, "99 samples cannot hold a p99");
        assert_eq!(paper[100], 99);
        assert_eq!(paper[10_000], 9_900);
    }

    #[test]
    fn a_positive_allotment_always_paces() {
        // Weight 1 beside weight 10^8 on IB-56: 60 B/s and 0.06 ops/s, which truncated to
        // 0 ops/s, a pause.
        let allotment = Allotment {
            bytes_per_sec: 60.0,
            ops_per_sec: 0.06,
            chunk_bytes: 5 * 1024,
            token: Token {
                bytes: 5 * 1024,
                ops: 3,
            },
            phase: ReleasePhase {
                offset: 0.0,
                epoch: 1,
            },
            generation: 1,
        };
        let rate = allotment.pace_rate();
        assert_eq!(rate.bytes_per_sec, 60);
        assert_eq!(rate.ops_per_sec, Some(1));
        let tiny = Allotment {
            bytes_per_sec: 0.5,
            ..allotment
        };
        assert_eq!(tiny.pace_rate().bytes_per_sec, 1);
        let idle = Allotment {
            bytes_per_sec: 0.0,
            ops_per_sec: 0.0,
            ..allotment
        };
        assert_eq!(idle.pace_rate().bytes_per_sec, 0);
        assert_eq!(idle.pace_rate().ops_per_sec, Some(0));
        // The pacer releases the flow's burst, then a chunk every 5120 / 60 s: slowly, but
        // not the 60 s of a pause.
        let mut pacer = crate::pacer::Pacer::new(rate, Duration::ZERO);
        assert!(pacer.try_release(Duration::ZERO, 5 * 1024, 1).is_ok());
        assert_ne!(
            pacer.try_release(Duration::ZERO, 5 * 1024, 1),
            Err(crate::pacer::MAX_WAIT),
            "paused"
        );
    }

    #[test]
    fn a_driver_stall_neither_expires_outstanding_probes_nor_counts_toward_delta() {
        // 1 s of 60 us probes against a 50 us target (delta is 5 s), then a probe is sent
        // and the driver stalls for 4.5 s.
        let mut lp = busy_loop(Target99::Absolute(us(50)));
        let mut t = Duration::ZERO;
        drive(&mut lp, &mut t, 2_000, us(60));
        assert_eq!(lp.mode(), ControlMode::Normal);
        t += us(500);
        lp.handle_timeout(t);
        let mut outstanding = None;
        while let Some(event) = lp.poll_event() {
            if event == Event::ProbeDue {
                outstanding = Some(lp.probe_sent(t));
            }
        }
        t += Duration::from_millis(4_500);
        lp.handle_timeout(t);
        let mut lost = false;
        while let Some(event) = lp.poll_event() {
            lost |= matches!(event, Event::ProbeLost(_));
            if event == Event::ProbeDue {
                let id = lp.probe_sent(t);
                assert!(lp.probe_completed(t + us(60), id));
            }
        }
        assert!(!lost, "a probe outstanding across the stall expired");
        assert!(!lp.probe_completed(t, outstanding.unwrap()), "forgotten");
        assert_eq!(
            lp.mode(),
            ControlMode::Normal,
            "the stall counted toward delta"
        );
        // The violation goes on being observed: delta is reached about 4 s later.
        drive(&mut lp, &mut t, 7_800, us(60));
        assert_eq!(lp.mode(), ControlMode::Normal);
        drive(&mut lp, &mut t, 400, us(60));
        assert!(matches!(lp.mode(), ControlMode::Unattainable { .. }));
    }

    #[test]
    fn a_lost_probe_is_a_violation_even_when_the_target_exceeds_the_timeout() {
        // Target 20 ms, probe timeout 5 ms: a lost probe waited at least 5 ms, which says
        // nothing against a 20 ms target, yet a reference flow whose probes vanish is in
        // trouble. Lost probes are recorded just above the target: three in a row halve.
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(Duration::from_millis(20)),
            ..LoopConfig::default()
        };
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        for (id, class) in [(1, FlowClass::Latency), (2, FlowClass::Bandwidth)] {
            lp.register_flow(Duration::ZERO, flow(id, class)).unwrap();
            lp.set_flow_active(Duration::ZERO, FlowId(id), true)
                .unwrap();
        }
        let mut t = Duration::ZERO;
        let mut lost = 0;
        for _ in 0..20 {
            t += us(500);
            lp.handle_timeout(t);
            while let Some(event) = lp.poll_event() {
                match event {
                    Event::ProbeDue => {
                        lp.probe_sent(t);
                    }
                    Event::ProbeLost(_) => lost += 1,
                    _ => {}
                }
            }
        }
        assert!(lost >= 3, "{lost} probes lost");
        assert!(lp.safe_util() < lp.max_rate(), "no decrease on lost probes");
    }

    /// The events waiting, in order.
    fn events(lp: &mut ControlLoop) -> Vec<Event> {
        std::iter::from_fn(|| lp.poll_event()).collect()
    }

    /// A probe is lost when its timeout has run out and not before: at `sent +
    /// probe_timeout` exactly.
    #[test]
    fn a_probe_is_lost_exactly_when_its_timeout_runs_out() {
        let mut lp = quiet_loop(1);
        let timeout = lp.config().probe_timeout;
        let id = lp.probe_sent(Duration::ZERO);
        lp.handle_timeout(timeout - Duration::from_nanos(1));
        assert!(!events(&mut lp).contains(&Event::ProbeLost(id)));
        lp.handle_timeout(timeout);
        assert!(events(&mut lp).contains(&Event::ProbeLost(id)));
        assert!(!lp.probe_completed(timeout, id), "already counted");
    }

    /// "Later than `poll_timeout` by more than the probe timeout" is a stall: a call
    /// exactly one probe timeout late expires the probe outstanding as lost, a nanosecond
    /// later forgets it (no loss, and its completion is unknown).
    #[test]
    fn a_call_one_probe_timeout_late_expires_probes_and_a_later_one_forgets_them() {
        for (late, lost) in [(Duration::ZERO, true), (Duration::from_nanos(1), false)] {
            let mut lp = quiet_loop(1);
            let id = lp.probe_sent(Duration::ZERO);
            let due = lp.poll_timeout().unwrap();
            let now = due + lp.config().probe_timeout + late;
            lp.handle_timeout(now);
            assert_eq!(
                events(&mut lp).contains(&Event::ProbeLost(id)),
                lost,
                "{late:?} beyond"
            );
            assert!(!lp.probe_completed(now, id));
        }
    }

    /// A probe that failed is counted lost once: the first report is taken, a second one
    /// and a completion after it are not.
    #[test]
    fn a_failed_probe_is_counted_lost_once() {
        let mut lp = quiet_loop(1);
        let id = lp.probe_sent(Duration::ZERO);
        assert!(lp.probe_lost(us(1), id));
        assert_eq!(events(&mut lp), vec![Event::ProbeLost(id)]);
        assert!(!lp.probe_lost(us(2), id));
        assert!(!lp.probe_completed(us(3), id));
        assert!(!lp.probe_lost(us(4), ProbeId(99)), "never sent");
    }

    /// A loop with no flow at all asks for nothing: it updates every quiet period.
    #[test]
    fn a_loop_without_flows_updates_every_quiet_period() {
        let mut lp = quiet_loop(QUIET_PERIODS);
        let trace = follow(&mut lp, &[], Duration::from_millis(100));
        assert!(trace.probes.is_empty(), "{:?}", trace.probes);
        assert!(
            gaps(&trace.updates[1..])
                .iter()
                .all(|&g| g == Duration::from_millis(5)),
            "{:?}",
            trace.updates
        );
    }

    /// An idle-multiple loop waiting for its baseline is not quiet: it asks for a probe at
    /// every RefPeriod until its 10 idle samples are in, and is quiet from then on.
    #[test]
    fn a_loop_measuring_its_idle_baseline_is_quiet_only_once_it_has() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::IdleMultiple(2.0),
            idle_samples: 10,
            quiet_periods: QUIET_PERIODS,
            ..LoopConfig::default()
        };
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        let trace = follow(&mut lp, &[], Duration::from_millis(100));
        let every_ref_period: Vec<Duration> = (1..=10).map(|k| us(500 * k)).collect();
        assert_eq!(trace.probes, every_ref_period);
        assert_eq!(lp.target().idle_p99, Some(us(10)));
        assert!(
            gaps(&trace.updates[10..])
                .iter()
                .all(|&g| g == Duration::from_millis(5)),
            "{:?}",
            trace.updates
        );
    }

    /// A change of mode is said once, when it happens: RefPeriod 10 ms, delta 50 ms, every
    /// probe slow, and one `ModeChanged` (to unattainable) in 20 updates.
    #[test]
    fn a_change_of_mode_is_one_event() {
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            ref_period: Duration::from_millis(10),
            unattainable_after: Some(Duration::from_millis(50)),
            ..LoopConfig::default()
        });
        let mut changes = Vec::new();
        let mut t = Duration::ZERO;
        for _ in 0..20 {
            t += lp.config().ref_period;
            lp.handle_timeout(t);
            for event in events(&mut lp) {
                match event {
                    Event::ProbeDue => {
                        let id = lp.probe_sent(t);
                        assert!(lp.probe_completed(t + us(100), id));
                    }
                    Event::ModeChanged(mode) => changes.push(mode),
                    _ => {}
                }
            }
        }
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert!(matches!(changes[0], ControlMode::Unattainable { .. }));
    }

    /// The allotments follow SafeUtil at the update that changes it, with nothing else
    /// changed: one bandwidth flow beside a latency flow is allotted the whole of SafeUtil,
    /// MaxRate, then half of it after the halving.
    #[test]
    fn an_allotment_follows_safe_util_at_the_update_that_changes_it() {
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        run_periods(&mut lp, &mut t, 1, us(10));
        let max = lp.max_rate();
        assert_eq!(lp.allotment(FlowId(2)).unwrap().bytes_per_sec, max);
        while lp.last_action() != Some(ControlAction::Decrease) {
            run_periods(&mut lp, &mut t, 1, us(100));
            assert!(t < Duration::from_millis(100), "no decrease");
        }
        assert_eq!(lp.safe_util(), max / 2.0);
        assert_eq!(lp.allotment(FlowId(2)).unwrap().bytes_per_sec, max / 2.0);
    }

    /// The probes that show a violation went at the rates of the latest updates, so a
    /// decrease's ceiling is the lowest SafeUtil of the latest [`VIOLATION_RUN`] updates,
    /// not the rate SafeUtil had climbed to when they showed it: after a halving, four
    /// updates on fast probes (a hold, then the climb), then slow probes, the search aims
    /// half-way to the lowest rate of the three updates before the second decrease.
    #[test]
    fn a_decrease_after_a_climb_aims_below_the_lowest_recent_rate() {
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        let until = |lp: &mut ControlLoop, t: &mut Duration, action, latency| {
            let mut rates = Vec::new();
            while lp.last_action() != Some(action) {
                run_periods(lp, t, 1, latency);
                rates.push(lp.safe_util());
                assert!(*t < Duration::from_millis(100), "no {action:?}");
            }
            rates
        };
        until(&mut lp, &mut t, ControlAction::Decrease, us(100));
        let floor = lp.safe_util();
        assert_eq!(floor, lp.max_rate() / 2.0);
        let mut rates = vec![floor];
        for _ in 0..4 {
            run_periods(&mut lp, &mut t, 1, us(10));
            rates.push(lp.safe_util());
        }
        rates.extend(until(&mut lp, &mut t, ControlAction::Decrease, us(100)));
        // The decrease is the last entry; the three before it are the latest rates.
        let before = &rates[rates.len() - 1 - VIOLATION_RUN..rates.len() - 1];
        let ceiling = before.iter().copied().fold(f64::MAX, f64::min);
        let climbed = before[VIOLATION_RUN - 1];
        assert!(ceiling < climbed, "SafeUtil climbed: {before:?}");
        assert_eq!(lp.safe_util(), floor);
        until(&mut lp, &mut t, ControlAction::Increase, us(10));
        let want = floor + (ceiling - floor) / 2.0;
        assert!(
            (lp.safe_util() - want).abs() <= 1e-9 * want,
            "{} against {want} (half-way to {ceiling}, not to {climbed})",
            lp.safe_util()
        );
    }

    /// The division follows the tenants: two tenants of one bandwidth flow each get 1/2 of
    /// SafeUtil; when a third tenant with two flows starts, each tenant gets 1/3, its two
    /// flows 1/6 each (no share kept from the division before).
    #[test]
    fn a_tenant_that_starts_takes_its_share_from_the_others_split_over_its_flows() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        };
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        for id in [1, 2] {
            lp.register_flow(Duration::ZERO, flow(id, FlowClass::Bandwidth))
                .unwrap();
            lp.set_flow_active(Duration::ZERO, FlowId(id), true)
                .unwrap();
        }
        let mut t = Duration::ZERO;
        drive(&mut lp, &mut t, 1, us(10));
        let max = lp.max_rate();
        assert_eq!(lp.safe_util(), max);
        let share = |lp: &ControlLoop, id| lp.allotment(FlowId(id)).unwrap().bytes_per_sec / max;
        assert_eq!((share(&lp, 1), share(&lp, 2)), (0.5, 0.5));
        for id in [3, 4] {
            let mut reg = flow(id, FlowClass::Bandwidth);
            reg.spec.tenant = TenantId(3);
            lp.register_flow(t, reg).unwrap();
            lp.set_flow_active(t, FlowId(id), true).unwrap();
        }
        drive(&mut lp, &mut t, 1, us(10));
        for (id, want) in [
            (1, 1.0 / 3.0),
            (2, 1.0 / 3.0),
            (3, 1.0 / 6.0),
            (4, 1.0 / 6.0),
        ] {
            let got = share(&lp, id);
            assert!((got - want).abs() < 1e-12, "flow {id}: {got}, not {want}");
        }
    }

    /// Three slow probes in a row decide a violation whatever the window holds: after 100
    /// fast probes (a window where the binomial rule needs 6 of about 100), probes of twice
    /// the target from the update that sends the first of them halve SafeUtil at the
    /// third update after it, the first to see three.
    #[test]
    fn three_slow_probes_in_a_row_decide_a_violation_in_a_long_window() {
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        run_periods(&mut lp, &mut t, 100, us(10));
        assert_eq!(lp.safe_util(), lp.max_rate());
        let mut actions = Vec::new();
        for _ in 0..4 {
            run_periods(&mut lp, &mut t, 1, us(100));
            actions.push(lp.last_action());
        }
        assert_eq!(actions[3], Some(ControlAction::Decrease), "{actions:?}");
        assert!(
            !actions[..3].contains(&Some(ControlAction::Decrease)),
            "{actions:?}"
        );
    }

    /// The memo of shares is direct-mapped and checks its whole key: tenants of weight 1
    /// and 17 with one flow each share a slot, as do tenants of weight 1 with 1 and 17
    /// flows; each still gets its own share (1/18 and 17/18; 1/2 for the flow alone and
    /// 1/34 for each of the 17).
    #[test]
    fn tenants_whose_memo_slots_collide_get_their_own_shares() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        };
        for (weights, flows) in [([1, 17], [1, 1]), ([1, 1], [1, 17])] {
            assert_eq!(
                ShareMemo::slot(weights[0], flows[0]),
                ShareMemo::slot(weights[1], flows[1])
            );
            let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
            let mut id = 0;
            let mut first = Vec::new();
            for tenant in 0..2 {
                for _ in 0..flows[tenant] {
                    id += 1;
                    first.push(tenant == 0);
                    let mut reg = flow(id, FlowClass::Bandwidth);
                    reg.spec.tenant = TenantId(tenant as u64 + 100);
                    reg.spec.weight = Weight::new(weights[tenant]).unwrap();
                    lp.register_flow(Duration::ZERO, reg).unwrap();
                    lp.set_flow_active(Duration::ZERO, FlowId(id), true)
                        .unwrap();
                }
            }
            let mut t = Duration::ZERO;
            drive(&mut lp, &mut t, 1, us(10));
            let total = f64::from(weights[0] + weights[1]);
            for (k, &of_first) in first.iter().enumerate() {
                let tenant = usize::from(!of_first);
                let want = f64::from(weights[tenant]) / total / f64::from(flows[tenant]);
                let got = lp.allotment(FlowId(k as u64 + 1)).unwrap().bytes_per_sec / lp.max_rate();
                assert!(
                    (got - want).abs() < 1e-12,
                    "weights {weights:?}, flows {flows:?}: flow {}: {got}, not {want}",
                    k + 1
                );
            }
        }
    }

    /// A window too short for the binomial rule to decide on still increases once its
    /// newest three samples all meet the target: at 10^-7 a window of 3 decides nothing
    /// (three slow probes of three happen with probability 10^-6), so after a decrease
    /// the first increase comes at the third update, the first with three fast samples.
    #[test]
    fn a_window_too_short_to_decide_increases_on_three_fast_samples() {
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            violation: ViolationRule::Confident(1e-7),
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        let mut since_decrease = None;
        while t < Duration::from_millis(100) {
            t += lp.config().ref_period;
            lp.handle_timeout(t);
            if lp.last_action() == Some(ControlAction::Decrease) && since_decrease.is_none() {
                since_decrease = Some(0);
            } else if let Some(n) = &mut since_decrease {
                *n += 1;
                if lp.last_action() == Some(ControlAction::Increase) {
                    break;
                }
            }
            let latency = if since_decrease.is_some() {
                us(10)
            } else {
                us(100)
            };
            for event in events(&mut lp) {
                if event == Event::ProbeDue {
                    let id = lp.probe_sent(t);
                    assert!(lp.probe_completed(t + latency, id));
                }
            }
        }
        assert_eq!(lp.last_action(), Some(ControlAction::Increase));
        assert_eq!(since_decrease, Some(3));
    }

    /// A tenant counts at the largest weight of its active flows: when its flow of weight
    /// 3 stops, its flow of weight 1 is left and it weighs 1 again, beside another tenant
    /// of weight 1 (3/4 then 1/2 of SafeUtil). Each allotment's operations are its bytes
    /// at the profile's MaxTput / MaxRate, and each change of the allotments is the next
    /// generation.
    #[test]
    fn a_tenant_weighs_its_largest_active_flow_and_allotments_carry_ops_and_generations() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            idle_grace_periods: 0,
            ..LoopConfig::default()
        };
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        for (id, tenant, weight) in [(1, 7, 3), (2, 7, 1), (3, 8, 1)] {
            let mut reg = flow(id, FlowClass::Bandwidth);
            reg.spec.tenant = TenantId(tenant);
            reg.spec.weight = Weight::new(weight).unwrap();
            lp.register_flow(Duration::ZERO, reg).unwrap();
            lp.set_flow_active(Duration::ZERO, FlowId(id), true)
                .unwrap();
        }
        let mut t = Duration::ZERO;
        let mut generations = Vec::new();
        let mut update = |lp: &mut ControlLoop, t: &mut Duration| {
            *t += us(500);
            lp.handle_timeout(*t);
            for event in events(lp) {
                if let Event::AllotmentsChanged { generation } = event {
                    generations.push(generation);
                }
            }
        };
        update(&mut lp, &mut t);
        let max = lp.max_rate();
        let share = |lp: &ControlLoop, id| lp.allotment(FlowId(id)).unwrap().bytes_per_sec / max;
        // Tenant 7 weighs 3 of 4, split over its two flows.
        assert_eq!(
            (share(&lp, 1), share(&lp, 2), share(&lp, 3)),
            (0.375, 0.375, 0.25)
        );
        lp.set_flow_active(t, FlowId(1), false).unwrap();
        update(&mut lp, &mut t);
        assert_eq!(
            (share(&lp, 1), share(&lp, 2), share(&lp, 3)),
            (0.0, 0.5, 0.5)
        );
        for id in [2, 3] {
            let a = lp.allotment(FlowId(id)).unwrap();
            assert_eq!(a.ops_per_sec, a.bytes_per_sec * profile.ops_per_byte());
        }
        assert_eq!(generations, vec![1, 2]);
        assert_eq!(lp.generation(), 2);
    }

    /// A new assignment of release phases is a new epoch, and only that: the first
    /// division is epoch 1; a halving of SafeUtil alone keeps it; a flow that starts to
    /// share (a new division with new phases) makes epoch 2; a second latency flow (a new
    /// division of the same sharing flows) keeps it.
    #[test]
    fn a_new_phase_epoch_comes_with_new_phases_and_not_with_safe_util_alone() {
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        let epoch = |lp: &ControlLoop| lp.allotment(FlowId(2)).unwrap().phase.epoch;
        run_periods(&mut lp, &mut t, 1, us(10));
        assert_eq!(epoch(&lp), 1);
        while lp.last_action() != Some(ControlAction::Decrease) {
            run_periods(&mut lp, &mut t, 1, us(100));
            assert!(t < Duration::from_millis(100), "no decrease");
        }
        assert_eq!(epoch(&lp), 1, "SafeUtil alone");
        lp.register_flow(t, flow(3, FlowClass::Bandwidth)).unwrap();
        lp.set_flow_active(t, FlowId(3), true).unwrap();
        run_periods(&mut lp, &mut t, 1, us(100));
        assert_eq!(epoch(&lp), 2);
        // A second latency flow: a new division, but the same flows share (and the chunk
        // stays that of a host with latency flows), so every phase stays.
        lp.register_flow(t, flow(4, FlowClass::Latency)).unwrap();
        lp.set_flow_active(t, FlowId(4), true).unwrap();
        run_periods(&mut lp, &mut t, 1, us(10));
        assert_eq!(lp.counts().latency, 2);
        assert_eq!(epoch(&lp), 2, "the same sharing flows");
    }

    /// A READ tenant's share of a responder is split among its active flows of one class
    /// reading from that responder, and only those: tenant 9's two bandwidth flows reading
    /// from host 1 (weight 3, guarantee 1/4) get 3/8 of its MaxRate and MaxTput each, beside
    /// another tenant's flow, tenant 9's flow reading from host 2 and its throughput flow
    /// reading from host 1, none of which is a sibling.
    #[test]
    fn a_read_tenants_share_is_split_among_its_flows_of_one_class_and_responder_only() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        };
        let mut a = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        let g = guarantee(1, 0, 0.25, &profile);
        for (id, tenant, class, responder) in [
            (1, 9, FlowClass::Bandwidth, 1),
            (2, 9, FlowClass::Bandwidth, 1),
            (3, 10, FlowClass::Bandwidth, 1),
            (4, 9, FlowClass::Bandwidth, 2),
            (5, 9, FlowClass::Throughput, 1),
        ] {
            let mut reg = flow(id, class);
            reg.spec.tenant = TenantId(tenant);
            reg.spec.weight = Weight::new(3).unwrap();
            a.register_flow(Duration::ZERO, reg).unwrap();
            a.set_flow_reads_from(Duration::ZERO, FlowId(id), Some(responder))
                .unwrap();
            a.set_flow_active(Duration::ZERO, FlowId(id), true).unwrap();
            a.read_guarantee_received(Duration::ZERO, FlowId(id), g)
                .unwrap();
        }
        let mut t = Duration::ZERO;
        announced(&mut a, &mut t, 1);
        for id in [1, 2] {
            let got = a.allotment(FlowId(id)).unwrap();
            let bytes = 0.375 * profile.max_rate_bytes_per_sec();
            let ops = 0.375 * profile.max_ops_per_sec();
            assert!((got.bytes_per_sec - bytes).abs() < 1.0, "{got:?}");
            assert!((got.ops_per_sec - ops).abs() < 1e-3 * ops, "{got:?}");
        }
    }

    /// The flows that share are spread over one release interval in id order, and a flow
    /// that stops sharing leaves its offset: three flows at 0, 1/3 and 2/3; when the third
    /// stops, the two left are at 0 and 1/2 and the third back at 0.
    #[test]
    fn a_flow_that_stops_sharing_gives_up_its_phase() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            idle_grace_periods: 0,
            ..LoopConfig::default()
        };
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        for id in [1, 2, 3] {
            lp.register_flow(Duration::ZERO, flow(id, FlowClass::Bandwidth))
                .unwrap();
            lp.set_flow_active(Duration::ZERO, FlowId(id), true)
                .unwrap();
        }
        let mut t = Duration::ZERO;
        drive(&mut lp, &mut t, 1, us(10));
        let offset = |lp: &ControlLoop, id| lp.allotment(FlowId(id)).unwrap().phase.offset;
        let offsets = |lp: &ControlLoop| [1, 2, 3].map(|id| offset(lp, id));
        assert_eq!(offsets(&lp), [0.0, 1.0 / 3.0, 2.0 / 3.0]);
        lp.set_flow_active(t, FlowId(3), false).unwrap();
        drive(&mut lp, &mut t, 1, us(10));
        assert_eq!(offsets(&lp), [0.0, 0.5, 0.0]);
    }

    /// A READ flow's allotment follows each figure of its guarantee on its own: a new
    /// guarantee that changes only the bytes, only the operations or only the chunk
    /// changes that figure of the allotment, as a new generation.
    #[test]
    fn a_read_flows_allotment_follows_each_figure_of_its_guarantee() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut a = reading_loop(Duration::ZERO);
        a.set_flow_reads_from(Duration::ZERO, FlowId(1), Some(3))
            .unwrap();
        let mut t = Duration::ZERO;
        announced(&mut a, &mut t, 1);
        let mut g = guarantee(1, 0, 0.25, &profile);
        let check = |a: &mut ControlLoop, t: &mut Duration, g: ReadGuarantee| {
            let before = a.allotment(FlowId(1)).unwrap().generation;
            a.read_guarantee_received(*t, FlowId(1), g).unwrap();
            announced(a, t, 1);
            let got = a.allotment(FlowId(1)).unwrap();
            assert_eq!(
                (got.bytes_per_sec, got.ops_per_sec, got.chunk_bytes),
                (g.bytes_per_sec, g.ops_per_sec, g.chunk_bytes)
            );
            assert!(got.generation > before, "{got:?}");
        };
        check(&mut a, &mut t, g);
        g.sequence += 1;
        g.bytes_per_sec /= 2.0;
        check(&mut a, &mut t, g);
        g.sequence += 1;
        g.ops_per_sec /= 2.0;
        check(&mut a, &mut t, g);
        g.sequence += 1;
        g.chunk_bytes = 4096;
        check(&mut a, &mut t, g);
    }

    /// A flow's queue pairs are those it registered with; an unknown flow has none.
    #[test]
    fn a_flow_reports_the_queue_pairs_it_registered_with() {
        let mut lp = quiet_loop(1);
        let mut reg = flow(1, FlowClass::Bandwidth);
        reg.qps = 4;
        lp.register_flow(Duration::ZERO, reg).unwrap();
        assert_eq!(lp.flow_qps(FlowId(1)), Some(4));
        assert_eq!(lp.flow_qps(FlowId(2)), None);
    }

    /// The sharing floor the loop reports is (B + T) / (L + B + T) x MaxRate of the flows
    /// counted: one latency and one bandwidth flow, half of MaxRate.
    #[test]
    fn the_sharing_floor_is_the_hungry_flows_fraction_of_max_rate() {
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(us(50)),
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        run_periods(&mut lp, &mut t, 1, us(10));
        assert_eq!(lp.sharing_floor(), lp.max_rate() / 2.0);
    }

    /// "All of the newest three exceed the target" is strict: newest three samples whose
    /// least equals the target leave the decision to the window's rank. With a target of
    /// 49 984 ns (the estimator's value for 50 us), samples of 100, 50, 50 and 100 us: the
    /// newest three are 50, 50 and 100 us, the least at the target, and the rank of a
    /// window of four (the third of four: two samples above the target decide) is 100 us,
    /// a violation.
    #[test]
    fn newest_samples_at_the_target_leave_the_decision_to_the_rank() {
        let target = Duration::from_nanos(49_984);
        let mut lp = loop_of(LoopConfig {
            target: Target99::Absolute(target),
            ..LoopConfig::default()
        });
        let mut t = Duration::ZERO;
        for latency in [100, 50, 50, 100] {
            run_periods(&mut lp, &mut t, 1, us(latency));
            assert_ne!(lp.last_action(), Some(ControlAction::Decrease));
        }
        let least = lp.estimator.newest_range(3).map(|(least, _)| least);
        assert_eq!(least, Some(target), "the least of the newest three");
        run_periods(&mut lp, &mut t, 1, us(10));
        assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
    }

    /// The peer channel resends an unchanged grant every 5 ms (`justitia-peer`'s default
    /// refresh), each time under a new sequence number. At a RefPeriod of 100 us a
    /// guarantee so renewed must cap the READ flow at every update for 100 ms: it must
    /// never lapse between two refreshes (40 RefPeriods are 4 ms, shorter than one), and a
    /// renewal must restart its lifetime (the first one heard does not set it for good).
    #[test]
    fn a_guarantee_renewed_every_5_ms_caps_a_read_flow_at_every_update_at_a_100_us_ref_period() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let period = us(100);
        let config = LoopConfig {
            target: Target99::Absolute(us(50)),
            ref_period: period,
            ..LoopConfig::default()
        };
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        lp.register_flow(Duration::ZERO, flow(1, FlowClass::Bandwidth))
            .unwrap();
        lp.set_flow_reads_from(Duration::ZERO, FlowId(1), Some(3))
            .unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(1), true).unwrap();
        let quarter = 0.25 * profile.max_rate_bytes_per_sec();
        let refresh = Duration::from_millis(5);
        let mut t = Duration::ZERO;
        let mut sequence = 0;
        let mut next_refresh = Duration::ZERO;
        while t < Duration::from_millis(100) {
            if t >= next_refresh {
                lp.read_guarantee_received(t, FlowId(1), guarantee(1, sequence, 0.25, &profile))
                    .unwrap();
                sequence += 1;
                next_refresh += refresh;
            }
            t += period;
            lp.handle_timeout(t);
            while lp.poll_event().is_some() {}
            let got = lp.allotment(FlowId(1)).unwrap().bytes_per_sec;
            assert_eq!(
                got, quarter,
                "at {t:?}: READ flow allotted {got} B/s, its guarantee 0.25 x MaxRate = \
                 {quarter} B/s renewed every 5 ms (RefPeriod 100 us)"
            );
        }
    }

    /// The responder's whole RNIC is the most a READ flow can get from it, whatever its
    /// tenant's weight: a weight-3 flow guaranteed 0.5 of the responder per unit of weight
    /// gets min(3 x 0.5, 1) of the responder's MaxRate, not 1.5 times it.
    #[test]
    fn a_weight_3_read_flow_gets_at_most_the_responders_whole_rnic() {
        let profile = RnicProfile::builtin("roce-100").unwrap();
        let mut lp = reading_loop(Duration::ZERO);
        lp.remove_flow(Duration::ZERO, FlowId(1)).unwrap();
        let mut heavy = flow(1, FlowClass::Bandwidth);
        heavy.spec.weight = Weight::new(3).unwrap();
        lp.register_flow(Duration::ZERO, heavy).unwrap();
        lp.set_flow_reads_from(Duration::ZERO, FlowId(1), Some(3))
            .unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(1), true).unwrap();
        let mut t = Duration::ZERO;
        announced(&mut lp, &mut t, 1);
        for (sequence, fraction) in [(0, 0.5), (1, 1.0)] {
            lp.read_guarantee_received(t, FlowId(1), guarantee(1, sequence, fraction, &profile))
                .unwrap();
            announced(&mut lp, &mut t, 1);
            let got = lp.allotment(FlowId(1)).unwrap();
            assert_eq!(
                (got.bytes_per_sec, got.ops_per_sec),
                (profile.max_rate_bytes_per_sec(), profile.max_ops_per_sec()),
                "weight 3 x fraction {fraction}: at most the responder's whole RNIC, {} B/s",
                profile.max_rate_bytes_per_sec()
            );
        }
    }

    /// The default lifetime is the default refresh (5 ms) times three losses plus one, 20
    /// ms; a lifetime shorter than refresh x (losses + 1) is refused naming both settings,
    /// one equal to it is accepted, and a lifetime of zero is refused by `validate`.
    #[test]
    fn a_guarantee_lifetime_shorter_than_the_refresh_times_losses_plus_one_is_refused() {
        let config = LoopConfig::default();
        assert_eq!(config.read_guarantee_lifetime, Duration::from_millis(20));
        assert_eq!(
            read_guarantee_lifetime(DEFAULT_GRANT_REFRESH, DEFAULT_REFRESH_LOSSES),
            DEFAULT_READ_GUARANTEE_LIFETIME
        );
        assert_eq!(
            config.check_grant_refresh(Duration::from_millis(5), 3),
            Ok(())
        );
        let err = config
            .check_grant_refresh(Duration::from_millis(6), 3)
            .unwrap_err();
        assert_eq!(err.needed, Duration::from_millis(24));
        let text = err.to_string();
        for named in ["read_guarantee_lifetime", "refresh", "20ms", "6ms", "24ms"] {
            assert!(text.contains(named), "{named} not in: {text}");
        }
        assert_eq!(
            config.check_grant_refresh(Duration::from_millis(20), 0),
            Ok(()),
            "no loss tolerated: one refresh"
        );
        assert!(config
            .check_grant_refresh(Duration::from_millis(10), 1)
            .is_ok());
        assert!(config
            .check_grant_refresh(Duration::from_millis(10), 2)
            .is_err());
        assert_eq!(
            read_guarantee_lifetime(Duration::MAX, u32::MAX),
            Duration::MAX,
            "saturates"
        );
        let zero = LoopConfig {
            read_guarantee_lifetime: Duration::ZERO,
            ..LoopConfig::default()
        };
        assert!(matches!(
            zero.validate(),
            Err(LoopError::Setting("read_guarantee_lifetime", _))
        ));
    }

    /// A profile is checked whole by the loop, not only its MaxRate: MaxTput 0 (every
    /// allotment's operations 0, a pause) is refused naming the field, as are MaxRate 0,
    /// NaN and infinity.
    #[test]
    fn a_profile_with_max_tput_0_or_an_unusable_max_rate_is_refused_by_the_loop() {
        let mut profile = RnicProfile::builtin("roce-100").unwrap();
        profile.max_tput_mops = 0.0;
        let err = ControlLoop::new(LoopConfig::default(), &profile, Duration::ZERO).err();
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("max_tput_mops"), "MaxTput 0: `{text}`");
        for bad in [0.0, f64::NAN, f64::INFINITY, -1.0] {
            let mut profile = RnicProfile::builtin("roce-100").unwrap();
            profile.max_rate_gbps = bad;
            assert!(
                ControlLoop::new(LoopConfig::default(), &profile, Duration::ZERO).is_err(),
                "MaxRate {bad} accepted"
            );
        }
    }
}
