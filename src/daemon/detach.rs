//! `create` without `--foreground`: start this program again as a detached daemon and wait
//! for it to report the device live, over the sd_notify protocol that systemd also speaks.

#![forbid(unsafe_code)]

use std::cell::Cell;
use std::ffi::OsString;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{io_error, DaemonError, DETACHED_ENV, RUN_DIR};
use crate::config::DeviceSettings;
use crate::ublk::UblkError;

/// How long `create` waits for a detached daemon to report the device live. START_DEV
/// scans partitions, which under emulation can take a while.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a daemon that missed `READY_TIMEOUT` gets to stop on SIGTERM before a SIGKILL.
const STOP_AFTER_TIMEOUT: Duration = Duration::from_secs(10);
/// Logs of failed starts kept in the run directory, the newest (see `prune_failed_start_logs`).
const FAILED_START_LOGS_KEPT: usize = 4;

/// Start this program again as a detached daemon (`create --foreground` with a private
/// notify socket) and wait until it reports the device live, or fails.
pub(super) fn start_detached(settings: &DeviceSettings) -> Result<(), DaemonError> {
    // Fail fast, in the user's terminal, on what we can check here.
    super::check_host(settings)?;
    drop(crate::ublk::Control::open()?);
    if let Some(id) = settings.id {
        // A device that exists is resumed by the daemon unless a live daemon serves it.
        let mut control = crate::ublk::Control::open()?;
        if let Ok(info) = control.dev_info(id) {
            if info.state == crate::ublk::sys::UBLK_S_DEV_LIVE
                && !crate::os::process_exited(info.ublksrv_pid)
            {
                return Err(UblkError::IdInUse(id).into());
            }
        }
    }
    std::fs::create_dir_all(RUN_DIR).map_err(io_error(format!("creating {RUN_DIR}")))?;
    set_mode(Path::new(RUN_DIR), 0o700)?;
    prune_failed_start_logs(Path::new(RUN_DIR), FAILED_START_LOGS_KEPT);
    let log_path = PathBuf::from(format!("{RUN_DIR}/starting-{}.log", std::process::id()));
    // Appended to: the daemon's three processes share it, and one of them may empty it
    // (`log_file`), after which every process's next line must land at its new end.
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .and_then(|log| log.set_len(0).map(|()| log))
        .map_err(io_error(format!("creating {}", log_path.display())))?;

    // A socket in the root-only run directory, not an abstract one: any local user can send to
    // an abstract socket, and a forged "READY=1" with another device path would make
    // `mkswap $(trueno-ublk create ...)` format the wrong disk.
    let socket_path = PathBuf::from(format!(
        "{RUN_DIR}/create-{}-{:x}.notify",
        std::process::id(),
        nanos()
    ));
    let socket = UnixDatagram::bind(&socket_path).map_err(io_error(format!(
        "binding the notify socket {}",
        socket_path.display()
    )))?;
    let _socket_file = RemoveOnDrop(&socket_path);
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .map_err(io_error("notify socket"))?;

    let exe = std::env::current_exe().map_err(io_error("finding this program"))?;
    let mut child_args: Vec<OsString> = std::env::args_os().skip(1).collect();
    child_args.push("--foreground".into());
    let mut child = Command::new(exe)
        .arg0(crate::os::DAEMON_ARGV0)
        .args(child_args)
        .env("NOTIFY_SOCKET", &socket_path)
        .env(DETACHED_ENV, &log_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(io_error("starting the daemon"))?;

    let deadline = Instant::now() + READY_TIMEOUT;
    let mut buffer = [0u8; 4096];
    loop {
        match socket.recv(&mut buffer) {
            Ok(n) => {
                let message = String::from_utf8_lossy(&buffer[..n]);
                let field = |key: &str| {
                    message
                        .lines()
                        .find_map(|l| l.strip_prefix(key))
                        .map(str::to_owned)
                };
                if message.lines().any(|l| l == "READY=1") {
                    // The daemon is up whatever happens to this output (`print!` would panic
                    // if its reader had gone).
                    let _ = writeln!(
                        std::io::stdout(),
                        "{}",
                        field("STATUS=").unwrap_or_default()
                    );
                    return Ok(());
                }
                if field("ERRNO=").is_some() {
                    let _ = child.wait();
                    let failure = field("STATUS=").unwrap_or_else(|| "the daemon failed".into());
                    // What its processes said before it (a serving process's last words, an
                    // allocation that failed say) is in the log, kept.
                    return Err(DaemonError::Daemon(format!(
                        "{failure} (its log: {})",
                        log_path.display()
                    )));
                }
            }
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(error) => return Err(io_error("reading the notify socket")(error)),
        }
        if let Some(status) = child
            .try_wait()
            .map_err(io_error("waiting for the daemon"))?
        {
            return Err(DaemonError::Daemon(format!(
                "the daemon exited ({status}) before the device was live; its log: {}",
                log_path.display()
            )));
        }
        if Instant::now() > deadline {
            // SIGTERM first: the supervisor passes it on and stops its serving process, which
            // deletes a device that never went live. A SIGKILL alone left that process
            // serving with no supervisor (and no standby) at all.
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let stop_deadline = Instant::now() + STOP_AFTER_TIMEOUT;
            while child.try_wait().ok().flatten().is_none() {
                if Instant::now() > stop_deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            return Err(DaemonError::Daemon(format!(
                "the device was not live after {}s, and the daemon was stopped; its log: {} \
                 (`trueno-ublk list` shows whether a device was left)",
                READY_TIMEOUT.as_secs(),
                log_path.display()
            )));
        }
    }
}

/// Remove the logs of earlier failed starts (`starting-PID.log`) but the newest `keep`. A
/// failed `create` names its log and keeps it (a start that succeeds renames it to the
/// device's); a script or a unit that retries `create` would otherwise fill the run
/// directory, which is RAM, one log at a time. Only logs no start can still be writing: their
/// `create` has exited and they were last written longer ago than a start may take.
fn prune_failed_start_logs(run_dir: &Path, keep: usize) {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return;
    };
    let settled_for = READY_TIMEOUT + STOP_AFTER_TIMEOUT;
    let mut failed: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name();
            let pid = name
                .to_str()?
                .strip_prefix("starting-")?
                .strip_suffix(".log")?
                .parse::<i32>()
                .ok()?;
            let written = entry.metadata().ok()?.modified().ok()?;
            let settled = written.elapsed().is_ok_and(|age| age > settled_for);
            (settled && crate::os::process_exited(pid)).then(|| (written, entry.path()))
        })
        .collect();
    // Newest first.
    failed.sort_unstable_by_key(|(written, _)| std::cmp::Reverse(*written));
    for (_, path) in failed.into_iter().skip(keep) {
        if let Err(error) = std::fs::remove_file(&path) {
            tracing::debug!(%error, path = %path.display(), "cannot remove an old log of a failed start");
        }
    }
}

