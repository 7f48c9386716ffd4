//! Background recompression: hot pages fast, cold pages small. New pages are compressed with
//! the store's algorithm (LZ4 by default: the write and read paths at LZ4's speed); a thread
//! of low priority recompresses pages that nobody has read or written for a while with a
//! stronger codec (`RecompressConfig`), and keeps the result only when it saves enough.
//!
//! It never blocks I/O for longer than a read of the same page would: under the entry's lock it
//! only copies the compressed bytes and claims the page in its hint (see `table::Hint`), and
//! later installs its result. Decompressing, compressing and storing the new object happen
//! outside every lock. The result is installed only if the entry and its hint are exactly
//! what it claimed: a page written (the write clears the claim) or read (its access time
//! moves) meanwhile wins, and the result is dropped, as a flush drops a page rewritten while
//! its batch was compressed.
//!
//! Crash consistency, as everywhere in the store (see `layout`): the new object is copied in
//! first, then the entry flips to it in one atomic store, then the old object is freed. A
//! process that dies in between leaves an object no entry names, which `resume` gives back.
//!
//! A page it has dealt with (recompressed, or found not worth it) is marked settled in its
//! hint and not tried again until it is written: incompressible pages cost one try per write.
//!
//! The same thread compacts: each pass starts by asking the allocator to mark the sparsest
//! chunks of fragmented classes as evacuating (`ZsAllocator::plan_evacuation`), and moves the
//! object of every page still in one to another chunk, by the same claim, copy, flip and free
//! (recompressing frees a chunk of old objects only if every one of them goes).

#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::alloc::Handle;
use super::config::{recompresses_zstd_pages, store_thread_codecs, RecompressConfig};
use super::counters::add;
use super::nanos;
use super::table::{EntryGuard, Hint, PageState};
use super::{BatchedPageStore, StoreThread};
use crate::codec::{compress_page, decompress_page, page_len, Encoding, Page, PAGE_SIZE};

/// Ticks of the idle clock per idle threshold: a page counts as idle once its hint is this many
/// ticks old, so it is recompressed between 15/16 and 17/16 of the threshold after its last
/// access (plus the time the scan takes to reach it).
pub(super) const TICKS_PER_IDLE: u16 = 16;
/// The idle clock never ticks faster than this (tests use thresholds of a few ms).
const MIN_TICK: Duration = Duration::from_millis(1);
/// Pages recompressed between looks at the clock, the CPU share and the stop flag.
const SLICE_PAGES: usize = 64;
/// Entries scanned between those looks when few need work: a pass over a large table whose
/// pages are settled is CPU time of its own (a few ns an entry), and a store that shuts down
/// waits for the pass to see it.
const SLICE_ENTRIES: usize = 1 << 16;
/// Scanning alone (no page to recompress or move) pauses for the CPU share once it has taken
/// this much CPU time (see `recompress_pass`).
const PACED_SCAN: Duration = Duration::from_millis(10);
/// Passes a compaction asked for makes at most: each plans at most a few chunks per class
/// (see `ZsAllocator::plan_evacuation`), and a page that is written meanwhile keeps its
/// chunk until the next.
const MAX_COMPACTION_PASSES: u32 = 64;

/// What a compaction asked for did (see `BatchedPageStore::compact`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compaction {
    pub passes: u32,
    /// Objects moved out of sparse chunks.
    pub moved_pages: u64,
    /// The store's chunk memory before and after.
    pub chunk_bytes_before: u64,
    pub chunk_bytes_after: u64,
}

/// What happened to one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Recompressed and installed; this many bytes smaller.
    Installed { saved: u64 },
    /// Recompressed, but not enough smaller: settled as it is.
    Rejected,
    /// Read, written or discarded meanwhile (or no longer idle): left for a later pass.
    Dropped,
    /// Its object moved out of an evacuating chunk.
    Moved,
}

/// Buffers of one recompression, reused page after page.
pub(super) struct Scratch {
    compressed: Box<Page>,
    page: Box<Page>,
    out: Box<Page>,
}

