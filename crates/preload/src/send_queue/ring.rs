//! The quick ring: the tags of one send queue's WQEs, and the records of the requests
//! posted straight from the application's request, shared between the QP's posts and the
//! polls of its send CQ.
//!
//! Locks: none of its own. Everything but [`QuickRing::settle`] and the reads a poll makes
//! runs under the QP's lock (its caller's); `settle` runs under the CQ's poll lock only.
//! The protocol between the two (see [`QuickRing`]) is checked by `loom` over post, poll,
//! close, reopen and destroy: `RUSTFLAGS="--cfg loom" cargo test -p justitia-preload --lib
//! --release send_queue::ring` builds this module alone against loom's atomics.
//!
//! Invariants:
//! - `tail <= head`, and `head - tail` never exceeds the slot count: the records of the
//!   quick requests in flight are distinct.
//! - While the ring is closed (`CLOSED` set in `tail`), only the QP's lock holder moves
//!   `tail`; while open, only a poll's compare-and-swap does, and only forward.
//! - A record is written before the WQE it describes is posted and before `head` is
//!   published past it.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};

use justitia_verbs::sys::*;

/// The record of a request [`SendQueue::post_now`](super::SendQueue::post_now) posted
/// whole (a *quick* request), kept until its completion in the slot of its WQE's tag: no
/// search, no allocation. Turned into an entry of the general queue only when the general
/// path needs the queue (`SendQueue::materialize`). Atomic words, because a poll reads them without the QP's
/// lock (see [`QuickRing`]); plain loads and stores on x86-64.
#[derive(Debug)]
struct QuickSlot {
    /// The application's `wr_id`.
    wr_id: AtomicU64,
    /// [`QUICK_SIGNALED`] and [`QUICK_VISIBLE`], and its opcode (`IBV_WR_*`) in the high
    /// 32 bits.
    meta: AtomicU64,
}

/// [`QuickSlot::meta`]: the WQE was posted signaled.
pub(super) const QUICK_SIGNALED: u64 = IBV_SEND_SIGNALED as u64;
/// [`QuickSlot::meta`]: its completion is the application's.
pub(super) const QUICK_VISIBLE: u64 = (IBV_SEND_SIGNALED as u64) << 8;
/// [`QuickRing::tail`]: the ring is closed (no sequence number reaches this bit).
pub(super) const CLOSED: u64 = 1 << 63;

/// The tags of one send queue's WQEs, and the records of its quick requests, shared between
/// the QP's posts (under its lock) and the polls of its send CQ (under the CQ's lock only).
///
/// Tags are `wr_id` values: the addresses of the ring's own records, one per send-queue
/// slot, so they identify the QP and the WQE exactly, cannot be a pointer the application
/// owns, and are never shown to it: an error completion names exactly the WQE that failed
/// even when the application reuses `wr_id`s, and a completion finds its record without a
/// search. The slot count is a power of two, so that a tag is a mask and a shift away from
/// its WQE's sequence number (no division per WQE).
///
/// Quick requests are the newest WQEs in flight, `tail..head` by sequence number (every WQE
/// posted has a sequence number; `head` is the next one). While the ring is *open* (the
/// queue holds no other request, has not failed and is not being destroyed), a poll settles
/// the completion of one without the QP's lock ([`Self::settle`]): RC completes in order,
/// so it and the unsignaled ones before it are done, and one compare-and-swap moves `tail`
/// past them. Whatever else changes the queue holds the QP's lock and first *closes* the
/// ring (sets the `CLOSED` bit in `tail`, one atomic step that makes a poll's
/// compare-and-swap fail from then on, so that poll takes the QP's lock instead); while
/// closed, only the lock's holder moves `tail`. A post reopens the ring, under the lock,
/// when the queue is empty again. A post writes a record before it posts the WQE and
/// publishes `head` after, so a poll that reads a published `head` reads the records behind
/// it; a WQE whose completion comes before its `head` is published is settled by the poll
/// under the QP's lock, which waits for the post to finish.
pub struct QuickRing {
    /// The records; their addresses are the tags.
    slots: Box<[QuickSlot]>,
    /// The address of the first record.
    base: u64,
    /// The QP's number: a completion of another QP (one the shaper only observes, say) is
    /// never settled here, whatever its `wr_id`.
    qp_num: u32,
    /// The size of the records in bytes.
    bytes: u64,
    /// The slot count less one.
    mask: u64,
    /// The sequence number of the next WQE posted. Written under the QP's lock (`Release`,
    /// after the record of a quick request), read by polls (`Acquire`).
    head: AtomicU64,
    /// The oldest quick request in flight, with [`CLOSED`] while the ring is closed. Moved
    /// by polls with compare-and-swap while open, by the QP's lock holder while closed.
    tail: AtomicU64,
}

