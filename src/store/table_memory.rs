//! The page table's memory, committed a group of entries at a time as the device is written
//! and given back when a group holds no page again, as the arena's memory follows the pages.
//!
//! Why: the table, its idle hints and checksums take 14 bytes per device page (3.5 MiB per
//! GiB, 28 MiB for an 8 GiB device), locked, whether or not swap ever reaches that far; on an
//! idle daemon it was the largest part of its memory. A group of `GROUP_PAGES` entries (8 MiB
//! of device, 28 KiB of table) is committed when the first write reaches it, by the refill
//! thread (the I/O path never commits memory itself: see `reserve`), with the next groups
//! asked for as soon as a write lands in one, so that writes moving through the device do not
//! wait (see `TABLE_GROUPS_AHEAD` in `admission`). Swap spreads its 2 MiB clusters over the
//! device (Linux 6.12 hands out every 32nd first), so while it fills, the groups committed
//! are about twice those holding pages, and their memory comes back as groups empty.
//!
//! Each group has one word: its state in the low bits and, above them, how many threads have
//! it pinned: a writer pins the groups of its request before it touches their entries (`pin`),
//! and every thread that touches an entry holds its group while it does (`hold`: a locker
//! until it has the entry's lock, a look without the lock for as long as it looks). Giving a
//! group back (`PageTable::retire`) takes it from committed with no pins to retiring in one
//! compare-and-swap, locks every entry, checks that all are empty, and punches the group's
//! memory out (`give_back`). A group that is not committed holds no memory and reads as empty:
//! readers, discards and slot frees never wait for it. Why a reader holds its group, and does
//! not just look at its state first: between that look and its touch the group could go, and
//! the touch of a punched page makes the kernel allocate a zeroed one, in a thread that serves
//! I/O, near OOM (the VM's near-OOM stage checks that those threads allocate nothing).
//!
//! Where a group's memory lies: in a store of layout version 5 or 6 any *slot* of the table's
//! regions (a group's worth of entries, hints and checksums) may hold any group, and a small
//! map in the segment says which (`Slots`); the refill thread keeps `SPARE_SLOTS` slots
//! committed and empty, and a writer that reaches a group with no memory takes one at once,
//! without a system call. Why: a write that reaches a new group otherwise waits for the
//! refill thread to fault its seven pages in, and near OOM each of those faults sleeps in the
//! kernel's reclaim throttle (a second at a time: the refill thread is an I/O flusher), while
//! every tag of the queue fills with writes to the same swap cluster and swap-out stops (seen
//! in the VM: a write starved 5 s with the refill thread in one group's commit, in the
//! three-process swap run of the clean-clone CI; 5 to 15 s in the near-OOM stage). Spares are
//! the table's reserve, as committed chunks are the arena's. A group given back leaves its
//! slot as a spare (if fewer are kept) rather than to the system. In a store of version 3 or
//! 4, group `g` is slot `g` (the layout those binaries made), and nothing is spare.
//!
//! A resumed store of version 5 or 6 finds its groups in the map, commits each one's slot (a
//! process may have died committing it), keeps up to `SPARE_SLOTS` other slots with memory as
//! spares (every entry empty) and gives back the memory of the rest. One
//! of version 3 or 4 finds its committed groups by asking which of their pages are in memory
//! (`Segment::any_in_memory`: the segment's file, which allocates nothing), and commits the
//! rest of a group a process died in the middle of committing. A store made by a binary that
//! committed the whole table up front resumes with every group committed.

#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::nanos;
use crate::codec::PAGE_SIZE;
use crate::mem::{Segment, Words};

/// Entries per group: 16 KiB of entries, 4 KiB of hints, 8 KiB of checksums (whole pages
/// each), 8 MiB of device (four of swap's clusters).
pub(super) const GROUP_PAGES: usize = 2048;

