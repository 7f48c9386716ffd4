//! The ublk UAPI (`include/uapi/linux/ublk_cmd.h`) as Rust: command opcodes (ioctl-encoded),
//! feature flags, and the `#[repr(C)]` structs shared with the kernel, each with compile-time
//! size and offset checks against the header. Nothing but the UAPI: other system calls are in
//! `crate::os`.

use std::mem::{offset_of, size_of};

/// `_IOC` direction bits, from `include/uapi/asm-generic/ioctl.h`.
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;
const IOC_TYPE_UBLK: u32 = b'u' as u32;

#[allow(
    clippy::cast_possible_truncation,
    reason = "the command structs are 32 and 16 bytes (asserted below): they fit the 14-bit size field"
)]
const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (IOC_TYPE_UBLK << 8) | nr
}
const fn ior_ctrl(nr: u32) -> u32 {
    ioc(IOC_READ, nr, size_of::<CtrlCmd>())
}
const fn iowr_ctrl(nr: u32) -> u32 {
    ioc(IOC_READ | IOC_WRITE, nr, size_of::<CtrlCmd>())
}
const fn iowr_io(nr: u32) -> u32 {
    ioc(IOC_READ | IOC_WRITE, nr, size_of::<IoCmd>())
}

// Control commands, sent to /dev/ublk-control.
pub const UBLK_U_CMD_GET_DEV_INFO: u32 = ior_ctrl(0x02);
pub const UBLK_U_CMD_ADD_DEV: u32 = iowr_ctrl(0x04);
pub const UBLK_U_CMD_DEL_DEV: u32 = iowr_ctrl(0x05);
pub const UBLK_U_CMD_START_DEV: u32 = iowr_ctrl(0x06);
pub const UBLK_U_CMD_STOP_DEV: u32 = iowr_ctrl(0x07);
pub const UBLK_U_CMD_SET_PARAMS: u32 = iowr_ctrl(0x08);
pub const UBLK_U_CMD_GET_PARAMS: u32 = ior_ctrl(0x09);
pub const UBLK_U_CMD_START_USER_RECOVERY: u32 = iowr_ctrl(0x10);
pub const UBLK_U_CMD_END_USER_RECOVERY: u32 = iowr_ctrl(0x11);
pub const UBLK_U_CMD_GET_FEATURES: u32 = ior_ctrl(0x13);
/// DEL_DEV without waiting for the device's last user (Linux 6.9+; encoded form only).
pub const UBLK_U_CMD_DEL_DEV_ASYNC: u32 = ior_ctrl(0x14);

// I/O commands, sent to /dev/ublkcN by the queue threads.
pub const UBLK_U_IO_FETCH_REQ: u32 = iowr_io(0x20);
pub const UBLK_U_IO_COMMIT_AND_FETCH_REQ: u32 = iowr_io(0x21);

/// Completion result of a fetch: a request is ready in the tag's descriptor.
pub const UBLK_IO_RES_OK: i32 = 0;
/// Completion result of a fetch: the queue is going away, do not re-arm the tag.
pub const UBLK_IO_RES_ABORT: i32 = -libc::ENODEV;

/// Offset of queue 0's descriptor array in the char device's mmap space.
pub const UBLKSRV_CMD_BUF_OFFSET: i64 = 0;
/// With `UBLK_F_USER_COPY`, where a request's data is in the char device's file space (for
/// pread/pwrite): this, plus the queue id and the tag shifted into place, plus the byte offset
/// within the request (below 32 MiB).
const UBLKSRV_IO_BUF_OFFSET: u64 = 0x8000_0000;
pub const UBLK_IO_BUF_BITS: u32 = 25;
const UBLK_TAG_OFF: u32 = UBLK_IO_BUF_BITS;
const UBLK_QID_OFF: u32 = UBLK_TAG_OFF + 16;

/// The char device file position of byte `offset` of the request held by tag `tag` of queue
/// `q_id` (`UBLK_F_USER_COPY`).
pub fn user_copy_pos(q_id: u16, tag: u16, offset: usize) -> u64 {
    UBLKSRV_IO_BUF_OFFSET
        + (u64::from(q_id) << UBLK_QID_OFF)
        + (u64::from(tag) << UBLK_TAG_OFF)
        + offset as u64
}
/// The descriptor arrays are laid out for this depth whatever the device's depth is.
pub const UBLK_MAX_QUEUE_DEPTH: u16 = 4096;

