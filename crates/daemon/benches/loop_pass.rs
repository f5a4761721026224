//! Benchmark: the time one pass of justitiad's loop takes under a message flood, with 1,
//! 64 and 1024 connections.
//!
//! Run with `cargo bench -p justitia-daemon --bench loop_pass`. It prints a table; it
//! asserts nothing about time (a benchmark, not a test).
//!
//! The daemon runs in this process (the synthetic probe, the packaged defaults:
//! `stale_after_ms = 5`, so a pass serves sockets for at most 1 ms) with 1024 bandwidth
//! flows registered over the row's connections. Before every pass each connection queues
//! 64 usage reports (what it can of them without blocking); the pass is then timed from
//! its wake-up to its end (serving the sockets, the control loop's update, the
//! heartbeat), on the wall clock and as the thread's CPU time (the wall figure includes
//! any time the thread was descheduled, which on a shared machine dominates the tail).
//! Without the pass budget a pass would serve every queued message: 65536 of them with
//! 1024 connections. The heartbeat is written at the start and the end of each pass, so
//! its gap is at most the pass time plus the wait before it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use justitia_agent::proto::{Register, Reply, Request, Usage};
use justitia_core::flow::FlowClass;
use justitia_daemon::config::{Config, ProbeKind};
use justitia_daemon::metrics::Metrics;
use justitia_daemon::probe::SyntheticProbe;
use justitia_daemon::server::Daemon;
use rustix::net::{RecvFlags, SendFlags};

const FLOWS: usize = 1024;
const MESSAGES: usize = 64;
const PASSES: usize = 400;

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn connect(path: &std::path::Path) -> OwnedFd {
    use rustix::net::*;
    let s = socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .unwrap();
    connect(&s, &SocketAddrUnix::new(path).unwrap()).unwrap();
    s
}

/// Runs passes until `done` says so (at most 10 s).
fn pump(d: &mut Daemon, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < end, "the daemon did not answer");
        let ready = d.wait();
        d.turn(ready);
    }
}

fn row(connections: usize) {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        probe: ProbeKind::Synthetic(Duration::from_micros(20)),
        socket: dir.path().join("j.sock"),
        admin_socket: dir.path().join("a.sock"),
        metrics: None,
        max_flows_per_tenant: FLOWS,
        max_connections_per_tenant: 4096,
        // One tenant holds all the flows: they must fit the open part of the table.
        slots: 2 * FLOWS as u32,
        ..Config::default()
    };
    let mut d = Daemon::new(
        config.clone(),
        None,
        Box::new(SyntheticProbe::new(Duration::from_micros(20))),
        Metrics::new(),
    )
    .unwrap();
    // Connected in batches the listen queue (128) holds, accepted in between.
    let mut socks: Vec<OwnedFd> = Vec::with_capacity(connections);
    while socks.len() < connections {
        let batch = (connections - socks.len()).min(64);
        socks.extend((0..batch).map(|_| connect(&config.socket)));
        let ready = d.wait();
        d.turn(ready);
    }
    let mut buf = [0u8; 256];
    // Greetings, then the registrations: the flows spread over the connections.
    let mut greeted = vec![false; connections];
    pump(&mut d, || {
        for (i, s) in socks.iter().enumerate() {
            if !greeted[i] && rustix::net::recv(s, &mut buf, RecvFlags::DONTWAIT).is_ok() {
                greeted[i] = true;
            }
        }
        greeted.iter().all(|&g| g)
    });
    let uid = rustix::process::getuid().as_raw();
    let mut flows: Vec<Vec<u64>> = vec![Vec::new(); connections];
    let per = FLOWS.div_ceil(connections);
    let mut sent = vec![0usize; connections];
    let mut answered = 0;
    let end = Instant::now() + Duration::from_secs(20);
    while answered < FLOWS {
        assert!(Instant::now() < end, "registrations not answered");
        let mut left = FLOWS - sent.iter().sum::<usize>();
        for (i, s) in socks.iter().enumerate() {
            // A few in flight per connection, so that every answer fits its queue.
            while left > 0 && sent[i] < per && sent[i] - flows[i].len() < 16 {
                let r = Request::Register(Register {
                    client_ref: i as u64,
                    class: FlowClass::Bandwidth,
                    qps: 1,
                    demand_bytes_per_sec: 0,
                    claimed_uid: uid,
                });
                if rustix::net::send(s, &r.encode(), SendFlags::DONTWAIT).is_err() {
                    break;
                }
                sent[i] += 1;
                left -= 1;
            }
        }
        let ready = d.wait();
        d.turn(ready);
        for (i, s) in socks.iter().enumerate() {
            while let Ok((n, _)) = rustix::net::recv(s, &mut buf, RecvFlags::DONTWAIT) {
                answered += 1;
                match Reply::parse(&buf[..n]) {
                    Ok(Reply::Registered { flow, .. }) => flows[i].push(flow),
                    other => panic!("registration answered {other:?}"),
                }
            }
        }
    }
    let registered: usize = flows.iter().map(Vec::len).sum();
    let mut times = Vec::with_capacity(PASSES);
    let mut cpu = Vec::with_capacity(PASSES);
    let mut queued = 0u64;
    for pass in 0..PASSES {
        for (i, s) in socks.iter().enumerate() {
            let Some(&flow) = flows[i].first() else {
                continue;
            };
            for m in 0..MESSAGES {
                let u = Request::Usage(Usage {
                    flow,
                    active: (pass + m) % 2 == 0,
                    bytes: 1,
                    ops: 1,
                });
                if rustix::net::send(s, &u.encode(), SendFlags::DONTWAIT).is_err() {
                    break;
                }
                queued += 1;
            }
        }
        let ready = d.wait();
        let t = Instant::now();
        let c = thread_cpu();
        d.turn(ready);
        times.push(t.elapsed());
        cpu.push(thread_cpu() - c);
    }
    let q = |v: &mut Vec<Duration>, p: f64| {
        v.sort();
        v[((v.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e3
    };
    let mean = times.iter().map(Duration::as_secs_f64).sum::<f64>() / times.len() as f64 * 1e3;
    println!(
        "{connections:>11} {registered:>6} {:>12.0} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>10.3} {:>10.3}",
        queued as f64 / PASSES as f64,
        mean,
        q(&mut times, 0.5),
        q(&mut times, 0.99),
        q(&mut times, 1.0),
        q(&mut cpu, 0.99),
        q(&mut cpu, 1.0),
    );
}

fn main() {
    // 1024 connections need 1024 descriptors here and 2048 in the daemon.
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: hard,
            maximum: hard,
        },
    )
    .unwrap();
    println!("loop pass time under a flood of usage reports ({MESSAGES} per connection per pass), {FLOWS} flows, {PASSES} passes; pass budget 1 ms (stale_after_ms 5)");
    println!("wall: from wake-up to the pass's end (includes time the thread was descheduled); cpu: the thread's own CPU time in the pass");
    println!("connections  flows  queued/pass  mean ms   p50 ms   p99 ms   max ms  p99 cpu ms max cpu ms");
    for c in [1, 64, 1024] {
        row(c);
    }
}
