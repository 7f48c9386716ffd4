//! Decoding and checking one request's descriptor before anything acts on it.

#![forbid(unsafe_code)]

use super::sys::{self, IoDesc};

const SECTOR_SHIFT: u32 = 9;

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
}

/// A request as the store sees it: byte offset and length, already checked against the
/// device size and the tag buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    /// `UBLK_IO_F_*` flags (FUA, NOUNMAP, SWAP, ...).
    pub flags: u32,
    pub offset: u64,
    pub len: u64,
}

/// Why a descriptor was refused; `errno()` is what the request completes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("unsupported operation {0}")]
    Unsupported(u8),
    #[error("request of {len} bytes at byte {offset} is beyond the device end")]
    OutOfRange { offset: u64, len: u64 },
    #[error("request of {len} bytes is larger than the {max} bytes the device takes at once")]
    TooLarge { len: u64, max: u64 },
    #[error("request of {len} bytes at byte {offset} is not aligned to {block} bytes")]
    Misaligned { offset: u64, len: u64, block: u64 },
}

impl RequestError {
    pub fn errno(&self) -> i32 {
        match self {
            RequestError::Unsupported(_) => -libc::EOPNOTSUPP,
            RequestError::OutOfRange { .. } | RequestError::TooLarge { .. } => -libc::EIO,
            RequestError::Misaligned { .. } => -libc::EINVAL,
        }
    }
}

/// What a request completes with when its handler failed with `errno`: that errno, or EIO for
/// a value that is not a negative errno (0 or more would read as bytes done: a write the
/// kernel requeues, a piece of a read left as a hole in data reported whole).
pub(crate) fn failure_result(errno: i32) -> i32 {
    if errno < 0 {
        errno
    } else {
        -libc::EIO
    }
}

impl Request {
    /// Decode `desc` and check it against a device of `dev_bytes` bytes with `block`-byte
    /// logical blocks and a `max_io`-byte buffer per tag.
    pub fn decode(
        desc: &IoDesc,
        dev_bytes: u64,
        block: u64,
        max_io: u64,
    ) -> Result<Self, RequestError> {
        let op = match (desc.op_flags & 0xff) as u8 {
            sys::UBLK_IO_OP_READ => Op::Read,
            sys::UBLK_IO_OP_WRITE => Op::Write,
            sys::UBLK_IO_OP_FLUSH => Op::Flush,
            sys::UBLK_IO_OP_DISCARD => Op::Discard,
            sys::UBLK_IO_OP_WRITE_ZEROES => Op::WriteZeroes,
            other => return Err(RequestError::Unsupported(other)),
        };
        let flags = desc.op_flags >> 8 << 8;
        if op == Op::Flush {
            return Ok(Self {
                op,
                flags,
                offset: 0,
                len: 0,
            });
        }
        // Sectors are 512 bytes whatever the logical block size; u64 arithmetic cannot
        // overflow for a u32 count, but a hostile start sector can.
        let offset = desc.start_sector.checked_mul(1 << SECTOR_SHIFT);
        let len = (desc.nr_sectors as u64) << SECTOR_SHIFT;
        let Some(offset) = offset else {
            return Err(RequestError::OutOfRange {
                offset: u64::MAX,
                len,
            });
        };
        match offset.checked_add(len) {
            Some(end) if end <= dev_bytes => {}
            _ => return Err(RequestError::OutOfRange { offset, len }),
        }
        if !offset.is_multiple_of(block) || !len.is_multiple_of(block) || len == 0 {
            return Err(RequestError::Misaligned { offset, len, block });
        }
        if matches!(op, Op::Read | Op::Write) && len > max_io {
            return Err(RequestError::TooLarge { len, max: max_io });
        }
        Ok(Self {
            op,
            flags,
            offset,
            len,
        })
    }
}

#[cfg(test)]
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]
mod tests {
    use super::*;

    const DEV: u64 = 1 << 30;
    const MAX_IO: u64 = 512 << 10;

    fn desc(op: u8, flags: u32, start_sector: u64, nr_sectors: u32) -> IoDesc {
        IoDesc {
            op_flags: op as u32 | flags,
            nr_sectors,
            start_sector,
            addr: 0,
        }
    }

