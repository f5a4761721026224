//! Benchmark (run with `cargo test -p justitia-daemon --release --test cpu_share -- --ignored --nocapture`):
//! the daemon's CPU share at steady state with 1, 10 and 100 registered flows, half of
//! them active bandwidth flows and a latency flow present so that the reference flow
//! runs every RefPeriod (0.5 ms), with the synthetic 20 us probe: two wake-ups per
//! RefPeriod, one for the update and one for the probe's completion. CPU time is the
//! daemon's own getrusage figure (microseconds), read from its metrics endpoint at the
//! start and end of 5 s; wake-ups are the main thread's voluntary context switches.
//!
//! The figure to compare is the CPU a wake-up costs: next to the daemon's, the benchmark
//! measures a loop that does nothing but sleep on an absolute timerfd through epoll at
//! the same rate, which is the floor any sleeping loop pays on the machine at hand (on a
//! virtual machine most of it is the hypervisor's timer and idle exits).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::{metric, Daemon};
use justitia_agent::client::{AgentClient, FlowState};
use justitia_core::flow::FlowClass;

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

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// CPU per wake-up of a bare loop sleeping `wakes` times `period` apart on an absolute
/// timerfd through epoll, and its share of one core.
fn bare_loop(period: Duration, wakes: u32) -> (Duration, f64) {
    use rustix::event::epoll;
    use rustix::time::*;
    let ep = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    let tfd = timerfd_create(TimerfdClockId::Monotonic, TimerfdFlags::NONBLOCK).unwrap();
    epoll::add(
        &ep,
        tfd.as_fd(),
        epoll::EventData::new_u64(0),
        epoll::EventFlags::IN,
    )
    .unwrap();
    let now = clock_gettime(ClockId::Monotonic);
    let mut t = now.tv_sec as u128 * 1_000_000_000 + now.tv_nsec as u128;
    let mut events = [epoll::Event {
        flags: epoll::EventFlags::empty(),
        data: epoll::EventData::new_u64(0),
    }; 4];
    let (c0, w0) = (thread_cpu(), Instant::now());
    for _ in 0..wakes {
        t += period.as_nanos();
        let spec = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: Timespec {
                tv_sec: (t / 1_000_000_000) as i64,
                tv_nsec: (t % 1_000_000_000) as _,
            },
        };
        timerfd_settime(&tfd, TimerfdTimerFlags::ABSTIME, &spec).unwrap();
        epoll::wait(&ep, &mut events[..], None).unwrap();
    }
    let cpu = thread_cpu() - c0;
    (cpu / wakes, cpu.as_secs_f64() / w0.elapsed().as_secs_f64())
}

#[test]
#[ignore = "benchmark: prints figures"]
fn daemon_cpu_share_with_1_10_100_flows() {
    let window = Duration::from_secs(5);
    for n in [1usize, 10, 100] {
        let d = Daemon::start_with("", true);
        let mut c = AgentClient::connect(d.socket()).unwrap();
        let l = c.register(FlowClass::Latency, 1, 0);
        c.wait_registered(l, Duration::from_secs(2));
        c.report_usage(l, true, 16, 1);
        for i in 1..n {
            let h = c.register(FlowClass::Bandwidth, 1, 0);
            assert!(matches!(
                c.wait_registered(h, Duration::from_secs(2)),
                FlowState::Registered { .. }
            ));
            c.report_usage(h, i % 2 == 0, 1 << 20, 1);
        }
        std::thread::sleep(Duration::from_millis(500));
        let cpu = || metric(&d.scrape(), "justitia_process_cpu_seconds", None).unwrap();
        let pid = d.child.id();
        let (t0, c0, s0) = (Instant::now(), cpu(), voluntary_switches(pid));
        std::thread::sleep(window);
        let (t1, c1, s1) = (Instant::now(), cpu(), voluntary_switches(pid));
        let secs = (t1 - t0).as_secs_f64();
        let share = (c1 - c0) / secs;
        let wakes = (s1 - s0) as f64 / secs;
        println!(
            "justitiad with {n:>3} registered flows: {:.2} % of one core, {wakes:.0} wake-ups/s, {:.1} us of CPU per wake-up",
            share * 100.0,
            (c1 - c0) / (s1 - s0) as f64 * 1e6
        );
        assert!(share < 0.25, "{share}");
    }
    // The same number of wake-ups per second with no work at all.
    let (per_wake, share) = bare_loop(Duration::from_micros(250), 20_000);
    println!(
        "bare timerfd + epoll loop at 4000 wake-ups/s: {:.2} % of one core, {:.1} us of CPU per wake-up",
        share * 100.0,
        per_wake.as_secs_f64() * 1e6
    );
}
