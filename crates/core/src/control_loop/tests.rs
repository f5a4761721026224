//! The loop's unit tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::flow::Weight;

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

fn flow(id: u64, class: FlowClass) -> FlowRegistration {
    FlowRegistration {
        spec: FlowSpec {
            id: FlowId(id),
            tenant: TenantId(id),
            class,
            weight: Weight::ONE,
        },
        qps: 1,
    }
}

/// A loop with a latency flow and an active bandwidth flow (ids 1 and 2).
fn busy_loop(target: Target99) -> ControlLoop {
    busy_loop_with(target, ViolationRule::Current99)
}

/// As [`busy_loop`], deciding violations by `violation`.
fn busy_loop_with(target: Target99, violation: ViolationRule) -> ControlLoop {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target,
        idle_samples: 10,
        violation,
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    lp.register_flow(Duration::ZERO, flow(1, FlowClass::Latency))
        .unwrap();
    lp.set_flow_active(Duration::ZERO, FlowId(1), true).unwrap();
    lp.register_flow(Duration::ZERO, flow(2, FlowClass::Bandwidth))
        .unwrap();
    lp.set_flow_active(Duration::ZERO, FlowId(2), true).unwrap();
    lp
}

/// A loop on RoCE-100 without flows, its target twice the idle p99 of 10 probes.
fn idle_multiple_loop() -> ControlLoop {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::IdleMultiple(2.0),
        idle_samples: 10,
        ..LoopConfig::default()
    };
    ControlLoop::new(config, &profile, Duration::ZERO).unwrap()
}

/// Runs `periods` RefPeriods from `*t`, each probe taking `latency`.
fn drive(lp: &mut ControlLoop, t: &mut Duration, periods: u32, latency: Duration) {
    for _ in 0..periods {
        *t += us(500);
        lp.handle_timeout(*t);
        while let Some(event) = lp.poll_event() {
            if event == Event::ProbeDue {
                let id = lp.probe_sent(*t);
                assert!(lp.probe_completed(*t + latency, id));
            }
        }
    }
}

/// An input of the quiet-cadence tests, at a time.
#[derive(Clone, Copy)]
enum Input {
    Register(u64, FlowClass),
    Active(u64, bool),
    Remove(u64),
}

/// What a driver saw: the time of every update, and every allotment change.
#[derive(Default, Debug, PartialEq)]
struct Trace {
    updates: Vec<Duration>,
    allotments: Vec<(Duration, u64, u64)>,
    probes: Vec<Duration>,
}

/// Drives a loop the way the daemon does until `end`: it sleeps until `poll_timeout`
/// or the next scripted input, applies the input, and reads `poll_timeout` again.
/// Probes take 10 us.
fn follow(lp: &mut ControlLoop, script: &[(Duration, Input)], end: Duration) -> Trace {
    let mut trace = Trace::default();
    let mut script = script.iter().peekable();
    loop {
        let due = lp.poll_timeout().unwrap();
        let input = script.peek().map(|&&(t, _)| t);
        let now = match input {
            Some(t) if t <= due => t,
            _ => due,
        };
        if now > end {
            return trace;
        }
        if input == Some(now) {
            let (_, input) = script.next().unwrap();
            match *input {
                Input::Register(id, class) => {
                    lp.register_flow(now, flow(id, class)).unwrap();
                }
                Input::Active(id, active) => lp.set_flow_active(now, FlowId(id), active).unwrap(),
                Input::Remove(id) => lp.remove_flow(now, FlowId(id)).unwrap(),
            }
        }
        let updates = lp.updates();
        if lp.poll_timeout().unwrap() <= now {
            lp.handle_timeout(now);
        }
        if lp.updates() != updates {
            trace.updates.push(now);
        }
        while let Some(event) = lp.poll_event() {
            match event {
                Event::ProbeDue => {
                    trace.probes.push(now);
                    let id = lp.probe_sent(now);
                    assert!(lp.probe_completed(now + us(10), id));
                }
                Event::AllotmentsChanged { generation } => {
                    for id in 1..=8 {
                        if let Some(a) = lp.allotment(FlowId(id)) {
                            if a.generation == generation {
                                trace.allotments.push((now, id, a.bytes_per_sec as u64));
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }
}

fn quiet_loop(quiet_periods: u32) -> ControlLoop {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        quiet_periods,
        ..LoopConfig::default()
    };
    ControlLoop::new(config, &profile, Duration::ZERO).unwrap()
}

fn gaps(times: &[Duration]) -> Vec<Duration> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

#[test]
fn the_papers_loop_is_its_window_rule_and_law_with_the_given_target() {
    let target = Target99::Absolute(us(7));
    let paper = LoopConfig::paper(target);
    assert_eq!(paper.target, target);
    assert_eq!(paper.window, 10_000);
    assert_eq!(paper.violation, ViolationRule::Current99);
    assert_eq!(paper.increase, IncreaseLaw::Fixed);
    // The rest is the default's.
    let default = LoopConfig::default();
    assert_eq!(paper.ref_period, default.ref_period);
    assert_eq!(paper.probe_timeout, default.probe_timeout);
    assert_ne!(default.violation, ViolationRule::Current99);
}

/// A loop on RoCE-100 with one latency and one bandwidth flow, driven every RefPeriod of
/// `config` with probes of `latency`, for `periods` updates; the time of each update.
fn run_periods(lp: &mut ControlLoop, t: &mut Duration, periods: u32, latency: Duration) {
    for _ in 0..periods {
        *t += lp.config().ref_period;
        lp.handle_timeout(*t);
        while let Some(event) = lp.poll_event() {
            if event == Event::ProbeDue {
                let id = lp.probe_sent(*t);
                assert!(lp.probe_completed(*t + latency, id));
            }
        }
    }
}

fn loop_of(config: LoopConfig) -> ControlLoop {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    for (id, class) in [(1, FlowClass::Latency), (2, FlowClass::Bandwidth)] {
        lp.register_flow(Duration::ZERO, flow(id, class)).unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(id), true)
            .unwrap();
    }
    lp
}

/// [`loop_of`] with Target99 50 us and the fixed increase law stepping a tenth of MaxRate,
/// so that one calm update after a halving shows as a distinct SafeUtil.
fn fixed_step_loop() -> ControlLoop {
    loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        increase: IncreaseLaw::Fixed,
        increase_step: 0.1,
        ..LoopConfig::default()
    })
}

#[test]
fn the_controller_runs_on_the_loops_ref_period_delta_step_and_law() {
    // RefPeriod 10 ms, delta 50 ms, every probe slow: the second sample (update 3, at
    // 30 ms) starts the violation run, and each update adds its 10 ms gap to the time
    // observed (a gap counts up to ten RefPeriods), so delta is reached 50 ms later, at
    // 80 ms, and the mode changes then or at the next update. The controller's own default RefPeriod (0.5 ms) would count 5 ms an update
    // (130 ms); its default delta (5 s) would not give up at all.
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        ref_period: Duration::from_millis(10),
        unattainable_after: Some(Duration::from_millis(50)),
        ..LoopConfig::default()
    });
    let mut t = Duration::ZERO;
    let mut entered = None;
    for _ in 0..20 {
        run_periods(&mut lp, &mut t, 1, us(100));
        if entered.is_none() && matches!(lp.mode(), ControlMode::Unattainable { .. }) {
            entered = Some(t);
        }
    }
    let entered = entered.unwrap_or_else(|| panic!("never gave up the target"));
    assert!(
        (Duration::from_millis(80)..=Duration::from_millis(90)).contains(&entered),
        "gave up at {entered:?}"
    );
    // The fixed law with a step of a tenth of MaxRate: from the floor (one halving,
    // 1/2), the first increase reaches 6/10 of MaxRate. The default step (1/1000) or the
    // search law would not.
    let mut lp = fixed_step_loop();
    let mut t = Duration::ZERO;
    run_periods(&mut lp, &mut t, 3, us(100));
    assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
    assert!((lp.safe_util() / lp.max_rate() - 0.5).abs() < 1e-9);
    while lp.last_action() != Some(ControlAction::Increase) {
        run_periods(&mut lp, &mut t, 1, us(10));
        assert!(t < Duration::from_millis(100), "no increase");
    }
    let fraction = lp.safe_util() / lp.max_rate();
    assert!(
        (fraction - 0.6).abs() < 1e-9,
        "SafeUtil {fraction} of MaxRate"
    );
    // The loop's default law, the search: the first increase after the halving from
    // MaxRate goes half-way back to it, to 3/4. The controller's own default, the
    // fixed step of 1/1000, would reach 0.501.
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    });
    let mut t = Duration::ZERO;
    run_periods(&mut lp, &mut t, 3, us(100));
    assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
    while lp.last_action() != Some(ControlAction::Increase) {
        run_periods(&mut lp, &mut t, 1, us(10));
        assert!(t < Duration::from_millis(100), "no increase");
    }
    assert_eq!(lp.safe_util() / lp.max_rate(), 0.75);
}

#[test]
fn only_active_resource_hungry_flows_share_safe_util() {
    // A latency flow, an active bandwidth flow, and one registered without work: the
    // active one is allotted the whole of SafeUtil.
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    });
    lp.register_flow(Duration::ZERO, flow(3, FlowClass::Bandwidth))
        .unwrap();
    let mut t = Duration::ZERO;
    run_periods(&mut lp, &mut t, 2, us(10));
    let active = lp.allotment(FlowId(2)).unwrap();
    assert!((active.bytes_per_sec / lp.safe_util() - 1.0).abs() < 1e-9);
    assert!(
        lp.allotment(FlowId(1)).is_none(),
        "a latency flow is never shaped"
    );
    assert!(lp
        .allotment(FlowId(3))
        .is_none_or(|a| a.bytes_per_sec == 0.0));
}

#[test]
fn targets_rates_and_windows_out_of_range_are_refused_by_name() {
    let refused = |config: LoopConfig| match config.validate() {
        Err(LoopError::Setting(name, _)) => Some(name),
        _ => None,
    };
    let with = |target, window, violation| LoopConfig {
        target,
        window,
        violation,
        ..LoopConfig::default()
    };
    let (ok_target, rule) = (Target99::Absolute(us(5)), ViolationRule::HeldP99);
    assert_eq!(
        refused(with(Target99::Absolute(Duration::ZERO), 1000, rule)),
        Some("target")
    );
    assert_eq!(
        refused(with(
            Target99::Absolute(Duration::from_nanos(1)),
            1000,
            rule
        )),
        None
    );
    // A false-violation rate lies strictly between 0 and 1.
    for alpha in [0.0, 1.0, -0.1, f64::NAN] {
        let config = with(ok_target, 1000, ViolationRule::Confident(alpha));
        assert_eq!(refused(config), Some("violation"), "alpha {alpha}");
    }
    for alpha in [1e-9, 0.5, 0.999] {
        assert_eq!(
            refused(with(ok_target, 1000, ViolationRule::Confident(alpha))),
            None
        );
    }
    // A rule that needs VIOLATION_RUN samples needs a window that holds them; the
    // paper's rule decides on any window.
    for rule in [ViolationRule::HeldP99, ViolationRule::Confident(1e-3)] {
        assert_eq!(
            refused(with(ok_target, VIOLATION_RUN - 1, rule)),
            Some("window")
        );
        assert_eq!(refused(with(ok_target, VIOLATION_RUN, rule)), None);
    }
    assert_eq!(refused(with(ok_target, 1, ViolationRule::Current99)), None);
}

