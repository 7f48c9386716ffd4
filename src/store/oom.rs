//! Asking the kernel's OOM killer to act when the store starves and swapping frees nothing.
//!
//! Why: when the programs filling RAM hold more than RAM and swap can hold (pages that do not
//! compress free nothing when swapped out), the only way on is an OOM kill, and zram gets one:
//! it allocates inside the reclaiming task, which finds no progress and calls the OOM killer.
//! Through a ublk device the kernel cannot see that: its reclaim waits on our writes, and every
//! page the refill thread manages to commit completes a few of them, which reclaim counts as
//! progress. So it does not call the OOM killer, and the whole machine crawls through reclaim
//! (seen in the VM: stress-ng's move-inv, 2 x 100 MiB in 256 MiB, no OOM kill in minutes, the
//! store failing writes with ENOMEM, every process stalled). The store can tell: a write waits
//! for memory the refill thread is not given (`admission`'s starvation rule), while most pages
//! lately did not compress. It then asks the kernel's OOM killer once (the daemon writes `f` to
//! `/proc/sysrq-trigger`, which picks the task the kernel itself would; the daemon's processes
//! have `oom_score_adj` -1000), and the memory the victim held comes back.
//!
//! When pages compress, a starving store is only slow, and no kill is asked for (seen in the VM
//! on a host shared by three VMs: a kill asked for after 300 ms took a program that would have
//! fitted).

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::nanos;

/// At most one OOM kill asked for per this long: the victim needs time to exit and its memory
/// to reach the refill thread.
const NUDGE_INTERVAL: Duration = Duration::from_secs(1);

/// The window of `swap_frees_nothing`, in pages compressed: one flush part, so that the part
/// the flusher is stuck on decides. A larger one (4096) remembered the compressible pages of
/// an earlier fill, and the VM's first incompressible stall failed writes without asking.
const RECENT_PAGES: u64 = 256;

/// Pages compressed this long before a writer began to starve belong to another workload and
/// say nothing of the pages it waits to store; after a gap this long in compressing, the
/// window starts again. Why: in the VM test, random patterns written by `dd` (raw pages) were
/// the last pages compressed when, minutes later, the first writes of a swap run over
/// compressible pages waited 300 ms for memory, and a kill was asked for that took the
/// program being swapped out (clean-clone CI, 2026-11-26). In a real storm of raw pages the
/// flusher compresses until the moment it stalls storing them, just before writers starve.
const STALE_AFTER: Duration = Duration::from_secs(1);

/// How the store asks the kernel's OOM killer to kill a task, given by whoever opens the store:
/// the daemon writes `f` to `/proc/sysrq-trigger`, opened at its start (under memory pressure
/// opening it could wait in reclaim). The store only decides when. With it, whether the system
/// as a whole is out of memory: a store starved while the system has free memory is held back
/// by something a kill elsewhere does not mend (a memory limit on the daemon's own cgroup, a
/// refill thread stalled for another reason), and the kernel's OOM killer kills whatever
/// scores worst, whether memory is short or not.
#[derive(Clone)]
pub struct OomKiller {
    ask: Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>,
    system_out_of_memory: Arc<dyn Fn() -> bool + Send + Sync>,
}

impl OomKiller {
    pub fn new(
        system_out_of_memory: impl Fn() -> bool + Send + Sync + 'static,
        ask: impl Fn() -> std::io::Result<()> + Send + Sync + 'static,
    ) -> Self {
        Self {
            ask: Arc::new(ask),
            system_out_of_memory: Arc::new(system_out_of_memory),
        }
    }
}

impl std::fmt::Debug for OomKiller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OomKiller")
    }
}

pub(super) struct OomNudge {
    killer: Option<OomKiller>,
    /// The earliest time (ns on the store's clock) the next kill may be asked for.
    next_ns: AtomicU64,
    /// Pages compressed lately, and how many of them raw (they did not compress), both halved
    /// while they reach `RECENT_PAGES`: whether swapping out frees any memory now.
    recent_pages: AtomicU64,
    recent_raw: AtomicU64,
    /// When pages were last compressed (ns on the store's clock).
    last_note_ns: AtomicU64,
    /// When a kill was last asked for (ns on the store's clock; 0: never).
    asked_ns: AtomicU64,
}

impl OomNudge {
    /// Without a `killer` (tests, bench: they must never kill) it never asks.
    pub(super) fn new(killer: Option<OomKiller>) -> Self {
        Self {
            killer,
            next_ns: AtomicU64::new(0),
            recent_pages: AtomicU64::new(0),
            recent_raw: AtomicU64::new(0),
            last_note_ns: AtomicU64::new(0),
            asked_ns: AtomicU64::new(0),
        }
    }

