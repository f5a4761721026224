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
//! Invariants: the bandwidth flows' rates sum to the plan's pace (MaxRate when not
//! paced), and a tenant's sum is `pace x w / B` whatever the number of its flows, so a tenant does not
//! take another's bandwidth by opening more applications; every allotment is finite and
//! positive.

use std::collections::BTreeMap;

use super::{AdaptiveLaw, Plan};
use crate::flow::{FlowClass, FlowId, FlowSpec, TenantId};

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
    let total_weight: u32 = bandwidth.values().map(|&(w, _)| w).sum();
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
                        / f64::from(total_weight.max(1))
                        / f64::from(count.max(1));
                    Some(FlowAllotment {
                        bytes_per_sec,
                        ops_per_sec: None,
                        chunk_bytes: plan.chunk_bytes,
                    })
                }
                FlowClass::Throughput => Some(FlowAllotment {
                    bytes_per_sec: max_rate,
                    ops_per_sec: throughput.get(&f.spec.id).copied().flatten(),
                    chunk_bytes: config.mtu,
                }),
            };
            (f.spec.id, allotment)
        })
        .collect()
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

    /// Throughput flows beside a latency and a bandwidth tenant, with MaxTput 30 Mops/s
    /// and 5.5 Mops/s a queue pair: the share is 1/3; one tenant's two flows on one queue
    /// pair each post at most 11 Mops/s together, so each is paced at 11/3/2.
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
            flow(2, 20, FlowClass::Bandwidth, 1),
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
}
