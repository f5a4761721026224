//! The deterministic event queue.
//!
//! Events are plain data ordered by time, then by the order they were scheduled in: two
//! events at the same picosecond run in the order they were scheduled, so a run depends
//! only on its inputs and its seed. Cancelling is done by the owners of events
//! (generation counters), not by the queue.
//!
//! Time only moves forward and nothing is scheduled before now, so the queue is a radix
//! heap (a monotone priority queue): an event waits in the bucket of the highest bit in
//! which its time differs from the time of the last event popped. Scheduling is a push;
//! popping takes from bucket 0 (events at exactly that time, in schedule order) and, when
//! it is empty, from the lowest non-empty bucket: straight when it holds one or two events,
//! else by spreading it over the lower ones around its earliest time. An event moves down
//! at most 64 buckets in its life, in practice a few, where a binary heap of thousands of
//! pending events (one per paced queue pair) sifts a dozen levels on every push and pop.
//! The order is exactly that of a binary heap of (time, sequence number).

use std::collections::VecDeque;

use crate::time::Picos;

/// Buckets: 0 holds events at the last popped time, `b` (1..=64) those whose time first
/// differs from it in bit `b - 1`.
const BUCKETS: usize = 65;

/// What the queue keeps of an event besides the event itself, which waits in a slab so
/// that spreading a bucket moves 16 bytes per entry rather than whole events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    at: Picos,
    slot: u32,
}

/// A queue of future events.
pub struct EventQueue<E> {
    /// Bucket 0, in schedule order (every event in it has time `last`).
    due: VecDeque<Key>,
    /// Buckets 1..=64 (index `b - 1`), unordered.
    later: [Vec<Key>; BUCKETS - 1],
    /// Per bucket of `later`, the earliest time in it (meaningless while it is empty).
    earliest: [Picos; BUCKETS - 1],
    /// Bit `b - 1` set while bucket `b` holds an event.
    occupied: u64,
    /// The time of the last event popped: no event waiting is earlier.
    last: Picos,
    len: usize,
    slab: Vec<E>,
    free: Vec<u32>,
    now: Picos,
    popped: u64,
}

impl<E: Copy> Default for EventQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E: Copy> EventQueue<E> {
    /// An empty queue at time zero.
    pub fn new() -> Self {
        EventQueue {
            due: VecDeque::with_capacity(1024),
            later: std::array::from_fn(|_| Vec::new()),
            earliest: [Picos::MAX; BUCKETS - 1],
            occupied: 0,
            last: 0,
            len: 0,
            slab: Vec::with_capacity(1024),
            free: Vec::with_capacity(1024),
            now: 0,
            popped: 0,
        }
    }

    /// The time of the event being handled (the last one popped).
    pub fn now(&self) -> Picos {
        self.now
    }

