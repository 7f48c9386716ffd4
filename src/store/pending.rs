//! Pending batches: preallocated page slots that writers fill without a shared lock.
//!
//! A batch is *open* while writers may reserve slots in it. Reserving is one compare-and-swap
//! on `state` (open bit + count of reserved slots). The flusher *seals* a batch (clears the
//! open bit), waits until every writer that reserved a slot has finished copying (`committed`),
//! compresses the slots and only then lets the batch be opened again. So while a page-table
//! entry says `Pending { batch, slot }`, that slot holds that page's data.
//!
//! Writers may use a batch's first `limit` slots, set when it opens (see `BatchSpan`): all of
//! them while writes come or memory is short, the first `QUIET_SLOTS` once none came for a
//! while, the rest of the slots' memory then given back.
//!
//! The slots' pages and the page index each holds are in the store's memory (see `layout`),
//! so a write acknowledged before the process died is found by the next one: an entry that
//! says `Pending { batch, slot }` whose slot names the same page is that page's data. The
//! reservation state is the process's own: a resumed store installs every pending page and
//! starts with empty batches.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::mem::{PageSlots, SlotRead, Words};

/// `state`: the open bit, the batch's slot limit (bits 32 to 62) and the count of reserved
/// slots (the low 32 bits), so that one compare-and-swap reserves a slot below the limit.
const OPEN: u64 = 1 << 63;
const COUNT_MASK: u64 = (1 << 32) - 1;
const LIMIT_SHIFT: u32 = 32;
const LIMIT_MASK: u64 = (1 << 31) - 1;
/// Slots each batch keeps with memory while no writes come and memory is not short (64 KiB a
/// batch, one step of growth: `GROW_STEP_SLOTS`): what a swap device's occasional page needs.
/// Why not all: every slot is a locked page, and the two batches' 512 slots were 2 MiB of the
/// daemon's idle footprint (32 slots a batch from 2026-11-28 to 2026-11-29).
pub(super) const QUIET_SLOTS: usize = 16;
/// `first_write_ns` of a batch none has written to yet.
const NO_WRITE: u64 = u64::MAX;

/// One page waiting for compression, and the device page it belongs to.
pub(super) struct PendingSlot<'a> {
    pub(super) page: SlotRead<'a>,
    pub(super) index: u64,
}

pub(super) enum Reserve {
    Slot(usize),
    /// Every slot is taken: wait for the flusher to open another batch.
    Full,
    /// Sealed: another batch is (or is about to be) open.
    Closed,
}

pub(super) struct PendingBatch {
    slots: PageSlots,
    /// The page index each slot holds.
    indexes: Words<AtomicU64>,
    state: AtomicU64,
    committed: AtomicUsize,
    /// When the first page was written, in ns since the store's epoch.
    first_write_ns: AtomicU64,
}

impl PendingBatch {
    /// A batch of the slots and index words given (committed by the caller), closed.
    pub(super) fn new(slots: PageSlots, indexes: Words<AtomicU64>) -> Self {
        Self {
            slots,
            indexes,
            state: AtomicU64::new(0),
            committed: AtomicUsize::new(0),
            first_write_ns: AtomicU64::new(NO_WRITE),
        }
    }

    pub(super) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The slots writers may use while the batch is open.
    pub(super) fn limit(&self) -> usize {
        limit_of(self.state.load(Ordering::Acquire))
    }

