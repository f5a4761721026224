//! Time for the pacer, injectable so tests can drive it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A source of `now`, as a duration since an arbitrary fixed origin.
pub trait Clock: Send + Sync {
    /// The current time.
    fn now(&self) -> Duration;

    /// Lets `d` pass on this clock: the calling thread sleeps on the real clock, and
    /// a virtual clock moves forward, so that a test sees a wait as time gone by.
    fn sleep(&self, d: Duration);
}

/// The monotonic clock of the process (`CLOCK_MONOTONIC`, what `Instant` reads).
///
/// Read on the shaped post path of every paced request, so it is one `clock_gettime` (a
/// vDSO call) and integer nanoseconds, without `Instant`'s checked `timespec` arithmetic.
/// `CLOCK_MONOTONIC_COARSE` would be cheaper still, but it moves in steps of a scheduler
/// tick (1 to 4 ms): the pacer, whose burst is about a microsecond at the line rate,
/// would see time in bursts of milliseconds and lose most of them to its burst cap.
#[derive(Debug)]
pub struct MonotonicClock {
    origin_ns: u64,
}

/// `CLOCK_MONOTONIC` in nanoseconds; 0 if it cannot be read (never on Linux).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is writable.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        MonotonicClock {
            origin_ns: monotonic_ns(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(monotonic_ns().saturating_sub(self.origin_ns))
    }

    fn sleep(&self, d: Duration) {
        // `nanosleep`, resumed for the rest after a signal: the verbs that wait here are
        // not interruptible natively either.
        std::thread::sleep(d);
    }
}

/// A clock that moves only when told to (tests, simulation).
#[derive(Debug, Default)]
pub struct VirtualClock {
    nanos: AtomicU64,
}

impl VirtualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(ns, Ordering::SeqCst);
    }

    /// Sets the clock to `to` (never backwards).
    pub fn set(&self, to: Duration) {
        let ns = u64::try_from(to.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_max(ns, Ordering::SeqCst);
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }

    fn sleep(&self, d: Duration) {
        self.advance(d);
    }
}
