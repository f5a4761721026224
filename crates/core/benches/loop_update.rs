//! The cost of one control-loop update for 1, 100 and 10 000 registered flows.
//!
//! `update` is the common case: a probe completes and the RefPeriod update runs. The
//! loop runs the paper's fixed step with a one-sample window and the probe is above
//! Target99 once in 100 updates, so every update moves SafeUtil (99 steps up, one
//! halving to the floor) and rewrites every allotment: the most an update does without a
//! change of flows. `update_after_flow_change` adds one flow going idle or
//! resuming before each update, so the counts and the division are redone too.

// criterion's macros generate the bench's entry points without documentation.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use justitia_core::control_loop::{ControlLoop, Event, FlowRegistration, LoopConfig, Target99};
use justitia_core::controller::IncreaseLaw;
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;

const TARGET: Duration = Duration::from_micros(5);

/// A loop with one latency flow (tenant 0) and `flows - 1` bandwidth flows of tenant 1,
/// all active, after its first update. One latency and one resource-hungry tenant put the
/// sharing floor at one half, so SafeUtil moves on every update and every allotment is
/// rewritten.
fn setup(flows: u64) -> (ControlLoop, Duration) {
    let profile = RnicProfile::builtin("RoCE-100").unwrap_or_else(|e| panic!("{e}"));
    let config = LoopConfig {
        target: Target99::Absolute(TARGET),
        increase: IncreaseLaw::Fixed,
        window: 1,
        ..LoopConfig::default()
    };
    let mut lp =
        ControlLoop::new(config, &profile, Duration::ZERO).unwrap_or_else(|e| panic!("{e}"));
    for id in 0..flows {
        let class = if id == 0 {
            FlowClass::Latency
        } else {
            FlowClass::Bandwidth
        };
        let spec = FlowSpec {
            id: FlowId(id),
            tenant: TenantId(id.min(1)),
            class,
            weight: Weight::ONE,
        };
        lp.register_flow(Duration::ZERO, FlowRegistration { spec, qps: 1 })
            .unwrap_or_else(|e| panic!("{e}"));
        lp.set_flow_active(Duration::ZERO, FlowId(id), true)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let now = lp.poll_timeout().unwrap_or_default();
    lp.handle_timeout(now);
    while lp.poll_event().is_some() {}
    (lp, now)
}

/// One RefPeriod: the outstanding probe completes, the update runs, its events are
/// drained and the next probe is sent.
fn step(
    lp: &mut ControlLoop,
    now: &mut Duration,
    probe: &mut Option<justitia_core::control_loop::ProbeId>,
    high: bool,
) {
    *now = lp.poll_timeout().unwrap_or(*now);
    if let Some(id) = probe.take() {
        let latency = if high { TARGET * 2 } else { TARGET / 2 };
        lp.probe_completed(now.saturating_sub(lp.config().ref_period) + latency, id);
    }
    lp.handle_timeout(*now);
    while let Some(event) = lp.poll_event() {
        if event == Event::ProbeDue {
            *probe = Some(lp.probe_sent(*now));
        }
        black_box(event);
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("control_loop");
    for flows in [1u64, 100, 10_000] {
        group.bench_with_input(BenchmarkId::new("update", flows), &flows, |b, &flows| {
            let (mut lp, mut now) = setup(flows);
            let mut probe = None;
            let mut count = 0u64;
            b.iter(|| {
                count += 1;
                step(&mut lp, &mut now, &mut probe, count.is_multiple_of(100));
            });
        });
        group.bench_with_input(
            BenchmarkId::new("update_after_flow_change", flows),
            &flows,
            |b, &flows| {
                let (mut lp, mut now) = setup(flows);
                let mut probe = None;
                let mut count = 0u64;
                b.iter(|| {
                    count += 1;
                    // The last flow (a bandwidth flow when there are several) flips.
                    let _ = lp.set_flow_active(now, FlowId(flows - 1), count.is_multiple_of(2));
                    step(&mut lp, &mut now, &mut probe, count.is_multiple_of(100));
                });
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
