//! The cost of one control-loop update for 1, 100 and 10 000 registered flows.
//!
//! `update` is the common case: a probe completes and the RefPeriod update runs. The
//! loop runs the paper's fixed step and violation rule with a one-sample window and the probe is above
//! Target99 once in 100 updates, so every update moves SafeUtil (99 steps up, one
//! halving to the floor) and rewrites every allotment: the most an update does without a
//! change of flows. `update_after_flow_change` adds one flow going idle or resuming before
//! each update, so the counts, the division and the release phases are redone too (the loop
//! runs without idle grace here: a flow that resumes within its grace never counted as
//! idle, and nothing would be redone); in `update_after_flow_change_many_tenants` every
//! bandwidth flow is a tenant of its own, with weights 1 to 4, so the division is weighted
//! across as many tenants as flows. `remove_and_register_first` is the churn of flows,
//! without an update: the flow of the lowest id goes and comes back, the worst case when
//! the loop kept its flows sorted by id.
//!
//! Beside them, in the same run, `adaptive`'s: `adaptive_update` is one update of the
//! adaptive law as the simulator's driver makes it, the flows' tenant weights counted from
//! the present flows (one latency tenant and the bandwidth flows as one tenant) and the law
//! stepped with a measured tail above the target once in 100 updates; `adaptive_pick` is
//! the per-chunk cost of dealing the bandwidth stream among tenants, one
//! `TenantRoundRobin::pick` over the bandwidth flows' queue pairs, every one ready, the
//! flows a tenant each (weights 1 to 4); `adaptive_allotments` is what `justitiad` adds to
//! each update under `policy = "adaptive"`, the plan split into one allotment per flow
//! (`adaptive::allotments`).
//!
//! On the shared 2-core development VM (criterion means, 1 / 100 / 10 000 flows):
//! `update` 75 ns / 169 ns / 11.3 us; `update_after_flow_change` 67 ns / 636 ns / 56 us;
//! `update_after_flow_change_many_tenants` 65 ns / 775 ns / 85 us;
//! `remove_and_register_first` 59 ns / 69 ns / 65 ns. The host's load moves them by up to
//! a factor of two; compare runs made one after the other. One run with `adaptive`'s beside
//! (`-- --warm-up-time 1 --measurement-time 2`, the VM busier): `update` 147 ns / 325 ns /
//! 32 us, `update_after_flow_change` 86 ns / 1.19 us / 303 us; `adaptive_update` 491 ns /
//! 1.49 us / 119 us (the tenant count's map of tenants and classes is most of it: the law's
//! own step does not depend on the flows); `adaptive_pick` 35 ns / 64 ns / 98 ns. With
//! `adaptive_allotments` beside them (same options, the VM busier still, `update` too noisy
//! to read): `update_after_flow_change` 208 ns / 5.1 us / 486 us, `adaptive_update` 233 ns /
//! 1.74 us / 211 us, `adaptive_allotments` 165 ns / 3.13 us / 282 us: justitiad's update
//! under `adaptive` (the two together) costs about what Justitia's does after a change of
//! flows.

// criterion's macros generate the bench's entry points without documentation.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use justitia_core::adaptive::allotments::{allotments, HostFlow};
use justitia_core::adaptive::{
    AdaptiveConfig, AdaptiveLaw, Observation, TenantRoundRobin, TenantWeights,
};
use justitia_core::control_loop::{
    ControlLoop, Event, FlowRegistration, LoopConfig, Target99, ViolationRule,
};
use justitia_core::controller::IncreaseLaw;
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;

const TARGET: Duration = Duration::from_micros(5);

