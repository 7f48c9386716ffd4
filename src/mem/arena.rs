//! The arena compressed pages live in: a region of a segment, carved into chunks as they are
//! needed, with one 32-bit tag word per arena page for the owner's bookkeeping (the allocator
//! notes there which of its chunks starts at that page, so that a page-table entry can name
//! an object by its position alone).
//!
//! How far the arena is carved is a word of the segment, not of the process: a store resumed
//! after a crash knows which part of the arena may hold data.

#![forbid(unsafe_code)]

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::segment::{Segment, Words};
use super::HOST_PAGE;

/// A region of a segment handed out as chunks.
pub struct Arena {
    segment: Arc<Segment>,
    /// Where the arena starts in the segment, and its length.
    start: usize,
    len: usize,
    /// Bytes carved so far (chunks are recycled, never re-carved): one word of the segment.
    carved: Words<AtomicU64>,
    /// One tag word per arena page, at `tags_offset` in the segment.
    tags: Words<AtomicU32>,
    tags_offset: usize,
    /// Where in the segment the committed tag pages end, from `tags_offset` on (tags are
    /// never given back): a carve commits only the tag pages beyond it. Why: every carve
    /// committed its tags' page anew, a system call per commit group for a page
    /// that covers 4 MiB of arena and was in memory already.
    tags_committed_end: AtomicUsize,
}

