//! Compressed-page memory: a size-class allocator in the manner of the kernel's zsmalloc.
//!
//! An object is named by its position alone (`Handle`: the arena page its chunk starts at and
//! its index there; the class follows from its length), so a page-table entry is one word and
//! means the same to the next process: a store resumed after a crash rebuilds the bookkeeping
//! here from its table (`rebuild`). Each chunk's first page carries a tag (see `mem::Arena`)
//! naming the chunk's id in its class.
//!
//! Objects are rounded up to 16 bytes and packed into chunks of 1 to `MAX_CHUNK_PAGES` pages,
//! the chunk size chosen per class to waste the least tail. Neighbouring sizes that pack the
//! same number of objects into the same chunk size share one class (as in zsmalloc): that
//! costs nothing in packing and saves the partly used last chunk of every merged class. There is no heap allocation per
//! object: a chunk holds many objects, and a bitmap says which are free. A chunk is freed as
//! soon as its last object is. Each chunk has its own lock, so readers of different chunks
//! never meet, and readers of one chunk share it.
//!
//! Compaction: frees leave holes, and a class whose chunks hold many fewer objects than they
//! could (after random discards, or the recompressor moving pages to smaller classes) keeps
//! the memory. `plan_evacuation` marks a class's sparsest chunks *evacuating*: no new object
//! goes there, and the store's background thread moves each object still in one to another
//! chunk (see `store::recompress`); the last move frees the chunk.

#![allow(
    clippy::cast_possible_truncation,
    reason = "size classes are fewer than 256, a chunk holds at most 256 objects (tested), and chunk ids are fewer than stored pages, which are fewer than 2^32 (checked)"
)]
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

pub(super) use super::reserve::Shortage;
use super::reserve::{ChunkReserve, Stall};
use crate::codec::PAGE_SIZE;
use crate::mem::{
    empty_list, faulted_in_list, growth_in_place, out_of_memory, Arena, ArenaChunk, ListAlloc,
    ListVec, Words,
};

/// Object sizes are multiples of this.
const GRANULE: usize = 16;
/// Object sizes before merging: 16, 32, ..., PAGE_SIZE bytes.
const GRANULES: usize = PAGE_SIZE / GRANULE;
/// Most size classes (one per object size before merging).
pub(super) const MAX_CLASSES: usize = GRANULES;
/// Largest chunk, in pages (zsmalloc's default chain size too). Chunks of up to 16 pages fit
/// the classes 0.7% tighter on a 4 GiB working set, but every class's last, partly used chunk
/// costs twice as much: on real pages 8 is better up to about 1 GiB and within 0.7% above.
const MAX_CHUNK_PAGES: usize = 8;

/// Most objects a chunk holds (16-byte objects in one page; no class packs more: the test
/// `merged_classes_pack_like_their_members`), and the words of its free bitmap.
const MAX_OBJS_PER_CHUNK: usize = 256;
const BITMAP_WORDS: usize = MAX_OBJS_PER_CHUNK / 64;
/// Chunks a class can add before its bookkeeping must grow (see `provision`).
const PROVISION_MIN_SLACK: usize = 64;
/// The same for a class that never had a chunk. Why less: every chunk of room is about 100
/// bytes of locked heap, and of the 120 classes many hold nothing for a long time (an idle
/// store, or pages that all compress alike); at `PROVISION_MIN_SLACK`'s room an idle store
/// held 1.6 MB of it. The first chunks of a class make the next `provision` give it the usual
/// room.
const UNUSED_CLASS_SLACK: usize = 8;
/// The same for a rebuilt class until the first `provision` after the resume (see
/// `rebuild_room`).
const REBUILD_MIN_SLACK: usize = 8;
/// A class's lists are made small again (see `provision`) once they have room for at least
/// this many times what its live chunks and their slack need...
const SHRINK_FACTOR: usize = 2;
/// ...and that room is at least this many bytes: below it, making them anew frees too little
/// to be worth a pass over them under the class lock.
const SHRINK_MIN_BYTES: usize = 256 << 10;
/// A class is compacted once it holds more chunks than its objects need by at least one
/// chunk and by at least 1/`COMPACT_SLACK_DIVISOR` of its chunks (3%).
const COMPACT_SLACK_DIVISOR: usize = 32;
/// Chunks one `plan_evacuation` marks in a class at most: moves come in bounded rounds.
const MAX_EVACUATING_PER_PLAN: usize = 1024;

/// Where one object lives: the arena page its chunk starts at and its index in the chunk,
/// packed into the low 45 bits of a `u64` (the page table keeps them in its entry word).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Handle(u64);

/// Bits of a handle for the object index (a chunk holds at most 256 objects).
const OBJ_BITS: u32 = 8;
/// Arena pages a handle can name: 2^37 (an arena of up to 512 TiB).
pub(super) const MAX_ARENA_PAGES: u64 = 1 << 37;

impl Handle {
    fn new(page: usize, obj: usize) -> Self {
        Handle(((page as u64) << OBJ_BITS) | obj as u64)
    }
    fn page(self) -> usize {
        (self.0 >> OBJ_BITS) as usize
    }
    fn obj(self) -> usize {
        (self.0 & ((1 << OBJ_BITS) - 1)) as usize
    }
    pub(super) fn to_bits(self) -> u64 {
        self.0
    }
    pub(super) fn from_bits(bits: u64) -> Self {
        Handle(bits)
    }
}

/// How long background work tries to commit a chunk of its own where no refill thread runs
/// (a takeover's first moments, a shutdown's last): a commit the system grants at once, never
/// a wait in reclaim that holds a hand-over up.
const BACKGROUND_PATIENCE: std::time::Duration = std::time::Duration::from_millis(20);

fn background_patience(waited: std::time::Duration) -> bool {
    waited >= BACKGROUND_PATIENCE
}

/// Who takes an object, and so how a new chunk for it is waited for.
#[derive(Clone, Copy)]
enum Taker<'a> {
    /// The I/O path (a write, a flush): waits for the refill thread until `give_up` says so
    /// (`None`: never gives up), as `ChunkReserve::take`.
    Io(Option<&'a dyn Fn(std::time::Duration) -> bool>),
    /// Background work: a ready chunk (`ChunkReserve::take_ready`), never a wait for the
    /// refill thread; without one, a commit of its own given up after
    /// `BACKGROUND_PATIENCE`.
    Background,
}

/// Bookkeeping of one chunk, kept under its class's mutex.
#[derive(Debug)]
struct ChunkUsage {
    used: u32,
    /// Bit set = object free. Inline, so adding a chunk allocates nothing on the heap.
    free: [u64; BITMAP_WORDS],
    /// Position in the class's `partial` list, if the chunk has a free object and is not
    /// evacuating.
    partial_pos: Option<u32>,
    /// Being emptied by compaction: takes no new objects.
    evacuating: bool,
}

#[derive(Debug)]
struct ClassState {
    /// Indexed by chunk id; `None` for ids whose chunk was freed.
    usage: ListVec<Option<ChunkUsage>>,
    /// Chunks with at least one free object.
    partial: ListVec<u32>,
    /// Chunk ids free for reuse.
    free_ids: ListVec<u32>,
    /// Objects held and live chunks, for `plan_evacuation`.
    objects: usize,
    chunks: usize,
    /// Live chunks marked evacuating.
    evacuating: usize,
}

impl ClassState {
    fn new() -> Self {
        Self {
            usage: empty_list(ListAlloc::Mapped),
            partial: empty_list(ListAlloc::Mapped),
            free_ids: empty_list(ListAlloc::Mapped),
            objects: 0,
            chunks: 0,
            evacuating: 0,
        }
    }
}

/// Bookkeeping bytes per chunk id: its entries in the four lists.
const LIST_BYTES_PER_CHUNK: usize = std::mem::size_of::<Option<ChunkUsage>>()
    + std::mem::size_of::<Option<Chunk>>()
    + 2 * std::mem::size_of::<u32>();

/// One chunk's bytes, shared by readers, exclusive to the writer copying an object in.
type Chunk = RwLock<ArenaChunk>;

/// A class's chunks by id, read-locked.
type ChunkDirectory<'a> = RwLockReadGuard<'a, ListVec<Option<Chunk>>>;

struct SizeClass {
    obj_size: usize,
    objs_per_chunk: usize,
    chunk_bytes: usize,
    /// The chunks, by id. Readers take this lock shared; it is taken exclusively only to add
    /// or remove a chunk, or to renumber them (see `provision`), and always with `state`
    /// held.
    chunks: RwLock<ListVec<Option<Chunk>>>,
    state: Mutex<ClassState>,
    /// `ClassState::evacuating`, readable without the lock: whether any object of the class
    /// may need moving.
    evacuating: AtomicU64,
}

/// The allocator. All methods take `&self`; it is shared by writers, readers and the flusher.
pub(super) struct ZsAllocator {
    classes: Box<[SizeClass]>,
    /// Class of an object of `(i + 1) * GRANULE` bytes.
    class_of: Box<[u8]>,
    /// Bytes of all live chunks (zram's mem_used_total).
    chunk_bytes: AtomicU64,
    /// Where chunks come from and go back to.
    pub(super) reserve: ChunkReserve,
    /// Where each class's live chunks are noted when its lists are provisioned, for the next
    /// process's rebuild (see `layout`): `None` for an allocator no process resumes.
    chunk_notes: Option<Words<AtomicU64>>,
    /// Times the system refused a class's lists (`provision`): logged at powers of two, not
    /// on every refill pass while it lasts.
    list_refusals: AtomicU64,
    /// The object size of the class a taker last waited for room in the lists of (0: none
    /// yet), for the log line of a write that starved.
    room_waited_object_bytes: AtomicUsize,
}

