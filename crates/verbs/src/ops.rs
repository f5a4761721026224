//! The verbs that `<infiniband/verbs.h>` defines `static inline`: they are not exported by
//! libibverbs but dispatch through function pointers that the provider installs in the
//! context (`ibv_context.ops`), in the extended context ([`verbs_context`]) or in the object.
//! They are what a shaper intercepts by replacing those pointers, so calling them here goes
//! through any shaper that did.
//!
//! Every function is `unsafe`: the pointers must be live objects of an open device.

use std::ffi::c_int;
use std::mem::offset_of;

use crate::sys::*;
use crate::VERBS_ABI_IS_EXTENDED;

/// `EOPNOTSUPP`, what rdma-core returns when a provider leaves an inline verb's pointer empty.
const NO_OP: c_int = libc::EOPNOTSUPP;

/// The extended context around `ctx`, or null when the provider did not embed it in one
/// (`verbs_get_ctx`).
///
/// # Safety
/// `ctx` must point to a live `ibv_context`.
pub unsafe fn verbs_get_ctx(ctx: *mut ibv_context) -> *mut verbs_context {
    // SAFETY: the caller guarantees ctx is live; an extended context holds the ibv_context as
    // its last field, so stepping back by that field's offset reaches the containing struct.
    unsafe {
        if (*ctx).abi_compat != VERBS_ABI_IS_EXTENDED {
            return std::ptr::null_mut();
        }
        ctx.cast::<u8>()
            .sub(offset_of!(verbs_context, context))
            .cast::<verbs_context>()
    }
}

/// True when the extended context is large enough to hold the field at `field_offset`
/// (rdma-core's `verbs_get_ctx_op` size check: the struct grows towards lower addresses, so
/// older providers have a smaller `sz` and lack the fields furthest from `context`).
///
/// # Safety
/// `vctx` must point to a live `verbs_context`.
pub unsafe fn verbs_ctx_has(vctx: *const verbs_context, field_offset: usize) -> bool {
    // SAFETY: the caller guarantees vctx is live.
    let sz = unsafe { (*vctx).sz };
    sz >= std::mem::size_of::<verbs_context>() - field_offset
}

/// `ibv_post_send`.
///
/// # Safety
/// `qp` must be a live QP and `wr` a valid work-request list; `bad_wr` must be writable.
pub unsafe fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: guaranteed by the caller.
    unsafe {
        match (*(*qp).context).ops.post_send {
            Some(f) => f(qp, wr, bad_wr),
            None => NO_OP,
        }
    }
}

/// `ibv_post_recv`.
///
/// # Safety
/// As [`post_send`].
pub unsafe fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: guaranteed by the caller.
    unsafe {
        match (*(*qp).context).ops.post_recv {
            Some(f) => f(qp, wr, bad_wr),
            None => NO_OP,
        }
    }
}

/// `ibv_poll_cq`: up to `num_entries` completions into `wc`; the count, or negative on error.
///
/// # Safety
/// `cq` must be a live CQ and `wc` must have room for `num_entries` entries.
pub unsafe fn poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: guaranteed by the caller.
    unsafe {
        match (*(*cq).context).ops.poll_cq {
            Some(f) => f(cq, num_entries, wc),
            None => -NO_OP,
        }
    }
}

/// `ibv_req_notify_cq`.
///
/// # Safety
/// `cq` must be a live CQ.
pub unsafe fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: guaranteed by the caller.
    unsafe {
        match (*(*cq).context).ops.req_notify_cq {
            Some(f) => f(cq, solicited_only),
            None => NO_OP,
        }
    }
}

/// `ibv_query_port`: the extended query when the provider has one, else the exported verb
/// that fills the leading part of the attributes (`query_port_compat`).
///
/// # Safety
/// `ctx` must be a live context; `query_port_compat` must be libibverbs' `ibv_query_port`.
pub unsafe fn query_port(
    ctx: *mut ibv_context,
    port_num: u8,
    attr: &mut ibv_port_attr,
    query_port_compat: unsafe extern "C" fn(
        *mut ibv_context,
        u8,
        *mut _compat_ibv_port_attr,
    ) -> c_int,
) -> c_int {
    // SAFETY: guaranteed by the caller; the compat struct is a prefix of ibv_port_attr.
    unsafe {
        let vctx = verbs_get_ctx(ctx);
        if !vctx.is_null() && verbs_ctx_has(vctx, offset_of!(verbs_context, query_port)) {
            if let Some(f) = (*vctx).query_port {
                return f(ctx, port_num, attr, std::mem::size_of::<ibv_port_attr>());
            }
        }
        *attr = ibv_port_attr::default();
        query_port_compat(ctx, port_num, (attr as *mut ibv_port_attr).cast())
    }
}