    /// `pages` pages were compressed for writes at `now_ns`, `raw` of them did not compress.
    /// Noted before they are stored: storing them is what may starve. Kept without a killer
    /// too: the starvation rule's patience depends on it (see `admission`).
    pub(super) fn note_compressed(&self, now_ns: u64, pages: u64, raw: u64) {
        let last = self.last_note_ns.swap(now_ns, Ordering::Relaxed);
        if now_ns.saturating_sub(last) > nanos(STALE_AFTER) {
            // A racy restart is fine: only the rough share of raw pages matters.
            self.recent_pages.store(0, Ordering::Relaxed);
            self.recent_raw.store(0, Ordering::Relaxed);
        }
        self.recent_raw.fetch_add(raw, Ordering::Relaxed);
        let mut seen = self.recent_pages.fetch_add(pages, Ordering::Relaxed) + pages;
        while seen >= RECENT_PAGES {
            // A racy halving is fine: only the rough share of raw pages matters.
            for c in [&self.recent_pages, &self.recent_raw] {
                c.store(c.load(Ordering::Relaxed) / 2, Ordering::Relaxed);
            }
            seen /= 2;
        }
    }

    /// Whether most pages compressed lately were raw, for a writer starving at `now_ns` that
    /// has `waited`: swapping such a page out frees a page and costs one, so no reclaim through
    /// this store makes progress, only an OOM kill does. False when nothing was compressed
    /// within `STALE_AFTER` before the writer began to wait.
    pub(super) fn swap_frees_nothing(&self, now_ns: u64, waited: Duration) -> bool {
        let waited_ns = nanos(waited);
        let began = now_ns.saturating_sub(waited_ns);
        if began.saturating_sub(self.last_note_ns.load(Ordering::Relaxed)) > nanos(STALE_AFTER) {
            return false;
        }
        2 * self.recent_raw.load(Ordering::Relaxed) > self.recent_pages.load(Ordering::Relaxed)
    }

    /// Whether at most a quarter of the pages compressed lately were raw, however long ago
    /// that was (none compressed yet counts as yes): swapping pages out gives memory back.
    /// Not the opposite of `swap_frees_nothing`, which forgets pages compressed before a
    /// pause and holds from half raw: between the two the answer to both is no.
    pub(super) fn swap_frees_memory(&self) -> bool {
        4 * self.recent_raw.load(Ordering::Relaxed) <= self.recent_pages.load(Ordering::Relaxed)
    }

