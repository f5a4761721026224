//! The clock that times latency samples: the time-stamp counter (TSC) at a rate fitted
//! against `CLOCK_MONOTONIC`, as RPerf times its samples, or the monotonic clock itself.
//!
//! The TSC is read in a few nanoseconds without a system call, but it is a clock only when
//! it is invariant: it ticks at one rate whatever the core's frequency (`constant_tsc`) and
//! through sleep states (`nonstop_tsc`). Where `/proc/cpuinfo` lacks either flag (an old
//! CPU, or a guest under QEMU's TCG emulation, whose virtual CPU does not claim them) the
//! TSC is refused with that reason; [`ClockChoice::Auto`] then falls back to the monotonic
//! clock and says so once.
//!
//! The kernel's clocksource must be `tsc` too ([`tsc_clocksource`]): the kernel's watchdog
//! switches away from the TSC when it finds it drifting against another clock, and the
//! TSC's rate is fitted against `CLOCK_MONOTONIC`, which then runs off that other clock.
//! A guest whose clocksource is `kvm-clock` is refused the TSC too: its kernel does not
//! vouch for the TSC; where the TSC is known to be stable there, writing `tsc` to the
//! clocksource's `current_clocksource` file makes it usable.
//!
//! **Calibration** ([`calibrate`]): [`CALIBRATION_PAIRS`] readings of the counter and the
//! clock taken together, spread evenly over [`CALIBRATION_WINDOW_NS`], and the
//! least-squares line through them: its slope is the rate. Two readings alone let one
//! preempted reading spoil the rate (one process saw 1.548 GHz for a 2.1 GHz TSC, three
//! calibrating at once 1.187 GHz); the fit says how well it knows the rate
//! ([`Calibration::relative_error`]). A fit worse than [`MAX_RELATIVE_ERROR`] is refused
//! and the calibration tried again, [`CALIBRATION_ATTEMPTS`] times in all; then the TSC is
//! refused with the last fit's figures.
//!
//! **One calibration per run**: every process calibrating for itself costs each one the
//! window and, when many start at once on few cores, preemptions inside their readings.
//! [`calibrate_tsc`] (or `justitia-loadgen calibrate`, which prints `tsc-hz HZ`) fits the
//! rate once; `justitia-loadgen request --tsc-hz HZ` then uses it without calibrating. The
//! invariance and clocksource checks still run in every process (they read two files).
//!
//! Invariant: a [`Timer`] turns its own ticks into nanoseconds; ticks of two timers are
//! never mixed.

use std::str::FromStr;
use std::time::Instant;

/// Which clock to time samples with (`--clock`; also what `justitia run` asks of a
/// run-server for its host, in the same words).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum ClockChoice {
    /// The TSC where it is invariant, else the monotonic clock (said once on stderr).
    Auto,
    /// The TSC; refused where it is not invariant.
    Tsc,
    /// `CLOCK_MONOTONIC` (a vDSO call per reading).
    Monotonic,
}

/// Readings of the counter and the clock a calibration fits a line through.
pub const CALIBRATION_PAIRS: usize = 200;

/// The clock time a calibration's readings are spread over, ns: 20 ms, one pair every
/// 100 us.
pub const CALIBRATION_WINDOW_NS: u64 = 20_000_000;

/// Calibrations tried before the TSC is refused.
pub const CALIBRATION_ATTEMPTS: u32 = 3;

/// The largest relative error of a fitted rate that is accepted: 1e-4, i.e. 10 ns off a
/// 100 us sample. Fits on a 2-core VM, six at once, were bounded by 3.5e-6 to 1.1e-5; a
/// reading preempted for a millisecond near either end of the window, a rate that changed
/// or a clock that jumped during it push the bound past 1e-3.
pub const MAX_RELATIVE_ERROR: f64 = 1e-4;

/// Where Linux says which clocksource `CLOCK_MONOTONIC` runs off.
pub const CLOCKSOURCE_PATH: &str =
    "/sys/devices/system/clocksource/clocksource0/current_clocksource";

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

/// A counter's rate fitted against a clock.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Calibration {
    /// Counter ticks per nanosecond: the slope of the least-squares line.
    pub cycles_per_ns: f64,
    /// Bound on the rate's relative error: the worst case the readings' brackets allow
    /// (each counter value is known to within half its bracket) plus three standard errors
    /// of the slope from the residuals (which a changing rate or a jumping clock inflates).
    pub relative_error: f64,
    /// How well a line explains the readings (1 is perfectly).
    pub r_squared: f64,
    /// Readings fitted.
    pub pairs: usize,
}

