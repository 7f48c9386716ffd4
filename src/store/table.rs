//! The page table: one 8-byte word per device page, each with its own lock bit, and beside it
//! one 16-bit idle hint per page (`Hint`) and a 32-bit check: the checksum of a stored page's
//! data (`codec::PageChecksum`), or of the entry's own word for any other (`word_check`).
//!
//! Every change of a page's state is one atomic store of its word, so a process that dies at
//! any instruction leaves every entry whole: the old state or the new one (the store's memory
//! outlives the process, see `layout`). The word holds the lock bit, the kind of entry and
//! what the kind needs: the fill word of a same-filled page (if it fits, see `PageState::same`),
//! the pending batch slot, or a stored object's encoding, length and position. Readers and
//! writers of different pages never share a lock. Critical sections are a few hundred
//! nanoseconds (a decompression at most): a short spin, then yielding, is enough.
//!
//! The hint says when the page was last written or read, on the store's coarse idle clock
//! (see `IdleClock`), and what the recompressor (see `recompress`) knows of its data. It is
//! read and written under the entry's lock, so it costs the I/O path no lock and no atomic
//! read-modify-write of its own: a load, and a store only when it changes. It needs no crash
//! consistency: a resumed store starts every hint afresh.
//!
//! The checksum belongs to the data, not to the object holding it: it is set under the entry's
//! lock before the entry names a stored object (so a process that dies in between leaves an
//! entry that does not name it yet, or, when the entry was already `Stored`, a locked entry
//! whose checksum the resume sets again from the data it names), and stays when the
//! recompressor stores the same data again. While the entry is anything but `Stored`, the
//! same word holds the entry word's own check (`word_check`), set as the entry is unlocked:
//! a same-filled page (zero pages above all) has no memory but its entry, so a bit flipped in
//! it would otherwise read as other data; checked, the read fails (EIO) instead, as a stored
//! page's does, and so does a `Stored` entry flipped to another kind (its checksum is no
//! entry's check). A resume sets the check of every entry that is not `Stored` again
//! (`recover`), and the checks beside a slot's entries are cleared when it becomes a spare,
//! at a resume or when its group is given back (`table_memory`): a binary before the checks
//! left other values there, beside entries no group of this process used among them.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};

use super::alloc::Handle;
use super::table_memory::{GroupState, TableMemory};
use crate::codec::Encoding;
use crate::mem::Words;

const LOCKED: u64 = 1 << 63;
const KIND_SHIFT: u32 = 60;
const KIND_MASK: u64 = 0b111;
const KIND_EMPTY: u64 = 0;
const KIND_SAME: u64 = 1;
const KIND_PENDING: u64 = 2;
const KIND_STORED: u64 = 3;
const KIND_LOST: u64 = 4;
/// Bits below the kind: a same-filled page's word, sign-extended from here.
const PAYLOAD_BITS: u32 = 60;
const PAYLOAD_MASK: u64 = (1 << PAYLOAD_BITS) - 1;
const ENC_SHIFT: u32 = 58;
const ENC_MASK: u64 = 0b11;
const LEN_SHIFT: u32 = 45;
const LEN_MASK: u64 = 0x1fff;
/// A stored object's position (`Handle`) takes the low bits.
const POSITION_MASK: u64 = (1 << LEN_SHIFT) - 1;
const BATCH_SHIFT: u32 = 32;
/// Spins before a waiter starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 100;

/// Ticks of the idle clock a hint can tell apart: ages are taken modulo this.
const EPOCH_BITS: u32 = 14;
const EPOCH_MASK: u16 = (1 << EPOCH_BITS) - 1;
/// The recompressor has dealt with the page's current data (recompressed it, or found it not
/// worth it): not tried again until the page is written.
const SETTLED: u16 = 1 << 15;
/// The recompressor copied the page's data and is compressing it: any write clears this, so
/// the recompressor installs its result only if the page was not written meanwhile (the entry
/// word alone could be the same again after a write: a freed object's place is reused).
const CLAIMED: u16 = 1 << 14;

/// A page's idle hint: when it was last written or read (an epoch of the idle clock, modulo
/// 2^14), and the recompressor's flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Hint(u16);

impl Hint {
    /// A page written at `epoch`: no flags.
    pub(super) fn written(epoch: u16) -> Self {
        Hint(epoch & EPOCH_MASK)
    }

    pub(super) fn epoch(self) -> u16 {
        self.0 & EPOCH_MASK
    }

    /// Ticks from the last access to `now` (modulo 2^14: a page idle for longer may look
    /// young again for a while, which only delays its recompression).
    pub(super) fn age(self, now: u16) -> u16 {
        now.wrapping_sub(self.epoch()) & EPOCH_MASK
    }

    pub(super) fn settled(self) -> bool {
        self.0 & SETTLED != 0
    }

    /// The same access time, with `settled` and `claimed` as given.
    pub(super) fn with_flags(self, settled: bool, claimed: bool) -> Self {
        let mut bits = self.epoch();
        if settled {
            bits |= SETTLED;
        }
        if claimed {
            bits |= CLAIMED;
        }
        Hint(bits)
    }

    /// Accessed at `epoch`, flags kept.
    fn touched(self, epoch: u16) -> Self {
        Hint((self.0 & !EPOCH_MASK) | (epoch & EPOCH_MASK))
    }
}

