//! A flush: seal the open batch, compress it in parts, install each page unless a newer write
//! or a discard got there first.

#![forbid(unsafe_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::counters::{add, sub};
use super::pending::PendingSlot;
use super::table::PageState;
use super::{BatchedPageStore, PENDING_BATCHES};
use crate::codec::{
    compress_page, decompress_page, Algorithm, Backend, CompressedBatch, Encoding, Page,
    MAX_COMPRESSED_LEN, PAGE_SIZE,
};

/// Without a GPU a batch is flushed this many pages at a time: what a panic while compressing
/// leaves to store raw. A GPU takes whole batches.
const FLUSH_PART_PAGES: usize = 256;

/// Pages a flush compresses at a time, for batches of `slots` pages.
pub(super) fn flush_part_pages(slots: usize, gpu: bool) -> usize {
    if gpu {
        slots.max(1)
    } else {
        slots.clamp(1, FLUSH_PART_PAGES)
    }
}

/// Pages the flush's output buffer holds, for batches of `slots` pages: a part, for a GPU
/// codec's output; none without one, where each page is compressed into its thread's stack and
/// stored from there (see `flush_part_on_cpu`), so the daemon locks no buffer for it.
pub(super) fn flush_buffer_pages(slots: usize, gpu: bool) -> usize {
    if gpu {
        flush_part_pages(slots, gpu)
    } else {
        0
    }
}

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
        self.take_span_offer();
        self.batches[next].open(self.span.slots());
        self.current.store(next, Ordering::Release);
        // A free batch again: writers may wait for slots instead of failing.
        self.fail_fast_until.store(0, Ordering::Release);
        {
            let _ctl = self.control.lock();
            self.writers_wake.notify_all();
        }
        let n = self.batches[b].seal();
        if self.span.note_sealed(n) {
            self.alloc.reserve.wake_refill();
        }
        let slots: Vec<PendingSlot<'_>> = (0..n).map(|i| self.batches[b].slot(i)).collect();
        add(&self.counters.batch_flushes, 1);
        for (part_index, part) in slots.chunks(self.flush_part_pages).enumerate() {
            let first = part_index * self.flush_part_pages;
            // Which slots are resolved, so that after a panic the rest still are: the batch
            // is reopened by a later flush, and an entry left pointing into it would then
            // read another page's data.
            let resolved: Vec<AtomicBool> = part.iter().map(|_| AtomicBool::new(false)).collect();
            let flushed = catch_unwind(AssertUnwindSafe(|| {
                self.flush_part(b, first, part, &mut out, &resolved);
            }));
            if flushed.is_err() {
                tracing::error!(
                    pages = resolved
                        .iter()
                        .filter(|r| !r.load(Ordering::Acquire))
                        .count(),
                    "flushing a batch panicked; storing its pages not yet stored uncompressed"
                );
                for (i, s) in part.iter().enumerate() {
                    if resolved[i].load(Ordering::Acquire) {
                        continue;
                    }
                    let installed = catch_unwind(AssertUnwindSafe(|| {
                        self.install(b, first + i, s, Encoding::Raw, &s.page[..]);
                    }));
                    if installed.is_err() {
                        self.lose_pending(b, first + i, s);
                    }
                }
            }
        }
    }

    /// Compress `part` (slots `first..` of sealed batch `b`) and install each page, marking
    /// it in `resolved`.
    fn flush_part(
        &self,
        b: usize,
        first: usize,
        part: &[PendingSlot<'_>],
        out: &mut CompressedBatch,
        resolved: &[AtomicBool],
    ) {
        let (compressor, short) = self.compressor_now();
        if let Some(cpu) = compressor.cpu_backend_for(part.len()) {
            self.flush_part_on_cpu(compressor.algorithm(), cpu, short, b, first, part, resolved);
            return;
        }
        let pages: Vec<&Page> = part.iter().map(|s| &*s.page).collect();
        let done = compressor.compress(&pages, out);
        if done.fell_back {
            add(&self.counters.gpu_fallback_batches, 1);
        }
        // The whole part was compressed, superseded pages too (they are found after).
        self.count_compressed(done.backend, short, part.len() as u64);
        let out = &*out;
        // Counted before installing, which is what may starve (see `oom`).
        let raw = (0..part.len())
            .filter(|&i| match out.page(i) {
                (Encoding::Raw, _) => true,
                (_, bytes) => bytes.len() > MAX_COMPRESSED_LEN,
            })
            .count();
        self.note_compressed(part.len() as u64, raw as u64);
        let from_gpu = done.backend == Backend::Gpu;
        let mismatched = AtomicUsize::new(0);
        let install = |(i, s): (usize, &PendingSlot<'_>)| {
            if self.superseded(b, first + i, s) {
                self.slot_done();
                resolved[i].store(true, Ordering::Release);
                return;
            }
            // Filled only for a page the GPU got wrong: no 4 KiB cleared per page otherwise.
            let mut again;
            let (encoding, bytes) = match out.page(i) {
                // The huge-page rule holds whichever backend compressed (the GPU codec may
                // not apply it): such a page costs less, and reads faster, as itself.
                (Encoding::Lz4 | Encoding::Zstd, bytes) if bytes.len() > MAX_COMPRESSED_LEN => {
                    (Encoding::Raw, &s.page[..])
                }
                // The GPU's output is decoded on the CPU and compared before it is stored: a
                // page it got wrong is compressed again on the CPU, never stored as what it
                // would decode to (nor raw: a GPU that keeps getting pages wrong would leave
                // them all uncompressed, counted as compressed by `note_compressed`).
                (encoding, bytes) if from_gpu && !decodes_to(encoding, bytes, &s.page) => {
                    tracing::error!(
                        page = s.index,
                        "the GPU's compressed page does not decode to the page: compressed again on the CPU"
                    );
                    add(&self.counters.gpu_mismatched_pages, 1);
                    mismatched.fetch_add(1, Ordering::Relaxed);
                    again = [0u8; PAGE_SIZE];
                    let (encoding, len) =
                        compress_page(compressor.algorithm(), &s.page, &mut again);
                    (encoding, &again[..len])
                }
                page => page,
            };
            self.install(b, first + i, s, encoding, bytes);
            resolved[i].store(true, Ordering::Release);
        };
        // Installing is an allocation and a copy per page: spread it like the compression.
        if done.backend == Backend::Simd {
            part.iter().enumerate().for_each(install);
        } else {
            part.par_iter().enumerate().for_each(install);
        }
        if mismatched.into_inner() > 0 {
            compressor.gpu_output_rejected(part.len());
        }
    }

    /// `flush_part` on the CPU (`backend`: one core or all of them): each page compressed into
    /// its thread's stack and installed from there at once, so a part is one pass over its
    /// pages, not a compression pass and then an installing one, and the compressed bytes are
    /// still in the core's cache when they are copied into the store. `short`: `algorithm` is
    /// the short-memory one (for `count_compressed`).
    #[allow(
        clippy::too_many_arguments,
        reason = "the part, where it lies, and how to compress it"
    )]
    fn flush_part_on_cpu(
        &self,
        algorithm: Algorithm,
        backend: Backend,
        short: bool,
        b: usize,
        first: usize,
        part: &[PendingSlot<'_>],
        resolved: &[AtomicBool],
    ) {
        let flush_one = |(i, s): (usize, &PendingSlot<'_>)| {
            if self.superseded(b, first + i, s) {
                self.slot_done();
                resolved[i].store(true, Ordering::Release);
                return;
            }
            // Counted before the page is stored: once it is, `pending_pages` says so, and a
            // look at the figures then must find it counted.
            self.count_compressed(backend, short, 1);
            let mut compressed = [0u8; PAGE_SIZE];
            let (encoding, len) = compress_page(algorithm, &s.page, &mut compressed);
            // Noted before the page is stored, which is what may starve (see `oom`).
            self.note_compressed(1, u64::from(encoding == Encoding::Raw));
            let bytes = match encoding {
                Encoding::Raw => &s.page[..],
                _ => &compressed[..len],
            };
            self.install(b, first + i, s, encoding, bytes);
            resolved[i].store(true, Ordering::Release);
        };
        if backend == Backend::Simd {
            part.iter().enumerate().for_each(flush_one);
        } else {
            for_each_beside_pool(part, flush_one);
        }
    }

    /// Store slot `slot` of batch `batch` as `bytes` encoded as `encoding`, and point its
    /// page's entry at it (with the page's checksum), if the entry still points at the slot; a
    /// newer write or a discard wins otherwise.
    fn install(
        &self,
        batch: usize,
        slot: usize,
        pending: &PendingSlot<'_>,
        encoding: Encoding,
        bytes: &[u8],
    ) {
        #[cfg(test)]
        if self
            .install_panics
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            panic!("install bug (test)");
        }
        let index = pending.index;
        let page_checksum = self.checksum.of(&pending.page);
        let handle = self.alloc.store(bytes);
        let len = crate::codec::page_len(bytes.len());
        let installed = {
            // A pending entry's group is committed: it holds a page, so it is not given back.
            let mut entry = self.table.lock(index);
            let expected = PageState::pending(batch, slot);
            if let Some(entry) = entry.as_mut().filter(|e| e.state() == expected) {
                let new = match handle {
                    Some(handle) => PageState::Stored {
                        handle,
                        len,
                        encoding,
                    },
                    // The system refused memory for long (see `ZsAllocator::store`); the
                    // batch is reopened after this, so the entry must not keep pointing at
                    // the slot.
                    None => {
                        tracing::error!(page = index, "no memory to store a pending page: lost");
                        PageState::Lost
                    }
                };
                // Before the entry names the object: see `table`.
                entry.set_checksum(page_checksum);
                entry.replace(new);
                self.counters.transition(expected, new);
                true
            } else {
                false
            }
        };
        if let (false, Some(handle)) = (installed, handle) {
            self.alloc.free(handle, usize::from(len));
        }
        self.slot_done();
    }

    /// Whether slot `slot` of batch `batch` (sealed, being flushed) holds a page nobody reads
    /// any more: its entry, seen without its lock, names something else (a newer write, a
    /// discard, a freed slot). Final: no entry comes to name a sealed batch's slot again until
    /// the batch reopens after its flush. Then the flush takes no memory for it (and on the CPU
    /// does not compress it), which near OOM is most of a killed program's pages. An entry locked
    /// right now is flushed (`install` settles it under the lock).
    fn superseded(&self, batch: usize, slot: usize, pending: &PendingSlot<'_>) -> bool {
        let index = usize::try_from(pending.index).unwrap_or(usize::MAX);
        match self.table.peek(index) {
            Some((state, _)) => state != PageState::pending(batch, slot),
            // Locked, or in a group being given back (flushed: `install` settles it under the
            // lock, which waits for the group to be kept or gone), or in a group given back: a
            // pending entry holds a page, so its group was emptied first. Not "any group not
            // committed": `retire` marks a group retiring after a look without locks, and a
            // write may land in between; it keeps the group once it finds the page.
            None => index < self.table.len() && self.table.is_absent(index),
        }
    }

    /// A slot of a batch being flushed is settled: its page stored, superseded or lost.
    fn slot_done(&self) {
        sub(&self.counters.pending_pages, 1);
        sub(&self.reserved_bytes, PAGE_SIZE as u64);
    }
}

