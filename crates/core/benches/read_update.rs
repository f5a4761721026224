//! The cost of a control-loop update that rewrites every allotment, at 10 000 local
//! bandwidth flows and at 10 000 READ requester flows, in one run.
//!
//! `local_flows`: 10 000 active bandwidth flows, a tenant each; before each update one of
//! them goes idle or resumes, so the division and every allotment are redone.
//! `read_flows`: 10 000 active bandwidth flows marked as READing from one of eight
//! responders, a tenant each, every one holding a guarantee; before each update one of
//! them receives a newer guarantee of another fraction, so every READ allotment is redone
//! (the READ flows' siblings are counted per responder, tenant and class). Both updates
//! do the same work but for the READ flows' own allotment, so their figures should stay
//! within a small factor of each other; before the READ allotments were counted in one
//! sorted pass, each READ flow counted its siblings over every flow (quadratic in the
//! READ flows).
//!
//! On the shared 2-core development VM (criterion means, `-- --warm-up-time 1
//! --measurement-time 5`): with the sibling count over every flow, `local_flows` 141 us and
//! `read_flows` 324 ms; with the sorted keys, `local_flows` 153 us and `read_flows` 603 us.

// criterion's macros generate the bench's entry points without documentation.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use justitia_core::control_loop::{ControlLoop, FlowRegistration, LoopConfig, Target99};
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;
use justitia_core::remote_read::ReadGuarantee;

const FLOWS: u64 = 10_000;
/// Responders the READ flows read from.
const RESPONDERS: u64 = 8;

fn profile() -> RnicProfile {
    RnicProfile::builtin("RoCE-100").unwrap_or_else(|e| panic!("{e}"))
}

fn guarantee(profile: &RnicProfile, sequence: u64, fraction: f64) -> ReadGuarantee {
    ReadGuarantee {
        epoch: 1,
        sequence,
        fraction,
        bytes_per_sec: fraction * profile.max_rate_bytes_per_sec(),
        ops_per_sec: fraction * profile.max_ops_per_sec(),
        chunk_bytes: 5 * 1024,
    }
}

/// Runs the loop's due update and drains its events.
fn update(lp: &mut ControlLoop, now: &mut Duration) {
    *now = lp.poll_timeout().unwrap_or(*now);
    lp.handle_timeout(*now);
    while let Some(event) = lp.poll_event() {
        black_box(event);
    }
}

/// A loop with `FLOWS` active bandwidth flows, a tenant each, READing from one of
/// `RESPONDERS` hosts with a guarantee each when `reads`, after its first updates.
fn setup(reads: bool) -> (ControlLoop, Duration) {
    let profile = profile();
    let config = LoopConfig {
        target: Target99::Absolute(Duration::from_micros(50)),
        idle_grace_periods: 0,
        ..LoopConfig::default()
    };
    let mut lp =
        ControlLoop::new(config, &profile, Duration::ZERO).unwrap_or_else(|e| panic!("{e}"));
    for id in 0..FLOWS {
        let spec = FlowSpec {
            id: FlowId(id),
            tenant: TenantId(id),
            class: FlowClass::Bandwidth,
            weight: Weight::ONE,
        };
        lp.register_flow(Duration::ZERO, FlowRegistration { spec, qps: 1 })
            .unwrap_or_else(|e| panic!("{e}"));
        if reads {
            lp.set_flow_reads_from(Duration::ZERO, FlowId(id), Some(id % RESPONDERS))
                .unwrap_or_else(|e| panic!("{e}"));
        }
        lp.set_flow_active(Duration::ZERO, FlowId(id), true)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let mut now = Duration::ZERO;
    update(&mut lp, &mut now);
    if reads {
        for id in 0..FLOWS {
            lp.read_guarantee_received(now, FlowId(id), guarantee(&profile, 0, 0.5))
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    update(&mut lp, &mut now);
    (lp, now)
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("update_rewriting_every_allotment");
    group.sample_size(10);
    group.bench_with_input(BenchmarkId::new("local_flows", FLOWS), &FLOWS, |b, _| {
        let (mut lp, mut now) = setup(false);
        let mut count = 0u64;
        b.iter(|| {
            count += 1;
            let _ = lp.set_flow_active(now, FlowId(FLOWS - 1), count.is_multiple_of(2));
            update(&mut lp, &mut now);
        });
    });
    group.bench_with_input(BenchmarkId::new("read_flows", FLOWS), &FLOWS, |b, _| {
        let profile = profile();
        let (mut lp, mut now) = setup(true);
        let mut count = 0u64;
        b.iter(|| {
            count += 1;
            let fraction = if count.is_multiple_of(2) { 0.5 } else { 0.25 };
            let _ = lp.read_guarantee_received(
                now,
                FlowId(FLOWS - 1),
                guarantee(&profile, count, fraction),
            );
            update(&mut lp, &mut now);
        });
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