#[test]
fn quiet_periods_zero_is_refused() {
    let config = LoopConfig {
        quiet_periods: 0,
        ..LoopConfig::default()
    };
    assert!(matches!(
        config.validate(),
        Err(LoopError::Setting("quiet_periods", _))
    ));
    // Off by default; the cadence for drivers that follow every input is 5 ms.
    assert_eq!(LoopConfig::default().quiet_period(), us(500));
    let config = LoopConfig {
        quiet_periods: QUIET_PERIODS,
        ..LoopConfig::default()
    };
    assert_eq!(config.quiet_period(), Duration::from_millis(5));
}

#[test]
fn without_a_latency_flow_the_loop_updates_every_quiet_period() {
    let mut lp = quiet_loop(QUIET_PERIODS);
    let ms = Duration::from_millis;
    let script = [
        (Duration::ZERO, Input::Register(1, FlowClass::Bandwidth)),
        (Duration::ZERO, Input::Active(1, true)),
    ];
    let trace = follow(&mut lp, &script, ms(100));
    // The first update counts the flow; from then on nothing changes, so every update
    // is 5 ms after the one before: 20 in 100 ms instead of 200.
    assert_eq!(trace.updates[0], us(500));
    assert!(
        gaps(&trace.updates[1..]).iter().all(|&g| g == ms(5)),
        "{:?}",
        trace.updates
    );
    assert!(
        (19..=21).contains(&trace.updates.len()),
        "{}",
        trace.updates.len()
    );
    assert!(
        trace.probes.is_empty(),
        "no latency flow, no probe: {:?}",
        trace.probes
    );
    let max = lp.max_rate();
    assert_eq!(lp.allotment(FlowId(1)).unwrap().bytes_per_sec, max);
}

#[test]
fn a_latency_flow_that_starts_brings_back_an_update_and_a_probe_every_ref_period_at_once() {
    let mut lp = quiet_loop(QUIET_PERIODS);
    let ms = Duration::from_millis;
    let start = ms(21) + us(130);
    let script = [
        (Duration::ZERO, Input::Register(1, FlowClass::Bandwidth)),
        (Duration::ZERO, Input::Active(1, true)),
        (start, Input::Register(2, FlowClass::Latency)),
        (start, Input::Active(2, true)),
        (ms(40) + us(70), Input::Active(2, false)),
    ];
    let trace = follow(&mut lp, &script, ms(80));
    // Quiet before: updates 5 ms apart, the last at 20.5 ms. The latency flow starts at
    // 21.13 ms: the next update is at the next RefPeriod tick, 21.5 ms, not 25.5 ms.
    let first = *trace.probes.first().unwrap();
    assert_eq!(first, ms(21) + us(500));
    // Then a probe and an update every RefPeriod while the latency flow is active
    // (its grace runs out at 41.07 ms, counted at the update of 41.5 ms)...
    let busy: Vec<_> = trace
        .updates
        .iter()
        .copied()
        .filter(|&t| t >= first && t <= ms(41) + us(500))
        .collect();
    assert_eq!(busy.len(), 41, "{busy:?}");
    assert!(gaps(&busy).iter().all(|&g| g == us(500)), "{busy:?}");
    assert_eq!(trace.probes.len(), 40, "{:?}", trace.probes);
    assert_eq!(*trace.probes.last().unwrap(), ms(41));
    // ...and quiet again after the update that counted it gone.
    let after: Vec<_> = trace
        .updates
        .iter()
        .copied()
        .filter(|&t| t >= ms(41) + us(500))
        .collect();
    assert!(gaps(&after).iter().all(|&g| g == ms(5)), "{after:?}");
    // The bandwidth flow was cut to 5 KB chunks while it counted, and back after.
    assert_eq!(
        lp.chunk_bytes(),
        RnicProfile::builtin("roce-100").unwrap().chunk_bytes(false)
    );
}

#[test]
fn a_quiet_loop_takes_the_same_decisions_at_the_same_times_as_one_updating_every_ref_period() {
    let ms = Duration::from_millis;
    let script = [
        (Duration::ZERO, Input::Register(1, FlowClass::Bandwidth)),
        (Duration::ZERO, Input::Register(2, FlowClass::Bandwidth)),
        (Duration::ZERO, Input::Register(3, FlowClass::Throughput)),
        (Duration::ZERO, Input::Active(1, true)),
        (ms(12) + us(310), Input::Active(2, true)),
        (ms(30) + us(1), Input::Active(3, true)),
        (ms(30) + us(499), Input::Active(3, false)),
        (ms(30) + us(900), Input::Active(3, true)),
        (ms(47) + us(250), Input::Active(2, false)),
        (ms(63) + us(200), Input::Remove(3)),
        (ms(63) + us(500), Input::Register(4, FlowClass::Bandwidth)),
    ];
    let mut every = quiet_loop(1);
    let mut quiet = quiet_loop(QUIET_PERIODS);
    let reference = follow(&mut every, &script, ms(90));
    let trace = follow(&mut quiet, &script, ms(90));
    assert_eq!(trace.allotments, reference.allotments);
    assert!(
        reference.updates.len() >= 180,
        "{}",
        reference.updates.len()
    );
    assert!(
        trace.updates.len() < reference.updates.len() / 3,
        "{}",
        trace.updates.len()
    );
    // Flow 2 starts at 12.31 ms and has half the NIC at the next RefPeriod tick.
    let half = every.max_rate() / 2.0;
    assert!(trace
        .allotments
        .contains(&(ms(12) + us(500), 2, half as u64)));
    // Flow 2 stops at 47.25 ms: its grace ends at 48.25 ms, and flows 1 and 3 share its
    // third at 48.5 ms, within the grace and one RefPeriod.
    let third = (every.max_rate() / 3.0) as u64;
    let before = trace
        .allotments
        .iter()
        .rfind(|&&(t, id, _)| t < ms(48) && id == 1)
        .unwrap();
    assert_eq!(before.2, third, "{:?}", trace.allotments);
    let back = trace
        .allotments
        .iter()
        .find(|&&(t, id, _)| t > ms(47) + us(500) && id == 1)
        .unwrap();
    assert_eq!(*back, (ms(48) + us(500), 1, half as u64));
    // Flow 3, removed at 63.2 ms while active, leaves its share at 63.5 ms.
    let whole = every.max_rate() as u64;
    assert!(trace.allotments.contains(&(ms(63) + us(500), 1, whole)));
}

#[test]
fn a_completion_collected_late_counts_the_time_it_happened() {
    let mut lp = busy_loop(Target99::Absolute(us(50)));
    let id = lp.probe_sent(us(100));
    // Seen 400 us later, on the next wake-up: the sample is the 20 us it took.
    assert!(lp.probe_completed_at(us(500), id, us(120)));
    let p99 = lp.current_p99().unwrap();
    assert!(p99 >= us(19) && p99 <= us(21), "{p99:?}");
    assert!(
        !lp.probe_completed_at(us(600), id, us(130)),
        "counted twice"
    );
    // A completion time after `now` counts as `now`.
    let id = lp.probe_sent(us(1_000));
    assert!(lp.probe_completed_at(us(1_030), id, us(9_000)));
    let p99 = lp.current_p99().unwrap();
    assert!(p99 >= us(29) && p99 <= us(31), "{p99:?}");
}

#[test]
fn set_target_keeps_safe_util_flows_and_window_and_the_next_update_pursues_it() {
    let mut lp = busy_loop(Target99::Absolute(us(50)));
    let fresh_safe_util = lp.safe_util();
    let mut t = Duration::ZERO;
    // 60 us probes against a 50 us target: SafeUtil falls away from its start.
    drive(&mut lp, &mut t, 40, us(60));
    assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
    let before = lp.safe_util();
    assert!(
        before < 0.9 * fresh_safe_util,
        "SafeUtil {before} did not fall from {fresh_safe_util}"
    );
    let allotment = lp.allotment(FlowId(2)).unwrap();
    let p99 = lp.current_p99();
    let updates = lp.updates();

    lp.set_target(t, Target99::Absolute(us(100))).unwrap();
    assert_eq!(lp.safe_util(), before);
    assert_eq!(lp.allotment(FlowId(2)), Some(allotment));
    assert_eq!(lp.flow_qps(FlowId(1)), Some(1));
    assert_eq!(lp.counts().latency, 1);
    assert_eq!(lp.counts().bandwidth, 1);
    assert_eq!(lp.current_p99(), p99);
    assert_eq!(lp.updates(), updates);
    assert_eq!(lp.target().value, Some(us(100)));

    // The next update measures 60 us against the new 100 us target: no decrease, and
    // SafeUtil goes on from where it was, not from the start.
    drive(&mut lp, &mut t, 1, us(60));
    assert_ne!(lp.last_action(), Some(ControlAction::Decrease));
    assert!(lp.safe_util() >= before, "{} vs {before}", lp.safe_util());
    assert!(lp.safe_util() < fresh_safe_util, "{}", lp.safe_util());
}

/// A loop at `start` (the sender's epoch) on RoCE-100 with one active bandwidth flow
/// (id 1) and the loop's update times.
fn reading_loop(start: Duration) -> ControlLoop {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, start).unwrap();
    lp.register_flow(start, flow(1, FlowClass::Bandwidth))
        .unwrap();
    lp.set_flow_active(start, FlowId(1), true).unwrap();
    lp
}

/// Runs `periods` RefPeriods from `*t` and returns the guarantees announced.
fn announced(lp: &mut ControlLoop, t: &mut Duration, periods: u32) -> Vec<ReadGuarantee> {
    let mut out = Vec::new();
    for _ in 0..periods {
        *t += us(500);
        lp.handle_timeout(*t);
        while let Some(event) = lp.poll_event() {
            if let Event::ReadGuarantee(g) = event {
                out.push(g);
            }
        }
    }
    out
}

/// The default lifetime of a READ guarantee, 20 ms, in the tests' RefPeriods of 500 us.
const LIFETIME_PERIODS: u32 = 40;

fn guarantee(epoch: u64, sequence: u64, fraction: f64, profile: &RnicProfile) -> ReadGuarantee {
    ReadGuarantee {
        epoch,
        sequence,
        fraction,
        bytes_per_sec: fraction * profile.max_rate_bytes_per_sec(),
        ops_per_sec: fraction * profile.max_ops_per_sec(),
        chunk_bytes: 5 * 1024,
    }
}

