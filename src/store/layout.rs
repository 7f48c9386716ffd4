//! The store's memory: one segment holding everything a store needs to be found again by the
//! next process after this one dies (kill -9, a crash, a hand-over to a newer binary):
//!
//! | region | what |
//! | --- | --- |
//! | header (one page) | magic, layout version, device pages, slots per batch, arena size, the allocator's class fingerprint, the arena's carve cursor, the pid of the process using it, then each size class's live chunks (a hint, see `H_CLASS_CHUNKS`) |
//! | table | one word per device page (see `table`); this and the next two are committed a group of pages at a time as the device is written (see `table_memory`) |
//! | hints | one 16-bit idle hint per device page (see `table::Hint`); not crash-consistent, started afresh on resume |
//! | checksums | the checksum of each stored page's data (`codec::PageChecksum`: CRC32C in a store of version 3 or 6, XXH64's low half in one of version 4 or 5, XXH3's in one of version 7), written before its entry names the object |
//! | group map | (versions 5 to 7) the slot of the three regions above each group of entries is in (see `table_memory`); those regions then hold whole groups |
//! | slot indexes | the page index each pending slot holds |
//! | slot pages | the pending batches' pages |
//! | arena tags | a word per arena page (see `mem::Arena`) |
//! | arena | compressed pages |
//!
//! A private store (tests, bench, `Backing::Private`) has the same layout in a memfd. A shared
//! one is the SysV segment of its device id, locked in memory; what the kernel frees it on is
//! `remove_shared` (`trueno-ublk delete`, or a daemon stopping an unused device), never a
//! process's death. Everything else a store has (locks, reservations, the allocator's lists,
//! counters) is rebuilt from the table by `resume`.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::table_memory::{Region, Slots, TableMemory, GROUP_PAGES};
use super::{alloc, StoreError, PENDING_BATCHES};
use crate::codec::{PageChecksum, PAGE_SIZE};
use crate::mem::{Arena, PageSlots, Segment, Words};

/// Version of this layout and of the meaning of its words. A binary refuses a segment of a
/// version it does not read (`READ_VERSIONS`), and leaves it untouched for a binary that does.
/// Version 5 places groups of the table in any slot (the group map), versions 3 and 4 group
/// `g` in slot `g`; versions 6 and 7 are version 5 with other checksums. Versions 3 and 6
/// checksum pages with CRC32C, 4 and 5 with XXH64, 7 with XXH3 (their words mean the same
/// otherwise). A new store is the version of the fastest checksum here (see
/// `new_store_version`), so a store made where XXH64 wins can still be taken by a binary of
/// before version 6, and one made where CRC32C wins by one of before version 7. A store of an
/// older version is resumed as it is, and keeps its layout and its version, so the binary that
/// made it can still take it back.
pub const LAYOUT_VERSION: u64 = 7;
/// The version of a new store checksummed with CRC32C (see `LAYOUT_VERSION`).
const CRC32C_LAYOUT_VERSION: u64 = 6;
/// The version of a new store checksummed with XXH64 (see `LAYOUT_VERSION`).
const XXH64_LAYOUT_VERSION: u64 = 5;
const READ_VERSIONS: [u64; 5] = [
    3,
    4,
    XXH64_LAYOUT_VERSION,
    CRC32C_LAYOUT_VERSION,
    LAYOUT_VERSION,
];

/// The layout version of the stores this thread makes: that of the fastest checksum on this
/// machine (`PageChecksum::fastest_here`); tests choose (`LAYOUT_FOR_TESTS`).
fn new_store_version() -> u64 {
    #[cfg(test)]
    return LAYOUT_FOR_TESTS.with(std::cell::Cell::get);
    #[cfg(not(test))]
    match PageChecksum::fastest_here() {
        PageChecksum::Crc32c => CRC32C_LAYOUT_VERSION,
        PageChecksum::Xxh64 => XXH64_LAYOUT_VERSION,
        PageChecksum::Xxh3 => LAYOUT_VERSION,
    }
}

#[cfg(test)]
thread_local! {
    /// See `new_store_version`.
    pub(super) static LAYOUT_FOR_TESTS: std::cell::Cell<u64> =
        const { std::cell::Cell::new(LAYOUT_VERSION) };
}

