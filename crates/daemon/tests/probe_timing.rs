//! The probe's latency as the daemon reports it. In a test binary of its own so that no
//! other test's daemon competes with this one for the two cores while it measures.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use justitia_agent::admin::StatusReport;
use justitia_agent::admin::{AdminReply, AdminRequest};
use justitia_agent::client::AgentClient;
use justitia_core::flow::FlowClass;

/// Gives the daemon the scheduling the packaged unit asks for (SCHED_FIFO, priority 1)
/// when this test may, so that what is measured is the loop's timing and not how long
/// other processes on a busy machine keep it from running: under the normal policy a
/// descheduled daemon waits for the next scheduler tick (4 ms at 250 Hz), which is what a
/// p99 over 1000 probes then reports. Unprivileged, the daemon keeps the normal policy
/// and the test says so.
fn realtime(d: &Daemon) {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler reads the parameter it is given; the pid is our child's.
    let rc = unsafe { libc::sched_setscheduler(d.child.id() as i32, libc::SCHED_FIFO, &param) };
    if rc != 0 {
        println!(
            "justitiad left at the normal policy: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Starts a daemon with `latency_us` synthetic probes and a latency flow registered, so
/// the probe runs every RefPeriod and nothing else moves the window; waits until
/// `samples` probes have completed.
fn probing_daemon(latency_us: u64, samples: u64, fifo: bool) -> (Daemon, AgentClient) {
    let d = Daemon::start_with(
        &format!("synthetic_latency_us = {latency_us}\ntarget = \"10ms\""),
        !fifo,
    );
    if fifo {
        realtime(&d);
    }
    let mut c = AgentClient::connect(d.socket()).unwrap();
    let l = c.register(FlowClass::Latency, 1, 0);
    c.wait_registered(l, Duration::from_secs(2));
    assert!(c.report_usage(l, true, 16, 1));
    // Asked rarely: an admin request served while a completion is due delays it.
    std::thread::sleep(Duration::from_micros(500 * samples));
    let deadline = Instant::now() + Duration::from_secs(20);
    while status(&d).probes < samples {
        assert!(Instant::now() < deadline, "{:?}", status(&d));
        std::thread::sleep(Duration::from_millis(100));
    }
    // The flow stays registered while the caller reads: its leaving would restart the
    // window.
    (d, c)
}

fn status(d: &Daemon) -> StatusReport {
    match d.admin(&AdminRequest::Status) {
        AdminReply::Status(s) => s,
        other => panic!("{other:?}"),
    }
}

/// Current99 as `justitia status` reports it after `samples` probes under SCHED_FIFO.
fn probe_p99_with_latency(latency_us: u64, samples: u64) -> u64 {
    let (d, _flow) = probing_daemon(latency_us, samples, true);
    let s = status(&d);
    assert_eq!(s.probes_lost, 0, "{s:?}");
    s.current_p99_ns.unwrap()
}

#[test]
fn the_reported_probe_p99_is_the_probe_latency_within_scheduling_noise() {
    // A completion is stamped with the time it happened, not the time the loop collects
    // it (the synthetic probe's on the wake-up after it, up to a RefPeriod later):
    // Current99 within 20 % of the probe's latency plus 50 us. Each latency gets five
    // attempts of 1500 probes, as the probe is posted late when other processes hold
    // both cores.
    for latency_us in [20u64, 300] {
        let (lo, hi) = (latency_us * 800, latency_us * 1200 + 50_000);
        let mut readings = Vec::new();
        for _ in 0..5 {
            let p99 = probe_p99_with_latency(latency_us, 1500);
            readings.push(p99);
            if (lo..=hi).contains(&p99) {
                break;
            }
        }
        println!("synthetic {latency_us} us probes: Current99 readings {readings:?} ns");
        assert!(
            readings.iter().any(|p| (lo..=hi).contains(p)),
            "synthetic {latency_us} us probes: Current99 {readings:?} ns, all outside {lo}..={hi}"
        );
    }
}

#[test]
fn most_probes_are_seen_without_timer_slack_under_the_normal_policy() {
    // Under SCHED_OTHER the daemon is woken late on a busy machine, but a probe's latency
    // is its own: the median of 20 us probes must sit under 64 us (a bucket of the probe
    // histogram), where a loop that measured to the wake-up that collected it would put
    // it near a RefPeriod.
    let (d, _flow) = probing_daemon(20, 1500, false);
    let s = d.scrape();
    let probes = s
        .samples
        .iter()
        .find(|x| x.metric == "justitia_probe_latency_seconds")
        .expect("histogram");
    let prometheus_parse::Value::Histogram(buckets) = &probes.value else {
        panic!("{:?}", probes.value)
    };
    let count = |le: f64| {
        buckets
            .iter()
            .find(|b| (b.less_than - le).abs() < le * 1e-6)
            .map(|b| b.count)
            .unwrap()
    };
    let total = buckets.last().unwrap().count;
    let fast = count(64e-6) / total;
    println!("{:.1} % of {total} probes seen within 64 us", fast * 100.0);
    assert!(fast >= 0.5, "{:.1} % of {total} within 64 us", fast * 100.0);
}

/// The main thread's voluntary context switches: one per sleep in epoll.
fn voluntary_switches(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn the_daemon_wakes_once_per_refperiod_while_probing() {
    // The probe is posted on the update's wake-up and its completion collected on the
    // next: one sleep per RefPeriod, where waking for each completion makes two. A count
    // of sleeps per probe, not a time: 1.5 separates the two designs with room for the
    // admin requests and any wake-up a signal or the heartbeat adds.
    let (d, _flow) = probing_daemon(20, 200, true);
    let pid = d.child.id();
    let (s0, p0) = (voluntary_switches(pid), status(&d).probes);
    std::thread::sleep(Duration::from_secs(1));
    let (s1, p1) = (voluntary_switches(pid), status(&d).probes);
    let per_probe = (s1 - s0) as f64 / (p1 - p0) as f64;
    println!("{} sleeps for {} probes", s1 - s0, p1 - p0);
    assert!(p1 - p0 > 100, "{} probes in 1 s", p1 - p0);
    assert!(per_probe < 1.5, "{per_probe:.2} sleeps per probe");
}