#[test]
fn a_responder_announces_one_over_its_flows_and_the_reads_it_serves_after_every_update() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let start = Duration::from_secs(7);
    let mut lp = reading_loop(start);
    lp.register_flow(start, flow(2, FlowClass::Latency))
        .unwrap();
    lp.set_flow_active(start, FlowId(2), true).unwrap();
    let mut t = start;
    assert!(
        announced(&mut lp, &mut t, 3).is_empty(),
        "no remote reads, nothing to say"
    );
    // Two remote READ flows: L' + B' + T' = 1 + 1 + 2 = 4.
    let unit = RemoteReadUnit {
        class: FlowClass::Bandwidth,
        weight: Weight::ONE,
    };
    lp.set_remote_reads(t, &[unit, unit]);
    let said = announced(&mut lp, &mut t, 3);
    assert_eq!(said.len(), 3, "one per update");
    for (i, g) in said.iter().enumerate() {
        assert_eq!(g.epoch, 7_000_000_000, "the loop's start");
        assert_eq!(g.sequence, i as u64);
        assert_eq!(g.fraction, 0.25);
        assert_eq!(g.bytes_per_sec, 0.25 * profile.max_rate_bytes_per_sec());
        assert_eq!(g.ops_per_sec, 0.25 * profile.max_ops_per_sec());
        assert_eq!(
            g.chunk_bytes,
            profile.chunk_bytes(true),
            "its latency flow's chunk"
        );
    }
    lp.set_remote_reads(t, &[]);
    assert!(announced(&mut lp, &mut t, 2).is_empty());
}

/// The figure: a host that WRITEs to B and READs from B, no latency flow
/// anywhere. Natively each flow gets the whole of its RNIC (48 + 48 Gb/s on the
/// paper's 56 Gb/s IB): the WRITE's data leaves A's RNIC, the READ's leaves B's. A
/// READ requester's flow counted in A's own L/B/T halved the WRITE for READs it never
/// competes with; now the WRITE keeps A's whole SafeUtil and the READ gets B's
/// guarantee, 1 of 1 unit at B.
#[test]
fn a_host_that_writes_and_reads_gets_its_write_flows_full_rate_not_half() {
    let profile = RnicProfile::builtin("IB-56").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    };
    let mut a = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    let mut b = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    let (write, read) = (FlowId(1), FlowId(2));
    a.register_flow(Duration::ZERO, flow(1, FlowClass::Bandwidth))
        .unwrap();
    a.register_flow(Duration::ZERO, flow(2, FlowClass::Bandwidth))
        .unwrap();
    a.set_flow_reads_from(Duration::ZERO, read, Some(7))
        .unwrap();
    a.set_flow_active(Duration::ZERO, write, true).unwrap();
    a.set_flow_active(Duration::ZERO, read, true).unwrap();
    // B serves A's one READ unit and has no flow of its own.
    b.set_remote_reads(
        Duration::ZERO,
        &[RemoteReadUnit {
            class: FlowClass::Bandwidth,
            weight: Weight::ONE,
        }],
    );
    let mut t = Duration::ZERO;
    let mut tb = Duration::ZERO;
    for _ in 0..4 {
        for g in announced(&mut b, &mut tb, 1) {
            a.read_guarantee_received(t, read, g).unwrap();
        }
        announced(&mut a, &mut t, 1);
    }
    let max = profile.max_rate_bytes_per_sec();
    assert_eq!(a.counts.bandwidth, 1, "the READ is not counted at A");
    assert_eq!(
        a.allotment(write).unwrap().bytes_per_sec,
        max,
        "not max / 2"
    );
    let capped = a.read_cap(read).expect("B's guarantee");
    assert_eq!(capped.fraction, 1.0, "B counts the READ unit alone");
    assert_eq!(a.allotment(read).unwrap().bytes_per_sec, max);
}

/// Weights apply across hosts: B holds a local bandwidth tenant of weight 1 and serves
/// A's READ tenant of weight 3 (two flows): 1/4 of B per unit of weight, 3/4 for A's
/// tenant, 3/8 of B's MaxRate for each of its two flows.
#[test]
fn a_read_tenant_gets_its_weighted_share_of_the_responder_split_among_its_flows() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut b = reading_loop(Duration::ZERO);
    b.set_remote_reads(
        Duration::ZERO,
        &[RemoteReadUnit {
            class: FlowClass::Bandwidth,
            weight: Weight::new(3).unwrap(),
        }],
    );
    let mut tb = Duration::ZERO;
    let g = *announced(&mut b, &mut tb, 2).last().unwrap();
    assert_eq!(g.fraction, 0.25);

    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    };
    let mut a = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    for id in [1, 2] {
        let mut reg = flow(id, FlowClass::Bandwidth);
        reg.spec.tenant = TenantId(9);
        reg.spec.weight = Weight::new(3).unwrap();
        a.register_flow(Duration::ZERO, reg).unwrap();
        a.set_flow_reads_from(Duration::ZERO, FlowId(id), Some(1))
            .unwrap();
        a.set_flow_active(Duration::ZERO, FlowId(id), true).unwrap();
        a.read_guarantee_received(Duration::ZERO, FlowId(id), g)
            .unwrap();
    }
    let mut t = Duration::ZERO;
    announced(&mut a, &mut t, 1);
    let each = 0.375 * profile.max_rate_bytes_per_sec();
    for id in [1, 2] {
        let got = a.allotment(FlowId(id)).unwrap();
        assert!((got.bytes_per_sec - each).abs() < 1.0, "{got:?}");
        assert_eq!(got.chunk_bytes, g.chunk_bytes);
    }
    assert_eq!(a.counts.total(), 0, "READ requesters count at B, not here");
}

/// The responder's own tenants count at their weight too: a local bandwidth tenant of
/// weight 3 and a served READ tenant of weight 1 share its RNIC 3 to 1, so the READ
/// tenant's guarantee is 1/4.
#[test]
fn a_responders_own_tenant_counts_at_its_weight_in_the_guarantee() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    };
    let mut b = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    let mut reg = flow(1, FlowClass::Bandwidth);
    reg.spec.weight = Weight::new(3).unwrap();
    b.register_flow(Duration::ZERO, reg).unwrap();
    b.set_flow_active(Duration::ZERO, FlowId(1), true).unwrap();
    let unit = RemoteReadUnit {
        class: FlowClass::Bandwidth,
        weight: Weight::ONE,
    };
    b.set_remote_reads(Duration::ZERO, &[unit]);
    let mut t = Duration::ZERO;
    let g = *announced(&mut b, &mut t, 2).last().unwrap();
    assert_eq!(g.fraction, 0.25);
}

/// Fail-open: a READ requester's flow whose guarantee lapses is no longer constrained
/// (MaxRate), and one that goes idle gets nothing.
#[test]
fn a_read_requesters_flow_runs_unconstrained_once_its_guarantee_lapses() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut a = reading_loop(Duration::ZERO);
    a.set_flow_reads_from(Duration::ZERO, FlowId(1), Some(3))
        .unwrap();
    let mut t = Duration::ZERO;
    announced(&mut a, &mut t, 1);
    let max = profile.max_rate_bytes_per_sec();
    assert_eq!(a.allotment(FlowId(1)).unwrap().bytes_per_sec, max);
    a.read_guarantee_received(t, FlowId(1), guarantee(1, 0, 0.25, &profile))
        .unwrap();
    announced(&mut a, &mut t, 1);
    assert_eq!(a.allotment(FlowId(1)).unwrap().bytes_per_sec, 0.25 * max);
    announced(&mut a, &mut t, LIFETIME_PERIODS);
    assert_eq!(a.read_cap(FlowId(1)), None);
    assert_eq!(a.allotment(FlowId(1)).unwrap().bytes_per_sec, max);
    a.set_flow_active(t, FlowId(1), false).unwrap();
    announced(&mut a, &mut t, 4);
    assert_eq!(a.allotment(FlowId(1)).unwrap().bytes_per_sec, 0.0);
}

#[test]
fn a_read_flow_is_capped_at_its_guarantee_from_the_next_update_and_stale_ones_are_ignored() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut lp = reading_loop(Duration::ZERO);
    let mut t = Duration::ZERO;
    announced(&mut lp, &mut t, 2);
    let alone = lp.allotment(FlowId(1)).unwrap();
    assert_eq!(alone.bytes_per_sec, lp.safe_util());

    let quarter = guarantee(3, 5, 0.25, &profile);
    assert_eq!(
        lp.read_guarantee_received(t, FlowId(1), quarter),
        Ok(Receipt::Applied)
    );
    assert_eq!(
        lp.allotment(FlowId(1)),
        Some(alone),
        "applied at the next update"
    );
    announced(&mut lp, &mut t, 1);
    let capped = lp.allotment(FlowId(1)).unwrap();
    assert_eq!(capped.bytes_per_sec, quarter.bytes_per_sec);
    assert_eq!(
        capped.ops_per_sec,
        quarter.ops_per_sec.min(alone.ops_per_sec)
    );
    assert_eq!(alone.chunk_bytes, profile.chunk_bytes(false));
    assert_eq!(
        capped.chunk_bytes, quarter.chunk_bytes,
        "cut to the responder's chunk"
    );
    assert_eq!(lp.read_cap(FlowId(1)), Some(quarter));

    // Reordered or replayed: an older message never raises the cap again.
    let older = guarantee(3, 4, 1.0, &profile);
    assert_eq!(
        lp.read_guarantee_received(t, FlowId(1), older),
        Ok(Receipt::Stale)
    );
    // Out of range: refused, nothing changes.
    let broken = ReadGuarantee {
        fraction: 2.0,
        ..guarantee(3, 6, 1.0, &profile)
    };
    assert!(matches!(
        lp.read_guarantee_received(t, FlowId(1), broken),
        Err(LoopError::ReadGuarantee(_))
    ));
    announced(&mut lp, &mut t, 1);
    assert_eq!(
        lp.allotment(FlowId(1)).unwrap().bytes_per_sec,
        quarter.bytes_per_sec
    );

    // The responder restarted: a new epoch is believed at once, whatever its sequence.
    let restarted = guarantee(4, 0, 0.5, &profile);
    assert_eq!(
        lp.read_guarantee_received(t, FlowId(1), restarted),
        Ok(Receipt::Applied)
    );
    announced(&mut lp, &mut t, 1);
    assert_eq!(
        lp.allotment(FlowId(1)).unwrap().bytes_per_sec,
        restarted.bytes_per_sec
    );
    assert_eq!(
        lp.read_guarantee_received(t, FlowId(9), restarted),
        Err(LoopError::UnknownFlow(FlowId(9)))
    );
}

#[test]
fn a_guarantee_not_renewed_lapses_and_the_flow_gets_its_share_back() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut lp = reading_loop(Duration::ZERO);
    let mut t = Duration::ZERO;
    announced(&mut lp, &mut t, 1);
    let share = lp.allotment(FlowId(1)).unwrap().bytes_per_sec;
    let heard = t;
    lp.read_guarantee_received(t, FlowId(1), guarantee(1, 0, 0.25, &profile))
        .unwrap();
    announced(&mut lp, &mut t, 1);
    assert!(lp.allotment(FlowId(1)).unwrap().bytes_per_sec < share);
    // Still held one RefPeriod before it lapses, gone at the first update after.
    let hold = DEFAULT_READ_GUARANTEE_LIFETIME;
    while t + us(500) < heard + hold {
        announced(&mut lp, &mut t, 1);
    }
    assert!(lp.read_cap(FlowId(1)).is_some());
    announced(&mut lp, &mut t, 1);
    assert_eq!(lp.read_cap(FlowId(1)), None);
    assert_eq!(lp.allotment(FlowId(1)).unwrap().bytes_per_sec, share);
    // A message from the responder's next incarnation caps it again.
    lp.read_guarantee_received(t, FlowId(1), guarantee(0, 0, 0.5, &profile))
        .unwrap();
    announced(&mut lp, &mut t, 1);
    assert_eq!(
        lp.allotment(FlowId(1)).unwrap().bytes_per_sec,
        0.5 * profile.max_rate_bytes_per_sec()
    );
}

