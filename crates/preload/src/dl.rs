//! `dlsym` and `dlvsym`, interposed so that a program looking verbs up through a handle
//! reaches the shaper.
//!
//! A program that loads libibverbs with `dlopen` and finds each verb with `dlsym(handle,
//! ...)` or `dlvsym(handle, ..., "IBVERBS_1.1")` (NCCL's verbs wrapper, ctypes, JNI) gets
//! what that handle's scope holds: libibverbs and its dependencies, never the preloaded
//! library. So the library exports `dlsym` and `dlvsym` at glibc's versions
//! (`GLIBC_2.2.5`, the x86-64 base, and `GLIBC_2.34`, the default since libdl moved into
//! libc), forwards every call to glibc's own, and when the answer is one of the verbs the
//! shaper interposes, at its current version, defined in a libibverbs, returns that verb as
//! the global scope has it instead: the shaper's entry, since the preloaded library comes
//! before any libibverbs there (found by name, so that this module names no entry of
//! [`crate::exports`], whose versioned names must stay defined beside them). Anything else
//! is glibc's answer, unchanged.
//!
//! Invariants:
//! - glibc's `dlsym` and `dlvsym` are found without calling either (which would reach
//!   these very functions): by their names in libc's own dynamic symbol table, or in
//!   libdl's where glibc before 2.34 keeps them (Debian 11, Ubuntu 20.04, RHEL 8), through
//!   `dl_iterate_phdr` and its GNU hash table: in the library's constructor, and again at
//!   a call while they are not found (a program may load libdl only later, with a library
//!   it opens).
//! - `RTLD_NEXT` is relative to the caller: an entry reached with it jumps to glibc's
//!   function with the caller's return address in place (`dl_next`), so glibc searches
//!   after the caller's object, not after this library.
//! - The shaper's own look-ups of the real verbs ([`crate::exports`]) run with
//!   `crate::ffi::ResolvingReal` held, and get glibc's answer unchanged: else the shaper's entry
//!   would be its own real verb.
//! - Should glibc's functions not be found when a program calls one of these entries, the
//!   entry answers null and it is said once on stderr; a program that never calls them
//!   hears nothing.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::log::log;

/// `Elf64_Dyn`.
#[repr(C)]
struct ElfDyn {
    d_tag: i64,
    d_val: u64,
}

/// `Elf64_Sym`.
#[repr(C)]
struct ElfSym {
    st_name: u32,
    st_info: u8,
    st_other: u8,
    st_shndx: u16,
    st_value: u64,
    st_size: u64,
}

const PT_DYNAMIC: u32 = 2;
const DT_NULL: i64 = 0;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_GNU_HASH: i64 = 0x6fff_fef5;

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
type DlvsymFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> *mut c_void;