impl Arena {
    /// The arena at `[start, start + len)` of `segment`, its carve cursor the word at
    /// `carved_offset`, its tags at `tags_offset` (4 bytes per arena page). Commits nothing.
    pub fn new(
        segment: &Arc<Segment>,
        start: usize,
        len: usize,
        carved_offset: usize,
        tags_offset: usize,
    ) -> std::io::Result<Arc<Self>> {
        if !start.is_multiple_of(HOST_PAGE) || !len.is_multiple_of(HOST_PAGE) {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(Arc::new(Self {
            segment: Arc::clone(segment),
            start,
            len,
            carved: segment.words(carved_offset, 1)?,
            tags: segment.words_of::<AtomicU32>(tags_offset, len / HOST_PAGE)?,
            tags_offset,
            tags_committed_end: AtomicUsize::new(tags_offset),
        }))
    }

    /// An arena of `max_bytes` in a private segment of its own (tests).
    pub fn private(max_bytes: usize) -> std::io::Result<Arc<Self>> {
        let len = max_bytes.div_ceil(HOST_PAGE).max(1) * HOST_PAGE;
        let tags_bytes = (len / HOST_PAGE * 4).div_ceil(HOST_PAGE) * HOST_PAGE;
        let segment = Segment::private(HOST_PAGE + tags_bytes + len)?;
        segment.commit(0, HOST_PAGE)?;
        Self::new(&segment, HOST_PAGE + tags_bytes, len, 0, HOST_PAGE)
    }

    /// Bytes carved so far.
    pub fn carved(&self) -> usize {
        usize::try_from(self.carved[0].load(Ordering::Acquire)).unwrap_or(usize::MAX)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Hand out `count` adjacent chunks of `chunk_bytes` each, committed. `None` once the
    /// arena is used up. A commit that fails (no memory) leaves the chunks carved but given
    /// back to the system: `CarveFailed` hands them over, for the caller to commit later.
    pub fn carve(
        self: &Arc<Self>,
        chunk_bytes: usize,
        count: usize,
    ) -> Result<Option<Vec<ArenaChunk>>, CarveFailed> {
        let total = (chunk_bytes * count) as u64;
        // Advanced only when the carve fits: an add undone after a failed fit let the cursor
        // move back below a range another taker had carved meanwhile (the same pages handed
        // out twice), and a kill between the two left the cursor past the end for good.
        let len = self.len as u64;
        let carved = self.carved[0].fetch_update(Ordering::AcqRel, Ordering::Acquire, |start| {
            start.checked_add(total).filter(|&end| end <= len)
        });
        let Ok(start) = carved else {
            return Ok(None);
        };
        // Below `len`, so it fits a usize.
        let start = usize::try_from(start).unwrap_or(usize::MAX);
        let total = chunk_bytes * count;
        let chunks = (0..count)
            .map(|i| self.chunk_at(start + i * chunk_bytes, chunk_bytes))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|error| CarveFailed {
                error,
                chunks: Vec::new(),
            })?;
        let committed = self
            .commit_tags(start, start + total)
            .and_then(|()| self.segment.commit(self.start + start, total));
        match committed {
            Ok(()) => Ok(Some(chunks)),
            Err(error) => {
                // Other takers carved past them already: the range stays carved, its pages
                // given back (those the failed commit faulted in are locked memory).
                let mut chunks = chunks;
                if let Err(undo) = ArenaChunk::decommit_all(&mut chunks) {
                    tracing::warn!(%undo, "giving back a carve whose commit failed");
                }
                Err(CarveFailed { error, chunks })
            }
        }
    }

    /// The chunk of `len` bytes at arena offset `offset` (inside the carved part), as it is:
    /// for a store resumed after a crash, which finds its live chunks in its page table. The
    /// caller hands each range to one holder.
    pub fn chunk_at(self: &Arc<Self>, offset: usize, len: usize) -> std::io::Result<ArenaChunk> {
        let fits = offset.checked_add(len).is_some_and(|end| end <= self.len);
        let einval = || std::io::Error::from_raw_os_error(libc::EINVAL);
        if !fits {
            return Err(einval());
        }
        // Whole pages: the arena starts on a page, so the segment's check says it.
        self.segment.check(self.start + offset, len)?;
        Ok(ArenaChunk {
            arena: Arc::clone(self),
            page: u32::try_from(offset / HOST_PAGE).map_err(|_| einval())?,
            pages: u32::try_from(len / HOST_PAGE).map_err(|_| einval())?,
        })
    }

    /// Make sure the tag words of arena bytes `[from, to)` are committed (a resumed store
    /// calls it for the whole carved part).
    pub fn commit_tags(&self, from: usize, to: usize) -> std::io::Result<()> {
        let committed_end = self.tags_committed_end.load(Ordering::Acquire);
        let first = (self.tags_offset + from / HOST_PAGE * 4) / HOST_PAGE * HOST_PAGE;
        let first = if first >= self.tags_offset && first <= committed_end {
            committed_end
        } else {
            first
        };
        let last = (self.tags_offset + to.div_ceil(HOST_PAGE) * 4).div_ceil(HOST_PAGE) * HOST_PAGE;
        if last > first {
            self.segment.commit(first, last - first)?;
        }
        // The committed pages stay one run from `tags_offset` only if this one joins it (a
        // carve whose commit failed leaves a gap, and the pages past it are committed anew).
        if first <= committed_end {
            self.tags_committed_end.fetch_max(last, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Make the page tables that map the committed arena pages `pages` (sorted) in this
    /// process: a resumed store's live chunks. The pages exist already, so a later first
    /// touch of one only fills in an entry; a missing page table would be an allocation.
    /// Touches one page per page table (2 MiB of the mapping), not every page: faulting in
    /// 120 MiB of chunks page by page added 0.4 s to every takeover in the VM.
    pub fn map_page_tables(&self, pages: impl Iterator<Item = usize>) -> std::io::Result<()> {
        let mut mapped_table = None;
        for page in pages {
            let offset = page * HOST_PAGE;
            if offset >= self.len {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            }
            let table = self.segment.page_table_of(self.start + offset);
            if mapped_table != Some(table) {
                self.segment.commit(self.start + offset, HOST_PAGE)?;
                mapped_table = Some(table);
            }
        }
        Ok(())
    }

    /// Whether the arena bytes `[offset, offset + len)` (a chunk) are all in memory.
    pub fn in_memory(&self, offset: usize, len: usize) -> std::io::Result<bool> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        self.segment.all_in_memory(self.start + offset, len)
    }

    /// The tag word of arena page `page`; `None` past the arena.
    pub fn tag(&self, page: usize) -> Option<&AtomicU32> {
        self.tags.get(page)
    }
}

/// A carve whose commit failed: why, and the chunks carved (not committed; none when the
/// range could not even be made into chunks).
#[derive(Debug)]
pub struct CarveFailed {
    pub error: std::io::Error,
    pub chunks: Vec<ArenaChunk>,
}

/// One chunk of the arena: like a `Box<[u8]>` whose memory is a range of the arena (read
/// through `&`, written through `&mut`; the arena hands each range to one holder at a time).
/// 16 bytes: the reserve keeps lists of thousands of them ready, in locked memory (at 32,
/// with the segment's reference beside the arena's, they were half a MiB of an idle daemon).
pub struct ArenaChunk {
    arena: Arc<Arena>,
    /// The arena page it starts at, and its length in pages.
    page: u32,
    pages: u32,
}

const _: () = assert!(std::mem::size_of::<ArenaChunk>() == 16);

impl ArenaChunk {
    /// The arena page the chunk starts at.
    pub fn page(&self) -> usize {
        self.page as usize
    }

    /// Where it starts in the segment.
    fn offset(&self) -> usize {
        self.arena.start + self.page() * HOST_PAGE
    }

    /// Its length in bytes (whole pages): what `len()` gives, without going through the
    /// segment's view of the memory.
    fn byte_len(&self) -> usize {
        self.pages as usize * HOST_PAGE
    }

    /// Return the chunk's pages to the system; `recommit_all` brings them back (zeroed).
    /// `&mut`: the kernel zeroes them, so no view of them may be alive meanwhile.
    pub fn decommit(&mut self) -> std::io::Result<()> {
        self.arena.segment.decommit(self.offset(), self.byte_len())
    }

    /// Give back the pages of every chunk in `chunks`, one system call per run of adjacent
    /// chunks (sorting `chunks` by position): how many calls. Why: a reserve moving memory
    /// between chunk sizes punched its chunks one by one, over a thousand calls for 200 MiB
    /// written, each also a TLB shootdown of every other core running the daemon.
    pub fn decommit_all(chunks: &mut [ArenaChunk]) -> std::io::Result<usize> {
        Self::for_each_run(chunks, Segment::decommit)
    }

    /// Commit again the pages of every chunk in `chunks` (given back earlier), one system
    /// call per run of adjacent chunks, as `decommit_all`, and their tag words: a carve whose
    /// tags' commit failed gave its chunks back with their tag pages never committed (a
    /// chunk's first tag store would fault one in). No system call for tags already
    /// committed.
    pub fn recommit_all(chunks: &mut [ArenaChunk]) -> std::io::Result<()> {
        Self::for_each_run(chunks, Segment::commit)?;
        for chunk in chunks.iter() {
            let in_arena = chunk.page() * HOST_PAGE;
            chunk
                .arena
                .commit_tags(in_arena, in_arena + chunk.byte_len())?;
        }
        Ok(())
    }

    /// `op(segment, offset, len)` for each run of adjacent chunks of `chunks`, sorted first:
    /// how many runs; every run is tried, and the first error is returned.
    fn for_each_run(
        chunks: &mut [ArenaChunk],
        op: impl Fn(&Segment, usize, usize) -> std::io::Result<()>,
    ) -> std::io::Result<usize> {
        chunks.sort_unstable_by_key(ArenaChunk::offset);
        let mut result = Ok(());
        let mut runs = 0;
        let mut run_op = |segment: &Segment, start: usize, len: usize| {
            runs += 1;
            let done = op(segment, start, len);
            if result.is_ok() {
                result = done;
            }
        };
        let mut run: Option<(&Arc<Segment>, usize, usize)> = None;
        for chunk in chunks.iter() {
            let segment = &chunk.arena.segment;
            let offset = chunk.offset();
            match &mut run {
                Some((run_segment, start, len))
                    if Arc::ptr_eq(run_segment, segment) && *start + *len == offset =>
                {
                    *len += chunk.byte_len();
                }
                _ => {
                    if let Some((run_segment, start, len)) =
                        run.replace((segment, offset, chunk.byte_len()))
                    {
                        run_op(run_segment, start, len);
                    }
                }
            }
        }
        if let Some((segment, start, len)) = run {
            run_op(segment, start, len);
        }
        result.map(|()| runs)
    }

    /// The chunk as two: its first `len` bytes (whole pages, fewer than it has) and the rest,
    /// with their memory as it is. `Err` gives the chunk back whole.
    pub fn split(self, len: usize) -> Result<(ArenaChunk, ArenaChunk), ArenaChunk> {
        if len == 0 || len >= self.byte_len() || !len.is_multiple_of(HOST_PAGE) {
            return Err(self);
        }
        let offset = self.page() * HOST_PAGE;
        match (
            self.arena.chunk_at(offset, len),
            self.arena.chunk_at(offset + len, self.byte_len() - len),
        ) {
            (Ok(head), Ok(rest)) => Ok((head, rest)),
            _ => Err(self),
        }
    }

    /// `first` and `second`, adjacent in one arena (`second` right after `first`), as one
    /// chunk with their memory as it is. `Err` gives both back as they were.
    pub fn join(
        first: ArenaChunk,
        second: ArenaChunk,
    ) -> Result<ArenaChunk, (ArenaChunk, ArenaChunk)> {
        let offset = first.page() * HOST_PAGE;
        if !Arc::ptr_eq(&first.arena, &second.arena)
            || offset + first.byte_len() != second.page() * HOST_PAGE
        {
            return Err((first, second));
        }
        let joined = first
            .arena
            .chunk_at(offset, first.byte_len() + second.byte_len());
        joined.map_err(|_| (first, second))
    }
}

impl std::fmt::Debug for ArenaChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ArenaChunk(page {}, {} pages)", self.page, self.pages)
    }
}

impl Deref for ArenaChunk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.arena.segment.bytes(self.offset(), self.byte_len())
    }
}

