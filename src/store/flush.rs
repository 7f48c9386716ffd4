//! A flush: seal the open batch, compress it in parts, install each page unless a newer write
//! or a discard got there first.

#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;

use parking_lot::RwLockReadGuard;
use rayon::prelude::*;

use super::counters::{add, sub};
use super::pending::PendingSlot;
use super::table::PageState;
use super::{BatchedPageStore, PENDING_BATCHES};
use crate::codec::{Backend, CompressedBatch, Encoding, Page, MAX_COMPRESSED_LEN, PAGE_SIZE};

/// Without a GPU a batch is compressed and installed this many pages at a time, so that the
/// compression buffer (locked memory, like everything the daemon has) holds 1 MiB rather than
/// a whole batch; rayon still spreads each part over every core. A GPU takes whole batches.
pub(super) const FLUSH_PART_PAGES: usize = 256;

impl BatchedPageStore {
    /// Seal the open batch (if it holds anything), open the other one, and compress and
    /// install the sealed one. One flush at a time.
    pub(super) fn flush_open_batch(&self) {
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
            let done = self.compressor.compress(&pages, &mut out);
            if done.fell_back {
                add(&self.counters.gpu_fallback_batches, 1);
            }
            let backend = done.backend;
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
            let mut entry = self.table.lock(index);
            let expected = PageState::pending(batch, slot);
            if entry.state() == expected {
                let new = PageState::Stored {
                    handle,
                    len: crate::codec::page_len(bytes.len()),
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
}
