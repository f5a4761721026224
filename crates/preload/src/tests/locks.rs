//! The lock rule (see the README's "Locks"): a verb call never waits for another thread's
//! provider call on another object. Each test holds a provider post inside the mock (on a
//! channel, not a clock) and checks that a verb on another object returns while it is
//! held; the old code waited for the post instead, which the tests turn into a failure
//! rather than a hang.

use std::sync::mpsc;
use std::time::Duration;

use justitia_verbs::ops;
use justitia_verbs::sys::*;

use super::{create_qp, forget, pattern, post_on, qp_attr, rdma, rig_with, sge};
use crate::exports::on_create_cq;

const BW: &[(&str, &str)] = &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "64K")];

/// How long a test waits for a verb that must not wait at all before it calls it stuck.
/// Nothing in the fixed code depends on it: the held post is let go only after the verb
/// returned, so on any machine, at any load, the verb either returns without the post or
/// never does. It only turns the old code's deadlock into a failure instead of a hang.
const STUCK: Duration = Duration::from_secs(60);

/// Polls `cq` once for up to 8 completions.
fn poll_once(cq: *mut ibv_cq) -> Vec<ibv_wc> {
    let mut buf = [ibv_wc::default(); 8];
    // SAFETY: a live CQ and room for 8 entries.
    let n = unsafe { ops::poll_cq(cq, 8, buf.as_mut_ptr()) };
    assert!(n >= 0, "poll failed: {n}");
    buf[..n as usize].to_vec()
}

/// Two QPs share a CQ. A thread posts on X and its post is held inside the provider,
/// with X's lock held by the shaper across it; meanwhile the CQ holds a completion of X's
/// general queue (a split request's, which needs X's lock to settle) and one of Y. A poll
/// of the CQ returns Y's completion without waiting for the post, and X's is delivered
/// once, by a poll after the post returned.
#[test]
fn a_poll_never_waits_for_another_threads_post_on_a_qp_of_its_cq() {
    let r = rig_with(BW, 8, false);
    let x = r.qp;
    let y = create_qp(&r.dev, qp_attr(r.cq, 8));
    let src = pattern(256 << 10, 3);
    let mut dst = vec![0u8; 256 << 10];
    let remote = dst.as_mut_ptr() as u64;
    // X: 256 KiB in four chunks, all posted; its completion is the general queue's.
    let mut s = [sge(&src, 0, 256 << 10)];
    let mut w = rdma(IBV_WR_RDMA_WRITE, 1, &mut s, remote, true);
    assert_eq!(post_on(x, &mut w), 0);
    assert_eq!(r.dev.queued(x), 4);
    r.dev.execute_all(x);
    // Y: one small request, settled on its ring.
    let mut s = [sge(&src, 0, 100)];
    let mut w = rdma(IBV_WR_RDMA_WRITE, 7, &mut s, remote, true);
    assert_eq!(post_on(y, &mut w), 0);
    r.dev.execute_all(y);
    assert_eq!(r.dev.cq_entries(r.cq), 2);

    let held = r.dev.hold_next_post(x);
    let poster = {
        let (src_addr, remote, x) = (src.as_ptr() as u64, remote, x as usize);
        std::thread::spawn(move || {
            let mut s = [ibv_sge {
                addr: src_addr,
                length: 100,
                lkey: 1,
            }];
            let mut w = rdma(IBV_WR_RDMA_WRITE, 50, &mut s, remote, true);
            post_on(x as *mut ibv_qp, &mut w)
        })
    };
    held.entered
        .recv_timeout(STUCK)
        .expect("the post reached the provider");

    let (done_tx, done_rx) = mpsc::channel();
    let cq = r.cq as usize;
    let poller = std::thread::spawn(move || {
        let got = poll_once(cq as *mut ibv_cq);
        let _ = done_tx.send(got.iter().map(|w| w.wr_id).collect::<Vec<u64>>());
    });
    let during = done_rx.recv_timeout(STUCK);
    // Let the post go whatever happened, so that every thread ends.
    let _ = held.go.send(());
    assert_eq!(poster.join().unwrap(), 0);
    poller.join().unwrap();
    let during = during.expect("the poll waited for another thread's post on X");
    assert_eq!(during, vec![7], "Y's completion, X's held behind the post");

    let after: Vec<u64> = poll_once(r.cq).iter().map(|w| w.wr_id).collect();
    assert_eq!(after, vec![1], "X's completion, once");
    r.dev.execute_all(x);
    let last: Vec<u64> = poll_once(r.cq).iter().map(|w| w.wr_id).collect();
    assert_eq!(last, vec![50]);
    assert_eq!(src[..], dst[..], "X's WRITE landed whole");
    forget(&r.dev, &[y], std::ptr::null_mut());
}