/// Slots the refill thread keeps committed and empty for writers reaching new groups (a store
/// of layout version 5 or 6): 112 KiB. Groups asked for ahead of writes (see `admission`) cover a
/// swap storm while memory is plentiful; the spares cover writes that outrun them, or reach a
/// group when memory is short (then nothing is asked for ahead), and the refill thread, woken
/// by each one taken, replaces it in its next pass.
pub(super) const SPARE_SLOTS: usize = 4;

/// A group's state, the low bits of its word.
const STATE_MASK: u64 = 0b11;
/// No memory: every entry is empty.
const ABSENT: u64 = 0;
/// No memory yet; a writer asked the refill thread for it.
const WANTED: u64 = 1;
const COMMITTED: u64 = 2;
/// Being given back: entries are being locked and checked (`PageTable::retire`).
const RETIRING: u64 = 3;
/// Bit 2: an entry of the group was emptied since the last look for empty groups.
const EMPTIED: u64 = 1 << 2;
/// Bit 3: committed and no writer has pinned it since (asked for ahead of writes that have
/// not come, or adopted on resume).
const UNWRITTEN: u64 = 1 << 3;
/// Pins count from bit 4 (up to bit 31: writers and holders in flight are far fewer than
/// 2^28).
const PIN: u64 = 1 << 4;
/// The slot holding a committed (or retiring) group's memory: the high 32 bits, so that a
/// locker reads the state and the place of an entry in one load.
const SLOT_SHIFT: u32 = 32;
const STATE_AND_SLOT: u64 = STATE_MASK | (u64::MAX << SLOT_SHIFT);

/// A slot's state (`Slots::states`).
/// No memory.
const SLOT_FREE: u8 = 0;
/// Committed, empty (every entry empty and unlocked), held by no group.
const SLOT_SPARE: u8 = 1;
/// Holds a group.
const SLOT_USED: u8 = 2;
/// Being committed by the thread that took it free.
const SLOT_BUSY: u8 = 3;

/// How often groups are looked at for giving back (`groups_to_look_at`): their memory is
/// back well within the 2 s in which a daemon whose swapped pages were freed is to be back at
/// its idle footprint.
const LOOK_PERIOD: Duration = Duration::from_millis(250);

/// Groups committed that no write reached are looked at for giving back once no group was
/// asked for this long: the writes moving through the device have stopped, and what was
/// asked for ahead of them is not needed soon.
const QUIET_FOR: Duration = Duration::from_secs(1);

/// A hold on a group (`TableMemory::hold`), let go when dropped.
pub(super) struct Held<'a> {
    word: &'a AtomicU64,
    held: u64,
}

impl Held<'_> {
    /// The group's word when the hold was taken.
    pub(super) fn word(&self) -> u64 {
        self.held
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        // Release: every touch of the group's entries comes before a retirer sees no pin.
        self.word.fetch_sub(PIN, Ordering::Release);
    }
}

/// What a group is, for the table's lockers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GroupState {
    /// No memory: its entries are empty.
    Absent,
    Committed,
    /// Being given back: wait (it ends absent or committed again).
    Retiring,
}

impl GroupState {
    /// The state in a group's word.
    pub(super) fn of(word: u64) -> Self {
        match word & STATE_MASK {
            COMMITTED => GroupState::Committed,
            RETIRING => GroupState::Retiring,
            _ => GroupState::Absent,
        }
    }
}

/// The bytes of one kind of per-page data (entries, hints or checksums) in the segment.
#[derive(Clone, Copy, Debug)]
pub(super) struct Region {
    pub(super) offset: usize,
    /// Bytes per device page.
    pub(super) width: usize,
}

/// Where groups' memory may lie, in a store of layout version 5 or 6 (see the module's comment).
pub(super) struct Slots {
    /// Per group: its slot plus one, 0 for none. Written while `placing` is held, before the
    /// group's word names the slot and after it no longer does: what a resumed store reads.
    map: Words<AtomicU32>,
    /// Per slot: `SLOT_FREE`, `SLOT_SPARE`, `SLOT_USED` or `SLOT_BUSY`.
    states: Box<[AtomicU8]>,
    spares: AtomicUsize,
    /// Held while a group takes a slot or gives one up, so that the map and the group's word
    /// agree, and no two threads give one group two slots.
    placing: Mutex<()>,
}

