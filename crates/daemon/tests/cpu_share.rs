//! Benchmark (run with `cargo test -p justitia-daemon --release --test cpu_share -- --ignored --nocapture`):
//! the daemon's CPU share at steady state with 1, 10 and 100 registered flows, half of
//! them active bandwidth flows and a latency flow present so that the reference flow
//! runs every RefPeriod (0.5 ms). CPU time is the daemon process's utime + stime from
//! /proc over 3 s. Target: under 2 % of one core.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use justitia_agent::client::{AgentClient, FlowState};
use justitia_core::flow::FlowClass;

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime) are 12 and 13 after the command name.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
#[ignore = "benchmark: prints figures"]
fn daemon_cpu_share_with_1_10_100_flows() {
    let hz = 100.0; // USER_HZ on Linux
    for n in [1usize, 10, 100] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.toml");
        std::fs::write(
            &path,
            format!(
                "probe = \"synthetic\"\nsocket = \"{0}/j.sock\"\nadmin_socket = \"{0}/a.sock\"\nmetrics = \"\"\nstale_after_ms = 500\n",
                dir.path().display()
            ),
        )
        .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_justitiad"))
            .arg("--config")
            .arg(&path)
            .spawn()
            .unwrap();
        let sock = dir.path().join("j.sock");
        let start = Instant::now();
        let mut c = loop {
            if let Ok(c) = AgentClient::connect(&sock) {
                break c;
            }
            assert!(start.elapsed() < Duration::from_secs(20));
            std::thread::sleep(Duration::from_millis(10));
        };
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
        let t0 = (Instant::now(), cpu_ticks(child.id()));
        std::thread::sleep(Duration::from_secs(3));
        let t1 = (Instant::now(), cpu_ticks(child.id()));
        let share = (t1.1 - t0.1) as f64 / hz / (t1.0 - t0.0).as_secs_f64();
        println!(
            "justitiad CPU share with {n:>3} registered flows: {:.2} % of one core",
            share * 100.0
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(share < 0.10, "{share}");
    }
}