/// A paced QP X on one CQ and a QP Y on another: when X's tokens are due, a poll of Y's
/// CQ posts nothing of X's (it would run X's provider post, and wait for X's lock, inside
/// the application's poll of an unrelated CQ); a poll of X's own CQ releases it.
#[test]
fn a_poll_releases_paced_requests_only_of_the_qps_of_its_cq() {
    let r = rig_with(
        &[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "64K"),
            ("JUSTITIA_RATE", "10M"),
        ],
        64,
        false,
    );
    let other_cq = r.dev.create_cq();
    // SAFETY: created on the rig's context.
    unsafe { on_create_cq(r.dev.context(), other_cq) };
    let y = create_qp(&r.dev, qp_attr(other_cq, 8));
    let src = pattern(1 << 20, 5);
    let mut dst = vec![0u8; 1 << 20];
    let mut s = [sge(&src, 0, 1 << 20)];
    let mut w = rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, true);
    assert_eq!(post_on(r.qp, &mut w), 0);
    let first = r.dev.log().len();
    assert!(first < 16, "the burst goes, the rest waits for tokens");
    // Long enough for every chunk's tokens (1 MiB at 10 MB/s).
    r.clock.advance(Duration::from_millis(200));
    assert!(poll_once(other_cq).is_empty());
    assert_eq!(
        r.dev.log().len(),
        first,
        "a poll of Y's CQ posted X's paced chunks"
    );
    assert!(poll_once(r.cq).is_empty());
    assert!(
        r.dev.log().len() > first,
        "a poll of X's own CQ releases them"
    );
    forget(&r.dev, &[y], other_cq);
}

/// The provider refuses a chunk of request A in the middle of a post call that also
/// carries request B: A completes with an error, B runs. A poll on another thread while
/// the post call is still inside the provider (B already taken and run) must not let B's
/// success overtake A's error: the application sees A's completion, then B's.
#[test]
fn an_error_synthesized_for_a_request_is_never_overtaken_by_the_next_ones_success() {
    let r = rig_with(BW, 8, false);
    let x = r.qp;
    let src = pattern(256 << 10, 9);
    let mut dst = vec![0u8; 256 << 10];
    let remote = dst.as_mut_ptr() as u64;
    // The first call's third WQE (A's third chunk) is refused; the second call (B) is held
    // inside the provider once it took B.
    r.dev.refuse_in_next_post(x, 2, libc::EIO);
    let held = r.dev.hold_post(x, 1, true);
    let poster = {
        let (src_addr, remote, x) = (src.as_ptr() as u64, remote, x as usize);
        std::thread::spawn(move || {
            let mut a = [ibv_sge {
                addr: src_addr,
                length: 256 << 10,
                lkey: 1,
            }];
            let mut b = [ibv_sge {
                addr: src_addr,
                length: 100,
                lkey: 1,
            }];
            let mut wrs = [
                rdma(IBV_WR_RDMA_WRITE, 1, &mut a, remote, true),
                rdma(IBV_WR_RDMA_WRITE, 2, &mut b, remote, true),
            ];
            let next: *mut ibv_send_wr = &mut wrs[1];
            wrs[0].next = next;
            let mut bad = std::ptr::null_mut();
            // SAFETY: a live QP and a valid two-request list.
            unsafe { ops::post_send(x as *mut ibv_qp, wrs.as_mut_ptr(), &mut bad) }
        })
    };
    held.entered
        .recv_timeout(STUCK)
        .expect("B's post call reached the provider");
    r.dev.execute_all(x);
    let mut seen: Vec<(u64, ibv_wc_status)> = poll_once(r.cq)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    let _ = held.go.send(());
    assert_eq!(poster.join().unwrap(), 0, "A and B were taken");
    seen.extend(poll_once(r.cq).iter().map(|w| (w.wr_id, w.status)));
    assert_eq!(
        seen,
        vec![(1, IBV_WC_GENERAL_ERR), (2, IBV_WC_SUCCESS)],
        "A's error, then B's success"
    );
}
