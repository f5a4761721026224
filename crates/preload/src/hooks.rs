//! The data-path function pointers the shaper installs in a device context:
//! `ops.post_send`, `ops.post_recv`, `ops.poll_cq` and `ops.req_notify_cq` (what the
//! static-inline verbs call). Where they go is declared in [`crate::install`].
//!
//! Every one is an `extern "C"` entry from the application, so none may unwind: the shaped
//! paths run under `catch_unwind` and fall back to the provider's own function (fail open),
//! except `post_send`, where the shaper may already hold part of the list: a panic there
//! refuses the rest of the list and makes the QP's posts pass through from then on.
//! The pass-through path of an observed QP or a CQ without shaped QPs is a map lookup, two
//! counter additions and the provider call. The shaped entries the hooks hand over to are
//! public only so that the compiler keeps their signatures the hooks' own (unused first
//! argument included): a hook then reaches one with a plain jump.

use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

use justitia_verbs::sys::*;

use crate::engine;
use crate::ffi::{caught, guarded};

/// `ops.post_send`.
///
/// # Safety
/// Called by `ibv_post_send` with a live QP, a valid request list and a writable `bad_wr`.
pub unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    if let Some(q) = engine::qp_fast(qp) {
        let shaped = q.posts_shaped();
        // SAFETY: guaranteed by the caller.
        if let Some(w) = unsafe { wr.as_ref() } {
            if w.opcode == IBV_WR_RDMA_READ {
                // Its data leaves the peer's RNIC: the daemon tells the peer's.
                crate::remote::saw_read();
            }
            if w.next.is_null() {
                if shaped {
                    // SAFETY: guaranteed by the caller; a single request.
                    return unsafe { post_one_shaped(qp, wr, bad_wr, q) };
                }
                if w.num_sge == 1 {
                    // SAFETY: one readable SGE; then the provider's own post_send.
                    unsafe {
                        q.observe_one((*w.sg_list).length);
                        return (q.post_send)(qp, wr, bad_wr);
                    }
                }
            }
        }
        if shaped {
            // SAFETY: guaranteed by the caller.
            return unsafe { post_send_shaped(qp, wr, bad_wr, q) };
        }
    }
    // SAFETY: guaranteed by the caller.
    unsafe { post_send_slow(qp, wr, bad_wr) }
}

/// `ops.post_send` in a latency-class process that times its requests' round trips for
/// the daemon ([`crate::round_trips`]), installed there instead of [`post_send`]: such a
/// process shapes no QP, so every post is counted and passed through, and a single
/// request on an RC QP may be timed. Other processes never pay for the timing.
///
/// # Safety
/// Called by `ibv_post_send` with a live QP and a valid request list.
pub unsafe extern "C" fn post_send_timed(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    if let Some(q) = engine::qp_fast(qp) {
        // SAFETY: guaranteed by the caller.
        if let Some(w) = unsafe { wr.as_ref() } {
            if w.opcode == IBV_WR_RDMA_READ {
                crate::remote::saw_read();
            }
            if w.next.is_null() && q.timed && !q.posts_shaped() {
                // SAFETY: guaranteed by the caller; a single request.
                return unsafe { post_one_timed(qp, wr, bad_wr, q) };
            }
        }
    }
    // SAFETY: guaranteed by the caller.
    unsafe { post_send(qp, wr, bad_wr) }
}

/// [`post_send_timed`] of a single request on an observed RC QP: counted, maybe timed
/// ([`engine::QpShared::post_timed`]), posted.
///
/// # Safety
/// As [`post_send`], with a single request.
#[inline(never)]
unsafe extern "C" fn post_one_timed(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
    q: &'static engine::QpShared,
) -> c_int {
    // SAFETY: guaranteed by the caller.
    unsafe { q.post_timed(qp, wr, bad_wr) }
}

