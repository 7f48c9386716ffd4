//! Memory the I/O path uses: the segment page data lives in (`segment`: a private memfd or a
//! SysV segment that outlives the process), the arena of compressed-page chunks carved from it
//! (`arena`), the rules for everything else the I/O path touches (prefaulted stacks and
//! heap, `populate`), and waking the thread that commits memory from the kernel's reclaim
//! throttle once memory is back (`throttle`). All `unsafe` for memory lives in this module.
//!
//! Why not the heap for page data: the daemon serves swap. When memory runs short, the kernel
//! frees memory by swapping out through this daemon, and whatever gets the daemon more memory
//! may have to wait for that swap-out. Growing the heap (brk, mmap, mprotect) does that wait
//! holding the process's mmap lock for writing, which stops every other thread that needs the
//! lock at all. The segment's pages are committed by faulting them in (holding the mmap lock
//! for reading, which the I/O path never takes: everything it touches is faulted in before the
//! device is live) and locked; freed chunks give their pages back with a hole punch, which
//! takes the file's lock and not the mmap lock (see `segment` for why commits do not go
//! through `fallocate`).

use std::ptr::NonNull;

use nix::sys::mman::{madvise, MmapAdvise};

mod arena;
mod lists;
mod segment;
mod throttle;

pub use arena::{Arena, ArenaChunk, CarveFailed};
pub use lists::{
    empty_list, faulted_in_list, growth_in_place, out_of_memory, reserve_list_space, Growth,
    ListAlloc, ListVec,
};
#[cfg(test)]
pub(crate) use segment::give_shared_to_user;
pub use segment::{PageSlots, Segment, SharedId, SlotRead, SlotWrite, Words};
pub use throttle::{free_memory_is_back, ThrottledThread};

/// The MMU's base page: what the arena and the segment align to, and what
/// `/proc/PID/pagemap` has one entry for (x86-64 and 4 KiB-page arm64).
pub const HOST_PAGE: usize = 4096;

/// Stack every I/O-path thread (queue, flusher, rayon worker) is given.
pub const IO_THREAD_STACK_BYTES: usize = 1 << 20;
/// How much of it is faulted in up front: deeper than any I/O path goes. liblz4's compressor,
/// the deepest frame, takes 16 KiB. Measured with builds faulting in 4 KiB, each thread's
/// stack mapping's Rss from /proc/PID/smaps: 36 KiB at most in `trueno-ublk bench` with lz4,
/// zstd and recompression (2026-11-26); 56 KiB in two of the serving process's six I/O
/// threads after the VM's near-OOM stage (2026-11-29; with 64 KiB faulted in, 72-76 KiB at
/// idle: a thread's start frames and TLS above the prefault take 8-12). Every KiB here is
/// locked memory in the serving process and the standby alike, for each of their I/O threads.
const IO_STACK_PREFAULT_BYTES: usize = 64 << 10;
/// Free heap each I/O-path thread faults in for its own malloc arena.
const IO_HEAP_WARM_BYTES: usize = 256 << 10;
/// What the I/O path of a thread that compresses allocates beside its codec contexts, at most:
/// four times the most measured in the VM's near-OOM stage (2026-11-28, a diagnostic build
/// counting the live bytes of Rust's allocations per malloc arena: 5 KiB in each compression
/// pool thread, 6 in the queue thread, 10 in the flusher, 17 in the recompressor; the C codecs
/// allocate nothing per page). Half of it, tried on 2026-12-06 for the idle footprint, was too
/// little: in the VM's near-OOM stage the flusher faulted fresh heap in reclaim and swap
/// stalled for good (docs/measurements.md).
pub const IO_ALLOCATIONS_BESIDE_CODEC_BYTES: usize = 64 << 10;

