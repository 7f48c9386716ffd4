//! The bench's progress bar.
//!
//! Drawn here rather than with a progress-bar crate: the daemon is the same binary, and it
//! locks every page of code it maps, its libraries' included. indicatif's rate estimate was
//! the one caller of `pow` in the binary, so it linked libm, whose start-up alone (its
//! `IFUNC` resolvers, spread over its code) mapped about 330 KiB of it into every serving
//! process (issue 16's idle footprint). What `bench` shows needs no more than this.

#![forbid(unsafe_code)]

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a run goes before the bar appears, and how often it is drawn.
const SHOWN_AFTER: Duration = Duration::from_secs(1);
const REDRAWN_EVERY: Duration = Duration::from_millis(100);
/// Cells of the bar itself.
const BAR_CELLS: u64 = 40;

/// Where the run is: the phase's name and size, and how far into it.
struct State {
    phase: Mutex<&'static str>,
    total: AtomicU64,
    done: AtomicU64,
}

/// A progress bar on stderr that appears only once a run has lasted a second; `hidden` for
/// `--json` or when stderr is not a terminal.
pub struct Progress {
    state: Arc<State>,
    drawer: Mutex<Option<Drawer>>,
}

/// The thread that draws the bar, and the channel whose closing stops it.
struct Drawer {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Progress {
    pub fn hidden() -> Self {
        Self {
            state: Arc::new(State {
                phase: Mutex::new(""),
                total: AtomicU64::new(0),
                done: AtomicU64::new(0),
            }),
            drawer: Mutex::new(None),
        }
    }

    pub fn on_stderr_after_a_second() -> Self {
        let progress = Self::hidden();
        let state = progress.state.clone();
        let (stop, stopped) = mpsc::channel::<()>();
        // Without a thread the run goes on without a bar.
        let thread = std::thread::Builder::new()
            .name("bench-progress".into())
            .spawn(move || draw_until_stopped(&state, &stopped))
            .ok();
        if let Some(thread) = thread {
            *lock(&progress.drawer) = Some(Drawer { stop, thread });
        }
        progress
    }

    /// Start a phase of `total` units (bytes or operations).
    pub fn phase(&self, name: &'static str, total: u64) {
        *lock(&self.state.phase) = name;
        self.state.total.store(total, Ordering::Relaxed);
        self.state.done.store(0, Ordering::Relaxed);
    }

    pub fn advance(&self, units: u64) {
        self.state.done.fetch_add(units, Ordering::Relaxed);
    }

    /// Stop drawing and clear the bar's line.
    pub fn finish(&self) {
        if let Some(drawer) = lock(&self.drawer).take() {
            drop(drawer.stop);
            let _ = drawer.thread.join();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Draw the bar every `REDRAWN_EVERY` from `SHOWN_AFTER` on, until `stopped` closes; then
/// clear its line if it was drawn.
fn draw_until_stopped(state: &State, stopped: &mpsc::Receiver<()>) {
    let started = Instant::now();
    let mut wait = SHOWN_AFTER;
    let mut drawn = false;
    while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(wait) {
        let line = bar_line(
            &lock(&state.phase),
            state.done.load(Ordering::Relaxed),
            state.total.load(Ordering::Relaxed),
            started.elapsed(),
        );
        let _ = write!(std::io::stderr(), "\r\x1b[2K{line}");
        drawn = true;
        wait = REDRAWN_EVERY;
    }
    if drawn {
        let _ = write!(std::io::stderr(), "\r\x1b[2K");
    }
}

/// `store write            [=================>                      ]  45% 12s`
fn bar_line(phase: &str, done: u64, total: u64, elapsed: Duration) -> String {
    let done = done.min(total);
    let filled = (done * BAR_CELLS).checked_div(total).unwrap_or(0);
    let percent = (done * 100).checked_div(total).unwrap_or(0);
    let mut bar = "=".repeat(usize::try_from(filled).unwrap_or(0));
    if filled < BAR_CELLS {
        bar.push('>');
    }
    format!(
        "{phase:<22} [{bar:<width$}] {percent:>3}% {}s",
        elapsed.as_secs(),
        width = usize::try_from(BAR_CELLS).unwrap_or(0)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_fills_with_the_phase_and_never_past_its_end() {
        let second = Duration::from_secs(1);
        assert_eq!(
            bar_line("store write", 0, 100, second),
            format!("{:<22} [>{}]   0% 1s", "store write", " ".repeat(39))
        );
        let half = bar_line("store write", 50, 100, second);
        assert!(half.contains(&format!("[{}>{}]  50%", "=".repeat(20), " ".repeat(19))));
        let over = bar_line("store write", 150, 100, 3 * second);
        assert!(over.ends_with(&format!("[{}] 100% 3s", "=".repeat(40))));
        // A phase of nothing yet (no total) draws an empty bar, not a division by zero.
        assert!(bar_line("latency: read", 5, 0, second).contains("  0%"));
    }

    #[test]
    fn finishing_stops_the_drawing_thread_and_may_be_repeated() {
        let progress = Progress::on_stderr_after_a_second();
        progress.phase("codec compress", 10);
        progress.advance(3);
        assert_eq!(progress.state.done.load(Ordering::Relaxed), 3);
        progress.finish();
        assert!(lock(&progress.drawer).is_none());
        progress.finish();
    }
}
