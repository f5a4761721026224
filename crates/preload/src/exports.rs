//! The exported verbs that the library interposes, and the process's engine.
//!
//! Each wrapped verb is exported twice, like libibverbs exports it: the current version
//! (`@@IBVERBS_1.1`, what programs built against rdma-core bind to) runs the shaper around
//! the real verb, and the compatibility version (`@IBVERBS_1.0`, what programs built
//! against the old libibverbs bind to) forwards to libibverbs' own 1.0 entry, whose
//! compatibility layer calls the 1.1 verbs through the global scope and so reaches the
//! shaper too. The versions come from `.symver` directives below and the version script
//! `exports.map` (passed to the linker by `build.rs`). The real verbs are found at the exact
//! version in the libibverbs the process actually loaded, linked or loaded later with
//! `dlopen(RTLD_LOCAL)` (see [`justitia_verbs::loader::real_symbol`]). A verb that cannot be
//! found is looked for again at the next call; until then the call fails as libibverbs
//! would without a device (said once on stderr), never because of the shaper's settings. `ibv_get_cq_event` and
//! `ibv_ack_cq_events` are exported at 1.1 only: their 1.0 entries take old-layout CQs,
//! and a program bound to them is served by libibverbs alone.
//!
//! A thread-local flag marks when the shaper itself is inside a real verb, so that a verb
//! libibverbs or a provider calls from there passes straight through. No wrapper unwinds:
//! the shaper's part runs under `catch_unwind` and the real verb's result is returned
//! whatever happens to it. The exception is `ibv_get_cq_event`, which blocks at a POSIX
//! cancellation point: a cancelled thread must unwind through it, which `catch_unwind`
//! would turn into an abort, so it holds nothing that could panic or needs dropping there.

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, OnceLock};

use justitia_core::control_verbs::ControlVerb;
use justitia_verbs::loader::real_symbol;
use justitia_verbs::ops::set_errno;
use justitia_verbs::sys::*;

use crate::channel::{AckCqEventsFn, GetCqEventFn};
use crate::clock::{Clock, MonotonicClock};
use crate::config::Config;
use crate::engine::{self, Engine, PacerMode, QpInit};
use crate::ffi::{guarded, Reentry};
use crate::log::{self, log, LogLevel};

static ENGINE: OnceLock<Option<Arc<Engine>>> = OnceLock::new();

/// The process's engine, made from the environment on first use; `None` when a setting
/// was invalid, or in a program running with privileges its user lacks (the shaper is then
/// off and everything passes through).
///
/// A deployment preloads the shaper through `/etc/ld.so.preload`, which the dynamic linker
/// honours for set-user-ID programs too (unlike `LD_PRELOAD`); their environment is the
/// invoking user's, so a `JUSTITIA_STATS` path there would have a privileged process write
/// where the user chooses. In secure-execution mode (`AT_SECURE`, as glibc's
/// `secure_getenv` decides) the shaper reads none of its variables and shapes nothing.
pub fn global_engine() -> Option<&'static Arc<Engine>> {
    ENGINE
        .get_or_init(|| {
            // SAFETY: getauxval reads the process's auxiliary vector.
            if unsafe { libc::getauxval(libc::AT_SECURE) } != 0 {
                log!(
                    Info,
                    "a set-user-ID or privileged program: the shaper passes everything through"
                );
                return None;
            }
            crate::ffi::watch_forks();
            let engine = engine_from(
                |name| std::env::var(name).ok(),
                Arc::new(MonotonicClock::new()),
                PacerMode::Thread,
            )?;
            if engine.config().stats_path.is_some() {
                // SAFETY: registers a function with no preconditions to run at exit.
                if unsafe { libc::atexit(write_stats_at_exit) } != 0 {
                    log!(
                        Warn,
                        "cannot register the exit handler; JUSTITIA_STATS will not be written"
                    );
                }
            }
            Some(engine)
        })
        .as_ref()
}

