//! The memory of the OOM killer's victims, released as soon as they are killed rather than
//! when they have exited: process_mrelease(2), which does what the kernel's OOM reaper does
//! two seconds after a kill. A thread of the serving process wakes at each OOM kill (the
//! probe of `crate::oom_kills`; where it cannot be attached, it looks at the kernel's count of
//! OOM kills at every poll, see `crate::slotfree::POLL`) and releases the memory of every
//! process being killed: of those a second thread holds for it while memory is short, the
//! ones the OOM killer would pick first (`Candidates`), or, where none of them was, of any it
//! finds in /proc.
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

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use parking_lot::Mutex;

use crate::oom_kills::OomKillProbe;
use crate::os::{HeldProcess, OomKillCount};
use crate::store::BatchedPageStore;

/// How many of the processes the OOM killer would kill first are held ahead of a kill.
const CANDIDATES: usize = 8;
/// How often they are chosen again while memory is short.
const CANDIDATES_CHOSEN_EVERY: Duration = Duration::from_secs(1);

/// The releasing thread and the thread that chooses the candidates, stopped when dropped.
/// Neither wakes on a clock while memory is not short and the probe is there: an idle
/// daemon's threads sleep until something happens (a laptop's `powertop` counts wake-ups).
pub(super) struct OomVictimReleaser {
    /// Dropped to stop the threads (their receivers then disconnect).
    stop: Option<Sender<()>>,
    /// Dropped after `stop`, which wakes the releasing thread: it waits in poll(2) on the
    /// probe and on this socket's other end, with no timeout.
    wake_releasing: Option<UnixStream>,
    /// Told when memory goes short: the choosing thread waits for it while memory is not.
    went_short: Sender<()>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl OomVictimReleaser {
    /// Start the releasing thread, which wakes at each OOM kill (`KillWatch`), and the
    /// choosing thread. The releasing thread is its own, not the main thread's poll: that one
    /// frees the slots of the last victim's pages, half a second at a time near OOM, while the
    /// next victim waits. `None` (with the reason in the log) where process_mrelease cannot be
    /// called or the kills can be neither probed nor counted: victims then free their memory
    /// as they exit, or when the kernel's OOM reaper gets to them.
    pub(super) fn start(store: Arc<BatchedPageStore>) -> Option<Self> {
        if let Err(error) = crate::os::process_mrelease_available() {
            tracing::warn!(%error, "process_mrelease(2) unavailable: the memory of processes the OOM killer kills comes back only as they exit");
            return None;
        }
        let kills = KillWatch::open()?;
        let (wake_releasing, woken) = UnixStream::pair()
            .map_err(|error| tracing::warn!(%error, "cannot make the socket that stops the thread releasing OOM victims' memory"))
            .ok()?;
        let candidates = Arc::new(Candidates::default());
        let (stop, stopped) = crossbeam_channel::bounded(0);
        let (went_short, short) = crossbeam_channel::bounded(1);
        let mut releaser = Self {
            stop: Some(stop),
            wake_releasing: Some(wake_releasing),
            went_short,
            threads: Vec::with_capacity(2),
        };
        let spawned = std::thread::Builder::new()
            .name("oom-victims".into())
            .stack_size(256 << 10)
            .spawn({
                let (candidates, store, stopped) =
                    (Arc::clone(&candidates), Arc::clone(&store), stopped.clone());
                move || release_victims(kills, &candidates, &store, &stopped, &woken)
            })
            .and_then(|releasing| {
                releaser.threads.push(releasing);
                std::thread::Builder::new()
                    .name("oom-candidates".into())
                    .stack_size(256 << 10)
                    .spawn(move || choose_candidates(&candidates, &store, &stopped, &short))
            });
        match spawned {
            Ok(choosing) => {
                releaser.threads.push(choosing);
                Some(releaser)
            }
            Err(error) => {
                tracing::warn!(%error, "cannot start the threads that release OOM victims' memory");
                None
            }
        }
    }

    /// Memory has just gone short (the main thread's `MemoryWatch` says so): the choosing
    /// thread starts holding candidates.
    pub(super) fn memory_went_short(&self) {
        // Full: a word the thread has not taken yet says the same.
        let _ = self.went_short.try_send(());
    }
}

impl Drop for OomVictimReleaser {
    fn drop(&mut self) {
        drop(self.stop.take());
        drop(self.wake_releasing.take());
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// The processes the OOM killer would kill first (the highest OOM scores), held while memory
/// is short, so that at a kill their memory is released without a look at /proc. Why: such a
/// look opens a file per process, each taking a page of the kernel's, and at the moment of a
/// kill there is none to take; seen in the VM (the near-OOM stage, 2026-12-06): looks that
/// waited 1 and 4.2 s for memory before they reached the victim, which the kernel's OOM reaper
/// took meanwhile. Releasing a held process allocates nothing. Chosen by a thread of their
/// own, since choosing is such a look: the releasing thread must not be inside one when the
/// kill comes.
#[derive(Default)]
struct Candidates {
    held: Mutex<Vec<(u32, HeldProcess)>>,
}

impl Candidates {
    /// Hold `chosen` instead; what was held is let go outside the lock.
    fn replace(&self, chosen: Vec<(u32, HeldProcess)>) {
        let before = std::mem::replace(&mut *self.held.lock(), chosen);
        drop(before);
    }

    /// Release the memory of each held process that is being killed, after an OOM kill seen
    /// at `seen_at`, and let go of those gone: how many were held, and how many released.
    fn release_killed(&self, seen_at: Instant) -> (usize, u32) {
        let mut held = self.held.lock();
        let before = held.len();
        let mut released = 0;
        held.retain(|(pid, process)| {
            let releasing = Instant::now();
            match process.release_memory_if_killed() {
                Ok(()) => {
                    released += 1;
                    log_released(*pid, "held", seen_at, releasing);
                    true
                }
                Err(error) if error.raw_os_error() == Some(libc::ESRCH) => false,
                // Not being killed (EINVAL), or released already (EAGAIN).
                Err(_) => true,
            }
        });
        (before, released)
    }
}

/// The choosing thread: while memory is short, every `CANDIDATES_CHOSEN_EVERY`, hold the
/// `CANDIDATES` processes with the highest OOM scores but this one; while it is not, none,
/// and it sleeps until told that memory `went_short`.
fn choose_candidates(
    candidates: &Candidates,
    store: &BatchedPageStore,
    stopped: &Receiver<()>,
    went_short: &Receiver<()>,
) {
    super::harden::ready_oom_candidates_thread();
    let own = std::process::id();
    let mut chosen_at: Option<Instant> = None;
    loop {
        let stop = if store.memory_short() {
            matches!(
                stopped.recv_timeout(super::poll_interval(store)),
                Ok(()) | Err(RecvTimeoutError::Disconnected)
            )
        } else {
            crossbeam_channel::select! {
                recv(stopped) -> _ => true,
                recv(went_short) -> _ => false,
            }
        };
        if stop {
            return;
        }
        if !store.memory_short() {
            if chosen_at.take().is_some() {
                candidates.replace(Vec::new());
            }
            continue;
        }
        if chosen_at.is_some_and(|at| at.elapsed() < CANDIDATES_CHOSEN_EVERY) {
            continue;
        }
        let mut scored: Vec<(u32, u32)> = processes(own)
            .filter_map(|pid| crate::os::oom_score(pid).map(|score| (score, pid)))
            .collect();
        scored.sort_unstable_by(|a, b| b.cmp(a));
        let chosen = scored
            .into_iter()
            .take(CANDIDATES)
            .filter_map(|(_, pid)| {
                let raw = i32::try_from(pid).ok()?;
                Some((pid, HeldProcess::open(raw).ok()?))
            })
            .collect();
        candidates.replace(chosen);
        chosen_at = Some(Instant::now());
    }
}

/// How the releasing thread learns of OOM kills.
enum KillWatch {
    /// Woken at each kill.
    Probe(OomKillProbe),
    /// The kernel's count of kills, read at every poll, and its value at the last read.
    Count { kills: OomKillCount, seen: u64 },
}

impl KillWatch {
    /// The probe where it can be attached, else the count; `None` (with the reasons in the
    /// log) where neither is there.
    fn open() -> Option<Self> {
        match OomKillProbe::attach() {
            Ok(probe) => {
                tracing::info!("OOM kills are probed at the tracepoint oom:mark_victim");
                Some(Self::Probe(probe))
            }
            Err(error) => Self::count_instead(&error),
        }
    }

    /// The count, where the probe is not there (`why_not`); `None` (with the reasons in the
    /// log) where the count cannot be read either.
    fn count_instead(why_not: &dyn std::fmt::Display) -> Option<Self> {
        let counted = OomKillCount::open().and_then(|mut kills| {
            let seen = kills.read()?;
            Ok(Self::Count { kills, seen })
        });
        match counted {
            Ok(count) => {
                tracing::info!(probe = %why_not, "no OOM kill probe: the count of OOM kills in /proc/vmstat is read at every poll instead");
                Some(count)
            }
            Err(error) => {
                tracing::warn!(probe = %why_not, %error, "OOM kills can be neither probed nor counted: the memory of processes the OOM killer kills comes back only as they exit");
                None
            }
        }
    }

    /// Wait for an OOM kill (on the probe, with no timeout; on the count, a poll of
    /// `store`'s), or until `stopped` says stop, which on the probe only `woken` (closed after
    /// it) wakes: `None` to stop, else whether a kill came. A probe whose wait fails is given
    /// up for the count (a kill is assumed then: one may have been missed, and a look where
    /// there was none only finds nothing).
    fn wait(
        &mut self,
        store: &BatchedPageStore,
        stopped: &Receiver<()>,
        woken: &UnixStream,
    ) -> Option<bool> {
        match self {
            Self::Probe(probe) => match probe.wait(Some(woken.as_fd()), None) {
                Ok(killed) => match stopped.try_recv() {
                    Err(TryRecvError::Empty) => Some(killed),
                    Ok(()) | Err(TryRecvError::Disconnected) => None,
                },
                Err(error) => {
                    tracing::warn!(%error, "waiting on the OOM kill probe failed");
                    *self = Self::count_instead(&error)?;
                    Some(true)
                }
            },
            Self::Count { kills, seen } => {
                match stopped.recv_timeout(super::poll_interval(store)) {
                    Err(RecvTimeoutError::Timeout) => {}
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => return None,
                }
                Some(match kills.read() {
                    Ok(now) if now > *seen => {
                        *seen = now;
                        true
                    }
                    _ => false,
                })
            }
        }
    }
}

/// The releasing thread's loop: for each OOM kill, the held candidates being killed (SIGKILL
/// pending) get their memory released, or, where none was, every process being killed found
/// in /proc. Any process being killed, not only the OOM killer's victims: each is about to
/// free its memory anyway, and /proc does not tell the one from the other.
fn release_victims(
    mut kills: KillWatch,
    candidates: &Candidates,
    store: &BatchedPageStore,
    stopped: &Receiver<()>,
    woken: &UnixStream,
) {
    super::harden::ready_oom_victims_thread();
    let own = std::process::id();
    // A first look, with no kill to act on: what a look touches (stack, heap) is faulted in
    // and locked now rather than at the first kill.
    release_found_in_proc(own, Instant::now());
    loop {
        match kills.wait(store, stopped, woken) {
            None => return,
            Some(false) => continue,
            Some(true) => {}
        }
        let seen_at = Instant::now();
        let (held, released_held) = candidates.release_killed(seen_at);
        // The victim was among them (each kill is of one process, and of those sharing its
        // memory): no look at /proc, which near OOM may wait seconds for memory.
        let (looked_at, released_found) = if released_held > 0 {
            (0, 0)
        } else {
            release_found_in_proc(own, seen_at)
        };
        tracing::info!(
            held,
            released_held,
            looked_at,
            released_found,
            took_ms = seen_at.elapsed().as_millis(),
            "looked for processes being killed after an OOM kill"
        );
    }
}

/// The pids in /proc, but this process's (`own`).
fn processes(own: u32) -> impl Iterator<Item = u32> {
    crate::os::numbered_entries("/proc", "").filter(move |&pid| pid != own)
}

fn log_released(pid: u32, how: &str, seen_at: Instant, releasing: Instant) {
    tracing::info!(
        pid,
        how,
        after_kill_seen_ms = releasing.duration_since(seen_at).as_millis(),
        took_ms = releasing.elapsed().as_millis(),
        "released the memory of a process being killed, ahead of its exit"
    );
}

/// Release the memory of every process being killed found in /proc, but this one (`own`),
/// after an OOM kill seen at `seen_at`: how many processes were looked at, and how many had
/// their memory released.
fn release_found_in_proc(own: u32, seen_at: Instant) -> (u32, u32) {
    let (mut looked_at, mut released) = (0_u32, 0_u32);
    for pid in processes(own) {
        looked_at += 1;
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        if !crate::os::being_killed(&status) {
            continue;
        }
        let Some(process) = i32::try_from(pid)
            .ok()
            .and_then(|raw| HeldProcess::open(raw).ok())
        else {
            continue;
        };
        let releasing = Instant::now();
        match process.release_memory_if_killed() {
            Ok(()) => {
                released += 1;
                log_released(pid, "found in /proc", seen_at, releasing);
            }
            // Exited meanwhile (ESRCH), or its memory is being freed already (EINVAL).
            Err(error) if matches!(error.raw_os_error(), Some(libc::ESRCH | libc::EINVAL)) => {
                tracing::info!(pid, %error, "a process being killed had no memory left to release");
            }
            Err(error) => {
                tracing::warn!(pid, %error, "could not release the memory of a process being killed");
            }
        }
    }
    (looked_at, released)
}
