//! The shaper's state for each completion channel with registered CQs: an eventfd that
//! wakes a thread waiting for an event when the shaper queues a completion the hardware
//! will not announce. The `ibv_get_cq_event` and `ibv_ack_cq_events` that use it are in
//! [`crate::channel`].

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use justitia_verbs::sys::*;

use super::CqShared;
use crate::registry::PtrMap;

/// The shaper's state for one completion channel.
pub struct ChannelShared {
    /// Signalled when a synthesized completion is queued on an armed CQ of the channel.
    pub(crate) wake: c_int,
    /// The registered CQs bound to the channel.
    cqs: Mutex<Vec<Arc<CqShared>>>,
}

impl Drop for ChannelShared {
    fn drop(&mut self) {
        // SAFETY: the eventfd is this value's own.
        unsafe { libc::close(self.wake) };
    }
}

/// Channels with registered CQs.
pub(crate) static CHANNELS: PtrMap<ChannelShared, 1024> = PtrMap::new();

/// Binds a newly registered CQ to its completion channel, if it has one.
pub(crate) fn attach(cq: &Arc<CqShared>) {
    let ch = cq.channel;
    if ch.is_null() {
        return;
    }
    let state = match CHANNELS.get_arc(ch.cast()) {
        Some(state) => state,
        None => {
            // SAFETY: creates a file descriptor owned by the new state.
            let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if wake < 0 {
                crate::log::log!(
                    Warn,
                    "cannot create an eventfd ({}); synthesized completions on this channel raise no event",
                    std::io::Error::last_os_error()
                );
                return;
            }
            let state = Arc::new(ChannelShared {
                wake,
                cqs: Mutex::new(Vec::new()),
            });
            if CHANNELS.insert(ch.cast(), Arc::clone(&state)).is_err() {
                crate::log::log!(
                    Warn,
                    "too many completion channels; synthesized completions on this one raise no event"
                );
                return;
            }
            state
        }
    };
    state
        .cqs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Arc::clone(cq));
}

/// Unbinds a destroyed CQ from its channel; returns the channel's state when that was its
/// last CQ (removed from the registry; freed when the caller and any waiter drop it).
pub(crate) fn detach(cq: &CqShared) -> Option<Arc<ChannelShared>> {
    let ch = cq.channel;
    if ch.is_null() {
        return None;
    }
    let state = CHANNELS.get_arc(ch.cast())?;
    let empty = {
        let mut cqs = state.cqs.lock().unwrap_or_else(|e| e.into_inner());
        cqs.retain(|c| !std::ptr::eq(Arc::as_ptr(c), cq));
        cqs.is_empty()
    };
    if empty {
        let token = CHANNELS.get(ch.cast())?;
        return CHANNELS.remove(ch.cast(), token);
    }
    None
}

/// Wakes a thread waiting on `cq`'s channel in [`get_cq_event`].
pub(crate) fn notify(cq: &CqShared) {
    if cq.channel.is_null() {
        return;
    }
    if let Some(state) = CHANNELS.get_arc(cq.channel.cast()) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes to the state's own eventfd; a full counter only means a
        // wake-up is already pending.
        unsafe { libc::write(state.wake, (&one as *const u64).cast(), 8) };
    }
}

impl ChannelShared {
    /// An armed CQ of the channel with synthesized completions waiting, disarmed and
    /// counted as having had a shaper event.
    pub(crate) fn take_ready(&self) -> Option<*mut ibv_cq> {
        let cqs = self.cqs.lock().unwrap_or_else(|e| e.into_inner());
        let ready = cqs
            .iter()
            .find(|c| c.has_held() && c.armed.load(Ordering::Acquire))?;
        ready.armed.store(false, Ordering::Release);
        ready.synthetic_events.fetch_add(1, Ordering::AcqRel);
        Some(ready.cq)
    }

    /// Empties the eventfd.
    pub(crate) fn clear_wake(&self) {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes from the state's own non-blocking eventfd.
        unsafe { libc::read(self.wake, (&mut value as *mut u64).cast(), 8) };
    }
}
