//! `policy = "adaptive"`: justitia-core's adaptive law
//! ([`justitia_core::adaptive::AdaptiveLaw`]) on the host, driven as the
//! simulator's driver drives it, its plan published as each flow's allotment.
//!
//! What the driver does, each step a call into the core:
//!
//! - **Target.** The control loop still runs, for its reference flow: it resolves Target99
//!   (absolute, or a multiple of the probe's idle p99) and measures Current99. Its SafeUtil
//!   and allotments are not published.
//! - **Measured tail.** The latency applications' own round trips, as their shapers timed
//!   and reported them ([`Self::record_latency`](AdaptiveDriver::record_latency)), gathered
//!   per tenant in the core's [`LatencyTail`] as the simulator's driver gathers them: at
//!   each update the worst tenant's p99 over the round trips since the last one it was
//!   read at. An update at which no tenant has reported enough round trips (no latency
//!   flow's shaper reports: one of the automatic class, an older shaper, a flow that is
//!   quiet) takes the loop's Current99 instead, the reference flow's p99 over the last
//!   RefPeriod, whose requests wait in the same transmit queue. Which one the law read
//!   last is in [`AdaptiveStatus::tail_source`].
//! - **Others' load.** Bytes the latency and throughput flows reported since the last
//!   update, over the time since: the bandwidth flows are paced within what they leave.
//! - **Reverse load.** What this host's messages make a send path carry besides their own
//!   payload, as the simulator's driver charges it: each message a flow WRITEs or SENDs
//!   to a peer costs that peer's path an acknowledgement, each READ chunk costs this
//!   host's path its request packet (the packet sizes from the profile's `[link]` table,
//!   [`PacketBytes`]). A flow's messages since the last update are its reported work
//!   requests, or its bytes over the plan's chunk when that is more (a split request's
//!   chunks are messages of their own).
//! - **Settings.** The simulator's ([`AdaptiveConfig::for_model`]), from the profile file's
//!   model tables ([`RnicFacts`]): the wire's rate and headers, one queue pair's message
//!   rate, the caches.
//! - **Context turns.** The tenants' QP turns are as long as the law's
//!   ([`AdaptiveDriver::context_turn_bytes`]) unless the operator sets `qp_turn_bytes`;
//!   how many there are is the operator's `qp_turns` (the cache's size, which no built-in
//!   profile of real hardware states). Each bandwidth flow's allotment carries the price of its requests
//!   ([`FlowAllotment::charge`]), which its slot publishes and its shaper's pacer charges.
//! - **Plan.** After each loop update [`AdaptiveLaw::update`](justitia_core::adaptive::AdaptiveLaw::update)
//!   takes the tenants' weighted counts of the active flows, the target, the tail and the
//!   others' load; whenever the active flows (or their send paths) change in between,
//!   the plan for the new counts is made at once.
//! - **Send paths.** A flow its shaper reported as a READ requester of a peer the peer
//!   channel names is charged to that responder's send path, every other flow to this
//!   host's ([`Resource`]). Each path's bandwidth flows are planned as a stream of their
//!   own, as the simulator's are, and each stream's plan becomes one allotment per flow
//!   (by tenant and weight, then among a tenant's own flows), the latency and throughput
//!   flows under this host's path's plan: one call, the core's
//!   [`charged_allotments`]. The server publishes them in the tenants' pages as it
//!   publishes Justitia's, a bandwidth flow into a peer that granted an incast share
//!   lowered to its cap there as under Justitia
//!   ([`justitia_core::incast::paced_plan`]). Each path's plan leaves what the others'
//!   load and the reverse load take of it.
//!
//! Cost: a plan allocates (the active flows' list, the tenants' counts, each send path's
//! flows, the allotments), where the loop's own update does not; it runs only on a wake-up
//! that updated the loop or changed the flows, in a few passes over the flows whatever the
//! number of responders, and with the update it costs about what the loop's update after a
//! change of flows does (`loop_update` bench, measured when one stream was planned:
//! `adaptive_update` plus `adaptive_allotments`, 0.4 us / 4.9 us / 0.49 ms for 1 / 100 /
//! 10 000 flows).
//!
//! Invariants: only active flows count and get an allotment (an idle flow's share goes to
//! the others at the next plan); the allotments change only when a plan is made, and each
//! plan that changes them raises [`AdaptiveDriver::generation`].

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use justitia_agent::admin::{AdaptiveStatus, TailSource};
use justitia_core::adaptive::allotments::{charged_allotments, ChargedFlow, FlowAllotment};
use justitia_core::adaptive::latency_tail::LatencyTail;
use justitia_core::adaptive::{
    AdaptiveConfig, AdaptiveConfigError, AdaptiveLaw, Observation, Plan, Resource, TenantWeights,
};
use justitia_core::flow::{FlowClass, FlowId, TenantId};
use justitia_core::profile::{PacketBytes, RnicFacts, RnicProfile};
use justitia_peer::NodeId;