/// Whether a store of layout `version` has the group map (see `table_memory`).
fn maps_groups(version: u64) -> bool {
    version >= 5
}

/// The page checksum of a store of layout `version` (one of `READ_VERSIONS`).
pub(super) fn checksum_of_version(version: u64) -> PageChecksum {
    match version {
        3 | CRC32C_LAYOUT_VERSION => PageChecksum::Crc32c,
        LAYOUT_VERSION => PageChecksum::Xxh3,
        _ => PageChecksum::Xxh64,
    }
}
const MAGIC: u64 = u64::from_le_bytes(*b"trueublk");
/// SysV keys of device stores: this plus the device id, in the key's low `DEVICE_ID_BITS`.
const DEVICE_KEY_BASE: i32 = 0x7400_0000;
const DEVICE_ID_BITS: u32 = 20;
/// The highest device id a store's key holds (the daemon asserts that ublk's ids fit).
pub const MAX_DEVICE_ID: u32 = (1 << DEVICE_ID_BITS) - 1;
/// The bits of a device key that are its id.
const DEVICE_ID_MASK: i32 = (1 << DEVICE_ID_BITS) - 1;

/// Header words.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 1;
const H_PAGES: usize = 2;
const H_SLOTS: usize = 3;
const H_ARENA: usize = 4;
const H_CLASSES: usize = 5;
const H_CARVED: usize = 6;
const H_OWNER: usize = 7;
/// From here, one word per size class: how many live chunks the class had when the owner
/// last provisioned its lists. A hint, not state: it sizes the next process's rebuild (and
/// the heap a standby keeps ready for it, see `ResumeHint`); any value is safe to read. Stores made before it have zeros here, and binaries before it never read it, so
/// it needs no new layout version.
const H_CLASS_CHUNKS: usize = 8;
const HEADER_WORDS: usize = H_CLASS_CHUNKS + alloc::MAX_CLASSES;
const _: () = assert!(HEADER_WORDS * 8 <= PAGE_SIZE, "the header is one page");

/// Where a store keeps its pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Memory of this process only (tests, bench).
    Private,
    /// The shared segment of device `device_id`: kept, locked in memory, when the process
    /// dies; the next store opened for the device resumes it.
    Shared { device_id: u32 },
    /// A shared segment under `key`, not locked in memory (no CAP_IPC_LOCK needed): for tests
    /// of resuming only, never for serving swap.
    SharedUnlocked { key: i32 },
}

/// What `BatchedPageStore::open` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opened {
    /// A new, empty store.
    Fresh,
    /// The store a previous process left: `pages` pages held, `lost` of them unreadable
    /// (their entries could not be validated; they read as EIO until written).
    Resumed { pages: u64, lost: u64 },
}

/// Where a shared store made under another key than its own is recorded (`recorded_key`):
/// the daemons' run directory, root's only.
const KEY_RECORD_DIR: &str = "/run/trueno-ublk";

#[cfg(test)]
thread_local! {
    /// Tests record keys in a directory of their own.
    pub(super) static KEY_RECORD_DIR_FOR_TESTS: std::cell::RefCell<Option<std::path::PathBuf>> =
        const { std::cell::RefCell::new(None) };
}

/// The file that records the key a shared store whose own key is `own_key` was made under
/// instead (see `open_shared`).
fn key_record(own_key: i32) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(KEY_RECORD_DIR);
    #[cfg(test)]
    let dir = KEY_RECORD_DIR_FOR_TESTS
        .with(|dir| dir.borrow().clone())
        .unwrap_or(dir);
    dir.join(format!("shm-{own_key:#x}.key"))
}

/// The key the store whose own key is `own_key` was made under instead, if it was.
fn recorded_key(own_key: i32) -> Option<i32> {
    std::fs::read_to_string(key_record(own_key))
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|&key| key > 0 && key != own_key)
}

/// The key a shared store whose own key is `own_key` is under: that, or the one recorded.
fn current_key(own_key: i32) -> i32 {
    recorded_key(own_key).unwrap_or(own_key)
}

