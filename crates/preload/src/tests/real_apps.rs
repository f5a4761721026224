//! The shaper under real applications: loaded through `dlopen`, destroying objects with
//! requests held, moving QPs to the error state, not polling, forking. Each test here
//! reproduces one way an application that runs without the shaper failed with it.

use std::sync::Arc;
use std::time::Duration;

use justitia_verbs::sys::*;

use super::{
    attached, create_qp, lookup, pattern, post_on, qp_attr, rdma, rig, rig_device, rig_with, sge,
};
use crate::clock::{Clock, VirtualClock};
use crate::engine::{self, PacerMode};
use crate::exports::{engine_from, on_create_cq};
use crate::mock::MockDevice;

/// An application (NCCL, a ctypes binding) loads libibverbs with `dlopen(RTLD_LOCAL)` after
/// the shaper: the shaper must still reach the real verbs, found in the library actually
/// loaded; looking in the global scope after itself (`RTLD_NEXT`) finds nothing there.
#[test]
fn real_verbs_are_found_in_a_libibverbs_loaded_with_rtld_local() {
    // SAFETY: loading libibverbs runs its constructors, which only register providers.
    let handle = unsafe {
        libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    if handle.is_null() {
        eprintln!("skipping: libibverbs.so.1 is not installed");
        return;
    }
    // SAFETY: the names are NUL-terminated; the address is not called.
    let (expected, next) = unsafe {
        (
            libc::dlvsym(
                handle,
                c"ibv_ack_cq_events".as_ptr(),
                c"IBVERBS_1.1".as_ptr(),
            ),
            justitia_verbs::loader::next_symbol(c"ibv_ack_cq_events", Some(c"IBVERBS_1.1")),
        )
    };
    assert!(!expected.is_null());
    assert!(
        next.is_none(),
        "a local library is outside the global scope"
    );
    // Through the export: libibverbs' own ibv_ack_cq_events counts the acknowledged event
    // in the CQ (a mock CQ; the shaper has none of its own events to take out).
    let dev = MockDevice::new();
    let cq = dev.create_cq();
    // SAFETY: a live CQ.
    unsafe { crate::exports::justitia_ibv_ack_cq_events_1_1(cq, 1) };
    // SAFETY: as above.
    assert_eq!(
        unsafe { (*cq).comp_events_completed },
        1,
        "the real verb was reached"
    );
}

const PACED_64K: &[(&str, &str)] = &[
    ("JUSTITIA_CLASS", "bandwidth"),
    ("JUSTITIA_CHUNK", "64K"),
    ("JUSTITIA_RATE", "10M"),
];

/// `ibv_destroy_qp` used to destroy through the provider first and forget the QP after,
/// while the pacer thread (or another CQ's poll) could drain the QP's held requests into the
/// provider's `post_send` in between. Here the pacer runs inside the provider's destroy,
/// where that thread could: nothing may reach the destroyed QP, then or later.
#[test]
fn destroying_a_qp_with_paced_requests_held_posts_nothing_to_it() {
    let r = rig_with(PACED_64K, 64, false);
    // The buffers stay alive to the end: held chunks still point into them.
    let (_src, _dst) = r.post_write(1 << 20, 3, 1, true);
    let posted = r.log().len();
    assert!(posted < 16, "chunks are held for tokens ({posted} posted)");
    let later = r.clock.now() + Duration::from_secs(1);
    let rc = engine::destroy_qp(r.qp, || {
        r.dev.destroy_qp(r.qp);
        r.engine.pacer_tick(later);
        0
    });
    assert_eq!(rc, 0);
    r.clock.set(later + Duration::from_secs(1));
    r.engine.pacer_tick(r.clock.now());
    assert!(r.poll().is_empty());
    assert_eq!(r.dev.posts_after_destroy(), 0);
    assert_eq!(r.log().len(), posted);
    assert!(engine::qp_token(r.qp).is_none(), "forgotten");
}

/// A provider that refuses the destroy leaves the QP as it was: still shaped, its held
/// requests still going out.
#[test]
fn a_refused_destroy_leaves_the_qp_shaped() {
    let r = rig_with(PACED_64K, 64, false);
    let (src, dst) = r.post_write(1 << 20, 4, 9, true);
    assert_eq!(engine::destroy_qp(r.qp, || libc::EBUSY), libc::EBUSY);
    let mut seen = Vec::new();
    for _ in 0..1000 {
        r.clock.advance(Duration::from_millis(10));
        r.engine.pacer_tick(r.clock.now());
        seen.extend(r.run());
        if !seen.is_empty() {
            break;
        }
    }
    assert_eq!(seen.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [9]);
    assert_eq!(r.log().len(), 16);
    assert_eq!(src, dst);
}

/// Completions the shaper made for a QP (flush errors of requests that never reached a
/// failed QP) were still delivered after the QP was destroyed; a provider purges a
/// destroyed QP's completions, and so must the shaper.
#[test]
fn completions_held_for_a_destroyed_qp_are_not_delivered() {
    let r = rig_with(PACED_64K, 64, false);
    let (src, mut dst) = r.post_write(1 << 20, 5, 2, true);
    let mut s2 = [sge(&src, 0, 4096)];
    let mut w2 = [rdma(
        IBV_WR_RDMA_WRITE,
        3,
        &mut s2,
        dst.as_mut_ptr() as u64,
        true,
    )];
    assert_eq!(r.post(&mut w2).0, 0);
    // The first chunk fails: the rest is flushed, with completions the shaper makes.
    r.dev.fail_next(r.qp, IBV_WC_REM_ACCESS_ERR);
    r.dev.execute_all(r.qp);
    let mut first = [ibv_wc::default(); 1];
    // SAFETY: a live CQ and room for one completion.
    let n = unsafe { justitia_verbs::ops::poll_cq(r.cq, 1, first.as_mut_ptr()) };
    assert_eq!(
        (n, first[0].wr_id, first[0].status),
        (1, 2, IBV_WC_REM_ACCESS_ERR)
    );
    let rc = engine::destroy_qp(r.qp, || {
        r.dev.destroy_qp(r.qp);
        0
    });
    assert_eq!(rc, 0);
    assert!(r.poll().is_empty(), "nothing of the destroyed QP");
}

/// State of destroyed QPs, CQs and completion channels (an eventfd each) was kept until the
/// device context closed, which librdmacm never does: a server dropping connections ran
/// out of descriptors. Now it is freed at destroy, and the descriptor count stays flat.
#[test]
fn destroyed_qps_cqs_and_channels_free_their_state_and_descriptors() {
    let clock = Arc::new(VirtualClock::new());
    let engine = engine_from(
        lookup(&[("JUSTITIA_CLASS", "bandwidth")]),
        clock,
        PacerMode::Manual,
    )
    .unwrap();
    let dev = MockDevice::new();
    let ctx = dev.context();
    // SAFETY: a fresh mock context.
    assert!(unsafe { crate::install::attach_context(ctx, Arc::clone(&engine)) });
    let open_fds = || std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let before = open_fds();
    let mut channels: Vec<Box<ibv_comp_channel>> = Vec::new();
    let mut weak = None;
    for _ in 0..400 {
        let mut ch = Box::new(ibv_comp_channel {
            context: ctx,
            fd: -1,
            refcnt: 0,
        });
        let cq = dev.create_cq_on(&mut *ch);
        // SAFETY: cq was just created on ctx.
        unsafe { on_create_cq(ctx, cq) };
        let qp = create_qp(&dev, qp_attr(cq, 16));
        weak = Some(Arc::downgrade(&engine::QPS.get_arc(qp.cast()).unwrap()));
        assert_eq!(engine::destroy_qp(qp, || 0), 0);
        engine::unregister_cq(cq, engine::cq_token(cq).unwrap());
        channels.push(ch);
    }
    let after = open_fds();
    assert!(
        after <= before + 50,
        "descriptors grew from {before} to {after} over 400 connections"
    );
    assert!(
        weak.and_then(|w| w.upgrade()).is_none(),
        "the last QP's state is freed"
    );
    engine::detach_context(ctx);
}

/// Issue 10, item 6: the QP's receives complete on the same CQ as its sends. When it fails,
/// a receive is flushed carrying the same `wr_id` as a send in flight; error completions
/// have no meaningful opcode, and the shaper used to take the receive's flush for the
/// send's completion, hiding the send's real status and then dropping the receive's.
#[test]
fn a_receive_flush_with_a_sends_wr_id_is_not_taken_for_the_send() {
    let r = rig_with(
        &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "4K")],
        16,
        false,
    );
    // The buffers stay alive to the end: held chunks still point into them.
    let (_src, _dst) = r.post_write(8192, 6, 7, true);
    assert_eq!(r.log().len(), 2, "two chunks");
    // SAFETY: the rig's live QP.
    let qp_num = unsafe { (*r.qp).qp_num };
    r.dev.push_completion(
        r.cq,
        ibv_wc {
            wr_id: 7,
            status: IBV_WC_WR_FLUSH_ERR,
            qp_num,
            ..Default::default()
        },
    );
    r.dev.fail_next(r.qp, IBV_WC_REM_ACCESS_ERR);
    assert_eq!(
        r.run()
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect::<Vec<_>>(),
        [(7, IBV_WC_WR_FLUSH_ERR), (7, IBV_WC_REM_ACCESS_ERR)],
        "the receive's flush, then the send's own error (its first chunk's)"
    );
}

