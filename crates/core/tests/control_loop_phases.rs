//! The control loop's release phases: the n flows that share get offsets 0, 1/n, ... in the
//! order of their ids under one epoch, a new epoch whenever that set or the chunk size
//! changes, and the same epoch when only SafeUtil moves. Expected offsets come from n,
//! never from the loop.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use justitia_core::control_loop::{
    ControlLoop, Event, FlowRegistration, LoopConfig, Target99, ViolationRule,
};
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::pacer::ReleasePhase;
use justitia_core::profile::RnicProfile;

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

struct Host {
    lp: ControlLoop,
    now: Duration,
    /// Latency every probe completes with.
    probe_latency: Duration,
}

impl Host {
    fn new() -> Host {
        let config = LoopConfig {
            target: Target99::Absolute(us(5)),
            // One probe decides: the paper's rule on a window of one sample.
            window: 1,
            violation: ViolationRule::Current99,
            idle_grace_periods: 0,
            ..LoopConfig::default()
        };
        let profile = RnicProfile::builtin("IB-56").unwrap();
        Host {
            lp: ControlLoop::new(config, &profile, Duration::ZERO).unwrap(),
            now: Duration::ZERO,
            probe_latency: us(1),
        }
    }

    fn add(&mut self, id: u64, class: FlowClass) {
        let spec = FlowSpec {
            id: FlowId(id),
            tenant: TenantId(id),
            class,
            weight: Weight::ONE,
        };
        self.lp
            .register_flow(self.now, FlowRegistration { spec, qps: 1 })
            .unwrap();
        self.lp.set_flow_active(self.now, FlowId(id), true).unwrap();
    }

    /// Runs the updates due up to `end`; probes complete at once with `probe_latency`.
    fn run_until(&mut self, end: Duration) {
        while let Some(t) = self.lp.poll_timeout().filter(|&t| t <= end) {
            self.now = t;
            self.lp.handle_timeout(t);
            while let Some(event) = self.lp.poll_event() {
                if event == Event::ProbeDue {
                    let id = self.lp.probe_sent(t);
                    self.lp.probe_completed(t + self.probe_latency, id);
                }
            }
        }
        self.now = end;
    }

    fn phase(&self, id: u64) -> ReleasePhase {
        self.lp.allotment(FlowId(id)).unwrap().phase
    }

    fn offsets(&self, ids: &[u64]) -> Vec<f64> {
        ids.iter().map(|&id| self.phase(id).offset).collect()
    }
}

#[test]
fn sharing_flows_are_spread_over_one_interval_in_id_order() {
    let mut h = Host::new();
    for id in [4, 2, 3, 1] {
        h.add(id, FlowClass::Bandwidth);
    }
    h.run_until(us(500));
    assert_eq!(h.offsets(&[1, 2, 3, 4]), [0.0, 0.25, 0.5, 0.75]);
    let epoch = h.phase(1).epoch;
    assert!(epoch > 0);
    assert!([2, 3, 4].iter().all(|&id| h.phase(id).epoch == epoch));

    // Flow 2 stops: three flows share, at thirds, under a new epoch; flow 2 is at 0.
    h.lp.set_flow_active(h.now, FlowId(2), false).unwrap();
    h.run_until(us(1_000));
    assert_eq!(h.offsets(&[1, 3, 4, 2]), [0.0, 1.0 / 3.0, 2.0 / 3.0, 0.0]);
    assert!(h.phase(1).epoch > epoch);
}

#[test]
fn a_new_chunk_size_is_a_new_assignment_and_safe_util_alone_is_not() {
    let mut h = Host::new();
    h.add(1, FlowClass::Bandwidth);
    h.add(2, FlowClass::Bandwidth);
    h.run_until(us(500));
    let first = h.phase(1).epoch;
    // A latency flow: the chunk goes from 1 MB to 5 KB, a new release interval.
    h.add(3, FlowClass::Latency);
    h.run_until(us(1_000));
    assert_eq!(h.lp.chunk_bytes(), 5 * 1024);
    let rechunked = h.phase(1).epoch;
    assert!(rechunked > first);
    assert_eq!(h.offsets(&[1, 2]), [0.0, 0.5]);
    // Probes far above the 5 us target: SafeUtil halves, allotments change, the epoch
    // does not (every flow's wait scales alike, so the spacing holds).
    let before = h.lp.allotment(FlowId(1)).unwrap();
    h.probe_latency = us(100);
    h.run_until(us(3_000));
    let after = h.lp.allotment(FlowId(1)).unwrap();
    assert!(after.bytes_per_sec < before.bytes_per_sec);
    assert!(after.generation > before.generation);
    assert_eq!(after.phase, before.phase);
}
