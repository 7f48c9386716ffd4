//! `list` and `delete`: ublk devices as the kernel sees them, whether or not their daemon is
//! still alive.

#![forbid(unsafe_code)]

use std::os::unix::fs::MetadataExt;
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

#[derive(Debug, Error)]
pub enum DevicesError {
    #[error(transparent)]
    Ublk(#[from] UblkError),
    #[error(
        "{path} is an active swap device (see /proc/swaps): run `swapoff {path}` first, \
         or pass --force"
    )]
    ActiveSwap { path: String },
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

/// Paths in /proc/swaps that refer to block device `path` (same device number).
pub fn is_active_swap(path: &str, proc_swaps: &str) -> bool {
    let device = std::fs::metadata(path).map(|m| m.rdev()).ok();
    proc_swaps
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().next())
        .any(|swap| {
            swap == path
                || (device.is_some() && std::fs::metadata(swap).map(|m| m.rdev()).ok() == device)
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
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    // Check every device before touching any, so `--all` does nothing if one is refused.
    for &id in &ids {
        let path = block_path(id);
        if is_active_swap(&path, &swaps) && !force {
            return Err(DevicesError::ActiveSwap { path });
        }
    }
    let mut deleted = Vec::with_capacity(ids.len());
    for id in ids {
        let path = block_path(id);
        if is_active_swap(&path, &swaps) {
            let status = std::process::Command::new("swapoff").arg(&path).status();
            if !matches!(status, Ok(s) if s.success()) {
                eprintln!(
                    "trueno-ublk: warning: swapoff {path} failed; deleting it anyway (--force)"
                );
            }
        }
        delete_one(&mut control, id)?;
        deleted.push(path);
    }
    Ok(deleted)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn active_swap_is_found_by_path() {
        let swaps = "Filename\tType\tSize\tUsed\tPriority\n/dev/ublkb0 partition 1048572 0 100\n";
        assert!(is_active_swap("/dev/ublkb0", swaps));
        assert!(!is_active_swap("/dev/ublkb1", swaps));
        assert!(!is_active_swap(
            "/dev/ublkb0",
            "Filename\tType\tSize\tUsed\tPriority\n"
        ));
    }
}
