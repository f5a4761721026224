//! Property tests of the allotment: rate water-filling and the token stream.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use justitia_core::allotment::{allot_rates, Demand, FlowDemand, Token, TokenStream};
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;
use proptest::prelude::*;

/// Relative slack for floating-point sums.
const EPS: f64 = 1e-9;

fn profile() -> RnicProfile {
    RnicProfile::builtin("IB-56").unwrap()
}

/// Up to 6 tenants of weight 1..=4, each with 1..=3 flows of a random class and demand.
/// Flows of a tenant carry the tenant's weight.
fn flows() -> impl Strategy<Value = Vec<FlowDemand>> {
    let demand = prop_oneof![
        Just(Demand::Unbounded),
        Just(Demand::BytesPerSec(0.0)),
        (0.0f64..8e9).prop_map(Demand::BytesPerSec),
        (0.0f64..4e7).prop_map(Demand::OpsPerSec),
    ];
    let class = prop_oneof![
        Just(FlowClass::Latency),
        Just(FlowClass::Throughput),
        Just(FlowClass::Bandwidth),
    ];
    let tenant = (1u32..=4, prop::collection::vec((class, demand), 1..=3));
    prop::collection::vec(tenant, 0..=6).prop_map(|tenants| {
        let mut out = Vec::new();
        for (t, (weight, flows)) in tenants.into_iter().enumerate() {
            for (class, demand) in flows {
                out.push(FlowDemand {
                    spec: FlowSpec {
                        id: FlowId(out.len() as u64),
                        tenant: TenantId(t as u64),
                        class,
                        weight: Weight::new(weight).unwrap(),
                    },
                    demand,
                });
            }
        }
        out
    })
}

/// Demand in bytes/s as the allotment reads it.
fn demand_bytes(demand: Demand) -> f64 {
    match demand {
        Demand::Unbounded => f64::INFINITY,
        Demand::BytesPerSec(b) => b,
        Demand::OpsPerSec(ops) => ops / profile().ops_per_byte(),
    }
}

/// Per tenant of the resource-hungry flows: (weight, demand, granted).
fn tenant_totals(flows: &[FlowDemand], safe_util: f64) -> BTreeMap<TenantId, (f64, f64, f64)> {
    let rates = allot_rates(safe_util, &profile(), flows);
    let mut totals = BTreeMap::new();
    let hungry = flows.iter().filter(|f| f.spec.class.is_resource_hungry());
    for (f, rate) in hungry.zip(&rates) {
        assert_eq!(f.spec.id, rate.flow);
        let entry = totals.entry(f.spec.tenant).or_insert((0.0, 0.0, 0.0));
        entry.0 = f64::from(f.spec.weight.get());
        entry.1 += demand_bytes(f.demand);
        entry.2 += rate.bytes_per_sec;
    }
    totals
}

