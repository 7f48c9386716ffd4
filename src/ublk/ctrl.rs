//! `/dev/ublk-control`: add, configure, start, stop and delete devices, and query them.
//! Commands travel as io_uring `URING_CMD` on a ring of 128-byte SQEs, one at a time.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::sys::{self, CtrlCmd, CtrlDevInfo, Params};
use super::UblkError;

pub const CONTROL_PATH: &str = "/dev/ublk-control";
/// How long a control command's submit or wait that failed for a passing reason pauses before
/// it tries again.
const RETRY: Duration = Duration::from_millis(1);
/// How long [`Control::del_dev_bounded`] waits for a deleted device's id to be free: well
/// inside the unit's 10 s to stop, since the daemon's own stop waits it out where something
/// holds the deleted disk.
const DEL_DEV_ID_WAIT: Duration = Duration::from_secs(3);

/// An open control device.
pub struct Control {
    file: File,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    /// Whether the driver takes ioctl-encoded opcodes (`UBLK_F_CMD_IOCTL_ENCODE`); older ones
    /// only know the bare command numbers.
    ioctl_encode: bool,
    features: u64,
}

/// The opcode to send: the encoded form, or its bare number (`_IOC_NR`) for old drivers.
pub(super) fn opcode_for(encoded: u32, ioctl_encode: bool) -> u32 {
    if ioctl_encode {
        encoded
    } else {
        encoded & 0xff
    }
}

