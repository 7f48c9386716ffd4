//! One mapping of memory that pages live in: a private memfd, or a SysV shared-memory segment
//! that outlives every process of ours. Committing and giving back ranges, and typed views of
//! it (atomic words, page slots). All `unsafe` for it lives here.
//!
//! Why SysV for the shared case: the memory must stay resident and unswappable while no
//! process of ours maps it (between a crash and the restart). A segment locked with
//! `SHM_LOCK` is exactly that, with no process to keep it; a memfd is only as locked as the
//! mappings that have faulted its pages in, and a page swapped out in that gap would have to
//! come back through the very device that waits for us. See ../shared/RECOVERY.md.
//!
//! Why commit by faulting pages in through the mapping (MADV_POPULATE_WRITE) and give them
//! back through the file (a hole punch, `fallocate`) when there is a descriptor: a commit under
//! memory pressure waits in reclaim for as long as the kernel has no page for it (an I/O
//! flusher's allocation never invokes the OOM killer), and what it holds meanwhile nobody else
//! gets. Committed with `fallocate`, that was the file's lock, which every hole punch needs: the
//! memory of chunks freed while a commit waited (a killed program's swap slots) could not go
//! back to the system, and the kernel's OOM killer went on to kill everything else (the
//! near-OOM stage of `scripts/vm-test.sh --stress`, 2026-11-26: the serving process held
//! 102 MiB for 31 MiB of swap; another run ended in "System is deadlocked on memory"). A fault
//! holds the process's mmap lock for reading instead, which the I/O path does not take (its
//! memory is faulted in before the device is live; see `crate::mem`), and a hole punch does
//! not take it. A SysV segment has no descriptor of its own; `/proc/self/map_files` gives one
//! for its mapping to a process with CAP_SYS_ADMIN (the daemon). Without one, pages are given
//! back with MADV_REMOVE (which takes the mmap lock for reading, then the file's), which works
//! only on a mapping that is not locked: tests, never the daemon under `mlockall` (attaching
//! says so in the log).

use std::num::NonZeroUsize;
use std::ops::{Deref, DerefMut};
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{fallocate, FallocateFlags};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::mman::{madvise, mmap, munmap, MapFlags, MmapAdvise, ProtFlags};
use nix::unistd::{lseek, Whence};
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::HOST_PAGE;
use crate::os::cvt;

/// Bytes of address space one last-level page table maps (x86-64, and arm64 with 4 KiB pages).
const PAGE_TABLE_SPAN: usize = 2 << 20;

/// Where a segment's memory comes from.
#[derive(Debug)]
enum Backing {
    Memfd,
    /// The segment's shmid.
    SysV(libc::c_int),
}

/// A mapping of `len` bytes (whole pages) of memfd or SysV shared memory; nothing committed
/// until `commit`.
#[derive(Debug)]
pub struct Segment {
    base: NonNull<u8>,
    len: usize,
    /// For hole punches and `first_page_in_memory`: the memfd, or the SysV segment's file
    /// through /proc/self/map_files.
    fd: Option<OwnedFd>,
    /// A committed page stays in memory (a SysV segment locked with `SHM_LOCK`): which pages
    /// are in memory is then which are committed, and the file says so without mincore(2)
    /// (see `first_page_in_memory`).
    committed_stays: bool,
    backing: Backing,
}

// SAFETY: a segment is a mapping plus descriptors; outside `mem` it hands out typed views
// only (atomics, page slots behind locks, arena chunks owned one range each), and its plain
// byte slices (`bytes`, `bytes_mut`, `pub(super)`) go only to those views, each over a range it
// owns or holds the lock of, so sharing it between threads shares no unsynchronised state.
unsafe impl Send for Segment {}
// SAFETY: see `Send`.
unsafe impl Sync for Segment {}

/// `SHM_LOCKED` from `include/uapi/linux/shm.h`: the mode bit of a segment locked with
/// `SHM_LOCK`.
const SHM_LOCKED: libc::c_ushort = 0o2000;

/// A byte count or position as the `off_t` that ftruncate and fallocate take.
pub(super) fn file_offset(bytes: usize) -> std::io::Result<i64> {
    i64::try_from(bytes).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))
}

/// Why a shared segment cannot be used.
fn foreign_segment(key: i32, what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!(
            "the shared-memory segment with key {key:#x} {what}: it is not one this daemon made; \
             check `ipcs -m` and remove it (`ipcrm -M {key:#x}`) if nothing uses it"
        ),
    )
}

