//! The arena's cold pages: pages of free chunks whose memory was given back to the system,
//! one bit each, committed again for a chunk of any size before the arena is carved further.
//!
//! Why one map for every chunk size rather than a list per size (as until 2026-11-27): a
//! chunk cut from a larger one (`ChunkReserve::split_larger`) comes back as smaller ones, so
//! pages moved from the larger sizes' lists to the smaller sizes' and never back; the larger
//! sizes carved fresh pages, and the one-page list only grew. After the VM's near-OOM stage
//! (`bash scripts/vm-test.sh --stress`, four cases) it held 323,129 pages, 1.2 GiB of a 1 GiB
//! device's arena, in 3 MiB of locked bookkeeping that never shrank. Here any run of cold
//! pages serves any size, and the map costs a bit per carved page (32 KiB per GiB carved).

#![forbid(unsafe_code)]

use parking_lot::Mutex;

use crate::mem::{faulted_in_list, growth_in_place, ListAlloc, ListVec};

const WORD_BITS: usize = u64::BITS as usize;

/// Cold arena pages (see the module's comment). Marking and taking pages never allocates;
/// only `cover`, from the thread that carves, grows the map.
pub(super) struct ColdPages {
    map: Mutex<Map>,
}

struct Map {
    /// Bit `p % 64` of word `p / 64` set: arena page `p` is cold.
    words: ListVec<u64>,
    /// Pages set.
    pages: usize,
    /// The word the next search starts at: the last run found, so that a search does not
    /// walk again over the words it emptied.
    cursor: usize,
}

impl ColdPages {
    pub(super) fn new() -> Self {
        Self {
            map: Mutex::new(Map {
                words: crate::mem::empty_list(ListAlloc::Mapped),
                pages: 0,
                cursor: 0,
            }),
        }
    }

    /// Make room for arena pages below `pages` (the carved part, before the carve that makes
    /// it so): its new room faulted in outside the lock, so that marking pages never waits
    /// for memory. An error, and the map as it was, where the system refuses the room: carve
    /// nothing past what it covers then (a page it cannot mark is lost address space).
    pub(super) fn cover(&self, pages: usize) -> std::io::Result<()> {
        let want = pages.div_ceil(WORD_BITS);
        let room = room_for(want);
        let growth = {
            let map = self.map.lock();
            if map.words.len() >= want {
                return Ok(());
            }
            growth_in_place(&map.words, room)
        };
        // In place where it can be (a mapped list within its reservation), else a new list;
        // faulted in here, outside the lock.
        let mut fresh = match &growth {
            Some(growth) => {
                growth.fault_in()?;
                None
            }
            None => Some(faulted_in_list::<u64>(room, ListAlloc::Mapped)?),
        };
        let mut map = self.map.lock();
        match (&growth, &mut fresh) {
            (Some(growth), _) => {
                growth.apply(&mut map.words, room);
            }
            (None, Some(fresh)) if map.words.len() <= fresh.capacity() => {
                fresh.append(&mut map.words);
                std::mem::swap(&mut map.words, fresh);
            }
            _ => {}
        }
        // Within the room made (only this thread grows the map); past it would allocate.
        let to = want.min(map.words.capacity()).max(map.words.len());
        map.words.resize(to, 0);
        drop(map);
        // The old list (in `fresh` once swapped) is freed here, outside the lock.
        Ok(())
    }

    /// Mark the `count` pages from arena page `page` cold. Pages past the room made
    /// (`cover`; not reachable, every chunk lies in the carved part) are left out with an
    /// error logged: their address space is lost, nothing else.
    pub(super) fn mark(&self, page: usize, count: usize) {
        let mut map = self.map.lock();
        let words = page.saturating_add(count).div_ceil(WORD_BITS);
        if words > map.words.len() {
            // Two takers without a refill thread may each have made room for their own carve
            // only: the room made has slack for that, already faulted in.
            if words > map.words.capacity() {
                tracing::error!(page, count, "cold pages past the map: left out");
                return;
            }
            map.words.resize(words, 0);
        }
        for p in page..page + count {
            let (word, bit) = (p / WORD_BITS, 1u64 << (p % WORD_BITS));
            if map.words[word] & bit != 0 {
                tracing::error!(page = p, "a page marked cold twice");
                continue;
            }
            map.words[word] |= bit;
            map.pages += 1;
        }
    }

