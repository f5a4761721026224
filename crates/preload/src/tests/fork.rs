//! A child forked while another thread of the parent held the shaper's locks: every verb
//! passes through there, taking none of them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia_verbs::ops;
use justitia_verbs::sys::*;

use super::{forget, lookup, pattern, BANDWIDTH_64K, RKEY};
use crate::clock::VirtualClock;
use crate::engine::{self, PacerMode};
use crate::exports::{engine_from, on_create_cq};
use crate::mock::MockDevice;

/// How long the parent waits for the child, whose verbs must take no lock at all: it only
/// turns a child stuck on an inherited lock into a failure instead of a hang.
const STUCK: Duration = Duration::from_secs(60);

/// The parent holds its shaped extended QP's lock and its CQ's held queue (as the pacer
/// thread or a poster could at the moment of the fork) and forks. In the child, a batch of
/// `ibv_wr_*` requests on that QP reaches the provider, and `ibv_req_notify_cq` returns,
/// without waiting for those locks (which no thread of the child will ever release).
#[test]
fn a_forked_child_passes_wr_batches_and_notify_through_without_the_shapers_locks() {
    let engine = engine_from(
        lookup(BANDWIDTH_64K),
        Arc::new(VirtualClock::new()),
        PacerMode::Manual,
    )
    .unwrap();
    let dev = MockDevice::new();
    let ctx = dev.context();
    // SAFETY: a fresh mock context.
    unsafe { crate::install::attach_context(ctx, Arc::clone(&engine)) };
    let cq = dev.create_cq();
    // SAFETY: cq was just created on ctx.
    unsafe { on_create_cq(ctx, cq) };
    let mut attr = ibv_qp_init_attr_ex {
        send_cq: cq,
        recv_cq: cq,
        qp_type: IBV_QPT_RC,
        cap: ibv_qp_cap {
            max_send_wr: 32,
            max_send_sge: 2,
            ..Default::default()
        },
        comp_mask: IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
        ..Default::default()
    };
    // SAFETY: a live context, through the shaper's create_qp_ex.
    let qp = unsafe { ops::create_qp_ex(ctx, &mut attr) };
    assert!(!qp.is_null());
    let qpx = qp.cast::<ibv_qp_ex>();
    let src = pattern(4096, 3);
    let dst = vec![0u8; 4096];
    let shared = engine::qp(qp).unwrap();
    let cq_shared = engine::cq(cq).unwrap();

    let qp_lock = shared.state.lock();
    let held_lock = cq_shared.lock_held();
    // SAFETY: the child only calls the shaper's hooks and the mock, then _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: the hooks the shaper installed, called as the inline ibv_wr_* do.
        let code = unsafe {
            let x = &mut *qpx;
            x.wr_start.unwrap()(qpx);
            x.wr_id = 7;
            x.wr_flags = IBV_SEND_SIGNALED;
            x.wr_rdma_write.unwrap()(qpx, RKEY, dst.as_ptr() as u64);
            x.wr_set_sge.unwrap()(qpx, 1, src.as_ptr() as u64, 4096);
            let rc = x.wr_complete.unwrap()(qpx);
            let notified = ops::req_notify_cq(cq, 0);
            let log = dev.log();
            // The request whole, as the application posted it (its wr_id, no tag).
            let passed = rc == 0 && notified == 0 && log.len() == 1 && log[0].wr_id == 7;
            i32::from(!passed)
        };
        // SAFETY: ends the child without running the parent's destructors or tests.
        unsafe { libc::_exit(code) };
    }
    drop(held_lock);
    drop(qp_lock);
    assert!(pid > 0, "fork failed");
    let start = Instant::now();
    let mut status = 0;
    loop {
        // SAFETY: our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if start.elapsed() > STUCK {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the child waited for a lock its parent held at the fork");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's batch did not reach the provider as posted (status {status:#x})"
    );
    forget(&dev, &[qp], cq);
}
