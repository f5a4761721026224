//! The attack suite: every row of the table of what a hostile local user did to
//! `justitiad`, done again against a daemon started from `packaging/justitiad.toml` with
//! `probe = "synthetic"`, a soft descriptor limit of 1024 (systemd's default) and the
//! unit's SCHED_FIFO priority 1, by unprivileged uids (65534, 2001-2004) through
//! `tests/attack/tenant.py`. Acting as another uid needs root: those tests are ignored
//! otherwise and run as root by `scripts/test.sh`
//! (`cargo test -p justitia-daemon --test attacks -- --ignored --test-threads=1`).
//!
//! Each asserts that a well-behaved shaper (run as root, a process of its own with uid
//! [`WELL_BEHAVED_UID`]; else this process) registers and gets an allotment within
//! [`SERVED_WITHIN`] while the attack runs, and again after it stops,
//! and the bounds of its row: the heartbeat gap under the stale limit (5 ms), CPU time,
//! log size, RSS, descriptors, threads. `JUSTITIAD_BIN` runs them against another build.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia_agent::admin::{AdminReply, AdminRequest};
use justitia_agent::block::monotonic_ns;
use justitia_agent::client::{AgentClient, FlowState};
use justitia_agent::proto::{Register, Request, Usage};
use justitia_core::flow::FlowClass;

use common::{eventually, free_port, metric, parse_scrape};

/// How soon a well-behaved shaper must be registered and allotted, attack or not.
const SERVED_WITHIN: Duration = Duration::from_secs(2);
/// The packaged staleness limit.
const STALE_LIMIT: Duration = Duration::from_millis(5);

struct Hostile {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
}

impl Hostile {
    /// A daemon from the packaged configuration with the synthetic probe, `edits`
    /// applied to its text, sockets in a temporary directory open to other uids.
    fn start(edits: &[(&str, &str)], port: u16) -> Hostile {
        Self::start_notifying(edits, port, None)
    }

