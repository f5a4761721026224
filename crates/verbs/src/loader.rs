//! Loading libibverbs at run time.
//!
//! [`Ibverbs::load`] opens `libibverbs.so.1` with `RTLD_GLOBAL` and then resolves every verb
//! by name in the *global* scope (`RTLD_DEFAULT`), not in the library's own handle. The
//! difference matters under `LD_PRELOAD`: a preloaded shaper that exports `ibv_open_device`
//! comes first in the global scope, so a program using this loader reaches the shaper just
//! as a program linked against libibverbs does. Without a preload the global scope yields
//! libibverbs' own default symbol versions, which are what a link would bind to.
//!
//! [`next_symbol`] is the other direction, for the shaper itself: the definition that comes
//! *after* the caller's object in the search order (`RTLD_NEXT`), optionally at an exact
//! symbol version.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use crate::error::VerbsError;
use crate::sys::*;

/// The library name tried by [`Ibverbs::load`] (the soname Debian's libibverbs1 ships).
pub const LIBIBVERBS: &CStr = c"libibverbs.so.1";

/// The most recent error of the dynamic loader, as text.
fn dlerror_text() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc, valid until the
    // next dl* call on this thread; it is copied at once.
    unsafe {
        let msg = libc::dlerror();
        if msg.is_null() {
            "unknown error".to_string()
        } else {
            CStr::from_ptr(msg).to_string_lossy().into_owned()
        }
    }
}

/// The address of `name` in the objects after the calling object in the symbol search order
/// (`RTLD_NEXT`), at symbol version `version` when given (`dlvsym`), else at its default
/// version. `None` when no later object defines it.
///
/// # Safety
/// The caller must transmute the address only to the function type that the C declaration
/// of `name` (at that version) has.
pub unsafe fn next_symbol(name: &CStr, version: Option<&CStr>) -> Option<*mut c_void> {
    // SAFETY: both calls take NUL-terminated names and only look symbols up.
    let addr = unsafe {
        match version {
            Some(v) => libc::dlvsym(libc::RTLD_NEXT, name.as_ptr(), v.as_ptr()),
            None => libc::dlsym(libc::RTLD_NEXT, name.as_ptr()),
        }
    };
    (!addr.is_null()).then_some(addr)
}