impl Control {
    /// Open the control device and ask the driver what it supports.
    pub fn open() -> Result<Self, UblkError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(CONTROL_PATH)
            .map_err(|error| match error.kind() {
                std::io::ErrorKind::NotFound => UblkError::DriverMissing,
                std::io::ErrorKind::PermissionDenied => UblkError::PermissionDenied,
                _ => UblkError::Io {
                    what: "opening /dev/ublk-control",
                    source: error,
                },
            })?;
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .build(4)
            .map_err(|source| UblkError::Io {
                what: "creating the control io_uring",
                source,
            })?;
        let mut control = Self {
            file,
            ring,
            ioctl_encode: true,
            features: 0,
        };
        let mut features = 0u64;
        match control.command(
            sys::UBLK_U_CMD_GET_FEATURES,
            u32::MAX,
            Some(&mut features),
            0,
        ) {
            Ok(_) => control.features = features,
            // Drivers before GET_FEATURES (6.5) refuse it: 6.0 and 6.1 with ENODEV (their
            // answer to any opcode they do not know), 6.2 to 6.4 with ENODEV too (every
            // command but ADD_DEV looks its device up first, and there is no device u32::MAX),
            // others with EINVAL or EOPNOTSUPP. Legacy opcodes work on all of them.
            Err(UblkError::Command {
                errno: libc::EINVAL | libc::EOPNOTSUPP | libc::ENODEV,
                ..
            }) => {
                control.ioctl_encode = false;
            }
            Err(other) => return Err(other),
        }
        if control.features != 0 {
            control.ioctl_encode = control.features & sys::UBLK_F_CMD_IOCTL_ENCODE != 0;
        }
        Ok(control)
    }

    /// The driver's `UBLK_F_*` feature bits (0 for drivers before GET_FEATURES).
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Send one control command and wait for its completion. `buffer`, if any, is read and/or
    /// written by the kernel through `ctrl_cmd.addr`; it is borrowed mutably until the
    /// completion arrives, so it outlives the kernel's use of it.
    fn command<T: Copy>(
        &mut self,
        encoded_op: u32,
        dev_id: u32,
        buffer: Option<&mut T>,
        data: u64,
    ) -> Result<i32, UblkError> {
        #[allow(
            clippy::cast_possible_truncation,
            reason = "the payloads are the kernel's structs, at most a few hundred bytes"
        )]
        // From the `&mut` itself, not a shared reborrow: the kernel writes through it.
        let (addr, len) = match buffer {
            Some(value) => (
                std::ptr::from_mut(value) as u64,
                std::mem::size_of::<T>() as u16,
            ),
            None => (0, 0),
        };
        let cmd = CtrlCmd {
            dev_id,
            queue_id: u16::MAX,
            len,
            addr,
            data: [data],
            ..Default::default()
        };
        let op = opcode_for(encoded_op, self.ioctl_encode);
        let entry = opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), op)
            .cmd(sys::command_bytes(&cmd))
            .build()
            .user_data(u64::from(op));
        // An entry left unsent by a failed submit (below) points at a buffer long gone: it
        // must never go out with this command.
        if !self.ring.submission().is_empty() {
            return Err(UblkError::Io {
                what: "sending a control command (an earlier one failed before the kernel took it; open the control device again)",
                source: std::io::ErrorKind::InvalidInput.into(),
            });
        }
        // SAFETY: the command points at `buffer` (or nothing); `buffer` is mutably borrowed for
        // this whole call, and the call returns only once the command's completion is in or
        // the kernel never took it (an entry that stays queued is never sent: see above), so
        // the kernel never sees a dangling address.
        unsafe { self.ring.submission().push(&entry) }.map_err(|_| UblkError::Io {
            what: "queueing a control command",
            source: std::io::ErrorKind::OutOfMemory.into(),
        })?;
        // Wait for the completion however long it takes: until it is in, the kernel may still
        // write `buffer` (the 6.12 driver runs control commands in io_uring's workers). A
        // signal can end io_uring_enter's wait after the command was sent; the call then
        // returns the count sent, not EINTR, with no completion yet.
        let mut failing = false;
        let cqe = loop {
            if let Some(cqe) = self.ring.completion().next() {
                break cqe;
            }
            let Err(source) = self.ring.submit_and_wait(1) else {
                continue;
            };
            match source.raw_os_error() {
                Some(libc::EINTR) => {}
                // No memory for the request yet: it stays queued; again shortly.
                Some(libc::EAGAIN | libc::EBUSY | libc::ENOMEM) => std::thread::sleep(RETRY),
                _ if !self.ring.submission().is_empty() => {
                    return Err(UblkError::Io {
                        what: "submitting a control command",
                        source,
                    })
                }
                _ => {
                    // Sent: the kernel holds `buffer` until the completion comes.
                    if !failing {
                        tracing::error!(%source, dev_id, "waiting for a control command's completion failed; waiting on");
                        failing = true;
                    }
                    std::thread::sleep(RETRY);
                }
            }
        };
        let res = cqe.result();
        if res < 0 {
            return Err(UblkError::command(encoded_op, dev_id, -res));
        }
        Ok(res)
    }

    /// ADD_DEV: the kernel fills in the id (when asked to pick), the queue count it allows and
    /// the rounded buffer size.
    pub fn add_dev(&mut self, info: &mut CtrlDevInfo) -> Result<(), UblkError> {
        self.command(sys::UBLK_U_CMD_ADD_DEV, info.dev_id, Some(info), 0)
            .map(drop)
    }

    pub fn set_params(&mut self, dev_id: u32, params: &Params) -> Result<(), UblkError> {
        let mut params = *params;
        self.command(sys::UBLK_U_CMD_SET_PARAMS, dev_id, Some(&mut params), 0)
            .map(drop)
    }

    /// START_DEV: returns once every queue's fetches have arrived and /dev/ublkbN exists.
    pub fn start_dev(&mut self, dev_id: u32, daemon_pid: u32) -> Result<(), UblkError> {
        self.command::<u8>(
            sys::UBLK_U_CMD_START_DEV,
            dev_id,
            None,
            u64::from(daemon_pid),
        )
        .map(drop)
    }

    pub fn stop_dev(&mut self, dev_id: u32) -> Result<(), UblkError> {
        self.command::<u8>(sys::UBLK_U_CMD_STOP_DEV, dev_id, None, 0)
            .map(drop)
    }

    /// DEL_DEV: removes the device, then waits (interruptibly, with no time limit) until its
    /// last user lets go of it: an active swap area keeps a deleted disk open forever.
    pub fn del_dev(&mut self, dev_id: u32) -> Result<(), UblkError> {
        self.command::<u8>(sys::UBLK_U_CMD_DEL_DEV, dev_id, None, 0)
            .map(drop)
    }

    /// DEL_DEV_ASYNC (Linux 6.9+): removes the device like DEL_DEV and returns at once; the id
    /// is free again once its last user lets go. Drivers without it answer as to any command
    /// they do not know (`unknown_command`).
    pub fn del_dev_async(&mut self, dev_id: u32) -> Result<(), UblkError> {
        if !self.ioctl_encode {
            return Err(UblkError::command(
                sys::UBLK_U_CMD_DEL_DEV_ASYNC,
                dev_id,
                libc::EOPNOTSUPP,
            ));
        }
        self.command::<u8>(sys::UBLK_U_CMD_DEL_DEV_ASYNC, dev_id, None, 0)
            .map(drop)
    }

    /// DEL_DEV with its wait for the id to be free bounded by [`DEL_DEV_ID_WAIT`]: the last
    /// user of a deleted disk may hold it for as long as it likes (a swap area, a process with
    /// it open), and a daemon waiting for it would keep its store's memory as long. Ok once
    /// the device is removed (its char device gone) and either its id is free, so that a
    /// `create` of it right after succeeds, or the time is up (logged). DEL_DEV_ASYNC and a
    /// look at the id where the driver has it (6.9+), else DEL_DEV on a thread of its own,
    /// left to the kernel past the time (the removal comes before its wait; this process's
    /// exit ends the wait). A device already gone (ENODEV) counts as removed.
    pub fn del_dev_bounded(&mut self, dev_id: u32) -> Result<(), UblkError> {
        let deadline = Instant::now() + DEL_DEV_ID_WAIT;
        let freed = match self.del_dev_async(dev_id) {
            // GET_DEV_INFO fails with ENODEV once the device's last reference is gone, a
            // moment before the driver frees the id (`ublk_cdev_rel`); DEL_DEV waits for the
            // latter, which only a `create` started in that moment could tell apart.
            Ok(()) => loop {
                match self.dev_info(dev_id) {
                    Ok(_) => {}
                    Err(UblkError::Command {
                        errno: libc::ENODEV,
                        ..
                    }) => break true,
                    Err(error) => {
                        // Removed all the same: only whether its id is free is not known.
                        tracing::warn!(id = dev_id, %error, "cannot tell whether the deleted device's id is free");
                        return Ok(());
                    }
                }
                if Instant::now() >= deadline {
                    break false;
                }
                std::thread::sleep(Duration::from_millis(20));
            },
            Err(UblkError::Command { errno, .. }) if unknown_command(errno) => {
                let (done_tx, done) = crossbeam_channel::bounded(1);
                std::thread::Builder::new()
                    .name("del-dev".into())
                    .spawn(move || {
                        let result =
                            Control::open().and_then(|mut control| control.del_dev(dev_id));
                        let _ = done_tx.send(result);
                    })
                    .map_err(|source| UblkError::Io {
                        what: "starting a thread for DEL_DEV (nothing was deleted)",
                        source,
                    })?;
                match done.recv_deadline(deadline) {
                    Ok(
                        Ok(())
                        | Err(UblkError::Command {
                            errno: libc::ENODEV,
                            ..
                        }),
                    ) => true,
                    Ok(Err(error)) => return Err(error),
                    Err(_) => false,
                }
            }
            Err(UblkError::Command {
                errno: libc::ENODEV,
                ..
            }) => true,
            Err(error) => return Err(error),
        };
        if !freed {
            tracing::warn!(
                id = dev_id,
                seconds = DEL_DEV_ID_WAIT.as_secs(),
                "the device is removed, but something still holds its deleted disk: its id is \
                 free once that lets go"
            );
        }
        Ok(())
    }

    /// START_USER_RECOVERY: the driver forgets the dead daemon's queues so a new one can fetch
    /// them. EBUSY while the device is not quiesced yet or the old `/dev/ublkcN` is still open.
    pub fn start_user_recovery(&mut self, dev_id: u32) -> Result<(), UblkError> {
        self.command::<u8>(sys::UBLK_U_CMD_START_USER_RECOVERY, dev_id, None, 0)
            .map(drop)
    }

    /// END_USER_RECOVERY: waits until every queue's fetches have arrived, then unquiesces the
    /// device with `daemon_pid` as its server: requests that waited are served from here on.
    pub fn end_user_recovery(&mut self, dev_id: u32, daemon_pid: u32) -> Result<(), UblkError> {
        self.command::<u8>(
            sys::UBLK_U_CMD_END_USER_RECOVERY,
            dev_id,
            None,
            u64::from(daemon_pid),
        )
        .map(drop)
    }

    pub fn dev_info(&mut self, dev_id: u32) -> Result<CtrlDevInfo, UblkError> {
        let mut info = CtrlDevInfo::default();
        self.command(sys::UBLK_U_CMD_GET_DEV_INFO, dev_id, Some(&mut info), 0)?;
        Ok(info)
    }

    pub fn params(&mut self, dev_id: u32) -> Result<Params, UblkError> {
        let mut params = Params {
            len: sys::PARAMS_LEN,
            ..Default::default()
        };
        self.command(sys::UBLK_U_CMD_GET_PARAMS, dev_id, Some(&mut params), 0)?;
        Ok(params)
    }

    /// The device's size in bytes, from its parameters (GET_PARAMS).
    pub fn device_bytes(&mut self, dev_id: u32) -> Result<u64, UblkError> {
        Ok(self.params(dev_id)?.basic.dev_sectors << 9)
    }
}

