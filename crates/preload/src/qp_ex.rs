//! The `ibv_wr_*` send interface of QPs created with `ibv_create_qp_ex` and send-ops flags
//! (perftest's default on rxe).
//!
//! Its verbs are function pointers in the `ibv_qp_ex` object. On a shaped QP the shaper
//! replaces them all: between `ibv_wr_start` and `ibv_wr_complete` it collects the requests
//! (reading `wr_id` and `wr_flags` from the object when each one starts, as providers do)
//! and at `ibv_wr_complete` hands the batch to the shaped post path, all or nothing, which
//! posts through the provider's `ibv_post_send` (rdma-core allows both interfaces on one
//! QP). On an observed QP only the request-starting and SGE-setting verbs are wrapped, to
//! count, and forward at once.

use std::ffi::{c_int, c_void};

use justitia_verbs::sys::*;

use crate::engine::ex_state::{Collected, WrBatch};
use crate::engine::{self, QpShared};
use crate::ffi::guarded;
use crate::send_queue::OwnedWr;
use crate::stats::Counters;

/// Installs the shaper's pointers in `qpx`: all of them when `shaped`, else the counting
/// wrappers of the verbs that start a request or set its SGEs.
pub fn install(qpx: &mut ibv_qp_ex, shaped: bool) {
    if shaped {
        qpx.wr_start = Some(wr_start);
        qpx.wr_complete = Some(wr_complete);
        qpx.wr_abort = Some(wr_abort);
        qpx.wr_rdma_write = Some(wr_rdma_write);
        qpx.wr_rdma_write_imm = Some(wr_rdma_write_imm);
        qpx.wr_rdma_read = Some(wr_rdma_read);
        qpx.wr_send = Some(wr_send);
        qpx.wr_send_imm = Some(wr_send_imm);
        qpx.wr_send_inv = Some(wr_send_inv);
        qpx.wr_local_inv = Some(wr_local_inv);
        qpx.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
        qpx.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
        qpx.wr_bind_mw = Some(wr_bind_mw);
        qpx.wr_set_sge = Some(wr_set_sge);
        qpx.wr_set_sge_list = Some(wr_set_sge_list);
        qpx.wr_set_inline_data = Some(wr_set_inline_data);
        qpx.wr_set_inline_data_list = Some(wr_set_inline_data_list);
        qpx.wr_atomic_write = Some(wr_atomic_write);
        return;
    }
    macro_rules! wrap {
        ($($field:ident => $hook:ident),*) => {
            $( if qpx.$field.is_some() { qpx.$field = Some($hook); } )*
        };
    }
    wrap!(
        wr_rdma_write => count_rdma_write,
        wr_rdma_write_imm => count_rdma_write_imm,
        wr_rdma_read => count_rdma_read,
        wr_send => count_send,
        wr_send_imm => count_send_imm,
        wr_set_sge => count_set_sge,
        wr_set_sge_list => count_set_sge_list
    );
}

/// In a forked child, calls the provider's own `$field` with the application's arguments
/// and returns: every verb passes through there, and the shaper's locks may have been
/// held by a thread of the parent at the fork (see [`crate::ffi`]).
macro_rules! in_child_pass_through {
    ($qpx:ident, $field:ident ($($arg:expr),*)) => {
        if crate::ffi::in_forked_child() {
            return match state($qpx).and_then(|q| q.ex).and_then(|ops| ops.0.$field) {
                // SAFETY: the provider's own function, with the application's arguments.
                Some(f) => unsafe { f($qpx $(, $arg)*) },
                None => Default::default(),
            };
        }
    };
}

/// The QP state behind a `qpx` the shaper installed pointers in.
fn state(qpx: *mut ibv_qp_ex) -> Option<&'static QpShared> {
    engine::qp(qpx.cast())
}

/// Runs `f` on the QP's batch.
fn with_batch(qpx: *mut ibv_qp_ex, f: impl FnOnce(&mut WrBatch)) {
    if let Some(q) = state(qpx) {
        guarded(
            || {
                let mut st = q.state.lock();
                f(&mut st.batch);
            },
            || (),
        );
    }
}

