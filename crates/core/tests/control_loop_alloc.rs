//! Once its flows are registered and its queues have grown, the control loop's updates
//! allocate nothing, with or without flows changing activity before them, with flows in
//! their idle grace and with release phases assigned anew.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use justitia_core::control_loop::{ControlLoop, Event, FlowRegistration, LoopConfig, Target99};
use justitia_core::controller::IncreaseLaw;
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::RnicProfile;

/// The system allocator, counting allocations and reallocations per thread.
struct Counting;

thread_local! {
    /// This thread's allocations. Per thread because the test harness's own thread
    /// allocates now and then (when it blocks waiting for the test), which is not the
    /// loop's doing. A `Cell` of an integer has no destructor, so the allocator may use
    /// it at any time.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// Counts one allocation on this thread.
fn count() {
    // `try_with` fails only after the thread's locals are gone, when nothing is measured.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

/// This thread's allocations so far.
fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's guarantees are the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
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
    let phase = |lp: &ControlLoop| lp.allotment(FlowId(2)).unwrap().phase;
    let mut epoch = phase(&lp).epoch;
    let (mut new_epochs, mut held_in_grace) = (0u32, 0u32);
    let before = allocations();
    for n in 200..2_200 {
        step(&mut lp, &mut probe, n);
        if phase(&lp).epoch != epoch {
            epoch = phase(&lp).epoch;
            new_epochs += 1;
        }
        // Tenant 9's flow that has just reported no work still has its share.
        let resting = FlowId(90 + n % 10);
        if (n / 10) % 2 == 0 && lp.allotment(resting).unwrap().bytes_per_sec > 0.0 {
            held_in_grace += 1;
        }
    }
    let allocations = allocations() - before;
    // The updates did work: allotments changed at nearly every one of them, the sharing
    // flows were given new release phases at most of them, and flows were in their idle
    // grace (half of tenant 9's flows' reports are "no work", each kept within its grace).
    assert!(lp.generation() >= generation + 1_900, "{}", lp.generation());
    assert!(new_epochs >= 1_500, "{new_epochs} new phase epochs");
    assert!(held_in_grace >= 900, "{held_in_grace} flows held in grace");
    assert_eq!(allocations, 0, "allocations in 2000 updates");
}
