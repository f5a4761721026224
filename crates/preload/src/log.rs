//! One-line messages on stderr, filtered by `JUSTITIA_LOG`.
//!
//! A preloaded library shares stderr with the application, so it says little by default
//! (warnings only), prefixes every line with `justitia:`, and never fails or panics when
//! stderr is closed.
//!
//! Every line leaves in one `write`: the processes of a container (and the threads of one
//! process) share one stderr, and a line written in pieces interleaves with theirs
//! mid-line. A pipe keeps a write of up to `PIPE_BUF` (4096) bytes whole.

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
        write_line(&mut std::io::stderr().lock(), args);
    }
}

/// Formats the whole line first and hands it to `out` in one `write_all`, which on stderr
/// is one `write` unless the kernel takes part of it (see the module's documentation).
pub fn write_line(out: &mut impl Write, args: std::fmt::Arguments<'_>) {
    let line = format!("justitia: {args}\n");
    let _ = out.write_all(line.as_bytes());
}

/// Logs at a level: `log!(Warn, "...", args)`.
macro_rules! log {
    ($level:ident, $($arg:tt)*) => {
        $crate::log::write($crate::log::LogLevel::$level, format_args!($($arg)*))
    };
}
pub(crate) use log;

#[cfg(test)]
mod tests {
    use super::*;

    /// Records each `write` call it gets.
    #[derive(Default)]
    struct Calls(Vec<Vec<u8>>);

    impl Write for Calls {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_with_arguments_is_one_write() {
        let mut calls = Calls::default();
        let (qp, class) = (17, "bandwidth");
        write_line(&mut calls, format_args!("QP {qp} is of class {class}"));
        assert_eq!(
            calls.0,
            [b"justitia: QP 17 is of class bandwidth\n".to_vec()]
        );
    }
}
