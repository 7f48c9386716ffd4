//! The page store: page table (index → entry), compressed-page memory, the pending batch,
//! the flusher, stats, memory limit and discard. Knows nothing of the kernel or io_uring.
//!
//! Files by role: `config` (what the store is told), `error`, `counters` (stats), `admission`
//! (memory limit, pending slots, starved writes), `flusher` (the store's threads), `flush`
//! (compress and install a batch), `recompress` (idle pages to a stronger codec, and
//! compaction, in the background); this file holds the read, write and discard core. Below
//! them: `table` (entries, idle hints, checksums), `pending` (batches), `alloc` and `reserve`
//! (compressed-page memory).
//!
//! Write path: classify the page; a same-filled page goes straight into its table entry.
//! Anything else is copied into a slot of the open pending batch and the entry points at that
//! slot, so reads of pending pages are O(1). The flusher compresses a batch when it reaches
//! its slot limit (`batch_threshold` pages while writes come, fewer while the batches are
//! quiet: see `pending::BatchSpan`) or its oldest page is `flush_timeout` old, and swaps each
//! entry from its slot to the stored object, unless a newer write or discard changed the entry
//! meanwhile.
//!
//! Batch compression, installing and reads of 1 MiB or more run on rayon's global pool: a
//! daemon that needs those threads to be I/O flushers builds the global pool with a start
//! handler, and must not call `write` from inside that pool (a writer waiting for a free batch
//! would hold a worker the flush needs).
//!
//! Locks, always taken in this order: the flush mutex (one flush at a time), a page-table
//! entry's lock bit, an allocator class, its chunk directory, one chunk. Pending slots stand
//! apart: only the writer that reserved a slot in the open batch write-locks it (holding
//! nothing else), while readers (under an entry lock) and the flusher (around its entry locks)
//! only read-lock slots, and the flusher only those of the sealed batch, so they never wait
//! on each other.

#![forbid(unsafe_code)]

mod admission;
mod alloc;
mod cold;
mod config;
mod counters;
mod error;
mod flush;
mod flusher;
mod layout;
mod oom;
mod pending;
mod recompress;
mod reserve;
mod resume;
mod table;
mod table_memory;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};
use rayon::prelude::*;

pub use crate::codec::BackendThresholds;
use crate::codec::{
    classify, compress_page, decompress_page, fill_page, Algorithm, Backend, BatchCodec,
    CompressedBatch, Compressor, Encoding, Page, PageChecksum, PageClass, PAGE_SIZE,
};
use crate::units::nanos;
use admission::SlotWait;
use alloc::{Handle, ZsAllocator};
pub use config::{
    short_memory_algorithm, store_thread_codecs, thread_algorithm, RecompressConfig, StoreConfig,
};
pub use counters::StoreStats;
use counters::{add, sub, Counters};
pub use error::StoreError;
pub use flusher::{FlusherHandle, StoreThread, StoreThreads};
pub use layout::{
    remove_shared, shared_exists, shared_store, AttachedStore, Backing, Opened, SharedStore,
    LAYOUT_VERSION, MAX_DEVICE_ID,
};
use layout::{Ownership, Regions, Shape};
pub use oom::OomKiller;
use pending::{BatchSpan, PendingBatch};
pub use recompress::Compaction;
use reserve::FreedTogether;
pub use reserve::Punches;
/// How long after its last use the chunk reserve shrinks to a quarter of its target.
pub use reserve::QUIET_AFTER as RESERVE_QUIET_AFTER;
use table::{IdleClock, PageState, PageTable};
use table_memory::TableMemory;

/// How a `BatchedPageStore::try_write` went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Every page is stored.
    Done,
    /// The pages from byte `done_bytes` of the write on would have waited for memory: try
    /// them again later.
    Deferred { done_bytes: u64 },
}

/// Pending batches: one fills while the flusher compresses the other.
const PENDING_BATCHES: usize = 2;

/// Reads of at least this many pages (1 MiB) decompress on all cores. Smaller ones, which is
/// every request the kernel sends a ublk device by default, stay on the caller's thread: the
/// shared rayon pool may be busy with a flush, and a small read must not wait behind it.
const PARALLEL_READ_MIN_PAGES: usize = 256;

/// Flusher wake-ups and the writers waiting for a free batch.
struct Control {
    stop: bool,
    /// A flusher thread was started (it may still be readying itself).
    flusher_started: bool,
    /// The flusher thread is ready and flushing: writers wait for it rather than flush.
    flusher_running: bool,
}