/// A new random key for the shared store whose own key is `own_key`, recorded before any
/// segment is made under it (so that a segment never exists that `remove_shared` cannot find).
pub(super) fn record_new_key(own_key: i32, attempt: u32) -> std::io::Result<i32> {
    use std::hash::{BuildHasher, Hasher};
    use std::os::unix::fs::DirBuilderExt;
    // 31 bits, never 0 (IPC_PRIVATE) nor any device's own key (another device's would be
    // freed as that device's when it is made).
    let mut draw = 0u32;
    let key = loop {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(attempt);
        hasher.write_u32(draw);
        draw += 1;
        let key = i32::try_from(hasher.finish() & 0x7fff_ffff).unwrap_or(0);
        if key != 0 && key != own_key && key & !DEVICE_ID_MASK != DEVICE_KEY_BASE {
            break key;
        }
    };
    let path = key_record(own_key);
    let dir = path.parent().unwrap_or(std::path::Path::new("/"));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let staged = path.with_extension("key.new");
    std::fs::write(&staged, format!("{key}\n"))?;
    std::fs::rename(&staged, &path)?;
    Ok(key)
}

/// Whether the SysV segment `key` is another user's (`Segment::attach_shared` refuses it).
fn foreign(key: i32) -> bool {
    matches!(Segment::attach_shared(key),
        Err(error) if error.kind() == std::io::ErrorKind::PermissionDenied)
}

/// The SysV key of device `id`'s store, its own (see `open_shared` for the key it may be
/// under instead).
fn device_key(id: u32) -> Result<i32, StoreError> {
    if id > MAX_DEVICE_ID {
        return Err(StoreError::Config(format!(
            "device id {id} is above {MAX_DEVICE_ID}"
        )));
    }
    // At most 2^20 - 1: fits.
    Ok(DEVICE_KEY_BASE | i32::try_from(id).unwrap_or(0))
}

pub(super) fn memory_error(what: &str) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Memory {
        what: what.to_string(),
        source,
    }
}

/// Free device `device_id`'s shared store (once no process maps it). False if it had none.
pub fn remove_shared(device_id: u32) -> Result<bool, StoreError> {
    shared_store(device_id)?.remove()
}

/// Device `device_id`'s shared store as it is now, to be freed later (`SharedStore::remove`).
pub fn shared_store(device_id: u32) -> Result<SharedStore, StoreError> {
    shared_store_under(device_key(device_id)?)
}

/// The shared store whose own key is `own_key`, as it is now: the segment under the key
/// recorded for it, the record, and whatever segment is under its own key (another user's,
/// there to keep it from being made, too).
pub(super) fn shared_store_under(own_key: i32) -> Result<SharedStore, StoreError> {
    let looking = || memory_error("looking up the store's shared memory");
    let recorded = recorded_key(own_key);
    let mut segments = Vec::new();
    for key in recorded.into_iter().chain([own_key]) {
        segments.extend(Segment::shared_id(key).map_err(looking())?);
    }
    Ok(SharedStore {
        own_key,
        recorded,
        segments,
    })
}

/// A shared store's segments and key record as they were when looked up. Why not by key at
/// the time of freeing: `trueno-ublk delete` frees a store after its device is deleted, and
/// by then a `create` of the same id (a unit restarted, say) may have made a store of its own
/// under the same keys, which freeing by key would take from under it.
#[derive(Debug)]
pub struct SharedStore {
    own_key: i32,
    recorded: Option<i32>,
    segments: Vec<crate::mem::SharedId>,
}

impl SharedStore {
    /// Free the segments (each once no process maps it) and the key record, if it still
    /// names the key it did. False if there was no segment to free.
    pub fn remove(self) -> Result<bool, StoreError> {
        let removing = || memory_error("removing the store's shared memory");
        let mut removed = false;
        for segment in self.segments {
            removed |= segment.remove().map_err(removing())?;
        }
        if self.recorded.is_some() && recorded_key(self.own_key) == self.recorded {
            match std::fs::remove_file(key_record(self.own_key)) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    return Err(removing()(error))
                }
                _ => {}
            }
        }
        Ok(removed)
    }
}

