//! The memory compressed pages live in: one shared mapping of a memfd, whose pages are
//! committed with `fallocate(2)` and handed out as chunks. All `unsafe` for it lives here.
//!
//! Why not the heap: the daemon serves swap. When memory runs short, the kernel frees memory
//! by swapping out through this daemon, and whatever gets the daemon more memory may have to
//! wait for that swap-out. Growing the heap (brk, mmap, mprotect) or faulting in fresh pages
//! does that wait while holding the process's mmap lock, which every other thread of the
//! daemon, the queue threads included, may need: a deadlock. `fallocate` on a memfd allocates
//! pages holding only that file's lock, so a thread committing memory can wait in reclaim while
//! the queue threads carry on. Committed pages are then faulted into the mapping (they already
//! exist, so no allocation waits) and, under `mlockall`, locked. Freed chunks can give their
//! pages back with a hole punch.

use std::num::NonZeroUsize;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nix::fcntl::{fallocate, FallocateFlags};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::mman::{madvise, mmap, munmap, MapFlags, MmapAdvise, ProtFlags};

const HOST_PAGE: usize = 4096;

/// A reserved (not yet committed) range of address space backed by a memfd.
pub struct Arena {
    fd: OwnedFd,
    base: NonNull<u8>,
    len: usize,
    /// Bytes of the arena handed out as chunks so far (chunks are recycled, never re-carved).
    carved: AtomicUsize,
}

// SAFETY: the arena is a mapping plus a file descriptor; it hands out disjoint ranges of the
// mapping (`carve`), each owned by exactly one `ArenaChunk`, so sharing the arena itself
// between threads shares no mutable state beyond the atomic cursor.
unsafe impl Send for Arena {}
// SAFETY: see `Send`: `&Arena` only allows carving (atomic) and committing ranges of the file.
unsafe impl Sync for Arena {}

/// A byte count or position in the memfd as the `off_t` that ftruncate and fallocate take.
fn file_offset(bytes: usize) -> std::io::Result<i64> {
    i64::try_from(bytes).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))
}

impl Arena {
    /// Reserve `max_bytes` of address space (rounded up to pages); nothing is committed yet.
    pub fn new(max_bytes: usize) -> std::io::Result<Arc<Self>> {
        let len = max_bytes.div_ceil(HOST_PAGE).max(1) * HOST_PAGE;
        let fd = memfd_create("trueno-ublk-pages", MFdFlags::MFD_CLOEXEC)?;
        nix::unistd::ftruncate(&fd, file_offset(len)?)?;
        let length = NonZeroUsize::new(len).ok_or(std::io::ErrorKind::InvalidInput)?;
        // SAFETY: a fresh shared mapping of our own memfd; it aliases no Rust object, and all
        // access goes through the disjoint chunks handed out by `carve`.
        let base = unsafe {
            mmap(
                None,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED | MapFlags::MAP_NORESERVE,
                &fd,
                0,
            )
        }?;
        Ok(Arc::new(Self {
            fd,
            base: base.cast(),
            len,
            carved: AtomicUsize::new(0),
        }))
    }

    /// Hand out `count` adjacent chunks of `chunk_bytes` each, committed. `None` once the
    /// arena is used up.
    pub fn carve(
        self: &Arc<Self>,
        chunk_bytes: usize,
        count: usize,
    ) -> std::io::Result<Option<Vec<ArenaChunk>>> {
        let total = chunk_bytes * count;
        let start = self.carved.fetch_add(total, Ordering::Relaxed);
        if start + total > self.len {
            self.carved.fetch_sub(total, Ordering::Relaxed);
            return Ok(None);
        }
        self.commit(start, total)?;
        Ok(Some(
            (0..count)
                .map(|i| ArenaChunk {
                    arena: Arc::clone(self),
                    offset: start + i * chunk_bytes,
                    len: chunk_bytes,
                    heap: None,
                })
                .collect(),
        ))
    }

    /// Allocate the pages of `[offset, offset + len)` in the file, then fault them into the
    /// mapping (they exist now, so the faults allocate nothing but page tables).
    fn commit(&self, offset: usize, len: usize) -> std::io::Result<()> {
        fallocate(
            &self.fd,
            FallocateFlags::empty(),
            file_offset(offset)?,
            file_offset(len)?,
        )?;
        // SAFETY: the range lies inside our mapping (checked by the callers); populating
        // changes no contents, it only makes the pages present.
        unsafe { madvise(self.range_ptr(offset), len, MmapAdvise::MADV_POPULATE_WRITE) }?;
        Ok(())
    }

