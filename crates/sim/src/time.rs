//! Simulated time.
//!
//! Time is an integer count of picoseconds since the start of a run. Integers keep runs
//! exactly reproducible (no floating-point drift in event ordering) and a `u64` of
//! picoseconds spans about 213 days, far beyond any scenario. Rates are turned into integer
//! costs once, when a model is built, with [`ByteTime`].

/// A point in simulated time, or a span of it, in picoseconds.
pub type Picos = u64;

/// One nanosecond.
pub const NANOSECOND: Picos = 1_000;
/// One microsecond.
pub const MICROSECOND: Picos = 1_000_000;
/// One millisecond.
pub const MILLISECOND: Picos = 1_000_000_000;
/// One second.
pub const SECOND: Picos = 1_000_000_000_000;

/// Picoseconds from a (non-negative, finite) number of nanoseconds, rounded to the nearest.
pub fn from_ns(ns: f64) -> Picos {
    (ns.max(0.0) * 1e3).round() as Picos
}

/// Picoseconds from microseconds, rounded to the nearest.
pub fn from_us(us: f64) -> Picos {
    (us.max(0.0) * 1e6).round() as Picos
}

/// Picoseconds from milliseconds, rounded to the nearest.
pub fn from_ms(ms: f64) -> Picos {
    (ms.max(0.0) * 1e9).round() as Picos
}

/// Picoseconds as microseconds.
pub fn to_us(t: Picos) -> f64 {
    t as f64 / 1e6
}

/// Picoseconds as seconds.
pub fn to_secs(t: Picos) -> f64 {
    t as f64 / 1e12
}

/// The time one byte takes at some rate, kept in femtoseconds so that a 100 Gb/s rate
/// (80 ps per byte) and a 54.5 Gb/s rate (146.8 ps per byte) both stay exact enough: the
/// rounding error is below one part in 10^5.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteTime {
    femtos_per_byte: u64,
}

impl ByteTime {
    /// The byte time of a rate in Gb/s (10^9 bits per second). Zero or negative rates mean
    /// "instantaneous": such a stage never limits throughput.
    pub fn from_gbps(gbps: f64) -> Self {
        let femtos_per_byte = if gbps > 0.0 && gbps.is_finite() {
            (8.0e6 / gbps).round() as u64
        } else {
            0
        };
        ByteTime { femtos_per_byte }
    }

    /// The time `bytes` take at this rate, rounded up to a whole picosecond.
    pub fn of(self, bytes: u64) -> Picos {
        (bytes * self.femtos_per_byte).div_ceil(1_000)
    }
}

/// The interval between operations at a rate in millions per second (0 = unlimited).
pub fn interval_of_mops(mops: f64) -> Picos {
    if mops > 0.0 && mops.is_finite() {
        (1e6 / mops).round() as Picos
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_trip() {
        assert_eq!(from_us(1.3), 1_300_000);
        assert_eq!(from_ns(0.5), 500);
        assert_eq!(from_ms(2.0), 2 * MILLISECOND);
        assert!((to_us(from_us(2.25)) - 2.25).abs() < 1e-12);
        assert_eq!(to_secs(SECOND), 1.0);
    }

    #[test]
    fn byte_time_matches_line_rates() {
        // 100 Gb/s: 80 ps per byte; a 4096-byte packet takes 327.68 ns.
        let t = ByteTime::from_gbps(100.0);
        assert_eq!(t.of(1), 80);
        assert_eq!(t.of(4096), 327_680);
        // 40 Gb/s: 200 ps per byte.
        assert_eq!(ByteTime::from_gbps(40.0).of(1000), 200_000);
        // Unlimited stages cost nothing.
        assert_eq!(ByteTime::from_gbps(0.0).of(1 << 20), 0);
    }

    #[test]
    fn message_rate_interval() {
        assert_eq!(interval_of_mops(10.0), 100_000);
        assert_eq!(interval_of_mops(0.0), 0);
    }
}
