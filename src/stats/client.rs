//! `trueno-ublk stat`'s side: read every daemon's report.

#![forbid(unsafe_code)]

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use thiserror::Error;

use super::reload::{outcome_for, outcome_path, ReloadOutcome};
use super::render::{render, StatFormat};
use super::{
    connect, socket_path, ConnectError, DeviceReport, Probe, COMPACT_REQUEST, COMPACT_SIGNAL,
    IO_TIMEOUT, MAX_REPORT_BYTES, RELOAD_REQUEST,
};

#[derive(Debug, Error)]
pub enum StatError {
    #[error("cannot read {}: the statistics sockets are root-only; run with sudo", dir.display())]
    NeedsRoot { dir: PathBuf },
    #[error("cannot list {}: {source}", dir.display())]
    List { dir: PathBuf, source: io::Error },
    #[error("no trueno-ublk daemon serves ublkb{id} (no socket in {})", dir.display())]
    NoSuchDevice { id: u32, dir: PathBuf },
    #[error("the daemon of ublkb{id} does not answer: {reason}")]
    Unreachable { id: u32, reason: String },
    #[error("the daemon of ublkb{id} (pid {pid}) predates `compact`: restart it with this version (`systemctl restart trueno-ublk@{id}` keeps its pages)")]
    NoCompaction { id: u32, pid: u32 },
    #[error("cannot signal the daemon of ublkb{id} (pid {pid}): {source}")]
    Signal {
        id: u32,
        pid: u32,
        source: nix::errno::Errno,
    },
    #[error("the daemon of ublkb{id} reported pid {pid}, which no process can have: its socket is not a trueno-ublk daemon's")]
    BadPid { id: u32, pid: u32 },
    #[error("pid {pid}, a process of ublkb{id}'s daemon a moment ago, is no longer a trueno-ublk process (the daemon was replaced or exited); ask again")]
    NotDaemon { id: u32, pid: u32 },
    #[error("the daemon of ublkb{id} (pid {pid}) was replaced before it finished compacting (see `trueno-ublk list`); ask again")]
    Replaced { id: u32, pid: u32 },
    #[error("the daemon of ublkb{id} has not finished compacting after {} s: a compaction that started goes on in the background (`trueno-ublk stat --id {id} --json` counts compactions); one that could not start is in the daemon's log (`journalctl -u trueno-ublk@{id}`, or /run/trueno-ublk/ublkb{id}.log for a daemon `create` started)", waited.as_secs())]
    CompactionTimeout { id: u32, waited: Duration },
    #[error("the daemon of ublkb{id} (pid {pid}) predates `reload`: restart it instead (`systemctl restart trueno-ublk@{id}` keeps its pages)")]
    NoReload { id: u32, pid: u32 },
    #[error("the serving process of ublkb{id} (pid {pid}) has no trueno-ublk supervisor to reload it{why}: restart it instead (`systemctl restart trueno-ublk@{id}` keeps its pages)")]
    NoSupervisor { id: u32, pid: u32, why: String },
    #[error("reload of ublkb{id} failed: {why}; pid {pid} serves on (`journalctl -u trueno-ublk@{id}`, or /run/trueno-ublk/ublkb{id}.log for a daemon `create` started, says more)")]
    ReloadFailed { id: u32, pid: u32, why: String },
    #[error("ublkb{id} is still served by pid {pid} {} s after the reload was asked for; its log says why (`journalctl -u trueno-ublk@{id}`, or /run/trueno-ublk/ublkb{id}.log for a daemon `create` started): a new binary that cannot start leaves the running one serving", waited.as_secs())]
    ReloadTimeout { id: u32, pid: u32, waited: Duration },
}

/// Send `signal` to process `pid` (of device `id`'s daemon) if it is a daemon of ours still:
/// between the report that named it and the signal the daemon may have exited and its pid
/// gone to another process, which SIGUSR2 or SIGHUP would end. Why the pid is checked first:
/// `kill` takes 0 and negative pids as process groups, and a pid comes from what a socket
/// answered.
fn signal_daemon(id: u32, pid: u32, signal: nix::sys::signal::Signal) -> Result<(), StatError> {
    let raw = match i32::try_from(pid) {
        Ok(raw) if raw > 0 => raw,
        _ => return Err(StatError::BadPid { id, pid }),
    };
    let daemon = crate::os::OurDaemon::find(raw).ok_or(StatError::NotDaemon { id, pid })?;
    daemon
        .signal(signal)
        .map_err(|source| StatError::Signal { id, pid, source })
}