    /// A writer starves (see `admission`) at `now_ns` on the store's clock: ask for an OOM kill
    /// if swapping frees nothing, the system is out of memory and none was asked for within
    /// `NUDGE_INTERVAL`. True if one was asked for now. Asking only queues the kill (sysrq runs
    /// it in a kernel work item).
    pub(super) fn nudge(&self, now_ns: u64, waited: Duration) -> bool {
        let Some(killer) = &self.killer else {
            return false;
        };
        let next = self.next_ns.load(Ordering::Relaxed);
        if now_ns < next || !self.swap_frees_nothing(now_ns, waited) {
            return false;
        }
        let interval = nanos(NUDGE_INTERVAL);
        if self
            .next_ns
            .compare_exchange(
                next,
                now_ns.saturating_add(interval),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_err()
        {
            return false; // another writer asks now
        }
        let waited_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
        if !(killer.system_out_of_memory)() {
            // Once per interval at most, as an ask would be.
            tracing::warn!(
                waited_ms,
                "no memory for the store while the system has free memory (a memory limit on the daemon's own cgroup, or a refill thread stalled for another reason): no OOM kill asked for; starved writes fail"
            );
            return false;
        }
        match (killer.ask)() {
            Ok(()) => {
                self.asked_ns.store(now_ns.max(1), Ordering::Relaxed);
                tracing::warn!(
                    waited_ms,
                    "no memory for the store and swapped-out pages do not compress: asked the kernel's OOM killer to act"
                );
                true
            }
            Err(error) => {
                tracing::warn!(%error, waited_ms, "asking the kernel's OOM killer to act failed");
                false
            }
        }
    }

    /// Whether a kill was asked for within `window` before `now_ns`: the victim's memory is
    /// coming back.
    pub(super) fn asked_within(&self, now_ns: u64, window: Duration) -> bool {
        let asked = self.asked_ns.load(Ordering::Relaxed);
        asked != 0 && now_ns.saturating_sub(asked) <= nanos(window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A killer that counts its asks, on a system out of memory or not.
    fn counting_on(system_out_of_memory: bool) -> (OomKiller, Arc<AtomicU64>) {
        let asked = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&asked);
        let killer = OomKiller::new(
            move || system_out_of_memory,
            move || {
                count.fetch_add(1, Ordering::Relaxed);
                Ok(())
            },
        );
        (killer, asked)
    }

    fn counting() -> (OomKiller, Arc<AtomicU64>) {
        counting_on(true)
    }

    #[test]
    fn asks_for_nothing_while_the_system_has_free_memory() {
        let (killer, asked) = counting_on(false);
        let nudge = OomNudge::new(Some(killer));
        nudge.note_compressed(0, RECENT_PAGES, RECENT_PAGES);
        assert!(nudge.swap_frees_nothing(1, Duration::ZERO));
        assert!(!nudge.nudge(1, Duration::ZERO));
        assert_eq!(asked.load(Ordering::Relaxed), 0);
        assert!(!nudge.asked_within(2, Duration::from_secs(1)));
    }

    #[test]
    fn without_a_killer_nothing_is_asked() {
        let nudge = OomNudge::new(None);
        nudge.note_compressed(0, 10_000, 10_000);
        assert!(!nudge.nudge(1, Duration::ZERO));
    }

    #[test]
    fn asks_only_while_pages_do_not_compress() {
        let (killer, asked) = counting();
        let nudge = OomNudge::new(Some(killer));
        assert!(!nudge.nudge(1, Duration::ZERO), "nothing stored yet");
        for i in 0..10_000 {
            nudge.note_compressed(1, 1, u64::from(i % 10 == 0));
        }
        assert!(
            !nudge.nudge(2, Duration::ZERO),
            "10% raw: swapping frees memory"
        );
        // One flush part that does not compress, after many that did, decides.
        nudge.note_compressed(2, RECENT_PAGES, RECENT_PAGES);
        assert!(!nudge.asked_within(3, Duration::from_secs(1)));
        assert!(nudge.nudge(3, Duration::ZERO), "raw lately");
        assert_eq!(asked.load(Ordering::Relaxed), 1);
        assert!(nudge.asked_within(3 + nanos(Duration::from_secs(1)), Duration::from_secs(1)));
        assert!(!nudge.asked_within(4 + nanos(Duration::from_secs(1)), Duration::from_secs(1)));
    }

    #[test]
    fn asks_at_most_once_per_interval() {
        let (killer, asked) = counting();
        let nudge = OomNudge::new(Some(killer));
        nudge.note_compressed(0, RECENT_PAGES, RECENT_PAGES);
        let second = 1_000_000_000;
        // Writers starving since the flusher last compressed (it stalls storing those pages).
        let asks = (0..40u64)
            .map(|i| i * second / 10)
            .filter(|&now| nudge.nudge(now, Duration::from_nanos(now)))
            .count();
        assert_eq!(asks, 4, "4 s of starving writers");
        assert_eq!(asked.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_failed_ask_is_not_counted() {
        let nudge = OomNudge::new(Some(OomKiller::new(
            || true,
            || Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied)),
        )));
        nudge.note_compressed(0, RECENT_PAGES, RECENT_PAGES);
        assert!(!nudge.nudge(0, Duration::ZERO));
    }

    #[test]
    fn swap_frees_memory_while_at_most_a_quarter_of_the_pages_lately_were_raw() {
        let nudge = OomNudge::new(None);
        assert!(nudge.swap_frees_memory(), "nothing stored yet");
        nudge.note_compressed(0, RECENT_PAGES, RECENT_PAGES / 4);
        assert!(nudge.swap_frees_memory(), "a quarter raw");
        nudge.note_compressed(1, 4, 4);
        assert!(!nudge.swap_frees_memory(), "just over a quarter raw");
        assert!(
            !nudge.swap_frees_nothing(1, Duration::ZERO),
            "nor under half"
        );
        // Remembered through a pause, unlike `swap_frees_nothing`: a pause in the writes of
        // pages that do not compress is where their program's memory is given back.
        nudge.note_compressed(2, RECENT_PAGES, RECENT_PAGES);
        let minute_later = 2 + nanos(Duration::from_secs(60));
        assert!(!nudge.swap_frees_nothing(minute_later, Duration::ZERO));
        assert!(!nudge.swap_frees_memory());
        // Pages that compress, after the pause, decide again.
        nudge.note_compressed(minute_later, RECENT_PAGES, 0);
        assert!(nudge.swap_frees_memory());
    }

    #[test]
    fn raw_pages_of_an_earlier_workload_ask_for_nothing() {
        let (killer, asked) = counting();
        let nudge = OomNudge::new(Some(killer));
        let second: u64 = 1_000_000_000;
        // Random data written a minute ago, then a writer that has waited 300 ms.
        nudge.note_compressed(second, RECENT_PAGES, RECENT_PAGES);
        let now = 61 * second;
        assert!(!nudge.swap_frees_nothing(now, Duration::from_millis(300)));
        assert!(!nudge.nudge(now, Duration::from_millis(300)));
        // New pages after the gap start the window again: compressible ones now decide.
        nudge.note_compressed(now, 10, 0);
        assert!(!nudge.nudge(now + 1, Duration::ZERO));
        // Raw pages compressed just before a writer began to wait do.
        nudge.note_compressed(now + 2, RECENT_PAGES, RECENT_PAGES);
        let later = now + 2 + second / 2;
        assert!(nudge.nudge(later, Duration::from_millis(400)));
        assert_eq!(asked.load(Ordering::Relaxed), 1);
    }
}