/// What the administrator can do about shmget(2) refusing a segment of `len` bytes with
/// `errno`, `strict_overcommit` saying whether `vm.overcommit_memory` is 2.
fn creation_refused(errno: Option<i32>, len: usize, strict_overcommit: bool) -> Option<String> {
    let mib = len >> 20;
    match errno? {
        libc::ENOMEM if strict_overcommit => Some(format!(
            "under strict overcommit (vm.overcommit_memory = 2) the kernel charges all {mib} MiB \
             of the store's address space to the commit limit at once, though only what is \
             stored becomes memory: set vm.overcommit_memory to 0 (the default) or 1"
        )),
        libc::ENOMEM => Some(format!(
            "the kernel could not set up {mib} MiB of shared memory now (its own memory is \
             short): try again once memory is free"
        )),
        libc::EINVAL => Some(format!(
            "{mib} MiB is more than kernel.shmmax allows: raise it (sysctl kernel.shmmax)"
        )),
        libc::ENOSPC => Some(
            "kernel.shmall or kernel.shmmni is used up: raise it (sysctl), or remove stale \
             segments (ipcs -m)"
                .to_string(),
        ),
        _ => None,
    }
}

/// What the administrator can do about SHM_LOCK refused with `errno`.
fn lock_refused(errno: Option<i32>) -> Option<String> {
    match errno? {
        libc::EPERM => Some("locking it needs CAP_IPC_LOCK: run as root".to_string()),
        libc::ENOMEM => Some(
            "locking it is past RLIMIT_MEMLOCK: raise it (LimitMEMLOCK=infinity in the unit, \
             or run as root)"
                .to_string(),
        ),
        _ => None,
    }
}

/// `error` with `hint` after it, if there is one (its kind kept).
fn explained(error: std::io::Error, hint: Option<String>) -> std::io::Error {
    match hint {
        Some(hint) => std::io::Error::new(error.kind(), format!("{error}: {hint}")),
        None => error,
    }
}

impl Segment {
    /// Private memory of this process: a memfd mapping of `len` bytes.
    pub fn private(len: usize) -> std::io::Result<Arc<Self>> {
        let len = round_to_pages(len);
        let fd = memfd_create("trueno-ublk-pages", MFdFlags::MFD_CLOEXEC)?;
        nix::unistd::ftruncate(&fd, file_offset(len)?)?;
        let length = NonZeroUsize::new(len).ok_or(std::io::ErrorKind::InvalidInput)?;
        // SAFETY: a fresh shared mapping of our own memfd; it aliases no Rust object, and all
        // access goes through the typed views below.
        let base = unsafe {
            mmap(
                None,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED | MapFlags::MAP_NORESERVE,
                &fd,
                0,
            )
        }?;
        Ok(Arc::new(Self {
            base: base.cast(),
            len,
            fd: Some(fd),
            committed_stays: false,
            backing: Backing::Memfd,
        }))
    }

    /// Create the SysV segment `key` of `len` bytes (owner-only, swap space not reserved),
    /// locked in memory (`SHM_LOCK`) unless `lock` is false (tests without CAP_IPC_LOCK).
    /// Fails with `AlreadyExists` if it exists.
    pub fn create_shared(key: i32, len: usize, lock: bool) -> std::io::Result<Arc<Self>> {
        let len = round_to_pages(len);
        let flags = libc::IPC_CREAT | libc::IPC_EXCL | libc::SHM_NORESERVE | 0o600;
        // SAFETY: shmget takes no pointers.
        let id = unsafe { libc::shmget(key, len, flags) };
        if id < 0 {
            let error = std::io::Error::last_os_error();
            let hint = creation_refused(error.raw_os_error(), len, super::strict_overcommit());
            return Err(explained(error, hint));
        }
        let locked = if lock {
            // SAFETY: SHM_LOCK takes no buffer.
            cvt(unsafe { libc::shmctl(id, libc::SHM_LOCK, std::ptr::null_mut()) }).map_err(
                |error| {
                    let hint = lock_refused(error.raw_os_error());
                    explained(error, hint)
                },
            )
        } else {
            Ok(())
        };
        match locked.and_then(|()| Self::attach(id, len)) {
            Ok(segment) => Ok(segment),
            Err(error) => {
                let _ = remove_id(id);
                Err(error)
            }
        }
    }

    /// Attach the existing SysV segment `key`; `None` if there is none. Refuses a segment
    /// that another user could have made or can read (a local user must not be able to hand
    /// the daemon page data).
    pub fn attach_shared(key: i32) -> std::io::Result<Option<Arc<Self>>> {
        // SAFETY: shmget takes no pointers.
        let id = unsafe { libc::shmget(key, 0, 0) };
        if id < 0 {
            let error = std::io::Error::last_os_error();
            return match error.raw_os_error() {
                Some(libc::ENOENT) => Ok(None),
                _ => Err(error),
            };
        }
        let stat = stat(id)?;
        // SAFETY: geteuid cannot fail.
        let me = unsafe { libc::geteuid() };
        if stat.shm_perm.uid != me || stat.shm_perm.cuid != me {
            return Err(foreign_segment(key, "belongs to another user"));
        }
        if stat.shm_perm.mode & 0o077 != 0 {
            return Err(foreign_segment(key, "is open to other users"));
        }
        Self::attach(id, stat.shm_segsz).map(Some)
    }

    /// Remove the SysV segment `key` (freed once no process maps it); false if there was none.
    pub fn remove_shared(key: i32) -> std::io::Result<bool> {
        match Self::shared_id(key)? {
            Some(id) => id.remove(),
            None => Ok(false),
        }
    }