impl Calibration {
    /// The rate in Hz, as `--tsc-hz` takes it.
    pub fn hz(&self) -> f64 {
        self.cycles_per_ns * 1e9
    }
}

/// Why a counter cannot be calibrated.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CalibrationError {
    /// The counter did not advance, or went backwards, while the clock advanced.
    #[error("the counter moved by {cycles} ticks while the clock moved {ns} ns")]
    NotCounting {
        /// Counter ticks from the first reading to the last.
        cycles: i128,
        /// Clock time from the first reading to the last.
        ns: u64,
    },
    /// Too few readings to fit a line and judge it.
    #[error("{pairs} readings are too few to fit a rate (at least 3)")]
    TooFewPairs {
        /// Readings given.
        pairs: usize,
    },
    /// The readings do not pin the rate down well enough.
    #[error(
        "the fit over {pairs} readings knows the rate ({cycles_per_ns:.6} ticks/ns) only to \
         {relative_error:.2e} (r^2 {r_squared:.9}), above the {MAX_RELATIVE_ERROR:.0e} \
         allowed: readings preempted, or the counter's rate or the clock changed during \
         the window"
    )]
    PoorFit {
        /// The slope fitted.
        cycles_per_ns: f64,
        /// Its relative error bound, as [`Calibration::relative_error`].
        relative_error: f64,
        /// The fit's r^2.
        r_squared: f64,
        /// Readings fitted.
        pairs: usize,
    },
    /// Every attempt failed.
    #[error("{attempts} calibrations in a row failed; the last: {last}")]
    GaveUp {
        /// Attempts made.
        attempts: u32,
        /// Why the last one failed.
        last: Box<CalibrationError>,
    },
}

/// One clock reading bracketed by two counter readings.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Pair {
    /// The clock, ns.
    ns: u64,
    /// The counter at the clock's reading: the brackets' midpoint.
    cycles: u64,
    /// Half the brackets' distance: the counter at the clock's reading is within this
    /// many ticks of `cycles`.
    half_width: u64,
}

fn bracket(counter: &impl Counter, clock: &impl Clock) -> Pair {
    let before = counter.cycles();
    let ns = clock.now_ns();
    let after = counter.cycles();
    let half_width = after.wrapping_sub(before) / 2;
    Pair {
        ns,
        cycles: before.wrapping_add(half_width),
        half_width,
    }
}

/// `count` pairs, the first now and the rest at even steps of clock time over `window_ns`.
/// Between pairs only the clock is read, so a preemption mostly falls between pairs
/// (where it does no harm: the line runs through both sides of it) rather than inside a
/// bracket.
fn sample_pairs(
    counter: &impl Counter,
    clock: &impl Clock,
    count: usize,
    window_ns: u64,
) -> Vec<Pair> {
    let first = bracket(counter, clock);
    let step = window_ns / u64::try_from(count.saturating_sub(1).max(1)).unwrap_or(u64::MAX);
    let mut pairs = Vec::with_capacity(count);
    pairs.push(first);
    for i in 1..count as u64 {
        let target = first.ns.saturating_add(step.saturating_mul(i));
        while clock.now_ns() < target {
            std::hint::spin_loop();
        }
        pairs.push(bracket(counter, clock));
    }
    pairs
}

