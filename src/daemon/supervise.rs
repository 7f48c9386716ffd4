//! The supervisor: the process `create` runs (in the foreground under systemd, or the one
//! `create` detaches). It serves nothing itself: it starts the serving process (this program
//! again, `create ... --serve-child`), passes its readiness on (sd_notify, once), passes a
//! stop (`super::STOP_SIGNALS`) on to it as SIGTERM and a compaction (SIGUSR2) as it is, and
//! keeps a standby (`--serve-child --standby`) ready beside it: when the serving process dies
//! by a signal (`kill -9`, a crash), the standby takes the device over at once, which the
//! kernel keeps quiesced meanwhile, and a new standby is made.
//!
//! Why a standby made in advance: while the device has no daemon, every task that reclaims
//! memory by swapping to it blocks until it has one again (for a tag of the quiesced queue).
//! A process started only then must fault in its memory (program, heap, stacks, buffers) in
//! that state; under memory pressure its own reclaim blocks on the device it is about to
//! serve, and nothing ever moves again (seen in the VM). The standby has everything in place;
//! taking over costs it next to no memory.
//!
//! Why a process of its own: whatever restarts the daemon must not itself need swap while the
//! device waits for a daemon, and systemd (PID 1) may have pages out on this very device. The
//! supervisor locks its memory, faults in its stack and heap at start, is an I/O flusher (its
//! reclaim, and its children's from their first instruction on, never waits for swap-out),
//! and afterwards only waits in poll(2), reaps its children and starts the next from a
//! command made in advance.
//!
//! Reload (SIGHUP, `systemctl reload`): the way to swap in a new build without the device
//! ever waiting for a process to start. The supervisor starts a standby of the binary now on
//! disk beside the serving process; once it is ready it replaces the standby, the serving
//! process is asked (`HANDOVER=1` on its channel) to hand the device over, and the new standby
//! takes it over as after a death. A start that fails, or a standby that ends before it is
//! ready, leaves the running build serving. Later restarts run the binary on disk; the
//! supervisor itself stays (a restart of the unit replaces it). How each reload ended is
//! written for the process that sent its SIGHUP (`stats::ReloadOutcomes`: `trueno-ublk
//! reload` reads it). A SIGHUP the kernel sends (a terminal hung up) is no reload.
//!
//! Why exec and not fork: the serving process is multi-threaded and owns everything the I/O
//! path needs; a fresh program image starts clean, and `/proc/self/exe` names the binary this
//! supervisor runs, so a crash restart runs the same build even if a package upgrade replaced
//! the file on disk (the upgrade takes effect at the unit's next start).

#![forbid(unsafe_code)]

use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use signal_hook::consts::{SIGCHLD, SIGHUP, SIGUSR1, SIGUSR2};
use signal_hook::iterator::exfiltrator::origin::{Origin, WithOrigin};
use signal_hook::iterator::SignalsInfo;

use super::detach::{Notifier, HANDOVER, TAKEOVER};
use super::signal_wake::SignalWake;
use super::{io_error, DaemonError, RUN_DIR, STOP_SIGNALS};
use crate::config::DeviceSettings;
use crate::stats::{ReloadOutcome, ReloadOutcomes};

/// Tells the serving process who its supervisor is (its parent's pid), so that it can tell
/// whether that parent is still there when it starts.
pub(super) const SUPERVISOR_ENV: &str = "TRUENO_UBLK_SUPERVISOR";

/// Set for a reload's standby: a config file that does not read fails it (the running build
/// serves on, with its settings), where other serving processes of a device that exists
/// serve without the file (`super::resolve_settings`). An environment variable, not an
/// argument: the binary on disk may be of another build, and an older one ignores it.
pub(super) const RELOAD_ENV: &str = "TRUENO_UBLK_RELOAD";
/// How long a reload's standby may take to be ready before the reload fails: meanwhile the
/// device has no standby (the reload dismissed it) and further reloads are refused. A standby
/// is ready in about a second, several under emulation.
pub(crate) const RELOAD_READY_LIMIT: Duration = Duration::from_secs(60);
/// Processes started at once after deaths by a signal within `RESTART_WINDOW`; after more
/// deaths, each start waits twice as long as the one before (from `FIRST_BACKOFF` up to
/// `MAX_BACKOFF`): something kills every new process (a bug that crashes it on resume, say),
/// and starting processes flat out would only burn the CPU. A standby that is ready takes the
/// device over at once whatever the count (that costs next to nothing); what waits is the
/// start of the next process. Never given up: while no process serves the device, its I/O
/// waits, so the supervisor keeps trying.
const QUICK_RESTARTS: usize = 5;
const RESTART_WINDOW: Duration = Duration::from_secs(60);
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// Deaths remembered: enough to tell how deep into backing off the supervisor is.
const DEATHS_KEPT: usize = 16;

/// What a serving process tells the supervisor, one datagram per event: `ADDED=1` with
/// `DEVICE=N` once it has added a new device (before the device goes live), `READY=1` with
/// `DEVICE=N`, `STATUS=/dev/ublkbN` and `PID=P` once the device is live (at start and after
/// each resume), `STANDBY=1` when a standby is ready, `STATUS=...` with `ERRNO=...` when it
/// fails. The supervisor answers a standby `TAKEOVER=1` when it is to take the device over.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ChildMessage<'a> {
    pub added: bool,
    pub ready: bool,
    pub standby: bool,
    pub device: Option<u32>,
    pub status: Option<&'a str>,
    pub errno: Option<&'a str>,
    pub pid: Option<u32>,
}

