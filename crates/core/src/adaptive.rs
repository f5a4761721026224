//! The `adaptive` decision law: latency flows near their alone tail while the bandwidth
//! flows keep almost all of their alone bandwidth.
//!
//! **Mechanism it works against.** A small message waits behind whatever the RNIC has
//! already queued for the wire: a packet in its transmit pipeline cannot be taken back.
//! Natively a bandwidth flow keeps that pipeline full (tens of KB), so a latency message
//! waits microseconds (Justitia §2.4). Justitia shortens the wait by pacing bandwidth flows
//! at SafeUtil, which it drives down to the sharing floor, halving them; PeRF shortens it
//! with yields, which cost processing slots and bandwidth and still leave a whole
//! sub-message in the pipeline.
//!
//! **The law.** The wait a latency message sees is at most what is queued ahead of it.
//! Pacing all of a host's bandwidth flows as one stream of chunks, slightly below the rate
//! the transmitter drains them, keeps at most about one chunk queued; so a chunk no larger
//! than the time the goal allows (`(band - 1) / band` of the target tail) at the drain rate
//! bounds the wait, and the pacing costs only the headroom. Per update ([`AdaptiveLaw::update`],
//! time passed in, no clock read):
//!
//! **Tenants.** Flows are counted as Justitia's loop counts them: a tenant counts once in
//! each class in which it has flows present, with its weight ([`TenantWeights`]); below, L,
//! B and T are those weighted tenant counts. The stream's chunks are dealt among the
//! bandwidth tenants by [`TenantRoundRobin`] (by weight, then among a tenant's own flows
//! and queue pairs), so a tenant's bandwidth is split among its own flows and never taken
//! from another tenant by opening more applications or queue pairs, and a tenant that
//! leaves its turn unused gives it to the others at once.
//!
//! 1. No latency and no throughput flow: nothing to protect. No pacing, chunks as large as
//!    the profile's chunk without latency flows, no yields.
//! 2. A latency flow, or a throughput flow (moved into the protected class: it suffers from
//!    the same queue, PeRF §2.3.1), present: the bandwidth flows are paced together at
//!    `headroom x fraction x (MaxRate - the other flows' wire rate)`, in chunks of the
//!    current chunk size, no yields (pacing keeps the queue short; a yield would only
//!    take a processing slot).
//! 3. The chunk size is chosen from the measured tail. It starts at the budget: the slack
//!    the target allows, at MaxRate, rounded down to whole MTU packets when it is above
//!    one (a partial packet costs a header for less payload). When the measured p99 is
//!    above the target, the chunk halves (not below [`AdaptiveConfig::min_chunk_bytes`]);
//!    once at the minimum, the pacing fraction drops by [`RATE_DECREASE`] (not below the
//!    sharing floor (B+T)/(L+B+T)). When the tail is within the target, the fraction
//!    recovers first, halfway toward the fraction that last violated (which rises by
//!    [`RATE_INCREASE`] per update), then the chunk grows by a quarter toward the budget.
//!    Throughput flows without latency flows have no tail to measure: their chunk is the
//!    budget of one MTU packet and the fraction stays 1.
//! 4. The rate left to the bandwidth flows is MaxRate, or what the wire leaves beside the
//!    other flows' measured load in chunks of this size (headers included), whichever is
//!    less: small inline messages take wire, not the payload reads that bound MaxRate on
//!    some RNICs. The rate the stream is finally paced at is never below the bandwidth
//!    tenants' sharing-incentive floor B/(L+B+T) x MaxRate: the headroom, the fraction and
//!    what is left each shrink it, and their product alone fell to 0.244 of MaxRate with
//!    one latency and one bandwidth tenant under persistent violations and a busy wire,
//!    against a floor of 0.5.
//! 5. The smallest chunk is what the host can post at the pacing rate
//!    ([`AdaptiveConfig::max_chunks_per_sec`]): below it the rate gives way instead.
//! 6. With latency flows present, throughput flows beside bandwidth flows are paced by
//!    operations at their equal share of what the throughput flows could post alone: on
//!    Q queue pairs in all they post at most `min(MaxTput, Q x one QP's rate)`, and each
//!    flow is paced at that over (L+B+T) (or at what its own q queue pairs can post, if
//!    less): its sharing-incentive floor, and no more. Unpaced, their small messages queue
//!    ahead of the latency flows' and take the bandwidth flows' turns, and with many of
//!    them (8 latency + 8 bandwidth + 8 throughput flows on RoCE-100) the bandwidth flows
//!    fell under their own floor (28% of alone); the goal asks nothing of a throughput flow
//!    beyond its floor. By tenant: a throughput tenant of weight w is paced at w/(L+B+T)
//!    of that, split equally among its throughput flows. Without latency flows the
//!    throughput flows are the protected class (step 2) and are not paced; without
//!    bandwidth flows there is nobody to give way to.
//!
//! 7. Where the RNIC caches a bounded number of queue-pair contexts (C), each bandwidth
//!    tenant is served from at most C/(L+B+T) of its queue pairs at a time per unit of
//!    weight, each for one large chunk before the next takes its place
//!    ([`AdaptiveLaw::queue_budget`]): dealt chunk by chunk round a tenant's 512 queue
//!    pairs on a 256-context RNIC, nearly every chunk waited for a context read (the link
//!    66% used, the latency tenant at x1.40; with the budget 91% and x1.21, and with an
//!    open queue pair keeping its place while it waits for its application's next message
//!    94.9% and x1.18). A queue pair's turn is long enough that the context read opening
//!    the next disturbs the latency flows at most [`TAIL_SHARE`] of the time, from what a
//!    context read costs ([`AdaptiveConfig::qp_context_miss`],
//!    [`AdaptiveLaw::context_turn_bytes`]): 28 MB on that RNIC, and the row at 96.4% and
//!    x1.19.
//!
//! 8. Costs by resource ([`resources`]): a bandwidth flow's bytes are charged to the send
//!    path they leave by, this host's for WRITEs and SENDs, the responder's for a READ
//!    requester, and the flows charged to each are paced as a stream of their own, planned
//!    by [`AdaptiveLaw::plan_charged`] from the observation of that resource's flows
//!    ([`charged_to`]): a SEND tenant is not cut for a READ tenant whose data never
//!    crosses this host's transmitter (the suite's `read-beside-send`: the SEND tenant
//!    kept 0.72 of its tenant-fair share in one stream). The feedback is one: every stream
//!    follows the law's one chunk and fraction, stepped by [`AdaptiveLaw::update`] on the
//!    host's observation.
//!
//! 9. Where the RNIC caches a bounded number of translation entries (MPT entries of memory
//!    regions, MTT entries of pages), a throughput tenant's message is charged, besides its
//!    one operation, the processing-unit time of each entry it brings into the tenant's
//!    full share of the caches ([`translation`], [`AdaptiveLaw::translation_share`],
//!    [`AdaptiveConfig::miss_operations`]): found from the pages each request reads, which
//!    the host knows, not from the RNIC's hits, which it does not. A tenant of 64 B WRITEs
//!    spread over 1024 regions of 64 MB, a new page each, is charged 9 operations a message
//!    on RoCE-100-husky, and its operations pace holds it to its share of the units' time
//!    rather than of message starts (2.9 M messages/s, where it took 12.4 M): counted as
//!    one operation each, its misses held the processing units its queue pairs share with
//!    the other tenants', and the throughput tenant beside it kept 0.29 of its tenant-fair
//!    share, the bandwidth tenant (its small chunks each waiting for a unit) 0.45; charged,
//!    2.65 and 2.40.
//!
//! Arrivals and departures change the plan at once: the driver calls
//! [`AdaptiveLaw::plan`] whenever the counts change, so a bandwidth flow is unpaced in the
//! same instant the last latency flow leaves.

use std::time::Duration;

use crate::message_charge::{MessageCharge, FIXED_ONE};
use crate::profile::{RnicFacts, RnicProfile};

pub mod allotments;
pub mod latency_tail;
pub mod resources;
pub mod tenants;
pub mod translation;

pub use resources::{charged_to, latency_paths, Resource};
pub use tenants::{QueueBudget, TenantRoundRobin, TenantWeights};
pub use translation::{Access, TranslationBudget, TranslationShare};

/// Goal band: a latency flow's p99 within this multiple of alone.
pub const DEFAULT_BAND: f64 = 1.2;
/// Fraction of what is left of MaxRate at which the bandwidth flows are paced: the
/// transmitter must drain faster than it is fed, or its queue, and the latency flows'
/// wait, grows without bound.
pub const DEFAULT_HEADROOM: f64 = 0.975;
/// Multiplier of the pacing fraction on a violation with the chunk at its minimum.
pub const RATE_DECREASE: f64 = 0.9;
/// How far the last violating pacing fraction rises per update with the target met, so
/// that the search probes above it again.
pub const RATE_INCREASE: f64 = 0.05;
/// The share of the latency flows' samples the goal's tail leaves out (p99: one in a
/// hundred): the most of the time the context reads of the queue budget may disturb
/// ([`AdaptiveLaw::context_turn_bytes`]).
pub const TAIL_SHARE: f64 = 0.01;