/// `ops.poll_cq` in a latency-class process that times its requests' round trips, installed
/// there instead of [`poll_cq`]: the provider's poll (such a process shapes no QP, so
/// there is nothing to translate), and a look for the timed request's completion in what
/// it returned.
///
/// # Safety
/// Called by `ibv_poll_cq` with a live CQ and room for `n` completions at `wc`.
pub unsafe extern "C" fn poll_cq_timed(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    let Some(c) = engine::cq_fast(cq).or_else(|| engine::cq(cq)) else {
        // SAFETY: guaranteed by the caller.
        return unsafe { poll_cq(cq, n, wc) };
    };
    if c.needs_shaping() {
        // SAFETY: guaranteed by the caller.
        return unsafe { poll_cq(cq, n, wc) };
    }
    // SAFETY: the provider's own poll_cq, with the caller's arguments.
    let got = unsafe { (c.poll_cq)(cq, n, wc) };
    if got > 0 {
        if let Some(r) = c.engine.round_trips() {
            // SAFETY: the provider wrote `got` entries at `wc`.
            r.polled(unsafe { std::slice::from_raw_parts(wc, got as usize) });
        }
    }
    got
}

/// `ops.post_send` of a QP whose posts are shaped (`q`, the state of `qp`; the caller
/// checked `QpShared::posts_shaped`, which also keeps a forked child out). Like
/// [`poll_cq_shaped`], it keeps the hook's argument order and cannot unwind, so the hook
/// jumps to it.
///
/// # Safety
/// As [`post_send`].
#[inline(never)]
pub unsafe extern "C" fn post_send_shaped(
    _qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
    q: &'static engine::QpShared,
) -> c_int {
    // SAFETY: guaranteed by the caller.
    unsafe {
        shaped_post(wr, bad_wr, q, |settled| {
            q.post_send_shaped(wr, bad_wr, settled)
        })
    }
}

/// [`post_send_shaped`] of a single request (`wr` is not null, its `next` is): the hook
/// checked that already.
///
/// # Safety
/// As [`post_send`], with a single request.
#[inline(never)]
pub unsafe extern "C" fn post_one_shaped(
    _qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
    q: &'static engine::QpShared,
) -> c_int {
    // SAFETY: guaranteed by the caller.
    unsafe { shaped_post(wr, bad_wr, q, |settled| q.post_single(wr, bad_wr, settled)) }
}

/// Runs the shaped post `post` of the list `wr` on `q` without unwinding: after a panic,
/// the shaper's hold on the list is settled by [`engine::QpShared::recover_post`].
///
/// # Safety
/// As [`post_send`]; `post` posts `wr` with `bad_wr`.
#[inline(always)]
unsafe fn shaped_post(
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
    q: &engine::QpShared,
    post: impl FnOnce(&engine::Settled) -> c_int,
) -> c_int {
    let settled = engine::Settled::new();
    match catch_unwind(AssertUnwindSafe(|| post(&settled))) {
        Ok(rc) => rc,
        // Not the provider's post_send with the whole list: the shaper may hold part
        // of it already (see QpShared::recover_post).
        // SAFETY: guaranteed by the caller.
        Err(_) => catch_unwind(AssertUnwindSafe(|| unsafe {
            q.recover_post(wr, bad_wr, settled.get())
        }))
        .unwrap_or_else(|_| {
            // What the shaper holds of the list is unknown now: all of it is refused.
            if !bad_wr.is_null() {
                // SAFETY: guaranteed writable by the caller.
                unsafe { *bad_wr = wr };
            }
            libc::EIO
        }),
    }
}

