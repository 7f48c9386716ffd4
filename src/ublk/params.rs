//! The device's shape as the kernel wants it: the `ADD_DEV` info and the `SET_PARAMS` block.

#![forbid(unsafe_code)]

use super::sys::{
    self, CtrlDevInfo, ParamBasic, ParamDiscard, Params, UBLK_MAX_QUEUE_DEPTH,
    UBLK_PARAM_TYPE_BASIC, UBLK_PARAM_TYPE_DISCARD,
};
use super::UblkError;

/// Logical and physical block size: one page, so every request is whole pages.
pub const BLOCK_SHIFT: u8 = 12;
pub const BLOCK_SIZE: u64 = 1 << BLOCK_SHIFT;
const BLOCK_SIZE_U32: u32 = 1 << BLOCK_SHIFT;
/// Largest single discard or write-zeroes request we advertise (1 GiB).
const MAX_DISCARD_SECTORS: u32 = (1 << 30) >> 9;
/// Largest device we accept: dev_sectors must fit the kernel's sector_t arithmetic with room.
pub const MAX_DEVICE_BYTES: u64 = 1 << 50;
/// Most queues a device may have. The driver allows 4096, but each queue is a thread that
/// holds its tags' buffers locked, and blk-mq maps at most one queue per CPU.
pub const MAX_QUEUES: u16 = 64;
/// Most tags per queue: the driver's limit.
pub const MAX_DEPTH: u16 = UBLK_MAX_QUEUE_DEPTH;
/// Highest device id: the driver's `UBLK_MAX_UBLKS` (one minor number each, 20 bits) less one;
/// it refuses ADD_DEV above it (and kernels before 6.x read the id as an int, so one of 2^31
/// or more had the kernel pick an id itself).
pub const MAX_DEVICE_ID: u32 = (1 << 20) - 1;
/// Largest READ or WRITE: what a user-copy position can address within a request (32 MiB,
/// the driver's `UBLK_IO_BUF_BITS`).
const MAX_IO_BYTES: u32 = 1 << sys::UBLK_IO_BUF_BITS;

/// What the user asked for, before the kernel has seen it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    /// `None`: the kernel picks the id.
    pub id: Option<u32>,
    pub size_bytes: u64,
    pub queues: u16,
    pub depth: u16,
    /// The largest READ or WRITE the kernel will send when every tag has a buffer of that
    /// size (no user copy).
    pub max_io_bytes: u32,
    /// `Some(largest READ or WRITE)`: copy request data with pread/pwrite on the char device
    /// (`UBLK_F_USER_COPY`, Linux 6.5+) where the driver offers it, through one staging buffer
    /// per queue, a piece at a time; requests may then be larger than a tag buffer could
    /// sensibly be.
    pub user_copy_max_io_bytes: Option<u32>,
    /// The most that the buffers of every tag of every queue may take together where the
    /// device has them (no user copy): they stay locked for the device's life.
    pub tag_buffers_limit_bytes: u64,
}

impl DeviceSpec {
    /// Check the spec before the kernel sees it, with messages a user can act on.
    pub fn validate(&self) -> Result<(), UblkError> {
        let bad = |what: String| Err(UblkError::InvalidSpec(what));
        if self.size_bytes == 0 || !self.size_bytes.is_multiple_of(BLOCK_SIZE) {
            return bad(format!(
                "size {} is not a positive multiple of 4 KiB",
                self.size_bytes
            ));
        }
        if self.size_bytes > MAX_DEVICE_BYTES {
            return bad(format!(
                "size {} is larger than the 1 PiB limit",
                self.size_bytes
            ));
        }
        if self.queues == 0 || self.queues > MAX_QUEUES {
            return bad(format!("{} queues: use 1 to {MAX_QUEUES}", self.queues));
        }
        if self.depth == 0 || self.depth > MAX_DEPTH {
            return bad(format!("queue depth {}: use 1 to {MAX_DEPTH}", self.depth));
        }
        for max_io in [Some(self.max_io_bytes), self.user_copy_max_io_bytes]
            .into_iter()
            .flatten()
        {
            if max_io < BLOCK_SIZE_U32 || max_io % BLOCK_SIZE_U32 != 0 || max_io > MAX_IO_BYTES {
                return bad(format!(
                    "requests of up to {max_io} bytes: use a multiple of 4 KiB up to 32 MiB"
                ));
            }
        }
        if let Some(id) = self.id.filter(|&id| id > MAX_DEVICE_ID) {
            return bad(format!(
                "device id {id} is out of range: the ublk driver takes 0 to {MAX_DEVICE_ID}"
            ));
        }
        Ok(())
    }

