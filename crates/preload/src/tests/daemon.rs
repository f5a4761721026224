//! The shaper under a real `justitiad` (the synthetic probe, sockets in a temporary
//! directory): it registers, follows its allotment, falls back when the daemon dies and
//! registers again when it returns. The daemon's binary is built by
//! `cargo build -p justitia-daemon` into the same target directory as this test (or named
//! by `JUSTITIAD`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia_agent::admin::{AdminReply, AdminRequest, FlowReport};
use justitia_agent::client::{AgentClient, FlowState};
use justitia_core::flow::FlowClass;
use justitia_verbs::ops;
use justitia_verbs::sys::*;

use super::{forget, lookup, pattern, rdma, sge};
use crate::clock::MonotonicClock;
use crate::engine::{self, Engine, PacerMode};
use crate::exports::{engine_from, on_create_cq, on_create_qp};
use crate::mock::MockDevice;

/// The daemon's binary: `JUSTITIAD`, or `justitiad` beside this test's own directory.
fn justitiad() -> PathBuf {
    if let Some(p) = std::env::var_os("JUSTITIAD") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<this test> -> target/<profile>/justitiad
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("justitiad");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p justitia-daemon` (or set JUSTITIAD)",
        bin.display()
    );
    bin
}

/// A `justitiad` process on sockets in `dir`.
pub(super) struct Daemon {
    child: Child,
    dir: PathBuf,
}

impl Daemon {
    fn start(dir: &Path) -> Daemon {
        Self::start_with(dir, "")
    }

    /// A daemon whose configuration has `extra` lines besides the usual ones.
    pub(super) fn start_with(dir: &Path, extra: &str) -> Daemon {
        let config = format!(
            "probe = \"synthetic\"\nsynthetic_latency_us = 20\nsocket = \"{0}/j.sock\"\nadmin_socket = \"{0}/a.sock\"\nmetrics = \"\"\nstale_after_ms = 500\n{extra}",
            dir.display()
        );
        let path = dir.join("justitiad.toml");
        std::fs::write(&path, config).unwrap();
        let log = std::fs::File::create(dir.join("log")).unwrap();
        let child = Command::new(justitiad())
            .arg("--config")
            .arg(&path)
            .stderr(log)
            .spawn()
            .unwrap();
        let d = Daemon {
            child,
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while AgentClient::connect(d.socket()).is_err() {
            assert!(Instant::now() < deadline, "justitiad did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        d
    }

    pub(super) fn socket(&self) -> PathBuf {
        self.dir.join("j.sock")
    }

    fn flows(&self) -> Vec<FlowReport> {
        match self.admin(&AdminRequest::Flows) {
            AdminReply::Flows(f) => f,
            other => panic!("{other:?}"),
        }
    }

    /// The daemon's answer to `req` on its admin socket.
    pub(super) fn admin(&self, req: &AdminRequest) -> AdminReply {
        let mut s = UnixStream::connect(self.dir.join("a.sock")).unwrap();
        let mut line = serde_json::to_string(req).unwrap();
        line.push('\n');
        s.write_all(line.as_bytes()).unwrap();
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap()
    }

    /// The daemon's allotment for `flow`, in bytes/s.
    fn allotment_of(&self, flow: u64) -> Option<u64> {
        self.flows()
            .into_iter()
            .find(|f| f.flow == flow)
            .and_then(|f| f.allot_bytes_per_sec)
            .map(|b| b as u64)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The size of [`App::post_large`]'s WRITE, and of the application's buffers.
const LARGE: usize = 64 * 1024;

/// An engine with the real clock and the pacer and follower threads, and a mock RC QP.
struct App {
    dev: MockDevice,
    engine: Arc<Engine>,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    src: Vec<u8>,
    dst: Vec<u8>,
    posted: u64,
}

impl App {
    fn start(vars: &[(&str, &str)]) -> App {
        let engine = engine_from(
            lookup(vars),
            Arc::new(MonotonicClock::new()),
            PacerMode::Thread,
        )
        .unwrap();
        let dev = MockDevice::new();
        let ctx = dev.context();
        // SAFETY: a fresh mock context.
        assert!(unsafe { crate::install::attach_context(ctx, Arc::clone(&engine)) });
        let cq = dev.create_cq();
        // SAFETY: just created on ctx.
        unsafe { on_create_cq(ctx, cq) };
        let mut attr = ibv_qp_init_attr {
            send_cq: cq,
            recv_cq: cq,
            qp_type: IBV_QPT_RC,
            cap: ibv_qp_cap {
                max_send_wr: 64,
                max_send_sge: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        let qp = dev.create_qp(&mut attr);
        // SAFETY: just created with attr.
        unsafe { on_create_qp(qp, &attr) };
        App {
            dev,
            engine,
            cq,
            qp,
            src: pattern(LARGE, 3),
            dst: vec![0u8; LARGE],
            posted: 0,
        }
    }

    /// Posts one signaled 16 B WRITE, lets the mock execute it and polls its completion;
    /// returns how long the post call took.
    fn post_one(&mut self) -> Duration {
        let mut s = [sge(&self.src, 0, 16)];
        let mut w = rdma(
            IBV_WR_RDMA_WRITE,
            self.posted,
            &mut s,
            self.dst.as_mut_ptr() as u64,
            true,
        );
        let mut bad = std::ptr::null_mut();
        let start = Instant::now();
        // SAFETY: a live QP; the request and its SGE live for the call.
        let rc = unsafe { ops::post_send(self.qp, &mut w, &mut bad) };
        let took = start.elapsed();
        assert_eq!(rc, 0, "a post never fails because of the daemon");
        self.posted += 1;
        self.dev.execute_all(self.qp);
        let mut wc = [ibv_wc::default(); 4];
        // SAFETY: a live CQ with room for 4.
        while unsafe { ops::poll_cq(self.cq, 4, wc.as_mut_ptr()) } > 0 {}
        took
    }

    /// Posts one signaled WRITE of [`LARGE`] bytes and runs the mock until its completion
    /// is polled (the chunks of a split request are posted as earlier ones complete, and a
    /// paced one by the pacer's thread), for at most 5 s.
    fn post_large(&mut self) {
        let wr_id = self.posted;
        let mut s = [sge(&self.src, 0, LARGE)];
        let mut w = rdma(
            IBV_WR_RDMA_WRITE,
            wr_id,
            &mut s,
            self.dst.as_mut_ptr() as u64,
            true,
        );
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP; the request and its SGE live for the call.
        assert_eq!(unsafe { ops::post_send(self.qp, &mut w, &mut bad) }, 0);
        self.posted += 1;
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut wc = [ibv_wc::default(); 4];
        loop {
            self.dev.execute_all(self.qp);
            // SAFETY: a live CQ with room for 4.
            let n = unsafe { ops::poll_cq(self.cq, 4, wc.as_mut_ptr()) };
            if wc[..usize::try_from(n).unwrap_or(0)]
                .iter()
                .any(|c| c.wr_id == wr_id)
            {
                return;
            }
            assert!(Instant::now() < deadline, "WRITE {wr_id} never completed");
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Keeps the flow busy (a post every 200 us) until `done`, for at most `timeout`.
    fn drive_until(&mut self, what: &str, timeout: Duration, mut done: impl FnMut(&App) -> bool) {
        let deadline = Instant::now() + timeout;
        while !done(self) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {:?}, settings {:?}",
                self.engine.follow_status(),
                self.engine.settings()
            );
            self.post_one();
            // The side thread's turn, for an engine whose threads the test drives.
            self.engine.side_turn(justitia_agent::block::monotonic_ns());
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The daemon's id for this process's flow, once registered.
    fn flow_id(&self) -> Option<u64> {
        match self.engine.follow_status()?.flow? {
            FlowState::Registered { flow, .. } => Some(flow),
            _ => None,
        }
    }

    fn paced_at(&self) -> Option<u64> {
        self.engine.settings().rate.map(|r| r.bytes_per_sec)
    }

    /// Destroys the QP, as `ibv_destroy_qp` would.
    fn destroy_qp(&mut self) {
        if let Some(t) = engine::qp_token(self.qp) {
            engine::unregister_qp(self.qp, t);
        }
    }
}

impl Drop for App {
    fn drop(&mut self) {
        forget(&self.dev, &[self.qp], self.cq);
    }
}

/// A client standing for another application of the same user: registers a flow of
/// `class` and reports it active.
fn other_flow(d: &Daemon, class: FlowClass) -> AgentClient {
    let mut c = AgentClient::connect(d.socket()).unwrap();
    let h = c.register(class, 1, 0);
    assert!(matches!(
        c.wait_registered(h, Duration::from_secs(2)),
        FlowState::Registered { .. }
    ));
    assert!(c.report_usage(h, true, 1 << 20, 1));
    c
}

#[test]
fn under_a_daemon_a_shaped_qp_registers_and_its_pacer_follows_the_allotment() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    let socket = d.socket();
    let mut app = App::start(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
    ]);
    // Unpaced, 5 KiB chunks until the daemon says otherwise.
    assert_eq!(app.paced_at(), None);
    app.drive_until("the daemon's allotment", Duration::from_secs(5), |a| {
        a.paced_at().is_some()
    });
    let flow = app.flow_id().expect("registered");
    let flows = d.flows();
    assert_eq!(flows.len(), 1, "{flows:?}");
    assert_eq!(
        (flows[0].pid as u32, flows[0].class.as_str(), flows[0].qps),
        (std::process::id(), "bandwidth", 1)
    );
    // Its activity reaches the daemon with the shaper's next report: on a starved host that
    // may come after the allotment did, or lapse while the test's thread did not post.
    app.drive_until("the flow reported active", Duration::from_secs(5), |_| {
        d.flows().first().is_some_and(|f| f.active)
    });
    // The pacer runs at what the daemon publishes for this flow (all of SafeUtil, over
    // 1 GB/s with the synthetic probe), with the daemon's chunk (1 MiB without a latency
    // flow on the host).
    app.drive_until("the pacer at the allotment", Duration::from_secs(5), |a| {
        a.paced_at() == d.allotment_of(flow)
    });
    let alone = app.paced_at().unwrap();
    assert!(alone > 1_000_000_000, "{alone}");
    assert_eq!(app.engine.settings().chunk_bytes, 1 << 20);
    // A second bandwidth flow of the same user takes half.
    let other = other_flow(&d, FlowClass::Bandwidth);
    app.drive_until("half the rate", Duration::from_secs(5), |a| {
        a.paced_at()
            .is_some_and(|r| r < alone * 11 / 20 && Some(r) == d.allotment_of(flow))
    });
    let shared = app.paced_at().unwrap();
    assert!(shared > alone * 9 / 20, "{shared} of {alone}");
    // A latency flow on the host cuts the chunk to 5 KiB.
    let latency = other_flow(&d, FlowClass::Latency);
    app.drive_until("5 KiB chunks", Duration::from_secs(5), |a| {
        a.engine.settings().chunk_bytes == 5 * 1024
    });
    // The QP destroyed, the flow is unregistered.
    app.destroy_qp();
    let deadline = Instant::now() + Duration::from_secs(5);
    while d.flows().iter().any(|f| f.flow == flow) {
        assert!(Instant::now() < deadline, "the flow stays registered");
        std::thread::sleep(Duration::from_millis(2));
    }
    drop((other, latency));
}

/// Under an adaptive daemon a latency-class process times its requests' round trips and
/// reports them, and the daemon's law reads them (the applications' tail, not the
/// probe's); under the `justitia` policy they are reported as well and read by nobody.
#[test]
fn under_an_adaptive_daemon_a_latency_flow_reports_its_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(dir.path(), "policy = \"adaptive\"\n");
    let socket = d.socket();
    let mut app = App::start(&[
        ("JUSTITIA_CLASS", "latency"),
        ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
    ]);
    let adaptive = |d: &Daemon| match d.admin(&AdminRequest::Status) {
        AdminReply::Status(s) => *s.adaptive.expect("adaptive's state"),
        other => panic!("{other:?}"),
    };
    app.drive_until("timing on", Duration::from_secs(5), |a| {
        a.engine.settings().time_round_trips
    });
    app.drive_until(
        "the law reading the round trips",
        Duration::from_secs(10),
        |_| {
            let s = adaptive(&d);
            s.round_trips >= 40 && s.applications_tail_updates >= 1
        },
    );
    let flow = app.flow_id().expect("registered");
    assert_eq!(
        d.flows()
            .iter()
            .find(|f| f.flow == flow)
            .map(|f| f.class.clone()),
        Some("latency".to_string())
    );
    // The mock completes at once: round trips of the test's own steps, under a second
    // (an unset post time would give the uptime, or 4.3 s saturated).
    app.drive_until(
        "the tail of the applications",
        Duration::from_secs(10),
        |_| {
            let s = adaptive(&d);
            s.tail_source == justitia_agent::admin::TailSource::Applications
        },
    );
    let tail = adaptive(&d).tail_ns;
    assert!(
        tail.is_some_and(|ns| ns > 0 && ns < 1_000_000_000),
        "{tail:?}"
    );
}

/// The daemon's release phase reaches the shaper's pacer: a second bandwidth flow on the
/// host puts this one half a release interval after the first, under the epoch the daemon
/// published, and a dead daemon leaves the pacer without a phase (static settings).
#[test]
fn under_a_daemon_the_pacer_is_given_the_flows_release_phase() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    let socket = d.socket();
    // The other flow registers first: the lower id, offset 0.
    let other = other_flow(&d, FlowClass::Bandwidth);
    let mut app = App::start(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
    ]);
    assert_eq!(
        app.engine.settings().phase,
        None,
        "no phase before the daemon's"
    );
    app.drive_until("half an interval", Duration::from_secs(5), |a| {
        a.engine.settings().phase.is_some_and(|p| p.offset == 0.5)
    });
    let phase = app.engine.settings().phase.unwrap();
    let published = app.engine.follow_status().unwrap().allotment.unwrap();
    assert_eq!(
        (published.phase_offset, published.phase_epoch),
        (1 << 31, phase.epoch),
        "the pacer holds the phase of the slot"
    );
    assert!(phase.epoch > 0, "{phase:?}");
    // The other flow gone, this one is alone: a new epoch, offset 0.
    drop(other);
    app.drive_until("offset 0 alone", Duration::from_secs(5), |a| {
        a.engine
            .settings()
            .phase
            .is_some_and(|p| p.offset == 0.0 && p.epoch > phase.epoch)
    });
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    app.drive_until("static settings", Duration::from_secs(5), |a| {
        a.engine.settings().rate.is_none()
    });
    assert_eq!(app.engine.settings().phase, None);
}

#[test]
fn the_daemon_killed_the_shaper_falls_back_within_10_ms_and_registers_again_when_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    let socket = d.socket();
    let mut app = App::start(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
    ]);
    app.drive_until("the daemon's allotment", Duration::from_secs(5), |a| {
        a.paced_at().is_some()
    });
    // SIGKILL: no goodbye; the kernel hangs up the socket as the process exits. The time
    // counts from the daemon's death (reaped: its sockets are closed), not from the
    // signal, whose delivery and the exit's teardown are not the shaper's.
    let engine = Arc::clone(&app.engine);
    let watcher = std::thread::spawn(move || {
        let start = Instant::now();
        while engine.settings().rate.is_some() {
            assert!(
                start.elapsed() < Duration::from_secs(1),
                "still paced by a dead daemon"
            );
            std::thread::sleep(Duration::from_micros(50));
        }
        Instant::now()
    });
    let killed = Instant::now();
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let dead = Instant::now();
    let fell_back = watcher.join().unwrap();
    let after_death = fell_back.saturating_duration_since(dead);
    eprintln!(
        "daemon dead {:?} after SIGKILL, static settings {after_death:?} after its death ({:?} after SIGKILL)",
        dead - killed,
        fell_back.saturating_duration_since(killed)
    );
    assert!(
        after_death < Duration::from_millis(10),
        "static settings {after_death:?} after the daemon died"
    );
    assert_eq!(app.engine.settings().chunk_bytes, 5 * 1024);
    let status = app.engine.follow_status().unwrap();
    assert!(!status.connected && status.fallbacks == 1, "{status:?}");
    let mut slowest = Duration::ZERO;
    // It keeps posting: every request reaches the provider, none waits (for a reconnection
    // attempt, which happens on the follower's thread).
    let before = app.dev.log().len();
    for _ in 0..100 {
        slowest = slowest.max(app.post_one());
    }
    assert_eq!(app.dev.log().len(), before + 100);
    assert!(
        slowest < Duration::from_millis(50),
        "a post took {slowest:?}"
    );
    // The daemon back on the same socket: the flow registers again and follows it.
    let d2 = Daemon::start(dir.path());
    registered_with_the_second_daemon(&mut app);
    let second = app.flow_id().unwrap();
    let flows = d2.flows();
    assert_eq!(flows.len(), 1, "{flows:?}");
    assert_eq!(
        (flows[0].flow, flows[0].pid as u32),
        (second, std::process::id())
    );
    app.drive_until("the new allotment", Duration::from_secs(5), |a| {
        a.paced_at() == d2.allotment_of(second)
    });
}

/// Drives `app` until its flow is registered with, and paced by, the second daemon it
/// connected to.
fn registered_with_the_second_daemon(app: &mut App) {
    app.drive_until(
        "registration with the new daemon",
        Duration::from_secs(10),
        |a| {
            a.engine
                .follow_status()
                .is_some_and(|s| s.connected && s.connections == 2)
                && a.flow_id().is_some()
                && a.paced_at().is_some()
        },
    );
}

/// A daemon replaced as a rolling update replaces it (SIGTERM, then a new one on the same
/// socket): the statistics count the two connections, the one loss, and the requests the
/// shaper split on its static settings in between, not those split under either daemon.
#[test]
fn a_replaced_daemon_shows_in_the_statistics_with_the_requests_split_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path());
    let socket = d.socket();
    // A chunk of its own, kept under a daemon too: every 64 KiB WRITE is split.
    let mut app = App::start(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_CHUNK", "16K"),
        ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
    ]);
    app.drive_until("the daemon's allotment", Duration::from_secs(5), |a| {
        a.paced_at().is_some()
    });
    for _ in 0..3 {
        app.post_large();
    }
    let s = app.engine.stats();
    assert_eq!(
        (s.split_requests, s.daemon_connections, s.daemon_fallbacks),
        (3, 1, 0),
        "{s:?}"
    );
    assert_eq!(s.split_while_daemon_gone, 0, "{s:?}");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    d.child.wait().unwrap();
    app.drive_until("the loss seen", Duration::from_secs(5), |a| {
        a.engine.follow_status().unwrap().fallbacks == 1 && a.paced_at().is_none()
    });
    for _ in 0..5 {
        app.post_large();
    }
    let d2 = Daemon::start(dir.path());
    registered_with_the_second_daemon(&mut app);
    for _ in 0..2 {
        app.post_large();
    }
    let s = app.engine.stats();
    assert_eq!(
        (
            s.split_requests,
            s.split_while_daemon_gone,
            s.daemon_connections,
            s.daemon_fallbacks
        ),
        (10, 5, 2, 1),
        "{s:?}"
    );
    let json = s.to_json();
    assert!(
        json.contains(
            "\"daemon_connections\":2,\"daemon_fallbacks\":1,\"split_while_daemon_gone\":5"
        ),
        "{json}"
    );
    drop(d2);
}

/// A daemon that is slow (stopped for longer than its 500 ms stale limit, three times) is
/// not a gone daemon: the shaper drops to static settings while the heartbeat is stale and
/// follows again when it is fresh, on the same connection and registration, and counts
/// three stale periods and no fallback. Before, each stale period was reported (and
/// counted) as the daemon gone and back.
#[test]
fn a_slow_daemon_is_neither_gone_nor_reconnected_and_is_said_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    let socket = d.socket();
    let mut app = App::start(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
    ]);
    app.drive_until("the daemon's allotment", Duration::from_secs(5), |a| {
        a.paced_at().is_some()
    });
    let flow = app.flow_id().unwrap();
    let pid = d.child.id() as i32;
    for period in 1..=3u64 {
        // SAFETY: stopping our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        // The stale heartbeat counted, and static settings: an allotment can also lapse
        // for a moment when the daemon plans again for a flow gone idle, which is not
        // what this waits for.
        app.drive_until("static settings", Duration::from_secs(5), |a| {
            a.paced_at().is_none()
                && a.engine
                    .follow_status()
                    .is_some_and(|s| s.stale_periods >= period)
        });
        // SAFETY: continuing it.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        app.drive_until("the allotment again", Duration::from_secs(5), |a| {
            a.paced_at().is_some()
        });
        let s = app.engine.follow_status().unwrap();
        assert_eq!(
            (s.stale_periods, s.fallbacks, s.connections),
            (period, 0, 1),
            "{s:?}"
        );
    }
    assert_eq!(app.flow_id(), Some(flow), "registered again");
}

#[test]
fn justitia_rate_keeps_its_rate_under_a_daemon_and_the_chunk_follows() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    let socket = d.socket();
    let mut app = App::start(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_RATE", "20M"),
        ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
    ]);
    assert_eq!(app.paced_at(), Some(20_000_000));
    app.drive_until("the daemon's chunk", Duration::from_secs(5), |a| {
        a.engine.settings().chunk_bytes == 1 << 20
    });
    let flow = app.flow_id().unwrap();
    let daemon_rate = d.allotment_of(flow);
    assert!(
        daemon_rate.is_some_and(|r| r > 1_000_000_000),
        "{daemon_rate:?}"
    );
    assert_eq!(app.paced_at(), Some(20_000_000), "JUSTITIA_RATE wins");
    assert_eq!(
        app.engine.settings().rate.map(|r| r.chunk_bytes),
        Some(1 << 20),
        "the burst is counted in the chunks in effect"
    );
}

/// A listening socket that never accepts: a connection attempt is queued and its greeting
/// never comes.
fn silent_listener(path: &Path) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: plain socket calls on a fresh descriptor and a zeroed address.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
            *d = *s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        assert_eq!(
            libc::bind(fd, (&raw const addr).cast(), len),
            0,
            "bind {}",
            path.display()
        );
        assert_eq!(libc::listen(fd, 8), 0);
        owned
    }
}

/// How long the test waits for posts that must not wait at all (see
/// [`without_a_daemon_settings_stay_static_and_posts_never_wait_for_one`]): the follower
/// is let go only after they returned, so the posts either return without it or never do;
/// this only turns a post stuck on the follower into a failure instead of a hang.
const STUCK: Duration = Duration::from_secs(60);

/// An application's QP, posted on from a thread of the test.
struct Posting<'a>(&'a mut App);

// SAFETY: the QP and CQ pointers are the mock's, usable from any thread; one thread posts.
unsafe impl Send for Posting<'_> {}

#[test]
fn without_a_daemon_settings_stay_static_and_posts_never_wait_for_one() {
    let dir = tempfile::tempdir().unwrap();
    // A socket path with nothing behind it, and one whose "daemon" never answers (each
    // connection attempt waits for a greeting on the follower's thread).
    let missing = dir.path().join("none.sock");
    let silent = dir.path().join("silent.sock");
    let _listener = silent_listener(&silent);
    for socket in [&missing, &silent] {
        let mut app = App::start(&[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
        ]);
        // The QP joins the flow at its first post, which starts the follower thread; it
        // tries the socket meanwhile.
        app.post_one();
        // The test stands in for a follower stuck in a connection attempt (a daemon that
        // never greets) for as long as it likes: a post that waited for the daemon (the
        // follower's lock, or its socket behind it) would wait until the test lets go,
        // which it does once the posts returned, or when it gives up on them.
        let engine = Arc::clone(&app.engine);
        let following = engine.hold_follower();
        assert!(following.is_some(), "a follower with a socket set");
        let (done, posts_done) = std::sync::mpsc::channel();
        let posting = Posting(&mut app);
        let outcome = std::thread::scope(|s| {
            s.spawn(move || {
                let posting = posting;
                for _ in 0..100 {
                    posting.0.post_one();
                }
                let _ = done.send(());
            });
            let outcome = posts_done.recv_timeout(STUCK);
            drop(following);
            outcome
        });
        assert!(
            outcome.is_ok(),
            "{}: a post waited for the follower",
            socket.display()
        );
        // Let go, the follower registers the flow as pending (no daemon took it) at its
        // next tick, while the application keeps posting.
        let start = Instant::now();
        while app.engine.follow_status().unwrap().flow.is_none() {
            assert!(start.elapsed() < STUCK, "the follower never ticked");
            app.post_one();
            std::thread::sleep(Duration::from_millis(1));
        }
        // Every request went out whole, unpaced, as without the daemon.
        let log = app.dev.log();
        assert_eq!(log.len() as u64, app.posted);
        assert!(log.iter().all(|w| w.len() == 16));
        let settings = app.engine.settings();
        assert_eq!((settings.rate, settings.chunk_bytes), (None, 5 * 1024));
        let status = app.engine.follow_status().unwrap();
        assert!(
            !status.connected && status.connections == 0 && status.allotment.is_none(),
            "{status:?}"
        );
        assert!(
            matches!(status.flow, Some(FlowState::Pending)),
            "{status:?}"
        );
    }
}

#[test]
fn justitia_daemon_off_never_registers() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    let socket = d.socket();
    let mut app = App::start(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_DAEMON", "off"),
        ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
    ]);
    assert_eq!(app.engine.follow_status(), None);
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(50) {
        app.post_one();
    }
    assert!(d.flows().is_empty());
    assert_eq!(app.paced_at(), None);
}

/// Datagrams sent, with where to.
type Sent = Arc<std::sync::Mutex<Vec<(justitia_verbs::DatagramDest, Vec<u8>)>>>;

/// Side channels that are never opened on a device: every port gets the same address,
/// and what is sent is kept (shared with the test).
#[derive(Debug)]
struct FixedSideChannels(crate::side_channel::SideAddress, Sent);

impl crate::side_channel::SideChannels for FixedSideChannels {
    fn open(
        &mut self,
        _port: &crate::pairing::Port,
    ) -> Result<crate::side_channel::SideAddress, String> {
        Ok(self.0)
    }

    fn count(&self) -> u32 {
        1
    }

    fn send(
        &mut self,
        _port: &crate::pairing::Port,
        _sgid_index: u8,
        to: &justitia_verbs::DatagramDest,
        bytes: &[u8],
    ) -> Result<(), String> {
        self.1.lock().unwrap().push((*to, bytes.to_vec()));
        Ok(())
    }

    fn receive(&mut self, _max: usize) -> Vec<crate::side_channel::Datagram> {
        Vec::new()
    }
}

/// The GID of 127.0.0.1 (IPv4-mapped), this host as the test's daemon knows it.
const LOOPBACK_GID: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1];

/// A daemon with the peer channel on 127.0.0.1 and no member yet: two processes on this
/// host connected to each other are paired by it.
fn start_peered_daemon(dir: &Path) -> Daemon {
    use std::os::unix::fs::PermissionsExt;
    let key = Command::new(justitiad()).arg("genkey").output().unwrap();
    assert!(key.status.success(), "justitiad genkey");
    let key_file = dir.join("peer.key");
    std::fs::write(&key_file, &key.stdout).unwrap();
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    Daemon::start_with(
        dir,
        &format!(
            "[peer]\nnode = \"127.0.0.1\"\nkey_file = \"{}\"\nlisten = \"127.0.0.1:{port}\"\nport = {port}\nmembers_file = \"{}\"\n",
            key_file.display(),
            dir.join("members").display()
        ),
    )
}

/// `JUSTITIA_TWO_SIDED=split`: a queue pair that reaches RTR is reported to the daemon with
/// the process's side channel, and the side channel of the process at its other end comes
/// back, once; a queue pair destroyed is withdrawn.
#[test]
fn with_two_sided_split_a_connected_queue_pair_learns_its_peers_side_channel() {
    let _record = super::pairing_record();
    let before = crate::pairing::record().counts();
    let dir = tempfile::tempdir().unwrap();
    let d = start_peered_daemon(dir.path());
    let socket = d.socket();
    let mut app = App::start(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_TWO_SIDED", "split"),
        ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
    ]);
    let ours = crate::side_channel::SideAddress {
        qpn: 0x51,
        qkey: 0x0123_4567,
    };
    let sent = Arc::new(std::sync::Mutex::new(Vec::new()));
    app.engine
        .hold_follower()
        .unwrap()
        .set_side_channels(Box::new(FixedSideChannels(ours, Arc::clone(&sent))));
    app.drive_until("registration", Duration::from_secs(5), |a| {
        a.flow_id().is_some()
    });
    // SAFETY: the mock's live QP.
    let qpn = unsafe { (*app.qp).qp_num };
    let peer_qpn = 0x7e_0001;
    crate::pairing::record().connected(crate::pairing::Connection {
        qpn,
        end: crate::remote::End {
            gid: LOOPBACK_GID,
            lid: 0,
            qpn: peer_qpn,
        },
        port: crate::pairing::Port {
            device: "mock0".into(),
            number: 1,
        },
        sgid_index: 0,
    });
    app.drive_until("the pairing reported", Duration::from_secs(5), |a| {
        a.engine
            .follow_status()
            .is_some_and(|s| s.pairing.reported == before.reported + 1)
    });
    // The other process: its queue pair is the far end of ours.
    let mut other = AgentClient::connect(d.socket()).unwrap();
    let h = other.register(FlowClass::Bandwidth, 1, 0);
    assert!(matches!(
        other.wait_registered(h, Duration::from_secs(2)),
        FlowState::Registered { .. }
    ));
    assert!(other.report_pairing(
        h,
        justitia_agent::proto::QpPairing {
            flow: 0,
            local_qpn: peer_qpn,
            remote_gid: LOOPBACK_GID,
            remote_lid: 0,
            remote_qpn: qpn,
            side_qpn: 0x52,
            side_qkey: 0x0765_4321,
        }
    ));
    app.drive_until("the peer's side channel", Duration::from_secs(5), |_| {
        crate::pairing::record().peer(qpn).is_some()
    });
    let (end, side) = crate::pairing::record().peer(qpn).unwrap();
    assert_eq!(
        (end.qpn, side.qpn, side.qkey),
        (peer_qpn, 0x52, 0x0765_4321)
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let told = loop {
        other.tick(0);
        if let Some(p) = other.take_paired() {
            break p;
        }
        assert!(Instant::now() < deadline, "the other process was not told");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        (told.local_qpn, told.side_qpn, told.side_qkey),
        (peer_qpn, 0x51, 0x0123_4567)
    );
    let status = app.engine.follow_status().unwrap();
    assert_eq!(
        (status.pairing.reported, status.pairing.paired),
        (before.reported + 1, before.paired + 1)
    );
    // Paired: a hello goes to the peer's side channel, naming the peer's queue pair.
    app.drive_until("a hello sent", Duration::from_secs(5), |_| {
        !sent.lock().unwrap().is_empty()
    });
    let (to, bytes) = sent.lock().unwrap()[0].clone();
    assert_eq!((to.gid, to.qpn, to.qkey), (LOOPBACK_GID, 0x52, 0x0765_4321));
    assert_eq!(
        justitia_core::two_sided::SideMessage::decode(&bytes),
        Ok(justitia_core::two_sided::SideMessage::Hello {
            qp_num: peer_qpn,
            heard: false,
            splits: true,
        })
    );
    assert_eq!(status.side_channels, 1);
    // Destroyed: withdrawn, and the record forgets it.
    crate::pairing::on_destroy(qpn);
    app.drive_until("the withdrawal sent", Duration::from_secs(5), |_| {
        crate::pairing::record().withdrawals().is_empty()
    });
    assert_eq!(crate::pairing::record().peer(qpn), None);
}
