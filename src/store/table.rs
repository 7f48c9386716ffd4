//! The page table: one 8-byte word per device page, each with its own lock bit.
//!
//! Every change of a page's state is one atomic store of its word, so a process that dies at
//! any instruction leaves every entry whole: the old state or the new one (the store's memory
//! outlives the process, see `layout`). The word holds the lock bit, the kind of entry and
//! what the kind needs: the fill word of a same-filled page (if it fits, see `PageState::same`),
//! the pending batch slot, or a stored object's encoding, length and position. Readers and
//! writers of different pages never share a lock. Critical sections are a few hundred
//! nanoseconds (a decompression at most): a short spin, then yielding, is enough.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use super::alloc::Handle;
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
            reason = "there are two batches of at most 2^20 slots (checked in BatchedPageStore::new)"
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

/// Exclusive access to one entry; the lock is released when it is dropped.
pub(super) struct EntryGuard<'a> {
    entry: &'a AtomicU64,
    word: u64,
    state: PageState,
    changed: bool,
}

impl EntryGuard<'_> {
    pub(super) fn state(&self) -> PageState {
        self.state
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
            self.state.encode()
        } else {
            self.word
        };
        // One store: the new state and the unlock. Release: the next locker sees everything
        // done under the lock (an object copied in before the entry names it).
        self.entry.store(word & !LOCKED, Ordering::Release);
    }
}

pub(super) struct PageTable {
    entries: Words<AtomicU64>,
}

impl PageTable {
    /// The table in `entries` (committed by the caller), as a fresh or a resumed store left it.
    pub(super) fn new(entries: Words<AtomicU64>) -> Self {
        Self { entries }
    }

    pub(super) fn bytes(&self) -> u64 {
        std::mem::size_of_val(&*self.entries) as u64
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entry `index`'s state, with a lock bit left by a dead process cleared. Only for a store
    /// nobody serves yet (resume).
    pub(super) fn recover(&self, index: usize) -> PageState {
        let entry = &self.entries[index];
        let word = entry.load(Ordering::Acquire) & !LOCKED;
        entry.store(word, Ordering::Release);
        PageState::decode(word)
    }

    /// Lock entry `index` (which the caller has bounds-checked).
    pub(super) fn lock(&self, index: u64) -> EntryGuard<'_> {
        // An index past the table (impossible: requests are range-checked) fails the lookup.
        let entry = &self.entries[usize::try_from(index).unwrap_or(usize::MAX)];
        let mut spins = 0u32;
        let word = loop {
            let cur = entry.load(Ordering::Relaxed);
            if cur & LOCKED == 0
                && entry
                    .compare_exchange_weak(cur, cur | LOCKED, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                break cur;
            }
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        };
        EntryGuard {
            entry,
            word,
            state: PageState::decode(word),
            changed: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pages: usize) -> PageTable {
        let segment = crate::mem::Segment::private(pages * 8).unwrap();
        PageTable::new(segment.words(0, pages).unwrap())
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
            t.lock(2).replace(s);
            assert_eq!(t.lock(2).state(), s);
        }
        assert_eq!(t.lock(3).state(), PageState::Empty);
        assert_eq!(t.bytes(), 32);
        assert_eq!(PageState::same(0x8000_0000_0000_0000), None);
        assert_eq!(PageState::same(0x0fff_ffff_ffff_ffff), None);
        assert_eq!(PageState::same(0x1234_5678_9abc_def0), None);
    }

    #[test]
    fn a_lock_left_by_a_dead_process_is_cleared_on_recovery() {
        let t = table(2);
        t.lock(1).replace(PageState::same(7).unwrap());
        std::mem::forget(t.lock(1));
        assert_eq!(t.recover(1), PageState::Same(7));
        assert_eq!(t.lock(1).state(), PageState::Same(7));
    }

    #[test]
    fn lock_excludes_other_threads() {
        let t = table(1);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        let mut g = t.lock(0);
                        let n = match g.state() {
                            PageState::Same(n) => n,
                            _ => 0,
                        };
                        g.replace(PageState::Same(n + 1));
                    }
                });
            }
        });
        assert_eq!(t.lock(0).state(), PageState::Same(40_000));
    }
}