    /// Lower the limit of a batch none has reserved a slot in (open or not) to `limit`; false
    /// if a writer holds a slot.
    pub(super) fn shrink_empty(&self, limit: usize) -> bool {
        let cur = self.state.load(Ordering::Acquire);
        if cur & COUNT_MASK != 0 {
            return false;
        }
        limit_of(cur) <= limit
            || self
                .state
                .compare_exchange(
                    cur,
                    (cur & OPEN) | limit_bits(limit),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// Fault in the memory of slots `range` (see `Segment::commit`).
    pub(super) fn commit_slots(&self, range: std::ops::Range<usize>) -> std::io::Result<()> {
        self.slots.commit(range)
    }

    #[cfg(test)]
    pub(super) fn slots_in_memory(&self, range: std::ops::Range<usize>) -> bool {
        self.slots.any_in_memory(range).unwrap_or(true)
    }

    /// Give the memory of slots `range` back; only for slots no writer may use (past the
    /// limit of an empty batch, or of a batch that will open with a lower one).
    pub(super) fn decommit_slots(&self, range: std::ops::Range<usize>) -> std::io::Result<()> {
        self.slots.decommit(range)
    }

    /// Copy `page`, the data of device page `index`, into slot `slot` (reserved by the caller).
    pub(super) fn fill(&self, slot: usize, index: u64, page: &[u8; crate::codec::PAGE_SIZE]) {
        let mut data = self.slots.write(slot);
        data.copy_from_slice(page);
        self.indexes[slot].store(index, Ordering::Release);
    }

    /// Slot `slot`'s page and index, read-locked.
    pub(super) fn slot(&self, slot: usize) -> PendingSlot<'_> {
        let page = self.slots.read(slot);
        PendingSlot {
            index: self.indexes[slot].load(Ordering::Acquire),
            page,
        }
    }

    /// The page index slot `slot` names, if the slot exists (a resumed store's check).
    pub(super) fn index_of(&self, slot: usize) -> Option<u64> {
        self.indexes.get(slot).map(|i| i.load(Ordering::Acquire))
    }

    pub(super) fn reserve(&self) -> Reserve {
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            if cur & OPEN == 0 {
                return Reserve::Closed;
            }
            let n = cur & COUNT_MASK;
            if n as usize >= limit_of(cur) {
                return Reserve::Full;
            }
            match self.state.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Reserve::Slot(n as usize),
                Err(now) => cur = now,
            }
        }
    }

    /// Slots reserved so far.
    pub(super) fn reserved(&self) -> usize {
        (self.state.load(Ordering::Acquire) & COUNT_MASK) as usize
    }

    pub(super) fn is_full(&self) -> bool {
        let state = self.state.load(Ordering::Acquire);
        (state & COUNT_MASK) as usize >= limit_of(state)
    }

    /// A writer is done with its slot: data copied and the entry pointing at it, or the write
    /// failed and nothing points at it.
    pub(super) fn commit(&self) {
        self.committed.fetch_add(1, Ordering::Release);
    }

    pub(super) fn note_first_write(&self, now_ns: u64) {
        self.first_write_ns.store(now_ns, Ordering::Release);
    }

    /// When the first page was written, once its writer has recorded it.
    pub(super) fn first_write_ns(&self) -> Option<u64> {
        match self.first_write_ns.load(Ordering::Acquire) {
            NO_WRITE => None,
            t => Some(t),
        }
    }

    /// Make the batch empty and open with its first `limit` slots usable (only for a batch
    /// that is sealed and fully flushed).
    pub(super) fn open(&self, limit: usize) {
        self.committed.store(0, Ordering::Relaxed);
        self.first_write_ns.store(NO_WRITE, Ordering::Relaxed);
        self.state.store(
            OPEN | limit_bits(limit.min(self.slots.len())),
            Ordering::Release,
        );
    }

    /// Stop reservations; returns how many slots were reserved, then waits until all of them
    /// are committed (each writer is copying one page, so this is short).
    pub(super) fn seal(&self) -> usize {
        let n = (self.state.fetch_and(!OPEN, Ordering::AcqRel) & COUNT_MASK) as usize;
        let mut spins = 0u32;
        while self.committed.load(Ordering::Acquire) < n {
            if spins < 100 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        n
    }
}

fn limit_of(state: u64) -> usize {
    ((state >> LIMIT_SHIFT) & LIMIT_MASK) as usize
}

fn limit_bits(limit: usize) -> u64 {
    (limit as u64 & LIMIT_MASK) << LIMIT_SHIFT
}

