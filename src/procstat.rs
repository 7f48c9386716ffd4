//! The daemon's own memory, read from `/proc/self/status`, for `stat`: what it costs the
//! machine now (`VmRSS`, all of it locked by `mlockall`) against what it cost idle, right after
//! its device went live with nothing stored. The difference is what the stored pages, and
//! whatever the store has not yet given back, cost.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

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
    /// `VmRSS` right after the device went live, before any page was stored.
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
    fn reads_this_process() {
        let m = ProcessMemory::now(7);
        assert!(m.rss_bytes > 0 && m.rss_bytes >= m.rss_anon_bytes);
        assert_eq!(m.idle_rss_bytes, 7);
    }
}
