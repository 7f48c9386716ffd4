//! Bookkeeping lists that give their memory back when they shrink: vectors whose large
//! buffers are anonymous mappings of their own instead of heap blocks.
//!
//! Why: the daemon keeps its heap (`configure_heap`: glibc never trims, and the kernel
//! refuses `MADV_DONTNEED` on locked memory), so a list that grew to hold the chunks of a
//! near-OOM fill and was then made small again kept its old buffers in the process for good
//! (seen in the VM: 9.6 MiB of one thread's malloc arena after stress-ng's workers died, all
//! of it locked). A buffer of `MAPPED_MIN_BYTES` or more is a mapping here (or a window of
//! one, below), and dropping it gives its pages back: the memory is the system's again at
//! once. Smaller buffers stay on the heap,
//! where a page holds many of them.
//!
//! A mapping reserves `MAPPED_RESERVATION_BYTES` of address space (none of it memory until
//! faulted in: the daemon locks on fault), so that a list grows in place within it: the thread
//! that provisions faults the new room in first (`growth_in_place`), outside the lock the list
//! is under, and growing it under the lock then moves nothing and touches no fresh page. Why:
//! growing by a new buffer needs the old and the new at once, faulted in while memory is
//! shortest (a near-OOM fill of raw pages grows the allocator's lists by about 100 bytes a
//! page), and copies under the lock; in the VM's near-OOM stage writes failed while the
//! thread that provisions waited in reclaim for such a buffer (2026-11-27).
//!
//! The daemon reserves the address space of its mapped lists once, before its devices are
//! live (`reserve_list_space`): a window of `MAPPED_RESERVATION_BYTES` for each list, all in
//! one mapping. A list that outgrows the heap then moves into a window, and one dropped gives
//! its window's pages back with `MADV_DONTNEED_LOCKED`: neither makes or removes a mapping.
//! Why: making one takes the process's mmap lock for writing, and near OOM that waits (for a
//! thread faulting inside a neighbouring mapping, which the new one merges with, or one
//! holding the lock for reading while in reclaim) and, while it waits, stops every other
//! thread that needs the lock at all: seen in the VM's near-OOM stage (2026-12-06), the thread
//! that provisions sat 63 and 136 s in `vm_mmap_pgoff`, growing a class's lists past the heap
//! during a fill of raw pages, and every write failed meanwhile. Where there is no such space
//! (a test, strict overcommit, every window taken) a list maps a buffer of its own as before.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::OnceLock;

use allocator_api2::alloc::{AllocError, Allocator, Global};
use parking_lot::Mutex;

use super::HOST_PAGE;

/// Buffers this large or larger are mappings of their own.
const MAPPED_MIN_BYTES: usize = 16 << 10;
/// Address space a mapped buffer reserves and grows within (about 1.3 million chunks'
/// bookkeeping, 5 GiB of raw pages in one class); a larger one is mapped at its size and
/// moves to grow.
const MAPPED_RESERVATION_BYTES: usize = 64 << 20;
/// Windows the daemon's list space holds: about twice what a serving process's one store maps
/// at most at once (every class's four lists, 480 with 120 classes; the four a class remakes
/// beside its old ones as it shrinks them; the cold-page list). 64 GiB of address space, none
/// of it memory until faulted in.
const LIST_SPACE_WINDOWS: usize = 1024;

/// The process's list space, once reserved.
static LIST_SPACE: OnceLock<ListSpace> = OnceLock::new();

/// Reserve the process's list space (see the module's comment), if it is not yet: true where
/// it is there now, false where the system does not overcommit (the space would be charged
/// in full; lists then map buffers of their own), an error where the system refused it.
pub fn reserve_list_space() -> std::io::Result<bool> {
    if LIST_SPACE.get().is_some() {
        return Ok(true);
    }
    if !super::reservations_allowed() {
        return Ok(false);
    }
    let space = ListSpace::reserve(LIST_SPACE_WINDOWS)?;
    // A second caller racing this one keeps its own, which its drop unmaps.
    let _ = LIST_SPACE.set(space);
    Ok(true)
}

/// Address space carved into windows of `MAPPED_RESERVATION_BYTES`, a mapped list's buffer
/// each.
struct ListSpace {
    base: usize,
    windows: usize,
    /// Indices of the windows no list holds; popped from the end. Made holding every index,
    /// so a push back never allocates.
    free: Mutex<Vec<usize>>,
}