    /// The SysV segment under `key` now, by its id; `None` if there is none.
    pub fn shared_id(key: i32) -> std::io::Result<Option<SharedId>> {
        // SAFETY: shmget takes no pointers.
        let id = unsafe { libc::shmget(key, 0, 0) };
        if id < 0 {
            let error = std::io::Error::last_os_error();
            return match error.raw_os_error() {
                Some(libc::ENOENT) => Ok(None),
                _ => Err(error),
            };
        }
        Ok(Some(SharedId(id)))
    }

    /// Remove the SysV segment this is an attachment of, by its id (it is freed once no
    /// process maps it, and its key is free at once): unlike `remove_shared`, never a
    /// segment made under the same key since. False for private memory.
    pub fn remove_attached(&self) -> std::io::Result<bool> {
        match self.backing {
            Backing::SysV(id) => remove_id(id).map(|()| true),
            Backing::Memfd => Ok(false),
        }
    }

    /// Whether the SysV segment `key` exists.
    pub fn shared_exists(key: i32) -> bool {
        // SAFETY: shmget takes no pointers.
        unsafe { libc::shmget(key, 0, 0) >= 0 }
    }

    fn attach(id: libc::c_int, len: usize) -> std::io::Result<Arc<Self>> {
        // SAFETY: attaching a segment at an address the kernel picks; the mapping aliases no
        // Rust object and is only reached through the views below.
        let base = unsafe { libc::shmat(id, std::ptr::null(), 0) };
        if base as isize == -1 {
            return Err(std::io::Error::last_os_error());
        }
        let base = NonNull::new(base.cast::<u8>()).ok_or(std::io::ErrorKind::InvalidData)?;
        let start = base.as_ptr() as usize;
        // The segment's file: hole punches, and which pages are in memory (module comment).
        let fd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/map_files/{start:x}-{:x}", start + len))
            .map_err(|error| {
                // Without it, memory goes back through MADV_REMOVE, which the kernel refuses
                // on a locked mapping (EINVAL): under `mlockall` nothing would go back.
                tracing::warn!(
                    %error,
                    "the shared store's file cannot be opened (/proc/self/map_files needs \
                     CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE): with memory locked, the \
                     store cannot give memory back"
                );
            })
            .ok()
            .map(OwnedFd::from);
        let committed_stays = stat(id).is_ok_and(|ds| ds.shm_perm.mode & SHM_LOCKED != 0);
        Ok(Arc::new(Self {
            base,
            len,
            fd,
            committed_stays,
            backing: Backing::SysV(id),
        }))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether this is an attachment of the SysV segment that is `key` now (not of one removed
    /// since, and so of another device's memory).
    pub fn is_shared_under(&self, key: i32) -> bool {
        // SAFETY: shmget takes no pointers.
        matches!(self.backing, Backing::SysV(id) if unsafe { libc::shmget(key, 0, 0) } == id)
    }

    /// How many last-level page tables (`PAGE_TABLE_SPAN` of address space each) the mapping
    /// reaches into.
    pub fn page_table_count(&self) -> usize {
        self.page_table_of(self.len.saturating_sub(1)) - self.page_table_of(0) + 1
    }

    /// Make the page tables that map `[offset, offset + len)` in this process, so that
    /// touching its pages later allocates nothing (their pages are committed already; only
    /// the tables are this process's). `made` has an entry per page table of the mapping
    /// (`page_table_count`): a table not yet made is made by reading one page of its span
    /// that is in memory (never a hole: that would allocate a page the store gave back), and
    /// marked; a span with no page in memory is left for a later call.
    pub fn make_page_tables(
        &self,
        offset: usize,
        len: usize,
        made: &mut [bool],
    ) -> std::io::Result<()> {
        self.check(offset, len)?;
        let first = self.page_table_of(0);
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let table = self.page_table_of(at);
            // The span's end, as an offset into the mapping.
            let span_end = ((table + 1) * PAGE_TABLE_SPAN - self.base.as_ptr() as usize).min(end);
            let done = made
                .get_mut(table - first)
                .ok_or(std::io::ErrorKind::InvalidInput)?;
            if !*done {
                if let Some(page) = self.first_page_in_memory(at, span_end - at)? {
                    // SAFETY: one page inside our mapping (checked above), committed (it is
                    // in memory); reading it in changes no contents.
                    unsafe { madvise(self.ptr(page), HOST_PAGE, MmapAdvise::MADV_POPULATE_READ) }?;
                    *done = true;
                }
            }
            at = span_end;
        }
        Ok(())
    }

    /// The segment's file, when it tells which pages are in memory (`committed_stays`).
    ///
    /// Why not mincore(2) there: it takes a free page from the kernel for every call
    /// (`__get_free_page(GFP_USER)`), and a resume asks at a takeover, with RAM at the
    /// watermark and swap waiting for this very process: seen in the VM (the clean-clone CI
    /// run of 2026-11-26 06:17), the new serving process spent 100 s in reclaim inside
    /// mincore and swap stalled. lseek(2)'s SEEK_DATA and SEEK_HOLE walk the file's pages and
    /// allocate nothing.
    fn residency_file(&self) -> Option<&OwnedFd> {
        self.fd.as_ref().filter(|_| self.committed_stays)
    }

    /// The offset of the first page of `[offset, offset + len)` (at most one page table's
    /// span) that is in memory: by the segment's file (`residency_file`), else mincore(2).
    fn first_page_in_memory(&self, offset: usize, len: usize) -> std::io::Result<Option<usize>> {
        if let Some(fd) = self.residency_file() {
            let data = match lseek(fd, file_offset(offset)?, Whence::SeekData) {
                Ok(at) => usize::try_from(at).ok(),
                // No data from `offset` to the end of the file.
                Err(Errno::ENXIO) => None,
                Err(error) => return Err(error.into()),
            };
            return Ok(data
                .filter(|&at| at < offset + len)
                .map(|at| at / HOST_PAGE * HOST_PAGE));
        }
        let mut in_memory = [0u8; PAGE_TABLE_SPAN / HOST_PAGE];
        let pages = self.residency(offset, len, &mut in_memory)?;
        Ok(pages
            .iter()
            .position(|state| state & 1 != 0)
            .map(|page| offset + page * HOST_PAGE))
    }

    /// Whether any page of `[offset, offset + len)` (at most one page table's span) is in
    /// memory; allocates nothing (see `residency_file`).
    pub fn any_in_memory(&self, offset: usize, len: usize) -> std::io::Result<bool> {
        self.check(offset, len)?;
        Ok(self.first_page_in_memory(offset, len)?.is_some())
    }

    /// Whether every page of `[offset, offset + len)` (at most one page table's span) is in
    /// memory: committed, for memory that is never swapped.
    pub fn all_in_memory(&self, offset: usize, len: usize) -> std::io::Result<bool> {
        self.check(offset, len)?;
        if let Some(fd) = self.residency_file() {
            // The end of the file counts as a hole.
            let hole = lseek(fd, file_offset(offset)?, Whence::SeekHole)?;
            return Ok(usize::try_from(hole).is_ok_and(|hole| hole >= offset + len));
        }
        let mut in_memory = [0u8; PAGE_TABLE_SPAN / HOST_PAGE];
        let pages = self.residency(offset, len, &mut in_memory)?;
        Ok(pages.iter().all(|state| state & 1 != 0))
    }

    /// mincore(2) of `[offset, offset + len)` into `in_memory`: a byte per page, returned.
    fn residency<'a>(
        &self,
        offset: usize,
        len: usize,
        in_memory: &'a mut [u8],
    ) -> std::io::Result<&'a [u8]> {
        let pages = len.div_ceil(HOST_PAGE);
        if pages > in_memory.len() {
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        // SAFETY: the range lies inside our mapping (callers check it) and `in_memory` has a
        // byte for each of its pages; mincore only writes those bytes.
        cvt(unsafe { libc::mincore(self.ptr(offset).as_ptr(), len, in_memory.as_mut_ptr()) })?;
        Ok(&in_memory[..pages])
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Which page table (2 MiB of address space, on x86-64 and 4 KiB-page arm64) maps the
    /// byte at `offset`.
    pub fn page_table_of(&self, offset: usize) -> usize {
        (self.base.as_ptr() as usize + offset) / PAGE_TABLE_SPAN
    }

    /// Fault the pages of `[offset, offset + len)` into the mapping, allocating those not
    /// committed yet (see the module's comment for why not with `fallocate`); pages committed
    /// already only get their page table entries.
    pub fn commit(&self, offset: usize, len: usize) -> std::io::Result<()> {
        self.check(offset, len)?;
        // SAFETY: the range lies inside our mapping (checked); populating changes no
        // contents, it only makes the pages present.
        unsafe { madvise(self.ptr(offset), len, MmapAdvise::MADV_POPULATE_WRITE) }?;
        Ok(())
    }

    /// Give the pages of `[offset, offset + len)` back to the system; they read as zeros after.
    pub fn decommit(&self, offset: usize, len: usize) -> std::io::Result<()> {
        self.check(offset, len)?;
        if let Some(fd) = &self.fd {
            let punch = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
            fallocate(fd, punch, file_offset(offset)?, file_offset(len)?)?;
            return Ok(());
        }
        // SAFETY: the range lies inside our mapping (checked), and MADV_REMOVE only makes it
        // read as zeros. What callers give back is reached by no plain slice meanwhile: free
        // chunks they hold `&mut` (`ArenaChunk::decommit_all`), slots whose locks they hold
        // (`PageSlots::decommit`), or words read only as atomics (the page table's groups),
        // for which the kernel's zeroing is one more store by another thread.
        unsafe { madvise(self.ptr(offset), len, MmapAdvise::MADV_REMOVE) }?;
        Ok(())
    }

    pub(super) fn check(&self, offset: usize, len: usize) -> std::io::Result<()> {
        match offset.checked_add(len) {
            Some(end)
                if end <= self.len
                    && offset.is_multiple_of(HOST_PAGE)
                    && len.is_multiple_of(HOST_PAGE) =>
            {
                Ok(())
            }
            _ => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }

    fn ptr(&self, offset: usize) -> NonNull<std::ffi::c_void> {
        // SAFETY: callers pass offsets inside the mapping, so the pointer stays in bounds.
        unsafe { self.base.add(offset) }.cast()
    }

    /// `count` atomic 64-bit words at `offset` (8-byte aligned, inside the segment).
    pub fn words(
        self: &Arc<Self>,
        offset: usize,
        count: usize,
    ) -> std::io::Result<Words<AtomicU64>> {
        self.words_of(offset, count)
    }

    /// `count` atomic words of type `T` (`AtomicU32`, `AtomicU16`) at `offset`, aligned to
    /// their size and inside the segment.
    pub fn words_of<T: AtomicWord>(
        self: &Arc<Self>,
        offset: usize,
        count: usize,
    ) -> std::io::Result<Words<T>> {
        Words::new(self, offset, count)
    }

    /// `count` page slots of `HOST_PAGE` bytes at `offset`, each behind its own lock.
    pub fn page_slots(self: &Arc<Self>, offset: usize, count: usize) -> std::io::Result<PageSlots> {
        let bytes = count
            .checked_mul(HOST_PAGE)
            .ok_or(std::io::ErrorKind::InvalidInput)?;
        self.check(offset, bytes)?;
        Ok(PageSlots {
            segment: Arc::clone(self),
            offset,
            locks: (0..count).map(|_| RwLock::new(())).collect(),
        })
    }

    /// Bytes `[offset, offset + len)`, shared. The caller makes sure nobody writes them
    /// meanwhile (see `ArenaChunk`).
    pub(super) fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        debug_assert!(
            self.check(offset, len).is_ok(),
            "{offset}+{len} outside the segment"
        );
        // SAFETY: callers pass ranges inside the mapping (checked when their view was made),
        // which lives as long as `&self`; exclusion of writers is the view's contract.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), len) }
    }

    #[allow(
        clippy::mut_from_ref,
        reason = "views hand out disjoint ranges under their own locks"
    )]
    pub(super) fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(
            self.check(offset, len).is_ok(),
            "{offset}+{len} outside the segment"
        );
        // SAFETY: as for `bytes`; the view holding the range's exclusive lock (or owning the
        // range outright) is the only one that reaches it.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        let result = match self.backing {
            // SAFETY: detaching exactly our attachment; every view holds an `Arc` to the
            // segment, so none is alive when this runs.
            Backing::SysV(_) => cvt(unsafe { libc::shmdt(self.base.as_ptr().cast()) }),
            // SAFETY: as above, for our own mapping.
            Backing::Memfd => unsafe { munmap(self.base.cast(), self.len) }.map_err(Into::into),
        };
        if let Err(error) = result {
            tracing::warn!(%error, "unmapping page memory failed");
        }
    }
}