impl<'a> ChildMessage<'a> {
    pub(super) fn parse(text: &'a str) -> Self {
        let mut message = Self::default();
        for line in text.lines() {
            match line.split_once('=') {
                Some(("ADDED", "1")) => message.added = true,
                Some(("READY", "1")) => message.ready = true,
                Some(("STANDBY", "1")) => message.standby = true,
                Some(("DEVICE", id)) => message.device = id.parse().ok(),
                Some(("STATUS", status)) => message.status = Some(status),
                Some(("ERRNO", errno)) => message.errno = Some(errno),
                Some(("PID", pid)) => message.pid = pid.parse().ok(),
                _ => {}
            }
        }
        message
    }
}

/// Deaths by a signal within the last `RESTART_WINDOW`, without allocating.
#[derive(Debug, Default)]
struct Restarts {
    at: [Option<Instant>; DEATHS_KEPT],
    next: usize,
}

impl Restarts {
    /// Record a death at `now`.
    fn record(&mut self, now: Instant) {
        self.at[self.next] = Some(now);
        self.next = (self.next + 1) % DEATHS_KEPT;
    }

    /// How long a process started at `now` should wait first.
    fn delay(&self, now: Instant) -> Duration {
        let recent = self
            .at
            .iter()
            .flatten()
            .filter(|&&t| now.duration_since(t) < RESTART_WINDOW)
            .count();
        match recent.checked_sub(QUICK_RESTARTS + 1) {
            None => Duration::ZERO,
            Some(beyond) => FIRST_BACKOFF
                .saturating_mul(1 << beyond.min(8))
                .min(MAX_BACKOFF),
        }
    }
}

/// The supervisor's signals, each with the process that sent it (a reload's outcome goes to
/// the process that asked for it: `ReloadOutcomes`).
type SupervisorSignals = SignalsInfo<WithOrigin>;

/// Why a reload is refused when this process cannot find its own binary's path.
fn unknown_binary(error: &std::io::Error) -> String {
    format!("cannot tell which binary this is: {error}")
}

/// The process that sent a signal; `None` for one the kernel sent. A SIGHUP of the kernel's is
/// the hang-up of a terminal (that of a `create --foreground` closed), not a reload: a swap
/// device's daemon goes on as it was.
fn sender(origin: &Origin) -> Option<i32> {
    origin.process.as_ref().map(|process| process.pid)
}

/// Wait `delay`, or less if one of `STOP_SIGNALS` comes: then true. A process's SIGHUP (a
/// reload) seen meanwhile adds that process to `reloads_asked`.
fn wait_or_stop(
    wake: &SignalWake,
    signals: &mut SupervisorSignals,
    delay: Duration,
    reloads_asked: &mut Vec<i32>,
) -> bool {
    let deadline = Instant::now() + delay;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut fds = [PollFd::new(
            std::os::fd::AsFd::as_fd(wake),
            PollFlags::POLLIN,
        )];
        let timeout = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
        let _ = poll(&mut fds, timeout);
        wake.drain();
        let mut stop = false;
        for origin in signals.pending() {
            stop |= STOP_SIGNALS.contains(&origin.signal);
            if origin.signal == SIGHUP {
                // One answer per process: a flood of SIGHUPs from one adds it once.
                if let Some(asker) = sender(&origin).filter(|pid| !reloads_asked.contains(pid)) {
                    reloads_asked.push(asker);
                }
            }
        }
        if stop {
            return true;
        }
    }
}

/// A serving process (or a standby) and the supervisor's end of its channel.
struct ServingProcess {
    child: Child,
    channel: UnixDatagram,
}

impl ServingProcess {
    /// Start one from `command`; its stdin is its end of a new channel.
    fn spawn(command: &mut Command) -> Result<Self, DaemonError> {
        let (channel, theirs) =
            UnixDatagram::pair().map_err(io_error("making the serving process's channel"))?;
        channel
            .set_nonblocking(true)
            .map_err(io_error("making the serving process's channel"))?;
        let child = command
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .spawn()
            .map_err(io_error("starting the serving process"))?;
        Ok(Self { child, channel })
    }

    fn signal(&self, signal: Signal) {
        let _ = kill(child_pid(&self.child), signal);
    }

    /// Tell a standby to take the device over; `then_stop`: and to stop it after (SIGTERM
    /// behind the word, which it reads first).
    fn take_over(&self, then_stop: bool) {
        if let Err(error) = self.channel.send(TAKEOVER.as_bytes()) {
            // Never told, it would wait as a standby while the device waits for it. Ended
            // instead, the loop sees it die: a new process resumes the device, or, while
            // stopping, the stop ends with the device handed over (the next start resumes it).
            tracing::error!(pid = self.child.id(), %error, then_stop, "the standby could not be told to take the device over; it is ended");
            self.signal(Signal::SIGKILL);
            return;
        }
        if then_stop {
            self.signal(Signal::SIGTERM);
        }
    }

    /// Kill it and reap it within `limit`; the child, if it has not ended by then.
    fn kill_and_reap_within(mut self, limit: Duration) -> Option<Child> {
        self.signal(Signal::SIGKILL);
        let deadline = Instant::now() + limit;
        loop {
            match self.child.try_wait() {
                // Ended and reaped; or not our child to wait for any more (nothing to keep).
                Ok(Some(_)) | Err(_) => return None,
                Ok(None) if Instant::now() >= deadline => return Some(self.child),
                Ok(None) => std::thread::sleep(DISMISS_POLL),
            }
        }
    }
}

/// How long `Dismissed::dismiss` waits for a killed process to end: one ends within
/// milliseconds, but one asleep in the kernel where a kill does not reach it at once (an
/// uninterruptible wait in reclaim, say) may take longer, and meanwhile the supervisor would
/// answer no signal and restart nothing.
const DISMISS_WAIT: Duration = Duration::from_secs(1);
/// How often that wait looks.
const DISMISS_POLL: Duration = Duration::from_millis(5);