impl ListSpace {
    fn reserve(windows: usize) -> std::io::Result<Self> {
        let len = windows
            .checked_mul(MAPPED_RESERVATION_BYTES)
            .ok_or(std::io::ErrorKind::InvalidInput)?;
        let base = super::map_private(len)?.as_ptr() as usize;
        Ok(Self {
            base,
            windows,
            free: Mutex::new((0..windows).rev().collect()),
        })
    }

    /// A window for a buffer of `size` bytes, if one is free and it fits.
    fn take(&self, size: usize) -> Option<NonNull<u8>> {
        if size > MAPPED_RESERVATION_BYTES {
            return None;
        }
        let index = self.free.lock().pop()?;
        NonNull::new((self.base + index * MAPPED_RESERVATION_BYTES) as *mut u8)
    }

    /// Whether `ptr` lies in this space.
    fn holds(&self, ptr: NonNull<u8>) -> bool {
        let address = ptr.as_ptr() as usize;
        address >= self.base && address - self.base < self.windows * MAPPED_RESERVATION_BYTES
    }

    /// Take back the window `ptr` starts (one `take` gave), its pages given back to the
    /// system first.
    fn give_back(&self, ptr: NonNull<u8>) {
        let index = (ptr.as_ptr() as usize - self.base) / MAPPED_RESERVATION_BYTES;
        // SAFETY: the window is the one `take` handed out for `ptr`, which its vector no
        // longer uses (the allocator's contract) and nothing else points into; dropped pages
        // read as zeros if a later list faults them in again.
        let dropped = unsafe {
            let start = ptr.as_ptr().cast::<libc::c_void>();
            match libc::madvise(start, MAPPED_RESERVATION_BYTES, libc::MADV_DONTNEED_LOCKED) {
                0 => Ok(()),
                // A kernel before 5.18 (none with a ublk driver, which came in 6.0) knows
                // only MADV_DONTNEED: that one does for memory not locked (tests), and
                // leaves locked pages for the next list.
                _ if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) => {
                    match libc::madvise(start, MAPPED_RESERVATION_BYTES, libc::MADV_DONTNEED) {
                        0 => Ok(()),
                        _ => Err(std::io::Error::last_os_error()),
                    }
                }
                _ => Err(std::io::Error::last_os_error()),
            }
        };
        if let Err(error) = dropped {
            tracing::warn!(%error, "giving a bookkeeping list's pages back failed: the next list in its window reuses them");
        }
        self.free.lock().push(index);
    }
}

impl Drop for ListSpace {
    fn drop(&mut self) {
        let len = self.windows * MAPPED_RESERVATION_BYTES;
        let Some(base) = NonNull::new(self.base as *mut std::ffi::c_void) else {
            return;
        };
        // SAFETY: the mapping `reserve` made; a space is dropped only with no window taken
        // (the process's own never is: it is a static).
        if let Err(error) = unsafe { nix::sys::mman::munmap(base, len) } {
            tracing::warn!(%error, "unmapping a list space failed");
        }
    }
}

/// Where a list's buffers come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListAlloc {
    /// The heap, always: for room made from heap a thread faulted in ahead (a standby's
    /// rebuild at a takeover, when no new page can be had).
    Heap,
    /// Large buffers mapped, small ones on the heap.
    Mapped,
}

/// A vector of bookkeeping (see the module's comment).
pub type ListVec<T> = allocator_api2::vec::Vec<T, ListAlloc>;

/// An empty list whose buffers come from `alloc`; it allocates nothing yet.
pub fn empty_list<T>(alloc: ListAlloc) -> ListVec<T> {
    ListVec::new_in(alloc)
}

/// A list with room for `capacity` entries from `alloc`, that room faulted in (see
/// `populate`). An error, and nothing kept, where the system refuses the room (a mapping past
/// `vm.max_map_count` or, under strict overcommit, past the commit limit; a heap that cannot
/// grow) or does not fault it in (a limit on the daemon's cgroup): the caller goes on with the
/// list it has, where `with_capacity` would abort the process, and with it every device it
/// serves, and where room not faulted in would fault under the caller's lock.
pub fn faulted_in_list<T>(capacity: usize, alloc: ListAlloc) -> std::io::Result<ListVec<T>> {
    let mut list = ListVec::new_in(alloc);
    list.try_reserve_exact(capacity).map_err(out_of_memory)?;
    super::populate(list.spare_capacity_mut())?;
    Ok(list)
}

/// An allocation the system refused, as the I/O error its caller reports.
pub fn out_of_memory(error: impl std::error::Error + Send + Sync + 'static) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::OutOfMemory, error)
}

