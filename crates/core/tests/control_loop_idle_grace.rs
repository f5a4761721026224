//! The control loop's idle grace: a flow that reports no work keeps its share for
//! `idle_grace_periods` RefPeriods, gives it away at the first update after that, and one
//! that resumes gets it back at the next update. Expected times come from the settings
//! (RefPeriod 0.5 ms, grace 2 RefPeriods, updates every RefPeriod from 0.5 ms), expected
//! shares from the division of two equal flows; none from the loop.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use justitia_core::control_loop::{ControlLoop, FlowRegistration, LoopConfig, Target99};
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

/// A loop with two bandwidth flows of their own tenants, both active since the start, and
/// no latency flow (so no probe, and SafeUtil stays at MaxRate).
struct Host {
    lp: ControlLoop,
    now: Duration,
    /// (update time, flow 1's fraction of MaxRate, flow 2's), after every update.
    shares: Vec<(Duration, f64, f64)>,
}

impl Host {
    fn new(config: LoopConfig) -> Host {
        let profile = RnicProfile::builtin("IB-56").unwrap();
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        for id in [1, 2] {
            let spec = FlowSpec {
                id: FlowId(id),
                tenant: TenantId(id),
                class: FlowClass::Bandwidth,
                weight: Weight::ONE,
            };
            lp.register_flow(Duration::ZERO, FlowRegistration { spec, qps: 1 })
                .unwrap();
            lp.set_flow_active(Duration::ZERO, FlowId(id), true)
                .unwrap();
        }
        Host {
            lp,
            now: Duration::ZERO,
            shares: Vec::new(),
        }
    }

    /// A flow's fraction of MaxRate; 0 for a flow not registered.
    fn share(&self, id: u64) -> f64 {
        self.lp
            .allotment(FlowId(id))
            .map_or(0.0, |a| a.bytes_per_sec / self.lp.max_rate())
    }

    /// Runs every update due up to and including `end`.
    fn run_until(&mut self, end: Duration) {
        while let Some(t) = self.lp.poll_timeout().filter(|&t| t <= end) {
            self.now = t;
            self.lp.handle_timeout(t);
            while self.lp.poll_event().is_some() {}
            self.shares.push((t, self.share(1), self.share(2)));
        }
        self.now = end;
    }

    fn set_active(&mut self, id: u64, active: bool) {
        self.lp
            .set_flow_active(self.now, FlowId(id), active)
            .unwrap();
    }

    /// The shares after the updates in `[from, to]`.
    fn shares_between(&self, from: Duration, to: Duration) -> Vec<(Duration, f64, f64)> {
        self.shares
            .iter()
            .copied()
            .filter(|&(t, _, _)| t >= from && t <= to)
            .collect()
    }
}

const HALF: f64 = 0.5;

#[test]
fn the_default_grace_is_two_ref_periods() {
    let config = LoopConfig::default();
    assert_eq!(config.ref_period, us(500));
    assert_eq!(config.idle_grace(), us(1_000));
    // It follows a RefPeriod set without touching the grace, as the daemon sets it.
    let config = LoopConfig {
        ref_period: us(200),
        ..LoopConfig::default()
    };
    assert_eq!(config.idle_grace(), us(400));
}

#[test]
fn a_flow_idle_for_less_than_the_grace_keeps_its_allotment() {
    let mut h = Host::new(LoopConfig::default());
    h.run_until(us(5_000));
    assert_eq!((h.share(1), h.share(2)), (HALF, HALF));
    let before = h.lp.allotment(FlowId(1)).unwrap();
    // Idle at 5.1 ms, across the updates of 5.5 and 6.0 ms, back at 6.05 ms: 0.95 ms,
    // under the 1 ms grace.
    h.run_until(us(5_100));
    h.set_active(1, false);
    h.run_until(us(6_050));
    h.set_active(1, true);
    h.run_until(us(8_000));
    let during = h.shares_between(us(5_100), us(8_000));
    assert_eq!(
        during.len(),
        6,
        "updates at 5.5, 6.0, ... 8.0 ms: {during:?}"
    );
    assert!(
        during.iter().all(|&(_, a, b)| (a, b) == (HALF, HALF)),
        "{during:?}"
    );
    // Not even rewritten: the allotment the shaper holds stays valid.
    assert_eq!(h.lp.allotment(FlowId(1)).unwrap(), before);
}

