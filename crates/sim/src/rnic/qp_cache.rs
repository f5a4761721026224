//! The RNIC's on-chip cache of queue-pair contexts (step 2 of the model): which queue
//! pairs' contexts an RNIC holds, least recently used first out.
//!
//! A queue pair is known here by its index among its RNIC's queue pairs (dense from 0).
//! Recency is a doubly-linked list threaded through one entry per index, so a touch costs
//! the same with thousands of queue pairs as with a few: a hit unlinks the queue pair and
//! puts it at the front, a miss takes the back out when full and puts the queue pair at
//! the front.
//!
//! Invariants: at most `capacity` queue pairs are resident, and `resident` counts them;
//! the list from `front` to `back` holds exactly the resident ones, the one touched last
//! at the front; a capacity of 0 holds nothing and never misses (every context on chip), and
//! then a touch does no work at all.

/// No index (an end of the list).
const NONE: u32 = u32::MAX;

/// A queue pair's place in the recency list.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The index touched just after it (toward the front); `NONE` at the front.
    newer: u32,
    /// The index touched just before it (toward the back); `NONE` at the back.
    older: u32,
    /// Whether its context is held.
    resident: bool,
}

impl Entry {
    const OUT: Entry = Entry {
        newer: NONE,
        older: NONE,
        resident: false,
    };
}

/// The contexts one RNIC holds: a least-recently-used set of at most `capacity` indices.
#[derive(Clone, Debug)]
pub(super) struct QpCache {
    /// Contexts it can hold; 0: unbounded (not modelled).
    capacity: u32,
    /// Contexts it holds.
    resident: u32,
    /// Per index, its place in the list (grown to the largest index touched).
    entries: Vec<Entry>,
    /// The index touched last, or `NONE` when empty.
    front: u32,
    /// The resident index touched longest ago, or `NONE` when empty.
    back: u32,
}

impl QpCache {
    /// A cache of `capacity` contexts (0: every context on chip), holding none yet.
    pub(super) fn new(capacity: u32) -> Self {
        QpCache {
            capacity,
            resident: 0,
            entries: Vec::new(),
            front: NONE,
            back: NONE,
        }
    }

    /// A processing unit needs the context of `index`: makes it the most recent, loading it
    /// (and evicting the least recent when full) if it was not held. True on a miss.
    #[inline]
    pub(super) fn touch(&mut self, index: u32) -> bool {
        if self.capacity == 0 {
            return false;
        }
        self.touch_bounded(index)
    }

    fn touch_bounded(&mut self, index: u32) -> bool {
        let i = index as usize;
        if i >= self.entries.len() {
            self.entries.resize(i + 1, Entry::OUT);
        }
        if self.entries[i].resident {
            if self.front != index {
                self.unlink(index);
                self.push_front(index);
            }
            return false;
        }
        if self.resident == self.capacity {
            let lru = self.back;
            self.unlink(lru);
            self.entries[lru as usize].resident = false;
            self.resident -= 1;
        }
        self.push_front(index);
        self.entries[i].resident = true;
        self.resident += 1;
        true
    }

    /// Takes a resident index out of the list.
    fn unlink(&mut self, index: u32) {
        let Entry { newer, older, .. } = self.entries[index as usize];
        match newer {
            NONE => self.front = older,
            n => self.entries[n as usize].older = older,
        }
        match older {
            NONE => self.back = newer,
            o => self.entries[o as usize].newer = newer,
        }
        let e = &mut self.entries[index as usize];
        e.newer = NONE;
        e.older = NONE;
    }

    /// Puts an index that is not in the list at its front.
    fn push_front(&mut self, index: u32) {
        let old_front = self.front;
        self.entries[index as usize].older = old_front;
        self.entries[index as usize].newer = NONE;
        match old_front {
            NONE => self.back = index,
            f => self.entries[f as usize].newer = index,
        }
        self.front = index;
    }