/// An engine with the settings read through `lookup`. When a setting is invalid, says so
/// in one line on stderr (naming the variable) and returns `None`: the shaper is then off
/// and traffic passes through unshaped. It never aborts the application.
pub fn engine_from(
    lookup: impl Fn(&str) -> Option<String>,
    clock: Arc<dyn Clock>,
    pacer: PacerMode,
) -> Option<Arc<Engine>> {
    match Config::from_lookup(&lookup) {
        Ok(config) => {
            log::set_level(config.log);
            log!(Info, "{config}");
            for note in config.notes() {
                log!(Warn, "{note}");
            }
            Some(Engine::new(config, clock, pacer))
        }
        Err(e) => {
            let level = lookup("JUSTITIA_LOG")
                .and_then(|v| v.parse().ok())
                .unwrap_or(LogLevel::Warn);
            log::set_level(level);
            log!(
                Warn,
                "{e}; the shaper is off, traffic passes through unshaped"
            );
            None
        }
    }
}

extern "C" fn write_stats_at_exit() {
    guarded(
        || {
            let Some(Some(engine)) = ENGINE.get() else {
                return;
            };
            if let Some(path) = engine.config().stats_path_for(std::process::id()) {
                if let Err(e) = engine.stats().write_to(&path) {
                    log!(
                        Warn,
                        "cannot write JUSTITIA_STATS to {}: {e}",
                        path.display()
                    );
                }
            }
        },
        || (),
    );
}

/// The real verb `name` at `version`, or null when no loaded libibverbs defines it (said
/// once per process on stderr).
fn find_real(name: &CStr, version: &CStr) -> *mut c_void {
    // glibc's answers, not the shaper's own entries (see `crate::dl`).
    #[cfg(target_env = "gnu")]
    let _real = crate::ffi::ResolvingReal::hold();
    // SAFETY: the address is only transmuted by `real!` to the verb's C signature.
    match unsafe { real_symbol(name, Some(version)) } {
        Some(p) => p,
        None => {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                log!(
                    Warn,
                    "{}@{} is not in any libibverbs loaded in this process; the call fails as it would without RDMA",
                    name.to_string_lossy(),
                    version.to_string_lossy()
                );
            }
            std::ptr::null_mut()
        }
    }
}

/// Resolves the real verb `$name` at version `$ver` as a `$ty`; a found address is cached,
/// a missing one looked for again next time (libibverbs may be loaded later).
macro_rules! real {
    ($name:literal, $ver:literal, $ty:ty) => {{
        static CACHE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
        let mut p = CACHE.load(Ordering::Acquire);
        if p.is_null() {
            let name = CStr::from_bytes_with_nul(concat!($name, "\0").as_bytes());
            let ver = CStr::from_bytes_with_nul(concat!($ver, "\0").as_bytes());
            if let (Ok(name), Ok(ver)) = (name, ver) {
                p = find_real(name, ver);
                CACHE.store(p, Ordering::Release);
            }
        }
        if p.is_null() {
            None
        } else {
            // SAFETY: p is the verb $name@$ver, whose C signature is $ty.
            Some(unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
        }
    }};
}

type OpenDevice = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
type CloseDevice = unsafe extern "C" fn(*mut ibv_context) -> c_int;
type CreateQp = unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
type RegMrIova2 =
    unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, std::ffi::c_uint) -> *mut ibv_mr;
type RegDmabufMr = unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
type DestroyQp = unsafe extern "C" fn(*mut ibv_qp) -> c_int;
type ModifyQp = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
type CreateCq = unsafe extern "C" fn(
    *mut ibv_context,
    c_int,
    *mut c_void,
    *mut ibv_comp_channel,
    c_int,
) -> *mut ibv_cq;
type DestroyCq = unsafe extern "C" fn(*mut ibv_cq) -> c_int;

/// The shaper's part of `ibv_open_device`: attach the new context to the process's engine.
///
/// # Safety
/// `ctx` is null or a context just opened.
pub unsafe fn on_open_device(ctx: *mut ibv_context) {
    if ctx.is_null() || crate::ffi::in_forked_child() {
        return;
    }
    if let Some(engine) = global_engine() {
        // SAFETY: guaranteed by the caller.
        let attached = guarded(
            || unsafe { crate::install::attach_context(ctx, Arc::clone(engine)) },
            || false,
        );
        // SAFETY: as above.
        if attached && guarded(|| unsafe { is_soft_roce(ctx) }, || false) {
            engine::mark_soft_roce(ctx);
            log!(
                Info,
                "the device is Soft-RoCE (rxe): a bandwidth flow's RDMA WRITE goes one path MTU a work request"
            );
        }
    }
}

