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
//! Each group has one word: its state in the low bits and, above them, how many writers have
//! it pinned (a writer pins the groups of its request before it touches their entries, so a
//! group cannot be given back under it). Giving a group back (`PageTable::retire`) takes it
//! from committed with no pins to retiring in one compare-and-swap, locks every entry, checks
//! that all are empty, and punches the group's memory out (`give_back`). A group that is not
//! committed holds no memory and reads as empty: readers, discards and slot frees never wait
//! for it. One race is left, and costs a page, never a page's data: a reader that saw the
//! group committed just before its memory went touches an entry again, the kernel maps it a
//! zeroed page (empty entries), the reader sees the group absent and lets go; that page stays
//! until the group is committed and given back again.
//!
//! A resumed store finds its committed groups by asking which of their pages are in memory
//! (`Segment::any_in_memory`: the segment's file, which allocates nothing), and commits the
//! rest of a group a process died in the middle of committing. A store made by a binary that
//! committed the whole table up front resumes with every group committed.

#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::nanos;
use crate::codec::PAGE_SIZE;
use crate::mem::Segment;

/// Entries per group: 16 KiB of entries, 4 KiB of hints, 8 KiB of checksums (whole pages
/// each), 8 MiB of device (four of swap's clusters).
pub(super) const GROUP_PAGES: usize = 2048;

/// A group's state, the low bits of its word.
const STATE_MASK: u32 = 0b11;
/// No memory: every entry is empty.
const ABSENT: u32 = 0;
/// No memory yet; a writer asked the refill thread for it.
const WANTED: u32 = 1;
const COMMITTED: u32 = 2;
/// Being given back: entries are being locked and checked (`PageTable::retire`).
const RETIRING: u32 = 3;
/// Bit 2: an entry of the group was emptied since the last look for empty groups.
const EMPTIED: u32 = 1 << 2;
/// Bit 3: committed and no writer has pinned it since (asked for ahead of writes that have
/// not come, or adopted on resume).
const UNWRITTEN: u32 = 1 << 3;
/// Pins count from bit 4.
const PIN: u32 = 1 << 4;

/// How often groups are looked at for giving back (`groups_to_look_at`): their memory is
/// back well within the 2 s in which a daemon whose swapped pages were freed is to be back at
/// its idle footprint.
const LOOK_PERIOD: Duration = Duration::from_millis(250);

/// Groups committed that no write reached are looked at for giving back once no group was
/// asked for this long: the writes moving through the device have stopped, and what was
/// asked for ahead of them is not needed soon.
const QUIET_FOR: Duration = Duration::from_secs(1);

/// What a group is, for the table's lockers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GroupState {
    /// No memory: its entries are empty.
    Absent,
    Committed,
    /// Being given back: wait (it ends absent or committed again).
    Retiring,
}

/// The bytes of one kind of per-page data (entries, hints or checksums) in the segment.
#[derive(Clone, Copy, Debug)]
pub(super) struct Region {
    pub(super) offset: usize,
    /// Bytes per device page.
    pub(super) width: usize,
}