/// Tells the shaper what `ibv_modify_qp(qp, attr, mask)` set.
fn modify(qp: *mut ibv_qp, attr: ibv_qp_attr, mask: u32) {
    engine::qp(qp).unwrap().on_modify(&attr, mask);
}

/// Issue 10, item 9: `JUSTITIA_CHUNK=1` turned a request into a WQE per byte. Chunks are
/// now floored at the QP's path MTU.
#[test]
fn a_one_byte_chunk_setting_is_floored_at_the_path_mtu() {
    let r = rig_with(
        &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1")],
        64,
        false,
    );
    modify(
        r.qp,
        ibv_qp_attr {
            path_mtu: IBV_MTU_1024,
            ..Default::default()
        },
        IBV_QP_PATH_MTU,
    );
    let (src, dst) = r.post_write(16384, 8, 1, true);
    let lens: Vec<u64> = r.log().iter().map(|w| w.len()).collect();
    assert_eq!(lens, vec![1024; 16], "one MTU per chunk");
    assert_eq!(r.run().len(), 1);
    assert_eq!(src, dst);
}

/// Posts one RDMA WRITE of `len` bytes with `JUSTITIA_CHUNK=64K` on a QP with a 1 KiB path
/// MTU, on a device taken for Soft-RoCE when `soft_roce`, paced at 10 MB/s when `paced`;
/// drives the pacer until it completes. Returns the lengths of the WQEs the provider got.
fn write_on(len: usize, soft_roce: bool, paced: bool) -> Vec<u64> {
    let mut vars = vec![("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "64K")];
    if paced {
        vars.push(("JUSTITIA_RATE", "10M"));
    }
    let r = rig_device(&vars, 128, false, std::ptr::null_mut(), soft_roce);
    modify(
        r.qp,
        ibv_qp_attr {
            path_mtu: IBV_MTU_1024,
            ..Default::default()
        },
        IBV_QP_PATH_MTU,
    );
    let (src, dst) = r.post_write(len, 12, 5, true);
    let mut wcs = Vec::new();
    while wcs.is_empty() && r.clock.now() < Duration::from_secs(1) {
        let next = r.engine.pacer_tick(r.clock.now());
        wcs.extend(r.run());
        r.clock
            .set(next.unwrap_or(r.clock.now() + Duration::from_millis(1)));
    }
    assert_eq!(
        wcs.iter()
            .map(|w| (w.wr_id, w.status, w.byte_len))
            .collect::<Vec<_>>(),
        [(5, IBV_WC_SUCCESS, len as u32)],
        "one completion, the request's"
    );
    assert_eq!(src, dst);
    r.log().iter().map(|w| w.len()).collect()
}

/// A paced 64 KiB WRITE on Soft-RoCE across two hosts failed with
/// `IBV_WC_REM_INV_REQ_ERR`: rxe's retransmission of a multi-packet WRITE whose last
/// packet's acknowledgement arrives while it is being resent leaves rxe's acknowledged PSN
/// past a WRITE it has not completed, and its next retry replays that WRITE as a
/// zero-length WRITE ONLY one PSN late, shifting the rest of the stream (see
/// `QpState::chunk_bytes_for`). On rxe a bandwidth flow's WRITE now goes one path MTU a
/// WQE, paced or not (a flow whose daemon is slow falls back to unpaced), which rxe never
/// half resends; the application still sees one completion of its 64 KiB.
#[test]
fn a_write_on_soft_roce_goes_one_path_mtu_a_wqe() {
    assert_eq!(write_on(65536, true, true), vec![1024; 64]);
    assert_eq!(write_on(65536, true, false), vec![1024; 64]);
    // Below the chunk too: the fast lane posts only single-packet requests whole there.
    assert_eq!(
        write_on(5000, true, true),
        vec![1024, 1024, 1024, 1024, 904]
    );
}

/// The single-packet WQEs are Soft-RoCE's only: elsewhere a 64 KiB WRITE with 64 KiB chunks
/// is posted whole, as the application gave it.
#[test]
fn a_write_elsewhere_keeps_its_chunk() {
    assert_eq!(write_on(65536, false, true), vec![65536]);
    assert_eq!(write_on(65536, false, false), vec![65536]);
}

/// Issue 10, item 10: a READ was cut into chunks regardless of `max_rd_atomic`; the NIC
/// holds back READs beyond that depth, so each extra piece cost a round trip. A READ now
/// goes in at most `max_rd_atomic` pieces.
#[test]
fn a_read_is_cut_into_no_more_pieces_than_max_rd_atomic() {
    let r = rig_with(
        &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "4K")],
        64,
        false,
    );
    modify(
        r.qp,
        ibv_qp_attr {
            max_rd_atomic: 4,
            ..Default::default()
        },
        IBV_QP_MAX_QP_RD_ATOMIC,
    );
    let remote = pattern(65536, 9);
    let local = vec![0u8; 65536];
    let mut s = [sge(&local, 0, 65536)];
    let mut w = [rdma(
        IBV_WR_RDMA_READ,
        3,
        &mut s,
        remote.as_ptr() as u64,
        true,
    )];
    assert_eq!(r.post(&mut w).0, 0);
    let lens: Vec<u64> = r.log().iter().map(|w| w.len()).collect();
    assert_eq!(lens, vec![16384; 4]);
    let wcs = r.run();
    assert_eq!((wcs.len(), wcs[0].wr_id, wcs[0].byte_len), (1, 3, 65536));
    assert_eq!(remote, local);
    // A WRITE on the same QP is still cut at the configured chunk.
    let mut s = [sge(&local, 0, 16384)];
    let mut dst = vec![0u8; 16384];
    let mut w = [rdma(
        IBV_WR_RDMA_WRITE,
        4,
        &mut s,
        dst.as_mut_ptr() as u64,
        true,
    )];
    assert_eq!(r.post(&mut w).0, 0);
    assert_eq!(r.log().len(), 8);
    r.run();
    assert_eq!(&dst[..], &local[..16384]);
}