impl Slots {
    /// The slots of a table of `groups` groups, with `map` (one word per group) in its segment.
    pub(super) fn new(map: Words<AtomicU32>, groups: usize) -> Self {
        Self {
            map,
            states: (0..groups).map(|_| AtomicU8::new(SLOT_FREE)).collect(),
            spares: AtomicUsize::new(0),
            placing: Mutex::new(()),
        }
    }

    /// Take a slot in state `from` for a new state `to`; `None` if none is in `from`. A plain
    /// load before each compare-and-swap: a writer taking a spare scans every slot of a large
    /// table, and a locked instruction per slot would cost it about a millisecond per 10^5.
    fn take(&self, from: u8, to: u8) -> Option<usize> {
        self.states.iter().position(|state| {
            state.load(Ordering::Relaxed) == from
                && state
                    .compare_exchange(from, to, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
        })
    }
}

pub(super) struct TableMemory {
    segment: Arc<Segment>,
    /// Entries first: a group is committed once its entries' pages are (see `adopt`).
    entries: Region,
    others: [Region; 2],
    pages: usize,
    groups: Box<[AtomicU64]>,
    /// `None`: group `g` is slot `g` (layout versions 3 and 4).
    slots: Option<Slots>,
    /// Some group is `WANTED`.
    wanted: AtomicBool,
    /// Some group is marked `EMPTIED`.
    emptied: AtomicBool,
    /// Some group may be `UNWRITTEN`.
    unwritten: AtomicBool,
    /// When a group was last asked for (`want`), in nanoseconds since `epoch`.
    last_want_ns: AtomicU64,
    /// When `groups_to_look_at` may look again, in nanoseconds since `epoch`.
    next_look_ns: AtomicU64,
    epoch: Instant,
    committed_bytes: AtomicU64,
}

impl TableMemory {
    /// The memory of a table of `pages` entries: `entries`, and the hints and checksums beside
    /// them, in `segment`, placed by `slots` (`None`: group `g` in slot `g`); every group absent.
    /// With `slots`, each region holds a whole group's worth per group.
    pub(super) fn new(
        segment: Arc<Segment>,
        entries: Region,
        others: [Region; 2],
        pages: usize,
        slots: Option<Slots>,
    ) -> Self {
        Self {
            segment,
            entries,
            others,
            pages,
            groups: (0..Self::groups_of(pages))
                .map(|_| AtomicU64::new(ABSENT))
                .collect(),
            slots,
            wanted: AtomicBool::new(false),
            emptied: AtomicBool::new(false),
            unwritten: AtomicBool::new(false),
            last_want_ns: AtomicU64::new(0),
            next_look_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            committed_bytes: AtomicU64::new(0),
        }
    }

    /// Groups of a table of `pages` entries.
    pub(super) fn groups_of(pages: usize) -> usize {
        pages.div_ceil(GROUP_PAGES)
    }

    /// The group of entry `index`.
    pub(super) fn group_of(index: u64) -> usize {
        // Entries are fewer than 2^32 (checked when a store is made), and so are groups.
        usize::try_from(index / GROUP_PAGES as u64).unwrap_or(usize::MAX)
    }

    pub(super) fn groups(&self) -> usize {
        self.groups.len()
    }

    /// The entries of `group`.
    pub(super) fn indexes(&self, group: usize) -> Range<usize> {
        group * GROUP_PAGES..((group + 1) * GROUP_PAGES).min(self.pages)
    }

    /// Group `group`'s word: its state (`GroupState::of`) and, committed or retiring, the
    /// slot its entries are in (`place`).
    pub(super) fn word(&self, group: usize) -> u64 {
        self.groups[group].load(Ordering::Acquire)
    }