impl std::fmt::Debug for QuickRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tail = self.tail.load(Ordering::Relaxed);
        f.debug_struct("QuickRing")
            .field("head", &self.head.load(Ordering::Relaxed))
            .field("tail", &(tail & !CLOSED))
            .field("closed", &(tail & CLOSED != 0))
            .finish()
    }
}

impl QuickRing {
    /// Room for `slots` WQEs in flight, rounded up to a power of two; closed and empty.
    pub(crate) fn new(slots: u32, qp_num: u32) -> Self {
        let len = (slots.max(1) as usize).next_power_of_two();
        let slots: Box<[QuickSlot]> = (0..len)
            .map(|_| QuickSlot {
                wr_id: AtomicU64::new(0),
                meta: AtomicU64::new(0),
            })
            .collect();
        QuickRing {
            base: slots.as_ptr() as u64,
            qp_num,
            bytes: std::mem::size_of_val(&*slots) as u64,
            mask: len as u64 - 1,
            slots,
            head: AtomicU64::new(0),
            tail: AtomicU64::new(CLOSED),
        }
    }

    /// The record of the WQE with sequence number `seq`, whose address is its tag; unique
    /// among the WQEs in flight, which never outnumber the slots.
    #[inline(always)]
    fn record(&self, seq: u64) -> &QuickSlot {
        // SAFETY: masked, the index is below the slot count, which is `mask + 1`.
        unsafe { self.slots.get_unchecked((seq & self.mask) as usize) }
    }

    /// The tag of the WQE with sequence number `seq`.
    #[inline(always)]
    pub(super) fn tag(&self, seq: u64) -> u64 {
        std::ptr::from_ref(self.record(seq)) as u64
    }

    /// The oldest quick request in flight with the [`CLOSED`] bit, as one word: a post
    /// tests openness and room with one subtraction.
    #[inline(always)]
    pub(super) fn tail_word(&self) -> u64 {
        self.tail.load(Ordering::Acquire)
    }

    /// Publishes `head` (under the QP's lock, after the records behind it are written).
    #[inline(always)]
    pub(super) fn publish_head(&self, head: u64) {
        self.head.store(head, Ordering::Release);
    }

    /// Writes the record of the quick request with sequence number `seq` (under the QP's
    /// lock, before its WQE is posted and `head` published past it); returns its tag.
    #[inline(always)]
    pub(super) fn write_record(&self, seq: u64, wr_id: u64, meta: u64) -> u64 {
        let record = self.record(seq);
        record.wr_id.store(wr_id, Ordering::Relaxed);
        record.meta.store(meta, Ordering::Relaxed);
        std::ptr::from_ref(record) as u64
    }

    /// The application's `wr_id` and the meta word of the record of `seq` (under the QP's
    /// lock).
    pub(super) fn read_record(&self, seq: u64) -> (u64, u64) {
        let record = self.record(seq);
        (
            record.wr_id.load(Ordering::Relaxed),
            record.meta.load(Ordering::Relaxed),
        )
    }

    /// Whether `wr_id` is one of the tags: a completion carrying one belongs to this QP
    /// whatever the completion queue says.
    pub fn contains(&self, wr_id: u64) -> bool {
        wr_id.wrapping_sub(self.base) < self.bytes
    }

    /// The sequence number of the next WQE (read under the QP's lock, which writes it).
    #[inline(always)]
    pub(super) fn head(&self) -> u64 {
        self.head.load(Ordering::Relaxed)
    }

    /// The oldest quick request in flight, and whether the ring is closed.
    #[inline(always)]
    pub(super) fn tail(&self) -> (u64, bool) {
        let tail = self.tail.load(Ordering::Acquire);
        (tail & !CLOSED, tail & CLOSED != 0)
    }

    /// Quick requests in flight.
    pub(super) fn quick_len(&self) -> usize {
        (self.head() - self.tail().0) as usize
    }

    /// Closes the ring (no poll settles a quick request from now on); returns the oldest
    /// quick request in flight.
    pub(super) fn close(&self) -> u64 {
        let (tail, closed) = self.tail();
        if closed {
            return tail;
        }
        self.tail.fetch_or(CLOSED, Ordering::AcqRel) & !CLOSED
    }

