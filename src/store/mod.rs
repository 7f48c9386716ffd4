//! The page store: page table (index → entry), compressed-page memory, the pending batch,
//! the flusher, stats, memory limit and discard. Knows nothing of the kernel or io_uring.
//!
//! Write path: classify the page; a same-filled page goes straight into its table entry.
//! Anything else is copied into a slot of the open pending batch and the entry points at that
//! slot, so reads of pending pages are O(1). The flusher compresses a batch when it reaches
//! `batch_threshold` pages or its oldest page is `flush_timeout` old, and swaps each entry from
//! its slot to the stored object, unless a newer write or discard changed the entry meanwhile.
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

mod alloc;
mod pending;
mod reserve;
mod table;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLockReadGuard};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use crate::codec::BackendThresholds;
use crate::codec::{
    classify, compress_page, decompress_page, fill_page, select_backend, Algorithm, Backend,
    BatchCodec, CompressedBatch, CpuCodec, Encoding, Page, PageClass, MAX_COMPRESSED_LEN,
    PAGE_SIZE,
};
use alloc::ZsAllocator;
use pending::{PendingBatch, PendingSlot, Reserve};
use table::{PageState, PageTable};

/// Pending batches: one fills while the flusher compresses the other.
const PENDING_BATCHES: usize = 2;

/// Without a GPU a batch is compressed and installed this many pages at a time, so that the
/// compression buffer (locked memory, like everything the daemon has) holds 1 MiB rather than
/// a whole batch; rayon still spreads each part over every core. A GPU takes whole batches.
const FLUSH_PART_PAGES: usize = 256;

/// A writer that has waited this long for a pending slot while the flusher waits for chunk
/// memory, and the refill thread has committed none in that time, fails its write with
/// `ENOMEM`, and so do the writes after it for `FAIL_FAST_PERIOD` or until the flusher frees a
/// batch. A refill that is slow but commits keeps writes waiting: at the onset of pressure
/// memory comes back in well under a second per commit group, and failing then only logs
/// write errors. Why: the daemon serves swap, and when the system has no memory to give the store,
/// a write that waits holds its bio, and with it every task in reclaim (they wait for bios and
/// writeback), the swap-ins queued behind it, and the OOM killer, which the kernel does not
/// call while writeback is pending. Failing the write lets reclaim go on (the kernel keeps the
/// page and tries again later) and, if memory really is gone, the OOM killer act. Bursts, in
/// which the refill thread catches up within milliseconds, never fail.
const STARVED_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// After a write gave up, later writes fail at once for this long, then wait again: the
/// queue serves swap-ins too, and must not hold each write for a whole timeout.
const FAIL_FAST_PERIOD: Duration = Duration::from_millis(200);

/// Reads of at least this many pages (1 MiB) decompress on all cores. Smaller ones, which is
/// every request the kernel sends a ublk device by default, stay on the caller's thread: the
/// shared rayon pool may be busy with a flush, and a small read must not wait behind it.
const PARALLEL_READ_MIN_PAGES: usize = 256;

/// Everything the store needs to know, from the command line or the config file.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Device size in bytes (a multiple of `PAGE_SIZE`).
    pub size_bytes: u64,
    pub algorithm: Algorithm,
    /// `false` (`--no-batched`): every write is compressed in the writer's thread.
    pub batched: bool,
    /// Pages in the pending batch that trigger a flush (`--batch-threshold`, default 1000).
    pub batch_threshold: usize,
    /// Age of the oldest pending page that triggers a flush (`--flush-timeout-ms`, default 10).
    pub flush_timeout: Duration,
    /// `--mem-limit`: writes that would exceed it fail with `NoSpace`.
    pub mem_limit: Option<u64>,
    pub thresholds: BackendThresholds,
    /// Force one backend for every batch (`bench --backend`); `None` selects by batch size.
    pub forced_backend: Option<Backend>,
    /// Bytes of chunk memory kept faulted in and ready, refilled by a thread of its own, so
    /// that storing pages never waits on reclaim (see `reserve`). 0 for none (tests, bench);
    /// the daemon always keeps one.
    pub reserve_bytes: u64,
}