/// Whether device `device_id` has a shared store.
pub fn shared_exists(device_id: u32) -> bool {
    device_key(device_id).is_ok_and(|key| Segment::shared_exists(current_key(key)))
}

/// What a store's header says about the memory a resume of it needs.
pub(super) struct ResumeHint {
    pub(super) carved_bytes: u64,
    pub(super) slots_per_batch: u64,
    pub(super) class_chunks: [u64; alloc::MAX_CLASSES],
}

/// Device `device_id`'s store, attached ahead of a takeover (a standby's) without taking it:
/// its header tells the heap a resume needs (`hint`), and the page tables of the part it uses
/// are made in this process beforehand (`make_page_tables`), so that the takeover maps nothing
/// new. Why: a process's page tables of shared memory are its own, allocated when it first
/// touches each 2 MiB of it; a takeover that made them then did so with memory at the
/// watermark, as an I/O flusher whose reclaim may not write swap, with the device waiting for
/// it: seen in the VM, its allocation spun in reclaim for good and swap stalled.
pub struct AttachedStore {
    key: i32,
    segment: Arc<Segment>,
    /// Per page table of the mapping: made already.
    page_tables: Vec<bool>,
}

impl AttachedStore {
    /// Attach device `device_id`'s store; `None` if it has none.
    pub fn attach(device_id: u32) -> Result<Option<Self>, StoreError> {
        Self::attach_key(current_key(device_key(device_id)?))
    }

    /// Attach the store in shared memory under `key`; `None` if there is none.
    pub(super) fn attach_key(key: i32) -> Result<Option<Self>, StoreError> {
        let attaching = memory_error("attaching the store's shared memory");
        let Some(segment) = Segment::attach_shared(key).map_err(attaching)? else {
            return Ok(None);
        };
        let page_tables = crate::mem::faulted_in_vec(segment.page_table_count());
        let mut attached = Self {
            key,
            segment,
            page_tables,
        };
        attached
            .page_tables
            .resize(attached.segment.page_table_count(), false);
        Ok(Some(attached))
    }

    /// Whether this is still the device's store (not one removed since, with its device).
    pub fn is_current(&self) -> bool {
        self.segment.is_shared_under(self.key)
    }

    /// The header of a store made whole (its magic set last); `None` while one is being
    /// made, or if the header cannot be mapped (the resume maps it again, and says what failed).
    fn made_header(&self) -> Option<Words<AtomicU64>> {
        let header = self.segment.words(0, HEADER_WORDS).ok()?;
        (header[H_MAGIC].load(Ordering::Acquire) == MAGIC).then_some(header)
    }

    /// The header of a store of a layout version this binary reads (see `made_header`).
    fn header(&self) -> Option<Words<AtomicU64>> {
        self.made_header()
            .filter(|header| READ_VERSIONS.contains(&header[H_VERSION].load(Ordering::Acquire)))
    }

    /// Whether this binary can resume the store, as far as the build that made it matters:
    /// the error a resume would end with for a store of a layout version or of size classes
    /// this binary does not read. `Ok` for a store still being made. A standby checks this
    /// before it says it is ready, so that a `reload` to a build that cannot take the store
    /// over leaves the running process serving rather than the device without one.
    pub fn check_this_binary_reads(&self) -> Result<(), StoreError> {
        let Some(header) = self.made_header() else {
            return Ok(());
        };
        let word = |i: usize| header[i].load(Ordering::Acquire);
        check_this_binary_reads(self.key, word(H_VERSION), word(H_CLASSES))
    }

    /// What the header says about the heap a resume needs; `None` for a store this binary
    /// cannot read (which the resume then refuses) or one not made yet.
    pub(super) fn hint(&self) -> Option<ResumeHint> {
        let header = self.header()?;
        let word = |i: usize| header[i].load(Ordering::Acquire);
        Some(ResumeHint {
            carved_bytes: word(H_CARVED),
            slots_per_batch: word(H_SLOTS),
            class_chunks: std::array::from_fn(|class| word(H_CLASS_CHUNKS + class)),
        })
    }

