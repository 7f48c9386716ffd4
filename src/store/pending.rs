//! Pending batches: preallocated page slots that writers fill without a shared lock.
//!
//! A batch is *open* while writers may reserve slots in it. Reserving is one compare-and-swap
//! on `state` (open bit + count of reserved slots). The flusher *seals* a batch (clears the
//! open bit), waits until every writer that reserved a slot has finished copying (`committed`),
//! compresses the slots and only then lets the batch be opened again. So while a page-table
//! entry says `Pending { batch, slot }`, that slot holds that page's data.
//!
//! The slots' pages and the page index each holds are in the store's memory (see `layout`),
//! so a write acknowledged before the process died is found by the next one: an entry that
//! says `Pending { batch, slot }` whose slot names the same page is that page's data. The
//! reservation state is the process's own: a resumed store installs every pending page and
//! starts with empty batches.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::mem::{PageSlots, SlotRead, Words};

const OPEN: u64 = 1 << 63;
const COUNT_MASK: u64 = (1 << 32) - 1;
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
            if n as usize >= self.slots.len() {
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
        self.reserved() >= self.slots.len()
    }

    /// A writer finished its slot (data copied, entry pointing at it).
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

    /// Make the batch empty and open (only for a batch that is sealed and fully flushed).
    pub(super) fn open(&self) {
        self.committed.store(0, Ordering::Relaxed);
        self.first_write_ns.store(NO_WRITE, Ordering::Relaxed);
        self.state.store(OPEN, Ordering::Release);
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
