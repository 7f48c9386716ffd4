//! The store's counters: live atomics, and the snapshot `stat` and `bench` read.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::table::PageState;
use crate::codec::{Backend, Encoding};

/// A point-in-time copy of the store's counters (zram's mm_stat and more). Gauges describe the
/// pages held now; counters (`pages_simd` .. `starved_writes`) count since the store started.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StoreStats {
    pub disk_size: u64,
    /// The version of the store's memory layout (`store::layout`); 0 from a daemon that
    /// predates this field.
    #[serde(default)]
    pub layout_version: u64,
    /// How stored pages are checksummed (`crc32c`, `xxh64` or `xxh3`, by the layout version); empty
    /// from a daemon that predates this field.
    #[serde(default)]
    pub checksum: String,
    /// Bytes of pages written and held (same-filled pages included), like zram's orig_data_size.
    pub orig_bytes: u64,
    /// Bytes of compressed data held, like zram's compr_data_size (raw pages count 4 KiB).
    pub compr_bytes: u64,
    /// Bytes of memory holding page data (allocator chunks, pending pages), like mem_used_total.
    pub mem_used: u64,
    /// Bytes of metadata (page table and allocator bookkeeping).
    pub metadata_bytes: u64,
    /// Of `metadata_bytes`, the page table's committed part: 28 KiB for each 8 MiB of device
    /// that holds a page or was written lately.
    #[serde(default)]
    pub table_bytes: u64,
    /// Bytes of the pending batches' memory now (their slots with memory and the slot
    /// indexes; not in `mem_used`).
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
    /// OOM kills the store asked the kernel for while writes starved and pages did not
    /// compress (see `store::oom`).
    #[serde(default)]
    pub oom_kills_asked: u64,
    /// Writes stored after waiting over a second for memory (deferred by their queue; see
    /// `admission`'s patience), and the longest such wait of any stored write, in ms.
    #[serde(default)]
    pub long_waited_writes: u64,
    #[serde(default)]
    pub longest_write_wait_ms: u64,
    /// Groups of the page table (8 MiB of device each) a write reached with no memory that
    /// took a spare slot at once, and that a write waited for the refill thread to commit (no
    /// spare was ready; see `table_memory`).
    #[serde(default)]
    pub table_spares_taken: u64,
    #[serde(default)]
    pub table_group_waits: u64,
    /// Times the pending batches grew to every slot (writes came) and shrank to their quiet
    /// slots (none came for a while), giving those slots' memory back (see `BatchSpan`).
    #[serde(default)]
    pub batch_span_grows: u64,
    #[serde(default)]
    pub batch_span_shrinks: u64,
    /// Bytes of chunk memory held ready in the reserve (not in `mem_used`).
    #[serde(default)]
    pub reserve_bytes: u64,
    /// Takes of a chunk that found the reserve's pool of that size empty and waited for the
    /// refill thread (the I/O path commits no memory itself while one runs).
    #[serde(default)]
    pub reserve_misses: u64,
    /// Bytes of ready chunks the reserve gave back, while memory was short, to refill a pool a
    /// taker waited on or for bookkeeping faulted in (the page table, the allocator's lists; see
    /// `reserve::ChunkReserve::steal_for`, `make_room_for`).
    #[serde(default)]
    pub reserve_stolen_bytes: u64,
    /// Chunks a write whose size had run dry cut from a larger ready chunk.
    #[serde(default)]
    pub reserve_split_chunks: u64,
    /// Chunks a write whose size had run dry joined from adjacent smaller ready chunks.
    #[serde(default)]
    pub reserve_joined_chunks: u64,
    /// Bytes of freed chunks given back to the system by a thread other than the refill
    /// thread, which otherwise does it: because it was stuck in a commit, or behind (a full
    /// surplus list; see `reserve::ChunkReserve::give_back`).
    #[serde(default)]
    pub reserve_given_back_past_refill_bytes: u64,
    /// Times a thread waiting for the refill thread woke it from the kernel's reclaim throttle
    /// once free memory was back (see `reserve::ChunkReserve::rouse_stuck_refill`).
    #[serde(default)]
    pub reserve_refill_rousings: u64,
    /// Pages a resumed store could not find whole: reads of them fail with EIO until they
    /// are written or discarded.
    #[serde(default)]
    pub lost_pages: u64,
    /// Stored pages whose data did not match their checksum when read (or when the
    /// recompressor read them): each such read failed with EIO.
    #[serde(default)]
    pub checksum_failures: u64,
    /// Pages the GPU compressed into something that did not decode back to them (stored raw).
    #[serde(default)]
    pub gpu_mismatched_pages: u64,
    /// Pages the recompressor (see `store::recompress`) stored again with its stronger codec.
    #[serde(default)]
    pub recompressed_pages: u64,
    /// Compressed bytes those recompressions saved when they were made.
    #[serde(default)]
    pub recompress_saved_bytes: u64,
    /// Idle pages the recompressor tried and kept as they were: the stronger codec did not save
    /// enough. Not tried again until written.
    #[serde(default)]
    pub recompress_rejected_pages: u64,
    /// Recompressions dropped because the page was read, written or discarded meanwhile.
    #[serde(default)]
    pub recompress_dropped_pages: u64,
    /// CPU time the recompressor's thread has used (ns).
    #[serde(default)]
    pub recompress_cpu_ns: u64,
    /// Stored pages its last pass left to do: not idle long enough yet, or dropped.
    #[serde(default)]
    pub recompress_backlog: u64,
    /// Passes over the page table it has made.
    #[serde(default)]
    pub recompress_passes: u64,
    /// Objects the same thread moved out of sparse chunks so that those could be freed
    /// (compaction, see `store::alloc`).
    #[serde(default)]
    pub compacted_pages: u64,
    /// Compactions asked for and finished (`trueno-ublk compact`, see `store::recompress`).
    #[serde(default)]
    pub compactions: u64,
    /// The system is short of memory now (see `BatchedPageStore::set_memory_short`): the store
    /// keeps what memory it has, and an LZ4 store with recompression gives new pages the
    /// stronger codec.
    #[serde(default)]
    pub memory_short: bool,
    /// Pages compressed with the stronger codec when written, because memory was short.
    #[serde(default)]
    pub short_memory_pages: u64,
}