/// Pages per chunk for objects of `obj_size` bytes: the fewest pages with the least tail waste.
fn chunk_pages(obj_size: usize) -> usize {
    (1..=MAX_CHUNK_PAGES)
        .min_by_key(|&k| {
            let bytes = k * PAGE_SIZE;
            // Waste per object, scaled to compare fractions without floats.
            (bytes % obj_size) * 1_000_000 / bytes
        })
        .unwrap_or(1)
}

/// The size classes, and the class of an object of `(i + 1) * GRANULE` bytes.
fn size_classes() -> (Box<[SizeClass]>, Box<[u8]>) {
    let mut classes: Vec<SizeClass> = Vec::new();
    let mut class_of = vec![0u8; GRANULES];
    // From the largest size down, so that a merged class takes its largest member's size.
    for granule in (0..GRANULES).rev() {
        let obj_size = (granule + 1) * GRANULE;
        let chunk_bytes = chunk_pages(obj_size) * PAGE_SIZE;
        let objs_per_chunk = chunk_bytes / obj_size;
        let same_packing = classes.last().is_some_and(|c: &SizeClass| {
            c.chunk_bytes == chunk_bytes && c.objs_per_chunk == objs_per_chunk
        });
        if !same_packing {
            classes.push(SizeClass {
                obj_size,
                objs_per_chunk,
                chunk_bytes,
                chunks: RwLock::new(empty_list(ListAlloc::Mapped)),
                state: Mutex::new(ClassState::new()),
                evacuating: AtomicU64::new(0),
            });
        }
        // At most GRANULES (256) classes: the index fits a u8.
        class_of[granule] = (classes.len() - 1) as u8;
    }
    (classes.into_boxed_slice(), class_of.into_boxed_slice())
}

/// A fingerprint of the class table: objects are found by their length's class, so a store is
/// only readable by a binary whose classes pack the same (see `layout`).
pub(super) fn class_fingerprint() -> u64 {
    let (classes, class_of) = size_classes();
    // FNV-1a over every class's object size and chunk size, by member size.
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let mut mix = |v: u64| {
        hash ^= v;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    };
    for (granule, &class) in class_of.iter().enumerate() {
        let c = &classes[usize::from(class)];
        mix(granule as u64);
        mix(c.obj_size as u64);
        mix(c.chunk_bytes as u64);
    }
    hash
}

impl ZsAllocator {
    /// An allocator of chunks from `arena` that keeps about `reserve_bytes` of them ready (see
    /// `reserve`), noting its classes' live chunks in `chunk_notes` (one word per class).
    pub(super) fn new(
        reserve_bytes: u64,
        arena: Arc<Arena>,
        chunk_notes: Option<Words<AtomicU64>>,
    ) -> Self {
        let (classes, class_of) = size_classes();
        let mut classes_per_size = [0u64; MAX_CHUNK_PAGES];
        for class in &classes {
            classes_per_size[class.chunk_bytes / PAGE_SIZE - 1] += 1;
        }
        Self {
            classes,
            class_of,
            chunk_bytes: AtomicU64::new(0),
            reserve: ChunkReserve::new(reserve_bytes, arena, &classes_per_size),
            chunk_notes,
            list_refusals: AtomicU64::new(0),
            room_waited_object_bytes: AtomicUsize::new(0),
        }
    }

    /// The class of an object of `len` bytes.
    fn class_index(&self, len: usize) -> usize {
        let granule = len.clamp(1, PAGE_SIZE).div_ceil(GRANULE) - 1;
        usize::from(self.class_of[granule])
    }

    /// The id, in class `class`, of the live chunk starting at arena page `page`.
    fn chunk_id(&self, page: usize) -> Option<usize> {
        let tag = self.reserve.arena().tag(page)?.load(Ordering::Acquire);
        (tag as usize).checked_sub(1)
    }