/// `bytes` rounded up to whole pages.
fn page_rounded(bytes: usize) -> usize {
    bytes.div_ceil(HOST_PAGE) * HOST_PAGE
}

/// The length of the mapping a mapped buffer of `size` bytes lives in: its reservation, or
/// just its pages where the system does not overcommit (`super::reservations_allowed`) or it
/// is larger. A function of the size alone, so that freeing unmaps what was mapped.
fn mapping_len(size: usize) -> usize {
    if size <= MAPPED_RESERVATION_BYTES && super::reservations_allowed() {
        MAPPED_RESERVATION_BYTES
    } else {
        page_rounded(size)
    }
}

/// Room faulted in for a list to grow in place (`growth_in_place`): the pages past its
/// capacity, inside the mapping it lives in.
#[derive(Debug, PartialEq, Eq)]
pub struct Growth {
    start: usize,
    len: usize,
}

impl Growth {
    /// The bytes `fault_in` faults in.
    pub fn bytes(&self) -> usize {
        self.len
    }

    /// Fault the room in (and so, under `mlockall`, lock it). An error where the system
    /// refused (part of) it: the list is not to grow into it then (`apply`), since growing
    /// would fault the rest in under the caller's lock.
    pub fn fault_in(&self) -> std::io::Result<()> {
        let Some(start) = NonNull::new(self.start as *mut std::ffi::c_void) else {
            return Ok(());
        };
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: the range lies inside a list's mapping past its capacity (or, had the list
        // been dropped meanwhile, in no mapping or another one): no Rust value lives there,
        // and MADV_POPULATE_WRITE only makes pages present without changing a byte.
        unsafe {
            nix::sys::mman::madvise(
                start,
                self.len,
                nix::sys::mman::MmapAdvise::MADV_POPULATE_WRITE,
            )
        }
        .map_err(|error| {
            tracing::warn!(%error, bytes = self.len, "faulting in a list's room failed");
            std::io::Error::from(error)
        })
    }

    /// Give `list` room for `capacity` entries if it is still the list this room was measured
    /// for (`growth_in_place` gives the same): growing it then moves nothing, allocates
    /// nothing and touches no fresh page. False, and nothing done, if it changed meanwhile.
    pub fn apply<T>(&self, list: &mut ListVec<T>, capacity: usize) -> bool {
        if growth_in_place(list, capacity).as_ref() != Some(self) {
            return false;
        }
        let len = list.len();
        list.try_reserve_exact(capacity.saturating_sub(len)).is_ok()
    }
}

/// The room `list` needs to hold `capacity` entries without moving, if it can grow there in
/// place: a mapped list whose mapping reaches that far. Fault it in (`Growth::fault_in`), then
/// grow the list (`Growth::apply`). `None` for a list that would move.
pub fn growth_in_place<T>(list: &ListVec<T>, capacity: usize) -> Option<Growth> {
    let size = |entries: usize| entries.checked_mul(std::mem::size_of::<T>());
    let (now, then) = (size(list.capacity())?, size(capacity)?);
    let start = list.as_ptr() as usize;
    if then <= now {
        return Some(Growth { start, len: 0 });
    }
    let alloc = *list.allocator();
    let align = std::mem::align_of::<T>();
    let (Ok(now_layout), Ok(then_layout)) = (
        Layout::from_size_align(now, align),
        Layout::from_size_align(then, align),
    ) else {
        return None;
    };
    if now == 0
        || !alloc.maps(now_layout)
        || !alloc.maps(then_layout)
        || mapping_len(now) < page_rounded(then)
    {
        return None;
    }
    Some(Growth {
        start: start + page_rounded(now),
        len: page_rounded(then) - page_rounded(now),
    })
}

impl ListAlloc {
    /// Whether a buffer of `layout` is a mapping of its own. The same answer for the layout a
    /// buffer is allocated with and the one it is freed with: a vector frees with the size it
    /// asked for.
    fn maps(self, layout: Layout) -> bool {
        self == ListAlloc::Mapped
            && layout.size() >= MAPPED_MIN_BYTES
            && layout.align() <= HOST_PAGE
    }
}