/// The least-squares line through `pairs` (counter on clock), judged.
///
/// With `y = a + b x + e` and each `|e_i|` at most its half-width `h_i`, the fitted slope
/// is off by `sum((x_i - mean x) e_i) / Sxx`, so at most `sum(|x_i - mean x| h_i) / Sxx`:
/// the brackets' part of [`Calibration::relative_error`].
fn fit(pairs: &[Pair]) -> Result<Calibration, CalibrationError> {
    let n = pairs.len();
    let (Some(first), Some(last)) = (pairs.first(), pairs.last()) else {
        return Err(CalibrationError::TooFewPairs { pairs: n });
    };
    if n < 3 {
        return Err(CalibrationError::TooFewPairs { pairs: n });
    }
    // From the first pair, so that the sums stay far from f64's precision limits (the raw
    // counter is near 1e15 after days of uptime).
    let xs: Vec<f64> = pairs
        .iter()
        .map(|p| p.ns.wrapping_sub(first.ns) as i64 as f64)
        .collect();
    let ys: Vec<f64> = pairs
        .iter()
        .map(|p| p.cycles.wrapping_sub(first.cycles) as i64 as f64)
        .collect();
    let nf = n as f64;
    let mx = xs.iter().sum::<f64>() / nf;
    let my = ys.iter().sum::<f64>() / nf;
    let (mut sxx, mut sxy, mut syy) = (0.0, 0.0, 0.0);
    for (x, y) in xs.iter().zip(&ys) {
        sxx += (x - mx) * (x - mx);
        sxy += (x - mx) * (y - my);
        syy += (y - my) * (y - my);
    }
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    if slope <= 0.0 || !slope.is_finite() {
        return Err(CalibrationError::NotCounting {
            cycles: i128::from(last.cycles.wrapping_sub(first.cycles) as i64),
            ns: last.ns.saturating_sub(first.ns),
        });
    }
    // Residuals summed directly, not as Syy - b Sxy, which cancels to noise.
    let ss_res: f64 = xs
        .iter()
        .zip(&ys)
        .map(|(x, y)| {
            let r = y - my - slope * (x - mx);
            r * r
        })
        .sum();
    let r_squared = if syy > 0.0 { 1.0 - ss_res / syy } else { 0.0 };
    let brackets: f64 = xs
        .iter()
        .zip(pairs)
        .map(|(x, p)| (x - mx).abs() * p.half_width as f64)
        .sum::<f64>()
        / sxx;
    let standard_error = (ss_res / (nf - 2.0) / sxx).sqrt();
    let relative_error = (brackets + 3.0 * standard_error) / slope;
    if relative_error.is_nan() || relative_error > MAX_RELATIVE_ERROR {
        return Err(CalibrationError::PoorFit {
            cycles_per_ns: slope,
            relative_error,
            r_squared,
            pairs: n,
        });
    }
    Ok(Calibration {
        cycles_per_ns: slope,
        relative_error,
        r_squared,
        pairs: n,
    })
}

/// Fits the counter's rate against the clock over at least `window_ns` of clock time
/// ([`CALIBRATION_PAIRS`] readings), once.
pub fn calibrate(
    counter: &impl Counter,
    clock: &impl Clock,
    window_ns: u64,
) -> Result<Calibration, CalibrationError> {
    fit(&sample_pairs(counter, clock, CALIBRATION_PAIRS, window_ns))
}