    /// Sets the ring's tail (closed) or opens it at `tail` (under the QP's lock).
    pub(super) fn set_tail(&self, tail: u64, closed: bool) {
        let tail = if closed { tail | CLOSED } else { tail };
        self.tail.store(tail, Ordering::Release);
    }

    /// Settles a completion of this QP without its lock, if that needs nothing but the
    /// ring: a completion without a tag is not the send queue's (a receive's, or one of a
    /// post that passed through), nor is one of another QP (an observed QP sharing the CQ
    /// whose `wr_id` happens to equal a tag); a success that is a receive is not either; a success of a
    /// signaled quick request in flight on the open ring retires it and the ones before it
    /// (RC completes in order: the unsignaled ones completed silently), and is delivered
    /// with the application's `wr_id` if it asked for it, else hidden. `None`: the QP's lock
    /// is needed (an error, a closed ring, a stale tag, or a WQE whose record is not
    /// published yet), the completion left untouched.
    #[inline(always)]
    pub fn settle(&self, wc: &mut ibv_wc) -> Option<Verdict> {
        let offset = wc.wr_id.wrapping_sub(self.base);
        if offset >= self.bytes || wc.qp_num != self.qp_num {
            return Some(Verdict::NotOurs);
        }
        if wc.status != IBV_WC_SUCCESS {
            return None;
        }
        if wc.opcode & IBV_WC_RECV != 0 {
            return Some(Verdict::NotOurs);
        }
        let tail = self.tail.load(Ordering::Acquire);
        if tail & CLOSED != 0 {
            return None;
        }
        let head = self.head.load(Ordering::Acquire);
        // The slot of a tag is its record's index (a tag is the record's address).
        let slot = offset / std::mem::size_of::<QuickSlot>() as u64;
        let before = slot.wrapping_sub(tail) & self.mask;
        if before >= head.wrapping_sub(tail) {
            return None;
        }
        let record = self.record(slot);
        let meta = record.meta.load(Ordering::Relaxed);
        if meta & QUICK_SIGNALED == 0 {
            return None;
        }
        let wr_id = record.wr_id.load(Ordering::Relaxed);
        #[cfg(all(test, not(loom)))]
        race::window();
        // Fails only if the ring was closed meanwhile (polls of one CQ hold its lock).
        self.tail
            .compare_exchange(tail, tail + before + 1, Ordering::AcqRel, Ordering::Relaxed)
            .ok()?;
        Some(if meta & QUICK_VISIBLE != 0 {
            wc.wr_id = wr_id;
            Verdict::Deliver
        } else {
            Verdict::Hide
        })
    }
}

/// What became of one completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not from this QP's send queue: leave it alone.
    NotOurs,
    /// The application's completion (possibly rewritten): deliver it.
    Deliver,
    /// Internal or duplicate: hide it.
    Hide,
}

/// A test hook: the moment between a poll's reading of the ring and its compare-and-swap.
#[cfg(all(test, not(loom)))]
pub(crate) mod race {
    thread_local! {
        /// Set on a thread whose polls give way to other threads between reading the ring
        /// and moving its tail, so that a race test hits that window often.
        pub(crate) static WIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Between reading the ring and moving its tail in [`super::QuickRing::settle`].
    pub(crate) fn window() {
        if WIDE.get() {
            std::thread::yield_now();
        }
    }
}

/// The ring's protocol under `loom`, which runs every interleaving (up to its preemption
/// bound) of a poster, a poller and a third thread that closes the ring under the QP's
/// lock, as a split request, a move to the error state or a destroy does. What runs under
/// the QP's lock is a small model of the send queue's use of the ring: a general queue of
/// the WQEs the ring no longer tracks, filled by `materialize`, and the poll's locked path.
/// Every completion must be delivered exactly once, in order, with its own `wr_id`, and the
/// queue must end empty (a completion settled twice, or never, fails).
#[cfg(all(test, loom))]
mod loom_model {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::VecDeque;

    use loom::sync::{Arc, Mutex};

    use super::*;

    /// The send queue under the QP's lock, as far as the ring is concerned.
    #[derive(Default)]
    struct Queue {
        /// WQEs posted and not yet completed that the ring does not track: (tag, `wr_id`).
        general: VecDeque<(u64, u64)>,
        destroyed: bool,
    }

    struct Qp {
        ring: QuickRing,
        queue: Mutex<Queue>,
        /// The hardware: tags in posting order, completing in that order.
        wire: Mutex<VecDeque<u64>>,
    }

    const META: u64 = QUICK_SIGNALED | QUICK_VISIBLE;