/// The vendor ID Soft-RoCE (rxe) reports (`RXE_VENDOR_ID`, Linux 5.9 and later).
const RXE_VENDOR_ID: u32 = 0xff_ffff;

type QueryDevice = unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;

/// Whether the device of `ctx` is Soft-RoCE (rxe), by the vendor ID it reports.
///
/// # Safety
/// `ctx` must be a live context.
unsafe fn is_soft_roce(ctx: *mut ibv_context) -> bool {
    let Some(query) = real!("ibv_query_device", "IBVERBS_1.1", QueryDevice) else {
        return false;
    };
    // SAFETY: a plain C struct, all zeroes is a valid value.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the real verb on a live context, with an attribute block it may fill.
    unsafe { query(ctx, &mut attr) == 0 && attr.vendor_id == RXE_VENDOR_ID }
}

/// The shaper's part of `ibv_create_qp`: register the new QP.
///
/// # Safety
/// `qp` is null or a QP just created with `attr` on `pd`.
pub unsafe fn on_create_qp(qp: *mut ibv_qp, attr: *const ibv_qp_init_attr) {
    // SAFETY: guaranteed by the caller.
    let (Some(q), Some(a)) = (unsafe { qp.as_ref() }, unsafe { attr.as_ref() }) else {
        return;
    };
    let Some(c) = engine::context(q.context) else {
        return;
    };
    let init = QpInit {
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        qp_type: a.qp_type,
        sig_all: a.sq_sig_all != 0,
        cap: a.cap,
        shapable: true,
        has_srq: !a.srq.is_null(),
    };
    // SAFETY: qp was just created on its context.
    guarded(
        || unsafe { crate::install::register_qp(c, qp, init, std::ptr::null_mut()) },
        || (),
    );
}

/// The shaper's part of `ibv_create_cq`: register the new CQ.
///
/// # Safety
/// `cq` is null or a CQ just created on `ctx`.
pub unsafe fn on_create_cq(ctx: *mut ibv_context, cq: *mut ibv_cq) {
    if cq.is_null() {
        return;
    }
    if let Some(c) = engine::context(ctx) {
        // SAFETY: cq was just created on ctx.
        guarded(
            || unsafe { crate::install::register_cq(c, cq, std::ptr::null_mut(), 0) },
            || (),
        );
    }
}

/// `ibv_open_device@@IBVERBS_1.1`.
///
/// # Safety
/// As `ibv_open_device`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_open_device_1_1(dev: *mut ibv_device) -> *mut ibv_context {
    let Some(real) = real!("ibv_open_device", "IBVERBS_1.1", OpenDevice) else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    let Some(_inside) = Reentry::enter() else {
        // SAFETY: the real verb with the caller's arguments.
        return unsafe { real(dev) };
    };
    // SAFETY: the real verb with the caller's arguments.
    let ctx = unsafe { real(dev) };
    // SAFETY: ctx was just opened.
    unsafe { on_open_device(ctx) };
    ctx
}

/// `ibv_close_device@@IBVERBS_1.1`.
///
/// # Safety
/// As `ibv_close_device`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_close_device_1_1(ctx: *mut ibv_context) -> c_int {
    let Some(real) = real!("ibv_close_device", "IBVERBS_1.1", CloseDevice) else {
        return libc::ENOSYS;
    };
    let Some(_inside) = Reentry::enter() else {
        // SAFETY: the real verb with the caller's arguments.
        return unsafe { real(ctx) };
    };
    guarded(|| engine::detach_context(ctx), || ());
    // SAFETY: the real verb with the caller's arguments.
    unsafe { real(ctx) }
}

/// Waits for the process's turn to issue control verb `verb` under its control-verb
/// budget ([`Engine::before_control_verb`]); at once when the shaper is off or in a
/// forked child, which pass everything through.
pub fn pace_control_verb(verb: ControlVerb) {
    guarded(
        || {
            if crate::ffi::in_forked_child() {
                return;
            }
            if let Some(engine) = global_engine() {
                engine.before_control_verb(verb);
            }
        },
        || (),
    );
}