/// Standbys (and reloads' standbys) dismissed: a standby that never took the device over
/// holds nothing, so it is killed and reaped; one that had not ended within `DISMISS_WAIT` is
/// kept here and reaped once it has (its end wakes the supervisor with SIGCHLD).
#[derive(Default)]
struct Dismissed {
    unreaped: Vec<Child>,
}

impl Dismissed {
    fn dismiss(&mut self, process: ServingProcess) {
        self.dismiss_within(process, DISMISS_WAIT);
    }

    fn dismiss_within(&mut self, process: ServingProcess, limit: Duration) {
        let pid = process.child.id();
        if let Some(child) = process.kill_and_reap_within(limit) {
            tracing::warn!(
                pid,
                waited_ms = limit.as_millis(),
                "a dismissed standby has not ended since it was killed (asleep in the kernel); it is reaped when it ends"
            );
            self.unreaped.push(child);
        }
    }

    /// Reap those that have ended since.
    fn reap(&mut self) {
        self.unreaped.retain_mut(|child| {
            let ended = !matches!(child.try_wait(), Ok(None));
            if ended {
                tracing::info!(pid = child.id(), "a dismissed standby ended");
            }
            !ended
        });
    }
}

/// Supervise serving processes for the device of `settings` until the device is gone or the
/// supervisor is told to stop: 0 when the last one exited 0 (the device was deleted, or handed
/// over on a stop), a failure otherwise.
pub(super) fn supervise(
    settings: &DeviceSettings,
    notifier: &Notifier,
    detached_log: Option<&Path>,
) -> Result<(), DaemonError> {
    crate::daemon::harden::lock_memory();
    // Never the OOM killer's pick: its death ends the serving process and the standby with it
    // (seen in the VM: with the scatter run's workers killed, the supervisor, at the default
    // score, went next, and the device waited with no daemon).
    crate::daemon::harden::protect_from_oom_killer();
    crate::mem::configure_heap();
    // Fault in (and so lock) the stack and heap the restart path will use.
    crate::mem::prepare_io_thread();
    // Inherited by the children from their start: exec and a program's start-up fault in
    // memory, and a reclaim that swaps out to a device waiting for its daemon waits forever.
    if let Err(error) = crate::os::set_io_flusher() {
        tracing::warn!(%error, "PR_SET_IO_FLUSHER failed: a serving process starting under memory pressure may wait on its own device");
    }

    // Before any child: it inherits the ignoring (see `os::ignore_job_control`).
    if let Err(error) = crate::os::ignore_job_control() {
        tracing::warn!(%error, "could not ignore terminal job control: Ctrl-Z in the daemon's terminal would stop it");
    }
    // Signals wake poll(2) through a socket; `Signals` then says which arrived. Each has a
    // handler, so that none ends the supervisor (SIGUSR2 is the serving process's, passed
    // on; SIGUSR1 is ignored), and a child's exec resets it.
    let handled: Vec<i32> = STOP_SIGNALS
        .iter()
        .chain(&[SIGHUP, SIGCHLD, SIGUSR1, SIGUSR2])
        .copied()
        .collect();
    let mut signals =
        SupervisorSignals::new(&handled).map_err(io_error("installing signal handlers"))?;
    let wake = SignalWake::new(&handled).map_err(io_error("installing signal handlers"))?;

    // `--id` is in the arguments when the user gave it; otherwise it is learnt below, and a
    // standby (which must know the device) is made only then.
    let mut device = settings.id;
    // Held for this supervisor's life (see `claim_device`); taken once the id is known.
    let mut _claim = device.map(claim_device).transpose()?;
    let mut reloads = ReloadOutcomes::default();
    if let Some(id) = device {
        reloads.set_device(Path::new(RUN_DIR), id);
    }
    // The id the kernel picked, for the children's `--id` (none while the user gave it).
    let mut learnt_id = None;
    // The binary the children run: this one (even if a package upgrade replaced the file on
    // disk) until a reload switches to the file on disk (`installed`).
    let mut program = PathBuf::from("/proc/self/exe");
    let installed = std::env::current_exe();
    let (mut serving_command, mut standby_command) = child_commands(&program, None, device, false);
    let mut serving = ServingProcess::spawn(&mut serving_command)?;
    let mut standby: Option<ServingProcess> = None;
    // A reload (SIGHUP): a standby of the binary on disk, readied while the serving process
    // serves on; once ready it replaces the standby and the serving process is asked to hand
    // the device over (`handing_over`), which it then takes over.
    let mut incoming: Option<ServingProcess> = None;
    // When the reload fails if `incoming` is not ready by then (`RELOAD_READY_LIMIT`).
    let mut incoming_deadline: Option<Instant> = None;
    let mut handing_over = false;
    // A reload's standby of the new build takes (or took) the device over: the children
    // become the binary on disk once it serves (its READY=1), not before. A build that cannot
    // serve the store (one that cannot read its layout, say, or one that fails in its resume)
    // fails that takeover, and the next start must then be of this binary, which can:
    // switched at once, every restart would be of the failing build, for good.
    let mut switch_when_served = false;
    // When to make the next standby: once the device is live, later while backing off.
    let mut standby_due: Option<Instant> = None;
    let mut ready = false;
    // The new device the serving process added (`ADDED=1`), until it is live.
    let mut added: Option<u32> = None;
    let mut stopping = false;
    let mut restarts = Restarts::default();
    // Standbys that failed to start or died, apart: a standby that keeps failing (no memory
    // or tasks for it) must not slow the cold restart after the serving process's crash.
    let mut standby_failures = Restarts::default();
    let mut dismissed = Dismissed::default();
    let mut buffer = [0u8; 2048];
    let result = loop {
        {
            let mut fds = [
                PollFd::new(std::os::fd::AsFd::as_fd(&wake), PollFlags::POLLIN),
                PollFd::new(
                    std::os::fd::AsFd::as_fd(&serving.channel),
                    PollFlags::POLLIN,
                ),
                PollFd::new(
                    std::os::fd::AsFd::as_fd(
                        standby.as_ref().map_or(&serving.channel, |s| &s.channel),
                    ),
                    PollFlags::POLLIN,
                ),
                PollFd::new(
                    std::os::fd::AsFd::as_fd(
                        incoming.as_ref().map_or(&serving.channel, |s| &s.channel),
                    ),
                    PollFlags::POLLIN,
                ),
            ];
            let wake_at = match (
                standby_due,
                incoming_deadline.filter(|_| incoming.is_some()),
            ) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let timeout = wake_at.map_or(PollTimeout::NONE, |at| {
                PollTimeout::try_from(at.saturating_duration_since(Instant::now()))
                    .unwrap_or(PollTimeout::MAX)
            });
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(errno) => {
                    break Err(DaemonError::Io {
                        what: "waiting for the serving process".into(),
                        source: errno.into(),
                    })
                }
            }
        }
        wake.drain();
        dismissed.reap();
        for origin in signals.pending() {
            let signal = origin.signal;
            if signal == SIGUSR2 {
                // A compaction asked of the unit's main process (`systemctl kill -s USR2
                // --kill-whom=main`): the serving process's to do.
                serving.signal(Signal::SIGUSR2);
            } else if STOP_SIGNALS.contains(&signal) {
                if !stopping {
                    stopping = true;
                    notifier.send("STOPPING=1");
                    tracing::info!(
                        signal,
                        pid = serving.child.id(),
                        "stopping: passing the signal on to the serving process"
                    );
                }
                serving.signal(Signal::SIGTERM);
                // The standby stays until the serving process has ended: during a reload's
                // hand-over it is the new build's, and the serving process may have handed
                // the device over already; and a serving process may die as the stop comes
                // (a kill -9 a moment before). Either way the standby then takes the device
                // over and is stopped in its turn (below), which deletes a device nothing
                // uses, where dismissing it would leave that device quiesced, its memory
                // locked. Once the serving process has stopped, it goes with the supervisor.
                if let Some(incoming) = incoming.take() {
                    dismissed.dismiss(incoming);
                    reloads.failed("stopping: the device's unit or daemon was told to stop");
                }
            } else if signal == SIGHUP {
                let Some(asker) = sender(&origin) else {
                    tracing::info!("SIGHUP from the kernel (a terminal hung up): not a reload");
                    continue;
                };
                let refused = if stopping {
                    Some("stopping")
                } else if incoming.is_some() || handing_over {
                    Some("a reload is under way")
                } else if !ready || device.is_none() {
                    Some("the device is not live yet")
                } else if serving.child.try_wait().ok().flatten().is_some() {
                    // Dead already (its end is handled below, after the signals): a reload
                    // now would dismiss the ready standby and leave the takeover to a
                    // process that still has to start, with the device waiting meanwhile.
                    Some("the serving process has just ended; its standby takes the device over first")
                } else {
                    None
                };
                match (refused, &installed, device) {
                    (Some(why), _, _) => {
                        tracing::warn!(why, "reload (SIGHUP) ignored");
                        reloads.answer(asker, &ReloadOutcome::Failed(why.into()));
                    }
                    (None, Err(error), _) => {
                        let why = unknown_binary(error);
                        tracing::warn!(why, "reload (SIGHUP) ignored");
                        reloads.answer(asker, &ReloadOutcome::Failed(why));
                    }
                    (None, Ok(path), Some(_)) => {
                        tracing::info!(binary = %path.display(), "reload: starting a standby of the binary on disk in place of the current one; the serving process hands the device over once it is ready");
                        // The current standby goes first: two at once would lock a second
                        // standby's memory, and with RAM at the watermark that was an OOM
                        // kill in the VM. Meanwhile the new one takes over if the serving
                        // process dies.
                        if let Some(old) = standby.take() {
                            dismissed.dismiss(old);
                        }
                        standby_due = None;
                        // A failed start fails the reload, never the supervisor.
                        reloads.asked(asker);
                        incoming = ServingProcess::spawn(child_command(path, learnt_id, true).env(RELOAD_ENV, "1"))
                            .map_err(|error| {
                                tracing::error!(%error, "reload failed: cannot start the binary on disk; the device is still served by the running build");
                                reloads.failed(&format!("cannot start the binary on disk: {error}"));
                            })
                            .ok();
                        if incoming.is_none() {
                            standby_due = Some(Instant::now());
                        }
                        incoming_deadline = Some(Instant::now() + RELOAD_READY_LIMIT);
                    }
                    (None, Ok(_), None) => {}
                }
            }
        }
        // Reaped before its words are read: all it said before it ended is then read below
        // (a READY=1 just before a death makes the death one after the start).
        let ended = serving
            .child
            .try_wait()
            .map_err(io_error("waiting for the serving process"))?;
        while let Ok(n) = serving.channel.recv(&mut buffer) {
            let Ok(text) = std::str::from_utf8(&buffer[..n]) else {
                continue;
            };
            let message = ChildMessage::parse(text);
            if message.errno.is_some() {
                // The serving process failed; pass its reason on (`create` prints it).
                notifier.send(text);
            }
            if message.added && !ready {
                added = message.device;
            }
            if !message.ready {
                continue;
            }
            let path = message.status.unwrap_or_default();
            if std::mem::take(&mut switch_when_served) {
                if let Ok(installed) = &installed {
                    tracing::info!(binary = %installed.display(), "reload: the new build serves the device; its binary runs the next processes");
                    reloads.done();
                    program = installed.clone();
                    (serving_command, standby_command) =
                        child_commands(&program, learnt_id, device, true);
                }
            }
            if !ready {
                ready = true;
                added = None;
                if device.is_none() {
                    // The kernel picked the id: every later serving process resumes that one.
                    device = message.device;
                    learnt_id = device;
                    if let Some(id) = device {
                        reloads.set_device(Path::new(RUN_DIR), id);
                        // A new id nobody else had: a claim on it fails only if the run
                        // directory does, which the device does not need.
                        _claim = claim_device(id)
                            .inspect_err(|error| tracing::warn!(%error, "no claim on the device: a second `create` of it while no process serves it would not be refused"))
                            .ok();
                    }
                }
                (serving_command, standby_command) =
                    child_commands(&program, learnt_id, device, true);
                if let (Some(log), Some(id)) = (detached_log, message.device) {
                    // The previous daemon's log (one that was killed, say) is kept as
                    // `.log.1`: what it said before it went is what an administrator looks for.
                    let path = format!("{RUN_DIR}/ublkb{id}.log");
                    let _ = std::fs::rename(&path, format!("{path}.1"));
                    let _ = std::fs::rename(log, path);
                }
                if detached_log.is_none() {
                    // Not `println!`: it panics once the reader of stdout has gone (a pipe
                    // into a logger that ended), and this process must outlive its readers.
                    let _ = writeln!(std::io::stdout(), "{path}");
                }
                notifier.send(&format!(
                    "READY=1\nSTATUS={path}\nMAINPID={}",
                    std::process::id()
                ));
            } else {
                notifier.send(&format!(
                    "STATUS={path} (resumed, served by pid {})",
                    message.pid.unwrap_or(0)
                ));
            }
            // The device is live: the moment to make the next standby.
            if standby.is_none() {
                let now = Instant::now();
                standby_due = Some(now + restarts.delay(now).max(standby_failures.delay(now)));
            }
        }
        if standby_due.is_some_and(|due| due <= Instant::now()) {
            standby_due = None;
            if standby.is_none() && incoming.is_none() && !stopping {
                if let Some(command) = standby_command.as_mut() {
                    // A start that fails (no memory or tasks for a fork, say) is tried again
                    // later: the serving process serves on meanwhile.
                    match ServingProcess::spawn(command) {
                        Ok(process) => standby = Some(process),
                        Err(error) => {
                            tracing::error!(%error, "cannot start a standby; trying again later");
                            standby_failures.record(Instant::now());
                            standby_due = Some(
                                Instant::now()
                                    + standby_failures.delay(Instant::now()).max(FIRST_BACKOFF),
                            );
                        }
                    }
                }
            }
        }
        if let Some(process) = incoming.as_mut() {
            let mut is_ready = false;
            while let Ok(n) = process.channel.recv(&mut buffer) {
                is_ready |=
                    ChildMessage::parse(std::str::from_utf8(&buffer[..n]).unwrap_or_default())
                        .standby;
            }
            if is_ready {
                if let Some(process) = incoming.take() {
                    tracing::info!(
                        pid = process.child.id(),
                        serving = serving.child.id(),
                        "reload: the new standby is ready; asking the serving process to hand the device over"
                    );
                    if let Some(old) = standby.replace(process) {
                        dismissed.dismiss(old);
                    }
                    // The next processes are of the new build once it serves, not before: a
                    // takeover it fails then leaves this build, which serves, to start again.
                    switch_when_served = true;
                    if let Err(error) = serving.channel.send(HANDOVER.as_bytes()) {
                        // Dead already (its end is gone): the new standby takes over below,
                        // as after any death. Alive, it serves on with the new build's
                        // process as its standby, and the command's wait runs out.
                        tracing::warn!(%error, "reload: the serving process could not be asked to hand the device over");
                    }
                    // So that it looks at once, not at its next poll.
                    serving.signal(Signal::SIGHUP);
                    handing_over = true;
                }
            } else if let Ok(Some(status)) = process.child.try_wait() {
                tracing::error!(pid = process.child.id(), %status, "reload failed: the standby of the binary on disk ended before it was ready (its log says why); the device is still served by the running build");
                reloads.failed(&format!(
                    "the standby of the binary on disk ended before it was ready ({status})"
                ));
                incoming = None;
                standby_due = Some(Instant::now());
            } else if incoming_deadline.is_some_and(|deadline| deadline <= Instant::now()) {
                tracing::error!(
                    pid = process.child.id(),
                    limit_s = RELOAD_READY_LIMIT.as_secs(),
                    "reload failed: the standby of the binary on disk was not ready in time (its log may say why); the device is still served by the running build"
                );
                reloads.failed(&format!(
                    "the standby of the binary on disk was not ready within {} s",
                    RELOAD_READY_LIMIT.as_secs()
                ));
                if let Some(process) = incoming.take() {
                    dismissed.dismiss(process);
                }
                standby_due = Some(Instant::now());
            }
        }
        if let Some(process) = standby.as_mut() {
            while let Ok(n) = process.channel.recv(&mut buffer) {
                if ChildMessage::parse(std::str::from_utf8(&buffer[..n]).unwrap_or_default())
                    .standby
                {
                    tracing::info!(pid = process.child.id(), "standby ready");
                }
            }
            if let Ok(Some(status)) = process.child.try_wait() {
                tracing::warn!(pid = process.child.id(), %status, "the standby ended; a crash of the serving process now waits for a new process to start");
                if std::mem::take(&mut switch_when_served) {
                    // The reload's new build, ready, died before it served: the process that
                    // takes over next is of the running build, and so are the ones after it.
                    tracing::error!("reload failed: the new build's standby ended before it took the device over; the running build's next process takes it over");
                    reloads.failed("the new build's standby ended before it took the device over");
                }
                standby = None;
                standby_failures.record(Instant::now());
                standby_due = Some(Instant::now() + standby_failures.delay(Instant::now()));
            }
        }
        let Some(status) = ended else {
            continue;
        };
        // A device it added and died with, by a signal (its own clean-up never ran), before
        // the device went live: nobody was told of it, and left behind it would keep its id
        // and its store's locked memory. Removed, and the start fails: a start that dies is
        // the administrator's (or the service manager's) to repeat, not a loop's.
        if let (Some(signal), Some(id)) = (status.signal(), added.take()) {
            let removed = remove_unstarted(id, serving.child.id());
            if let Err(error) = &removed {
                tracing::error!(id, %error, "the device the dead serving process added could not be removed");
            }
            if !stopping {
                break Err(DaemonError::Daemon(match removed {
                    Ok(false) => format!(
                        "the serving process was killed by signal {signal} before device {id} \
                         went live; device {id} is no longer as it left it (deleted and made \
                         again meanwhile?) and was left alone"
                    ),
                    Ok(true) => format!(
                        "the serving process was killed by signal {signal} before device {id} \
                         went live; the device and its memory were removed: create it again"
                    ),
                    Err(error) => format!(
                        "the serving process was killed by signal {signal} before device {id} \
                         went live, and the device could not be removed ({error}): delete it \
                         with `trueno-ublk delete --id {id}`"
                    ),
                }));
            }
        }
        let signal = match (status.code(), status.signal()) {
            (Some(0), _) if handing_over && standby.is_some() => {
                handing_over = false;
                if let Some(process) = standby.take() {
                    // While stopping, it takes the device over first, then stops it.
                    process.take_over(stopping);
                    tracing::info!(
                        pid = serving.child.id(),
                        standby = process.child.id(),
                        "reload: the serving process handed the device over; the new build's standby takes it over"
                    );
                    serving = process;
                }
                continue;
            }
            // Ended without being asked to stop, its device still there: handed over to
            // nobody (a `delete` that found it unused while a swapon came, a SIGTERM sent to it
            // alone, a reload whose new standby died meanwhile) or failed once live (a queue
            // that panicked). The device waits, quiesced, perhaps with swap on it, and no
            // service manager would restart an exit 0: taken over as after a death.
            (Some(code), _)
                if !stopping && ready && device.is_some_and(crate::ublk::device::device_exists) =>
            {
                tracing::error!(
                    pid = serving.child.id(),
                    code,
                    "the serving process ended on its own and left its device; it is taken over as after a death"
                );
                None
            }
            // A process that failed to take over a device deleted meanwhile (`trueno-ublk
            // delete` while it was quiesced for the takeover, or a stop during a reload's
            // hand-over that deleted it first): nothing is left to serve, and a failure would
            // have the service manager's restart answer the delete with a new, empty device.
            (Some(code), _)
                if code != 0
                    && ready
                    && device.is_some_and(|id| !crate::ublk::device::device_exists(id)) =>
            {
                tracing::info!(
                    pid = serving.child.id(),
                    code,
                    "the device was deleted while a process was taking it over; nothing is left to serve"
                );
                break Ok(());
            }
            (Some(0), _) => break Ok(()),
            (Some(code), _) => {
                break Err(DaemonError::Daemon(format!(
                    "the serving process failed (exit status {code}); its log says why"
                )))
            }
            // Killed by the SIGTERM passed on to it: it had not installed its handlers yet,
            // the first thing a serving process does, so it had done nothing with the device.
            // A stop like any other, not a failed one.
            (_, Some(libc::SIGTERM)) if stopping => {
                tracing::info!(
                    pid = serving.child.id(),
                    "the serving process was stopped before it had started serving"
                );
                break Ok(());
            }
            (_, Some(signal)) if stopping => {
                if let Some(process) = standby.take() {
                    // Died as the stop came: its standby (kept, above) takes the device over
                    // and is stopped in its turn.
                    process.take_over(true);
                    tracing::warn!(
                        pid = serving.child.id(),
                        signal,
                        standby = process.child.id(),
                        "the serving process died as the daemon was stopping; its standby takes the device over to stop it"
                    );
                    serving = process;
                    continue;
                }
                break Err(DaemonError::Daemon(format!(
                    "the serving process was killed by signal {signal} while stopping"
                )));
            }
            // Killed before it served, with no device to resume (none added; one it added
            // was removed above): a start that dies is the administrator's to repeat.
            (_, Some(signal))
                if !ready && !device.is_some_and(crate::ublk::device::device_exists) =>
            {
                break Err(DaemonError::Daemon(format!(
                    "the serving process was killed by signal {signal} before it added its \
                     device: create it again"
                )));
            }
            (_, signal) => signal,
        };
        // A death while handing over for a reload ends the same way: the new build's standby
        // takes the device over.
        handing_over = false;
        let dead = serving.child.id();
        restarts.record(Instant::now());
        // During a reload the new build's standby is the only one (not yet ready: `incoming`;
        // ready: `standby` with a switch pending): it takes over, and the next ones are of its
        // binary once it serves (`switch_when_served`). One that died before it served leaves
        // this binary in place.
        let was_switching = switch_when_served;
        switch_when_served =
            (switch_when_served && standby.is_some()) || (standby.is_none() && incoming.is_some());
        if was_switching && !switch_when_served {
            // The new build's process took the device over and ended before it served it.
            tracing::error!(pid = dead, "reload failed: the new build's process ended before it served the device; this build's next process takes it over");
            reloads.failed("the new build's process ended before it served the device (its log says why); the running build's next process takes it over");
        }
        if let Some(process) = standby.take().or_else(|| incoming.take()) {
            // It takes over as soon as it has its ring ready; if it is still making it, as
            // soon as that is done.
            process.take_over(false);
            tracing::warn!(
                pid = dead,
                signal = signal.unwrap_or(0),
                standby = process.child.id(),
                "the serving process died; the standby takes the device over"
            );
            serving = process;
            continue;
        }
        tracing::warn!(
            pid = dead,
            signal = signal.unwrap_or(0),
            "the serving process died and no standby is ready; starting a new one to resume the device"
        );
        // Started again however often the start fails (no memory or tasks for a fork, say):
        // while no process serves the device, its I/O waits.
        let started = loop {
            let delay = restarts.delay(Instant::now());
            if !delay.is_zero() {
                tracing::warn!(
                    ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                    "the serving process keeps dying; waiting before the next start"
                );
                notifier.send(
                    "STATUS=no process serves the device: its serving processes keep ending (see the log); trying again",
                );
                let mut reloads_asked = Vec::new();
                if wait_or_stop(&wake, &mut signals, delay, &mut reloads_asked) {
                    break None;
                }
                // A reload while no process serves has nothing to hand over; what it asks
                // for is the binary on disk (a fixed build, say), which the next start runs:
                // done as far as the supervisor goes (the command waits for that start).
                if !reloads_asked.is_empty() {
                    match &installed {
                        Ok(path) => {
                            tracing::info!(binary = %path.display(), "reload while no process serves the device: the next start runs the binary on disk");
                            program = path.clone();
                            (serving_command, standby_command) =
                                child_commands(&program, learnt_id, device, ready);
                            switch_when_served = false;
                            for asker in reloads_asked {
                                reloads.answer(asker, &ReloadOutcome::Done);
                            }
                        }
                        Err(error) => {
                            let why = unknown_binary(error);
                            tracing::warn!(why, "reload (SIGHUP) ignored");
                            for asker in reloads_asked {
                                reloads.answer(asker, &ReloadOutcome::Failed(why.clone()));
                            }
                        }
                    }
                }
            }
            match ServingProcess::spawn(&mut serving_command) {
                Ok(process) => break Some(process),
                Err(error) => {
                    tracing::error!(%error, "cannot start a serving process; trying again");
                    restarts.record(Instant::now());
                }
            }
        };
        let Some(process) = started else {
            break Err(DaemonError::Daemon(
                "stopped while no process served the device: it stays quiesced with its pages \
                 until the next start"
                    .into(),
            ));
        };
        serving = process;
    };
    for process in [standby.take(), incoming.take()].into_iter().flatten() {
        dismissed.dismiss(process);
    }
    reloads.remove();
    result
}

