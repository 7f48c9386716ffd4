//! How long a queue thread watches its ring for the next request after serving some, before
//! it sleeps in the kernel (hybrid polling, `Queue::poll_briefly`).
//!
//! A client that waits for each answer before it asks again (fio at queue depth 1, a page
//! fault waiting on its swap-in) sends the next request as long after the answer as it takes
//! to use it: under the VM's emulation that can be more than the 50 µs the window was, and
//! the thread then sleeps and is woken through the scheduler, which there costs about as much
//! as serving a request. So the window follows the gaps the thread has seen
//! lately: half as long again as their running mean while that mean is under `LONGEST`,
//! `SHORTEST` otherwise, so that a device whose requests come far apart (or an idle one: the
//! window follows only a wait that brought requests) spins no longer than it did before.
//! With it the VM's fio rows went 1.1–1.5 times as fast (`scripts/vm-bench.sh --compare`,
//! 2026-12-05; docs/measurements.md). The handler says when not (`may_poll`): the daemon's,
//! while memory is short and pages do not compress, where a spinning queue thread takes the
//! CPU from what gives memory back.

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::units::nanos;

/// The window while requests come far apart.
pub(super) const SHORTEST: Duration = Duration::from_micros(50);
/// The longest window: past this mean gap the client is not waiting on each answer, and
/// watching would only take a CPU from whoever runs meanwhile.
pub(super) const LONGEST: Duration = Duration::from_millis(1);

/// The running mean of the gaps between serving and the next request's arrival.
#[derive(Debug)]
pub(super) struct PollWindow {
    mean_gap_ns: u64,
}

impl PollWindow {
    /// A window that starts at `SHORTEST` (no gap seen yet counts as a long one).
    pub(super) fn new() -> Self {
        Self {
            mean_gap_ns: nanos(LONGEST),
        }
    }

    /// The window to watch for after serving.
    pub(super) fn window(&self) -> Duration {
        if self.mean_gap_ns < nanos(LONGEST) {
            Duration::from_nanos(self.mean_gap_ns.saturating_mul(3) / 2).clamp(SHORTEST, LONGEST)
        } else {
            SHORTEST
        }
    }

    /// A request arrived `gap` after the thread had served the ones before (whether the
    /// window caught it or the thread slept): a mean over about the last eight. A gap of
    /// minutes counts as ten times `LONGEST`, so that one long pause does not keep the
    /// window short for the next hundred requests.
    pub(super) fn note_gap(&mut self, gap: Duration) {
        let gap = nanos(gap).min(nanos(LONGEST) * 10);
        self.mean_gap_ns = (self.mean_gap_ns * 7 + gap) / 8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn after(gaps: &[Duration]) -> Duration {
        let mut poll = PollWindow::new();
        for gap in gaps {
            poll.note_gap(*gap);
        }
        poll.window()
    }

    #[test]
    fn the_window_starts_short() {
        assert_eq!(PollWindow::new().window(), SHORTEST);
    }

    #[test]
    fn a_client_that_waits_on_each_answer_gets_a_window_half_as_long_again_as_its_gaps() {
        let us = Duration::from_micros;
        let window = after(&[us(300); 64]);
        assert!(
            (us(440)..=us(460)).contains(&window),
            "steady 300 µs gaps gave a window of {window:?}"
        );
        // Gaps shorter than the shortest window keep it.
        assert_eq!(after(&[us(10); 64]), SHORTEST);
        // A gap near the longest window never takes it past that.
        assert_eq!(after(&[us(900); 64]), LONGEST);
    }

    #[test]
    fn requests_far_apart_keep_the_window_short() {
        assert_eq!(after(&[Duration::from_millis(3); 64]), SHORTEST);
        assert_eq!(after(&[Duration::from_secs(60); 4]), SHORTEST);
    }

    #[test]
    fn one_long_pause_is_soon_forgotten() {
        let us = Duration::from_micros;
        let mut gaps = vec![us(300); 64];
        gaps.push(Duration::from_secs(600));
        // Right after it the client is taken for one that pauses...
        assert_eq!(after(&gaps), SHORTEST);
        // ...and some twenty requests later, for one that waits on each answer again.
        gaps.extend([us(300); 24]);
        assert!(after(&gaps) > SHORTEST, "{:?}", after(&gaps));
    }
}