/// Settings of the law, from the RNIC profile.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptiveConfig {
    /// MaxRate: payload bytes/s the RNIC sustains.
    pub max_rate_bytes_per_sec: f64,
    /// Path MTU, bytes.
    pub mtu: u32,
    /// The goal's band: the target tail is `band` times the alone tail.
    pub band: f64,
    /// Fraction of the rate left to the bandwidth flows at which they are paced.
    pub headroom: f64,
    /// The smallest chunk (a floor on the WQEs posted per GB).
    pub min_chunk_bytes: u32,
    /// The chunk with nothing to protect (the profile's chunk without latency flows).
    pub max_chunk_bytes: u32,
    /// The link's rate in wire bytes/s (headers included).
    pub wire_bytes_per_sec: f64,
    /// Wire bytes every packet carries besides its payload.
    pub packet_overhead_bytes: u32,
    /// Wire bytes the first packet of a request carries besides those (a RETH).
    pub request_overhead_bytes: u32,
    /// Chunks per second the host may post: a chunk smaller than the pacing rate over
    /// this costs more per byte than the transmitter drains, so the rate, not the chunk,
    /// gives way below it.
    pub max_chunks_per_sec: f64,
    /// MaxTput: operations/s the RNIC sustains (infinite: throughput flows never paced).
    pub max_ops_per_sec: f64,
    /// Operations/s one queue pair sustains (infinite: unknown, MaxTput alone bounds a
    /// flow).
    pub qp_ops_per_sec: f64,
    /// Queue-pair contexts the RNIC holds on chip (0: not bounded, or unknown).
    pub qp_cache_entries: u32,
    /// How long a processing unit waits to read a queue-pair context the RNIC does not hold
    /// (a DMA read of host memory) before it starts the queue pair's message; zero:
    /// unknown, and a queue pair of the budget is served for one large chunk
    /// ([`AdaptiveLaw::context_turn_bytes`]).
    pub qp_context_miss: Duration,
    /// MPT entries (one per memory region) the RNIC caches (0: not bounded, or unknown).
    pub mpt_cache_entries: u32,
    /// MTT entries (one per registered page) the RNIC caches (0: not bounded, or unknown).
    pub mtt_cache_entries: u32,
    /// How long a processing unit waits for a translation entry the RNIC does not cache (a
    /// read of host memory) before it starts the message; zero: unknown, and no request is
    /// charged for its memory ([`AdaptiveConfig::miss_operations`]).
    pub translation_miss: Duration,
    /// The processing units the RNIC starts messages on, each held while it waits for a
    /// translation entry (0: unknown, and no request is charged for its memory).
    pub processing_units: u32,
}

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdaptiveConfigError {
    /// A setting is out of range.
    #[error("adaptive law: {field} {reason}")]
    Invalid {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl AdaptiveConfig {
    /// The law's defaults for an RNIC of this MaxRate, MTU and large chunk, with a wire
    /// that costs nothing beyond MaxRate (set the wire fields for a real link).
    pub fn for_rnic(max_rate_bytes_per_sec: f64, mtu: u32, max_chunk_bytes: u32) -> Self {
        AdaptiveConfig {
            max_rate_bytes_per_sec,
            mtu,
            band: DEFAULT_BAND,
            headroom: DEFAULT_HEADROOM,
            min_chunk_bytes: 512,
            max_chunk_bytes,
            wire_bytes_per_sec: f64::INFINITY,
            packet_overhead_bytes: 0,
            request_overhead_bytes: 0,
            max_chunks_per_sec: f64::INFINITY,
            max_ops_per_sec: f64::INFINITY,
            qp_ops_per_sec: f64::INFINITY,
            qp_cache_entries: 0,
            qp_context_miss: Duration::ZERO,
            mpt_cache_entries: 0,
            mtt_cache_entries: 0,
            translation_miss: Duration::ZERO,
            processing_units: 0,
        }
    }

    /// The law's settings for an RNIC whose policy profile is `policy` and whose model
    /// tables say `facts`, as the simulator's model and a daemon both build them: MaxRate,
    /// MaxTput, the MTU and the large chunk from the policy; the wire's rate and headers;
    /// one queue pair's message rate, and half of it for the chunks (so per-chunk costs
    /// stay a small part of each chunk's time); the caches it bounds, and what a miss
    /// costs (a context's: one DMA read of host memory; a translation entry's, the
    /// profile's figure), on its processing units.
    pub fn for_model(policy: &RnicProfile, facts: &RnicFacts) -> Self {
        let nanos = |ns: f64| Duration::try_from_secs_f64(ns * 1e-9).unwrap_or(Duration::ZERO);
        AdaptiveConfig {
            wire_bytes_per_sec: facts.wire_gbps * 1e9 / 8.0,
            packet_overhead_bytes: facts.header_bytes,
            request_overhead_bytes: facts.first_packet_extra_bytes,
            max_chunks_per_sec: facts.qp_mops * 1e6 / 2.0,
            max_ops_per_sec: policy.max_ops_per_sec(),
            qp_ops_per_sec: facts.qp_mops * 1e6,
            qp_cache_entries: facts.qp_cache_entries,
            qp_context_miss: nanos(facts.pcie_read_latency_ns),
            mpt_cache_entries: facts.mpt_cache_entries,
            mtt_cache_entries: facts.mtt_cache_entries,
            translation_miss: nanos(facts.translation_miss_ns),
            processing_units: facts.processing_units,
            ..AdaptiveConfig::for_rnic(
                policy.max_rate_bytes_per_sec(),
                policy.mtu,
                policy.chunk_bytes_without_latency,
            )
        }
    }

    /// The operations a request's `misses` translation entries not held cost besides its
    /// own one ([`translation`]): each miss holds one of the `processing_units` for
    /// `translation_miss`, that unit's part of the time in which the RNIC starts MaxTput
    /// messages, so `translation_miss x MaxTput / processing_units` operations a miss,
    /// rounded to whole operations; none when the miss time, MaxTput or the units are
    /// unknown. Paced at its share of MaxTput, a tenant whose messages miss is then held
    /// to the same share of the units' time. On RoCE-100-husky (600 ns a miss, 105 M
    /// messages/s on 16 units) a region's and a page's miss cost 2 x 3.94 = 7.9
    /// operations: 8.
    pub fn miss_operations(&self, misses: u64) -> u64 {
        let per_miss = self.translation_miss.as_secs_f64() * self.max_ops_per_sec
            / f64::from(self.processing_units);
        if !per_miss.is_finite() || per_miss <= 0.0 {
            return 0;
        }
        // A float beyond u64 saturates.
        (misses as f64 * per_miss).round() as u64
    }

    /// Payload bytes/s the transmitter drains in chunks of `chunk` bytes: MaxRate, or less
    /// when the chunk's headers take more of the wire than full packets do.
    pub fn drain_rate(&self, chunk: u32) -> f64 {
        self.drain_rate_beside(chunk, 0.0)
    }

    /// The same with `other` wire bytes/s taken by flows that are not paced. Their small
    /// messages take wire, not what else bounds MaxRate (on IB-56 the payload reads over
    /// PCIe, which inline messages do not use), so they come off the wire's rate; with no
    /// wire rate configured they come off MaxRate.
    pub fn drain_rate_beside(&self, chunk: u32, other: f64) -> f64 {
        let other = other.max(0.0);
        if !self.wire_bytes_per_sec.is_finite() {
            return (self.max_rate_bytes_per_sec - other).max(0.0);
        }
        let packets = chunk.div_ceil(self.mtu).max(1);
        let wire = f64::from(chunk)
            + f64::from(packets) * f64::from(self.packet_overhead_bytes)
            + f64::from(self.request_overhead_bytes);
        let on_wire = (self.wire_bytes_per_sec - other).max(0.0) * f64::from(chunk) / wire;
        self.max_rate_bytes_per_sec.min(on_wire)
    }

    /// What one message of `bytes` costs the RNIC, in bytes of MaxRate: the most of its
    /// payload (the payload path MaxRate bounds), its wire bytes, headers included, scaled
    /// from the wire's rate to MaxRate, and one operation at MaxTput (the processing units'
    /// message rate), since a message takes whichever it uses most for that long. A 64 B
    /// WRITE on RoCE-100 costs 162 wire bytes, 157 B of MaxRate, where its payload is 64;
    /// a full chunk costs its payload.
    pub fn message_cost(&self, bytes: u64) -> f64 {
        let payload = bytes as f64;
        let wire = if self.wire_bytes_per_sec.is_finite() {
            let packets = bytes.div_ceil(u64::from(self.mtu.max(1))).max(1);
            let wire = payload
                + packets as f64 * f64::from(self.packet_overhead_bytes)
                + f64::from(self.request_overhead_bytes);
            wire * self.max_rate_bytes_per_sec / self.wire_bytes_per_sec
        } else {
            0.0
        };
        let operation = self.max_rate_bytes_per_sec / self.max_ops_per_sec;
        payload.max(wire).max(operation)
    }

    /// The bytes a message of `bytes` is charged in a stream paced for chunks of `chunk`
    /// (the tenants' turns and the pacer count these): its payload, or more when it costs
    /// more per byte than a chunk does ([`AdaptiveConfig::message_cost`]), so that a tenant
    /// of small messages is paced, and shares, by the wire or the message rate it uses. A
    /// chunk is charged its own bytes: the plan's pace, in payload bytes/s of chunks, holds.
    /// It is [`MessageCharge::charged`] of [`Self::message_charge`], which a shaper
    /// evaluates.
    pub fn charged_bytes(&self, bytes: u64, chunk: u32) -> u64 {
        self.message_charge(chunk).charged(bytes)
    }

    /// The price of a request in a stream paced for chunks of `chunk`, as integers a
    /// tenant page carries ([`crate::message_charge`]): a message's cost over what a
    /// chunk's byte costs, `p = message_cost(chunk) / chunk` (at least 1). Its payload over
    /// `p` is never more than its payload, so the charge is the most of the payload, one
    /// operation at MaxTput over `p` and its wire bytes scaled by MaxRate over the wire's
    /// rate over `p`; each term absent when its rate is not known. On RoCE-100 with 5 KiB
    /// chunks (5120 + 2 x 82 + 16 = 5300 wire bytes, 5141 B of MaxRate: p = 1.0041) a
    /// 64 B WRITE is charged 162 x 0.97 / 1.0041 = 156 B.
    pub fn message_charge(&self, chunk: u32) -> MessageCharge {
        let chunk = chunk.max(1);
        let per_chunk_byte = (self.message_cost(u64::from(chunk)) / f64::from(chunk)).max(1.0);
        let least = self.max_rate_bytes_per_sec / self.max_ops_per_sec / per_chunk_byte;
        let scale = self.max_rate_bytes_per_sec / self.wire_bytes_per_sec / per_chunk_byte;
        // `as` saturates: an unknown (infinite) rate leaves its term at 0.
        let whole = |x: f64| {
            if x.is_finite() && x > 0.0 {
                x.round() as u64
            } else {
                0
            }
        };
        let fixed = |bytes: f64| whole(bytes * scale * FIXED_ONE as f64);
        MessageCharge {
            least_bytes: whole(least),
            byte_cost: fixed(1.0),
            packet_cost: fixed(f64::from(self.packet_overhead_bytes)),
            request_cost: fixed(f64::from(self.request_overhead_bytes)),
            // A path MTU is a power of two; another is read as the one below it.
            mtu_shift: self.mtu.max(1).ilog2(),
        }
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), AdaptiveConfigError> {
        let invalid = |field, reason: String| Err(AdaptiveConfigError::Invalid { field, reason });
        if !(self.max_rate_bytes_per_sec.is_finite() && self.max_rate_bytes_per_sec > 0.0) {
            return invalid(
                "max_rate_bytes_per_sec",
                format!("must be positive, got {}", self.max_rate_bytes_per_sec),
            );
        }
        if self.mtu == 0 {
            return invalid("mtu", "must be positive".into());
        }
        if self.wire_bytes_per_sec.is_nan() || self.wire_bytes_per_sec <= 0.0 {
            return invalid(
                "wire_bytes_per_sec",
                format!("must be positive, got {}", self.wire_bytes_per_sec),
            );
        }
        if self.max_chunks_per_sec.is_nan() || self.max_chunks_per_sec <= 0.0 {
            return invalid(
                "max_chunks_per_sec",
                format!("must be positive, got {}", self.max_chunks_per_sec),
            );
        }
        for (field, value) in [
            ("max_ops_per_sec", self.max_ops_per_sec),
            ("qp_ops_per_sec", self.qp_ops_per_sec),
        ] {
            if value.is_nan() || value <= 0.0 {
                return invalid(field, format!("must be positive, got {value}"));
            }
        }
        if !(self.band.is_finite() && self.band > 1.0) {
            return invalid("band", format!("must be above 1, got {}", self.band));
        }
        if !(self.headroom > 0.0 && self.headroom <= 1.0) {
            return invalid(
                "headroom",
                format!("must be in (0, 1], got {}", self.headroom),
            );
        }
        if self.min_chunk_bytes == 0 || self.min_chunk_bytes > self.max_chunk_bytes {
            return invalid(
                "min_chunk_bytes",
                format!(
                    "must be in [1, max_chunk_bytes = {}], got {}",
                    self.max_chunk_bytes, self.min_chunk_bytes
                ),
            );
        }
        Ok(())
    }
}

/// What the law is told at an update.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Observation {
    /// L, B and T: the weights of the tenants with flows of each class present.
    pub tenants: TenantWeights,
    /// The tail to defend (band x the latency flows' alone p99), if known.
    pub target99: Option<Duration>,
    /// The latency flows' p99 measured since the last update, if there were samples.
    pub current99: Option<Duration>,
    /// Wire bytes/s the flows that are not paced (latency, throughput) used lately.
    pub other_bytes_per_sec: f64,
}

/// What the bandwidth flows' shaper does until the next plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// Total rate of the host's bandwidth flows, bytes/s; `None`: not paced.
    pub pace_bytes_per_sec: Option<f64>,
    /// Bytes per chunk (a message no larger goes whole).
    pub chunk_bytes: u32,
    /// Zero-length yields after each chunk.
    pub yields_per_chunk: u32,
    /// The fraction of what the throughput flows could post alone each throughput tenant
    /// is paced at per unit of its weight (see [`AdaptiveLaw::throughput_ops_per_sec`]);
    /// `None`: not paced.
    pub throughput_share: Option<f64>,
    /// Where the RNIC caches a bounded number of queue-pair contexts: the queue pairs a
    /// bandwidth tenant is served from at a time per unit of its weight, and the bytes
    /// each is served before the next takes its place (see
    /// [`TenantRoundRobin::set_queue_budget`]); `None`: no bound.
    pub queue_budget: Option<QueueBudget>,
}

