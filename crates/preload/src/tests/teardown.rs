//! Destroy, reset and registration against a provider that leaves completions behind: the
//! pacer never reaches a destroyed QP's CQ, the shaper's tags never reach the application,
//! a completion from before a reset never completes a later request, and registering a
//! reused address never deadlocks.

use std::time::Duration;

use justitia_verbs::sys::*;

use super::{create_qp, pattern, post_on, qp_attr, rdma, rig_with, sge, to_error};
use crate::clock::Clock;
use crate::engine;

const BW: &[(&str, &str)] = &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "64K")];

/// The tags (`wr_id`s the shaper put on its WQEs) among `wcs`: any is a leak.
fn tags_among(wcs: &[ibv_wc], app_ids: &[u64]) -> Vec<u64> {
    wcs.iter()
        .map(|w| w.wr_id)
        .filter(|id| !app_ids.contains(id))
        .collect()
}

/// The pacer holds a QP by `Arc` (its due list) while the application destroys it: the
/// pacer's turn for that QP must not poll its send CQ, which the application may have
/// destroyed as well.
#[test]
fn the_pacer_never_polls_the_cq_of_a_qp_destroyed_under_it() {
    let r = rig_with(BW, 4, false);
    let src = pattern(1 << 20, 1);
    let mut dst = vec![0u8; 1 << 20];
    let mut s = [sge(&src, 0, 1 << 20)];
    let w = rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, false);
    assert_eq!(r.post(&mut [w]).0, 0);
    assert_eq!(
        r.dev.queued(r.qp),
        4,
        "four chunks fill the queue, twelve wait"
    );
    let held_by_pacer = engine::QPS.get_arc(r.qp.cast()).unwrap();
    let rc = engine::destroy_qp(r.qp, || {
        r.dev.destroy_qp(r.qp);
        0
    });
    assert_eq!(rc, 0);
    // Another QP's completion waits in the CQ: a poll would take it.
    r.dev.push_completion(
        r.cq,
        ibv_wc {
            wr_id: 77,
            qp_num: 4242,
            ..Default::default()
        },
    );
    held_by_pacer.progress(r.clock.now() + Duration::from_secs(1));
    assert_eq!(
        r.dev.cq_entries(r.cq),
        1,
        "the pacer polled the CQ of a destroyed QP"
    );
    assert_eq!(r.dev.posts_after_destroy(), 0);
}

/// A provider that leaves a destroyed QP's completions in the CQ: the one of a request
/// that completed before the destroy carries the shaper's tag, which must not reach the
/// application; a completion of another kind (a receive's) is still delivered as it was.
#[test]
fn a_destroyed_qps_completions_left_in_the_cq_never_show_a_tag() {
    let r = rig_with(BW, 8, false);
    r.dev.keep_stale_completions();
    let src = pattern(100, 2);
    let mut dst = vec![0u8; 100];
    let mut s = [sge(&src, 0, 100)];
    let w = rdma(IBV_WR_RDMA_WRITE, 5, &mut s, dst.as_mut_ptr() as u64, true);
    assert_eq!(r.post(&mut [w]).0, 0);
    r.dev.execute_all(r.qp);
    // SAFETY: a live mock QP.
    let qp_num = unsafe { (*r.qp).qp_num };
    r.dev.push_completion(
        r.cq,
        ibv_wc {
            wr_id: 9,
            qp_num,
            opcode: IBV_WC_RECV,
            ..Default::default()
        },
    );
    let rc = engine::destroy_qp(r.qp, || {
        r.dev.destroy_qp(r.qp);
        0
    });
    assert_eq!(rc, 0);
    let got = r.poll();
    assert_eq!(tags_among(&got, &[5, 9]), Vec::<u64>::new());
    assert!(got.iter().any(|w| w.wr_id == 9), "the receive is delivered");
}

