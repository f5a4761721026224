//! The boundary between C callers and the shaper: what every entry point from C goes
//! through, and nothing else. It names no other module of the crate.
//!
//! - [`guarded`]: runs the shaper's part of a call and, if it panics, says so once and runs
//!   the fallback (the provider's or libibverbs' own function): no entry point unwinds into
//!   C, and a failure of the shaper degrades to passing the call through. [`caught`] is the
//!   same without the fork check below, for an entry point a forked child never reaches.
//! - [`Reentry`]: marks the thread as inside a real verb the shaper called, so that a verb
//!   libibverbs or a provider calls from there passes straight through.
//! - [`in_forked_child`]: true in a child made by `fork()` after the shaper started. A fork
//!   copies only the forking thread: a lock the pacer thread (or any other) held at that
//!   moment stays held in the child for ever. The child therefore never takes the
//!   shaper's locks: every entry point passes its call through, as [`guarded`] and
//!   [`Reentry::enter`] do by themselves (the post and poll hooks find out from the state
//!   they look up, which the child marks to pass through when it starts). (A child may
//!   not use its parent's verbs objects anyway; the ones it creates itself pass through
//!   unshaped.)

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

thread_local! {
    static IN_SHAPER: Cell<bool> = const { Cell::new(false) };
}

/// Set in the child of a `fork()` (see the module's documentation).
static FORKED_CHILD: AtomicBool = AtomicBool::new(false);

/// Said once per process when the shaper's part of a call panicked.
static PANIC_SAID: AtomicBool = AtomicBool::new(false);

/// Said once per process in a forked child, at its first call into the shaper.
static CHILD_SAID: AtomicBool = AtomicBool::new(false);

extern "C" fn on_fork_child() {
    FORKED_CHILD.store(true, Ordering::Relaxed);
    // A grandchild says it again.
    CHILD_SAID.store(false, Ordering::Relaxed);
}

/// Says once, in a forked child, that the shaper passes everything through there. Written
/// with one `write(2)`: the child must take no lock (std's stderr lock included) that a
/// thread of the parent may have held at the fork.
#[cold]
fn say_child() {
    if CHILD_SAID.swap(true, Ordering::Relaxed) {
        return;
    }
    let msg = b"justitia: this process was forked from one the shaper had started in; its verbs pass through unshaped\n";
    // SAFETY: writes a static buffer to stderr; the result does not matter.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// Registers the fork handler (once per process); called when the shaper starts.
pub fn watch_forks() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(on_fork_child)) };
    });
}

/// True in a child forked after the shaper started: every call passes through.
#[inline(always)]
pub fn in_forked_child() -> bool {
    let child = FORKED_CHILD.load(Ordering::Relaxed);
    if child {
        say_child();
    }
    child
}

/// True while the calling thread is inside a real verb called by the shaper.
pub fn in_shaper() -> bool {
    IN_SHAPER.with(Cell::get)
}

/// Marks the thread as inside the shaper until dropped.
pub struct Reentry;

impl Reentry {
    /// `None` when the thread is already inside, or in a forked child: the caller then
    /// passes the call straight through.
    pub fn enter() -> Option<Reentry> {
        if in_forked_child() {
            return None;
        }
        IN_SHAPER.with(|f| (!f.replace(true)).then_some(Reentry))
    }
}

impl Drop for Reentry {
    fn drop(&mut self) {
        IN_SHAPER.with(|f| f.set(false));
    }
}

/// Runs `shaped`; in a forked child, or if it panics (said once), runs `fallback` instead.
#[inline(always)]
pub fn guarded<R>(shaped: impl FnOnce() -> R, fallback: impl FnOnce() -> R) -> R {
    if in_forked_child() {
        return fallback();
    }
    caught(shaped, fallback)
}

/// [`guarded`] without its fork check, for an entry point that a forked child never
/// reaches: the state that routes the call there is marked to pass through in the child.
#[inline(always)]
pub fn caught<R>(shaped: impl FnOnce() -> R, fallback: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(shaped)) {
        Ok(r) => r,
        Err(_) => {
            say_panic();
            fallback()
        }
    }
}

/// Says once per process that the shaper's part of a call panicked.
#[cold]
#[inline(never)]
fn say_panic() {
    if !PANIC_SAID.swap(true, Ordering::Relaxed) {
        crate::log::log!(
            Warn,
            "internal error in the shaper; the call passes through unshaped"
        );
    }
}

#[cfg(target_env = "gnu")]
thread_local! {
    static RESOLVING_REAL: Cell<bool> = const { Cell::new(false) };
}

/// While held, the shaper is looking up the real verbs on this thread: its own `dlsym` and
/// `dlvsym` (see [`crate::dl`]) give glibc's answers unchanged, else the shaper's entry
/// would be taken for its own real verb. glibc only: the musl build interposes neither.
#[cfg(target_env = "gnu")]
pub(crate) struct ResolvingReal(bool);

#[cfg(target_env = "gnu")]
impl ResolvingReal {
    /// Marks this thread as looking up real verbs until dropped.
    pub(crate) fn hold() -> Self {
        ResolvingReal(RESOLVING_REAL.replace(true))
    }
}

#[cfg(target_env = "gnu")]
impl Drop for ResolvingReal {
    fn drop(&mut self) {
        RESOLVING_REAL.set(self.0);
    }
}

/// Whether this thread holds a [`ResolvingReal`].
#[cfg(target_env = "gnu")]
pub(crate) fn resolving_real() -> bool {
    RESOLVING_REAL.get()
}