// Feature flags (`UBLK_F_*`), reported by GET_FEATURES and requested in ADD_DEV.
pub const UBLK_F_SUPPORT_ZERO_COPY: u64 = 1 << 0;
pub const UBLK_F_URING_CMD_COMP_IN_TASK: u64 = 1 << 1;
pub const UBLK_F_NEED_GET_DATA: u64 = 1 << 2;
pub const UBLK_F_USER_RECOVERY: u64 = 1 << 3;
pub const UBLK_F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
pub const UBLK_F_UNPRIVILEGED_DEV: u64 = 1 << 5;
pub const UBLK_F_CMD_IOCTL_ENCODE: u64 = 1 << 6;
pub const UBLK_F_USER_COPY: u64 = 1 << 7;
pub const UBLK_F_ZONED: u64 = 1 << 8;
pub const UBLK_F_USER_RECOVERY_FAIL_IO: u64 = 1 << 9;
pub const UBLK_F_UPDATE_SIZE: u64 = 1 << 10;
pub const UBLK_F_AUTO_BUF_REG: u64 = 1 << 11;
pub const UBLK_F_QUIESCE: u64 = 1 << 12;
pub const UBLK_F_PER_IO_DAEMON: u64 = 1 << 13;
pub const UBLK_F_BUF_REG_OFF_DAEMON: u64 = 1 << 14;
pub const UBLK_F_BATCH_IO: u64 = 1 << 15;
pub const UBLK_F_INTEGRITY: u64 = 1 << 16;
/// The feature bits by the names the kernel's header gives them (without `UBLK_F_`), for
/// the log: which driver a machine has says what it offers.
const FEATURE_NAMES: [(u64, &str); 17] = [
    (UBLK_F_SUPPORT_ZERO_COPY, "SUPPORT_ZERO_COPY"),
    (UBLK_F_URING_CMD_COMP_IN_TASK, "URING_CMD_COMP_IN_TASK"),
    (UBLK_F_NEED_GET_DATA, "NEED_GET_DATA"),
    (UBLK_F_USER_RECOVERY, "USER_RECOVERY"),
    (UBLK_F_USER_RECOVERY_REISSUE, "USER_RECOVERY_REISSUE"),
    (UBLK_F_UNPRIVILEGED_DEV, "UNPRIVILEGED_DEV"),
    (UBLK_F_CMD_IOCTL_ENCODE, "CMD_IOCTL_ENCODE"),
    (UBLK_F_USER_COPY, "USER_COPY"),
    (UBLK_F_ZONED, "ZONED"),
    (UBLK_F_USER_RECOVERY_FAIL_IO, "USER_RECOVERY_FAIL_IO"),
    (UBLK_F_UPDATE_SIZE, "UPDATE_SIZE"),
    (UBLK_F_AUTO_BUF_REG, "AUTO_BUF_REG"),
    (UBLK_F_QUIESCE, "QUIESCE"),
    (UBLK_F_PER_IO_DAEMON, "PER_IO_DAEMON"),
    (UBLK_F_BUF_REG_OFF_DAEMON, "BUF_REG_OFF_DAEMON"),
    (UBLK_F_BATCH_IO, "BATCH_IO"),
    (UBLK_F_INTEGRITY, "INTEGRITY"),
];

/// `flags` as the names of its feature bits, any bits without a name last in hex:
/// `"USER_RECOVERY USER_COPY 0x100000"`.
pub fn feature_names(flags: u64) -> String {
    let known = FEATURE_NAMES.iter().fold(0, |all, &(bit, _)| all | bit);
    let mut names: Vec<String> = FEATURE_NAMES
        .iter()
        .filter(|&&(bit, _)| flags & bit != 0)
        .map(|&(_, name)| name.to_owned())
        .collect();
    if flags & !known != 0 {
        names.push(format!("{:#x}", flags & !known));
    }
    names.join(" ")
}
/// What a device needs to survive its daemon with every request kept: with `USER_RECOVERY`
/// the kernel keeps the disk and queues new I/O while no daemon serves it; with `_REISSUE` the
/// requests the dead daemon had taken are handed to the next one instead of failing.
pub const UBLK_F_RECOVERY_REISSUE: u64 = UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE;

// Device states in `CtrlDevInfo::state`.
pub const UBLK_S_DEV_DEAD: u16 = 0;
pub const UBLK_S_DEV_LIVE: u16 = 1;
pub const UBLK_S_DEV_QUIESCED: u16 = 2;

// Request operations (low 8 bits of `IoDesc::op_flags`) and flags (the rest).
pub const UBLK_IO_OP_READ: u8 = 0;
pub const UBLK_IO_OP_WRITE: u8 = 1;
pub const UBLK_IO_OP_FLUSH: u8 = 2;
pub const UBLK_IO_OP_DISCARD: u8 = 3;
pub const UBLK_IO_OP_WRITE_SAME: u8 = 4;
pub const UBLK_IO_OP_WRITE_ZEROES: u8 = 5;
pub const UBLK_IO_F_FUA: u32 = 1 << 13;
pub const UBLK_IO_F_NOUNMAP: u32 = 1 << 15;
pub const UBLK_IO_F_SWAP: u32 = 1 << 16;