/// A flow as the driver is told of it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DriverFlow {
    /// The flow, with its queue pairs; the send path its bytes leave by (a READ requester
    /// of a peer the channel names: the peer's) and that peer.
    pub flow: ChargedFlow<NodeId>,
    /// It reported work.
    pub active: bool,
    /// Bytes it reported sent so far (a running count).
    pub bytes: u64,
    /// Work requests it reported posting so far (a running count).
    pub ops: u64,
}

/// The adaptive law on this host. See the module documentation.
#[derive(Debug)]
pub struct AdaptiveDriver {
    law: AdaptiveLaw,
    plan: Plan,
    /// Active flows, as last told.
    present: Vec<ChargedFlow<NodeId>>,
    /// Their allotments under the plan.
    allotted: BTreeMap<u64, Option<FlowAllotment>>,
    generation: u64,
    /// The latency and throughput flows' reported bytes at the last update, and when.
    other_bytes: Option<(u64, Duration)>,
    other_rate: f64,
    /// The sizes of the packets the reverse load counts; `None`: not counted.
    packets: Option<PacketBytes>,
    /// Each flow's reported (bytes, work requests) at the last update.
    sent: BTreeMap<u64, (u64, u64)>,
    /// The reverse load on each send path over the last span, wire bytes/s.
    reverse: BTreeMap<Resource<NodeId>, f64>,
    /// The latency applications' round trips since they were last read, per tenant.
    tail: LatencyTail,
    /// The tail the law read at the last update, and where it came from.
    last_tail: (Option<Duration>, TailSource),
    /// Round trips the shapers reported so far.
    round_trips: u64,
    /// Updates at which the law read them.
    applications_tail_updates: u64,
}

/// Tenants whose round trips are gathered at once. A report comes only for a registered
/// latency flow, and tenants without a flow are forgotten at each update, so the flow
/// table bounds them first; this is the backstop.
const TAIL_TENANTS: usize = 4096;

/// The law's settings for the RNIC profile: the simulator's
/// ([`AdaptiveConfig::for_model`]) from the profile file's model tables (`facts`), or,
/// without them, MaxRate, MaxTput, the MTU and the chunk without latency flows, the rest
/// the law's defaults.
pub fn law_config(profile: &RnicProfile, facts: Option<&RnicFacts>) -> AdaptiveConfig {
    match facts {
        Some(facts) => AdaptiveConfig::for_model(profile, facts),
        None => AdaptiveConfig {
            max_ops_per_sec: profile.max_ops_per_sec(),
            ..AdaptiveConfig::for_rnic(
                profile.max_rate_bytes_per_sec(),
                profile.mtu,
                profile.chunk_bytes_without_latency,
            )
        },
    }
}

impl AdaptiveDriver {
    /// A driver for a host with this RNIC, whose profile file's model tables say `facts`
    /// (`None`: not known; the reverse load is then not counted, and the law knows only
    /// the policy's figures).
    pub fn new(
        profile: &RnicProfile,
        facts: Option<&RnicFacts>,
    ) -> Result<Self, AdaptiveConfigError> {
        let law = AdaptiveLaw::new(law_config(profile, facts))?;
        let packets = facts.map(RnicFacts::packets);
        let plan = law.plan(&Observation::default());
        Ok(AdaptiveDriver {
            law,
            plan,
            present: Vec::new(),
            allotted: BTreeMap::new(),
            generation: 0,
            other_bytes: None,
            other_rate: 0.0,
            packets,
            sent: BTreeMap::new(),
            reverse: BTreeMap::new(),
            tail: LatencyTail::new(TAIL_TENANTS),
            last_tail: (None, TailSource::None),
            round_trips: 0,
            applications_tail_updates: 0,
        })
    }

    /// A latency flow's shaper reported `count` round trips of `tenant`'s requests, whose
    /// longest are `longest` (see [`LatencyTail::record_longest`]). False when the tenant
    /// found no room.
    pub fn record_latency(&mut self, tenant: TenantId, count: u64, longest: &[Duration]) -> bool {
        self.round_trips = self.round_trips.saturating_add(count);
        self.tail.record_longest(tenant, count, longest)
    }