/// glibc's `dlsym`, or null before it is found.
static JUSTITIA_REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// glibc's `dlvsym`, or null before it is found.
static JUSTITIA_REAL_DLVSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The address of the symbol `name` in the dynamic symbol table of the loaded object whose
/// path contains `object` (found with its GNU hash table), or null.
fn lookup_in_object(object: &[u8], name: &CStr) -> *mut c_void {
    struct Search<'a> {
        object: &'a [u8],
        name: &'a CStr,
        found: *mut c_void,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid info and our own data pointer.
        let (info, search) = unsafe { (&*info, &mut *data.cast::<Search<'_>>()) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: a NUL-terminated path owned by the dynamic linker.
        let path = unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes();
        if !path
            .windows(search.object.len())
            .any(|w| w == search.object)
        {
            return 0;
        }
        // SAFETY: the object's program headers and dynamic section, mapped.
        search.found = unsafe { find_symbol(info, search.name) };
        c_int::from(!search.found.is_null())
    }
    let mut search = Search {
        object,
        name,
        found: std::ptr::null_mut(),
    };
    // SAFETY: `visit` only reads what the dynamic linker hands it.
    unsafe { libc::dl_iterate_phdr(Some(visit), std::ptr::from_mut(&mut search).cast()) };
    search.found
}

/// The GNU hash of a symbol name.
fn gnu_hash(name: &[u8]) -> u32 {
    name.iter().fold(5381u32, |h, &c| {
        h.wrapping_mul(33).wrapping_add(u32::from(c))
    })
}

/// Looks `name` up in the dynamic symbol table of the object `info` describes.
///
/// # Safety
/// `info` describes a loaded object, whose dynamic section and tables are mapped.
unsafe fn find_symbol(info: &libc::dl_phdr_info, name: &CStr) -> *mut c_void {
    let base = info.dlpi_addr as usize;
    // SAFETY: dlpi_phdr has dlpi_phnum entries.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
    let Some(dynamic) = phdrs.iter().find(|p| p.p_type == PT_DYNAMIC) else {
        return std::ptr::null_mut();
    };
    let (mut symtab, mut strtab, mut gnu_hash_at) = (0usize, 0usize, 0usize);
    let mut entry = (base + dynamic.p_vaddr as usize) as *const ElfDyn;
    // The dynamic linker relocates these entries in place where the section is writable;
    // a value below the load address is still an offset.
    let at = |v: u64| {
        let v = v as usize;
        if v < base {
            base + v
        } else {
            v
        }
    };
    // SAFETY: the dynamic section ends with DT_NULL.
    unsafe {
        while (*entry).d_tag != DT_NULL {
            match (*entry).d_tag {
                DT_SYMTAB => symtab = at((*entry).d_val),
                DT_STRTAB => strtab = at((*entry).d_val),
                DT_GNU_HASH => gnu_hash_at = at((*entry).d_val),
                _ => {}
            }
            entry = entry.add(1);
        }
    }
    if symtab == 0 || strtab == 0 || gnu_hash_at == 0 {
        return std::ptr::null_mut();
    }
    let wanted = name.to_bytes();
    let h = gnu_hash(wanted);
    // SAFETY: the GNU hash table's layout: nbuckets, symoffset, bloom size, bloom shift,
    // the bloom words (64-bit), the buckets, then the chains.
    unsafe {
        let header = gnu_hash_at as *const u32;
        let nbuckets = *header;
        let symoffset = *header.add(1);
        let bloom_size = *header.add(2) as usize;
        if nbuckets == 0 {
            return std::ptr::null_mut();
        }
        let buckets = header.add(4).cast::<u64>().add(bloom_size).cast::<u32>();
        let chains = buckets.add(nbuckets as usize);
        let mut index = *buckets.add((h % nbuckets) as usize);
        if index < symoffset {
            return std::ptr::null_mut();
        }
        loop {
            let chain = *chains.add((index - symoffset) as usize);
            if (chain | 1) == (h | 1) {
                let sym = &*(symtab as *const ElfSym).add(index as usize);
                let sym_name = CStr::from_ptr((strtab + sym.st_name as usize) as *const c_char);
                if sym_name.to_bytes() == wanted && sym.st_shndx != 0 && sym.st_value != 0 {
                    return (base + sym.st_value as usize) as *mut c_void;
                }
            }
            if chain & 1 != 0 {
                return std::ptr::null_mut();
            }
            index += 1;
        }
    }
}

/// The objects glibc's `dlsym` and `dlvsym` live in: libc since glibc 2.34, libdl before.
const DL_OBJECTS: [&[u8]; 2] = [b"libc.so", b"libdl.so"];

/// Finds glibc's `dlsym` and `dlvsym` unless found already; whether they are.
fn find_glibc() -> bool {
    if !JUSTITIA_REAL_DLSYM.load(Ordering::Acquire).is_null() {
        return true;
    }
    for object in DL_OBJECTS {
        let dlsym = lookup_in_object(object, c"dlsym");
        let dlvsym = lookup_in_object(object, c"dlvsym");
        if !dlsym.is_null() && !dlvsym.is_null() {
            JUSTITIA_REAL_DLVSYM.store(dlvsym, Ordering::Release);
            JUSTITIA_REAL_DLSYM.store(dlsym, Ordering::Release);
            return true;
        }
    }
    false
}

/// Finds glibc's functions for a call of the program's; says once on stderr when they are
/// not found, since the call then answers null.
fn find_glibc_for_a_call() {
    if find_glibc() {
        return;
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        log!(
            Warn,
            "glibc's dlsym is not found in this process (neither in libc nor in libdl); dlsym and dlvsym answer null"
        );
    }
}

/// Runs at load, before the program can call `dlsym` through this library. Silent: a
/// process without libdl before glibc 2.34 cannot call `dlsym` until it loads libdl.
extern "C" fn at_load() {
    crate::ffi::guarded(
        || {
            find_glibc();
        },
        || (),
    );
}

#[used]
#[link_section = ".init_array"]
static AT_LOAD: extern "C" fn() = at_load;

/// The verbs the shaper interposes, each at its current version: the version whose
/// entry it exports as the default (a look-up at another, such as a verb's `IBVERBS_1.0`
/// compatibility version, gets glibc's answer). Kept with `exports.map`.
const INTERPOSED: [(&[u8], &CStr); 11] = [
    (b"ibv_open_device", c"IBVERBS_1.1"),
    (b"ibv_close_device", c"IBVERBS_1.1"),
    (b"ibv_create_qp", c"IBVERBS_1.1"),
    (b"ibv_destroy_qp", c"IBVERBS_1.1"),
    (b"ibv_modify_qp", c"IBVERBS_1.1"),
    (b"ibv_create_cq", c"IBVERBS_1.1"),
    (b"ibv_destroy_cq", c"IBVERBS_1.1"),
    (b"ibv_get_cq_event", c"IBVERBS_1.1"),
    (b"ibv_ack_cq_events", c"IBVERBS_1.1"),
    // NCCL's verbs wrapper looks memory registration up at these versions itself.
    (b"ibv_reg_mr_iova2", c"IBVERBS_1.8"),
    (b"ibv_reg_dmabuf_mr", c"IBVERBS_1.12"),
];

/// The current version of `name` when the shaper interposes it.
fn interposed_version(name: &[u8]) -> Option<&'static CStr> {
    INTERPOSED
        .iter()
        .find(|(verb, _)| *verb == name)
        .map(|(_, version)| *version)
}