// `ublk_params::types` bits.
pub const UBLK_PARAM_TYPE_BASIC: u32 = 1 << 0;
pub const UBLK_PARAM_TYPE_DISCARD: u32 = 1 << 1;

/// `struct ublksrv_ctrl_cmd`: the first 32 bytes of a control SQE's 80-byte command area.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtrlCmd {
    pub dev_id: u32,
    pub queue_id: u16,
    pub len: u16,
    pub addr: u64,
    pub data: [u64; 1],
    pub dev_path_len: u16,
    pub pad: u16,
    pub reserved: u32,
}

/// `struct ublksrv_ctrl_dev_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtrlDevInfo {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pub pad0: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub pad1: u32,
    pub flags: u64,
    pub ublksrv_flags: u64,
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub reserved1: u64,
    pub reserved2: u64,
}

/// `struct ublksrv_io_desc`: one per tag in the mmapped, read-only descriptor array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoDesc {
    pub op_flags: u32,
    pub nr_sectors: u32,
    pub start_sector: u64,
    pub addr: u64,
}

/// `struct ublksrv_io_cmd`: the 16-byte command area of a FETCH / COMMIT_AND_FETCH SQE.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoCmd {
    pub q_id: u16,
    pub tag: u16,
    pub result: i32,
    pub addr: u64,
}

/// `struct ublk_param_basic`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamBasic {
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub chunk_sectors: u32,
    pub dev_sectors: u64,
    pub virt_boundary_mask: u64,
}

/// `struct ublk_param_discard`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamDiscard {
    pub discard_alignment: u32,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
    pub reserved0: u16,
}

/// `struct ublk_param_devt` (read-only, filled by GET_PARAMS).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamDevt {
    pub char_major: u32,
    pub char_minor: u32,
    pub disk_major: u32,
    pub disk_minor: u32,
}

/// `struct ublk_param_zoned` (unused; present so the layout matches the 6.x header).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamZoned {
    pub max_open_zones: u32,
    pub max_active_zones: u32,
    pub max_zone_append_sectors: u32,
    pub reserved: [u8; 20],
}

/// `Params::len`: the size of the whole struct.
#[allow(
    clippy::cast_possible_truncation,
    reason = "the struct is a few hundred bytes (asserted below)"
)]
pub const PARAMS_LEN: u32 = size_of::<Params>() as u32;

/// `struct ublk_params` as of Linux 6.12 (basic, discard, devt, zoned). Newer kernels append
/// more parts; `len` tells the kernel how much of the struct we know, and it accepts a shorter
/// one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Params {
    pub len: u32,
    pub types: u32,
    pub basic: ParamBasic,
    pub discard: ParamDiscard,
    pub devt: ParamDevt,
    pub zoned: ParamZoned,
}

// Layouts, checked against the kernel header at compile time.
const _: () = {
    assert!(size_of::<CtrlCmd>() == 32);
    assert!(offset_of!(CtrlCmd, addr) == 8);
    assert!(offset_of!(CtrlCmd, data) == 16);
    assert!(offset_of!(CtrlCmd, dev_path_len) == 24);
    assert!(size_of::<CtrlDevInfo>() == 64);
    assert!(offset_of!(CtrlDevInfo, max_io_buf_bytes) == 8);
    assert!(offset_of!(CtrlDevInfo, dev_id) == 12);
    assert!(offset_of!(CtrlDevInfo, ublksrv_pid) == 16);
    assert!(offset_of!(CtrlDevInfo, flags) == 24);
    assert!(offset_of!(CtrlDevInfo, owner_uid) == 40);
    assert!(size_of::<IoDesc>() == 24);
    assert!(offset_of!(IoDesc, start_sector) == 8);
    assert!(offset_of!(IoDesc, addr) == 16);
    assert!(size_of::<IoCmd>() == 16);
    assert!(offset_of!(IoCmd, result) == 4);
    assert!(offset_of!(IoCmd, addr) == 8);
    assert!(size_of::<ParamBasic>() == 32);
    assert!(offset_of!(ParamBasic, max_sectors) == 8);
    assert!(offset_of!(ParamBasic, dev_sectors) == 16);
    assert!(size_of::<ParamDiscard>() == 20);
    assert!(size_of::<ParamDevt>() == 16);
    assert!(size_of::<ParamZoned>() == 32);
    assert!(offset_of!(Params, basic) == 8);
    assert!(offset_of!(Params, discard) == 40);
    assert!(offset_of!(Params, devt) == 60);
    assert!(offset_of!(Params, zoned) == 76);
    assert!(size_of::<Params>() == 112);
    // The encoded opcodes, as the header's _IOR/_IOWR macros give them.
    assert!(UBLK_U_CMD_ADD_DEV == 0xc020_7504);
    assert!(UBLK_U_CMD_GET_DEV_INFO == 0x8020_7502);
    assert!(UBLK_U_CMD_GET_FEATURES == 0x8020_7513);
    assert!(UBLK_U_CMD_START_USER_RECOVERY == 0xc020_7510);
    assert!(UBLK_U_CMD_END_USER_RECOVERY == 0xc020_7511);
    assert!(UBLK_U_CMD_DEL_DEV_ASYNC == 0x8020_7514);
    assert!(UBLK_U_IO_FETCH_REQ == 0xc010_7520);
    assert!(UBLK_U_IO_COMMIT_AND_FETCH_REQ == 0xc010_7521);
};