    /// Make the page tables of the store's regions and of the arena as far as it is carved
    /// now (it grows as the serving process stores pages: call again). Returns how many
    /// bytes of the store's memory that is (0 while no store is made), so that a caller can
    /// tell a growing store from a quiet one.
    pub fn make_page_tables(&mut self) -> Result<usize, StoreError> {
        let Some(header) = self.header() else {
            return Ok(0);
        };
        let word = |i: usize| usize::try_from(header[i].load(Ordering::Acquire)).ok();
        let (Some(pages), Some(slots_per_batch), Some(arena_bytes), Some(carved)) =
            (word(H_PAGES), word(H_SLOTS), word(H_ARENA), word(H_CARVED))
        else {
            return Ok(0);
        };
        let shape = Shape {
            pages,
            slots_per_batch,
            arena_bytes,
            version: header[H_VERSION].load(Ordering::Acquire),
        };
        let used = shape
            .offsets()
            .arena
            .saturating_add(page_round(carved))
            .min(self.segment.len());
        self.segment
            .make_page_tables(0, used, &mut self.page_tables)
            .map_err(memory_error("making the page tables of the store's memory"))?;
        Ok(used)
    }
}

/// The sizes a store's memory is made from.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub(super) pages: usize,
    pub(super) slots_per_batch: usize,
    pub(super) arena_bytes: usize,
    /// The layout version: a resumed store's own; a new store's is chosen when it is made
    /// (`of_new_store`).
    pub(super) version: u64,
}

impl Shape {
    /// This shape for a store about to be made, with the layout version it gets here (see
    /// `new_store_version`). Only then: the choice times the checksums, which a resume (a
    /// takeover, with the device waiting) must not spend time and code pages on.
    fn of_new_store(self) -> Self {
        Self {
            version: new_store_version(),
            ..self
        }
    }
}

/// Byte offsets of the regions.
struct Offsets {
    table: usize,
    /// Entries in the table, hints and checksums: whole groups with a group map.
    table_len: usize,
    hints: usize,
    checksums: usize,
    group_map: usize,
    indexes: usize,
    slots: usize,
    tags: usize,
    arena: usize,
    total: usize,
}

fn page_round(bytes: usize) -> usize {
    bytes.div_ceil(PAGE_SIZE) * PAGE_SIZE
}

impl Shape {
    fn offsets(&self) -> Offsets {
        let groups = TableMemory::groups_of(self.pages);
        let (table_len, map_len) = if maps_groups(self.version) {
            (groups * GROUP_PAGES, groups * 4)
        } else {
            (self.pages, 0)
        };
        let table = PAGE_SIZE;
        let hints = table + page_round(table_len * 8);
        let checksums = hints + page_round(table_len * 2);
        let group_map = checksums + page_round(table_len * 4);
        let indexes = group_map + page_round(map_len);
        let slots_total = PENDING_BATCHES * self.slots_per_batch;
        let slots = indexes + page_round(slots_total * 8);
        let tags = slots + slots_total * PAGE_SIZE;
        let arena = tags + page_round(self.arena_bytes / PAGE_SIZE * 4);
        Offsets {
            table,
            table_len,
            hints,
            checksums,
            group_map,
            indexes,
            slots,
            tags,
            arena,
            total: arena + self.arena_bytes,
        }
    }
}

/// This process's claim on a store's memory (the header's owner word), given up when the
/// store is dropped; a process that dies leaves its pid, which no live process has.
pub(super) struct Ownership {
    header: Words<AtomicU64>,
    /// The memory claimed, for `free_shared`.
    segment: Arc<Segment>,
}

impl Ownership {
    /// Free the store's shared memory as its device is deleted: the segment this process
    /// maps, by its id (freed once no process maps it). Never by its key: once the device is
    /// deleted, a `create` of the same id makes its store under that key, and freeing that
    /// one would leave the new device's pages unreachable for its next daemon. (A key record,
    /// where another user holds the device's own key, is cleared by the next create of the
    /// id, as is any segment left under the key.) False for private memory.
    pub(super) fn free_shared(&self) -> Result<bool, StoreError> {
        self.segment
            .remove_attached()
            .map_err(memory_error("removing the store's shared memory"))
    }
}