fn round_to_pages(len: usize) -> usize {
    len.div_ceil(HOST_PAGE).max(1) * HOST_PAGE
}

fn stat(id: libc::c_int) -> std::io::Result<libc::shmid_ds> {
    let mut ds = std::mem::MaybeUninit::<libc::shmid_ds>::zeroed();
    // SAFETY: IPC_STAT writes one shmid_ds into the buffer we own.
    cvt(unsafe { libc::shmctl(id, libc::IPC_STAT, ds.as_mut_ptr()) })?;
    // SAFETY: initialised: zeroed, then filled by the kernel.
    Ok(unsafe { ds.assume_init() })
}

/// Make the SysV segment `key` another user's (`uid`), as if that user had made it: tests of
/// what a local user's segment under a device's key does. Needs CAP_SYS_ADMIN (or being its
/// owner) and, for `uid` other than one's own, CAP_SYS_ADMIN.
#[cfg(test)]
pub(crate) fn give_shared_to_user(key: i32, uid: libc::uid_t) -> std::io::Result<()> {
    // SAFETY: shmget takes no pointers.
    let id = unsafe { libc::shmget(key, 0, 0) };
    cvt(id)?;
    let mut ds = stat(id)?;
    ds.shm_perm.uid = uid;
    // SAFETY: IPC_SET reads one shmid_ds from the buffer we own.
    cvt(unsafe { libc::shmctl(id, libc::IPC_SET, &mut ds) })?;
    Ok(())
}

