//! Property tests of the SafeUtil controller over random update sequences.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use justitia_core::controller::{
    ControlAction, ControlMode, ControllerConfig, IncreaseLaw, SafeUtilController,
};
use justitia_core::flow::FlowCounts;
use justitia_core::profile::RnicProfile;
use proptest::prelude::*;

fn step() -> impl Strategy<Value = (FlowCounts, Option<Duration>, u64)> {
    let counts =
        (0u32..5, 0u32..4, 0u32..4).prop_map(|(latency, bandwidth, throughput)| FlowCounts {
            latency,
            bandwidth,
            throughput,
        });
    let p99 = prop_oneof![
        Just(None),
        (500u64..4_000).prop_map(|n| Some(Duration::from_nanos(n))),
    ];
    // Gaps of one RefPeriod mostly, sometimes seconds (to reach the unattainable mode).
    let gap = prop_oneof![9 => Just(500u64), 1 => 500u64..3_000_000];
    (counts, p99, gap)
}

proptest! {
    #[test]
    fn safe_util_stays_between_floor_and_max_rate(
        steps in prop::collection::vec(step(), 1..400),
        unattainable in any::<bool>(),
        search in any::<bool>(),
    ) {
        let config = ControllerConfig {
            unattainable_after: unattainable.then(|| Duration::from_secs(1)),
            increase: if search { IncreaseLaw::SEARCH } else { IncreaseLaw::Fixed },
            ..ControllerConfig::default()
        };
        let target = config.target_p99;
        let mut c = SafeUtilController::new(config, &RnicProfile::builtin("RoCE-100").unwrap())
            .unwrap();
        let max = c.max_rate();
        let mut now = Duration::ZERO;
        for (counts, p99, gap) in steps {
            now += Duration::from_micros(gap);
            let before = c.safe_util();
            let action = c.update(now, counts, p99);
            let after = c.safe_util();
            prop_assert!(after > 0.0 && after <= max);
            let tau = c.tau().as_secs_f64();
            let expected_tau = 1e6 / after;
            prop_assert!((tau - expected_tau).abs() <= 1e-9 + 1e-9 * expected_tau);
            match action {
                ControlAction::Reset | ControlAction::Unattainable => prop_assert_eq!(after, max),
                ControlAction::Decrease => {
                    prop_assert!(p99.is_some_and(|p| p > target));
                    let expected = (before / 2.0).max(c.sharing_floor(counts));
                    prop_assert!((after - expected).abs() <= 1e-9 * max);
                }
                ControlAction::Increase | ControlAction::Settle => {
                    prop_assert!(p99.is_some_and(|p| p <= target));
                    prop_assert!(after >= before.min(max) - 1e-9 * max);
                }
                ControlAction::Hold => prop_assert!(p99.is_none()),
            }
            if counts.latency > 0 && c.mode() == ControlMode::Normal {
                prop_assert!(after >= c.sharing_floor(counts) * (1.0 - 1e-12));
                prop_assert!(action != ControlAction::Reset);
            }
            if !unattainable {
                prop_assert_eq!(c.mode(), ControlMode::Normal);
            }
        }
    }
}