/// Ready the calling thread for the I/O path: fault in (and so, under `mlockall`, lock) the
/// next 64 KiB of its stack and 256 KiB of free space in its malloc arena.
///
/// Why: under `MCL_ONFAULT` pages are only faulted in when first written. A thread serving
/// swap I/O that touches a fresh page under memory pressure waits in reclaim for the very
/// swap-out it is serving, and with it every bio in flight (seen in the VM: a rayon worker
/// stuck in a page fault while kswapd and every allocating task waited for a free bio).
/// The I/O path allocates little (batch bookkeeping) and frees what it allocates, so with
/// trimming off (`configure_heap`) it is served from pages it already has. Whether the main
/// thread, which frees the slots swap frees, and the refill thread, whose heap grows with the
/// store, can do with less is not known: with 64 KiB (2026-11-28) writes failed for want of
/// memory in the near-OOM stage's 2 x 100 MiB case in 4 runs of 4, against none in 4 runs of
/// the builds before.
/// Each thread gets a malloc arena of its own (glibc's default up to 8 per CPU), and so a
/// lock of its own: with one arena for all (`M_ARENA_MAX=1`, tried on 2026-11-26 to save
/// the 256 KiB each), a thread not readied so may fault in the heap's new top while holding
/// the one lock, in reclaim, and every I/O thread that allocates waits with it.
/// Call it first thing on every such thread.
pub fn prepare_io_thread() {
    prefault_stack();
    warm_heap(IO_HEAP_WARM_BYTES);
}

/// Fault in (and so, under `mlockall`, lock) the next `IO_STACK_PREFAULT_BYTES` of the calling
/// thread's stack: the first half of `prepare_io_thread`, for a thread whose heap is readied
/// otherwise (one whose heap is its codec contexts and little else, see
/// `IO_ALLOCATIONS_BESIDE_CODEC_BYTES`).
#[inline(never)]
pub fn prefault_stack() {
    let mut probe = [0u8; IO_STACK_PREFAULT_BYTES];
    std::hint::black_box(&mut probe);
}

/// An empty vector with room for `capacity` entries, that room faulted in (see `populate`):
/// pushes up to `capacity` touch no fresh page. Where the system does not fault it in, the
/// room is still there, with a warning: for its callers (start-up, and room for lists that
/// must not grow under a lock) room that faults on first use is better than none.
pub fn faulted_in_vec<T>(capacity: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(capacity);
    if let Err(error) = populate(v.spare_capacity_mut()) {
        tracing::warn!(%error, capacity, "faulting in room for a list failed: it faults on first use");
    }
    v
}

/// Fault in (and so, under `mlockall`, lock) the pages under `items`, without changing them.
///
/// Why: memory that is only allocated is not there yet. Zeroed allocations in particular
/// (the compiler turns a zero-filled `collect` into one) come from the kernel untouched, and
/// the first write to each page under memory pressure, from a thread serving swap, waits in
/// reclaim for the swap-out it is serving (seen in the VM: the page table's pages faulted in
/// by the queue thread). Call it on everything the I/O path writes, before the device is live.
/// An error where the system does not (no memory the daemon's cgroup may have, a fatal
/// signal): then some pages are not there, and the first write to them may wait.
pub fn populate<T>(items: &[T]) -> std::io::Result<()> {
    let bytes = std::mem::size_of_val(items);
    if bytes == 0 {
        return Ok(());
    }
    let start = items.as_ptr() as usize & !(HOST_PAGE - 1);
    let end = (items.as_ptr() as usize + bytes).div_ceil(HOST_PAGE) * HOST_PAGE;
    let Some(ptr) = NonNull::new(start as *mut std::ffi::c_void) else {
        return Ok(());
    };
    // SAFETY: `[start, end)` covers only whole pages that hold part of `items`, which are
    // mapped for as long as `items` is borrowed; MADV_POPULATE_WRITE makes them present
    // without changing a byte, so no Rust value, ours or a neighbour's, sees any change.
    unsafe { madvise(ptr, end - start, MmapAdvise::MADV_POPULATE_WRITE) }?;
    Ok(())
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

/// A fresh private anonymous mapping of `len` bytes, readable and writable; nothing is
/// faulted in yet, and none of it is charged to a commit limit (`MAP_NORESERVE`): memory only
/// where it is faulted in (see `lists` for why reserve more than that), a page at a time
/// (`MADV_NOHUGEPAGE`: with transparent huge pages always on, the first touch of a large
/// mapping takes a 2 MiB page). Unmapping it is the caller's.
fn map_private(len: usize) -> std::io::Result<NonNull<std::ffi::c_void>> {
    let length = std::num::NonZeroUsize::new(len).ok_or(std::io::ErrorKind::InvalidInput)?;
    // SAFETY: a fresh private anonymous mapping; it aliases no Rust object.
    let base = unsafe {
        nix::sys::mman::mmap_anonymous(
            None,
            length,
            nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
            nix::sys::mman::MapFlags::MAP_PRIVATE | nix::sys::mman::MapFlags::MAP_NORESERVE,
        )
    }?;
    // SAFETY: the range is the fresh mapping just made, which holds no Rust value yet;
    // MADV_NOHUGEPAGE changes how it is faulted in, not a byte of it.
    let advised = unsafe { madvise(base, len, MmapAdvise::MADV_NOHUGEPAGE) };
    if let Err(error) = advised {
        // A kernel without THP refuses the advice (EINVAL), and has no huge pages to take.
        tracing::debug!(%error, "MADV_NOHUGEPAGE refused");
    }
    Ok(base)
}

/// `vm.overcommit_memory`, read once, so that every buffer's mapping length stays what it was
/// made with; `None` where it cannot be read.
pub fn overcommit_mode() -> Option<u32> {
    static MODE: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/vm/overcommit_memory")
            .ok()
            .and_then(|mode| mode.trim().parse().ok())
    })
}