/// Many QPs share one CQ: every completion is attributed to its own QP (found by number).
#[test]
fn completions_of_many_qps_on_one_cq_reach_their_own_qp() {
    let r = rig_with(
        &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "4K")],
        16,
        false,
    );
    let mut qps = Vec::new();
    for _ in 0..40 {
        qps.push(create_qp(&r.dev, qp_attr(r.cq, 8)));
    }
    let src = pattern(8192, 10);
    let mut dst = vec![0u8; 8192 * 40];
    for (i, &qp) in qps.iter().enumerate().rev() {
        let mut s = [sge(&src, 0, 8192)];
        let mut w = rdma(
            IBV_WR_RDMA_WRITE,
            1000 + i as u64,
            &mut s,
            dst.as_mut_ptr() as u64 + 8192 * i as u64,
            true,
        );
        assert_eq!(post_on(qp, &mut w), 0);
        r.dev.execute_all(qp);
    }
    let mut got: Vec<(u64, u32)> = r.poll().iter().map(|w| (w.wr_id, w.qp_num)).collect();
    got.sort_unstable();
    let want: Vec<(u64, u32)> = qps
        .iter()
        .enumerate()
        // SAFETY: live QPs.
        .map(|(i, &qp)| (1000 + i as u64, unsafe { (*qp).qp_num }))
        .collect();
    assert_eq!(got, want);
    for &qp in &qps {
        assert_eq!(engine::destroy_qp(qp, || 0), 0);
    }
}