/// The application polls the CQ on another thread while it destroys the CQ's only shaped
/// QP, after the shaper has taken the QP out of the CQ's list and before the provider has
/// destroyed it: the QP's completion waiting there carries the shaper's tag, which must not
/// reach the application (the CQ, with no shaped QP left, would otherwise pass its polls
/// straight through).
#[test]
fn a_poll_during_a_destroy_never_shows_the_departing_qps_tag() {
    let r = rig_with(BW, 8, false);
    r.dev.keep_stale_completions();
    let src = pattern(100, 3);
    let mut dst = vec![0u8; 100];
    let mut s = [sge(&src, 0, 100)];
    let w = rdma(IBV_WR_RDMA_WRITE, 5, &mut s, dst.as_mut_ptr() as u64, true);
    assert_eq!(r.post(&mut [w]).0, 0);
    r.dev.execute_all(r.qp);
    let mut during = Vec::new();
    let rc = engine::destroy_qp(r.qp, || {
        during = r.poll();
        r.dev.destroy_qp(r.qp);
        0
    });
    assert_eq!(rc, 0);
    assert_eq!(
        tags_among(&during, &[5]),
        Vec::<u64>::new(),
        "during the destroy"
    );
    let after = r.poll();
    assert_eq!(tags_among(&after, &[5]), Vec::<u64>::new(), "after it");
    let cq = engine::cq(r.cq).unwrap();
    assert_eq!(
        cq.shaped.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the departed QP forgotten once its CQ was polled clean"
    );
}

/// A QP created after another was destroyed with a completion left in the shared CQ (its
/// ring may be allocated where the old one was): the old completion never settles a
/// request of the new QP that has not run.
#[test]
fn a_destroyed_qps_stale_completion_never_completes_a_new_qps_request() {
    let r = rig_with(BW, 8, false);
    r.dev.keep_stale_completions();
    let src = pattern(100, 4);
    let mut dst = vec![0u8; 100];
    let mut s = [sge(&src, 0, 100)];
    let w = rdma(IBV_WR_RDMA_WRITE, 5, &mut s, dst.as_mut_ptr() as u64, true);
    assert_eq!(r.post(&mut [w]).0, 0);
    r.dev.execute_all(r.qp);
    let rc = engine::destroy_qp(r.qp, || {
        r.dev.destroy_qp(r.qp);
        0
    });
    assert_eq!(rc, 0);
    let y = create_qp(&r.dev, qp_attr(r.cq, 8));
    let mut s = [sge(&src, 0, 100)];
    let mut w = rdma(
        IBV_WR_RDMA_WRITE,
        200,
        &mut s,
        dst.as_mut_ptr() as u64,
        true,
    );
    assert_eq!(post_on(y, &mut w), 0);
    let got = r.poll();
    let ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
    assert!(
        !ids.contains(&200),
        "Y's request completed before it ran: {ids:#x?}"
    );
    assert_eq!(tags_among(&got, &[5]), Vec::<u64>::new());
    r.dev.execute_all(y);
    let got: Vec<u64> = r.poll().iter().map(|w| w.wr_id).collect();
    assert_eq!(got, vec![200], "Y's request completes once, when it ran");
    assert_eq!(engine::destroy_qp(y, || 0), 0);
}

/// A QP reset while its completions wait in the CQ (the provider keeps them across RESET)
/// and used again: a stale success never completes a new request, and the new request
/// completes exactly once, after it ran.
#[test]
fn a_completion_from_before_a_reset_never_completes_a_new_request() {
    let r = rig_with(BW, 4, false);
    let src = pattern(100, 3);
    let mut dst = vec![0u8; 100];
    for id in 0..4u64 {
        let mut s = [sge(&src, 0, 100)];
        let w = rdma(IBV_WR_RDMA_WRITE, id, &mut s, dst.as_mut_ptr() as u64, true);
        assert_eq!(r.post(&mut [w]).0, 0);
    }
    r.dev.execute_all(r.qp);
    assert_eq!(r.dev.cq_entries(r.cq), 4);
    r.dev.reset_qp(r.qp);
    let attr = ibv_qp_attr {
        qp_state: IBV_QPS_RESET,
        ..Default::default()
    };
    engine::qp(r.qp).unwrap().on_modify(&attr, IBV_QP_STATE);
    let mut s = [sge(&src, 0, 100)];
    let w = rdma(
        IBV_WR_RDMA_WRITE,
        100,
        &mut s,
        dst.as_mut_ptr() as u64,
        true,
    );
    assert_eq!(r.post(&mut [w]).0, 0);
    let got = r.poll();
    let ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
    assert!(
        !ids.contains(&100),
        "request 100 completed before it ran: {ids:#x?}"
    );
    assert_eq!(tags_among(&got, &[0, 1, 2, 3]), Vec::<u64>::new());
    r.dev.execute_all(r.qp);
    let got: Vec<u64> = r.poll().iter().map(|w| w.wr_id).collect();
    assert_eq!(got, vec![100]);
}

