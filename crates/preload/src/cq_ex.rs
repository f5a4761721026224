//! Polling of extended CQs (`ibv_create_cq_ex`): `ibv_start_poll`, `ibv_next_poll`,
//! `ibv_end_poll` and the `ibv_wc_read_*` accessors are function pointers in the CQ.
//!
//! The shaper wraps the three poll verbs and `read_byte_len`. When the CQ serves shaped
//! QPs, each entry the provider presents is translated like an `ibv_poll_cq` completion:
//! internal and duplicate entries are skipped (the shaper moves on with the provider's
//! `next_poll`), and a split request's entry shows the original `wr_id` (a field of the CQ)
//! and length (through `read_byte_len`). Synthesized completions (requests that never
//! reached a failed QP) are delivered through `ibv_poll_cq` only.

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use justitia_verbs::sys::*;

use crate::engine::{self, CqShared, QpShared};
use crate::hooks::guarded;

/// The provider's own poll pointers of one extended CQ.
#[derive(Clone, Copy)]
pub struct CqExOps {
    start_poll: unsafe extern "C" fn(*mut ibv_cq_ex, *mut ibv_poll_cq_attr) -> c_int,
    next_poll: unsafe extern "C" fn(*mut ibv_cq_ex) -> c_int,
    end_poll: unsafe extern "C" fn(*mut ibv_cq_ex),
    read_opcode: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> ibv_wc_opcode>,
    read_byte_len: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u32>,
    read_qp_num: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> u32>,
    /// The CQ reports QP numbers (`IBV_WC_EX_WITH_QP_NUM`).
    has_qp_num: bool,
}

impl CqExOps {
    /// Saves the pointers of `cqx`, created with `wc_flags`; `None` when the provider
    /// lacks the poll verbs.
    pub fn save(cqx: &ibv_cq_ex, wc_flags: u64) -> Option<Self> {
        Some(CqExOps {
            start_poll: cqx.start_poll?,
            next_poll: cqx.next_poll?,
            end_poll: cqx.end_poll?,
            read_opcode: cqx.read_opcode,
            read_byte_len: cqx.read_byte_len,
            read_qp_num: cqx.read_qp_num,
            has_qp_num: wc_flags & u64::from(IBV_WC_EX_WITH_QP_NUM) != 0,
        })
    }
}

/// The entry being presented to the application, and the QPs heard from in this poll.
#[derive(Default)]
pub struct Current {
    byte_len: Option<u32>,
    touched: Vec<Arc<QpShared>>,
}

/// Installs the shaper's poll pointers in `cqx`.
pub fn install(cqx: &mut ibv_cq_ex) {
    cqx.start_poll = Some(start_poll);
    cqx.next_poll = Some(next_poll);
    cqx.end_poll = Some(end_poll);
    cqx.read_byte_len = Some(read_byte_len);
}

fn state(cqx: *mut ibv_cq_ex) -> Option<(&'static CqShared, CqExOps)> {
    let c = engine::cq(cqx.cast())?;
    Some((c, c.ex?))
}

impl CqShared {
    /// Skips entries the application must not see, starting from the one the provider
    /// presents after a poll verb returned `rc`; returns the verb's result for the
    /// application.
    ///
    /// # Safety
    /// `cqx` is this CQ, inside a poll.
    unsafe fn filter_ex(&self, cqx: *mut ibv_cq_ex, ops: CqExOps, mut rc: c_int) -> c_int {
        let mut current = self.ex_current.lock().unwrap_or_else(|e| e.into_inner());
        current.byte_len = None;
        if self.shaped.load(Ordering::Relaxed) == 0 {
            return rc;
        }
        let qps = self.qps.lock().unwrap_or_else(|e| e.into_inner());
        let mut synthesized = Vec::new();
        while rc == 0 {
            // SAFETY: inside a poll, the provider presents a valid entry.
            let mut wc = unsafe {
                let c = &*cqx;
                ibv_wc {
                    wr_id: c.wr_id,
                    status: c.status,
                    opcode: match (c.status, ops.read_opcode) {
                        (IBV_WC_SUCCESS, Some(f)) => f(cqx),
                        _ => 0,
                    },
                    byte_len: ops.read_byte_len.map_or(0, |f| f(cqx)),
                    qp_num: match (ops.has_qp_num, ops.read_qp_num) {
                        (true, Some(f)) => f(cqx),
                        // Without QP numbers, an entry can only be attributed when one
                        // shaped QP uses the CQ.
                        _ if qps.len() == 1 => qps[0].qp_num,
                        _ => u32::MAX,
                    },
                    ..Default::default()
                }
            };
            let before = wc.byte_len;
            let (deliver, q) = self.translate(&qps, &mut wc, &mut synthesized);
            if let Some(q) = q {
                if !current.touched.iter().any(|t| Arc::ptr_eq(t, &q)) {
                    current.touched.push(q);
                }
            }
            if deliver {
                // SAFETY: as above; wr_id is the CQ's field for the current entry.
                unsafe { (*cqx).wr_id = wc.wr_id };
                if wc.byte_len != before {
                    current.byte_len = Some(wc.byte_len);
                }
                return 0;
            }
            // SAFETY: inside a poll.
            rc = unsafe { (ops.next_poll)(cqx) };
        }
        rc
    }
}

unsafe extern "C" fn start_poll(cqx: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    let Some((c, ops)) = state(cqx) else {
        return libc::ENOENT;
    };
    // SAFETY: the provider's own start_poll, with the caller's arguments.
    let rc = unsafe { (ops.start_poll)(cqx, attr) };
    if rc != 0 {
        return rc;
    }
    guarded(
        || {
            // SAFETY: a poll has started on cqx.
            let rc = unsafe { c.filter_ex(cqx, ops, 0) };
            if rc == libc::ENOENT {
                // Everything the provider had was internal: the application will not call
                // end_poll after ENOENT, so end the provider's poll here.
                // SAFETY: a poll has started on cqx.
                unsafe { end_poll(cqx) };
            }
            rc
        },
        || 0,
    )
}

unsafe extern "C" fn next_poll(cqx: *mut ibv_cq_ex) -> c_int {
    let Some((c, ops)) = state(cqx) else {
        return libc::ENOENT;
    };
    // SAFETY: the provider's own next_poll, inside the application's poll.
    let rc = unsafe { (ops.next_poll)(cqx) };
    // SAFETY: inside a poll.
    guarded(|| unsafe { c.filter_ex(cqx, ops, rc) }, || rc)
}

unsafe extern "C" fn end_poll(cqx: *mut ibv_cq_ex) {
    let Some((c, ops)) = state(cqx) else {
        return;
    };
    // SAFETY: the provider's own end_poll, ending the poll.
    unsafe { (ops.end_poll)(cqx) };
    guarded(
        || {
            let touched = {
                let mut current = c.ex_current.lock().unwrap_or_else(|e| e.into_inner());
                current.byte_len = None;
                std::mem::take(&mut current.touched)
            };
            let now = c.engine.now();
            for q in touched {
                q.drain(now);
            }
        },
        || (),
    );
}

unsafe extern "C" fn read_byte_len(cqx: *mut ibv_cq_ex) -> u32 {
    let Some((c, ops)) = state(cqx) else {
        return 0;
    };
    let over = c
        .ex_current
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .byte_len;
    match (over, ops.read_byte_len) {
        (Some(len), _) => len,
        // SAFETY: the provider's own accessor, inside the application's poll.
        (None, Some(f)) => unsafe { f(cqx) },
        (None, None) => 0,
    }
}
