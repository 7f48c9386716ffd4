//! How often the serving process's main thread looks at what it watches (freed swap slots, the
//! system's memory, a hand-over asked for): every `slotfree::POLL` while the device is in use,
//! every `IDLE_POLL` once nothing has happened for `QUIET_LOOKS` looks, and at once at the next
//! request (swap's first writes are when memory has run short: the store must hear so before it
//! compresses them). Why: an idle daemon should sleep (a laptop's `powertop` counts wake-ups;
//! kernel zram makes none), while freed slots must still give their memory back within two
//! seconds of a program's exit (issue 16).

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

/// The main thread's period once the device is idle.
pub(super) const IDLE_POLL: Duration = Duration::from_secs(1);
/// Looks in a row that saw nothing happen before the main thread polls at `IDLE_POLL`: two
/// seconds of looks at `slotfree::POLL`.
const QUIET_LOOKS: u32 = 20;

/// A request came since the main thread's last look.
const BUSY: u8 = 0;
/// None came since its last look.
const QUIET: u8 = 1;
/// None came, and the main thread sleeps for `IDLE_POLL`: the next request wakes it.
const ASLEEP: u8 = 2;

/// Whether requests came, told by the queue threads (`note_request`) to the main thread.
pub(super) struct Activity {
    state: AtomicU8,
    wake: Sender<()>,
    woken: Receiver<()>,
}

impl Activity {
    pub(super) fn new() -> Self {
        let (wake, woken) = crossbeam_channel::bounded(1);
        Self {
            state: AtomicU8::new(BUSY),
            wake,
            woken,
        }
    }

    /// A request is being served: one load on a line that only changes at the main thread's
    /// looks, and a wake-up for a main thread asleep.
    pub(super) fn note_request(&self) {
        if self.state.load(Ordering::Relaxed) != BUSY
            && self.state.swap(BUSY, Ordering::AcqRel) == ASLEEP
        {
            // Full: a wake-up it has not taken yet does the same.
            let _ = self.wake.try_send(());
        }
    }

    /// Ready when a request came while the main thread slept.
    pub(super) fn woken(&self) -> &Receiver<()> {
        &self.woken
    }
}

/// The main thread's side: how long its next wait is.
pub(super) struct MainPoll {
    quiet_looks: u32,
    asleep: bool,
    /// Woken by a request: the next look is now.
    look_now: bool,
}

impl MainPoll {
    pub(super) fn new() -> Self {
        Self {
            quiet_looks: 0,
            asleep: false,
            look_now: false,
        }
    }

    /// The wait before the next look: `busy` while the device is in use.
    pub(super) fn interval(&self, busy: Duration) -> Duration {
        if self.look_now {
            Duration::ZERO
        } else if self.asleep {
            IDLE_POLL
        } else {
            busy
        }
    }

    /// A look was made; `happened`: it found something to do (slots freed, memory short).
    pub(super) fn looked(&mut self, activity: &Activity, happened: bool) {
        self.look_now = false;
        let requests = activity.state.swap(QUIET, Ordering::AcqRel) == BUSY;
        self.quiet_looks = if requests || happened {
            0
        } else {
            self.quiet_looks.saturating_add(1)
        };
        // Asleep only if no request came since the swap above (else it is looked at soon).
        self.asleep = self.quiet_looks >= QUIET_LOOKS
            && activity
                .state
                .compare_exchange(QUIET, ASLEEP, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
    }

    /// Woken by a request (`Activity::woken`): look now, then at the busy period.
    pub(super) fn wake(&mut self) {
        self.asleep = false;
        self.look_now = true;
        self.quiet_looks = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUSY_POLL: Duration = Duration::from_millis(100);

    #[test]
    fn the_main_thread_sleeps_after_quiet_looks_and_a_request_wakes_it() {
        let activity = Activity::new();
        let mut poll = MainPoll::new();
        // The first look finds what a new handler starts as (busy), then `QUIET_LOOKS` quiet.
        for _ in 0..=QUIET_LOOKS {
            assert_eq!(poll.interval(BUSY_POLL), BUSY_POLL);
            poll.looked(&activity, false);
        }
        assert_eq!(poll.interval(BUSY_POLL), IDLE_POLL);
        assert!(activity.woken().is_empty());
        activity.note_request();
        activity.note_request();
        assert_eq!(
            activity.woken().len(),
            1,
            "one wake-up for the first request"
        );
        activity.woken().recv().unwrap();
        poll.wake();
        assert_eq!(poll.interval(BUSY_POLL), Duration::ZERO, "a look at once");
        poll.looked(&activity, false);
        assert_eq!(
            poll.interval(BUSY_POLL),
            BUSY_POLL,
            "the request counts as activity"
        );
    }

    #[test]
    fn requests_or_work_found_keep_the_busy_period() {
        let activity = Activity::new();
        let mut poll = MainPoll::new();
        for look in 0..QUIET_LOOKS * 3 {
            if look % 10 == 0 {
                activity.note_request();
            }
            poll.looked(&activity, false);
            assert_eq!(poll.interval(BUSY_POLL), BUSY_POLL);
        }
        for _ in 0..QUIET_LOOKS * 3 {
            poll.looked(&activity, true);
            assert_eq!(poll.interval(BUSY_POLL), BUSY_POLL);
        }
        assert!(activity.woken().is_empty(), "never woken: never asleep");
    }
}
