//! Polling of extended CQs (`ibv_create_cq_ex`): `ibv_start_poll`, `ibv_next_poll`,
//! `ibv_end_poll` and the `ibv_wc_read_*` accessors are function pointers in the CQ.
//!
//! The shaper wraps the three poll verbs and the accessors. When the CQ serves shaped QPs,
//! each entry the provider presents is translated like an `ibv_poll_cq` completion:
//! internal and duplicate entries are skipped (the shaper moves on with the provider's
//! `next_poll`), and a split request's entry shows the original `wr_id` (a field of the CQ)
//! and length (through `read_byte_len`). When the provider has nothing more, synthesized
//! completions (requests that never reached a failed QP) are presented the same way, their
//! fields served by the wrapped accessors; the provider's poll is then ended first, so the
//! application's `ibv_end_poll` ends it exactly once.
//!
//! Locks, in order: the poll in progress (`CqShared::ex_current`), then the CQ's poll lock
//! (`CqShared::qps`). Between `ibv_start_poll` and `ibv_end_poll` the provider holds the
//! CQ's own lock, and an `ibv_poll_cq` of the same CQ on another thread may be waiting for
//! it with the poll lock held: so while the provider's poll is active the poll lock is only
//! tried (`CqShared::filter_ex` holds entries it cannot translate without it), and taken
//! outright only once the provider's poll is over (`CqShared::present_held`). The
//! shaper's own poll of the CQ (`CqShared::poll_ex_aside`, after a destroy or reset)
//! holds the poll-in-progress lock and runs only when no application poll has begun.
//!
//! Entries are attributed to QPs by QP number; the shaper asks for QP numbers when it
//! creates the CQ (see [`crate::install::create_cq_ex`]). Without them, the tags of internal
//! WQEs and the `wr_id` each QP expects next attribute them instead.

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use justitia_verbs::sys::*;

use crate::engine::ex_state::{CqExOps, Current};
use crate::engine::{self, note_touched, CqShared, Held, QpShared};
use crate::ffi::guarded;
use crate::send_queue::QuickRing;

/// Installs the shaper's poll pointers in `cqx`, and its accessors in place of the
/// provider's it has.
pub fn install(cqx: &mut ibv_cq_ex) {
    cqx.start_poll = Some(start_poll);
    cqx.next_poll = Some(next_poll);
    cqx.end_poll = Some(end_poll);
    macro_rules! wrap {
        ($($field:ident => $hook:ident),*) => {
            $( if cqx.$field.is_some() { cqx.$field = Some($hook); } )*
        };
    }
    wrap!(
        read_opcode => read_opcode,
        read_vendor_err => read_vendor_err,
        read_byte_len => read_byte_len,
        read_imm_data => read_imm_data,
        read_qp_num => read_qp_num,
        read_src_qp => read_src_qp,
        read_wc_flags => read_wc_flags,
        read_slid => read_slid,
        read_sl => read_sl,
        read_dlid_path_bits => read_dlid_path_bits
    );
}

fn state(cqx: *mut ibv_cq_ex) -> Option<(&'static CqShared, CqExOps)> {
    let c = engine::cq(cqx.cast())?;
    Some((c, c.ex?))
}

/// Reads the provider's current entry, every field the shaper presents for a held one.
///
/// # Safety
/// `cqx` is inside a provider poll.
unsafe fn read_entry(cqx: *mut ibv_cq_ex, ops: CqExOps, all: bool) -> ibv_wc {
    // SAFETY: guaranteed by the caller; the accessors are the provider's.
    unsafe {
        let c = &*cqx;
        let success = c.status == IBV_WC_SUCCESS;
        let mut wc = ibv_wc {
            wr_id: c.wr_id,
            status: c.status,
            opcode: match (success, ops.read_opcode) {
                (true, Some(f)) => f(cqx),
                _ => 0,
            },
            vendor_err: match (success, ops.read_vendor_err) {
                (false, Some(f)) => f(cqx),
                _ => 0,
            },
            byte_len: ops.read_byte_len.map_or(0, |f| f(cqx)),
            qp_num: match (ops.has_qp_num, ops.read_qp_num) {
                (true, Some(f)) => f(cqx),
                _ => 0,
            },
            ..Default::default()
        };
        if all && success {
            wc.__bindgen_anon_1.imm_data = ops.read_imm_data.map_or(0, |f| f(cqx));
            wc.src_qp = ops.read_src_qp.map_or(0, |f| f(cqx));
            wc.wc_flags = ops.read_wc_flags.map_or(0, |f| f(cqx));
            wc.slid = ops.read_slid.map_or(0, |f| f(cqx)) as u16;
            wc.sl = ops.read_sl.map_or(0, |f| f(cqx));
            wc.dlid_path_bits = ops.read_dlid_path_bits.map_or(0, |f| f(cqx));
        }
        wc
    }
}

