//! The per-process token bucket: bytes per second and, optionally, operations per second.
//!
//! Tokens accrue continuously up to a small burst ([`BURST`] of the rate, and at least one
//! operation). A work request may go when neither balance is negative, and then takes its
//! bytes and one operation, which may drive a balance below zero: the next request waits
//! until the debt is repaid. This lets a chunk larger than the burst through without a
//! special case, and over any long interval the bytes sent are the rate times the interval
//! plus at most one burst and one request.
//!
//! A refused request is told when to come back, and is brought back then, give or take the
//! scheduler: the application's thread or the pacer thread may run milliseconds late on a
//! busy or emulated host, longer than the burst, and the tokens of those milliseconds would
//! be lost to the cap (at 5 MB/s with 64 KiB chunks the rate fell to 70 %). Crediting them
//! at once would hold the rate but turn every late return into a burst as long as the
//! lateness, which queues a co-located latency flow behind it (under Soft-RoCE its p99 rose
//! from under 0.2 ms to several). So the lateness, up to [`MAX_LATENESS_CREDIT`], is owed
//! instead, and repaid by refilling at twice the rate until it is made good: the rate holds
//! while the returns are late less than half the time, and no return releases more than
//! the burst and one request at once. A balance that reaches its cap forgives what is
//! owed: nothing was waiting.

use std::time::Duration;

use crate::config::Rate;

/// How much a full bucket holds, as time at the configured rate.
pub const BURST: Duration = Duration::from_millis(1);

/// The most lateness of a refused request's return that is owed back: a return later than
/// this is a stall, not latency.
pub const MAX_LATENESS_CREDIT: Duration = Duration::from_millis(50);

/// The longest wait [`TokenBucket::try_take`] names. A longer debt (a huge request at a
/// tiny rate) is repaid over several waits: the caller comes back, is refused again and
/// told the rest, instead of a conversion of years of seconds overflowing a `Duration`.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// One resource's balance (bytes or operations).
#[derive(Clone, Debug)]
struct Balance {
    rate: f64,
    tokens: f64,
    cap: f64,
    /// Tokens lost to lateness, repaid on top of the rate.
    owed: f64,
}

impl Balance {
    fn full(rate: f64) -> Self {
        let cap = (rate * BURST.as_secs_f64()).max(1.0);
        Balance {
            rate,
            tokens: cap,
            cap,
            owed: 0.0,
        }
    }

    /// Accrues `dt` seconds, the last `late` of which a waiting request was kept waiting
    /// past its time.
    fn refill(&mut self, dt: f64, late: f64) {
        let accrued = dt * self.rate;
        let repaid = self.owed.min(accrued);
        self.owed -= repaid;
        let total = self.tokens + accrued + repaid;
        if total <= self.cap {
            self.tokens = total;
            return;
        }
        self.tokens = self.cap;
        self.owed = if late > 0.0 {
            // What the cap took from a request kept waiting is owed back.
            let lost = (total - self.cap).min(late * self.rate);
            (self.owed + lost).min(self.rate * MAX_LATENESS_CREDIT.as_secs_f64())
        } else {
            // Full with nobody late: nothing was waiting.
            0.0
        };
    }

    /// Seconds until the balance is no longer negative.
    fn wait(&self) -> f64 {
        let debt = (-self.tokens).max(0.0);
        // Twice the rate while something is owed, the rate after.
        let fast = self.owed.min(debt / 2.0);
        fast / self.rate + (debt - 2.0 * fast) / self.rate
    }
}

