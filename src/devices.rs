//! `list` and `delete`: ublk devices as the kernel sees them, whether or not their daemon is
//! still alive.

#![forbid(unsafe_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde::Serialize;
use thiserror::Error;

use crate::ublk::device::{block_path, char_class_path, device_exists, state_name};
use crate::ublk::{Control, UblkError};

const UBLK_CHAR_CLASS: &str = "/sys/class/ublk-char";
/// How long a daemon gets to stop and delete its device after SIGTERM.
const DAEMON_STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the kernel gets to remove a device after DEL_DEV.
const DELETE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `delete --force` lets swapoff read the swapped-out pages back. Killing swapoff is
/// safe (the swap area stays on); waiting without end is not what a command line should do.
const SWAPOFF_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a swapoff killed at `SWAPOFF_TIMEOUT` is given to exit.
const SWAPOFF_KILL_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum DevicesError {
    #[error(transparent)]
    Ublk(#[from] UblkError),
    #[error(
        "{path} is in use (the kernel holds it exclusively: active swap, a mounted file system, \
         or a dm, md or LVM device on it): as swap, run `swapoff {path}` first or pass --force \
         to run it; otherwise unmount it or remove that holder first (--force only swaps off)"
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
    #[error(
        "{path}: swapoff failed ({status}); the device stays as it is (not swap but mounted, \
         or under dm, md or LVM? unmount it or remove that holder first)"
    )]
    SwapoffFailed { path: String, status: String },
    #[error("{path} is still in use after swapoff (mounted?): unmount it first; the device stays")]
    StillInUse { path: String },
    #[error(
        "the daemon of {path} (pid {pid}) did not delete it within {seconds} s and the device \
         is in use (it became so meanwhile?); nothing was deleted (see `journalctl -u \
         trueno-ublk@{id}` or its log)"
    )]
    DaemonRefused {
        path: String,
        pid: i32,
        seconds: u64,
        id: u32,
    },
    #[error(
        "{path} is in use and being resumed: its supervisor (pid {pid}) starts the daemon that \
         serves it next (its I/O waits meanwhile). Wait for it and delete it then; or stop that \
         daemon first (`systemctl stop trueno-ublk@{id}`, or `kill {pid}`)"
    )]
    Resuming { path: String, id: u32, pid: String },
    #[error(
        "{path} is in use and no daemon serves it (state {state}): its I/O waits, and swapoff \
         would wait too. Resume it (`systemctl start trueno-ublk@{id}`, or `trueno-ublk create \
         --id {id}` with its other options; it keeps its size), then delete it; or delete it \
         anyway with --lose-pages (I/O waiting on it fails: processes with pages on it may die)"
    )]
    NoDaemon {
        path: String,
        id: u32,
        state: &'static str,
    },
    #[error(
        "/proc/swaps still lists `{name}`: the device's block device was deleted while it was \
         active swap, and the kernel keeps that swap area (and the device's id) until reboot. \
         Pass --force to delete what is left of the device (its pages are lost already)"
    )]
    DeletedSwap { name: String },
    #[error(
        "device {id}: the kernel did not finish deleting it within {seconds} s; see \
         `trueno-ublk list` and dmesg"
    )]
    DeleteTimeout { id: u32, seconds: u64 },
    #[error(
        "device {id} is another user's unprivileged ublk device: the kernel does not describe \
         it to us, so it is not this program's to delete (its owner's ublk server deletes it)"
    )]
    NotOurs { id: u32 },
}

/// The order of reads of a process's swapped-out pages (`fault-in`) and hand-overs of
/// devices. `fault-in` looks at every device's state, then reads a few pages, and a device
/// handed over in between would hold such a read until its next daemon serves it: for PID 1's
/// pages (the unit's stop faults them in), with PID 1's memory map locked, while PID 1 must
/// fork that daemon (one unit's stop reading a page on another device whose unit restarts at
/// the same moment): a deadlock. Two flocks in the run directory order them. A reader passes
/// the turnstile (exclusive, for a moment) and holds the gate shared around each look and its
/// reads. A hand-over holds the turnstile shared from before its daemon stops serving until
/// the device is quiesced, and waits until the gate is free of readers: a read that began
/// before the hand-over ends before it, and a look after it finds the device quiesced, so no
/// read is made. Hand-overs share the turnstile, so several devices handed over at once
/// (a poweroff) do not wait for each other.
///
/// Both waits are bounded. A hand-over that waited in vain goes on (a reader stuck on
/// another device must not stop it for good); a reader that did stops reading (see
/// `GateUnavailable::Busy`). Only where the lock files cannot be had at all does either go on
/// as before the gate existed.
pub struct HandOverGate {
    _held: std::fs::File,
}

