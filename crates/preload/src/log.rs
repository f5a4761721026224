//! One-line messages on stderr, filtered by `JUSTITIA_LOG`.
//!
//! A preloaded library shares stderr with the application, so it says little by default
//! (warnings only), prefixes every line with `justitia:`, and never fails or panics when
//! stderr is closed.

use std::io::Write;
use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};

/// How much the shaper says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// Nothing.
    Off = 0,
    /// Problems: bad settings, failures the shaper worked around.
    Warn = 1,
    /// What the shaper does: its settings, each QP's class.
    Info = 2,
    /// Per-object detail.
    Debug = 3,
}

impl FromStr for LogLevel {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "none" => Ok(LogLevel::Off),
            "warn" | "warning" => Ok(LogLevel::Warn),
            "info" => Ok(LogLevel::Info),
            "debug" => Ok(LogLevel::Debug),
            _ => Err(()),
        }
    }
}

static LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Warn as u8);

/// Sets the process-wide level.
pub fn set_level(level: LogLevel) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

/// True when messages at `level` are shown.
pub fn enabled(level: LogLevel) -> bool {
    level != LogLevel::Off && level as u8 <= LEVEL.load(Ordering::Relaxed)
}

/// Writes one line if `level` is enabled; write errors are ignored.
pub fn write(level: LogLevel, args: std::fmt::Arguments<'_>) {
    if enabled(level) {
        let _ = writeln!(std::io::stderr().lock(), "justitia: {args}");
    }
}

/// Logs at a level: `log!(Warn, "...", args)`.
macro_rules! log {
    ($level:ident, $($arg:tt)*) => {
        $crate::log::write($crate::log::LogLevel::$level, format_args!($($arg)*))
    };
}
pub(crate) use log;