impl Drop for Ownership {
    fn drop(&mut self) {
        let me = u64::from(std::process::id());
        let _ = self.header[H_OWNER].compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// A store's memory, mapped, with views of its regions.
pub(super) struct Regions {
    pub(super) shape: Shape,
    pub(super) owner: Ownership,
    pub(super) table: Words<AtomicU64>,
    pub(super) hints: Words<AtomicU16>,
    pub(super) checksums: Words<AtomicU32>,
    pub(super) table_memory: TableMemory,
    pub(super) batches: Vec<(PageSlots, Words<AtomicU64>)>,
    pub(super) arena: Arc<Arena>,
    /// The header's words from `H_CLASS_CHUNKS` on.
    pub(super) class_chunks: Words<AtomicU64>,
    pub(super) resumed: bool,
}

impl Regions {
    /// Open the memory of `backing` for a store of `shape`: a fresh one, or the one a previous
    /// process left (whose own slots-per-batch and arena size then apply).
    /// Resume the store `attached` (see `AttachedStore`) for `shape`; a store replaced since
    /// it was attached is opened anew (as `Backing::Shared`).
    pub(super) fn open_attached(
        attached: AttachedStore,
        device_id: u32,
        shape: Shape,
    ) -> Result<Self, StoreError> {
        if attached.is_current() {
            return Self::resume(&attached.segment, shape, attached.key);
        }
        Self::open(Backing::Shared { device_id }, shape)
    }

    pub(super) fn open(backing: Backing, shape: Shape) -> Result<Self, StoreError> {
        let (key, lock) = match backing {
            Backing::Private => {
                let shape = shape.of_new_store();
                let segment = Segment::private(shape.offsets().total)
                    .map_err(memory_error("reserving the store's memory"))?;
                return Self::fresh(&segment, shape);
            }
            Backing::Shared { device_id } => (device_key(device_id)?, true),
            Backing::SharedUnlocked { key } => (key, false),
        };
        Self::open_shared(key, lock, shape)
    }

    /// Resume the shared store whose own key is `own_key`, or make it. SysV keys are one
    /// namespace for every user, and a device's own key is known to all: a local user who
    /// makes a segment under it first (in the moment between a daemon freeing a deleted
    /// device's memory and making the new one's) would keep every new device from starting.
    /// So where its own key is another's, the store is made under a random key instead,
    /// recorded in a file only root can write (`key_record`), which every later look for
    /// the store reads first.
    fn open_shared(own_key: i32, lock: bool, shape: Shape) -> Result<Self, StoreError> {
        let key = current_key(own_key);
        let taken = match Segment::attach_shared(key) {
            Ok(Some(segment)) => return Self::resume(&segment, shape, key),
            Ok(None) => false,
            // Another user's (`attach_shared` refuses it): not one to resume, nor to use.
            Err(error) if error.kind() == std::io::ErrorKind::PermissionDenied => true,
            Err(error) => return Err(memory_error("attaching the store's shared memory")(error)),
        };
        let shape = shape.of_new_store();
        let len = shape.offsets().total;
        let creating = || {
            memory_error("creating the store's shared memory (a SysV segment, locked in memory)")
        };
        let mut created = if taken {
            Err(std::io::ErrorKind::AlreadyExists.into())
        } else {
            match Segment::create_shared(key, len, lock) {
                // Only another user's segment sends the store elsewhere. One of ours made
                // under the key since the look above (two processes opening the store at
                // once) fails this open, as it always did: a second store, and a record
                // pointing away from the first, would leave one of them unreachable.
                Err(error)
                    if error.kind() == std::io::ErrorKind::AlreadyExists && !foreign(key) =>
                {
                    return Err(creating()(error));
                }
                created => created,
            }
        };
        let mut attempt = 0;
        while matches!(&created, Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists)
            && attempt < 8
        {
            attempt += 1;
            let new_key = record_new_key(own_key, attempt).map_err(memory_error(
                "recording the key of the store's shared memory",
            ))?;
            tracing::warn!(
                own_key = format_args!("{own_key:#x}"),
                key = format_args!("{new_key:#x}"),
                "another user's shared memory has the key of this device's store: the store is made under another key"
            );
            created = Segment::create_shared(new_key, len, lock);
        }
        let segment = created.map_err(creating())?;
        Self::fresh(&segment, shape).inspect_err(|_| {
            // Never finished (no magic): no store to resume, only locked memory until the
            // device's next fresh start frees it.
            if let Err(error) = segment.remove_attached() {
                tracing::warn!(%error, "removing the shared memory of a store never made");
            }
        })
    }

    fn fresh(segment: &Arc<Segment>, shape: Shape) -> Result<Self, StoreError> {
        let regions = Self::map(segment, shape, false)?;
        let header = &regions.owner.header;
        for (word, value) in [
            (H_VERSION, shape.version),
            (H_PAGES, shape.pages as u64),
            (H_SLOTS, shape.slots_per_batch as u64),
            (H_ARENA, shape.arena_bytes as u64),
            (H_CLASSES, alloc::class_fingerprint()),
            (H_CARVED, 0),
            (H_OWNER, u64::from(std::process::id())),
        ] {
            header[word].store(value, Ordering::Relaxed);
        }
        // Last: a segment whose creator died before this is not taken for a store.
        header[H_MAGIC].store(MAGIC, Ordering::Release);
        Ok(regions)
    }

    fn resume(segment: &Arc<Segment>, wanted: Shape, key: i32) -> Result<Self, StoreError> {
        segment
            .commit(0, PAGE_SIZE)
            .map_err(memory_error("mapping the store's header"))?;
        let header = segment
            .words(0, HEADER_WORDS)
            .map_err(memory_error("mapping the store's header"))?;
        let word = |i: usize| header[i].load(Ordering::Acquire);
        match word(H_MAGIC) {
            MAGIC => {}
            // Written last by `fresh`: its maker died before it served a page.
            0 => {
                return Err(StoreError::Layout(format!(
                    "the shared memory of this device (SysV key {key:#x}) was never finished: \
                     the process making it died first, so it holds no page; `trueno-ublk \
                     delete` the device (nothing is lost) and create it again"
                )))
            }
            _ => return Err(layout_error(key, "is not a trueno-ublk store")),
        }
        let version = word(H_VERSION);
        check_this_binary_reads(key, version, word(H_CLASSES))?;
        if word(H_PAGES) != wanted.pages as u64 {
            return Err(layout_error(
                key,
                &format!(
                    "holds {} pages, not the {} of the size asked for",
                    word(H_PAGES),
                    wanted.pages
                ),
            ));
        }
        // Checked before the owner word is taken: a refused store keeps its owner.
        let shape = Shape {
            pages: wanted.pages,
            slots_per_batch: usize::try_from(word(H_SLOTS)).unwrap_or(usize::MAX),
            arena_bytes: usize::try_from(word(H_ARENA)).unwrap_or(usize::MAX),
            version,
        };
        // A carve cursor past the arena or off a page would fail every carve from here on.
        let carved = word(H_CARVED);
        // Each bound before `offsets`, whose sums it keeps from overflowing.
        if shape.slots_per_batch > 1 << 20
            || !shape.arena_bytes.is_multiple_of(PAGE_SIZE)
            || shape.arena_bytes > segment.len()
            || shape.offsets().total > segment.len()
            || carved > shape.arena_bytes as u64
            || !carved.is_multiple_of(PAGE_SIZE as u64)
        {
            return Err(layout_error(
                key,
                "has a header that does not fit the segment",
            ));
        }
        let owner = word(H_OWNER);
        if let Some(pid) = i32::try_from(owner).ok().filter(|&p| p > 0) {
            if pid != i32::try_from(std::process::id()).unwrap_or(0)
                && crate::os::same_program_alive(pid)
            {
                return Err(StoreError::Config(format!(
                    "the shared memory of this device is in use by process {pid}"
                )));
            }
        }
        // Taken in one step with the look above: two processes resuming at once (a `create
        // --id N` by hand racing the unit's restart) both found the owner gone, and both then
        // rebuilt the allocator over the same memory.
        let me = u64::from(std::process::id());
        if header[H_OWNER]
            .compare_exchange(owner, me, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(StoreError::Config(format!(
                "the shared memory of this device was taken by process {} just now",
                word(H_OWNER)
            )));
        }
        let regions = Self::map(segment, shape, true).inspect_err(|_| {
            // Not ours after all: the next process must not find it held by this one.
            header[H_OWNER].store(owner, Ordering::Release);
        })?;
        drop(header);
        regions.owner.header[H_OWNER].store(u64::from(std::process::id()), Ordering::Release);
        Ok(regions)
    }

    /// Views of every region, the fixed ones committed; `resumed`: whether the store was
    /// found (else it is fresh).
    fn map(segment: &Arc<Segment>, shape: Shape, resumed: bool) -> Result<Self, StoreError> {
        let o = shape.offsets();
        let mapping = || memory_error("mapping the store's memory");
        // The header, group map and slot indexes; the slot pages as batches open (see
        // `BatchSpan`), the table, hints and checksums a group at a time as the device is
        // written (`TableMemory`), the tags and the arena as chunks are carved.
        segment.commit(0, PAGE_SIZE).map_err(mapping())?;
        if o.slots > o.group_map {
            segment
                .commit(o.group_map, o.slots - o.group_map)
                .map_err(mapping())?;
        }
        fn view<T>(r: std::io::Result<T>) -> Result<T, StoreError> {
            r.map_err(memory_error("mapping the store's memory"))
        }
        let batches = (0..PENDING_BATCHES)
            .map(|b| {
                let first = b * shape.slots_per_batch;
                Ok((
                    view(segment.page_slots(o.slots + first * PAGE_SIZE, shape.slots_per_batch))?,
                    view(segment.words(o.indexes + first * 8, shape.slots_per_batch))?,
                ))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(Self {
            shape,
            owner: Ownership {
                header: view(segment.words(0, HEADER_WORDS))?,
                segment: Arc::clone(segment),
            },
            table: view(segment.words(o.table, o.table_len))?,
            hints: view(segment.words_of::<AtomicU16>(o.hints, o.table_len))?,
            checksums: view(segment.words_of::<AtomicU32>(o.checksums, o.table_len))?,
            table_memory: TableMemory::new(
                Arc::clone(segment),
                Region {
                    offset: o.table,
                    width: 8,
                },
                [
                    Region {
                        offset: o.hints,
                        width: 2,
                    },
                    Region {
                        offset: o.checksums,
                        width: 4,
                    },
                ],
                shape.pages,
                if maps_groups(shape.version) {
                    let groups = TableMemory::groups_of(shape.pages);
                    Some(Slots::new(
                        view(segment.words_of::<AtomicU32>(o.group_map, groups))?,
                        groups,
                    ))
                } else {
                    None
                },
            ),
            batches,
            arena: view(Arena::new(
                segment,
                o.arena,
                shape.arena_bytes,
                H_CARVED * 8,
                o.tags,
            ))?,
            class_chunks: view(segment.words(H_CLASS_CHUNKS * 8, alloc::MAX_CLASSES))?,
            resumed,
        })
    }
}

/// The error of a store in shared memory under `key` that this process does not resume
/// because it `what`, and what the user can do.
fn layout_error(key: i32, what: &str) -> StoreError {
    StoreError::Layout(format!(
        "the shared memory of this device (SysV key {key:#x}) {what}; it was left untouched: \
         start the trueno-ublk that made it, or `trueno-ublk delete` the device (its pages are \
         lost then)"
    ))
}

/// Whether this binary reads a store of layout `version` whose size classes have fingerprint
/// `classes`: what a store made by another build may differ in.
fn check_this_binary_reads(key: i32, version: u64, classes: u64) -> Result<(), StoreError> {
    if !READ_VERSIONS.contains(&version) {
        return Err(layout_error(
            key,
            &format!(
                "has layout version {version}, and this binary reads versions {READ_VERSIONS:?}"
            ),
        ));
    }
    if classes != alloc::class_fingerprint() {
        return Err(layout_error(
            key,
            "packs compressed pages in other size classes than this binary",
        ));
    }
    Ok(())
}