/// Device `id`'s report, read from its socket in `dir`.
fn device_report(dir: &Path, id: u32) -> Result<DeviceReport, StatError> {
    match query(&socket_path(dir, id), id) {
        Ok(report) => Ok(report),
        Err(QueryError::Gone) => Err(StatError::NoSuchDevice {
            id,
            dir: dir.to_path_buf(),
        }),
        Err(QueryError::Denied) => Err(StatError::NeedsRoot {
            dir: dir.to_path_buf(),
        }),
        Err(QueryError::Failed(reason)) => Err(StatError::Unreachable { id, reason }),
    }
}

/// `trueno-ublk reload --id N`: SIGHUP to the supervisor of device `id`'s serving process (what
/// `systemctl reload` sends), then wait, `patience` at most, until another process serves it;
/// returns the reports before and after.
pub fn reload(
    dir: &Path,
    id: u32,
    patience: Duration,
) -> Result<(DeviceReport, DeviceReport), StatError> {
    let before = device_report(dir, id)?;
    let no_supervisor = |why: String| StatError::NoSupervisor {
        id,
        pid: before.pid,
        why,
    };
    if !before.requests.iter().any(|r| r == RELOAD_REQUEST) {
        return Err(StatError::NoReload {
            id,
            pid: before.pid,
        });
    }
    let status = fs::read_to_string(format!("/proc/{}/status", before.pid))
        .map_err(|error| no_supervisor(format!(": {error}")))?;
    let parent = status
        .lines()
        .find_map(|line| line.strip_prefix("PPid:"))
        .and_then(|pid| pid.trim().parse::<u32>().ok())
        .ok_or_else(|| no_supervisor(": no parent in its /proc status".into()))?;
    if !i32::try_from(parent).is_ok_and(crate::os::same_program_alive) {
        let comm = fs::read_to_string(format!("/proc/{parent}/comm")).unwrap_or_default();
        return Err(no_supervisor(format!(
            " (its parent {parent} is `{}`)",
            comm.trim()
        )));
    }
    let outcomes = outcome_path(dir, id);
    let me = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
    let asked_at = SystemTime::now();
    signal_daemon(id, parent, nix::sys::signal::Signal::SIGHUP)?;
    let asked = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        // A failure first: a new build's process that failed its takeover is followed by one
        // of the running build, another pid too.
        if let Some(ReloadOutcome::Failed(why)) = outcome_for(&outcomes, me, asked_at) {
            return Err(StatError::ReloadFailed {
                id,
                pid: before.pid,
                why,
            });
        }
        // Between the hand-over and the new process's socket the device has none for a moment.
        // `Done` comes as the new process serves: its report follows.
        if let Ok(now) = device_report(dir, id) {
            if now.pid != before.pid {
                return Ok((before, now));
            }
        }
        if asked.elapsed() >= patience {
            return Err(StatError::ReloadTimeout {
                id,
                pid: before.pid,
                waited: asked.elapsed(),
            });
        }
    }
}

/// A ublk device whose I/O waits for a daemon (quiesced between two, or its daemon gone), as
/// the kernel lists it: one with no socket (a stop that handed it over removed it) is
/// reported too, not left out as if it were not there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unserved {
    pub id: u32,
    /// The kernel's state of it (`quiesced`, `live`).
    pub state: &'static str,
    /// The pid of a supervisor that holds its claim, if one does: it is starting the process
    /// that resumes the device (a takeover or a reload under way).
    pub supervisor: Option<String>,
}