/// Live counters behind `StoreStats`.
#[derive(Default)]
pub(super) struct Counters {
    pub(super) pages_held: AtomicU64,
    pub(super) compr_bytes: AtomicU64,
    pub(super) pages_stored: AtomicU64,
    pub(super) zero_pages: AtomicU64,
    pub(super) same_pages: AtomicU64,
    pub(super) huge_pages: AtomicU64,
    pub(super) pending_pages: AtomicU64,
    pub(super) pages_lz4: AtomicU64,
    pub(super) pages_zstd: AtomicU64,
    pub(super) pages_simd: AtomicU64,
    pub(super) pages_simd_parallel: AtomicU64,
    pub(super) pages_gpu: AtomicU64,
    pub(super) gpu_fallback_batches: AtomicU64,
    pub(super) batch_flushes: AtomicU64,
    pub(super) failed_reads: AtomicU64,
    pub(super) failed_writes: AtomicU64,
    pub(super) discarded_pages: AtomicU64,
    pub(super) mem_limit_hits: AtomicU64,
    pub(super) starved_writes: AtomicU64,
    pub(super) oom_kills_asked: AtomicU64,
    pub(super) long_waited_writes: AtomicU64,
    pub(super) longest_write_wait_ms: AtomicU64,
    pub(super) table_spares_taken: AtomicU64,
    pub(super) batch_span_grows: AtomicU64,
    pub(super) batch_span_shrinks: AtomicU64,
    pub(super) table_group_waits: AtomicU64,
    pub(super) lost_pages: AtomicU64,
    pub(super) checksum_failures: AtomicU64,
    pub(super) gpu_mismatched_pages: AtomicU64,
    pub(super) recompressed_pages: AtomicU64,
    pub(super) recompress_saved_bytes: AtomicU64,
    pub(super) recompress_rejected_pages: AtomicU64,
    pub(super) recompress_dropped_pages: AtomicU64,
    pub(super) recompress_cpu_ns: AtomicU64,
    pub(super) recompress_backlog: AtomicU64,
    pub(super) recompress_passes: AtomicU64,
    pub(super) compacted_pages: AtomicU64,
    pub(super) compactions: AtomicU64,
    pub(super) short_memory_pages: AtomicU64,
}

pub(super) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(super) fn sub(c: &AtomicU64, n: u64) {
    c.fetch_sub(n, Ordering::Relaxed);
}

impl Counters {
    /// Move the gauges from page state `old` to `new`.
    pub(super) fn transition(&self, old: PageState, new: PageState) {
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
            PageState::Lost => op(&self.lost_pages, 1),
            PageState::Empty | PageState::Pending { .. } => {}
        }
    }

    pub(super) fn backend(&self, backend: Backend) -> &AtomicU64 {
        match backend {
            Backend::Simd => &self.pages_simd,
            Backend::SimdParallel => &self.pages_simd_parallel,
            Backend::Gpu => &self.pages_gpu,
        }
    }
}
