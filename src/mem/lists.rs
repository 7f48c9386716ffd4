//! Bookkeeping lists that give their memory back when they shrink: vectors whose large
//! buffers are anonymous mappings of their own instead of heap blocks.
//!
//! Why: the daemon keeps its heap (`configure_heap`: glibc never trims, and the kernel
//! refuses `MADV_DONTNEED` on locked memory), so a list that grew to hold the chunks of a
//! near-OOM fill and was then made small again kept its old buffers in the process for good
//! (seen in the VM: 9.6 MiB of one thread's malloc arena after stress-ng's workers died, all
//! of it locked). A buffer of `MAPPED_MIN_BYTES` or more is a mapping here, and dropping it
//! unmaps it: the memory is the system's again at once. Smaller buffers stay on the heap,
//! where a page holds many of them.

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Global};

use super::HOST_PAGE;

/// Buffers this large or larger are mappings of their own.
const MAPPED_MIN_BYTES: usize = 16 << 10;

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
/// `populate`).
pub fn faulted_in_list<T>(capacity: usize, alloc: ListAlloc) -> ListVec<T> {
    let mut list = ListVec::with_capacity_in(capacity, alloc);
    super::populate(list.spare_capacity_mut());
    list
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
// with; a mapped buffer is a fresh private mapping of at least `layout.size()` bytes, aligned
// to a page (so to any alignment `maps` accepts), valid until `deallocate` unmaps it, and
// owned by the one vector it was given to. `maps` decides the same for both calls.
unsafe impl Allocator for ListAlloc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if !self.maps(layout) {
            return Global.allocate(layout);
        }
        let len = layout.size().div_ceil(HOST_PAGE) * HOST_PAGE;
        let base = super::map_private(len).map_err(|_| AllocError)?;
        Ok(NonNull::slice_from_raw_parts(base.cast::<u8>(), len))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if !self.maps(layout) {
            // SAFETY: the caller passes a block this allocator allocated with `layout`, which
            // (`maps` being false) Global allocated.
            unsafe { Global.deallocate(ptr, layout) };
            return;
        }
        let len = layout.size().div_ceil(HOST_PAGE) * HOST_PAGE;
        // SAFETY: `ptr` is the start of a mapping `allocate` made of `len` bytes (the same
        // rounding of a size it accepted), which its vector no longer uses.
        if let Err(error) = unsafe { nix::sys::mman::munmap(ptr.cast(), len) } {
            tracing::warn!(%error, len, "unmapping a bookkeeping list failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `/proc/self/maps` has a mapping of exactly `[start, start + len)`.
    fn mapped_exactly(start: usize, len: usize) -> bool {
        let want = format!("{:x}-{:x} ", start, start + len);
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .any(|l| l.starts_with(&want))
    }

    #[test]
    fn a_large_mapped_list_is_a_mapping_of_its_own_and_dropping_it_unmaps_it() {
        let entries = 1 << 20;
        let mut list: ListVec<u64> = faulted_in_list(entries, ListAlloc::Mapped);
        list.extend((0..entries as u64).map(|i| i * 3));
        assert_eq!(list[12345], 12345 * 3);
        let (start, len) = (list.as_ptr() as usize, entries * 8);
        assert!(mapped_exactly(start, len), "a mapping of its own");
        drop(list);
        assert!(!mapped_exactly(start, len), "unmapped when dropped");
        // On the heap it is no mapping of its own.
        let list: ListVec<u64> = faulted_in_list(entries, ListAlloc::Heap);
        assert!(!mapped_exactly(list.as_ptr() as usize, entries * 8));
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
            let mut other: ListVec<u32> = faulted_in_list(list.len() + 10, alloc);
            other.append(&mut list);
            assert_eq!(
                other.iter().map(|&v| u64::from(v)).sum::<u64>(),
                4_999_950_000
            );
        }
    }
}