pub(super) struct TableMemory {
    segment: Arc<Segment>,
    /// Entries first: a group is committed once its entries' pages are (see `adopt`).
    entries: Region,
    others: [Region; 2],
    pages: usize,
    groups: Box<[AtomicU32]>,
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
    /// them, in `segment`; every group absent.
    pub(super) fn new(
        segment: Arc<Segment>,
        entries: Region,
        others: [Region; 2],
        pages: usize,
    ) -> Self {
        Self {
            segment,
            entries,
            others,
            pages,
            groups: (0..pages.div_ceil(GROUP_PAGES))
                .map(|_| AtomicU32::new(ABSENT))
                .collect(),
            wanted: AtomicBool::new(false),
            emptied: AtomicBool::new(false),
            unwritten: AtomicBool::new(false),
            last_want_ns: AtomicU64::new(0),
            next_look_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            committed_bytes: AtomicU64::new(0),
        }
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

    pub(super) fn state(&self, group: usize) -> GroupState {
        match self.groups[group].load(Ordering::Acquire) & STATE_MASK {
            COMMITTED => GroupState::Committed,
            RETIRING => GroupState::Retiring,
            _ => GroupState::Absent,
        }
    }

    pub(super) fn is_committed_group(&self, group: usize) -> bool {
        self.state(group) == GroupState::Committed
    }

    /// Bytes of table memory committed now.
    pub(super) fn committed_bytes(&self) -> u64 {
        self.committed_bytes.load(Ordering::Relaxed)
    }

    /// `(offset, len)` of the memory of `group` in each region, entries first: whole pages,
    /// shared with no other group (a group's entries, hints and checksums are 16, 4 and 8 KiB,
    /// and each region starts on a page and ends on one, see `layout`).
    fn ranges(&self, group: usize) -> [(usize, usize); 3] {
        let Range { start, end } = self.indexes(group);
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

    fn group_bytes(&self, group: usize) -> usize {
        self.ranges(group).iter().map(|&(_, len)| len).sum()
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

    /// Note that an entry of `group` was emptied (a discard or a freed slot), so that the
    /// group is looked at for giving back.
    pub(super) fn note_emptied(&self, group: usize) {
        let word = &self.groups[group];
        if word.load(Ordering::Relaxed) & EMPTIED == 0 {
            word.fetch_or(EMPTIED, Ordering::Relaxed);
            self.emptied.store(true, Ordering::Release);
        }
    }

    /// Commit `group` now, if it is not committed. For the refill thread, and for a store
    /// without one (tests, bench); never the I/O path of a store with one.
    pub(super) fn commit(&self, group: usize) -> std::io::Result<()> {
        if self.state(group) == GroupState::Committed {
            return Ok(());
        }
        // Hints and checksums first, the entries last: a group counts as committed on resume
        // once any of its entries' pages is in memory.
        let mut ranges = self.ranges(group);
        ranges.rotate_left(1);
        for (offset, len) in ranges {
            self.segment.commit(offset, len)?;
        }
        // Unwritten until a writer pins it (a writer waiting for it does so at once).
        if self.set_state(group, COMMITTED | UNWRITTEN) & STATE_MASK != COMMITTED {
            self.committed_bytes
                .fetch_add(self.group_bytes(group) as u64, Ordering::Relaxed);
        }
        self.unwritten.store(true, Ordering::Release);
        Ok(())
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
            before(self.group_bytes(group));
            if let Err(error) = self.commit(group) {
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
    /// checks its entries and calls `give_back` or `keep`.
    pub(super) fn begin_retire(&self, group: usize) -> bool {
        let word = &self.groups[group];
        let current = word.load(Ordering::Acquire);
        current & STATE_MASK == COMMITTED
            && current & !(STATE_MASK | EMPTIED | UNWRITTEN) == 0
            && word
                .compare_exchange(
                    current,
                    current & !STATE_MASK | RETIRING,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// Give the memory of `group` (retiring, its entries locked and empty) back to the
    /// system: absent after. On an error it stays retiring, and what was punched reads as
    /// zeros (the caller unlocks the entries and `keep`s it).
    pub(super) fn give_back(&self, group: usize) -> std::io::Result<()> {
        for (offset, len) in self.ranges(group) {
            self.segment.decommit(offset, len)?;
        }
        self.groups[group].fetch_and(!(STATE_MASK | UNWRITTEN), Ordering::AcqRel);
        self.committed_bytes
            .fetch_sub(self.group_bytes(group) as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Keep `group` (retiring) committed after all: it holds pages.
    pub(super) fn keep(&self, group: usize) {
        self.set_state(group, COMMITTED);
        self.groups[group].fetch_and(!UNWRITTEN, Ordering::AcqRel);
    }

    fn set_state(&self, group: usize, state: u32) -> u32 {
        self.groups[group]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
                Some(word & !STATE_MASK | state)
            })
            .unwrap_or(state)
    }

    /// For a resumed store: mark committed each group whose entries have a page in memory,
    /// committing the rest of it (a process may have died while committing it). How many.
    pub(super) fn adopt(&self) -> std::io::Result<usize> {
        let mut adopted = 0;
        for group in 0..self.groups.len() {
            let [(offset, len), ..] = self.ranges(group);
            if self.segment.any_in_memory(offset, len)? {
                self.commit(group)?;
                adopted += 1;
            }
        }
        Ok(adopted)
    }
}