/// Why `HandOverGate` was not had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateUnavailable {
    /// Not within the patience given: readers under way (for a hand-over), or hand-overs
    /// under way (for a reader, who must not read now).
    Busy,
    /// The lock files could not be made or locked (no run directory: not root, say).
    NoLockFiles,
}

impl HandOverGate {
    /// For a look at the devices' states and the reads after it: the gate, shared, once no
    /// hand-over is under way.
    pub fn for_reads(dir: &Path, patience: Duration) -> Result<Self, GateUnavailable> {
        let (_passed, gate) = Self::lock_both(
            dir,
            patience,
            std::fs::File::try_lock,
            std::fs::File::try_lock_shared,
        )?;
        // Passed: the turnstile goes (closing it unlocks it), the gate stays shared.
        Ok(Self { _held: gate })
    }

    /// For a hand-over, from before the daemon stops serving until its device is quiesced:
    /// the turnstile, shared (no new reader passes), once the reads under way are done.
    pub fn for_hand_over(dir: &Path, patience: Duration) -> Result<Self, GateUnavailable> {
        // Free of readers once the gate could be had exclusive; let go at once (readers now
        // wait at the turnstile), so that other hand-overs find it free too.
        let (turnstile, _free) = Self::lock_both(
            dir,
            patience,
            std::fs::File::try_lock_shared,
            std::fs::File::try_lock,
        )?;
        Ok(Self { _held: turnstile })
    }

    /// The turnstile and then the gate, locked with `turnstile` and `gate` within `patience`.
    fn lock_both(
        dir: &Path,
        patience: Duration,
        turnstile: TryLock,
        gate: TryLock,
    ) -> Result<(std::fs::File, std::fs::File), GateUnavailable> {
        let deadline = Instant::now() + patience;
        let turnstile_file = lock_file(dir, HAND_OVER_TURNSTILE)?;
        lock_by(&turnstile_file, deadline, turnstile)?;
        let gate_file = lock_file(dir, HAND_OVER_GATE)?;
        lock_by(&gate_file, deadline, gate)?;
        Ok((turnstile_file, gate_file))
    }
}

/// A flock taken without waiting (`File::try_lock`, `File::try_lock_shared`).
type TryLock = fn(&std::fs::File) -> Result<(), std::fs::TryLockError>;

/// The gate's lock files in the run directory (`HandOverGate`).
const HAND_OVER_GATE: &str = "hand-over.lock";
const HAND_OVER_TURNSTILE: &str = "hand-over.turnstile";

/// Open (making it, and `dir`, root's only) the lock file `name` in `dir`.
fn lock_file(dir: &Path, name: &str) -> Result<std::fs::File, GateUnavailable> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .and_then(|()| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(dir.join(name))
        })
        .map_err(|_| GateUnavailable::NoLockFiles)
}

/// Take a lock on `file` with `try_lock` (a flock), trying until `deadline`.
fn lock_by(
    file: &std::fs::File,
    deadline: Instant,
    try_lock: TryLock,
) -> Result<(), GateUnavailable> {
    loop {
        match try_lock(file) {
            Ok(()) => return Ok(()),
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(std::fs::TryLockError::WouldBlock) => return Err(GateUnavailable::Busy),
            Err(std::fs::TryLockError::Error(_)) => return Err(GateUnavailable::NoLockFiles),
        }
    }
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

/// Whether I/O to a device in kernel state `state` waits for a daemon: quiesced between two,
/// or live with its daemon gone (until the kernel notices).
fn io_waits(state: &str, daemon_alive: bool) -> bool {
    state == state_name(crate::ublk::sys::UBLK_S_DEV_QUIESCED)
        || (state == state_name(crate::ublk::sys::UBLK_S_DEV_LIVE) && !daemon_alive)
}

/// A ublk device whose I/O waits for a daemon (`io_waits`), and its kernel state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitingDevice {
    pub id: u32,
    pub state: &'static str,
}