/// The store's coarse clock for idle hints: an epoch counter that the recompressor's thread
/// advances (see `recompress`), so that the I/O path reads the time with one relaxed load
/// rather than a clock call per page. Without recompression nothing needs ages and it stays
/// at 0.
#[derive(Debug, Default)]
pub(super) struct IdleClock(AtomicU16);

impl IdleClock {
    pub(super) fn now(&self) -> u16 {
        self.0.load(Ordering::Relaxed)
    }

    /// Set the clock to `ticks` since the store started (modulo 2^14).
    pub(super) fn set(&self, ticks: u64) {
        #[allow(
            clippy::cast_possible_truncation,
            reason = "masked to the 14 bits of an epoch"
        )]
        let epoch = (ticks & u64::from(EPOCH_MASK)) as u16;
        self.0.store(epoch, Ordering::Relaxed);
    }
}

/// What one page holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PageState {
    /// Never written, or discarded: reads as zeros.
    Empty,
    /// Every 8-byte word is this one.
    Same(u64),
    /// In slot `slot` of pending batch `batch`, not yet compressed.
    Pending { batch: u32, slot: u32 },
    /// Compressed (or raw) in the allocator.
    Stored {
        handle: Handle,
        len: u16,
        encoding: Encoding,
    },
    /// Held data once, but a resumed store could not find it whole (see `resume`): reads
    /// fail with EIO until the page is written or discarded, never return zeros.
    Lost,
}

impl PageState {
    /// `Pending { batch, slot }` from indexes.
    pub(super) fn pending(batch: usize, slot: usize) -> Self {
        #[allow(
            clippy::cast_possible_truncation,
            reason = "there are two batches of at most 2^20 slots (checked in `check_config`, and for a resumed store in `layout`)"
        )]
        let (batch, slot) = (batch as u32, slot as u32);
        PageState::Pending { batch, slot }
    }

    /// `Same(word)` if the entry can hold `word` (a sign-extended 60-bit value: zero, small
    /// numbers and all ones among them); other same-filled pages are compressed like any page.
    pub(super) fn same(word: u64) -> Option<Self> {
        let extended = sign_extend(word & PAYLOAD_MASK);
        (extended == word).then_some(PageState::Same(word))
    }

    #[allow(
        clippy::cast_possible_truncation,
        reason = "fields are masked to their widths, which fit their types"
    )]
    fn decode(word: u64) -> Self {
        match (word >> KIND_SHIFT) & KIND_MASK {
            KIND_EMPTY => PageState::Empty,
            KIND_SAME => PageState::Same(sign_extend(word & PAYLOAD_MASK)),
            KIND_PENDING => PageState::Pending {
                batch: ((word & PAYLOAD_MASK) >> BATCH_SHIFT) as u32,
                slot: word as u32,
            },
            KIND_STORED => match Encoding::from_bits(((word >> ENC_SHIFT) & ENC_MASK) as u8) {
                Some(encoding) => PageState::Stored {
                    handle: Handle::from_bits(word & POSITION_MASK),
                    len: ((word >> LEN_SHIFT) & LEN_MASK) as u16,
                    encoding,
                },
                None => PageState::Lost,
            },
            _ => PageState::Lost,
        }
    }

    fn encode(self) -> u64 {
        let kind = |k: u64| k << KIND_SHIFT;
        match self {
            PageState::Empty => kind(KIND_EMPTY),
            // `same` made sure the word fits.
            PageState::Same(w) => kind(KIND_SAME) | (w & PAYLOAD_MASK),
            PageState::Pending { batch, slot } => {
                kind(KIND_PENDING) | (u64::from(batch) << BATCH_SHIFT) | u64::from(slot)
            }
            PageState::Stored {
                handle,
                len,
                encoding,
            } => {
                kind(KIND_STORED)
                    | ((encoding as u64) << ENC_SHIFT)
                    | ((u64::from(len) & LEN_MASK) << LEN_SHIFT)
                    | (handle.to_bits() & POSITION_MASK)
            }
            PageState::Lost => kind(KIND_LOST),
        }
    }
}

/// `value` (60 bits) sign-extended to 64.
fn sign_extend(value: u64) -> u64 {
    let shift = 64 - PAYLOAD_BITS;
    #[allow(
        clippy::cast_possible_wrap,
        clippy::cast_sign_loss,
        reason = "a bit-for-bit reinterpretation, to shift arithmetically"
    )]
    let extended = (((value << shift) as i64) >> shift) as u64;
    extended
}

/// CRC32C of eight zero bytes, with the algorithm's initial and final inversions.
const CRC32C_OF_ZERO_WORD: u32 = 0x8c28_b28a;

/// The check of entry word `word` (without the lock bit) that the checksum word holds while
/// the entry is not `Stored`: the CRC32C of its eight bytes without the initial and final
/// inversions, so that an empty entry's is 0, as memory given back reads, and so that every
/// error of up to 32 adjacent bits in the word changes it.
fn word_check(word: u64) -> u32 {
    // CRC32C's 32 bits, in the low half of the crate's u64.
    #[allow(clippy::cast_possible_truncation)]
    let crc = crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, &word.to_le_bytes()) as u32;
    crc ^ CRC32C_OF_ZERO_WORD
}

