//! `policy = "adaptive"`: justitia-core's adaptive law
//! ([`justitia_core::adaptive::AdaptiveLaw`]) on the host, driven as the
//! simulator's driver drives it, its plan published as each flow's allotment.
//!
//! What the driver does, each step a call into the core:
//!
//! - **Target.** The control loop still runs, for its reference flow: it resolves Target99
//!   (absolute, or a multiple of the probe's idle p99) and measures Current99. Its SafeUtil
//!   and allotments are not published.
//! - **Measured tail.** The loop's Current99, the reference flow's p99 over the last
//!   RefPeriod. (The simulator's driver sees the latency applications' own completions; the
//!   daemon sees only the reference flow's, which wait in the same transmit queue.)
//! - **Others' load.** Bytes the latency and throughput flows reported since the last
//!   update, over the time since: the bandwidth flows are paced within what they leave.
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
//!   ([`justitia_core::incast::paced_plan`]). The others' load is counted on this host's path only: what this
//!   host's messages make a responder's path carry is not measured here.
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

use std::collections::BTreeMap;
use std::time::Duration;

use justitia_agent::admin::AdaptiveStatus;
use justitia_core::adaptive::allotments::{charged_allotments, ChargedFlow, FlowAllotment};
use justitia_core::adaptive::{
    AdaptiveConfig, AdaptiveConfigError, AdaptiveLaw, Observation, Plan, Resource, TenantWeights,
};
use justitia_core::flow::{FlowClass, FlowId};
use justitia_core::profile::RnicProfile;
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
}

/// The law's settings from the RNIC profile: MaxRate, MaxTput, the MTU and the chunk
/// without latency flows; the rest are the law's defaults.
pub fn law_config(profile: &RnicProfile) -> AdaptiveConfig {
    AdaptiveConfig {
        max_ops_per_sec: profile.max_ops_per_sec(),
        ..AdaptiveConfig::for_rnic(
            profile.max_rate_bytes_per_sec(),
            profile.mtu,
            profile.chunk_bytes_without_latency,
        )
    }
}

impl AdaptiveDriver {
    /// A driver for a host with this RNIC.
    pub fn new(profile: &RnicProfile) -> Result<Self, AdaptiveConfigError> {
        let law = AdaptiveLaw::new(law_config(profile))?;
        let plan = law.plan(&Observation::default());
        Ok(AdaptiveDriver {
            law,
            plan,
            present: Vec::new(),
            allotted: BTreeMap::new(),
            generation: 0,
            other_bytes: None,
            other_rate: 0.0,
        })
    }

    fn observation(&self, target99: Option<Duration>, current99: Option<Duration>) -> Observation {
        Observation {
            tenants: TenantWeights::of(self.present.iter().map(|f| &f.flow.spec)),
            target99,
            current99,
            other_bytes_per_sec: self.other_rate,
        }
    }

    /// Takes the flows as they are now; true if the active ones changed.
    fn take_flows(&mut self, flows: impl IntoIterator<Item = DriverFlow>) -> (bool, u64) {
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
    /// target, the others' load since the last update) and plans. True if any allotment
    /// changed.
    pub fn update(
        &mut self,
        now: Duration,
        flows: impl IntoIterator<Item = DriverFlow>,
        target99: Option<Duration>,
        current99: Option<Duration>,
    ) -> bool {
        let (_, other) = self.take_flows(flows);
        if let Some((bytes, since)) = self.other_bytes {
            let span = now.saturating_sub(since).as_secs_f64();
            if span > 0.0 {
                self.other_rate = other.saturating_sub(bytes) as f64 / span;
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
        let (changed, _) = self.take_flows(flows);
        if !changed {
            return false;
        }
        let o = self.observation(target99, None);
        self.apply(&o)
    }

    /// Plans each send path's stream and splits it per flow. The other flows' load is
    /// counted on this host's send path; a responder's is not measured here (zero).
    fn apply(&mut self, host: &Observation) -> bool {
        let other = |r: &Resource<NodeId>| match r {
            Resource::SendPath => host.other_bytes_per_sec,
            Resource::Responder(_) => 0.0,
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
        }
    }
}