/// Issue 10, item 11: `fork()` while another thread holds one of the shaper's locks (the
/// pacer draining a QP) left that lock held for ever in the child, whose next post on the
/// QP hung. The child now passes every call through.
#[test]
fn a_child_forked_while_a_qp_is_locked_passes_its_posts_through() {
    let r = rig(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "4K")]);
    let src = pattern(8192, 11);
    let mut dst = vec![0u8; 8192];
    let state = &engine::qp(r.qp).unwrap().state;
    let held = state.lock();
    // SAFETY: the child only posts on the mock (no lock another thread can hold in it
    // but the shaper's) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mut s = [sge(&src, 0, 8192)];
        let mut w = rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, true);
        // On the child's copy of the mock's QP.
        let rc = post_on(r.qp, &mut w);
        let whole = r.log().len() == 1;
        // SAFETY: leaves the child at once, running nothing of the parent's.
        unsafe { libc::_exit(if rc == 0 && whole { 0 } else { 1 }) };
    }
    let status = reap(pid);
    drop(held);
    let status = status.expect("the child hung on the shaper's lock");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's post passed through whole (status {status})"
    );
}

/// The same with a CQ's poll lock held (the pacer polling the CQ for the application): the
/// child's polls of the CQ pass through, as its posts do. At the fork, the child marks the
/// CQs it inherited as needing no shaping, which keeps its polls away from the lock;
/// without that mark the child's poll hung on it.
#[test]
fn a_child_forked_while_a_cq_is_polled_passes_its_polls_through() {
    let r = rig(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "4K")]);
    let src = pattern(8192, 12);
    let mut dst = vec![0u8; 8192];
    let held = engine::cq(r.cq).unwrap().qps.lock();
    // SAFETY: as above.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mut s = [sge(&src, 0, 8192)];
        let mut w = rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, true);
        let posted = post_on(r.qp, &mut w) == 0;
        r.dev.execute_all(r.qp);
        let mut wc = [ibv_wc::default(); 2];
        // SAFETY: the child's copy of the mock's CQ, with room for 2 entries.
        let n = unsafe { justitia_verbs::ops::poll_cq(r.cq, 2, wc.as_mut_ptr()) };
        let whole = n == 1 && wc[0].wr_id == 1 && wc[0].status == IBV_WC_SUCCESS && src == dst;
        // SAFETY: leaves the child at once, running nothing of the parent's.
        unsafe { libc::_exit(if posted && whole { 0 } else { 1 }) };
    }
    let status = reap(pid);
    drop(held);
    let status = status.expect("the child hung on the shaper's lock");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's completion passed through as the provider gave it (status {status})"
    );
}