    /// How many events have been popped so far.
    pub fn popped(&self) -> u64 {
        self.popped
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no event waits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Schedules `event` at `at`; a time in the past is moved to now, because nothing may
    /// happen before the event being handled. `event` may be any component's own event
    /// type that converts into the queue's.
    pub fn schedule(&mut self, at: Picos, event: impl Into<E>) {
        let event = event.into();
        let at = at.max(self.now);
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slab[slot as usize] = event;
                slot
            }
            None => {
                self.slab.push(event);
                (self.slab.len() - 1) as u32
            }
        };
        self.len += 1;
        self.file(Key { at, slot });
    }

    /// Puts `key` (no earlier than `last`) in its bucket.
    fn file(&mut self, key: Key) {
        let bucket = 64 - (key.at ^ self.last).leading_zeros() as usize;
        if bucket == 0 {
            self.due.push_back(key);
        } else {
            let b = bucket - 1;
            self.later[b].push(key);
            self.earliest[b] = self.earliest[b].min(key.at);
            self.occupied |= 1 << b;
        }
    }

    /// The time of the earliest event waiting.
    fn earliest_at(&self) -> Option<Picos> {
        if !self.due.is_empty() {
            return Some(self.last);
        }
        (self.occupied != 0).then(|| self.earliest[self.occupied.trailing_zeros() as usize])
    }

    /// Pops the earliest event if it is due no later than `until`, advancing the clock.
    pub fn pop_until(&mut self, until: Picos) -> Option<(Picos, E)> {
        if self.earliest_at()? > until {
            return None;
        }
        let key = match self.due.pop_front() {
            Some(key) => key,
            None => self.take_lowest()?,
        };
        self.len -= 1;
        self.now = key.at;
        self.popped += 1;
        self.free.push(key.slot);
        Some((self.now, self.slab[key.slot as usize]))
    }

    /// With bucket 0 empty, the earliest event: the lowest non-empty bucket's, taken
    /// straight when it is the only one there (the usual case, as events seldom share a
    /// picosecond) or one of two (the next most usual), else after spreading the bucket.
    fn take_lowest(&mut self) -> Option<Key> {
        if self.occupied == 0 {
            return None;
        }
        let b = self.occupied.trailing_zeros() as usize;
        match self.later[b][..] {
            [only] => {
                self.empty(b);
                self.last = only.at;
                Some(only)
            }
            // What spreading two events and popping bucket 0 comes to, without passing
            // through bucket 0: the earlier (the first scheduled of a tie) is taken and the
            // other filed around its time (in bucket 0 if they tie).
            [first, second] => {
                let (earlier, later) = if second.at < first.at {
                    (second, first)
                } else {
                    (first, second)
                };
                self.empty(b);
                self.last = earlier.at;
                self.file(later);
                Some(earlier)
            }
            _ => {
                self.spread(b);
                self.due.pop_front()
            }
        }
    }

    /// Empties bucket `b`.
    fn empty(&mut self, b: usize) {
        self.later[b].clear();
        self.occupied &= !(1 << b);
        self.earliest[b] = Picos::MAX;
    }

    /// Moves `last` to the earliest time of bucket `b` (the lowest non-empty one) and files
    /// its events again around it: those at that time land in bucket 0, every other in
    /// a lower bucket than before. Buckets above keep their events: `last` moved within the
    /// bits they share with it.
    ///
    /// Events of one time always share a bucket (a bucket is a function of the time and of
    /// the bits of `last` above it, which moving `last` to an earliest time never changes
    /// for a later one), and enter it in schedule order, directly or by spreading a bucket
    /// in order; so bucket 0 receives them in schedule order, with no sorting.
    fn spread(&mut self, b: usize) {
        self.occupied &= !(1 << b);
        self.last = self.earliest[b];
        self.earliest[b] = Picos::MAX;
        let mut keys = std::mem::take(&mut self.later[b]);
        for key in keys.drain(..) {
            self.file(key);
        }
        // Give the emptied bucket its memory back, so that it is not allocated again.
        self.later[b] = keys;
    }

    /// Moves the clock to `t` (no earlier than now) once no event is due before it.
    pub fn advance_to(&mut self, t: Picos) {
        self.now = self.now.max(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_by_time_then_schedule_order() {
        let mut q = EventQueue::<&str>::new();
        q.schedule(30, "c");
        q.schedule(10, "a1");
        q.schedule(20, "b");
        q.schedule(10, "a2");
        let order: Vec<_> = std::iter::from_fn(|| q.pop_until(u64::MAX))
            .map(|(_, e)| e)
            .collect();
        assert_eq!(order, vec!["a1", "a2", "b", "c"]);
        assert_eq!(q.now(), 30);
        assert_eq!(q.popped(), 4);
    }

    #[test]
    fn past_events_run_now_and_limit_is_respected() {
        let mut q = EventQueue::<i32>::new();
        q.schedule(100, 1);
        assert_eq!(q.pop_until(50), None);
        assert_eq!(q.pop_until(100), Some((100, 1)));
        q.schedule(10, 2);
        assert_eq!(q.pop_until(u64::MAX), Some((100, 2)));
        assert!(q.is_empty());
    }

    proptest::proptest! {
        /// Whatever the times, ties and interleaving of scheduling and popping, events come
        /// out in exactly the order of a binary heap of (time, sequence number).
        #[test]
        fn pops_in_the_order_of_a_heap_of_time_and_sequence(
            steps in proptest::collection::vec((0u8..4, 0u64..1 << 40, 0u64..3), 1..400)
        ) {
            use std::cmp::Reverse;
            use std::collections::BinaryHeap;
            let mut q = EventQueue::<u64>::new();
            let mut reference = BinaryHeap::new();
            let mut seq = 0u64;
            for (op, delay, tie) in steps {
                if op < 3 {
                    // Delays from none (ties at now) to about a second, some in the past.
                    let at = (q.now() + (delay >> (tie * 16))).saturating_sub(tie);
                    q.schedule(at, seq);
                    reference.push(Reverse((at.max(q.now()), seq)));
                    seq += 1;
                } else {
                    let until = q.now() + delay;
                    let expected = match reference.peek() {
                        Some(Reverse((at, _))) if *at <= until => reference.pop(),
                        _ => None,
                    };
                    let got = q.pop_until(until);
                    proptest::prop_assert_eq!(got, expected.map(|Reverse((at, s))| (at, s)));
                    if got.is_none() {
                        q.advance_to(until);
                    }
                }
            }
            while let Some(Reverse((at, s))) = reference.pop() {
                proptest::prop_assert_eq!(q.pop_until(u64::MAX), Some((at, s)));
            }
            proptest::prop_assert!(q.is_empty());
        }
    }
}