impl StoreConfig {
    /// Defaults for a device of `size_bytes`.
    pub fn new(size_bytes: u64) -> Self {
        Self {
            size_bytes,
            algorithm: Algorithm::Lz4,
            batched: true,
            batch_threshold: 1000,
            flush_timeout: Duration::from_millis(10),
            mem_limit: None,
            thresholds: BackendThresholds::default(),
            forced_backend: None,
            reserve_bytes: 0,
        }
    }
}

/// Errors of the store; `errno()` gives what the block request completes with.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("request at byte {offset} of length {len} is beyond the device end ({size} bytes)")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("request at byte {offset} of length {len} is not 4 KiB aligned")]
    Misaligned { offset: u64, len: u64 },
    #[error(
        "memory limit of {limit} bytes reached (raise --mem-limit or free pages with discard)"
    )]
    NoSpace { limit: u64 },
    #[error(
        "no memory for compressed pages: a write waited {waited_ms} ms while the flusher waited for the system to give the store some"
    )]
    OutOfMemory { waited_ms: u64 },
    #[error("stored page {page} failed to decompress: {source}")]
    Corrupt {
        page: u64,
        source: crate::codec::CodecError,
    },
    #[error("invalid store configuration: {0}")]
    Config(String),
}

impl StoreError {
    /// The negative errno a block request fails with.
    pub fn errno(&self) -> i32 {
        match self {
            StoreError::OutOfRange { .. } | StoreError::Corrupt { .. } => -libc::EIO,
            StoreError::Misaligned { .. } | StoreError::Config(_) => -libc::EINVAL,
            StoreError::NoSpace { .. } => -libc::ENOSPC,
            StoreError::OutOfMemory { .. } => -libc::ENOMEM,
        }
    }
}

/// A point-in-time copy of the store's counters (zram's mm_stat and more). Gauges describe the
/// pages held now; counters (`pages_simd` .. `starved_writes`) count since the store started.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StoreStats {
    pub disk_size: u64,
    /// Bytes of pages written and held (same-filled pages included), like zram's orig_data_size.
    pub orig_bytes: u64,
    /// Bytes of compressed data held, like zram's compr_data_size (raw pages count 4 KiB).
    pub compr_bytes: u64,
    /// Bytes of memory holding page data (allocator chunks, pending pages), like mem_used_total.
    pub mem_used: u64,
    /// Bytes of metadata (page table and allocator bookkeeping).
    pub metadata_bytes: u64,
    /// Bytes of the preallocated pending-batch buffers (fixed; not in `mem_used`).
    pub batch_buffer_bytes: u64,
    /// 0 when there is no limit.
    pub mem_limit: u64,
    /// Pages held compressed or raw in the allocator.
    pub pages_stored: u64,
    /// Zero pages held (a subset of `same_pages`).
    pub zero_pages: u64,
    /// Same-filled pages held, zero pages included (zram's same_pages).
    pub same_pages: u64,
    /// Pages held raw because they did not compress (zram's huge_pages).
    pub huge_pages: u64,
    /// Pages written but not yet compressed.
    pub pending_pages: u64,
    /// Pages held encoded with LZ4.
    pub pages_lz4: u64,
    /// Pages held encoded with zstd.
    pub pages_zstd: u64,
    /// Pages compressed by each backend.
    pub pages_simd: u64,
    pub pages_simd_parallel: u64,
    pub pages_gpu: u64,
    /// GPU batches that failed and were compressed again on the CPU.
    pub gpu_fallback_batches: u64,
    pub batch_flushes: u64,
    pub failed_reads: u64,
    pub failed_writes: u64,
    pub discarded_pages: u64,
    pub mem_limit_hits: u64,
    /// Writes failed with ENOMEM because the system gave the store no memory for a while.
    #[serde(default)]
    pub starved_writes: u64,
    /// Bytes of chunk memory held ready in the reserve (not in `mem_used`).
    #[serde(default)]
    pub reserve_bytes: u64,
    /// Chunks allocated on the I/O path because the reserve was empty.
    #[serde(default)]
    pub reserve_misses: u64,
}