/// Read the report of every socket in `dir` (or only `ublkb{only}`), in id order, with a line
/// for each device of `unserved` that has no socket.
pub fn collect(
    dir: &Path,
    only: Option<u32>,
    unserved: &[Unserved],
) -> Result<Vec<Probe>, StatError> {
    let mut probes = collect_sockets(dir, only)?;
    let probed = |id: u32| {
        probes.iter().any(|probe| match probe {
            Probe::Live(report) => report.id == id,
            Probe::Unreachable { id: theirs, .. } => *theirs == id,
        })
    };
    let missing: Vec<Probe> = unserved
        .iter()
        .filter(|device| only.is_none_or(|only| only == device.id) && !probed(device.id))
        .map(|device| Probe::Unreachable {
            id: device.id,
            socket: socket_path(dir, device.id),
            reason: match &device.supervisor {
                Some(pid) => format!(
                    "no daemon serves it (the device is {}): its supervisor (pid {pid}) is \
                     starting the one that resumes it; its I/O waits until then",
                    device.state
                ),
                None => format!(
                    "no daemon serves it (the device is {}): its I/O waits until one resumes it \
                     (`systemctl start trueno-ublk@{id}`, or `trueno-ublk create --id {id}`)",
                    device.state,
                    id = device.id
                ),
            },
        })
        .collect();
    probes.extend(missing);
    probes.sort_by_key(|probe| match probe {
        Probe::Live(report) => report.id,
        Probe::Unreachable { id, .. } => *id,
    });
    Ok(probes)
}

/// Read the report of every socket in `dir` (or only `ublkb{only}`), in id order.
fn collect_sockets(dir: &Path, only: Option<u32>) -> Result<Vec<Probe>, StatError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) if error.kind() == io::ErrorKind::PermissionDenied => {
            return Err(StatError::NeedsRoot {
                dir: dir.to_path_buf(),
            })
        }
        Err(source) => {
            return Err(StatError::List {
                dir: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut ids: Vec<u32> = entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| socket_id(&entry.file_name().to_string_lossy()))
        .filter(|id| only.is_none_or(|only| only == *id))
        .collect();
    ids.sort_unstable();
    let mut probes = Vec::with_capacity(ids.len());
    for (id, answer) in query_all(dir, &ids) {
        let socket = socket_path(dir, id);
        match answer {
            Ok(report) => probes.push(Probe::Live(Box::new(report))),
            Err(QueryError::Gone) => {}
            Err(QueryError::Denied) => {
                return Err(StatError::NeedsRoot {
                    dir: dir.to_path_buf(),
                })
            }
            Err(QueryError::Failed(reason)) => {
                probes.push(Probe::Unreachable { id, socket, reason })
            }
        }
    }
    Ok(probes)
}

/// The answers of the sockets of `ids` in `dir`, in that order, asked side by side (up to
/// `QUERIES_AT_ONCE` at a time): each stuck daemon costs `IO_TIMEOUT`, and asked one after
/// the other, eight of them kept `stat` waiting 16 s.
fn query_all(dir: &Path, ids: &[u32]) -> Vec<(u32, Result<DeviceReport, QueryError>)> {
    let ask = |id: u32| (id, query(&socket_path(dir, id), id));
    let mut answers = Vec::with_capacity(ids.len());
    for group in ids.chunks(QUERIES_AT_ONCE) {
        std::thread::scope(|scope| {
            let asking: Vec<_> = group
                .iter()
                .map(|&id| {
                    let thread = std::thread::Builder::new().spawn_scoped(scope, move || ask(id));
                    (id, thread)
                })
                .collect();
            for (id, thread) in asking {
                answers.push(match thread {
                    Ok(handle) => handle.join().unwrap_or_else(|_| {
                        (
                            id,
                            Err(QueryError::Failed("the query's thread panicked".into())),
                        )
                    }),
                    // No thread to be had (no memory or tasks left): asked here.
                    Err(_) => ask(id),
                });
            }
        });
    }
    answers
}

/// How many sockets `query_all` asks at once.
const QUERIES_AT_ONCE: usize = 16;

/// `ublkb7.sock` → 7.
fn socket_id(name: &str) -> Option<u32> {
    crate::os::numbered_name(name.strip_suffix(".sock")?, "ublkb")
}

enum QueryError {
    /// The socket disappeared between listing and connecting (the daemon stopped).
    Gone,
    Denied,
    Failed(String),
}

impl From<ConnectError> for QueryError {
    fn from(error: ConnectError) -> Self {
        match error {
            ConnectError::Gone => Self::Gone,
            ConnectError::Denied => Self::Denied,
            other => Self::Failed(other.to_string()),
        }
    }
}

fn query(socket: &Path, id: u32) -> Result<DeviceReport, QueryError> {
    let stream = connect(socket)?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|error| QueryError::Failed(error.to_string()))?;
    let mut answer = Vec::new();
    stream
        .take(MAX_REPORT_BYTES)
        .read_to_end(&mut answer)
        .map_err(|error| match error.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                QueryError::Failed(format!("no answer within {} s", IO_TIMEOUT.as_secs()))
            }
            _ => QueryError::Failed(format!("cannot read the answer: {error}")),
        })?;
    let line = answer.split(|&b| b == b'\n').next().unwrap_or_default();
    let report: DeviceReport = serde_json::from_slice(line)
        .map_err(|error| QueryError::Failed(format!("unreadable answer: {error}")))?;
    if report.id != id {
        return Err(QueryError::Failed(format!(
            "answered for ublkb{} instead",
            report.id
        )));
    }
    Ok(report)
}