/// ENOTSUPP, the kernel's own errno (not in libc): what ublk drivers from 6.2 until the fix of
/// late 2024 (6.13, and the stable kernels it went back to) answer a command they do not know.
const ENOTSUPP: i32 = 524;

/// Whether `errno` is a driver's answer to a command it does not know: EOPNOTSUPP, ENOTSUPP
/// (6.2 to 6.12 before the fix: Ubuntu 24.04's 6.8, say) or EINVAL (drivers that take no
/// encoded opcodes).
fn unknown_command(errno: i32) -> bool {
    matches!(errno, libc::EOPNOTSUPP | libc::EINVAL | ENOTSUPP)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver of 6.5 to 6.8 (GET_FEATURES known, DEL_DEV_ASYNC not) answers DEL_DEV_ASYNC
    /// with ENOTSUPP: taken for "not known", so that DEL_DEV deletes the device (before, the
    /// delete failed and every device stayed behind, dead).
    #[test]
    fn drivers_answers_to_an_unknown_command_are_known() {
        for errno in [libc::EOPNOTSUPP, libc::EINVAL, 524] {
            assert!(unknown_command(errno), "{errno}");
        }
        for errno in [libc::ENODEV, libc::EPERM, libc::EBUSY, libc::EIO] {
            assert!(!unknown_command(errno), "{errno}");
        }
    }

    #[test]
    fn old_drivers_get_bare_command_numbers() {
        assert_eq!(opcode_for(sys::UBLK_U_CMD_ADD_DEV, false), 0x04);
        assert_eq!(opcode_for(sys::UBLK_U_CMD_START_DEV, false), 0x06);
        assert_eq!(opcode_for(sys::UBLK_U_IO_COMMIT_AND_FETCH_REQ, false), 0x21);
        assert_eq!(
            opcode_for(sys::UBLK_U_CMD_ADD_DEV, true),
            sys::UBLK_U_CMD_ADD_DEV
        );
    }

    #[test]
    fn add_dev_refused_with_eacces_is_the_device_limit() {
        let limit = UblkError::command(sys::UBLK_U_CMD_ADD_DEV, 0, libc::EACCES);
        assert!(matches!(limit, UblkError::DeviceLimit), "{limit}");
        assert!(limit.to_string().contains("ublks_max"), "{limit}");
        for (op, errno) in [
            (sys::UBLK_U_CMD_ADD_DEV, libc::EPERM),
            (sys::UBLK_U_CMD_START_DEV, libc::EACCES),
        ] {
            let error = UblkError::command(op, 0, errno);
            assert!(matches!(error, UblkError::PermissionDenied), "{error}");
        }
    }

    #[test]
    fn opening_without_a_driver_says_what_to_do() {
        if std::path::Path::new(CONTROL_PATH).exists() {
            return; // this host has the driver; the error path is not reachable here
        }
        let error = Control::open().err().expect("no driver, no control device");
        assert!(matches!(error, UblkError::DriverMissing));
        assert!(error.to_string().contains("modprobe ublk_drv"), "{error}");
    }
}
