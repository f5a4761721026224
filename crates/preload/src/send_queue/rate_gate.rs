//! The rate gate: the process's rate pacer behind a lock, and an allowance taken from it
//! ahead that posts spend without the lock or a clock reading.
//!
//! Locks: the pacer's own (`parking_lot`), taken by [`RateGate::lock`] and
//! [`RateGate::release`] and by nothing else; no other lock is taken while it is held.
//! It may be taken under a QP's lock (a paced post) or the engine's record of the applied
//! rate (a change of settings), never the other way round.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use justitia_core::message_charge::MessageCharge;
use justitia_core::pacer::Pacer;

/// The process's rate pacer, and an allowance taken from it ahead that posts spend without
/// its lock or a clock reading.
///
/// The allowance is what [`Pacer::unclocked_allowance`] says the balances of the pacer's
/// last refill cover: requests that fit in it are ones [`Pacer::try_release_unclocked`]
/// would release. A post takes its bytes and its operation from it with one
/// compare-and-swap ([`Self::try_take`]); whoever locks the pacer first takes back what is
/// left and charges the pacer what was spent ([`Self::lock`]), so the pacer's own
/// decisions always see every release. The allowance is handed out again only by a post
/// that found it short ([`Self::release`]).
pub struct RateGate {
    pacer: parking_lot::Mutex<Pacer>,
    /// What is left of the allowance: operations in the high 32 bits, bytes in the low 32.
    /// Taken from with compare-and-swap and emptied with a swap, both `Relaxed`: it is a
    /// counter whose every change is one atomic step in a single modification order, so
    /// the swap under the lock sees exactly what the posts before it took and no post
    /// after it takes anything. Nothing else is published through it (the pacer is read
    /// only under its lock).
    allowance: AtomicU64,
    /// The allowance last handed out, in the same layout; written and read only under the
    /// pacer's lock (`Relaxed`: the lock orders it).
    granted: AtomicU64,
    /// What a request is charged in the pacer's bytes, as [`MessageCharge::to_words`]:
    /// read at every paced post, without a lock (see [`Self::charged`]).
    charge: [AtomicU64; 5],
    /// [`Self::charge`] is not [`MessageCharge::NONE`].
    priced: AtomicBool,
}

/// The bytes field of a [`RateGate`] allowance.
const ALLOWANCE_BYTES: u64 = u32::MAX as u64;

impl RateGate {
    /// A gate for `pacer`, with no allowance handed out.
    pub fn new(pacer: Pacer) -> Self {
        RateGate {
            pacer: parking_lot::Mutex::new(pacer),
            allowance: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            charge: Default::default(),
            priced: AtomicBool::new(false),
        }
    }

    /// Takes a request of `bytes` payload from the allowance at its price, or else
    /// releases it as [`Self::release`] does: whether it may go. A request is priced
    /// ([`MessageCharge::charged`]) only when the price counts more than the payload: an
    /// unpriced flow pays one load and a branch.
    #[inline(always)]
    pub fn take(&self, bytes: u64, now: impl FnOnce() -> Duration) -> bool {
        if self.priced.load(Ordering::Relaxed) {
            return self.take_priced(bytes, now);
        }
        self.try_take(bytes) || self.release(bytes, now)
    }

    #[inline(always)]
    fn take_priced(&self, bytes: u64, now: impl FnOnce() -> Duration) -> bool {
        let cost = self.charged(bytes);
        self.try_take(cost) || self.release(cost, now)
    }

    /// What a request of `bytes` payload is charged ([`MessageCharge::charged`]).
    ///
    /// Each word is read alone (`Relaxed`): a post racing a change of the price may be
    /// charged the old price's terms mixed with the new one's, each a price the daemon
    /// gave, for that one request.
    #[inline(always)]
    pub fn charged(&self, bytes: u64) -> u64 {
        self.charge().charged(bytes)
    }

    /// The price in force.
    #[inline(always)]
    pub fn charge(&self) -> MessageCharge {
        MessageCharge::from_words(self.charge.each_ref().map(|w| w.load(Ordering::Relaxed)))
    }

    /// Puts `charge` in force for the posts that follow.
    pub fn set_charge(&self, charge: MessageCharge) {
        for (word, value) in self.charge.iter().zip(charge.to_words()) {
            word.store(value, Ordering::Relaxed);
        }
        self.priced
            .store(charge != MessageCharge::NONE, Ordering::Relaxed);
    }

    /// Takes a request of `bytes` and one operation from the allowance, if it has room:
    /// the request is released, without the lock or the clock.
    #[inline(always)]
    pub fn try_take(&self, bytes: u64) -> bool {
        let mut left = self.allowance.load(Ordering::Relaxed);
        loop {
            // No operation left, or too few bytes (always for more than the field holds).
            if left >> 32 == 0 || left & ALLOWANCE_BYTES < bytes {
                return false;
            }
            match self.allowance.compare_exchange_weak(
                left,
                // Both fields stay in range: one operation of at least one, and `bytes` of
                // at least as many.
                left - (1 << 32) - bytes,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(now) => left = now,
            }
        }
    }

    /// Locks the pacer, first charging it what was spent of the allowance (which is then
    /// empty until [`Self::release`] hands one out again).
    pub fn lock(&self) -> parking_lot::MutexGuard<'_, Pacer> {
        let mut pacer = self.pacer.lock();
        let left = self.allowance.swap(0, Ordering::Relaxed);
        let granted = self.granted.swap(0, Ordering::Relaxed);
        if granted != 0 {
            let spent = |field: fn(u64) -> u64| field(granted).saturating_sub(field(left));
            pacer.charge_unclocked(spent(|a| a & ALLOWANCE_BYTES), spent(|a| a >> 32));
        }
        pacer
    }

    /// Releases a request of `bytes` and one operation that [`Self::try_take`] could not:
    /// asks the pacer without the clock, then at `now()`, and hands out a new allowance.
    #[cold]
    #[inline(never)]
    pub fn release(&self, bytes: u64, now: impl FnOnce() -> Duration) -> bool {
        let mut pacer = self.lock();
        let released =
            pacer.try_release_unclocked(bytes, 1) || pacer.try_release(now(), bytes, 1).is_ok();
        let (bytes, ops) = pacer.unclocked_allowance();
        let granted =
            (ops.unwrap_or(u64::MAX).min(ALLOWANCE_BYTES) << 32) | bytes.min(ALLOWANCE_BYTES);
        // Published after `granted`, both under the lock: a post that takes from it is
        // charged by the next `lock`, which reads both under the same lock.
        self.granted.store(granted, Ordering::Relaxed);
        self.allowance.store(granted, Ordering::Relaxed);
        released
    }
}