/// Exclusive access to one entry (and its hint); the lock is released when it is dropped.
pub(super) struct EntryGuard<'a> {
    entry: &'a AtomicU64,
    hint: &'a AtomicU16,
    checksum: &'a AtomicU32,
    word: u64,
    state: PageState,
    changed: bool,
}

impl EntryGuard<'_> {
    pub(super) fn state(&self) -> PageState {
        self.state
    }

    /// The entry's word as it was locked (without the lock bit): what the recompressor
    /// compares to tell whether an entry is still the one it read.
    pub(super) fn word(&self) -> u64 {
        self.word
    }

    /// The checksum of the data of the stored object the entry names.
    pub(super) fn checksum(&self) -> u32 {
        self.checksum.load(Ordering::Relaxed)
    }

    /// Whether the entry's word, as locked, matches the check beside it (see `word_check`):
    /// for an entry read as anything but `Stored`, whose data is checked otherwise.
    pub(super) fn word_holds(&self) -> bool {
        self.checksum() == word_check(self.word)
    }

    /// Set the checksum of the data the entry is about to name (before `replace`: the entry's
    /// word is stored, with Release, when the guard drops).
    pub(super) fn set_checksum(&self, checksum: u32) {
        self.checksum.store(checksum, Ordering::Relaxed);
    }

    pub(super) fn hint(&self) -> Hint {
        Hint(self.hint.load(Ordering::Relaxed))
    }

    pub(super) fn set_hint(&self, hint: Hint) {
        self.hint.store(hint.0, Ordering::Relaxed);
    }

    /// The page was read at `epoch`: its access time moves, its flags stay. Written only when
    /// it changes, so reads of a page within one tick leave its cache line clean.
    pub(super) fn touch(&self, epoch: u16) {
        let old = self.hint();
        let new = old.touched(epoch);
        if new != old {
            self.set_hint(new);
        }
    }

    /// The page was written (or discarded) at `epoch`: new data, so the recompressor's flags
    /// go (a claim in flight fails, and the page will be tried again once idle).
    pub(super) fn written(&self, epoch: u16) {
        let new = Hint::written(epoch);
        if new != self.hint() {
            self.set_hint(new);
        }
    }

    /// Replace the state; returns the old one.
    pub(super) fn replace(&mut self, state: PageState) -> PageState {
        self.changed = true;
        std::mem::replace(&mut self.state, state)
    }
}

impl Drop for EntryGuard<'_> {
    fn drop(&mut self) {
        let word = if self.changed {
            let word = self.state.encode();
            // A stored page's checksum was set for its data (`set_checksum`); any other
            // state's is its word's check, stored before the word that unlocks the entry.
            if !matches!(self.state, PageState::Stored { .. }) {
                self.checksum.store(word_check(word), Ordering::Relaxed);
            }
            word
        } else {
            self.word
        };
        // One store: the new state and the unlock. Release: the next locker sees everything
        // done under the lock (an object copied in before the entry names it).
        self.entry.store(word & !LOCKED, Ordering::Release);
    }
}

/// The word of an empty entry, unlocked.
const EMPTY_WORD: u64 = KIND_EMPTY << KIND_SHIFT;
const _: () = assert!(
    EMPTY_WORD == 0,
    "memory given back reads as zeros: empty, unlocked entries (see `table_memory`)"
);

/// The entries, hints and checksums, over memory committed a group of entries at a time
/// (`TableMemory`): an entry of a group that is not committed is empty, and only a writer that
/// pinned its group (`TableMemory::pin`) may lock it to make it anything else. Entry `index`
/// is at `TableMemory::place` in the three views, by the slot its group is in.
pub(super) struct PageTable {
    /// Entries of the device: `entries` may be longer (whole slots).
    pages: usize,
    entries: Words<AtomicU64>,
    /// One per entry.
    hints: Words<AtomicU16>,
    /// One per entry.
    checksums: Words<AtomicU32>,
    memory: TableMemory,
}

impl PageTable {
    /// The table of `pages` entries in `entries` with its `hints` and `checksums` (as many),
    /// whose memory `memory` commits, as a fresh or a resumed store left them.
    pub(super) fn new(
        pages: usize,
        entries: Words<AtomicU64>,
        hints: Words<AtomicU16>,
        checksums: Words<AtomicU32>,
        memory: TableMemory,
    ) -> Self {
        debug_assert!(entries.len() >= pages, "an entry per page");
        debug_assert_eq!(entries.len(), hints.len(), "one hint per entry");
        debug_assert_eq!(entries.len(), checksums.len(), "one checksum per entry");
        Self {
            pages,
            entries,
            hints,
            checksums,
            memory,
        }
    }

    pub(super) fn memory(&self) -> &TableMemory {
        &self.memory
    }

    /// Bytes of memory the table holds now.
    pub(super) fn bytes(&self) -> u64 {
        self.memory.committed_bytes()
    }

    /// Whether entry `index`'s group is committed (its entry may hold a page).
    pub(super) fn is_committed(&self, index: usize) -> bool {
        self.memory
            .is_committed_group(TableMemory::group_of(index as u64))
    }

    /// Whether entry `index`'s group has no memory: then its entry is empty. A group being
    /// given back (retiring) may still hold pages until `retire` has locked its entries.
    pub(super) fn is_absent(&self, index: usize) -> bool {
        self.memory.state(TableMemory::group_of(index as u64)) == GroupState::Absent
    }