/// Removes a file when dropped (the notify socket, whichever way `create` returns).
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

pub(super) fn set_mode(path: &Path, mode: u32) -> Result<(), DaemonError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io_error(
        format!("setting permissions of {}", path.display()),
    ))
}

/// What the supervisor sends a serving process to have it hand its device over.
pub(super) const HANDOVER: &str = "HANDOVER=1";
/// What the supervisor sends a standby to have it take the device over.
pub(super) const TAKEOVER: &str = "TAKEOVER=1";

/// Readiness and status: for the service manager or the `create` that started the supervisor
/// (`NOTIFY_SOCKET`, the sd_notify protocol), or, in the serving process, for its supervisor
/// (a datagram socket pair whose end is the serving process's stdin: nothing on the file
/// system, nothing another process could write to).
pub(super) enum Notifier {
    None,
    Socket(String),
    /// The channel, and the words read from it while looking for another one: a hand-over
    /// asked for while a standby still looks for its word to take over (it was slow to start)
    /// comes in the same read, and must still be heard by the serving loop after it.
    Supervisor(UnixDatagram, Cell<Heard>),
}

/// Which of the supervisor's words have been read but not yet asked about.
#[derive(Clone, Copy, Default)]
pub(super) struct Heard {
    takeover: bool,
    handover: bool,
}

impl Heard {
    fn word(&mut self, word: &str) -> Option<&mut bool> {
        match word {
            TAKEOVER => Some(&mut self.takeover),
            HANDOVER => Some(&mut self.handover),
            _ => None,
        }
    }
}

impl Notifier {
    pub(super) fn from_env() -> Self {
        match std::env::var_os("NOTIFY_SOCKET") {
            Some(path) => Self::Socket(path.to_string_lossy().into_owned()),
            None => Self::None,
        }
    }

