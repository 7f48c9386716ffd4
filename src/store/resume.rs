//! Resuming the store a previous process left in shared memory (see `layout`): it died at some
//! instruction (kill -9, a crash) or handed over. What it left is whole entry by entry (each
//! change is one atomic store); everything else is rebuilt here, before the store serves:
//!
//! - lock bits left by dead threads are cleared, and a stored page whose entry was locked gets
//!   the checksum of the data its entry names (the dead thread may have set the checksum of
//!   an overwrite it had not yet named: `--no-batched` writes a stored page in place);
//! - the allocator's bookkeeping is rebuilt from the stored entries, and carved memory no
//!   entry holds (objects copied in before an entry named them, chunks in the reserve) goes
//!   back to the system;
//! - pending pages (acknowledged writes not yet compressed) are installed: an entry
//!   `Pending { batch, slot }` is valid only if the slot says it holds the same page;
//! - an entry that does not hold together (an object outside the arena, two entries naming
//!   one object, an unknown kind) is marked `Lost`: its reads fail with EIO, never zeros.

#![forbid(unsafe_code)]

use super::counters::add;
use super::table::PageState;
use super::{BatchedPageStore, Opened, StoreError};
use crate::codec::{compress_page, Encoding, PAGE_SIZE};

/// Lost pages named one by one in the log; the rest are counted.
const LOST_PAGES_LOGGED: u64 = 16;

impl BatchedPageStore {
    /// Rebuild this store's process-local state from the table it was opened on.
    pub(super) fn resume(&self) -> Result<Opened, StoreError> {
        let memory = |source| StoreError::Memory {
            what: "rebuilding the resumed store's allocator".into(),
            source,
        };
        let groups = self
            .table
            .memory()
            .adopt()
            .map_err(|source| StoreError::Memory {
                what: "finding the resumed store's page table".into(),
                source,
            })?;
        tracing::debug!(groups, "page table groups committed");
        let mut occupancy = self.alloc.begin_rebuild().map_err(memory)?;
        let mut pending = Vec::new();
        let mut checksum_unsure = Vec::new();
        let (mut held, mut lost) = (0u64, 0u64);
        // Entries of groups not committed are empty (and have no memory to read).
        for index in (0..self.table.len()).filter(|&i| self.table.is_committed(i)) {
            let (found, was_locked) = self.table.recover(index);
            // A lock the dead process left is let go of at once, but a stored page's: its
            // checksum may be unsure, and the lock stays until it is settled (below, or once
            // the allocator is rebuilt, `checksum_stored_data`).
            let unsure = was_locked && matches!(found, PageState::Stored { .. });
            if was_locked && !unsure {
                drop(self.table.take_over_lock(index as u64));
            }
            let state = match found {
                PageState::Pending { batch, slot } => {
                    let names_this_page = self
                        .batches
                        .get(batch as usize)
                        .and_then(|b| b.index_of(slot as usize))
                        == Some(index as u64);
                    if names_this_page {
                        pending.push(index as u64);
                        continue;
                    }
                    PageState::Lost
                }
                PageState::Stored {
                    handle,
                    len,
                    encoding,
                } => {
                    let whole = len > 0
                        && (encoding != Encoding::Raw || usize::from(len) == PAGE_SIZE)
                        && self.alloc.adopt(handle, usize::from(len), &mut occupancy);
                    if whole {
                        if unsure {
                            checksum_unsure.push(index as u64);
                        }
                        found
                    } else {
                        PageState::Lost
                    }
                }
                other => other,
            };
            if state == PageState::Lost {
                lost += 1;
                let entry = if unsure {
                    self.table.take_over_lock(index as u64)
                } else if found != PageState::Lost {
                    self.table.lock(index as u64)
                } else {
                    None
                };
                if let Some(mut entry) = entry {
                    entry.replace(PageState::Lost);
                }
                if lost <= LOST_PAGES_LOGGED {
                    tracing::error!(page = index, entry = ?found, "page lost: its entry does not hold together");
                }
            }
            if state != PageState::Empty {
                held += 1;
            }
            self.counters.transition(PageState::Empty, state);
        }
        self.alloc.finish_rebuild(occupancy).map_err(memory)?;
        for &index in &checksum_unsure {
            self.checksum_stored_data(index);
        }
        for &index in &pending {
            if !self.install_resumed(index) {
                // Its entry and slot are as the dead process left them, and every step before
                // is one the next process takes again: that one stores it, with the memory
                // this process's end gives back. Lost here, an acknowledged write would read
                // as EIO for good.
                return Err(StoreError::Memory {
                    what: format!(
                        "storing page {index}, left pending by the dead process (the next \
                         process tries again; nothing is lost)"
                    ),
                    source: std::io::Error::from_raw_os_error(libc::ENOMEM),
                });
            }
        }
        held += pending.len() as u64;
        if lost > 0 {
            tracing::error!(
                lost,
                "pages lost on resume: reads of them fail with EIO until they are written again"
            );
        }
        tracing::info!(pages = held, pending = pending.len(), lost, "store resumed");
        Ok(Opened::Resumed { pages: held, lost })
    }

    /// Set a stored page's checksum to that of the data its entry names, and unlock the entry
    /// the dead process left locked. Data that does not decompress keeps the checksum it had:
    /// its reads fail with EIO either way.
    fn checksum_stored_data(&self, index: u64) {
        let Some(entry) = self.table.take_over_lock(index) else {
            return;
        };
        let PageState::Stored {
            handle,
            len,
            encoding,
        } = entry.state()
        else {
            return;
        };
        let mut page = [0u8; PAGE_SIZE];
        if self.decode_object(handle, len, encoding, &mut page).is_ok() {
            let (was, now) = (entry.checksum(), self.checksum.of(&page));
            if was != now {
                // Expected for a write killed between the two (see above); a bit flipped in
                // this page's data meanwhile would pass unseen from here on.
                tracing::warn!(
                    page = index,
                    was = format_args!("{was:#010x}"),
                    now = format_args!("{now:#010x}"),
                    "a page left locked by the dead process got the checksum of its data"
                );
                entry.set_checksum(now);
            }
        }
    }

    /// Compress and store a pending page of the resumed store (its batch is not reopened:
    /// every batch starts empty). False, the page left pending, if no memory could be had.
    fn install_resumed(&self, index: u64) -> bool {
        let Some(mut entry) = self.table.lock(index) else {
            return true;
        };
        let PageState::Pending { batch, slot } = entry.state() else {
            return true;
        };
        let source = self.batches[batch as usize].slot(slot as usize);
        let mut out = [0u8; PAGE_SIZE];
        let (encoding, len) = compress_page(self.config.algorithm, &source.page, &mut out);
        let Some(handle) = self.alloc.store(&out[..len]) else {
            return false;
        };
        let new = PageState::Stored {
            handle,
            len: crate::codec::page_len(len),
            encoding,
        };
        entry.set_checksum(self.checksum.of(&source.page));
        entry.replace(new);
        self.counters.transition(PageState::Empty, new);
        add(&self.counters.pages_simd, 1);
        true
    }
}