impl Scratch {
    pub(super) fn new() -> Self {
        Self {
            compressed: Box::new([0; PAGE_SIZE]),
            page: Box::new([0; PAGE_SIZE]),
            out: Box::new([0; PAGE_SIZE]),
        }
    }
}

/// The tick of the idle clock for `config`: a sixteenth of the idle threshold.
pub(super) fn tick(config: &RecompressConfig) -> Duration {
    (config.idle / u32::from(TICKS_PER_IDLE)).max(MIN_TICK)
}

impl BatchedPageStore {
    /// The recompressor's thread: advance the idle clock every tick and, on each, make a pass
    /// over the table. Returns when the store shuts down.
    pub(super) fn recompress_loop(&self, config: RecompressConfig) {
        crate::codec::prepare_thread(store_thread_codecs(
            StoreThread::Recompress,
            self.config.algorithm,
            Some(config),
        ));
        let tick = tick(&config);
        let mut scratch = Scratch::new();
        loop {
            {
                let mut sleep = self.recompress_sleep.lock();
                if self.stopping() {
                    return;
                }
                self.recompress_wake.wait_for(&mut sleep, tick);
                if self.stopping() {
                    return;
                }
            }
            self.advance_idle_clock(tick);
            self.recompress_pass(&config, tick, &mut scratch);
        }
    }

    fn advance_idle_clock(&self, tick: Duration) {
        let ticks = self.epoch.elapsed().as_nanos() / tick.as_nanos().max(1);
        self.idle_clock
            .set(u64::try_from(ticks).unwrap_or(u64::MAX));
    }

    fn stopping(&self) -> bool {
        self.shut_down.load(Ordering::Acquire)
    }

    /// One pass over the table: recompress every stored, idle, unsettled page, pacing itself to
    /// its CPU share. Publishes the pages it left unsettled (`recompress_backlog`).
    pub(super) fn recompress_pass(
        &self,
        config: &RecompressConfig,
        tick: Duration,
        scratch: &mut Scratch,
    ) {
        // While the system has no memory to give, chunks stay in use for new objects
        // (compaction would mark the sparsest, which have the most room, and new pages would
        // need new chunks): a later pass plans again.
        if self.alloc.reserve.starving() {
            self.alloc.abandon_evacuation();
        } else {
            self.alloc.plan_evacuation();
        }
        let mut backlog = 0u64;
        let mut slice = Slice::start();
        for index in 0..self.table.len() {
            if slice.pages >= SLICE_PAGES || slice.entries >= SLICE_ENTRIES {
                if self.stopping() {
                    return;
                }
                self.advance_idle_clock(tick);
                // Entries only looked at get no pause of their own until their time adds up
                // to `PACED_SCAN` (a pass over an idle device's table would wake the thread
                // once per `SLICE_ENTRIES`): it is paid with the next pause.
                let scanned_for = crate::os::thread_cpu_time().saturating_sub(slice.cpu_at_start);
                if slice.pages > 0 || scanned_for >= PACED_SCAN {
                    self.pace(config, &slice);
                    slice = Slice::start();
                } else {
                    slice.entries = 0;
                }
            }
            slice.entries += 1;
            let Some((state, hint)) = self.table.peek(index) else {
                continue; // locked: in use right now, so not idle
            };
            let PageState::Stored { len, encoding, .. } = state else {
                continue;
            };
            // A zstd page of a store that writes LZ4 (or adaptive) got zstd when it was
            // written, while memory was short (or by adaptive's choice): it is as small as
            // this would make it, give or take the 1/8 a result must save.
            let settled = hint.settled()
                || (encoding == Encoding::Zstd && !recompresses_zstd_pages(self.config.algorithm));
            let idle = hint.age(self.idle_clock.now()) >= TICKS_PER_IDLE;
            let to_recompress = !settled && idle;
            let to_move = !to_recompress && self.alloc.class_evacuating(usize::from(len));
            if !to_recompress && !to_move {
                // Not idle yet (unless settled), or nothing to do.
                backlog += u64::from(!settled);
                continue;
            }
            if self.alloc.reserve.starving() {
                // The system has no memory to give: a later pass, and the chunks marked for
                // compaction back in use for new objects now (as at a pass's start).
                self.alloc.abandon_evacuation();
                backlog += u64::from(!settled);
                continue;
            }
            slice.pages += 1;
            let outcome = if to_recompress {
                self.recompress_page(index as u64, config, scratch)
            } else {
                match self.move_page(index as u64, scratch) {
                    Some(outcome) => outcome,
                    None => {
                        // Not in an evacuating chunk after all.
                        backlog += u64::from(!settled);
                        continue;
                    }
                }
            };
            match outcome {
                Outcome::Installed { saved } => {
                    add(&self.counters.recompressed_pages, 1);
                    add(&self.counters.recompress_saved_bytes, saved);
                }
                Outcome::Rejected => add(&self.counters.recompress_rejected_pages, 1),
                Outcome::Dropped => {
                    add(&self.counters.recompress_dropped_pages, 1);
                    backlog += u64::from(!settled);
                }
                // Moved as it was: still to be recompressed once idle, unless settled.
                Outcome::Moved => {
                    add(&self.counters.compacted_pages, 1);
                    backlog += u64::from(!settled);
                }
            }
        }
        self.note_cpu_time();
        self.counters
            .recompress_backlog
            .store(backlog, Ordering::Relaxed);
        add(&self.counters.recompress_passes, 1);
    }