/// Live counters behind `StoreStats`.
#[derive(Default)]
struct Counters {
    pages_held: AtomicU64,
    compr_bytes: AtomicU64,
    pages_stored: AtomicU64,
    zero_pages: AtomicU64,
    same_pages: AtomicU64,
    huge_pages: AtomicU64,
    pending_pages: AtomicU64,
    pages_lz4: AtomicU64,
    pages_zstd: AtomicU64,
    pages_simd: AtomicU64,
    pages_simd_parallel: AtomicU64,
    pages_gpu: AtomicU64,
    gpu_fallback_batches: AtomicU64,
    batch_flushes: AtomicU64,
    failed_reads: AtomicU64,
    failed_writes: AtomicU64,
    discarded_pages: AtomicU64,
    mem_limit_hits: AtomicU64,
    starved_writes: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

fn sub(c: &AtomicU64, n: u64) {
    c.fetch_sub(n, Ordering::Relaxed);
}

impl Counters {
    /// Move the gauges from page state `old` to `new`.
    fn transition(&self, old: PageState, new: PageState) {
        self.gauge(old, sub);
        self.gauge(new, add);
        match (old, new) {
            (PageState::Empty, PageState::Empty) => {}
            (PageState::Empty, _) => add(&self.pages_held, 1),
            (_, PageState::Empty) => sub(&self.pages_held, 1),
            _ => {}
        }
    }

    fn gauge(&self, state: PageState, op: fn(&AtomicU64, u64)) {
        match state {
            PageState::Same(w) => {
                op(&self.same_pages, 1);
                if w == 0 {
                    op(&self.zero_pages, 1);
                }
            }
            PageState::Stored { len, encoding, .. } => {
                op(&self.pages_stored, 1);
                op(&self.compr_bytes, u64::from(len));
                match encoding {
                    Encoding::Lz4 => op(&self.pages_lz4, 1),
                    Encoding::Zstd => op(&self.pages_zstd, 1),
                    Encoding::Raw => op(&self.huge_pages, 1),
                }
            }
            PageState::Empty | PageState::Pending { .. } => {}
        }
    }

    fn backend(&self, backend: Backend) -> &AtomicU64 {
        match backend {
            Backend::Simd => &self.pages_simd,
            Backend::SimdParallel => &self.pages_simd_parallel,
            Backend::Gpu => &self.pages_gpu,
        }
    }
}

/// Flusher wake-ups and the writers waiting for a free batch.
struct Control {
    stop: bool,
    flusher_running: bool,
}

/// The page store.
pub struct BatchedPageStore {
    config: StoreConfig,
    table: PageTable,
    alloc: ZsAllocator,
    gpu: Option<Arc<dyn BatchCodec>>,
    simd: CpuCodec,
    parallel: CpuCodec,
    batches: Box<[PendingBatch]>,
    /// Index of the open batch.
    current: AtomicUsize,
    control: Mutex<Control>,
    flusher_wake: Condvar,
    writers_wake: Condvar,
    /// Held for a whole flush; holds the reused output buffer, of `flush_part_pages` pages.
    flush: Mutex<CompressedBatch>,
    flush_part_pages: usize,
    /// Bytes promised to written pages not yet compressed: each may need a whole page.
    reserved_bytes: AtomicU64,
    /// Until when (ns since `epoch`) writers fail at once rather than wait, after one gave up
    /// waiting for memory (see `STARVED_WRITE_TIMEOUT`); 0 when memory came back.
    fail_fast_until: AtomicU64,
    shut_down: AtomicBool,
    epoch: Instant,
    counters: Counters,
}

/// The store's own threads, as `start_flusher`'s `thread_init` is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreThread {
    /// Compresses the pending batches and installs them.
    Flusher,
    /// Commits chunk memory ahead of need (see `reserve`).
    Refill,
}

/// Joins the flusher thread when dropped after `BatchedPageStore::shutdown` (dropping it
/// first shuts the store down).
pub struct FlusherHandle {
    store: Arc<BatchedPageStore>,
    thread: Option<std::thread::JoinHandle<()>>,
    refill_thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for FlusherHandle {
    fn drop(&mut self) {
        self.store.shutdown();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the flusher thread panicked");
            }
        }
        if let Some(t) = self.refill_thread.take() {
            if t.join().is_err() {
                tracing::error!("the reserve refill thread panicked");
            }
        }
    }
}