/// How long a supervisor waits for another's claim on its device to go (`claim_device`): one
/// told to stop (an upgrade's hand-over, a unit's restart) ends within seconds.
const CLAIM_WAIT: Duration = Duration::from_secs(20);

/// This supervisor's claim on device `id`, for its whole life: an exclusive lock on
/// `RUN_DIR/ublkbN.lock`, which the kernel lets go however the supervisor ends (the descriptor
/// is close-on-exec: no child holds it). Without it, a second `create` of the device while
/// this supervisor starts a new serving process (backing off after deaths), its device
/// quiesced, would resume the device beside it: two daemons recovering one device. Waits up
/// to `CLAIM_WAIT` for a supervisor that is ending.
fn claim_device(id: u32) -> Result<std::fs::File, DaemonError> {
    std::fs::create_dir_all(RUN_DIR).map_err(io_error(format!("creating {RUN_DIR}")))?;
    super::detach::set_mode(Path::new(RUN_DIR), 0o700)?;
    let path = super::claim_path(id);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_error(format!("opening {path}")))?;
    let deadline = Instant::now() + CLAIM_WAIT;
    loop {
        match file.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                return Err(DaemonError::Daemon(format!(
                    "device {id} has a daemon already: its supervisor (pid {}) holds {path} and \
                     resumes the device itself; wait for it, or stop that daemon first",
                    holder.trim()
                )));
            }
            Err(std::fs::TryLockError::Error(error)) => {
                return Err(io_error(format!("locking {path}"))(error))
            }
        }
    }
    // Whose claim it is, for the message above.
    let written = file
        .set_len(0)
        .and_then(|()| writeln!(file, "{}", std::process::id()));
    if let Err(error) = written {
        tracing::warn!(%error, path, "could not write this supervisor's pid into its claim");
    }
    Ok(file)
}