impl CqShared {
    fn current(&self) -> MutexGuard<'_, Current> {
        self.ex_current.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The provider's poll of the application ended (or never began).
    fn session_ended(&self, current: &mut Current) {
        current.provider_active = false;
        self.sessions.fetch_sub(1, Ordering::AcqRel);
    }

    /// Skips entries the application must not see, starting from the one the provider
    /// presents after a poll verb returned `rc`; returns the verb's result for the
    /// application.
    ///
    /// The poll lock is only tried here: inside the application's poll the provider holds
    /// the CQ's own lock, for which an `ibv_poll_cq` of another thread may be waiting with
    /// the poll lock held. Without it, entries are held as they are (their QP not known
    /// yet), and every later one behind them, for [`Self::present_held`].
    ///
    /// # Safety
    /// `cqx` is this CQ, inside a provider poll.
    unsafe fn filter_ex(
        &self,
        cqx: *mut ibv_cq_ex,
        ops: CqExOps,
        mut rc: c_int,
        current: &mut Current,
    ) -> c_int {
        current.byte_len = None;
        if self.shaped.load(Ordering::Relaxed) == 0 && current.stale.is_empty() {
            return rc;
        }
        let qps = self.qps.try_lock();
        let mut synthesized = Vec::new();
        let mut held = Vec::new();
        while rc == 0 {
            // SAFETY: inside a poll, the provider presents a valid entry.
            let mut wc = unsafe { read_entry(cqx, ops, false) };
            let before = wc.byte_len;
            let stale = current
                .stale
                .iter()
                .any(|(n, ring)| (!ops.has_qp_num || wc.qp_num == *n) && ring.contains(wc.wr_id));
            let verdict = match &qps {
                _ if stale => Some((false, None)),
                Some(qps) if !current.hold_all => self.translate(
                    qps,
                    &mut wc,
                    ops.has_qp_num,
                    &mut synthesized,
                    &mut current.held_back,
                    true,
                ),
                _ => {
                    current.hold_all = true;
                    None
                }
            };
            match verdict {
                // Held (whole, should it be the application's) to be presented once what
                // is held before it is.
                None => {
                    // SAFETY: as above.
                    let whole = unsafe { read_entry(cqx, ops, true) };
                    let known = ops.has_qp_num || wc.qp_num != 0;
                    held.push(Held::raw(
                        ibv_wc {
                            qp_num: wc.qp_num,
                            ..whole
                        },
                        known,
                    ));
                }
                Some((deliver, q)) => {
                    if let Some(q) = q {
                        note_touched(&mut current.touched, q);
                    }
                    held.extend(synthesized.drain(..).map(Held::settled));
                    if deliver {
                        // SAFETY: as above; wr_id is the CQ's field for the current entry.
                        unsafe { (*cqx).wr_id = wc.wr_id };
                        if wc.byte_len != before {
                            current.byte_len = Some(wc.byte_len);
                        }
                        break;
                    }
                }
            }
            // SAFETY: inside a poll.
            rc = unsafe { (ops.next_poll)(cqx) };
        }
        drop(qps);
        self.push_held(held);
        rc
    }

