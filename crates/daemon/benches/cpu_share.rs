//! Benchmark: justitiad's CPU share at steady state with 1, 10 and 100 registered flows.
//!
//! Run with `cargo bench -p justitia-daemon --bench cpu_share`. It prints a table; it
//! asserts nothing about time (a benchmark, not a test).
//!
//! Each row starts its own daemon with the synthetic probe (20 us, no RDMA device
//! needed) and the packaged defaults (RefPeriod 0.5 ms, `stale_after_ms = 5`), and
//! registers the flows over one connection. Two sets of rows:
//! - with a latency flow: one latency flow, so the reference flow runs every RefPeriod,
//!   and the rest bandwidth flows, half of them active;
//! - without one: bandwidth and throughput flows alternately, half of them active (the
//!   one flow of the first row is): no probe runs and the loop is quiet (10 RefPeriods
//!   between updates), so the daemon wakes for the heartbeat, every third of
//!   `stale_after_ms`, which comes first.
//!
//! After 0.5 s to settle each row measures 5 s:
//! - CPU: the daemon's own getrusage figure (user + system, every thread), read from its
//!   metrics endpoint at the start and the end;
//! - wake-ups: the main thread's voluntary context switches (each sleep in epoll is one);
//! - probes: the reference flow's completed probes, from `justitia status` (one per
//!   update while a latency flow is counted).
//!
//! The last rows are the floor any sleeping loop pays on the machine at hand: a loop that
//! does nothing but sleep on an absolute timerfd through epoll, once per RefPeriod, once
//! per heartbeat interval and once per quiet period (on a virtual machine most of its
//! cost is the hypervisor's timer and idle exits).

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
    println!(
        "justitiad at steady state, synthetic 20 us probe, RefPeriod 0.5 ms, stale_after 5 ms, {window:?} each"
    );
    println!(
        "{:>22} | {:>12} | {:>10} | {:>8} | {:>13}",
        "flows", "CPU (% core)", "wake-ups/s", "probes/s", "CPU/wake (us)"
    );
    for latency in [true, false] {
        for n in [1usize, 10, 100] {
            row(n, latency, window);
        }
    }
    for (what, period) in [
        ("bare, per RefPeriod", Duration::from_micros(500)),
        // The heartbeat: a third of the packaged stale_after_ms = 5.
        ("bare, per heartbeat", Duration::from_nanos(5_000_000 / 3)),
        ("bare, per quiet period", Duration::from_millis(5)),
    ] {
        let wakes = (window.as_nanos() / period.as_nanos()) as u32;
        let (per_wake, share) = bare_loop(period, wakes);
        println!(
            "{what:>22} | {:>12.2} | {:>10.0} | {:>8} | {:>13.1}",
            share * 100.0,
            1.0 / period.as_secs_f64(),
            "-",
            per_wake.as_secs_f64() * 1e6
        );
    }
}

/// One row: a daemon with `n` flows, the first a latency flow if `latency`.
fn row(n: usize, latency: bool, window: Duration) {
    let d = Daemon::start_with("stale_after_ms = 5", true);
    let mut c = AgentClient::connect(d.socket()).unwrap();
    for i in 0..n {
        let class = match (latency, i) {
            (true, 0) => FlowClass::Latency,
            (true, _) => FlowClass::Bandwidth,
            (false, i) if i % 2 == 0 => FlowClass::Bandwidth,
            (false, _) => FlowClass::Throughput,
        };
        let h = c.register(class, 1, 0);
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
    let what = if latency {
        format!("{n}, one latency")
    } else {
        format!("{n}, no latency")
    };
    println!(
        "{what:>22} | {:>12.2} | {:>10.0} | {:>8.0} | {:>13.1}",
        (c1 - c0) / secs * 100.0,
        wakes / secs,
        (p1 - p0) as f64 / secs,
        (c1 - c0) / wakes * 1e6
    );
}
