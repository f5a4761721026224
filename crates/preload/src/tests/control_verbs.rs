//! Control verbs: a process's QP creations and memory registrations wait for its budget,
//! from `JUSTITIA_CONTROL_RATE` or from the daemon, and are counted where the operator
//! sees them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia_agent::admin::{AdminReply, AdminRequest, TenantReport};
use justitia_core::control_verbs::{ControlVerb, ControlVerbBudget};
use justitia_verbs::ops;
use justitia_verbs::sys::*;

use super::daemon::Daemon;
use super::{forget, lookup, qp_attr_ex};
use crate::clock::{Clock, MonotonicClock, VirtualClock};
use crate::engine::PacerMode;
use crate::exports::{engine_from, on_create_cq};
use crate::mock::MockDevice;

/// Creates `n` RC QPs through the shaper's `create_qp_ex` on an engine with `vars` and
/// a virtual clock; returns how far the clock moved and the engine's statistics.
fn create_qps(vars: &[(&str, &str)], n: usize) -> (Duration, crate::stats::StatsSnapshot) {
    let clock = Arc::new(VirtualClock::new());
    let engine = engine_from(lookup(vars), clock.clone(), PacerMode::Manual).unwrap();
    let dev = MockDevice::new();
    let ctx = dev.context();
    // SAFETY: a fresh mock context.
    assert!(unsafe { crate::install::attach_context(ctx, Arc::clone(&engine)) });
    let cq = dev.create_cq();
    // SAFETY: just created on ctx.
    unsafe { on_create_cq(ctx, cq) };
    let mut qps = Vec::new();
    for _ in 0..n {
        let mut attr = qp_attr_ex(cq, 8, 1, IBV_QP_INIT_ATTR_PD);
        // SAFETY: a live context, through the shaper's create_qp_ex.
        let qp = unsafe { ops::create_qp_ex(ctx, &mut attr) };
        assert!(!qp.is_null());
        qps.push(qp);
    }
    let stats = engine.stats();
    forget(&dev, &qps, cq);
    (clock.now(), stats)
}

/// 1000 verbs/s with a burst of 4: the first 4 of 10 creations go at once, each of the 6
/// others waits 1 ms after the one before (the application blocks in the verb).
#[test]
fn qp_creations_beyond_the_burst_wait_one_interval_each() {
    let (elapsed, s) = create_qps(
        &[
            ("JUSTITIA_CONTROL_RATE", "1000:4"),
            ("JUSTITIA_DAEMON", "off"),
        ],
        10,
    );
    assert_eq!(elapsed, Duration::from_millis(6));
    assert_eq!(
        (s.control_verbs, s.control_verbs_delayed, s.control_wait_ns),
        (10, 6, 6_000_000)
    );
    let unpaced = create_qps(&[("JUSTITIA_DAEMON", "off")], 10);
    assert_eq!(unpaced.0, Duration::ZERO);
    assert_eq!(
        (unpaced.1.control_verbs, unpaced.1.control_verbs_delayed),
        (10, 0)
    );
}

/// The tenants the daemon reports.
fn tenants(d: &Daemon) -> Vec<TenantReport> {
    match d.admin(&AdminRequest::Tenants) {
        AdminReply::Tenants(t) => t,
        other => panic!("{other:?}"),
    }
}