    /// Hold `group` while touching its entries, whatever its state: its word as held. A group
    /// held while committed stays committed, in the slot the word names, until the hold is let
    /// go (`begin_retire` takes only a group nobody pins; placing changes only a group that is
    /// not committed), so its entries' memory is there. Unlike a writer's `pin`, a hold leaves
    /// `UNWRITTEN` as it is: a read writes nothing.
    pub(super) fn hold(&self, group: usize) -> Held<'_> {
        let word = &self.groups[group];
        Held {
            word,
            held: word.fetch_add(PIN, Ordering::AcqRel),
        }
    }

    /// Where entry `index` is in the table's regions, for its group's `word` (committed or
    /// retiring).
    pub(super) fn place(word: u64, index: usize) -> usize {
        Self::slot_of(word) * GROUP_PAGES + index % GROUP_PAGES
    }

    /// The slot a group's `word` names (committed or retiring).
    fn slot_of(word: u64) -> usize {
        usize::try_from(word >> SLOT_SHIFT).unwrap_or(usize::MAX)
    }

    pub(super) fn state(&self, group: usize) -> GroupState {
        GroupState::of(self.word(group))
    }

    pub(super) fn is_committed_group(&self, group: usize) -> bool {
        self.state(group) == GroupState::Committed
    }

    /// Bytes of table memory committed now (spare slots included).
    pub(super) fn committed_bytes(&self) -> u64 {
        self.committed_bytes.load(Ordering::Relaxed)
    }

    /// `(offset, len)` of the memory of slot `slot` in each region, entries first: whole pages,
    /// shared with no other slot (a slot's entries, hints and checksums are 16, 4 and 8 KiB,
    /// and each region starts on a page and ends on one, see `layout`). With `Slots` each slot
    /// is a whole group's worth; otherwise slot `g` is group `g`'s entries.
    fn ranges(&self, slot: usize) -> [(usize, usize); 3] {
        let Range { start, end } = if self.slots.is_some() {
            slot * GROUP_PAGES..(slot + 1) * GROUP_PAGES
        } else {
            self.indexes(slot)
        };
        let range = |r: Region| {
            let first = r.offset + start * r.width / PAGE_SIZE * PAGE_SIZE;
            let last = (r.offset + end * r.width).next_multiple_of(PAGE_SIZE);
            (first, last - first)
        };
        [
            range(self.entries),
            range(self.others[0]),
            range(self.others[1]),
        ]
    }

    fn slot_bytes(&self, slot: usize) -> usize {
        self.ranges(slot).iter().map(|&(_, len)| len).sum()
    }

    /// Fault slot `slot`'s memory in.
    fn commit_slot(&self, slot: usize) -> std::io::Result<()> {
        // Hints and checksums first, the entries last: a group of a store without `Slots`
        // counts as committed on resume once any of its entries' pages is in memory.
        let mut ranges = self.ranges(slot);
        ranges.rotate_left(1);
        for (offset, len) in ranges {
            self.segment.commit(offset, len)?;
        }
        Ok(())
    }

    /// Whether every entry of slot `slot` is empty and unlocked (a zero word: see `table`).
    fn slot_is_empty(&self, slot: usize) -> std::io::Result<bool> {
        let [(offset, len), ..] = self.ranges(slot);
        let entries = self.segment.words(offset, len / 8)?;
        Ok(entries
            .iter()
            .all(|entry| entry.load(Ordering::Relaxed) == 0))
    }

