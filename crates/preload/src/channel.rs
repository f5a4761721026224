//! Completion-channel events for completions the hardware never produces.
//!
//! An event-driven application arms its CQ (`ibv_req_notify_cq`), blocks in
//! `ibv_get_cq_event` until the kernel reports a new completion on the channel, then polls.
//! Completions the shaper synthesizes (flush errors for requests that never reached a
//! failed QP, an error for a request the provider refused part-way) produce no kernel event,
//! so such an application would wait for ever. The shaper therefore keeps, per channel, an
//! eventfd and the CQs bound to it; when it queues a synthesized completion on an armed CQ,
//! it signals the eventfd, and its `ibv_get_cq_event` (see [`get_cq_event`]) waits on both
//! file descriptors and returns the CQ itself when the wake-up is the shaper's. Such an
//! event has no kernel counterpart, so [`ack_cq_events`] keeps it out of the count of
//! acknowledged events that `ibv_destroy_cq` compares with the kernel's.
//!
//! The wait is a POSIX cancellation point (rping cancels its completion thread there), so
//! while blocked the shaper's frames hold nothing with a destructor: a thread cancelled
//! there unwinds through them cleanly. The channel's state is held across the wait by a
//! counted reference taken as a raw pointer, given back after the wait: a cancelled thread
//! leaves one channel's state (and its eventfd) behind, never a dangling one.
//!
//! A channel's state, with its eventfd, is freed when its last registered CQ is destroyed
//! and no thread waits on it.
//!
//! A signal interrupts the wait as it interrupts the native one (see
//! `resumes_after_signal`): `-1` with `errno` `EINTR` after a handler without
//! `SA_RESTART`.
//!
//! Limit: an application that waits on the channel's file descriptor with its own `poll`
//! or `epoll` sees synthesized completions at its next poll of the CQ, not as an event.

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use justitia_verbs::sys::*;

use crate::engine;
use crate::engine::channels::CHANNELS;

/// `ibv_get_cq_event`.
pub type GetCqEventFn =
    unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
/// `ibv_ack_cq_events`.
pub type AckCqEventsFn = unsafe extern "C" fn(*mut ibv_cq, u32);

/// The shaper's `ibv_get_cq_event`: an event for an armed CQ with synthesized completions
/// waiting if there is one, else the kernel's next event (`real`), waiting for whichever
/// comes first when the channel blocks.
///
/// # Safety
/// As `ibv_get_cq_event`; `real` must be libibverbs' own.
pub unsafe fn get_cq_event(
    ch: *mut ibv_comp_channel,
    cq_out: *mut *mut ibv_cq,
    ctx_out: *mut *mut c_void,
    real: GetCqEventFn,
) -> c_int {
    // A counted reference as a raw pointer: nothing with a destructor lives in this frame
    // across the cancellation point below. A forked child passes through.
    let held = (!crate::ffi::in_forked_child())
        .then(|| CHANNELS.get_arc(ch.cast()).map(Arc::into_raw))
        .flatten();
    let Some(held) = held else {
        // SAFETY: the real verb with the caller's arguments; in a forked child the
        // shaper's state is not touched.
        return unsafe { real_event(ch, cq_out, ctx_out, real, !crate::ffi::in_forked_child()) };
    };
    // SAFETY: `held` is a counted reference, given back below.
    let state = unsafe { &*held };
    // SAFETY: the caller passes a live channel.
    let fd = unsafe { (*ch).fd };
    // SAFETY: F_GETFL only reads the descriptor's flags.
    let nonblocking = unsafe { libc::fcntl(fd, libc::F_GETFL) } & libc::O_NONBLOCK != 0;
    loop {
        if let Some(cq) = state.take_ready() {
            // SAFETY: the caller's out-pointers; cq is a live registered CQ. `held` is the
            // reference taken above.
            unsafe {
                *cq_out = cq;
                *ctx_out = (*cq).cq_context;
                drop(Arc::from_raw(held));
            }
            return 0;
        }
        if nonblocking {
            break;
        }
        let mut fds = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: state.wake,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfd entries. A cancellation point: nothing here has a
        // destructor.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break;
            }
            if resumes_after_signal() {
                continue;
            }
            // SAFETY: the reference taken above; the wait is over. errno is set last, as
            // the native verb leaves it.
            unsafe {
                drop(Arc::from_raw(held));
                *libc::__errno_location() = libc::EINTR;
            }
            return -1;
        }
        if fds[1].revents != 0 {
            state.clear_wake();
        }
        if fds[0].revents != 0 {
            break;
        }
    }
    // SAFETY: the reference taken above; the wait is over.
    drop(unsafe { Arc::from_raw(held) });
    // SAFETY: the real verb with the caller's arguments.
    unsafe { real_event(ch, cq_out, ctx_out, real, true) }
}

