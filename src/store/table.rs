//! The page table: one 16-byte entry per device page, each with its own lock bit.
//!
//! `meta` holds the lock bit, the kind of entry, and for stored pages the encoding and length;
//! `word` holds the fill word, the pending batch slot, or the allocator handle. Both are read
//! and written only under the lock bit, so readers and writers of different pages never
//! share a lock. Critical sections are a few hundred nanoseconds (a decompression at most):
//! a short spin, then yielding, is enough.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use super::alloc::Handle;
use crate::codec::Encoding;

const LOCKED: u64 = 1 << 63;
const KIND_MASK: u64 = 0b11;
const KIND_EMPTY: u64 = 0;
const KIND_SAME: u64 = 1;
const KIND_PENDING: u64 = 2;
const KIND_STORED: u64 = 3;
const ENC_SHIFT: u32 = 2;
const ENC_MASK: u64 = 0b11;
const LEN_SHIFT: u32 = 4;
const LEN_MASK: u64 = 0x1fff;
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

    #[allow(
        clippy::cast_possible_truncation,
        reason = "a pending entry packs batch and slot as the two 32-bit halves of its word"
    )]
    fn decode(meta: u64, word: u64) -> Self {
        match meta & KIND_MASK {
            KIND_SAME => PageState::Same(word),
            KIND_PENDING => PageState::Pending {
                batch: (word >> 32) as u32,
                slot: word as u32,
            },
            KIND_STORED => PageState::Stored {
                handle: Handle::from_bits(word),
                len: ((meta >> LEN_SHIFT) & LEN_MASK) as u16,
                // Only `encode` writes these bits, from a valid encoding.
                encoding: Encoding::from_bits(((meta >> ENC_SHIFT) & ENC_MASK) as u8)
                    .unwrap_or(Encoding::Raw),
            },
            _ => PageState::Empty,
        }
    }

    fn encode(self) -> (u64, u64) {
        match self {
            PageState::Empty => (KIND_EMPTY, 0),
            PageState::Same(w) => (KIND_SAME, w),
            PageState::Pending { batch, slot } => {
                (KIND_PENDING, (u64::from(batch) << 32) | u64::from(slot))
            }
            PageState::Stored {
                handle,
                len,
                encoding,
            } => (
                KIND_STORED
                    | ((encoding as u64) << ENC_SHIFT)
                    | ((u64::from(len) & LEN_MASK) << LEN_SHIFT),
                handle.to_bits(),
            ),
        }
    }
}

#[derive(Default)]
struct Entry {
    meta: AtomicU64,
    word: AtomicU64,
}

/// Exclusive access to one entry; the lock is released when it is dropped.
pub(super) struct EntryGuard<'a> {
    entry: &'a Entry,
    meta: u64,
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
        let meta = if self.changed {
            let (meta, word) = self.state.encode();
            self.entry.word.store(word, Ordering::Relaxed);
            meta
        } else {
            self.meta
        };
        // Release: the next locker sees `word` and everything done under the lock.
        self.entry.meta.store(meta & !LOCKED, Ordering::Release);
    }
}

pub(super) struct PageTable {
    entries: Box<[Entry]>,
}

impl PageTable {
    pub(super) fn new(pages: usize) -> Self {
        let entries: Box<[Entry]> = (0..pages).map(|_| Entry::default()).collect();
        crate::mem::populate(&entries);
        Self { entries }
    }

    pub(super) fn bytes(&self) -> u64 {
        std::mem::size_of_val(&*self.entries) as u64
    }

    /// Lock entry `index` (which the caller has bounds-checked).
    pub(super) fn lock(&self, index: u64) -> EntryGuard<'_> {
        // An index past the table (impossible: requests are range-checked) fails the lookup.
        let entry = &self.entries[usize::try_from(index).unwrap_or(usize::MAX)];
        let mut spins = 0u32;
        let meta = loop {
            let cur = entry.meta.load(Ordering::Relaxed);
            if cur & LOCKED == 0
                && entry
                    .meta
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
        let word = entry.word.load(Ordering::Relaxed);
        EntryGuard {
            entry,
            meta,
            state: PageState::decode(meta, word),
            changed: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_survive_encoding() {
        let t = PageTable::new(4);
        let states = [
            PageState::Same(u64::MAX),
            PageState::Pending {
                batch: 1,
                slot: 999_999,
            },
            PageState::Stored {
                handle: Handle::from_bits(0x00ab_1234_5678_0fff),
                len: 4096,
                encoding: Encoding::Zstd,
            },
            PageState::Empty,
        ];
        for s in states {
            t.lock(2).replace(s);
            assert_eq!(t.lock(2).state(), s);
        }
        assert_eq!(t.lock(3).state(), PageState::Empty);
        assert_eq!(t.bytes(), 64);
    }

    #[test]
    fn lock_excludes_other_threads() {
        let t = PageTable::new(1);
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