/// `trueno-ublk compact --id N`: ask device `id`'s daemon for a compaction (`COMPACT_SIGNAL`
/// to the pid its report gives) and wait, `patience` at most, until its report counts one
/// more; returns the reports before and after.
pub fn compact(
    dir: &Path,
    id: u32,
    patience: Duration,
) -> Result<(DeviceReport, DeviceReport), StatError> {
    let report = || device_report(dir, id);
    let before = report()?;
    if !before.requests.iter().any(|r| r == COMPACT_REQUEST) {
        return Err(StatError::NoCompaction {
            id,
            pid: before.pid,
        });
    }
    signal_daemon(id, before.pid, COMPACT_SIGNAL)?;
    let asked = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        // As in `reload`: a hand-over leaves the device without a socket for a moment, and a
        // daemon short of memory may answer late; both are asked again until `patience` ends.
        if let Ok(now) = report() {
            if now.pid != before.pid {
                return Err(StatError::Replaced {
                    id,
                    pid: before.pid,
                });
            }
            if now.store.compactions > before.store.compactions {
                return Ok((before, now));
            }
        }
        if asked.elapsed() >= patience {
            return Err(StatError::CompactionTimeout {
                id,
                waited: asked.elapsed(),
            });
        }
    }
}

/// What `trueno-ublk stat` prints: the reports of the sockets in `dir` (every device, or only
/// `only`, which must be there) and a line for each device of `unserved` without a socket,
/// rendered as `format`.
pub fn report_text(
    dir: &Path,
    only: Option<u32>,
    format: StatFormat,
    unserved: &[Unserved],
) -> Result<String, StatError> {
    let mut probes = collect(dir, only, unserved)?;
    if let Some(id) = only {
        // The one device asked for: a daemon that does not answer is an error (exit status
        // 1), as no daemon at all is, so that a check of one device fails when it should.
        match probes.pop() {
            None => {
                return Err(StatError::NoSuchDevice {
                    id,
                    dir: dir.to_path_buf(),
                })
            }
            Some(Probe::Unreachable { id, reason, .. }) => {
                return Err(StatError::Unreachable { id, reason })
            }
            Some(live) => probes.push(live),
        }
    }
    Ok(render(&probes, format))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_no_process_can_have_is_refused_not_taken_as_a_process_group() {
        for pid in [0, u32::MAX] {
            let refused = signal_daemon(3, pid, nix::sys::signal::Signal::SIGCONT);
            assert!(
                matches!(refused, Err(StatError::BadPid { id: 3, .. })),
                "{pid}"
            );
        }
        // A live process that is no daemon of ours is not signalled (this test's own).
        let own = signal_daemon(3, std::process::id(), nix::sys::signal::Signal::SIGCONT);
        assert!(
            matches!(own, Err(StatError::NotDaemon { id: 3, .. })),
            "{own:?}"
        );
    }
}