/// Waits up to 5 s for the child `pid` to exit; returns its status, or `None` (the child
/// killed) if it did not.
fn reap(pid: libc::pid_t) -> Option<libc::c_int> {
    assert!(pid > 0);
    let mut status = 0;
    for _ in 0..500 {
        // SAFETY: waits for our own child without blocking.
        if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: our own hung child.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, &mut status, 0);
    }
    None
}

/// Issue 10, item 7: a QP asking for an `ibv_wr_*` operation the bindings do not know (here
/// a flag past rdma-core 44's, as `IBV_QP_EX_WITH_FLUSH` is for rdma-core 45) used to get
/// the shaper's pointers for the operations it knows, while the unknown one stayed the
/// provider's and ran between the shaper's `ibv_wr_start` and `ibv_wr_complete`, never
/// posted. Such a QP now passes through whole, every pointer the provider's.
#[test]
fn a_qp_asking_for_send_ops_the_shaper_does_not_know_passes_through_whole() {
    let r = rig(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "4K")]);
    let ctx = r.dev.context();
    let create = |flags: u64| {
        let mut attr = ibv_qp_init_attr_ex {
            send_cq: r.cq,
            recv_cq: r.cq,
            qp_type: IBV_QPT_RC,
            cap: ibv_qp_cap {
                max_send_wr: 16,
                max_send_sge: 1,
                ..Default::default()
            },
            comp_mask: IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
            send_ops_flags: flags,
            ..Default::default()
        };
        // SAFETY: the mock context, through the shaper's installed create_qp_ex.
        let qp = unsafe { justitia_verbs::ops::create_qp_ex(ctx, &mut attr) };
        assert!(!qp.is_null());
        qp
    };
    let known = create(u64::from(IBV_QP_EX_WITH_RDMA_WRITE));
    let unknown = create(u64::from(IBV_QP_EX_WITH_RDMA_WRITE) | 1 << 20);
    let wr_start = |qp: *mut ibv_qp| {
        // SAFETY: a live extended QP.
        unsafe { (*qp.cast::<ibv_qp_ex>()).wr_start }.map(|f| f as usize)
    };
    let mock = MockDevice::new();
    let mock_qp = mock.create_qp(&mut ibv_qp_init_attr {
        qp_type: IBV_QPT_RC,
        ..Default::default()
    });
    assert_ne!(wr_start(known), wr_start(mock_qp), "shaped: the shaper's");
    assert_eq!(wr_start(unknown), wr_start(mock_qp), "the provider's own");
    assert!(engine::qp(known).unwrap().shaped);
    assert!(!engine::qp(unknown).unwrap().shaped);
    for qp in [known, unknown] {
        assert_eq!(engine::destroy_qp(qp, || 0), 0);
    }
}