/// A loop with one latency flow (tenant 0) and `flows - 1` bandwidth flows, all active,
/// after its first update. The bandwidth flows are one tenant (tenant 1, weight 1), or
/// with `many_tenants` a tenant each (weights 1 to 4). One latency and one resource-hungry
/// tenant put the sharing floor at one half, so SafeUtil moves on every update and every
/// allotment is rewritten.
fn setup(flows: u64, many_tenants: bool) -> (ControlLoop, Duration) {
    let profile = RnicProfile::builtin("RoCE-100").unwrap_or_else(|e| panic!("{e}"));
    let config = LoopConfig {
        target: Target99::Absolute(TARGET),
        increase: IncreaseLaw::Fixed,
        window: 1,
        // The paper's comparison: the default rule refuses a one-sample window.
        violation: ViolationRule::Current99,
        idle_grace_periods: 0,
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
        let (tenant, weight) = if many_tenants {
            (id, (id % 4) as u32 + 1)
        } else {
            (id.min(1), 1)
        };
        let spec = FlowSpec {
            id: FlowId(id),
            tenant: TenantId(tenant),
            class,
            weight: Weight::new(weight).unwrap_or_else(|e| panic!("{e}")),
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
            let (mut lp, mut now) = setup(flows, false);
            let mut probe = None;
            let mut count = 0u64;
            b.iter(|| {
                count += 1;
                step(&mut lp, &mut now, &mut probe, count.is_multiple_of(100));
            });
        });
        for (name, many_tenants) in [
            ("update_after_flow_change", false),
            ("update_after_flow_change_many_tenants", true),
        ] {
            group.bench_with_input(BenchmarkId::new(name, flows), &flows, |b, &flows| {
                let (mut lp, mut now) = setup(flows, many_tenants);
                let mut probe = None;
                let mut count = 0u64;
                b.iter(|| {
                    count += 1;
                    // The last flow (a bandwidth flow when there are several) flips.
                    let _ = lp.set_flow_active(now, FlowId(flows - 1), count.is_multiple_of(2));
                    step(&mut lp, &mut now, &mut probe, count.is_multiple_of(100));
                });
            });
        }
        group.bench_with_input(
            BenchmarkId::new("remove_and_register_first", flows),
            &flows,
            |b, &flows| {
                let (mut lp, now) = setup(flows, false);
                let spec = FlowSpec {
                    id: FlowId(0),
                    tenant: TenantId(0),
                    class: FlowClass::Latency,
                    weight: Weight::ONE,
                };
                b.iter(|| {
                    let _ = lp.remove_flow(now, FlowId(0));
                    let _ = lp.register_flow(now, FlowRegistration { spec, qps: 1 });
                });
            },
        );
    }
    group.finish();
    let mut group = c.benchmark_group("adaptive");
    for flows in [1u64, 100, 10_000] {
        let specs: Vec<FlowSpec> = (0..flows)
            .map(|id| FlowSpec {
                id: FlowId(id),
                tenant: TenantId(id.min(1)),
                class: if id == 0 {
                    FlowClass::Latency
                } else {
                    FlowClass::Bandwidth
                },
                weight: Weight::ONE,
            })
            .collect();
        group.bench_with_input(
            BenchmarkId::new("adaptive_update", flows),
            &flows,
            |b, _| {
                let config = AdaptiveConfig::for_rnic(12.125e9, 4096, 1 << 20);
                let mut law = AdaptiveLaw::new(config).unwrap_or_else(|e| panic!("{e}"));
                let mut now = Duration::ZERO;
                let mut count = 0u64;
                b.iter(|| {
                    count += 1;
                    now += Duration::from_micros(500);
                    let current = if count.is_multiple_of(100) {
                        TARGET * 2
                    } else {
                        TARGET / 2
                    };
                    let o = Observation {
                        tenants: TenantWeights::of(black_box(&specs)),
                        target99: Some(TARGET),
                        current99: Some(current),
                        other_bytes_per_sec: 1e8,
                    };
                    black_box(law.update(now, &o));
                });
            },
        );
        // What justitiad adds to each update under `policy = "adaptive"`: the plan split
        // into one allotment per flow.
        group.bench_with_input(
            BenchmarkId::new("adaptive_allotments", flows),
            &flows,
            |b, _| {
                let config = AdaptiveConfig::for_rnic(12.125e9, 4096, 1 << 20);
                let law = AdaptiveLaw::new(config).unwrap_or_else(|e| panic!("{e}"));
                let host: Vec<HostFlow> = specs
                    .iter()
                    .map(|&spec| HostFlow { spec, qps: 1 })
                    .collect();
                let plan = law.plan(&Observation {
                    tenants: TenantWeights::of(&specs),
                    target99: Some(TARGET),
                    current99: None,
                    other_bytes_per_sec: 1e8,
                });
                b.iter(|| black_box(allotments(&law, &plan, black_box(&host))));
            },
        );
        group.bench_with_input(BenchmarkId::new("adaptive_pick", flows), &flows, |b, _| {
            let mut order = TenantRoundRobin::new();
            order.set_quantum(4096);
            for id in 0..flows {
                let spec = FlowSpec {
                    id: FlowId(id),
                    tenant: TenantId(id),
                    class: FlowClass::Bandwidth,
                    weight: Weight::new((id % 4) as u32 + 1).unwrap_or(Weight::ONE),
                };
                order.insert(&spec, id);
            }
            b.iter(|| black_box(order.pick(|_| Some(4096))));
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
