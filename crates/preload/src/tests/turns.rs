//! Turns among the process's shaped QPs (`JUSTITIA_QP_TURNS`, or the daemon's share): a
//! QP out of turn posts nothing, a QP with nothing left or with its turn spent hands it
//! on, every request still arrives whole and completes once, and turns that begin or end
//! at a follower's tick take hold at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia_agent::admin::{AdminReply, AdminRequest};
use justitia_core::queue_turns::TurnBudget;

use justitia_verbs::ops;
use justitia_verbs::sys::*;

use super::daemon::Daemon;
use super::{attached_on, create_qp, forget, pattern, post_on, qp_attr, rdma, sge};
use crate::clock::{Clock, MonotonicClock, VirtualClock};
use crate::engine::PacerMode;
use crate::exports::on_create_cq;
use crate::mock::MockDevice;

/// An engine configured by `vars` reading `clock`, its pacer driven as `pacer` says,
/// attached to a mock device with one CQ.
fn with_cq(
    vars: &[(&str, &str)],
    clock: Arc<dyn Clock>,
    pacer: PacerMode,
) -> (Arc<crate::engine::Engine>, MockDevice, *mut ibv_cq) {
    let (engine, dev) = attached_on(vars, clock, pacer);
    let cq = dev.create_cq();
    // SAFETY: cq was just created on the engine's context.
    unsafe { on_create_cq(dev.context(), cq) };
    (engine, dev, cq)
}

/// Which QP each WQE that reached the provider was posted on, as runs: (QP number, WQEs).
fn runs(log: &[crate::mock::PostedWr]) -> Vec<(u32, usize)> {
    let mut out: Vec<(u32, usize)> = Vec::new();
    for w in log {
        match out.last_mut() {
            Some((qp, n)) if *qp == w.qp_num => *n += 1,
            _ => out.push((w.qp_num, 1)),
        }
    }
    out
}

/// One turn of 64 KiB between two QPs of 8 slots, each WRITEing 256 KiB in 16 KiB chunks:
/// the second waits in line while the first posts; a drain fills the first's 8 slots
/// (128 KiB, its turn spent), so when its completions let it post again it yields to the
/// second, which does the same, and each QP's last 8 chunks end its turn: 8 chunks a turn,
/// the QPs in alternation. Every byte arrives and each request completes once.
#[test]
fn one_turn_between_two_qps_alternates_them_by_turns() {
    let clock = Arc::new(VirtualClock::new());
    let (engine, dev, cq) = with_cq(
        &[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "16K"),
            ("JUSTITIA_QP_TURNS", "1:64K"),
        ],
        clock.clone(),
        PacerMode::Manual,
    );
    let qps = [
        create_qp(&dev, qp_attr(cq, 8)),
        create_qp(&dev, qp_attr(cq, 8)),
    ];
    // SAFETY: live QPs.
    let nums = qps.map(|q| unsafe { (*q).qp_num });
    let len = 256 << 10;
    let srcs = [pattern(len, 3), pattern(len, 9)];
    let mut dsts = [vec![0u8; len], vec![0u8; len]];
    for i in 0..2 {
        let mut s = [sge(&srcs[i], 0, len)];
        let mut w = rdma(
            IBV_WR_RDMA_WRITE,
            100 + i as u64,
            &mut s,
            dsts[i].as_mut_ptr() as u64,
            true,
        );
        assert_eq!(post_on(qps[i], &mut w), 0);
    }
    // The first filled its slots; the second posted nothing and waits in line.
    assert_eq!(runs(&dev.log()), [(nums[0], 8)]);
    assert_eq!(engine.stats().turn_waits, 1);
    let mut seen = Vec::new();
    let mut buf = [ibv_wc::default(); 8];
    for _ in 0..100 {
        let ran = dev.execute_all(qps[0]) + dev.execute_all(qps[1]);
        // SAFETY: a live CQ with room for 8 entries.
        let n = unsafe { ops::poll_cq(cq, 8, buf.as_mut_ptr()) };
        assert!(n >= 0);
        seen.extend_from_slice(&buf[..n as usize]);
        // A QP let in is due at once, or at the pacer's look at its slots if that was
        // set before (1 ms).
        clock.set(clock.now() + Duration::from_millis(1));
        engine.pacer_tick(clock.now());
        if ran == 0 && n == 0 && seen.len() == 2 {
            break;
        }
    }
    assert_eq!(
        runs(&dev.log()),
        [(nums[0], 8), (nums[1], 8), (nums[0], 8), (nums[1], 8)]
    );
    let mut ids: Vec<u64> = seen.iter().map(|w| w.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [100, 101]);
    assert!(seen.iter().all(|w| w.status == IBV_WC_SUCCESS));
    assert_eq!(srcs, dsts);
    let stats = engine.stats();
    assert_eq!((stats.turn_waits, stats.turn_yields), (1, 2), "{stats:?}");
    forget(&dev, &qps, cq);
}

