//! The deterministic event queue.
//!
//! Events are plain data ordered by (time, sequence number): two events at the same
//! picosecond run in the order they were scheduled, so a run depends only on its inputs
//! and its seed. Cancelling is done by the owners of events (generation counters), not by
//! the queue, which keeps the queue a plain binary heap.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::time::Picos;

/// The heap holds only keys; events wait in a slab, so that sifting moves two words per
/// entry rather than whole events. The order is (time, sequence number) packed into one
/// `u128`, compared in one go.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key {
    order: u128,
    slot: u32,
}

impl Key {
    fn at(self) -> Picos {
        (self.order >> 64) as Picos
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    // Reversed so that the std max-heap pops the earliest (time, sequence) first; the
    // sequence numbers are unique, so the slot never decides.
    fn cmp(&self, other: &Self) -> Ordering {
        other.order.cmp(&self.order)
    }
}

/// A queue of future events.
pub struct EventQueue<E> {
    heap: BinaryHeap<Key>,
    slab: Vec<E>,
    free: Vec<u32>,
    next_seq: u64,
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
            heap: BinaryHeap::with_capacity(1024),
            slab: Vec::with_capacity(1024),
            free: Vec::with_capacity(1024),
            next_seq: 0,
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
        self.heap.len()
    }

    /// True when no event waits.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Schedules `event` at `at`; a time in the past is moved to now, because nothing may
    /// happen before the event being handled. `event` may be any component's own event
    /// type that converts into the queue's.
    pub fn schedule(&mut self, at: Picos, event: impl Into<E>) {
        let event = event.into();
        let at = at.max(self.now);
        let seq = self.next_seq;
        self.next_seq += 1;
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
        self.heap.push(Key {
            order: (u128::from(at) << 64) | u128::from(seq),
            slot,
        });
    }

    /// Pops the earliest event if it is due no later than `until`, advancing the clock.
    pub fn pop_until(&mut self, until: Picos) -> Option<(Picos, E)> {
        if self.heap.peek()?.at() > until {
            return None;
        }
        let key = self.heap.pop()?;
        self.now = key.at();
        self.popped += 1;
        self.free.push(key.slot);
        Some((self.now, self.slab[key.slot as usize]))
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
}