impl BatchedPageStore {
    /// A pending page that could not be stored even raw (installing it panicked twice): its
    /// entry, if it still points at the slot, becomes `Lost` (its reads fail with EIO), as
    /// the batch is reopened after this flush and an entry left pointing into it would read
    /// whatever page fills the slot next, without an error.
    fn lose_pending(&self, batch: usize, slot: usize, pending: &PendingSlot<'_>) {
        let index = pending.index;
        tracing::error!(page = index, "storing a pending page panicked twice: lost");
        let expected = PageState::pending(batch, slot);
        if let Some(mut entry) = self.table.lock(index).filter(|e| e.state() == expected) {
            entry.replace(PageState::Lost);
            self.counters.transition(expected, PageState::Lost);
        }
        self.slot_done();
    }
}

/// How long the calling thread of `for_each_beside_pool`, its own items done, spins for the
/// pool's threads to finish theirs before it sleeps: a few pages' compressing and storing.
const POOL_SPIN: Duration = Duration::from_micros(50);

/// Run `work` on every item of `items`, on the calling thread and on every thread of the pool,
/// each taking the next item from one counter.
///
/// Why not `par_iter`: its caller, outside the pool, sleeps until the pool's threads are done,
/// and the cores idle until it wakes and starts the next batch (on the development machine's
/// 2 vCPUs 100–300 µs a batch, of the 1.8 ms a batch of 256 pages took: a vCPU with nothing
/// to run halts, and waking it takes the hypervisor). Here the caller works until no item is
/// left and spins for the pool's last ones, so it goes straight on to the next batch. Why one
/// thread more than the pool's: the writers filling the next batch preempt a pool thread in
/// the middle of its page, and the others take the items meanwhile (with the pool's threads
/// but one, the caller then slept on that page, and nothing was gained).
/// Measured: docs/measurements.md, "The flush beside the pool".
fn for_each_beside_pool<T: Sync>(items: &[T], work: impl Fn((usize, &T)) + Sync) {
    /// Counts a helper out however it ends (a panic in `work` included).
    struct Finished<'a>(&'a AtomicUsize);
    impl Drop for Finished<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Release);
        }
    }
    let helpers = rayon::current_num_threads().min(items.len().saturating_sub(1));
    let next = AtomicUsize::new(0);
    let unfinished = AtomicUsize::new(helpers);
    let run = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(item) = items.get(i) else {
            break;
        };
        work((i, item));
    };
    rayon::in_place_scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| {
                let _finished = Finished(&unfinished);
                run();
            });
        }
        run();
        // The scope's end waits for the helpers too, but asleep.
        let spin_until = Instant::now() + POOL_SPIN;
        while unfinished.load(Ordering::Acquire) > 0 && Instant::now() < spin_until {
            std::hint::spin_loop();
        }
    });
}