/// A process that only registers memory (no QP, so no flow) connects to the daemon,
/// learns its share of the host's budget (200 verbs/s for its tenant alone, burst 4), is
/// held to it, and its counts reach the daemon's tenant report. A process's own
/// `JUSTITIA_CONTROL_RATE` may lower the daemon's budget, never raise it.
#[test]
fn under_a_daemon_a_registration_storm_is_held_to_the_tenants_budget() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(
        dir.path(),
        "control_verbs_per_sec = 200\ncontrol_verb_burst = 4\n",
    );
    let socket = d.socket();
    let sock = socket.to_str().unwrap();
    let engine = engine_from(
        lookup(&[("JUSTITIA_SOCKET", sock), ("JUSTITIA_CONTROL_RATE", "1000")]),
        Arc::new(MonotonicClock::new()),
        PacerMode::Thread,
    )
    .unwrap();
    let want = ControlVerbBudget {
        per_sec: 200.0,
        burst: 4,
    };
    // The first verb starts the follower and waits for its first tick, which connects
    // and reads the budget: a storm is paced from its first verbs by the daemon's budget
    // (its burst of 4, not the environment's 16; its rate may still count the harness's
    // own probe connection, which the daemon reclaims within a pass).
    engine.before_control_verb(ControlVerb::RegMr);
    assert_eq!(
        engine.settings().control.map(|b| b.burst),
        Some(4),
        "after the first verb: {:?}",
        engine.follow_status()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.settings().control != Some(want) {
        assert!(
            Instant::now() < deadline,
            "budget never followed: {:?}",
            engine.settings().control
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // A storm of 40 more, back to back: the burst's 4 (whatever the first one left)
    // and then one every 5 ms.
    let start = Instant::now();
    for _ in 0..40 {
        engine.before_control_verb(ControlVerb::RegMr);
    }
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(5 * 35),
        "40 verbs at 200/s with a burst of 4 took {took:?}"
    );
    let s = engine.stats();
    assert_eq!(s.control_verbs, 41);
    // On a quiet machine 36 or more wait; a thread starved of the CPU for longer than an
    // interval finds its next turns already due, and those do not count as delayed. The
    // storm's length above is what shows the pacing; the mock tests count exactly.
    assert!((1..=40).contains(&s.control_verbs_delayed), "{s:?}");
    // The follower reports the counts within a few ticks.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let t = tenants(&d);
        if t.first().is_some_and(|t| t.control_verbs == 41) {
            let t = &t[0];
            assert_eq!(t.processes, 1);
            assert_eq!(t.control_verbs_per_sec, Some(200.0));
            assert_eq!(t.control_verbs_delayed, s.control_verbs_delayed);
            assert!(
                (t.control_verb_wait_seconds - s.control_wait_ns as f64 / 1e9).abs() < 1e-6,
                "{t:?} {s:?}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "counts never reported: {t:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    // A process asking for less than the daemon's share gets what it asked for.
    let slower = engine_from(
        lookup(&[("JUSTITIA_SOCKET", sock), ("JUSTITIA_CONTROL_RATE", "50:2")]),
        Arc::new(MonotonicClock::new()),
        PacerMode::Thread,
    )
    .unwrap();
    slower.before_control_verb(ControlVerb::CreateQp);
    let deadline = Instant::now() + Duration::from_secs(10);
    // Two processes of one tenant now: 100 verbs/s each from the daemon, and 50 asked.
    while tenants(&d).first().map(|t| t.processes) != Some(2) {
        assert!(Instant::now() < deadline, "second process never connected");
        std::thread::sleep(Duration::from_millis(5));
    }
    while engine.settings().control.map(|b| b.per_sec) != Some(100.0) {
        assert!(Instant::now() < deadline, "budget never split");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        slower.settings().control,
        Some(ControlVerbBudget {
            per_sec: 50.0,
            burst: 2
        })
    );
}

/// A QP's first move to ready-to-receive is part of its creation; every later one (after
/// a reset or an error) brings it up again and waits as a creation.
#[test]
fn only_a_qp_brought_up_again_waits_as_a_creation() {
    let r = super::rig(&[]);
    let q = crate::engine::qp(r.qp).unwrap();
    let to = |qp_state| ibv_qp_attr {
        qp_state,
        ..Default::default()
    };
    assert!(!q.rebrings_up(&to(IBV_QPS_INIT), IBV_QP_STATE));
    assert!(!q.rebrings_up(&to(IBV_QPS_RTR), IBV_QP_STATE), "its first");
    q.on_modify(&to(IBV_QPS_RTR), IBV_QP_STATE);
    q.on_modify(&to(IBV_QPS_RTS), IBV_QP_STATE);
    // Other attributes of a ready QP change nothing in the RNIC's context cache.
    assert!(!q.rebrings_up(&to(IBV_QPS_RTR), IBV_QP_TIMEOUT));
    q.on_modify(&to(IBV_QPS_RESET), IBV_QP_STATE);
    q.on_modify(&to(IBV_QPS_INIT), IBV_QP_STATE);
    assert!(
        q.rebrings_up(&to(IBV_QPS_RTR), IBV_QP_STATE),
        "brought up again"
    );
}