    /// The serving process's channel to its supervisor: its stdin.
    pub(super) fn to_supervisor() -> Self {
        match std::io::stdin().as_fd().try_clone_to_owned() {
            Ok(fd) => Self::supervisor(UnixDatagram::from(fd)),
            Err(error) => {
                tracing::warn!(%error, "no channel to the supervisor: it will not hear of readiness");
                Self::None
            }
        }
    }

    /// Whether the supervisor has asked this serving process to hand its device over to the
    /// standby it readied (`HANDOVER=1`, see `supervise`'s reload); never waits.
    pub(super) fn handover_asked(&self) -> bool {
        self.supervisor_said(HANDOVER)
    }

    pub(super) fn supervisor(channel: UnixDatagram) -> Self {
        Self::Supervisor(channel, Cell::default())
    }

    /// Whether the supervisor has sent `word` (TAKEOVER or HANDOVER) since the last time this
    /// asked about it; reads all that waits on the channel, keeps the other word for its own
    /// question, never waits.
    pub(super) fn supervisor_said(&self, word: &str) -> bool {
        let Self::Supervisor(channel, heard) = self else {
            return false;
        };
        let mut words = heard.get();
        let mut buffer = [0u8; 256];
        loop {
            let mut fds = [nix::poll::PollFd::new(
                channel.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            let readable =
                nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).is_ok_and(|n| n > 0);
            if !readable {
                break;
            }
            let Ok(n) = channel.recv(&mut buffer) else {
                break;
            };
            let text = std::str::from_utf8(&buffer[..n]).unwrap_or_default();
            for line in text.lines() {
                if let Some(flag) = words.word(line) {
                    *flag = true;
                }
            }
        }
        let said = words.word(word).is_some_and(std::mem::take);
        heard.set(words);
        said
    }

    pub(super) fn send(&self, state: &str) {
        let sent = match self {
            Self::None => return,
            Self::Supervisor(channel, _) => channel.send(state.as_bytes()).map(drop),
            Self::Socket(path) => {
                let address = match path.strip_prefix('@') {
                    Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
                    None => SocketAddr::from_pathname(path),
                };
                // Never waits: PID 1 may itself be waiting on a page of this device, its
                // notification queue full, and a blocking send would then wait for good.
                address.and_then(|address| {
                    let socket = UnixDatagram::unbound()?;
                    socket.set_nonblocking(true)?;
                    socket.send_to_addr(state.as_bytes(), &address).map(drop)
                })
            }
        };
        match sent {
            Ok(()) => {}
            // A detached daemon's `create` removes its socket once the device is live: the
            // later status lines (after each takeover) have nobody to go to.
            Err(error)
                if matches!(self, Self::Socket(_))
                    && error.kind() == std::io::ErrorKind::NotFound =>
            {
                tracing::debug!(%error, "status notification: nobody listens any more");
            }
            Err(error) => tracing::warn!(%error, "readiness notification failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_newest_settled_logs_of_failed_starts_are_kept() {
        let dir = std::env::temp_dir().join(format!("trueno-ublk-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // Pids of processes that have ended: children, reaped.
        let mut gone = (0..8).map(|_| {
            let mut child = Command::new("true").spawn().unwrap();
            let pid = i32::try_from(child.id()).unwrap();
            child.wait().unwrap();
            pid
        });
        let now = std::time::SystemTime::now();
        let log = |name: String, hours_ago: u64| {
            let path = dir.join(name);
            let file = std::fs::File::create(&path).unwrap();
            file.set_modified(now - Duration::from_secs(hours_ago * 3600))
                .unwrap();
            path
        };
        // Six failed starts, an hour apart: the four newest stay.
        let failed: Vec<PathBuf> = (1..=6)
            .map(|hours| log(format!("starting-{}.log", gone.next().unwrap()), hours))
            .collect();
        // A start that may still be writing (its log is new), one whose `create` still
        // waits (this process), and a device's log: all stay.
        let fresh = log(format!("starting-{}.log", gone.next().unwrap()), 0);
        let waiting = log(format!("starting-{}.log", std::process::id()), 9);
        let device = log("ublkb0.log".into(), 9);

        prune_failed_start_logs(&dir, 4);

        for path in &failed[..4] {
            assert!(path.exists(), "{} was removed", path.display());
        }
        for path in &failed[4..] {
            assert!(!path.exists(), "{} was kept", path.display());
        }
        for path in [&fresh, &waiting, &device] {
            assert!(path.exists(), "{} was removed", path.display());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