/// Remove device `id` and its store's shared memory, made by serving process `pid`, which
/// died by a signal before the device went live: true once done (or gone already). Only while
/// the device is as that process left it (never started, or started by it and now waiting
/// for it): one deleted and made again meanwhile is someone else's, left alone (false).
fn remove_unstarted(id: u32, pid: u32) -> Result<bool, DaemonError> {
    use crate::ublk::{sys, UblkError};
    let mut control = crate::ublk::Control::open()?;
    let info = match control.dev_info(id) {
        Err(UblkError::Command {
            errno: libc::ENODEV,
            ..
        }) => return Ok(true),
        info => info?,
    };
    // Until START_DEV the pid is -1 (Linux 6.12) or the 0 ADD_DEV sent (older drivers).
    let as_left = match info.state {
        sys::UBLK_S_DEV_DEAD => info.ublksrv_pid <= 0,
        _ => u32::try_from(info.ublksrv_pid) == Ok(pid),
    };
    if !as_left {
        tracing::warn!(
            id,
            state = info.state,
            pid = info.ublksrv_pid,
            "the device the dead serving process added is no longer as it left it: left alone"
        );
        return Ok(false);
    }
    tracing::warn!(
        id,
        pid,
        "removing the device the serving process added and died with before it went live"
    );
    control.del_dev_bounded(id)?;
    crate::store::remove_shared(id)?;
    Ok(true)
}