    /// Refuse the device the driver made of this spec (`info`, its answer to ADD_DEV: whether
    /// user copy is on, how many queues it gave, at most one per CPU) where its tags' buffers
    /// would take more than `tag_buffers_limit_bytes`.
    pub fn check_tag_buffers(&self, info: &CtrlDevInfo) -> Result<(), UblkError> {
        if info.flags & sys::UBLK_F_USER_COPY != 0 {
            return Ok(());
        }
        let bytes = u64::from(info.nr_hw_queues)
            * u64::from(info.queue_depth)
            * u64::from(info.max_io_buf_bytes);
        if bytes <= self.tag_buffers_limit_bytes {
            return Ok(());
        }
        let why = if self.user_copy_max_io_bytes.is_some() {
            "this kernel's ublk driver has no user copy (Linux 6.5+)"
        } else {
            "user copy is off (`--no-user-copy`, `user-copy = no`)"
        };
        Err(UblkError::InvalidSpec(format!(
            "{} queue(s) of depth {} would lock {} MiB in a {} KiB buffer per tag, as {why}: \
             more than the {} MiB allowed here; lower the depth or the queues",
            info.nr_hw_queues,
            info.queue_depth,
            bytes >> 20,
            info.max_io_buf_bytes >> 10,
            self.tag_buffers_limit_bytes >> 20
        )))
    }

    /// The `ADD_DEV` payload, asking only for features the driver reported: encoded opcodes,
    /// recovery with re-issue when the driver has both (see `survives_daemon`), and user copy
    /// when the spec wants it.
    pub fn dev_info(&self, driver_features: u64) -> CtrlDevInfo {
        let mut flags = driver_features & sys::UBLK_F_CMD_IOCTL_ENCODE;
        let mut max_io_buf_bytes = self.max_io_bytes;
        if let Some(max_io) = self.user_copy_max_io_bytes {
            if driver_features & sys::UBLK_F_USER_COPY != 0 {
                flags |= sys::UBLK_F_USER_COPY;
                max_io_buf_bytes = max_io;
            }
        }
        if survives_daemon(driver_features) {
            flags |= sys::UBLK_F_RECOVERY_REISSUE;
        }
        CtrlDevInfo {
            nr_hw_queues: self.queues,
            queue_depth: self.depth,
            max_io_buf_bytes,
            dev_id: self.id.unwrap_or(u32::MAX),
            flags,
            ..Default::default()
        }
    }
}

/// Whether `flags` (a driver's features, or a device's flags) let a device outlive its daemon
/// with no request lost: `UBLK_F_USER_RECOVERY` and `UBLK_F_USER_RECOVERY_REISSUE` (Linux 6.0+;
/// an unprivileged device gets neither).
pub fn survives_daemon(flags: u64) -> bool {
    flags & sys::UBLK_F_RECOVERY_REISSUE == sys::UBLK_F_RECOVERY_REISSUE
}

/// Why a device of `flags` and logical blocks of `1 << logical_bs_shift` bytes, made by
/// another ublk server, is not one this daemon can serve; `None` if it is. Its requests are
/// served on 4 KiB blocks with the data at hand (no GET_DATA round, no zones).
pub fn unservable(flags: u64, logical_bs_shift: u8) -> Option<String> {
    if flags & sys::UBLK_F_NEED_GET_DATA != 0 {
        return Some("it asks for its write data in a second round (NEED_GET_DATA)".into());
    }
    if flags & sys::UBLK_F_ZONED != 0 {
        return Some("it is zoned".into());
    }
    (logical_bs_shift != BLOCK_SHIFT).then(|| {
        format!(
            "its logical blocks are {} bytes, not {BLOCK_SIZE}",
            1u64.checked_shl(u32::from(logical_bs_shift)).unwrap_or(0)
        )
    })
}