/// How long batches stay whole without a flush: `QUIET_AFTER` (the reserve's), or in tests
/// what the test set.
pub(super) fn quiet_after(quiet_after: Duration) -> Duration {
    #[cfg(test)]
    return QUIET_AFTER_FOR_TESTS
        .with(std::cell::Cell::get)
        .unwrap_or(quiet_after);
    #[cfg(not(test))]
    quiet_after
}

#[cfg(test)]
thread_local! {
    /// See `quiet_after`.
    pub(super) static QUIET_AFTER_FOR_TESTS: std::cell::Cell<Option<Duration>> =
        const { std::cell::Cell::new(None) };
}

/// What the refill thread should do with the batches' slots (see `BatchSpan::next`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SpanChange {
    /// Writes come faster than a quiet batch holds, or memory is short: commit every slot,
    /// then open batches whole.
    Grow,
    /// No write for `QUIET_AFTER` with memory not short: open batches with `QUIET_SLOTS`,
    /// then give the rest back.
    Shrink,
    /// A grow stopped part-way (`note_grow_stopped`) and is no longer asked for (no quiet
    /// fill, memory not short): the span is quiet, so the slots it committed past the quiet
    /// span go back (only a whole span is shrunk).
    AbandonGrow,
}

/// How many slots the batches open with: all of them, or `QUIET_SLOTS` (see `QUIET_SLOTS`).
/// Changed only under the flush mutex, so that the memory of the slots past `QUIET_SLOTS` is
/// given back only while no batch may use them, and committed before one may: the refill
/// thread sets the quiet span, with the open batch empty and lowered to it, before it gives
/// their memory back; it commits that memory and then offers the whole span
/// (`offer_whole`), which the next holder of the flush mutex takes (`take_offer`).
pub(super) struct BatchSpan {
    slots: AtomicUsize,
    capacity: usize,
    /// Batches flushed full at the quiet span.
    quiet_fills: AtomicU64,
    /// Every slot's memory is committed, and batches may open whole. Why an offer and not
    /// the refill thread making the span whole itself: it may only try the flush mutex (a
    /// flush may wait for it), and while writes come hard a flush nearly always holds it; in
    /// `trueno-ublk bench` (400 MiB of real pages, 2026-11-29) one fill in three flushed up to
    /// 3,066 quiet batches first, each of 32 pages and so compressed on the flusher's core
    /// alone (fewer than `parallel_min_pages`), at under half the speed.
    whole_offered: AtomicBool,
    quiet_after: Duration,
    watch: Mutex<SpanWatch>,
}

/// What the refill thread saw at its last look.
struct SpanWatch {
    flushes: u64,
    quiet_fills: u64,
    changed: Instant,
    /// A grow stopped part-way, its committed slots neither offered nor given back.
    grow_stopped: bool,
}

impl BatchSpan {
    /// Batches of `capacity` slots, quiet again after `quiet_after` without a flush; quiet
    /// to begin with if a refill thread keeps the span (`kept`), else whole for good.
    pub(super) fn new(capacity: usize, quiet_after: Duration, kept: bool) -> Self {
        Self {
            slots: AtomicUsize::new(if kept {
                capacity.min(QUIET_SLOTS)
            } else {
                capacity
            }),
            capacity,
            quiet_fills: AtomicU64::new(0),
            whole_offered: AtomicBool::new(false),
            quiet_after,
            watch: Mutex::new(SpanWatch {
                flushes: 0,
                quiet_fills: 0,
                changed: Instant::now(),
                grow_stopped: false,
            }),
        }
    }

    /// The slots a batch opens with now.
    pub(super) fn slots(&self) -> usize {
        self.slots.load(Ordering::Acquire)
    }

    /// The slots a quiet batch keeps.
    pub(super) fn quiet_slots(&self) -> usize {
        self.capacity.min(QUIET_SLOTS)
    }

    pub(super) fn is_whole(&self) -> bool {
        self.slots() == self.capacity
    }