/// A serving process's command, made once (and again when the device's id is learnt, or a
/// reload switches to the binary on disk) so that a restart has nothing to build: `program`
/// (this supervisor's own binary, `/proc/self/exe`, until a reload) with the supervisor's arguments,
/// `--serve-child` (and `--standby`), and `--id learnt_id` when the kernel picked the id.
fn child_command(program: &Path, learnt_id: Option<u32>, standby: bool) -> Command {
    let mut command = Command::new(program);
    command
        .arg0(crate::os::DAEMON_ARGV0)
        .args(std::env::args_os().skip(1))
        .arg("--serve-child");
    if standby {
        command.arg("--standby");
    }
    if let Some(id) = learnt_id {
        command.arg("--id").arg(id.to_string());
    }
    // A service manager restarts this supervisor should it die: under one, in the foreground
    // (a detached one reports to `create` through a socket of its own).
    if std::env::var_os("NOTIFY_SOCKET").is_some()
        && std::env::var_os(super::DETACHED_ENV).is_none()
    {
        command.env(super::MANAGED_ENV, "1");
    } else {
        command.env_remove(super::MANAGED_ENV);
    }
    command
        .env_remove("NOTIFY_SOCKET")
        .env_remove(super::DETACHED_ENV)
        .env(SUPERVISOR_ENV, std::process::id().to_string())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    command
}

