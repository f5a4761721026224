//! Probes completing out of order: each completion is matched to its own probe, and the
//! earliest outstanding probe sets the next deadline.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use justitia_core::control_loop::{ControlLoop, Event, LoopConfig, Target99};
use justitia_core::profile::RnicProfile;

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

/// Whether `measured` is within 2 % of `expected` (the estimator's buckets are finer).
fn near(measured: Option<Duration>, expected: Duration) -> bool {
    measured.is_some_and(|m| (m.as_secs_f64() / expected.as_secs_f64() - 1.0).abs() < 0.02)
}

#[test]
fn completions_match_their_own_probes_in_any_order() {
    let profile = RnicProfile::builtin("RoCE-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        probe_timeout: us(250),
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    let first = lp.probe_sent(us(0));
    let second = lp.probe_sent(us(100));
    let third = lp.probe_sent(us(200));
    // The first probe's deadline (0 + 250 us) comes before the update (500 us).
    assert_eq!(lp.poll_timeout(), Some(us(250)));

    // The second completes first: a 110 us sample, not the first probe's 210 us.
    assert!(lp.probe_completed(us(210), second));
    assert!(near(lp.current_p99(), us(110)), "{:?}", lp.current_p99());
    assert!(!lp.probe_completed(us(211), second), "counted twice");
    assert_eq!(lp.poll_timeout(), Some(us(250)));

    // The first is lost; the third's deadline (200 + 250 us) is next.
    assert!(lp.probe_lost(us(220), first));
    assert!(
        !lp.probe_completed(us(230), first),
        "a lost probe completed"
    );
    assert_eq!(lp.poll_timeout(), Some(us(450)));
    lp.handle_timeout(us(449));
    let mut lost = Vec::new();
    while let Some(event) = lp.poll_event() {
        if let Event::ProbeLost(id) = event {
            lost.push(id);
        }
    }
    assert_eq!(lost, [first]);
    lp.handle_timeout(us(450));
    while let Some(event) = lp.poll_event() {
        if let Event::ProbeLost(id) = event {
            lost.push(id);
        }
    }
    assert_eq!(lost, [first, third]);
    assert!(!lp.probe_completed(us(460), third));
    assert_eq!(lp.poll_timeout(), Some(us(500)));
}