    /// A batch of `pages` was sealed; true if it filled at the quiet span (then the refill
    /// thread has work: `Grow`).
    pub(super) fn note_sealed(&self, pages: usize) -> bool {
        let filled = !self.is_whole() && pages >= self.quiet_slots();
        if filled {
            self.quiet_fills.fetch_add(1, Ordering::Relaxed);
        }
        filled
    }

    /// The change due, from the count of batches flushed so far and whether the system is
    /// short of memory: then batches stay (or become) whole, as the chunk reserve does, since
    /// that is when swap writes come hardest (and the refill thread's commits are slowest).
    pub(super) fn next(&self, flushes: u64, memory_short: bool) -> Option<SpanChange> {
        if self.capacity <= QUIET_SLOTS {
            return None;
        }
        let mut watch = self.watch.lock();
        if flushes != watch.flushes || memory_short {
            watch.flushes = flushes;
            watch.changed = Instant::now();
        }
        let quiet_fills = self.quiet_fills.load(Ordering::Relaxed);
        let filled = quiet_fills != watch.quiet_fills;
        watch.quiet_fills = quiet_fills;
        if self.is_whole() {
            (watch.changed.elapsed() >= self.quiet_after).then_some(SpanChange::Shrink)
        } else {
            // An offer not yet taken asks again: if no flush comes to take it, the refill
            // thread must, or the span would stay quiet with its memory committed.
            if filled || memory_short || self.is_offered() {
                Some(SpanChange::Grow)
            } else {
                std::mem::take(&mut watch.grow_stopped).then_some(SpanChange::AbandonGrow)
            }
        }
    }

    /// A grow stopped before its offer (a write waiting for memory, a failed commit): asked
    /// for again, it goes on; if not, its slots go back (`AbandonGrow`).
    pub(super) fn note_grow_stopped(&self) {
        self.watch.lock().grow_stopped = true;
    }

    /// Every slot's memory is committed: the next holder of the flush mutex opens batches
    /// whole (`take_offer`).
    pub(super) fn offer_whole(&self) {
        self.watch.lock().grow_stopped = false;
        self.whole_offered.store(true, Ordering::Release);
    }

    /// Whether an offer waits to be taken.
    pub(super) fn is_offered(&self) -> bool {
        self.whole_offered.load(Ordering::Acquire)
    }

    /// Under the flush mutex: make the span whole if it was offered; true if it was.
    pub(super) fn take_offer(&self) -> bool {
        if !self.whole_offered.swap(false, Ordering::AcqRel) {
            return false;
        }
        self.watch.lock().changed = Instant::now();
        self.slots.store(self.capacity, Ordering::Release);
        true
    }

