//! A set of queue-pair numbers for the arbiter's round robin: membership and "the first
//! number at or after `n`" in constant time for the numbers a run has, whatever their count.
//!
//! Two levels of bits: one bit per number, and one summary bit per 64-number word that is
//! set exactly when that word has a bit set. Finding the next member scans the rest of one
//! word, then the summary (one word covers 4096 numbers), then one word again, so a turn
//! among 8000 ready queue pairs costs what it costs among 8 (an ordered tree paid a cache
//! miss per level).
//!
//! Invariants: `summary` bit `w` is set if and only if `words[w] != 0`; `len` is the number
//! of set bits in `words`.

/// A set of `u32` numbers, growing to the largest one inserted.
#[derive(Clone, Debug, Default)]
pub(super) struct ReadyBits {
    words: Vec<u64>,
    summary: Vec<u64>,
    len: usize,
}

impl ReadyBits {
    /// Adds `n`; true if it was not there.
    pub(super) fn insert(&mut self, n: u32) -> bool {
        let (w, bit) = split(n);
        if w >= self.words.len() {
            self.words.resize(w + 1, 0);
            self.summary.resize(w / 64 + 1, 0);
        }
        let word = &mut self.words[w];
        if *word & bit != 0 {
            return false;
        }
        if *word == 0 {
            self.summary[w / 64] |= 1 << (w % 64);
        }
        *word |= bit;
        self.len += 1;
        true
    }

    /// Takes `n` out; true if it was there.
    pub(super) fn remove(&mut self, n: u32) -> bool {
        let (w, bit) = split(n);
        let Some(word) = self.words.get_mut(w) else {
            return false;
        };
        if *word & bit == 0 {
            return false;
        }
        *word &= !bit;
        if *word == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
        self.len -= 1;
        true
    }

    /// True if `n` is in the set.
    pub(super) fn contains(&self, n: u32) -> bool {
        let (w, bit) = split(n);
        self.words.get(w).is_some_and(|word| word & bit != 0)
    }

    /// True when no number is in the set.
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The smallest member at or after `n`.
    pub(super) fn at_or_after(&self, n: u32) -> Option<u32> {
        let (w, _) = split(n);
        let here = self.words.get(w)? & (u64::MAX << (n % 64));
        if here != 0 {
            return Some(join(w, here));
        }
        let w = self.word_after(w)?;
        Some(join(w, self.words[w]))
    }

    /// The first member after `n`, wrapping around to the smallest.
    pub(super) fn after_wrapping(&self, n: u32) -> Option<u32> {
        n.checked_add(1)
            .and_then(|m| self.at_or_after(m))
            .or_else(|| self.at_or_after(0))
    }

    /// The members from `from` up, in ascending order.
    pub(super) fn iter_from(&self, from: u32) -> impl Iterator<Item = u32> + '_ {
        let mut next = self.at_or_after(from);
        std::iter::from_fn(move || {
            let n = next?;
            next = n.checked_add(1).and_then(|m| self.at_or_after(m));
            Some(n)
        })
    }

    /// The index of the first non-empty word after word `w`.
    fn word_after(&self, w: usize) -> Option<usize> {
        let s = (w + 1) / 64;
        let first = self.summary.get(s)? & (u64::MAX.checked_shl(((w + 1) % 64) as u32)?);
        if first != 0 {
            return Some(s * 64 + first.trailing_zeros() as usize);
        }
        self.summary[s + 1..]
            .iter()
            .position(|&b| b != 0)
            .map(|at| (s + 1 + at) * 64 + self.summary[s + 1 + at].trailing_zeros() as usize)
    }
}

/// The word of `n` and its bit there.
fn split(n: u32) -> (usize, u64) {
    ((n / 64) as usize, 1 << (n % 64))
}

/// The lowest set bit of `bits`, a word of index `w`, as a number.
fn join(w: usize, bits: u64) -> u32 {
    (w * 64) as u32 + bits.trailing_zeros()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn next_members_across_words_and_summary_words() {
        let mut b = ReadyBits::default();
        for n in [3, 64, 4095, 4096, 9000] {
            assert!(b.insert(n));
        }
        assert!(!b.insert(64));
        assert_eq!(b.at_or_after(0), Some(3));
        assert_eq!(b.at_or_after(4), Some(64));
        assert_eq!(b.at_or_after(65), Some(4095));
        assert_eq!(b.at_or_after(4096), Some(4096));
        assert_eq!(b.at_or_after(4097), Some(9000));
        assert_eq!(b.at_or_after(9001), None);
        assert_eq!(b.after_wrapping(9000), Some(3));
        assert_eq!(b.after_wrapping(u32::MAX), Some(3));
        assert!(b.remove(4095) && !b.remove(4095));
        assert_eq!(b.at_or_after(65), Some(4096));
        assert_eq!(b.iter_from(10).collect::<Vec<_>>(), [64, 4096, 9000]);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u32),
        Remove(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Numbers over three summary words, clustered enough that removals hit members.
        let n = prop_oneof![0u32..200, 0u32..13_000];
        prop_oneof![n.clone().prop_map(Op::Insert), n.prop_map(Op::Remove)]
    }

    proptest! {
        /// After any sequence of inserts and removes, the set answers as an ordered set
        /// does: membership, emptiness, the next member from every point, and the order.
        #[test]
        fn answers_as_an_ordered_set(ops in prop::collection::vec(op(), 0..300), probes in prop::collection::vec(0u32..13_500, 1..40)) {
            let mut bits = ReadyBits::default();
            let mut set = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Insert(n) => prop_assert_eq!(bits.insert(n), set.insert(n)),
                    Op::Remove(n) => prop_assert_eq!(bits.remove(n), set.remove(&n)),
                }
            }
            prop_assert_eq!(bits.is_empty(), set.is_empty());
            for n in probes {
                prop_assert_eq!(bits.contains(n), set.contains(&n));
                prop_assert_eq!(bits.at_or_after(n), set.range(n..).next().copied());
                let wrapped = set.range(n + 1..).next().or_else(|| set.first()).copied();
                prop_assert_eq!(bits.after_wrapping(n), wrapped);
            }
            prop_assert_eq!(bits.iter_from(0).collect::<Vec<_>>(), set.iter().copied().collect::<Vec<_>>());
        }
    }
}
