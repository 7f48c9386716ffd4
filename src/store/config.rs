//! What the store is told: size, algorithm, batching, limits.

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::codec::{Algorithm, Backend, BackendThresholds, BatchCodec, Compressor, ThreadCodecs};

use super::StoreThread;

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

/// Whether a store of `algorithm` recompresses zstd pages: only a zstd store's are not
/// already as small as recompression would make them (an LZ4 or adaptive store's zstd pages
/// got zstd when memory was short, or by adaptive's choice).
pub fn recompresses_zstd_pages(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::Zstd { .. })
}

/// The codec contexts the store's thread `role` keeps (see `codec::prepare_thread`): the
/// flusher compresses new pages and reads none; the recompressor compresses with the
/// recompression codec and decompresses only the zstd pages it recompresses (its compactions
/// move compressed bytes); the refill thread compresses nothing.
pub fn store_thread_codecs(
    role: StoreThread,
    algorithm: Algorithm,
    recompress: Option<RecompressConfig>,
) -> ThreadCodecs {
    match (role, recompress) {
        (StoreThread::Flusher, _) => {
            ThreadCodecs::compressing(thread_algorithm(algorithm, recompress))
        }
        (StoreThread::Recompress, Some(config)) => ThreadCodecs {
            compresses: config.algorithm,
            decompresses_zstd: recompresses_zstd_pages(algorithm),
        },
        (StoreThread::Recompress, None) | (StoreThread::Refill, _) => ThreadCodecs::none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recompress(level: i32) -> Option<RecompressConfig> {
        Some(RecompressConfig {
            algorithm: Algorithm::Zstd { level },
            idle: Duration::from_secs(30),
            min_saving_divisor: 8,
            cpu_percent: 50,
        })
    }

    #[test]
    fn only_threads_that_read_or_recompress_zstd_pages_keep_a_zstd_decompressor() {
        let zstd = |level| Algorithm::Zstd { level };
        // The default: LZ4, zstd:3 for idle pages and while memory is short.
        let lz4 = |role| store_thread_codecs(role, Algorithm::Lz4, recompress(3));
        assert_eq!(
            lz4(StoreThread::Flusher),
            ThreadCodecs::compressing(zstd(3))
        );
        // An LZ4 store's zstd pages are settled: the recompressor never decodes one.
        assert_eq!(
            lz4(StoreThread::Recompress),
            ThreadCodecs::compressing(zstd(3))
        );
        assert_eq!(lz4(StoreThread::Refill), ThreadCodecs::none());
        assert_eq!(
            store_thread_codecs(StoreThread::Flusher, Algorithm::Lz4, None),
            ThreadCodecs::none()
        );
        // A zstd store recompressing at a higher level decodes its zstd pages.
        assert_eq!(
            store_thread_codecs(StoreThread::Recompress, zstd(1), recompress(9)),
            ThreadCodecs::reading(zstd(9))
        );
        assert_eq!(
            store_thread_codecs(StoreThread::Flusher, zstd(1), recompress(9)),
            ThreadCodecs::compressing(zstd(1))
        );
        // Without recompression the recompressor's thread (and a compaction) needs none.
        assert_eq!(
            store_thread_codecs(StoreThread::Recompress, zstd(1), None),
            ThreadCodecs::none()
        );
    }
}