    /// The reverse load on `path` over the last span between updates, wire bytes/s.
    pub fn reverse_load(&self, path: &Resource<NodeId>) -> f64 {
        self.reverse.get(path).copied().unwrap_or(0.0)
    }

    fn observation(&self, target99: Option<Duration>, current99: Option<Duration>) -> Observation {
        Observation {
            tenants: TenantWeights::of(self.present.iter().map(|f| &f.flow.spec)),
            target99,
            current99,
            other_bytes_per_sec: self.other_rate + self.reverse_load(&Resource::SendPath),
        }
    }

    /// The wire bytes each send path carried besides the payload of `flows`' messages
    /// since the last update (see the module documentation), by path; each flow's counts
    /// are kept for the next.
    fn count_reverse(&mut self, flows: &[DriverFlow]) -> BTreeMap<Resource<NodeId>, f64> {
        let mut out = BTreeMap::new();
        let chunk = u64::from(self.plan.chunk_bytes.max(1));
        let mut sent = BTreeMap::new();
        for f in flows {
            let id = f.flow.flow.spec.id.0;
            let (bytes, ops) = self.sent.get(&id).copied().unwrap_or((f.bytes, f.ops));
            sent.insert(id, (f.bytes, f.ops));
            let (Some(p), Some(peer)) = (self.packets, f.flow.peer) else {
                continue;
            };
            let messages = f
                .ops
                .saturating_sub(ops)
                .max(f.bytes.saturating_sub(bytes).div_ceil(chunk));
            let (path, size) = match f.flow.charged {
                Resource::Responder(_) => (Resource::SendPath, p.read_request),
                Resource::SendPath => (Resource::Responder(peer), p.ack),
            };
            *out.entry(path).or_insert(0.0) += messages as f64 * f64::from(size);
        }
        self.sent = sent;
        out
    }