/// A SysV segment named by its id: the one a key held when it was looked up (`shared_id`),
/// never a segment made under that key since (it has another id).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedId(libc::c_int);

impl SharedId {
    /// Remove the segment (freed once no process maps it); false if it is gone already.
    pub fn remove(self) -> std::io::Result<bool> {
        match remove_id(self.0) {
            Ok(()) => Ok(true),
            Err(error) if matches!(error.raw_os_error(), Some(libc::EINVAL | libc::EIDRM)) => {
                Ok(false)
            }
            Err(error) => Err(error),
        }
    }
}

/// IPC_RMID: the segment `id` is freed once no process maps it; its key is free at once.
fn remove_id(id: libc::c_int) -> std::io::Result<()> {
    // SAFETY: IPC_RMID takes no buffer.
    cvt(unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) }).map(|_| ())
}

/// Atomic words in a segment: like a `&[AtomicU64]` (or `AtomicU32`, `AtomicU16`) that keeps the
/// segment mapped. Other processes of ours may have written them before (a resumed store).
pub struct Words<T> {
    segment: Arc<Segment>,
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the words are atomics; sharing them between threads is what atomics are for.
unsafe impl<T: Sync> Send for Words<T> {}
// SAFETY: see `Send`.
unsafe impl<T: Sync> Sync for Words<T> {}

/// The atomics `Words` may hold: their layout is that of the plain integer.
pub trait AtomicWord: Sync {}
impl AtomicWord for AtomicU64 {}
impl AtomicWord for AtomicU32 {}
impl AtomicWord for AtomicU16 {}

impl<T: AtomicWord> Words<T> {
    fn new(segment: &Arc<Segment>, offset: usize, count: usize) -> std::io::Result<Self> {
        let size = std::mem::size_of::<T>();
        let bytes = count
            .checked_mul(size)
            .ok_or(std::io::ErrorKind::InvalidInput)?;
        if !offset.is_multiple_of(size)
            || offset
                .checked_add(bytes)
                .is_none_or(|end| end > segment.len)
        {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        let ptr = NonNull::new(segment.ptr(offset).as_ptr().cast::<T>())
            .ok_or(std::io::ErrorKind::InvalidInput)?;
        Ok(Self {
            segment: Arc::clone(segment),
            ptr,
            len: count,
        })
    }
}

impl<T: AtomicWord> Deref for Words<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the range is inside the mapping (checked in `new`) and aligned for `T`; the
        // mapping lives as long as `self.segment`; `T` is an atomic integer, valid for any bit
        // pattern and meant to be shared, so other threads' (and earlier processes') writes
        // through the same memory are fine.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> std::fmt::Debug for Words<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Words({} in {:?})", self.len, self.segment.backing)
    }
}