/// The count of flows holding a guarantee follows every way a guarantee goes: refused
/// before any was held, lapsed, and the flow removed (the update's debug check compares
/// it with the flows).
#[test]
fn every_way_a_guarantee_goes_is_counted() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut lp = reading_loop(Duration::ZERO);
    let mut t = Duration::ZERO;
    announced(&mut lp, &mut t, 1);
    let mut bad = guarantee(1, 0, 0.25, &profile);
    bad.fraction = 0.0;
    assert!(lp.read_guarantee_received(t, FlowId(1), bad).is_err());
    assert_eq!(lp.read_cap(FlowId(1)), None);
    announced(&mut lp, &mut t, 1);
    assert_eq!(lp.capped, 0);
    lp.read_guarantee_received(t, FlowId(1), guarantee(1, 0, 0.25, &profile))
        .unwrap();
    announced(&mut lp, &mut t, LIFETIME_PERIODS + 2);
    assert_eq!((lp.read_cap(FlowId(1)), lp.capped), (None, 0), "lapsed");
    lp.read_guarantee_received(t, FlowId(1), guarantee(2, 0, 0.25, &profile))
        .unwrap();
    assert_eq!(lp.capped, 1);
    lp.remove_flow(t, FlowId(1)).unwrap();
    assert_eq!(lp.capped, 0, "removed with its guarantee");
    announced(&mut lp, &mut t, 1);
}

/// A tenant's state is freed with its last flow, so a host where tenants come and go
/// keeps as many as are there at once: 1000 tenants one after another use one state.
#[test]
fn tenants_that_come_and_go_leave_no_state_behind() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut lp = ControlLoop::new(LoopConfig::default(), &profile, Duration::ZERO).unwrap();
    for id in 1..=1000 {
        lp.register_flow(Duration::ZERO, flow(id, FlowClass::Bandwidth))
            .unwrap();
        lp.remove_flow(Duration::ZERO, FlowId(id)).unwrap();
    }
    assert_eq!(lp.tenants.len(), 1);
    assert!(lp.tenant_slots.is_empty());
}

/// A flow that says again that it is idle while in its grace keeps the grace it began
/// with: it loses its share one grace after the first report, not after the last.
#[test]
fn an_idle_report_repeated_within_the_grace_does_not_restart_it() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut lp = ControlLoop::new(LoopConfig::default(), &profile, Duration::ZERO).unwrap();
    for id in [1, 2] {
        lp.register_flow(Duration::ZERO, flow(id, FlowClass::Bandwidth))
            .unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(id), true)
            .unwrap();
    }
    let mut t = Duration::ZERO;
    drive(&mut lp, &mut t, 2, us(2));
    let grace = lp.config().idle_grace();
    let idle_at = t;
    lp.set_flow_active(t, FlowId(2), false).unwrap();
    drive(&mut lp, &mut t, 1, us(2));
    lp.set_flow_active(t, FlowId(2), false).unwrap();
    // The first update at or after one grace from the first report.
    while t < idle_at + grace {
        drive(&mut lp, &mut t, 1, us(2));
    }
    assert_eq!(
        lp.counts().bandwidth,
        1,
        "flow 2 idle one grace after its first report"
    );
    assert_eq!(
        lp.allotment(FlowId(1)).unwrap().bytes_per_sec,
        lp.safe_util(),
        "flow 1 has the whole of SafeUtil"
    );
}

/// As in the daemon's guest test: the probes of the idle baseline are in the window,
/// the target is then set below them, and a latency flow registers before any latency
/// flow is counted. The verdict follows the Current99 an operator sees.
#[test]
fn a_latency_flow_is_judged_on_the_current99_shown_even_while_none_is_counted() {
    let mut lp = idle_multiple_loop();
    let mut t = Duration::ZERO;
    drive(&mut lp, &mut t, 20, us(20));
    assert!(lp.target().idle_p99.is_some(), "the baseline was measured");
    lp.set_target(t, Target99::Absolute(us(1))).unwrap();
    let shown = lp.current_p99().expect("the baseline's samples");
    assert_eq!(lp.counts().latency, 0);
    assert_eq!(
        lp.register_flow(t, flow(5, FlowClass::Latency)).unwrap(),
        Admission::TargetAtRisk {
            current_p99: shown,
            target_p99: us(1),
        }
    );
}

#[test]
fn a_latency_flow_registered_while_the_window_is_empty_after_a_decrease_is_warned() {
    let mut lp = busy_loop(Target99::Absolute(us(50)));
    let mut t = Duration::ZERO;
    // 60 us probes against a 50 us target, until the first decrease restarts the window;
    // the probe asked for then is not sent (as when probes take longer than a RefPeriod).
    let measured = loop {
        t += us(500);
        let shown = lp.current_p99();
        lp.handle_timeout(t);
        if lp.last_action() == Some(ControlAction::Decrease) {
            while lp.poll_event().is_some() {}
            break shown.expect("the probes before the decrease completed");
        }
        while let Some(event) = lp.poll_event() {
            if event == Event::ProbeDue {
                let id = lp.probe_sent(t);
                assert!(lp.probe_completed(t + us(60), id));
            }
        }
    };
    assert_eq!(lp.current_p99(), None);
    assert_eq!(
        lp.register_flow(t, flow(3, FlowClass::Latency)).unwrap(),
        Admission::TargetAtRisk {
            current_p99: measured,
            target_p99: us(50),
        }
    );
}

#[test]
fn set_target_to_an_idle_multiple_uses_the_measured_idle_p99_at_once() {
    let mut lp = idle_multiple_loop();
    let mut t = Duration::ZERO;
    // No resource-hungry flow: every probe is uncontended and measures the idle p99.
    drive(&mut lp, &mut t, 12, us(10));
    let idle = lp.target().idle_p99.unwrap();
    assert!(idle >= us(9) && idle <= us(11), "{idle:?}");
    lp.set_target(t, Target99::IdleMultiple(3.0)).unwrap();
    let value = lp.target().value.unwrap();
    assert_eq!(value, idle_target(idle, 3.0));
    assert_eq!(lp.controller.config().target_p99, value);
    lp.set_target(t, Target99::Absolute(us(70))).unwrap();
    assert_eq!(lp.target().value, Some(us(70)));
    assert_eq!(lp.target().idle_p99, Some(idle));
    // A bad target is refused and the one in effect stays.
    assert!(lp.set_target(t, Target99::IdleMultiple(0.5)).is_err());
    assert_eq!(lp.target().value, Some(us(70)));
}

/// The probe moves from loopback (10 us) to a peer across a wire (300 us), once while
/// the idle p99 is being measured (the daemon's start) and once after: the idle p99 is
/// measured from the new path's probes alone, and a probe sent on the old path and
/// completed after the move counts in neither the baseline nor Current99.
#[test]
fn a_reference_path_change_measures_the_idle_p99_again_on_the_new_path() {
    for measured_before in [false, true] {
        let mut lp = idle_multiple_loop();
        let mut t = Duration::ZERO;
        drive(
            &mut lp,
            &mut t,
            if measured_before { 12 } else { 5 },
            us(10),
        );
        assert_eq!(lp.target().value.is_some(), measured_before);
        let straddling = lp.probe_sent(t);
        t += us(100);
        lp.reference_path_changed(t).unwrap();
        assert_eq!(lp.target().idle_p99, None);
        assert_eq!(lp.target().value, None);
        assert_eq!(lp.current_p99(), None);
        // The old path's probe completes after the move, at 500 us: were it counted, the
        // new baseline's p99 (its largest of 10) would be 500 us.
        assert!(lp.probe_completed(t + us(400), straddling));
        assert_eq!(lp.current_p99(), None);
        drive(&mut lp, &mut t, 12, us(300));
        // The estimator's buckets hold a value within 0.2 %: 300 us reads as 299.52 us.
        let idle = lp.target().idle_p99.unwrap();
        assert!(idle >= us(299) && idle <= us(301), "{idle:?}");
        assert_eq!(lp.target().value, Some(idle * 2));
    }
    // An absolute target is kept across a move.
    let mut lp = busy_loop(Target99::Absolute(us(50)));
    lp.reference_path_changed(us(1)).unwrap();
    assert_eq!(lp.target().value, Some(us(50)));
}

#[test]
fn set_target_to_an_idle_multiple_before_any_measurement_holds_until_measured() {
    let mut lp = busy_loop(Target99::Absolute(us(50)));
    let mut t = Duration::ZERO;
    drive(&mut lp, &mut t, 5, us(10));
    lp.set_target(t, Target99::IdleMultiple(2.0)).unwrap();
    assert_eq!(lp.target().value, None);
    // The bandwidth flow stops: probes are uncontended and measure the idle p99.
    lp.set_flow_active(t, FlowId(2), false).unwrap();
    drive(&mut lp, &mut t, 20, us(10));
    let value = lp.target().value.unwrap();
    assert!(value >= us(18) && value <= us(22), "{value:?}");
}

/// An idle-multiple loop measuring its baseline from 10 probes, with a bandwidth flow
/// (id 2, registered idle) that loses its share the moment it reports no work (no
/// idle grace), so that a busy spell can begin and end between two probe events.
fn baseline_loop_with_a_bandwidth_flow() -> ControlLoop {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::IdleMultiple(2.0),
        idle_samples: 10,
        idle_grace_periods: 0,
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    lp.register_flow(Duration::ZERO, flow(2, FlowClass::Bandwidth))
        .unwrap();
    lp
}

/// Completes the baseline with 10 probes of 10 us sent and completed while no flow is
/// active, from `t`, and returns the idle p99 measured. Every uncontended probe took
/// 10 us, so a baseline of uncontended probes only has a p99 of exactly 10 us, and a
/// target of twice that.
fn measure_idle(lp: &mut ControlLoop, mut t: Duration) -> Duration {
    for i in 0..10 {
        assert_eq!(lp.target().idle_p99, None, "{i} samples of 10");
        let id = lp.probe_sent(t);
        t += us(10);
        assert!(lp.probe_completed(t, id));
    }
    let report = lp.target();
    assert_eq!(report.value, report.idle_p99.map(|p| p * 2));
    report
        .idle_p99
        .expect("10 uncontended probes measure the idle p99")
}

/// A probe sent while the NIC is idle but outstanding across a busy spell (a bandwidth
/// flow starts and stops before it completes) saw contention: it is not an idle
/// sample, although no hungry flow is active at either end. The spell advances the
/// idle epoch the probe was sent in.
#[test]
fn a_probe_outstanding_across_a_busy_spell_is_not_an_idle_sample() {
    let mut lp = baseline_loop_with_a_bandwidth_flow();
    let straddling = lp.probe_sent(Duration::ZERO);
    lp.set_flow_active(us(1), FlowId(2), true).unwrap();
    lp.set_flow_active(us(2), FlowId(2), false).unwrap();
    assert_eq!(lp.counts().bandwidth, 0, "the spell is over");
    assert!(lp.probe_completed(us(1000), straddling));
    assert_eq!(lp.target().idle_p99, None, "1 sample of 10 at most");
    assert_eq!(measure_idle(&mut lp, us(1000)), us(10));
}