macro_rules! verbs_table {
    ($( $(#[$doc:meta])* $name:ident : fn($($arg:ty),*) $(-> $ret:ty)?; )*) => {
        /// The exported verbs this crate uses, resolved once. Every field is a C function of
        /// the same name and signature as in `<infiniband/verbs.h>`.
        #[derive(Debug)]
        pub struct Ibverbs {
            $( $(#[$doc])* pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
        }

        impl Ibverbs {
            /// Resolves every verb in the global scope; fails naming the first one missing.
            fn resolve() -> Result<Self, VerbsError> {
                Ok(Ibverbs {
                    $( $name: {
                        let name = concat!(stringify!($name), "\0");
                        // SAFETY: the name is NUL-terminated; the lookup has no side effect.
                        let addr = unsafe {
                            libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr().cast::<c_char>())
                        };
                        if addr.is_null() {
                            return Err(VerbsError::MissingSymbol { symbol: stringify!($name) });
                        }
                        // SAFETY: the symbol is the verb of that name, whose C signature the
                        // field's type spells out.
                        unsafe {
                            core::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(addr)
                        }
                    }, )*
                })
            }
        }
    };
}

verbs_table! {
    /// `ibv_get_device_list`.
    ibv_get_device_list: fn(*mut c_int) -> *mut *mut ibv_device;
    /// `ibv_free_device_list`.
    ibv_free_device_list: fn(*mut *mut ibv_device);
    /// `ibv_get_device_name`.
    ibv_get_device_name: fn(*mut ibv_device) -> *const c_char;
    /// `ibv_open_device`.
    ibv_open_device: fn(*mut ibv_device) -> *mut ibv_context;
    /// `ibv_close_device`.
    ibv_close_device: fn(*mut ibv_context) -> c_int;
    /// `ibv_query_device`.
    ibv_query_device: fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
    /// `ibv_query_port`, the exported form that fills the leading (compat) part of the
    /// port attributes; [`crate::ops::query_port`] prefers the extended form.
    ibv_query_port: fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int;
    /// `ibv_query_gid`.
    ibv_query_gid: fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    /// `ibv_alloc_pd`.
    ibv_alloc_pd: fn(*mut ibv_context) -> *mut ibv_pd;
    /// `ibv_dealloc_pd`.
    ibv_dealloc_pd: fn(*mut ibv_pd) -> c_int;
    /// `ibv_reg_mr`.
    ibv_reg_mr: fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    /// `ibv_dereg_mr`.
    ibv_dereg_mr: fn(*mut ibv_mr) -> c_int;
    /// `ibv_create_comp_channel`.
    ibv_create_comp_channel: fn(*mut ibv_context) -> *mut ibv_comp_channel;
    /// `ibv_destroy_comp_channel`.
    ibv_destroy_comp_channel: fn(*mut ibv_comp_channel) -> c_int;
    /// `ibv_get_cq_event`.
    ibv_get_cq_event: fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    /// `ibv_ack_cq_events`.
    ibv_ack_cq_events: fn(*mut ibv_cq, c_uint);
    /// `ibv_create_cq`.
    ibv_create_cq: fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    /// `ibv_destroy_cq`.
    ibv_destroy_cq: fn(*mut ibv_cq) -> c_int;
    /// `ibv_create_qp`.
    ibv_create_qp: fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    /// `ibv_modify_qp`.
    ibv_modify_qp: fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    /// `ibv_query_qp`.
    ibv_query_qp: fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int;
    /// `ibv_destroy_qp`.
    ibv_destroy_qp: fn(*mut ibv_qp) -> c_int;
    /// `ibv_qp_to_qp_ex`.
    ibv_qp_to_qp_ex: fn(*mut ibv_qp) -> *mut ibv_qp_ex;
    /// `ibv_wc_status_str`.
    ibv_wc_status_str: fn(ibv_wc_status) -> *const c_char;
}

impl Ibverbs {
    /// Loads libibverbs (`libibverbs.so.1`) and resolves the verbs.
    pub fn load() -> Result<Self, VerbsError> {
        Self::load_from(LIBIBVERBS)
    }

    /// Loads libibverbs from `library` (a soname or a path) and resolves the verbs. The
    /// library stays loaded for the life of the process: providers register themselves
    /// with it and cannot be unloaded safely.
    pub fn load_from(library: &CStr) -> Result<Self, VerbsError> {
        // SAFETY: dlopen with a NUL-terminated name; running the library's constructors is
        // what loading it is for.
        let handle = unsafe { libc::dlopen(library.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            return Err(VerbsError::Load {
                library: library.to_string_lossy().into_owned(),
                reason: dlerror_text(),
            });
        }
        Self::resolve()
    }

    /// The text rdma-core gives a completion status (`ibv_wc_status_str`).
    pub fn status_str(&self, status: ibv_wc_status) -> String {
        // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any value.
        unsafe {
            let s = (self.ibv_wc_status_str)(status);
            if s.is_null() {
                format!("status {status}")
            } else {
                CStr::from_ptr(s).to_string_lossy().into_owned()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_reported_with_its_name() {
        let err = Ibverbs::load_from(c"libibverbs-does-not-exist.so.9").err();
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("libibverbs-does-not-exist.so.9"), "{text}");
    }

    #[test]
    fn loads_the_installed_libibverbs_when_present() {
        match Ibverbs::load() {
            Ok(verbs) => {
                assert_eq!(verbs.status_str(IBV_WC_SUCCESS), "success");
                // Without RDMA support in the kernel the list itself fails (ENOSYS); the
                // error must then name the verb.
                match crate::Context::devices(&verbs) {
                    Ok(devices) => eprintln!("devices: {devices:?}"),
                    Err(e) => assert!(e.to_string().contains("ibv_get_device_list"), "{e}"),
                }
            }
            Err(e) => eprintln!("skipping: {e}"),
        }
    }
}