/// Marks the flusher stopped even if it unwinds, so writers flush for themselves.
struct FlusherRunning<'a>(&'a BatchedPageStore);

impl Drop for FlusherRunning<'_> {
    fn drop(&mut self) {
        self.0.control.lock().flusher_running = false;
        self.0.writers_wake.notify_all();
    }
}

impl BatchedPageStore {
    /// Build a store; allocates the page table and the pending batches up front.
    pub fn new(
        config: StoreConfig,
        gpu: Option<Arc<dyn BatchCodec>>,
    ) -> Result<Arc<Self>, StoreError> {
        if config.size_bytes == 0 || config.size_bytes % PAGE_SIZE as u64 != 0 {
            return Err(StoreError::Config(format!(
                "device size {} is not a positive multiple of {PAGE_SIZE} bytes",
                config.size_bytes
            )));
        }
        let pages = config.size_bytes / PAGE_SIZE as u64;
        let table_pages = usize::try_from(pages)
            .ok()
            .filter(|&p| u32::try_from(p).is_ok())
            .ok_or_else(|| {
                StoreError::Config(format!(
                    "device size {} bytes is too large (at most 16 TiB)",
                    config.size_bytes
                ))
            })?;
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
            if gpu.is_none() {
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
        let batch_pages = if config.batched {
            config.batch_threshold
        } else {
            0
        };
        let flush_part_pages = if gpu.is_some() {
            batch_pages
        } else {
            batch_pages.min(FLUSH_PART_PAGES)
        }
        .max(1);
        let batches: Box<[PendingBatch]> = (0..PENDING_BATCHES)
            .map(|_| PendingBatch::new(batch_pages))
            .collect();
        batches[0].open();
        // Address space only: stored pages never take more than the device's pages plus
        // partly used chunks, and churn between chunk sizes leaves room to spare.
        let arena_bytes = config
            .size_bytes
            .saturating_mul(16)
            .saturating_add(1 << 30)
            .min(1 << 45);
        let alloc = ZsAllocator::new(config.reserve_bytes, arena_bytes as usize)
            .map_err(|e| StoreError::Config(format!("cannot reserve page memory: {e}")))?;
        alloc.reserve.refill();
        alloc.provision();
        Ok(Arc::new(Self {
            simd: CpuCodec::single(config.algorithm),
            parallel: CpuCodec::parallel(config.algorithm),
            table: PageTable::new(table_pages),
            alloc,
            gpu,
            batches,
            current: AtomicUsize::new(0),
            control: Mutex::new(Control {
                stop: false,
                flusher_running: false,
            }),
            flusher_wake: Condvar::new(),
            writers_wake: Condvar::new(),
            // Sized (and so faulted in) now: the first flush may come under memory pressure.
            flush_part_pages,
            flush: Mutex::new({
                let mut out = CompressedBatch::default();
                out.reset(flush_part_pages);
                crate::mem::populate(&out.data);
                crate::mem::populate(&out.lens);
                crate::mem::populate(&out.encodings);
                out
            }),
            reserved_bytes: AtomicU64::new(0),
            fail_fast_until: AtomicU64::new(0),
            shut_down: AtomicBool::new(false),
            epoch: Instant::now(),
            counters: Counters::default(),
            config,
        }))
    }

    /// Start the flusher thread and, when the store keeps a chunk reserve, its refill thread.
    /// `thread_init` runs first on each, told which it is (the daemon readies them for the I/O
    /// path and makes them I/O flushers: see `reserve` for why the refill thread is one too).
    pub fn start_flusher(
        self: &Arc<Self>,
        thread_init: impl Fn(StoreThread) + Send + Sync + Clone + 'static,
    ) -> std::io::Result<FlusherHandle> {
        {
            let mut ctl = self.control.lock();
            if ctl.flusher_running || ctl.stop {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the flusher is already running or the store is shut down",
                ));
            }
            ctl.flusher_running = true;
        }
        let store = Arc::clone(self);
        let init = thread_init.clone();
        let spawned = std::thread::Builder::new()
            .name("trueno-flusher".into())
            .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
            .spawn(move || {
                let _running = FlusherRunning(&store);
                init(StoreThread::Flusher);
                store.flusher_loop();
            });
        let refill_thread = if self.alloc.reserve.enabled() {
            let store = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name("trueno-reserve".into())
                .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
                .spawn(move || {
                    thread_init(StoreThread::Refill);
                    store.alloc.reserve.run_refill(|| store.alloc.provision())
                });
            match spawned {
                Ok(thread) => Some(thread),
                Err(e) => {
                    self.control.lock().flusher_running = false;
                    return Err(e);
                }
            }
        } else {
            None
        };
        match spawned {
            Ok(thread) => Ok(FlusherHandle {
                store: Arc::clone(self),
                thread: Some(thread),
                refill_thread,
            }),
            Err(e) => {
                self.control.lock().flusher_running = false;
                Err(e)
            }
        }
    }

    fn flusher_loop(&self) {
        let timeout_ns = u64::try_from(self.config.flush_timeout.as_nanos()).unwrap_or(u64::MAX);
        let mut ctl = self.control.lock();
        while !ctl.stop {
            let batch = &self.batches[self.current.load(Ordering::Acquire)];
            if !batch.is_full() {
                // Not full: wait for the first page's writer to note its time (it wakes us),
                // then until that page is `flush_timeout` old, or for the batch to fill.
                let Some(first) = batch.first_write_ns() else {
                    self.flusher_wake.wait(&mut ctl);
                    continue;
                };
                let deadline = first.saturating_add(timeout_ns);
                let now = self.now_ns();
                if now < deadline {
                    let wait = Duration::from_nanos(deadline - now);
                    self.flusher_wake.wait_for(&mut ctl, wait);
                    continue;
                }
            }
            drop(ctl);
            self.flush_open_batch();
            ctl = self.control.lock();
        }
        drop(ctl);
        self.flush_open_batch();
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn wake_flusher(&self) {
        let _ctl = self.control.lock();
        self.flusher_wake.notify_one();
    }

    /// Check that `[offset, offset + len)` is whole pages inside the device; returns the first
    /// page index.
    fn check_range(&self, offset: u64, len: u64) -> Result<u64, StoreError> {
        let page = PAGE_SIZE as u64;
        if offset % page != 0 || len % page != 0 {
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

    /// Write whole pages at byte `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        let result = self
            .check_range(offset, data.len() as u64)
            .and_then(|first| {
                data.chunks_exact(PAGE_SIZE)
                    .zip(first..)
                    .try_for_each(|(bytes, index)| match <&Page>::try_from(bytes) {
                        Ok(page) => self.write_page(index, page),
                        Err(_) => Err(StoreError::Misaligned {
                            offset,
                            len: data.len() as u64,
                        }),
                    })
            });
        if result.is_err() {
            add(&self.counters.failed_writes, 1);
        }
        result
    }

    fn write_page(&self, index: u64, page: &Page) -> Result<(), StoreError> {
        if let PageClass::SameFilled(word) = classify(page) {
            self.set_state(index, PageState::Same(word));
            return Ok(());
        }
        self.admit()?;
        if self.config.batched {
            if let Err(error) = self.write_pending(index, page) {
                sub(&self.reserved_bytes, PAGE_SIZE as u64);
                return Err(error);
            }
        } else {
            let mut out = [0u8; PAGE_SIZE];
            let (encoding, len) = compress_page(self.config.algorithm, page, &mut out);
            add(&self.counters.pages_simd, 1);
            let handle = self.alloc.store(&out[..len]);
            self.set_state(
                index,
                PageState::Stored {
                    handle,
                    len: len as u16,
                    encoding,
                },
            );
            sub(&self.reserved_bytes, PAGE_SIZE as u64);
        }
        Ok(())
    }

    fn failing_fast(&self) -> bool {
        self.now_ns() < self.fail_fast_until.load(Ordering::Acquire)
    }

    /// A write gives up waiting for memory: count it, make the writes after it fail at once for
    /// a while (unless that is already so), and say why.
    fn starved_write(&self, waited: Duration) -> StoreError {
        if !self.failing_fast() {
            let period = u64::try_from(FAIL_FAST_PERIOD.as_nanos()).unwrap_or(u64::MAX);
            self.fail_fast_until
                .store(self.now_ns().saturating_add(period), Ordering::Release);
        }
        add(&self.counters.starved_writes, 1);
        StoreError::OutOfMemory {
            waited_ms: waited.as_millis() as u64,
        }
    }

    /// Reserve a page's worth of the memory limit for a page about to be compressed.
    fn admit(&self) -> Result<(), StoreError> {
        let Some(limit) = self.config.mem_limit else {
            add(&self.reserved_bytes, PAGE_SIZE as u64);
            return Ok(());
        };
        let before = self
            .reserved_bytes
            .fetch_add(PAGE_SIZE as u64, Ordering::Relaxed);
        if self.alloc.chunk_bytes() + before + PAGE_SIZE as u64 > limit {
            sub(&self.reserved_bytes, PAGE_SIZE as u64);
            add(&self.counters.mem_limit_hits, 1);
            return Err(StoreError::NoSpace { limit });
        }
        Ok(())
    }

    /// Copy a page into the open batch and point its entry at the slot.
    fn write_pending(&self, index: u64, page: &Page) -> Result<(), StoreError> {
        let (batch_idx, slot) = self.reserve_slot()?;
        let batch = &self.batches[batch_idx];
        {
            let mut s = batch.slots[slot].write();
            s.page.copy_from_slice(page);
            s.index = index;
        }
        add(&self.counters.pending_pages, 1);
        self.set_state(
            index,
            PageState::Pending {
                batch: batch_idx as u32,
                slot: slot as u32,
            },
        );
        if slot == 0 {
            batch.note_first_write(self.now_ns());
        }
        batch.commit();
        if slot == 0 || slot + 1 == batch.slots.len() {
            self.wake_flusher();
        }
        Ok(())
    }

    /// A free pending slot; waits for the flusher while every batch is full.
    fn reserve_slot(&self) -> Result<(usize, usize), StoreError> {
        // Since when this writer has waited without the refill thread committing anything.
        let mut stalled: Option<(Instant, u64)> = None;
        loop {
            let b = self.current.load(Ordering::Acquire);
            match self.batches[b].reserve() {
                Reserve::Slot(s) => return Ok((b, s)),
                Reserve::Closed => std::thread::yield_now(),
                Reserve::Full => {
                    let commits = self.alloc.reserve.commits();
                    let since = match stalled {
                        Some((since, seen)) if seen == commits => since,
                        _ => stalled.insert((Instant::now(), commits)).0,
                    };
                    let waited = since.elapsed();
                    if self.failing_fast()
                        || (waited >= STARVED_WRITE_TIMEOUT && self.alloc.reserve.starving())
                    {
                        return Err(self.starved_write(waited));
                    }
                    let mut ctl = self.control.lock();
                    if !ctl.flusher_running {
                        drop(ctl);
                        self.flush_open_batch();
                    } else if self.current.load(Ordering::Acquire) == b && self.batches[b].is_full()
                    {
                        // Bounded, so a flusher that starts starving is noticed.
                        self.writers_wake
                            .wait_for(&mut ctl, Duration::from_millis(5));
                    }
                }
            }
        }
    }

    /// Set a page's state; frees what it held before.
    fn set_state(&self, index: u64, state: PageState) {
        let old = {
            let mut entry = self.table.lock(index as usize);
            let old = entry.replace(state);
            self.counters.transition(old, state);
            old
        };
        if let PageState::Stored { handle, .. } = old {
            self.alloc.free(handle);
        }
    }

    /// Seal the open batch (if it holds anything), open the other one, and compress and
    /// install the sealed one. One flush at a time.
    fn flush_open_batch(&self) {
        let mut out = self.flush.lock();
        let b = self.current.load(Ordering::Acquire);
        if self.batches[b].reserved() == 0 {
            return;
        }
        // Under the flush mutex every batch but the open one is flushed and free.
        let next = (b + 1) % PENDING_BATCHES;
        self.batches[next].open();
        self.current.store(next, Ordering::Release);
        // A free batch again: writers may wait for slots instead of failing.
        self.fail_fast_until.store(0, Ordering::Release);
        {
            let _ctl = self.control.lock();
            self.writers_wake.notify_all();
        }
        let n = self.batches[b].seal();
        let slots: Vec<RwLockReadGuard<'_, PendingSlot>> = self.batches[b].slots[..n]
            .iter()
            .map(|s| s.read())
            .collect();
        add(&self.counters.batch_flushes, 1);
        for (part_index, part) in slots.chunks(self.flush_part_pages).enumerate() {
            let first = part_index * self.flush_part_pages;
            let pages: Vec<&Page> = part.iter().map(|s| &s.page).collect();
            let backend = self.compress(&pages, &mut out);
            add(self.counters.backend(backend), part.len() as u64);
            // Installing is an allocation and a copy per page: spread it like the compression.
            if backend == Backend::Simd {
                for (i, s) in part.iter().enumerate() {
                    self.install(b, first + i, s, &out, i);
                }
            } else {
                part.par_iter()
                    .enumerate()
                    .for_each(|(i, s)| self.install(b, first + i, s, &out, i));
            }
        }
    }

    /// Compress with the configured or selected backend; a GPU failure, or GPU output that
    /// does not hold together, sends the batch to the CPU. Returns the backend that did it.
    fn compress(&self, pages: &[&Page], out: &mut CompressedBatch) -> Backend {
        let gpu = self
            .gpu
            .as_ref()
            .filter(|_| self.config.algorithm == Algorithm::Lz4);
        let backend = self
            .config
            .forced_backend
            .unwrap_or_else(|| select_backend(pages.len(), gpu.is_some(), &self.config.thresholds));
        let cpu = match (backend, gpu) {
            (Backend::Gpu, Some(gpu)) => match gpu.compress_batch(pages, out) {
                Ok(()) if out.is_well_formed(pages.len()) => return Backend::Gpu,
                Ok(()) => {
                    tracing::warn!(
                        pages = pages.len(),
                        "GPU batch output malformed; compressing on the CPU"
                    );
                    add(&self.counters.gpu_fallback_batches, 1);
                    Backend::SimdParallel
                }
                Err(e) => {
                    tracing::warn!(
                        pages = pages.len(),
                        "GPU batch failed ({e}); compressing on the CPU"
                    );
                    add(&self.counters.gpu_fallback_batches, 1);
                    Backend::SimdParallel
                }
            },
            (Backend::Simd, _) => Backend::Simd,
            _ => Backend::SimdParallel,
        };
        let codec = if cpu == Backend::Simd {
            &self.simd
        } else {
            &self.parallel
        };
        // CPU codecs do not fail: pages that do not compress are stored raw.
        if let Err(e) = codec.compress_batch(pages, out) {
            tracing::error!("CPU batch compression failed: {e}");
        }
        cpu
    }

    /// Store slot `slot` of batch `batch`, compressed as page `out_page` of `out`, and point
    /// its page's entry at it, if the entry still points at the slot; a newer write or a
    /// discard wins otherwise.
    fn install(
        &self,
        batch: usize,
        slot: usize,
        pending: &PendingSlot,
        out: &CompressedBatch,
        out_page: usize,
    ) {
        let index = pending.index;
        let (encoding, bytes) = match out.page(out_page) {
            // The huge-page rule holds whichever backend compressed (the GPU codec may not
            // apply it): such a page costs less, and reads faster, as itself.
            (Encoding::Lz4 | Encoding::Zstd, bytes) if bytes.len() > MAX_COMPRESSED_LEN => {
                (Encoding::Raw, &pending.page[..])
            }
            page => page,
        };
        let handle = self.alloc.store(bytes);
        let installed = {
            let mut entry = self.table.lock(index as usize);
            let expected = PageState::Pending {
                batch: batch as u32,
                slot: slot as u32,
            };
            if entry.state() == expected {
                let new = PageState::Stored {
                    handle,
                    len: bytes.len() as u16,
                    encoding,
                };
                entry.replace(new);
                self.counters.transition(expected, new);
                true
            } else {
                false
            }
        };
        if !installed {
            self.alloc.free(handle);
        }
        sub(&self.counters.pending_pages, 1);
        sub(&self.reserved_bytes, PAGE_SIZE as u64);
    }

    /// Read whole pages at byte `offset` (never-written pages read as zeros).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let len = buf.len() as u64;
        let read_one =
            |(i, bytes): (usize, &mut [u8]), first: u64| match <&mut Page>::try_from(bytes) {
                Ok(page) => self.read_page(first + i as u64, page),
                Err(_) => Err(StoreError::Misaligned { offset, len }),
            };
        let result = self.check_range(offset, len).and_then(|first| {
            if buf.len() >= PARALLEL_READ_MIN_PAGES * PAGE_SIZE {
                buf.par_chunks_exact_mut(PAGE_SIZE)
                    .enumerate()
                    .try_for_each(|item| read_one(item, first))
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

    fn read_page(&self, index: u64, out: &mut Page) -> Result<(), StoreError> {
        let entry = self.table.lock(index as usize);
        match entry.state() {
            PageState::Empty => out.fill(0),
            PageState::Same(word) => fill_page(out, word),
            PageState::Pending { batch, slot } => {
                let s = self.batches[batch as usize].slots[slot as usize].read();
                out.copy_from_slice(&s.page);
            }
            PageState::Stored {
                handle,
                len,
                encoding,
            } => {
                let result = self
                    .alloc
                    .with_object(handle, usize::from(len), |bytes| {
                        decompress_page(encoding, bytes, out)
                    })
                    .unwrap_or(Err(crate::codec::CodecError::Corrupt));
                if let Err(source) = result {
                    tracing::error!(page = index, %source, ?encoding, len, "stored page failed to decompress");
                    return Err(StoreError::Corrupt {
                        page: index,
                        source,
                    });
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
            let old = {
                let mut entry = self.table.lock(index as usize);
                if entry.state() == PageState::Empty {
                    continue;
                }
                let old = entry.replace(PageState::Empty);
                self.counters.transition(old, PageState::Empty);
                old
            };
            add(&self.counters.discarded_pages, 1);
            if let PageState::Stored { handle, .. } = old {
                self.alloc.free(handle);
            }
        }
        Ok(())
    }

    /// Compress whatever is pending now (shutdown, tests, bench).
    pub fn flush_pending(&self) -> Result<(), StoreError> {
        if self.config.batched {
            self.flush_open_batch();
        }
        Ok(())
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
        self.flush_open_batch();
        self.alloc.reserve.stop();
    }

    pub fn stats(&self) -> StoreStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let pending = get(&c.pending_pages);
        StoreStats {
            disk_size: self.config.size_bytes,
            orig_bytes: get(&c.pages_held) * PAGE_SIZE as u64,
            compr_bytes: get(&c.compr_bytes),
            mem_used: self.alloc.chunk_bytes() + pending * PAGE_SIZE as u64,
            metadata_bytes: self.table.bytes() + self.alloc.metadata_bytes(),
            batch_buffer_bytes: self
                .batches
                .iter()
                .map(|b| {
                    (b.slots.len() * std::mem::size_of::<parking_lot::RwLock<PendingSlot>>()) as u64
                })
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
            reserve_bytes: self.alloc.reserve.held_bytes(),
            reserve_misses: self.alloc.reserve.misses(),
        }
    }

    pub fn size_bytes(&self) -> u64 {
        self.config.size_bytes
    }

    /// Test hook: overwrite a stored page's compressed bytes with `byte`.
    #[cfg(test)]
    fn corrupt_stored_page(&self, index: u64, byte: u8) -> bool {
        let entry = self.table.lock(index as usize);
        if let PageState::Stored { handle, .. } = entry.state() {
            self.alloc.with_object_mut(handle, |b| b.fill(byte));
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests;