/// Issue 10, item 8: the shaper's own signaled WQEs could overflow a CQ the application
/// sized for its own signaling. A QP whose send queue does not fit in what is left of its
/// CQ is only observed: its requests go whole, as the application posted them.
#[test]
fn a_qp_whose_send_queue_does_not_fit_its_cq_is_not_shaped() {
    let (_engine, dev) = attached(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "4K")]);
    let ctx = dev.context();
    let cq = dev.create_cq();
    dev.set_cq_size(cq, 24);
    // SAFETY: cq was just created on ctx.
    unsafe { on_create_cq(ctx, cq) };
    let new_qp = || create_qp(&dev, qp_attr(cq, 16));
    let first = new_qp();
    let second = new_qp();
    assert!(engine::qp(first).unwrap().shaped, "16 of 24 entries");
    assert!(!engine::qp(second).unwrap().shaped, "32 > 24 entries");
    let src = pattern(16384, 12);
    let mut dst = vec![0u8; 16384];
    let mut s = [sge(&src, 0, 16384)];
    let mut w = rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, true);
    assert_eq!(post_on(second, &mut w), 0);
    assert_eq!(dev.log().len(), 1, "posted whole");
    // The first QP's room comes back when it is destroyed.
    assert_eq!(engine::destroy_qp(first, || 0), 0);
    let third = new_qp();
    assert!(engine::qp(third).unwrap().shaped);
    for qp in [second, third] {
        assert_eq!(engine::destroy_qp(qp, || 0), 0);
    }
    engine::unregister_cq(cq, engine::cq_token(cq).unwrap());
}

/// The CQ-size rule counts the receives sharing the CQ: a QP of 16 send and 16 receive
/// slots whose completions all go to one CQ of 24 entries may have 32 waiting there under
/// the shaper, so it is only observed; the same QP with its receives on another CQ fits.
#[test]
fn the_cq_size_rule_counts_receives_sharing_the_cq() {
    let (_engine, dev) = attached(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "4K")]);
    let ctx = dev.context();
    let cq = dev.create_cq();
    dev.set_cq_size(cq, 24);
    let recv_cq = dev.create_cq();
    // SAFETY: both just created on ctx.
    unsafe {
        on_create_cq(ctx, cq);
        on_create_cq(ctx, recv_cq);
    }
    let with_receives = |recv| {
        let mut attr = qp_attr(cq, 16);
        attr.recv_cq = recv;
        attr.cap.max_recv_wr = 16;
        create_qp(&dev, attr)
    };
    let shared = with_receives(cq);
    assert!(
        !engine::qp(shared).unwrap().shaped,
        "16 sends + 16 receives > 24 entries"
    );
    assert_eq!(engine::destroy_qp(shared, || 0), 0);
    // Its receives left the CQ's count with it: a QP of 16 sends alone fits.
    let alone = create_qp(&dev, qp_attr(cq, 16));
    assert!(engine::qp(alone).unwrap().shaped, "16 sends of 24 entries");
    assert_eq!(engine::destroy_qp(alone, || 0), 0);
    let apart = with_receives(recv_cq);
    assert!(
        engine::qp(apart).unwrap().shaped,
        "16 sends of 24 entries, its receives elsewhere"
    );
    assert_eq!(engine::destroy_qp(apart, || 0), 0);
    for c in [cq, recv_cq] {
        engine::unregister_cq(c, engine::cq_token(c).unwrap());
    }
}