impl DerefMut for ArenaChunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        // `&mut self`: this holder is the only one reaching the range.
        self.arena.segment.bytes_mut(self.offset(), self.byte_len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_disjoint_committed_and_recyclable() {
        let arena = Arena::private(16 * HOST_PAGE).unwrap();
        let mut chunks = arena.carve(2 * HOST_PAGE, 3).unwrap().unwrap();
        for (i, chunk) in chunks.iter_mut().enumerate() {
            assert_eq!(chunk.len(), 2 * HOST_PAGE);
            assert_eq!(chunk.page(), 2 * i);
            chunk.fill(u8::try_from(i).unwrap() + 1);
        }
        for (i, chunk) in chunks.iter().enumerate() {
            assert!(chunk.iter().all(|&b| usize::from(b) == i + 1));
        }
        chunks[1].decommit().unwrap();
        ArenaChunk::recommit_all(&mut chunks[1..2]).unwrap();
        assert!(
            chunks[1].iter().all(|&b| b == 0),
            "a punched hole reads back as zeros"
        );
        assert!(chunks[0].iter().all(|&b| b == 1));
        assert_eq!(arena.carved(), 6 * HOST_PAGE);
        assert!(
            arena.carve(4 * HOST_PAGE, 3).unwrap().is_none(),
            "16 pages hold no 6+12"
        );
        assert_eq!(arena.carve(4 * HOST_PAGE, 2).unwrap().unwrap().len(), 2);
        arena.tag(15).unwrap().store(3, Ordering::Relaxed);
        assert!(arena.tag(16).is_none());
        let again = arena.chunk_at(2 * HOST_PAGE, 2 * HOST_PAGE).unwrap();
        assert_eq!(again.page(), 2);
    }

    #[test]
    fn chunks_given_back_together_leave_their_neighbours_alone() {
        let arena = Arena::private(16 * HOST_PAGE).unwrap();
        let mut chunks = arena.carve(HOST_PAGE, 6).unwrap().unwrap();
        for (i, chunk) in chunks.iter_mut().enumerate() {
            chunk.fill(u8::try_from(i).unwrap() + 1);
        }
        // Out of order, in two runs (0-1 and 3-4) around a chunk that stays.
        let mut given: Vec<ArenaChunk> = [4, 0, 3, 1]
            .into_iter()
            .map(|i| arena.chunk_at(i * HOST_PAGE, HOST_PAGE).unwrap())
            .collect();
        assert_eq!(
            ArenaChunk::decommit_all(&mut given).unwrap(),
            2,
            "a call per run"
        );
        assert_eq!(
            given.iter().map(ArenaChunk::page).collect::<Vec<_>>(),
            [0, 1, 3, 4],
            "sorted by position"
        );
        ArenaChunk::recommit_all(&mut given).unwrap();
        for (i, chunk) in chunks.iter().enumerate() {
            let expected = match i {
                0 | 1 | 3 | 4 => 0,
                _ => u8::try_from(i).unwrap() + 1,
            };
            assert!(chunk.iter().all(|&b| b == expected), "chunk {i}");
        }
    }

    #[test]
    fn every_carve_has_its_tag_pages_committed() {
        // Tags of 3 pages (4 bytes per arena page), carved in groups that straddle them.
        let pages = 3 * HOST_PAGE / 4;
        let arena = Arena::private(pages * HOST_PAGE).unwrap();
        let tag_page = |page: usize| (arena.tags_offset + page * 4) / HOST_PAGE * HOST_PAGE;
        let group = 100;
        let mut carved = 0;
        while let Some(chunks) = arena.carve(HOST_PAGE, group).unwrap() {
            carved += chunks.len();
            let last_tag_page = tag_page(carved - 1);
            assert!(
                arena
                    .segment
                    .all_in_memory(
                        arena.tags_offset,
                        last_tag_page + HOST_PAGE - arena.tags_offset
                    )
                    .unwrap(),
                "tags of the first {carved} pages"
            );
        }
        assert_eq!(carved, pages / group * group);
    }

    #[test]
    fn takers_racing_for_an_arena_s_last_pages_never_get_the_same_page() {
        // Groups that no longer fit and single pages carved at once: a failed fit must not
        // move the cursor back under a page another taker was given meanwhile.
        const PAGES: usize = 40;
        for _ in 0..300 {
            let arena = Arena::private(PAGES * HOST_PAGE).unwrap();
            let barrier = std::sync::Barrier::new(4);
            let mut pages: Vec<usize> = std::thread::scope(|scope| {
                let takers: Vec<_> = (0..4)
                    .map(|taker| {
                        let (arena, barrier) = (&arena, &barrier);
                        scope.spawn(move || {
                            barrier.wait();
                            let mut pages = Vec::new();
                            let mut group = if taker % 2 == 0 { 16 } else { 1 };
                            loop {
                                match arena.carve(HOST_PAGE, group).unwrap() {
                                    Some(chunks) => pages.extend(chunks.iter().map(|c| c.page())),
                                    None if group > 1 => group = 1,
                                    None => return pages,
                                }
                            }
                        })
                    })
                    .collect();
                takers
                    .into_iter()
                    .flat_map(|taker| taker.join().unwrap())
                    .collect()
            });
            pages.sort_unstable();
            assert_eq!(pages, (0..PAGES).collect::<Vec<_>>(), "every page once");
            assert_eq!(arena.carved(), PAGES * HOST_PAGE);
        }
    }

    #[test]
    fn a_chunk_splits_into_two_that_keep_its_data() {
        let arena = Arena::private(16 * HOST_PAGE).unwrap();
        let mut chunk = arena.carve(4 * HOST_PAGE, 1).unwrap().unwrap().remove(0);
        chunk[HOST_PAGE] = 7;
        let chunk = chunk.split(4 * HOST_PAGE).unwrap_err();
        let chunk = chunk.split(HOST_PAGE + 1).unwrap_err();
        let (head, rest) = chunk.split(HOST_PAGE).unwrap();
        assert_eq!((head.page(), head.len()), (0, HOST_PAGE));
        assert_eq!((rest.page(), rest.len()), (1, 3 * HOST_PAGE));
        assert_eq!(rest[0], 7);
    }

    #[test]
    fn adjacent_chunks_join_into_one_that_keeps_their_data() {
        let arena = Arena::private(16 * HOST_PAGE).unwrap();
        let mut chunks = arena.carve(HOST_PAGE, 3).unwrap().unwrap();
        chunks[1][5] = 9;
        let third = chunks.pop().unwrap();
        let second = chunks.pop().unwrap();
        let first = chunks.pop().unwrap();
        // Not adjacent (or in the wrong order): both back as they were.
        let (first, third) = ArenaChunk::join(first, third).unwrap_err();
        let (second, first) = ArenaChunk::join(second, first).unwrap_err();
        let other = Arena::private(16 * HOST_PAGE).unwrap();
        let elsewhere = other.carve(HOST_PAGE, 2).unwrap().unwrap().remove(1);
        let (first, _) = ArenaChunk::join(first, elsewhere).unwrap_err();
        let joined = ArenaChunk::join(first, second).unwrap();
        let joined = ArenaChunk::join(joined, third).unwrap();
        assert_eq!((joined.page(), joined.len()), (0, 3 * HOST_PAGE));
        assert_eq!(joined[HOST_PAGE + 5], 9);
    }
}
