//! Where a phase's CPU went, thread by thread: whether the compression pool, the reserve's
//! refill thread or the writers limit the store's write path (issue 13) is read from here.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::os::{process_cpu_time, thread_cpu_times, ThreadCpu};

/// CPU seconds a phase used, by thread.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PhaseCpu {
    pub wall_seconds: f64,
    /// By thread name with the digits at its end dropped (the compression pool's
    /// `trueno-pool0`, `trueno-pool1`, ... count as `trueno-pool`), live threads only.
    pub threads: BTreeMap<String, f64>,
    /// Threads that ended during the phase (the bench's writers), read as what the process
    /// used beyond its live threads.
    pub ended_threads: f64,
}

impl PhaseCpu {
    /// One line: the wall time, then each thread group's share of it, the largest first.
    pub fn summary(&self) -> String {
        let mut groups: Vec<(&str, f64)> = self
            .threads
            .iter()
            .map(|(name, &seconds)| (name.as_str(), seconds))
            .chain([("ended threads (writers)", self.ended_threads)])
            .filter(|&(_, seconds)| seconds >= 0.0005)
            .collect();
        groups.sort_by(|a, b| b.1.total_cmp(&a.1));
        let wall = self.wall_seconds.max(1e-9);
        let shares: Vec<String> = groups
            .iter()
            .map(|(name, seconds)| {
                format!("{name} {seconds:.3} s ({:.0}%)", seconds / wall * 100.0)
            })
            .collect();
        format!("{:.3} s: {}", self.wall_seconds, shares.join(", "))
    }
}

/// The process's and each live thread's CPU time at one moment.
pub(super) struct CpuMark {
    at: Instant,
    process: Duration,
    threads: Vec<ThreadCpu>,
}

impl CpuMark {
    pub(super) fn now() -> Self {
        Self {
            at: Instant::now(),
            process: process_cpu_time(),
            // Without /proc, every thread counts as ended: the total is still right.
            threads: thread_cpu_times().unwrap_or_default(),
        }
    }

    /// What was used from this mark until now.
    pub(super) fn since(&self) -> PhaseCpu {
        let now = Self::now();
        let mut threads: BTreeMap<String, f64> = BTreeMap::new();
        let mut live = Duration::ZERO;
        for thread in &now.threads {
            let before = self
                .threads
                .iter()
                .find(|old| old.tid == thread.tid)
                .map_or(Duration::ZERO, |old| old.cpu);
            let used = thread.cpu.saturating_sub(before);
            live += used;
            *threads.entry(group_name(&thread.name)).or_default() += used.as_secs_f64();
        }
        let total = now.process.saturating_sub(self.process);
        PhaseCpu {
            wall_seconds: now.at.duration_since(self.at).as_secs_f64(),
            threads,
            ended_threads: total.saturating_sub(live).as_secs_f64(),
        }
    }
}

fn group_name(name: &str) -> String {
    name.trim_end_matches(|c: char| c.is_ascii_digit())
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_threads_count_as_one_group() {
        assert_eq!(group_name("trueno-pool12"), "trueno-pool");
        assert_eq!(group_name("trueno-reserve"), "trueno-reserve");
    }

    #[test]
    fn a_phase_tells_live_threads_by_name_and_ended_ones_together() {
        let mark = CpuMark::now();
        let spin = |wanted: Duration| {
            let start = crate::os::thread_cpu_time();
            while crate::os::thread_cpu_time() - start < wanted {}
        };
        std::thread::Builder::new()
            .name("cpu-test-ended".into())
            .spawn(move || spin(Duration::from_millis(40)))
            .unwrap()
            .join()
            .unwrap();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let (spun, told) = std::sync::mpsc::channel();
        let live = std::thread::Builder::new()
            .name("cpu-test-live7".into())
            .spawn(move || {
                spin(Duration::from_millis(40));
                spun.send(()).unwrap();
                stopped.recv().unwrap();
            })
            .unwrap();
        told.recv().unwrap();
        let phase = mark.since();
        stop.send(()).unwrap();
        live.join().unwrap();
        assert!(phase.threads["cpu-test-live"] >= 0.040, "{phase:?}");
        assert!(phase.ended_threads >= 0.040, "{phase:?}");
        assert!(phase.wall_seconds >= 0.080, "{phase:?}");
        assert!(
            phase.summary().contains("cpu-test-live"),
            "{}",
            phase.summary()
        );
    }
}