    /// Under the flush mutex: batches open quiet from now on (an offer withdrawn: the memory
    /// past the quiet span goes back next).
    pub(super) fn set_quiet(&self) {
        self.whole_offered.store(false, Ordering::Release);
        self.slots.store(self.quiet_slots(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Segment;

    fn batch(slots: usize) -> PendingBatch {
        let segment = Segment::private(slots * 4096 + 4096).unwrap();
        segment.commit(0, slots * 4096 + 4096).unwrap();
        PendingBatch::new(
            segment.page_slots(4096, slots).unwrap(),
            segment.words(0, slots).unwrap(),
        )
    }

    #[test]
    fn writers_reserve_up_to_the_limit_the_batch_opened_with() {
        let b = batch(64);
        assert!(matches!(b.reserve(), Reserve::Closed));
        b.open(3);
        assert_eq!(b.limit(), 3);
        for want in 0..3 {
            assert!(matches!(b.reserve(), Reserve::Slot(s) if s == want));
        }
        assert!(matches!(b.reserve(), Reserve::Full));
        assert!(b.is_full());
        // A limit past the slots is the slots.
        b.open(1_000);
        assert_eq!(b.limit(), 64);
    }

    #[test]
    fn only_an_empty_batch_shrinks() {
        let b = batch(64);
        b.open(64);
        assert!(matches!(b.reserve(), Reserve::Slot(0)));
        assert!(!b.shrink_empty(8), "a writer holds slot 0");
        b.commit();
        assert_eq!(b.seal(), 1);
        b.open(64);
        assert!(b.shrink_empty(8));
        assert_eq!(b.limit(), 8);
        for _ in 0..8 {
            assert!(matches!(b.reserve(), Reserve::Slot(_)));
        }
        assert!(
            matches!(b.reserve(), Reserve::Full),
            "still open, at the lower limit"
        );
    }

    #[test]
    fn the_span_grows_on_a_quiet_fill_and_shrinks_after_a_quiet_spell() {
        let quiet = Duration::from_millis(40);
        let span = BatchSpan::new(256, quiet, true);
        assert_eq!(span.slots(), QUIET_SLOTS);
        assert_eq!(span.next(0, false), None);
        // A batch sealed before it filled asks for nothing; one that filled, for every slot.
        assert!(!span.note_sealed(QUIET_SLOTS - 1));
        assert_eq!(span.next(1, false), None);
        assert!(span.note_sealed(QUIET_SLOTS));
        assert_eq!(span.next(2, false), Some(SpanChange::Grow));
        span.offer_whole();
        assert_eq!(span.slots(), QUIET_SLOTS, "quiet until the offer is taken");
        assert_eq!(
            span.next(2, false),
            Some(SpanChange::Grow),
            "an offer asks again"
        );
        assert!(span.take_offer());
        assert!(!span.take_offer(), "taken once");
        assert_eq!(span.slots(), 256);
        assert!(!span.note_sealed(256), "whole: nothing to grow");
        // Flushes keep it whole; a spell without one shrinks it.
        for flushes in 3..6 {
            assert_eq!(span.next(flushes, false), None);
            std::thread::sleep(quiet / 4);
        }
        std::thread::sleep(quiet + quiet / 2);
        assert_eq!(span.next(5, false), Some(SpanChange::Shrink));
        span.set_quiet();
        assert_eq!(span.slots(), QUIET_SLOTS);
        // Memory short: whole, and whole it stays however quiet.
        assert_eq!(span.next(5, true), Some(SpanChange::Grow));
        span.offer_whole();
        span.set_quiet();
        assert!(!span.take_offer(), "a quiet span withdraws the offer");
        span.offer_whole();
        assert!(span.take_offer());
        std::thread::sleep(quiet + quiet / 2);
        assert_eq!(span.next(5, true), None);
        assert_eq!(span.next(5, false), None, "short until just now");
        // A grow that stopped part-way goes on while asked for, and is abandoned (its slots
        // given back) once it is not.
        let stopped = BatchSpan::new(256, quiet, true);
        assert!(stopped.note_sealed(QUIET_SLOTS));
        assert_eq!(stopped.next(1, false), Some(SpanChange::Grow));
        stopped.note_grow_stopped();
        assert_eq!(
            stopped.next(1, true),
            Some(SpanChange::Grow),
            "memory short"
        );
        stopped.note_grow_stopped();
        assert_eq!(stopped.next(1, false), Some(SpanChange::AbandonGrow));
        assert_eq!(stopped.next(1, false), None, "abandoned once");
        assert!(stopped.note_sealed(QUIET_SLOTS));
        assert_eq!(stopped.next(2, false), Some(SpanChange::Grow));
        stopped.note_grow_stopped();
        stopped.offer_whole();
        assert_eq!(stopped.next(2, false), Some(SpanChange::Grow), "offered");
        assert!(stopped.take_offer());
        assert_eq!(stopped.next(2, false), None, "whole: nothing to abandon");
        // Batches no larger than the quiet span never change, nor does an unkept span.
        let small = BatchSpan::new(QUIET_SLOTS, Duration::ZERO, true);
        assert!(small.is_whole() && !small.note_sealed(QUIET_SLOTS));
        assert_eq!(small.next(1, false), None);
        let unkept = BatchSpan::new(256, quiet, false);
        assert!(unkept.is_whole());
    }
}