/// Starts a request of `opcode`, with the `wr_id` and flags the application set.
fn start(qpx: *mut ibv_qp_ex, opcode: ibv_wr_opcode, set: impl FnOnce(&mut ibv_send_wr)) {
    // SAFETY: the application passes its live extended QP.
    let (wr_id, flags) = unsafe { ((*qpx).wr_id, (*qpx).wr_flags) };
    with_batch(qpx, |b| {
        let mut wr = ibv_send_wr {
            wr_id,
            opcode,
            send_flags: flags,
            ..Default::default()
        };
        set(&mut wr);
        b.wrs.push(Collected {
            wr,
            ..Default::default()
        });
    });
}

/// Applies `f` to the request being collected.
fn current(qpx: *mut ibv_qp_ex, f: impl FnOnce(&mut Collected)) {
    with_batch(qpx, |b| {
        if let Some(c) = b.wrs.last_mut() {
            f(c);
        }
    });
}

unsafe extern "C" fn wr_start(qpx: *mut ibv_qp_ex) {
    in_child_pass_through!(qpx, wr_start());
    with_batch(qpx, |b| {
        b.wrs.clear();
        b.unsupported = None;
    });
}

unsafe extern "C" fn wr_abort(qpx: *mut ibv_qp_ex) {
    in_child_pass_through!(qpx, wr_abort());
    with_batch(qpx, |b| {
        b.wrs.clear();
        b.unsupported = None;
    });
}

unsafe extern "C" fn wr_complete(qpx: *mut ibv_qp_ex) -> c_int {
    in_child_pass_through!(qpx, wr_complete());
    let Some(q) = state(qpx) else {
        return libc::EINVAL;
    };
    guarded(
        || {
            let (wrs, unsupported) = {
                let mut st = q.state.lock();
                (
                    std::mem::take(&mut st.batch.wrs),
                    st.batch.unsupported.take(),
                )
            };
            if let Some(verb) = unsupported {
                crate::log::log!(
                    Warn,
                    "{verb} is not supported on a shaped QP; batch refused"
                );
                return libc::EOPNOTSUPP;
            }
            let batch: Vec<OwnedWr> = wrs
                .into_iter()
                .map(|c| {
                    let inline = c.inline.map(Vec::into_boxed_slice);
                    OwnedWr::from_parts(c.wr, c.sges, inline)
                })
                .collect();
            q.post_batch(batch)
        },
        || guarded(|| q.recover_batch(), || libc::EIO),
    )
}

unsafe extern "C" fn wr_rdma_write(qpx: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    in_child_pass_through!(qpx, wr_rdma_write(rkey, remote_addr));
    start(qpx, IBV_WR_RDMA_WRITE, |wr| {
        wr.wr.rdma.rkey = rkey;
        wr.wr.rdma.remote_addr = remote_addr;
    });
}

unsafe extern "C" fn wr_rdma_write_imm(
    qpx: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    imm_data: __be32,
) {
    in_child_pass_through!(qpx, wr_rdma_write_imm(rkey, remote_addr, imm_data));
    start(qpx, IBV_WR_RDMA_WRITE_WITH_IMM, |wr| {
        wr.wr.rdma.rkey = rkey;
        wr.wr.rdma.remote_addr = remote_addr;
        wr.__bindgen_anon_1.imm_data = imm_data;
    });
}

unsafe extern "C" fn wr_rdma_read(qpx: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    in_child_pass_through!(qpx, wr_rdma_read(rkey, remote_addr));
    crate::remote::saw_read();
    start(qpx, IBV_WR_RDMA_READ, |wr| {
        wr.wr.rdma.rkey = rkey;
        wr.wr.rdma.remote_addr = remote_addr;
    });
}

unsafe extern "C" fn wr_send(qpx: *mut ibv_qp_ex) {
    in_child_pass_through!(qpx, wr_send());
    start(qpx, IBV_WR_SEND, |_| {});
}

unsafe extern "C" fn wr_send_imm(qpx: *mut ibv_qp_ex, imm_data: __be32) {
    in_child_pass_through!(qpx, wr_send_imm(imm_data));
    start(qpx, IBV_WR_SEND_WITH_IMM, |wr| {
        wr.__bindgen_anon_1.imm_data = imm_data;
    });
}

