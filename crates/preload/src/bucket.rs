//! The per-process token bucket: bytes per second and, optionally, operations per second.
//!
//! Tokens accrue continuously up to a small burst (one millisecond's worth, and at least
//! one operation). A work request may go when neither balance is negative, and then takes
//! its bytes and one operation, which may drive a balance below zero: the next request waits
//! until the debt is repaid. This lets a chunk larger than the burst through without a
//! special case, and over any long interval the bytes sent are the rate times the interval
//! plus at most one burst, one request and the lateness credit below.
//!
//! A refused request is told when to come back, and the pacer thread brings it back then,
//! give or take its wake-up latency. That latency is the scheduler's, not the policy's: on
//! a busy or emulated host it is several milliseconds, longer than the burst, and the
//! tokens of those milliseconds would be lost to the cap (at 5 MB/s with 64 KiB chunks the
//! rate fell to 70 %). So the tokens that accrue after the promised time, up to
//! [`MAX_LATENESS_CREDIT`], are credited above the cap.

use std::time::Duration;

use crate::config::Rate;

/// How much a full bucket holds, as time at the configured rate.
const BURST: Duration = Duration::from_millis(1);

/// The most lateness of a refused request's return that is credited above the cap: a wake-up
/// later than this is a stall, not latency, and must not turn into a burst.
pub const MAX_LATENESS_CREDIT: Duration = Duration::from_millis(50);

/// Token balances for bytes and operations.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    rate: Rate,
    bytes: f64,
    ops: f64,
    byte_cap: f64,
    op_cap: f64,
    last: Duration,
    /// When the last refused request was told the balances would allow it.
    promised: Option<Duration>,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(rate: Rate, now: Duration) -> Self {
        let byte_cap = (rate.bytes_per_sec * BURST.as_secs_f64()).max(1.0);
        let op_cap = rate
            .ops_per_sec
            .map_or(f64::INFINITY, |r| (r * BURST.as_secs_f64()).max(1.0));
        TokenBucket {
            rate,
            bytes: byte_cap,
            ops: op_cap,
            byte_cap,
            op_cap,
            last: now,
            promised: None,
        }
    }

    /// The configured rate.
    pub fn rate(&self) -> Rate {
        self.rate
    }

    fn refill(&mut self, now: Duration) {
        if now <= self.last {
            return;
        }
        let late = match self.promised {
            Some(at) if now >= at => {
                self.promised = None;
                now.saturating_sub(at)
                    .min(MAX_LATENESS_CREDIT)
                    .as_secs_f64()
            }
            _ => 0.0,
        };
        let dt = (now - self.last).as_secs_f64();
        self.last = now;
        let r = self.rate.bytes_per_sec;
        self.bytes = (self.bytes + dt * r).min(self.byte_cap + late * r);
        if let Some(r) = self.rate.ops_per_sec {
            self.ops = (self.ops + dt * r).min(self.op_cap + late * r);
        }
    }

    /// Takes `bytes` and one operation if the balances allow it at `now`; otherwise returns
    /// how long until they will.
    pub fn try_take(&mut self, now: Duration, bytes: u32) -> Result<(), Duration> {
        self.refill(now);
        if self.bytes >= 0.0 && self.ops >= 0.0 {
            self.bytes -= f64::from(bytes);
            self.ops -= 1.0;
            return Ok(());
        }
        let byte_wait = (-self.bytes).max(0.0) / self.rate.bytes_per_sec;
        let op_wait = match self.rate.ops_per_sec {
            Some(r) => (-self.ops).max(0.0) / r,
            None => 0.0,
        };
        // Round up to a whole nanosecond so that waking at now + wait always succeeds.
        let wait = Duration::from_secs_f64(byte_wait.max(op_wait)) + Duration::from_nanos(1);
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
    fn a_stall_is_not_credited_beyond_the_bound() {
        let rate = Rate {
            bytes_per_sec: 1e6,
            ops_per_sec: None,
        };
        let mut b = TokenBucket::new(rate, Duration::ZERO);
        assert!(b.try_take(Duration::ZERO, 1_000_000).is_ok());
        assert!(b.try_take(Duration::ZERO, 1_000).is_err());
        // Back ten seconds late: at most the burst, 50 ms of credit and one request go.
        let now = Duration::from_secs(10);
        let mut sent = 0u64;
        while b.try_take(now, 1_000).is_ok() {
            sent += 1_000;
        }
        let bound = 1e6 * (0.001 + MAX_LATENESS_CREDIT.as_secs_f64()) + 1_000.0;
        assert!(sent as f64 <= bound, "{sent} > {bound}");
        assert!(sent >= 50_000, "{sent}");
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
        // 1 MB at 1 MB/s, less the 1 ms burst that was in the bucket.
        assert!((wait.as_secs_f64() - 0.999).abs() < 1e-6, "{wait:?}");
        assert!(b.try_take(wait, 1).is_ok());
    }
}
