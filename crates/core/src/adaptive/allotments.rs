//! `adaptive`'s plan as one allotment per flow: what a host whose shapers each pace one
//! flow on their own (`justitiad`'s tenant pages, followed by the shaper in each process)
//! enforces, and the throughput flows' operations rates every driver paces them at.
//!
//! The law's [`Plan`] gives one rate for all of a host's bandwidth flows together. A
//! driver that serves them as one stream of chunks (the simulator's) splits it chunk by
//! chunk with [`TenantRoundRobin`](super::TenantRoundRobin); a shaper in each process
//! cannot share one stream, so each flow is allotted its part of the rate instead, split
//! the same way: by tenant and weight, then equally among the tenant's own flows.
//!
//! - **Bandwidth flow** of a tenant of weight `w` (the largest among its bandwidth flows
//!   present) with `n` bandwidth flows present, B the bandwidth tenants' summed weights:
//!   `pace x w / B / n` bytes/s in chunks of the plan's size. Without pacing (nothing to
//!   protect) MaxRate is split so, in the plan's large chunks: a single-stream driver's
//!   unpaced stream is still dealt among the tenants by its round robin, and per-flow
//!   shapers keep that split only if each is held to its part (a flow alone, or a tenant
//!   whose flows are all idle, gives its part to the others at the next plan).
//! - **Throughput flow**: the plan's operations rate for its tenant
//!   ([`AdaptiveLaw::throughput_ops_per_sec`]) split among the tenant's throughput flows
//!   ([`throughput_paces`]), bytes/s at MaxRate (its small messages are paced by
//!   operations, never by bytes), chunks of one MTU packet; without an operations pace,
//!   MaxRate and no operations bound.
//! - **Latency flow**: no allotment; never shaped.
//!
//! Where the flows' bytes leave by different send paths ([`Resource`]: a READ requester's
//! by its responder's), [`charged_allotments`] plans each path's bandwidth flows as a
//! stream of their own and splits each stream's plan as above, so a WRITE flow is not cut
//! for a READ flow whose data never crosses this host's transmitter.
//!
//! Invariants: the bandwidth flows' rates sum to the plan's pace (MaxRate when not
//! paced), and a tenant's sum is `pace x w / B` whatever the number of its flows, so a tenant does not
//! take another's bandwidth by opening more applications; every allotment is finite and
//! positive.

use std::collections::BTreeMap;

use super::{charged_to, latency_paths, AdaptiveLaw, Observation, Plan, Resource};
use crate::flow::{FlowClass, FlowId, FlowSpec, TenantId};
use crate::message_charge::MessageCharge;

/// A flow present on the host, as the law's allotments need it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostFlow {
    /// The flow: id, tenant, class, weight.
    pub spec: FlowSpec,
    /// Its queue pairs.
    pub qps: u32,
}

/// What one flow is held to until the next plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlowAllotment {
    /// Payload bytes/s.
    pub bytes_per_sec: f64,
    /// Operations/s; `None`: no bound on operations.
    pub ops_per_sec: Option<f64>,
    /// Bytes per chunk a request is cut to.
    pub chunk_bytes: u32,
    /// What each request is charged in the pace: a bandwidth flow's, what its message
    /// costs in its chunk's bytes ([`AdaptiveConfig::message_charge`](super::AdaptiveConfig::message_charge)), as the
    /// simulator's stream charges it; a throughput flow's, its payload (its operations
    /// pace binds).
    pub charge: MessageCharge,
}

/// Each tenant's largest weight and its flows present, in `class`.
fn tenants_of(flows: &[HostFlow], class: FlowClass) -> BTreeMap<TenantId, (u32, u32)> {
    let mut tenants: BTreeMap<TenantId, (u32, u32)> = BTreeMap::new();
    for f in flows.iter().filter(|f| f.spec.class == class) {
        let t = tenants.entry(f.spec.tenant).or_insert((0, 0));
        *t = (t.0.max(f.spec.weight.get()), t.1 + 1);
    }
    tenants
}