proptest! {
    #[test]
    fn rates_never_exceed_safe_util_and_use_it_all_when_demand_allows(
        flows in flows(),
        safe_util in 1e6f64..6e9,
    ) {
        let totals = tenant_totals(&flows, safe_util);
        let granted: f64 = totals.values().map(|t| t.2).sum();
        let demanded: f64 = totals.values().map(|t| t.1).sum();
        prop_assert!(granted <= safe_util * (1.0 + EPS), "{} > {}", granted, safe_util);
        let expected = demanded.min(safe_util);
        prop_assert!((granted - expected).abs() <= EPS * safe_util, "{} vs {}", granted, expected);
        if demanded.is_infinite() {
            prop_assert!((granted - safe_util).abs() <= EPS * safe_util);
        }
    }

    #[test]
    fn every_tenant_gets_its_weighted_share_unless_it_wants_less(
        flows in flows(),
        safe_util in 1e6f64..6e9,
    ) {
        let totals = tenant_totals(&flows, safe_util);
        let weights: f64 = totals.values().map(|t| t.0).sum();
        for (tenant, &(weight, demand, granted)) in &totals {
            let share = weight / weights * safe_util;
            prop_assert!(
                granted >= demand.min(share) * (1.0 - EPS),
                "{:?} got {} of demand {} share {}", tenant, granted, demand, share
            );
            prop_assert!(granted <= demand * (1.0 + EPS) + EPS);
        }
    }

    #[test]
    fn allotment_is_weighted_max_min_fair(
        flows in flows(),
        safe_util in 1e6f64..6e9,
    ) {
        // A tenant held below its demand has at least the per-weight rate of any other.
        let totals = tenant_totals(&flows, safe_util);
        for &(weight, demand, granted) in totals.values() {
            if granted < demand * (1.0 - EPS) {
                for &(other_weight, _, other_granted) in totals.values() {
                    prop_assert!(
                        granted / weight >= other_granted / other_weight * (1.0 - EPS) - EPS
                    );
                }
            }
        }
    }

    #[test]
    fn idle_flows_get_nothing_and_backlogged_flows_of_a_tenant_share_equally(
        flows in flows(),
        safe_util in 1e6f64..6e9,
    ) {
        let rates = allot_rates(safe_util, &profile(), &flows);
        let hungry: Vec<&FlowDemand> =
            flows.iter().filter(|f| f.spec.class.is_resource_hungry()).collect();
        let mut backlogged: BTreeMap<TenantId, Vec<f64>> = BTreeMap::new();
        for (f, rate) in hungry.iter().zip(&rates) {
            prop_assert!((rate.ops_per_sec - rate.bytes_per_sec * profile().ops_per_byte()).abs()
                <= EPS * rate.ops_per_sec.max(1.0));
            match f.demand {
                Demand::BytesPerSec(0.0) => prop_assert_eq!(rate.bytes_per_sec, 0.0),
                Demand::Unbounded => {
                    backlogged.entry(f.spec.tenant).or_default().push(rate.bytes_per_sec)
                }
                _ => {}
            }
        }
        for shares in backlogged.values() {
            for s in shares {
                prop_assert!((s - shares[0]).abs() <= EPS * shares[0].max(1.0));
            }
        }
    }

    #[test]
    fn token_stream_long_run_shares_follow_weights(
        tenants in prop::collection::vec((1u32..=4, 1usize..=3), 1..=5),
        rounds in 1u64..20,
    ) {
        let mut active = Vec::new();
        for (t, &(weight, flows)) in tenants.iter().enumerate() {
            for _ in 0..flows {
                active.push(FlowSpec {
                    id: FlowId(active.len() as u64),
                    tenant: TenantId(t as u64),
                    class: FlowClass::Bandwidth,
                    weight: Weight::new(weight).unwrap(),
                });
            }
        }
        let round: u64 = tenants.iter().map(|t| u64::from(t.0)).sum();
        let tau = Duration::from_micros(167);
        let mut stream = TokenStream::new(Token::for_profile(1_000_000, &profile()), Duration::ZERO);
        let mut per_flow: BTreeMap<FlowId, u64> = BTreeMap::new();
        let mut per_tenant: BTreeMap<TenantId, u64> = BTreeMap::new();
        for _ in 0..rounds * round {
            let now = stream.next_token_due(tau);
            let grant = stream.issue(now, tau, &active).unwrap();
            *per_flow.entry(grant.flow).or_default() += 1;
            *per_tenant.entry(grant.tenant).or_default() += 1;
        }
        for (t, &(weight, flows)) in tenants.iter().enumerate() {
            let got = per_tenant.get(&TenantId(t as u64)).copied().unwrap_or(0);
            prop_assert_eq!(got, rounds * u64::from(weight));
            let counts: Vec<u64> = active
                .iter()
                .filter(|f| f.tenant == TenantId(t as u64))
                .map(|f| per_flow.get(&f.id).copied().unwrap_or(0))
                .collect();
            prop_assert_eq!(counts.len(), flows);
            let (min, max) = (counts.iter().min(), counts.iter().max());
            prop_assert!(max.zip(min).is_some_and(|(a, b)| a - b <= 1), "{:?}", counts);
        }
    }

    #[test]
    fn token_stream_only_grants_to_active_hungry_flows_as_the_set_changes(
        sets in prop::collection::vec(flows(), 1..40),
    ) {
        let tau = Duration::from_micros(10);
        let mut stream = TokenStream::new(Token { bytes: 5_120, ops: 26 }, Duration::ZERO);
        let mut issued = 0u32;
        for set in &sets {
            let active: Vec<FlowSpec> = set.iter().map(|f| f.spec).collect();
            let now = stream.next_token_due(tau);
            match stream.issue(now, tau, &active) {
                Some(grant) => {
                    issued += 1;
                    prop_assert!(active.iter().any(|f| f.id == grant.flow
                        && f.tenant == grant.tenant
                        && f.class.is_resource_hungry()));
                }
                None => prop_assert!(active.iter().all(|f| !f.class.is_resource_hungry())),
            }
            prop_assert_eq!(stream.next_token_due(tau), now + tau);
        }
        prop_assert!(issued as usize <= sets.len());
    }
}