/// A probe sent while a hungry flow is active is contended even if the flow has
/// stopped by the time the probe completes.
#[test]
fn a_probe_sent_while_busy_is_not_an_idle_sample_though_it_completes_idle() {
    let mut lp = baseline_loop_with_a_bandwidth_flow();
    lp.set_flow_active(Duration::ZERO, FlowId(2), true).unwrap();
    let contended = lp.probe_sent(us(1));
    lp.set_flow_active(us(2), FlowId(2), false).unwrap();
    assert_eq!(lp.counts().bandwidth, 0, "the flow has stopped");
    assert!(lp.probe_completed(us(1000), contended));
    assert_eq!(measure_idle(&mut lp, us(1000)), us(10));
}

/// A xorshift64 generator: reproducible noise without a dependency.
struct Noise(u64);

impl Noise {
    /// A uniform number in [0, 1).
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Drives `lp` for `periods` RefPeriods with probes of 10 us, a fraction `slow` of them
/// 100 us; returns the times of the decreases and SafeUtil's mean fraction of MaxRate.
fn slow_probe_run(lp: &mut ControlLoop, periods: u32, slow: f64) -> (Vec<Duration>, f64) {
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    let mut t = Duration::ZERO;
    let (mut decreases, mut safe_util) = (Vec::new(), 0.0);
    for _ in 0..periods {
        t += us(500);
        lp.handle_timeout(t);
        while let Some(event) = lp.poll_event() {
            if event == Event::ProbeDue {
                let latency = if noise.next() < slow { us(100) } else { us(10) };
                let id = lp.probe_sent(t);
                assert!(lp.probe_completed(t + latency, id));
            }
        }
        if lp.last_action() == Some(ControlAction::Decrease) {
            decreases.push(t);
        }
        safe_util += lp.safe_util() / lp.max_rate();
    }
    (decreases, safe_util / f64::from(periods))
}

#[test]
fn one_slow_probe_in_a_window_too_short_for_a_p99_is_not_a_violation() {
    // 20 fast probes, one slow one, then fast ones: the nearest-rank p99 of fewer than
    // 100 samples is their largest, which halved SafeUtil on that one probe.
    let mut lp = busy_loop_with(Target99::Absolute(us(50)), ViolationRule::HeldP99);
    let mut t = Duration::ZERO;
    drive(&mut lp, &mut t, 20, us(10));
    drive(&mut lp, &mut t, 1, us(100));
    for _ in 0..150 {
        drive(&mut lp, &mut t, 1, us(10));
        assert_ne!(lp.last_action(), Some(ControlAction::Decrease), "at {t:?}");
    }
}

#[test]
fn slow_probes_below_one_percent_are_decided_on_windows_that_hold_a_p99() {
    // 0.9 % of probes above the 50 us target: the true p99 (10 us) meets it. Every
    // decrease restarts the window, and the next one needs a window of 100 samples
    // (50 ms), or three slow probes in a row (p = 7 x 10^-7 per update): so decreases
    // come at least 50 ms apart, at most 20 a second. The old estimator decided on the
    // largest sample of the restarted window and halved again at once.
    let mut lp = busy_loop_with(Target99::Absolute(us(50)), ViolationRule::HeldP99);
    let (decreases, mean) = slow_probe_run(&mut lp, 60_000, 0.009);
    let rate = decreases.len() as f64 / 30.0;
    eprintln!("0.9 % slow probes: {rate:.2} decreases/s, mean SafeUtil {mean:.3} x MaxRate");
    let closest = decreases.windows(2).map(|w| w[1] - w[0]).min();
    assert!(
        closest.is_none_or(|gap| gap >= Duration::from_millis(50)),
        "decreases {closest:?} apart"
    );
}

#[test]
fn the_default_rule_makes_almost_no_false_violations_with_slow_probes_below_one_percent() {
    // 0.9 % of probes above the 50 us target: the true p99 (10 us) meets it, so every
    // decrease is a false violation. The default's binomial rule at 10^-3 per update
    // needs 22 slow of 1000 samples, where 0.9 % gives about Poisson(9): P(>= 22) is
    // 1.4 x 10^-4, and a full window's count moves by at most one sample an update, so
    // runs of such updates are rare too. At most 3 in 30 s (0.1 a second), SafeUtil
    // near MaxRate. The paper's Current99 made 122 (4.07 a second, SafeUtil 0.895),
    // HeldP99 80 (2.67, 0.955).
    let default = LoopConfig::default().violation;
    assert_eq!(default, ViolationRule::Confident(1e-3));
    let mut lp = busy_loop_with(Target99::Absolute(us(50)), default);
    let (decreases, mean) = slow_probe_run(&mut lp, 60_000, 0.009);
    let rate = decreases.len() as f64 / 30.0;
    eprintln!("0.9 % slow probes, default rule: {rate:.2} decreases/s, mean SafeUtil {mean:.3}");
    assert!(rate <= 0.1, "{rate} decreases/s");
    assert!(mean >= 0.99, "mean SafeUtil {mean}");
}

#[test]
fn the_default_rule_reacts_to_a_real_violation_within_two_samples() {
    // Every probe slow: one of one is chance (10^-2 > 10^-3), two of two is not
    // (10^-4). The first update asks for the first probe, so the third halves, one
    // update sooner than HeldP99's three in a row.
    let default = LoopConfig::default().violation;
    let mut lp = busy_loop_with(Target99::Absolute(us(50)), default);
    let mut t = Duration::ZERO;
    drive(&mut lp, &mut t, 2, us(100));
    assert_eq!(lp.last_action(), Some(ControlAction::Hold));
    drive(&mut lp, &mut t, 1, us(100));
    assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
    // The decrease restarted the window with the slow probe it asked for: a violation
    // that goes on halves again at every second update, while one slow probe among
    // fast ones decides nothing.
    drive(&mut lp, &mut t, 1, us(100));
    assert_eq!(lp.last_action(), Some(ControlAction::Hold));
    drive(&mut lp, &mut t, 1, us(10));
    assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
    for _ in 0..200 {
        drive(&mut lp, &mut t, 1, us(10));
        assert_ne!(lp.last_action(), Some(ControlAction::Decrease), "at {t:?}");
    }
    // 5 % slow (the p99 twice the target): a decrease within 200 ms (400 probes), and
    // more than 10 a second over 30 s.
    let mut lp = busy_loop_with(Target99::Absolute(us(50)), default);
    let (decreases, _) = slow_probe_run(&mut lp, 60_000, 0.05);
    assert!(
        decreases
            .first()
            .is_some_and(|&t| t <= Duration::from_millis(200)),
        "first decrease at {:?}",
        decreases.first()
    );
    let rate = decreases.len() as f64 / 30.0;
    assert!(rate >= 10.0, "{rate} decreases/s with 5 % slow probes");
}

#[test]
fn decision_ranks_are_the_binomial_bound_or_the_p99_of_a_full_enough_window() {
    // The default, 10^-3: P(Binomial(5, 0.01) >= 2) = 9.8 x 10^-4, two of five decide;
    // P(Binomial(6, 0.01) >= 2) = 1.46 x 10^-3, three of six; one of one never
    // (10^-2). n = 100: P(>= 6) = 5.3 x 10^-4, P(>= 5) = 3.4 x 10^-3. n = 1000:
    // P(>= 22) = 6.5 x 10^-4, P(>= 21) = 1.2 x 10^-3.
    let ranks = decision_ranks(1000, Some(FALSE_VIOLATION_RATE));
    assert_eq!(&ranks[..7], &[0, 0, 1, 2, 3, 4, 4]);
    assert_eq!(ranks[100], 95);
    assert_eq!(ranks[1000], 979);
    // P(Binomial(3, 0.01) >= 3) = 10^-6 <= 10^-4, P(>= 2) = 3 x 10^-4 > 10^-4.
    let ranks = decision_ranks(1000, Some(1e-4));
    assert_eq!(&ranks[..4], &[0, 0, 0, 1]);
    // n = 100: P(>= 7) = 7.1 x 10^-5, P(>= 6) = 5.3 x 10^-4: 7 slow probes decide.
    assert_eq!(ranks[100], 94);
    // n = 1000: P(>= 25) = 4.2 x 10^-5, P(>= 24) = 1.09 x 10^-4.
    assert_eq!(ranks[1000], 976);
    let paper = decision_ranks(10_000, None);
    assert_eq!(paper[99], 0, "99 samples cannot hold a p99");
    assert_eq!(paper[100], 99);
    assert_eq!(paper[10_000], 9_900);
}

#[test]
fn a_positive_allotment_always_paces() {
    // Weight 1 beside weight 10^8 on IB-56: 60 B/s and 0.06 ops/s, which truncated to
    // 0 ops/s, a pause.
    let allotment = Allotment {
        bytes_per_sec: 60.0,
        ops_per_sec: 0.06,
        chunk_bytes: 5 * 1024,
        token: Token {
            bytes: 5 * 1024,
            ops: 3,
        },
        phase: ReleasePhase {
            offset: 0.0,
            epoch: 1,
        },
        generation: 1,
    };
    let rate = allotment.pace_rate();
    assert_eq!(rate.bytes_per_sec, 60);
    assert_eq!(rate.ops_per_sec, Some(1));
    let tiny = Allotment {
        bytes_per_sec: 0.5,
        ..allotment
    };
    assert_eq!(tiny.pace_rate().bytes_per_sec, 1);
    let idle = Allotment {
        bytes_per_sec: 0.0,
        ops_per_sec: 0.0,
        ..allotment
    };
    assert_eq!(idle.pace_rate().bytes_per_sec, 0);
    assert_eq!(idle.pace_rate().ops_per_sec, Some(0));
    // The pacer releases the flow's burst, then a chunk every 5120 / 60 s: slowly, but
    // not the 60 s of a pause.
    let mut pacer = crate::pacer::Pacer::new(rate, Duration::ZERO);
    assert!(pacer.try_release(Duration::ZERO, 5 * 1024, 1).is_ok());
    assert_ne!(
        pacer.try_release(Duration::ZERO, 5 * 1024, 1),
        Err(crate::pacer::MAX_WAIT),
        "paused"
    );
}

#[test]
fn a_driver_stall_neither_expires_outstanding_probes_nor_counts_toward_delta() {
    // 1 s of 60 us probes against a 50 us target (delta is 5 s), then a probe is sent
    // and the driver stalls for 4.5 s.
    let mut lp = busy_loop(Target99::Absolute(us(50)));
    let mut t = Duration::ZERO;
    drive(&mut lp, &mut t, 2_000, us(60));
    assert_eq!(lp.mode(), ControlMode::Normal);
    t += us(500);
    lp.handle_timeout(t);
    let mut outstanding = None;
    while let Some(event) = lp.poll_event() {
        if event == Event::ProbeDue {
            outstanding = Some(lp.probe_sent(t));
        }
    }
    t += Duration::from_millis(4_500);
    lp.handle_timeout(t);
    let mut lost = false;
    while let Some(event) = lp.poll_event() {
        lost |= matches!(event, Event::ProbeLost(_));
        if event == Event::ProbeDue {
            let id = lp.probe_sent(t);
            assert!(lp.probe_completed(t + us(60), id));
        }
    }
    assert!(!lost, "a probe outstanding across the stall expired");
    assert!(!lp.probe_completed(t, outstanding.unwrap()), "forgotten");
    assert_eq!(
        lp.mode(),
        ControlMode::Normal,
        "the stall counted toward delta"
    );
    // The violation goes on being observed: delta is reached about 4 s later.
    drive(&mut lp, &mut t, 7_800, us(60));
    assert_eq!(lp.mode(), ControlMode::Normal);
    drive(&mut lp, &mut t, 400, us(60));
    assert!(matches!(lp.mode(), ControlMode::Unattainable { .. }));
}

#[test]
fn a_lost_probe_is_a_violation_even_when_the_target_exceeds_the_timeout() {
    // Target 20 ms, probe timeout 5 ms: a lost probe waited at least 5 ms, which says
    // nothing against a 20 ms target, yet a reference flow whose probes vanish is in
    // trouble. Lost probes are recorded just above the target: three in a row halve.
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(Duration::from_millis(20)),
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    for (id, class) in [(1, FlowClass::Latency), (2, FlowClass::Bandwidth)] {
        lp.register_flow(Duration::ZERO, flow(id, class)).unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(id), true)
            .unwrap();
    }
    let mut t = Duration::ZERO;
    let mut lost = 0;
    for _ in 0..20 {
        t += us(500);
        lp.handle_timeout(t);
        while let Some(event) = lp.poll_event() {
            match event {
                Event::ProbeDue => {
                    lp.probe_sent(t);
                }
                Event::ProbeLost(_) => lost += 1,
                _ => {}
            }
        }
    }
    assert!(lost >= 3, "{lost} probes lost");
    assert!(lp.safe_util() < lp.max_rate(), "no decrease on lost probes");
}