/// Slots `PageSlots::decommit` gives back a system call at a time, with their locks held.
const DECOMMIT_RUN: usize = 64;

/// Page-sized slots in a segment, each behind its own (process-local) read-write lock.
pub struct PageSlots {
    segment: Arc<Segment>,
    offset: usize,
    locks: Box<[RwLock<()>]>,
}

impl PageSlots {
    pub fn len(&self) -> usize {
        self.locks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.locks.is_empty()
    }

    /// Fault in the memory of slots `range` (see `Segment::commit`).
    pub fn commit(&self, range: std::ops::Range<usize>) -> std::io::Result<()> {
        match self.bytes_of(range)? {
            (_, 0) => Ok(()),
            (offset, len) => self.segment.commit(offset, len),
        }
    }

    /// Give the memory of slots `range` back (see `Segment::decommit`); they read as zeros
    /// after. The kernel zeroes them behind any view, so each slot's lock is held for writing
    /// while its page goes, `DECOMMIT_RUN` slots a system call: a caller gives back slots
    /// nobody uses, whose locks nobody holds, but a slot read meanwhile would only wait.
    pub fn decommit(&self, range: std::ops::Range<usize>) -> std::io::Result<()> {
        self.bytes_of(range.clone())?;
        for start in range.clone().step_by(DECOMMIT_RUN) {
            let run = start..(start + DECOMMIT_RUN).min(range.end);
            let mut held: [Option<RwLockWriteGuard<'_, ()>>; DECOMMIT_RUN] =
                std::array::from_fn(|_| None);
            for (guard, lock) in held.iter_mut().zip(&self.locks[run.clone()]) {
                *guard = Some(lock.write());
            }
            let (offset, len) = self.bytes_of(run)?;
            self.segment.decommit(offset, len)?;
        }
        Ok(())
    }

    /// Whether any slot of `range` (within one page table's span) has memory.
    #[cfg(test)]
    pub fn any_in_memory(&self, range: std::ops::Range<usize>) -> std::io::Result<bool> {
        let (offset, len) = self.bytes_of(range)?;
        self.segment.any_in_memory(offset, len)
    }

    fn bytes_of(&self, range: std::ops::Range<usize>) -> std::io::Result<(usize, usize)> {
        if range.start > range.end || range.end > self.len() {
            return Err(Errno::EINVAL.into());
        }
        Ok((
            self.offset + range.start * HOST_PAGE,
            range.len() * HOST_PAGE,
        ))
    }

    /// Slot `i`, shared.
    pub fn read(&self, i: usize) -> SlotRead<'_> {
        let guard = self.locks[i].read();
        SlotRead {
            _guard: guard,
            bytes: page_array(self.segment.bytes(self.offset + i * HOST_PAGE, HOST_PAGE)),
        }
    }

