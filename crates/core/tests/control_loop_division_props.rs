//! The loop's division of SafeUtil checked against the straightforward one: whatever
//! flows come, go and change activity, after every update each resource-hungry flow's
//! allotment is, to the last bit, its `allot_rates` fraction (SafeUtil 1, every active
//! resource-hungry flow with an unbounded demand) times SafeUtil, with the loop's chunk
//! size and token, release phases i/n in id order under one epoch, and a generation that
//! moved exactly when the allotment did; and L, B, T are the distinct (tenant, class) pairs
//! among the active flows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use justitia_core::allotment::{allot_rates, Demand, FlowDemand, Token};
use justitia_core::control_loop::{Allotment, ControlLoop, FlowRegistration, LoopConfig, Target99};
use justitia_core::flow::{FlowClass, FlowCounts, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Input {
    Register {
        id: u64,
        tenant: u64,
        class: FlowClass,
        weight: u32,
    },
    Remove(u64),
    Active(u64, bool),
    Update,
}

fn input() -> impl Strategy<Value = Input> {
    let class = prop_oneof![
        1 => Just(FlowClass::Latency),
        2 => Just(FlowClass::Bandwidth),
        2 => Just(FlowClass::Throughput)
    ];
    prop_oneof![
        3 => (0u64..24, 0u64..7, class, 1u32..=5).prop_map(|(id, tenant, class, weight)| {
            Input::Register { id, tenant, class, weight }
        }),
        1 => (0u64..24).prop_map(Input::Remove),
        5 => (0u64..24, any::<bool>()).prop_map(|(id, a)| Input::Active(id, a)),
        2 => Just(Input::Update),
    ]
}

/// Checks the loop's allotments and counts against a model of the registered flows
/// (id -> spec and activity) and the allotments seen at the previous update (of flows
/// registered since).
fn check(
    lp: &ControlLoop,
    profile: &RnicProfile,
    model: &BTreeMap<u64, (FlowSpec, bool)>,
    previous: &mut BTreeMap<u64, Allotment>,
) -> Result<(), TestCaseError> {
    let demands: Vec<FlowDemand> = model
        .values()
        .filter(|(spec, active)| *active && spec.class.is_resource_hungry())
        .map(|(spec, _)| FlowDemand {
            spec: *spec,
            demand: Demand::Unbounded,
        })
        .collect();
    let fractions: BTreeMap<FlowId, f64> = allot_rates(1.0, profile, &demands)
        .iter()
        .map(|r| (r.flow, r.bytes_per_sec))
        .collect();
    let safe_util = lp.safe_util();
    // `model` is ordered by id, as the phases are.
    let sharing: Vec<FlowId> = model
        .values()
        .filter(|(spec, active)| *active && spec.class.is_resource_hungry())
        .map(|(spec, _)| spec.id)
        .collect();
    let epoch = model
        .values()
        .find_map(|(spec, _)| lp.allotment(spec.id))
        .map_or(0, |a| a.phase.epoch);
    for (spec, _) in model.values() {
        let allotment = lp.allotment(spec.id);
        if !spec.class.is_resource_hungry() {
            prop_assert_eq!(allotment, None);
            continue;
        }
        let allotment = allotment.expect("a resource-hungry flow has an allotment");
        let expected = fractions.get(&spec.id).copied().unwrap_or(0.0) * safe_util;
        // Release phases: the sharing flows at i/n in the order of their ids, others at 0,
        // all under the loop's one epoch.
        let offset = sharing
            .iter()
            .position(|id| *id == spec.id)
            .map_or(0.0, |i| i as f64 / sharing.len() as f64);
        prop_assert_eq!(allotment.phase.offset, offset);
        prop_assert_eq!(allotment.phase.epoch, epoch);
        prop_assert_eq!(
            allotment.bytes_per_sec.to_bits(),
            expected.to_bits(),
            "flow {:?}: {} bytes/s, expected {}",
            spec.id,
            allotment.bytes_per_sec,
            expected
        );
        prop_assert_eq!(
            allotment.ops_per_sec.to_bits(),
            (expected * profile.ops_per_byte()).to_bits()
        );
        prop_assert_eq!(allotment.chunk_bytes, lp.chunk_bytes());
        prop_assert_eq!(
            allotment.token,
            Token::for_profile(u64::from(lp.chunk_bytes()), profile)
        );
        if let Some(before) = previous.insert(spec.id.0, allotment) {
            let moved = before.bytes_per_sec != allotment.bytes_per_sec
                || before.chunk_bytes != allotment.chunk_bytes
                || before.phase != allotment.phase;
            if moved {
                prop_assert!(allotment.generation > before.generation);
                prop_assert_eq!(allotment.generation, lp.generation());
            } else {
                prop_assert_eq!(allotment.generation, before.generation);
            }
        }
        prop_assert!(allotment.generation <= lp.generation());
    }
    let distinct: BTreeSet<(TenantId, FlowClass)> = model
        .values()
        .filter(|(_, active)| *active)
        .map(|(spec, _)| (spec.tenant, spec.class))
        .collect();
    let mut counts = FlowCounts::default();
    for (_, class) in distinct {
        counts.add(class);
    }
    prop_assert_eq!(lp.counts(), counts);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn division_matches_allot_rates_bit_for_bit(
        steps in prop::collection::vec(input(), 1..200),
    ) {
        let profile = RnicProfile::builtin("RoCE-100").unwrap();
        let config = LoopConfig {
            target: Target99::Absolute(Duration::from_micros(5)),
            // The model counts a flow idle as soon as it says so; the grace has its own tests.
            idle_grace_periods: 0,
            ..LoopConfig::default()
        };
        let mut now = Duration::ZERO;
        let mut lp = ControlLoop::new(config, &profile, now).unwrap();
        let mut model: BTreeMap<u64, (FlowSpec, bool)> = BTreeMap::new();
        let mut previous = BTreeMap::new();
        for step in steps {
            match step {
                Input::Register { id, tenant, class, weight } => {
                    let spec = FlowSpec {
                        id: FlowId(id),
                        tenant: TenantId(tenant),
                        class,
                        weight: Weight::new(weight).unwrap(),
                    };
                    let known = model.contains_key(&id);
                    let result = lp.register_flow(now, FlowRegistration { spec, qps: 1 });
                    prop_assert_eq!(result.is_err(), known);
                    if !known {
                        model.insert(id, (spec, false));
                        previous.remove(&id);
                    }
                }
                Input::Remove(id) => {
                    let result = lp.remove_flow(now, FlowId(id));
                    prop_assert_eq!(result.is_ok(), model.remove(&id).is_some());
                }
                Input::Active(id, active) => {
                    let result = lp.set_flow_active(now, FlowId(id), active);
                    match model.get_mut(&id) {
                        Some(entry) => {
                            prop_assert!(result.is_ok());
                            entry.1 = active;
                        }
                        None => prop_assert!(result.is_err()),
                    }
                }
                Input::Update => {
                    now = lp.poll_timeout().unwrap();
                    lp.handle_timeout(now);
                    while lp.poll_event().is_some() {}
                    check(&lp, &profile, &model, &mut previous)?;
                }
            }
        }
    }
}