/// Whether `bytes`, encoded as `encoding`, decode to exactly `page`.
fn decodes_to(encoding: Encoding, bytes: &[u8], page: &Page) -> bool {
    let mut decoded = [0u8; PAGE_SIZE];
    decompress_page(encoding, bytes, &mut decoded).is_ok() && decoded == *page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_is_worked_on_once_beside_the_pool_even_when_one_panics() {
        let items: Vec<usize> = (0..1000).collect();
        let seen: Vec<AtomicUsize> = items.iter().map(|_| AtomicUsize::new(0)).collect();
        for_each_beside_pool(&items, |(i, &item)| {
            assert_eq!(i, item);
            seen[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));

        // A panic ends only the item it came from: the others are still worked on, and the
        // caller gets the panic once every thread is done.
        let seen: Vec<AtomicUsize> = items.iter().map(|_| AtomicUsize::new(0)).collect();
        let worked = catch_unwind(AssertUnwindSafe(|| {
            for_each_beside_pool(&items, |(i, _)| {
                assert_ne!(i, 500, "item 500 (test)");
                seen[i].fetch_add(1, Ordering::Relaxed);
            });
        }));
        assert!(worked.is_err());
        let worked_on = |s: &AtomicUsize| s.load(Ordering::Relaxed);
        assert_eq!(worked_on(&seen[500]), 0);
        assert!(seen
            .iter()
            .enumerate()
            .all(|(i, s)| i == 500 || worked_on(s) == 1));
    }
}