/// The law's state on one host.
#[derive(Clone, Debug)]
pub struct AdaptiveLaw {
    config: AdaptiveConfig,
    chunk: Option<u32>,
    fraction: f64,
    /// The pacing fraction of the last violation at the smallest chunk (1: none yet).
    ceiling: f64,
    last_update: Option<Duration>,
    decreases: u64,
}

impl AdaptiveLaw {
    /// A law with these settings.
    pub fn new(config: AdaptiveConfig) -> Result<Self, AdaptiveConfigError> {
        config.validate()?;
        Ok(AdaptiveLaw {
            config,
            chunk: None,
            fraction: 1.0,
            ceiling: 1.0,
            last_update: None,
            decreases: 0,
        })
    }

    /// The settings.
    pub fn config(&self) -> &AdaptiveConfig {
        &self.config
    }

    /// The pacing fraction now (1 until a violation at the smallest chunk).
    pub fn fraction(&self) -> f64 {
        self.fraction
    }

    /// Violations that shrank the chunk or the rate so far.
    pub fn decreases(&self) -> u64 {
        self.decreases
    }

    /// The chunk the target allows: its slack, `(band - 1) / band` of it, at MaxRate,
    /// whole MTU packets when that is at least one; one MTU packet without a target.
    pub fn chunk_budget(&self, target99: Option<Duration>) -> u32 {
        let c = &self.config;
        let Some(target) = target99 else {
            return c.mtu.clamp(c.min_chunk_bytes, c.max_chunk_bytes);
        };
        let slack = target.as_secs_f64() * (c.band - 1.0) / c.band;
        let bytes = (slack * c.max_rate_bytes_per_sec)
            .round()
            .min(f64::from(c.max_chunk_bytes)) as u32;
        self.whole_packets(bytes.clamp(c.min_chunk_bytes, c.max_chunk_bytes))
    }

    /// `bytes` rounded down to whole MTU packets when it is at least one: a partial packet
    /// costs a whole header for part of a payload.
    fn whole_packets(&self, bytes: u32) -> u32 {
        let mtu = self.config.mtu;
        if bytes >= mtu {
            bytes / mtu * mtu
        } else {
            bytes
        }
    }

    /// The smallest chunk worth posting: the configured minimum, or what the host can
    /// post at the pacing rate, whichever is larger. The stream is one for all queue pairs
    /// because a chunk's costs (its WQE fetch, its payload read) are the RNIC's, not the
    /// queue pair's: spread over four queue pairs, 532 B chunks on IB-56 drained slower
    /// than they were paced and the latency flow's median rose to x2.4.
    fn chunk_floor(&self) -> u32 {
        let c = &self.config;
        let by_rate = c.headroom * c.max_rate_bytes_per_sec / c.max_chunks_per_sec;
        let by_rate = if by_rate.is_finite() {
            by_rate.ceil().min(f64::from(c.max_chunk_bytes)) as u32
        } else {
            c.max_chunk_bytes
        };
        by_rate.max(c.min_chunk_bytes)
    }

    /// The bandwidth tenants' sharing-incentive floor, B/(L+B+T) x MaxRate: the least the
    /// stream is ever paced at.
    pub fn floor_rate(&self, o: &Observation) -> f64 {
        o.tenants.bandwidth_share() * self.config.max_rate_bytes_per_sec
    }

    /// Feedback from the measured tail at `now`, then the plan.
    pub fn update(&mut self, now: Duration, o: &Observation) -> Plan {
        self.last_update = Some(now);
        if o.tenants.latency > 0 {
            let floor = self.chunk_floor();
            let budget = self.chunk_budget(o.target99).max(floor);
            // A target that moved down takes the chunk with it.
            let chunk = self.chunk.map_or(budget, |c| c.clamp(floor, budget));
            let mut next = chunk;
            if let (Some(p99), Some(target)) = (o.current99, o.target99) {
                if p99 > target {
                    self.decreases += 1;
                    if chunk > floor {
                        next = self.whole_packets(chunk / 2).max(floor);
                    } else {
                        self.ceiling = self.fraction;
                        self.fraction =
                            (self.fraction * RATE_DECREASE).max(o.tenants.hungry_share());
                    }
                } else if self.fraction < 1.0 {
                    // Halfway back toward the rate that last violated, which itself rises
                    // slowly: the search settles just under the rate the transmitter
                    // really drains (less than MaxRate when its service times vary).
                    self.ceiling = (self.ceiling + RATE_INCREASE).min(1.0);
                    self.fraction += (self.ceiling - self.fraction) / 2.0;
                    if 1.0 - self.fraction < 1e-3 {
                        self.fraction = 1.0;
                    }
                } else {
                    next = self.whole_packets(chunk + chunk / 4).clamp(floor, budget);
                    if next == chunk && chunk < budget {
                        // A quarter more rounds back down to the same packets: one more.
                        next = (chunk + self.config.mtu).min(budget);
                    }
                }
            }
            self.chunk = Some(next);
        } else {
            // Nothing measured to defend: start afresh when latency flows come back.
            self.chunk = None;
            self.fraction = 1.0;
            self.ceiling = 1.0;
        }
        self.plan(o)
    }

