//! Extended CQs (`ibv_create_cq_ex`, polled with `ibv_start_poll`, `ibv_next_poll` and
//! `ibv_end_poll`) against a provider that leaves a destroyed or reset QP's completions
//! in the CQ, as plain CQs are in `teardown`; and one extended CQ polled with both APIs
//! from two threads.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use justitia_verbs::ops;
use justitia_verbs::sys::*;

use super::{attached, create_qp, forget, pattern, post_on, qp_attr, rdma, sge};
use crate::engine::{self, Engine};
use crate::mock::MockDevice;

/// A mock device with an extended CQ (with QP numbers) and a shaped QP on it.
struct ExRig {
    dev: MockDevice,
    _engine: Arc<Engine>,
    cqx: *mut ibv_cq_ex,
    qp: *mut ibv_qp,
}

impl ExRig {
    fn new(depth: u32) -> ExRig {
        let (engine, dev) = attached(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "64K")]);
        let ctx = dev.context();
        let mut cq_attr = ibv_cq_init_attr_ex {
            cqe: 1024,
            wc_flags: u64::from(IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_BYTE_LEN),
            ..Default::default()
        };
        // SAFETY: a live context, through the shaper's create_cq_ex.
        let cqx = unsafe { ops::create_cq_ex(ctx, &mut cq_attr) };
        assert!(!cqx.is_null());
        let qp = create_qp(&dev, qp_attr(cqx.cast(), depth));
        ExRig {
            dev,
            _engine: engine,
            cqx,
            qp,
        }
    }

    fn cq(&self) -> *mut ibv_cq {
        self.cqx.cast()
    }

    fn qp_num(&self) -> u32 {
        // SAFETY: a live mock QP.
        unsafe { (*self.qp).qp_num }
    }

    /// Posts a signaled 100-byte WRITE `wr_id` and runs it.
    fn write_and_run(&self, wr_id: u64, src: &[u8], dst: &mut [u8]) {
        let mut s = [sge(src, 0, 100)];
        let mut w = rdma(
            IBV_WR_RDMA_WRITE,
            wr_id,
            &mut s,
            dst.as_mut_ptr() as u64,
            true,
        );
        assert_eq!(post_on(self.qp, &mut w), 0);
        self.dev.execute_all(self.qp);
    }

    /// A receive completion of the QP, as the peer's SEND would leave it.
    fn push_receive(&self, wr_id: u64) {
        self.dev.push_completion(
            self.cq(),
            ibv_wc {
                wr_id,
                qp_num: self.qp_num(),
                opcode: IBV_WC_RECV,
                ..Default::default()
            },
        );
    }
}

impl Drop for ExRig {
    fn drop(&mut self) {
        forget(&self.dev, &[self.qp], self.cq());
    }
}

/// The `wr_id`s of one whole extended poll.
fn poll_ex(cqx: *mut ibv_cq_ex) -> Vec<u64> {
    let mut seen = Vec::new();
    // SAFETY: the installed poll pointers, used as the inline ibv_start_poll & co.
    unsafe {
        let c = &*cqx;
        let mut attr = ibv_poll_cq_attr::default();
        let mut rc = c.start_poll.unwrap()(cqx, &mut attr);
        if rc != 0 {
            return seen;
        }
        while rc == 0 {
            seen.push((*cqx).wr_id);
            rc = c.next_poll.unwrap()(cqx);
        }
        c.end_poll.unwrap()(cqx);
    }
    seen
}

fn destroy(r: &ExRig) {
    let rc = engine::destroy_qp(r.qp, || {
        r.dev.destroy_qp(r.qp);
        0
    });
    assert_eq!(rc, 0);
}

/// As for a plain CQ: a destroyed QP's completion left in its extended CQ never reaches
/// the application with the shaper's tag, and a receive completion is still delivered.
#[test]
fn an_extended_cq_drops_a_destroyed_qps_tagged_completions() {
    let r = ExRig::new(8);
    r.dev.keep_stale_completions();
    let src = pattern(100, 2);
    let mut dst = vec![0u8; 100];
    r.write_and_run(5, &src, &mut dst);
    r.push_receive(9);
    destroy(&r);
    assert_eq!(poll_ex(r.cqx), vec![9], "the receive, and no tag");
}

/// The QP is destroyed while the application is inside a poll of its extended CQ (from
/// `ibv_start_poll` to `ibv_end_poll` the provider holds the CQ's lock, so the shaper
/// cannot poll it then): its stale completion is dropped when that poll ends, and the
/// next poll finds nothing.
#[test]
fn a_qp_destroyed_during_a_poll_of_its_extended_cq_leaves_no_tag_behind() {
    let r = ExRig::new(8);
    r.dev.keep_stale_completions();
    let src = pattern(100, 2);
    let mut dst = vec![0u8; 100];
    r.push_receive(7);
    r.write_and_run(5, &src, &mut dst);
    // SAFETY: the installed poll pointers.
    unsafe {
        let c = &*r.cqx;
        let mut attr = ibv_poll_cq_attr::default();
        assert_eq!(c.start_poll.unwrap()(r.cqx, &mut attr), 0);
        assert_eq!((*r.cqx).wr_id, 7);
        destroy(&r);
        c.end_poll.unwrap()(r.cqx);
    }
    assert_eq!(
        r.dev.cq_entries(r.cq()),
        0,
        "polled empty when the poll ended"
    );
    assert_eq!(poll_ex(r.cqx), Vec::<u64>::new());
}