/// An unsignaled 1 MiB WRITE and a signaled SEND posted on a 4-deep send queue shaped in
/// 64 KiB chunks (the queue fills with chunks, 12 chunks and the SEND wait), then nobody
/// polls: `first` runs once the chunks on the wire have run, then the pacer alone must get
/// the SEND out. The WRITE's bytes land, and the SEND completes once, for the
/// application's next poll.
fn write_then_send_with_nobody_polling(first: impl FnOnce(&super::Rig), seed: u8) {
    let r = rig_with(
        &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "64K")],
        4,
        false,
    );
    let src = pattern(1 << 20, seed);
    let mut dst = vec![0u8; 1 << 20];
    let mut s1 = [sge(&src, 0, 1 << 20)];
    let mut s2 = [sge(&src, 0, 64)];
    let write = rdma(
        IBV_WR_RDMA_WRITE,
        1,
        &mut s1,
        dst.as_mut_ptr() as u64,
        false,
    );
    let mut send = rdma(IBV_WR_SEND, 2, &mut s2, 0, true);
    send.opcode = IBV_WR_SEND;
    assert_eq!(r.post(&mut [write, send]).0, 0);
    assert_eq!(r.log().len(), 4, "the queue is full of chunks");
    r.dev.execute_all(r.qp);
    first(&r);
    let sent = |r: &super::Rig| r.log().iter().any(|w| w.opcode == IBV_WR_SEND);
    for _ in 0..100 {
        if sent(&r) {
            break;
        }
        r.dev.execute_all(r.qp);
        r.clock.advance(Duration::from_millis(2));
        r.engine.pacer_tick(r.clock.now());
    }
    assert!(sent(&r), "the SEND went out with nobody polling");
    assert_eq!(r.log().len(), 17, "16 chunks and the SEND");
    r.dev.execute_all(r.qp);
    assert_eq!(src, dst);
    let wcs = r.run();
    assert_eq!(
        wcs.iter()
            .map(|w| (w.wr_id, w.opcode, w.status))
            .collect::<Vec<_>>(),
        [(2, IBV_WC_SEND, IBV_WC_SUCCESS)],
        "the SEND completes once"
    );
}

/// As [`requests_blocked_on_slots_go_out_without_the_application_polling`], but the
/// pacer's first poll of the send CQ comes while the application holds the QP's lock (it
/// is posting on another thread): the completion it finds cannot be settled then and is
/// held as the provider gave it, and every later one of the QP behind it. Those used to
/// wait for an application poll to settle them, which never came: the queue never got its
/// slots back and the SEND never went (the guest's hang case, about 3 runs in 100). The
/// pacer's next turn settles them itself.
#[test]
fn a_pacer_poll_that_meets_a_posting_thread_does_not_strand_the_queue() {
    write_then_send_with_nobody_polling(
        |r| {
            let qp = engine::qp(r.qp).unwrap();
            let cq = engine::cq(r.cq).unwrap();
            {
                let _posting = qp.state.lock();
                cq.poll_for_pacer(qp, r.clock.now());
            }
            assert!(cq.has_held(), "the completion found is held, unsettled");
        },
        14,
    );
}

/// Issue 10, item 3: an application posts an unsignaled 1 MiB WRITE and a SEND, then waits
/// for the peer's reply without polling its send CQ. Natively both go at once; under the
/// shaper the WRITE's chunks filled the send queue and the SEND waited for slots that only
/// a poll gives back, for ever. The pacer now polls the send CQ itself, and the completion
/// it finds is held for the application's next poll.
#[test]
fn requests_blocked_on_slots_go_out_without_the_application_polling() {
    write_then_send_with_nobody_polling(|_| {}, 13);
}