unsafe extern "C" fn wr_send_inv(qpx: *mut ibv_qp_ex, invalidate_rkey: u32) {
    in_child_pass_through!(qpx, wr_send_inv(invalidate_rkey));
    start(qpx, IBV_WR_SEND_WITH_INV, |wr| {
        wr.__bindgen_anon_1.invalidate_rkey = invalidate_rkey;
    });
}

unsafe extern "C" fn wr_local_inv(qpx: *mut ibv_qp_ex, invalidate_rkey: u32) {
    in_child_pass_through!(qpx, wr_local_inv(invalidate_rkey));
    start(qpx, IBV_WR_LOCAL_INV, |wr| {
        wr.__bindgen_anon_1.invalidate_rkey = invalidate_rkey;
    });
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qpx: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    compare: u64,
    swap: u64,
) {
    in_child_pass_through!(qpx, wr_atomic_cmp_swp(rkey, remote_addr, compare, swap));
    start(qpx, IBV_WR_ATOMIC_CMP_AND_SWP, |wr| {
        wr.wr.atomic.rkey = rkey;
        wr.wr.atomic.remote_addr = remote_addr;
        wr.wr.atomic.compare_add = compare;
        wr.wr.atomic.swap = swap;
    });
}

unsafe extern "C" fn wr_atomic_fetch_add(
    qpx: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    add: u64,
) {
    in_child_pass_through!(qpx, wr_atomic_fetch_add(rkey, remote_addr, add));
    start(qpx, IBV_WR_ATOMIC_FETCH_AND_ADD, |wr| {
        wr.wr.atomic.rkey = rkey;
        wr.wr.atomic.remote_addr = remote_addr;
        wr.wr.atomic.compare_add = add;
    });
}

unsafe extern "C" fn wr_bind_mw(
    qpx: *mut ibv_qp_ex,
    mw: *mut ibv_mw,
    rkey: u32,
    bind_info: *const ibv_mw_bind_info,
) {
    in_child_pass_through!(qpx, wr_bind_mw(mw, rkey, bind_info));
    // SAFETY: the application passes a valid bind description.
    let info = unsafe { bind_info.as_ref() }.copied().unwrap_or_default();
    start(qpx, IBV_WR_BIND_MW, |wr| {
        wr.__bindgen_anon_2.bind_mw.mw = mw;
        wr.__bindgen_anon_2.bind_mw.rkey = rkey;
        wr.__bindgen_anon_2.bind_mw.bind_info = info;
    });
}

unsafe extern "C" fn wr_atomic_write(
    qpx: *mut ibv_qp_ex,
    _rkey: u32,
    _remote_addr: u64,
    _atomic_wr: *const c_void,
) {
    in_child_pass_through!(qpx, wr_atomic_write(_rkey, _remote_addr, _atomic_wr));
    with_batch(qpx, |b| b.unsupported = Some("ibv_wr_atomic_write"));
}

unsafe extern "C" fn wr_set_sge(qpx: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    in_child_pass_through!(qpx, wr_set_sge(lkey, addr, length));
    current(qpx, |c| c.sges = vec![ibv_sge { addr, length, lkey }]);
}

unsafe extern "C" fn wr_set_sge_list(qpx: *mut ibv_qp_ex, num_sge: usize, sg_list: *const ibv_sge) {
    in_child_pass_through!(qpx, wr_set_sge_list(num_sge, sg_list));
    let sges = if num_sge == 0 || sg_list.is_null() {
        Vec::new()
    } else {
        // SAFETY: the application passes num_sge readable entries.
        unsafe { std::slice::from_raw_parts(sg_list, num_sge) }.to_vec()
    };
    current(qpx, |c| c.sges = sges);
}

unsafe extern "C" fn wr_set_inline_data(qpx: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    in_child_pass_through!(qpx, wr_set_inline_data(addr, length));
    let data = if addr.is_null() || length == 0 {
        Vec::new()
    } else {
        // SAFETY: inline data is read during the call, as the verb specifies.
        unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), length) }.to_vec()
    };
    current(qpx, |c| {
        c.wr.send_flags |= IBV_SEND_INLINE;
        c.inline = Some(data);
    });
}