/// The operations/s each present throughput flow is paced at under `plan`: its tenant's
/// share of what the throughput flows could post alone on their queue pairs, split among
/// the tenant's throughput flows (see [`AdaptiveLaw::throughput_ops_per_sec`]). `None` for
/// a flow the plan does not pace (no share, or no bound known). Flows of other classes
/// are not listed.
pub fn throughput_paces(
    law: &AdaptiveLaw,
    plan: &Plan,
    flows: &[HostFlow],
) -> Vec<(FlowId, Option<f64>)> {
    let tenants = tenants_of(flows, FlowClass::Throughput);
    let throughput_qps: u32 = flows
        .iter()
        .filter(|f| f.spec.class == FlowClass::Throughput)
        .map(|f| f.qps)
        .fold(0, u32::saturating_add);
    flows
        .iter()
        .filter(|f| f.spec.class == FlowClass::Throughput)
        .map(|f| {
            let (weight, count) = tenants.get(&f.spec.tenant).copied().unwrap_or((1, 1));
            let ops = plan
                .throughput_share
                .map(|share| {
                    law.throughput_ops_per_sec(share, weight, count, f.qps, throughput_qps)
                })
                .filter(|ops| ops.is_finite());
            (f.spec.id, ops)
        })
        .collect()
}

/// Every present flow's allotment under `plan` (`None`: a latency flow, not shaped), in
/// the order of `flows`. See the module documentation for the split.
pub fn allotments(
    law: &AdaptiveLaw,
    plan: &Plan,
    flows: &[HostFlow],
) -> Vec<(FlowId, Option<FlowAllotment>)> {
    let config = law.config();
    let max_rate = config.max_rate_bytes_per_sec;
    let bandwidth = tenants_of(flows, FlowClass::Bandwidth);
    // Summed in u64: two tenants of weight 2^31 overflow a u32.
    let total_weight: u64 = bandwidth.values().map(|&(w, _)| u64::from(w)).sum();
    let throughput: BTreeMap<FlowId, Option<f64>> =
        throughput_paces(law, plan, flows).into_iter().collect();
    flows
        .iter()
        .map(|f| {
            let allotment = match f.spec.class {
                FlowClass::Latency => None,
                FlowClass::Bandwidth => {
                    let pace = plan.pace_bytes_per_sec.unwrap_or(max_rate);
                    let (weight, count) = bandwidth.get(&f.spec.tenant).copied().unwrap_or((1, 1));
                    let bytes_per_sec = pace * f64::from(weight)
                        / total_weight.max(1) as f64
                        / f64::from(count.max(1));
                    Some(FlowAllotment {
                        bytes_per_sec,
                        ops_per_sec: None,
                        chunk_bytes: plan.chunk_bytes,
                        charge: config.message_charge(plan.chunk_bytes),
                    })
                }
                FlowClass::Throughput => Some(FlowAllotment {
                    bytes_per_sec: max_rate,
                    ops_per_sec: throughput.get(&f.spec.id).copied().flatten(),
                    chunk_bytes: config.mtu,
                    charge: MessageCharge::NONE,
                }),
            };
            (f.spec.id, allotment)
        })
        .collect()
}

/// A present flow with the resource its bytes are charged to and the peer its queue pairs
/// go to (`None`: not known).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChargedFlow<P> {
    /// The flow, with its queue pairs.
    pub flow: HostFlow,
    /// The send path its bytes leave by.
    pub charged: Resource<P>,
    /// The host at the other end.
    pub peer: Option<P>,
}

