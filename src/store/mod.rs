//! The page store: page table (index → entry), compressed-page memory, the pending batch,
//! the flusher, stats, memory limit and discard. Knows nothing of the kernel or io_uring.
//!
//! SKELETON: the public API below is the contract the daemon and `bench` build against.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::codec::{Algorithm, Backend, BatchCodec, PAGE_SIZE};

/// Batch sizes at which the store switches backend (see `codec::select_backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendThresholds {
    /// Batches of at least this many pages use all cores.
    pub parallel_min_pages: usize,
    /// Batches of at least this many pages use the GPU when one is present.
    pub gpu_min_pages: usize,
}

impl Default for BackendThresholds {
    fn default() -> Self {
        Self {
            parallel_min_pages: 100,
            gpu_min_pages: 1000,
        }
    }
}

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
    #[error("memory limit of {limit} bytes reached")]
    NoSpace { limit: u64 },
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
        }
    }
}

/// A point-in-time copy of the store's counters (zram's mm_stat and more).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StoreStats {
    pub disk_size: u64,
    /// Bytes of pages written and held (same-filled pages included), like zram's orig_data_size.
    pub orig_bytes: u64,
    /// Bytes of compressed data held, like zram's compr_data_size.
    pub compr_bytes: u64,
    /// Bytes of memory holding page data (allocator chunks, pending batch), like mem_used_total.
    pub mem_used: u64,
    /// Bytes of metadata (page table and allocator bookkeeping).
    pub metadata_bytes: u64,
    pub mem_limit: u64,
    pub pages_stored: u64,
    pub zero_pages: u64,
    pub same_pages: u64,
    pub huge_pages: u64,
    pub pending_pages: u64,
    pub pages_simd: u64,
    pub pages_simd_parallel: u64,
    pub pages_gpu: u64,
    pub pages_lz4: u64,
    pub pages_zstd: u64,
    pub batch_flushes: u64,
    pub failed_reads: u64,
    pub failed_writes: u64,
    pub discarded_pages: u64,
    pub mem_limit_hits: u64,
}

/// The page store.
pub struct BatchedPageStore {
    _config: StoreConfig,
    _gpu: Option<Arc<dyn BatchCodec>>,
}

/// Joins the flusher thread when dropped after `BatchedPageStore::shutdown`.
pub struct FlusherHandle {
    _thread: Option<std::thread::JoinHandle<()>>,
}

impl BatchedPageStore {
    /// Build a store; allocates the page table and the pending batches up front.
    pub fn new(
        config: StoreConfig,
        gpu: Option<Arc<dyn BatchCodec>>,
    ) -> Result<Arc<Self>, StoreError> {
        let _ = PAGE_SIZE;
        Ok(Arc::new(Self {
            _config: config,
            _gpu: gpu,
        }))
    }
    /// Start the flusher thread; `thread_init` runs first on it (the daemon sets PR_SET_IO_FLUSHER).
    pub fn start_flusher(
        self: &Arc<Self>,
        _thread_init: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<FlusherHandle> {
        todo!()
    }
    /// Write whole pages at byte `offset`.
    pub fn write(&self, _offset: u64, _data: &[u8]) -> Result<(), StoreError> {
        todo!()
    }
    /// Read whole pages at byte `offset` (never-written pages read as zeros).
    pub fn read(&self, _offset: u64, _buf: &mut [u8]) -> Result<(), StoreError> {
        todo!()
    }
    /// DISCARD and WRITE_ZEROES: the range reads as zeros and its memory is freed.
    pub fn discard(&self, _offset: u64, _len: u64) -> Result<(), StoreError> {
        todo!()
    }
    /// Compress whatever is pending now (shutdown, tests, bench).
    pub fn flush_pending(&self) -> Result<(), StoreError> {
        todo!()
    }
    /// Stop the flusher (after flushing what is pending).
    pub fn shutdown(&self) {
        todo!()
    }
    pub fn stats(&self) -> StoreStats {
        todo!()
    }
    pub fn size_bytes(&self) -> u64 {
        self._config.size_bytes
    }
}