/// Plain-old-data structs that may be viewed as bytes.
///
/// # Safety
/// The type is `#[repr(C)]`, its fields are integers, and it has no padding bytes: every byte
/// of a value is initialized (`command_bytes` reads them all).
pub unsafe trait Pod: Copy + Default {}
// SAFETY: `#[repr(C)]`, integer fields only; its size is asserted above to be the sum of its
// fields' (no padding).
unsafe impl Pod for CtrlCmd {}
// SAFETY: as for `CtrlCmd`.
unsafe impl Pod for IoCmd {}

/// The bytes of a command struct, to place in an SQE's command area.
pub fn command_bytes<T: Pod, const N: usize>(value: &T) -> [u8; N] {
    const { assert!(N >= size_of::<T>()) };
    let mut bytes = [0u8; N];
    // SAFETY: `T: Pod` is a `#[repr(C)]` struct of integers with no padding bytes (its layout
    // is asserted above), so reading `size_of::<T>()` bytes from it is reading initialized
    // memory; `bytes` is at least that long (asserted at compile time).
    unsafe {
        std::ptr::copy_nonoverlapping(
            (value as *const T).cast::<u8>(),
            bytes.as_mut_ptr(),
            size_of::<T>(),
        );
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_copy_positions_put_queue_tag_and_offset_where_the_driver_reads_them() {
        assert_eq!(user_copy_pos(0, 0, 0), 0x8000_0000);
        // ublk_pos_to_hwq / ublk_pos_to_tag / ublk_pos_to_buf_off in the 6.12 driver.
        let pos = user_copy_pos(3, 31, 61_440) - 0x8000_0000;
        assert_eq!(pos >> 41 & 0xfff, 3);
        assert_eq!(pos >> 25 & 0xffff, 31);
        assert_eq!(pos & ((1 << 25) - 1), 61_440);
    }

    #[test]
    fn command_bytes_are_little_endian_fields_in_header_order() {
        let cmd = IoCmd {
            q_id: 0x0102,
            tag: 0x0304,
            result: -5,
            addr: 0x1122_3344_5566_7788,
        };
        let bytes: [u8; 16] = command_bytes(&cmd);
        assert_eq!(&bytes[0..2], &0x0102u16.to_le_bytes());
        assert_eq!(&bytes[2..4], &0x0304u16.to_le_bytes());
        assert_eq!(&bytes[4..8], &(-5i32).to_le_bytes());
        assert_eq!(&bytes[8..16], &0x1122_3344_5566_7788u64.to_le_bytes());
        let ctrl = CtrlCmd {
            dev_id: 7,
            queue_id: u16::MAX,
            len: 64,
            addr: 9,
            ..Default::default()
        };
        let bytes: [u8; 80] = command_bytes(&ctrl);
        assert_eq!(&bytes[0..4], &7u32.to_le_bytes());
        assert_eq!(&bytes[4..6], &u16::MAX.to_le_bytes());
        assert_eq!(&bytes[6..8], &64u16.to_le_bytes());
        assert_eq!(&bytes[8..16], &9u64.to_le_bytes());
        assert!(bytes[32..].iter().all(|&b| b == 0));
    }

    #[test]
    fn feature_names_name_every_known_bit_and_show_the_rest_in_hex() {
        assert_eq!(feature_names(0), "");
        // What the 6.12 driver of the VM test offers (its log line, features=0x1fe).
        assert_eq!(
            feature_names(0x1fe),
            "URING_CMD_COMP_IN_TASK NEED_GET_DATA USER_RECOVERY USER_RECOVERY_REISSUE \
             UNPRIVILEGED_DEV CMD_IOCTL_ENCODE USER_COPY ZONED"
        );
        let all = feature_names(u64::MAX);
        assert!(all.starts_with("SUPPORT_ZERO_COPY "), "{all}");
        assert!(all.ends_with(" INTEGRITY 0xfffffffffffe0000"), "{all}");
        assert_eq!(all.split(' ').count(), FEATURE_NAMES.len() + 1);
        assert_eq!(
            feature_names(UBLK_F_USER_COPY | UBLK_F_BATCH_IO | 1 << 40 | 1 << 17),
            "USER_COPY BATCH_IO 0x10000020000"
        );
    }
}