    /// As [`Hostile::start`], with systemd's notification socket at `notify` and a
    /// 200 ms watchdog, as the unit's `Type=notify` and `WatchdogSec=` set them.
    fn start_notifying(
        edits: &[(&str, &str)],
        port: u16,
        notify: Option<&std::path::Path>,
    ) -> Hostile {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let mut text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../packaging/justitiad.toml"
        ))
        .unwrap();
        let d = dir.path().display();
        for (from, to) in [
            ("probe = \"verbs\"", "probe = \"synthetic\""),
            (
                "socket = \"/run/justitia/justitiad.sock\"",
                &format!("socket = \"{d}/j.sock\""),
            ),
            (
                "admin_socket = \"/run/justitia/justitiad-admin.sock\"",
                &format!("admin_socket = \"{d}/a.sock\""),
            ),
            (
                "metrics = \"127.0.0.1:9464\"",
                &format!("metrics = \"127.0.0.1:{port}\""),
            ),
        ]
        .iter()
        .copied()
        .chain(edits.iter().copied())
        {
            assert!(text.contains(from), "{from} not in the packaged config");
            text = text.replace(from, to);
        }
        let path = dir.path().join("justitiad.toml");
        std::fs::write(&path, text).unwrap();
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        // Another build (to see an assertion fail against it) runs under the normal
        // policy: a daemon spinning at SCHED_FIFO would take a core from everyone.
        let other = std::env::var("JUSTITIAD_BIN").ok();
        let fifo = other.is_none();
        let bin = other.unwrap_or_else(|| env!("CARGO_BIN_EXE_justitiad").to_string());
        let mut cmd = match notify {
            // WATCHDOG_PID must be the daemon's own pid: the shell's, kept by exec.
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg("WATCHDOG_PID=$$ exec \"$0\" \"$@\"")
                    .arg(bin)
                    .env("NOTIFY_SOCKET", n)
                    .env("WATCHDOG_USEC", "200000");
                c
            }
            None => Command::new(bin),
        };
        cmd.arg("--config").arg(&path).stderr(log);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: 1024,
                    rlim_max: 1024,
                };
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
                let p = libc::sched_param { sched_priority: 1 };
                // As the unit runs it; where not permitted it runs under the normal policy.
                if fifo {
                    libc::sched_setscheduler(0, libc::SCHED_FIFO, &p);
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        let h = Hostile { child, dir, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        while AgentClient::connect(h.socket()).is_err() {
            assert!(
                Instant::now() < deadline,
                "daemon did not start: {}",
                h.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        h
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("j.sock")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    fn log_bytes(&self) -> u64 {
        std::fs::metadata(self.dir.path().join("log")).map_or(0, |m| m.len())
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// (RSS in kB, threads) of the daemon.
    fn status(&self) -> (u64, u64) {
        let text = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("Threads:"))
    }

    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// User + system CPU seconds of the daemon.
    fn cpu_seconds(&self) -> f64 {
        let text = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        let after = &text[text.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = after.split_whitespace().collect();
        let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
        ticks / 100.0
    }

    fn admin(&self, req: &AdminRequest) -> AdminReply {
        let mut s =
            std::os::unix::net::UnixStream::connect(self.dir.path().join("a.sock")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut line = serde_json::to_string(req).unwrap();
        line.push('\n');
        s.write_all(line.as_bytes()).unwrap();
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap()
    }

    fn scrape(&self) -> Option<prometheus_parse::Scrape> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut s, &mut text).ok()?;
        text.contains("\r\n\r\n").then(|| parse_scrape(&text))
    }

    /// A well-behaved shaper: registers a flow of `class`, reports work (a resource-hungry
    /// flow), and must hold an allotment within [`SERVED_WITHIN`]. Returns how long it took.
    /// Run as root, it is a process of its own with [`WELL_BEHAVED_UID`], so it has no
    /// privilege the attackers lack; otherwise it runs in this process, as this user.
    fn shaper_served(&self, class: FlowClass) -> Duration {
        if rustix::process::geteuid().is_root() {
            served_as(WELL_BEHAVED_UID, || self.shaper_served_here(class))
        } else {
            self.shaper_served_here(class)
        }
    }

    fn shaper_served_here(&self, class: FlowClass) -> Duration {
        let start = Instant::now();
        let mut c = AgentClient::connect(self.socket())
            .unwrap_or_else(|e| panic!("shaper not connected: {e}; {}", tail(&self.log())));
        let h = c.register(class, 1, 0);
        let state = c.wait_registered(h, SERVED_WITHIN);
        assert!(
            matches!(state, FlowState::Registered { .. }),
            "shaper's {class} flow: {state:?} after {:?}",
            start.elapsed()
        );
        if class.is_resource_hungry() {
            c.report_usage(h, true, 4096, 1);
            while c.allotment(h).is_none() {
                assert!(
                    start.elapsed() < SERVED_WITHIN,
                    "no allotment within {SERVED_WITHIN:?}"
                );
                c.tick(monotonic_ns());
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        start.elapsed()
    }
}

/// The uid of the well-behaved shaper: none of the attackers' (65534, 2001-2004), so no
/// per-uid cap an attacker reaches is also its own.
const WELL_BEHAVED_UID: u32 = 3001;

/// Runs `shaper` in a child process of `uid` (no supplementary groups) and returns what it
/// returned; panics with the child's message if it failed, or if it is not done within
/// twice [`SERVED_WITHIN`] (it is then killed).
fn served_as(uid: u32, shaper: impl FnOnce() -> Duration) -> Duration {
    let (mut read, mut write) = std::io::pipe().unwrap();
    // SAFETY: the child only drops privileges, runs the shaper (a client of its own, no
    // lock shared with this process's other threads, which the tests do not start while a
    // shaper runs), writes one message and leaves with `_exit`, running no destructor and
    // no at-exit handler of the parent's.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        drop(read);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: plain system calls; dropping supplementary groups, then gid, then uid.
            let dropped = unsafe {
                libc::setgroups(0, std::ptr::null()) == 0
                    && libc::setgid(uid) == 0
                    && libc::setuid(uid) == 0
            };
            assert!(
                dropped,
                "privileges not dropped: {}",
                std::io::Error::last_os_error()
            );
            shaper()
        }));
        let message = match &outcome {
            Ok(took) => format!("ok {}", took.as_nanos()),
            Err(p) => format!(
                "failed {}",
                p.downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| p.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)")
            ),
        };
        let _ = write.write_all(message.as_bytes());
        // SAFETY: leaves the child at once, as a forked child of a threaded process must.
        unsafe { libc::_exit(0) };
    }
    drop(write);
    let mut fds = [rustix::event::PollFd::new(
        &read,
        rustix::event::PollFlags::IN,
    )];
    let limit = rustix::time::Timespec {
        tv_sec: (2 * SERVED_WITHIN).as_secs() as i64,
        tv_nsec: 0,
    };
    let ready = rustix::event::poll(&mut fds, Some(&limit)).unwrap_or(0);
    let mut message = vec![0u8; 4096];
    let n = if ready > 0 {
        std::io::Read::read(&mut read, &mut message).unwrap_or(0)
    } else {
        // SAFETY: our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        0
    };
    let mut status = 0;
    // SAFETY: reaps our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let message = String::from_utf8_lossy(&message[..n]).into_owned();
    match message.strip_prefix("ok ") {
        Some(ns) => Duration::from_nanos(ns.parse().unwrap()),
        None if n == 0 => panic!(
            "the shaper of uid {uid} said nothing within {:?}",
            2 * SERVED_WITHIN
        ),
        None => panic!("the shaper of uid {uid}: {message}"),
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// A hostile tenant: `tenant.py` under `uid`, after it printed its first line.
struct Tenant {
    child: Child,
    said: String,
}

impl Tenant {
    fn run(uid: u32, args: &[&str]) -> Tenant {
        let mut child = Command::new("python3")
            .arg(common::tenant_script())
            .args(args)
            .uid(uid)
            .gid(uid)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut said = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut said)
            .unwrap();
        assert!(!said.is_empty(), "tenant {args:?} said nothing");
        Tenant { child, said }
    }

    /// As [`Tenant::run`], the process first moved into the cgroup whose `cgroup.procs`
    /// is `procs` (as root, before it takes `uid`).
    fn run_in(procs: &std::path::Path, uid: u32, args: &[&str]) -> Tenant {
        let mut cmd = Command::new("python3");
        cmd.arg(common::tenant_script())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        // Command's own `uid` would drop privileges before this runs, and an unprivileged
        // process cannot move itself between cgroups.
        join_cgroup_before_exec(&mut cmd, procs, Some(uid));
        let mut child = cmd.spawn().unwrap();
        let mut said = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut said)
            .unwrap();
        assert!(!said.is_empty(), "tenant {args:?} said nothing");
        Tenant { child, said }
    }

    fn count(&self, word: &str) -> usize {
        let w: Vec<&str> = self.said.split_whitespace().collect();
        w.iter()
            .position(|x| *x == word)
            .and_then(|i| w.get(i + 1)?.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Makes `cmd`'s process move itself into the cgroup whose `cgroup.procs` is `procs`
/// between fork and exec, as root, then take `uid` (no supplementary groups) if given.
fn join_cgroup_before_exec(cmd: &mut Command, procs: &std::path::Path, uid: Option<u32>) {
    let procs = std::ffi::CString::new(procs.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: only async-signal-safe calls between fork and exec: open, write, close,
    // then dropping groups, gid and uid.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
            if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(fd);
            if let Some(uid) = uid {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(uid) != 0
                    || libc::setuid(uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

fn hex(msg: &[u8]) -> String {
    msg.iter().map(|b| format!("{b:02x}")).collect()
}

fn register_hex(uid: u32, class: FlowClass) -> String {
    hex(&Request::Register(Register {
        client_ref: 1,
        class,
        qps: 1,
        demand_bytes_per_sec: 0,
        claimed_uid: uid,
    })
    .encode())
}

/// Uids 2001-2004, each registering 256 bandwidth flows on `sock` (its cap), as the rows
/// that crowd the slot table and flood the loop both start.
fn four_uids_registering_256_flows(sock: &std::path::Path) -> Vec<Tenant> {
    (2001..=2004)
        .map(|uid| {
            Tenant::run(
                uid,
                &[
                    "register",
                    sock.to_str().unwrap(),
                    "256",
                    &register_hex(uid, FlowClass::Bandwidth),
                ],
            )
        })
        .collect()
}

/// The longest the daemon's heartbeat is seen old, sampled every 100 us for `span`.
fn heartbeat_gap(socket: &std::path::Path, span: Duration) -> Duration {
    let c = AgentClient::connect(socket).unwrap();
    let end = Instant::now() + span;
    let mut worst = 0;
    while Instant::now() < end {
        let now = monotonic_ns();
        worst = worst.max(now.saturating_sub(c.heartbeat_ns().unwrap()));
        std::thread::sleep(Duration::from_micros(100));
    }
    Duration::from_nanos(worst)
}

/// Row 1: 2000 connections held. Before: 506 accepted, then EMFILE and a spinning loop
/// (3 M log lines in 35 s), new shapers timed out.
#[test]
#[ignore = "needs root: acts as uids 65534 and 2001-2004"]
fn two_thousand_held_connections_neither_spin_the_loop_nor_lock_out_shapers() {
    let d = Hostile::start(&[], free_port());
    let sock = d.socket();
    let holders: Vec<Tenant> = (2001..=2004)
        .chain([65534])
        .map(|uid| Tenant::run(uid, &["hold", sock.to_str().unwrap(), "2000"]))
        .collect();
    let cpu0 = d.cpu_seconds();
    let log0 = d.log_bytes();
    std::thread::sleep(Duration::from_secs(1));
    let took = d.shaper_served(FlowClass::Bandwidth);
    let cpu = d.cpu_seconds() - cpu0;
    let logged = d.log_bytes() - log0;
    let fds = d.fds();
    let (rss, _) = d.status();
    println!(
        "held {:?}; shaper served in {took:?}; daemon {cpu:.2} CPU-s over ~1 s, {logged} B logged, {fds} fds, {rss} kB RSS",
        holders.iter().map(|t| t.count("held")).collect::<Vec<_>>()
    );
    assert!(cpu < 0.3, "the loop spins: {cpu} CPU-s in ~1 s");
    assert!(logged < 64 * 1024, "{logged} bytes logged in ~1 s");
    // Five uids of at most 64 connections each, two descriptors a connection.
    assert!(fds <= 5 * 64 * 2 + 64, "{fds} descriptors");
    assert!(rss < 64 * 1024, "{rss} kB");
    drop(holders);
    std::thread::sleep(Duration::from_millis(200));
    d.shaper_served(FlowClass::Bandwidth);
}

/// Rows 2 and 3: 507 idle metrics connections, then a 512 MiB request head line. Before:
/// 508 threads and 1022 descriptors, then a dead endpoint; RSS 4.8 -> 529 MB.
#[test]
#[ignore = "needs root: acts as uids 65534 and 2001-2004"]
fn the_metrics_endpoint_survives_idle_connections_and_a_huge_header() {
    let d = Hostile::start(&[], free_port());
    let addr = format!("127.0.0.1:{}", d.port);
    let idle = Tenant::run(65534, &["tcp-idle", &addr, "507"]);
    std::thread::sleep(Duration::from_millis(300));
    let (rss_idle, threads) = d.status();
    let fds = d.fds();
    println!(
        "{} idle metrics connections: {threads} threads, {fds} fds, {rss_idle} kB",
        idle.count("held")
    );
    assert!(threads <= 4, "{threads} threads");
    assert!(fds < 200, "{fds} descriptors");
    d.shaper_served(FlowClass::Bandwidth);
    drop(idle);
    eventually(
        "a scrape after the idle connections",
        Duration::from_secs(5),
        || d.scrape().is_some(),
    );
    let huge = Tenant::run(2001, &["tcp-header", &addr, "512"]);
    let (rss, _) = d.status();
    println!("{}; RSS {rss} kB", huge.said.trim());
    assert!(huge.count("sent") < 512, "the whole 512 MiB line was taken");
    assert!(rss < 64 * 1024, "RSS {rss} kB");
    drop(huge);
    d.shaper_served(FlowClass::Bandwidth);
    eventually(
        "a scrape after the huge header",
        Duration::from_secs(5),
        || d.scrape().is_some(),
    );
}

/// Row 4: the metrics port bound first by nobody. Before: the daemon refused to start.
#[test]
#[ignore = "needs root: acts as uids 65534 and 2001-2004"]
fn the_daemon_starts_with_its_metrics_port_taken_and_binds_it_once_free() {
    let port = free_port();
    let squatter = Tenant::run(65534, &["squat", &format!("127.0.0.1:{port}")]);
    assert!(squatter.said.contains("bound"));
    let d = Hostile::start(&[], port);
    d.shaper_served(FlowClass::Bandwidth);
    drop(squatter);
    eventually(
        "the endpoint bound by retry",
        Duration::from_secs(10),
        || {
            d.scrape()
                .is_some_and(|s| metric(&s, "justitia_safe_util_bytes_per_second", None).is_some())
        },
    );
}

/// Row 5: four uids registering 256 flows each. Before: every other tenant refused
/// `Full`, latency flows included.
#[test]
#[ignore = "needs root: acts as uids 65534 and 2001-2004"]
fn four_uids_at_their_cap_do_not_lock_out_a_fifth() {
    let d = Hostile::start(&[], free_port());
    let sock = d.socket();
    let hogs = four_uids_registering_256_flows(&sock);
    let held: usize = hogs.iter().map(|t| t.count("registered")).sum();
    println!("the four uids hold {held} flows");
    d.shaper_served(FlowClass::Latency);
    d.shaper_served(FlowClass::Bandwidth);
    drop(hogs);
    d.shaper_served(FlowClass::Bandwidth);
}

/// Row 7: 64 connections x 64 messages over 1024 flows' worth of registrations. Before:
/// 52.6 ms between heartbeats against a 5 ms stale limit.
#[test]
#[ignore = "needs root: acts as uids 65534 and 2001-2004"]
fn a_message_flood_keeps_the_heartbeat_under_the_stale_limit() {
    let d = Hostile::start(&[], free_port());
    let sock = d.socket();
    let hogs = four_uids_registering_256_flows(&sock);
    let usage = hex(&Request::Usage(Usage {
        flow: 1,
        active: true,
        bytes: 1,
        ops: 1,
    })
    .encode());
    let reg = register_hex(65534, FlowClass::Bandwidth);
    let unreg = hex(&Request::Unregister { flow: 1 }.encode());
    let mut msgs = vec!["flood", sock.to_str().unwrap(), "64"];
    let batch: Vec<String> = (0..64)
        .map(|i| match i % 3 {
            0 => reg.clone(),
            1 => unreg.clone(),
            _ => usage.clone(),
        })
        .collect();
    msgs.extend(batch.iter().map(String::as_str));
    let flood = Tenant::run(65534, &msgs);
    std::thread::sleep(Duration::from_millis(300));
    // The longest gap in a 2 s window. On two cores shared with the flood a single
    // descheduling of the daemon took one window past the limit (5.7 ms, where 1 to 2 ms
    // is usual), so a second window is measured then; the stall this guards against
    // (52.6 ms) spoils every window.
    let first = heartbeat_gap(&sock, Duration::from_secs(2));
    let gap = if first < STALE_LIMIT {
        first
    } else {
        heartbeat_gap(&sock, Duration::from_secs(2))
    };
    let log = d.log_bytes();
    println!(
        "{}; heartbeat gap {gap:?} (first window {first:?}; limit {STALE_LIMIT:?}); log {log} B",
        flood.said.trim()
    );
    assert!(gap < STALE_LIMIT, "heartbeat {gap:?} old under the flood");
    d.shaper_served(FlowClass::Bandwidth);
    drop(flood);
    drop(hogs);
    d.shaper_served(FlowClass::Bandwidth);
}

/// Row 8: an admin client sending one byte every 150 ms. Before: the heartbeat 3038 ms
/// old (the reads blocked the loop). Root is the admin; the loop must not wait on it.
#[test]
fn a_slow_admin_client_does_not_hold_the_loop() {
    // A limit a busy machine keeps without the real-time priority (this test needs no
    // root): the blocking reads held the loop for 1.5 to 3 s.
    let d = Hostile::start(
        &[("stale_after_ms = 5", "stale_after_ms = 500")],
        free_port(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let path = d.dir.path().join("a.sock");
    let s2 = stop.clone();
    let slow = std::thread::spawn(move || {
        let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
        let started = Instant::now();
        for b in b"{\"cmd\":\"status\"}\n".iter().cycle() {
            if s2.load(Ordering::Relaxed) || s.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(150));
        }
        started.elapsed()
    });
    let gap = heartbeat_gap(&d.socket(), Duration::from_millis(1500));
    let t = Instant::now();
    assert!(matches!(
        d.admin(&AdminRequest::Status),
        AdminReply::Status(_)
    ));
    let answered = t.elapsed();
    let cut = slow.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    println!("heartbeat gap {gap:?}; another admin answered in {answered:?}; slow client cut after {cut:?}");
    assert!(gap < Duration::from_millis(500), "heartbeat {gap:?} old");
    assert!(answered < Duration::from_millis(500));
    assert!(
        cut < Duration::from_secs(3),
        "the slow client was kept {cut:?}"
    );
    d.shaper_served(FlowClass::Bandwidth);
}

/// Row 9: `target = "150us"` and no latency flow: READY=1 must still come (it waited for
/// a probe that never runs, so systemd timed the start out), and WATCHDOG=1 pings follow.
#[test]
fn ready_comes_once_the_sockets_are_bound_and_the_watchdog_is_pinged() {
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify");
    let listener = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    listener
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let started = Instant::now();
    let d = Hostile::start_notifying(
        &[("target = \"2x\"", "target = \"150us\"")],
        0,
        Some(&notify),
    );
    let mut buf = [0u8; 256];
    let mut seen = Vec::new();
    while seen
        .iter()
        .filter(|m: &&String| m.contains("WATCHDOG=1"))
        .count()
        < 3
    {
        let n = listener
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("{e}: got {seen:?}; {}", tail(&d.log())));
        seen.push(String::from_utf8_lossy(&buf[..n]).to_string());
    }
    let ready_at = seen.iter().position(|m| m.contains("READY=1"));
    println!("{seen:?} within {:?}", started.elapsed());
    assert_eq!(ready_at, Some(0), "{seen:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Row 6: 300 register/unregister pairs from one process, each unregister sent before
/// the registration's answer. Before: 256 flows orphaned, the next registration refused
/// `TooManyFlows`.
#[test]
fn unregisters_before_the_answer_orphan_no_flow() {
    let d = Hostile::start(&[("stale_after_ms = 5", "stale_after_ms = 500")], 0);
    let mut c = AgentClient::connect(d.socket()).unwrap();
    for _ in 0..300 {
        let h = c.register(FlowClass::Bandwidth, 1, 0);
        c.unregister(h);
    }
    eventually(
        "no flow left in the daemon nor in the client's list",
        Duration::from_secs(5),
        || {
            c.tick(monotonic_ns());
            c.entries() == 0
                && matches!(d.admin(&AdminRequest::Status), AdminReply::Status(s) if s.flows == 0)
        },
    );
    let h = c.register(FlowClass::Bandwidth, 1, 0);
    assert!(matches!(
        c.wait_registered(h, SERVED_WITHIN),
        FlowState::Registered { .. }
    ));
}

/// The admin socket refuses a user who is neither root nor in the admin group, even when
/// the socket's mode lets them connect (a misconfigured directory, a copied socket).
#[test]
#[ignore = "needs root: acts as uids 65534 and 2001-2004"]
fn the_admin_socket_refuses_other_users() {
    let d = Hostile::start(&[], 0);
    let admin = d.dir.path().join("a.sock");
    std::fs::set_permissions(&admin, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let t = Tenant::run(65534, &["admin", admin.to_str().unwrap()]);
    let reply: AdminReply = serde_json::from_str(t.said.trim()).unwrap();
    assert!(
        matches!(&reply, AdminReply::Error(e) if e.contains("permission denied")),
        "{reply:?}"
    );
    assert!(matches!(
        d.admin(&AdminRequest::Status),
        AdminReply::Status(_)
    ));
}

/// A peer in a pid namespace the daemon cannot see has pid 0 in `SO_PEERCRED`: it is
/// served as its uid's tenant. Here the daemon runs in a pid namespace of its own
/// (`unshare --pid --fork`), so this process is such a peer, with `tenant = "cgroup"` too.
#[test]
#[ignore = "needs root: starts the daemon in a new pid namespace"]
fn a_peer_of_unseen_pid_is_served_by_uid() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let config = dir.path().join("justitiad.toml");
    std::fs::write(
        &config,
        format!("probe = \"synthetic\"\nsocket = \"{d}/j.sock\"\nadmin_socket = \"{d}/a.sock\"\nmetrics = \"\"\nstale_after_ms = 500\ntenant = \"cgroup\"\n"),
    )
    .unwrap();
    let bin = std::env::var("JUSTITIAD_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_justitiad").to_string());
    let log = std::fs::File::create(dir.path().join("log")).unwrap();
    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _daemon = Killed(
        Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child"])
            .arg(bin)
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let sock = dir.path().join("j.sock");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut c = loop {
        if let Ok(c) = AgentClient::connect(&sock) {
            break c;
        }
        let log = std::fs::read_to_string(dir.path().join("log")).unwrap_or_default();
        assert!(Instant::now() < deadline, "not served: {}", tail(&log));
        std::thread::sleep(Duration::from_millis(20));
    };
    let h = c.register(FlowClass::Bandwidth, 1, 0);
    let state = c.wait_registered(h, SERVED_WITHIN);
    assert!(matches!(state, FlowState::Registered { .. }), "{state:?}");
}

/// Cgroups made for one test under the unified hierarchy, removed (their processes
/// killed first by the test) when dropped.
struct Cgroups {
    root: PathBuf,
}

impl Cgroups {
    /// A directory of this test's own under the cgroup2 mount.
    fn new(name: &str) -> Cgroups {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let mount = mounts
            .lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
            })
            .expect("a cgroup2 mount");
        let root = mount.join(format!("justitia-{name}-{}", std::process::id()));
        std::fs::create_dir(&root).unwrap();
        Cgroups { root }
    }

    /// The `cgroup.procs` of child cgroup `name`, created on first use.
    fn procs(&self, name: &str) -> PathBuf {
        let dir = self.root.join(name);
        if !dir.exists() {
            std::fs::create_dir(&dir).unwrap();
        }
        dir.join("cgroup.procs")
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        if let Ok(dirs) = std::fs::read_dir(&self.root) {
            for d in dirs.flatten() {
                if d.path().is_dir() {
                    let _ = std::fs::remove_dir(d.path());
                }
            }
        }
        let _ = std::fs::remove_dir(&self.root);
    }
}

fn status(d: &Hostile) -> justitia_agent::admin::StatusReport {
    match d.admin(&AdminRequest::Status) {
        AdminReply::Status(s) => s,
        other => panic!("{other:?}"),
    }
}

/// Cgroup tenants that leave are dropped: with `tenant = "cgroup"`, 24 cgroups each
/// holding a registered flow of uid 65534 are 24 tenants; once their processes are gone
/// the daemon holds no tenant, no cgroup and no page for them, and three more rounds of 24
/// new cgroups (a host churning through containers) leave it there, with its descriptors
/// back where they were.
#[test]
#[ignore = "needs root: creates cgroups and acts as uid 65534"]
fn cgroup_tenants_that_leave_are_dropped() {
    let d = Hostile::start(&[("tenant = \"uid\"", "tenant = \"cgroup\"")], free_port());
    let sock = d.socket();
    let wire = register_hex(65534, FlowClass::Bandwidth);
    let cgroups = Cgroups::new("churn");
    let fds0 = d.fds();
    let before = status(&d);
    assert_eq!((before.tenants, before.cgroups), (0, 0), "{before:?}");
    for round in 0..4 {
        let tenants: Vec<Tenant> = (0..24)
            .map(|i| {
                let procs = cgroups.procs(&format!("r{round}-{i}"));
                Tenant::run_in(&procs, 65534, &["shaper", sock.to_str().unwrap(), &wire])
            })
            .collect();
        let during = status(&d);
        assert_eq!(
            (during.tenants, during.cgroups, during.flows),
            (24, 24, 24),
            "round {round}: {during:?}"
        );
        d.shaper_served(FlowClass::Bandwidth);
        drop(tenants);
        eventually("every cgroup tenant dropped", SERVED_WITHIN, || {
            let s = status(&d);
            (s.tenants, s.cgroups, s.flows) == (0, 0, 0)
        });
    }
    let fds = d.fds();
    println!("96 cgroup tenants came and went; descriptors {fds0} -> {fds}");
    assert!(fds <= fds0 + 2, "descriptors {fds0} -> {fds}");
}

/// A pid reused between `connect` and `accept` is not taken for the peer: a process of
/// uid 65534 in cgroup `a` connects while the daemon is stopped, hands the connection to
/// its child and exits; its pid is then given (through `ns_last_pid`) to a process in
/// cgroup `b`. When the daemon runs again it must not read `b`'s cgroup for that
/// connection: the pidfd the kernel took at `connect` holds the exited process, so the
/// connection is refused (`no_cgroup`) and no tenant is made of `b`.
#[test]
#[ignore = "needs root: writes /proc/sys/kernel/ns_last_pid, creates cgroups, acts as uid 65534"]
fn a_reused_pid_is_not_taken_for_the_peer() {
    let port = free_port();
    let d = Hostile::start(&[("tenant = \"uid\"", "tenant = \"cgroup\"")], port);
    let cgroups = Cgroups::new("reuse");
    let (a, b) = (cgroups.procs("a"), cgroups.procs("b"));
    // SAFETY: stopping and continuing our own child.
    unsafe { libc::kill(d.pid() as i32, libc::SIGSTOP) };
    let handed = Tenant::run_in(&a, 65534, &["handoff", d.socket().to_str().unwrap()]);
    let pid: i32 = handed
        .said
        .trim()
        .strip_prefix("pid ")
        .unwrap()
        .parse()
        .unwrap();
    // The connecting process has exited (its parent, this test, reaps it in `wait`).
    let mut first = handed;
    let _ = first.child.wait();
    let mut reuser = None;
    for _ in 0..200 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        join_cgroup_before_exec(&mut cmd, &b, None);
        let mut child = cmd.spawn().unwrap();
        if child.id() as i32 == pid {
            reuser = Some(child);
            break;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut reuser = reuser.expect("pid not reused in 200 tries");
    let now_in = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(now_in.contains("/b\n"), "pid {pid} is in {now_in}");
    // SAFETY: our own child.
    unsafe { libc::kill(d.pid() as i32, libc::SIGCONT) };
    eventually("the connection refused", SERVED_WITHIN, || {
        d.scrape().is_some_and(|s| {
            metric(
                &s,
                "justitia_messages_refused_total",
                Some(("value", "no_cgroup")),
            ) == Some(1.0)
        })
    });
    let s = status(&d);
    assert_eq!((s.tenants, s.cgroups, s.flows), (0, 0, 0), "{s:?}");
    d.shaper_served(FlowClass::Bandwidth);
    let _ = reuser.kill();
    let _ = reuser.wait();
    drop(first);
}

/// A registration refused `Full` is sent again by the shaper's client, with backoff, so
/// the flow is registered once room frees without the caller doing anything. Before, a
/// refused flow stayed refused, and the harm outlasted the attack.
#[test]
fn a_flow_refused_full_registers_once_room_frees() {
    let d = Hostile::start(
        &[
            ("slots = 1024", "slots = 4"),
            ("stale_after_ms = 5", "stale_after_ms = 500"),
        ],
        0,
    );
    let me = rustix::process::getuid().as_raw();
    let mut hog = AgentClient::connect(d.socket()).unwrap();
    let held: Vec<_> = (0..4)
        .map(|_| hog.register(FlowClass::Bandwidth, 1, 0))
        .collect();
    for &h in &held {
        assert!(matches!(
            hog.wait_registered(h, SERVED_WITHIN),
            FlowState::Registered { .. }
        ));
    }
    let mut late = AgentClient::connect(d.socket()).unwrap();
    let h = late.register(FlowClass::Bandwidth, 1, 0);
    let refused = late.wait_registered(h, SERVED_WITHIN);
    assert!(
        matches!(
            refused,
            FlowState::Refused(justitia_agent::proto::RefuseReason::Full)
        ),
        "{refused:?} (uid {me})"
    );
    drop(hog);
    let freed = Instant::now();
    eventually(
        "the refused flow registered",
        Duration::from_secs(3),
        || {
            late.tick(monotonic_ns());
            matches!(late.state(h), FlowState::Registered { .. })
        },
    );
    println!("registered {:?} after room freed", freed.elapsed());
}

/// The packaged `[peer]` table switched on by an edit: this host is 127.0.0.1 with its
/// private key written into `key_dir` (mode 0600), 127.0.0.2 its one member, peers'
/// daemons listening on `port`.
fn peer_on(key_dir: &tempfile::TempDir, port: u16) -> String {
    use std::os::unix::fs::PermissionsExt;
    let key = key_dir.path().join("peer.key");
    let own = common::PeerCluster::key(1);
    std::fs::write(&key, format!("{}\n", own.to_base64())).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    format!(
        "[peer]\nnode = \"127.0.0.1\"\nkey_file = \"{}\"\nlisten = \"127.0.0.1:{port}\"\nport = {port}\nmembers = {{ \"127.0.0.2\" = \"{}\" }}\n# node",
        key.display(),
        common::PeerCluster::key(2).public()
    )
}

/// The IPv4-mapped GID of `a.b.c.d`, as RoCE v2 forms it.
fn gid_of(v4: [u8; 4]) -> [u8; 16] {
    std::net::Ipv4Addr::from(v4).to_ipv6_mapped().octets()
}

/// What became of a tenant's 64 flows naming 64 remote ends, and of root's READ flow
/// against the member 127.0.0.2 registered after them.
struct Steered {
    /// Datagrams the member received in the second after root's flow reported its peer.
    member_datagrams: usize,
    /// The daemon's refusals of its own demands as `too_many_peers`.
    too_many_peers: f64,
    /// Datagrams the daemon could not address (sent toward a GID it has no address for).
    send_failures: f64,
    /// The tenant's flows paced: allotted less than MaxRate (a READ flow with no
    /// guarantee from its responder runs at MaxRate: unpaced), of 64.
    tenant_paced: usize,
    /// The sum of the tenant's allotments, in MaxRates.
    tenant_sum: f64,
    /// Remote ends refused, by the registration socket's reasons.
    refused_not_member: f64,
    refused_over_cap: f64,
}

/// Uid 65534 registers 64 active bandwidth flows on one connection, each reported as
/// READing from one of `gids`; then root registers one READ flow against 127.0.0.2 (a
/// socket of this test on the peers' port: the member). The daemon runs the packaged
/// configuration with `[peer]` on.
fn steer(d: &Hostile, port: u16, gids: &[[u8; 16]]) -> Steered {
    let member = std::net::UdpSocket::bind(("127.0.0.2", port)).unwrap();
    member
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let gid_args: Vec<String> = gids.iter().map(|g| hex(g)).collect();
    let mut args = vec![
        "remotes".to_string(),
        d.socket().to_str().unwrap().to_string(),
        register_hex(65534, FlowClass::Bandwidth),
    ];
    args.extend(gid_args);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let tenant = Tenant::run(65534, &args);
    assert_eq!(tenant.count("registered"), 64, "{}", tenant.said);
    // Its remote ends are served with its registrations' connection.
    std::thread::sleep(Duration::from_millis(300));

    let mut root = AgentClient::connect(d.socket()).unwrap();
    let h = root.register(FlowClass::Bandwidth, 1, 0);
    let state = root.wait_registered(h, SERVED_WITHIN);
    assert!(matches!(state, FlowState::Registered { .. }), "{state:?}");
    assert!(root.report_usage(h, true, 4096, 1));
    assert!(root.report_remote(h, gid_of([127, 0, 0, 2]), 0, 1, true));
    let mut member_datagrams = 0;
    let mut buf = [0u8; 2048];
    let end = Instant::now() + Duration::from_secs(1);
    while Instant::now() < end {
        if member.recv_from(&mut buf).is_ok() {
            member_datagrams += 1;
        }
    }
    let scrape = d.scrape().expect("metrics scraped");
    let count = |name: &str, reason: &str| metric(&scrape, name, Some(("value", reason)));
    let AdminReply::Flows(flows) = d.admin(&AdminRequest::Flows) else {
        panic!("no flows answer")
    };
    let max_rate = status(d).max_rate;
    let allotted: Vec<f64> = flows
        .iter()
        .filter(|f| f.uid == 65534)
        .map(|f| f.allot_bytes_per_sec.unwrap_or(f64::INFINITY))
        .collect();
    let tenant_paced = allotted.iter().filter(|&&a| a < max_rate).count();
    let tenant_sum = allotted.iter().sum::<f64>() / max_rate;
    drop(tenant);
    Steered {
        member_datagrams,
        too_many_peers: count("justitia_peer_messages_refused_total", "too_many_peers")
            .unwrap_or(0.0),
        send_failures: metric(&scrape, "justitia_peer_send_failures_total", None).unwrap_or(0.0),
        tenant_paced,
        tenant_sum,
        refused_not_member: count("justitia_messages_refused_total", "remote_not_a_member")
            .unwrap_or(0.0),
        refused_over_cap: count("justitia_messages_refused_total", "too_many_remote_ends")
            .unwrap_or(0.0),
    }
}

/// Issue 36, local tenants steering the channel: uid 65534 names 64 link-local GIDs
/// (fe80::1:k, which no `[peer.hosts]` maps: no member's) as the peers its 64 flows READ
/// from. Before: they took 63 places of the 64-peer table, root's demand to the member was
/// refused `too_many_peers` (0 datagrams reached the member), the daemon tried to send to
/// 63 GIDs it had no address for, and the tenant's 64 flows were unpaced (0 paced). Now
/// the 64 remote ends are refused and counted, the flows stay paced as local flows, no
/// datagram is addressed to a non-member, and root's demand reaches its member.
#[test]
#[ignore = "needs root: acts as uid 65534"]
fn a_tenant_naming_64_non_members_neither_fills_the_peer_table_nor_goes_unpaced() {
    let key_dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let d = Hostile::start(
        &[("# [peer]\n# node", &peer_on(&key_dir, port))],
        free_port(),
    );
    let gids: Vec<[u8; 16]> = (1..=64u16)
        .map(|k| {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[13] = 1;
            g[14..].copy_from_slice(&k.to_be_bytes());
            g
        })
        .collect();
    let s = steer(&d, port, &gids);
    let figures = format!(
        "member got {} datagrams in 1 s, {} too_many_peers, {} sends to non-members, {} of 64 tenant flows paced ({:.2} x MaxRate in all), {} remote ends refused as non-members",
        s.member_datagrams, s.too_many_peers, s.send_failures, s.tenant_paced, s.tenant_sum, s.refused_not_member
    );
    println!("{figures}");
    assert!(
        s.member_datagrams > 0,
        "root's demand never sent: {figures}"
    );
    assert_eq!(s.too_many_peers, 0.0, "{figures}");
    assert_eq!(
        s.send_failures, 0.0,
        "datagrams toward non-members: {figures}"
    );
    assert_eq!(s.tenant_paced, 64, "{figures}");
    assert!(s.tenant_sum <= 1.0 + 1e-9, "{figures}");
    assert_eq!(s.refused_not_member, 64.0, "{figures}");
    d.shaper_served(FlowClass::Bandwidth);
}

/// Issue 36, the same with addresses the tenant chose: 64 flows READing from 127.1.0.k
/// (k = 1..=64), which discovery maps to 127.1.0.k on the peers' port. Before: the daemon
/// sent demands to 63 of them (12,749 datagrams/s in the report), root's demand was
/// refused `too_many_peers`, and the tenant's flows went unpaced. Now a tenant's distinct
/// remote ends are capped (`max_remote_ends_per_tenant`, 16 as packaged): datagrams go to
/// at most 16 of the addresses it named, at least 48 of its flows stay paced as local
/// flows, the rest of its remote ends are refused and counted, and root's demand reaches
/// its member. (Where the peer channel holds a list of members, none of these addresses
/// is one and all 64 are refused.)
#[test]
#[ignore = "needs root: acts as uid 65534"]
fn a_tenant_naming_64_addresses_reaches_at_most_16_and_root_still_reaches_its_member() {
    let key_dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let d = Hostile::start(
        &[("# [peer]\n# node", &peer_on(&key_dir, port))],
        free_port(),
    );
    let chosen: Vec<std::net::UdpSocket> = (1..=64u8)
        .map(|k| {
            let s =
                std::net::UdpSocket::bind(("127.1.0.".to_string() + &k.to_string(), port)).unwrap();
            s.set_nonblocking(true).unwrap();
            s
        })
        .collect();
    let gids: Vec<[u8; 16]> = (1..=64u8).map(|k| gid_of([127, 1, 0, k])).collect();
    let s = steer(&d, port, &gids);
    let mut buf = [0u8; 2048];
    let mut reached = 0;
    let mut datagrams = 0;
    for sock in &chosen {
        let mut got = 0;
        while sock.recv_from(&mut buf).is_ok() {
            got += 1;
        }
        datagrams += got;
        reached += usize::from(got > 0);
    }
    let figures = format!(
        "{reached} of 64 chosen addresses got {datagrams} datagrams, member got {} in 1 s, {} too_many_peers, {} of 64 tenant flows paced ({:.2} x MaxRate in all), {} + {} remote ends refused (non-member, over the cap)",
        s.member_datagrams, s.too_many_peers, s.tenant_paced, s.tenant_sum, s.refused_not_member, s.refused_over_cap
    );
    println!("{figures}");
    assert!(reached <= 16, "{figures}");
    assert!(
        s.member_datagrams > 0,
        "root's demand never sent: {figures}"
    );
    assert_eq!(s.too_many_peers, 0.0, "{figures}");
    assert!(s.tenant_paced >= 48, "{figures}");
    assert!(
        s.refused_not_member + s.refused_over_cap >= 48.0,
        "{figures}"
    );
    d.shaper_served(FlowClass::Bandwidth);
}

/// Issue 36, squatting the metrics endpoint: threads of an unprivileged user connecting to
/// it and closing as fast as they can, and one holding 64 connections that send nothing
/// (replacing each as it is closed), while a scraper makes 30 scrapes, each given
/// [`SCRAPE_WITHIN`]. Before: 30 of 30 denied (the idle connections held every place, the
/// rest queued behind the churn). Now all 30 are answered.
#[test]
fn scrapes_are_answered_while_a_user_churns_and_idles_metrics_connections() {
    const SCRAPE_WITHIN: Duration = Duration::from_secs(2);
    let d = Hostile::start(&[], free_port());
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", d.port).parse().unwrap();
    eventually("the metrics endpoint", Duration::from_secs(5), || {
        d.scrape().is_some()
    });
    let stop = Arc::new(AtomicBool::new(false));
    let churners: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut made = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    if std::net::TcpStream::connect(addr).is_ok() {
                        made += 1;
                    }
                }
                made
            })
        })
        .collect();
    let idler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut held = std::collections::VecDeque::new();
            let mut made = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(s) =
                    std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
                {
                    made += 1;
                    held.push_back(s);
                    if held.len() > 64 {
                        held.pop_front();
                    }
                }
            }
            made
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let mut answered = 0;
    let mut slowest = Duration::ZERO;
    for _ in 0..30 {
        let start = Instant::now();
        let ok = (|| {
            let mut s = std::net::TcpStream::connect_timeout(&addr, SCRAPE_WITHIN).ok()?;
            s.set_read_timeout(Some(SCRAPE_WITHIN)).ok()?;
            write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
            let mut text = String::new();
            std::io::Read::read_to_string(&mut s, &mut text).ok()?;
            (text.starts_with("HTTP/1.1 200") && start.elapsed() <= SCRAPE_WITHIN)
                .then(|| parse_scrape(&text))
        })();
        slowest = slowest.max(start.elapsed());
        answered +=
            usize::from(ok.is_some_and(|s| {
                metric(&s, "justitia_safe_util_bytes_per_second", None).is_some()
            }));
    }
    stop.store(true, Ordering::Relaxed);
    let churned: u64 = churners.into_iter().map(|t| t.join().unwrap()).sum();
    let idled = idler.join().unwrap();
    let figures = format!(
        "{answered} of 30 scrapes answered within {SCRAPE_WITHIN:?} (slowest {slowest:?}) against {churned} connect-and-close and {idled} idle connections"
    );
    println!("{figures}");
    assert_eq!(answered, 30, "{figures}");
    d.shaper_served(FlowClass::Bandwidth);
}

/// Pods as tenants, their caps their own. Most pods run as uid 0: with `tenant = "pod"`
/// two pods whose processes run as one uid each register up to `max_flows_per_tenant`
/// (256) flows, and each pod is one tenant, `pod/<UID>`. With the caps per uid (as
/// `tenant = "cgroup"` keeps them, a cgroup being something a user may make), the first
/// pod's 256 flows leave the second none: the mechanism removed, the lock-out seen.
#[test]
#[ignore = "needs root: creates cgroups and acts as uid 65534"]
fn two_pods_of_one_uid_each_register_up_to_their_own_cap() {
    const POD_A: &str = "5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f60";
    const POD_B: &str = "6e1d7b3f-8e2c-4d4a-8f1b-4c3e2d5f6a71";
    let wire = register_hex(65534, FlowClass::Bandwidth);
    for (mode, b_gets) in [("pod", 256), ("cgroup", 0)] {
        let d = Hostile::start(
            &[("tenant = \"uid\"", &format!("tenant = \"{mode}\""))],
            free_port(),
        );
        let sock = d.socket();
        let sock = sock.to_str().unwrap();
        let cgroups = Cgroups::new(&format!("pods-{mode}"));
        // kubelet's cgroupfs names: a pod<UID> directory holds the pod's containers.
        let a = Tenant::run_in(
            &cgroups.procs(&format!("pod{POD_A}")),
            65534,
            &["register", sock, "300", &wire],
        );
        assert_eq!(
            (a.count("registered"), a.count("refused")),
            (256, 44),
            "{mode}: pod A, 300 registrations against a cap of 256: {}",
            a.said
        );
        let b = Tenant::run_in(
            &cgroups.procs(&format!("pod{POD_B}")),
            65534,
            &["register", sock, "256", &wire],
        );
        assert_eq!(
            b.count("registered"),
            b_gets,
            "{mode}: pod B, same uid, 256 registrations: {}",
            b.said
        );
        let AdminReply::Flows(flows) = d.admin(&AdminRequest::Flows) else {
            panic!("no flow list");
        };
        if mode == "pod" {
            let of = |pod: &str| {
                flows
                    .iter()
                    .filter(|f| f.tenant == format!("pod/{pod}"))
                    .count()
            };
            assert_eq!(
                (of(POD_A), of(POD_B)),
                (256, 256),
                "flows by tenant name `pod/<UID>` (no log directory names them)"
            );
        }
        drop((a, b));
    }
}

/// Namespaces as tenants, and weights by namespace and pod: with `tenant = "namespace"`
/// two pods of team-a (named in kubelet's log directory, `pod_logs_dir`) are one tenant,
/// `namespace/team-a`, whose flows take its weight (4) and share its cap (256 flows
/// between them); a pod of team-b is another, its flows at its own pod's weight (3).
#[test]
#[ignore = "needs root: creates cgroups and acts as uid 65534"]
fn pods_of_one_namespace_are_one_tenant_at_its_weight() {
    const POD_A: &str = "5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f60";
    const POD_B: &str = "6e1d7b3f-8e2c-4d4a-8f1b-4c3e2d5f6a71";
    const POD_C: &str = "7f2e8c40-9f3d-4e5b-9a2c-5d4f3e6a7b82";
    let logs = tempfile::tempdir().unwrap();
    for dir in [
        format!("team-a_writer-0_{POD_A}"),
        format!("team-b_reader_{POD_B}"),
        format!("team-a_writer-1_{POD_C}"),
    ] {
        std::fs::create_dir(logs.path().join(dir)).unwrap();
    }
    let tenant = format!(
        "tenant = \"namespace\"\npod_logs_dir = \"{}\"",
        logs.path().display()
    );
    let d = Hostile::start(
        &[
            ("tenant = \"uid\"", tenant.as_str()),
            (
                "[weights]\n",
                "[weights]\n\"namespace/team-a\" = 4\n\"pod/team-b/reader\" = 3\n",
            ),
        ],
        free_port(),
    );
    let sock = d.socket();
    let sock = sock.to_str().unwrap();
    let wire = register_hex(65534, FlowClass::Bandwidth);
    let cgroups = Cgroups::new("namespaces");
    let run = |pod: &str, n: &str| {
        Tenant::run_in(
            &cgroups.procs(&format!("pod{pod}")),
            65534,
            &["register", sock, n, &wire],
        )
    };
    let a = run(POD_A, "200");
    let c = run(POD_C, "100");
    let b = run(POD_B, "10");
    assert_eq!(
        (
            a.count("registered"),
            c.count("registered"),
            b.count("registered")
        ),
        (200, 56, 10),
        "team-a's two pods share its cap of 256 flows; team-b's pod has its own: {} / {} / {}",
        a.said,
        c.said,
        b.said
    );
    let AdminReply::Flows(flows) = d.admin(&AdminRequest::Flows) else {
        panic!("no flow list");
    };
    let by = |tenant: &str| {
        let of: Vec<_> = flows.iter().filter(|f| f.tenant == tenant).collect();
        let weights: std::collections::BTreeSet<u32> = of.iter().map(|f| f.weight).collect();
        (of.len(), weights.into_iter().collect::<Vec<_>>())
    };
    assert_eq!(by("namespace/team-a"), (256, vec![4]), "team-a's flows");
    assert_eq!(
        by("namespace/team-b"),
        (10, vec![3]),
        "team-b's flows, at its pod's weight"
    );
    assert_eq!(status(&d).tenants, 2, "two tenants");
    drop((a, b, c));
}