// SAFETY: heap buffers are Global's, freed by Global with the layout they were allocated
// with; a mapped buffer is a window of the list space (`MAPPED_RESERVATION_BYTES`, which is
// what `mapping_len` gives for a size it fits, the space being reserved only where
// reservations are allowed) or a fresh private mapping of `mapping_len(layout.size())` bytes,
// either at least `layout.size()`, aligned to a page (so to any alignment `maps` accepts),
// valid until `deallocate` gives it back, owned by the one vector it was given to, and grown
// in place only within it. `maps` and `mapping_len` decide the same for every call, and the
// space, once reserved, stays.
unsafe impl Allocator for ListAlloc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if !self.maps(layout) {
            return Global.allocate(layout);
        }
        let base = match LIST_SPACE.get().and_then(|space| space.take(layout.size())) {
            Some(window) => window,
            None => super::map_private(mapping_len(layout.size()))
                .map_err(|_| AllocError)?
                .cast::<u8>(),
        };
        Ok(NonNull::slice_from_raw_parts(
            base,
            page_rounded(layout.size()),
        ))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if !self.maps(layout) {
            // SAFETY: the caller passes a block this allocator allocated with `layout`, which
            // (`maps` being false) Global allocated.
            unsafe { Global.deallocate(ptr, layout) };
            return;
        }
        if let Some(space) = LIST_SPACE.get().filter(|space| space.holds(ptr)) {
            space.give_back(ptr);
            return;
        }
        let len = mapping_len(layout.size());
        // SAFETY: `ptr` is the start of a mapping `allocate` made of `len` bytes (the same
        // function of a size it accepted, or grew to within it), which its vector no longer
        // uses.
        if let Err(error) = unsafe { nix::sys::mman::munmap(ptr.cast(), len) } {
            tracing::warn!(%error, len, "unmapping a bookkeeping list failed");
        }
    }

    /// In place while the new size stays within the buffer's mapping (see the module's
    /// comment), else moved to a new buffer.
    unsafe fn grow(
        &self,
        ptr: NonNull<u8>,
        old_layout: Layout,
        new_layout: Layout,
    ) -> Result<NonNull<[u8]>, AllocError> {
        if self.maps(old_layout)
            && self.maps(new_layout)
            && mapping_len(old_layout.size()) >= page_rounded(new_layout.size())
            && mapping_len(old_layout.size()) == mapping_len(new_layout.size())
        {
            return Ok(NonNull::slice_from_raw_parts(
                ptr,
                page_rounded(new_layout.size()),
            ));
        }
        let new = self.allocate(new_layout)?;
        // SAFETY: `ptr` holds `old_layout.size()` bytes (the caller's contract), the new
        // block at least `new_layout.size()`, which is larger, and they are distinct blocks.
        unsafe {
            std::ptr::copy_nonoverlapping(
                ptr.as_ptr(),
                new.cast::<u8>().as_ptr(),
                old_layout.size(),
            );
            self.deallocate(ptr, old_layout);
        }
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mapping `/proc/self/maps` has at `address`, as `(start, end)`, if any.
    fn mapping_at(address: usize) -> Option<(usize, usize)> {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter_map(crate::os::smaps_mapping_range)
            .find(|range| range.contains(&(address as u64)))
            .and_then(|range| {
                Some((
                    usize::try_from(range.start).ok()?,
                    usize::try_from(range.end).ok()?,
                ))
            })
    }

    #[test]
    fn a_large_mapped_list_is_a_mapping_of_its_own_and_dropping_it_unmaps_it() {
        let entries = 1 << 20;
        let mut list: ListVec<u64> = faulted_in_list(entries, ListAlloc::Mapped).unwrap();
        list.extend((0..entries as u64).map(|i| i * 3));
        assert_eq!(list[12345], 12345 * 3);
        let start = list.as_ptr() as usize;
        let end = start + mapping_len(entries * 8);
        // (The kernel may merge it with a neighbouring mapping of the same kind.)
        let held = mapping_at(start).filter(|&(_, to)| to >= end);
        assert!(held.is_some(), "mapped, its reservation too: {held:?}");
        // Other tests' threads may map something into the freed range at once (placed from the
        // top down, it even ends where this one ended): this mapping is marked so that no
        // other can be taken for a piece of it left behind.
        // SAFETY: `start..end` is the list's mapping, held until the drop below; MADV_DONTFORK
        // changes only what a fork would inherit.
        let marked =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTFORK) };
        assert_eq!(marked, 0, "{}", std::io::Error::last_os_error());
        assert!(marked_dont_fork(start) && marked_dont_fork(end - 1));
        drop(list);
        assert!(!marked_dont_fork(start), "unmapped when dropped");
        assert!(!marked_dont_fork(end - 1), "its reservation too");
    }

    /// Whether the mapping at `address` is marked MADV_DONTFORK (`dc` in `/proc/self/smaps`).
    fn marked_dont_fork(address: usize) -> bool {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                if inside {
                    return flags.split_whitespace().any(|flag| flag == "dc");
                }
            } else if let Some(range) = crate::os::smaps_mapping_range(line) {
                inside = range.contains(&(address as u64));
            }
        }
        false
    }

    #[test]
    fn a_mapped_list_grows_in_place_into_room_faulted_in_ahead() {
        if !super::super::reservations_allowed() {
            return; // strict overcommit: mapped lists move to grow, as every list once did
        }
        let entries = 10_000;
        let mut list: ListVec<u64> = faulted_in_list(entries, ListAlloc::Mapped).unwrap();
        list.extend(0..entries as u64);
        let start = list.as_ptr();
        let growth = growth_in_place(&list, 8 * entries).expect("within its reservation");
        growth.fault_in().expect("fault in the room");
        assert!(growth.apply(&mut list, 8 * entries));
        assert_eq!(list.as_ptr(), start, "not moved");
        assert!(list.capacity() >= 8 * entries);
        list.extend(entries as u64..8 * entries as u64);
        assert!(list.iter().enumerate().all(|(i, &v)| v == i as u64));
        // Past its reservation it would move, and so would a heap list.
        let past = MAPPED_RESERVATION_BYTES / 8 + 1;
        assert!(growth_in_place(&list, past).is_none());
        let heap: ListVec<u64> = faulted_in_list(entries, ListAlloc::Heap).unwrap();
        assert!(growth_in_place(&heap, 2 * entries).is_none());
        // Pushing past it moves it, contents kept.
        list.reserve_exact(past - list.len());
        list.push(1);
        assert_eq!(list[8 * entries - 1], 8 * entries as u64 - 1);
    }

    #[test]
    fn a_list_space_hands_out_each_window_once_and_takes_it_back_emptied() {
        if !super::super::reservations_allowed() {
            return; // strict overcommit: no space is reserved
        }
        let space = ListSpace::reserve(2).unwrap();
        assert!(
            space.take(MAPPED_RESERVATION_BYTES + 1).is_none(),
            "too large for a window"
        );
        let first = space.take(MAPPED_RESERVATION_BYTES).unwrap();
        let second = space.take(1).unwrap();
        assert!(space.take(1).is_none(), "both windows taken");
        assert!(space.holds(first) && space.holds(second));
        let distance = (first.as_ptr() as usize).abs_diff(second.as_ptr() as usize);
        assert_eq!(distance, MAPPED_RESERVATION_BYTES);
        let outside = NonNull::new((space.base + 2 * MAPPED_RESERVATION_BYTES) as *mut u8);
        assert!(!space.holds(outside.unwrap()));
        // SAFETY: the window's first two pages, this test's alone while it holds the window.
        unsafe { std::ptr::write_bytes(second.as_ptr(), 0xa5, 2 * HOST_PAGE) };
        space.give_back(second);
        let again = space.take(1).unwrap();
        assert_eq!(again, second, "the window given back is the one free");
        // SAFETY: as above; the pages given back read as fresh ones.
        let page = unsafe { std::slice::from_raw_parts(again.as_ptr(), 2 * HOST_PAGE) };
        assert!(
            page.iter().all(|&byte| byte == 0),
            "its pages were given back"
        );
        space.give_back(again);
        space.give_back(first);
    }

    #[test]
    fn room_the_system_refuses_is_an_error_not_an_abort() {
        // 128 TiB: the whole of a 47-bit address space, which no mapping or heap gets.
        let entries = (1usize << 47) / 8;
        for alloc in [ListAlloc::Heap, ListAlloc::Mapped] {
            assert!(faulted_in_list::<u64>(entries, alloc).is_err(), "{alloc:?}");
        }
        let error = faulted_in_list::<u64>(entries, ListAlloc::Mapped).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::OutOfMemory);
    }

    #[test]
    fn small_and_heap_lists_behave_as_vectors() {
        for alloc in [ListAlloc::Heap, ListAlloc::Mapped] {
            let mut list: ListVec<u32> = empty_list(alloc);
            for i in 0..100_000 {
                list.push(i);
            }
            assert_eq!(list.swap_remove(0), 0);
            assert_eq!(list.len(), 99_999);
            let mut other: ListVec<u32> = faulted_in_list(list.len() + 10, alloc).unwrap();
            other.append(&mut list);
            assert_eq!(
                other.iter().map(|&v| u64::from(v)).sum::<u64>(),
                4_999_950_000
            );
        }
    }
}