/// [`calibrate`], tried up to `attempts` times until a fit is accepted: a preempted
/// reading spoils one window, not the next.
pub fn calibrate_retrying(
    counter: &impl Counter,
    clock: &impl Clock,
    window_ns: u64,
    attempts: u32,
) -> Result<Calibration, CalibrationError> {
    let mut last = CalibrationError::TooFewPairs { pairs: 0 };
    for _ in 0..attempts {
        match calibrate(counter, clock, window_ns) {
            Ok(c) => return Ok(c),
            Err(e) => last = e,
        }
    }
    Err(CalibrationError::GaveUp {
        attempts,
        last: Box::new(last),
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

/// Whether the text of [`CLOCKSOURCE_PATH`] says the kernel keeps time with the TSC;
/// `Err` names the clocksource it uses instead and why that refuses the TSC.
pub fn tsc_clocksource(current: &str) -> Result<(), String> {
    match current.trim() {
        "tsc" => Ok(()),
        other => Err(format!(
            "the kernel's clocksource is `{other}`, not `tsc` ({CLOCKSOURCE_PATH}): either \
             its watchdog found the TSC unstable, or (in a guest) it prefers a paravirtual \
             clock; either way CLOCK_MONOTONIC does not run off the TSC, so the kernel does \
             not vouch for the TSC's rate"
        )),
    }
}

/// Whether this machine's TSC may time samples: invariant on every CPU and the kernel's
/// clocksource.
pub fn tsc_usable() -> Result<(), String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo")
        .map_err(|e| format!("reading /proc/cpuinfo: {e}"))?;
    invariant_tsc(&cpuinfo)?;
    let source = std::fs::read_to_string(CLOCKSOURCE_PATH)
        .map_err(|e| format!("reading {CLOCKSOURCE_PATH}: {e}"))?;
    tsc_clocksource(&source)
}

/// Checks that the TSC is usable ([`tsc_usable`]) and fits its rate against
/// `CLOCK_MONOTONIC` ([`calibrate_retrying`] with the defaults above): what a runner calls
/// once to hand the rate to every process of a run as `--tsc-hz`.
pub fn calibrate_tsc() -> Result<Calibration, String> {
    #[cfg(target_arch = "x86_64")]
    {
        tsc_usable()?;
        calibrate_retrying(
            &Tsc,
            &Monotonic::new(),
            CALIBRATION_WINDOW_NS,
            CALIBRATION_ATTEMPTS,
        )
        .map_err(|e| format!("calibrating the TSC: {e}"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    Err("no TSC on this architecture".to_string())
}

/// Slowest TSC rate `--tsc-hz` accepts: 100 MHz.
pub const MIN_TSC_HZ: f64 = 1e8;

/// Fastest TSC rate `--tsc-hz` accepts: 100 GHz.
pub const MAX_TSC_HZ: f64 = 1e11;

/// A TSC rate handed in on the command line (`--tsc-hz`), in Hz.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TscHz(f64);

/// Why a `--tsc-hz` value is refused.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error(
    "`{text}` is not a TSC rate in Hz from {MIN_TSC_HZ:.0e} to {MAX_TSC_HZ:.0e} (e.g. 2100000000)"
)]
pub struct TscHzError {
    /// The text given.
    pub text: String,
}

impl FromStr for TscHz {
    type Err = TscHzError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().parse::<f64>() {
            Ok(hz) if (MIN_TSC_HZ..=MAX_TSC_HZ).contains(&hz) => Ok(TscHz(hz)),
            _ => Err(TscHzError { text: text.into() }),
        }
    }
}

impl TscHz {
    /// Ticks per nanosecond.
    pub fn cycles_per_ns(self) -> f64 {
        self.0 / 1e9
    }
}

/// Where a TSC timer's rate comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TscRate {
    /// Fitted by this process.
    Fitted(Calibration),
    /// Handed in with `--tsc-hz` (fitted once for the whole run).
    Given(TscHz),
}

impl TscRate {
    /// Ticks per nanosecond.
    pub fn cycles_per_ns(&self) -> f64 {
        match self {
            TscRate::Fitted(c) => c.cycles_per_ns,
            TscRate::Given(hz) => hz.cycles_per_ns(),
        }
    }
}

/// Reads of one clock and their conversion to nanoseconds.
#[derive(Clone, Copy, Debug)]
pub enum Timer {
    /// The TSC at a fitted or given rate.
    Tsc(TscRate),
    /// The monotonic clock, read through [`std::time::Instant`], in ns from `base`.
    Monotonic(Instant),
}

impl Timer {
    /// The timer `choice` asks for on this machine, at the rate `given` when there is one
    /// (else fitted here); a note to print once when `Auto` fell back, or an error with
    /// the reason when the TSC was asked for and cannot be used. A given rate is unused
    /// when the monotonic clock times the samples.
    pub fn choose(
        choice: ClockChoice,
        given: Option<TscHz>,
    ) -> Result<(Timer, Option<String>), String> {
        let tsc = || -> Result<Timer, String> {
            match given {
                Some(hz) => {
                    tsc_usable()?;
                    Ok(Timer::Tsc(TscRate::Given(hz)))
                }
                None => calibrate_tsc().map(|c| Timer::Tsc(TscRate::Fitted(c))),
            }
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
            Timer::Tsc(rate) => ticks as f64 / rate.cycles_per_ns(),
            Timer::Monotonic(_) => ticks as f64,
        }
    }

    /// Its name in reports: the rate, and whether it was fitted here (with its relative
    /// error bound) or given.
    pub fn describe(&self) -> String {
        match self {
            Timer::Tsc(TscRate::Fitted(c)) => format!(
                "tsc at {:.4} GHz (fitted, +-{:.0e})",
                c.cycles_per_ns, c.relative_error
            ),
            Timer::Tsc(TscRate::Given(hz)) => {
                format!("tsc at {:.4} GHz (given)", hz.cycles_per_ns())
            }
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
        assert!((c.cycles_per_ns - 3.0).abs() < 1e-9, "{c:?}");
        assert_eq!(c.pairs, 200);
        // Each bracket spans a clock read (25 ns) and a counter read (10 ns): 35 ns, half
        // of it 17.5 ns. For n pairs evenly spaced d apart, sum|x - mean| = (n/2)^2 d and
        // Sxx = n (n^2 - 1) d^2 / 12: with n = 200 and d = 1 ms / 199, the brackets' bound
        // is 17.5 x 10 000 / (666 650 x 5025.1) = 5.22e-5; the counter is exactly linear,
        // so the residuals add nothing. The spacing is only even to within a clock read
        // (25 ns of 5025), hence the 2% either side.
        assert!(
            c.relative_error > 5.1e-5 && c.relative_error < 5.35e-5,
            "{c:?}"
        );
        assert!(c.r_squared > 1.0 - 1e-12, "{c:?}");
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

    /// 200 pairs 100 us apart from a counter at 2.1 ticks per ns that started 7e12 ticks
    /// before the clock, each counter value off by `noise(i)` ticks and claiming a
    /// half-width of `half_width` ticks.
    fn pairs(noise: impl Fn(u64) -> i64, half_width: u64) -> Vec<Pair> {
        (0..200u64)
            .map(|i| {
                let ns = 5_000 + i * 100_000;
                let cycles = 7_000_000_000_000 + 210_000 * i;
                Pair {
                    ns,
                    cycles: cycles.wrapping_add_signed(noise(i)),
                    half_width,
                }
            })
            .collect()
    }

    #[test]
    fn the_fit_finds_a_noisy_rate_within_the_brackets_bound() {
        // Noise spread over -50..=50 ticks, inside each bracket's half-width of 50. The
        // slope is off by sum((x_i - mean) e_i) / Sxx, so at most 50 sum|x_i - mean| / Sxx.
        // With d = 100 000 ns: sum|x_i - mean| = sum|i - 99.5| d = 10 000 d and
        // Sxx = sum (i - 99.5)^2 d^2 = 666 650 d^2, so the bound is
        // 50 x 10 000 / (666 650 x 100 000) = 7.5002e-6 ticks per ns.
        let noisy = pairs(|i| ((i * 37) % 101) as i64 - 50, 50);
        let c = fit(&noisy).unwrap_or_else(|e| panic!("{e}"));
        let off = (c.cycles_per_ns - 2.1).abs();
        assert!(off <= 7.51e-6, "off by {off}: {c:?}");
        // The bound the fit reports covers the error it made, and is accepted.
        assert!(off / 2.1 <= c.relative_error, "{off} vs {c:?}");
        assert!(c.relative_error <= MAX_RELATIVE_ERROR, "{c:?}");
        assert!((c.hz() - 2.1e9).abs() <= 7.51e3, "{c:?}");
    }

    #[test]
    fn a_reading_preempted_inside_its_bracket_is_refused() {
        // The last pair's counter readings straddle a 5 ms preemption: its half-width is
        // 2.5 ms x 2.1 = 5 250 000 ticks and its midpoint is that far from the truth. Its
        // share of the brackets' bound alone is |x - mean| h / Sxx / slope =
        // 99.5 d x 5.25e6 / (666 650 d^2) / 2.1 = 3.73e-3 with d = 100 000 ns.
        let mut p = pairs(|_| 0, 50);
        if let Some(last) = p.last_mut() {
            last.cycles += 5_250_000;
            last.half_width = 5_250_000;
        }
        match fit(&p) {
            Err(CalibrationError::PoorFit { relative_error, .. }) => {
                assert!(relative_error > 3.7e-3, "{relative_error}")
            }
            other => panic!("accepted or wrongly refused: {other:?}"),
        }
    }

    #[test]
    fn pairs_at_two_rates_are_refused_even_with_tight_brackets() {
        // The first 100 pairs at 2.1 ticks per ns, the next 100 at 1.5: the residuals
        // reach tens of thousands of ticks against brackets of 50.
        let p = pairs(
            |i| {
                if i < 100 {
                    0
                } else {
                    -60_000 * (i as i64 - 99)
                }
            },
            50,
        );
        let got = fit(&p);
        assert!(
            matches!(got, Err(CalibrationError::PoorFit { .. })),
            "{got:?}"
        );
    }

    #[test]
    fn too_few_pairs_are_refused() {
        let p = pairs(|_| 0, 50);
        assert_eq!(
            fit(&p[..2]),
            Err(CalibrationError::TooFewPairs { pairs: 2 })
        );
    }

    /// Time whose counter and clock are arbitrary functions of the true time, read at the
    /// same costs as [`FakeTime`].
    struct Warped {
        now: Cell<u64>,
        counter: fn(u64) -> u64,
        clock: fn(u64) -> u64,
    }

    impl Clock for &Warped {
        fn now_ns(&self) -> u64 {
            let t = self.now.get() + 25;
            self.now.set(t);
            (self.clock)(t)
        }
    }

    impl Counter for Warped {
        fn cycles(&self) -> u64 {
            let t = self.now.get() + 10;
            self.now.set(t);
            (self.counter)(t)
        }
    }

    fn warped(counter: fn(u64) -> u64, clock: fn(u64) -> u64) -> Warped {
        Warped {
            now: Cell::new(1_000),
            counter,
            clock,
        }
    }

    #[test]
    fn pairs_from_two_rates_are_refused() {
        // 3 ticks per ns for the first 0.5 ms, then 2: no single rate converts this
        // counter, and a two-point estimate would say 2.5 (17% off either rate).
        let time = warped(
            |t| {
                if t < 501_000 {
                    3 * t
                } else {
                    3 * 501_000 + 2 * (t - 501_000)
                }
            },
            |t| t,
        );
        let got = calibrate(&time, &&time, 1_000_000);
        assert!(got.is_err(), "two rates accepted: {got:?}");
    }

    #[test]
    fn a_gap_the_counter_saw_and_the_clock_did_not_is_refused() {
        // Halfway through, the counter jumps by 100 us worth of ticks (300 000) that the
        // clock never saw: a two-point estimate over the 1 ms window would say
        // 3 x 1.1 = 3.3 ticks per ns, 10% off.
        let time = warped(|t| if t < 501_000 { 3 * t } else { 3 * t + 300_000 }, |t| t);
        let got = calibrate(&time, &&time, 1_000_000);
        assert!(got.is_err(), "a gap accepted: {got:?}");
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
    fn a_later_window_rescues_a_spoiled_one() {
        // The gap at 0.5 ms spoils the first 1 ms window; the second starts after it and
        // sees one rate.
        let time = warped(|t| if t < 501_000 { 3 * t } else { 3 * t + 300_000 }, |t| t);
        let c = calibrate_retrying(&time, &&time, 1_000_000, 3);
        let c = c.unwrap_or_else(|e| panic!("{e}"));
        assert!((c.cycles_per_ns - 3.0).abs() < 1e-9, "{c:?}");
        assert!(time.now.get() >= 2_000_000, "only one window was used");
    }

    #[test]
    fn calibration_gives_up_after_its_attempts() {
        let time = fake(0, 42);
        let got = calibrate_retrying(&FakeCounter(&time), &FakeClock(&time), 10_000, 3);
        match got {
            Err(CalibrationError::GaveUp { attempts: 3, last }) => {
                assert!(matches!(*last, CalibrationError::NotCounting { .. }))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn only_the_tsc_clocksource_vouches_for_the_tsc() {
        assert_eq!(tsc_clocksource("tsc\n"), Ok(()));
        assert!(tsc_clocksource("kvm-clock\n").is_err_and(|e| e.contains("`kvm-clock`")));
        assert!(tsc_clocksource("hpet").is_err_and(|e| e.contains("`hpet`")));
        assert!(tsc_clocksource("").is_err());
    }

    #[test]
    fn tsc_hz_takes_plain_and_exponent_forms_in_range() {
        let ok = |t: &str| t.parse::<TscHz>().map(TscHz::cycles_per_ns);
        assert_eq!(ok("2100000000"), Ok(2.1));
        assert_eq!(ok("2.1e9"), Ok(2.1));
        assert_eq!(ok(" 3e9 "), Ok(3.0));
        for bad in ["", "abc", "0", "-2.1e9", "NaN", "inf", "5e7", "2e11"] {
            assert!(bad.parse::<TscHz>().is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn timers_convert_their_own_ticks() {
        let fitted = Timer::Tsc(TscRate::Fitted(Calibration {
            cycles_per_ns: 2.5,
            relative_error: 0.0,
            r_squared: 1.0,
            pairs: 200,
        }));
        assert_eq!(fitted.ns(2_500), 1_000.0);
        let given = Timer::Tsc(TscRate::Given(TscHz(2.0e9)));
        assert_eq!(given.ns(2_500), 1_250.0);
        assert_eq!(given.describe(), "tsc at 2.0000 GHz (given)");
        assert_eq!(Timer::Monotonic(Instant::now()).ns(2_500), 2_500.0);
    }
}