/// Whether large reservations of address space cost nothing here: known not to be under
/// strict overcommit (mode 2), which ignores `MAP_NORESERVE` and charges all of it.
fn reservations_allowed() -> bool {
    overcommit_mode().is_some_and(|mode| mode != 2)
}

/// Whether the kernel is known to be under strict overcommit (for what a refusal means).
fn strict_overcommit() -> bool {
    overcommit_mode() == Some(2)
}

/// Pages held only to be given back: faulted in (and, under `mlockall`, locked) when made,
/// returned to the kernel when dropped.
///
/// Why: a standby serving process takes a device over while the device waits for a daemon,
/// and then every task that reclaims memory by swapping to it waits too; memory is then only
/// to be had from what is free. The kernel memory the takeover itself needs (page tables of
/// the store's mapping, the descriptor arrays' mappings) must come from somewhere: the
/// standby frees these pages just before, for the kernel to hand out again.
pub struct SparePages {
    base: NonNull<std::ffi::c_void>,
    len: usize,
}

impl SparePages {
    pub fn new(bytes: usize) -> std::io::Result<Self> {
        let len = bytes.div_ceil(HOST_PAGE).max(1) * HOST_PAGE;
        // Owned first, so that a failure below unmaps it.
        let spare = Self {
            base: map_private(len)?,
            len,
        };
        // SAFETY: exactly the mapping just made, which nothing reads; populating it changes
        // no byte anyone sees.
        unsafe { madvise(spare.base, len, MmapAdvise::MADV_POPULATE_WRITE) }?;
        Ok(spare)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SparePages {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`; no reference into it exists.
        if let Err(error) = unsafe { nix::sys::mman::munmap(self.base, self.len) } {
            tracing::warn!(%error, "returning spare pages failed");
        }
    }
}

// SAFETY: the mapping is owned by this value alone and never read through it; which thread
// unmaps it does not matter.
unsafe impl Send for SparePages {}

/// Fault in (and, under `mlockall`, lock) `bytes` of free space in the calling thread's heap
/// arena: with trimming off (`configure_heap`), later allocations up to that much are served
/// from pages the process already has. For what a thread allocates once and then lives in
/// without touching all of it at first (codec contexts: zstd's workspace is written as pages
/// need it; made in fresh heap, a page's compression faulted the rest in under memory pressure
/// and wedged swap in the VM, 2026-11-28), and for a thread that will allocate while memory
/// cannot be had (a standby taking a device over). It must come before those allocations.
pub fn warm_heap(bytes: usize) {
    // Many blocks rather than one, so that, once freed, they coalesce into free space any later
    // allocation can use.
    const BLOCK: usize = 32 << 10;
    let blocks: Vec<Vec<u8>> = (0..bytes.div_ceil(BLOCK))
        .map(|_| vec![1u8; BLOCK])
        .collect();
    std::hint::black_box(&blocks);
}