    /// Bytes of memory in chunks.
    pub(super) fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of bookkeeping (chunk directory, usage and bitmaps, the reserve's lists), for the
    /// stats.
    pub(super) fn metadata_bytes(&self) -> u64 {
        let mut total = 0usize;
        for class in self.classes.iter() {
            let dir = class.chunks.read().capacity();
            let st = class.state.lock();
            total += dir * std::mem::size_of::<Option<Chunk>>()
                + st.usage.capacity() * std::mem::size_of::<Option<ChunkUsage>>()
                + (st.partial.capacity() + st.free_ids.capacity()) * 4;
        }
        (total + std::mem::size_of_val(&*self.classes) + self.class_of.len()) as u64
            + self.reserve.list_bytes()
    }

    /// Grow each class's bookkeeping ahead of need, and make it small again once most of
    /// the class's chunks are gone, from the calling (refill) thread.
    ///
    /// Why grow here: adding a chunk on the I/O path pushes onto these vectors, and a push
    /// past their capacity reallocates: fresh heap pages faulted in under memory pressure by a
    /// thread that serves swap (seen in the VM: a rayon worker stuck in such a fault while
    /// every swap bio waited for it). Here the new buffers are allocated and faulted in
    /// outside every lock, and only the move of the entries happens under the class lock.
    ///
    /// Why shrink: the lists only ever grew, and after a near-OOM fill whose pages were then
    /// freed (its programs killed) they held room for every chunk the fill had, about 100
    /// bytes a chunk, all locked (9.6 MiB in the VM after stress-ng's workers died). Chunk ids
    /// are the allocator's own (a handle names an arena page, and the chunk there names its
    /// id in its tag), so the live chunks are renumbered 0.. and the lists cut to them; their
    /// old buffers, large ones being mappings of their own (`ListAlloc`), go back to the
    /// system when dropped. Not while memory is short: a class then keeps what it has, since
    /// its chunks may be needed again at once.
    pub(super) fn provision(&self) {
        self.provision_classes(
            &|_, lists| lists.capacity - lists.len < provision_slack(lists.len),
            !self.reserve.memory_short(),
        );
    }

    /// `provision` only for the classes with no room left, where the next taker of a new
    /// chunk would wait for it (`take_object`), and no shrinking: for when the refill thread
    /// must not fault in memory that nobody waits for yet (while a write waits for memory:
    /// `BatchedPageStore::provide`).
    pub(super) fn provision_where_full(&self) {
        self.provision_classes(&|_, lists| !lists.has_room, false);
    }

    /// The object size of the class a taker last waited for room in the lists of, if one
    /// did.
    pub(super) fn room_waited_object_bytes(&self) -> Option<usize> {
        match self.room_waited_object_bytes.load(Ordering::Relaxed) {
            0 => None,
            bytes => Some(bytes),
        }
    }

    /// `provision` for the classes `remake` picks (given a class and its lists), and with
    /// `shrink`, for the classes whose lists are far larger than their live chunks need:
    /// their lists are made anew with faulted-in room. Each class's live chunks are noted
    /// (`chunk_notes`).
    fn provision_classes(&self, remake: &dyn Fn(usize, ListsNow) -> bool, shrink: bool) {
        for (index, class) in self.classes.iter().enumerate() {
            let (lists, chunks) = {
                let st = class.state.lock();
                let lists = ListsNow {
                    len: st.usage.len(),
                    capacity: st.usage.capacity(),
                    has_room: has_room(&st),
                };
                (lists, st.chunks)
            };
            self.note_chunks(index, chunks);
            let compact_want = chunks + 2 * provision_slack(chunks);
            let compact = shrink
                && lists.capacity >= SHRINK_FACTOR * compact_want
                && lists.capacity * LIST_BYTES_PER_CHUNK >= SHRINK_MIN_BYTES;
            let grow = remake(index, lists);
            if !compact && !grow {
                continue;
            }
            let want = if compact {
                compact_want
            } else {
                lists.len + 2 * provision_slack(lists.len)
            };
            if !compact && self.grow_lists_in_place(class, want) {
                continue;
            }
            self.reserve.make_room_for(want * LIST_BYTES_PER_CHUNK);
            let lists = (|| {
                Ok::<_, std::io::Error>((
                    faulted_in_list::<Option<ChunkUsage>>(want, ListAlloc::Mapped)?,
                    faulted_in_list::<Option<Chunk>>(want, ListAlloc::Mapped)?,
                    faulted_in_list::<u32>(want, ListAlloc::Mapped)?,
                    faulted_in_list::<u32>(want, ListAlloc::Mapped)?,
                ))
            })();
            // Refused: the class keeps its lists, a taker finding no room in them waits for a
            // later pass (see `take_object`), and this one goes on with the other classes.
            let (mut usage, mut dir, mut partial, mut free_ids) = match lists {
                Ok(lists) => lists,
                Err(error) => {
                    let refusals = self.list_refusals.fetch_add(1, Ordering::Relaxed) + 1;
                    if refusals.is_power_of_two() {
                        tracing::warn!(%error, class = index, entries = want, refusals, "no room for a size class's bookkeeping: its lists stay as they are");
                    }
                    continue;
                }
            };
            {
                let mut st = class.state.lock();
                let mut chunks = class.chunks.write();
                // `partial` and `free_ids` never hold more entries than `usage`: one capacity
                // covers all four.
                // Moved only if it still fits: nothing may allocate under the class lock.
                if compact && st.chunks <= want && st.usage.len() == chunks.len() {
                    self.renumber_into(&mut st, &mut chunks, &mut usage, &mut dir, &mut partial);
                    std::mem::swap(&mut st.usage, &mut usage);
                    std::mem::swap(&mut *chunks, &mut dir);
                    std::mem::swap(&mut st.partial, &mut partial);
                    std::mem::swap(&mut st.free_ids, &mut free_ids);
                } else if (grow || st.usage.capacity() < want) && st.usage.len() <= want {
                    usage.append(&mut st.usage);
                    dir.append(&mut chunks);
                    partial.append(&mut st.partial);
                    free_ids.append(&mut st.free_ids);
                    std::mem::swap(&mut st.usage, &mut usage);
                    std::mem::swap(&mut *chunks, &mut dir);
                    std::mem::swap(&mut st.partial, &mut partial);
                    std::mem::swap(&mut st.free_ids, &mut free_ids);
                }
            }
            // The old (or unused) buffers are freed here, outside the locks.
        }
    }

    /// Grow a class's four lists to `want` entries in place (see `mem::growth_in_place`): their
    /// new room faulted in outside the class lock, then the lists grown under it, which moves
    /// nothing and touches no fresh page (with memory short, reserve memory beyond demand is
    /// given back first for the fault: `ChunkReserve::make_room_for`). False (nothing grown)
    /// if one of them would move, or the system refused the room.
    fn grow_lists_in_place(&self, class: &SizeClass, want: usize) -> bool {
        let [Some(usage), Some(dir), Some(partial), Some(free_ids)] = ({
            let st = class.state.lock();
            [
                growth_in_place(&st.usage, want),
                growth_in_place(&class.chunks.read(), want),
                growth_in_place(&st.partial, want),
                growth_in_place(&st.free_ids, want),
            ]
        }) else {
            return false;
        };
        let growths = [&usage, &dir, &partial, &free_ids];
        self.reserve
            .make_room_for(growths.iter().map(|growth| growth.bytes()).sum());
        // Room the system refused is not grown into (that would fault it in under the
        // locks): the caller's fallback, fresh lists, is refused the same way, or not.
        if growths.iter().any(|growth| growth.fault_in().is_err()) {
            return false;
        }
        let mut st = class.state.lock();
        let mut chunks = class.chunks.write();
        // Only this thread replaces a class's lists; one changed meanwhile (its room not the
        // room faulted in) is left as it is for the next `provision`.
        usage.apply(&mut st.usage, want);
        dir.apply(&mut chunks, want);
        partial.apply(&mut st.partial, want);
        free_ids.apply(&mut st.free_ids, want);
        true
    }

    /// Move a class's live chunks into the empty lists given (room for every live chunk),
    /// numbered 0.. in their old order, each chunk's tag naming its new id, and the partial
    /// list into `partial` with the new ids; the old lists are left empty. Under the class
    /// lock and its directory's write lock: every id in use is taken under the one, every
    /// chunk looked up under the other.
    fn renumber_into(
        &self,
        st: &mut ClassState,
        dir: &mut ListVec<Option<Chunk>>,
        new_usage: &mut ListVec<Option<ChunkUsage>>,
        new_dir: &mut ListVec<Option<Chunk>>,
        new_partial: &mut ListVec<u32>,
    ) {
        // Within the room given: `partial` never holds more entries than there are chunks.
        new_partial.resize(st.partial.len(), u32::MAX);
        for (usage, chunk) in st.usage.drain(..).zip(dir.drain(..)) {
            let (usage, mut chunk) = match (usage, chunk) {
                (Some(usage), Some(chunk)) => (usage, chunk),
                (None, None) => continue,
                (usage, chunk) => {
                    tracing::error!(
                        usage = usage.is_some(),
                        chunk = chunk.is_some(),
                        "a chunk id with bookkeeping but no chunk, or the reverse: dropped"
                    );
                    continue;
                }
            };
            let id = new_usage.len() as u32;
            if let Some(slot) = usage
                .partial_pos
                .and_then(|pos| new_partial.get_mut(pos as usize))
            {
                *slot = id;
            }
            if let Some(tag) = self.reserve.arena().tag(chunk.get_mut().page()) {
                tag.store(id + 1, Ordering::Release);
            }
            new_usage.push(Some(usage));
            new_dir.push(Some(chunk));
        }
        st.partial.clear();
        st.free_ids.clear();
    }

    fn note_chunks(&self, class: usize, chunks: usize) {
        if let Some(note) = self.chunk_notes.as_ref().and_then(|notes| notes.get(class)) {
            note.store(chunks as u64, Ordering::Relaxed);
        }
    }

    /// Copy `bytes` (1 to `PAGE_SIZE` of them) into a new object; `None` if the arena's
    /// address space is used up, which its size rules out (see `BatchedPageStore::open`), or
    /// if, with no refill thread to wait for, the system refused every commit for
    /// `COMMIT_RETRY_FOR` (a memory limit on the daemon's cgroup that nothing can be
    /// killed for: see `ChunkReserve::take`).
    pub(super) fn store(&self, bytes: &[u8]) -> Option<Handle> {
        self.store_within(bytes, None).ok()
    }

    /// `store`, giving up on a new chunk when `give_up` says so, as `ChunkReserve::take` does.
    pub(super) fn store_within(
        &self,
        bytes: &[u8],
        give_up: Option<&dyn Fn(std::time::Duration) -> bool>,
    ) -> Result<Handle, Shortage> {
        self.store_as(bytes, Taker::Io(give_up))
    }

    /// `store` for background work (the recompressor, compaction): `None` where a new chunk
    /// would have to be waited for while writes wait for one, or for longer than
    /// `BACKGROUND_PATIENCE` (see `Taker::Background`).
    pub(super) fn store_in_background(&self, bytes: &[u8]) -> Option<Handle> {
        self.store_as(bytes, Taker::Background).ok()
    }

    fn store_as(&self, bytes: &[u8], taker: Taker<'_>) -> Result<Handle, Shortage> {
        let class_idx = self.class_index(bytes.len());
        let class = &self.classes[class_idx];
        let (dir, chunk, obj) = self.take_object(class_idx, taker)?;
        let Some(Some(lock)) = dir.get(chunk as usize) else {
            return Err(Shortage::ArenaFull);
        };
        let mut data = lock.write();
        let off = usize::from(obj) * class.obj_size;
        // Objects are at most PAGE_SIZE (every caller's slot size), so this always fits.
        data.get_mut(off..off + bytes.len())
            .ok_or(Shortage::ArenaFull)?
            .copy_from_slice(bytes);
        Ok(Handle::new(data.page(), usize::from(obj)))
    }

    /// Take a free object of class `class_idx`: its chunk's id and its index there, with the
    /// class's directory read-locked, taken before the class lock is let go, so that the id
    /// still names the chunk when it is looked up (`provision` renumbers chunks).
    fn take_object(
        &self,
        class_idx: usize,
        taker: Taker<'_>,
    ) -> Result<(ChunkDirectory<'_>, u32, u16), Shortage> {
        let class = &self.classes[class_idx];
        let mut st = class.state.lock();
        loop {
            let chunk = match st.partial.last() {
                Some(&id) => id,
                None if matches!(taker, Taker::Io(_)) && st.evacuating > 0 => {
                    // The class's other chunks are full and its sparsest are marked for
                    // compaction: new objects go into their room, not into a chunk taken
                    // for them (memory the system may not have; seen by a review: writes
                    // starving while marked chunks held room until the recompressor's next
                    // pass).
                    unmark_evacuating(class, &mut st);
                    continue;
                }
                None => {
                    // Taking a chunk may wait for the reserve's refill thread: not under the
                    // class lock, which frees (discards, overwrites) need meanwhile, and which
                    // free memory the refill may be waiting for (seen in the VM: a discard
                    // stuck behind a flush that waited for the refill).
                    drop(st);
                    let pages = class.chunk_bytes / PAGE_SIZE;
                    let data = match taker {
                        Taker::Io(give_up) => self.reserve.take(pages, give_up)?,
                        Taker::Background => {
                            match self.reserve.take_ready(pages) {
                                Some(data) => data,
                                // Waiting for the refill thread would count as a waiter
                                // (the store's writes then fall under the starvation rule)
                                // and may open the pools' kept quarter: `take_ready` has
                                // asked it for one, for the next try.
                                None if self.reserve.refill_serves() => {
                                    return Err(Shortage::Starved {
                                        waited: std::time::Duration::ZERO,
                                    })
                                }
                                // No refill thread (none is set up, or it ended): commit
                                // here, as nothing else will.
                                None => self.reserve.take(pages, Some(&background_patience))?,
                            }
                        }
                    };
                    st = class.state.lock();
                    // No push here may grow a list (see `provision`): wait for the refill
                    // thread to make room, as for the chunk itself, and give up as a taker
                    // of a chunk does (the system may refuse the room for good).
                    if self.reserve.refill_running() && !has_room(&st) {
                        let give_up = match taker {
                            Taker::Io(give_up) => give_up,
                            // Background work never waits, and gives up before it is noted
                            // as waiting: that counts as a taker waiting for the refill
                            // thread (`ChunkReserve::starving`) and names its size in the
                            // next starved write's log line.
                            Taker::Background => {
                                drop(st);
                                self.reserve.give_back(data);
                                return Err(Shortage::Starved {
                                    waited: std::time::Duration::ZERO,
                                });
                            }
                        };
                        self.room_waited_object_bytes
                            .store(class.obj_size, Ordering::Relaxed);
                        self.reserve.note_waiting_for_room();
                        let stall = Stall::new();
                        // Until the refill thread ends (a shutdown's last flush): then the
                        // push below grows the list itself, as without one.
                        while !has_room(&st) && self.reserve.refill_running() {
                            drop(st);
                            let waited = stall.waited(&self.reserve);
                            if give_up.is_some_and(|give_up| give_up(waited)) {
                                self.reserve.note_stopped_waiting_for_room();
                                self.reserve.give_back(data);
                                return Err(Shortage::Starved { waited });
                            }
                            self.reserve.await_refill_pass();
                            st = class.state.lock();
                        }
                        self.reserve.note_stopped_waiting_for_room();
                    }
                    self.add_chunk(class, &mut st, data)
                }
            };
            let ClassState { usage, partial, .. } = &mut *st;
            let pos = partial.len() as u32 - 1;
            let free_bit = usage
                .get_mut(chunk as usize)
                .and_then(Option::as_mut)
                .and_then(|u| {
                    let word = u.free.iter().position(|w| *w != 0)?;
                    Some((u, word))
                });
            let Some((u, word)) = free_bit else {
                // Not reachable while the lists agree; dropping the stale entry keeps the
                // allocator serving instead of failing a flush.
                tracing::error!(class_idx, chunk, "partial list named a full or dead chunk");
                partial.pop();
                // A live chunk must not keep the position just dropped: its next free would
                // take out whichever chunk holds that position later.
                if let Some(Some(u)) = usage.get_mut(chunk as usize) {
                    u.partial_pos = None;
                }
                continue;
            };
            let bit = u.free[word].trailing_zeros() as usize;
            u.free[word] &= !(1u64 << bit);
            u.used += 1;
            if u.used as usize == class.objs_per_chunk {
                u.partial_pos = None;
                remove_partial(partial, usage, pos);
            }
            st.objects += 1;
            return Ok((class.chunks.read(), chunk, (word * 64 + bit) as u16));
        }
    }

    /// Add `data` as a new, empty chunk of `class`; returns its id.
    fn add_chunk(&self, class: &SizeClass, st: &mut ClassState, data: ArenaChunk) -> u32 {
        let mut free = [0u64; BITMAP_WORDS];
        for i in 0..class.objs_per_chunk {
            free[i / 64] |= 1 << (i % 64);
        }
        let page = data.page();
        let data = RwLock::new(data);
        let mut dir = class.chunks.write();
        let id = match st.free_ids.pop() {
            Some(id) => {
                dir[id as usize] = Some(data);
                id
            }
            None => {
                dir.push(Some(data));
                st.usage.push(None);
                (dir.len() - 1) as u32
            }
        };
        st.usage[id as usize] = Some(ChunkUsage {
            used: 0,
            free,
            partial_pos: Some(st.partial.len() as u32),
            evacuating: false,
        });
        st.partial.push(id);
        st.chunks += 1;
        if let Some(tag) = self.reserve.arena().tag(page) {
            tag.store(id + 1, Ordering::Release);
        }
        self.chunk_bytes
            .fetch_add(class.chunk_bytes as u64, Ordering::Relaxed);
        id
    }

    /// Free the object of `len` bytes at `handle`; frees its chunk if it was the chunk's last
    /// (to the reserve, see `ChunkReserve::give_back`).
    pub(super) fn free(&self, handle: Handle, len: usize) {
        if let Some(chunk) = self.free_object(handle, len) {
            self.reserve.give_back(chunk);
        }
    }

    /// Free the object of `len` bytes at `handle`; its chunk, if it was the chunk's last, for
    /// the caller to give back (one of a run of frees, see `ChunkReserve::give_back_all`).
    pub(super) fn free_object(&self, handle: Handle, len: usize) -> Option<ArenaChunk> {
        let class = &self.classes[self.class_index(len)];
        // As `with_object`: an object its class cannot have (a table word broken) names no
        // free bit, and taking one off the chunk's count would give the chunk back early.
        if handle.obj() >= class.objs_per_chunk || len > class.obj_size {
            tracing::error!(
                ?handle,
                len,
                "free of an object its class cannot have ignored"
            );
            return None;
        }
        let mut st = class.state.lock();
        let Some(id) = self.chunk_id(handle.page()) else {
            tracing::error!(?handle, "free of an object in no live chunk ignored");
            return None;
        };
        let ClassState {
            usage,
            partial,
            free_ids,
            objects,
            chunks,
            evacuating,
        } = &mut *st;
        let Some(Some(u)) = usage.get_mut(id) else {
            tracing::error!(?handle, "free of an object in no live chunk ignored");
            return None;
        };
        let bit = handle.obj() % 64;
        let Some(word) = u.free.get_mut(handle.obj() / 64) else {
            tracing::error!(?handle, "free of an object past its chunk ignored");
            return None;
        };
        if *word & (1 << bit) != 0 {
            tracing::error!(?handle, "double free ignored");
            return None;
        }
        *word |= 1 << bit;
        u.used -= 1;
        *objects -= 1;
        if u.used == 0 {
            let was_evacuating = u.evacuating;
            if let Some(pos) = u.partial_pos.take() {
                remove_partial(partial, usage, pos);
            }
            if was_evacuating {
                *evacuating -= 1;
                class.evacuating.fetch_sub(1, Ordering::Relaxed);
            }
            *chunks -= 1;
            usage[id] = None;
            if let Some(tag) = self.reserve.arena().tag(handle.page()) {
                tag.store(0, Ordering::Release);
            }
            let chunk = class.chunks.write()[id].take();
            free_ids.push(id as u32);
            self.chunk_bytes
                .fetch_sub(class.chunk_bytes as u64, Ordering::Relaxed);
            return chunk.map(RwLock::into_inner);
        }
        if u.partial_pos.is_none() && !u.evacuating {
            u.partial_pos = Some(partial.len() as u32);
            partial.push(id as u32);
        }
        None
    }

    /// Whether the object of `len` bytes at `handle` is in a chunk being evacuated. Only
    /// meaningful while some entry names the object (its chunk is then live).
    pub(super) fn is_evacuating(&self, handle: Handle, len: usize) -> bool {
        let class = &self.classes[self.class_index(len)];
        if class.evacuating.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let st = class.state.lock();
        self.chunk_id(handle.page())
            .and_then(|id| st.usage.get(id))
            .and_then(Option::as_ref)
            .is_some_and(|u| u.evacuating)
    }

    /// Whether any chunk of the class of `len`-byte objects is being evacuated (no lock).
    pub(super) fn class_evacuating(&self, len: usize) -> bool {
        self.classes[self.class_index(len)]
            .evacuating
            .load(Ordering::Relaxed)
            > 0
    }

    /// Chunks of every class being evacuated (no lock).
    pub(super) fn evacuating_chunks(&self) -> u64 {
        self.classes
            .iter()
            .map(|class| class.evacuating.load(Ordering::Relaxed))
            .sum()
    }

    /// Mark the sparsest chunks of each class holding more chunks than its objects need
    /// (see `COMPACT_SLACK_DIVISOR`) as evacuating, as many as the other chunks have room to
    /// take their objects. A class with chunks still evacuating is left alone. Returns the
    /// chunks marked.
    pub(super) fn plan_evacuation(&self) -> usize {
        let mut marked = 0;
        for class in self.classes.iter() {
            // Nothing is allocated, nor sorted, under the class's lock, which every take and
            // free of an object waits for (and the daemon's heap is locked: an allocation
            // faults its pages in, and may wait in reclaim): the candidates are copied into
            // room made before, and sorted after.
            let ids = {
                let st = class.state.lock();
                if st.evacuating > 0 || evacuation_slack(&st, class.objs_per_chunk) == 0 {
                    continue;
                }
                st.usage.len()
            };
            let mut candidates: Vec<(u32, u32)> = Vec::with_capacity(ids);
            {
                let st = class.state.lock();
                let live = st.usage.iter().enumerate().filter_map(|(id, u)| {
                    u.as_ref()
                        .filter(|u| !u.evacuating)
                        .map(|u| (u.used, id as u32))
                });
                candidates.extend(live.take(ids));
            }
            // The sparsest chunks, fewest objects first.
            candidates.sort_unstable();
            let mut st = class.state.lock();
            let slack = evacuation_slack(&st, class.objs_per_chunk);
            if st.evacuating > 0 || slack == 0 {
                continue;
            }
            let ClassState {
                usage,
                partial,
                evacuating,
                ..
            } = &mut *st;
            let mut taken = 0;
            for &(_, id) in &candidates {
                if taken == slack.min(MAX_EVACUATING_PER_PLAN) {
                    break;
                }
                // Freed (or reused) since the copy: marking one is never wrong, only less
                // useful, but a freed id has nothing to mark.
                let Some(Some(u)) = usage.get_mut(id as usize) else {
                    continue;
                };
                u.evacuating = true;
                if let Some(pos) = u.partial_pos.take() {
                    remove_partial(partial, usage, pos);
                }
                *evacuating += 1;
                class.evacuating.fetch_add(1, Ordering::Relaxed);
                taken += 1;
            }
            marked += taken;
        }
        marked
    }

    /// Take every chunk marked evacuating back into use, its free objects for new ones: for
    /// a compaction that stopped early, and while a taker waits for a chunk (a marked chunk
    /// takes no new object, and the sparsest chunks have the most room: new pages would need
    /// new chunks, from memory the system does not have). Returns the chunks unmarked.
    pub(super) fn abandon_evacuation(&self) -> usize {
        let mut unmarked = 0;
        for class in self.classes.iter() {
            if class.evacuating.load(Ordering::Relaxed) == 0 {
                continue;
            }
            unmarked += unmark_evacuating(class, &mut class.state.lock());
        }
        unmarked
    }

    /// Run `f` on the first `len` bytes of the object, under its chunk's read lock.
    /// `None` if the handle names no live object (which would be a bug).
    pub(super) fn with_object<R>(
        &self,
        handle: Handle,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Option<R> {
        let class = &self.classes[self.class_index(len)];
        // A length beyond its class's objects (a table word broken, or not from this build)
        // would read into the next object or past the chunk.
        if handle.obj() >= class.objs_per_chunk || len > class.obj_size {
            return None;
        }
        // The id under the directory's lock: `provision` renumbers chunks under its write lock.
        let dir = class.chunks.read();
        let id = self.chunk_id(handle.page())?;
        let chunk = dir.get(id)?.as_ref()?.read();
        if chunk.page() != handle.page() {
            return None;
        }
        let off = handle.obj() * class.obj_size;
        Some(f(&chunk[off..off + len]))
    }

    /// Test hook: let `f` change an object's bytes in place.
    #[cfg(test)]
    pub(super) fn with_object_mut(&self, handle: Handle, len: usize, f: impl FnOnce(&mut [u8])) {
        let class = &self.classes[self.class_index(len)];
        let dir = class.chunks.read();
        if let Some(Some(lock)) = self.chunk_id(handle.page()).and_then(|id| dir.get(id)) {
            let off = handle.obj() * class.obj_size;
            f(&mut lock.write()[off..off + class.obj_size]);
        }
    }

    /// Test hook: each class's room in its lists (entries).
    #[cfg(test)]
    pub(super) fn list_capacities(&self) -> Vec<usize> {
        self.classes
            .iter()
            .map(|class| class.state.lock().usage.capacity())
            .collect()
    }

    /// Test hook: leave a class that holds no chunk with no room in its lists (as if the
    /// system had refused its room); which one, if any.
    #[cfg(test)]
    pub(super) fn leave_an_unused_class_without_room(&self) -> Option<usize> {
        self.classes.iter().position(|class| {
            let mut st = class.state.lock();
            let unused = st.usage.is_empty() && st.free_ids.is_empty();
            if unused {
                st.usage.shrink_to(0);
            }
            unused && !has_room(&st)
        })
    }
}

/// A rebuild in progress: the pages of the carved arena as a resumed store finds them in its
/// table (0 for pages no live chunk covers, else the class index + 1 of the chunk covering
/// it), and the room each class's lists were given, faulted in, before the scan.
pub(super) struct Occupancy {
    pages: Vec<u16>,
    room: [usize; MAX_CLASSES],
}

/// Room a rebuild gives a class whose previous owner noted `noted` live chunks: that, and a
/// margin for chunks added since the note and until the first `provision` after the resume,
/// which then gives the class its usual room the usual way. Less than `provision` keeps:
/// this room is heap a standby holds ready all the time (see `rebuild_heap_bytes`).
fn rebuild_room(noted: u64) -> usize {
    let noted = usize::try_from(noted).unwrap_or(usize::MAX);
    noted.saturating_add((noted / 8).max(REBUILD_MIN_SLACK))
}

/// Heap bytes a rebuild allocates for classes of `noted` live chunks and a carved arena of
/// `carved_bytes`: the lists, and the occupancy map.
pub(super) fn rebuild_heap_bytes(noted: &[u64], carved_bytes: u64) -> usize {
    let pages = usize::try_from(carved_bytes).unwrap_or(usize::MAX) / PAGE_SIZE;
    // All classes together hold no more chunks than the carved arena has pages: wild notes
    // ask for no more than room for those.
    let room = noted
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| rebuild_room(n.min(pages as u64)))
        .fold(0, usize::saturating_add)
        .min(rebuild_room(pages as u64).saturating_add(MAX_CLASSES * REBUILD_MIN_SLACK));
    room.saturating_mul(LIST_BYTES_PER_CHUNK)
        .saturating_add(pages.saturating_mul(std::mem::size_of::<u16>()))
}

impl ZsAllocator {
    /// Start a rebuild (a store resumed after its process died): every tag of the carved arena
    /// cleared, nothing live yet, and each class's lists given faulted-in room for the chunks
    /// its previous owner noted (see `chunk_notes`).
    ///
    /// Why the room first: lists grown by pushes during the scan would have to be copied and
    /// faulted in again after it, and at a takeover memory is at its scarcest; with the heap
    /// the standby kept ready (see `rebuild_heap_bytes`), the rebuild takes no new page.
    pub(super) fn begin_rebuild(&self) -> std::io::Result<Occupancy> {
        let arena = self.reserve.arena();
        let carved = arena.carved().min(arena.len());
        arena.commit_tags(0, carved)?;
        let pages = carved / PAGE_SIZE;
        for page in 0..pages {
            if let Some(tag) = arena.tag(page) {
                tag.store(0, Ordering::Relaxed);
            }
        }
        let mut room = [0; MAX_CLASSES];
        for (index, class) in self.classes.iter().enumerate() {
            let noted = self
                .chunk_notes
                .as_ref()
                .and_then(|notes| notes.get(index))
                .map_or(0, |note| note.load(Ordering::Relaxed));
            if noted == 0 {
                continue;
            }
            // A class never has more chunks than the carved arena holds: a wild note costs
            // no more than room for that.
            let most = (pages / (class.chunk_bytes / PAGE_SIZE)) as u64;
            let want = rebuild_room(noted.min(most));
            let mut st = class.state.lock();
            // From the heap the standby faulted in (see `rebuild_heap_bytes`), not new mappings.
            st.usage = faulted_in_list(want, ListAlloc::Heap)?;
            st.partial = faulted_in_list(want, ListAlloc::Heap)?;
            st.free_ids = faulted_in_list(want, ListAlloc::Heap)?;
            *class.chunks.write() = faulted_in_list(want, ListAlloc::Heap)?;
            room[index] = st.usage.capacity();
        }
        let mut occupied = Vec::new();
        occupied.try_reserve_exact(pages).map_err(out_of_memory)?;
        occupied.resize(pages, 0);
        Ok(Occupancy {
            pages: occupied,
            room,
        })
    }