/// The kernel's next event on the channel (`real`), its CQ's arm noted as spent when
/// `note` (see `CqShared::on_event`).
///
/// # Safety
/// As [`get_cq_event`].
unsafe fn real_event(
    ch: *mut ibv_comp_channel,
    cq_out: *mut *mut ibv_cq,
    ctx_out: *mut *mut c_void,
    real: GetCqEventFn,
    note: bool,
) -> c_int {
    // SAFETY: guaranteed by the caller.
    let rc = unsafe { real(ch, cq_out, ctx_out) };
    if rc == 0 && note {
        // SAFETY: the real verb wrote the CQ of the event.
        if let Some(c) = engine::cq(unsafe { *cq_out }) {
            c.on_event();
        }
    }
    rc
}

/// Whether a wait that a signal handler interrupted goes on, as the native verb's does.
///
/// libibverbs' `ibv_get_cq_event` blocks in `read` on the channel, which the kernel resumes
/// after a handler installed with `SA_RESTART` and fails with `EINTR` after one without
/// (qperf ends its tests with a `SIGALRM` handler without it). The shaper waits in `poll`,
/// which fails with `EINTR` after any handler, and cannot tell which signal ran. It resumes
/// when every signal that can interrupt this thread's wait has `SA_RESTART` or no handler;
/// when any has a handler without it, it returns `EINTR`, as the native verb does for that
/// signal. Signals this thread blocks cannot interrupt it; faults (`SIGSEGV`, `SIGBUS`,
/// `SIGFPE`, `SIGILL`, `SIGTRAP`, `SIGSYS`) are raised by the faulting instruction's thread,
/// never a thread waiting in `poll`, so their handlers (crash reporters, runtimes) are not
/// counted.
fn resumes_after_signal() -> bool {
    const FAULTS: [c_int; 6] = [
        libc::SIGSEGV,
        libc::SIGBUS,
        libc::SIGFPE,
        libc::SIGILL,
        libc::SIGTRAP,
        libc::SIGSYS,
    ];
    // SAFETY: an all-zero sigset_t is a valid (empty) set to be filled in.
    let mut blocked: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: reads the calling thread's mask into a local.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut blocked) };
    (1..=libc::SIGRTMAX())
        .filter(|sig| !FAULTS.contains(sig))
        // SAFETY: a membership test on the set read above.
        .filter(|&sig| unsafe { libc::sigismember(&blocked, sig) } != 1)
        .all(|sig| {
            // SAFETY: an all-zero sigaction is a valid place for the query's answer.
            let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: queries the disposition only (no new action); a signal the C library
            // reserves answers with an error and is skipped.
            if unsafe { libc::sigaction(sig, std::ptr::null(), &mut action) } != 0 {
                return true;
            }
            let handled =
                action.sa_sigaction != libc::SIG_DFL && action.sa_sigaction != libc::SIG_IGN;
            !handled || action.sa_flags & libc::SA_RESTART != 0
        })
}

/// The shaper's `ibv_ack_cq_events`: acknowledges the shaper's own events of `cq` first
/// and passes only the kernel's on to `real`.
///
/// # Safety
/// As `ibv_ack_cq_events`; `real` must be libibverbs' own.
pub unsafe fn ack_cq_events(cq: *mut ibv_cq, nevents: u32, real: AckCqEventsFn) {
    let mut kernel = nevents;
    if let Some(c) = engine::cq(cq) {
        let mut ours = c.synthetic_events.load(Ordering::Acquire);
        loop {
            let take = ours.min(nevents);
            match c.synthetic_events.compare_exchange(
                ours,
                ours - take,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    kernel = nevents - take;
                    break;
                }
                Err(now) => ours = now,
            }
        }
    }
    if kernel > 0 {
        // SAFETY: the real verb with the caller's CQ.
        unsafe { real(cq, kernel) };
    }
}
