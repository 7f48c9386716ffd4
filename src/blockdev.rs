//! "Is this block device in use?", asked the way the kernel answers it.
//!
//! swapon(2) and mount(2) claim their block device exclusively, and while they hold it an
//! `O_EXCL` open of the device fails with `EBUSY`, whatever name or mount namespace the swap
//! area or file system was set up through. Comparing names in /proc/swaps is not enough: a
//! swapon run in a private mount namespace (a sandboxed systemd service) shows up there as
//! `/ublkb0`, and a mounted device is not in /proc/swaps at all. Stopping a claimed ublk device
//! fails every later I/O to it, and when that is swap the processes with pages out die (PID 1
//! among them: a kernel panic). So `delete` and the daemon's SIGTERM path ask this instead.

#![forbid(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// What an exclusive open of a block device found.
#[derive(Debug)]
pub enum Claim {
    /// Nobody held it: this file holds it now, until it is dropped, so nothing (swapon, mount)
    /// can take the device meanwhile.
    Held(File),
    /// The kernel holds it (`EBUSY`): active swap, a mounted file system, a device-mapper or
    /// md member, or another `O_EXCL` opener.
    Busy,
}

/// Claim `path` (a block device) if nobody holds it. An error other than `EBUSY` (no such
/// node, no permission) means "cannot tell": callers that would lose data on a wrong "no"
/// must treat it as "in use".
pub fn claim(path: &Path) -> io::Result<Claim> {
    claim_with(path, open_exclusive)
}

/// [`claim`] with the open behind a function, so the decision can be tested on any answer
/// the kernel might give.
pub fn claim_with(path: &Path, open: impl FnOnce(&Path) -> io::Result<File>) -> io::Result<Claim> {
    match open(path) {
        Ok(file) => Ok(Claim::Held(file)),
        Err(error) if error.raw_os_error() == Some(libc::EBUSY) => Ok(Claim::Busy),
        Err(error) => Err(error),
    }
}

/// Whether the kernel holds `path` now (see [`claim`]); the claim this takes to ask is let go
/// at once, so the answer may be stale by the time it is read.
pub fn is_claimed(path: &Path) -> io::Result<bool> {
    claim(path).map(|claim| matches!(claim, Claim::Busy))
}

/// Open read-only with `O_EXCL`, which for a block device means "claim it": it fails with
/// `EBUSY` while someone else holds the claim. `O_NONBLOCK` so that a device without media
/// (or one that is being torn down) does not make the open wait.
pub fn open_exclusive(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    #[test]
    fn ebusy_means_claimed_and_other_errors_are_reported() {
        let path = Path::new("/dev/ublkb0");
        let busy = claim_with(path, |_| Err(io::Error::from_raw_os_error(libc::EBUSY)));
        assert!(matches!(busy, Ok(Claim::Busy)));
        let missing = claim_with(path, |_| Err(io::Error::from_raw_os_error(libc::ENOENT)));
        assert_eq!(
            missing.map_err(|e| e.raw_os_error()).err(),
            Some(Some(libc::ENOENT))
        );
        let free = claim_with(path, |_| File::open("/dev/null"));
        assert!(matches!(free, Ok(Claim::Held(_))));
    }

    /// A block device on this machine that nobody claims now (loop devices first), if any.
    fn unclaimed_block_device() -> Option<std::path::PathBuf> {
        let mut candidates: Vec<_> = std::fs::read_dir("/dev")
            .ok()?
            .flatten()
            .filter(|entry| entry.file_type().is_ok_and(|t| t.is_block_device()))
            .map(|entry| entry.path())
            .collect();
        candidates.sort_by_key(|p| !p.to_string_lossy().starts_with("/dev/loop"));
        candidates
            .into_iter()
            .find(|path| matches!(is_claimed(path), Ok(false)))
    }

    /// A real kernel claim, and nothing in /proc/swaps: the device is claimed through one
    /// name and asked about through another (a symlink), so no comparison of names or of
    /// swap entries could give the answer. Needs a block device that can be opened (root);
    /// skipped, saying so, where there is none.
    #[test]
    fn a_real_exclusive_claim_is_seen_through_another_name() {
        let Some(device) = unclaimed_block_device() else {
            eprintln!("skipped: no block device this user can open exclusively");
            return;
        };
        let dir = std::env::temp_dir().join(format!("trueno-ublk-claim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let other_name = dir.join("same-device");
        let _ = std::fs::remove_file(&other_name);
        std::os::unix::fs::symlink(&device, &other_name).unwrap();

        let holder = open_exclusive(&device).unwrap();
        let while_held = is_claimed(&other_name).unwrap();
        drop(holder);
        let after = is_claimed(&other_name).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();

        assert!(
            while_held,
            "{} held with O_EXCL reads as free",
            device.display()
        );
        assert!(
            !after,
            "{} reads as claimed after release",
            device.display()
        );
    }
}