/// `ibv_create_qp_ex` through the extended context. (The header's inline version first
/// routes a request that sets only the PD to the exported `ibv_create_qp`; callers that
/// want that do it themselves.) Null with `errno` set on failure.
///
/// # Safety
/// `ctx` must be a live context and `attr` a valid, initialised attribute block.
pub unsafe fn create_qp_ex(ctx: *mut ibv_context, attr: *mut ibv_qp_init_attr_ex) -> *mut ibv_qp {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let vctx = verbs_get_ctx(ctx);
        if !vctx.is_null() && verbs_ctx_has(vctx, offset_of!(verbs_context, create_qp_ex)) {
            if let Some(f) = (*vctx).create_qp_ex {
                return f(ctx, attr);
            }
        }
        set_errno(NO_OP);
        std::ptr::null_mut()
    }
}

/// `ibv_create_cq_ex` through the extended context. Null with `errno` set on failure.
///
/// # Safety
/// As [`create_qp_ex`].
pub unsafe fn create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let vctx = verbs_get_ctx(ctx);
        if !vctx.is_null() && verbs_ctx_has(vctx, offset_of!(verbs_context, create_cq_ex)) {
            if let Some(f) = (*vctx).create_cq_ex {
                return f(ctx, attr);
            }
        }
        set_errno(NO_OP);
        std::ptr::null_mut()
    }
}

/// `ibv_query_device_ex` through the extended context, with an empty input and the whole
/// `attr` as this crate's headers lay it out (a provider fills what it knows of it).
/// `EOPNOTSUPP` when the provider has no extended query.
///
/// # Safety
/// `ctx` must be a live context.
pub unsafe fn query_device_ex(ctx: *mut ibv_context, attr: &mut ibv_device_attr_ex) -> c_int {
    let input = ibv_query_device_ex_input { comp_mask: 0 };
    // SAFETY: guaranteed by the caller; input and attr are valid for the call.
    unsafe {
        let vctx = verbs_get_ctx(ctx);
        if !vctx.is_null() && verbs_ctx_has(vctx, offset_of!(verbs_context, query_device_ex)) {
            if let Some(f) = (*vctx).query_device_ex {
                return f(ctx, &input, attr, std::mem::size_of::<ibv_device_attr_ex>());
            }
        }
        NO_OP
    }
}

/// Sets the calling thread's `errno`.
pub fn set_errno(value: c_int) {
    // SAFETY: __errno_location returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() = value };
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn extended_context_is_found_from_its_embedded_context() {
        let mut vctx = verbs_context {
            sz: std::mem::size_of::<verbs_context>(),
            ..Default::default()
        };
        vctx.context.abi_compat = VERBS_ABI_IS_EXTENDED;
        let ctx: *mut ibv_context = &mut vctx.context;
        // SAFETY: ctx points into vctx, which is live.
        let found = unsafe { verbs_get_ctx(ctx) };
        assert_eq!(found, &mut vctx as *mut verbs_context);
        // SAFETY: as above.
        assert!(unsafe { verbs_ctx_has(found, offset_of!(verbs_context, create_qp_ex)) });
    }

    #[test]
    fn legacy_context_has_no_extension_and_small_contexts_lack_new_fields() {
        let mut vctx = verbs_context::default();
        let ctx: *mut ibv_context = &mut vctx.context;
        // SAFETY: ctx points into vctx, which is live.
        assert!(unsafe { verbs_get_ctx(ctx) }.is_null());
        // A provider built against an older header: only the fields next to `context`.
        vctx.sz = std::mem::size_of::<verbs_context>() - offset_of!(verbs_context, create_qp_ex);
        // SAFETY: vctx is live.
        unsafe {
            assert!(verbs_ctx_has(
                &vctx,
                offset_of!(verbs_context, create_qp_ex)
            ));
            assert!(!verbs_ctx_has(
                &vctx,
                offset_of!(verbs_context, create_cq_ex)
            ));
        }
    }

    #[test]
    fn missing_provider_ops_report_not_supported() {
        let mut ctx = ibv_context::default();
        let mut cq = ibv_cq {
            context: &mut ctx,
            ..Default::default()
        };
        // SAFETY: cq and ctx are live; no op is installed, so nothing is dereferenced further.
        unsafe {
            assert_eq!(poll_cq(&mut cq, 1, std::ptr::null_mut()), -libc::EOPNOTSUPP);
            assert_eq!(req_notify_cq(&mut cq, 0), libc::EOPNOTSUPP);
            assert!(create_cq_ex(&mut ctx, std::ptr::null_mut()).is_null());
        }
    }
}