    /// Slot `i`, exclusive.
    pub fn write(&self, i: usize) -> SlotWrite<'_> {
        let guard = self.locks[i].write();
        SlotWrite {
            _guard: guard,
            bytes: page_array_mut(
                self.segment
                    .bytes_mut(self.offset + i * HOST_PAGE, HOST_PAGE),
            ),
        }
    }
}

fn page_array(bytes: &[u8]) -> &[u8; HOST_PAGE] {
    // SAFETY: callers pass slices of exactly HOST_PAGE bytes; an array of bytes has the
    // alignment of a byte.
    unsafe { &*bytes.as_ptr().cast::<[u8; HOST_PAGE]>() }
}

fn page_array_mut(bytes: &mut [u8]) -> &mut [u8; HOST_PAGE] {
    // SAFETY: as for `page_array`, and the `&mut` is moved into the result.
    unsafe { &mut *bytes.as_mut_ptr().cast::<[u8; HOST_PAGE]>() }
}

/// A slot's bytes under its read lock.
pub struct SlotRead<'a> {
    _guard: RwLockReadGuard<'a, ()>,
    bytes: &'a [u8; HOST_PAGE],
}

impl Deref for SlotRead<'_> {
    type Target = [u8; HOST_PAGE];
    fn deref(&self) -> &[u8; HOST_PAGE] {
        self.bytes
    }
}

/// A slot's bytes under its write lock.
pub struct SlotWrite<'a> {
    _guard: RwLockWriteGuard<'a, ()>,
    bytes: &'a mut [u8; HOST_PAGE],
}

impl Deref for SlotWrite<'_> {
    type Target = [u8; HOST_PAGE];
    fn deref(&self) -> &[u8; HOST_PAGE] {
        self.bytes
    }
}