/// Every ublk device whose I/O waits for a daemon now, in id order. Only GET_DEV_INFO, which
/// the kernel answers without the device's mutex: `stat` and `fault-in` are run to look at a
/// device in trouble, and GET_PARAMS (the size `list` shows) waits behind a control command
/// stuck on it. Devices skipped as in `list`.
pub fn waiting_for_daemon() -> Result<Vec<WaitingDevice>, DevicesError> {
    let ids = device_ids();
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut control = Control::open()?;
    let mut waiting = Vec::new();
    for id in ids {
        match control.dev_info(id) {
            Ok(info) if io_waits(state_name(info.state), daemon_alive(info.ublksrv_pid)) => {
                waiting.push(WaitingDevice {
                    id,
                    state: state_name(info.state),
                });
            }
            Ok(_) => {}
            Err(error) if vanished(&error) || undescribed(&error) => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(waiting)
}

/// Ids of every ublk device the kernel knows, sorted.
pub fn device_ids() -> Vec<u32> {
    let mut ids: Vec<u32> = crate::os::numbered_entries(UBLK_CHAR_CLASS, "ublkc").collect();
    ids.sort_unstable();
    ids
}

/// Whether `pid` is a process that still runs (a zombie does not).
fn daemon_alive(pid: i32) -> bool {
    !crate::os::process_exited(pid)
}

/// Read one device's row from the kernel.
pub fn device_row(control: &mut Control, id: u32) -> Result<DeviceRow, UblkError> {
    let info = control.dev_info(id)?;
    // A device whose parameters were never set has none to report.
    let size = control.device_bytes(id).unwrap_or(0);
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

/// Every ublk device the kernel knows and lets us read (`trueno-ublk list`), in id order. One
/// deleted since its id was read is left out, and so is one the kernel will not describe to
/// us: another user's unprivileged device (`UBLK_F_UNPRIVILEGED_DEV`: GET_DEV_INFO without
/// its path fails with EINVAL), which would otherwise fail the whole list.
/// Any other failure fails the list: a device left out for it would look deleted.
pub fn list() -> Result<Vec<DeviceRow>, DevicesError> {
    let mut control = Control::open()?;
    let mut rows = Vec::new();
    for id in device_ids() {
        match device_row(&mut control, id) {
            Ok(row) => rows.push(row),
            Err(error) if vanished(&error) || undescribed(&error) => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(rows)
}

/// Whether a control command failed because the device is gone (deleted meanwhile).
fn vanished(error: &UblkError) -> bool {
    matches!(
        error,
        UblkError::NoSuchDevice(_)
            | UblkError::Command {
                errno: libc::ENODEV,
                ..
            }
    )
}

/// Whether a control command failed as GET_DEV_INFO does, for root too, on another user's
/// unprivileged device (`UBLK_F_UNPRIVILEGED_DEV`) asked without its path.
fn undescribed(error: &UblkError) -> bool {
    matches!(
        error,
        UblkError::Command {
            errno: libc::EINVAL,
            ..
        }
    )
}

/// Whether the block device at `path` is claimed (swap, mounted); an open error other than
/// EBUSY is an error here, since deleting a device that is in use loses its data.
fn in_use(path: &str) -> Result<bool, DevicesError> {
    crate::blockdev::is_claimed(Path::new(path)).map_err(|source| DevicesError::InUseUnknown {
        path: path.to_string(),
        source,
    })
}

/// The name /proc/swaps gives a swap area on device `id`'s block device after that block
/// device was deleted (`/dev/ublkbN (deleted)`, spaces written `\040`), unescaped, if any.
/// The kernel keeps such an area (and the deleted disk, and the device's id) until swapoff,
/// and keeps sending swap-outs to it, which fail.
pub fn deleted_swap_name(swaps: &str, id: u32) -> Option<String> {
    let deleted = format!("{}\\040(deleted)", block_path(id));
    swaps
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().next())
        .find(|name| *name == deleted)
        .map(|name| name.replace("\\040", " "))
}

/// How device `id` is used, as `delete` must know before it touches anything.
struct Usage {
    path: String,
    /// The kernel holds its block device (active swap, mounted).
    claimed: bool,
    /// /proc/swaps holds a swap area on its deleted block device (see `deleted_swap_name`).
    deleted_swap: Option<String>,
    /// The pid of the supervisor that holds its claim (see `delete`): one serving it, or
    /// resuming it.
    supervisor: Option<String>,
    /// A live daemon serves it.
    served: bool,
    state: &'static str,
}

fn usage(
    control: &mut Control,
    id: u32,
    supervisor_of: &dyn Fn(u32) -> Option<String>,
) -> Result<Usage, DevicesError> {
    let path = block_path(id);
    let row = device_row(control, id)?;
    // A device never started has no block device to hold. One that has is asked through its
    // node, and a node missing (a private /dev, one removed by hand) is "cannot tell", never
    // "unused": deleting a device that is active swap kills whatever has pages on it.
    let has_disk = Path::new(&format!("/sys/block/ublkb{id}")).exists();
    let claimed = has_disk && in_use(&path)?;
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    Ok(Usage {
        claimed,
        deleted_swap: deleted_swap_name(&swaps, id),
        served: row.state == "live" && row.daemon_alive,
        supervisor: supervisor_of(id),
        state: row.state,
        path,
    })
}

/// Whether `delete` may go on with a device used as `usage` says, and how.
fn check_delete(usage: &Usage, id: u32, force: bool, lose_pages: bool) -> Result<(), DevicesError> {
    let path = &usage.path;
    if let Some(name) = &usage.deleted_swap {
        if !force && !lose_pages {
            return Err(DevicesError::DeletedSwap { name: name.clone() });
        }
    }
    if !usage.claimed {
        return Ok(());
    }
    if !usage.served {
        // Quiesced a moment, between a serving process's death (or hand-over) and the next
        // one's takeover: with its pages there for the taking, not lost.
        if let Some(pid) = &usage.supervisor {
            return Err(DevicesError::Resuming {
                path: path.clone(),
                id,
                pid: pid.clone(),
            });
        }
        if lose_pages {
            return Ok(());
        }
        // swapoff would read every page back from a device nobody serves: it would wait
        // until one does, unkillably. Resuming it first keeps every page.
        return Err(DevicesError::NoDaemon {
            path: path.clone(),
            id,
            state: usage.state,
        });
    }
    // --lose-pages is for a device nobody serves; one that is served is swapped off first,
    // which --force asks for.
    if !force {
        return Err(DevicesError::InUse { path: path.clone() });
    }
    Ok(())
}

/// `trueno-ublk delete --id N | --all [--force] [--lose-pages]`: device `id`, or every device
/// for `None`. Tells `deleted` the path of each device as it is deleted (so that a failure of
/// `--all` part-way leaves no doubt which went), with a note for the user when something is
/// left behind (an id the kernel cannot free yet, a daemon still exiting). `supervisor_of`
/// names the supervisor that holds a device's claim, if one does (`daemon::device_claimed_by`,
/// given by the command line, which this module sits below).
pub fn delete(
    id: Option<u32>,
    force: bool,
    lose_pages: bool,
    supervisor_of: &dyn Fn(u32) -> Option<String>,
    deleted: &mut dyn FnMut(&str, Option<&str>),
) -> Result<(), DevicesError> {
    let mut control = Control::open()?;
    let all = id.is_none();
    let ids = match id {
        Some(id) => {
            if !device_exists(id) {
                return Err(UblkError::NoSuchDevice(id).into());
            }
            vec![id]
        }
        None => device_ids(),
    };
    // Check every device before touching any, so `--all` does nothing if one is refused. A
    // device deleted meanwhile (by another `delete`, its own daemon) is not `--all`'s to fail,
    // nor is one the kernel will not describe to us (another user's unprivileged device, left
    // out of `list` too): it is left alone.
    let usage_of = |control: &mut Control, id| match usage(control, id, supervisor_of) {
        Err(DevicesError::Ublk(error)) if all && (vanished(&error) || undescribed(&error)) => {
            Ok(None)
        }
        Err(DevicesError::Ublk(error)) if undescribed(&error) => Err(DevicesError::NotOurs { id }),
        found => found.map(Some),
    };
    for &id in &ids {
        if let Some(usage) = usage_of(&mut control, id)? {
            check_delete(&usage, id, force, lose_pages)?;
        }
    }
    for id in ids {
        let Some(usage) = usage_of(&mut control, id)? else {
            continue;
        };
        check_delete(&usage, id, force, lose_pages)?;
        let path = usage.path.clone();
        if usage.claimed && usage.served {
            swapoff(&path)?;
            if in_use(&path)? {
                return Err(DevicesError::StillInUse { path });
            }
        }
        if let Some(name) = &usage.deleted_swap {
            // No swapoff reaches it: the kernel cannot open a deleted block device by name.
            // Its pages were lost when that disk went; the device now under the id goes all
            // the same (`--force` or `--lose-pages` said so).
            crate::os::print_err(&format!(
                "trueno-ublk: warning: the swap area {name} stays until reboot (no swapoff reaches a deleted device); deleting {path} all the same"
            ));
        }
        // Its store as it is before the delete: a `create` of the same id after it (a unit
        // restarted) makes a store of its own under the same key, which must stay.
        let store = crate::store::shared_store(id);
        let daemon_left = delete_one(&mut control, id, usage.served)?;
        if let Err(error) = store.and_then(crate::store::SharedStore::remove) {
            crate::os::print_err(&format!(
                "trueno-ublk: warning: device {id}'s shared memory was not freed: {error}"
            ));
        }
        let note = match daemon_left {
            Some(pid) => Some(format!(
                "its daemon (pid {pid}) has not exited within {} s: wait for it before making \
                 device {id} again (as it ends it frees the shared memory under id {id}'s key)",
                DAEMON_STOP_TIMEOUT.as_secs()
            )),
            None => control.dev_info(id).is_ok().then(|| {
                format!(
                    "the kernel keeps id {id} until the last user of its old block device lets \
                     go (a swap area in /proc/swaps, a mount, or a process with it open)"
                )
            }),
        };
        deleted(&path, note.as_deref());
    }
    Ok(())
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
                // swapoff stops where it is and the swap area stays on. One reading a page
                // from a device whose daemon died meanwhile waits unkillably until one serves
                // it: it is not waited for.
                let _ = child.kill();
                let killed_by = Instant::now() + SWAPOFF_KILL_WAIT;
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < killed_by {
                    std::thread::sleep(Duration::from_millis(100));
                }
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

/// Delete device `id`. A live daemon of ours is asked to (SIGTERM: it deletes an unused
/// device itself), and waited for until it has exited; any other device is removed here with
/// DEL_DEV, which also stops it and fails whatever I/O waits on it. Returns the pid of a
/// daemon that deleted its device but had not exited by the deadline.
fn delete_one(control: &mut Control, id: u32, served: bool) -> Result<Option<i32>, DevicesError> {
    let path = block_path(id);
    let pid = control.dev_info(id)?.ublksrv_pid;
    if let Some(daemon) = served.then(|| crate::os::OurDaemon::find(pid)).flatten() {
        let _ = daemon.signal(Signal::SIGTERM);
        let deadline = Instant::now() + DAEMON_STOP_TIMEOUT;
        if wait_until_gone(id, DAEMON_STOP_TIMEOUT) {
            // The char device goes at the start of the daemon's DEL_DEV; it then shuts its
            // store down and frees the shared memory under the device's key. A `create` of
            // the same id before that would have its new store freed under it (and its next
            // takeover would find no pages), and its statistics socket refused as taken.
            let exited = wait_until(deadline, || daemon.exited());
            return Ok((!exited).then_some(pid));
        }
        // The daemon hands a claimed device over instead of deleting it: someone ran swapon
        // (or mounted it) after the check above. Deleting it now would lose its pages.
        if !Path::new(&path).exists() || in_use(&path)? {
            return Err(DevicesError::DaemonRefused {
                path,
                pid,
                seconds: DAEMON_STOP_TIMEOUT.as_secs(),
                id,
            });
        }
    }
    del_dev_bounded(control, id).map(|()| None)
}

/// Remove device `id`, waiting a bounded time for its id to be free
/// ([`Control::del_dev_bounded`]), then until its char device is gone. Its id may stay taken
/// while something (a swap area) holds its old disk.
fn del_dev_bounded(control: &mut Control, id: u32) -> Result<(), DevicesError> {
    control.del_dev_bounded(id)?;
    if wait_until_gone(id, DELETE_TIMEOUT) {
        Ok(())
    } else {
        Err(DevicesError::DeleteTimeout {
            id,
            seconds: DELETE_TIMEOUT.as_secs(),
        })
    }
}

fn wait_until_gone(id: u32, timeout: Duration) -> bool {
    let class = char_class_path(id);
    wait_until(Instant::now() + timeout, || !Path::new(&class).exists())
}

/// Poll `done` every 20 ms until it holds (true) or `deadline` passes (false).
fn wait_until(deadline: Instant, done: impl Fn() -> bool) -> bool {
    while !done() {
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

    /// Reads share the gate; a hand-over waits for the reads under way and holds new ones off
    /// until it is done, the reads that wait for it included; hand-overs do not wait for each
    /// other; each wait gives up in time, and says why.
    #[test]
    fn the_hand_over_gate_orders_reads_and_hand_overs() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("run");
        let short = Duration::from_millis(50);
        let long = Duration::from_secs(10);
        let busy = Some(GateUnavailable::Busy);
        let read = HandOverGate::for_reads(&dir, short).expect("the first read");
        let other = HandOverGate::for_reads(&dir, short).expect("reads share it");
        // A hand-over waits for both reads, and gives up in time.
        let started = Instant::now();
        assert_eq!(HandOverGate::for_hand_over(&dir, short).err(), busy);
        assert!(started.elapsed() >= short);
        drop(other);
        // One read left: a hand-over that waits for it gets the gate once it ends; meanwhile
        // a new read waits behind the hand-over (the turnstile), not beside the old read.
        let (handed_tx, handed_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let handing = {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let gate = HandOverGate::for_hand_over(&dir, long).expect("after the read");
                handed_tx.send(()).unwrap();
                let _ = release_rx.recv();
                drop(gate);
            })
        };
        // Once the hand-over waits (at the gate, with the turnstile), no new read passes.
        let deadline = Instant::now() + long;
        while let Ok(passed) = HandOverGate::for_reads(&dir, Duration::ZERO) {
            drop(passed);
            assert!(Instant::now() < deadline, "the hand-over never waited");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(HandOverGate::for_reads(&dir, short).err(), busy);
        assert!(handed_rx.try_recv().is_err(), "handed over under a read");
        drop(read);
        handed_rx
            .recv_timeout(long)
            .expect("the hand-over never got the gate");
        assert_eq!(
            HandOverGate::for_reads(&dir, short).err(),
            busy,
            "read during the hand-over"
        );
        // Another hand-over goes on beside it.
        let second = HandOverGate::for_hand_over(&dir, short).expect("hand-overs share it");
        drop(second);
        release_tx.send(()).unwrap();
        handing.join().unwrap();
        HandOverGate::for_reads(&dir, long).expect("a read after the hand-overs");
        // Its files are root's only (the run directory is); without them, it says so.
        use std::os::unix::fs::PermissionsExt;
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join(HAND_OVER_GATE)), 0o600);
        let not_a_dir = root.path().join("file");
        std::fs::write(&not_a_dir, "").unwrap();
        assert_eq!(
            HandOverGate::for_reads(&not_a_dir, short).err(),
            Some(GateUnavailable::NoLockFiles)
        );
    }

    #[test]
    fn io_waits_on_a_quiesced_device_or_one_whose_daemon_is_gone() {
        use crate::ublk::sys::{UBLK_S_DEV_DEAD, UBLK_S_DEV_LIVE, UBLK_S_DEV_QUIESCED};
        let waits = |state: u16, daemon_alive: bool| io_waits(state_name(state), daemon_alive);
        assert!(!waits(UBLK_S_DEV_LIVE, true));
        assert!(waits(UBLK_S_DEV_LIVE, false));
        assert!(waits(UBLK_S_DEV_QUIESCED, true));
        assert!(waits(UBLK_S_DEV_QUIESCED, false));
        // Stopped (I/O fails at once) or never started: nothing waits.
        assert!(!waits(UBLK_S_DEV_DEAD, false));
    }

    const SWAPS: &str = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n\
        /dev/ublkb0\\040(deleted)               partition\t1048572\t\t20480\t\t100\n\
        /dev/ublkb1                             partition\t1048572\t\t0\t\t-2\n\
        /dev/ublkb10\\040(deleted)              partition\t1048572\t\t0\t\t-3\n";

    #[test]
    fn deleted_swap_areas_are_found_by_their_exact_name() {
        assert_eq!(
            deleted_swap_name(SWAPS, 0).as_deref(),
            Some("/dev/ublkb0 (deleted)")
        );
        assert_eq!(deleted_swap_name(SWAPS, 1), None);
        assert_eq!(
            deleted_swap_name(SWAPS, 10).as_deref(),
            Some("/dev/ublkb10 (deleted)")
        );
        assert_eq!(deleted_swap_name(SWAPS, 2), None);
        assert_eq!(deleted_swap_name("", 0), None);
    }

    fn usage(claimed: bool, served: bool, deleted: bool) -> Usage {
        Usage {
            path: "/dev/ublkb3".into(),
            claimed,
            deleted_swap: deleted.then(|| "/dev/ublkb3 (deleted)".into()),
            supervisor: served.then(|| "77".into()),
            served,
            state: if served { "live" } else { "quiesced" },
        }
    }

    /// A device in use, quiesced while its supervisor starts the next serving process, is
    /// not deleted even with --lose-pages: its pages are about to be served again (before,
    /// DEL_DEV went to active swap mid-takeover). Once no supervisor holds it, it is.
    #[test]
    fn a_device_its_supervisor_resumes_is_not_deleted() {
        let mut resuming = usage(true, false, false);
        resuming.supervisor = Some("77".into());
        for (force, lose) in [(false, false), (true, false), (false, true), (true, true)] {
            let error = check_delete(&resuming, 3, force, lose).unwrap_err();
            assert!(matches!(error, DevicesError::Resuming { .. }), "{error}");
            let text = error.to_string();
            assert!(
                text.contains("pid 77") && text.contains("trueno-ublk@3"),
                "{text}"
            );
        }
        resuming.supervisor = None;
        check_delete(&resuming, 3, false, true).unwrap();
        // Not in use: deleted whoever holds it.
        let mut idle = usage(false, false, false);
        idle.supervisor = Some("77".into());
        check_delete(&idle, 3, false, false).unwrap();
    }

    #[test]
    fn delete_refuses_what_would_lose_pages_unless_told() {
        type Case = ((bool, bool, bool), (bool, bool), Result<(), &'static str>);
        let cases: [Case; 14] = [
            // (claimed, served, deleted swap), (force, lose_pages) -> allowed or the refusal
            ((false, true, false), (false, false), Ok(())),
            ((false, false, false), (false, false), Ok(())),
            ((true, true, false), (false, false), Err("in use")),
            ((true, true, false), (true, false), Ok(())),
            ((true, false, false), (false, false), Err("no daemon")),
            ((true, false, false), (true, false), Err("no daemon")),
            ((true, false, false), (false, true), Ok(())),
            ((true, false, false), (true, true), Ok(())),
            ((false, false, true), (false, false), Err("deleted")),
            ((false, false, true), (true, false), Ok(())),
            ((false, false, true), (false, true), Ok(())),
            ((true, true, true), (true, false), Ok(())),
            // --lose-pages does not stand for --force where a daemon serves the device.
            ((true, true, false), (false, true), Err("in use")),
            ((true, true, false), (true, true), Ok(())),
        ];
        for ((claimed, served, deleted), (force, lose), want) in cases {
            let got = check_delete(&usage(claimed, served, deleted), 3, force, lose);
            let got = got.map_err(|e| match e {
                DevicesError::InUse { .. } => "in use",
                DevicesError::NoDaemon { .. } => "no daemon",
                DevicesError::DeletedSwap { .. } => "deleted",
                _ => "other",
            });
            assert_eq!(
                got, want,
                "claimed {claimed} served {served} deleted {deleted} force {force} lose {lose}"
            );
        }
    }

    #[test]
    fn refusals_say_what_to_do() {
        let no_daemon = check_delete(&usage(true, false, false), 3, true, false).unwrap_err();
        let text = no_daemon.to_string();
        assert!(text.contains("trueno-ublk@3"), "{text}");
        assert!(text.contains("--lose-pages"), "{text}");
        let deleted = check_delete(&usage(false, false, true), 3, false, false).unwrap_err();
        assert!(deleted.to_string().contains("--force"), "{deleted}");
    }
}