    /// Whether some entry of `group` holds a page (a look without locks).
    pub(super) fn holds_pages(&self, group: usize) -> bool {
        let word = self.memory.word(group);
        GroupState::of(word) == GroupState::Committed
            && self.memory.indexes(group).any(|i| {
                self.entries[TableMemory::place(word, i)].load(Ordering::Relaxed) & !LOCKED
                    != EMPTY_WORD
            })
    }

    /// Give group `group`'s memory back if none of its entries holds a page; whether it was.
    /// Locks each of its entries, without waiting for one another thread holds: the caller is
    /// the real-time refill thread, and a holder it preempted on the same CPU would not run
    /// again while it spun (a real-time thread's yield lets no ordinary one run). Such a group
    /// is kept and looked at again at the next look.
    pub(super) fn retire(&self, group: usize) -> std::io::Result<bool> {
        // A look without locks first, so that a group in use costs a read of its entries.
        if self.memory.state(group) != GroupState::Committed || self.holds_pages(group) {
            return Ok(false);
        }
        if !self.memory.begin_retire(group) {
            // Pinned: by a writer, or held for a moment by a reader (`TableMemory::hold`),
            // after which nothing may mark it emptied again. Looked at again next time.
            self.memory.note_emptied(group);
            return Ok(false);
        }
        // Retiring, its slot stays put until it is absent.
        let word = self.memory.word(group);
        let indexes = self.memory.indexes(group);
        let places =
            TableMemory::place(word, indexes.start)..TableMemory::place(word, indexes.end - 1) + 1;
        // No writer has it pinned, and none can pin it now: only they make an empty entry
        // anything else, so once every entry is locked and empty it stays so (locked until
        // its slot is punched, or unlocked first where the slot is kept as a spare: see
        // `TableMemory::give_back`; lockers wait while it is retiring).
        let mut locked = places.start;
        let mut empty = true;
        while locked < places.end {
            let Some(word) = try_lock_word(&self.entries[locked]) else {
                self.unlock_empty(places.start..locked);
                self.memory.keep(group);
                self.memory.note_emptied(group);
                return Ok(false);
            };
            locked += 1;
            if word != EMPTY_WORD {
                empty = false;
                break;
            }
        }
        if empty {
            return match self.memory.give_back(group, || self.unlock_empty(places)) {
                Ok(()) => Ok(true),
                Err(error) => {
                    // What was punched reads as empty and unlocked.
                    self.memory.keep(group);
                    Err(error)
                }
            };
        }
        // The last one locked may hold a page: every other one was empty.
        let last = locked - 1;
        let last_word = self.entries[last].load(Ordering::Relaxed) & !LOCKED;
        self.unlock_empty(places.start..last);
        self.entries[last].store(last_word, Ordering::Release);
        self.memory.keep(group);
        Ok(false)
    }

    /// Unlock entries `range` (places), locked by `retire` and empty.
    fn unlock_empty(&self, range: std::ops::Range<usize>) {
        for i in range {
            self.entries[i].store(EMPTY_WORD, Ordering::Release);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.pages
    }

    /// Entry `index`'s word itself, lock bit and all, where its group is committed: for tests
    /// that break it as a flipped bit in RAM would.
    #[cfg(test)]
    pub(super) fn entry_word(&self, index: usize) -> Option<&AtomicU64> {
        let group = self.memory.word(TableMemory::group_of(index as u64));
        (index < self.pages && GroupState::of(group) == GroupState::Committed)
            .then(|| &self.entries[TableMemory::place(group, index)])
    }

    /// Every checksum word of the table, spare slots' included: for tests that leave in them
    /// what a binary before the entry checks would have.
    #[cfg(test)]
    pub(super) fn checksum_words(&self) -> &[AtomicU32] {
        &self.checksums
    }

    /// Entry `index`'s state, and whether a dead process left it locked (its checksum may then
    /// be one the dead process set for data it had not yet named). The lock bit stays until
    /// the caller settles the entry and lets go of it through `take_over_lock`: cleared here,
    /// a resume that failed (or was killed) before settling it would leave the next one an
    /// unlocked entry with a checksum nobody knows to be unsure. Only for a store nobody
    /// serves yet (resume). Its hint starts afresh (accessed now, on a clock that starts again
    /// at 0, no flags). An entry that is not `Stored` gets its word's check again (see
    /// `word_check`): the dead process may have set the check of a word it had not yet
    /// stored, or been a binary before the checks, which left whatever was there; a bit that
    /// flipped in such an entry before now passes unseen from here on. Only for an entry of a
    /// committed group.
    pub(super) fn recover(&self, index: usize) -> (PageState, bool) {
        let at = TableMemory::place(self.memory.word(TableMemory::group_of(index as u64)), index);
        let found = self.entries[at].load(Ordering::Acquire);
        self.hints[at].store(0, Ordering::Relaxed);
        let state = PageState::decode(found & !LOCKED);
        if !matches!(state, PageState::Stored { .. }) {
            let check = word_check(found & !LOCKED);
            if self.checksums[at].load(Ordering::Relaxed) != check {
                self.checksums[at].store(check, Ordering::Relaxed);
            }
        }
        (state, found & LOCKED != 0)
    }

    /// The lock a dead process left on entry `index` (see `recover`), taken over by this
    /// thread: the guard unlocks it when dropped, as one from `lock`. `None` if the entry is
    /// not locked or its group not committed. Only for a store nobody serves yet (resume).
    pub(super) fn take_over_lock(&self, index: u64) -> Option<EntryGuard<'_>> {
        let index = usize::try_from(index).ok().filter(|&i| i < self.pages)?;
        let group = self.memory.word(TableMemory::group_of(index as u64));
        if GroupState::of(group) != GroupState::Committed {
            return None;
        }
        let at = TableMemory::place(group, index);
        let found = self.entries[at].load(Ordering::Acquire);
        if found & LOCKED == 0 {
            return None;
        }
        let word = found & !LOCKED;
        Some(self.guard(at, word))
    }