/// A QP destroyed while it holds the one turn, with requests still queued, hands the turn
/// to the QP in line.
#[test]
fn a_destroyed_holder_hands_its_turn_on() {
    let clock = Arc::new(VirtualClock::new());
    let (engine, dev, cq) = with_cq(
        &[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "16K"),
            ("JUSTITIA_QP_TURNS", "1"),
        ],
        clock.clone(),
        PacerMode::Manual,
    );
    let qps = [
        create_qp(&dev, qp_attr(cq, 8)),
        create_qp(&dev, qp_attr(cq, 8)),
    ];
    // SAFETY: live QPs.
    let nums = qps.map(|q| unsafe { (*q).qp_num });
    let len = 256 << 10;
    let src = pattern(len, 5);
    let mut dst = vec![0u8; len];
    for &qp in &qps {
        let mut s = [sge(&src, 0, len)];
        let mut w = rdma(IBV_WR_RDMA_WRITE, 7, &mut s, dst.as_mut_ptr() as u64, true);
        assert_eq!(post_on(qp, &mut w), 0);
    }
    assert_eq!(runs(&dev.log()), [(nums[0], 8)]);
    // The first QP goes, its 8 queued chunks with it.
    let token = crate::engine::qp_token(qps[0]).unwrap();
    crate::engine::unregister_qp(qps[0], token);
    engine.pacer_tick(clock.now());
    assert_eq!(runs(&dev.log()), [(nums[0], 8), (nums[1], 8)]);
    forget(&dev, &qps[1..], cq);
}

/// Two QPs of 8 slots each post a 256 KiB WRITE in 16 KiB chunks on `engine` (mock
/// device `dev`, CQ `cq`); returns them with their QP numbers.
fn two_writes(
    dev: &MockDevice,
    cq: *mut ibv_cq,
    src: &[u8],
    dst: &mut [u8],
) -> ([*mut ibv_qp; 2], [u32; 2]) {
    let qps = [
        create_qp(dev, qp_attr(cq, 8)),
        create_qp(dev, qp_attr(cq, 8)),
    ];
    // SAFETY: live QPs.
    let nums = qps.map(|q| unsafe { (*q).qp_num });
    for &qp in &qps {
        let mut s = [sge(src, 0, src.len())];
        let mut w = rdma(IBV_WR_RDMA_WRITE, 7, &mut s, dst.as_mut_ptr() as u64, true);
        assert_eq!(post_on(qp, &mut w), 0);
    }
    (qps, nums)
}

/// Turns put in force at a tick take hold for the next requests (the QPs lose their fast
/// lane), and their end lets the QP in line post at the pacer's next look.
#[test]
fn turns_begun_at_a_tick_take_hold_and_their_end_lets_the_waiter_post() {
    let clock = Arc::new(VirtualClock::new());
    let (engine, dev, cq) = with_cq(
        &[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "16K"),
            ("JUSTITIA_DAEMON", "off"),
        ],
        clock.clone(),
        PacerMode::Manual,
    );
    let one = TurnBudget {
        open: 1,
        turn_bytes: 64 << 10,
    };
    engine.apply(
        crate::follow::Settings {
            turns: Some(one),
            ..engine.settings()
        },
        clock.now(),
    );
    assert_eq!(engine.settings().turns, Some(one));
    let len = 256 << 10;
    let src = pattern(len, 5);
    let mut dst = vec![0u8; len];
    let (qps, nums) = two_writes(&dev, cq, &src, &mut dst);
    assert_eq!(runs(&dev.log()), [(nums[0], 8)]);
    assert_eq!(engine.stats().turn_waits, 1);
    // The turns end: the QP in line is woken, due now.
    engine.apply(
        crate::follow::Settings {
            turns: None,
            ..engine.settings()
        },
        clock.now(),
    );
    engine.pacer_tick(clock.now());
    assert_eq!(runs(&dev.log()), [(nums[0], 8), (nums[1], 8)]);
    forget(&dev, &qps, cq);
}

/// Under a daemon with 1 turn of 64 KiB for the host, a process alone in its tenant gets
/// that turn: its second QP waits in line, and the wait reaches the daemon's tenant
/// report with the turns. A process's own `JUSTITIA_QP_TURNS` may lower the daemon's
/// share (here its turn's bytes), never raise it.
#[test]
fn under_a_daemon_the_qps_take_the_tenants_turns_and_their_waits_reach_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(dir.path(), "qp_turns = 1\nqp_turn_bytes = 65536\n");
    let socket = d.socket();
    let (engine, dev, cq) = with_cq(
        &[
            ("JUSTITIA_SOCKET", socket.to_str().unwrap()),
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "16K"),
            ("JUSTITIA_QP_TURNS", "4:32K"),
        ],
        Arc::new(MonotonicClock::new()),
        PacerMode::Thread,
    );
    // A first QP makes the flow the follower registers; the daemon's turns follow.
    let first = create_qp(&dev, qp_attr(cq, 8));
    let want = TurnBudget {
        open: 1,
        turn_bytes: 32 << 10,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.settings().turns != Some(want) {
        assert!(
            Instant::now() < deadline,
            "turns never followed: {:?} {:?}",
            engine.settings().turns,
            engine.follow_status()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let len = 256 << 10;
    let src = pattern(len, 5);
    let mut dst = vec![0u8; len];
    let (qps, nums) = two_writes(&dev, cq, &src, &mut dst);
    assert_eq!(runs(&dev.log()), [(nums[0], 8)]);
    assert_eq!(engine.stats().turn_waits, 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let tenants = match d.admin(&AdminRequest::Tenants) {
            AdminReply::Tenants(t) => t,
            other => panic!("{other:?}"),
        };
        if tenants.first().is_some_and(|t| t.qp_turn_waits == 1) {
            assert_eq!(tenants[0].qp_turns, Some(1), "{tenants:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "waits never reported: {tenants:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    forget(&dev, &[first, qps[0], qps[1]], cq);
}