/// The shaper's entry for `name`, the verb glibc found at `found`, when `found` is one of
/// the verbs the shaper interposes at their current version `version`, defined in a
/// libibverbs: the verb at that version in the global scope.
fn shaper_entry(found: *mut c_void, name: &CStr, version: &CStr) -> Option<*mut c_void> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the dynamic linker's tables.
    if unsafe { libc::dladdr(found, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated path owned by the dynamic linker.
    let file = unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes();
    if !file
        .windows(b"libibverbs.so".len())
        .any(|w| w == b"libibverbs.so")
    {
        return None;
    }
    // The verb at its current version in the global scope, where the preloaded library
    // comes before any libibverbs: the shaper's entry (or an interposer placed before it,
    // as a linked program would get).
    let real = JUSTITIA_REAL_DLVSYM.load(Ordering::Acquire);
    if real.is_null() {
        return None;
    }
    // SAFETY: glibc's dlvsym with NUL-terminated strings.
    let global = unsafe {
        std::mem::transmute::<*mut c_void, DlvsymFn>(real)(
            libc::RTLD_DEFAULT,
            name.as_ptr(),
            version.as_ptr(),
        )
    };
    (!global.is_null() && global != found).then_some(global)
}

/// glibc's answer `found` for `name` at `version` (`None`: the default), or the shaper's
/// entry for it (see the module's documentation).
///
/// # Safety
/// `name` and `version` are null or NUL-terminated strings.
unsafe fn answer(
    found: *mut c_void,
    name: *const c_char,
    version: Option<*const c_char>,
) -> *mut c_void {
    if found.is_null() || name.is_null() || crate::ffi::resolving_real() {
        return found;
    }
    // SAFETY: guaranteed by the caller.
    let name = unsafe { CStr::from_ptr(name) };
    let Some(current) = interposed_version(name.to_bytes()) else {
        return found;
    };
    if let Some(v) = version {
        // SAFETY: guaranteed by the caller.
        if v.is_null() || unsafe { CStr::from_ptr(v) } != current {
            return found;
        }
    }
    crate::ffi::guarded(|| shaper_entry(found, name, current), || None).unwrap_or(found)
}

/// `dlsym` for a handle other than `RTLD_NEXT` (see [`crate::dl`]).
///
/// # Safety
/// As `dlsym`.
unsafe extern "C" fn justitia_dlsym_handle(
    handle: *mut c_void,
    name: *const c_char,
) -> *mut c_void {
    find_glibc_for_a_call();
    let real = JUSTITIA_REAL_DLSYM.load(Ordering::Acquire);
    if real.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: glibc's dlsym, with the caller's arguments.
    let found = unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(real)(handle, name) };
    // SAFETY: the caller's name.
    unsafe { answer(found, name, None) }
}

/// `dlvsym` for a handle other than `RTLD_NEXT` (see [`crate::dl`]).
///
/// # Safety
/// As `dlvsym`.
unsafe extern "C" fn justitia_dlvsym_handle(
    handle: *mut c_void,
    name: *const c_char,
    version: *const c_char,
) -> *mut c_void {
    find_glibc_for_a_call();
    let real = JUSTITIA_REAL_DLVSYM.load(Ordering::Acquire);
    if real.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: glibc's dlvsym, with the caller's arguments.
    let found =
        unsafe { std::mem::transmute::<*mut c_void, DlvsymFn>(real)(handle, name, version) };
    // SAFETY: the caller's strings.
    unsafe { answer(found, name, Some(version)) }
}