    /// Zero what lies beside slot `slot`'s (empty) entries, as in a slot fresh from the
    /// system: the hints, and the checksums, where an empty entry's check is 0 (see
    /// `table::word_check`) and a binary before the checks left the checksums of its last
    /// stored pages, which the entries' reads would take for flipped bits.
    fn clear_beside_entries(&self, slot: usize) -> std::io::Result<()> {
        let [_, beside @ ..] = self.ranges(slot);
        for (offset, len) in beside {
            for word in self.segment.words(offset, len / 8)?.iter() {
                if word.load(Ordering::Relaxed) != 0 {
                    word.store(0, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// Punch slot `slot`'s entries alone: what a process killed while giving the slot back
    /// (`decommit_slot`, the entries first) leaves.
    #[cfg(test)]
    pub(super) fn punch_entries_only(&self, slot: usize) -> std::io::Result<()> {
        let [(offset, len), ..] = self.ranges(slot);
        self.segment.decommit(offset, len)
    }

    /// Whether any page of slot `slot` is in memory (asked of the segment's file, which
    /// allocates nothing).
    pub(super) fn slot_in_memory(&self, slot: usize) -> std::io::Result<bool> {
        for (offset, len) in self.ranges(slot) {
            if self.segment.any_in_memory(offset, len)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Give slot `slot`'s memory back: it reads as zeros (empty, unlocked entries) after.
    fn decommit_slot(&self, slot: usize) -> std::io::Result<()> {
        for (offset, len) in self.ranges(slot) {
            self.segment.decommit(offset, len)?;
        }
        Ok(())
    }

    /// Pin `group` for a writer if it is committed: until `unpin`, it stays committed.
    pub(super) fn pin(&self, group: usize) -> bool {
        let old = self.groups[group].fetch_add(PIN, Ordering::AcqRel);
        if old & STATE_MASK == COMMITTED {
            if old & UNWRITTEN != 0 {
                self.groups[group].fetch_and(!UNWRITTEN, Ordering::AcqRel);
            }
            return true;
        }
        self.groups[group].fetch_sub(PIN, Ordering::AcqRel);
        false
    }

    pub(super) fn unpin(&self, group: usize) {
        self.groups[group].fetch_sub(PIN, Ordering::AcqRel);
    }

    /// Ask the refill thread to commit `group` (if it is absent); true if this call asked.
    pub(super) fn want(&self, group: usize) -> bool {
        let asked = self.groups[group]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
                (word & STATE_MASK == ABSENT).then_some(word | WANTED)
            })
            .is_ok();
        if asked {
            self.last_want_ns.store(self.now_ns(), Ordering::Relaxed);
            self.wanted.store(true, Ordering::Release);
        }
        asked
    }

    /// Note that an entry of `group` was emptied (a discard or a freed slot; called once the
    /// entry's lock is released), so that the group is looked at for giving back. Always a
    /// release read-modify-write: a look that clears the mark after it sees the entry empty;
    /// one that cleared it before gets it set again (a mark only read as set was a look's
    /// to miss the entry by).
    pub(super) fn note_emptied(&self, group: usize) {
        if self.groups[group].fetch_or(EMPTIED, Ordering::Release) & EMPTIED == 0 {
            self.emptied.store(true, Ordering::Release);
        }
    }

    /// Make `group` (absent or wanted) committed in slot `slot` (committed, held for it),
    /// unwritten until a writer pins it; false if another thread placed it first (the caller
    /// keeps `slot`). With `Slots`, the caller holds `placing` and has written the map.
    fn place_in(&self, group: usize, slot: usize) -> bool {
        let slot_bits = (slot as u64) << SLOT_SHIFT;
        let placed = self.groups[group]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
                (word & STATE_MASK <= WANTED).then_some(
                    word & !STATE_AND_SLOT & !UNWRITTEN | COMMITTED | UNWRITTEN | slot_bits,
                )
            })
            .is_ok();
        if placed {
            self.unwritten.store(true, Ordering::Release);
        }
        placed
    }

    /// Give `group` (absent or wanted) a spare slot, if one is ready: a writer's way to a new
    /// group without a system call. True if this call placed it (false also if it was not
    /// absent).
    pub(super) fn take_spare(&self, group: usize) -> bool {
        let Some(slots) = &self.slots else {
            return false;
        };
        let _placing = slots.placing.lock();
        if self.state(group) != GroupState::Absent {
            return false;
        }
        let Some(slot) = slots.take(SLOT_SPARE, SLOT_USED) else {
            return false;
        };
        slots.spares.fetch_sub(1, Ordering::Relaxed);
        self.publish(slots, group, slot);
        // Asked for, as by `want`: writes are moving through the device.
        self.last_want_ns.store(self.now_ns(), Ordering::Relaxed);
        true
    }

    /// `group` (absent, `placing` held) is committed in `slot` (`SLOT_USED`): the map says so
    /// first, then its word.
    fn publish(&self, slots: &Slots, group: usize, slot: usize) {
        // Slots are as many as groups, which fit 32 bits (see `group_of`).
        slots.map[group].store(u32::try_from(slot + 1).unwrap_or(0), Ordering::Release);
        // Only this thread places groups now: the state is still absent or wanted.
        self.place_in(group, slot);
    }

    /// Commit `group` now, if it is not committed, in a slot committed for it (not a spare:
    /// those are for writers, `take_spare`). For the refill thread, and for a store without
    /// one (tests, bench); never the I/O path of a store with one.
    pub(super) fn commit(&self, group: usize) -> std::io::Result<()> {
        self.commit_with(group, |_| ())
    }

    /// `commit`, calling `before` with the bytes of the memory it is about to fault in (not
    /// at all if it faults in none).
    fn commit_with(&self, group: usize, before: impl Fn(usize)) -> std::io::Result<()> {
        if self.is_committed_group(group) {
            return Ok(());
        }
        let Some(slots) = &self.slots else {
            before(self.slot_bytes(group));
            self.commit_slot(group)?;
            if self.place_in(group, group) {
                self.committed_bytes
                    .fetch_add(self.slot_bytes(group) as u64, Ordering::Relaxed);
            }
            return Ok(());
        };
        let Some(slot) = self.commit_free_slot(slots, before)? else {
            // Every slot is held, spare or being committed: a spare is the one to take.
            self.take_spare(group);
            return Ok(());
        };
        let _placing = slots.placing.lock();
        if self.state(group) == GroupState::Absent {
            slots.states[slot].store(SLOT_USED, Ordering::Release);
            self.publish(slots, group, slot);
        } else {
            Self::make_spare(slots, slot);
        }
        Ok(())
    }

    /// Commit a free slot, held (`SLOT_BUSY`) for the caller, calling `before` with its bytes
    /// first; `None` if no slot is free (and `before` is not called: it makes room for memory
    /// about to be faulted in, which with memory short gives reserve memory back).
    fn commit_free_slot(
        &self,
        slots: &Slots,
        before: impl Fn(usize),
    ) -> std::io::Result<Option<usize>> {
        let Some(slot) = slots.take(SLOT_FREE, SLOT_BUSY) else {
            return Ok(None);
        };
        before(self.slot_bytes(slot));
        if let Err(error) = self.commit_slot(slot) {
            // Whatever was faulted in is given back when the slot is next given back; it
            // reads as zeros meanwhile.
            slots.states[slot].store(SLOT_FREE, Ordering::Release);
            return Err(error);
        }
        self.committed_bytes
            .fetch_add(self.slot_bytes(slot) as u64, Ordering::Relaxed);
        Ok(Some(slot))
    }

    fn make_spare(slots: &Slots, slot: usize) {
        slots.states[slot].store(SLOT_SPARE, Ordering::Release);
        slots.spares.fetch_add(1, Ordering::Relaxed);
    }

    /// Commit spare slots until `SPARE_SLOTS` are ready (or no slot is free), calling
    /// `before` with each one's bytes before its memory is faulted in (never for a slot not
    /// found); how many were. For the refill thread.
    pub(super) fn keep_spares(&self, before: impl Fn(usize)) -> std::io::Result<usize> {
        let Some(slots) = &self.slots else {
            return Ok(0);
        };
        let mut committed = 0;
        while slots.spares.load(Ordering::Relaxed) < SPARE_SLOTS {
            let Some(slot) = self.commit_free_slot(slots, &before)? else {
                break;
            };
            Self::make_spare(slots, slot);
            committed += 1;
        }
        Ok(committed)
    }

    /// Spare slots ready now.
    #[cfg(test)]
    pub(super) fn spares(&self) -> usize {
        self.slots
            .as_ref()
            .map_or(0, |slots| slots.spares.load(Ordering::Relaxed))
    }

    /// Whether a writer asked for group `group` and it is not committed yet.
    #[cfg(test)]
    pub(super) fn is_wanted(&self, group: usize) -> bool {
        self.word(group) & STATE_MASK == WANTED
    }

    /// Whether a writer asked for a group not committed yet.
    pub(super) fn any_wanted(&self) -> bool {
        self.wanted.load(Ordering::Acquire)
    }

    /// Commit every group a writer asked for, calling `before` with each group's bytes before
    /// its memory is faulted in; how many were.
    pub(super) fn commit_wanted(&self, before: impl Fn(usize)) -> std::io::Result<usize> {
        if !self.wanted.swap(false, Ordering::AcqRel) {
            return Ok(0);
        }
        let mut committed = 0;
        for group in 0..self.groups.len() {
            if self.groups[group].load(Ordering::Acquire) & STATE_MASK != WANTED {
                continue;
            }
            if let Err(error) = self.commit_with(group, &before) {
                // Asked for again next time: its writer is still waiting.
                self.wanted.store(true, Ordering::Release);
                return Err(error);
            }
            committed += 1;
        }
        Ok(committed)
    }

    /// The groups to look at for giving back: those marked emptied since the last look (marks
    /// cleared) and, once no group was asked for `QUIET_FOR`, those `UNWRITTEN`. None unless
    /// `LOOK_PERIOD` has passed since the last look (the refill thread asks before each of its
    /// commits, and under swap traffic entries are emptied all the time).
    pub(super) fn groups_to_look_at(&self) -> impl Iterator<Item = usize> + '_ {
        let now = self.now_ns();
        let time = self.next_look_ns.load(Ordering::Relaxed) <= now;
        let emptied = time && self.emptied.swap(false, Ordering::AcqRel);
        let quiet =
            now.saturating_sub(self.last_want_ns.load(Ordering::Relaxed)) >= nanos(QUIET_FOR);
        let unwritten = time && quiet && self.unwritten.swap(false, Ordering::AcqRel);
        let due = emptied || unwritten;
        if due {
            let period = nanos(LOOK_PERIOD);
            self.next_look_ns
                .store(now.saturating_add(period), Ordering::Relaxed);
        }
        (0..if due { self.groups.len() } else { 0 }).filter(move |&group| {
            let word = &self.groups[group];
            let was = word.load(Ordering::Relaxed);
            (was & EMPTIED != 0 && word.fetch_and(!EMPTIED, Ordering::AcqRel) & EMPTIED != 0)
                || (unwritten && was & UNWRITTEN != 0)
        })
    }

    fn now_ns(&self) -> u64 {
        nanos(self.epoch.elapsed())
    }

    /// Start giving `group` back: committed, pinned by no writer. Then the caller locks and
    /// checks its entries and, all empty, calls `give_back`, or `keep`.
    pub(super) fn begin_retire(&self, group: usize) -> bool {
        let word = &self.groups[group];
        let current = word.load(Ordering::Acquire);
        current & STATE_MASK == COMMITTED
            && current & !(STATE_AND_SLOT | EMPTIED | UNWRITTEN) == 0
            && word
                .compare_exchange(
                    current,
                    current & !STATE_MASK | RETIRING,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// Give `group` (retiring, its entries empty and still locked by the caller) up: absent
    /// after, its slot's memory back to the system, or kept as a spare while fewer than
    /// `SPARE_SLOTS` are. `unlock` unlocks the entries; it runs unless the slot is punched,
    /// which leaves them reading as zeros, empty and unlocked, with no lock to let go of (no
    /// other thread reaches them meanwhile: a thread touches an entry only while it holds the
    /// group, `hold`, or the entry's lock). On an error it stays retiring, its entries
    /// unlocked and what was punched reading as zeros (the caller `keep`s it).
    pub(super) fn give_back(&self, group: usize, unlock: impl FnOnce()) -> std::io::Result<()> {
        let slot = Self::slot_of(self.word(group));
        let spare = self
            .slots
            .as_ref()
            .is_some_and(|slots| slots.spares.load(Ordering::Relaxed) < SPARE_SLOTS);
        if spare {
            // A spare must read as empty and unlocked when it is placed again, with every
            // check beside its entries 0: places no group of this process used (those past
            // the device's last page, in the last group's slot) keep what a binary before the
            // checks left there.
            if let Err(error) = self.clear_beside_entries(slot) {
                unlock();
                return Err(error);
            }
            unlock();
        } else {
            if let Err(error) = self.decommit_slot(slot) {
                unlock();
                return Err(error);
            }
            self.committed_bytes
                .fetch_sub(self.slot_bytes(slot) as u64, Ordering::Relaxed);
        }
        let _placing = self.slots.as_ref().map(|slots| {
            let placing = slots.placing.lock();
            slots.map[group].store(0, Ordering::Release);
            if spare {
                Self::make_spare(slots, slot);
            } else {
                slots.states[slot].store(SLOT_FREE, Ordering::Release);
            }
            placing
        });
        self.groups[group].fetch_and(!(STATE_AND_SLOT | UNWRITTEN), Ordering::AcqRel);
        Ok(())
    }

    /// Keep `group` (retiring) committed after all: it holds pages.
    pub(super) fn keep(&self, group: usize) {
        self.groups[group]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
                Some(word & !STATE_MASK & !UNWRITTEN | COMMITTED)
            })
            .ok();
    }

    /// For a resumed store: mark committed each group it held, committing what of its slot
    /// is not (a process may have died while committing it). How many. With `Slots`, the map
    /// names them, and other slots with memory are spares again or give it back; without, a
    /// group whose entries have a page in memory is committed.
    pub(super) fn adopt(&self) -> std::io::Result<usize> {
        let Some(slots) = &self.slots else {
            let mut adopted = 0;
            for group in 0..self.groups.len() {
                let [(offset, len), beside @ ..] = self.ranges(group);
                if self.segment.any_in_memory(offset, len)? {
                    self.commit(group)?;
                    adopted += 1;
                } else if beside
                    .iter()
                    .map(|&(offset, len)| self.segment.any_in_memory(offset, len))
                    .collect::<std::io::Result<Vec<_>>>()?
                    .contains(&true)
                {
                    // A process died giving it back (the entries punched first): the rest
                    // goes too, so that the group, committed again, has nothing beside its
                    // entries (a binary before the entry checks left stored pages' checksums).
                    self.decommit_slot(group)?;
                }
            }
            return Ok(adopted);
        };
        let mut adopted = 0;
        for group in 0..self.groups.len() {
            let Some(slot) = (slots.map[group].load(Ordering::Acquire) as usize).checked_sub(1)
            else {
                continue;
            };
            let taken = slots.states.get(slot).is_some_and(|state| {
                state
                    .compare_exchange(SLOT_FREE, SLOT_USED, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            });
            if !taken {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("its page table's map puts group {group} in slot {slot}, which is out of range or another group's"),
                ));
            }
            self.commit_slot(slot)?;
            self.committed_bytes
                .fetch_add(self.slot_bytes(slot) as u64, Ordering::Relaxed);
            self.place_in(group, slot);
            adopted += 1;
        }
        // Any other slot with memory was a spare, or one a process died committing or giving
        // back: empty, or zeros. Kept as a spare (committed whole) while fewer are, if every
        // entry is empty indeed; given back otherwise.
        for (slot, state) in slots.states.iter().enumerate() {
            if state.load(Ordering::Relaxed) != SLOT_FREE {
                continue;
            }
            if !self.slot_in_memory(slot)? {
                continue;
            }
            if slots.spares.load(Ordering::Relaxed) < SPARE_SLOTS && self.slot_is_empty(slot)? {
                self.commit_slot(slot)?;
                self.clear_beside_entries(slot)?;
                self.committed_bytes
                    .fetch_add(self.slot_bytes(slot) as u64, Ordering::Relaxed);
                Self::make_spare(slots, slot);
            } else {
                self.decommit_slot(slot)?;
            }
        }
        Ok(adopted)
    }
}
