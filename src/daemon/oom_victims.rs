//! The memory of the OOM killer's victims, released as soon as they are killed rather than
//! when they have exited: process_mrelease(2), which does what the kernel's OOM reaper does
//! two seconds after a kill. A thread of the serving process looks at the kernel's count of
//! OOM kills at every poll (see `crate::slotfree::POLL`) and, when it rose, finds the
//! processes being killed and releases their memory.
//!
//! Why: a victim exits only once it gets out of what it was doing when it was killed, and near
//! OOM that is direct reclaim, swapping pages out to this device. Each swap write holds a bio
//! until the daemon completes it, and the daemon, short of memory itself, completes it only
//! when memory comes back: from the victim. Seen in the VM (the near-OOM stage,
//! 2026-12-06): 21 of 96 victims took a second or more to exit, waiting in `mempool_alloc <
//! bio_alloc_bioset < __swap_writepage`, and 12 were reaped by the kernel's OOM reaper
//! first; zram completes its writes in the reclaiming task, and its 148 victims all exited
//! within 272 ms. Released, a victim's pages in RAM are free at once and its swap slots are
//! freed (and with them, through the slot-free probe, the store's memory for them), so the
//! writes it waits for complete and it exits.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::os::OomKillCount;
use crate::store::BatchedPageStore;

/// The thread that releases the memory of processes being killed, stopped when dropped.
pub(super) struct OomVictimReleaser {
    /// Dropped to stop the thread (its receiver then disconnects).
    stop: Option<Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OomVictimReleaser {
    /// Start the releasing thread, which looks at the kernel's OOM kill count every
    /// `slotfree::POLL` (`POLL_MEMORY_SHORT` while `store` says memory is short). Its own
    /// thread, not the main thread's poll: that one frees the slots of the last victim's
    /// pages, half a second at a time near OOM, while the next victim waits. `None` (with the
    /// reason in the log) where process_mrelease cannot be called or /proc/vmstat has no OOM
    /// kill count: victims then free their memory as they exit, or when the kernel's OOM
    /// reaper gets to them.
    pub(super) fn start(store: Arc<BatchedPageStore>) -> Option<Self> {
        if let Err(error) = crate::os::process_mrelease_available() {
            tracing::warn!(%error, "process_mrelease(2) unavailable: the memory of processes the OOM killer kills comes back only as they exit");
            return None;
        }
        let opened =
            OomKillCount::open().and_then(|mut kills| kills.read().map(|seen| (kills, seen)));
        let (kills, seen) = match opened {
            Ok(opened) => opened,
            Err(error) => {
                tracing::warn!(%error, "cannot read the OOM kill count: the memory of processes the OOM killer kills comes back only as they exit");
                return None;
            }
        };
        let (stop, stopped) = crossbeam_channel::bounded(0);
        let thread = std::thread::Builder::new()
            .name("oom-victims".into())
            .stack_size(256 << 10)
            .spawn(move || release_victims(kills, seen, &store, &stopped))
            .map_err(|error| tracing::warn!(%error, "cannot start the thread that releases OOM victims' memory"))
            .ok()?;
        Some(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for OomVictimReleaser {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The releasing thread's loop: for each rise of the OOM kill count, every process being
/// killed (SIGKILL pending) gets its memory released. Any process being killed, not only the
/// OOM killer's victims: each is about to free its memory anyway, and /proc does not tell the
/// one from the other.
fn release_victims(
    mut kills: OomKillCount,
    mut seen: u64,
    store: &BatchedPageStore,
    stopped: &Receiver<()>,
) {
    super::harden::ready_oom_victims_thread();
    let own = std::process::id();
    // A first look, with no kill to act on: what a look touches (stack, heap) is faulted in
    // and locked now rather than at the first kill.
    release_processes_being_killed(own);
    loop {
        let poll = if store.memory_short() {
            crate::slotfree::POLL_MEMORY_SHORT
        } else {
            crate::slotfree::POLL
        };
        if let Err(RecvTimeoutError::Disconnected) | Ok(()) = stopped.recv_timeout(poll) {
            return;
        }
        match kills.read() {
            Ok(now) if now > seen => seen = now,
            _ => continue,
        }
        let seen_at = Instant::now();
        let (looked_at, released) = release_processes_being_killed(own);
        tracing::info!(
            looked_at,
            released,
            took_ms = seen_at.elapsed().as_millis(),
            "looked for processes being killed after an OOM kill"
        );
    }
}

/// Release the memory of every process being killed but this one (`own`): how many processes
/// were looked at, and how many had their memory released.
fn release_processes_being_killed(own: u32) -> (u32, u32) {
    let started = Instant::now();
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return (0, 0);
    };
    let (mut looked_at, mut released) = (0_u32, 0_u32);
    let pids = processes.flatten().filter_map(|entry| {
        entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
    });
    for pid in pids.filter(|&pid| pid != own) {
        looked_at += 1;
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        if !crate::os::being_killed(&status) {
            continue;
        }
        let Ok(pid) = i32::try_from(pid) else {
            continue;
        };
        let name = status
            .lines()
            .find_map(|line| line.strip_prefix("Name:"))
            .unwrap_or_default()
            .trim();
        let releasing = Instant::now();
        let after_look_started_ms = releasing.duration_since(started).as_millis();
        match crate::os::release_memory_of_killed(pid) {
            Ok(()) => {
                released += 1;
                tracing::info!(
                    pid,
                    name,
                    after_look_started_ms,
                    took_ms = releasing.elapsed().as_millis(),
                    "released the memory of a process being killed, ahead of its exit"
                );
            }
            // Exited meanwhile (ESRCH), or its memory is being freed already (EINVAL).
            Err(error) if matches!(error.raw_os_error(), Some(libc::ESRCH | libc::EINVAL)) => {
                tracing::info!(pid, name, after_look_started_ms, %error, "a process being killed had no memory left to release");
            }
            Err(error) => {
                tracing::warn!(pid, name, %error, "could not release the memory of a process being killed");
            }
        }
    }
    (looked_at, released)
}