/// `ibv_reg_mr_iova2@@IBVERBS_1.8`: paced as a control verb. libibverbs' `ibv_reg_mr`
/// (every version) and `ibv_reg_mr_iova` call it through the global scope, so this one
/// entry paces every registration of a virtual address range. With a libibverbs older
/// than rdma-core 29, which has no `ibv_reg_mr_iova2`, registrations are not paced.
///
/// # Safety
/// As `ibv_reg_mr_iova2`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_reg_mr_iova2_1_8(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: std::ffi::c_uint,
) -> *mut ibv_mr {
    let Some(real) = real!("ibv_reg_mr_iova2", "IBVERBS_1.8", RegMrIova2) else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    if let Some(_inside) = Reentry::enter() {
        pace_control_verb(ControlVerb::RegMr);
    }
    // SAFETY: the real verb with the caller's arguments.
    unsafe { real(pd, addr, length, iova, access) }
}

/// `ibv_reg_dmabuf_mr@@IBVERBS_1.12`: a registration of a dma-buf (GPU memory, as NCCL's
/// GPUDirect path registers it), paced as every other registration.
///
/// # Safety
/// As `ibv_reg_dmabuf_mr`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_reg_dmabuf_mr_1_12(
    pd: *mut ibv_pd,
    offset: u64,
    length: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut ibv_mr {
    let Some(real) = real!("ibv_reg_dmabuf_mr", "IBVERBS_1.12", RegDmabufMr) else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    if let Some(_inside) = Reentry::enter() {
        pace_control_verb(ControlVerb::RegMr);
    }
    // SAFETY: the real verb with the caller's arguments.
    unsafe { real(pd, offset, length, iova, fd, access) }
}

/// `ibv_create_qp@@IBVERBS_1.1`.
///
/// # Safety
/// As `ibv_create_qp`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_create_qp_1_1(
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    let Some(real) = real!("ibv_create_qp", "IBVERBS_1.1", CreateQp) else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    let Some(_inside) = Reentry::enter() else {
        // SAFETY: the real verb with the caller's arguments.
        return unsafe { real(pd, attr) };
    };
    pace_control_verb(ControlVerb::CreateQp);
    // SAFETY: the real verb with the caller's arguments.
    let qp = unsafe { real(pd, attr) };
    // SAFETY: qp was just created with attr.
    unsafe { on_create_qp(qp, attr) };
    qp
}

/// `ibv_destroy_qp@@IBVERBS_1.1`.
///
/// # Safety
/// As `ibv_destroy_qp`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_destroy_qp_1_1(qp: *mut ibv_qp) -> c_int {
    let Some(real) = real!("ibv_destroy_qp", "IBVERBS_1.1", DestroyQp) else {
        return libc::ENOSYS;
    };
    let Some(_inside) = Reentry::enter() else {
        // SAFETY: the real verb with the caller's arguments.
        return unsafe { real(qp) };
    };
    // Forgotten before the destroy, while its number is still its own: once destroyed, the
    // number may go to a queue pair another thread creates and connects at once. (A
    // destroy that fails leaves a queue pair that goes whole from now on.)
    // SAFETY: the caller's live QP.
    if let Some(q) = unsafe { qp.as_ref() } {
        guarded(|| crate::pairing::on_destroy(q.qp_num), || ());
    }
    // SAFETY: the real verb with the caller's arguments.
    guarded(
        || engine::destroy_qp(qp, || unsafe { real(qp) }),
        || libc::EIO,
    )
}