/// `ops.post_send` of a QP the first lookup did not settle: a list on an observed QP, a QP
/// outside its home slot, or an unregistered one.
///
/// # Safety
/// As [`post_send`].
#[cold]
#[inline(never)]
unsafe extern "C" fn post_send_slow(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    if let Some(q) = engine::qp(qp) {
        // SAFETY: guaranteed by the caller.
        return unsafe {
            if q.posts_shaped() {
                post_send_shaped(qp, wr, bad_wr, q)
            } else {
                post_send_observed(qp, wr, bad_wr, q)
            }
        };
    }
    // SAFETY: a live QP has a live context.
    match engine::context(unsafe { (*qp).context }).and_then(|c| c.post_send) {
        // SAFETY: the provider's own post_send, with the caller's arguments.
        Some(f) => unsafe { f(qp, wr, bad_wr) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ops.post_send` of a QP whose posts are only counted (`q`, the state of `qp`): an
/// observed one, one the shaper failed on, or any in a forked child, with a list.
///
/// # Safety
/// As [`post_send`].
#[cold]
#[inline(never)]
unsafe fn post_send_observed(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
    q: &engine::QpShared,
) -> c_int {
    // SAFETY: guaranteed by the caller.
    unsafe {
        q.observe(wr);
        (q.post_send)(qp, wr, bad_wr)
    }
}

/// `ops.post_recv`: passed through, but on a QP with a receiver half
/// (`JUSTITIA_TWO_SIDED=split`), whose receives the shaper owns once the peer splits its
/// sends (see [`engine::two_sided`]).
///
/// # Safety
/// Called by `ibv_post_recv` with a live QP and valid arguments.
pub unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    let owned = engine::qp(qp).filter(|q| q.receiver.is_some());
    if let (Some(q), false) = (owned, crate::ffi::in_forked_child()) {
        if let (Some(r), Some(f)) = (&q.receiver, q.post_recv) {
            return caught(
                // SAFETY: guaranteed by the caller.
                move || unsafe { q.post_recv_owned(r, wr, bad_wr) },
                // SAFETY: the provider's own post_recv, with the caller's arguments.
                move || unsafe { f(qp, wr, bad_wr) },
            );
        }
    }
    let f = match engine::qp(qp).and_then(|q| q.post_recv) {
        Some(f) => Some(f),
        // SAFETY: a live QP has a live context.
        None => engine::context(unsafe { (*qp).context }).and_then(|c| c.post_recv),
    };
    match f {
        // SAFETY: the provider's own post_recv, with the caller's arguments.
        Some(f) => unsafe { f(qp, wr, bad_wr) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ops.poll_cq`.
///
/// # Safety
/// Called by `ibv_poll_cq` with a live CQ and room for `n` completions.
pub unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    if let Some(c) = engine::cq_fast(cq) {
        if !c.needs_shaping() {
            // SAFETY: guaranteed by the caller.
            return unsafe { poll_cq_passing_through(cq, n, wc, c) };
        }
        // SAFETY: guaranteed by the caller.
        return unsafe { poll_cq_shaped(cq, n, wc, c) };
    }
    // SAFETY: guaranteed by the caller.
    unsafe { poll_cq_slow(cq, n, wc) }
}

/// `ops.poll_cq` of a CQ with shaped QPs or pending synthesized completions (`c`, the
/// state of `cq`). The arguments keep the hook's order and the function cannot unwind
/// (`extern "C"`, everything inside caught), so the hook reaches it with a plain jump.
///
/// # Safety
/// As [`poll_cq`].
#[inline(never)]
pub unsafe extern "C" fn poll_cq_shaped(
    _cq: *mut ibv_cq,
    n: c_int,
    wc: *mut ibv_wc,
    c: &'static engine::CqShared,
) -> c_int {
    // Not reached in a forked child: its CQs need no shaping there (see
    // `engine::pass_through_in_child`).
    caught(
        // SAFETY: guaranteed by the caller.
        move || unsafe { c.poll_shaped(n, wc) },
        // SAFETY: as above; `c.cq` is the CQ `c` was found for.
        move || unsafe { (c.poll_cq)(c.cq, n, wc) },
    )
}

/// `ops.poll_cq` of a CQ with no shaped QP and nothing held (`c`, the state of `cq`): the
/// provider's poll, and a second look at the CQ's state once it returns (see
/// [`settle_passed_through`]). Its own function, reached with a plain jump as
/// [`poll_cq_shaped`] is, so that the shaped path pays nothing for it.
///
/// # Safety
/// As [`poll_cq`].
#[inline(never)]
unsafe extern "C" fn poll_cq_passing_through(
    cq: *mut ibv_cq,
    n: c_int,
    wc: *mut ibv_wc,
    c: &'static engine::CqShared,
) -> c_int {
    // SAFETY: the provider's own poll_cq, with the caller's arguments.
    let got = unsafe { (c.poll_cq)(cq, n, wc) };
    if got > 0 && c.needs_shaping() {
        // SAFETY: guaranteed by the caller; `got` entries were written.
        return unsafe { settle_passed_through(wc, got, c) };
    }
    got
}

/// Completions a poll took from the provider on the pass-through path while a QP of the CQ
/// became shaped: the first QP shaped on a CQ may be registered, post and complete between
/// the poll's look at the CQ's state and its call to the provider, and its completions
/// carry the shaper's tags. Its registration counts it in the CQ's state before its first
/// post, and its completions come after that post, so a poll that took one sees the count
/// once the provider returns: then the batch is translated as the shaped path does.
///
/// # Safety
/// As [`poll_cq`], with the provider's `got` (> 0) entries in `wc`.
#[cold]
#[inline(never)]
unsafe fn settle_passed_through(
    wc: *mut ibv_wc,
    got: c_int,
    c: &'static engine::CqShared,
) -> c_int {
    caught(
        // SAFETY: guaranteed by the caller.
        move || unsafe { c.settle_provider_batch(wc, got) },
        move || got,
    )
}

/// `ops.poll_cq` of a CQ outside its home slot, or an unregistered one.
///
/// # Safety
/// As [`poll_cq`].
#[cold]
#[inline(never)]
unsafe extern "C" fn poll_cq_slow(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    if let Some(c) = engine::cq(cq) {
        if !c.needs_shaping() {
            // SAFETY: guaranteed by the caller.
            return unsafe { poll_cq_passing_through(cq, n, wc, c) };
        }
        // SAFETY: guaranteed by the caller.
        return unsafe { poll_cq_shaped(cq, n, wc, c) };
    }
    // SAFETY: a live CQ has a live context.
    match engine::context(unsafe { (*cq).context }).and_then(|c| c.poll_cq) {
        // SAFETY: the provider's own poll_cq.
        Some(f) => unsafe { f(cq, n, wc) },
        None => -libc::EOPNOTSUPP,
    }
}

/// `ops.req_notify_cq`: passed through, except that an arm for the next completion of a
/// receive CQ whose completions are all of split messages becomes one for the next
/// solicited completion (see `CqShared::arm_for_application`), so that the internal
/// receives' completions, which the polls hide, do not wake an event-driven application
/// once per chunk. The shaper notes that the CQ is armed, so that a synthesized completion
/// can raise an event (see [`crate::channel`]).
///
/// # Safety
/// Called by `ibv_req_notify_cq` with a live CQ.
pub unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    let shared = engine::cq(cq);
    let f = match shared.and_then(|c| c.req_notify_cq) {
        Some(f) => Some(f),
        // SAFETY: a live CQ has a live context.
        None => engine::context(unsafe { (*cq).context }).and_then(|c| c.req_notify_cq),
    };
    let rc = match (f, shared) {
        // Passed through in a forked child (`guarded`): the choice takes the shaper's locks.
        (Some(f), Some(c)) if solicited_only == 0 => guarded(
            // SAFETY: the provider's own req_notify_cq, for this live CQ.
            || unsafe { c.arm_for_application(f) },
            // SAFETY: as above.
            || unsafe { f(cq, 0) },
        ),
        // SAFETY: the provider's own req_notify_cq.
        (Some(f), _) => unsafe { f(cq, solicited_only) },
        (None, _) => libc::EOPNOTSUPP,
    };
    // Not in a forked child: noting it takes the shaper's locks.
    if let (0, Some(c), false) = (rc, shared, crate::ffi::in_forked_child()) {
        c.on_armed();
    }
    rc
}