    /// The plan for these counts with the law's present state (no feedback): what the
    /// driver applies when flows arrive or leave between updates.
    pub fn plan(&self, o: &Observation) -> Plan {
        self.plan_split(o, 1)
    }

    /// [`AdaptiveLaw::plan`] with the chunk split `paths` ways (at least one, never below
    /// the smallest chunk worth posting).
    fn plan_split(&self, o: &Observation, paths: u32) -> Plan {
        let c = &self.config;
        let w = &o.tenants;
        if w.latency == 0 && w.throughput == 0 {
            return Plan {
                pace_bytes_per_sec: None,
                chunk_bytes: c.max_chunk_bytes,
                yields_per_chunk: 0,
                throughput_share: None,
                queue_budget: self.queue_budget(o),
            };
        }
        let floor = self.chunk_floor();
        let (chunk, fraction) = if w.latency > 0 {
            let budget = self.chunk_budget(o.target99).max(floor);
            (
                (self.chunk.unwrap_or(budget).clamp(floor, budget) / paths.max(1)).max(floor),
                self.fraction.max(w.hungry_share()),
            )
        } else {
            (self.chunk_budget(None).max(floor), 1.0)
        };
        let left = c.drain_rate_beside(chunk, o.other_bytes_per_sec);
        Plan {
            pace_bytes_per_sec: Some((c.headroom * fraction * left).max(self.floor_rate(o))),
            chunk_bytes: chunk,
            yields_per_chunk: 0,
            throughput_share: Self::throughput_share(o),
            queue_budget: self.queue_budget(o),
        }
    }

    /// The plan for the bandwidth flows charged to one resource, from the observation of
    /// that resource's flows (`charged`, see [`charged_to`]) and the host's (`host`): paced
    /// and floored by `charged`'s counts; the queue budget the host's, since the context
    /// cache is this RNIC's whatever send path a queue pair's data leaves by. A latency
    /// message waits behind at most one chunk on each paced send path its round trip
    /// crosses (its request on this host's, its acknowledgement on the peer's, where READ
    /// responses to this host leave), so with `paths` of them carrying a stream the law's
    /// chunk, the wait the target's slack allows, is split `paths` ways (not below the
    /// smallest chunk worth posting): in one chunk each, a latency flow beside a SEND and a
    /// READ tenant reading from its peer waited two and reached x1.25 of alone. With
    /// `charged` the host's observation and one path it is [`AdaptiveLaw::plan`].
    pub fn plan_charged(&self, host: &Observation, charged: &Observation, paths: u32) -> Plan {
        Plan {
            queue_budget: self.queue_budget(host),
            ..self.plan_split(charged, paths)
        }
    }

    /// A tenant's share of the translation caches ([`translation`]): each bounded cache's
    /// entries by the tenant's `weight` over L+B+T, at least one and at most the whole
    /// cache. Nothing is bounded (0, never charged) for a cache of unknown size, or when
    /// a miss's cost is unknown. On RoCE-100-husky (256 MPT and 1024 MTT entries) each of
    /// four tenants of weight 1 keeps 64 regions and 256 pages.
    pub fn translation_share(&self, weight: u32, o: &Observation) -> TranslationShare {
        let c = &self.config;
        if c.translation_miss.is_zero() {
            return TranslationShare::default();
        }
        let total = o.tenants.total().max(1);
        let share = |entries: u32| {
            if entries == 0 {
                return 0;
            }
            let held = u64::from(entries) * u64::from(weight.max(1)) / total;
            u32::try_from(held).unwrap_or(u32::MAX).clamp(1, entries)
        };
        TranslationShare {
            regions: share(c.mpt_cache_entries),
            pages: share(c.mtt_cache_entries),
        }
    }

    /// The active-queue-pair budget: with C contexts cached on chip, C/(L+B+T) queue pairs
    /// per unit of a tenant's weight (at least one), and never more than C for one tenant
    /// whatever its weight, each served for one large chunk before
    /// the next: an equal split of the cache among the tenants, as PeRF bounds each
    /// application's queue pairs (QNum_allow), so that one tenant's hundreds of queue pairs
    /// do not evict the others' contexts. `None` without a bounded cache.
    pub fn queue_budget(&self, o: &Observation) -> Option<QueueBudget> {
        let c = &self.config;
        (c.qp_cache_entries > 0).then(|| QueueBudget {
            per_weight: u32::try_from(u64::from(c.qp_cache_entries) / o.tenants.total().max(1))
                .unwrap_or(u32::MAX)
                .max(1),
            most: c.qp_cache_entries,
            turn_bytes: self.context_turn_bytes(),
        })
    }

    /// The bytes a queue pair of the budget is served before the next takes its place: at
    /// least one large chunk, and long enough that the context read opening the next one
    /// disturbs at most [`TAIL_SHARE`] of the time. A context read stalls the processing
    /// unit for `m` ([`AdaptiveConfig::qp_context_miss`]) while the pacer goes on releasing
    /// chunks, so the stream leaves it up to `m` of its bytes behind; paced at `headroom`
    /// of what the transmitter drains, it catches them up in `m x headroom / (1 -
    /// headroom)`, and the latency flows wait behind more than their one chunk for about
    /// `m / (1 - headroom)` in all (24 us for a 600 ns read at 0.975). One read per turn,
    /// a turn of `t` bytes takes at least `t / MaxRate`, so `m / (1 - headroom) <=
    /// TAIL_SHARE x t / MaxRate` gives `t >= m x MaxRate / (TAIL_SHARE x (1 - headroom))`,
    /// rounded up to whole large chunks: 28 MB on RoCE-100-qp-cache (600 ns, 97 Gb/s),
    /// where one large chunk (1 MB) per turn left the row of 4 against 512 queue pairs at
    /// 94.9% of the link with the chunk shrunk by the stalls, and 28 MB at 96.4%.
    /// What it costs: a tenant's other queue pairs wait while one is served its turn (its
    /// backlogged messages are served one queue pair after another, not interleaved); the
    /// tenant's bytes, and the others' shares, are unchanged.
    pub fn context_turn_bytes(&self) -> u64 {
        let c = &self.config;
        let large = u64::from(c.max_chunk_bytes.max(1));
        let disturbed = c.qp_context_miss.as_secs_f64() / (1.0 - c.headroom).max(f64::EPSILON);
        let bytes = disturbed * c.max_rate_bytes_per_sec / TAIL_SHARE;
        if !bytes.is_finite() || bytes <= large as f64 {
            return large;
        }
        // Whole large chunks; beyond u64, as many as a u64 holds.
        let chunks = (bytes / large as f64).ceil().min((u64::MAX / large) as f64) as u64;
        chunks * large
    }

    /// The throughput tenants' share per unit of weight, 1/(L+B+T), while latency flows
    /// are present and bandwidth flows are there to give way to; `None` otherwise.
    fn throughput_share(o: &Observation) -> Option<f64> {
        let w = &o.tenants;
        (w.latency > 0 && w.bandwidth > 0 && w.throughput > 0).then(|| 1.0 / w.total() as f64)
    }

    /// The operations/s a throughput flow is paced at under a plan's `share`: its tenant,
    /// of weight `weight` with `tenant_flows` throughput flows present, is paced at `share
    /// x weight` of what the throughput flows post alone on their `throughput_qps` queue
    /// pairs, `min(MaxTput, throughput_qps x one queue pair's rate)`, split equally among
    /// its flows; or the flow at what its own `qps` queue pairs post, if less. Infinite
    /// when neither is known (not paced).
    pub fn throughput_ops_per_sec(
        &self,
        share: f64,
        weight: u32,
        tenant_flows: u32,
        qps: u32,
        throughput_qps: u32,
    ) -> f64 {
        let c = &self.config;
        let class = c
            .max_ops_per_sec
            .min(f64::from(throughput_qps.max(1)) * c.qp_ops_per_sec);
        (share * f64::from(weight.max(1)) * class / f64::from(tenant_flows.max(1)))
            .min(f64::from(qps.max(1)) * c.qp_ops_per_sec)
    }

    /// When the law last took feedback.
    pub fn last_update(&self) -> Option<Duration> {
        self.last_update
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::*;
    use crate::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
    use proptest::prelude::*;

    /// IB-56: 48 Gb/s MaxRate (6e9 B/s), 4 KB MTU, 1 MB chunks without latency flows.
    fn ib56() -> AdaptiveLaw {
        AdaptiveLaw::new(AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)).expect("valid")
    }

    /// The budget of a 256-context cache.
    fn budget(per_weight: u32, turn_bytes: u64) -> QueueBudget {
        QueueBudget {
            per_weight,
            most: 256,
            turn_bytes,
        }
    }

    fn weights(latency: u64, bandwidth: u64, throughput: u64) -> TenantWeights {
        TenantWeights {
            latency,
            bandwidth,
            throughput,
        }
    }

    fn us(x: f64) -> Duration {
        Duration::from_nanos((x * 1e3) as u64)
    }

    fn with_latency(target: f64, current: Option<f64>) -> Observation {
        Observation {
            tenants: weights(1, 1, 0),
            target99: Some(us(target)),
            current99: current.map(us),
            other_bytes_per_sec: 0.0,
        }
    }

