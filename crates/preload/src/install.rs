//! Which of the shaper's functions replace which of the provider's, declared in one place
//! and installed in one place, as rdma-core declares a provider's ops table and installs
//! it with `verbs_set_ops`.
//!
//! - A device context: [`CONTEXT_HOOKS`], into `ibv_context.ops` and the extended context.
//! - An extended CQ (`ibv_create_cq_ex`) that may serve shaped QPs: [`install_cq_ex`].
//! - An extended QP (`ibv_create_qp_ex` with `ibv_wr_*` send operations):
//!   [`install_qp_ex`], all of them when the QP is shaped, the counting ones when observed.
//!
//! Every pointer is installed only where the provider had one, and only after the object
//! is registered: a hook always finds the state it needs. This module is the only one that
//! names both the state ([`crate::engine`]) and the hooks ([`crate::hooks`],
//! [`crate::cq_ex`], [`crate::qp_ex`]); neither names it.

use std::sync::Arc;

use justitia_core::control_verbs::ControlVerb;
use justitia_verbs::ops::set_errno;
use justitia_verbs::sys::*;

use crate::cq_ex;
use crate::engine::{self, CtxShared, Engine, QpInit, QpShared};
use crate::ffi::{guarded, in_shaper};
use crate::hooks;
use crate::qp_ex;
use crate::registry::PtrMap;

/// The shaper's functions for a device context's pointers.
pub struct ContextHooks {
    /// `ibv_context.ops.post_send`.
    pub post_send: engine::PostSendFn,
    /// `ibv_context.ops.post_recv`.
    pub post_recv: engine::PostRecvFn,
    /// `ibv_context.ops.poll_cq`, installed only in a process whose class shapes QPs.
    pub poll_cq: engine::PollCqFn,
    /// `ibv_context.ops.req_notify_cq`.
    pub req_notify_cq: engine::ReqNotifyFn,
    /// `verbs_context.create_qp_ex`.
    pub create_qp_ex: engine::CreateQpExFn,
    /// `verbs_context.create_cq_ex`.
    pub create_cq_ex: engine::CreateCqExFn,
}

/// The table installed in every attached context.
pub const CONTEXT_HOOKS: ContextHooks = ContextHooks {
    post_send: hooks::post_send,
    post_recv: hooks::post_recv,
    poll_cq: hooks::poll_cq,
    req_notify_cq: hooks::req_notify_cq,
    create_qp_ex,
    create_cq_ex,
};

/// Attaches `ctx` to `engine` and installs [`CONTEXT_HOOKS`] where the provider has the
/// pointers (the poll only when the engine may shape a QP). Returns false when it was attached already (nothing is installed twice).
///
/// # Safety
/// `ctx` must be a live, just-opened context that no other thread uses yet.
pub unsafe fn attach_context(ctx: *mut ibv_context, engine: Arc<Engine>) -> bool {
    // A process that shapes nothing keeps the provider's poll: it has nothing to translate,
    // and its polls then cost nothing (see `Engine::shapes_any`); unless it times its
    // latency requests' round trips for the daemon, whose completions its polls return:
    // it gets hooks of its own for that, so that no other process pays for the timing.
    let polls_translated = engine.shapes_any();
    let timed = engine.round_trips().is_some();
    // SAFETY: guaranteed by the caller.
    if !unsafe { engine::attach_context(ctx, engine) } {
        return false;
    }
    let t = CONTEXT_HOOKS;
    // SAFETY: guaranteed by the caller; the extended part is read only when present.
    unsafe {
        let ops = &mut (*ctx).ops;
        if ops.post_send.is_some() {
            ops.post_send = Some(if timed {
                hooks::post_send_timed
            } else {
                t.post_send
            });
        }
        if ops.post_recv.is_some() {
            ops.post_recv = Some(t.post_recv);
        }
        if ops.poll_cq.is_some() && (polls_translated || timed) {
            ops.poll_cq = Some(if timed {
                hooks::poll_cq_timed
            } else {
                t.poll_cq
            });
        }
        if ops.req_notify_cq.is_some() {
            ops.req_notify_cq = Some(t.req_notify_cq);
        }
        let c = engine::context(ctx);
        let vctx = justitia_verbs::ops::verbs_get_ctx(ctx);
        if let (Some(c), false) = (c, vctx.is_null()) {
            if c.create_qp_ex.is_some() {
                (*vctx).create_qp_ex = Some(t.create_qp_ex);
            }
            if c.create_cq_ex.is_some() {
                (*vctx).create_cq_ex = Some(t.create_cq_ex);
            }
        }
    }
    true
}

/// Registers a QP and, when it has the `ibv_wr_*` interface (`qpx` non-null), installs the
/// shaper's pointers in it.
///
/// # Safety
/// As [`engine::register_qp`].
pub unsafe fn register_qp(ctx: &CtxShared, qp: *mut ibv_qp, init: QpInit, qpx: *mut ibv_qp_ex) {
    // SAFETY: guaranteed by the caller.
    unsafe { register_qp_in(&engine::QPS, ctx, qp, init, qpx) };
}

