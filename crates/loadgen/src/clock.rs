//! The clock that times latency samples: the time-stamp counter (TSC) at a rate
//! calibrated against `CLOCK_MONOTONIC` at start, as RPerf times its samples, or the
//! monotonic clock itself.
//!
//! The TSC is read in a few nanoseconds without a system call, but it is a clock only when
//! it is invariant: it ticks at one rate whatever the core's frequency (`constant_tsc`) and
//! through sleep states (`nonstop_tsc`). Where `/proc/cpuinfo` lacks either flag (an old
//! CPU, or a guest under QEMU's TCG emulation, whose virtual CPU does not claim them) the
//! TSC is refused with that reason; [`ClockChoice::Auto`] then falls back to the monotonic
//! clock and says so once.
//!
//! Invariant: a [`Timer`] turns its own ticks into nanoseconds; ticks of two timers are
//! never mixed.

use std::time::Instant;

/// Which clock to time samples with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ClockChoice {
    /// The TSC where it is invariant, else the monotonic clock (said once on stderr).
    Auto,
    /// The TSC; refused where it is not invariant.
    Tsc,
    /// `CLOCK_MONOTONIC` (a vDSO call per reading).
    Monotonic,
}

/// Nanoseconds from some fixed start.
pub trait Clock {
    /// Now, ns.
    fn now_ns(&self) -> u64;
}

/// A free-running counter.
pub trait Counter {
    /// Its value now.
    fn cycles(&self) -> u64;
}

/// The process's monotonic clock, from its first reading.
pub struct Monotonic {
    base: Instant,
}

impl Monotonic {
    /// A clock whose zero is now.
    pub fn new() -> Self {
        Monotonic {
            base: Instant::now(),
        }
    }
}

impl Default for Monotonic {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for Monotonic {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// The x86-64 time-stamp counter.
#[cfg(target_arch = "x86_64")]
pub struct Tsc;

#[cfg(target_arch = "x86_64")]
impl Counter for Tsc {
    #[inline]
    fn cycles(&self) -> u64 {
        // SAFETY: RDTSC has no preconditions on x86-64 (newer compilers call it safe).
        #[allow(unused_unsafe)]
        unsafe {
            core::arch::x86_64::_rdtsc()
        }
    }
}

/// A counter's rate against a clock, and one reading of both taken together.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Calibration {
    /// Counter ticks per nanosecond.
    pub cycles_per_ns: f64,
    /// Bound on the rate's relative error, from how long the two bracketing readings took.
    pub relative_error: f64,
}

/// Why a counter cannot be calibrated.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CalibrationError {
    /// The counter did not advance, or went backwards, while the clock advanced.
    #[error("the counter moved by {cycles} ticks while the clock moved {ns} ns")]
    NotCounting {
        /// Counter ticks.
        cycles: i128,
        /// Clock time.
        ns: u64,
    },
}

/// One clock reading bracketed by two counter readings: the counter at the clock's reading
/// is their midpoint, to within half their distance.
fn bracket(counter: &impl Counter, clock: &impl Clock) -> (u64, f64, f64) {
    let before = counter.cycles();
    let ns = clock.now_ns();
    let after = counter.cycles();
    let spread = after.wrapping_sub(before) as f64;
    (ns, before as f64 + spread / 2.0, spread / 2.0)
}

/// Measures the counter's rate against the clock over at least `window_ns` of clock time.
pub fn calibrate(
    counter: &impl Counter,
    clock: &impl Clock,
    window_ns: u64,
) -> Result<Calibration, CalibrationError> {
    let (ns0, c0, e0) = bracket(counter, clock);
    let mut last = bracket(counter, clock);
    while last.0.saturating_sub(ns0) < window_ns.max(1) {
        last = bracket(counter, clock);
    }
    let (ns1, c1, e1) = last;
    let ns = ns1 - ns0;
    let cycles = c1 - c0;
    if cycles <= 0.0 {
        return Err(CalibrationError::NotCounting {
            cycles: cycles as i128,
            ns,
        });
    }
    Ok(Calibration {
        cycles_per_ns: cycles / ns as f64,
        relative_error: (e0 + e1) / cycles,
    })
}

/// Whether `/proc/cpuinfo`'s text claims an invariant TSC on every CPU; `Err` says which
/// flag is missing.
pub fn invariant_tsc(cpuinfo: &str) -> Result<(), String> {
    let flag_lines: Vec<&str> = cpuinfo.lines().filter(|l| l.starts_with("flags")).collect();
    if flag_lines.is_empty() {
        return Err("/proc/cpuinfo lists no CPU flags (not an x86 CPU?)".into());
    }
    for flag in ["constant_tsc", "nonstop_tsc"] {
        let everywhere = flag_lines
            .iter()
            .all(|l| l.split_whitespace().any(|w| w == flag));
        if !everywhere {
            return Err(format!(
                "the TSC is not invariant: /proc/cpuinfo lacks the flag {flag} \
                 (as under QEMU's TCG emulation)"
            ));
        }
    }
    Ok(())
}

/// Reads of one clock and their conversion to nanoseconds.
#[derive(Clone, Copy, Debug)]
pub enum Timer {
    /// The TSC at a calibrated rate.
    Tsc(Calibration),
    /// The monotonic clock, read through [`std::time::Instant`], in ns from `base`.
    Monotonic(Instant),
}

