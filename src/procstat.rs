//! The daemon's own memory, read from `/proc/self/status`, for `stat`: what it costs the
//! machine now (`VmRSS`, all of it locked by `mlockall`) against what it costs idle, with its
//! device live, nothing stored and its chunk reserve quiet (`IdleFootprint`). The difference is
//! what the stored pages, and whatever the store has not yet given back, cost.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The serving process's idle footprint: its RSS when its device went live, taken again once
/// the store's chunk reserve has had time to go quiet if nothing was stored by then. Why: the
/// reserve keeps its whole target for a second after the device goes live, then a quarter;
/// taken only at go-live, the footprint was about 3 MiB above what a quiet device holds (its
/// RSS then read as below idle).
#[derive(Debug)]
pub struct IdleFootprint {
    rss_bytes: AtomicU64,
    settle_at: Instant,
    settled: AtomicBool,
}

impl IdleFootprint {
    /// The footprint now (at go-live), taken again after `settle_after` (see `settle`).
    pub fn at_go_live(settle_after: Duration) -> Self {
        Self {
            rss_bytes: AtomicU64::new(ProcessMemory::now(0).rss_bytes),
            settle_at: Instant::now() + settle_after,
            settled: AtomicBool::new(false),
        }
    }

    pub fn rss_bytes(&self) -> u64 {
        self.rss_bytes.load(Ordering::Relaxed)
    }

    /// Called now and then (the main thread's polls): the first time after `settle_after`,
    /// take the RSS again if `nothing_stored` says so; the go-live figure stays otherwise.
    pub fn settle(&self, nothing_stored: impl FnOnce() -> bool) {
        if self.settled.load(Ordering::Relaxed) || Instant::now() < self.settle_at {
            return;
        }
        self.settled.store(true, Ordering::Relaxed);
        if nothing_stored() {
            let rss = ProcessMemory::now(0).rss_bytes;
            if rss > 0 {
                self.rss_bytes.store(rss, Ordering::Relaxed);
            }
        }
    }
}

/// Resident memory of one daemon process, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessMemory {
    /// `VmRSS` now: anonymous + file + shared (the memfd arena holding compressed pages).
    pub rss_bytes: u64,
    /// `RssAnon`: heap, stacks, page table, pending batches, tag buffers.
    pub rss_anon_bytes: u64,
    /// `RssFile`: the binary and its libraries.
    pub rss_file_bytes: u64,
    /// `RssShmem`: the memfd arena (stored pages and the chunk reserve).
    pub rss_shmem_bytes: u64,
    /// The idle footprint (`IdleFootprint`): `VmRSS` with the device live, nothing stored and
    /// the chunk reserve quiet.
    pub idle_rss_bytes: u64,
}

impl ProcessMemory {
    /// This process's memory now, with `idle_rss_bytes` as given; zeros where
    /// `/proc/self/status` cannot be read (the report says nothing rather than fail).
    pub fn now(idle_rss_bytes: u64) -> Self {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        Self {
            idle_rss_bytes,
            ..Self::parse(&status)
        }
    }

    /// The fields of a `/proc/PID/status` text (values in kB there).
    pub fn parse(status: &str) -> Self {
        let field = |key: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
                .and_then(|value| value.split_whitespace().next()?.parse::<u64>().ok())
                .map_or(0, |kib| kib * 1024)
        };
        Self {
            rss_bytes: field("VmRSS"),
            rss_anon_bytes: field("RssAnon"),
            rss_file_bytes: field("RssFile"),
            rss_shmem_bytes: field("RssShmem"),
            idle_rss_bytes: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_rss_fields_of_proc_status() {
        let status = "Name:\ttrueno-ublk\nVmLck:\t   25000 kB\nVmRSS:\t   25600 kB\n\
                      RssAnon:\t   12000 kB\nRssFile:\t    4000 kB\nRssShmem:\t    9600 kB\n";
        let m = ProcessMemory::parse(status);
        assert_eq!(m.rss_bytes, 25600 * 1024);
        assert_eq!(m.rss_anon_bytes, 12000 * 1024);
        assert_eq!(m.rss_file_bytes, 4000 * 1024);
        assert_eq!(m.rss_shmem_bytes, 9600 * 1024);
        assert_eq!(ProcessMemory::parse("garbage"), ProcessMemory::default());
    }

    #[test]
    fn the_idle_footprint_is_taken_again_once_settled_and_only_if_nothing_is_stored() {
        let footprint = IdleFootprint::at_go_live(Duration::from_secs(3600));
        let at_go_live = footprint.rss_bytes();
        assert!(at_go_live > 0);
        footprint.settle(|| panic!("asked before the time to settle"));
        let settled = IdleFootprint::at_go_live(Duration::ZERO);
        settled.rss_bytes.store(1, Ordering::Relaxed);
        settled.settle(|| true);
        assert!(settled.rss_bytes() > 1, "taken again");
        settled.rss_bytes.store(1, Ordering::Relaxed);
        settled.settle(|| true);
        assert_eq!(settled.rss_bytes(), 1, "taken once only");
        let busy = IdleFootprint::at_go_live(Duration::ZERO);
        busy.rss_bytes.store(1, Ordering::Relaxed);
        busy.settle(|| false);
        assert_eq!(
            busy.rss_bytes(),
            1,
            "pages stored: the go-live figure stays"
        );
    }

    #[test]
    fn reads_this_process() {
        let m = ProcessMemory::now(7);
        assert!(m.rss_bytes > 0 && m.rss_bytes >= m.rss_anon_bytes);
        assert_eq!(m.idle_rss_bytes, 7);
    }
}