    /// Compact now (`trueno-ublk compact`), in the calling thread: plan, move every object out
    /// of the chunks planned, and again, until no class holds more chunks than its objects
    /// need by the planning threshold (or the store shuts down, or the system has no memory
    /// to give). Safe beside I/O and the recompressor: moves claim and install as they do.
    pub fn compact(&self) -> Compaction {
        let chunk_bytes_before = self.alloc.chunk_bytes();
        let mut scratch = Scratch::new();
        let mut done = Compaction {
            chunk_bytes_before,
            ..Compaction::default()
        };
        while done.passes < MAX_COMPACTION_PASSES && !self.stopping() {
            // Chunks planned earlier (by the recompressor, or a pass whose moves were
            // dropped) are still to empty, as well as any planned now.
            if self.alloc.plan_evacuation() == 0 && self.alloc.evacuating_chunks() == 0 {
                break;
            }
            done.passes += 1;
            for index in 0..self.table.len() {
                if self.stopping() || self.alloc.reserve.starving() {
                    break;
                }
                let Some((PageState::Stored { len, .. }, _)) = self.table.peek(index) else {
                    continue;
                };
                if !self.alloc.class_evacuating(usize::from(len)) {
                    continue;
                }
                if self.move_page(index as u64, &mut scratch) == Some(Outcome::Moved) {
                    add(&self.counters.compacted_pages, 1);
                    done.moved_pages += 1;
                }
            }
            if self.alloc.reserve.starving() {
                break;
            }
        }
        if self.alloc.evacuating_chunks() > 0 {
            // Stopped early (the store shutting down, no memory to give, or out of passes):
            // the chunks still marked take new objects again (see `recompress_pass`); the
            // recompressor, if one runs, or the next compaction, plans anew. Left marked with
            // no recompressor, their room went unused for good.
            self.alloc.abandon_evacuation();
        }
        done.chunk_bytes_after = self.alloc.chunk_bytes();
        add(&self.counters.compactions, 1);
        done
    }

    /// Sleep long enough after `slice` that the thread stays within its CPU share.
    fn pace(&self, config: &RecompressConfig, slice: &Slice) {
        let used = self.note_cpu_time().saturating_sub(slice.cpu_at_start);
        let percent = config.cpu_percent.clamp(1, 100);
        if percent >= 100 {
            return;
        }
        let rest = used * (100 - percent) / percent;
        let deadline = Instant::now() + rest;
        let mut sleep = self.recompress_sleep.lock();
        while !self.stopping() && Instant::now() < deadline {
            self.recompress_wake.wait_until(&mut sleep, deadline);
        }
    }