/// The events waiting, in order.
fn events(lp: &mut ControlLoop) -> Vec<Event> {
    std::iter::from_fn(|| lp.poll_event()).collect()
}

/// A probe is lost when its timeout has run out and not before: at `sent +
/// probe_timeout` exactly.
#[test]
fn a_probe_is_lost_exactly_when_its_timeout_runs_out() {
    let mut lp = quiet_loop(1);
    let timeout = lp.config().probe_timeout;
    let id = lp.probe_sent(Duration::ZERO);
    lp.handle_timeout(timeout - Duration::from_nanos(1));
    assert!(!events(&mut lp).contains(&Event::ProbeLost(id)));
    lp.handle_timeout(timeout);
    assert!(events(&mut lp).contains(&Event::ProbeLost(id)));
    assert!(!lp.probe_completed(timeout, id), "already counted");
}

/// "Later than `poll_timeout` by more than the probe timeout" is a stall: a call
/// exactly one probe timeout late expires the probe outstanding as lost, a nanosecond
/// later forgets it (no loss, and its completion is unknown).
#[test]
fn a_call_one_probe_timeout_late_expires_probes_and_a_later_one_forgets_them() {
    for (late, lost) in [(Duration::ZERO, true), (Duration::from_nanos(1), false)] {
        let mut lp = quiet_loop(1);
        let id = lp.probe_sent(Duration::ZERO);
        let due = lp.poll_timeout().unwrap();
        let now = due + lp.config().probe_timeout + late;
        lp.handle_timeout(now);
        assert_eq!(
            events(&mut lp).contains(&Event::ProbeLost(id)),
            lost,
            "{late:?} beyond"
        );
        assert!(!lp.probe_completed(now, id));
    }
}

/// A probe that failed is counted lost once: the first report is taken, a second one
/// and a completion after it are not.
#[test]
fn a_failed_probe_is_counted_lost_once() {
    let mut lp = quiet_loop(1);
    let id = lp.probe_sent(Duration::ZERO);
    assert!(lp.probe_lost(us(1), id));
    assert_eq!(events(&mut lp), vec![Event::ProbeLost(id)]);
    assert!(!lp.probe_lost(us(2), id));
    assert!(!lp.probe_completed(us(3), id));
    assert!(!lp.probe_lost(us(4), ProbeId(99)), "never sent");
}

/// A loop with no flow at all asks for nothing: it updates every quiet period.
#[test]
fn a_loop_without_flows_updates_every_quiet_period() {
    let mut lp = quiet_loop(QUIET_PERIODS);
    let trace = follow(&mut lp, &[], Duration::from_millis(100));
    assert!(trace.probes.is_empty(), "{:?}", trace.probes);
    assert!(
        gaps(&trace.updates[1..])
            .iter()
            .all(|&g| g == Duration::from_millis(5)),
        "{:?}",
        trace.updates
    );
}

/// An idle-multiple loop waiting for its baseline is not quiet: it asks for a probe at
/// every RefPeriod until its 10 idle samples are in, and is quiet from then on.
#[test]
fn a_loop_measuring_its_idle_baseline_is_quiet_only_once_it_has() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::IdleMultiple(2.0),
        idle_samples: 10,
        quiet_periods: QUIET_PERIODS,
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    let trace = follow(&mut lp, &[], Duration::from_millis(100));
    let every_ref_period: Vec<Duration> = (1..=10).map(|k| us(500 * k)).collect();
    assert_eq!(trace.probes, every_ref_period);
    assert_eq!(lp.target().idle_p99, Some(us(10)));
    assert!(
        gaps(&trace.updates[10..])
            .iter()
            .all(|&g| g == Duration::from_millis(5)),
        "{:?}",
        trace.updates
    );
}

/// A change of mode is said once, when it happens: RefPeriod 10 ms, delta 50 ms, every
/// probe slow, and one `ModeChanged` (to unattainable) in 20 updates.
#[test]
fn a_change_of_mode_is_one_event() {
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        ref_period: Duration::from_millis(10),
        unattainable_after: Some(Duration::from_millis(50)),
        ..LoopConfig::default()
    });
    let mut changes = Vec::new();
    let mut t = Duration::ZERO;
    for _ in 0..20 {
        t += lp.config().ref_period;
        lp.handle_timeout(t);
        for event in events(&mut lp) {
            match event {
                Event::ProbeDue => {
                    let id = lp.probe_sent(t);
                    assert!(lp.probe_completed(t + us(100), id));
                }
                Event::ModeChanged(mode) => changes.push(mode),
                _ => {}
            }
        }
    }
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert!(matches!(changes[0], ControlMode::Unattainable { .. }));
}

/// The allotments follow SafeUtil at the update that changes it, with nothing else
/// changed: one bandwidth flow beside a latency flow is allotted the whole of SafeUtil,
/// MaxRate, then half of it after the halving.
#[test]
fn an_allotment_follows_safe_util_at_the_update_that_changes_it() {
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    });
    let mut t = Duration::ZERO;
    run_periods(&mut lp, &mut t, 1, us(10));
    let max = lp.max_rate();
    assert_eq!(lp.allotment(FlowId(2)).unwrap().bytes_per_sec, max);
    while lp.last_action() != Some(ControlAction::Decrease) {
        run_periods(&mut lp, &mut t, 1, us(100));
        assert!(t < Duration::from_millis(100), "no decrease");
    }
    assert_eq!(lp.safe_util(), max / 2.0);
    assert_eq!(lp.allotment(FlowId(2)).unwrap().bytes_per_sec, max / 2.0);
}

/// The probes that show a violation went at the rates of the latest updates, so a
/// decrease's ceiling is the lowest SafeUtil of the latest [`VIOLATION_RUN`] updates,
/// not the rate SafeUtil had climbed to when they showed it: after a halving, four
/// updates on fast probes (a hold, then the climb), then slow probes, the search aims
/// half-way to the lowest rate of the three updates before the second decrease.
#[test]
fn a_decrease_after_a_climb_aims_below_the_lowest_recent_rate() {
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    });
    let mut t = Duration::ZERO;
    let until = |lp: &mut ControlLoop, t: &mut Duration, action, latency| {
        let mut rates = Vec::new();
        while lp.last_action() != Some(action) {
            run_periods(lp, t, 1, latency);
            rates.push(lp.safe_util());
            assert!(*t < Duration::from_millis(100), "no {action:?}");
        }
        rates
    };
    until(&mut lp, &mut t, ControlAction::Decrease, us(100));
    let floor = lp.safe_util();
    assert_eq!(floor, lp.max_rate() / 2.0);
    let mut rates = vec![floor];
    for _ in 0..4 {
        run_periods(&mut lp, &mut t, 1, us(10));
        rates.push(lp.safe_util());
    }
    rates.extend(until(&mut lp, &mut t, ControlAction::Decrease, us(100)));
    // The decrease is the last entry; the three before it are the latest rates.
    let before = &rates[rates.len() - 1 - VIOLATION_RUN..rates.len() - 1];
    let ceiling = before.iter().copied().fold(f64::MAX, f64::min);
    let climbed = before[VIOLATION_RUN - 1];
    assert!(ceiling < climbed, "SafeUtil climbed: {before:?}");
    assert_eq!(lp.safe_util(), floor);
    until(&mut lp, &mut t, ControlAction::Increase, us(10));
    let want = floor + (ceiling - floor) / 2.0;
    assert!(
        (lp.safe_util() - want).abs() <= 1e-9 * want,
        "{} against {want} (half-way to {ceiling}, not to {climbed})",
        lp.safe_util()
    );
}

/// The division follows the tenants: two tenants of one bandwidth flow each get 1/2 of
/// SafeUtil; when a third tenant with two flows starts, each tenant gets 1/3, its two
/// flows 1/6 each (no share kept from the division before).
#[test]
fn a_tenant_that_starts_takes_its_share_from_the_others_split_over_its_flows() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    for id in [1, 2] {
        lp.register_flow(Duration::ZERO, flow(id, FlowClass::Bandwidth))
            .unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(id), true)
            .unwrap();
    }
    let mut t = Duration::ZERO;
    drive(&mut lp, &mut t, 1, us(10));
    let max = lp.max_rate();
    assert_eq!(lp.safe_util(), max);
    let share = |lp: &ControlLoop, id| lp.allotment(FlowId(id)).unwrap().bytes_per_sec / max;
    assert_eq!((share(&lp, 1), share(&lp, 2)), (0.5, 0.5));
    for id in [3, 4] {
        let mut reg = flow(id, FlowClass::Bandwidth);
        reg.spec.tenant = TenantId(3);
        lp.register_flow(t, reg).unwrap();
        lp.set_flow_active(t, FlowId(id), true).unwrap();
    }
    drive(&mut lp, &mut t, 1, us(10));
    for (id, want) in [
        (1, 1.0 / 3.0),
        (2, 1.0 / 3.0),
        (3, 1.0 / 6.0),
        (4, 1.0 / 6.0),
    ] {
        let got = share(&lp, id);
        assert!((got - want).abs() < 1e-12, "flow {id}: {got}, not {want}");
    }
}

