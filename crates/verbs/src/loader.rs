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
//! symbol version. [`real_symbol`] is what the shaper uses: the verb in the libibverbs the
//! process actually loaded, which `RTLD_NEXT` misses when the library was loaded later with
//! `dlopen(RTLD_LOCAL)` (language bindings through ctypes or JNI, NCCL, UCX's transport
//! modules): the global scope then does not contain it, but the loaded object can still be
//! found by name with `RTLD_NOLOAD`.

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

/// `dlvsym` when a version is given, else `dlsym`.
///
/// # Safety
/// `handle` is `RTLD_NEXT`, `RTLD_DEFAULT` or a live handle from `dlopen`.
#[cfg(target_env = "gnu")]
unsafe fn lookup(handle: *mut c_void, name: &CStr, version: Option<&CStr>) -> *mut c_void {
    // SAFETY: as the caller promises, with NUL-terminated strings.
    unsafe {
        match version {
            Some(v) => libc::dlvsym(handle, name.as_ptr(), v.as_ptr()),
            None => libc::dlsym(handle, name.as_ptr()),
        }
    }
}

/// `dlsym`: musl's dynamic linker has no `dlvsym`, and binds every program to each name's
/// default version, so the default is the version a musl program's verbs are.
///
/// # Safety
/// As the glibc variant.
#[cfg(not(target_env = "gnu"))]
unsafe fn lookup(handle: *mut c_void, name: &CStr, _version: Option<&CStr>) -> *mut c_void {
    // SAFETY: as the caller promises, with a NUL-terminated name.
    unsafe { libc::dlsym(handle, name.as_ptr()) }
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
    let addr = unsafe { lookup(libc::RTLD_NEXT, name, version) };
    (!addr.is_null()).then_some(addr)
}

/// The address of `name` (at `version` when given) in the already loaded library `library`
/// (a soname or a path), found with `dlopen(RTLD_NOLOAD)` whatever scope it was loaded in.
/// `None` when the library is not loaded or does not define the symbol. Never loads
/// anything.
///
/// # Safety
/// As [`next_symbol`].
pub unsafe fn loaded_symbol(
    library: &CStr,
    name: &CStr,
    version: Option<&CStr>,
) -> Option<*mut c_void> {
    // SAFETY: RTLD_NOLOAD only looks for an object already loaded; it runs no constructor.
    let handle = unsafe { libc::dlopen(library.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: the handle is live; the lookups take NUL-terminated names.
    let addr = unsafe { lookup(handle, name, version) };
    // SAFETY: drops the reference RTLD_NOLOAD took; the object stays loaded by its owner.
    unsafe { libc::dlclose(handle) };
    (!addr.is_null()).then_some(addr)
}

/// Paths of the loaded objects whose file name starts with `libibverbs.so` (a libibverbs
/// loaded by path, under a name `RTLD_NOLOAD` with the soname would not match).
fn loaded_libibverbs_paths() -> Vec<std::ffi::CString> {
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader passes a valid entry; data is the Vec below.
        let (info, out) = unsafe { (&*info, &mut *data.cast::<Vec<std::ffi::CString>>()) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: dlpi_name is a NUL-terminated path owned by the loader.
        let path = unsafe { CStr::from_ptr(info.dlpi_name) };
        let file = path
            .to_bytes()
            .rsplit(|&b| b == b'/')
            .next()
            .unwrap_or_default();
        if file.starts_with(b"libibverbs.so") {
            out.push(path.to_owned());
        }
        0
    }
    let mut out: Vec<std::ffi::CString> = Vec::new();
    // SAFETY: visit only reads each entry and appends to `out`, which outlives the call.
    unsafe {
        libc::dl_iterate_phdr(
            Some(visit),
            (&mut out as *mut Vec<std::ffi::CString>).cast(),
        )
    };
    out
}

/// The real verb `name` at `version`: in the libibverbs the process loaded (by soname, in
/// any scope), else the next definition after the caller (`RTLD_NEXT`), else in any loaded
/// object named `libibverbs.so*`. `None` when no loaded libibverbs defines it.
///
/// # Safety
/// As [`next_symbol`]. The caller must not itself be a libibverbs.
pub unsafe fn real_symbol(name: &CStr, version: Option<&CStr>) -> Option<*mut c_void> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        loaded_symbol(LIBIBVERBS, name, version)
            .or_else(|| next_symbol(name, version))
            .or_else(|| {
                loaded_libibverbs_paths()
                    .iter()
                    .find_map(|path| loaded_symbol(path, name, version))
            })
    }
}

/// The rdma-core release of the libibverbs the process loaded, read from the name of its
/// file (`libibverbs.so.1.14.44.0` is rdma-core 44): the soname stays `libibverbs.so.1`
/// across releases, so the file's full name is where the release shows. `None` when no
/// libibverbs is loaded or its file name does not say.
pub fn loaded_rdma_core_release() -> Option<u32> {
    loaded_libibverbs_paths().iter().find_map(|path| {
        let path = std::path::Path::new(
            <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(path.to_bytes()),
        );
        let real = std::fs::canonicalize(path).ok()?;
        rdma_core_release_of(real.file_name()?.to_str()?)
    })
}

/// The rdma-core release in a libibverbs file name (`libibverbs.so.1.14.44.0` gives 44).
pub fn rdma_core_release_of(file_name: &str) -> Option<u32> {
    let rest = file_name.strip_prefix("libibverbs.so.")?;
    let parts: Vec<&str> = rest.split('.').collect();
    match parts.as_slice() {
        [_major, _minor, release, ..] => release.parse().ok(),
        _ => None,
    }
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
    /// `ibv_create_ah`.
    ibv_create_ah: fn(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah;
    /// `ibv_destroy_ah`.
    ibv_destroy_ah: fn(*mut ibv_ah) -> c_int;
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
    fn a_library_that_is_not_loaded_yields_no_symbol_and_is_not_loaded() {
        // SAFETY: the address is never used.
        let found =
            unsafe { loaded_symbol(c"libjustitia-not-a-library.so.3", c"ibv_open_device", None) };
        assert!(found.is_none());
    }

    #[test]
    fn the_rdma_core_release_is_read_from_the_file_name() {
        assert_eq!(rdma_core_release_of("libibverbs.so.1.14.44.0"), Some(44));
        assert_eq!(rdma_core_release_of("libibverbs.so.1.15.50.0"), Some(50));
        assert_eq!(rdma_core_release_of("libibverbs.so.1"), None);
        assert_eq!(rdma_core_release_of("librdmacm.so.1.3.44.0"), None);
    }

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
