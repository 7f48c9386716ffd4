//! What the store is told: size, algorithm, batching, limits.

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::codec::{Algorithm, Backend, BackendThresholds, BatchCodec, Compressor};

/// Everything the store needs to know. The product's defaults are `config::StoreSettings`'s:
/// the store has none of its own.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Device size in bytes (a multiple of `PAGE_SIZE`).
    pub size_bytes: u64,
    pub algorithm: Algorithm,
    /// `false` (`--no-batched`): every write is compressed in the writer's thread.
    pub batched: bool,
    /// Pages in the pending batch that trigger a flush (`--batch-threshold`).
    pub batch_threshold: usize,
    /// Age of the oldest pending page that triggers a flush (`--flush-timeout-ms`).
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
    /// Recompress idle pages in the background with a stronger codec (`--recompress`); `None`:
    /// pages stay as the flusher stored them.
    pub recompress: Option<RecompressConfig>,
    /// How to ask the kernel's OOM killer to act when writes starve and pages do not
    /// compress (see `store::oom`). Only the daemon gives one; `None` never asks.
    pub oom_killer: Option<super::OomKiller>,
}

/// Background recompression of idle pages (see `store::recompress`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecompressConfig {
    /// The stronger codec (zstd at some level).
    pub algorithm: Algorithm,
    /// How long a page must go unread and unwritten before it is recompressed.
    pub idle: Duration,
    /// A result is kept only if it is smaller than the stored object by at least
    /// 1/`min_saving_divisor` of it.
    pub min_saving_divisor: usize,
    /// Share of one core the recompressor may use, in percent (1 to 100); it runs at the
    /// lowest priority besides.
    pub cpu_percent: u32,
}

impl StoreConfig {
    /// The compressor for this configuration, with `gpu` as its GPU codec if any.
    pub(super) fn compressor(&self, gpu: Option<std::sync::Arc<dyn BatchCodec>>) -> Compressor {
        Compressor::new(self.algorithm, gpu, self.forced_backend, self.thresholds)
    }

    /// The compressor of new pages while memory is short (see `short_memory_algorithm`).
    pub(super) fn short_memory_compressor(&self) -> Option<Compressor> {
        short_memory_algorithm(self.algorithm, self.recompress)
            .map(|algorithm| Compressor::new(algorithm, None, None, self.thresholds))
    }
}

/// The codec new pages of a store of `algorithm` get while memory is short (see
/// `BatchedPageStore::set_memory_short`): the recompressor's stronger one, for an LZ4 store;
/// `None` (always `algorithm`) for a store without recompression or whose pages are already
/// zstd or adaptive (whose zstd level differs: one thread keeps a context for one level).
pub fn short_memory_algorithm(
    algorithm: Algorithm,
    recompress: Option<RecompressConfig>,
) -> Option<Algorithm> {
    recompress
        .map(|config| config.algorithm)
        .filter(|_| algorithm == Algorithm::Lz4)
}

/// The algorithm whose codec contexts a thread that compresses a store's new pages needs
/// (`codec::prepare_thread`): the short-memory one when there is one (its zstd contexts also
/// serve the LZ4 pages, which need none), else `algorithm`.
pub fn thread_algorithm(algorithm: Algorithm, recompress: Option<RecompressConfig>) -> Algorithm {
    short_memory_algorithm(algorithm, recompress).unwrap_or(algorithm)
}