    /// Presents the next held completion, if any, as the current entry (see
    /// [`CqShared::take_held`]). Called with no provider poll active.
    ///
    /// # Safety
    /// `cqx` is this CQ, inside the application's poll.
    unsafe fn present_held(&self, cqx: *mut ibv_cq_ex, current: &mut Current) -> c_int {
        let mut next = None;
        if self.has_held() {
            let qps = self.qps.lock();
            self.take_held(&qps, 1, &mut current.touched, |wc| next = Some(wc));
        }
        current.synthetic = next;
        match current.synthetic {
            Some(wc) => {
                // SAFETY: the application's live CQ.
                unsafe {
                    (*cqx).wr_id = wc.wr_id;
                    (*cqx).status = wc.status;
                }
                0
            }
            None => libc::ENOENT,
        }
    }

    /// `ibv_start_poll` after the provider's returned `rc`.
    ///
    /// # Safety
    /// `cqx` is this CQ.
    unsafe fn start_ex(&self, cqx: *mut ibv_cq_ex, ops: CqExOps, mut rc: c_int) -> c_int {
        let mut current = self.current();
        current.synthetic = None;
        current.provider_active = rc == 0;
        // The QPs with completions held: the provider's next ones of theirs go behind.
        (current.held_back, current.hold_all) = self.held_back();
        if rc == 0 {
            // SAFETY: a provider poll has started.
            rc = unsafe { self.filter_ex(cqx, ops, 0, &mut current) };
            if rc == 0 {
                return 0;
            }
            // Everything the provider had was internal, or it failed: the application
            // will not call end_poll after an error from start_poll, so end it here.
            // SAFETY: the provider's poll is active.
            unsafe { (ops.end_poll)(cqx) };
            self.session_ended(&mut current);
        } else {
            self.session_ended(&mut current);
        }
        // SAFETY: no provider poll is active; cqx is this CQ.
        unsafe { self.after_session(cqx, ops, &mut current) };
        if rc == libc::ENOENT {
            // SAFETY: no provider poll is active; cqx is this CQ.
            rc = unsafe { self.present_held(cqx, &mut current) };
        }
        if rc != 0 {
            let touched = std::mem::take(&mut current.touched);
            drop(current);
            self.drain_touched(touched);
        }
        rc
    }

    /// `ibv_next_poll`.
    ///
    /// # Safety
    /// `cqx` is this CQ, inside the application's poll.
    unsafe fn next_ex(&self, cqx: *mut ibv_cq_ex, ops: CqExOps) -> c_int {
        let mut current = self.current();
        if current.provider_active {
            // SAFETY: the provider's poll is active.
            let rc = unsafe { (ops.next_poll)(cqx) };
            // SAFETY: as above.
            let rc = unsafe { self.filter_ex(cqx, ops, rc, &mut current) };
            if rc != libc::ENOENT || !self.has_held() {
                return rc;
            }
            // The provider is done; end its poll now, and go on with held ones.
            // SAFETY: the provider's poll is active.
            unsafe { (ops.end_poll)(cqx) };
            self.session_ended(&mut current);
            // SAFETY: no provider poll is active; cqx is this CQ.
            unsafe { self.after_session(cqx, ops, &mut current) };
        }
        // SAFETY: no provider poll is active; cqx is this CQ.
        unsafe { self.present_held(cqx, &mut current) }
    }

    /// `ibv_end_poll`.
    ///
    /// # Safety
    /// `cqx` is this CQ, inside the application's poll.
    unsafe fn end_ex(&self, cqx: *mut ibv_cq_ex, ops: CqExOps) {
        let touched = {
            let mut current = self.current();
            if current.provider_active {
                // SAFETY: the provider's poll is active.
                unsafe { (ops.end_poll)(cqx) };
                self.session_ended(&mut current);
                // SAFETY: no provider poll is active; cqx is this CQ.
                unsafe { self.after_session(cqx, ops, &mut current) };
            }
            current.byte_len = None;
            current.synthetic = None;
            std::mem::take(&mut current.touched)
        };
        self.drain_touched(touched);
    }

    /// After a poll of the application's ended: if QPs were destroyed or reset meanwhile
    /// and no other poll has begun, polls the CQ for their stale completions.
    ///
    /// # Safety
    /// `cqx` is this CQ, with no provider poll active.
    unsafe fn after_session(&self, cqx: *mut ibv_cq_ex, ops: CqExOps, current: &mut Current) {
        if current.stale.is_empty() || self.sessions.load(Ordering::Acquire) != 0 {
            return;
        }
        let stale = std::mem::take(&mut current.stale);
        // SAFETY: guaranteed by the caller.
        let touched = unsafe { self.poll_ex_aside(cqx, ops, &stale) };
        for q in touched {
            note_touched(&mut current.touched, q);
        }
    }