/// Three slow probes in a row decide a violation whatever the window holds: after 100
/// fast probes (a window where the binomial rule needs 6 of about 100), probes of twice
/// the target from the update that sends the first of them halve SafeUtil at the
/// third update after it, the first to see three.
#[test]
fn three_slow_probes_in_a_row_decide_a_violation_in_a_long_window() {
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    });
    let mut t = Duration::ZERO;
    run_periods(&mut lp, &mut t, 100, us(10));
    assert_eq!(lp.safe_util(), lp.max_rate());
    let mut actions = Vec::new();
    for _ in 0..4 {
        run_periods(&mut lp, &mut t, 1, us(100));
        actions.push(lp.last_action());
    }
    assert_eq!(actions[3], Some(ControlAction::Decrease), "{actions:?}");
    assert!(
        !actions[..3].contains(&Some(ControlAction::Decrease)),
        "{actions:?}"
    );
}

/// The memo of shares is direct-mapped and checks its whole key: tenants of weight 1
/// and 17 with one flow each share a slot, as do tenants of weight 1 with 1 and 17
/// flows; each still gets its own share (1/18 and 17/18; 1/2 for the flow alone and
/// 1/34 for each of the 17).
#[test]
fn tenants_whose_memo_slots_collide_get_their_own_shares() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    };
    for (weights, flows) in [([1, 17], [1, 1]), ([1, 1], [1, 17])] {
        assert_eq!(
            ShareMemo::slot(weights[0], flows[0]),
            ShareMemo::slot(weights[1], flows[1])
        );
        let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
        let mut id = 0;
        let mut first = Vec::new();
        for tenant in 0..2 {
            for _ in 0..flows[tenant] {
                id += 1;
                first.push(tenant == 0);
                let mut reg = flow(id, FlowClass::Bandwidth);
                reg.spec.tenant = TenantId(tenant as u64 + 100);
                reg.spec.weight = Weight::new(weights[tenant]).unwrap();
                lp.register_flow(Duration::ZERO, reg).unwrap();
                lp.set_flow_active(Duration::ZERO, FlowId(id), true)
                    .unwrap();
            }
        }
        let mut t = Duration::ZERO;
        drive(&mut lp, &mut t, 1, us(10));
        let total = f64::from(weights[0] + weights[1]);
        for (k, &of_first) in first.iter().enumerate() {
            let tenant = usize::from(!of_first);
            let want = f64::from(weights[tenant]) / total / f64::from(flows[tenant]);
            let got = lp.allotment(FlowId(k as u64 + 1)).unwrap().bytes_per_sec / lp.max_rate();
            assert!(
                (got - want).abs() < 1e-12,
                "weights {weights:?}, flows {flows:?}: flow {}: {got}, not {want}",
                k + 1
            );
        }
    }
}

/// A window too short for the binomial rule to decide on still increases once its
/// newest three samples all meet the target: at 10^-7 a window of 3 decides nothing
/// (three slow probes of three happen with probability 10^-6), so after a decrease
/// the first increase comes at the third update, the first with three fast samples.
#[test]
fn a_window_too_short_to_decide_increases_on_three_fast_samples() {
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        violation: ViolationRule::Confident(1e-7),
        ..LoopConfig::default()
    });
    let mut t = Duration::ZERO;
    let mut since_decrease = None;
    while t < Duration::from_millis(100) {
        t += lp.config().ref_period;
        lp.handle_timeout(t);
        if lp.last_action() == Some(ControlAction::Decrease) && since_decrease.is_none() {
            since_decrease = Some(0);
        } else if let Some(n) = &mut since_decrease {
            *n += 1;
            if lp.last_action() == Some(ControlAction::Increase) {
                break;
            }
        }
        let latency = if since_decrease.is_some() {
            us(10)
        } else {
            us(100)
        };
        for event in events(&mut lp) {
            if event == Event::ProbeDue {
                let id = lp.probe_sent(t);
                assert!(lp.probe_completed(t + latency, id));
            }
        }
    }
    assert_eq!(lp.last_action(), Some(ControlAction::Increase));
    assert_eq!(since_decrease, Some(3));
}

/// A tenant counts at the largest weight of its active flows: when its flow of weight
/// 3 stops, its flow of weight 1 is left and it weighs 1 again, beside another tenant
/// of weight 1 (3/4 then 1/2 of SafeUtil). Each allotment's operations are its bytes
/// at the profile's MaxTput / MaxRate, and each change of the allotments is the next
/// generation.
#[test]
fn a_tenant_weighs_its_largest_active_flow_and_allotments_carry_ops_and_generations() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        idle_grace_periods: 0,
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    for (id, tenant, weight) in [(1, 7, 3), (2, 7, 1), (3, 8, 1)] {
        let mut reg = flow(id, FlowClass::Bandwidth);
        reg.spec.tenant = TenantId(tenant);
        reg.spec.weight = Weight::new(weight).unwrap();
        lp.register_flow(Duration::ZERO, reg).unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(id), true)
            .unwrap();
    }
    let mut t = Duration::ZERO;
    let mut generations = Vec::new();
    let mut update = |lp: &mut ControlLoop, t: &mut Duration| {
        *t += us(500);
        lp.handle_timeout(*t);
        for event in events(lp) {
            if let Event::AllotmentsChanged { generation } = event {
                generations.push(generation);
            }
        }
    };
    update(&mut lp, &mut t);
    let max = lp.max_rate();
    let share = |lp: &ControlLoop, id| lp.allotment(FlowId(id)).unwrap().bytes_per_sec / max;
    // Tenant 7 weighs 3 of 4, split over its two flows.
    assert_eq!(
        (share(&lp, 1), share(&lp, 2), share(&lp, 3)),
        (0.375, 0.375, 0.25)
    );
    lp.set_flow_active(t, FlowId(1), false).unwrap();
    update(&mut lp, &mut t);
    assert_eq!(
        (share(&lp, 1), share(&lp, 2), share(&lp, 3)),
        (0.0, 0.5, 0.5)
    );
    for id in [2, 3] {
        let a = lp.allotment(FlowId(id)).unwrap();
        assert_eq!(a.ops_per_sec, a.bytes_per_sec * profile.ops_per_byte());
    }
    assert_eq!(generations, vec![1, 2]);
    assert_eq!(lp.generation(), 2);
}

/// A new assignment of release phases is a new epoch, and only that: the first
/// division is epoch 1; a halving of SafeUtil alone keeps it; a flow that starts to
/// share (a new division with new phases) makes epoch 2; a second latency flow (a new
/// division of the same sharing flows) keeps it.
#[test]
fn a_new_phase_epoch_comes_with_new_phases_and_not_with_safe_util_alone() {
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    });
    let mut t = Duration::ZERO;
    let epoch = |lp: &ControlLoop| lp.allotment(FlowId(2)).unwrap().phase.epoch;
    run_periods(&mut lp, &mut t, 1, us(10));
    assert_eq!(epoch(&lp), 1);
    while lp.last_action() != Some(ControlAction::Decrease) {
        run_periods(&mut lp, &mut t, 1, us(100));
        assert!(t < Duration::from_millis(100), "no decrease");
    }
    assert_eq!(epoch(&lp), 1, "SafeUtil alone");
    lp.register_flow(t, flow(3, FlowClass::Bandwidth)).unwrap();
    lp.set_flow_active(t, FlowId(3), true).unwrap();
    run_periods(&mut lp, &mut t, 1, us(100));
    assert_eq!(epoch(&lp), 2);
    // A second latency flow: a new division, but the same flows share (and the chunk
    // stays that of a host with latency flows), so every phase stays.
    lp.register_flow(t, flow(4, FlowClass::Latency)).unwrap();
    lp.set_flow_active(t, FlowId(4), true).unwrap();
    run_periods(&mut lp, &mut t, 1, us(10));
    assert_eq!(lp.counts().latency, 2);
    assert_eq!(epoch(&lp), 2, "the same sharing flows");
}

/// A READ tenant's share of a responder is split among its active flows of one class
/// reading from that responder, and only those: tenant 9's two bandwidth flows reading
/// from host 1 (weight 3, guarantee 1/4) get 3/8 of its MaxRate and MaxTput each, beside
/// another tenant's flow, tenant 9's flow reading from host 2 and its throughput flow
/// reading from host 1, none of which is a sibling.
#[test]
fn a_read_tenants_share_is_split_among_its_flows_of_one_class_and_responder_only() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    };
    let mut a = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    let g = guarantee(1, 0, 0.25, &profile);
    for (id, tenant, class, responder) in [
        (1, 9, FlowClass::Bandwidth, 1),
        (2, 9, FlowClass::Bandwidth, 1),
        (3, 10, FlowClass::Bandwidth, 1),
        (4, 9, FlowClass::Bandwidth, 2),
        (5, 9, FlowClass::Throughput, 1),
    ] {
        let mut reg = flow(id, class);
        reg.spec.tenant = TenantId(tenant);
        reg.spec.weight = Weight::new(3).unwrap();
        a.register_flow(Duration::ZERO, reg).unwrap();
        a.set_flow_reads_from(Duration::ZERO, FlowId(id), Some(responder))
            .unwrap();
        a.set_flow_active(Duration::ZERO, FlowId(id), true).unwrap();
        a.read_guarantee_received(Duration::ZERO, FlowId(id), g)
            .unwrap();
    }
    let mut t = Duration::ZERO;
    announced(&mut a, &mut t, 1);
    for id in [1, 2] {
        let got = a.allotment(FlowId(id)).unwrap();
        let bytes = 0.375 * profile.max_rate_bytes_per_sec();
        let ops = 0.375 * profile.max_ops_per_sec();
        assert!((got.bytes_per_sec - bytes).abs() < 1.0, "{got:?}");
        assert!((got.ops_per_sec - ops).abs() < 1e-3 * ops, "{got:?}");
    }
}

/// The flows that share are spread over one release interval in id order, and a flow
/// that stops sharing leaves its offset: three flows at 0, 1/3 and 2/3; when the third
/// stops, the two left are at 0 and 1/2 and the third back at 0.
#[test]
fn a_flow_that_stops_sharing_gives_up_its_phase() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        idle_grace_periods: 0,
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    for id in [1, 2, 3] {
        lp.register_flow(Duration::ZERO, flow(id, FlowClass::Bandwidth))
            .unwrap();
        lp.set_flow_active(Duration::ZERO, FlowId(id), true)
            .unwrap();
    }
    let mut t = Duration::ZERO;
    drive(&mut lp, &mut t, 1, us(10));
    let offset = |lp: &ControlLoop, id| lp.allotment(FlowId(id)).unwrap().phase.offset;
    let offsets = |lp: &ControlLoop| [1, 2, 3].map(|id| offset(lp, id));
    assert_eq!(offsets(&lp), [0.0, 1.0 / 3.0, 2.0 / 3.0]);
    lp.set_flow_active(t, FlowId(3), false).unwrap();
    drive(&mut lp, &mut t, 1, us(10));
    assert_eq!(offsets(&lp), [0.0, 0.5, 0.0]);
}