// The exported entries: with `RTLD_NEXT` ((void *)-1), a jump to glibc's function, the
// caller's return address in place (glibc searches after the caller's object); else the
// functions above. Versioned names only in the shared library (its version script defines
// the nodes), not in the crate's own tests.
#[cfg(target_arch = "x86_64")]
std::arch::global_asm!(
    ".globl justitia_dlsym",
    ".type justitia_dlsym,@function",
    "justitia_dlsym:",
    "    cmp rdi, -1",
    "    jne {dlsym_handle}",
    "    mov rax, qword ptr [rip + {real_dlsym}]",
    "    test rax, rax",
    "    jz {dlsym_handle}",
    "    jmp rax",
    ".size justitia_dlsym, .-justitia_dlsym",
    ".globl justitia_dlvsym",
    ".type justitia_dlvsym,@function",
    "justitia_dlvsym:",
    "    cmp rdi, -1",
    "    jne {dlvsym_handle}",
    "    mov rax, qword ptr [rip + {real_dlvsym}]",
    "    test rax, rax",
    "    jz {dlvsym_handle}",
    "    jmp rax",
    ".size justitia_dlvsym, .-justitia_dlvsym",
    dlsym_handle = sym justitia_dlsym_handle,
    dlvsym_handle = sym justitia_dlvsym_handle,
    real_dlsym = sym JUSTITIA_REAL_DLSYM,
    real_dlvsym = sym JUSTITIA_REAL_DLVSYM,
);

#[cfg(all(target_arch = "x86_64", not(test)))]
std::arch::global_asm!(
    ".symver justitia_dlsym, dlsym@GLIBC_2.2.5",
    ".symver justitia_dlsym_default, dlsym@@GLIBC_2.34",
    ".symver justitia_dlvsym, dlvsym@GLIBC_2.2.5",
    ".symver justitia_dlvsym_default, dlvsym@@GLIBC_2.34",
    ".globl justitia_dlsym_default",
    ".set justitia_dlsym_default, justitia_dlsym",
    ".globl justitia_dlvsym_default",
    ".set justitia_dlvsym_default, justitia_dlvsym",
);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// glibc's own functions are found by name in libc's table: the same addresses the
    /// dynamic linker gives (this test binary does not interpose them).
    #[test]
    fn glibc_dlsym_and_dlvsym_are_found_in_libcs_table() {
        assert!(find_glibc());
        assert_eq!(
            JUSTITIA_REAL_DLSYM.load(Ordering::Acquire),
            libc::dlsym as *mut c_void
        );
        assert_eq!(
            JUSTITIA_REAL_DLVSYM.load(Ordering::Acquire),
            libc::dlvsym as *mut c_void
        );
    }

    /// Each verb the version script exports is interposed for look-ups at the newest of
    /// its versions there, and at no other.
    #[test]
    fn the_interposed_versions_are_the_version_scripts() {
        let script = include_str!("../exports.map");
        let mut newest: Vec<(String, String)> = Vec::new();
        let mut node = String::new();
        for line in script.lines().map(str::trim) {
            if let Some(name) = line.strip_suffix(" {") {
                node = name.to_string();
                continue;
            }
            if !node.starts_with("IBVERBS_") || line.starts_with("global:") {
                continue;
            }
            for verb in line
                .split(';')
                .map(str::trim)
                .filter(|v| v.starts_with("ibv_"))
            {
                // The script lists each verb's versions oldest first.
                newest.retain(|(v, _)| v != verb);
                newest.push((verb.to_string(), node.clone()));
            }
        }
        newest.sort();
        let mut interposed: Vec<(String, String)> = INTERPOSED
            .iter()
            .map(|(verb, version)| {
                (
                    String::from_utf8(verb.to_vec()).unwrap(),
                    version.to_str().unwrap().to_string(),
                )
            })
            .collect();
        interposed.sort();
        assert_eq!(interposed, newest);
        assert_eq!(
            interposed_version(b"ibv_reg_mr_iova2"),
            Some(c"IBVERBS_1.8")
        );
        assert_eq!(interposed_version(b"ibv_reg_mr"), None);
    }

    /// A look-up of something that is not a verb gets glibc's answer.
    #[test]
    fn other_symbols_are_glibcs_answer() {
        // SAFETY: NUL-terminated names.
        let got = unsafe { justitia_dlsym_handle(libc::RTLD_DEFAULT, c"getpid".as_ptr()) };
        assert_eq!(got, libc::getpid as *mut c_void);
    }
}