    /// Give the pages of `[offset, offset + len)` back to the system.
    fn decommit(&self, offset: usize, len: usize) -> std::io::Result<()> {
        let punch = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
        fallocate(
            self.fd.as_fd(),
            punch,
            file_offset(offset)?,
            file_offset(len)?,
        )?;
        Ok(())
    }

    fn range_ptr(&self, offset: usize) -> NonNull<std::ffi::c_void> {
        // SAFETY: callers pass offsets inside the mapping, so the pointer stays in bounds.
        unsafe { self.base.add(offset) }.cast()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly our mapping; every chunk holds an `Arc` to the arena, so
        // none is alive when this runs.
        if let Err(error) = unsafe { munmap(self.base.cast(), self.len) } {
            tracing::warn!(%error, "munmap of the page arena failed");
        }
    }
}

/// One chunk of the arena: like a `Box<[u8]>` whose memory is a range of the arena. Only if
/// the arena's address space is ever used up does a chunk come from the heap instead.
pub struct ArenaChunk {
    arena: Arc<Arena>,
    offset: usize,
    len: usize,
    heap: Option<Box<[u8]>>,
}

impl ArenaChunk {
    /// A chunk on the heap, for when the arena is used up.
    pub fn on_heap(arena: &Arc<Arena>, len: usize) -> Self {
        Self {
            arena: Arc::clone(arena),
            offset: 0,
            len,
            heap: Some(vec![0u8; len].into_boxed_slice()),
        }
    }

    /// Return the chunk's pages to the system; `recommit` brings them back (zeroed).
    pub fn decommit(&self) -> std::io::Result<()> {
        match self.heap {
            Some(_) => Ok(()),
            None => self.arena.decommit(self.offset, self.len),
        }
    }

    pub fn recommit(&self) -> std::io::Result<()> {
        match self.heap {
            Some(_) => Ok(()),
            None => self.arena.commit(self.offset, self.len),
        }
    }
}

impl std::fmt::Debug for ArenaChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ArenaChunk({}+{})", self.offset, self.len)
    }
}

impl Deref for ArenaChunk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        if let Some(heap) = &self.heap {
            return heap;
        }
        // SAFETY: `[offset, offset + len)` lies inside the arena's mapping, which outlives the
        // chunk (the chunk holds an `Arc`); no other chunk covers this range, and `&self`
        // forbids a simultaneous `&mut` through this chunk.
        unsafe { std::slice::from_raw_parts(self.arena.base.as_ptr().add(self.offset), self.len) }
    }
}

impl DerefMut for ArenaChunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        if let Some(heap) = &mut self.heap {
            return heap;
        }
        // SAFETY: as for `deref`, and `&mut self` makes this the only reference to the range.
        unsafe {
            std::slice::from_raw_parts_mut(self.arena.base.as_ptr().add(self.offset), self.len)
        }
    }
}

/// Stack every I/O-path thread (queue, flusher, rayon worker) is given.
pub const IO_THREAD_STACK_BYTES: usize = 1 << 20;
/// How much of it is faulted in up front: far deeper than any I/O path goes (liblz4's
/// compressor, the deepest frame, takes 16 KiB).
const IO_STACK_PREFAULT_BYTES: usize = 256 << 10;
/// Free heap each I/O-path thread faults in for its own malloc arena.
const IO_HEAP_WARM_BYTES: usize = 256 << 10;

/// Ready the calling thread for the I/O path: fault in (and so, under `mlockall`, lock) the
/// next 256 KiB of its stack and 256 KiB of free space in its malloc arena.
///
/// Why: under `MCL_ONFAULT` pages are only faulted in when first written. A thread serving
/// swap I/O that touches a fresh page under memory pressure waits in reclaim for the very
/// swap-out it is serving, and with it every bio in flight (seen in the VM: a rayon worker
/// stuck in a page fault while kswapd and every allocating task waited for a free bio).
/// The I/O path allocates little (batch bookkeeping, codec contexts) and frees what it
/// allocates, so with trimming off (`configure_heap`) it is served from pages it already has.
/// Call it first thing on every such thread.
pub fn prepare_io_thread() {
    prefault_stack();
    // Many blocks rather than one, so that they come from this thread's arena (not mmap) and,
    // once freed, coalesce into free space any later allocation can use.
    const BLOCK: usize = 32 << 10;
    let blocks: Vec<Vec<u8>> = (0..IO_HEAP_WARM_BYTES / BLOCK)
        .map(|_| vec![1u8; BLOCK])
        .collect();
    std::hint::black_box(&blocks);
}