    /// The guard of the entry at `at`, which this thread holds locked, unlocked `word`.
    fn guard(&self, at: usize, word: u64) -> EntryGuard<'_> {
        EntryGuard {
            entry: &self.entries[at],
            hint: &self.hints[at],
            checksum: &self.checksums[at],
            word,
            state: PageState::decode(word),
            changed: false,
        }
    }

    /// Entry `index`'s state and hint without locking it: a guess, for picking pages to look
    /// at under the lock (the recompressor's scan). `None` while the entry is locked.
    /// Also `None` for an entry of a group that is not committed (it is empty).
    pub(super) fn peek(&self, index: usize) -> Option<(PageState, Hint)> {
        if index >= self.pages {
            return None;
        }
        let group = TableMemory::group_of(index as u64);
        // A plain look first: a scan passes over every group, most of them absent.
        if GroupState::of(self.memory.word(group)) != GroupState::Committed {
            return None;
        }
        let held = self.memory.hold(group);
        if GroupState::of(held.word()) != GroupState::Committed {
            return None;
        }
        let at = TableMemory::place(held.word(), index);
        let word = self.entries[at].load(Ordering::Relaxed);
        if word & LOCKED != 0 {
            return None;
        }
        let hint = Hint(self.hints[at].load(Ordering::Relaxed));
        Some((PageState::decode(word), hint))
    }

    /// Lock entry `index` (which the caller has bounds-checked); `None` if its group is not
    /// committed (the entry is empty, and has no memory to lock). While its group is being
    /// given back (`retire`), waits to see whether it is.
    pub(super) fn lock(&self, index: u64) -> Option<EntryGuard<'_>> {
        // An index past the table (impossible for requests, which are range-checked, but a
        // pending slot's index is read from shared memory) fails the lookup.
        let index = usize::try_from(index).unwrap_or(usize::MAX);
        if index >= self.pages {
            return None;
        }
        let group = TableMemory::group_of(index as u64);
        let mut spins = 0u32;
        let (at, word) = loop {
            // Held until the entry's lock is taken (or not): meanwhile the group stays in its
            // slot, and once this thread has the lock, `retire` keeps the group.
            let held = self.memory.hold(group);
            match GroupState::of(held.word()) {
                GroupState::Absent => return None,
                GroupState::Retiring => {}
                GroupState::Committed => {
                    let at = TableMemory::place(held.word(), index);
                    let entry = &self.entries[at];
                    let cur = entry.load(Ordering::Relaxed);
                    if cur & LOCKED == 0
                        && entry
                            .compare_exchange_weak(
                                cur,
                                cur | LOCKED,
                                Ordering::AcqRel,
                                Ordering::Relaxed,
                            )
                            .is_ok()
                    {
                        break (at, cur);
                    }
                }
            }
            drop(held);
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        };
        Some(self.guard(at, word))
    }
}