/// A READ flow's allotment follows each figure of its guarantee on its own: a new
/// guarantee that changes only the bytes, only the operations or only the chunk
/// changes that figure of the allotment, as a new generation.
#[test]
fn a_read_flows_allotment_follows_each_figure_of_its_guarantee() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut a = reading_loop(Duration::ZERO);
    a.set_flow_reads_from(Duration::ZERO, FlowId(1), Some(3))
        .unwrap();
    let mut t = Duration::ZERO;
    announced(&mut a, &mut t, 1);
    let mut g = guarantee(1, 0, 0.25, &profile);
    let check = |a: &mut ControlLoop, t: &mut Duration, g: ReadGuarantee| {
        let before = a.allotment(FlowId(1)).unwrap().generation;
        a.read_guarantee_received(*t, FlowId(1), g).unwrap();
        announced(a, t, 1);
        let got = a.allotment(FlowId(1)).unwrap();
        assert_eq!(
            (got.bytes_per_sec, got.ops_per_sec, got.chunk_bytes),
            (g.bytes_per_sec, g.ops_per_sec, g.chunk_bytes)
        );
        assert!(got.generation > before, "{got:?}");
    };
    check(&mut a, &mut t, g);
    g.sequence += 1;
    g.bytes_per_sec /= 2.0;
    check(&mut a, &mut t, g);
    g.sequence += 1;
    g.ops_per_sec /= 2.0;
    check(&mut a, &mut t, g);
    g.sequence += 1;
    g.chunk_bytes = 4096;
    check(&mut a, &mut t, g);
}

/// A flow's queue pairs are those it registered with; an unknown flow has none.
#[test]
fn a_flow_reports_the_queue_pairs_it_registered_with() {
    let mut lp = quiet_loop(1);
    let mut reg = flow(1, FlowClass::Bandwidth);
    reg.qps = 4;
    lp.register_flow(Duration::ZERO, reg).unwrap();
    assert_eq!(lp.flow_qps(FlowId(1)), Some(4));
    assert_eq!(lp.flow_qps(FlowId(2)), None);
}

/// The sharing floor the loop reports is (B + T) / (L + B + T) x MaxRate of the flows
/// counted: one latency and one bandwidth flow, half of MaxRate.
#[test]
fn the_sharing_floor_is_the_hungry_flows_fraction_of_max_rate() {
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(us(50)),
        ..LoopConfig::default()
    });
    let mut t = Duration::ZERO;
    run_periods(&mut lp, &mut t, 1, us(10));
    assert_eq!(lp.sharing_floor(), lp.max_rate() / 2.0);
}

/// "All of the newest three exceed the target" is strict: newest three samples whose
/// least equals the target leave the decision to the window's rank. With a target of
/// 49 984 ns (the estimator's value for 50 us), samples of 100, 50, 50 and 100 us: the
/// newest three are 50, 50 and 100 us, the least at the target, and the rank of a
/// window of four (the third of four: two samples above the target decide) is 100 us,
/// a violation.
#[test]
fn newest_samples_at_the_target_leave_the_decision_to_the_rank() {
    let target = Duration::from_nanos(49_984);
    let mut lp = loop_of(LoopConfig {
        target: Target99::Absolute(target),
        ..LoopConfig::default()
    });
    let mut t = Duration::ZERO;
    for latency in [100, 50, 50, 100] {
        run_periods(&mut lp, &mut t, 1, us(latency));
        assert_ne!(lp.last_action(), Some(ControlAction::Decrease));
    }
    let least = lp.estimator.newest_range(3).map(|(least, _)| least);
    assert_eq!(least, Some(target), "the least of the newest three");
    run_periods(&mut lp, &mut t, 1, us(10));
    assert_eq!(lp.last_action(), Some(ControlAction::Decrease));
}

/// The peer channel resends an unchanged grant every 5 ms (`justitia-peer`'s default
/// refresh), each time under a new sequence number. At a RefPeriod of 100 us a
/// guarantee so renewed must cap the READ flow at every update for 100 ms: it must
/// never lapse between two refreshes (40 RefPeriods are 4 ms, shorter than one), and a
/// renewal must restart its lifetime (the first one heard does not set it for good).
#[test]
fn a_guarantee_renewed_every_5_ms_caps_a_read_flow_at_every_update_at_a_100_us_ref_period() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let period = us(100);
    let config = LoopConfig {
        target: Target99::Absolute(us(50)),
        ref_period: period,
        ..LoopConfig::default()
    };
    let mut lp = ControlLoop::new(config, &profile, Duration::ZERO).unwrap();
    lp.register_flow(Duration::ZERO, flow(1, FlowClass::Bandwidth))
        .unwrap();
    lp.set_flow_reads_from(Duration::ZERO, FlowId(1), Some(3))
        .unwrap();
    lp.set_flow_active(Duration::ZERO, FlowId(1), true).unwrap();
    let quarter = 0.25 * profile.max_rate_bytes_per_sec();
    let refresh = Duration::from_millis(5);
    let mut t = Duration::ZERO;
    let mut sequence = 0;
    let mut next_refresh = Duration::ZERO;
    while t < Duration::from_millis(100) {
        if t >= next_refresh {
            lp.read_guarantee_received(t, FlowId(1), guarantee(1, sequence, 0.25, &profile))
                .unwrap();
            sequence += 1;
            next_refresh += refresh;
        }
        t += period;
        lp.handle_timeout(t);
        while lp.poll_event().is_some() {}
        let got = lp.allotment(FlowId(1)).unwrap().bytes_per_sec;
        assert_eq!(
            got, quarter,
            "at {t:?}: READ flow allotted {got} B/s, its guarantee 0.25 x MaxRate = \
             {quarter} B/s renewed every 5 ms (RefPeriod 100 us)"
        );
    }
}

/// The responder's whole RNIC is the most a READ flow can get from it, whatever its
/// tenant's weight: a weight-3 flow guaranteed 0.5 of the responder per unit of weight
/// gets min(3 x 0.5, 1) of the responder's MaxRate, not 1.5 times it.
#[test]
fn a_weight_3_read_flow_gets_at_most_the_responders_whole_rnic() {
    let profile = RnicProfile::builtin("roce-100").unwrap();
    let mut lp = reading_loop(Duration::ZERO);
    lp.remove_flow(Duration::ZERO, FlowId(1)).unwrap();
    let mut heavy = flow(1, FlowClass::Bandwidth);
    heavy.spec.weight = Weight::new(3).unwrap();
    lp.register_flow(Duration::ZERO, heavy).unwrap();
    lp.set_flow_reads_from(Duration::ZERO, FlowId(1), Some(3))
        .unwrap();
    lp.set_flow_active(Duration::ZERO, FlowId(1), true).unwrap();
    let mut t = Duration::ZERO;
    announced(&mut lp, &mut t, 1);
    for (sequence, fraction) in [(0, 0.5), (1, 1.0)] {
        lp.read_guarantee_received(t, FlowId(1), guarantee(1, sequence, fraction, &profile))
            .unwrap();
        announced(&mut lp, &mut t, 1);
        let got = lp.allotment(FlowId(1)).unwrap();
        assert_eq!(
            (got.bytes_per_sec, got.ops_per_sec),
            (profile.max_rate_bytes_per_sec(), profile.max_ops_per_sec()),
            "weight 3 x fraction {fraction}: at most the responder's whole RNIC, {} B/s",
            profile.max_rate_bytes_per_sec()
        );
    }
}

/// The default lifetime is the default refresh (5 ms) times three losses plus one, 20
/// ms; a lifetime shorter than refresh x (losses + 1) is refused naming both settings,
/// one equal to it is accepted, and a lifetime of zero is refused by `validate`.
#[test]
fn a_guarantee_lifetime_shorter_than_the_refresh_times_losses_plus_one_is_refused() {
    let config = LoopConfig::default();
    assert_eq!(config.read_guarantee_lifetime, Duration::from_millis(20));
    assert_eq!(
        read_guarantee_lifetime(DEFAULT_GRANT_REFRESH, DEFAULT_REFRESH_LOSSES),
        DEFAULT_READ_GUARANTEE_LIFETIME
    );
    assert_eq!(
        config.check_grant_refresh(Duration::from_millis(5), 3),
        Ok(())
    );
    let err = config
        .check_grant_refresh(Duration::from_millis(6), 3)
        .unwrap_err();
    assert_eq!(err.needed, Duration::from_millis(24));
    let text = err.to_string();
    for named in ["read_guarantee_lifetime", "refresh", "20ms", "6ms", "24ms"] {
        assert!(text.contains(named), "{named} not in: {text}");
    }
    assert_eq!(
        config.check_grant_refresh(Duration::from_millis(20), 0),
        Ok(()),
        "no loss tolerated: one refresh"
    );
    assert!(config
        .check_grant_refresh(Duration::from_millis(10), 1)
        .is_ok());
    assert!(config
        .check_grant_refresh(Duration::from_millis(10), 2)
        .is_err());
    assert_eq!(
        read_guarantee_lifetime(Duration::MAX, u32::MAX),
        Duration::MAX,
        "saturates"
    );
    let zero = LoopConfig {
        read_guarantee_lifetime: Duration::ZERO,
        ..LoopConfig::default()
    };
    assert!(matches!(
        zero.validate(),
        Err(LoopError::Setting("read_guarantee_lifetime", _))
    ));
}

/// A profile is checked whole by the loop, not only its MaxRate: MaxTput 0 (every
/// allotment's operations 0, a pause) is refused naming the field, as are MaxRate 0,
/// NaN and infinity.
#[test]
fn a_profile_with_max_tput_0_or_an_unusable_max_rate_is_refused_by_the_loop() {
    let mut profile = RnicProfile::builtin("roce-100").unwrap();
    profile.max_tput_mops = 0.0;
    let err = ControlLoop::new(LoopConfig::default(), &profile, Duration::ZERO).err();
    let text = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("max_tput_mops"), "MaxTput 0: `{text}`");
    for bad in [0.0, f64::NAN, f64::INFINITY, -1.0] {
        let mut profile = RnicProfile::builtin("roce-100").unwrap();
        profile.max_rate_gbps = bad;
        assert!(
            ControlLoop::new(LoopConfig::default(), &profile, Duration::ZERO).is_err(),
            "MaxRate {bad} accepted"
        );
    }
}

/// The loop counts the updates that cut SafeUtil: stepped one RefPeriod at a time through
/// violations and then calm, the count rises exactly at the updates whose action was a
/// decrease, and not at an increase or a hold.
#[test]
fn the_loop_counts_its_decreases() {
    let mut lp = fixed_step_loop();
    let mut t = Duration::ZERO;
    let (mut seen_updates, mut counted, mut increases) = (0, 0, 0);
    for period in 0..3000 {
        // Twenty periods of slow probes, then fast ones, until the slow are under 1% of
        // the window and its p99 is fast again.
        let latency = if period < 20 { us(100) } else { us(10) };
        run_periods(&mut lp, &mut t, 1, latency);
        if lp.updates() != seen_updates {
            assert_eq!(lp.updates(), seen_updates + 1, "one update a period");
            seen_updates = lp.updates();
            match lp.last_action() {
                Some(ControlAction::Decrease) => counted += 1,
                Some(ControlAction::Increase) => increases += 1,
                _ => {}
            }
        }
        assert_eq!(lp.decreases(), counted, "after period {period}");
    }
    assert!(counted >= 1, "the slow probes cut SafeUtil");
    assert!(increases >= 1, "the fast probes raised it again");
}