#[inline(never)]
fn prefault_stack() {
    let mut probe = [0u8; IO_STACK_PREFAULT_BYTES];
    std::hint::black_box(&mut probe);
}

/// An empty vector with room for `capacity` entries, that room faulted in (see `populate`):
/// pushes up to `capacity` touch no fresh page.
pub fn faulted_in_vec<T>(capacity: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(capacity);
    populate(v.spare_capacity_mut());
    v
}

/// Fault in (and so, under `mlockall`, lock) the pages under `items`, without changing them.
///
/// Why: memory that is only allocated is not there yet. Zeroed allocations in particular
/// (the compiler turns a zero-filled `collect` into one) come from the kernel untouched, and
/// the first write to each page under memory pressure, from a thread serving swap, waits in
/// reclaim for the swap-out it is serving (seen in the VM: the page table's pages faulted in
/// by the queue thread). Call it on everything the I/O path writes, before the device is live.
pub fn populate<T>(items: &[T]) {
    let bytes = std::mem::size_of_val(items);
    if bytes == 0 {
        return;
    }
    let start = items.as_ptr() as usize & !(HOST_PAGE - 1);
    let end = (items.as_ptr() as usize + bytes).div_ceil(HOST_PAGE) * HOST_PAGE;
    let Some(ptr) = NonNull::new(start as *mut std::ffi::c_void) else {
        return;
    };
    // SAFETY: `[start, end)` covers only whole pages that hold part of `items`, which are
    // mapped for as long as `items` is borrowed; MADV_POPULATE_WRITE makes them present
    // without changing a byte, so no Rust value, ours or a neighbour's, sees any change.
    if let Err(error) = unsafe { madvise(ptr, end - start, MmapAdvise::MADV_POPULATE_WRITE) } {
        tracing::warn!(%error, bytes, "faulting in I/O-path memory failed");
    }
}

/// Keep freed heap memory in the process: glibc's malloc never trims its arenas and serves
/// everything under 32 MiB from them rather than from fresh mmaps. Without this, memory an
/// I/O-path thread freed goes back to the kernel and its next allocation faults fresh pages
/// in (see `prepare_io_thread`). Call it before other threads start.
pub fn configure_heap() {
    #[cfg(target_env = "gnu")]
    {
        /// glibc's largest mmap threshold on 64-bit targets (DEFAULT_MMAP_THRESHOLD_MAX).
        const MMAP_THRESHOLD_MAX: libc::c_int = 32 << 20;
        for (param, value, what) in [
            (libc::M_TRIM_THRESHOLD, libc::c_int::MAX, "M_TRIM_THRESHOLD"),
            (
                libc::M_MMAP_THRESHOLD,
                MMAP_THRESHOLD_MAX,
                "M_MMAP_THRESHOLD",
            ),
        ] {
            // SAFETY: mallopt only changes glibc's malloc tunables; it takes no pointers.
            if unsafe { libc::mallopt(param, value) } != 1 {
                tracing::warn!(
                    param = what,
                    "mallopt failed: the heap may need fresh pages under memory pressure"
                );
            }
        }
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

    #[test]
    fn chunks_are_disjoint_committed_and_recyclable() {
        let arena = Arena::new(16 * HOST_PAGE).unwrap();
        let mut chunks = arena.carve(2 * HOST_PAGE, 3).unwrap().unwrap();
        for (i, chunk) in chunks.iter_mut().enumerate() {
            assert_eq!(chunk.len(), 2 * HOST_PAGE);
            chunk.fill(i as u8 + 1);
        }
        for (i, chunk) in chunks.iter().enumerate() {
            assert!(chunk.iter().all(|&b| b == i as u8 + 1));
        }
        chunks[1].decommit().unwrap();
        chunks[1].recommit().unwrap();
        assert!(
            chunks[1].iter().all(|&b| b == 0),
            "a punched hole reads back as zeros"
        );
        assert!(chunks[0].iter().all(|&b| b == 1));
        assert!(
            arena.carve(4 * HOST_PAGE, 3).unwrap().is_none(),
            "16 pages hold no 6+12"
        );
        assert_eq!(arena.carve(4 * HOST_PAGE, 2).unwrap().unwrap().len(), 2);
    }
}