impl DerefMut for SlotWrite<'_> {
    fn deref_mut(&mut self) -> &mut [u8; HOST_PAGE] {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn private_segment_words_slots_and_chunks() {
        let seg = Segment::private(8 * HOST_PAGE).unwrap();
        seg.commit(0, 8 * HOST_PAGE).unwrap();
        let words = seg.words(0, 4).unwrap();
        words[3].store(7, Ordering::Relaxed);
        assert_eq!(seg.words(24, 1).unwrap()[0].load(Ordering::Relaxed), 7);
        assert!(seg.words(4, 1).is_err(), "misaligned");
        assert!(seg.words(8 * HOST_PAGE, 1).is_err(), "past the end");
        let slots = seg.page_slots(HOST_PAGE, 2).unwrap();
        slots.write(1).fill(9);
        assert!(slots.read(1).iter().all(|&b| b == 9));
        seg.check(4 * HOST_PAGE, 2 * HOST_PAGE).unwrap();
        assert!(
            seg.check(4 * HOST_PAGE, HOST_PAGE + 1).is_err(),
            "not whole pages"
        );
        seg.bytes_mut(4 * HOST_PAGE, 2 * HOST_PAGE).fill(5);
        seg.decommit(4 * HOST_PAGE, 2 * HOST_PAGE).unwrap();
        seg.commit(4 * HOST_PAGE, 2 * HOST_PAGE).unwrap();
        assert!(
            seg.bytes(4 * HOST_PAGE, 2 * HOST_PAGE)
                .iter()
                .all(|&b| b == 0),
            "a given-back range reads as zeros"
        );
        assert!(slots.read(1).iter().all(|&b| b == 9));
    }

    /// Slots given back in runs of `DECOMMIT_RUN` (each run's locks held): every slot of the
    /// range reads as zeros after, and the slots before it keep their data.
    #[test]
    fn slots_are_given_back_run_by_run() {
        let count = 2 * DECOMMIT_RUN + 3;
        let seg = Segment::private((count + 1) * HOST_PAGE).unwrap();
        let slots = seg.page_slots(HOST_PAGE, count).unwrap();
        slots.commit(0..count).unwrap();
        for i in 0..count {
            slots.write(i).fill(7);
        }
        slots.decommit(2..count).unwrap();
        assert!(slots.decommit(2..count + 1).is_err(), "past the slots");
        slots.commit(0..count).unwrap();
        for i in 0..count {
            let expect = if i < 2 { 7 } else { 0 };
            assert!(slots.read(i).iter().all(|&b| b == expect), "slot {i}");
        }
    }

    #[test]
    fn page_tables_are_made_through_committed_pages_only() {
        let spans = 4;
        let seg = Segment::private(spans * PAGE_TABLE_SPAN).unwrap();
        let mut made = vec![false; seg.page_table_count()];
        // One page committed, in the middle of the mapping; the rest are holes.
        let page = 2 * PAGE_TABLE_SPAN + 5 * HOST_PAGE;
        seg.commit(page, HOST_PAGE).unwrap();
        seg.make_page_tables(0, seg.len(), &mut made).unwrap();
        let table = seg.page_table_of(page) - seg.page_table_of(0);
        for (i, &done) in made.iter().enumerate() {
            assert_eq!(done, i == table, "page table {i} of {made:?}");
        }
        // Nothing was allocated where the store gave memory back.
        assert_eq!(
            seg.first_page_in_memory(0, PAGE_TABLE_SPAN - HOST_PAGE)
                .unwrap(),
            None
        );
        assert_eq!(
            seg.first_page_in_memory(page - 4 * HOST_PAGE, 8 * HOST_PAGE)
                .unwrap(),
            Some(page)
        );
        // A table made is not looked at again; a range past the mapping is refused.
        seg.decommit(page, HOST_PAGE).unwrap();
        seg.make_page_tables(0, seg.len(), &mut made).unwrap();
        assert_eq!(made.iter().filter(|&&done| done).count(), 1);
        assert!(seg
            .make_page_tables(0, seg.len() + HOST_PAGE, &mut made)
            .is_err());
    }

    #[test]
    fn residency_by_the_file_matches_mincore() {
        // Pages committed and given back in a pattern across two page tables' spans; every
        // window asked both ways (memfd pages committed here stay in memory, as a locked SysV
        // segment's do).
        let mut seg = Segment::private(2 * PAGE_TABLE_SPAN).unwrap();
        for page in [0, 1, 5, 6, 7, 300, 511, 512, 700, 1023] {
            seg.commit(page * HOST_PAGE, HOST_PAGE).unwrap();
        }
        seg.decommit(6 * HOST_PAGE, HOST_PAGE).unwrap();
        let pages = 2 * PAGE_TABLE_SPAN / HOST_PAGE;
        let windows: Vec<(usize, usize)> = (0..pages)
            .step_by(7)
            .flat_map(|first| {
                [1, 2, 3, 40, 512]
                    .into_iter()
                    .filter(move |&n| first + n <= pages && n <= PAGE_TABLE_SPAN / HOST_PAGE)
                    .map(move |n| (first * HOST_PAGE, n * HOST_PAGE))
            })
            .collect();
        let ask = |seg: &Segment| -> Vec<(Option<usize>, bool)> {
            windows
                .iter()
                .map(|&(offset, len)| {
                    (
                        seg.first_page_in_memory(offset, len).unwrap(),
                        seg.all_in_memory(offset, len).unwrap(),
                    )
                })
                .collect()
        };
        let by_mincore = ask(&seg);
        Arc::get_mut(&mut seg).unwrap().committed_stays = true;
        assert!(seg.residency_file().is_some());
        assert_eq!(ask(&seg), by_mincore);
        assert!(by_mincore
            .iter()
            .any(|&(first, all)| first.is_some() && all));
        assert!(by_mincore
            .iter()
            .any(|&(first, all)| first.is_some() && !all));
        assert!(by_mincore.iter().any(|&(first, _)| first.is_none()));
    }

    #[test]
    fn shared_segment_outlives_its_mapping() {
        // A key no daemon uses (device keys are 0x7400_0000 + id).
        let key = 0x7e00_0000 | i32::try_from(std::process::id() & 0xffff).unwrap();
        let _ = Segment::remove_shared(key);
        let seg = match Segment::create_shared(key, 4 * HOST_PAGE, false) {
            Ok(seg) => seg,
            // Containers without SysV IPC: nothing to test here.
            Err(error) if error.raw_os_error() == Some(libc::ENOSYS) => return,
            Err(error) => panic!("{error}"),
        };
        seg.commit(0, HOST_PAGE).unwrap();
        seg.words(8, 1).unwrap()[0].store(42, Ordering::Relaxed);
        drop(seg);
        let again = Segment::attach_shared(key).unwrap().expect("still there");
        assert_eq!(again.words(8, 1).unwrap()[0].load(Ordering::Relaxed), 42);
        assert!(Segment::create_shared(key, HOST_PAGE, false).is_err());
        assert!(Segment::remove_shared(key).unwrap());
        drop(again);
        assert!(!Segment::shared_exists(key));
        assert!(!Segment::remove_shared(key).unwrap());
    }

    #[test]
    fn a_refused_segment_says_which_setting_to_change() {
        let len = 17 << 30;
        let strict = creation_refused(Some(libc::ENOMEM), len, true).unwrap();
        assert!(strict.contains("vm.overcommit_memory") && strict.contains("17408 MiB"));
        let short = creation_refused(Some(libc::ENOMEM), len, false).unwrap();
        assert!(!short.contains("overcommit"), "{short}");
        assert!(creation_refused(Some(libc::EINVAL), len, false)
            .unwrap()
            .contains("kernel.shmmax"));
        assert!(creation_refused(Some(libc::ENOSPC), len, false)
            .unwrap()
            .contains("kernel.shmall"));
        assert_eq!(creation_refused(Some(libc::EACCES), len, false), None);
        assert!(lock_refused(Some(libc::EPERM))
            .unwrap()
            .contains("CAP_IPC_LOCK"));
        let error = explained(
            std::io::Error::from_raw_os_error(libc::ENOMEM),
            creation_refused(Some(libc::ENOMEM), len, true),
        );
        assert_eq!(error.kind(), std::io::ErrorKind::OutOfMemory);
        assert!(error.to_string().starts_with("Cannot allocate memory"));
    }
}