    /// Takes the flows as they are now; true if the active ones changed.
    fn take_flows<'a>(&mut self, flows: impl IntoIterator<Item = &'a DriverFlow>) -> (bool, u64) {
        let mut other = 0u64;
        let before = std::mem::take(&mut self.present);
        for f in flows {
            if f.flow.flow.spec.class != FlowClass::Bandwidth {
                other = other.saturating_add(f.bytes);
            }
            if f.active {
                self.present.push(f.flow);
            }
        }
        (before != self.present, other)
    }

    /// After a control-loop update at `now`: the law takes feedback (the tail against the
    /// target, the others' load since the last update) and plans. The tail is the
    /// applications' reported round trips' when a tenant reported enough since the last
    /// update, else `probe99`, the reference flow's. True if any allotment changed.
    pub fn update(
        &mut self,
        now: Duration,
        flows: impl IntoIterator<Item = DriverFlow>,
        target99: Option<Duration>,
        probe99: Option<Duration>,
    ) -> bool {
        let flows: Vec<DriverFlow> = flows.into_iter().collect();
        // Tenants with a flow, looked up once each: the pools of tenants that left go.
        let tenants: BTreeSet<TenantId> = flows.iter().map(|f| f.flow.flow.spec.tenant).collect();
        self.tail.retain(|t| tenants.contains(&t));
        let current99 = match self.tail.take_p99() {
            Some(p99) => {
                self.last_tail = (Some(p99), TailSource::Applications);
                self.applications_tail_updates += 1;
                Some(p99)
            }
            None => {
                self.last_tail = (
                    probe99,
                    probe99.map_or(TailSource::None, |_| TailSource::Probe),
                );
                probe99
            }
        };
        let (_, other) = self.take_flows(&flows);
        let reverse = self.count_reverse(&flows);
        if let Some((bytes, since)) = self.other_bytes {
            let span = now.saturating_sub(since).as_secs_f64();
            if span > 0.0 {
                self.other_rate = other.saturating_sub(bytes) as f64 / span;
                self.reverse = reverse
                    .into_iter()
                    .map(|(path, bytes)| (path, bytes / span))
                    .collect();
            }
        }
        self.other_bytes = Some((other, now));
        let o = self.observation(target99, current99);
        // One feedback, on the host's observation; each send path's plan then follows.
        let _ = self.law.update(now, &o);
        self.apply(&o)
    }

    /// The flows changed between updates: the plan for the new counts with the law's
    /// present state. True if any allotment changed.
    pub fn flows_changed(
        &mut self,
        flows: impl IntoIterator<Item = DriverFlow>,
        target99: Option<Duration>,
    ) -> bool {
        let flows: Vec<DriverFlow> = flows.into_iter().collect();
        let (changed, _) = self.take_flows(&flows);
        if !changed {
            return false;
        }
        let o = self.observation(target99, None);
        self.apply(&o)
    }

    /// Plans each send path's stream and splits it per flow, each within what the others'
    /// load (this host's path) and the reverse load leave of its path.
    fn apply(&mut self, host: &Observation) -> bool {
        let reverse = &self.reverse;
        let other = |r: &Resource<NodeId>| match r {
            // The host's observation counts its path's reverse load already.
            Resource::SendPath => host.other_bytes_per_sec,
            Resource::Responder(_) => reverse.get(r).copied().unwrap_or(0.0),
        };
        let (plan, allotted) = charged_allotments(&self.law, host, &self.present, other);
        self.plan = plan;
        let allotted: BTreeMap<u64, Option<FlowAllotment>> = allotted
            .into_iter()
            .map(|(FlowId(id), a)| (id, a))
            .collect();
        let changed = allotted != self.allotted;
        if changed {
            self.allotted = allotted;
            self.generation += 1;
        }
        changed
    }

    /// A flow's allotment: `None` for a latency flow, an idle one, or one not known.
    pub fn allotment(&self, flow: u64) -> Option<FlowAllotment> {
        self.allotted.get(&flow).copied().flatten()
    }

    /// The bytes of one QP turn as the law serves a host's queue pairs
    /// ([`AdaptiveLaw::context_turn_bytes`](justitia_core::adaptive::AdaptiveLaw::context_turn_bytes)).
    pub fn context_turn_bytes(&self) -> u64 {
        self.law.context_turn_bytes()
    }

    /// Raised each time a plan changes the allotments.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The state for metrics and `justitia status`.
    pub fn state(&self) -> AdaptiveStatus {
        AdaptiveStatus {
            pace_bytes_per_sec: self.plan.pace_bytes_per_sec,
            chunk_bytes: self.plan.chunk_bytes,
            fraction: self.law.fraction(),
            headroom: self.law.config().headroom,
            decreases: self.law.decreases(),
            other_bytes_per_sec: self.other_rate,
            tail_ns: self
                .last_tail
                .0
                .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
            tail_source: self.last_tail.1,
            round_trips: self.round_trips,
            applications_tail_updates: self.applications_tail_updates,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use justitia_core::adaptive::allotments::HostFlow;
    use justitia_core::flow::{FlowSpec, TenantId, Weight};

    /// Host A reads from peer P (its READ flow charged to P's path) and writes to P (its
    /// WRITE flow on its own path) beside a latency flow of its own, each a tenant of its
    /// own.
    fn flows(read: (u64, u64), write: (u64, u64)) -> [DriverFlow; 3] {
        let p = NodeId([7; 16]);
        let flow = |id, class, charged, peer, (bytes, ops)| DriverFlow {
            flow: ChargedFlow {
                flow: HostFlow {
                    spec: FlowSpec {
                        id: FlowId(id),
                        tenant: TenantId(id),
                        class,
                        weight: Weight::ONE,
                    },
                    qps: 1,
                },
                charged,
                peer,
            },
            active: true,
            bytes,
            ops,
        };
        let bw = FlowClass::Bandwidth;
        [
            flow(1, bw, Resource::Responder(p), Some(p), read),
            flow(2, bw, Resource::SendPath, Some(p), write),
            flow(3, FlowClass::Latency, Resource::SendPath, None, (0, 0)),
        ]
    }

    /// Over 2 s the WRITE flow posted 1000 requests of 512 B, each acknowledged on P's
    /// path, and the READ flow 400, each a request packet on A's path (512 B is the
    /// smallest chunk the law cuts to: a request each message): 1000 x 86 B / 2 s =
    /// 43 000 B/s on P's path, 400 x 98 B / 2 s = 19 600 B/s on A's. With the latency
    /// flow within its target the law paces; the READ flow's plan on P's path leaves the
    /// acknowledgements' part. The reverse load is wire bytes: it comes off the wire's
    /// rate, which on RoCE-100 (100 Gb/s against a MaxRate of 97) has room for it, so the
    /// comparison is made on a wire of 97 Gb/s, where the wire binds: the READ flow's
    /// allotment is below what the same flows get when acknowledgements are free (an
    /// `ack_bytes` of 0), and on RoCE-100's own wire it is not.
    #[test]
    fn a_hosts_messages_load_the_paths_that_carry_their_acknowledgements_and_requests() {
        let profile = RnicProfile::builtin("roce-100").unwrap_or_else(|e| panic!("{e}"));
        let facts = RnicFacts::builtin("roce-100").unwrap_or_else(|| panic!("built-in"));
        assert_eq!(
            (facts.packets().ack, facts.packets().read_request),
            (86, 98)
        );
        let run = |facts: &RnicFacts| {
            let mut d =
                AdaptiveDriver::new(&profile, Some(facts)).unwrap_or_else(|e| panic!("{e}"));
            let (target, current) = (Duration::from_micros(100), Duration::from_micros(50));
            d.update(
                Duration::ZERO,
                flows((0, 0), (0, 0)),
                Some(target),
                Some(current),
            );
            d.update(
                Duration::from_secs(2),
                flows((400 * 512, 400), (1000 * 512, 1000)),
                Some(target),
                Some(current),
            );
            d
        };
        let counted = run(&facts);
        let p = NodeId([7; 16]);
        assert_eq!(counted.reverse_load(&Resource::Responder(p)), 43_000.0);
        assert_eq!(counted.reverse_load(&Resource::SendPath), 19_600.0);
        let free = |facts: RnicFacts| RnicFacts {
            ack_bytes: 0,
            ..facts
        };
        let uncounted = run(&free(facts));
        assert_eq!(uncounted.reverse_load(&Resource::Responder(p)), 0.0);
        let read = |d: &AdaptiveDriver| d.allotment(1).map(|a| a.bytes_per_sec);
        assert_eq!(read(&counted), read(&uncounted), "the wire has room");
        let slow = RnicFacts {
            wire_gbps: 97.0,
            ..facts
        };
        let (with, without) = (read(&run(&slow)), read(&run(&free(slow))));
        assert!(
            with.zip(without).is_some_and(|(w, wo)| w < wo),
            "{with:?} {without:?}"
        );
    }

    /// The law reads the latency applications' round trips when a tenant reported
    /// enough since the last update, the probe's p99 otherwise; reports of a tenant
    /// without a flow are forgotten. 100 round trips whose two longest are 900 and 800 us:
    /// the p99 is the second longest (rank 100 - 99 + 1), 800 us, over a target of 100 us,
    /// so the law steps down although the probe says 50 us.
    #[test]
    fn the_law_reads_the_applications_round_trips_before_the_probe() {
        let profile = RnicProfile::builtin("roce-100").unwrap_or_else(|e| panic!("{e}"));
        let facts = RnicFacts::builtin("roce-100").unwrap_or_else(|| panic!("built-in"));
        let mut d = AdaptiveDriver::new(&profile, Some(&facts)).unwrap_or_else(|e| panic!("{e}"));
        let us = Duration::from_micros;
        let (target, probe) = (Some(us(100)), Some(us(50)));
        let step = |d: &mut AdaptiveDriver, ms: u64| {
            d.update(
                Duration::from_millis(ms),
                flows((0, 0), (0, 0)),
                target,
                probe,
            );
            d.state()
        };
        let s = step(&mut d, 0);
        assert_eq!(
            (s.tail_ns, s.tail_source),
            (Some(50_000), TailSource::Probe)
        );
        let mut longest = vec![us(900), us(800)];
        longest.extend([us(10); 10]);
        // Tenant 3 owns the latency flow.
        assert!(d.record_latency(TenantId(3), 100, &longest));
        let before = d.state().decreases;
        let s = step(&mut d, 1);
        assert_eq!(
            (s.tail_ns, s.tail_source, s.round_trips),
            (Some(800_000), TailSource::Applications, 100)
        );
        assert_eq!(s.applications_tail_updates, 1);
        assert_eq!(s.decreases, before + 1);
        // Read once: the next update has only the probe's.
        let s = step(&mut d, 2);
        assert_eq!(s.tail_source, TailSource::Probe);
        // A tenant with no flow: forgotten, not read.
        assert!(d.record_latency(TenantId(99), 100, &[us(5_000); 12]));
        let s = step(&mut d, 3);
        assert_eq!(
            (s.tail_ns, s.tail_source),
            (Some(50_000), TailSource::Probe)
        );
        // Fewer than 20 round trips gather into the next update.
        assert!(d.record_latency(TenantId(3), 19, &[us(300); 12]));
        assert_eq!(step(&mut d, 4).tail_source, TailSource::Probe);
        assert!(d.record_latency(TenantId(3), 1, &[us(200)]));
        let s = step(&mut d, 5);
        assert_eq!(
            (s.tail_ns, s.tail_source),
            (Some(300_000), TailSource::Applications)
        );
    }
}