/// [`register_qp`] into `qps`; returns whether the QP was registered (its pointers are
/// left the provider's when not).
///
/// # Safety
/// As [`engine::register_qp`].
pub(crate) unsafe fn register_qp_in<const N: usize>(
    qps: &PtrMap<QpShared, N>,
    ctx: &CtxShared,
    qp: *mut ibv_qp,
    init: QpInit,
    qpx: *mut ibv_qp_ex,
) -> bool {
    // SAFETY: guaranteed by the caller.
    if !unsafe { engine::register_qp_in(qps, ctx, qp, init, qpx) } {
        return false;
    }
    // SAFETY: registered just above, so the state is in the map.
    let shaped = qps
        .get(qp.cast())
        .is_some_and(|p| unsafe { p.as_ref() }.shaped);
    // SAFETY: qpx is null or the live extended QP whose pointers were saved.
    if let Some(x) = unsafe { qpx.as_mut() } {
        install_qp_ex(x, shaped);
    }
    true
}

/// Registers a CQ and, when it is an extended one the shaper may shape, installs its poll
/// hooks.
///
/// # Safety
/// As [`engine::register_cq`].
pub unsafe fn register_cq(ctx: &CtxShared, cq: *mut ibv_cq, cqx: *mut ibv_cq_ex, wc_flags: u64) {
    // SAFETY: guaranteed by the caller.
    if unsafe { engine::register_cq(ctx, cq, cqx, wc_flags) } {
        // SAFETY: register_cq said cqx is a live extended CQ whose pointers it saved.
        if let Some(x) = unsafe { cqx.as_mut() } {
            install_cq_ex(x);
        }
    }
}

/// Installs the shaper's poll verbs in an extended CQ, and its accessors in place of the
/// provider's it has.
pub fn install_cq_ex(cqx: &mut ibv_cq_ex) {
    cq_ex::install(cqx);
}

/// Installs the shaper's `ibv_wr_*` pointers in an extended QP: all of them when `shaped`,
/// else the counting wrappers of the verbs that start a request or set its SGEs.
pub fn install_qp_ex(qpx: &mut ibv_qp_ex, shaped: bool) {
    qp_ex::install(qpx, shaped);
}

/// `verbs_context.create_qp_ex` (reached by the inline `ibv_create_qp_ex`).
///
/// # Safety
/// Called with a live context and a valid attribute block.
pub unsafe extern "C" fn create_qp_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    let Some(c) = engine::context(ctx) else {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    };
    let Some(real) = c.create_qp_ex else {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    };
    if !in_shaper() && !crate::ffi::in_forked_child() {
        let engine = &c.engine;
        guarded(|| engine.before_control_verb(ControlVerb::CreateQp), || ());
    }
    // SAFETY: the provider's own create_qp_ex, with the caller's arguments.
    let qp = unsafe { real(ctx, attr) };
    if qp.is_null() || attr.is_null() || in_shaper() {
        return qp;
    }
    guarded(
        || {
            // SAFETY: attr is the caller's valid block, updated by the provider.
            let a = unsafe { &*attr };
            let send_ops = a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0;
            let shapable = !send_ops || engine::shapable_send_ops(a.send_ops_flags);
            let init = QpInit {
                send_cq: a.send_cq,
                recv_cq: a.recv_cq,
                qp_type: a.qp_type,
                sig_all: a.sq_sig_all != 0,
                cap: a.cap,
                shapable,
                has_srq: !a.srq.is_null(),
            };
            // rdma-core allocates a QP as part of its extended form, whose first member
            // is the ibv_qp (ibv_qp_to_qp_ex is that cast once the send ops were asked for).
            // A QP that passes through whole keeps every pointer the provider's.
            let qpx = if send_ops && shapable {
                qp.cast::<ibv_qp_ex>()
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: qp was just created on ctx.
            unsafe { register_qp(c, qp, init, qpx) };
        },
        || (),
    );
    qp
}

/// `verbs_context.create_cq_ex` (reached by the inline `ibv_create_cq_ex`).
///
/// When the shaper may shape, it asks the provider for QP numbers in the completions
/// (`IBV_WC_EX_WITH_QP_NUM`) even if the application did not, so that completions of
/// several shaped QPs sharing the CQ are attributed exactly; if the provider refuses, the
/// CQ is created as the application asked. The application's attribute block is left as
/// it gave it.
///
/// # Safety
/// Called with a live context and a valid attribute block.
pub unsafe extern "C" fn create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    let Some(c) = engine::context(ctx) else {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    };
    let Some(real) = c.create_cq_ex else {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    };
    let qp_num = u64::from(IBV_WC_EX_WITH_QP_NUM);
    // SAFETY: attr is the caller's valid block (or null).
    let asked = unsafe { attr.as_ref() }.map(|a| a.wc_flags);
    let mut wc_flags = asked.unwrap_or(0);
    let mut cqx = std::ptr::null_mut();
    if let (Some(flags), true) = (asked, c.engine.config().class.is_some()) {
        if flags & qp_num == 0 {
            // SAFETY: attr is non-null here; the provider's own create_cq_ex.
            unsafe {
                (*attr).wc_flags = flags | qp_num;
                cqx = real(ctx, attr);
                (*attr).wc_flags = flags;
            }
            if !cqx.is_null() {
                wc_flags = flags | qp_num;
            }
        }
    }
    if cqx.is_null() {
        // SAFETY: the provider's own create_cq_ex, with the caller's arguments.
        cqx = unsafe { real(ctx, attr) };
    }
    if cqx.is_null() || in_shaper() {
        return cqx;
    }
    guarded(
        // SAFETY: the extended CQ begins with the ibv_cq (ibv_cq_ex_to_cq is a cast).
        || unsafe { register_cq(c, cqx.cast::<ibv_cq>(), cqx, wc_flags) },
        || (),
    );
    cqx
}