/// The page store.
pub struct BatchedPageStore {
    config: StoreConfig,
    table: PageTable,
    alloc: ZsAllocator,
    compressor: Compressor,
    /// How pages' data is checksummed: `layout_version`'s checksum, kept at hand for every
    /// page stored and read.
    checksum: PageChecksum,
    /// The version of the store's memory layout (`layout::READ_VERSIONS`): its own when
    /// resumed.
    layout_version: u64,
    /// New pages' compressor while memory is short (see `set_memory_short`); `None`: always
    /// `compressor`.
    short_memory_compressor: Option<Compressor>,
    /// The system is short of memory (the daemon says so): new pages get the stronger codec.
    memory_short: AtomicBool,
    batches: Box<[PendingBatch]>,
    /// How many of their slots batches open with (see `pending`).
    span: BatchSpan,
    /// Index of the open batch.
    current: AtomicUsize,
    control: Mutex<Control>,
    flusher_wake: Condvar,
    writers_wake: Condvar,
    /// Wakes the recompressor early: only to stop it. Its sleeps wait under `recompress_sleep`,
    /// not `control`: a nice-19 thread holding the mutex the write path takes (`wake_flusher`)
    /// when preempted would hold up the queue threads until the scheduler gave it a turn.
    recompress_wake: Condvar,
    recompress_sleep: Mutex<()>,
    /// Held for a whole flush; holds the reused output buffer of a GPU codec (see
    /// `flush::flush_buffer_pages`).
    flush: Mutex<CompressedBatch>,
    flush_part_pages: usize,
    /// Bytes promised to written pages not yet compressed: each may need a whole page.
    reserved_bytes: AtomicU64,
    /// Until when (ns since `epoch`) writers fail at once rather than wait, after one gave up
    /// waiting for memory (see `STARVED_WRITE_TIMEOUT`); 0 when memory came back.
    fail_fast_until: AtomicU64,
    /// Pages whose read failed (lost, undecodable, failing their checksum): their log lines
    /// thin out as these grow (see `note_bad_page`).
    bad_page_reads: AtomicU64,
    shut_down: AtomicBool,
    /// A compaction asked for (`start_compaction`) is running.
    compacting: AtomicBool,
    /// Held by whoever claims a page to move or recompress it (`recompress`), from the claim
    /// to the install: the recompressor and a compaction asked for. Why one at a time: a claim
    /// is known by the entry's word and hint alone, and a write then a flush can make both
    /// what they were (the freed object taken again), so a second claimant's claim could
    /// pass for the first one's, which would then install the page's old data over the new.
    background_move: Mutex<()>,
    /// Test hook: this many of the next `flush::install` calls panic (an allocator bug, say).
    #[cfg(test)]
    install_panics: AtomicUsize,
    epoch: Instant,
    /// The epoch pages' idle hints are stamped with (see `table::Hint`).
    idle_clock: IdleClock,
    counters: Counters,
    /// Asks for an OOM kill when writes starve and pages do not compress (see `oom`).
    oom: oom::OomNudge,
    /// This process's claim on the store's memory (a second process must not serve it).
    owner: Ownership,
}

/// Check that a store of `size_bytes` can be made: a positive multiple of a page, and fewer
/// than 2^32 pages (just under 16 TiB: page numbers are 32-bit in the table and the slot
/// indexes); returns its pages. The daemon asks before it adds a device, so that a size the
/// store refuses never leaves a device added and unserved.
pub fn check_size(size_bytes: u64) -> Result<usize, StoreError> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(PAGE_SIZE as u64) {
        return Err(StoreError::Config(format!(
            "device size {size_bytes} is not a positive multiple of {PAGE_SIZE} bytes"
        )));
    }
    usize::try_from(size_bytes / PAGE_SIZE as u64)
        .ok()
        .filter(|&p| u32::try_from(p).is_ok())
        .ok_or_else(|| {
            StoreError::Config(format!(
                "device size {size_bytes} bytes is too large: it must be less than 16 TiB"
            ))
        })
}

/// Check `config` (for a store with a GPU codec if `has_gpu`); returns the device's pages.
fn check_config(config: &StoreConfig, has_gpu: bool) -> Result<usize, StoreError> {
    let table_pages = check_size(config.size_bytes)?;
    if config.batched && !(1..=1 << 20).contains(&config.batch_threshold) {
        return Err(StoreError::Config(format!(
            "batch threshold {} must be between 1 and {} pages",
            config.batch_threshold,
            1 << 20
        )));
    }
    if let Algorithm::Zstd { level } = config.algorithm {
        let range = zstd::compression_level_range();
        if !range.contains(&level) {
            return Err(StoreError::Config(format!(
                "zstd level {level} is outside {}..={}",
                range.start(),
                range.end()
            )));
        }
    }
    if config.forced_backend == Some(Backend::Gpu) {
        if !has_gpu {
            return Err(StoreError::Config(
                "backend gpu was asked for but no GPU is available; use simd or simd-parallel"
                    .into(),
            ));
        }
        if config.algorithm != Algorithm::Lz4 {
            return Err(StoreError::Config(
                "the GPU backend compresses LZ4 only; use --algorithm lz4".into(),
            ));
        }
    }
    Ok(table_pages)
}

/// Heap a process that resumes the `attached` store allocates while it does: the allocator's
/// lists and the rebuild's map (from what the store's owner last noted), the flush's buffers
/// and the list of pending pages; 0 if it is a store this binary cannot read; `gpu`: whether
/// the store will have a GPU codec. A standby keeps that much heap ready: a takeover comes
/// when memory is scarcest.
pub fn resume_heap_bytes(attached: &AttachedStore, gpu: bool) -> usize {
    let Some(hint) = attached.hint() else {
        return 0;
    };
    let slots = usize::try_from(hint.slots_per_batch)
        .unwrap_or(0)
        .min(1 << 20);
    let flush = CompressedBatch::heap_bytes(flush::flush_buffer_pages(slots, gpu));
    let pending = PENDING_BATCHES * slots * std::mem::size_of::<u64>();
    alloc::rebuild_heap_bytes(&hint.class_chunks, hint.carved_bytes) + flush + pending
}