impl Timer {
    /// The timer `choice` asks for on this machine; a note to print once when `Auto` fell
    /// back, or an error with the reason when the TSC was asked for and is not invariant.
    pub fn choose(choice: ClockChoice) -> Result<(Timer, Option<String>), String> {
        let tsc = || -> Result<Timer, String> {
            #[cfg(target_arch = "x86_64")]
            {
                let cpuinfo = std::fs::read_to_string("/proc/cpuinfo")
                    .map_err(|e| format!("reading /proc/cpuinfo: {e}"))?;
                invariant_tsc(&cpuinfo)?;
                // 20 ms against CLOCK_MONOTONIC: the bracketing readings take tens of ns,
                // so the rate is good to a few parts per million.
                calibrate(&Tsc, &Monotonic::new(), 20_000_000)
                    .map(Timer::Tsc)
                    .map_err(|e| format!("calibrating the TSC: {e}"))
            }
            #[cfg(not(target_arch = "x86_64"))]
            Err("no TSC on this architecture".to_string())
        };
        match choice {
            ClockChoice::Monotonic => Ok((Timer::Monotonic(Instant::now()), None)),
            ClockChoice::Tsc => tsc().map(|t| (t, None)),
            ClockChoice::Auto => match tsc() {
                Ok(t) => Ok((t, None)),
                Err(why) => Ok((
                    Timer::Monotonic(Instant::now()),
                    Some(format!("{why}; timing with CLOCK_MONOTONIC instead")),
                )),
            },
        }
    }

    /// Now, in this timer's ticks.
    #[inline]
    pub fn now(&self) -> u64 {
        match self {
            #[cfg(target_arch = "x86_64")]
            Timer::Tsc(_) => Tsc.cycles(),
            #[cfg(not(target_arch = "x86_64"))]
            Timer::Tsc(_) => 0,
            Timer::Monotonic(base) => u64::try_from(base.elapsed().as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// `ticks` of this timer in nanoseconds.
    #[inline]
    pub fn ns(&self, ticks: u64) -> f64 {
        match self {
            Timer::Tsc(c) => ticks as f64 / c.cycles_per_ns,
            Timer::Monotonic(_) => ticks as f64,
        }
    }

    /// Its name in reports.
    pub fn describe(&self) -> String {
        match self {
            Timer::Tsc(c) => format!("tsc at {:.4} GHz", c.cycles_per_ns),
            Timer::Monotonic(_) => "monotonic".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Time that moves only when read: every clock reading takes `clock_cost` ns and every
    /// counter reading `counter_cost` ns; the counter ticks `rate` per ns from `offset`.
    struct FakeTime {
        now: Cell<u64>,
        clock_cost: u64,
        counter_cost: u64,
        rate: u64,
        offset: u64,
    }

    struct FakeClock<'a>(&'a FakeTime);
    struct FakeCounter<'a>(&'a FakeTime);

    impl Clock for FakeClock<'_> {
        fn now_ns(&self) -> u64 {
            let t = self.0.now.get() + self.0.clock_cost;
            self.0.now.set(t);
            t
        }
    }

    impl Counter for FakeCounter<'_> {
        fn cycles(&self) -> u64 {
            let t = self.0.now.get() + self.0.counter_cost;
            self.0.now.set(t);
            self.0.offset + self.0.rate * t
        }
    }

    fn fake(rate: u64, offset: u64) -> FakeTime {
        FakeTime {
            now: Cell::new(1_000),
            clock_cost: 25,
            counter_cost: 10,
            rate,
            offset,
        }
    }

    #[test]
    fn calibration_recovers_the_counters_rate() {
        // A 3 GHz counter that started long before the clock: the rate, not the ratio of
        // the raw readings (which the offset would spoil), is 3 ticks per ns.
        let time = fake(3, 7_000_000_000);
        let c = calibrate(&FakeCounter(&time), &FakeClock(&time), 1_000_000);
        let c = c.unwrap_or_else(|e| panic!("{e}"));
        assert!((c.cycles_per_ns - 3.0).abs() < 1e-4, "{c:?}");
        // Each bracket spans one clock read and one counter read: 35 ns, i.e. 105 ticks;
        // half of it at each end over a window of 3e6 ticks.
        assert!(c.relative_error > 0.0 && c.relative_error < 1e-4, "{c:?}");
        // The window was honoured: at least 1 ms of fake time went by.
        assert!(time.now.get() >= 1_000_000);
    }

    #[test]
    fn a_stopped_counter_is_refused() {
        let time = fake(0, 42);
        let e = calibrate(&FakeCounter(&time), &FakeClock(&time), 10_000);
        assert!(
            matches!(e, Err(CalibrationError::NotCounting { .. })),
            "{e:?}"
        );
    }

    #[test]
    fn invariance_needs_both_flags_on_every_cpu() {
        let good = "processor\t: 0\nflags\t\t: fpu tsc constant_tsc nonstop_tsc rdtscp\n";
        assert_eq!(invariant_tsc(good), Ok(()));
        let tcg = "processor\t: 0\nflags\t\t: fpu de pse tsc msr pae\n";
        assert!(invariant_tsc(tcg).is_err_and(|e| e.contains("constant_tsc")));
        let one_lacks = format!("{good}processor\t: 1\nflags\t\t: fpu tsc constant_tsc\n");
        assert!(invariant_tsc(&one_lacks).is_err_and(|e| e.contains("nonstop_tsc")));
        assert!(invariant_tsc("").is_err());
    }

    #[test]
    fn timers_convert_their_own_ticks() {
        let tsc = Timer::Tsc(Calibration {
            cycles_per_ns: 2.5,
            relative_error: 0.0,
        });
        assert_eq!(tsc.ns(2_500), 1_000.0);
        assert_eq!(Timer::Monotonic(Instant::now()).ns(2_500), 2_500.0);
    }
}
