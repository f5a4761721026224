//! Once its flows are registered and its queues have grown, the control loop's updates
//! allocate nothing, with or without flows changing activity before them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use justitia_core::control_loop::{ControlLoop, Event, FlowRegistration, LoopConfig, Target99};
use justitia_core::controller::IncreaseLaw;
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;

/// The system allocator, counting allocations and reallocations.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's guarantees are the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const TARGET: Duration = Duration::from_micros(5);

/// One RefPeriod, as a driver runs it: flows `flips` change activity, the outstanding
/// probe completes (above Target99 once in 50), the update runs, events are drained and
/// the next probe is sent.
fn step(lp: &mut ControlLoop, probe: &mut Option<justitia_core::control_loop::ProbeId>, n: u64) {
    let now = lp.poll_timeout().unwrap();
    // Flows 1..100 are resource-hungry: one of them goes idle or resumes, and one of
    // tenant 9's, whose weights differ (its heaviest flows come and go).
    lp.set_flow_active(now, FlowId(1 + n % 99), (n / 99) % 2 == 1)
        .unwrap();
    lp.set_flow_active(now, FlowId(90 + n % 10), (n / 10) % 2 == 1)
        .unwrap();
    if let Some(id) = probe.take() {
        let latency = if n.is_multiple_of(50) {
            TARGET * 3
        } else {
            TARGET / 2
        };
        lp.probe_completed(now.saturating_sub(lp.config().ref_period) + latency, id);
    }
    lp.handle_timeout(now);
    while let Some(event) = lp.poll_event() {
        if event == Event::ProbeDue {
            *probe = Some(lp.probe_sent(now));
        }
    }
}

#[test]
fn updates_allocate_nothing() {
    let profile = RnicProfile::builtin("RoCE-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(TARGET),
        increase: IncreaseLaw::SEARCH,
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    // Flow 0 is a latency flow; 1..100 are bandwidth and throughput flows of ten tenants,
    // tenant 9's of weights 1 to 4.
    for id in 0..100u64 {
        let class = match id {
            0 => FlowClass::Latency,
            id if id % 2 == 0 => FlowClass::Bandwidth,
            _ => FlowClass::Throughput,
        };
        let tenant = id / 10;
        let weight = if tenant == 9 { (id % 4) as u32 + 1 } else { 1 };
        let spec = FlowSpec {
            id: FlowId(id),
            tenant: TenantId(tenant),
            class,
            weight: Weight::new(weight).unwrap(),
        };
        lp.register_flow(Duration::ZERO, FlowRegistration { spec, qps: 1 })
            .unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(id), true)
            .unwrap();
    }
    let mut probe = None;
    for n in 0..200 {
        step(&mut lp, &mut probe, n);
    }
    let generation = lp.generation();
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for n in 200..2_200 {
        step(&mut lp, &mut probe, n);
    }
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
    // The updates did work: allotments changed at nearly every one of them.
    assert!(lp.generation() >= generation + 1_900, "{}", lp.generation());
    assert_eq!(allocations, 0, "allocations in 2000 updates");
}