/// `ibv_modify_qp@@IBVERBS_1.1`: a move that brings a QP up again waits for the
/// control-verb budget as a creation (`QpShared::rebrings_up`).
///
/// # Safety
/// As `ibv_modify_qp`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_modify_qp_1_1(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    let Some(real) = real!("ibv_modify_qp", "IBVERBS_1.1", ModifyQp) else {
        return libc::ENOSYS;
    };
    engine::two_sided::set_modify_qp(real);
    let Some(_inside) = Reentry::enter() else {
        // SAFETY: the real verb with the caller's arguments.
        return unsafe { real(qp, attr, mask) };
    };
    // SAFETY: the caller's attribute block, read only.
    if let Some(a) = unsafe { attr.as_ref() } {
        if engine::qp(qp).is_some_and(|q| q.rebrings_up(a, mask as u32)) {
            pace_control_verb(ControlVerb::CreateQp);
        }
    }
    // SAFETY: the real verb with the caller's arguments.
    let rc = unsafe { real(qp, attr, mask) };
    // SAFETY: the caller's attribute block.
    if let (0, Some(a)) = (rc, unsafe { attr.as_ref() }) {
        // SAFETY: a QP the provider just modified is live.
        if let Some(live) = unsafe { qp.as_ref() } {
            guarded(|| crate::remote::on_modify(live, a, mask as u32), || ());
            guarded(|| crate::pairing::on_modify(live, a, mask as u32), || ());
        }
        if let Some(q) = engine::qp(qp) {
            guarded(|| q.on_modify(a, mask as u32), || ());
        }
    }
    rc
}

/// `ibv_create_cq@@IBVERBS_1.1`.
///
/// # Safety
/// As `ibv_create_cq`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_create_cq_1_1(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    let Some(real) = real!("ibv_create_cq", "IBVERBS_1.1", CreateCq) else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    let Some(_inside) = Reentry::enter() else {
        // SAFETY: the real verb with the caller's arguments.
        return unsafe { real(ctx, cqe, cq_context, channel, comp_vector) };
    };
    // SAFETY: the real verb with the caller's arguments.
    let cq = unsafe { real(ctx, cqe, cq_context, channel, comp_vector) };
    // SAFETY: cq was just created on ctx.
    unsafe { on_create_cq(ctx, cq) };
    cq
}

/// `ibv_destroy_cq@@IBVERBS_1.1`.
///
/// # Safety
/// As `ibv_destroy_cq`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_destroy_cq_1_1(cq: *mut ibv_cq) -> c_int {
    let Some(real) = real!("ibv_destroy_cq", "IBVERBS_1.1", DestroyCq) else {
        return libc::ENOSYS;
    };
    let Some(_inside) = Reentry::enter() else {
        // SAFETY: the real verb with the caller's arguments.
        return unsafe { real(cq) };
    };
    // SAFETY: the real verb with the caller's arguments.
    guarded(
        || engine::destroy_cq(cq, || unsafe { real(cq) }),
        || libc::EIO,
    )
}

/// `ibv_get_cq_event@@IBVERBS_1.1`: the kernel's events, and the shaper's own for
/// synthesized completions (see [`crate::channel`]).
///
/// # Safety
/// As `ibv_get_cq_event`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_get_cq_event_1_1(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    let Some(real) = real!("ibv_get_cq_event", "IBVERBS_1.1", GetCqEventFn) else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    // No guard and no catch_unwind here: the call blocks at a cancellation point, and a
    // cancelled thread must unwind through this frame (see crate::channel).
    // SAFETY: the caller's arguments and libibverbs' own verb.
    unsafe { crate::channel::get_cq_event(channel, cq, cq_context, real) }
}

/// `ibv_ack_cq_events@@IBVERBS_1.1`: acknowledges the shaper's own events itself.
///
/// # Safety
/// As `ibv_ack_cq_events`.
#[no_mangle]
pub unsafe extern "C" fn justitia_ibv_ack_cq_events_1_1(cq: *mut ibv_cq, nevents: u32) {
    if let Some(real) = real!("ibv_ack_cq_events", "IBVERBS_1.1", AckCqEventsFn) {
        // SAFETY: the caller's arguments and libibverbs' own verb.
        unsafe { crate::channel::ack_cq_events(cq, nevents, real) };
    }
}