/// The `SET_PARAMS` payload for a device of `size_bytes` whose tags carry `max_io_bytes`
/// (as the kernel returned it from `ADD_DEV`): 4 KiB blocks, discard and write-zeroes.
pub fn device_params(size_bytes: u64, max_io_bytes: u32) -> Params {
    Params {
        len: sys::PARAMS_LEN,
        types: UBLK_PARAM_TYPE_BASIC | UBLK_PARAM_TYPE_DISCARD,
        basic: ParamBasic {
            logical_bs_shift: BLOCK_SHIFT,
            physical_bs_shift: BLOCK_SHIFT,
            io_opt_shift: BLOCK_SHIFT,
            io_min_shift: BLOCK_SHIFT,
            max_sectors: max_io_bytes >> 9,
            dev_sectors: size_bytes >> 9,
            ..Default::default()
        },
        discard: ParamDiscard {
            discard_alignment: 0,
            discard_granularity: BLOCK_SIZE_U32,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_sectors: MAX_DISCARD_SECTORS,
            // The driver refuses anything but one segment when discard is advertised.
            max_discard_segments: 1,
            reserved0: 0,
        },
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> DeviceSpec {
        DeviceSpec {
            id: None,
            size_bytes: 1 << 30,
            queues: 1,
            depth: 64,
            max_io_bytes: 256 << 10,
            user_copy_max_io_bytes: None,
            tag_buffers_limit_bytes: 64 << 20,
        }
    }

    #[test]
    fn tag_buffers_past_the_limit_are_refused_where_the_device_has_them() {
        // 1 queue x 64 tags x 256 KiB = 16 MiB, within 64 MiB.
        assert!(spec().check_tag_buffers(&spec().dev_info(0x1fe)).is_ok());
        let deep = DeviceSpec {
            depth: 512,
            ..spec()
        };
        let refused = deep
            .check_tag_buffers(&deep.dev_info(0x1fe))
            .expect_err("128 MiB of tag buffers");
        assert!(
            refused.to_string().contains("user copy is off"),
            "{refused}"
        );
        // The driver gives fewer queues than asked (one per CPU): its answer counts.
        let mut info = DeviceSpec {
            queues: 8,
            ..spec()
        }
        .dev_info(0x1fe);
        assert!(spec().check_tag_buffers(&info).is_err());
        info.nr_hw_queues = 2;
        assert!(spec().check_tag_buffers(&info).is_ok());
        // With user copy there are no tag buffers; asked for but not offered, there are.
        let wanted = DeviceSpec {
            user_copy_max_io_bytes: Some(1 << 20),
            ..deep
        };
        assert!(wanted.check_tag_buffers(&wanted.dev_info(0x1fe)).is_ok());
        let refused = wanted
            .check_tag_buffers(&wanted.dev_info(0x7e))
            .expect_err("no user copy offered");
        assert!(refused.to_string().contains("no user copy"), "{refused}");
    }

    #[test]
    fn devices_of_other_servers_this_daemon_cannot_serve_are_named() {
        let ours = sys::UBLK_F_RECOVERY_REISSUE | sys::UBLK_F_USER_COPY;
        assert_eq!(unservable(ours, BLOCK_SHIFT), None);
        assert!(unservable(ours | sys::UBLK_F_NEED_GET_DATA, BLOCK_SHIFT).is_some());
        assert!(unservable(ours | sys::UBLK_F_ZONED, BLOCK_SHIFT).is_some());
        let small = unservable(ours, 9).expect("512-byte blocks");
        assert!(small.contains("512 bytes"), "{small}");
        assert!(unservable(ours, 200).is_some());
    }

    #[test]
    fn params_describe_a_4k_device_with_discard() {
        let params = device_params(1 << 30, 256 << 10);
        assert_eq!(params.len, 112);
        assert_eq!(
            params.types,
            UBLK_PARAM_TYPE_BASIC | UBLK_PARAM_TYPE_DISCARD
        );
        assert_eq!(params.basic.logical_bs_shift, 12);
        assert_eq!(params.basic.physical_bs_shift, 12);
        assert_eq!(params.basic.dev_sectors, (1 << 30) / 512);
        assert_eq!(params.basic.max_sectors, 512);
        assert_eq!(params.discard.discard_granularity, 4096);
        assert_eq!(params.discard.max_discard_segments, 1);
        assert!(params.discard.max_write_zeroes_sectors > 0);
    }

    #[test]
    fn dev_info_asks_only_for_reported_features() {
        let info = spec().dev_info(0x1fe);
        assert_eq!(
            info.flags,
            sys::UBLK_F_CMD_IOCTL_ENCODE
                | sys::UBLK_F_USER_RECOVERY
                | sys::UBLK_F_USER_RECOVERY_REISSUE
        );
        assert!(survives_daemon(info.flags));
        // Recovery without re-issue would fail the requests the dead daemon held: not asked.
        let info = spec().dev_info(sys::UBLK_F_CMD_IOCTL_ENCODE | sys::UBLK_F_USER_RECOVERY);
        assert_eq!(info.flags, sys::UBLK_F_CMD_IOCTL_ENCODE);
        assert!(!survives_daemon(info.flags));
        assert_eq!(info.dev_id, u32::MAX);
        assert_eq!(spec().dev_info(0).flags, 0);
        let info = DeviceSpec {
            id: Some(3),
            ..spec()
        }
        .dev_info(0x1fe);
        assert_eq!(
            (info.dev_id, info.nr_hw_queues, info.queue_depth),
            (3, 1, 64)
        );
        assert_eq!(info.max_io_buf_bytes, 256 << 10);
        // User copy, and its larger requests, only when asked for and offered.
        let wanted = DeviceSpec {
            user_copy_max_io_bytes: Some(1 << 20),
            ..spec()
        };
        let info = wanted.dev_info(0x1fe);
        assert_ne!(info.flags & sys::UBLK_F_USER_COPY, 0);
        assert_eq!(info.max_io_buf_bytes, 1 << 20);
        let info = wanted.dev_info(0x7e);
        assert_eq!(info.flags & sys::UBLK_F_USER_COPY, 0);
        assert_eq!(info.max_io_buf_bytes, 256 << 10);
        assert_eq!(spec().dev_info(0x1fe).flags & sys::UBLK_F_USER_COPY, 0);
    }

    #[test]
    fn specs_are_validated() {
        assert!(spec().validate().is_ok());
        let bad = [
            DeviceSpec {
                size_bytes: 0,
                ..spec()
            },
            DeviceSpec {
                size_bytes: 4097,
                ..spec()
            },
            DeviceSpec {
                size_bytes: MAX_DEVICE_BYTES + 4096,
                ..spec()
            },
            DeviceSpec {
                queues: 0,
                ..spec()
            },
            DeviceSpec { depth: 0, ..spec() },
            DeviceSpec {
                depth: 4097,
                ..spec()
            },
            DeviceSpec {
                max_io_bytes: 1000,
                ..spec()
            },
            DeviceSpec {
                user_copy_max_io_bytes: Some(1000),
                ..spec()
            },
            DeviceSpec {
                user_copy_max_io_bytes: Some(64 << 20),
                ..spec()
            },
            DeviceSpec {
                id: Some(u32::MAX),
                ..spec()
            },
            DeviceSpec {
                id: Some(MAX_DEVICE_ID + 1),
                ..spec()
            },
        ];
        assert!(DeviceSpec {
            id: Some(MAX_DEVICE_ID),
            ..spec()
        }
        .validate()
        .is_ok());
        for spec in bad {
            assert!(spec.validate().is_err(), "{spec:?} should be refused");
        }
    }
}
