//! Compressed-page memory: a size-class allocator in the manner of the kernel's zsmalloc.
//!
//! Objects are rounded up to 16 bytes and packed into chunks of 1 to `MAX_CHUNK_PAGES` pages,
//! the chunk size chosen per class to waste the least tail. Neighbouring sizes that pack the
//! same number of objects into the same chunk size share one class (as in zsmalloc): that
//! costs nothing in packing and saves the partly used last chunk of every merged class. There is no heap allocation per
//! object: a chunk holds many objects, and a bitmap says which are free. A chunk is freed as
//! soon as its last object is. Each chunk has its own lock, so readers of different chunks
//! never meet, and readers of one chunk share it.

#![allow(
    clippy::cast_possible_truncation,
    reason = "size classes are fewer than 256, a chunk holds at most 256 objects (checked), and chunk ids are fewer than stored pages, which are fewer than 2^32 (checked)"
)]
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};

use super::reserve::ChunkReserve;
use crate::codec::PAGE_SIZE;
use crate::mem::{faulted_in_vec, ArenaChunk};

/// Object sizes are multiples of this.
const GRANULE: usize = 16;
/// Object sizes before merging: 16, 32, ..., PAGE_SIZE bytes.
const GRANULES: usize = PAGE_SIZE / GRANULE;
/// Largest chunk, in pages (zsmalloc's default chain size too). Chunks of up to 16 pages fit
/// the classes 0.7% tighter on a 4 GiB working set, but every class's last, partly used chunk
/// costs twice as much: on real pages 8 is better up to about 1 GiB and within 0.7% above.
const MAX_CHUNK_PAGES: usize = 8;

/// Most objects a chunk holds (16-byte objects in one page; no class packs more, checked
/// when the allocator is built), and the words of its free bitmap.
const MAX_OBJS_PER_CHUNK: usize = 256;
const BITMAP_WORDS: usize = MAX_OBJS_PER_CHUNK / 64;
/// Chunks a class can add before its bookkeeping must grow (see `provision`).
const PROVISION_MIN_SLACK: usize = 64;

/// Where one object lives: class, chunk and object index packed into a `u64` so that the page
/// table can hold it in one word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Handle(u64);

impl Handle {
    fn new(class: usize, chunk: u32, obj: u16) -> Self {
        Handle(((class as u64) << 48) | (u64::from(chunk) << 16) | u64::from(obj))
    }
    fn class(self) -> usize {
        ((self.0 >> 48) & 0xff) as usize
    }
    fn chunk(self) -> usize {
        ((self.0 >> 16) & 0xffff_ffff) as usize
    }
    fn obj(self) -> usize {
        (self.0 & 0xffff) as usize
    }
    pub(super) fn to_bits(self) -> u64 {
        self.0
    }
    pub(super) fn from_bits(bits: u64) -> Self {
        Handle(bits)
    }
}

/// Bookkeeping of one chunk, kept under its class's mutex.
#[derive(Debug)]
struct ChunkUsage {
    used: u32,
    /// Bit set = object free. Inline, so adding a chunk allocates nothing on the heap.
    free: [u64; BITMAP_WORDS],
    /// Position in the class's `partial` list, if the chunk has a free object.
    partial_pos: Option<u32>,
}

#[derive(Debug, Default)]
struct ClassState {
    /// Indexed by chunk id; `None` for ids whose chunk was freed.
    usage: Vec<Option<ChunkUsage>>,
    /// Chunks with at least one free object.
    partial: Vec<u32>,
    /// Chunk ids free for reuse.
    free_ids: Vec<u32>,
}

/// One chunk's bytes, shared by readers, exclusive to the writer copying an object in.
type Chunk = RwLock<ArenaChunk>;

