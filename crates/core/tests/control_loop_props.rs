//! Property tests of the control loop over arbitrary input sequences: however the inputs
//! arrive, SafeUtil goes down at most once per RefPeriod, and the allotments stay within
//! SafeUtil and go to active resource-hungry flows only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use justitia_core::control_loop::{ControlLoop, Event, FlowRegistration, LoopConfig, Target99};
use justitia_core::controller::IncreaseLaw;
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Input {
    Register {
        id: u64,
        tenant: u64,
        class: FlowClass,
    },
    Remove(u64),
    Active(u64, bool),
    SendProbe,
    CompleteProbe {
        index: usize,
        latency_ns: u64,
    },
    LoseProbe(usize),
    Timeout,
}

fn input() -> impl Strategy<Value = Input> {
    let class = prop_oneof![
        Just(FlowClass::Latency),
        Just(FlowClass::Bandwidth),
        Just(FlowClass::Throughput)
    ];
    prop_oneof![
        2 => (0u64..8, 0u64..4, class).prop_map(|(id, tenant, class)| Input::Register { id, tenant, class }),
        1 => (0u64..8).prop_map(Input::Remove),
        3 => (0u64..8, any::<bool>()).prop_map(|(id, a)| Input::Active(id, a)),
        3 => Just(Input::SendProbe),
        4 => (0usize..4, 500u64..20_000).prop_map(|(index, latency_ns)| Input::CompleteProbe { index, latency_ns }),
        1 => (0usize..4).prop_map(Input::LoseProbe),
        4 => Just(Input::Timeout),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn at_most_one_decrease_per_ref_period(
        steps in prop::collection::vec((input(), 0u64..400_000), 1..400),
        search in any::<bool>(),
    ) {
        let config = LoopConfig {
            target: Target99::Absolute(Duration::from_micros(3)),
            increase: if search { IncreaseLaw::SEARCH } else { IncreaseLaw::Fixed },
            window: 20,
            unattainable_after: Some(Duration::from_millis(10)),
            // The model counts a flow idle as soon as it says so; the grace has its own tests.
            idle_grace_periods: 0,
            ..LoopConfig::default()
        };
        let ref_period = config.ref_period;
        let profile = RnicProfile::builtin("RoCE-100").unwrap();
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        let mut now = Duration::ZERO;
        let mut probes = Vec::new();
        let mut flows: BTreeMap<u64, (FlowClass, bool)> = BTreeMap::new();
        let mut last_decrease: Option<Duration> = None;
        let mut safe_util = lp.safe_util();
        for (input, gap_ns) in steps {
            now += Duration::from_nanos(gap_ns);
            match input {
                Input::Register { id, tenant, class } => {
                    let spec = FlowSpec { id: FlowId(id), tenant: TenantId(tenant), class, weight: Weight::ONE };
                    if lp.register_flow(now, FlowRegistration { spec, qps: 1 }).is_ok() {
                        flows.insert(id, (class, false));
                    }
                }
                Input::Remove(id) => {
                    prop_assert_eq!(lp.remove_flow(now, FlowId(id)).is_ok(), flows.remove(&id).is_some());
                }
                Input::Active(id, active) => {
                    prop_assert_eq!(lp.set_flow_active(now, FlowId(id), active).is_ok(), flows.contains_key(&id));
                    if let Some(flow) = flows.get_mut(&id) {
                        flow.1 = active;
                    }
                }
                Input::SendProbe => probes.push(lp.probe_sent(now)),
                Input::CompleteProbe { index, latency_ns } => {
                    if index < probes.len() {
                        let id = probes.remove(index);
                        lp.probe_completed(now + Duration::from_nanos(latency_ns), id);
                    }
                }
                Input::LoseProbe(index) => {
                    if index < probes.len() {
                        let id = probes.remove(index);
                        lp.probe_lost(now, id);
                    }
                }
                Input::Timeout => {
                    let due = lp.poll_timeout().unwrap();
                    now = now.max(due);
                    lp.handle_timeout(now);
                }
            }
            while let Some(event) = lp.poll_event() {
                if event == Event::ProbeDue {
                    probes.push(lp.probe_sent(now));
                }
            }
            let after = lp.safe_util();
            prop_assert!(after > 0.0 && after <= lp.max_rate());
            if after < safe_util {
                if let Some(previous) = last_decrease {
                    prop_assert!(now - previous >= ref_period, "decreases at {:?} and {:?}", previous, now);
                }
                last_decrease = Some(now);
            }
            safe_util = after;
            // Allotments: only resource-hungry flows have one, and they sum to at most
            // SafeUtil.
            let mut total = 0.0;
            for (&id, &(class, _)) in &flows {
                let allotment = lp.allotment(FlowId(id));
                prop_assert_eq!(allotment.is_some(), class != FlowClass::Latency);
                total += allotment.map_or(0.0, |a| a.bytes_per_sec);
            }
            prop_assert!(total <= after * (1.0 + 1e-9), "{} > {}", total, after);
        }
    }
}