    /// The resident indices, the most recent first.
    #[cfg(test)]
    fn by_recency(&self) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = self.front;
        while at != NONE {
            out.push(at);
            at = self.entries[at as usize].older;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EventQueue;
    use crate::rnic::testing::{dispatch, end, quiet_profile, two_hosts, TestEvent};
    use crate::rnic::{Fabric, Opcode, WorkRequest};
    use crate::time::{self, Picos};

    #[test]
    fn a_held_context_hits_and_becomes_the_most_recent() {
        let mut c = QpCache::new(3);
        for index in [0, 1, 2] {
            assert!(c.touch(index), "cold: {index} misses");
        }
        assert_eq!(c.by_recency(), [2, 1, 0]);
        assert!(!c.touch(0), "held: 0 hits");
        assert_eq!(c.by_recency(), [0, 2, 1]);
        assert!(!c.touch(0), "the front hits too");
        assert!(!c.touch(1), "the back hits");
        assert_eq!(c.by_recency(), [1, 0, 2]);
        assert_eq!(c.resident, 3);
    }

    #[test]
    fn a_miss_when_full_evicts_the_least_recently_used() {
        let mut c = QpCache::new(2);
        assert!(c.touch(5));
        assert!(c.touch(9));
        assert!(!c.touch(5), "5 is now more recent than 9");
        assert!(c.touch(7), "a third context misses");
        assert_eq!(c.by_recency(), [7, 5], "and evicts 9, the least recent");
        assert!(c.touch(9), "9 was evicted");
        assert_eq!(c.by_recency(), [9, 7], "and evicts 5");
        assert_eq!(c.resident, 2);
    }

    #[test]
    fn more_queue_pairs_in_turn_than_entries_miss_every_time() {
        let mut c = QpCache::new(4);
        let misses = (0..10)
            .flat_map(|_| 0..5)
            .filter(|&index| c.touch(index))
            .count();
        assert_eq!(misses, 50, "five in turn through four entries");
        let mut c = QpCache::new(5);
        let misses = (0..10)
            .flat_map(|_| 0..5)
            .filter(|&index| c.touch(index))
            .count();
        assert_eq!(misses, 5, "five through five: only the cold misses");
    }

    #[test]
    fn capacity_0_never_misses_and_holds_nothing() {
        let mut c = QpCache::new(0);
        assert!((0..10_000).all(|index| !c.touch(index % 977)));
        assert!(c.entries.is_empty(), "no work at all");
        assert_eq!(c.by_recency(), Vec::<u32>::new());
    }

    #[test]
    fn capacity_1_holds_the_last_one() {
        let mut c = QpCache::new(1);
        assert!(c.touch(3));
        assert!(!c.touch(3));
        assert!(c.touch(4));
        assert!(c.touch(3));
        assert_eq!(c.by_recency(), [3]);
    }

    /// Against a plain list kept in recency order, over a pseudo-random sequence of
    /// touches: the same hits and misses, and the same residents in the same order.
    #[test]
    fn agrees_with_a_list_in_recency_order() {
        for capacity in [1, 2, 3, 7, 16] {
            let mut c = QpCache::new(capacity);
            let mut list: Vec<u32> = Vec::new();
            let mut x: u32 = 12_345;
            for _ in 0..5_000 {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                let index = (x >> 16) % 24;
                let held = list.iter().position(|&s| s == index);
                let expected_miss = held.is_none();
                if let Some(at) = held {
                    list.remove(at);
                } else if list.len() == capacity as usize {
                    list.pop();
                }
                list.insert(0, index);
                assert_eq!(c.touch(index), expected_miss, "capacity {capacity}");
                assert_eq!(c.by_recency(), list, "capacity {capacity}");
                assert_eq!(c.resident as usize, list.len());
            }
        }
    }

    /// Two queue pairs of host 0 of a quiet RoCE-100 with a context cache of `capacity`,
    /// on processing units of their own, each post two 16 B inline WRITEs at time 0, the
    /// second queue pair first. Returns, per queue pair, when its unit starts each message
    /// (the bookings, in order), and the fabric.
    ///
    /// Both first messages are ready at the same instant and book in the order posted:
    /// the second queue pair's, then the first's. The arbiter's turn starts after queue
    /// pair 0, so it serves the second queue pair first, whose next message then books,
    /// and then the first's: the two alternate at the cache.
    fn starts(capacity: u32) -> ([Vec<Picos>; 2], Fabric) {
        let mut profile = quiet_profile();
        profile.rnic.qp_cache_entries = capacity;
        let mut f = two_hosts(&profile);
        let mut q = EventQueue::<TestEvent>::new();
        let qps = [0, 1].map(|_| f.connect(end(0, false), end(1, false), None).0);
        assert_ne!(f.qps[qps[0].index()].pu, f.qps[qps[1].index()].pu);
        for (tag, &qp) in [qps[1], qps[0], qps[1], qps[0]].iter().enumerate() {
            let wr = WorkRequest {
                tag: tag as u64,
                opcode: Opcode::Write,
                bytes: 16,
                inline: true,
            };
            f.post(qp, wr, &mut q);
        }
        let mut starts: [Vec<Picos>; 2] = Default::default();
        while let Some((_, event)) = q.pop_until(Picos::MAX) {
            dispatch(&mut f, event, &mut q);
            // A booking lasts until its message's first packet, at a later decision.
            for (seen, &qp) in starts.iter_mut().zip(&qps) {
                if let Some(at) = f.qps[qp.index()].pu_booking {
                    if seen.last() != Some(&at) {
                        seen.push(at);
                    }
                }
            }
        }
        (starts, f)
    }

    #[test]
    fn a_context_not_held_delays_the_message_by_one_dma_read() {
        let profile = quiet_profile();
        // Each queue pair's CPU posts its first WRITE by `post_ns`; inline, it is on the
        // RNIC a doorbell later and ready for its unit `wqe_process_ns` after that.
        let ready = time::from_ns(
            profile.host.post_ns + profile.pcie.doorbell_ns + profile.rnic.wqe_process_ns,
        );
        let (unbounded, f) = starts(0);
        let (interval, read) = (f.costs.pu_interval, f.costs.dma_read);
        assert_eq!(read, time::from_ns(profile.pcie.read_latency_ns));
        for s in &unbounded {
            assert_eq!(*s, [ready, ready + interval], "no cache: one turn apart");
        }
        // Two entries hold both: the first touch of each misses, the second hits.
        let (both, _) = starts(2);
        for s in &both {
            assert_eq!(*s, [ready + read, ready + read + interval], "two entries");
        }
        // One entry, the two queue pairs alternating: every touch misses, so the second
        // message of each starts one read latency later than with both held.
        let (one, _) = starts(1);
        for s in &one {
            assert_eq!(
                *s,
                [ready + read, ready + read + interval + read],
                "one entry"
            );
        }
    }
}
