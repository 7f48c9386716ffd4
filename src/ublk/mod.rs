//! The ublk kernel protocol: UAPI definitions (`sys`), the control device (`ctrl`), request
//! decoding (`io`), device parameters (`params`), the per-queue loop (`queue`) and its large
//! reads served on two threads (`shared_read`), memory shared with the kernel (`mmap`) and
//! one device's life cycle (`device`). Nothing here knows about compression: requests go to a
//! `BlockHandler` (`handler`).

pub mod ctrl;
pub mod device;
mod handler;
pub mod io;
pub mod mmap;
pub mod params;
mod poll;
pub mod queue;
mod shared_read;
pub mod sys;
pub mod timing;

pub use ctrl::Control;
pub use device::{AddedDevice, Device, Standby};
pub use handler::{BlockHandler, Failure, Handled};
pub use io::{Op, Request};
pub use params::{survives_daemon, DeviceSpec};
pub use timing::{IoTiming, IoTimingReport};

/// Errors of the ublk layer, worded so a user knows what to do.
#[derive(Debug, thiserror::Error)]
pub enum UblkError {
    #[error(
        "the ublk driver is not available (no /dev/ublk-control): run `modprobe ublk_drv`; \
         it needs Linux >= 6.0 built with CONFIG_BLK_DEV_UBLK"
    )]
    DriverMissing,
    #[error("permission denied on /dev/ublk-control: run as root")]
    PermissionDenied,
    #[error(
        "the ublk driver refused another device: before Linux 6.15 (and its backports) it \
         takes at most `ublks_max` devices (64 unless /sys/module/ublk_drv/parameters/ublks_max \
         says otherwise), root's too: delete devices no longer used (`trueno-ublk list`)"
    )]
    DeviceLimit,
    #[error(
        "device id {0} is already in use (a running daemon serves it): pick another --id or \
         delete it first"
    )]
    IdInUse(u32),
    #[error(
        "device id {0} is still taken by a deleted device whose block device something holds \
         open (a swap area `/dev/ublkb{0} (deleted)` in /proc/swaps, or a mount): it is free \
         once that lets go; pick another --id meanwhile"
    )]
    IdHeld(u32),
    #[error("device {id} cannot be resumed: {reason}")]
    CannotResume { id: u32, reason: String },
    #[error("hand-over: {0}")]
    HandOver(String),
    #[error("no ublk device with id {0}")]
    NoSuchDevice(u32),
    #[error("{0}")]
    InvalidSpec(String),
    #[error("ublk {command} for device {dev_id} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    Command {
        command: &'static str,
        dev_id: u32,
        errno: i32,
    },
    #[error("queue setup failed: {0}")]
    QueueSetup(String),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
}

impl UblkError {
    pub(crate) fn command(encoded_op: u32, dev_id: u32, errno: i32) -> Self {
        let command = match encoded_op & 0xff {
            0x02 => "GET_DEV_INFO",
            0x04 => "ADD_DEV",
            0x05 => "DEL_DEV",
            0x06 => "START_DEV",
            0x07 => "STOP_DEV",
            0x08 => "SET_PARAMS",
            0x09 => "GET_PARAMS",
            0x10 => "START_USER_RECOVERY",
            0x11 => "END_USER_RECOVERY",
            0x13 => "GET_FEATURES",
            0x14 => "DEL_DEV_ASYNC",
            _ => "command",
        };
        // Before Linux 6.15 ADD_DEV answers EACCES at its device limit, whoever asks; a
        // caller without CAP_SYS_ADMIN gets EPERM there (and cannot open the node at all).
        if command == "ADD_DEV" && errno == libc::EACCES {
            return UblkError::DeviceLimit;
        }
        if errno == libc::EPERM || errno == libc::EACCES {
            return UblkError::PermissionDenied;
        }
        UblkError::Command {
            command,
            dev_id,
            errno,
        }
    }
}
