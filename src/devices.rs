//! `list` and `delete`: ublk devices as the kernel sees them, whether or not their daemon is
//! still alive.

#![forbid(unsafe_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Serialize;
use thiserror::Error;

use crate::ublk::device::{block_path, state_name};
use crate::ublk::{Control, UblkError};

const UBLK_CHAR_CLASS: &str = "/sys/class/ublk-char";
/// How long a daemon gets to stop and delete its device after SIGTERM.
const DAEMON_STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `delete --force` lets swapoff read the swapped-out pages back. Killing swapoff is
/// safe (the swap area stays on); waiting without end is not what a command line should do.
const SWAPOFF_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Error)]
pub enum DevicesError {
    #[error(transparent)]
    Ublk(#[from] UblkError),
    #[error(
        "{path} is in use (the kernel holds it exclusively: active swap or a mounted file \
         system): run `swapoff {path}` or unmount it first, or pass --force to run swapoff"
    )]
    InUse { path: String },
    #[error(
        "could not tell whether {path} is in use ({source}); not deleting it: check \
         /proc/swaps and mounts, then retry"
    )]
    InUseUnknown {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: swapoff failed ({status}); the device stays as it is")]
    SwapoffFailed { path: String, status: String },
    #[error("{path} is still in use after swapoff (mounted?): unmount it first; the device stays")]
    StillInUse { path: String },
    #[error(
        "the daemon of {path} (pid {pid}) did not stop within {seconds} s and the device is \
         in use; nothing was deleted (see `journalctl -u trueno-ublk@{id}` or its log)"
    )]
    DaemonRefused {
        path: String,
        pid: i32,
        seconds: u64,
        id: u32,
    },
}

/// One row of `list`.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceRow {
    pub id: u32,
    pub path: String,
    pub size: u64,
    pub queues: u16,
    pub depth: u16,
    pub state: &'static str,
    pub pid: i32,
    pub daemon_alive: bool,
}

/// Ids of every ublk device the kernel knows, sorted.
pub fn device_ids() -> Vec<u32> {
    let mut ids: Vec<u32> = std::fs::read_dir(UBLK_CHAR_CLASS)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            entry
                .file_name()
                .to_str()?
                .strip_prefix("ublkc")?
                .parse()
                .ok()
        })
        .collect();
    ids.sort_unstable();
    ids
}

fn daemon_alive(pid: i32) -> bool {
    pid > 0 && kill(Pid::from_raw(pid), None).is_ok()
}

/// Read one device's row from the kernel.
pub fn device_row(control: &mut Control, id: u32) -> Result<DeviceRow, UblkError> {
    let info = control.dev_info(id)?;
    // A device whose parameters were never set has none to report.
    let size = control
        .params(id)
        .map(|p| p.basic.dev_sectors << 9)
        .unwrap_or(0);
    Ok(DeviceRow {
        id,
        path: block_path(id),
        size,
        queues: info.nr_hw_queues,
        depth: info.queue_depth,
        state: state_name(info.state),
        pid: info.ublksrv_pid,
        daemon_alive: daemon_alive(info.ublksrv_pid),
    })
}

/// Every ublk device the kernel knows (`trueno-ublk list`), in id order.
pub fn list() -> Result<Vec<DeviceRow>, DevicesError> {
    let mut control = Control::open()?;
    Ok(device_ids()
        .into_iter()
        .filter_map(|id| device_row(&mut control, id).ok())
        .collect())
}

/// Whether the block device at `path` is claimed (swap, mounted); an open error other than
/// EBUSY is an error here, since deleting a device that is in use loses its data.
fn in_use(path: &str) -> Result<bool, DevicesError> {
    crate::blockdev::is_claimed(Path::new(path)).map_err(|source| DevicesError::InUseUnknown {
        path: path.to_string(),
        source,
    })
}