    /// Take the object of `len` bytes at `handle` as live (a stored entry of the resumed
    /// table). False if it cannot be: outside the carved arena, overlapping a chunk of another
    /// class or at another start, longer than its class's objects, or an object some other
    /// entry already holds.
    pub(super) fn adopt(&self, handle: Handle, len: usize, occupancy: &mut Occupancy) -> bool {
        let class_idx = self.class_index(len);
        let class = &self.classes[class_idx];
        if handle.obj() >= class.objs_per_chunk || len > class.obj_size {
            return false;
        }
        let first = handle.page();
        let pages = class.chunk_bytes / PAGE_SIZE;
        let Some(span) = occupancy.pages.get_mut(first..first + pages) else {
            return false;
        };
        let mark = class_idx as u16 + 1;
        let mut st = class.state.lock();
        let id = if span.iter().all(|&c| c == 0) {
            let Ok(chunk) = self
                .reserve
                .arena()
                .chunk_at(first * PAGE_SIZE, class.chunk_bytes)
            else {
                return false;
            };
            span.fill(mark);
            self.add_chunk(class, &mut st, chunk) as usize
        } else {
            match self.chunk_id(first) {
                Some(id) if span.iter().all(|&c| c == mark) => id,
                _ => return false,
            }
        };
        let ClassState { usage, partial, .. } = &mut *st;
        let Some(Some(u)) = usage.get_mut(id) else {
            return false;
        };
        let (word, bit) = (handle.obj() / 64, handle.obj() % 64);
        if u.free[word] & (1 << bit) == 0 {
            return false; // another entry holds this object
        }
        u.free[word] &= !(1u64 << bit);
        u.used += 1;
        if u.used as usize == class.objs_per_chunk {
            if let Some(pos) = u.partial_pos.take() {
                remove_partial(partial, usage, pos);
            }
        }
        st.objects += 1;
        true
    }