/// Every present flow's allotment when each send path's bandwidth flows are planned as a
/// stream of their own, as the simulator's driver paces its streams, and this host's send
/// path's plan. Each resource's plan is [`AdaptiveLaw::plan_charged`] from the host's
/// observation and the one of its flows ([`charged_to`], with `other_bytes_per_sec` its
/// load besides the stream), the chunk split among the [`latency_paths`]. A bandwidth flow
/// splits its resource's plan with the other bandwidth flows charged to it (by tenant and
/// weight, then among a tenant's flows, as [`allotments`]); the latency and throughput
/// flows take this host's send path's plan, their small messages leaving from here.
/// Grouped by resource, this host's send path first. With no READ requester present it is
/// [`allotments`] of [`AdaptiveLaw::plan`] of `host` (with `host`'s load on this host's
/// send path). One pass over the flows per step, whatever the number of responders.
pub fn charged_allotments<P: Ord>(
    law: &AdaptiveLaw,
    host: &Observation,
    flows: &[ChargedFlow<P>],
    other_bytes_per_sec: impl Fn(&Resource<P>) -> f64,
) -> (Plan, Vec<(FlowId, Option<FlowAllotment>)>) {
    let paths = latency_paths(
        flows
            .iter()
            .map(|f| (&f.flow.spec, &f.charged, f.peer.as_ref())),
    );
    // Each resource's flows: its bandwidth flows; on this host's send path the others too.
    let mut send_path = Vec::new();
    let mut responders: BTreeMap<&Resource<P>, Vec<HostFlow>> = BTreeMap::new();
    for f in flows {
        match &f.charged {
            r @ Resource::Responder(_) if f.flow.spec.class == FlowClass::Bandwidth => {
                responders.entry(r).or_default().push(f.flow)
            }
            _ => send_path.push(f.flow),
        }
    }
    let plan_of = |resource: &Resource<P>, group: &[HostFlow]| {
        let charged = charged_to(
            resource,
            host,
            group.iter().map(|f| (&f.spec, resource)),
            other_bytes_per_sec(resource),
        );
        law.plan_charged(host, &charged, paths)
    };
    let send_plan = plan_of(&Resource::SendPath, &send_path);
    let mut allotted = allotments(law, &send_plan, &send_path);
    for (resource, group) in &responders {
        allotted.extend(allotments(law, &plan_of(resource, group), group));
    }
    (send_plan, allotted)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use std::time::Duration;

    use super::*;
    use crate::adaptive::{AdaptiveConfig, Observation, TenantWeights};
    use crate::flow::Weight;

    fn flow(id: u64, tenant: u64, class: FlowClass, weight: u32) -> HostFlow {
        HostFlow {
            spec: FlowSpec {
                id: FlowId(id),
                tenant: TenantId(tenant),
                class,
                weight: Weight::new(weight).expect("weight"),
            },
            qps: 1,
        }
    }

    /// 6 GB/s MaxRate: one latency tenant, a bandwidth tenant of weight 1 with three flows
    /// and one of weight 2 with one flow. A 2.4 us target's budget is 2400 B and the pace
    /// 0.975 x 6e9 = 5.85e9 B/s; the weight-2 tenant takes 2/3 of it, 3.9e9, the other
    /// 1.95e9 split three ways, 0.65e9 each: 16 flows would not take more.
    #[test]
    fn the_pace_is_split_by_tenant_weight_then_among_a_tenants_flows() {
        let law = AdaptiveLaw::new(AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)).expect("law");
        let flows = [
            flow(1, 10, FlowClass::Latency, 1),
            flow(2, 20, FlowClass::Bandwidth, 1),
            flow(3, 20, FlowClass::Bandwidth, 1),
            flow(4, 20, FlowClass::Bandwidth, 1),
            flow(5, 30, FlowClass::Bandwidth, 2),
        ];
        let specs: Vec<FlowSpec> = flows.iter().map(|f| f.spec).collect();
        let plan = law.plan(&Observation {
            tenants: TenantWeights::of(&specs),
            target99: Some(Duration::from_nanos(2400)),
            ..Observation::default()
        });
        let got = allotments(&law, &plan, &flows);
        assert_eq!(got[0], (FlowId(1), None));
        for (i, want) in [(1, 0.65e9), (2, 0.65e9), (3, 0.65e9), (4, 3.9e9)] {
            let a = got[i].1.expect("allotted");
            assert!((a.bytes_per_sec - want).abs() < 1.0, "{i}: {a:?}");
            assert_eq!(a.chunk_bytes, 2400);
            assert_eq!(a.ops_per_sec, None);
        }
        // Without latency flows: not paced, MaxRate split the same way, in the large
        // chunks: a third of 6e9 to the weight-1 tenant, 2e9, split three ways.
        let plan = law.plan(&Observation::default());
        let got = allotments(&law, &plan, &flows[1..]);
        let a = got[0].1.expect("allotted");
        assert!((a.bytes_per_sec - 2e9 / 3.0).abs() < 1.0, "{a:?}");
        assert_eq!(a.chunk_bytes, 1 << 20);
        let a = got[3].1.expect("allotted");
        assert!((a.bytes_per_sec - 4e9).abs() < 1.0, "{a:?}");
    }

    /// 6 GB/s MaxRate, a 2.4 us target (a 2400 B chunk budget): a latency flow to host 7,
    /// a WRITE tenant, a READ tenant reading from host 7 and one from host 8, 1e9 B/s of
    /// other load on this host's send path. Each send path has one bandwidth tenant (B =
    /// 1 of L + B = 2, the floor 3e9 below every pace): this host's is paced at 0.975 x
    /// (6e9 - 1e9) = 4.875e9, each responder's at 0.975 x 6e9 = 5.85e9, each flow's
    /// alone, where one stream split 0.975 x 5e9 three ways. The latency round trip
    /// crosses this host's path and host 7's, both carrying a stream, so the chunk is
    /// 2400 / 2 = 1200 B; host 8's is not on it and it is a stream still (1200 B too: the
    /// law's one chunk, split as every stream's).
    #[test]
    fn each_send_path_is_planned_for_its_own_flows() {
        let law = AdaptiveLaw::new(AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)).expect("law");
        let charged = |f: HostFlow, reads: bool, peer: u8| ChargedFlow {
            flow: f,
            charged: Resource::of(reads, peer),
            peer: Some(peer),
        };
        let flows = [
            charged(flow(1, 10, FlowClass::Latency, 1), false, 7),
            charged(flow(2, 20, FlowClass::Bandwidth, 1), false, 7),
            charged(flow(3, 30, FlowClass::Bandwidth, 1), true, 7),
            charged(flow(4, 40, FlowClass::Bandwidth, 1), true, 8),
        ];
        let specs: Vec<FlowSpec> = flows.iter().map(|f| f.flow.spec).collect();
        let host = Observation {
            tenants: TenantWeights::of(&specs),
            target99: Some(Duration::from_nanos(2400)),
            current99: None,
            other_bytes_per_sec: 1e9,
        };
        let (send_plan, got) = charged_allotments(&law, &host, &flows, |r| match r {
            Resource::SendPath => 1e9,
            Resource::Responder(_) => 0.0,
        });
        let got: BTreeMap<FlowId, Option<FlowAllotment>> = got.into_iter().collect();
        assert_eq!(got.len(), 4);
        assert_eq!(got[&FlowId(1)], None);
        for (id, want) in [(2, 4.875e9), (3, 5.85e9), (4, 5.85e9)] {
            let a = got[&FlowId(id)].expect("allotted");
            assert!((a.bytes_per_sec - want).abs() < 1.0, "{id}: {a:?}");
            assert_eq!(a.chunk_bytes, 1200, "{id}");
        }
        assert_eq!(send_plan.chunk_bytes, 1200);
        assert!((send_plan.pace_bytes_per_sec.expect("paced") - 4.875e9).abs() < 1.0);
    }

    /// A throughput flow that READs from a peer is still paced with this host's send
    /// path, where its small requests leave: beside a latency and a WRITE tenant (share
    /// 1/3), on one queue pair of 5.5 Mops/s, at 5.5e6 / 3 operations/s. Planned with the
    /// responder's stream, which has no throughput flows, it would not be paced at all.
    #[test]
    fn a_throughput_flow_reading_from_a_peer_is_paced_with_this_hosts_path() {
        let config = AdaptiveConfig {
            max_ops_per_sec: 30e6,
            qp_ops_per_sec: 5.5e6,
            ..AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)
        };
        let law = AdaptiveLaw::new(config).expect("law");
        let charged = |f: HostFlow, reads: bool| ChargedFlow {
            flow: f,
            charged: Resource::of(reads, 7u8),
            peer: Some(7u8),
        };
        let flows = [
            charged(flow(1, 10, FlowClass::Latency, 1), false),
            charged(flow(2, 20, FlowClass::Bandwidth, 1), false),
            charged(flow(3, 30, FlowClass::Throughput, 1), true),
        ];
        let specs: Vec<FlowSpec> = flows.iter().map(|f| f.flow.spec).collect();
        let host = Observation {
            tenants: TenantWeights::of(&specs),
            target99: Some(Duration::from_micros(2)),
            ..Observation::default()
        };
        let (_, got) = charged_allotments(&law, &host, &flows, |_| 0.0);
        let got: BTreeMap<FlowId, Option<FlowAllotment>> = got.into_iter().collect();
        let ops = got[&FlowId(3)]
            .expect("allotted")
            .ops_per_sec
            .expect("paced by operations");
        assert!((ops - 5.5e6 / 3.0).abs() < 1e-3, "{ops}");
    }

    /// Throughput flows beside a latency and a bandwidth tenant, with MaxTput 30 Mops/s
    /// and 5.5 Mops/s a queue pair: the share is 1/3; one tenant's two flows on one queue
    /// pair each post at most 11 Mops/s together, so each is paced at 11/3/2. The bandwidth
    /// flow's four queue pairs are not the throughput flows' (counted, they would make it
    /// 27.5/3/2).
    #[test]
    fn throughput_flows_are_paced_by_operations_split_among_their_tenants_flows() {
        let config = AdaptiveConfig {
            max_ops_per_sec: 30e6,
            qp_ops_per_sec: 5.5e6,
            ..AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)
        };
        let law = AdaptiveLaw::new(config).expect("law");
        let flows = [
            flow(1, 10, FlowClass::Latency, 1),
            HostFlow {
                qps: 4,
                ..flow(2, 20, FlowClass::Bandwidth, 1)
            },
            flow(3, 30, FlowClass::Throughput, 1),
            flow(4, 30, FlowClass::Throughput, 1),
        ];
        let specs: Vec<FlowSpec> = flows.iter().map(|f| f.spec).collect();
        let plan = law.plan(&Observation {
            tenants: TenantWeights::of(&specs),
            target99: Some(Duration::from_micros(2)),
            ..Observation::default()
        });
        let got = allotments(&law, &plan, &flows);
        for a in [got[2].1, got[3].1] {
            let a = a.expect("allotted");
            let ops = a.ops_per_sec.expect("paced by operations");
            assert!((ops - 11e6 / 6.0).abs() < 1e-3, "{ops}");
            assert_eq!((a.bytes_per_sec, a.chunk_bytes), (6e9, 4096));
        }
    }

    /// Two bandwidth tenants of weight 2^31: their weights sum past u32::MAX, and each
    /// gets half of the pace (3e9 of 6e9 B/s), not a panic or a wrapped sum.
    #[test]
    fn two_tenants_of_weight_2_pow_31_each_get_half_the_pace() {
        let law = AdaptiveLaw::new(AdaptiveConfig::for_rnic(6e9, 4096, 1 << 20)).expect("valid");
        let flows = [
            flow(1, 1, FlowClass::Bandwidth, 1 << 31),
            flow(2, 2, FlowClass::Bandwidth, 1 << 31),
        ];
        let plan = Plan {
            pace_bytes_per_sec: Some(6e9),
            ..law.plan(&Observation::default())
        };
        for (id, a) in allotments(&law, &plan, &flows) {
            let bytes = a.expect("a bandwidth flow").bytes_per_sec;
            assert_eq!(bytes, 3e9, "flow {id:?}: {bytes} B/s, half of 6e9");
        }
    }
}