/// `trueno-ublk delete --id N | --all [--force]`: device `id`, or every device for `None`.
/// Returns the paths of the devices deleted.
pub fn delete(id: Option<u32>, force: bool) -> Result<Vec<String>, DevicesError> {
    let mut control = Control::open()?;
    let ids = match id {
        Some(id) => {
            if !Path::new(&format!("{UBLK_CHAR_CLASS}/ublkc{id}")).exists() {
                return Err(UblkError::NoSuchDevice(id).into());
            }
            vec![id]
        }
        None => device_ids(),
    };
    // Check every device before touching any, so `--all` does nothing if one is refused.
    for &id in &ids {
        let path = block_path(id);
        if !Path::new(&path).exists() {
            // Added but never started (or its node is gone): nothing can have claimed it.
            continue;
        }
        if in_use(&path)? && !force {
            return Err(DevicesError::InUse { path });
        }
    }
    let mut deleted = Vec::with_capacity(ids.len());
    for id in ids {
        let path = block_path(id);
        if Path::new(&path).exists() && in_use(&path)? {
            swapoff(&path)?;
            if in_use(&path)? {
                return Err(DevicesError::StillInUse { path });
            }
        }
        delete_one(&mut control, id)?;
        deleted.push(path);
    }
    Ok(deleted)
}

/// `swapoff PATH`, bounded by [`SWAPOFF_TIMEOUT`]. On failure the device must stay: its swap
/// area still holds pages that only it can give back.
fn swapoff(path: &str) -> Result<(), DevicesError> {
    let failed = |status: String| DevicesError::SwapoffFailed {
        path: path.to_string(),
        status,
    };
    let mut child = std::process::Command::new("swapoff")
        .arg(path)
        .spawn()
        .map_err(|error| failed(format!("could not run swapoff: {error}")))?;
    let deadline = Instant::now() + SWAPOFF_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(failed(status.to_string())),
            Ok(None) if Instant::now() > deadline => {
                // swapoff stops where it is and the swap area stays on.
                let _ = child.kill();
                let _ = child.wait();
                return Err(failed(format!(
                    "did not finish within {} s",
                    SWAPOFF_TIMEOUT.as_secs()
                )));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(error) => return Err(failed(error.to_string())),
        }
    }
}

/// Ask the device's daemon to stop (it stops and deletes the device itself); if there is no
/// daemon, or it does not finish in time, stop and delete the device here.
fn delete_one(control: &mut Control, id: u32) -> Result<(), DevicesError> {
    let pid = control.dev_info(id)?.ublksrv_pid;
    if is_our_daemon(pid) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        if wait_until_gone(id, DAEMON_STOP_TIMEOUT) {
            return Ok(());
        }
        // The daemon refuses to stop a claimed device (it logs why); someone may have run
        // swapon after the check above. Killing it then would fail every swapped-out page.
        let path = block_path(id);
        if !Path::new(&path).exists() || in_use(&path)? {
            return Err(DevicesError::DaemonRefused {
                path,
                pid,
                seconds: DAEMON_STOP_TIMEOUT.as_secs(),
                id,
            });
        }
        eprintln!("trueno-ublk: warning: daemon {pid} did not stop in time; killing it");
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    match control.stop_dev(id) {
        Ok(())
        | Err(UblkError::Command {
            errno: libc::ENODEV,
            ..
        }) => {}
        Err(error) => return Err(error.into()),
    }
    match control.del_dev(id) {
        Ok(())
        | Err(UblkError::Command {
            errno: libc::ENODEV,
            ..
        }) => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// Whether `pid` is alive and is a trueno-ublk process (pids get reused).
fn is_our_daemon(pid: i32) -> bool {
    daemon_alive(pid)
        && std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|comm| comm.trim() == "trueno-ublk")
}

fn wait_until_gone(id: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let class = format!("{UBLK_CHAR_CLASS}/ublkc{id}");
    while Path::new(&class).exists() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}