    /// `SendQueue::materialize`: closes the ring and moves its quick requests to the
    /// general queue.
    fn materialize(ring: &QuickRing, q: &mut Queue) {
        let from = ring.close();
        let head = ring.head();
        for seq in from..head {
            let (wr_id, _) = ring.read_record(seq);
            q.general.push_back((ring.tag(seq), wr_id));
        }
        ring.set_tail(head, true);
    }

    /// `SendQueue::post_now` when the ring is open (or may open) with room, else the general
    /// path (`accept`, which materializes first, then the drain's `commit`).
    fn post(qp: &Qp, wr_id: u64, whole: bool) {
        let mut q = qp.queue.lock().unwrap();
        let ring = &qp.ring;
        let head = ring.head();
        let (tail, closed) = ring.tail();
        if whole && closed && q.general.is_empty() && !q.destroyed {
            ring.set_tail(tail, false);
        }
        let open_with_room = head.wrapping_sub(ring.tail_word()) < ring.mask + 1;
        if whole && open_with_room {
            let tag = ring.write_record(head, wr_id, META);
            qp.wire.lock().unwrap().push_back(tag);
            ring.publish_head(head + 1);
            return;
        }
        materialize(ring, &mut q);
        let tag = ring.tag(head);
        q.general.push_back((tag, wr_id));
        qp.wire.lock().unwrap().push_back(tag);
        ring.publish_head(head + 1);
        ring.set_tail(head + 1, true);
    }

    /// A poll of one completion: the ring without the lock, else the locked path
    /// (`complete_fast`, which may reopen the ring, then `complete`). Returns the `wr_id`
    /// delivered, if any.
    fn poll(qp: &Qp, tag: u64) -> Option<u64> {
        let mut wc = ibv_wc {
            wr_id: tag,
            qp_num: 7,
            status: IBV_WC_SUCCESS,
            opcode: IBV_WC_RDMA_WRITE,
            ..Default::default()
        };
        if let Some(v) = qp.ring.settle(&mut wc) {
            return (v == Verdict::Deliver).then_some(wc.wr_id);
        }
        let mut q = qp.queue.lock().unwrap();
        if q.general.is_empty() && !q.destroyed {
            let (tail, closed) = qp.ring.tail();
            if closed {
                qp.ring.set_tail(tail, false);
            }
            if let Some(v) = qp.ring.settle(&mut wc) {
                return (v == Verdict::Deliver).then_some(wc.wr_id);
            }
        }
        materialize(&qp.ring, &mut q);
        let at = q.general.iter().position(|&(t, _)| t == tag)?;
        let (_, wr_id) = q.general[at];
        q.general.drain(..=at);
        Some(wr_id)
    }

    /// Three requests (the second one split, so it takes the general path) posted by one
    /// thread and polled by another, while a third runs `third` under the QP's lock.
    fn run(third: fn(&QuickRing, &mut Queue)) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(2);
        builder.check(move || {
            let qp = Arc::new(Qp {
                ring: QuickRing::new(4, 7),
                queue: Mutex::new(Queue::default()),
                wire: Mutex::new(VecDeque::new()),
            });
            let poster = {
                let qp = Arc::clone(&qp);
                loom::thread::spawn(move || {
                    post(&qp, 1, true);
                    post(&qp, 2, false);
                    post(&qp, 3, true);
                })
            };
            let closer = {
                let qp = Arc::clone(&qp);
                loom::thread::spawn(move || third(&qp.ring, &mut qp.queue.lock().unwrap()))
            };
            let mut delivered = Vec::new();
            let mut polled = 0;
            while polled < 3 {
                let Some(tag) = qp.wire.lock().unwrap().pop_front() else {
                    loom::thread::yield_now();
                    continue;
                };
                polled += 1;
                delivered.extend(poll(&qp, tag));
            }
            poster.join().unwrap();
            closer.join().unwrap();
            assert_eq!(delivered, [1, 2, 3], "each completion once, in order");
            let q = qp.queue.lock().unwrap();
            assert!(q.general.is_empty(), "a request left behind");
            assert_eq!(qp.ring.quick_len(), 0, "a quick request left on the ring");
        });
    }

    /// Another thread takes the whole queue (a split request's accept, a move to the error
    /// state): it closes the ring and moves its quick requests to the general queue.
    #[test]
    fn a_close_that_takes_the_queue_races_posts_and_polls() {
        run(materialize);
    }

    /// The QP is destroyed meanwhile: the ring closes for good.
    #[test]
    fn a_destroy_races_posts_and_polls() {
        run(|ring, q| {
            q.destroyed = true;
            ring.close();
        });
    }
}