unsafe extern "C" fn wr_set_inline_data_list(
    qpx: *mut ibv_qp_ex,
    num_buf: usize,
    buf_list: *const ibv_data_buf,
) {
    in_child_pass_through!(qpx, wr_set_inline_data_list(num_buf, buf_list));
    let mut data = Vec::new();
    if num_buf > 0 && !buf_list.is_null() {
        // SAFETY: the application passes num_buf readable descriptors of readable buffers.
        for b in unsafe { std::slice::from_raw_parts(buf_list, num_buf) } {
            if !b.addr.is_null() && b.length > 0 {
                // SAFETY: as above.
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(b.addr.cast::<u8>(), b.length)
                });
            }
        }
    }
    current(qpx, |c| {
        c.wr.send_flags |= IBV_SEND_INLINE;
        c.inline = Some(data);
    });
}

/// The saved pointers and counters of an observed QP.
fn observed(qpx: *mut ibv_qp_ex) -> Option<(&'static ibv_qp_ex, &'static Counters)> {
    let q = state(qpx)?;
    Some((&q.ex.as_ref()?.0, q.engine.counters()))
}

/// Counts a request starting on an observed QP, and times it if it is the process's
/// candidate ([`QpShared::start_timing`]: its `wr_id` and flags are in the object, where
/// the application put them before starting it). A timed request that is never posted
/// (its batch aborted or refused) is given up by the round trips' give-up.
fn count_request(qpx: *mut ibv_qp_ex) -> Option<&'static ibv_qp_ex> {
    let q = state(qpx)?;
    let before = q
        .engine
        .counters()
        .requests
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if q.timed {
        // SAFETY: a live extended QP's object, which the application's thread owns
        // between ibv_wr_start and ibv_wr_complete.
        let (wr_id, flags) = unsafe { ((*qpx).wr_id, (*qpx).wr_flags) };
        q.start_timing(before, wr_id, flags);
    }
    Some(&q.ex.as_ref()?.0)
}

macro_rules! counting {
    ($name:ident, $field:ident, ($($arg:ident : $ty:ty),*)) => {
        unsafe extern "C" fn $name(qpx: *mut ibv_qp_ex, $($arg: $ty),*) {
            if let Some(orig) = count_request(qpx) {
                if let Some(f) = orig.$field {
                    // SAFETY: the provider's own verb, with the caller's arguments.
                    unsafe { f(qpx, $($arg),*) };
                }
            }
        }
    };
}

counting!(count_rdma_write, wr_rdma_write, (rkey: u32, remote_addr: u64));
counting!(count_rdma_write_imm, wr_rdma_write_imm, (rkey: u32, remote_addr: u64, imm: __be32));
counting!(count_rdma_read, wr_rdma_read, (rkey: u32, remote_addr: u64));
counting!(count_send, wr_send, ());
counting!(count_send_imm, wr_send_imm, (imm: __be32));

unsafe extern "C" fn count_set_sge(qpx: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    if let Some((orig, counters)) = observed(qpx) {
        Counters::add(&counters.bytes, u64::from(length));
        if let Some(f) = orig.wr_set_sge {
            // SAFETY: the provider's own verb, with the caller's arguments.
            unsafe { f(qpx, lkey, addr, length) };
        }
    }
}

unsafe extern "C" fn count_set_sge_list(
    qpx: *mut ibv_qp_ex,
    num_sge: usize,
    sg_list: *const ibv_sge,
) {
    if let Some((orig, counters)) = observed(qpx) {
        if num_sge > 0 && !sg_list.is_null() {
            // SAFETY: the application passes num_sge readable entries.
            let sges = unsafe { std::slice::from_raw_parts(sg_list, num_sge) };
            Counters::add(
                &counters.bytes,
                sges.iter().map(|s| u64::from(s.length)).sum(),
            );
        }
        if let Some(f) = orig.wr_set_sge_list {
            // SAFETY: the provider's own verb, with the caller's arguments.
            unsafe { f(qpx, num_sge, sg_list) };
        }
    }
}