#[test]
fn a_flow_idle_longer_than_the_grace_gives_its_share_within_grace_and_one_period() {
    let mut h = Host::new(LoopConfig::default());
    h.run_until(us(5_200));
    h.set_active(1, false);
    h.run_until(us(10_000));
    // Idle from 5.2 ms: the grace runs out at 6.2 ms, so the updates of 5.5, 6.0 keep the
    // share and the one of 6.5 ms (within 6.2 + 0.5) gives it to flow 2.
    for (t, a, b) in h.shares_between(us(5_200), us(10_000)) {
        let expected = if t < us(6_200) {
            (HALF, HALF)
        } else {
            (0.0, 1.0)
        };
        assert_eq!((a, b), expected, "at {t:?}");
    }
    assert_eq!(h.lp.counts().bandwidth, 1);
}

#[test]
fn a_resumed_flow_gets_its_share_back_at_the_next_update() {
    let mut h = Host::new(LoopConfig::default());
    h.run_until(us(5_200));
    h.set_active(1, false);
    h.run_until(us(8_300));
    assert_eq!((h.share(1), h.share(2)), (0.0, 1.0));
    h.set_active(1, true);
    // Resumed at 8.3 ms: the update of 8.5 ms counts it again.
    h.run_until(us(8_499));
    assert_eq!((h.share(1), h.share(2)), (0.0, 1.0));
    h.run_until(us(8_500));
    assert_eq!((h.share(1), h.share(2)), (HALF, HALF));
}

#[test]
fn a_flow_flickering_between_requests_never_loses_its_share() {
    // An RPC client: no work for 8 us of every 10 us (waiting for the reply), for 20 ms,
    // idle at every update (idle over [3, 11) us modulo 10 us, updates on whole 0.5 ms).
    let mut h = Host::new(LoopConfig::default());
    h.run_until(us(1_000));
    let generation = h.lp.allotment(FlowId(1)).unwrap().generation;
    let mut t = 1_003;
    while t < 21_000 {
        h.run_until(us(t));
        h.set_active(1, false);
        h.run_until(us(t + 8));
        h.set_active(1, true);
        t += 10;
    }
    h.run_until(us(21_000));
    let during = h.shares_between(us(1_000), us(21_000));
    assert!(during.len() >= 40);
    assert!(
        during.iter().all(|&(_, a, b)| (a, b) == (HALF, HALF)),
        "{:?}",
        during.iter().find(|&&(_, a, _)| a != HALF)
    );
    assert_eq!(h.lp.allotment(FlowId(1)).unwrap().generation, generation);
}

#[test]
fn a_removed_flow_has_no_grace() {
    let mut h = Host::new(LoopConfig::default());
    h.run_until(us(5_200));
    h.lp.remove_flow(h.now, FlowId(1)).unwrap();
    h.run_until(us(5_500));
    assert_eq!(h.share(2), 1.0);
    // Registered again, it starts idle: no grace from its former life.
    let spec = FlowSpec {
        id: FlowId(1),
        tenant: TenantId(1),
        class: FlowClass::Bandwidth,
        weight: Weight::ONE,
    };
    h.lp.register_flow(h.now, FlowRegistration { spec, qps: 1 })
        .unwrap();
    h.run_until(us(6_000));
    assert_eq!(h.lp.counts().bandwidth, 1);
}

#[test]
fn a_grace_of_zero_counts_a_flow_idle_at_the_next_update() {
    let config = LoopConfig {
        idle_grace_periods: 0,
        target: Target99::Absolute(us(5)),
        ..LoopConfig::default()
    };
    let mut h = Host::new(config);
    h.run_until(us(5_200));
    h.set_active(1, false);
    h.run_until(us(5_500));
    assert_eq!((h.share(1), h.share(2)), (0.0, 1.0));
}