    /// Take a run of `count` (1 to 64) adjacent cold pages: the arena page it starts at.
    pub(super) fn take(&self, count: usize) -> Option<usize> {
        let mut map = self.map.lock();
        if map.pages < count {
            return None;
        }
        let (start, word) = find_run(&map.words, map.cursor, count)?;
        map.cursor = word;
        for p in start..start + count {
            map.words[p / WORD_BITS] &= !(1u64 << (p % WORD_BITS));
        }
        map.pages -= count;
        Some(start)
    }

    /// Cold pages now.
    pub(super) fn pages(&self) -> usize {
        self.map.lock().pages
    }

    /// Bytes of the map: bookkeeping, for the stats.
    pub(super) fn bytes(&self) -> usize {
        self.map.lock().words.capacity() * std::mem::size_of::<u64>()
    }
}

/// Words of room for a map that needs `words`: a quarter more, so that carving a group at a
/// time does not grow it at every carve.
fn room_for(words: usize) -> usize {
    words + words / 4 + 8
}

/// The first run of `count` (1 to 64) set bits starting in a word at or after `from`, then
/// from the first word: its first bit's index, and the word it starts in.
fn find_run(words: &[u64], from: usize, count: usize) -> Option<(usize, usize)> {
    let from = from.min(words.len());
    (from..words.len()).chain(0..from).find_map(|i| {
        let here = words[i];
        if here == 0 {
            return None;
        }
        // The word and the next as one: a run may cross into it.
        let next = words.get(i + 1).copied().unwrap_or(0);
        let both = u128::from(here) | (u128::from(next) << WORD_BITS);
        let mut starts = both;
        for shift in 1..count {
            starts &= both >> shift;
        }
        let starts_here = starts & u128::from(u64::MAX);
        let bit = usize::try_from(starts_here.trailing_zeros()).ok()?;
        (starts_here != 0).then_some((i * WORD_BITS + bit, i))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_found_within_a_word_across_words_and_after_the_cursor() {
        let mut words = vec![0u64; 4];
        // Pages 3, 5..=7, 62..=65, 200.
        for p in [3, 5, 6, 7, 62, 63, 64, 65, 200] {
            words[p / 64] |= 1 << (p % 64);
        }
        assert_eq!(find_run(&words, 0, 1), Some((3, 0)));
        assert_eq!(find_run(&words, 0, 3), Some((5, 0)));
        assert_eq!(find_run(&words, 0, 4), Some((62, 0)));
        assert_eq!(find_run(&words, 0, 5), None);
        assert_eq!(find_run(&words, 1, 1), Some((64, 1)));
        assert_eq!(find_run(&words, 2, 1), Some((200, 3)));
        assert_eq!(find_run(&words, 4, 2), Some((5, 0)), "wraps to the start");
        words[3] = u64::MAX;
        assert_eq!(find_run(&words, 0, 64), Some((192, 3)));
    }

    #[test]
    fn pages_marked_are_taken_once_by_runs_of_any_size() {
        let cold = ColdPages::new();
        cold.cover(1000).unwrap();
        // A chunk of 8 pages and eight of 1, adjacent: one run of 16.
        cold.mark(100, 8);
        for p in 108..116 {
            cold.mark(p, 1);
        }
        cold.mark(500, 1);
        assert_eq!(cold.pages(), 17);
        assert_eq!(
            cold.take(16),
            Some(100),
            "one-page chunks serve a larger size"
        );
        assert_eq!(cold.take(2), None);
        assert_eq!(cold.take(1), Some(500));
        assert_eq!(cold.take(1), None);
        assert_eq!(cold.pages(), 0);
        // Marked twice: counted once.
        cold.mark(7, 1);
        cold.mark(7, 1);
        assert_eq!(cold.pages(), 1);
        // Past the room made: left out; within it, kept.
        cold.mark(1 << 20, 1);
        assert_eq!(cold.pages(), 1);
        cold.mark(1500, 1);
        assert_eq!(cold.pages(), 2);
        // (From the last run found on, then from the start.)
        assert_eq!(cold.take(1), Some(1500));
        assert_eq!(cold.take(1), Some(7));
    }

    #[test]
    fn the_map_grows_to_cover_what_is_carved_and_keeps_its_marks() {
        let cold = ColdPages::new();
        cold.cover(64).unwrap();
        cold.mark(10, 3);
        let small = cold.bytes();
        for pages in [1 << 12, 1 << 16, 1 << 20, 1 << 22] {
            cold.cover(pages).unwrap();
            cold.mark(pages - 1, 1);
        }
        assert!(cold.bytes() >= (1 << 22) / 8);
        assert!(cold.bytes() > small);
        assert_eq!(cold.pages(), 7);
        assert_eq!(cold.take(3), Some(10));
        assert_eq!(cold.take(1), Some((1 << 12) - 1));
    }
}