/// The IBVERBS_1.0 entries: forward to libibverbs' own compatibility entries, which call
/// the 1.1 verbs (and so the shaper) themselves. Their structures are the old ones, opaque
/// here.
macro_rules! forward_1_0 {
    ($export:ident, $name:literal, fn($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty, $fail:expr) => {
        /// The IBVERBS_1.0 entry of the verb of the same name, forwarded unchanged.
        ///
        /// # Safety
        /// As the 1.0 verb.
        #[no_mangle]
        pub unsafe extern "C" fn $export($($arg: $ty),*) -> $ret {
            match real!($name, "IBVERBS_1.0", unsafe extern "C" fn($($ty),*) -> $ret) {
                // SAFETY: the real 1.0 verb with the caller's arguments.
                Some(f) => unsafe { f($($arg),*) },
                None => $fail,
            }
        }
    };
}

forward_1_0!(
    justitia_ibv_open_device_1_0,
    "ibv_open_device",
    fn(dev: *mut c_void) -> *mut c_void,
    std::ptr::null_mut()
);
forward_1_0!(
    justitia_ibv_close_device_1_0,
    "ibv_close_device",
    fn(ctx: *mut c_void) -> c_int,
    libc::ENOSYS
);
forward_1_0!(
    justitia_ibv_create_qp_1_0,
    "ibv_create_qp",
    fn(pd: *mut c_void, attr: *mut c_void) -> *mut c_void,
    std::ptr::null_mut()
);
forward_1_0!(
    justitia_ibv_destroy_qp_1_0,
    "ibv_destroy_qp",
    fn(qp: *mut c_void) -> c_int,
    libc::ENOSYS
);
forward_1_0!(
    justitia_ibv_modify_qp_1_0,
    "ibv_modify_qp",
    fn(qp: *mut c_void, attr: *mut c_void, mask: c_int) -> c_int,
    libc::ENOSYS
);
forward_1_0!(
    justitia_ibv_create_cq_1_0,
    "ibv_create_cq",
    fn(
        ctx: *mut c_void,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut c_void,
        comp_vector: c_int,
    ) -> *mut c_void,
    std::ptr::null_mut()
);
forward_1_0!(
    justitia_ibv_destroy_cq_1_0,
    "ibv_destroy_cq",
    fn(cq: *mut c_void) -> c_int,
    libc::ENOSYS
);

// The versioned names of the entries above. Left out of the crate's own tests, which link
// without the version script that defines the version nodes.
#[cfg(not(test))]
std::arch::global_asm!(
    ".symver justitia_ibv_open_device_1_1, ibv_open_device@@IBVERBS_1.1",
    ".symver justitia_ibv_open_device_1_0, ibv_open_device@IBVERBS_1.0",
    ".symver justitia_ibv_close_device_1_1, ibv_close_device@@IBVERBS_1.1",
    ".symver justitia_ibv_close_device_1_0, ibv_close_device@IBVERBS_1.0",
    ".symver justitia_ibv_create_qp_1_1, ibv_create_qp@@IBVERBS_1.1",
    ".symver justitia_ibv_create_qp_1_0, ibv_create_qp@IBVERBS_1.0",
    ".symver justitia_ibv_destroy_qp_1_1, ibv_destroy_qp@@IBVERBS_1.1",
    ".symver justitia_ibv_destroy_qp_1_0, ibv_destroy_qp@IBVERBS_1.0",
    ".symver justitia_ibv_modify_qp_1_1, ibv_modify_qp@@IBVERBS_1.1",
    ".symver justitia_ibv_modify_qp_1_0, ibv_modify_qp@IBVERBS_1.0",
    ".symver justitia_ibv_create_cq_1_1, ibv_create_cq@@IBVERBS_1.1",
    ".symver justitia_ibv_create_cq_1_0, ibv_create_cq@IBVERBS_1.0",
    ".symver justitia_ibv_destroy_cq_1_1, ibv_destroy_cq@@IBVERBS_1.1",
    ".symver justitia_ibv_destroy_cq_1_0, ibv_destroy_cq@IBVERBS_1.0",
    ".symver justitia_ibv_get_cq_event_1_1, ibv_get_cq_event@@IBVERBS_1.1",
    ".symver justitia_ibv_ack_cq_events_1_1, ibv_ack_cq_events@@IBVERBS_1.1",
    ".symver justitia_ibv_reg_mr_iova2_1_8, ibv_reg_mr_iova2@@IBVERBS_1.8",
    ".symver justitia_ibv_reg_dmabuf_mr_1_12, ibv_reg_dmabuf_mr@@IBVERBS_1.12",
);
