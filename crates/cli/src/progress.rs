//! A progress bar for long scenarios.
//!
//! Short runs finish before a bar would be readable, so the bar stays hidden for the first
//! [`SHOW_AFTER`]; it is drawn on stderr and only when stderr is a terminal, so piped or
//! redirected output never carries it.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use justitia_sim::Progress;

/// How long a scenario runs before its bar appears.
pub const SHOW_AFTER: Duration = Duration::from_secs(1);

/// Steps of the bar: the fraction done in thousandths.
const STEPS: u64 = 1000;

/// The progress of one scenario, drawn once it has run longer than [`SHOW_AFTER`].
pub struct ScenarioProgress {
    bar: ProgressBar,
    started: Instant,
    /// Whether the bar may ever be drawn (stderr is a terminal).
    drawable: bool,
    shown: bool,
}

impl ScenarioProgress {
    /// A hidden bar for the scenario `name`.
    pub fn new(name: &str) -> Self {
        let bar = ProgressBar::with_draw_target(Some(STEPS), ProgressDrawTarget::hidden());
        // The template is a constant, so it cannot fail at run time; fall back to the
        // default style rather than abort a simulation over a cosmetic problem.
        if let Ok(style) = ProgressStyle::with_template(
            // `wide_msg` is cut to the terminal's width, so the bar never wraps.
            "{prefix} [{bar:24}] {percent:>3}% (about {eta} left) {wide_msg}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(name.to_string());
        ScenarioProgress {
            bar,
            started: Instant::now(),
            drawable: std::io::stderr().is_terminal(),
            shown: false,
        }
    }

    /// Moves the bar to where the simulator says it is.
    pub fn update(&mut self, progress: &Progress) {
        if !self.shown && self.drawable && self.started.elapsed() >= SHOW_AFTER {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.shown = true;
        }
        self.bar.set_message(format!(
            "run {}/{} `{}`",
            progress.run + 1,
            progress.runs,
            progress.variant
        ));
        // Truncation is intended: the position is a whole number of thousandths.
        let done = (progress.fraction() * STEPS as f64) as u64;
        self.bar.set_position(done.min(STEPS));
    }

    /// Removes the bar so that the report prints on a clean line.
    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}