struct SizeClass {
    obj_size: usize,
    objs_per_chunk: usize,
    chunk_bytes: usize,
    /// The chunks, by id. Readers take this lock shared; it is taken exclusively only to add
    /// or remove a chunk.
    chunks: RwLock<Vec<Option<Chunk>>>,
    state: Mutex<ClassState>,
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

impl ZsAllocator {
    /// An allocator for up to `max_bytes` of chunks that keeps about `reserve_bytes` of them
    /// ready (see `reserve`).
    pub(super) fn new(reserve_bytes: u64, max_bytes: usize) -> std::io::Result<Self> {
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
                    chunks: RwLock::new(Vec::new()),
                    state: Mutex::new(ClassState::default()),
                });
            }
            // At most GRANULES (256) classes: the index fits a u8.
            class_of[granule] = (classes.len() - 1) as u8;
        }
        let mut classes_per_size = [0u64; MAX_CHUNK_PAGES];
        for class in &classes {
            classes_per_size[class.chunk_bytes / PAGE_SIZE - 1] += 1;
        }
        Ok(Self {
            classes: classes.into_boxed_slice(),
            class_of: class_of.into_boxed_slice(),
            chunk_bytes: AtomicU64::new(0),
            reserve: ChunkReserve::new(reserve_bytes, max_bytes, &classes_per_size)?,
        })
    }

    /// Bytes of memory in chunks.
    pub(super) fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of bookkeeping (chunk directory, usage and bitmaps), for the stats.
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
    }

    /// Grow each class's bookkeeping ahead of need, from the calling (refill) thread.
    ///
    /// Why: adding a chunk on the I/O path pushes onto these vectors, and a push past their
    /// capacity reallocates: fresh heap pages faulted in under memory pressure by a thread that
    /// serves swap (seen in the VM: a rayon worker stuck in such a fault while every swap bio
    /// waited for it). Here the new buffers are allocated and faulted in outside every lock,
    /// and only the move of the entries happens under the class lock.
    pub(super) fn provision(&self) {
        for class in self.classes.iter() {
            let (len, capacity) = {
                let st = class.state.lock();
                (st.usage.len(), st.usage.capacity())
            };
            if capacity - len >= (len / 8).max(PROVISION_MIN_SLACK) {
                continue;
            }
            let want = len + (len / 4).max(2 * PROVISION_MIN_SLACK);
            let mut usage = faulted_in_vec::<Option<ChunkUsage>>(want);
            let mut dir = faulted_in_vec::<Option<Chunk>>(want);
            let mut partial = faulted_in_vec::<u32>(want);
            let mut free_ids = faulted_in_vec::<u32>(want);
            {
                let mut st = class.state.lock();
                let mut chunks = class.chunks.write();
                // `partial` and `free_ids` never hold more entries than `usage`: one capacity
                // covers all four.
                // Moved only if it still fits: nothing may allocate under the class lock.
                if st.usage.capacity() < want && st.usage.len() <= want {
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

    /// Copy `bytes` (1 to `PAGE_SIZE` of them) into a new object.
    pub(super) fn store(&self, bytes: &[u8]) -> Handle {
        let granule = bytes.len().clamp(1, PAGE_SIZE).div_ceil(GRANULE) - 1;
        let class_idx = usize::from(self.class_of[granule]);
        let class = &self.classes[class_idx];
        let (chunk, obj) = self.take_object(class_idx);
        let dir = class.chunks.read();
        if let Some(Some(lock)) = dir.get(chunk as usize) {
            let off = usize::from(obj) * class.obj_size;
            // Objects are at most PAGE_SIZE (every caller's slot size), so this always fits.
            if let Some(dst) = lock.write().get_mut(off..off + bytes.len()) {
                dst.copy_from_slice(bytes);
            }
        }
        Handle::new(class_idx, chunk, obj)
    }

    fn take_object(&self, class_idx: usize) -> (u32, u16) {
        let class = &self.classes[class_idx];
        let mut st = class.state.lock();
        loop {
            let chunk = match st.partial.last() {
                Some(&id) => id,
                None => {
                    // Taking a chunk may wait for the reserve's refill thread: not under the
                    // class lock, which frees (discards, overwrites) need meanwhile, and which
                    // free memory the refill may be waiting for (seen in the VM: a discard
                    // stuck behind a flush that waited for the refill).
                    drop(st);
                    let data = self.reserve.take(class.chunk_bytes / PAGE_SIZE);
                    st = class.state.lock();
                    // No push here may grow a list (see `provision`): wait for the refill
                    // thread to make room, as for the chunk itself.
                    if self.reserve.refill_running() && !has_room(&st) {
                        self.reserve.note_waiting();
                        while !has_room(&st) {
                            drop(st);
                            self.reserve.await_refill_pass();
                            st = class.state.lock();
                        }
                        self.reserve.note_served();
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
                continue;
            };
            let bit = u.free[word].trailing_zeros() as usize;
            u.free[word] &= !(1u64 << bit);
            u.used += 1;
            if u.used as usize == class.objs_per_chunk {
                u.partial_pos = None;
                remove_partial(partial, usage, pos);
            }
            return (chunk, (word * 64 + bit) as u16);
        }
    }

    /// Add `data` as a new, empty chunk of `class`; returns its id.
    fn add_chunk(&self, class: &SizeClass, st: &mut ClassState, data: ArenaChunk) -> u32 {
        let mut free = [0u64; BITMAP_WORDS];
        for i in 0..class.objs_per_chunk {
            free[i / 64] |= 1 << (i % 64);
        }
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
        });
        st.partial.push(id);
        self.chunk_bytes
            .fetch_add(class.chunk_bytes as u64, Ordering::Relaxed);
        id
    }

    /// Free an object; frees its chunk if it was the chunk's last.
    pub(super) fn free(&self, handle: Handle) {
        let Some(class) = self.classes.get(handle.class()) else {
            return;
        };
        let mut st = class.state.lock();
        let ClassState {
            usage,
            partial,
            free_ids,
        } = &mut *st;
        let Some(Some(u)) = usage.get_mut(handle.chunk()) else {
            tracing::error!(?handle, "free of an object in no live chunk ignored");
            return;
        };
        let bit = handle.obj() % 64;
        let Some(word) = u.free.get_mut(handle.obj() / 64) else {
            tracing::error!(?handle, "free of an object past its chunk ignored");
            return;
        };
        if *word & (1 << bit) != 0 {
            tracing::error!(?handle, "double free ignored");
            return;
        }
        *word |= 1 << bit;
        u.used -= 1;
        if u.used == 0 {
            if let Some(pos) = u.partial_pos.take() {
                remove_partial(partial, usage, pos);
            }
            usage[handle.chunk()] = None;
            let chunk = class.chunks.write()[handle.chunk()].take();
            if let Some(chunk) = chunk {
                self.reserve.give_back(chunk.into_inner());
            }
            free_ids.push(handle.chunk() as u32);
            self.chunk_bytes
                .fetch_sub(class.chunk_bytes as u64, Ordering::Relaxed);
        } else if u.partial_pos.is_none() {
            u.partial_pos = Some(partial.len() as u32);
            partial.push(handle.chunk() as u32);
        }
    }

    /// Run `f` on the first `len` bytes of the object, under its chunk's read lock.
    /// `None` if the handle names no live object (which would be a bug).
    pub(super) fn with_object<R>(
        &self,
        handle: Handle,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Option<R> {
        let class = self.classes.get(handle.class())?;
        if len > class.obj_size || handle.obj() >= class.objs_per_chunk {
            return None;
        }
        let dir = class.chunks.read();
        let chunk = dir.get(handle.chunk())?.as_ref()?.read();
        let off = handle.obj() * class.obj_size;
        Some(f(&chunk[off..off + len]))
    }

    /// Test hook: let `f` change an object's bytes in place.
    #[cfg(test)]
    pub(super) fn with_object_mut(&self, handle: Handle, f: impl FnOnce(&mut [u8])) {
        let class = &self.classes[handle.class()];
        let dir = class.chunks.read();
        if let Some(Some(lock)) = dir.get(handle.chunk()) {
            let off = handle.obj() * class.obj_size;
            f(&mut lock.write()[off..off + class.obj_size]);
        }
    }
}

/// Whether a class can add a chunk without growing a list: an id to reuse, or room for a new
/// one (`provision` keeps `partial` and the directory at least as large as `usage`).
fn has_room(st: &ClassState) -> bool {
    !st.free_ids.is_empty() || st.usage.len() < st.usage.capacity()
}

/// Remove the entry at `pos` of `partial` (swap-remove), fixing the moved chunk's position.
fn remove_partial(partial: &mut Vec<u32>, usage: &mut [Option<ChunkUsage>], pos: u32) {
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
    fn merged_classes_pack_like_their_members() {
        let a = ZsAllocator::new(0, 64 << 20).unwrap();
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
        }
    }

    #[test]
    fn store_read_free_and_chunk_release() {
        let a = ZsAllocator::new(0, 64 << 20).unwrap();
        let mut handles = Vec::new();
        for i in 0..1000usize {
            let len = 1 + (i * 37) % PAGE_SIZE;
            let bytes: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
            handles.push((a.store(&bytes), bytes));
        }
        assert!(a.chunk_bytes() > 0);
        for (h, bytes) in &handles {
            let got = a.with_object(*h, bytes.len(), |b| b.to_vec()).unwrap();
            assert_eq!(&got, bytes);
        }
        // Free every other one, then the rest; memory must come back to zero.
        for (h, _) in handles.iter().step_by(2) {
            a.free(*h);
        }
        for (h, bytes) in handles.iter().skip(1).step_by(2) {
            let got = a.with_object(*h, bytes.len(), |b| b.to_vec()).unwrap();
            assert_eq!(&got, bytes);
        }
        for (h, _) in handles.iter().skip(1).step_by(2) {
            a.free(*h);
        }
        assert_eq!(a.chunk_bytes(), 0);
    }

    #[test]
    fn freed_slots_are_reused() {
        let a = ZsAllocator::new(0, 64 << 20).unwrap();
        let hs: Vec<_> = (0..100).map(|_| a.store(&[1u8; 1000])).collect();
        let used = a.chunk_bytes();
        for h in &hs[..50] {
            a.free(*h);
        }
        for _ in 0..50 {
            a.store(&[2u8; 1000]);
        }
        assert_eq!(a.chunk_bytes(), used);
    }
}