    /// End a rebuild: every carved page no live chunk covers goes back to the system and into
    /// the reserve as free chunks; the page tables that map the live chunks are made in this
    /// process, and the reserve's lists get faulted-in room. A class's lists that outgrew the
    /// room `begin_rebuild` gave them are made anew: what pushes added was never faulted in.
    /// The others keep their room, however little slack it leaves: until the refill thread's
    /// first `provision`, a class out of room grows its lists on the I/O path, from the heap
    /// the standby kept ready.
    ///
    /// Why: the I/O path of a resumed store (the flusher adding a chunk, a read, a free) must
    /// allocate nothing. A first touch of fresh memory needs a page, or a page table for the
    /// mapping, and the I/O threads are I/O flushers: at the watermark such a fault can only
    /// wait for the writes they serve (seen in the VM after a takeover during a swap storm:
    /// the flusher spun in reclaim for good, faulting in room of a list that a rebuild had
    /// grown by pushes).
    pub(super) fn finish_rebuild(&self, occupancy: Occupancy) -> std::io::Result<()> {
        let arena = self.reserve.arena();
        let Occupancy {
            pages: occupied,
            room,
        } = occupancy;
        let pages = occupied.len();
        arena.map_page_tables((0..pages).filter(|&page| occupied[page] != 0))?;
        // Free pages still in memory (the previous process's reserve, chunks it freed) are
        // kept ready, as far as the reserve's target goes; the rest are given back. Why: a
        // resume comes when memory is scarcest (a takeover), and what it gave back would have
        // to be committed again at once, by a refill competing with every other task for the
        // pages it had just let go (seen in the VM: after a takeover at the watermark the
        // refill's commit waited in reclaim for good, and the writes behind it).
        let mut kept = Vec::new();
        let mut page = 0;
        while page < pages {
            if occupied[page] != 0 {
                page += 1;
                continue;
            }
            let end = page + occupied[page..].iter().take_while(|&&c| c == 0).count();
            while page < end {
                let left = end - page;
                let Some(n) = self.reserve.ready_chunk_wanted(left.min(MAX_CHUNK_PAGES)) else {
                    self.give_back_free_run(page, left)?;
                    page = end;
                    break;
                };
                let mut chunk = arena.chunk_at(page * PAGE_SIZE, n * PAGE_SIZE)?;
                // Not known to be in memory (mincore refused, as a system call filter may):
                // given back, as every free page was before.
                if arena
                    .in_memory(page * PAGE_SIZE, n * PAGE_SIZE)
                    .unwrap_or(false)
                {
                    kept.push(page);
                    self.reserve.adopt_ready(chunk);
                } else {
                    chunk.decommit()?;
                    self.reserve.adopt_cold(chunk);
                }
                page += n;
            }
        }
        arena.map_page_tables(kept.into_iter())?;
        self.provision_classes(&|class, lists| lists.capacity > room[class], false);
        self.reserve.provision_pools();
        Ok(())
    }
}

impl ZsAllocator {
    /// Give the free arena pages `[page, page + count)` of a resumed store back to the system
    /// and take them as cold chunks.
    fn give_back_free_run(&self, page: usize, count: usize) -> std::io::Result<()> {
        let arena = self.reserve.arena();
        arena
            .chunk_at(page * PAGE_SIZE, count * PAGE_SIZE)?
            .decommit()?;
        let mut left = count;
        while left > 0 {
            let n = left.min(MAX_CHUNK_PAGES);
            let at = page + count - left;
            self.reserve
                .adopt_cold(arena.chunk_at(at * PAGE_SIZE, n * PAGE_SIZE)?);
            left -= n;
        }
        Ok(())
    }
}

/// Room `provision` keeps free in a class whose lists have `len` entries.
fn provision_slack(len: usize) -> usize {
    if len == 0 {
        UNUSED_CLASS_SLACK
    } else {
        (len / 8).max(PROVISION_MIN_SLACK)
    }
}

/// A class's lists as `provision_classes` found them.
#[derive(Clone, Copy)]
struct ListsNow {
    /// Entries in `usage` (ids handed out).
    len: usize,
    /// Room in `usage` (and in the other lists, which are never shorter).
    capacity: usize,
    /// Whether a chunk can be added without growing a list (`has_room`).
    has_room: bool,
}

/// Whether a class can add a chunk without growing a list: an id to reuse, or room for a new
/// one (`provision` keeps `partial` and the directory at least as large as `usage`).
fn has_room(st: &ClassState) -> bool {
    !st.free_ids.is_empty() || st.usage.len() < st.usage.capacity()
}

/// Take `class`'s chunks marked evacuating back into use (`abandon_evacuation`), under its
/// lock `st`. The pushes grow no list: `partial` has room for every id (see `has_room`).
/// Returns the chunks unmarked.
fn unmark_evacuating(class: &SizeClass, st: &mut ClassState) -> usize {
    let ClassState {
        usage,
        partial,
        evacuating,
        ..
    } = st;
    let mut unmarked = 0;
    for id in 0..usage.len() {
        let Some(Some(u)) = usage.get_mut(id) else {
            continue;
        };
        if !u.evacuating {
            continue;
        }
        u.evacuating = false;
        *evacuating -= 1;
        class.evacuating.fetch_sub(1, Ordering::Relaxed);
        unmarked += 1;
        if (u.used as usize) < class.objs_per_chunk && u.partial_pos.is_none() {
            u.partial_pos = Some(partial.len() as u32);
            partial.push(id as u32);
        }
    }
    unmarked
}

/// How many more chunks the class of `st` holds than its objects need, when that is worth
/// compacting (at least 1/`COMPACT_SLACK_DIVISOR` of its chunks); else 0.
fn evacuation_slack(st: &ClassState, objs_per_chunk: usize) -> usize {
    if st.chunks == 0 {
        return 0;
    }
    let needed = st.objects.div_ceil(objs_per_chunk);
    let slack = st.chunks - needed.min(st.chunks);
    if slack * COMPACT_SLACK_DIVISOR < st.chunks {
        0
    } else {
        slack
    }
}

/// Remove the entry at `pos` of `partial` (swap-remove), fixing the moved chunk's position.
fn remove_partial(partial: &mut ListVec<u32>, usage: &mut [Option<ChunkUsage>], pos: u32) {
    // Past the end only if the lists disagree (see `take_object`): nothing to remove.
    if pos as usize >= partial.len() {
        return;
    }
    partial.swap_remove(pos as usize);
    if let Some(&moved) = partial.get(pos as usize) {
        if let Some(Some(m)) = usage.get_mut(moved as usize) {
            m.partial_pos = Some(pos);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_choice_keeps_tail_waste_small() {
        // Average tail waste over the classes compressed pages use (up to 3/4 page).
        let mut worst = 0.0f64;
        let mut sum = 0.0;
        let classes = crate::codec::MAX_COMPRESSED_LEN / GRANULE;
        for i in 0..classes {
            let s = (i + 1) * GRANULE;
            let bytes = chunk_pages(s) * PAGE_SIZE;
            let waste = (bytes % s) as f64 / bytes as f64;
            worst = worst.max(waste);
            sum += waste;
        }
        let avg = sum / classes as f64;
        assert!(avg < 0.015, "average tail waste {avg}");
        assert!(worst < 0.06, "worst tail waste {worst}");
    }

    #[test]
    fn a_free_of_an_object_its_class_cannot_have_changes_nothing() {
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        let len = 1000;
        let handle = a.store(&[7u8; 1000]).unwrap();
        let class = &a.classes[a.class_index(len)];
        let past = Handle::new(handle.page(), class.objs_per_chunk);
        assert!(a.free_object(past, len).is_none());
        assert!(a.free_object(handle, class.obj_size + 1).is_none());
        // The chunk still counts its object: freeing that one gives the chunk up.
        assert!(a.with_object(handle, len, |b| b == [7u8; 1000]).unwrap());
        assert!(a.free_object(handle, len).is_some());
    }

    #[test]
    fn merged_classes_pack_like_their_members() {
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        assert!(
            a.classes.len() < GRANULES / 2,
            "{} classes",
            a.classes.len()
        );
        for granule in 0..GRANULES {
            let size = (granule + 1) * GRANULE;
            let class = &a.classes[usize::from(a.class_of[granule])];
            assert!(class.obj_size >= size);
            assert_eq!(
                class.chunk_bytes,
                chunk_pages(size) * PAGE_SIZE,
                "size {size}"
            );
            assert_eq!(
                class.objs_per_chunk,
                class.chunk_bytes / size,
                "size {size}"
            );
            // A chunk's free bitmap and the objects' numbers within it rely on this.
            assert!(class.objs_per_chunk <= MAX_OBJS_PER_CHUNK, "size {size}");
        }
    }

    #[test]
    fn store_read_free_and_chunk_release() {
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        let mut handles = Vec::new();
        for i in 0..1000usize {
            let len = 1 + (i * 37) % PAGE_SIZE;
            let bytes: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
            handles.push((a.store(&bytes).unwrap(), bytes));
        }
        assert!(a.chunk_bytes() > 0);
        for (h, bytes) in &handles {
            let got = a.with_object(*h, bytes.len(), |b| b.to_vec()).unwrap();
            assert_eq!(&got, bytes);
        }
        // Free every other one, then the rest; memory must come back to zero.
        for (h, bytes) in handles.iter().step_by(2) {
            a.free(*h, bytes.len());
        }
        for (h, bytes) in handles.iter().skip(1).step_by(2) {
            let got = a.with_object(*h, bytes.len(), |b| b.to_vec()).unwrap();
            assert_eq!(&got, bytes);
        }
        for (h, bytes) in handles.iter().skip(1).step_by(2) {
            a.free(*h, bytes.len());
        }
        assert_eq!(a.chunk_bytes(), 0);
    }

    #[test]
    fn freed_slots_are_reused() {
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        let hs: Vec<_> = (0..100).map(|_| a.store(&[1u8; 1000]).unwrap()).collect();
        let used = a.chunk_bytes();
        for h in &hs[..50] {
            a.free(*h, 1000);
        }
        for _ in 0..50 {
            a.store(&[2u8; 1000]);
        }
        assert_eq!(a.chunk_bytes(), used);
    }

    /// An allocator whose 1000-byte class had 2000 objects, three in four of them freed
    /// since: chunks for 2000, objects for 500, spread over every chunk.
    fn sparse_class_of_1000_byte_objects() -> ZsAllocator {
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        let live: Vec<Handle> = (0..2000).map(|_| a.store(&[3u8; 1000]).unwrap()).collect();
        for (_, h) in live.iter().enumerate().filter(|(i, _)| i % 4 != 0) {
            a.free(*h, 1000);
        }
        a
    }

    #[test]
    fn abandoned_evacuations_take_new_objects_again() {
        let a = sparse_class_of_1000_byte_objects();
        let marked = a.plan_evacuation();
        assert!(marked > 0);
        assert_eq!(a.abandon_evacuation(), marked);
        assert!(!a.class_evacuating(1000) && a.evacuating_chunks() == 0);
        // Their free objects take new ones: no chunk more for as many as were freed.
        let chunk_bytes = a.chunk_bytes();
        for _ in 0..1000 {
            a.store(&[4u8; 1000]).unwrap();
        }
        assert_eq!(a.chunk_bytes(), chunk_bytes);
        assert_eq!(a.abandon_evacuation(), 0);
        assert!(a.plan_evacuation() > 0, "planned again later");
    }

    /// A write that finds its class's other chunks full takes the room of the chunks marked
    /// for compaction, rather than a new chunk: memory the system may not have while the
    /// marks wait for the recompressor's next pass.
    #[test]
    fn writes_take_marked_chunks_back_before_a_new_chunk() {
        let a = sparse_class_of_1000_byte_objects();
        let chunk_bytes = a.chunk_bytes();
        let marked = a.plan_evacuation();
        assert!(marked > 0 && a.class_evacuating(1000));
        // As many as were freed: more than the unmarked chunks have room for.
        for _ in 0..1500 {
            a.store(&[4u8; 1000]).unwrap();
        }
        assert_eq!(
            a.chunk_bytes(),
            chunk_bytes,
            "a chunk taken while marked ones had room"
        );
        assert_eq!(a.evacuating_chunks(), 0);
        assert_eq!(a.abandon_evacuation(), 0);
    }

    #[test]
    fn evacuating_chunks_take_no_new_objects_and_go_once_emptied() {
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        let mut live: Vec<Handle> = (0..2000).map(|_| a.store(&[3u8; 1000]).unwrap()).collect();
        assert_eq!(a.plan_evacuation(), 0, "a full class needs no compaction");
        // Free three objects in four, scattered over every chunk.
        let mut kept = Vec::new();
        for (i, h) in live.drain(..).enumerate() {
            if i % 4 == 0 {
                kept.push(h);
            } else {
                a.free(h, 1000);
            }
        }
        let fragmented = a.chunk_bytes();
        let marked = a.plan_evacuation();
        assert!(marked > 0);
        assert!(a.class_evacuating(1000) && !a.class_evacuating(100));
        assert_eq!(a.plan_evacuation(), 0, "not again while chunks evacuate");
        // Move what is in evacuating chunks, as the store's thread does: never into one.
        let mut moved = 0;
        for h in &mut kept {
            if a.is_evacuating(*h, 1000) {
                let new = a.store(&[3u8; 1000]).unwrap();
                assert!(!a.is_evacuating(new, 1000));
                a.free(*h, 1000);
                *h = new;
                moved += 1;
            }
        }
        assert!(moved > 0);
        assert!(!a.class_evacuating(1000), "every evacuated chunk was freed");
        let fresh = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        for _ in &kept {
            fresh.store(&[3u8; 1000]).unwrap();
        }
        assert!(a.chunk_bytes() < fragmented);
        assert!(
            a.chunk_bytes() * 100 <= fresh.chunk_bytes() * 105,
            "{} against {}",
            a.chunk_bytes(),
            fresh.chunk_bytes()
        );
        for h in &kept {
            assert_eq!(
                a.with_object(*h, 1000, <[u8]>::to_vec).unwrap(),
                vec![3u8; 1000]
            );
        }
    }

    #[test]
    fn a_rebuilt_class_adds_chunks_without_growing_a_list() {
        // Enough objects of one size for a class of well over 64 chunks, whose lists a rebuild
        // grows by pushes: their room must come from `provision` (faulted in; see
        // `finish_rebuild`), the same for all four lists.
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        let handles: Vec<Handle> = (0..1500).map(|_| a.store(&[3u8; 2000]).unwrap()).collect();
        let b = ZsAllocator::new(0, Arc::clone(a.reserve.arena()), None);
        drop(a);
        let mut occupancy = b.begin_rebuild().unwrap();
        for h in &handles {
            assert!(b.adopt(*h, 2000, &mut occupancy));
        }
        b.finish_rebuild(occupancy).unwrap();
        let class = &b.classes[b.class_index(2000)];
        let st = class.state.lock();
        assert!(
            st.usage.len() > 2 * PROVISION_MIN_SLACK,
            "{}",
            st.usage.len()
        );
        assert!(st.usage.capacity() - st.usage.len() >= PROVISION_MIN_SLACK);
        assert!(st.partial.capacity() >= st.usage.capacity());
        assert!(st.free_ids.capacity() >= st.usage.capacity());
        assert!(class.chunks.read().capacity() >= st.usage.capacity());
    }

    #[test]
    fn a_store_left_without_room_in_its_lists_gives_up_and_keeps_nothing() {
        // A refill thread that provisions nothing (the system refuses its lists): a fresh
        // class has no room for its first chunk, and the store gives up when told to, with
        // the chunk it took given back rather than left in no list.
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        a.reserve.pretend_refill_running(true);
        let give_up = |_: std::time::Duration| true;
        assert!(matches!(
            a.store_within(&[5u8; 1000], Some(&give_up)),
            Err(Shortage::Starved { .. })
        ));
        assert_eq!(a.chunk_bytes(), 0);
        assert!(!a.reserve.starving(), "no waiter left counted");
        let class = &a.classes[a.class_index(1000)];
        assert_eq!(a.room_waited_object_bytes(), Some(class.obj_size));
        // Once the lists get room, it stores.
        a.reserve.pretend_refill_running(false);
        let handle = a.store(&[5u8; 1000]).unwrap();
        assert_eq!(
            a.with_object(handle, 1000, <[u8]>::to_vec).unwrap(),
            vec![5u8; 1000]
        );
    }

    #[test]
    fn background_work_never_waits_for_a_chunk() {
        // A refill thread that commits nothing: background work gets no chunk, within its
        // patience, and is no longer counted as starving once it gives up; while a write
        // waits for a chunk, none at once. An object in a chunk that has room is stored as
        // ever.
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        a.reserve.pretend_refill_running(true);
        let started = std::time::Instant::now();
        assert_eq!(a.store_in_background(&[6u8; 1000]), None);
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        assert!(!a.reserve.starving());
        a.reserve.note_waiting();
        let started = std::time::Instant::now();
        assert_eq!(a.store_in_background(&[6u8; 1000]), None);
        assert!(started.elapsed() < BACKGROUND_PATIENCE);
        a.reserve.note_served();
        assert_eq!(a.chunk_bytes(), 0);
        a.reserve.pretend_refill_running(false);
        let first = a.store(&[6u8; 1000]).unwrap();
        a.reserve.pretend_refill_running(true);
        let second = a.store_in_background(&[7u8; 1000]).unwrap();
        assert_eq!(
            a.with_object(first, 1000, <[u8]>::to_vec).unwrap(),
            vec![6u8; 1000]
        );
        assert_eq!(
            a.with_object(second, 1000, <[u8]>::to_vec).unwrap(),
            vec![7u8; 1000]
        );
    }

    #[test]
    fn background_work_never_counts_as_a_taker_waiting_for_the_refill_thread() {
        // A reserve whose refill thread serves (said to run; it commits nothing): background
        // work that finds no ready chunk gives up at once and asks the refill thread for one,
        // without counting as a waiter or a miss (the store's writes would fall under the
        // starvation rule while it waited).
        let a = ZsAllocator::new(1 << 20, Arena::private(64 << 20).unwrap(), None);
        a.reserve.pretend_refill_running(true);
        let started = std::time::Instant::now();
        assert_eq!(a.store_in_background(&[6u8; 1000]), None);
        assert!(started.elapsed() < BACKGROUND_PATIENCE);
        assert_eq!(a.reserve.misses(), 0);
        assert!(!a.reserve.starving());
        assert_eq!(a.chunk_bytes(), 0);
        // Without a refill thread, it commits a chunk of its own.
        a.reserve.pretend_refill_running(false);
        let handle = a.store_in_background(&[6u8; 1000]).unwrap();
        assert_eq!(
            a.with_object(handle, 1000, <[u8]>::to_vec).unwrap(),
            vec![6u8; 1000]
        );
    }

    #[test]
    fn background_work_finding_no_room_in_its_lists_gives_up_unnoticed() {
        // A ready chunk, and a refill thread that provisions nothing (a fresh class's lists
        // have no room): background work gives its chunk back and gives up without being
        // noted as a taker waiting for room (which the next starved write's log line names).
        let a = ZsAllocator::new(1 << 20, Arena::private(64 << 20).unwrap(), None);
        a.reserve.refill();
        a.reserve.pretend_refill_running(true);
        assert!(a.reserve.held_bytes() > 0);
        assert_eq!(a.store_in_background(&[6u8; 1000]), None);
        assert_eq!(a.room_waited_object_bytes(), None);
        assert!(!a.reserve.starving());
        assert_eq!(a.chunk_bytes(), 0);
    }

    #[test]
    fn a_wait_for_room_ends_with_the_refill_thread() {
        // A taker with no give-up rule (the flusher's last install at a shutdown) waits for
        // the refill thread to make room in a fresh class's lists; once that thread has
        // ended, nothing else would, and it waited for good.
        let a = Arc::new(ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None));
        a.reserve.pretend_refill_running(true);
        let ender = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                a.reserve.pretend_refill_running(false);
            })
        };
        let handle = a.store(&[5u8; 1000]).unwrap();
        ender.join().unwrap();
        assert_eq!(
            a.with_object(handle, 1000, <[u8]>::to_vec).unwrap(),
            vec![5u8; 1000]
        );
    }

    #[test]
    fn an_unused_class_keeps_little_room_and_a_used_one_the_usual() {
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        a.provision();
        let idle = a.metadata_bytes();
        assert!(idle < 400 << 10, "idle bookkeeping {idle} bytes");
        let class = a.class_index(2000);
        for _ in 0..40 {
            a.store(&[1u8; 2000]).unwrap();
        }
        a.provision();
        let st = a.classes[class].state.lock();
        assert!(st.usage.capacity() - st.usage.len() >= PROVISION_MIN_SLACK);
    }

    /// Bytes of object number `n` of a test: a pattern no other object repeats.
    fn object_bytes(n: u64, len: usize) -> Vec<u8> {
        (0..len as u64)
            .map(|i| (n.wrapping_mul(0x9e37_79b9) ^ (i * 7)) as u8)
            .collect()
    }

    #[test]
    fn lists_shrink_to_the_live_chunks_and_every_object_stays_readable() {
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        let class = a.class_index(PAGE_SIZE);
        // One object a chunk: 6,000 chunk ids, then all but every 500th freed (so the ids
        // left are spread up to the highest).
        let handles: Vec<Handle> = (0..6000u64)
            .map(|n| a.store(&object_bytes(n, PAGE_SIZE)).unwrap())
            .collect();
        a.provision();
        let full = a.metadata_bytes();
        let mut kept = Vec::new();
        for (n, &h) in handles.iter().enumerate() {
            if n % 500 == 499 {
                kept.push((n as u64, h));
            } else {
                a.free(h, PAGE_SIZE);
            }
        }
        a.provision();
        let small = a.metadata_bytes();
        assert!(small * 4 < full, "bookkeeping {full} -> {small} bytes");
        {
            let st = a.classes[class].state.lock();
            assert_eq!(st.usage.len(), kept.len(), "ids renumbered 0..");
            assert!(st.free_ids.is_empty());
        }
        let check = |kept: &[(u64, Handle)]| {
            for &(n, h) in kept {
                let same = a.with_object(h, PAGE_SIZE, |b| b == &object_bytes(n, PAGE_SIZE)[..]);
                assert_eq!(same, Some(true), "object {n}");
            }
        };
        check(&kept);
        // The renumbered class takes new objects and frees old ones as before.
        for n in 10_000..10_100u64 {
            kept.push((n, a.store(&object_bytes(n, PAGE_SIZE)).unwrap()));
        }
        check(&kept);
        for &(_, h) in &kept {
            a.free(h, PAGE_SIZE);
        }
        assert_eq!(a.chunk_bytes(), 0);
        a.provision();
        // Beyond what an allocator that never held a chunk keeps (each class's room ahead, the
        // reserve's lists), little of what the 6,000 chunks took is left.
        let fresh = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        fresh.provision();
        let (left, floor) = (a.metadata_bytes(), fresh.metadata_bytes());
        assert!(
            left.saturating_sub(floor) * 8 < full,
            "{left} bytes against {floor} fresh, {full} at the fullest"
        );
    }

    #[test]
    fn renumbering_while_objects_come_and_go_loses_none() {
        let a = Arc::new(ZsAllocator::new(
            0,
            Arena::private(128 << 20).unwrap(),
            None,
        ));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let provisioner = {
            let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut passes = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    a.provision();
                    passes += 1;
                }
                passes
            })
        };
        let workers: Vec<_> = (0..4u64)
            .map(|w| {
                let a = Arc::clone(&a);
                std::thread::spawn(move || {
                    let mut live: Vec<(u64, usize, Handle)> = Vec::new();
                    let mut rng = 0x2545_f491_4f6c_dd1d_u64 ^ w;
                    let mut next = || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    for round in 0..4u64 {
                        // Up to 1,500 objects each (mostly one a chunk), then all but a
                        // twentieth freed: the lists grow past the shrink threshold and fall
                        // far below it.
                        for i in 0..1500u64 {
                            let n = (w << 40) | (round << 20) | i;
                            let len = [PAGE_SIZE, PAGE_SIZE, 3000, 100][(next() % 4) as usize];
                            live.push((n, len, a.store(&object_bytes(n, len)).unwrap()));
                            let (n, len, h) = live[(next() % live.len() as u64) as usize];
                            let same = a.with_object(h, len, |b| b == &object_bytes(n, len)[..]);
                            assert_eq!(same, Some(true), "object {n:x} while storing");
                        }
                        while live.len() > 75 {
                            let (_, len, h) =
                                live.swap_remove((next() % live.len() as u64) as usize);
                            a.free(h, len);
                        }
                        for &(n, len, h) in &live {
                            let same = a.with_object(h, len, |b| b == &object_bytes(n, len)[..]);
                            assert_eq!(same, Some(true), "object {n:x} after the frees");
                        }
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                    live
                })
            })
            .collect();
        let live: Vec<_> = workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect();
        stop.store(true, Ordering::Relaxed);
        assert!(provisioner.join().unwrap() > 0);
        for &(n, len, h) in &live {
            assert_eq!(
                a.with_object(h, len, |b| b == &object_bytes(n, len)[..]),
                Some(true)
            );
            a.free(h, len);
        }
        assert_eq!(a.chunk_bytes(), 0);
    }

    /// A memory of its own for one word per class, as a store's header has them.
    fn notes_memory() -> Arc<crate::mem::Segment> {
        let segment = crate::mem::Segment::private(PAGE_SIZE).unwrap();
        segment.commit(0, PAGE_SIZE).unwrap();
        segment
    }

    fn chunk_notes(memory: &Arc<crate::mem::Segment>) -> Words<AtomicU64> {
        memory.words(0, MAX_CLASSES).unwrap()
    }

    #[test]
    fn a_rebuild_sized_by_the_noted_chunks_copies_no_list() {
        let memory = notes_memory();
        let notes = chunk_notes(&memory);
        let a = ZsAllocator::new(
            0,
            Arena::private(64 << 20).unwrap(),
            Some(chunk_notes(&memory)),
        );
        let handles: Vec<Handle> = (0..1500).map(|_| a.store(&[3u8; 2000]).unwrap()).collect();
        a.provision();
        let class = a.class_index(2000);
        assert_eq!(
            notes[class].load(Ordering::Relaxed) as usize,
            a.classes[class].state.lock().chunks
        );
        let b = ZsAllocator::new(0, Arc::clone(a.reserve.arena()), Some(notes));
        drop(a);
        let mut occupancy = b.begin_rebuild().unwrap();
        let lists_before = {
            let st = b.classes[class].state.lock();
            (st.usage.as_ptr(), st.partial.as_ptr())
        };
        for h in &handles {
            assert!(b.adopt(*h, 2000, &mut occupancy));
        }
        b.finish_rebuild(occupancy).unwrap();
        {
            let st = b.classes[class].state.lock();
            assert_eq!(
                (st.usage.as_ptr(), st.partial.as_ptr()),
                lists_before,
                "a list was made anew"
            );
            assert!(has_room(&st));
        }
        // The first provision after the resume gives the class its usual room.
        b.provision();
        let st = b.classes[class].state.lock();
        assert!(
            st.usage.capacity() - st.usage.len() >= (st.usage.len() / 8).max(PROVISION_MIN_SLACK)
        );
    }

    #[test]
    fn a_wild_note_costs_no_more_than_the_arena_holds() {
        let notes = chunk_notes(&notes_memory());
        for note in notes.iter() {
            note.store(u64::MAX, Ordering::Relaxed);
        }
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        let h = a.store(&[5u8; 700]).unwrap();
        let b = ZsAllocator::new(0, Arc::clone(a.reserve.arena()), Some(notes));
        drop(a);
        let mut occupancy = b.begin_rebuild().unwrap();
        assert!(b.adopt(h, 700, &mut occupancy));
        b.finish_rebuild(occupancy).unwrap();
        assert_eq!(
            b.with_object(h, 700, <[u8]>::to_vec).unwrap(),
            vec![5u8; 700]
        );
        let carved_pages = b.reserve.arena().carved() / PAGE_SIZE;
        for class in b.classes.iter() {
            assert!(class.state.lock().usage.capacity() <= rebuild_room(carved_pages as u64));
        }
    }

    #[test]
    fn rebuild_takes_live_objects_and_refuses_conflicts() {
        let a = ZsAllocator::new(0, Arena::private(64 << 20).unwrap(), None);
        let objects: Vec<(Handle, Vec<u8>)> = (0..300usize)
            .map(|i| {
                let bytes = vec![i as u8; 1 + (i * 53) % 3000];
                (a.store(&bytes).unwrap(), bytes)
            })
            .collect();
        // The next process: same arena, bookkeeping rebuilt from the objects alone.
        let b = ZsAllocator::new(0, Arc::clone(a.reserve.arena()), None);
        drop(a);
        let mut occupancy = b.begin_rebuild().unwrap();
        for (h, bytes) in objects.iter().step_by(2) {
            assert!(b.adopt(*h, bytes.len(), &mut occupancy));
        }
        let (h, bytes) = &objects[0];
        assert!(!b.adopt(*h, bytes.len(), &mut occupancy), "held twice");
        assert!(
            !b.adopt(*h, 4096, &mut occupancy),
            "the same place as another class"
        );
        b.finish_rebuild(occupancy).unwrap();
        for (h, bytes) in objects.iter().step_by(2) {
            let got = b.with_object(*h, bytes.len(), <[u8]>::to_vec).unwrap();
            assert_eq!(&got, bytes);
        }
        for (h, bytes) in objects.iter().step_by(2) {
            b.free(*h, bytes.len());
        }
        assert_eq!(b.chunk_bytes(), 0);
        // Space freed by the rebuild is used again.
        let again = b.store(&[7u8; 100]).unwrap();
        assert_eq!(
            b.with_object(again, 100, <[u8]>::to_vec).unwrap(),
            vec![7u8; 100]
        );
    }
}
