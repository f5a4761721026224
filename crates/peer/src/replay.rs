//! A sliding window of the transport counters a session has accepted (RFC 6479, as
//! WireGuard keeps one): a counter is fresh if it is above the newest accepted, or within
//! [`WINDOW`] below it and not yet seen. Reordering within the window is accepted; an exact
//! replay or anything older than the window is refused.
//!
//! Invariants: the window is a fixed [`WINDOW`] bits; [`ReplayWindow::check`] changes
//! nothing (it runs before decryption), [`ReplayWindow::accept`] only after the datagram
//! authenticated; the newest accepted counter only grows.

/// Counters remembered below the newest: 2048, WireGuard's figure.
pub const WINDOW: u64 = 2048;
const WORDS: usize = (WINDOW / 64) as usize;

/// One session's received counters (see the module documentation).
#[derive(Debug, Clone)]
pub struct ReplayWindow {
    /// The newest counter accepted plus one; 0 before the first.
    next: u64,
    /// Bit `c % WINDOW` set when counter `c` (within the window) was accepted.
    bits: [u64; WORDS],
}

impl Default for ReplayWindow {
    fn default() -> Self {
        ReplayWindow {
            next: 0,
            bits: [0; WORDS],
        }
    }
}

impl ReplayWindow {
    /// Whether `counter` could be accepted: newer than any, or in the window and unseen.
    pub fn check(&self, counter: u64) -> bool {
        if counter >= self.next {
            return true;
        }
        if self.next - counter > WINDOW {
            return false;
        }
        let (word, bit) = Self::place(counter);
        self.bits[word] & (1 << bit) == 0
    }

    /// Records `counter`, which [`check`](Self::check) allowed and which authenticated.
    pub fn accept(&mut self, counter: u64) {
        if counter >= self.next {
            // Clear the slots the window slides over (all of them after a long jump).
            let gap = (counter - self.next).saturating_add(1);
            if gap >= WINDOW {
                self.bits = [0; WORDS];
            } else {
                for c in self.next..=counter {
                    let (word, bit) = Self::place(c);
                    self.bits[word] &= !(1 << bit);
                }
            }
            self.next = counter.saturating_add(1);
        }
        let (word, bit) = Self::place(counter);
        self.bits[word] |= 1 << bit;
    }

    fn place(counter: u64) -> (usize, u64) {
        let slot = counter % WINDOW;
        ((slot / 64) as usize, slot % 64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_and_counters_older_than_the_window_are_refused_reordering_is_not() {
        let mut w = ReplayWindow::default();
        for c in [0, 2, 1, 5000] {
            assert!(w.check(c), "{c}");
            w.accept(c);
            assert!(!w.check(c), "{c} twice");
        }
        assert!(w.check(5000 - 1), "within the window, unseen");
        assert!(w.check(5000 - 2047));
        assert!(!w.check(5000 - 2049), "older than 2048 below the newest");
        assert!(!w.check(2), "slid out");
        w.accept(4999);
        assert!(!w.check(4999));
        assert!(w.check(6000));
    }
}