/// The serving process's command and, once the device is known, the standby's; once the
/// device has been live (`resume_only`), a serving process resumes it or ends.
fn child_commands(
    program: &Path,
    learnt_id: Option<u32>,
    device: Option<u32>,
    resume_only: bool,
) -> (Command, Option<Command>) {
    let mut serving = child_command(program, learnt_id, false);
    if resume_only {
        serving.env(super::RESUME_ONLY_ENV, "1");
    } else {
        serving.env_remove(super::RESUME_ONLY_ENV);
    }
    (
        serving,
        device.map(|_| child_command(program, learnt_id, true)),
    )
}

fn child_pid(child: &Child) -> Pid {
    Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_messages_parse() {
        let ready = ChildMessage::parse("READY=1\nDEVICE=3\nSTATUS=/dev/ublkb3\nPID=42");
        assert_eq!(
            ready,
            ChildMessage {
                added: false,
                ready: true,
                standby: false,
                device: Some(3),
                status: Some("/dev/ublkb3"),
                errno: None,
                pid: Some(42),
            }
        );
        let added = ChildMessage::parse("ADDED=1\nDEVICE=7");
        assert!(added.added && !added.ready);
        assert_eq!(added.device, Some(7));
        let failed = ChildMessage::parse("STATUS=no such thing = here\nERRNO=5");
        assert!(!failed.ready);
        assert_eq!(failed.status, Some("no such thing = here"));
        assert_eq!(failed.errno, Some("5"));
        assert_eq!(
            ChildMessage::parse("READY=0\nnonsense"),
            ChildMessage::default()
        );
    }

    /// Whether `pid` names no process, not even a zombie: ended and reaped.
    fn reaped(pid: Pid) -> bool {
        kill(pid, None) == Err(nix::errno::Errno::ESRCH)
    }

    #[test]
    fn a_dismissed_standby_is_reaped_even_if_it_outlives_the_wait() {
        let mut dismissed = Dismissed::default();
        let spawn = || ServingProcess::spawn(Command::new("sleep").arg("100")).unwrap();

        let standby = spawn();
        let pid = child_pid(&standby.child);
        dismissed.dismiss(standby);
        assert!(dismissed.unreaped.is_empty());
        assert!(reaped(pid));

        // Not waited for at all: kept (unless it ended at once), and reaped once it has.
        let standby = spawn();
        let pid = child_pid(&standby.child);
        dismissed.dismiss_within(standby, Duration::ZERO);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !dismissed.unreaped.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            dismissed.reap();
        }
        assert!(dismissed.unreaped.is_empty());
        assert!(reaped(pid));
    }

    #[test]
    fn restarts_back_off_but_never_stop() {
        let mut restarts = Restarts::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        for i in 0..=QUICK_RESTARTS {
            restarts.record(at(i as u64));
            if i < QUICK_RESTARTS {
                assert_eq!(restarts.delay(at(i as u64)), Duration::ZERO, "death {i}");
            }
        }
        assert_eq!(restarts.delay(at(10)), FIRST_BACKOFF);
        restarts.record(at(11));
        assert_eq!(restarts.delay(at(11)), 2 * FIRST_BACKOFF);
        for s in 12..40 {
            restarts.record(at(s));
            assert!(restarts.delay(at(s)) <= MAX_BACKOFF);
        }
        assert_eq!(restarts.delay(at(40)), MAX_BACKOFF);
        // A quiet spell longer than the window: at once again.
        assert_eq!(
            restarts.delay(at(40) + RESTART_WINDOW + Duration::from_secs(1)),
            Duration::ZERO
        );
    }
}