    /// Every range `validate` checks, at its edge: an infinite or zero MaxRate, a zero
    /// wire rate or chunk rate are refused; a smallest chunk equal to the largest is a
    /// fixed chunk, and accepted.
    #[test]
    fn settings_out_of_range_are_refused_at_their_edges() {
        let good = AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20);
        let refused = |c: AdaptiveConfig| match c.validate() {
            Err(AdaptiveConfigError::Invalid { field, .. }) => field,
            Ok(()) => "accepted",
        };
        let mut c = good;
        c.max_rate_bytes_per_sec = f64::INFINITY;
        assert_eq!(refused(c), "max_rate_bytes_per_sec");
        c.max_rate_bytes_per_sec = 0.0;
        assert_eq!(refused(c), "max_rate_bytes_per_sec");
        let mut c = good;
        c.wire_bytes_per_sec = 0.0;
        assert_eq!(refused(c), "wire_bytes_per_sec");
        let mut c = good;
        c.max_chunks_per_sec = 0.0;
        assert_eq!(refused(c), "max_chunks_per_sec");
        let mut c = good;
        c.min_chunk_bytes = c.max_chunk_bytes;
        assert_eq!(refused(c), "accepted");
        c.min_chunk_bytes += 1;
        assert_eq!(refused(c), "min_chunk_bytes");
    }

    /// The others' wire bytes come off the wire's rate before the chunk's headers do: a
    /// 7 GB/s wire with 1 GB/s taken leaves 6 GB/s, of which a 4096 B chunk in one packet
    /// of 4096 + 58 + 16 wire bytes carries 6e9 x 4096 / 4170 = 5.8935e9 B/s of payload,
    /// under the 6 GB/s MaxRate.
    #[test]
    fn others_on_the_wire_come_off_the_wires_rate() {
        let mut c = AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20);
        c.wire_bytes_per_sec = 7e9;
        c.packet_overhead_bytes = 58;
        c.request_overhead_bytes = 16;
        let drained = c.drain_rate_beside(4096, 1e9);
        assert!((drained - 6e9 * 4096.0 / 4170.0).abs() < 1.0, "{drained}");
        assert_eq!(c.drain_rate(4096), 6e9, "alone the chunk is MaxRate-bound");
    }

    /// The context turn by hand (RoCE-100 with a 600 ns context read): the stalls disturb
    /// 600 ns / (1 - 0.975) = 24 us per turn, which is 1% of a turn of 24 us / 0.01 at
    /// 12.125 GB/s = 29.1 MB, rounded up to 28 whole 1 MiB chunks.
    #[test]
    fn a_context_turn_is_whole_large_chunks_long_enough_for_the_tail() {
        let mut c = AdaptiveConfig::for_rnic(12.125e9, 4096, 1 << 20);
        c.qp_context_miss = Duration::from_nanos(600);
        let law = AdaptiveLaw::new(c).expect("valid");
        assert_eq!(law.context_turn_bytes(), 28 << 20);
        // A read of a whole second: 40 s disturbed a turn, 4.85e13 B, 46 253 205 chunks.
        c.qp_context_miss = Duration::from_secs(1);
        let law = AdaptiveLaw::new(c).expect("valid");
        assert_eq!(law.context_turn_bytes(), 46_253_205 << 20);
    }

    /// A p99 equal to the target meets it; each one above counts one decrease.
    #[test]
    fn a_tail_at_the_target_meets_it_and_each_violation_is_counted() {
        let mut law = ib56();
        let at = law.update(Duration::ZERO, &with_latency(2.4, Some(2.4)));
        assert_eq!(at.chunk_bytes, 2400, "met: the chunk stays at the budget");
        assert_eq!(law.decreases(), 0);
        for i in 1..=3 {
            law.update(us(500.0 * f64::from(i)), &with_latency(2.4, Some(2.5)));
        }
        assert_eq!(law.decreases(), 3);
    }

    /// At the smallest chunk a violation cuts the rate, not the chunk: with 512 B chunks
    /// (a 1 us target leaves 1/6 us, 1000 B, halved to 512) the fraction goes 1 -> 0.9.
    #[test]
    fn at_the_smallest_chunk_a_violation_cuts_the_rate() {
        let mut law = ib56();
        let bad = with_latency(1.0, Some(2.0));
        assert_eq!(law.update(Duration::ZERO, &bad).chunk_bytes, 512);
        assert_eq!(law.fraction(), 1.0, "the chunk gave way first");
        assert_eq!(law.update(us(500.0), &bad).chunk_bytes, 512);
        assert!((law.fraction() - 0.9).abs() < 1e-12, "{}", law.fraction());
    }

    /// A quarter more of a chunk of whole packets that rounds back down to the same
    /// packets grows by one packet: with a 17 us target (2.83 us of slack, 17 000 B, four
    /// 4 KB packets) two violations take the chunk to 4096, and met targets grow it 4096
    /// -> 8192 -> 12288 -> 16384, not stuck at one packet nor jumping to the budget.
    #[test]
    fn whole_packet_chunks_grow_a_packet_at_a_time() {
        let mut law = ib56();
        assert_eq!(law.chunk_budget(Some(us(17.0))), 16384);
        let bad = with_latency(17.0, Some(30.0));
        let good = with_latency(17.0, Some(10.0));
        law.update(Duration::ZERO, &bad);
        assert_eq!(law.update(us(500.0), &bad).chunk_bytes, 4096);
        let grown: Vec<u32> = (2..6)
            .map(|i| law.update(us(500.0 * f64::from(i)), &good).chunk_bytes)
            .collect();
        assert_eq!(grown, vec![8192, 12288, 16384, 16384]);
    }

    /// With the latency flows gone the law starts afresh: their return finds the budget's
    /// chunk and the whole rate, not what the violations before left.
    #[test]
    fn latency_flows_leaving_reset_the_search() {
        let mut law = ib56();
        let bad = with_latency(1.0, Some(2.0));
        for i in 0..3 {
            law.update(us(500.0 * f64::from(i)), &bad);
        }
        assert!(law.fraction() < 1.0);
        let gone = Observation {
            tenants: weights(0, 1, 0),
            target99: Some(us(1.0)),
            current99: None,
            other_bytes_per_sec: 0.0,
        };
        law.update(us(2000.0), &gone);
        assert_eq!(law.fraction(), 1.0);
        let back = law.update(us(2500.0), &with_latency(2.4, None));
        assert_eq!(back.chunk_bytes, 2400);
    }

    /// Throughput flows without latency flows: the stream is paced for them, in one MTU
    /// packet per chunk, whatever target a departed latency flow left.
    #[test]
    fn without_latency_flows_the_chunk_is_one_packet() {
        let law = ib56();
        let o = Observation {
            tenants: weights(0, 1, 1),
            target99: Some(us(2.4)),
            current99: None,
            other_bytes_per_sec: 0.0,
        };
        let plan = law.plan(&o);
        assert_eq!(plan.chunk_bytes, 4096);
        let pace = plan
            .pace_bytes_per_sec
            .expect("paced for the throughput flows");
        assert!((pace - 0.975 * 6e9).abs() < 1.0, "{pace}");
    }

    /// Throughput tenants give way only to latency flows with bandwidth flows beside them
    /// (the pacing that protects the latency flows is the bandwidth stream's): with no
    /// bandwidth tenant they are not paced. The law records when it last took feedback.
    #[test]
    fn throughput_flows_are_paced_only_beside_bandwidth_flows() {
        let mut law = ib56();
        let mut o = with_latency(2.4, None);
        o.tenants = weights(1, 0, 1);
        assert_eq!(law.update(us(500.0), &o).throughput_share, None);
        assert_eq!(law.last_update(), Some(us(500.0)));
        o.tenants = weights(1, 1, 1);
        assert_eq!(law.update(us(1000.0), &o).throughput_share, Some(1.0 / 3.0));
        assert_eq!(law.last_update(), Some(us(1000.0)));
        o.tenants = weights(1, 1, 0);
        assert_eq!(law.update(us(1500.0), &o).throughput_share, None);
    }

    #[test]
    fn nothing_to_protect_means_no_pacing_and_large_chunks() {
        let mut law = ib56();
        let o = Observation {
            tenants: weights(0, 2, 0),
            ..Observation::default()
        };
        let plan = law.update(Duration::ZERO, &o);
        assert_eq!(plan.pace_bytes_per_sec, None);
        assert_eq!(plan.chunk_bytes, 1 << 20);
        assert_eq!(plan.yields_per_chunk, 0);
    }

    /// The budget by hand: a 2.4 us target with band 1.2 leaves 0.4 us of slack, 2400 B
    /// at 6 GB/s, under one 4 KB packet, so 2400 B; with a 1 KB MTU it rounds down to
    /// 2048 B; a 12 us target leaves 2 us, 12000 B, two whole 4 KB packets.
    #[test]
    fn the_chunk_budget_is_the_targets_slack_at_max_rate() {
        let law = ib56();
        assert_eq!(law.chunk_budget(Some(us(2.4))), 2400);
        assert_eq!(law.chunk_budget(Some(us(12.0))), 8192);
        assert_eq!(law.chunk_budget(None), 4096);
        let roce = AdaptiveLaw::new(AdaptiveConfig::for_rnic(6e9, 1024, 1 << 20)).expect("valid");
        assert_eq!(roce.chunk_budget(Some(us(2.4))), 2048);
    }

    /// A latency flow: paced at the headroom of MaxRate less the others' wire rate, in the
    /// budget's chunks.
    #[test]
    fn latency_flows_are_protected_by_pacing_below_the_drain_rate() {
        let mut law = ib56();
        let mut o = with_latency(2.4, None);
        o.other_bytes_per_sec = 1e9;
        let plan = law.update(Duration::ZERO, &o);
        let pace = plan.pace_bytes_per_sec.expect("paced");
        assert!((pace - 0.975 * 5e9).abs() < 1.0, "{pace}");
        assert_eq!(plan.chunk_bytes, 2400);
    }

    /// Violations halve the chunk to the minimum, then cut the rate, never below the
    /// sharing floor; met targets give the rate back first, then grow the chunk.
    #[test]
    fn violations_shrink_the_chunk_then_the_rate_and_recovery_reverses_it() {
        let mut law = ib56();
        let bad = with_latency(2.4, Some(3.0));
        let chunks: Vec<u32> = (0..4)
            .map(|i| law.update(us(500.0 * f64::from(i)), &bad).chunk_bytes)
            .collect();
        assert_eq!(chunks, vec![1200, 600, 512, 512]);
        assert!((law.fraction() - 0.9).abs() < 1e-12, "{}", law.fraction());
        for i in 0..40 {
            law.update(us(2000.0 + 500.0 * f64::from(i)), &bad);
        }
        assert!(
            (law.fraction() - 0.5).abs() < 1e-12,
            "floor (B+T)/(L+B+T) = 1/2"
        );
        let good = with_latency(2.4, Some(2.0));
        let mut t = 30_000.0;
        let mut step = |law: &mut AdaptiveLaw| {
            t += 500.0;
            law.update(us(t), &good)
        };
        step(&mut law);
        // The last violation was at 0.5: halfway toward 0.5 + 0.05, no further.
        assert!((law.fraction() - 0.525).abs() < 1e-12, "{}", law.fraction());
        let mut met = 1;
        while law.fraction() < 1.0 {
            step(&mut law);
            met += 1;
            assert!(met < 30, "the rate never came back: {}", law.fraction());
        }
        assert!(met > 5, "the rate came back in {met} updates: not a search");
        let chunks: Vec<u32> = (0..6).map(|_| step(&mut law).chunk_bytes).collect();
        assert_eq!(chunks, vec![640, 800, 1000, 1250, 1562, 1952]);
        assert_eq!(
            step(&mut law).chunk_bytes,
            2400,
            "up to the budget, not past it"
        );
        assert_eq!(step(&mut law).chunk_bytes, 2400);
    }

    /// The final pace keeps the floor: one latency and one bandwidth tenant, violations
    /// that never end and the latency tenant's messages taking 4 of the 6 GB/s. The fraction
    /// settles at (B+T)/(L+B+T) = 1/2 and 2 GB/s is left, so headroom x fraction x left is
    /// 0.975 GB/s (before, with what is left floored at half of MaxRate on its own, 1.46
    /// GB/s, 0.244 of MaxRate); the sharing-incentive floor B/(L+B+T) x MaxRate is 3 GB/s,
    /// and the stream is paced at it.
    #[test]
    fn the_final_pace_never_drops_below_the_sharing_floor() {
        let mut law = ib56();
        let mut bad = with_latency(2.4, Some(3.0));
        bad.other_bytes_per_sec = 4e9;
        let mut pace = 0.0;
        for i in 0..60 {
            pace = law
                .update(us(500.0 * f64::from(i)), &bad)
                .pace_bytes_per_sec
                .expect("paced");
        }
        assert!((law.fraction() - 0.5).abs() < 1e-12, "{}", law.fraction());
        assert!((pace - 3e9).abs() < 1.0, "{pace}");
        // Sixteen bandwidth flows of one tenant count as one: the floor stays a half.
        let flows: Vec<FlowSpec> = std::iter::once(FlowClass::Latency)
            .chain(std::iter::repeat_n(FlowClass::Bandwidth, 16))
            .enumerate()
            .map(|(i, class)| FlowSpec {
                id: FlowId(i as u64),
                tenant: TenantId(u64::from(class == FlowClass::Bandwidth)),
                class,
                weight: Weight::ONE,
            })
            .collect();
        bad.tenants = TenantWeights::of(&flows);
        assert!((law.floor_rate(&bad) - 3e9).abs() < 1.0);
    }

    /// The queue budget: 256 contexts among a latency tenant and two bandwidth tenants is
    /// 85 queue pairs per unit of weight, each for one 1 MB chunk; none without a cache.
    #[test]
    fn a_bounded_context_cache_gives_each_tenant_a_queue_budget() {
        let config = AdaptiveConfig {
            qp_cache_entries: 256,
            ..AdaptiveConfig::for_rnic(12e9, 4096, 1 << 20)
        };
        let law = AdaptiveLaw::new(config).expect("valid");
        let o = Observation {
            tenants: weights(1, 2, 0),
            target99: Some(us(2.0)),
            ..Observation::default()
        };
        assert_eq!(law.plan(&o).queue_budget, Some(budget(85, 1 << 20)));
        assert_eq!(ib56().plan(&o).queue_budget, None);
    }

    /// The turn from the cost of a context read, by hand on RoCE-100-qp-cache: MaxRate 97
    /// Gb/s (12.125e9 B/s), a 600 ns PCIe read, headroom 0.975. A read stalls the stream
    /// by 600 ns, 7275 B at MaxRate; paced 2.5% under the drain rate the stream catches
    /// that up in 600 ns x 0.975 / 0.025 = 23.4 us, so the latency flows are disturbed for
    /// 24 us a read. At most 1% of the time (p99) is one read per 2.4 ms, 29.1e6 B at
    /// MaxRate: 27.75 large chunks, rounded up to 28 (29360128 B). The bound is met: 24 us
    /// over the 28-chunk turn's 2.42 ms at MaxRate is under 1%, and over 27 chunks' it is
    /// not. A read twice as costly, twice the turn; none known, one large chunk.
    #[test]
    fn the_turn_keeps_context_reads_out_of_the_tail() {
        let config = AdaptiveConfig {
            qp_cache_entries: 256,
            qp_context_miss: Duration::from_nanos(600),
            ..AdaptiveConfig::for_rnic(97e9 / 8.0, 4096, 1 << 20)
        };
        let law = AdaptiveLaw::new(config).expect("valid");
        let turn = law.context_turn_bytes();
        assert_eq!(turn, 28 << 20);
        let disturbed: f64 = 600e-9 / (1.0 - 0.975);
        assert!((disturbed - 24e-6).abs() < 1e-12);
        assert!(disturbed <= 0.01 * turn as f64 / 12.125e9);
        assert!(disturbed > 0.01 * (27u64 << 20) as f64 / 12.125e9);
        let o = Observation {
            tenants: weights(1, 2, 0),
            target99: Some(us(2.0)),
            ..Observation::default()
        };
        assert_eq!(law.plan(&o).queue_budget, Some(budget(85, 28 << 20)));
        let costlier = AdaptiveLaw::new(AdaptiveConfig {
            qp_context_miss: Duration::from_nanos(1200),
            ..config
        })
        .expect("valid");
        // 58.2e6 B: 55.5 large chunks, 56.
        assert_eq!(costlier.context_turn_bytes(), 56 << 20);
        let unknown = AdaptiveLaw::new(AdaptiveConfig {
            qp_context_miss: Duration::ZERO,
            ..config
        })
        .expect("valid");
        assert_eq!(unknown.context_turn_bytes(), 1 << 20);
    }

    /// Costs by resource: a latency tenant, a READ tenant reading from the latency flow's
    /// peer and a SEND tenant. Under persistent violations, one stream for both bandwidth
    /// tenants is paced at its floor, 2/3 of MaxRate, and the SEND tenant gets half of
    /// that, a third of MaxRate; charged to its own send path it has the stream to itself,
    /// paced at the headroom times the law's fraction (floored at the host's (B+T)/(L+B+T)
    /// = 2/3): 0.65 of MaxRate, above its path's floor of 1/2 (L + B = 2). The target's 2 us leave 4000 B
    /// of slack at 12 GB/s; with both send paths of the latency flow's round trip carrying
    /// a stream, each stream's chunk is half of it. The queue budget is the host's, 256
    /// contexts over its three tenants, not the path's two.
    #[test]
    fn each_send_path_is_paced_for_its_own_tenants() {
        let config = AdaptiveConfig {
            qp_cache_entries: 256,
            ..AdaptiveConfig::for_rnic(12e9, 4096, 1 << 20)
        };
        let mut law = AdaptiveLaw::new(config).expect("valid");
        let spec = |id, class| FlowSpec {
            id: FlowId(id),
            tenant: TenantId(id),
            class,
            weight: Weight::ONE,
        };
        let flows = [
            (spec(1, FlowClass::Latency), Resource::of(false, 9_u8)),
            (spec(2, FlowClass::Bandwidth), Resource::of(true, 9)),
            (spec(3, FlowClass::Bandwidth), Resource::of(false, 9)),
        ];
        let host = Observation {
            tenants: TenantWeights::of(flows.iter().map(|(f, _)| f)),
            target99: Some(us(2.0)),
            current99: Some(us(50.0)),
            other_bytes_per_sec: 0.0,
        };
        let pairs = || flows.iter().map(|(f, r)| (f, r));
        let send = charged_to(&Resource::SendPath, &host, pairs(), 0.0);
        let read = charged_to(&Resource::Responder(9), &host, pairs(), 0.0);
        let fresh = law.plan_charged(&host, &send, 2);
        assert_eq!(fresh.chunk_bytes, 2000);
        assert_eq!(law.plan_charged(&host, &send, 1).chunk_bytes, 4000);
        assert_eq!(fresh.queue_budget, Some(budget(85, 1 << 20)));
        for i in 0..100 {
            law.update(Duration::from_millis(i), &host);
        }
        let one_stream = law.plan(&host).pace_bytes_per_sec.expect("paced");
        assert!((one_stream - 12e9 * 2.0 / 3.0).abs() < 1.0, "{one_stream}");
        for o in [send, read] {
            let plan = law.plan_charged(&host, &o, 2);
            let pace = plan.pace_bytes_per_sec.expect("paced");
            assert!((pace - 0.975 * 2.0 / 3.0 * 12e9).abs() < 1.0, "{pace}");
            assert!(pace >= law.floor_rate(&o));
            assert_eq!(plan.chunk_bytes, 512, "the smallest chunk, not half of it");
        }
    }

    /// The per-message charge by hand on RoCE-100 (MaxRate 97 Gb/s = 12.125e9 B/s, 100
    /// Gb/s = 12.5e9 B/s of wire, 4 KB MTU, 82 B a packet and a 16 B RETH, MaxTput 105 M
    /// messages/s): one operation is 12.125e9 / 105e6 = 115.5 B of MaxRate; a 64 B WRITE is
    /// 162 wire bytes, 162 x 0.97 = 157.1 B of MaxRate, so it is charged 157 B, the wire
    /// binding; a 4001 B chunk is 4099 wire bytes, 3976 B of MaxRate, under its payload, so
    /// it is charged 4001 and the pace in chunk bytes stands. On IB-56's 6e9 B/s and 30 M
    /// messages/s (no wire set) a 64 B WRITE is one operation, 200 B: the message rate
    /// binds, and it is charged 200 B, a 4 KB chunk its 4096.
    #[test]
    fn small_messages_are_charged_what_they_use_of_the_rnic() {
        let roce100 = AdaptiveConfig {
            wire_bytes_per_sec: 12.5e9,
            packet_overhead_bytes: 82,
            request_overhead_bytes: 16,
            max_ops_per_sec: 105e6,
            ..AdaptiveConfig::for_rnic(12.125e9, 4096, 1 << 20)
        };
        assert!((roce100.message_cost(64) - 162.0 * 0.97).abs() < 1e-6);
        assert!((roce100.message_cost(4001) - 4001.0).abs() < 1e-6);
        assert_eq!(roce100.charged_bytes(64, 4001), 157);
        assert_eq!(roce100.charged_bytes(4001, 4001), 4001);
        // A 3000 B piece: 3098 wire bytes, 3005.06 B of MaxRate, just above its payload;
        // a 1998 B piece of a 1 MB message in 2001 B chunks, 2096 wire bytes, 2033.1 B,
        // as a chunk costs per byte within a fraction of a byte.
        assert_eq!(roce100.charged_bytes(3000, 4001), 3005);
        assert_eq!(roce100.charged_bytes(1998, 2001), 1998);
        let ib56 = AdaptiveConfig {
            max_ops_per_sec: 30e6,
            ..AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)
        };
        assert!((ib56.message_cost(64) - 200.0).abs() < 1e-6);
        assert_eq!(ib56.charged_bytes(64, 4096), 200);
        assert_eq!(ib56.charged_bytes(4096, 4096), 4096);
        // Nothing known beyond MaxRate: the payload.
        let bare = AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20);
        assert_eq!(bare.charged_bytes(64, 4096), 64);
    }

    /// RoCE-100's law as a daemon builds it from the profile file, by hand: with 5 KiB
    /// chunks (5120 + 2 x 82 + 16 = 5300 wire bytes, x 0.97 = 5141 B of MaxRate, p =
    /// 5141 / 5120 = 1.0041) a request is charged at least 115.48 / 1.0041 = 115.0 B (one
    /// operation at 105 M messages/s) and 0.97 / 1.0041 = 0.96604 of its wire bytes: a
    /// 64 B WRITE 162 x 0.96604 = 156.5 -> 156 B, a 5 KiB chunk its 5120.
    #[test]
    fn a_daemon_charges_what_the_models_figures_price() {
        let policy = RnicProfile::builtin("roce-100").expect("built-in");
        let facts = RnicFacts::builtin("roce-100").expect("built-in");
        let c = AdaptiveConfig::for_model(&policy, &facts);
        assert_eq!(c.wire_bytes_per_sec, 12.5e9);
        assert_eq!(c.qp_ops_per_sec, 13e6);
        assert_eq!(c.max_chunks_per_sec, 6.5e6);
        assert_eq!(c.qp_context_miss, Duration::from_nanos(600));
        let charge = c.message_charge(5120);
        assert_eq!(charge.least_bytes, 115);
        let scale = charge.byte_cost as f64 / FIXED_ONE as f64;
        assert!((scale - 0.966_04).abs() < 1e-5, "{scale}");
        let per = |cost: u64| cost as f64 / charge.byte_cost as f64;
        assert!((per(charge.packet_cost) - 82.0).abs() < 1e-6);
        assert!((per(charge.request_cost) - 16.0).abs() < 1e-6);
        assert_eq!(charge.mtu_shift, 12);
        assert_eq!(c.charged_bytes(64, 5120), 156);
        assert_eq!(c.charged_bytes(5120, 5120), 5120);
    }

    proptest! {
        /// The integer price a shaper evaluates is the law's cost in chunk bytes,
        /// `max(payload, round(message_cost(bytes) / p))`, computed here in floats, within
        /// a byte (the scale's fixed point).
        #[test]
        fn the_published_charge_is_the_laws_cost_in_chunk_bytes(
            bytes in 0u64..(64 << 20),
            chunk in 512u32..(4 << 20),
            wire in prop_oneof![Just(f64::INFINITY), 1e9..2e10f64],
            ops in prop_oneof![Just(f64::INFINITY), 1e6..2e8f64],
        ) {
            let c = AdaptiveConfig {
                wire_bytes_per_sec: wire,
                packet_overhead_bytes: 82,
                request_overhead_bytes: 16,
                max_ops_per_sec: ops,
                ..AdaptiveConfig::for_rnic(12.125e9, 4096, 1 << 20)
            };
            let per_chunk_byte =
                (c.message_cost(u64::from(chunk)) / f64::from(chunk)).max(1.0);
            let want = (bytes as f64).max((c.message_cost(bytes) / per_chunk_byte).round());
            let got = c.charged_bytes(bytes, chunk) as f64;
            prop_assert!((got - want).abs() <= 1.0, "{got} against {want}");
        }
    }

    /// The translation charge by hand on RoCE-100-husky (256 MPT and 1024 MTT entries, 600
    /// ns a miss, 16 processing units, MaxTput 105 M messages/s, 13 M a queue pair). Four
    /// tenants of weight 1 (a latency, a bandwidth and two throughput tenants) keep 64
    /// regions and 256 pages each; a tenant of weight 2 among five units of weight, 102
    /// and 409. A miss holds one unit of 16 for 600 ns, 600e-9 x 105e6 / 16 = 3.94
    /// operations: one is charged 4, a region's and a page's together 7.875, 8.
    ///
    /// The husky-mtt attacker: 64 B WRITEs, message k in region k mod 1024 at page k div
    /// 1024. Its first 64 messages fill its regions and pages (nothing charged), the next
    /// 192 each bring a region in place of one of its own (4 operations) while its pages
    /// fill, and from message 256 on each brings a region and a page (8): 1 + 8 = 9
    /// operations a message. Its throughput share, a quarter of MaxTput (its 16 queue
    /// pairs and the victim's one post up to 17 x 13 M, above MaxTput), is 26.25 M
    /// operations/s: 2.917 M messages/s, where counted as one operation each it posted
    /// 12.4 M, all it could. A victim walking 255 pages of one region, a page a message,
    /// fits its share and is never charged.
    #[test]
    fn a_tenant_walking_more_memory_than_its_share_is_charged_its_misses() {
        let config = AdaptiveConfig {
            max_ops_per_sec: 105e6,
            qp_ops_per_sec: 13e6,
            mpt_cache_entries: 256,
            mtt_cache_entries: 1024,
            translation_miss: Duration::from_nanos(600),
            processing_units: 16,
            ..AdaptiveConfig::for_rnic(12.125e9, 4096, 1 << 20)
        };
        let law = AdaptiveLaw::new(config).expect("valid");
        let o = Observation {
            tenants: weights(1, 1, 2),
            target99: Some(us(2.0)),
            ..Observation::default()
        };
        let share = law.translation_share(1, &o);
        assert_eq!(
            share,
            TranslationShare {
                regions: 64,
                pages: 256
            }
        );
        let heavier = Observation {
            tenants: weights(1, 2, 2),
            ..o
        };
        assert_eq!(
            law.translation_share(2, &heavier),
            TranslationShare {
                regions: 102,
                pages: 409
            }
        );
        assert_eq!(config.miss_operations(1), 4);
        assert_eq!(config.miss_operations(2), 8);
        let mut budget = TranslationBudget::new();
        let charged: Vec<u64> = (0..300u64)
            .map(|k| {
                let misses = budget.touch(
                    &"attacker",
                    share,
                    &Access {
                        region: k % 1024,
                        first_page: k / 1024,
                        pages: 1,
                    },
                );
                config.miss_operations(misses)
            })
            .collect();
        assert!(charged[..64].iter().all(|&ops| ops == 0));
        assert!(charged[64..256].iter().all(|&ops| ops == 4));
        assert!(charged[256..].iter().all(|&ops| ops == 8));
        let share_of = law.plan(&o).throughput_share.expect("paced");
        let ops = law.throughput_ops_per_sec(share_of, 1, 1, 16, 17);
        assert!((ops - 26.25e6).abs() < 1e-3, "{ops}");
        let messages = ops / (1.0 + 8.0);
        assert!((messages - 2.9167e6).abs() < 1e2, "{messages}");
        let victim: u64 = (0..1000u64)
            .map(|k| {
                budget.touch(
                    &"victim",
                    share,
                    &Access {
                        region: 5000,
                        first_page: k % 255,
                        pages: 1,
                    },
                )
            })
            .sum();
        assert_eq!(victim, 0);
        // Unknown caches or miss time: nothing bounded, nothing charged.
        let unknown = ib56();
        assert_eq!(
            unknown.translation_share(1, &o),
            TranslationShare::default()
        );
        assert_eq!(unknown.config().miss_operations(100), 0);
    }

    /// Throughput flows without latency flows: paced in one-packet chunks at full fraction.
    #[test]
    fn throughput_flows_alone_are_protected_by_one_packet_chunks() {
        let mut law = ib56();
        let o = Observation {
            tenants: weights(0, 1, 1),
            other_bytes_per_sec: 0.5e9,
            ..Observation::default()
        };
        let plan = law.update(Duration::ZERO, &o);
        assert_eq!(plan.chunk_bytes, 4096);
        let pace = plan.pace_bytes_per_sec.expect("paced");
        assert!((pace - 0.975 * 5.5e9).abs() < 1.0, "{pace}");
    }

    /// With latency flows present, throughput flows beside bandwidth flows are paced at
    /// 1/(L+B+T) of what the throughput flows post alone: with MaxTput 30 Mops/s and 5.5
    /// Mops/s a queue pair, one throughput flow on one queue pair beside one latency and
    /// one bandwidth flow at 5.5/2 with a share of a half; in 8 + 8 + 8 flows of one queue
    /// pair each (MaxTput binds) at 30/24; a flow on one of ten queue pairs at 5.5 (its
    /// own queue pair binds); by tenant, a tenant's share split among its flows; without
    /// latency or bandwidth flows they are not paced.
    #[test]
    fn throughput_flows_beside_bandwidth_flows_are_paced_at_their_equal_share() {
        let config = AdaptiveConfig {
            max_ops_per_sec: 30e6,
            qp_ops_per_sec: 5.5e6,
            ..AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)
        };
        let mut law = AdaptiveLaw::new(config).expect("valid");
        let mix = Observation {
            tenants: weights(8, 8, 8),
            target99: Some(us(2.0)),
            ..Observation::default()
        };
        let share = law
            .update(Duration::ZERO, &mix)
            .throughput_share
            .expect("paced");
        assert!((share - 1.0 / 24.0).abs() < 1e-12, "{share}");
        let one = law.throughput_ops_per_sec(share, 1, 1, 1, 8);
        assert!((one - 30e6 / 24.0).abs() < 1e-6, "{one}");
        // A tenant of weight 2 with four of the eight throughput flows: 2/24 of 30 Mops/s
        // for the tenant, a quarter of it each.
        let tenant = law.throughput_ops_per_sec(share, 2, 4, 1, 8);
        assert!((tenant - 30e6 / 48.0).abs() < 1e-6, "{tenant}");
        let own = law.throughput_ops_per_sec(0.5, 1, 1, 1, 10);
        assert!((own - 5.5e6).abs() < 1e-6, "{own}");
        let one_each = Observation {
            tenants: weights(1, 1, 1),
            target99: Some(us(2.0)),
            ..Observation::default()
        };
        assert_eq!(law.plan(&one_each).throughput_share, Some(1.0 / 3.0));
        let no_latency = Observation {
            tenants: weights(0, 1, 1),
            ..one_each
        };
        assert_eq!(law.plan(&no_latency).throughput_share, None);
        let alone = law.throughput_ops_per_sec(0.5, 1, 1, 1, 1);
        assert!((alone - 2.75e6).abs() < 1e-6, "{alone}");
        let no_bandwidth = Observation {
            tenants: weights(8, 0, 8),
            ..mix
        };
        assert_eq!(law.plan(&no_bandwidth).throughput_share, None);
        assert!(ib56().throughput_ops_per_sec(0.5, 1, 1, 1, 1).is_infinite());
        let refused = AdaptiveConfig {
            qp_ops_per_sec: 0.0,
            ..AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)
        };
        assert!(AdaptiveLaw::new(refused).is_err());
    }

    /// RoCE-40 by hand: 40 Gb/s (5e9 B/s) of wire, 1 KB MTU, 82 B of headers a packet
    /// and a 16 B RETH. A 2 KB chunk is 2048 + 2 x 82 + 16 = 2228 wire bytes, so it drains
    /// at 5e9 x 2048 / 2228 = 4.596e9 B/s, above MaxRate (4.5625e9) which binds; a 768 B
    /// chunk (866 wire bytes) drains at 4.434e9, a 512 B one (610) at 4.197e9, and the
    /// pacing follows it: paced at MaxRate, 512 B chunks would overfill the wire.
    #[test]
    fn pacing_follows_the_wire_cost_of_small_chunks() {
        let config = AdaptiveConfig {
            wire_bytes_per_sec: 5e9,
            packet_overhead_bytes: 82,
            request_overhead_bytes: 16,
            ..AdaptiveConfig::for_rnic(4.5625e9, 1024, 1 << 20)
        };
        assert!((config.drain_rate(2048) - 4.5625e9).abs() < 1.0);
        assert!((config.drain_rate(768) - 5e9 * 768.0 / 866.0).abs() < 1.0);
        assert!((config.drain_rate(512) - 5e9 * 512.0 / 610.0).abs() < 1.0);
        let mut law = AdaptiveLaw::new(config).expect("valid");
        // A 0.6 us target: 0.1 us of slack, 456 B, below the 512 B minimum.
        let plan = law.update(Duration::ZERO, &with_latency(0.6, None));
        assert_eq!(plan.chunk_bytes, 512);
        let pace = plan.pace_bytes_per_sec.expect("paced");
        assert!((pace - 0.975 * 5e9 * 512.0 / 610.0).abs() < 1.0, "{pace}");
    }

    /// A chunk the host cannot post fast enough is not used: with 1 M chunks/s and 6 GB/s
    /// paced at 0.975, chunks are 5850 B or more (above the 2400 B budget), however many
    /// bandwidth flows share the stream; violations then cut the rate instead.
    #[test]
    fn the_chunk_never_drops_below_what_the_host_can_post() {
        let config = AdaptiveConfig {
            max_chunks_per_sec: 1e6,
            ..AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)
        };
        let mut law = AdaptiveLaw::new(config).expect("valid");
        let mut bad = with_latency(2.4, Some(3.0));
        bad.tenants.bandwidth = 4;
        let chunks: Vec<u32> = (0..3)
            .map(|i| law.update(us(500.0 * f64::from(i)), &bad).chunk_bytes)
            .collect();
        assert_eq!(chunks, vec![5850, 5850, 5850]);
        // 1, 0.9, 0.81, then the sharing floor (B+T)/(L+B+T) = 4/5 holds it.
        assert!(
            (law.fraction() - 0.8).abs() < 1e-12,
            "the rate gave way: {}",
            law.fraction()
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        let good = AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20);
        for bad in [
            AdaptiveConfig { band: 1.0, ..good },
            AdaptiveConfig {
                headroom: 0.0,
                ..good
            },
            AdaptiveConfig {
                max_rate_bytes_per_sec: f64::NAN,
                ..good
            },
            AdaptiveConfig {
                min_chunk_bytes: 2 << 20,
                ..good
            },
            AdaptiveConfig { mtu: 0, ..good },
        ] {
            assert!(AdaptiveLaw::new(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        /// Whatever the history, the plan paces the bandwidth flows at or above their
        /// sharing-incentive floor, below the drain rate unless the floor needs more, and
        /// the chunk within its bounds; the budget's one-chunk wait fits the target's slack.
        #[test]
        fn plans_stay_within_their_bounds(
            steps in proptest::collection::vec((0u64..4, 0u64..8, 0u64..4, 0.5f64..20.0, proptest::option::of(0.5f64..40.0), 0.0f64..7e9), 1..60),
        ) {
            let mut law = ib56();
            for (i, (l, b, t, target, current, other)) in steps.into_iter().enumerate() {
                let o = Observation {
                    tenants: weights(l, b, t),
                    target99: Some(us(target)),
                    current99: current.map(us),
                    other_bytes_per_sec: other,
                };
                let plan = law.update(us(500.0 * i as f64), &o);
                prop_assert!(plan.chunk_bytes >= 512 && plan.chunk_bytes <= 1 << 20);
                if let Some(pace) = plan.pace_bytes_per_sec {
                    // The final rate against the floor B/(L+B+T) x MaxRate, and never above
                    // the headroom of what the others leave unless the floor needs it.
                    let all = (l + b + t) as f64;
                    let floor = if all > 0.0 { b as f64 / all } else { 1.0 } * 6e9;
                    prop_assert!(pace >= floor - 1e-3, "pace {} under the floor {}", pace, floor);
                    prop_assert!(pace <= (0.975 * (6e9 - other).max(0.0)).max(floor) + 1e-3);
                }
                if l > 0 {
                    let slack = us(target).as_secs_f64() / 6.0;
                    prop_assert!(f64::from(plan.chunk_bytes) <= (slack * 6e9).max(512.0) + 1.0);
                } else if t == 0 {
                    prop_assert_eq!(plan.pace_bytes_per_sec, None);
                }
            }
        }
    }
}