    #[test]
    fn descriptors_decode_or_fail_with_the_right_errno() {
        use Op::*;
        let last_page = DEV / 512 - 8;
        type Decoded = Result<(Op, u64, u64), i32>;
        let cases: Vec<(IoDesc, Decoded)> = vec![
            (desc(0, 0, 0, 8), Ok((Read, 0, 4096))),
            (desc(1, 0, 8, 16), Ok((Write, 4096, 8192))),
            (
                desc(1, sys::UBLK_IO_F_SWAP, last_page, 8),
                Ok((Write, DEV - 4096, 4096)),
            ),
            (desc(0, 0, 0, (MAX_IO / 512) as u32), Ok((Read, 0, MAX_IO))),
            (desc(2, 0, 123, 0), Ok((Flush, 0, 0))),
            (desc(3, 0, 0, (DEV / 512) as u32), Ok((Discard, 0, DEV))),
            (
                desc(5, sys::UBLK_IO_F_NOUNMAP, 8, 8),
                Ok((WriteZeroes, 4096, 4096)),
            ),
            // Discards are not bounded by the tag buffer: they carry no data.
            (
                desc(3, 0, 0, (4 * MAX_IO / 512) as u32),
                Ok((Discard, 0, 4 * MAX_IO)),
            ),
            // Past the end, straddling the end, overflowing.
            (desc(0, 0, DEV / 512, 8), Err(-libc::EIO)),
            (desc(1, 0, last_page + 1, 8), Err(-libc::EIO)),
            (desc(0, 0, u64::MAX / 256, 8), Err(-libc::EIO)),
            (desc(0, 0, u64::MAX, 8), Err(-libc::EIO)),
            (desc(3, 0, 8, (DEV / 512) as u32), Err(-libc::EIO)),
            // Larger than the buffer.
            (desc(0, 0, 0, (MAX_IO / 512) as u32 + 8), Err(-libc::EIO)),
            // Not 4 KiB aligned, or empty.
            (desc(0, 0, 1, 8), Err(-libc::EINVAL)),
            (desc(1, 0, 0, 1), Err(-libc::EINVAL)),
            (desc(0, 0, 0, 0), Err(-libc::EINVAL)),
            // Unknown and unsupported operations.
            (desc(4, 0, 0, 8), Err(-libc::EOPNOTSUPP)),
            (desc(13, 0, 0, 8), Err(-libc::EOPNOTSUPP)),
            (desc(0xff, 0, 0, 8), Err(-libc::EOPNOTSUPP)),
        ];
        for (input, want) in cases {
            let got = Request::decode(&input, DEV, 4096, MAX_IO)
                .map(|r| (r.op, r.offset, r.len))
                .map_err(|e| e.errno());
            assert_eq!(got, want, "decoding {input:?}");
        }
    }

    #[test]
    fn swap_flag_is_visible() {
        let request =
            Request::decode(&desc(1, sys::UBLK_IO_F_SWAP, 0, 8), DEV, 4096, MAX_IO).unwrap();
        assert_ne!(request.flags & sys::UBLK_IO_F_SWAP, 0);
        let plain = Request::decode(&desc(1, 0, 0, 8), DEV, 4096, MAX_IO).unwrap();
        assert_eq!(plain.flags & sys::UBLK_IO_F_SWAP, 0);
    }

    proptest::proptest! {
        /// Whatever the kernel (or a corrupted descriptor) says, an accepted request lies
        /// inside the device, is block aligned, and a data request fits the tag buffer; and a
        /// request that does all that is accepted. Half the cases are drawn near the device
        /// (a tenth past its end, some off a block boundary) with known ops, so that requests
        /// are accepted as often as refused; the others are any bits at all.
        #[test]
        fn accepted_requests_are_always_in_bounds(
            any_bits: bool, op in 0u32..6, flags: u32, raw_op_flags: u32,
            nr_pages in 0u32..600, raw_nr_sectors: u32,
            start: u64, skew in 0u32..4,
            dev_pages in 1u64..(1 << 28), max_io_pages in 1u64..512,
        ) {
            let dev = dev_pages * 4096;
            let max_io = max_io_pages * 4096;
            let dev_sectors = dev / 512;
            let input = if any_bits {
                IoDesc { op_flags: raw_op_flags, nr_sectors: raw_nr_sectors, start_sector: start, addr: 0 }
            } else {
                // A sector off a block boundary in one case of four, at the start or the end.
                let near = start % (dev_sectors + dev_sectors / 10 + 1) / 8 * 8 + u64::from(skew == 1);
                let nr_sectors = nr_pages * 8 + u32::from(skew == 2);
                IoDesc { op_flags: op | (flags << 8), nr_sectors, start_sector: near, addr: 0 }
            };
            let (offset, len) = (u128::from(input.start_sector) * 512, u128::from(input.nr_sectors) * 512);
            let kind = input.op_flags & 0xff;
            let data = kind == u32::from(sys::UBLK_IO_OP_READ) || kind == u32::from(sys::UBLK_IO_OP_WRITE);
            let known = data
                || kind == u32::from(sys::UBLK_IO_OP_DISCARD)
                || kind == u32::from(sys::UBLK_IO_OP_WRITE_ZEROES);
            let valid = known
                && len > 0
                && offset % 4096 == 0
                && len % 4096 == 0
                && offset + len <= u128::from(dev)
                && (!data || len <= u128::from(max_io));
            match Request::decode(&input, dev, 4096, max_io) {
                Ok(request) if request.op == Op::Flush => proptest::prop_assert_eq!(request.len, 0),
                Ok(request) => {
                    proptest::prop_assert!(valid, "{input:?} accepted");
                    proptest::prop_assert!(request.offset + request.len <= dev);
                    proptest::prop_assert!(request.len > 0);
                    proptest::prop_assert_eq!(request.offset % 4096, 0);
                    proptest::prop_assert_eq!(request.len % 4096, 0);
                    if matches!(request.op, Op::Read | Op::Write) {
                        proptest::prop_assert!(request.len <= max_io);
                    }
                }
                Err(error) => {
                    proptest::prop_assert!(!valid, "{input:?} refused: {error}");
                    proptest::prop_assert!(error.errno() < 0);
                }
            }
        }
    }
}