    /// Polls this extended CQ empty with its own verbs, for the shaper: completions
    /// carrying the tags of a QP of `stale` are dropped, the others held for the
    /// application, in order. Called with the poll in progress locked and no poll of the
    /// application's begun: one that begins now waits for this one on that lock, before
    /// the provider's (see [`start_poll`]). Lock order: the poll in progress, the poll lock.
    ///
    /// # Safety
    /// `cqx` is this CQ, with no provider poll active.
    unsafe fn poll_ex_aside(
        &self,
        cqx: *mut ibv_cq_ex,
        ops: CqExOps,
        stale: &[(u32, Arc<QuickRing>)],
    ) -> Vec<Arc<QpShared>> {
        let mut touched = Vec::new();
        let qps = self.qps.lock();
        if self.dead.load(Ordering::Acquire) {
            return touched;
        }
        let mut attr = ibv_poll_cq_attr::default();
        // SAFETY: guaranteed by the caller.
        let mut rc = unsafe { (ops.start_poll)(cqx, &mut attr) };
        if rc != 0 {
            return touched;
        }
        let (mut held_back, _) = self.held_back();
        let mut held = Vec::new();
        let mut synthesized = Vec::new();
        while rc == 0 {
            // SAFETY: inside the provider poll started above.
            let mut wc = unsafe { read_entry(cqx, ops, true) };
            let dropped = stale
                .iter()
                .any(|(n, ring)| (!ops.has_qp_num || wc.qp_num == *n) && ring.contains(wc.wr_id));
            if !dropped {
                match self.translate(
                    &qps,
                    &mut wc,
                    ops.has_qp_num,
                    &mut synthesized,
                    &mut held_back,
                    true,
                ) {
                    None => held.push(Held::raw(wc, true)),
                    Some((deliver, q)) => {
                        if deliver {
                            held.push(Held::settled(wc));
                        }
                        held.extend(synthesized.drain(..).map(Held::settled));
                        if let Some(q) = q {
                            note_touched(&mut touched, q);
                        }
                    }
                }
            }
            // SAFETY: as above.
            rc = unsafe { (ops.next_poll)(cqx) };
        }
        // SAFETY: as above.
        unsafe { (ops.end_poll)(cqx) };
        self.push_held(held);
        touched
    }

    /// [`CqShared::drop_stale`] of an extended CQ: polled now if no poll of the
    /// application's is in progress, else by that poll as it goes and when it ends.
    pub(crate) fn drop_stale_ex(
        &self,
        ops: CqExOps,
        qp_num: u32,
        ring: &Arc<QuickRing>,
    ) -> Vec<Arc<QpShared>> {
        let mut current = self.current();
        current.stale.push((qp_num, Arc::clone(ring)));
        if self.sessions.load(Ordering::Acquire) != 0 {
            return Vec::new();
        }
        let stale = std::mem::take(&mut current.stale);
        // SAFETY: no poll of the application's is in progress, and none begins while the
        // poll in progress is locked (see `start_poll`).
        unsafe { self.poll_ex_aside(self.cq.cast(), ops, &stale) }
    }

    /// Lets the QPs heard from post more, and releases the paced requests that are due of
    /// this CQ's QPs, never waiting for a QP's lock.
    fn drain_touched(&self, touched: Vec<Arc<QpShared>>) {
        let now = self.engine.now();
        for q in touched {
            q.drain_or_defer(now);
        }
        self.engine.release_for(self, now);
    }
}

