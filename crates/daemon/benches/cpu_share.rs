//! Benchmark: justitiad's CPU share at steady state with 1, 10 and 100 registered flows.
//!
//! Run with `cargo bench -p justitia-daemon --bench cpu_share`. It prints a table; it
//! asserts nothing about time (a benchmark, not a test).
//!
//! Each row starts its own daemon with the synthetic probe (20 us, no RDMA device
//! needed) and registers the flows over one connection: a latency flow, so the reference
//! flow runs every RefPeriod (0.5 ms), and the rest bandwidth flows, half of them
//! active. After 0.5 s to settle it measures 5 s:
//! - CPU: the daemon's own getrusage figure (user + system, every thread), read from its
//!   metrics endpoint at the start and the end;
//! - wake-ups: the main thread's voluntary context switches (each sleep in epoll is one);
//! - updates: the control loop's updates, from the probes counted in `justitia status`.
//!
//! The last row is the floor any sleeping loop pays on the machine at hand: a loop that
//! does nothing but sleep on an absolute timerfd through epoll, once per RefPeriod (on a
//! virtual machine most of its cost is the hypervisor's timer and idle exits).

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::{metric, Daemon};
use justitia_agent::admin::{AdminReply, AdminRequest};
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

fn probes(d: &Daemon) -> u64 {
    match d.admin(&AdminRequest::Status) {
        AdminReply::Status(s) => s.probes,
        other => panic!("{other:?}"),
    }
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

fn main() {
    // `cargo bench` passes `--bench`; a filter or `--list` is not meaningful here.
    if std::env::args().any(|a| a == "--list") {
        println!("cpu_share: benchmark");
        return;
    }
    let window = Duration::from_secs(5);
    println!("justitiad at steady state, synthetic 20 us probe, RefPeriod 0.5 ms, {window:?} each");
    println!(
        "{:>6} | {:>14} | {:>10} | {:>9} | {:>14}",
        "flows", "CPU (% core)", "wake-ups/s", "updates/s", "CPU/wake (us)"
    );
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
        let (t0, c0, s0, p0) = (Instant::now(), cpu(), voluntary_switches(pid), probes(&d));
        std::thread::sleep(window);
        let (t1, c1, s1, p1) = (Instant::now(), cpu(), voluntary_switches(pid), probes(&d));
        let secs = (t1 - t0).as_secs_f64();
        let wakes = (s1 - s0) as f64;
        println!(
            "{n:>6} | {:>14.2} | {:>10.0} | {:>9.0} | {:>14.1}",
            (c1 - c0) / secs * 100.0,
            wakes / secs,
            (p1 - p0) as f64 / secs,
            (c1 - c0) / wakes * 1e6
        );
    }
    let (per_wake, share) = bare_loop(Duration::from_micros(500), 10_000);
    println!(
        "{:>6} | {:>14.2} | {:>10.0} | {:>9} | {:>14.1}",
        "bare",
        share * 100.0,
        2000,
        "-",
        per_wake.as_secs_f64() * 1e6
    );
}