/// A QP reset while its completions wait in its extended CQ and used again: a stale
/// success never completes the new request, which completes once after it ran.
#[test]
fn an_extended_cq_drops_completions_from_before_a_reset() {
    let r = ExRig::new(4);
    r.dev.keep_stale_completions();
    let src = pattern(100, 3);
    let mut dst = vec![0u8; 100];
    for id in 0..4u64 {
        let mut s = [sge(&src, 0, 100)];
        let mut w = rdma(IBV_WR_RDMA_WRITE, id, &mut s, dst.as_mut_ptr() as u64, true);
        assert_eq!(post_on(r.qp, &mut w), 0);
    }
    r.dev.execute_all(r.qp);
    r.dev.reset_qp(r.qp);
    let attr = ibv_qp_attr {
        qp_state: IBV_QPS_RESET,
        ..Default::default()
    };
    engine::qp(r.qp).unwrap().on_modify(&attr, IBV_QP_STATE);
    let mut s = [sge(&src, 0, 100)];
    let mut w = rdma(
        IBV_WR_RDMA_WRITE,
        100,
        &mut s,
        dst.as_mut_ptr() as u64,
        true,
    );
    assert_eq!(post_on(r.qp, &mut w), 0);
    let before = poll_ex(r.cqx);
    assert!(
        before.iter().all(|id| *id < 4),
        "stale or tagged completions delivered: {before:#x?}"
    );
    r.dev.execute_all(r.qp);
    assert_eq!(poll_ex(r.cqx), vec![100]);
}

/// How long a test waits for a call that must not wait for the other thread (see
/// `locks::STUCK`): the other thread is let go only after it returned.
const STUCK: Duration = Duration::from_secs(60);

/// One extended CQ polled with both APIs from two threads. Lock order: an extended
/// poll's state, then the CQ's poll lock; `ibv_poll_cq` takes the poll lock alone. Inside
/// an extended poll the provider holds the CQ's own lock, for which `ibv_poll_cq` on
/// another thread waits with the poll lock held: so the extended poll's calls only try
/// the poll lock. Thread A is inside an extended poll, thread B's `ibv_poll_cq` waits in
/// the provider for it to end; A's `ibv_next_poll` and `ibv_end_poll` return, and each
/// completion reaches one of the two, once.
#[test]
fn one_extended_cq_polled_with_both_apis_from_two_threads_never_deadlocks() {
    let r = ExRig::new(8);
    // Two receive completions: A's poll presents the first, its next_poll the second.
    r.push_receive(1);
    r.push_receive(2);
    let waits = r.dev.tell_when_a_poll_waits();
    let (inside_tx, inside) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let (a_done, a_got) = mpsc::channel();
    let cqx = r.cqx as usize;
    let a = std::thread::spawn(move || {
        let cqx = cqx as *mut ibv_cq_ex;
        let mut seen = Vec::new();
        // SAFETY: the installed poll pointers.
        unsafe {
            let c = &*cqx;
            let mut attr = ibv_poll_cq_attr::default();
            let mut rc = c.start_poll.unwrap()(cqx, &mut attr);
            assert_eq!(rc, 0);
            seen.push((*cqx).wr_id);
            let _ = inside_tx.send(());
            let _ = go_rx.recv();
            while rc == 0 {
                rc = c.next_poll.unwrap()(cqx);
                if rc == 0 {
                    seen.push((*cqx).wr_id);
                }
            }
            c.end_poll.unwrap()(cqx);
        }
        let _ = a_done.send(seen);
    });
    inside.recv_timeout(STUCK).expect("A's poll began");
    let cq = r.cq() as usize;
    let b = std::thread::spawn(move || {
        let mut buf = [ibv_wc::default(); 8];
        // SAFETY: a live CQ with room for 8 entries.
        let n = unsafe { ops::poll_cq(cq as *mut ibv_cq, 8, buf.as_mut_ptr()) };
        assert!(n >= 0);
        buf[..n as usize]
            .iter()
            .map(|w| w.wr_id)
            .collect::<Vec<u64>>()
    });
    waits
        .recv_timeout(STUCK)
        .expect("B's poll waits for A's in the provider");
    let _ = go.send(());
    let Ok(a_seen) = a_got.recv_timeout(STUCK) else {
        // Both threads are stuck for ever, B with the CQ's poll lock: the rig's teardown
        // would wait for it too, so it is left as it is.
        std::mem::forget(r);
        panic!("A's extended poll waited for B's ibv_poll_cq, which waited for A");
    };
    a.join().unwrap();
    let b_seen = b.join().unwrap();
    let mut all: Vec<u64> = a_seen.iter().chain(&b_seen).copied().collect();
    all.sort_unstable();
    assert_eq!(all, vec![1, 2], "A saw {a_seen:?}, B saw {b_seen:?}");
    assert_eq!(a_seen.first(), Some(&1));
}