    /// Record the thread's CPU time so far in the counters; returns it.
    fn note_cpu_time(&self) -> Duration {
        let used = crate::os::thread_cpu_time();
        self.counters
            .recompress_cpu_ns
            .store(nanos(used), Ordering::Relaxed);
        used
    }

    /// Recompress page `index` if it is still a stored, idle, unsettled page.
    fn recompress_page(
        &self,
        index: u64,
        config: &RecompressConfig,
        scratch: &mut Scratch,
    ) -> Outcome {
        let _one_mover = self.background_move.lock();
        match self.claim(index, scratch) {
            Ok(claim) => self.finish(claim, config, scratch),
            Err(outcome) => outcome,
        }
    }

    /// Move page `index`'s object out of its chunk if that chunk is evacuating; `None` if it
    /// is not (or the page holds no stored object any more).
    fn move_page(&self, index: u64, scratch: &mut Scratch) -> Option<Outcome> {
        let _one_mover = self.background_move.lock();
        let claim = {
            let entry = self.table.lock(index)?;
            let PageState::Stored {
                handle,
                len,
                encoding,
            } = entry.state()
            else {
                return None;
            };
            let len_bytes = usize::from(len);
            if !self.alloc.is_evacuating(handle, len_bytes) {
                return None;
            }
            self.alloc.with_object(handle, len_bytes, |bytes| {
                scratch.compressed[..len_bytes].copy_from_slice(bytes);
            })?;
            Claim::mark(
                index,
                &entry,
                entry.hint().settled(),
                (handle, len_bytes, encoding),
            )
        };
        // Evacuating chunks take no new objects: this lands in another one.
        let Some(new_handle) = self
            .alloc
            .store_in_background(&scratch.compressed[..claim.len])
        else {
            return Some(Outcome::Dropped);
        };
        let moved = {
            let mut entry = self.table.lock(index);
            if let Some(entry) = entry.as_mut().filter(|e| claim.holds(e)) {
                let new = PageState::Stored {
                    handle: new_handle,
                    len: page_len(claim.len),
                    encoding: claim.encoding,
                };
                let old = entry.replace(new);
                self.counters.transition(old, new);
                entry.set_hint(claim.hint.with_flags(claim.hint.settled(), false));
                true
            } else {
                false
            }
        };
        if moved {
            self.alloc.free(claim.handle, claim.len);
            Some(Outcome::Moved)
        } else {
            self.alloc.free(new_handle, claim.len);
            Some(Outcome::Dropped)
        }
    }

    /// Under the entry's lock: check that the page is still worth a try, copy its compressed
    /// bytes into `scratch` and mark the claim in its hint.
    pub(super) fn claim(&self, index: u64, scratch: &mut Scratch) -> Result<Claim, Outcome> {
        let entry = self.table.lock(index).ok_or(Outcome::Dropped)?;
        let PageState::Stored {
            handle,
            len,
            encoding,
        } = entry.state()
        else {
            return Err(Outcome::Dropped);
        };
        let hint = entry.hint();
        if hint.settled() || hint.age(self.idle_clock.now()) < TICKS_PER_IDLE {
            return Err(Outcome::Dropped);
        }
        let len_bytes = usize::from(len);
        let copied = self.alloc.with_object(handle, len_bytes, |bytes| {
            scratch.compressed[..len_bytes].copy_from_slice(bytes);
        });
        if copied.is_none() {
            // A broken entry: its reads report it (EIO); nothing to gain here.
            entry.set_hint(hint.with_flags(true, false));
            return Err(Outcome::Rejected);
        }
        Ok(Claim::mark(
            index,
            &entry,
            false,
            (handle, len_bytes, encoding),
        ))
    }

