//! The bench's progress bar.

#![forbid(unsafe_code)]

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar on stderr that appears only once a run has lasted a second, and never with
/// `--json` or when stderr is not a terminal.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn hidden() -> Self {
        Self {
            bar: ProgressBar::hidden(),
        }
    }

    pub fn on_stderr_after_a_second() -> Self {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template("{msg:<22} [{bar:40}] {percent:>3}% {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        let weak = bar.downgrade();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            if let Some(bar) = weak.upgrade() {
                if !bar.is_finished() {
                    bar.set_draw_target(ProgressDrawTarget::stderr());
                }
            }
        });
        Self { bar }
    }

    /// Start a phase of `total` units (bytes or operations).
    pub fn phase(&self, name: &'static str, total: u64) {
        self.bar.set_message(name);
        self.bar.set_length(total);
        self.bar.set_position(0);
    }

    pub fn advance(&self, units: u64) {
        self.bar.inc(units);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
