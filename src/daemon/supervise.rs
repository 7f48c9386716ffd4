//! The supervisor: the process `create` runs (in the foreground under systemd, or the one
//! `create` detaches). It serves nothing itself: it starts the serving process (this program
//! again, `create ... --serve-child`), passes its readiness on (sd_notify, once), forwards
//! SIGTERM and SIGINT to it, and starts a new one at once when it dies by a signal (`kill -9`,
//! a crash): the new one resumes the device, which the kernel keeps quiesced meanwhile.
//!
//! Why a process of its own: whatever restarts the daemon must not itself need swap while the
//! device waits for a daemon, and systemd (PID 1) may have pages out on this very device. The
//! supervisor locks its memory, faults in its stack and heap at start, and afterwards only
//! waits in poll(2), reaps its child and starts the next from a command made in advance.
//!
//! Why exec and not fork: the serving process is multi-threaded and owns everything the I/O
//! path needs; a fresh program image starts clean, and `/proc/self/exe` names the binary this
//! supervisor runs, so a crash restart runs the same build even if a package upgrade replaced
//! the file on disk (the upgrade takes effect at the unit's next start).

#![forbid(unsafe_code)]

use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use signal_hook::consts::{SIGCHLD, SIGHUP, SIGINT, SIGTERM};

use super::detach::Notifier;
use super::{io_error, DaemonError, RUN_DIR};
use crate::config::DeviceSettings;

/// Tells the serving process who its supervisor is (its parent's pid), so that it can tell
/// whether that parent is still there when it starts.
pub(super) const SUPERVISOR_ENV: &str = "TRUENO_UBLK_SUPERVISOR";
/// Restarts after a death by a signal allowed within `RESTART_WINDOW`; one more means
/// something kills every new process at once (a bug that crashes it on resume, say): the
/// supervisor then gives up and exits with a failure, for the service manager to decide.
const MAX_RESTARTS: usize = 5;
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// What the serving process tells the supervisor, one datagram per event: `READY=1` with
/// `DEVICE=N`, `STATUS=/dev/ublkbN` and `PID=P` once the device is live (at start and after
/// each resume), `STATUS=...` with `ERRNO=...` when it fails.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ChildMessage<'a> {
    pub ready: bool,
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
                Some(("READY", "1")) => message.ready = true,
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
struct RestartLog {
    at: [Option<Instant>; MAX_RESTARTS],
    next: usize,
}

impl RestartLog {
    /// Record a death at `now`; false if that makes more than `MAX_RESTARTS` in the window.
    fn allow(&mut self, now: Instant) -> bool {
        let recent = self
            .at
            .iter()
            .flatten()
            .filter(|&&t| now.duration_since(t) < RESTART_WINDOW)
            .count();
        if recent >= MAX_RESTARTS {
            return false;
        }
        self.at[self.next] = Some(now);
        self.next = (self.next + 1) % MAX_RESTARTS;
        true
    }
}

