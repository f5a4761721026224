//! The RNIC's caches of memory translation and protection entries (step 2 of the model):
//! the MPT entry of each memory region (its key, bounds and access rights) and the MTT
//! entry of each registered page (its physical address), each a least-recently-used set
//! of bounded size.
//!
//! A processing unit that starts a message reading its payload from host memory needs the
//! memory region's MPT entry and the MTT entry of every page the payload spans; each
//! entry it does not hold is read from host memory first, one after another (the MTT
//! entry's address is known only once the MPT entry is), so a message waits
//! `translation_miss_ns` per miss. Husky (NSDI'23, §4) finds these caches shared among
//! all tenants of an RNIC: a tenant touching many regions or pages spread over a large
//! region evicts the entries of the others, whose messages then miss.
//!
//! Invariants: each cache holds at most its capacity of keys, and `resident` counts them;
//! the recency list from `front` to `back` holds exactly the resident keys, the one
//! touched last at the front; a capacity of 0 holds nothing and never misses (every entry
//! on chip), and then a touch does no work at all.

use std::collections::HashMap;

use crate::time::Picos;

/// No slot (an end of the list).
const NONE: u32 = u32::MAX;

/// A resident key's place in the recency list.
#[derive(Clone, Copy, Debug)]
struct Slot {
    key: u64,
    /// The slot touched just after it (toward the front); `NONE` at the front.
    newer: u32,
    /// The slot touched just before it (toward the back); `NONE` at the back.
    older: u32,
}

/// A least-recently-used set of at most `capacity` keys. Keys may be sparse (a page
/// number of a large region), so they are found through a map; the slots, once all are
/// used, are reused by the keys that evict their holders.
#[derive(Clone, Debug)]
pub(super) struct Lru {
    /// Keys it can hold; 0: unbounded (not modelled).
    capacity: u32,
    /// Each resident key's slot.
    at: HashMap<u64, u32>,
    slots: Vec<Slot>,
    /// The slot touched last, or `NONE` when empty.
    front: u32,
    /// The resident slot touched longest ago, or `NONE` when empty.
    back: u32,
}

impl Lru {
    /// A set of `capacity` keys (0: every key held), holding none yet.
    pub(super) fn new(capacity: u32) -> Self {
        Lru {
            capacity,
            at: HashMap::new(),
            slots: Vec::new(),
            front: NONE,
            back: NONE,
        }
    }

    /// Whether it is bounded (a touch can miss).
    pub(super) fn bounded(&self) -> bool {
        self.capacity > 0
    }

    /// Makes `key` the most recent, inserting it (and evicting the least recent when full)
    /// if it was not held. True on a miss.
    pub(super) fn touch(&mut self, key: u64) -> bool {
        if self.capacity == 0 {
            return false;
        }
        if let Some(&slot) = self.at.get(&key) {
            if self.front != slot {
                self.unlink(slot);
                self.push_front(slot);
            }
            return false;
        }
        let slot = if self.at.len() == self.capacity as usize {
            let lru = self.back;
            self.unlink(lru);
            self.at.remove(&self.slots[lru as usize].key);
            self.slots[lru as usize].key = key;
            lru
        } else {
            self.slots.push(Slot {
                key,
                newer: NONE,
                older: NONE,
            });
            (self.slots.len() - 1) as u32
        };
        self.at.insert(key, slot);
        self.push_front(slot);
        true
    }

    fn unlink(&mut self, slot: u32) {
        let Slot { newer, older, .. } = self.slots[slot as usize];
        match newer {
            NONE => self.front = older,
            n => self.slots[n as usize].older = older,
        }
        match older {
            NONE => self.back = newer,
            o => self.slots[o as usize].newer = newer,
        }
    }

    fn push_front(&mut self, slot: u32) {
        let old_front = self.front;
        let s = &mut self.slots[slot as usize];
        s.older = old_front;
        s.newer = NONE;
        match old_front {
            NONE => self.back = slot,
            f => self.slots[f as usize].newer = slot,
        }
        self.front = slot;
    }

    /// The resident keys, the most recent first.
    #[cfg(test)]
    fn by_recency(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let mut at = self.front;
        while at != NONE {
            out.push(self.slots[at as usize].key);
            at = self.slots[at as usize].older;
        }
        out
    }
}

/// One RNIC's MPT and MTT caches and the cost of a miss.
#[derive(Clone, Debug)]
pub(super) struct Translation {
    /// MPT entries, keyed by memory region.
    mpt: Lru,
    /// MTT entries, keyed by memory region and page ([`page_key`]).
    mtt: Lru,
    /// Time per entry not held.
    miss: Picos,
}