unsafe extern "C" fn start_poll(cqx: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    let Some((c, ops)) = state(cqx) else {
        return libc::ENOENT;
    };
    if crate::ffi::in_forked_child() {
        // SAFETY: the provider's own start_poll; in a child every poll verb passes through.
        return unsafe { (ops.start_poll)(cqx, attr) };
    }
    // Counted before the provider's poll begins, and past the poll-in-progress lock, so
    // that the shaper's own poll of the CQ (which holds that lock, see
    // `CqShared::poll_ex_aside`) either sees this one coming or ends before it begins.
    c.sessions.fetch_add(1, Ordering::AcqRel);
    drop(c.current());
    // SAFETY: the provider's own start_poll, with the caller's arguments.
    let rc = unsafe { (ops.start_poll)(cqx, attr) };
    // SAFETY: cqx is the CQ whose state this is.
    guarded(|| unsafe { c.start_ex(cqx, ops, rc) }, || rc)
}

unsafe extern "C" fn next_poll(cqx: *mut ibv_cq_ex) -> c_int {
    let Some((c, ops)) = state(cqx) else {
        return libc::ENOENT;
    };
    // SAFETY: inside the application's poll of this CQ.
    guarded(
        || unsafe { c.next_ex(cqx, ops) },
        || unsafe { (ops.next_poll)(cqx) },
    )
}

unsafe extern "C" fn end_poll(cqx: *mut ibv_cq_ex) {
    let Some((c, ops)) = state(cqx) else {
        return;
    };
    if crate::ffi::in_forked_child() {
        // SAFETY: the provider's own end_poll; in a child every poll verb passes through.
        return unsafe { (ops.end_poll)(cqx) };
    }
    // SAFETY: ending the application's poll of this CQ.
    guarded(|| unsafe { c.end_ex(cqx, ops) }, || ());
}

/// The synthesized entry being presented, and the length to show for a provider one.
fn presented(c: &CqShared) -> (Option<ibv_wc>, Option<u32>) {
    let current = c.current();
    (current.synthetic, current.byte_len)
}

/// An accessor that reads a synthesized entry's field, else asks the provider.
macro_rules! accessor {
    ($name:ident, $field:ident, $ty:ty, |$wc:ident| $synthetic:expr) => {
        unsafe extern "C" fn $name(cqx: *mut ibv_cq_ex) -> $ty {
            let Some((c, ops)) = state(cqx) else {
                return Default::default();
            };
            if crate::ffi::in_forked_child() {
                // SAFETY: the provider's own accessor; in a child every verb passes through.
                return ops
                    .$field
                    .map_or_else(Default::default, |f| unsafe { f(cqx) });
            }
            match (presented(c).0, ops.$field) {
                (Some($wc), _) => $synthetic,
                // SAFETY: the provider's own accessor, inside the application's poll.
                (None, Some(f)) => unsafe { f(cqx) },
                (None, None) => Default::default(),
            }
        }
    };
}

accessor!(read_opcode, read_opcode, ibv_wc_opcode, |wc| wc.opcode);
accessor!(read_vendor_err, read_vendor_err, u32, |wc| wc.vendor_err);
// SAFETY (imm_data): both members of the union are plain 32-bit integers.
accessor!(read_imm_data, read_imm_data, __be32, |wc| unsafe {
    wc.__bindgen_anon_1.imm_data
});
accessor!(read_qp_num, read_qp_num, u32, |wc| wc.qp_num);
accessor!(read_src_qp, read_src_qp, u32, |wc| wc.src_qp);
accessor!(read_wc_flags, read_wc_flags, std::ffi::c_uint, |wc| wc
    .wc_flags);
accessor!(read_slid, read_slid, u32, |wc| u32::from(wc.slid));
accessor!(read_sl, read_sl, u8, |wc| wc.sl);
accessor!(read_dlid_path_bits, read_dlid_path_bits, u8, |wc| wc
    .dlid_path_bits);

unsafe extern "C" fn read_byte_len(cqx: *mut ibv_cq_ex) -> u32 {
    let Some((c, ops)) = state(cqx) else {
        return 0;
    };
    if crate::ffi::in_forked_child() {
        // SAFETY: the provider's own accessor; in a child every verb passes through.
        return ops.read_byte_len.map_or(0, |f| unsafe { f(cqx) });
    }
    match (presented(c), ops.read_byte_len) {
        ((Some(wc), _), _) => wc.byte_len,
        ((None, Some(len)), _) => len,
        // SAFETY: the provider's own accessor, inside the application's poll.
        ((None, None), Some(f)) => unsafe { f(cqx) },
        ((None, None), None) => 0,
    }
}