impl BatchedPageStore {
    /// Build a store in this process's own memory (tests, bench).
    pub fn new(
        config: StoreConfig,
        gpu: Option<Arc<dyn BatchCodec>>,
    ) -> Result<Arc<Self>, StoreError> {
        Self::open(config, gpu, Backing::Private).map(|(store, _)| store)
    }

    /// Open a store in the memory `backing` names: a fresh one, or (shared backing) the one a
    /// previous process left for the same device, resumed with every page it held (see
    /// `resume`). The page table and the pending batches are committed up front.
    pub fn open(
        config: StoreConfig,
        gpu: Option<Arc<dyn BatchCodec>>,
        backing: Backing,
    ) -> Result<(Arc<Self>, Opened), StoreError> {
        Self::open_in(config, gpu, |shape| Regions::open(backing, shape))
    }

    /// Open device `device_id`'s store that a standby attached ahead of its takeover (see
    /// `AttachedStore`), as `open` with `Backing::Shared` does.
    pub fn open_attached(
        config: StoreConfig,
        gpu: Option<Arc<dyn BatchCodec>>,
        device_id: u32,
        attached: AttachedStore,
    ) -> Result<(Arc<Self>, Opened), StoreError> {
        Self::open_in(config, gpu, |shape| {
            Regions::open_attached(attached, device_id, shape)
        })
    }

    fn open_in(
        mut config: StoreConfig,
        gpu: Option<Arc<dyn BatchCodec>>,
        regions: impl FnOnce(Shape) -> Result<Regions, StoreError>,
    ) -> Result<(Arc<Self>, Opened), StoreError> {
        let pages = check_config(&config, gpu.is_some())?;
        let batch_pages = if config.batched {
            config.batch_threshold
        } else {
            0
        };
        // Address space only: stored pages never take more than the device's pages plus
        // partly used chunks, and since chunks are recycled by size, the arena holds every
        // size's peak at once (at most 8 sizes) with room to spare.
        let arena_bytes = config
            .size_bytes
            .saturating_mul(16)
            .saturating_add(1 << 30)
            .min(alloc::MAX_ARENA_PAGES * PAGE_SIZE as u64);
        let regions = regions(Shape {
            pages,
            slots_per_batch: batch_pages,
            arena_bytes: usize::try_from(arena_bytes).unwrap_or(usize::MAX),
            // A resumed store keeps its own; a new one gets its own when it is made.
            version: layout::LAYOUT_VERSION,
        })?;
        // A resumed store keeps the batch size it was made with.
        let slots = regions.shape.slots_per_batch;
        if config.batched && slots != config.batch_threshold {
            tracing::warn!(
                asked = config.batch_threshold,
                kept = slots,
                "the resumed store keeps its batch size"
            );
            config.batched = slots > 0;
            config.batch_threshold = slots.max(1);
        }
        let flush_part_pages = flush::flush_part_pages(slots, gpu.is_some());
        let flush_buffer_pages = flush::flush_buffer_pages(slots, gpu.is_some());
        let resumed = regions.resumed;
        let owner = regions.owner;
        let batches: Box<[PendingBatch]> = regions
            .batches
            .into_iter()
            .map(|(slots, indexes)| PendingBatch::new(slots, indexes))
            .collect();
        let alloc = ZsAllocator::new(
            config.reserve_bytes,
            regions.arena,
            Some(regions.class_chunks),
        );
        let span = BatchSpan::new(
            batches.first().map_or(0, PendingBatch::capacity),
            pending::quiet_after(reserve::QUIET_AFTER),
            // The refill thread keeps it (see `provide_batches`), where there is one.
            alloc.reserve.enabled(),
        );
        for batch in batches.iter() {
            batch
                .commit_slots(0..span.slots())
                .map_err(layout::memory_error(
                    "committing the pending batches' memory",
                ))?;
        }
        let store = Self {
            compressor: config.compressor(gpu),
            checksum: layout::checksum_of_version(regions.shape.version),
            layout_version: regions.shape.version,
            short_memory_compressor: config.short_memory_compressor(),
            memory_short: AtomicBool::new(false),
            table: PageTable::new(
                regions.shape.pages,
                regions.table,
                regions.hints,
                regions.checksums,
                regions.table_memory,
            ),
            alloc,
            batches,
            span,
            current: AtomicUsize::new(0),
            control: Mutex::new(Control {
                stop: false,
                flusher_started: false,
                flusher_running: false,
            }),
            flusher_wake: Condvar::new(),
            writers_wake: Condvar::new(),
            recompress_wake: Condvar::new(),
            recompress_sleep: Mutex::new(()),
            // Sized (and so faulted in) now: the first flush may come under memory pressure.
            flush_part_pages,
            flush: Mutex::new({
                let mut out = CompressedBatch::default();
                out.reset(flush_buffer_pages);
                let faulted_in = crate::mem::populate(&out.data)
                    .and_then(|()| crate::mem::populate(&out.lens))
                    .and_then(|()| crate::mem::populate(&out.encodings));
                if let Err(error) = faulted_in {
                    tracing::warn!(%error, "faulting in the flush buffers failed: the first flush may wait for memory");
                }
                out
            }),
            reserved_bytes: AtomicU64::new(0),
            fail_fast_until: AtomicU64::new(0),
            bad_page_reads: AtomicU64::new(0),
            shut_down: AtomicBool::new(false),
            compacting: AtomicBool::new(false),
            background_move: Mutex::new(()),
            #[cfg(test)]
            install_panics: AtomicUsize::new(0),
            epoch: Instant::now(),
            idle_clock: IdleClock::default(),
            counters: Counters::default(),
            oom: oom::OomNudge::new(config.oom_killer.clone()),
            config,
            owner,
        };
        let opened = if resumed {
            store.resume()?
        } else {
            Opened::Fresh
        };
        // A resumed store's batches may still hold their predecessor's whole span: the
        // pages pending there are installed now, so the slots past a quiet span go back.
        if !store.span.is_whole() {
            store.give_back_batch_tails();
        }
        store.alloc.reserve.refill();
        store.alloc.provision();
        store.batches[0].open(store.span.slots());
        Ok((Arc::new(store), opened))
    }