    /// Outside every lock: decompress the claimed page, compress it with the stronger codec,
    /// store the result if it saves enough, and install it if the entry is still exactly as
    /// claimed.
    pub(super) fn finish(
        &self,
        claim: Claim,
        config: &RecompressConfig,
        scratch: &mut Scratch,
    ) -> Outcome {
        let old_len = claim.len;
        let decoded = decompress_page(
            claim.encoding,
            &scratch.compressed[..old_len],
            &mut scratch.page,
        );
        let intact = decoded.is_ok() && self.checksum.of(&scratch.page) == claim.checksum;
        if decoded.is_ok() && !intact {
            // Its reads fail with EIO and log it; the data must not be stored again as good.
            add(&self.counters.checksum_failures, 1);
            tracing::error!(
                page = claim.index,
                "stored page fails its checksum (found by the recompressor)"
            );
        }
        let result = if intact {
            Ok(compress_page(
                config.algorithm,
                &scratch.page,
                &mut scratch.out,
            ))
        } else {
            Err(())
        };
        let worth_it = match result {
            Ok((new_encoding, new_len)) => {
                let limit = old_len - old_len / config.min_saving_divisor.max(1);
                (new_encoding != Encoding::Raw && new_len <= limit && new_len < old_len)
                    .then_some((new_encoding, new_len))
            }
            // A corrupt page: its reads report it (EIO); settled as it is.
            Err(()) => None,
        };
        let Some((new_encoding, new_len)) = worth_it else {
            let Some(entry) = self.table.lock(claim.index).filter(|e| claim.holds(e)) else {
                return Outcome::Dropped;
            };
            entry.set_hint(claim.hint.with_flags(true, false));
            return Outcome::Rejected;
        };
        // The new object first, outside every lock; then the entry flips to it.
        let Some(new_handle) = self.alloc.store_in_background(&scratch.out[..new_len]) else {
            return Outcome::Dropped;
        };
        let new = PageState::Stored {
            handle: new_handle,
            len: page_len(new_len),
            encoding: new_encoding,
        };
        let installed = {
            let mut entry = self.table.lock(claim.index);
            if let Some(entry) = entry.as_mut().filter(|e| claim.holds(e)) {
                let old = entry.replace(new);
                self.counters.transition(old, new);
                entry.set_hint(claim.hint.with_flags(true, false));
                true
            } else {
                false
            }
        };
        if installed {
            self.alloc.free(claim.handle, old_len);
            Outcome::Installed {
                saved: (old_len - new_len) as u64,
            }
        } else {
            self.alloc.free(new_handle, new_len);
            Outcome::Dropped
        }
    }
}

/// A page the recompressor copied out, and how its entry and hint looked then.
pub(super) struct Claim {
    index: u64,
    word: u64,
    hint: Hint,
    /// Of the page's data: the same whatever codec stores it.
    checksum: u32,
    handle: Handle,
    len: usize,
    encoding: Encoding,
}

impl Claim {
    /// Claim page `index`, whose entry names `object` (handle, length in bytes, encoding) and
    /// whose bytes were just copied out: its hint marked claimed, with `settled` as given.
    fn mark(
        index: u64,
        entry: &EntryGuard<'_>,
        settled: bool,
        (handle, len, encoding): (Handle, usize, Encoding),
    ) -> Self {
        let hint = entry.hint().with_flags(settled, true);
        entry.set_hint(hint);
        Self {
            index,
            word: entry.word(),
            hint,
            checksum: entry.checksum(),
            handle,
            len,
            encoding,
        }
    }

    /// Whether `entry` is still exactly as claimed: not written (a write clears the claim, and
    /// the word alone could be the same again), not read (its access time moved), not
    /// discarded.
    fn holds(&self, entry: &EntryGuard<'_>) -> bool {
        entry.word() == self.word && entry.hint() == self.hint
    }
}

/// The pages worked on, entries scanned and CPU time since the last pause.
struct Slice {
    pages: usize,
    entries: usize,
    cpu_at_start: Duration,
}

impl Slice {
    fn start() -> Self {
        Self {
            pages: 0,
            entries: 0,
            cpu_at_start: crate::os::thread_cpu_time(),
        }
    }
}
