//! Memory shared with the kernel: the read-only descriptor array of a queue (mmapped from
//! /dev/ublkcN) and the per-tag I/O buffers (anonymous, locked). All `unsafe` for these
//! mappings lives here.

use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::ptr::NonNull;

use nix::sys::mman::{madvise, mmap, mmap_anonymous, munmap, MapFlags, MmapAdvise, ProtFlags};

use super::sys::{IoDesc, UBLKSRV_CMD_BUF_OFFSET, UBLK_MAX_QUEUE_DEPTH};

const HOST_PAGE: usize = 4096;

fn round_up_to_page(bytes: usize) -> usize {
    bytes.div_ceil(HOST_PAGE) * HOST_PAGE
}

/// Byte offset of queue `q_id`'s descriptor array in the char device's mmap space: arrays are
/// laid out for the maximum depth, whatever the device's depth.
#[allow(
    clippy::cast_possible_wrap,
    reason = "the stride is 96 KiB: 64 queues of it are far below i64::MAX"
)]
pub fn desc_array_offset(q_id: u16) -> i64 {
    let stride = round_up_to_page(UBLK_MAX_QUEUE_DEPTH as usize * std::mem::size_of::<IoDesc>());
    UBLKSRV_CMD_BUF_OFFSET + q_id as i64 * stride as i64
}

/// One queue's descriptor array, mapped read-only from /dev/ublkcN.
pub struct DescArray {
    base: NonNull<IoDesc>,
    map_len: usize,
    depth: u16,
}

// SAFETY: the mapping belongs to this value alone and has no tie to the thread that made it;
// moving it to another thread (a queue handed over is dropped by the thread that joins it) is
// moving the ownership of plain memory. It is not `Sync`: `get` reads it through `&self`, but
// one owner at a time is all the queue needs.
unsafe impl Send for DescArray {}

impl DescArray {
    pub fn map(char_dev: impl AsFd, q_id: u16, depth: u16) -> std::io::Result<Self> {
        let map_len = round_up_to_page(depth as usize * std::mem::size_of::<IoDesc>());
        let length = NonZeroUsize::new(map_len).ok_or(std::io::ErrorKind::InvalidInput)?;
        // SAFETY: a fresh shared read-only mapping of the kernel's descriptor array at the
        // offset the driver documents for this queue; it aliases no Rust object.
        let base = unsafe {
            mmap(
                None,
                length,
                ProtFlags::PROT_READ,
                MapFlags::MAP_SHARED | MapFlags::MAP_POPULATE,
                char_dev,
                desc_array_offset(q_id),
            )
        }?;
        Ok(Self {
            base: base.cast(),
            map_len,
            depth,
        })
    }

    /// A copy of tag `tag`'s descriptor. The kernel writes it before completing the tag's
    /// fetch, so it is stable while the tag is with us.
    pub fn get(&self, tag: u16) -> IoDesc {
        // Invariant: called only for completions whose tag `Queue::serve` checked against
        // depth; this guards the unsafe read below, not user input.
        assert!(
            tag < self.depth,
            "tag {tag} beyond queue depth {}",
            self.depth
        );
        // SAFETY: `tag < depth` so the element lies inside the mapping; the mapping lives as
        // long as `self`; a volatile read because the kernel, not Rust, writes this memory.
        unsafe { self.base.as_ptr().add(tag as usize).read_volatile() }
    }
}

impl Drop for DescArray {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map`, after which `self` is gone.
        if let Err(error) = unsafe { munmap(self.base.cast(), self.map_len) } {
            tracing::warn!(%error, "munmap of the descriptor array failed");
        }
    }
}

/// The I/O buffers of one queue: `depth` buffers of `tag_size` bytes in one anonymous
/// mapping, populated up front (and locked by the daemon's `mlockall`). With user copy, one
/// such buffer: the queue's staging buffer.
pub struct IoBuffers {
    base: NonNull<u8>,
    tag_size: usize,
    depth: u16,
}

// SAFETY: as for `DescArray`: a private anonymous mapping owned by this value alone, and
// every slice into it borrows `&mut self`, so whichever thread owns it is the only one using
// it.
unsafe impl Send for IoBuffers {}

impl IoBuffers {
    pub fn new(depth: u16, tag_size: usize) -> std::io::Result<Self> {
        let length = (depth as usize)
            .checked_mul(tag_size)
            .and_then(NonZeroUsize::new)
            .ok_or(std::io::ErrorKind::InvalidInput)?;
        // SAFETY: a fresh private anonymous mapping; it aliases no Rust object.
        let base = unsafe {
            mmap_anonymous(
                None,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_POPULATE,
            )
        }?;
        // Fault every page in now. MAP_POPULATE alone is not enough: under
        // mlockall(MCL_ONFAULT) it populates nothing, and the kernel would then fault the
        // pages in while copying a swap-out's data, on the I/O path, when memory is shortest.
        // Owned first, so that a failure below unmaps it.
        let buffers = Self {
            base: base.cast(),
            tag_size,
            depth,
        };
        // SAFETY: the range is exactly the mapping just made; populating changes no contents.
        unsafe { madvise(base, length.get(), MmapAdvise::MADV_POPULATE_WRITE) }?;
        Ok(buffers)
    }

    /// The address the kernel copies tag `tag`'s data to and from.
    pub fn addr(&self, tag: u16) -> u64 {
        // Invariant: the queue only names tags it made (0..depth) or completions whose tag it
        // has checked against depth; a bad tag here is a bug, not input.
        assert!(tag < self.depth);
        self.base.as_ptr() as u64 + tag as u64 * self.tag_size as u64
    }

    /// Tag `tag`'s buffer. Only called for a tag whose command has completed, so the kernel is
    /// not copying into it until the tag is committed again.
    pub fn tag_mut(&mut self, tag: u16) -> &mut [u8] {
        // Invariant as in `addr`: `Queue::serve` retires any completion whose tag is >= depth
        // before serving it.
        assert!(tag < self.depth);
        // SAFETY: the slice lies inside the mapping (tag < depth), lives no longer than
        // `&mut self`, and `&mut self` makes it the only Rust reference to that memory; the
        // kernel touches a tag's buffer only while the tag's command is in flight, which it
        // is not while the queue thread serves it.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base.as_ptr().add(tag as usize * self.tag_size),
                self.tag_size,
            )
        }
    }
}

impl Drop for IoBuffers {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`; no slice into it outlives
        // `&mut self`.
        if let Err(error) = unsafe { munmap(self.base.cast(), self.depth as usize * self.tag_size) }
        {
            tracing::warn!(%error, "munmap of the I/O buffers failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_arrays_are_strided_for_the_maximum_depth() {
        assert_eq!(desc_array_offset(0), 0);
        // 4096 descriptors of 24 bytes = 96 KiB, already page aligned.
        assert_eq!(desc_array_offset(1), 98_304);
        assert_eq!(desc_array_offset(3), 3 * 98_304);
    }

    #[test]
    fn io_buffers_are_distinct_per_tag() {
        let mut buffers = IoBuffers::new(4, 8192).unwrap();
        assert_eq!(buffers.addr(1) - buffers.addr(0), 8192);
        buffers.tag_mut(0).fill(1);
        buffers.tag_mut(3).fill(3);
        assert!(buffers.tag_mut(0).iter().all(|&b| b == 1));
        assert!(buffers.tag_mut(1).iter().all(|&b| b == 0));
        assert_eq!(buffers.tag_mut(3).len(), 8192);
    }
}