/// Lock `entry` whatever its group's state (for `retire`): its word, without the lock bit;
/// `None` if another thread still holds it after a short spin.
fn try_lock_word(entry: &AtomicU64) -> Option<u64> {
    for _ in 0..=SPINS_BEFORE_YIELD {
        let cur = entry.load(Ordering::Relaxed);
        if cur & LOCKED == 0
            && entry
                .compare_exchange_weak(cur, cur | LOCKED, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            return Some(cur);
        }
        std::hint::spin_loop();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of `pages` entries laid out as a store's (each region on whole pages), with
    /// every group committed.
    fn table(pages: usize) -> PageTable {
        let t = uncommitted_table(pages);
        for group in 0..t.memory().groups() {
            t.memory().commit(group).unwrap();
        }
        t
    }

    fn uncommitted_table(pages: usize) -> PageTable {
        laid_out_table(pages, false)
    }

    /// A table of `pages` entries as a store of layout version 5 or 6 lays it out (whole groups,
    /// placed by a group map: see `table_memory`) if `mapped`, else as versions 3 and 4 do;
    /// every group absent.
    fn laid_out_table(pages: usize, mapped: bool) -> PageTable {
        use super::super::table_memory::{Region, Slots, GROUP_PAGES};
        let round = |bytes: usize| bytes.next_multiple_of(crate::codec::PAGE_SIZE);
        let groups = TableMemory::groups_of(pages);
        let len = if mapped { groups * GROUP_PAGES } else { pages };
        let (hints, checksums) = (round(len * 8), round(len * 8) + round(len * 2));
        let map = checksums + round(len * 4);
        let segment = crate::mem::Segment::private(map + round(groups * 4)).unwrap();
        let memory = TableMemory::new(
            std::sync::Arc::clone(&segment),
            Region {
                offset: 0,
                width: 8,
            },
            [
                Region {
                    offset: hints,
                    width: 2,
                },
                Region {
                    offset: checksums,
                    width: 4,
                },
            ],
            pages,
            mapped.then(|| Slots::new(segment.words_of::<AtomicU32>(map, groups).unwrap(), groups)),
        );
        PageTable::new(
            pages,
            segment.words(0, len).unwrap(),
            segment.words_of::<AtomicU16>(hints, len).unwrap(),
            segment.words_of::<AtomicU32>(checksums, len).unwrap(),
            memory,
        )
    }

    #[test]
    fn an_entry_of_a_group_not_committed_is_empty_and_holds_no_memory() {
        use super::super::table_memory::GROUP_PAGES;
        let t = uncommitted_table(2 * GROUP_PAGES + 5);
        assert_eq!(t.memory().groups(), 3);
        assert_eq!(t.bytes(), 0);
        assert!(t.lock(0).is_none());
        assert_eq!(t.peek(GROUP_PAGES), None);
        t.memory().commit(1).unwrap();
        // 16 KiB of entries, 4 of hints, 8 of checksums.
        assert_eq!(t.bytes(), 28 << 10);
        t.lock(GROUP_PAGES as u64)
            .unwrap()
            .replace(PageState::same(7).unwrap());
        assert_eq!(
            t.peek(GROUP_PAGES).map(|(state, _)| state),
            Some(PageState::Same(7))
        );
        assert!(t.lock(GROUP_PAGES as u64 - 1).is_none());
        // The last group's five entries take a page of each.
        t.memory().commit(2).unwrap();
        assert_eq!(t.bytes(), (28 << 10) + 3 * crate::codec::PAGE_SIZE as u64);
    }

    #[test]
    fn a_group_is_given_back_only_when_every_entry_is_empty_and_no_writer_pinned_it() {
        use super::super::table_memory::GROUP_PAGES;
        let t = table(3 * GROUP_PAGES);
        let full = t.bytes();
        let last = 2 * GROUP_PAGES as u64 - 1;
        t.lock(last).unwrap().replace(PageState::same(9).unwrap());
        // Group 1 holds a page: kept, the page and every entry still unlocked.
        assert!(!t.retire(1).unwrap());
        assert_eq!(t.lock(last).unwrap().state(), PageState::Same(9));
        assert!(t.lock(GROUP_PAGES as u64).is_some());
        // Group 2 is pinned by a writer: kept.
        assert!(t.memory().pin(2));
        assert!(!t.retire(2).unwrap());
        t.memory().unpin(2);
        // Group 0 is empty but one of its entries is locked (a reader of an empty page): kept
        // without a wait (the holder may be a thread the caller preempted), to be looked at
        // again.
        let held = t.lock(5).unwrap();
        assert!(!t.retire(0).unwrap());
        drop(held);
        assert!(t.lock(4).is_some(), "left locked");
        assert!(t.memory().groups_to_look_at().any(|group| group == 0));
        // Group 0 is empty: its memory goes, and its entries read as empty without it.
        assert!(t.retire(0).unwrap());
        assert_eq!(t.bytes(), full - (28 << 10));
        assert!(t.lock(0).is_none());
        assert!(!t.memory().pin(0));
        // Once the last page of group 1 is emptied, it goes too; committed again, it works.
        t.lock(last).unwrap().replace(PageState::Empty);
        assert!(t.retire(1).unwrap());
        assert!(t.retire(2).unwrap());
        assert_eq!(t.bytes(), 0);
        t.memory().commit(1).unwrap();
        assert_eq!(t.lock(last).unwrap().state(), PageState::Empty);
        assert!(t.memory().pin(1));
    }

    #[test]
    fn a_group_is_not_given_back_while_a_thread_holds_it() {
        use super::super::table_memory::GROUP_PAGES;
        let t = table(2 * GROUP_PAGES);
        let held = t.memory().hold(0);
        assert!(!t.retire(0).unwrap(), "held");
        drop(held);
        assert!(
            t.memory().groups_to_look_at().any(|group| group == 0),
            "looked at again"
        );
        assert!(t.retire(0).unwrap());
        // A hold of a group given back sees it absent.
        assert_eq!(
            GroupState::of(t.memory().hold(0).word()),
            GroupState::Absent
        );
        assert!(t.retire(1).unwrap(), "every hold let go");
    }

    /// Readers and looks without the lock racing a group's memory given back and committed
    /// again, over and over: once `retire` has given the memory back, none of them touches it
    /// (a touch would fault a zeroed page in, in a thread that serves I/O). Before they held
    /// the group (until 2026-12-06) a locker could touch an entry between its look at the
    /// group's state and its lock; that window is a few instructions, so this test catches
    /// such a touch in some runs, not every run.
    #[test]
    fn lockers_racing_a_group_given_back_never_touch_its_memory() {
        use super::super::table_memory::GROUP_PAGES;
        let t = laid_out_table(2 * GROUP_PAGES, false);
        let m = t.memory();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for offset in [7usize, 1500] {
                let (t, stop) = (&t, &stop);
                s.spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        drop(t.lock(offset as u64));
                        let _ = t.peek(offset + 1);
                    }
                });
            }
            let touched = (0..500).find(|_| {
                m.commit(0).unwrap();
                while !t.retire(0).unwrap() {
                    std::thread::yield_now();
                }
                let touched = m.slot_in_memory(0).unwrap();
                std::thread::yield_now();
                touched
            });
            // The lockers stop before any assertion: a panic here would leave them running.
            stop.store(true, Ordering::Relaxed);
            assert_eq!(
                touched, None,
                "the round in which a slot given back was touched"
            );
        });
        assert!(
            !m.slot_in_memory(0).unwrap(),
            "touched after the last round"
        );
    }

    #[test]
    #[allow(clippy::cast_possible_truncation, reason = "a few groups of entries")]
    fn a_writer_takes_a_spare_slot_and_a_group_given_back_leaves_its_slot_spare() {
        use super::super::table_memory::{GROUP_PAGES, SPARE_SLOTS};
        const SLOT_BYTES: u64 = 28 << 10;
        let group = GROUP_PAGES as u64;
        let t = laid_out_table(8 * GROUP_PAGES, true);
        let m = t.memory();
        assert!(
            !m.take_spare(3),
            "no spare before the refill thread commits them"
        );
        assert_eq!(m.keep_spares(|_| ()).unwrap(), SPARE_SLOTS);
        let spares = SPARE_SLOTS as u64 * SLOT_BYTES;
        assert_eq!(t.bytes(), spares);
        // Group 6 takes a spare (slot 0): committed at once, with no memory committed for it.
        assert!(m.take_spare(6));
        assert_eq!(t.bytes(), spares);
        let page = 6 * group + 5;
        t.lock(page).unwrap().replace(PageState::same(42).unwrap());
        // Group 2 gets a slot committed for it (slot 4: the refill thread's way).
        m.commit(2).unwrap();
        assert_eq!(t.bytes(), spares + SLOT_BYTES);
        t.lock(2 * group)
            .unwrap()
            .replace(PageState::same(7).unwrap());
        // Group 6 emptied and given back: its slot is a spare again (three were left).
        t.lock(page).unwrap().replace(PageState::Empty);
        assert!(t.retire(6).unwrap());
        assert!(t.lock(page).is_none());
        assert_eq!(t.bytes(), spares + SLOT_BYTES);
        // That slot serves group 1 now: every entry empty and unlocked, group 6 still absent.
        assert!(m.take_spare(1));
        assert!((group..2 * group).all(|i| t.lock(i).unwrap().state() == PageState::Empty));
        t.lock(group + 5)
            .unwrap()
            .replace(PageState::same(1).unwrap());
        assert!(t.lock(page).is_none());
        assert_eq!(t.peek(page as usize), None);
        assert_eq!(
            t.peek(group as usize + 5).map(|(state, _)| state),
            Some(PageState::Same(1))
        );
        assert_eq!(t.lock(2 * group).unwrap().state(), PageState::Same(7));
        // With every spare ready, a group given back gives its memory back.
        assert_eq!(m.keep_spares(|_| ()).unwrap(), 1);
        let before = t.bytes();
        t.lock(2 * group).unwrap().replace(PageState::Empty);
        assert!(t.retire(2).unwrap());
        assert_eq!(t.bytes(), before - SLOT_BYTES);
        assert!(t.lock(2 * group).is_none());
        // Committed again (in the slot it left), it reads empty.
        m.commit(2).unwrap();
        assert_eq!(t.lock(2 * group + 1).unwrap().state(), PageState::Empty);
    }

    #[test]
    fn with_every_slot_in_use_keeping_spares_makes_no_room_for_memory_it_will_not_commit() {
        use super::super::table_memory::{GROUP_PAGES, SPARE_SLOTS};
        let t = laid_out_table(8 * GROUP_PAGES, true);
        let m = t.memory();
        let asked = std::cell::Cell::new(0);
        let before = |bytes: usize| asked.set(asked.get() + bytes);
        // Room is made for each spare committed, as much as it takes.
        assert_eq!(m.keep_spares(before).unwrap(), SPARE_SLOTS);
        assert_eq!(asked.get() as u64, t.bytes());
        for group in 0..8 {
            m.commit(group).unwrap();
        }
        // Every slot holds a group now: no spare can be committed, and no room is made for
        // one (with memory short, room is reserve memory given back, to be committed again:
        // every pass of the refill thread did so once the table was whole, 2026-11-30).
        asked.set(0);
        assert_eq!(m.keep_spares(before).unwrap(), 0);
        assert_eq!(asked.get(), 0);
    }

    #[test]
    #[allow(clippy::cast_possible_truncation, reason = "a few groups of entries")]
    fn lockers_racing_groups_moved_between_slots_see_only_their_own_entries() {
        use super::super::table_memory::GROUP_PAGES;
        let group = GROUP_PAGES as u64;
        let t = laid_out_table(4 * GROUP_PAGES, true);
        let m = t.memory();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            // Groups 0 and 1 given back and placed again over and over, in whichever slot is
            // spare: a page written in one must never be seen through the other.
            s.spawn(|| {
                for _ in 0..2000 {
                    m.keep_spares(|_| ()).unwrap();
                    for g in [0, 1] {
                        let _ = t.retire(g);
                        m.take_spare(g);
                    }
                }
                stop.store(true, Ordering::Relaxed);
            });
            let lockers: Vec<_> = [0u64, 1]
                .into_iter()
                .map(|g| {
                    let (t, stop) = (&t, &stop);
                    s.spawn(move || {
                        let mine = PageState::same(g + 100).unwrap();
                        let (mut checked, mut after_stop) = (0u64, 0u32);
                        // Past the mover's end only until the first check (bounded).
                        while !stop.load(Ordering::Relaxed)
                            || (checked == 0 && after_stop < 100_000)
                        {
                            after_stop += u32::from(stop.load(Ordering::Relaxed));
                            let i = g * group + 9;
                            if !m.pin(g as usize) {
                                continue;
                            }
                            if let Some(mut entry) = t.lock(i) {
                                assert!(
                                    matches!(entry.state(), PageState::Empty)
                                        || entry.state() == mine
                                );
                                entry.replace(mine);
                            }
                            if let Some(mut entry) = t.lock(i) {
                                assert_eq!(entry.state(), mine, "group {g}");
                                entry.replace(PageState::Empty);
                                checked += 1;
                            }
                            m.unpin(g as usize);
                        }
                        checked
                    })
                })
                .collect();
            for locker in lockers {
                assert!(locker.join().unwrap() > 0, "a locker never got its entry");
            }
        });
    }

    #[test]
    fn states_survive_encoding() {
        let t = table(4);
        let states = [
            PageState::same(0).unwrap(),
            PageState::Pending {
                batch: 1,
                slot: 999_999,
            },
            PageState::Stored {
                handle: Handle::from_bits(0x1fff_1234_5678),
                len: 4096,
                encoding: Encoding::Zstd,
            },
            PageState::same(u64::MAX).unwrap(),
            PageState::same(0x07ff_ffff_ffff_ffff).unwrap(),
            PageState::Lost,
            PageState::Empty,
        ];
        for s in states {
            t.lock(2).unwrap().replace(s);
            assert_eq!(t.lock(2).unwrap().state(), s);
        }
        assert_eq!(t.lock(3).unwrap().state(), PageState::Empty);
        // Its one group: a page each of entries, hints and checksums.
        assert_eq!(t.bytes(), 3 * crate::codec::PAGE_SIZE as u64);
        assert_eq!(PageState::same(0x8000_0000_0000_0000), None);
        assert_eq!(PageState::same(0x0fff_ffff_ffff_ffff), None);
        assert_eq!(PageState::same(0x1234_5678_9abc_def0), None);
    }

    /// A lock left by a dead process is seen by every recovery until the entry is settled
    /// and its lock taken over and let go (a resume that failed before that leaves it for the
    /// next one).
    #[test]
    fn a_lock_left_by_a_dead_process_stays_until_taken_over() {
        let t = table(2);
        t.lock(1).unwrap().replace(PageState::same(7).unwrap());
        std::mem::forget(t.lock(1).unwrap());
        assert_eq!(t.recover(1), (PageState::Same(7), true));
        assert_eq!(t.recover(1), (PageState::Same(7), true), "seen again");
        assert!(t.take_over_lock(0).is_none(), "entry 0 is not locked");
        let mut taken = t.take_over_lock(1).unwrap();
        assert_eq!(taken.state(), PageState::Same(7));
        taken.replace(PageState::same(9).unwrap());
        drop(taken);
        assert_eq!(t.recover(1), (PageState::Same(9), false));
        assert_eq!(t.lock(1).unwrap().state(), PageState::Same(9));
    }

    #[test]
    fn reads_move_the_access_time_and_keep_flags_writes_clear_them() {
        let t = table(2);
        let g = t.lock(0).unwrap();
        g.written(5);
        assert_eq!(g.hint(), Hint::written(5));
        g.set_hint(g.hint().with_flags(true, true));
        g.touch(9);
        assert_eq!(g.hint(), Hint::written(9).with_flags(true, true));
        assert!(g.hint().settled());
        g.written(11);
        assert_eq!(g.hint(), Hint::written(11));
        assert!(!g.hint().settled());
        drop(g);
        assert_eq!(t.peek(0).map(|(_, h)| h.epoch()), Some(11));
        let held = t.lock(0).unwrap();
        assert_eq!(t.peek(0), None, "a locked entry is not peeked");
        drop(held);
        t.lock(1)
            .unwrap()
            .set_hint(Hint::written(3).with_flags(true, false));
        t.recover(1);
        assert_eq!(
            t.lock(1).unwrap().hint(),
            Hint::default(),
            "a resumed hint starts afresh"
        );
    }

    #[test]
    fn ages_wrap_with_the_epoch() {
        let clock = IdleClock::default();
        assert_eq!(clock.now(), 0);
        clock.set(u64::from(EPOCH_MASK) + 3);
        assert_eq!(clock.now(), 2);
        let hint = Hint::written(EPOCH_MASK - 1);
        assert_eq!(hint.age(clock.now()), 4, "ages count across the wrap");
        assert_eq!(Hint::written(7).age(7), 0);
        assert_eq!(Hint::written(7).age(20), 13);
        assert_eq!(
            Hint::written(7).with_flags(true, true).age(20),
            13,
            "flags are not part of the age"
        );
    }

    #[test]
    fn lock_excludes_other_threads() {
        let t = table(1);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        let mut g = t.lock(0).unwrap();
                        let n = match g.state() {
                            PageState::Same(n) => n,
                            _ => 0,
                        };
                        g.replace(PageState::Same(n + 1));
                    }
                });
            }
        });
        assert_eq!(t.lock(0).unwrap().state(), PageState::Same(40_000));
    }
}