/// Token balances for bytes and operations.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    bytes: Balance,
    ops: Option<Balance>,
    last: Duration,
    /// When the last refused request was told the balances would allow it.
    promised: Option<Duration>,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(rate: Rate, now: Duration) -> Self {
        TokenBucket {
            bytes: Balance::full(rate.bytes_per_sec),
            ops: rate.ops_per_sec.map(Balance::full),
            last: now,
            promised: None,
        }
    }

    fn refill(&mut self, now: Duration) {
        if now <= self.last {
            return;
        }
        let late = match self.promised {
            Some(at) if now >= at => {
                self.promised = None;
                now.saturating_sub(at).as_secs_f64()
            }
            _ => 0.0,
        };
        let dt = (now - self.last).as_secs_f64();
        self.last = now;
        self.bytes.refill(dt, late);
        if let Some(ops) = &mut self.ops {
            ops.refill(dt, late);
        }
    }

    /// Takes `bytes` and one operation if the balances allow it at `now`; otherwise returns
    /// how long until they will, at most [`MAX_WAIT`].
    pub fn try_take(&mut self, now: Duration, bytes: u32) -> Result<(), Duration> {
        self.refill(now);
        if self.bytes.tokens >= 0.0 && self.ops.as_ref().is_none_or(|o| o.tokens >= 0.0) {
            self.bytes.tokens -= f64::from(bytes);
            if let Some(ops) = &mut self.ops {
                ops.tokens -= 1.0;
            }
            return Ok(());
        }
        let wait = self
            .bytes
            .wait()
            .max(self.ops.as_ref().map_or(0.0, Balance::wait));
        // A NaN (never expected: rates are finite and positive) waits the longest, so that
        // it cannot turn into a busy loop.
        let secs = if wait.is_nan() {
            MAX_WAIT.as_secs_f64()
        } else {
            wait.clamp(0.0, MAX_WAIT.as_secs_f64())
        };
        // Round up to a whole nanosecond so that waking at now + wait always succeeds.
        let wait = Duration::try_from_secs_f64(secs).unwrap_or(MAX_WAIT) + Duration::from_nanos(1);
        self.promised = Some(now + wait);
        Err(wait)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn long_run_rate_matches_the_configured_rate() {
        let rate = Rate {
            bytes_per_sec: 20e6,
            ops_per_sec: None,
        };
        let mut b = TokenBucket::new(rate, Duration::ZERO);
        let mut now = Duration::ZERO;
        let mut sent = 0u64;
        while now < Duration::from_secs(10) {
            match b.try_take(now, 65_536) {
                Ok(()) => sent += 65_536,
                Err(wait) => now += wait,
            }
        }
        let achieved = sent as f64 / now.as_secs_f64();
        assert!((achieved / 20e6 - 1.0).abs() < 0.01, "{achieved}");
    }

    #[test]
    fn ops_limit_binds_for_small_requests() {
        let rate = Rate {
            bytes_per_sec: 1e9,
            ops_per_sec: Some(1000.0),
        };
        let mut b = TokenBucket::new(rate, Duration::ZERO);
        let mut now = Duration::ZERO;
        let mut ops = 0u64;
        while now < Duration::from_secs(2) {
            match b.try_take(now, 16) {
                Ok(()) => ops += 1,
                Err(wait) => now += wait,
            }
        }
        assert!((ops as f64 / now.as_secs_f64() / 1000.0 - 1.0).abs() < 0.01);
    }

    #[test]
    fn a_pacer_that_wakes_late_still_gets_the_rate() {
        // 64 KiB chunks at 5 MB/s, every wake-up 6 ms after the time the bucket named
        // (what a pacer thread sees under emulation). Without credit for the lateness the
        // rate fell to 70 % (13.1 ms + 6 ms per chunk instead of 13.1 ms).
        let rate = Rate {
            bytes_per_sec: 5e6,
            ops_per_sec: None,
        };
        let mut b = TokenBucket::new(rate, Duration::ZERO);
        let late = Duration::from_millis(6);
        let mut now = Duration::ZERO;
        let mut sent = 0u64;
        while now < Duration::from_secs(20) {
            match b.try_take(now, 65_536) {
                Ok(()) => sent += 65_536,
                Err(wait) => now += wait + late,
            }
        }
        let achieved = sent as f64 / now.as_secs_f64();
        assert!((achieved / 5e6 - 1.0).abs() < 0.01, "{achieved}");
    }

    #[test]
    fn a_late_return_is_repaid_over_time_not_at_once() {
        // 5 KiB chunks at 32 MB/s, taken by a poller that is descheduled for 4 ms: on its
        // return at most one burst and one chunk go at once, yet the rate holds.
        let rate = Rate {
            bytes_per_sec: 32e6,
            ops_per_sec: None,
        };
        let mut b = TokenBucket::new(rate, Duration::ZERO);
        let chunk = 5_120u32;
        let mut now = Duration::ZERO;
        let mut sent = 0u64;
        let mut bursts = Vec::new();
        let mut ticks = 0u64;
        while now < Duration::from_secs(2) {
            let mut at_once = 0u64;
            while b.try_take(now, chunk).is_ok() {
                at_once += u64::from(chunk);
            }
            sent += at_once;
            bursts.push(at_once);
            ticks += 1;
            // Polls every 10 us, and one poll in 1000 comes 4 ms late.
            now += if ticks.is_multiple_of(1000) {
                Duration::from_millis(4)
            } else {
                Duration::from_micros(10)
            };
        }
        let largest = bursts.iter().copied().max().unwrap_or(0);
        let bound = 32e6 * BURST.as_secs_f64() + f64::from(chunk);
        assert!(largest as f64 <= bound, "{largest} B at once > {bound}");
        let achieved = sent as f64 / now.as_secs_f64();
        assert!((achieved / 32e6 - 1.0).abs() < 0.02, "{achieved}");
    }

    #[test]
    fn a_stall_is_not_credited_beyond_the_bound() {
        let rate = Rate {
            bytes_per_sec: 1e6,
            ops_per_sec: None,
        };
        let mut b = TokenBucket::new(rate, Duration::ZERO);
        assert!(b.try_take(Duration::ZERO, 1_000_000).is_ok());
        assert!(b.try_take(Duration::ZERO, 1_000).is_err());
        // Back ten seconds late: what a full bucket holds goes at once, then 50 ms of
        // credit on top of the rate, and no more.
        let mut now = Duration::from_secs(10);
        let mut sent = 0u64;
        while b.try_take(now, 1_000).is_ok() {
            sent += 1_000;
        }
        assert!(sent as f64 <= 1e6 * BURST.as_secs_f64() + 1_000.0, "{sent}");
        let end = now + Duration::from_secs(1);
        while now < end {
            match b.try_take(now, 1_000) {
                Ok(()) => sent += 1_000,
                Err(wait) => now += wait,
            }
        }
        let bound = 1e6 * (1.0 + (BURST + MAX_LATENESS_CREDIT).as_secs_f64()) + 2_000.0;
        assert!(sent as f64 <= bound, "{sent} > {bound}");
        assert!(sent as f64 >= 1e6 * 1.04, "{sent}");
    }

    #[test]
    fn an_extreme_debt_waits_in_bounded_steps_instead_of_panicking() {
        // 4 GiB at 1e-12 B/s is 4e21 s of debt, past what a Duration holds.
        let rate = Rate {
            bytes_per_sec: 1e-12,
            ops_per_sec: Some(1e-12),
        };
        let mut b = TokenBucket::new(rate, Duration::ZERO);
        assert!(b.try_take(Duration::ZERO, u32::MAX).is_ok());
        let wait = b.try_take(Duration::ZERO, 1).unwrap_err();
        assert_eq!(wait, MAX_WAIT + Duration::from_nanos(1));
        // Coming back when told is refused again, with another bounded wait.
        let again = b.try_take(wait, 1).unwrap_err();
        assert_eq!(again, MAX_WAIT + Duration::from_nanos(1));
    }

    #[test]
    fn a_request_larger_than_the_burst_goes_and_leaves_a_debt() {
        let rate = Rate {
            bytes_per_sec: 1e6,
            ops_per_sec: None,
        };
        let mut b = TokenBucket::new(rate, Duration::ZERO);
        assert!(b.try_take(Duration::ZERO, 1_000_000).is_ok());
        let wait = b.try_take(Duration::ZERO, 1).unwrap_err();
        // 1 MB at 1 MB/s, less the burst that was in the bucket.
        let expected = 1.0 - BURST.as_secs_f64();
        assert!((wait.as_secs_f64() - expected).abs() < 1e-6, "{wait:?}");
        assert!(b.try_take(wait, 1).is_ok());
    }
}
