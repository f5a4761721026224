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
//! # Files
//! This file holds the settings, the types and the loop's state machine: its inputs (flows,
//! activity, targets), the counts they keep up to date and the update. The rest is split by
//! concern, each file stating its inputs and invariants: `allotments` (the division of
//! SafeUtil and the allotments handed out), `remote_reads` (the READ units served, the
//! guarantees held and the READ flows' allotments) and `probes` (the reference probe's
//! samples and what the window decides on).
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

mod allotments;
mod probes;
mod remote_reads;

use allotments::ShareMemo;
use probes::{decision_ranks, idle_target, Outstanding};

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
    /// Updates whose action was [`ControlAction::Decrease`].
    decreases: u64,
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
            decreases: 0,
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
        if action == ControlAction::Decrease {
            self.decreases += 1;
        }
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

    /// How many updates cut SafeUtil ([`ControlAction::Decrease`]): the loop seen
    /// regulating, as a count a report can divide by its duration.
    pub fn decreases(&self) -> u64 {
        self.decreases
    }

    /// The settings the loop runs with.
    pub fn config(&self) -> &LoopConfig {
        &self.config
    }
}

#[cfg(test)]
mod tests;