/// The MTT key of page `page` of region `mr`: regions are numbered per run (fewer than
/// 2^32) and pages of a region counted from its start (fewer than 2^32: a region of up to
/// 16 TB of 4 KB pages).
fn page_key(mr: u32, page: u64) -> u64 {
    (u64::from(mr) << 32) | (page & 0xFFFF_FFFF)
}

impl Translation {
    /// Caches of `mpt_entries` and `mtt_entries` (0: unbounded), each miss costing `miss`.
    pub(super) fn new(mpt_entries: u32, mtt_entries: u32, miss: Picos) -> Self {
        Translation {
            mpt: Lru::new(mpt_entries),
            mtt: Lru::new(mtt_entries),
            miss,
        }
    }

    /// Whether either cache is bounded: only then is a message's memory looked up.
    pub(super) fn modelled(&self) -> bool {
        self.mpt.bounded() || self.mtt.bounded()
    }

    /// A message's payload in region `mr` spans `pages` pages from page `first`: touches
    /// the region's MPT entry and the pages' MTT entries, and returns the time the
    /// processing unit waits for the entries it did not hold.
    pub(super) fn look_up(&mut self, mr: u32, first: u64, pages: u64) -> Picos {
        let mut misses = u64::from(self.mpt.touch(u64::from(mr)));
        if self.mtt.bounded() {
            misses += (first..first + pages)
                .filter(|&p| self.mtt.touch(page_key(mr, p)))
                .count() as u64;
        }
        misses * self.miss
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time;

    #[test]
    fn a_bounded_set_evicts_the_least_recently_used_key() {
        let mut l = Lru::new(2);
        assert!(l.touch(1 << 40), "cold");
        assert!(l.touch(7));
        assert!(!l.touch(1 << 40), "held: a hit, now the most recent");
        assert!(l.touch(9), "a third key misses");
        assert_eq!(
            l.by_recency(),
            [9, 1 << 40],
            "and evicts 7, the least recent"
        );
        assert!(l.touch(7));
        assert_eq!(l.by_recency(), [7, 9]);
        assert_eq!(l.at.len(), 2);
        assert_eq!(l.slots.len(), 2, "slots are reused");
    }

    #[test]
    fn capacity_0_never_misses_and_holds_nothing() {
        let mut l = Lru::new(0);
        assert!((0..10_000u64).all(|k| !l.touch(k * 977)));
        assert!(l.at.is_empty() && l.slots.is_empty());
    }

    /// Against a plain list in recency order, over a pseudo-random sequence of sparse keys.
    #[test]
    fn agrees_with_a_list_in_recency_order() {
        for capacity in [1, 3, 16] {
            let mut l = Lru::new(capacity);
            let mut list: Vec<u64> = Vec::new();
            let mut x: u64 = 99;
            for _ in 0..3_000 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let key = ((x >> 33) % 24) << 30;
                let held = list.iter().position(|&k| k == key);
                if let Some(at) = held {
                    list.remove(at);
                } else if list.len() == capacity as usize {
                    list.pop();
                }
                list.insert(0, key);
                assert_eq!(l.touch(key), held.is_none(), "capacity {capacity}");
                assert_eq!(l.by_recency(), list, "capacity {capacity}");
            }
        }
    }

    /// MPT of 2 entries, MTT of 4, 500 ns a miss.
    ///
    /// - region 1, pages 0-2, cold: 1 MPT + 3 MTT misses = 4 x 500 = 2000 ns;
    /// - the same again: all held, 0 ns;
    /// - region 2, pages 0-1: 1 + 2 misses = 1500 ns; the MTT now holds (2,1) (2,0)
    ///   (1,2) (1,1): (1,0) was evicted;
    /// - region 1, page 0: its MPT entry is held (2 entries, 2 regions), its page was
    ///   evicted: 1 miss, 500 ns.
    #[test]
    fn a_message_waits_one_miss_time_per_entry_not_held() {
        let miss = time::from_ns(500.0);
        let mut t = Translation::new(2, 4, miss);
        assert!(t.modelled());
        assert_eq!(t.look_up(1, 0, 3), time::from_ns(2000.0));
        assert_eq!(t.look_up(1, 0, 3), 0);
        assert_eq!(t.look_up(2, 0, 2), time::from_ns(1500.0));
        assert_eq!(t.look_up(1, 0, 1), time::from_ns(500.0));
        assert!(!Translation::new(0, 0, miss).modelled());
        assert_eq!(Translation::new(0, 0, miss).look_up(5, 0, 1000), 0);
    }
}