/// A CQ of one shaped QP also serves a QP the shaper only observes (UD), whose
/// application happens to use a `wr_id` equal to one of the shaped QP's tags: that
/// completion is the UD QP's, delivered as it is, and settles nothing on the shaped QP.
#[test]
fn a_completion_of_another_qp_is_never_settled_on_the_sole_shaped_qps_ring() {
    let r = rig_with(BW, 8, false);
    let src = pattern(100, 5);
    let mut dst = vec![0u8; 100];
    let mut s = [sge(&src, 0, 100)];
    let w = rdma(IBV_WR_RDMA_WRITE, 5, &mut s, dst.as_mut_ptr() as u64, true);
    assert_eq!(r.post(&mut [w]).0, 0);
    let tag = r.log()[0].wr_id;
    let mut a = qp_attr(r.cq, 8);
    a.qp_type = IBV_QPT_UD;
    let ud = create_qp(&r.dev, a);
    let mut w = rdma(IBV_WR_SEND, tag, &mut [], 0, true);
    assert_eq!(post_on(ud, &mut w), 0);
    r.dev.execute_all(ud);
    // SAFETY: a live mock QP.
    let ud_num = unsafe { (*ud).qp_num };
    let got: Vec<(u64, u32)> = r.poll().iter().map(|w| (w.wr_id, w.qp_num)).collect();
    assert_eq!(
        got,
        vec![(tag, ud_num)],
        "the UD QP's own completion, as it is"
    );
    r.dev.execute_all(r.qp);
    let got: Vec<u64> = r.poll().iter().map(|w| w.wr_id).collect();
    assert_eq!(
        got,
        vec![5],
        "the shaped QP's request completes when it ran"
    );
    assert_eq!(engine::destroy_qp(ud, || 0), 0);
}

/// A QP address registered again on the same CQ (a QP destroyed behind the shaper's back,
/// its address reused) is registered, without a deadlock.
#[test]
fn registering_a_reused_qp_address_on_the_same_cq_does_not_deadlock() {
    let r = rig_with(BW, 8, false);
    let qp2 = create_qp(&r.dev, qp_attr(r.cq, 8));
    let (tx, rx) = std::sync::mpsc::channel();
    let (qp_addr, cq_addr) = (qp2 as usize, r.cq as usize);
    std::thread::spawn(move || {
        let attr = qp_attr(cq_addr as *mut ibv_cq, 8);
        // SAFETY: a live mock QP, registered again as if its address had been reused.
        unsafe { crate::exports::on_create_qp(qp_addr as *mut ibv_qp, &attr) };
        let _ = tx.send(());
    });
    if rx.recv_timeout(Duration::from_secs(5)).is_err() {
        // Its drop would wait for the CQ lock the stuck thread holds.
        std::mem::forget(r);
        panic!("registering a reused QP address hung");
    }
    let cq = engine::cq(r.cq).unwrap();
    assert_eq!(
        cq.shaped.load(std::sync::atomic::Ordering::Relaxed),
        2,
        "the old registration replaced, not added to"
    );
    assert_eq!(engine::destroy_qp(qp2, || 0), 0);
}

/// A destroy the provider refuses leaves the QP as it was, the completions the shaper held
/// for it included (here the flush of a request held when the QP moved to the error state).
#[test]
fn a_refused_destroy_keeps_the_completions_held_for_the_qp() {
    let r = rig_with(BW, 4, false);
    let src = pattern(1 << 20, 6);
    let mut dst = vec![0u8; 1 << 20];
    let mut s = [sge(&src, 0, 1 << 20)];
    let w = rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, true);
    assert_eq!(r.post(&mut [w]).0, 0);
    to_error(r.qp);
    assert_eq!(engine::destroy_qp(r.qp, || libc::EBUSY), libc::EBUSY);
    let got: Vec<(u64, u32)> = r.poll().iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, vec![(1, IBV_WC_WR_FLUSH_ERR)]);
}