    /// Check that `[offset, offset + len)` is whole pages inside the device; returns the first
    /// page index.
    fn check_range(&self, offset: u64, len: u64) -> Result<u64, StoreError> {
        let page = PAGE_SIZE as u64;
        if !offset.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(StoreError::Misaligned { offset, len });
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.config.size_bytes => Ok(offset / page),
            _ => Err(StoreError::OutOfRange {
                offset,
                len,
                size: self.config.size_bytes,
            }),
        }
    }

    /// Write whole pages at byte `offset`; waits for memory while the store has none (see
    /// `admission`).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        self.write_with(offset, data, SlotWait::Block).map(|_| ())
    }

    /// Write whole pages at byte `offset`, but not wait for memory: when a page would wait for
    /// a pending slot (every batch full while the flusher waits for memory), return
    /// `WriteOutcome::Deferred` with the bytes written before it, for the caller to try the
    /// rest again later, so that its other requests (reads above all) are served meanwhile.
    /// `deferred_since`: when the caller's first try of this write was deferred; the
    /// starvation rule counts from then. With `batched` off, this waits as `write` does.
    pub fn try_write(
        &self,
        offset: u64,
        data: &[u8],
        deferred_since: Option<Instant>,
    ) -> Result<WriteOutcome, StoreError> {
        self.write_with(
            offset,
            data,
            SlotWait::Defer {
                since: deferred_since,
            },
        )
    }

    fn write_with(
        &self,
        offset: u64,
        data: &[u8],
        wait: SlotWait,
    ) -> Result<WriteOutcome, StoreError> {
        let result = self
            .check_range(offset, data.len() as u64)
            .and_then(|first| {
                let written = self.write_pinned(first, offset, data, wait);
                if written.is_err() {
                    // A group this write pinned may hold no page now: pinning it took it
                    // from a spare (or asked-for) group that is given back once unwritten,
                    // and the write stored nothing. Looked at as after a discard.
                    self.note_maybe_emptied(first, data.len() / PAGE_SIZE);
                }
                written
            });
        if result.is_err() {
            add(&self.counters.failed_writes, 1);
        }
        result
    }

    /// `write_with` for pages from `first` (range checked), with their table groups pinned.
    fn write_pinned(
        &self,
        first: u64,
        offset: u64,
        data: &[u8],
        wait: SlotWait,
    ) -> Result<WriteOutcome, StoreError> {
        let Some(_pins) = self.pin_table(first, data.len() / PAGE_SIZE, wait)? else {
            return Ok(WriteOutcome::Deferred { done_bytes: 0 });
        };
        for (i, bytes) in data.chunks_exact(PAGE_SIZE).enumerate() {
            let Ok(page) = <&Page>::try_from(bytes) else {
                return Err(StoreError::Misaligned {
                    offset,
                    len: data.len() as u64,
                });
            };
            if !self.write_page(first + i as u64, page, wait)? {
                return Ok(WriteOutcome::Deferred {
                    done_bytes: (i * PAGE_SIZE) as u64,
                });
            }
        }
        if let SlotWait::Defer { since: Some(since) } = wait {
            self.note_write_wait(since.elapsed());
        }
        Ok(WriteOutcome::Done)
    }

    /// Have the table groups of `pages` pages from `first` looked at for giving back.
    fn note_maybe_emptied(&self, first: u64, pages: usize) {
        let Some(last) = (first + pages as u64).checked_sub(1) else {
            return;
        };
        for group in TableMemory::group_of(first)..=TableMemory::group_of(last) {
            self.table.memory().note_emptied(group);
        }
    }

    /// Store one page; false if it was deferred (see `try_write`), which leaves it as it was.
    fn write_page(&self, index: u64, page: &Page, wait: SlotWait) -> Result<bool, StoreError> {
        if let PageClass::SameFilled(word) = classify(page) {
            if let Some(same) = PageState::same(word) {
                self.set_state(index, same)?;
                return Ok(true);
            }
        }
        self.admit()?;
        if self.config.batched {
            match self.write_pending(index, page, wait) {
                Ok(true) => {}
                done => {
                    sub(&self.reserved_bytes, PAGE_SIZE as u64);
                    return done;
                }
            }
        } else {
            let mut out = [0u8; PAGE_SIZE];
            let (compressor, short) = self.compressor_now();
            let (encoding, len) = compress_page(compressor.algorithm(), page, &mut out);
            self.count_compressed(Backend::Simd, short, 1);
            self.note_compressed(1, u64::from(encoding == Encoding::Raw));
            // The starvation rule of batched writes (see `admission`), for a write waiting
            // for chunk memory itself.
            let handle = match self
                .alloc
                .store_within(&out[..len], Some(&|waited| self.gives_up(waited)))
            {
                Ok(handle) => handle,
                Err(shortage) => {
                    sub(&self.reserved_bytes, PAGE_SIZE as u64);
                    return Err(match shortage {
                        alloc::Shortage::Starved { waited } => self.starved_write(waited),
                        alloc::Shortage::ArenaFull => StoreError::ArenaFull,
                    });
                }
            };
            let stored = self.set_stored(
                index,
                PageState::Stored {
                    handle,
                    len: crate::codec::page_len(len),
                    encoding,
                },
                self.checksum.of(page),
            );
            sub(&self.reserved_bytes, PAGE_SIZE as u64);
            if let Err(error) = stored {
                self.alloc.free(handle, len);
                return Err(error);
            }
        }
        Ok(true)
    }

    /// Copy a page into the open batch and point its entry at the slot; false if it was
    /// deferred (see `try_write`).
    fn write_pending(&self, index: u64, page: &Page, wait: SlotWait) -> Result<bool, StoreError> {
        let Some(reserved) = self.reserve_slot(wait)? else {
            return Ok(false);
        };
        let (batch, slot) = (reserved.batch(), reserved.slot);
        // Data and index first, then the entry: a process that dies in between leaves the
        // entry as it was (the write was never acknowledged).
        batch.fill(slot, index, page);
        add(&self.counters.pending_pages, 1);
        // Whatever becomes of the entry: the slot is flushed all the same, and a batch with
        // no first write's time waits to fill before it is.
        if slot == 0 {
            batch.note_first_write(self.now_ns());
        }
        let wake = slot == 0 || slot + 1 == batch.limit();
        let set = self.set_state(index, PageState::pending(reserved.batch_index, slot));
        if set.is_err() {
            // The slot is flushed all the same (and its counts and reservation settled there,
            // its entry not pointing at it): keep the reservation the caller gives back.
            add(&self.reserved_bytes, PAGE_SIZE as u64);
        }
        drop(reserved);
        if wake {
            self.wake_flusher();
        }
        set.map(|()| true)
    }

    /// Set a page's state (it was written now); frees what it held before.
    fn set_state(&self, index: u64, state: PageState) -> Result<(), StoreError> {
        self.set_written(index, state, None)
    }

    /// `set_state` to a stored object holding data of checksum `checksum`.
    fn set_stored(&self, index: u64, state: PageState, checksum: u32) -> Result<(), StoreError> {
        self.set_written(index, state, Some(checksum))
    }

    /// The caller has pinned the page's group (`pin_table`), so its entry has memory; if it
    /// has none all the same (a bug), the write fails.
    fn set_written(
        &self,
        index: u64,
        state: PageState,
        checksum: Option<u32>,
    ) -> Result<(), StoreError> {
        let old = {
            let Some(mut entry) = self.table.lock(index) else {
                tracing::error!(
                    page = index,
                    "a write to a page whose table group has no memory"
                );
                return Err(StoreError::TableAbsent { page: index });
            };
            entry.written(self.idle_clock.now());
            if let Some(checksum) = checksum {
                entry.set_checksum(checksum);
            }
            let old = entry.replace(state);
            self.counters.transition(old, state);
            old
        };
        if let PageState::Stored { handle, len, .. } = old {
            self.alloc.free(handle, usize::from(len));
        }
        Ok(())
    }

    /// Read whole pages at byte `offset` (never-written pages read as zeros). An error with a
    /// `bad_page` names the first bad page of the range, and every page before it is read
    /// into `buf`: a request that merged several swap-ins fails from that page on only.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let len = buf.len() as u64;
        let read_one =
            |(i, bytes): (usize, &mut [u8]), first: u64| match <&mut Page>::try_from(bytes) {
                Ok(page) => self.read_page(first + i as u64, page),
                Err(_) => Err(StoreError::Misaligned { offset, len }),
            };
        let result = self.check_range(offset, len).and_then(|first| {
            if buf.len() >= PARALLEL_READ_MIN_PAGES * PAGE_SIZE {
                // Every page is read, and the first failure wins, as in order.
                let first_failure = buf
                    .par_chunks_exact_mut(PAGE_SIZE)
                    .enumerate()
                    .filter_map(|item| read_one(item, first).err())
                    .min_by_key(|error| error.bad_page().unwrap_or(0));
                first_failure.map_or(Ok(()), Err)
            } else {
                buf.chunks_exact_mut(PAGE_SIZE)
                    .enumerate()
                    .try_for_each(|item| read_one(item, first))
            }
        });
        if result.is_err() {
            add(&self.counters.failed_reads, 1);
        }
        result
    }

    /// Count a page whose read failed; how many so far where this one is to be logged (the
    /// first, second, fourth, ...: a resume that lost many pages, read back by swapoff, must
    /// not flood the log).
    fn note_bad_page(&self) -> Option<u64> {
        let bad_pages = self.bad_page_reads.fetch_add(1, Ordering::Relaxed) + 1;
        bad_pages.is_power_of_two().then_some(bad_pages)
    }

    /// Decompress the stored object `handle` of `len` bytes into `out`; an object that is not
    /// there (a length its class cannot hold) is corrupt.
    fn decode_object(
        &self,
        handle: Handle,
        len: u16,
        encoding: Encoding,
        out: &mut Page,
    ) -> Result<(), crate::codec::CodecError> {
        self.alloc
            .with_object(handle, usize::from(len), |bytes| {
                decompress_page(encoding, bytes, out)
            })
            .unwrap_or(Err(crate::codec::CodecError::Corrupt))
    }

    fn read_page(&self, index: u64, out: &mut Page) -> Result<(), StoreError> {
        let Some(entry) = self.table.lock(index) else {
            // A group never written (or given back): empty.
            out.fill(0);
            return Ok(());
        };
        entry.touch(self.idle_clock.now());
        // An empty, same-filled or pending page's entry is all there is of it (or names where
        // it is): a bit flipped in it would read as other data (see `table`). A stored page's
        // data has its own checksum, checked below.
        if !matches!(entry.state(), PageState::Stored { .. }) && !entry.word_holds() {
            add(&self.counters.checksum_failures, 1);
            if let Some(bad_pages) = self.note_bad_page() {
                tracing::error!(
                    page = index,
                    bad_pages,
                    entry = ?entry.state(),
                    "page's table entry fails its check"
                );
            }
            return Err(StoreError::EntryMismatch { page: index });
        }
        match entry.state() {
            PageState::Empty => out.fill(0),
            PageState::Same(word) => fill_page(out, word),
            PageState::Pending { batch, slot } => {
                let s = self.batches[batch as usize].slot(slot as usize);
                out.copy_from_slice(&*s.page);
            }
            PageState::Lost => {
                if let Some(bad_pages) = self.note_bad_page() {
                    tracing::error!(
                        page = index,
                        bad_pages,
                        "read of a page lost when the store was resumed"
                    );
                }
                return Err(StoreError::Lost { page: index });
            }
            PageState::Stored {
                handle,
                len,
                encoding,
            } => {
                match self.decode_object(handle, len, encoding, out) {
                    Ok(()) => {}
                    // No memory for a codec context: the page is fine, the read failed.
                    Err(crate::codec::CodecError::NoContext(message)) => {
                        tracing::error!(page = index, "{message}: the read fails");
                        return Err(StoreError::Memory {
                            what: format!("reading page {index}"),
                            source: std::io::Error::new(std::io::ErrorKind::OutOfMemory, message),
                        });
                    }
                    Err(source) => {
                        if let Some(bad_pages) = self.note_bad_page() {
                            tracing::error!(page = index, bad_pages, %source, ?encoding, len, "stored page failed to decompress");
                        }
                        return Err(StoreError::Corrupt {
                            page: index,
                            source,
                        });
                    }
                }
                let (stored, found) = (entry.checksum(), self.checksum.of(out));
                if found != stored {
                    add(&self.counters.checksum_failures, 1);
                    if let Some(bad_pages) = self.note_bad_page() {
                        tracing::error!(
                            page = index,
                            bad_pages,
                            ?encoding,
                            len,
                            stored = format_args!("{stored:#010x}"),
                            found = format_args!("{found:#010x}"),
                            "stored page fails its checksum"
                        );
                    }
                    return Err(StoreError::ChecksumMismatch { page: index });
                }
            }
        }
        Ok(())
    }

    /// DISCARD and WRITE_ZEROES: the range reads as zeros and its memory is freed.
    pub fn discard(&self, offset: u64, len: u64) -> Result<(), StoreError> {
        let first = self.check_range(offset, len).inspect_err(|_| {
            add(&self.counters.failed_writes, 1);
        })?;
        for index in first..first + len / PAGE_SIZE as u64 {
            if self.empty_page(index, || true) {
                add(&self.counters.discarded_pages, 1);
            }
        }
        Ok(())
    }

    /// For a run of frees of the slots swap freed (heard of outside the block protocol, see
    /// `crate::slotfree`): the memory they free goes back to the system together when the
    /// run ends (see `SlotFrees`). Not for the I/O path: giving memory back takes the segment
    /// file's lock.
    pub fn swap_slot_frees(&self) -> SlotFrees<'_> {
        SlotFrees {
            store: self,
            emptied: self.alloc.reserve.freed_together(),
        }
    }

    /// Empty page `index` (inside the device) and free its memory if `now`, asked while the
    /// page's lock is held, says so; whether it held anything.
    fn empty_page(&self, index: u64, now: impl FnOnce() -> bool) -> bool {
        self.empty_page_with(index, now, |handle, len| self.alloc.free(handle, len))
    }

    /// `empty_page`, freeing the object the page held with `free(handle, len)`.
    fn empty_page_with(
        &self,
        index: u64,
        now: impl FnOnce() -> bool,
        free: impl FnOnce(Handle, usize),
    ) -> bool {
        let old = {
            let Some(mut entry) = self.table.lock(index) else {
                now();
                return false;
            };
            if !now() || entry.state() == PageState::Empty {
                return false;
            }
            entry.written(self.idle_clock.now());
            let old = entry.replace(PageState::Empty);
            self.counters.transition(old, PageState::Empty);
            old
        };
        // Marked once the entry's lock is released: a look at the group for giving it back
        // that clears the mark then finds the entry empty, not locked (which kept the group,
        // its mark gone: committed and empty for good).
        self.table
            .memory()
            .note_emptied(TableMemory::group_of(index));
        if let PageState::Stored { handle, len, .. } = old {
            free(handle, usize::from(len));
        }
        true
    }

    /// Compress whatever is pending now (shutdown, tests, bench).
    pub fn flush_pending(&self) -> Result<(), StoreError> {
        if self.config.batched {
            self.flush_open_batch();
        }
        Ok(())
    }

    /// Free this store's shared memory, its device deleted: the segment it maps, not
    /// whatever is under the device's key by now (see `layout::Ownership::free_shared`).
    /// False for private memory.
    pub fn free_shared_memory(&self) -> Result<bool, StoreError> {
        self.owner.free_shared()
    }

    /// Stop the flusher (after flushing what is pending).
    pub fn shutdown(&self) {
        if self.shut_down.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let mut ctl = self.control.lock();
            ctl.stop = true;
            self.flusher_wake.notify_all();
        }
        {
            // Under its lock, so that a recompressor between its look at `shut_down` and its
            // wait cannot miss the wake-up.
            let _sleep = self.recompress_sleep.lock();
            self.recompress_wake.notify_all();
        }
        self.flush_open_batch();
        self.alloc.reserve.stop();
    }

    /// Give the system the memory of chunks freed beyond the reserve's target if the refill
    /// thread, which otherwise does, has been stuck in a commit for a while (see
    /// `reserve::ChunkReserve::give_back_past_stuck_refill`). For the thread that frees the
    /// slots swap reports, right after it has.
    pub fn give_back_past_stuck_refill(&self) {
        self.rouse_stuck_refill();
        self.alloc.reserve.give_back_past_stuck_refill();
    }

    /// Tell the store whether the system is short of memory. While it is, new pages are
    /// compressed with the recompressor's stronger codec (an LZ4 store's zstd) rather than
    /// waiting for them to go idle: a swap device is written to hardest when RAM runs out,
    /// and then every page's size counts more than its speed. Has no effect on a store
    /// without such a codec (`config::short_memory_algorithm`).
    pub fn set_memory_short(&self, short: bool) {
        self.memory_short.store(short, Ordering::Relaxed);
        self.alloc.reserve.set_memory_short(short);
    }

    /// Whether the system is short of memory, as last told (`set_memory_short`).
    pub fn memory_short(&self) -> bool {
        self.memory_short.load(Ordering::Relaxed)
    }

    /// Whether swapping pages out to this store gives memory back lately: at most a quarter of
    /// the pages compressed lately were stored raw (see `oom`). Near OOM with pages that do
    /// not compress, every page swapped out costs the store as much memory as it frees.
    pub fn swap_frees_memory(&self) -> bool {
        self.oom.swap_frees_memory()
    }

    /// The compressor of new pages now (see `set_memory_short`), and whether it is the
    /// short-memory one (for `count_compressed`).
    fn compressor_now(&self) -> (&Compressor, bool) {
        match &self.short_memory_compressor {
            Some(small) if self.memory_short.load(Ordering::Relaxed) => (small, true),
            _ => (&self.compressor, false),
        }
    }

    /// Count `pages` new pages compressed by `backend`, with the short-memory compressor if
    /// `short` (see `compressor_now`).
    fn count_compressed(&self, backend: Backend, short: bool, pages: u64) {
        add(self.counters.backend(backend), pages);
        if short {
            add(&self.counters.short_memory_pages, pages);
        }
    }

    /// How this store checksums its pages' data (by its layout version).
    pub fn checksum(&self) -> PageChecksum {
        self.checksum
    }

    pub fn stats(&self) -> StoreStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let pending = get(&c.pending_pages);
        StoreStats {
            disk_size: self.config.size_bytes,
            layout_version: self.layout_version,
            checksum: self.checksum.name().to_string(),
            orig_bytes: get(&c.pages_held) * PAGE_SIZE as u64,
            compr_bytes: get(&c.compr_bytes),
            mem_used: self.alloc.chunk_bytes() + pending * PAGE_SIZE as u64,
            metadata_bytes: self.table.bytes() + self.alloc.metadata_bytes(),
            table_bytes: self.table.bytes(),
            batch_buffer_bytes: self
                .batches
                .iter()
                .map(|b| (self.span.slots() * PAGE_SIZE + b.capacity() * 8) as u64)
                .sum(),
            mem_limit: self.config.mem_limit.unwrap_or(0),
            pages_stored: get(&c.pages_stored),
            zero_pages: get(&c.zero_pages),
            same_pages: get(&c.same_pages),
            huge_pages: get(&c.huge_pages),
            pending_pages: pending,
            pages_lz4: get(&c.pages_lz4),
            pages_zstd: get(&c.pages_zstd),
            pages_simd: get(&c.pages_simd),
            pages_simd_parallel: get(&c.pages_simd_parallel),
            pages_gpu: get(&c.pages_gpu),
            gpu_fallback_batches: get(&c.gpu_fallback_batches),
            batch_flushes: get(&c.batch_flushes),
            failed_reads: get(&c.failed_reads),
            failed_writes: get(&c.failed_writes),
            discarded_pages: get(&c.discarded_pages),
            mem_limit_hits: get(&c.mem_limit_hits),
            starved_writes: get(&c.starved_writes),
            long_waited_writes: get(&c.long_waited_writes),
            longest_write_wait_ms: get(&c.longest_write_wait_ms),
            table_spares_taken: get(&c.table_spares_taken),
            batch_span_grows: get(&c.batch_span_grows),
            batch_span_shrinks: get(&c.batch_span_shrinks),
            table_group_waits: get(&c.table_group_waits),
            oom_kills_asked: get(&c.oom_kills_asked),
            lost_pages: get(&c.lost_pages),
            checksum_failures: get(&c.checksum_failures),
            gpu_mismatched_pages: get(&c.gpu_mismatched_pages),
            reserve_bytes: self.alloc.reserve.held_bytes(),
            reserve_misses: self.alloc.reserve.misses(),
            reserve_stolen_bytes: self.alloc.reserve.stolen_bytes(),
            reserve_split_chunks: self.alloc.reserve.split_chunks(),
            reserve_joined_chunks: self.alloc.reserve.joined_chunks(),
            reserve_given_back_past_refill_bytes: self.alloc.reserve.given_back_past_refill(),
            reserve_refill_rousings: self.alloc.reserve.refill_rousings(),
            recompressed_pages: get(&c.recompressed_pages),
            recompress_saved_bytes: get(&c.recompress_saved_bytes),
            recompress_rejected_pages: get(&c.recompress_rejected_pages),
            recompress_dropped_pages: get(&c.recompress_dropped_pages),
            recompress_cpu_ns: get(&c.recompress_cpu_ns),
            recompress_backlog: get(&c.recompress_backlog),
            recompress_passes: get(&c.recompress_passes),
            compacted_pages: get(&c.compacted_pages),
            compactions: get(&c.compactions),
            memory_short: self.memory_short.load(Ordering::Relaxed),
            short_memory_pages: get(&c.short_memory_pages),
        }
    }

    pub fn size_bytes(&self) -> u64 {
        self.config.size_bytes
    }

    /// Test hook: flip the lowest bit of byte `at` of a stored page's object.
    #[cfg(test)]
    fn flip_stored_bit(&self, index: u64, at: usize) -> bool {
        let Some(entry) = self.table.lock(index) else {
            return false;
        };
        if let PageState::Stored { handle, len, .. } = entry.state() {
            self.alloc
                .with_object_mut(handle, usize::from(len), |b| b[at] ^= 1);
            true
        } else {
            false
        }
    }

    /// Test hook: the stored length of page `index`, if it is stored.
    #[cfg(test)]
    fn stored_len(&self, index: u64) -> Option<usize> {
        match self.table.lock(index)?.state() {
            PageState::Stored { len, .. } => Some(usize::from(len)),
            _ => None,
        }
    }

    /// Test hook: overwrite a stored page's compressed bytes with `byte`.
    #[cfg(test)]
    fn corrupt_stored_page(&self, index: u64, byte: u8) -> bool {
        let Some(entry) = self.table.lock(index) else {
            return false;
        };
        if let PageState::Stored { handle, len, .. } = entry.state() {
            self.alloc
                .with_object_mut(handle, usize::from(len), |b| b.fill(byte));
            true
        } else {
            false
        }
    }
}

/// A run of frees of the slots swap freed (`BatchedPageStore::swap_slot_frees`); the chunks
/// they empty go back together when it is dropped (see `reserve::FreedTogether`).
pub struct SlotFrees<'a> {
    store: &'a BatchedPageStore,
    emptied: FreedTogether<'a>,
}

impl SlotFrees<'_> {
    /// Swap freed the slot of page `index`: unless `still_freed`, asked while the page's lock
    /// is held, says a write came since, the page is emptied as by a discard. Whether it was
    /// emptied.
    pub fn free(&mut self, index: u64, still_freed: &dyn Fn() -> bool) -> bool {
        let store = self.store;
        if index >= store.config.size_bytes / PAGE_SIZE as u64 {
            // Nothing to free; forget the report all the same.
            still_freed();
            return false;
        }
        let emptied = &mut self.emptied;
        store.empty_page_with(index, still_freed, |handle, len| {
            if let Some(chunk) = store.alloc.free_object(handle, len) {
                emptied.push(chunk);
            }
        })
    }

    /// Give the memory of the run's frees back now, as dropping it does: the hole punches
    /// the whole run made.
    pub fn finish(self) -> Punches {
        self.emptied.finish()
    }
}

#[cfg(test)]
mod tests;