/// Supervise serving processes for the device of `settings` until one exits: 0 when it
/// exited 0 (the device was deleted, or handed over), a failure otherwise.
pub(super) fn supervise(
    settings: &DeviceSettings,
    notifier: &Notifier,
    detached_log: Option<&Path>,
) -> Result<(), DaemonError> {
    crate::daemon::harden::lock_memory();
    crate::mem::configure_heap();
    // Fault in (and so lock) the stack and heap the restart path will use.
    crate::mem::prepare_io_thread();

    let (to_child, from_child) =
        UnixDatagram::pair().map_err(io_error("making the serving process's channel"))?;
    from_child
        .set_nonblocking(true)
        .map_err(io_error("making the serving process's channel"))?;
    // Signals wake poll(2) through a socket; `Signals` then says which arrived.
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP, SIGCHLD])
        .map_err(io_error("installing signal handlers"))?;
    let (wake_rx, wake_tx) = UnixStream::pair().map_err(io_error("making the signal socket"))?;
    wake_rx
        .set_nonblocking(true)
        .map_err(io_error("making the signal socket"))?;
    wake_tx
        .set_nonblocking(true)
        .map_err(io_error("making the signal socket"))?;
    for signal in [SIGTERM, SIGINT, SIGHUP, SIGCHLD] {
        let tx = wake_tx
            .try_clone()
            .map_err(io_error("making the signal socket"))?;
        signal_hook::low_level::pipe::register(signal, tx)
            .map_err(io_error("installing signal handlers"))?;
    }

    // `--id` is in the arguments when the user gave it; otherwise it is learnt below.
    let mut device = settings.id;
    let mut command = child_command(None);
    let mut child = spawn(&mut command, &to_child)?;
    let mut ready = false;
    let mut stopping = false;
    let mut restarts = RestartLog::default();
    let mut buffer = [0u8; 2048];
    loop {
        {
            let mut fds = [
                PollFd::new(std::os::fd::AsFd::as_fd(&wake_rx), PollFlags::POLLIN),
                PollFd::new(std::os::fd::AsFd::as_fd(&from_child), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(errno) => {
                    return Err(DaemonError::Io {
                        what: "waiting for the serving process".into(),
                        source: errno.into(),
                    })
                }
            }
        }
        while std::io::Read::read(&mut &wake_rx, &mut buffer).is_ok_and(|n| n > 0) {}
        for signal in signals.pending() {
            if signal == SIGTERM || signal == SIGINT {
                if !stopping {
                    stopping = true;
                    notifier.send("STOPPING=1");
                    tracing::info!(
                        signal,
                        pid = child.id(),
                        "stopping: passing the signal on to the serving process"
                    );
                }
                let _ = kill(child_pid(&child), Signal::SIGTERM);
            }
        }
        while let Ok(n) = from_child.recv(&mut buffer) {
            let Ok(text) = std::str::from_utf8(&buffer[..n]) else {
                continue;
            };
            let message = ChildMessage::parse(text);
            if message.errno.is_some() {
                // The serving process failed; pass its reason on (`create` prints it).
                notifier.send(text);
            }
            if !message.ready {
                continue;
            }
            let path = message.status.unwrap_or_default();
            if !ready {
                ready = true;
                if device.is_none() {
                    // The kernel picked the id: every later serving process resumes that one.
                    device = message.device;
                    command = child_command(device);
                }
                if let (Some(log), Some(id)) = (detached_log, message.device) {
                    let _ = std::fs::rename(log, format!("{RUN_DIR}/ublkb{id}.log"));
                }
                if detached_log.is_none() {
                    println!("{path}");
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
        }
        let Some(status) = child
            .try_wait()
            .map_err(io_error("waiting for the serving process"))?
        else {
            continue;
        };
        match (status.code(), status.signal()) {
            (Some(0), _) => return Ok(()),
            (Some(code), _) => {
                return Err(DaemonError::Daemon(format!(
                    "the serving process failed (exit status {code}); its log says why"
                )))
            }
            (_, Some(signal)) if stopping => {
                return Err(DaemonError::Daemon(format!(
                    "the serving process was killed by signal {signal} while stopping"
                )))
            }
            (_, signal) => {
                if !restarts.allow(Instant::now()) {
                    return Err(DaemonError::Daemon(format!(
                        "the serving process died by a signal {} times within {} s; giving up",
                        MAX_RESTARTS + 1,
                        RESTART_WINDOW.as_secs()
                    )));
                }
                tracing::warn!(
                    pid = child.id(),
                    signal = signal.unwrap_or(0),
                    "the serving process died; starting a new one to resume the device"
                );
                child = spawn(&mut command, &to_child)?;
            }
        }
    }
}

/// The serving process's command, made once (and again when the device's id is learnt) so
/// that a restart has nothing to build: this program with the supervisor's arguments and
/// `--serve-child`, and `--id learnt_id` when the kernel picked the id.
fn child_command(learnt_id: Option<u32>) -> Command {
    let mut command = Command::new("/proc/self/exe");
    command
        .arg0("trueno-ublk")
        .args(std::env::args_os().skip(1))
        .arg("--serve-child");
    if let Some(id) = learnt_id {
        command.arg("--id").arg(id.to_string());
    }
    command
        .env_remove("NOTIFY_SOCKET")
        .env_remove(super::DETACHED_ENV)
        .env(SUPERVISOR_ENV, std::process::id().to_string())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    command
}

/// Start a serving process whose stdin is its end of the channel.
fn spawn(command: &mut Command, to_child: &UnixDatagram) -> Result<Child, DaemonError> {
    let end = to_child
        .try_clone()
        .map_err(io_error("passing the channel to the serving process"))?;
    command
        .stdin(Stdio::from(OwnedFd::from(end)))
        .spawn()
        .map_err(io_error("starting the serving process"))
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
                ready: true,
                device: Some(3),
                status: Some("/dev/ublkb3"),
                errno: None,
                pid: Some(42),
            }
        );
        let failed = ChildMessage::parse("STATUS=no such thing = here\nERRNO=5");
        assert!(!failed.ready);
        assert_eq!(failed.status, Some("no such thing = here"));
        assert_eq!(failed.errno, Some("5"));
        assert_eq!(
            ChildMessage::parse("READY=0\nnonsense"),
            ChildMessage::default()
        );
    }

    #[test]
    fn restarts_are_bounded_within_the_window() {
        let mut log = RestartLog::default();
        let t0 = Instant::now();
        for i in 0..MAX_RESTARTS {
            assert!(log.allow(t0 + Duration::from_secs(i as u64)), "restart {i}");
        }
        assert!(!log.allow(t0 + Duration::from_secs(10)));
        // Once the early ones are older than the window, restarts are allowed again.
        assert!(log.allow(t0 + RESTART_WINDOW + Duration::from_secs(1)));
    }
}
