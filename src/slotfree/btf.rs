//! What the probe needs to know of the running kernel, read from its BTF
//! (`/sys/kernel/btf/vmlinux`): which function frees swap slots (`FREE_FUNCTIONS`), which of
//! its arguments is which, where `swap_info_struct` keeps its block device, flags and
//! clusters, where `block_device` keeps its number, and the value of `SWP_BLKDEV`.
//!
//! Read as a stream, a few passes over the file with one small buffer, never the whole of it:
//! the file is several MiB and the daemon's memory is locked (a BTF library that parses every
//! type into the heap would lock tens of MiB for four numbers).

#![forbid(unsafe_code)]

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use super::SlotFreeError;

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_ENUM64: u32 = 19;
const KIND_FUNC: u32 = 12;
const KIND_FUNC_PROTO: u32 = 13;
/// Kinds that only name another type: TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG.
const ALIAS_KINDS: [u32; 5] = [8, 9, 10, 11, 18];
/// Aliases followed at most from a type to what it names (`dev_t` is four deep).
const MAX_ALIAS_CHAIN: usize = 16;

/// The function every freed swap slot passes through (`mm/swapfile.c`; each calls what tells
/// zram of the slot, `swap_range_free`, which the compiler inlines), newest kernels first: the
/// probe goes on the first one this kernel's BTF has. Seen in Debian's kernels (the VM test
/// on each): `__swap_cluster_free_entries(si, ci, ci_start, nr_pages)` in 7.3 (the swap
/// table's: a slot by its place in its cluster), `swap_entries_free(si, ci, entry, nr_pages)`
/// in 6.18, `swap_entry_range_free(si, entry, nr_pages)` in 6.12. Between 6.18 and 7.3 the
/// kernel had a `swap_entries_free` with the slot's offset in place of the entry, whose layout
/// is handled too but was never tried: a parameter of another name there leaves the probe
/// off (discards then free the memory), never a wrong slot freed.
pub const FREE_FUNCTIONS: [&str; 3] = [
    "__swap_cluster_free_entries",
    "swap_entries_free",
    "swap_entry_range_free",
];

/// How the free function's arguments give the first freed slot (its offset in the swap area).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstSlot {
    /// Argument `entry`, a `swp_entry_t` (one word): the slot is its offset bits, and its
    /// type bits are the swap area's `type`.
    Entry {
        arg: usize,
        /// Byte offset of `type` (a `signed char`) in `struct swap_info_struct`.
        si_type: u32,
    },
    /// Argument `offset`: the slot.
    Offset { arg: usize },
    /// Argument `ci_start`, the slot's place in the cluster argument `ci` points to (an element
    /// of the swap area's array `cluster_info`): the slot is `(ci - si->cluster_info) /
    /// cluster_info_bytes * cluster_slots + ci_start`.
    InCluster {
        arg_ci: usize,
        arg_start: usize,
        /// Byte offset of `cluster_info` in `struct swap_info_struct`.
        si_cluster_info: u32,
        /// `sizeof(struct swap_cluster_info)`.
        cluster_info_bytes: u32,
        /// Slots a cluster holds (`SWAPFILE_CLUSTER`: the length of `struct swap_table`'s
        /// `entries`, one per slot).
        cluster_slots: u32,
    },
}

/// Where the probe finds what it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLayout {
    /// The function probed, one of `FREE_FUNCTIONS`.
    pub function: &'static str,
    /// Byte offsets in `struct swap_info_struct` of `bdev`, `flags` and `max` (the slots the
    /// swap area has, an `unsigned int`).
    pub si_bdev: u32,
    pub si_flags: u32,
    pub si_max: u32,
    /// Byte offset of `bd_dev` (the kernel's `dev_t`) in `struct block_device`.
    pub bd_dev: u32,
    /// `SWP_BLKDEV`: set in `flags` when the swap area is a whole block device, so that slot
    /// offsets are device pages (a swap file's offsets go through its extents).
    pub swp_blkdev: u64,
    /// Argument positions of `function`: the `swap_info_struct *` and the count of slots;
    /// and how its arguments give the first slot.
    pub arg_si: usize,
    pub arg_nr_pages: usize,
    pub first_slot: FirstSlot,
}

#[cfg(test)]
impl KernelLayout {
    /// A layout of the shape x86-64 Linux 6.12 has, for tests of the program.
    pub(crate) fn sample() -> Self {
        Self {
            function: "swap_entry_range_free",
            si_bdev: 216,
            si_flags: 0,
            si_max: 36,
            bd_dev: 144,
            swp_blkdev: 64,
            arg_si: 0,
            arg_nr_pages: 2,
            first_slot: FirstSlot::Entry {
                arg: 1,
                si_type: 34,
            },
        }
    }

    /// The same with 7.3's shape: `__swap_cluster_free_entries(si, ci, ci_start, nr_pages)`.
    pub(crate) fn sample_in_cluster() -> Self {
        Self {
            function: "__swap_cluster_free_entries",
            arg_nr_pages: 3,
            first_slot: FirstSlot::InCluster {
                arg_ci: 1,
                arg_start: 2,
                si_cluster_info: 80,
                cluster_info_bytes: 48,
                cluster_slots: 512,
            },
            ..Self::sample()
        }
    }
}

/// One type's fixed part: `struct btf_type`.
#[derive(Clone, Copy, Debug)]
struct TypeHead {
    name_off: u32,
    info: u32,
    size_or_type: u32,
}

impl TypeHead {
    fn kind(self) -> u32 {
        (self.info >> 24) & 0x1f
    }
    fn vlen(self) -> usize {
        (self.info & 0xffff) as usize
    }
    fn kind_flag(self) -> bool {
        self.info >> 31 != 0
    }
    /// Bytes that follow the fixed part, by kind (the kernel's `btf_type_size`).
    fn extra_bytes(self) -> Result<usize, SlotFreeError> {
        Ok(match self.kind() {
            // INT, VAR, DECL_TAG: one word.
            1 | 14 | 17 => 4,
            // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG: nothing.
            2 | 7..=12 | 16 | 18 => 0,
            // ARRAY
            3 => 12,
            // STRUCT, UNION, DATASEC, ENUM64: 12 bytes an item.
            4 | 5 | 15 | 19 => 12 * self.vlen(),
            // ENUM, FUNC_PROTO: 8 bytes an item.
            6 | 13 => 8 * self.vlen(),
            kind => return Err(btf_error(format!("unknown BTF kind {kind}"))),
        })
    }
}

fn btf_error(what: impl Into<String>) -> SlotFreeError {
    SlotFreeError::Btf(what.into())
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

/// A BTF file opened for streaming passes.
struct BtfFile<R> {
    reader: BufReader<R>,
    types_at: u64,
    types_len: u64,
    strings_at: u64,
    strings_len: u64,
}

impl<R: Read + Seek> BtfFile<R> {
    fn open(source: R) -> Result<Self, SlotFreeError> {
        let mut reader = BufReader::with_capacity(64 << 10, source);
        let mut head = [0u8; 24];
        reader
            .read_exact(&mut head)
            .map_err(|error| btf_error(format!("reading the header: {error}")))?;
        if u16::from_le_bytes([head[0], head[1]]) != BTF_MAGIC {
            return Err(btf_error("not little-endian BTF (bad magic)"));
        }
        let hdr_len = u64::from(u32_at(&head, 4));
        Ok(Self {
            reader,
            types_at: hdr_len + u64::from(u32_at(&head, 8)),
            types_len: u64::from(u32_at(&head, 12)),
            strings_at: hdr_len + u64::from(u32_at(&head, 16)),
            strings_len: u64::from(u32_at(&head, 20)),
        })
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<(), SlotFreeError> {
        self.reader
            .read_exact(buf)
            .map_err(|error| btf_error(format!("reading: {error}")))
    }

    fn seek(&mut self, to: u64) -> Result<(), SlotFreeError> {
        self.reader
            .seek(SeekFrom::Start(to))
            .map(drop)
            .map_err(|error| btf_error(format!("seeking: {error}")))
    }

    /// The offsets in the string section of each of `wanted` (every occurrence).
    fn find_strings<const N: usize>(
        &mut self,
        wanted: [&str; N],
    ) -> Result<[Vec<u32>; N], SlotFreeError> {
        self.seek(self.strings_at)?;
        let mut found: [Vec<u32>; N] = std::array::from_fn(|_| Vec::new());
        let mut current = Vec::with_capacity(256);
        let mut start = 0u32;
        let mut at = 0u32;
        let mut chunk = [0u8; 4096];
        let mut left = self.strings_len;
        while left > 0 {
            let n = usize::try_from(left.min(chunk.len() as u64)).unwrap_or(chunk.len());
            self.read(&mut chunk[..n])?;
            left -= n as u64;
            for &byte in &chunk[..n] {
                if byte == 0 {
                    for (i, name) in wanted.iter().enumerate() {
                        if current == name.as_bytes() {
                            found[i].push(start);
                        }
                    }
                    current.clear();
                    start = at + 1;
                } else if current.len() < 256 {
                    current.push(byte);
                }
                at += 1;
            }
        }
        Ok(found)
    }

    /// What each of `ids` is, followed through aliases: a pass over the types per step of the
    /// longest chain. An id the file does not have (or `void`) is an error.
    fn resolve(&mut self, ids: &[u32]) -> Result<Vec<Resolved>, SlotFreeError> {
        let mut at = ids.to_vec();
        let mut resolved: Vec<Option<Resolved>> = vec![None; ids.len()];
        for _ in 0..MAX_ALIAS_CHAIN {
            let Some(last) = at
                .iter()
                .zip(&resolved)
                .filter(|(_, done)| done.is_none())
                .map(|(&id, _)| id)
                .max()
            else {
                break;
            };
            let mut next = at.clone();
            self.for_each_type(|id, head, _| {
                for (i, &want) in at.iter().enumerate() {
                    if want != id || resolved[i].is_some() {
                        continue;
                    }
                    if ALIAS_KINDS.contains(&head.kind()) {
                        next[i] = head.size_or_type;
                    } else {
                        resolved[i] = Some(Resolved {
                            id,
                            kind: head.kind(),
                            size_or_type: head.size_or_type,
                        });
                    }
                }
                id < last
            })?;
            if let Some(i) = (0..at.len()).find(|&i| resolved[i].is_none() && next[i] == at[i]) {
                return Err(btf_error(format!("no type {} in the file", at[i])));
            }
            at = next;
        }
        resolved
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                btf_error(format!(
                    "a type named through more than {MAX_ALIAS_CHAIN} aliases"
                ))
            })
    }

    /// Refuse a layout whose values the kernel types otherwise than the probe reads them:
    /// each check is what, the type id, and what it must be.
    fn check_types(&mut self, checks: &[(String, u32, Expect)]) -> Result<(), SlotFreeError> {
        let ids: Vec<u32> = checks.iter().map(|&(_, id, _)| id).collect();
        let resolved = self.resolve(&ids)?;
        let pointees: Vec<u32> = resolved
            .iter()
            .filter(|r| r.kind == KIND_PTR)
            .map(|r| r.size_or_type)
            .collect();
        let pointees = self.resolve(&pointees)?;
        let mut pointees = pointees.into_iter();
        for ((what, _, expect), resolved) in checks.iter().zip(resolved) {
            let pointee = (resolved.kind == KIND_PTR)
                .then(|| pointees.next())
                .flatten();
            if !expect.holds(resolved, pointee) {
                return Err(btf_error(format!(
                    "{what} is not what the probe reads ({expect:?}; the kernel has a type of \
                     kind {} and size or target {}): no probe, freed slots come back through \
                     discards",
                    resolved.kind, resolved.size_or_type
                )));
            }
        }
        Ok(())
    }

    /// Call `visit` with every type's id, fixed part and extra bytes, in order, until it
    /// returns `false`.
    fn for_each_type(
        &mut self,
        mut visit: impl FnMut(u32, TypeHead, &[u8]) -> bool,
    ) -> Result<(), SlotFreeError> {
        self.seek(self.types_at)?;
        let mut read_bytes = 0u64;
        let mut extra = Vec::new();
        let mut id = 1u32;
        while read_bytes < self.types_len {
            let mut head = [0u8; 12];
            self.read(&mut head)?;
            let head = TypeHead {
                name_off: u32_at(&head, 0),
                info: u32_at(&head, 4),
                size_or_type: u32_at(&head, 8),
            };
            let n = head.extra_bytes()?;
            extra.resize(n, 0);
            self.read(&mut extra)?;
            read_bytes += 12 + n as u64;
            if !visit(id, head, &extra) {
                return Ok(());
            }
            id += 1;
        }
        Ok(())
    }
}

/// The byte offset and type id of the member named by one of `names` in a struct's members.
fn member_of(head: TypeHead, members: &[u8], names: &[u32]) -> Option<Member> {
    members.chunks_exact(12).find_map(|member| {
        if !names.contains(&u32_at(member, 0)) {
            return None;
        }
        let offset = u32_at(member, 8);
        // With kind_flag, the top byte is a bitfield size; a plain member has 0 there.
        let bits = if head.kind_flag() {
            offset & 0x00ff_ffff
        } else {
            offset
        };
        (bits % 8 == 0).then_some(Member {
            offset: bits / 8,
            ty: u32_at(member, 4),
        })
    })
}

/// A struct member the probe reads.
#[derive(Clone, Copy)]
struct Member {
    offset: u32,
    ty: u32,
}

/// A type id followed through aliases to what it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Resolved {
    id: u32,
    kind: u32,
    /// The size (INT, ENUM, STRUCT) or, for a PTR, the type pointed at.
    size_or_type: u32,
}

/// What the probe reads a value as: the type the kernel gives it must be so, or the probe
/// would read the wrong bytes (and could mark slots still in use as freed).
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// An integer (or enum) of one of these sizes.
    Integer(&'static [u32]),
    /// A pointer to the struct with this id.
    PointerTo(u32),
    /// One 8-byte word: an integer, or a struct of that size (`swp_entry_t`).
    Word,
    /// Anything passed in one general-purpose register: an integer, an enum or a pointer, or
    /// a struct or union of at most 8 bytes. A larger one by value takes two registers or the
    /// stack, a float a vector register, and the arguments after it are not where their
    /// positions say.
    OneRegister,
}

impl Expect {
    fn holds(self, resolved: Resolved, pointee: Option<Resolved>) -> bool {
        match self {
            Expect::Integer(sizes) => {
                matches!(resolved.kind, KIND_INT | KIND_ENUM)
                    && sizes.contains(&resolved.size_or_type)
            }
            Expect::PointerTo(id) => {
                resolved.kind == KIND_PTR && pointee.is_some_and(|pointee| pointee.id == id)
            }
            Expect::Word => {
                matches!(resolved.kind, KIND_INT | KIND_STRUCT) && resolved.size_or_type == 8
            }
            Expect::OneRegister => match resolved.kind {
                KIND_PTR => true,
                KIND_INT | KIND_ENUM | KIND_ENUM64 | KIND_STRUCT | KIND_UNION => {
                    (1..=8).contains(&resolved.size_or_type)
                }
                _ => false,
            },
        }
    }
}

/// Read the layout the probe needs from the BTF file at `path`.
pub fn kernel_layout(path: &Path) -> Result<KernelLayout, SlotFreeError> {
    let file =
        File::open(path).map_err(|error| btf_error(format!("{}: {error}", path.display())))?;
    layout_of(file)
}

/// The names `layout_of` looks for: `Name::X as usize` is X's place, and the free functions
/// come last, from `Name::FreeFunctions` on.
const NAMES: [&str; 20] = [
    "swap_info_struct",
    "bdev",
    "flags",
    "max",
    "type",
    "cluster_info",
    "block_device",
    "bd_dev",
    "SWP_BLKDEV",
    "swap_cluster_info",
    "swap_table",
    "entries",
    "entry",
    "offset",
    "ci",
    "ci_start",
    "nr_pages",
    FREE_FUNCTIONS[0],
    FREE_FUNCTIONS[1],
    FREE_FUNCTIONS[2],
];

#[derive(Clone, Copy)]
enum Name {
    SwapInfo,
    Bdev,
    Flags,
    Max,
    Type,
    ClusterInfo,
    BlockDevice,
    BdDev,
    SwpBlkdev,
    SwapClusterInfo,
    SwapTable,
    Entries,
    Entry,
    Offset,
    Ci,
    CiStart,
    NrPages,
    FreeFunctions,
}
const _: () = assert!(Name::FreeFunctions as usize + FREE_FUNCTIONS.len() == NAMES.len());

/// Read the layout the probe needs from BTF read from `source` (`kernel_layout`'s file, or a
/// test's or a fuzzer's bytes): an error for anything that is not BTF holding it, never a
/// panic.
pub fn layout_of(source: impl Read + Seek) -> Result<KernelLayout, SlotFreeError> {
    let mut btf = BtfFile::open(source)?;
    let names = btf.find_strings(NAMES)?;
    let name = |n: Name| names[n as usize].as_slice();
    let missing = |what: &str| btf_error(format!("this kernel's BTF has no {what}"));

    // Pass 1: the structs, the enumerator and the free functions.
    let (mut si_struct, mut si_bdev, mut si_flags, mut si_cluster_info) = (None, None, None, None);
    let (mut si_max, mut si_type) = (None, None);
    let (mut bd_struct, mut bd_dev, mut swp_blkdev) = (None, None, None);
    let (mut ci_struct, mut cluster_info_bytes, mut table_entries) = (None, None, None);
    let mut protos: [Option<u32>; FREE_FUNCTIONS.len()] = [None; FREE_FUNCTIONS.len()];
    btf.for_each_type(|id, head, extra| {
        let is = |n: Name| name(n).contains(&head.name_off);
        match head.kind() {
            KIND_STRUCT if is(Name::SwapInfo) => {
                si_struct = Some(id);
                si_bdev = member_of(head, extra, name(Name::Bdev));
                si_flags = member_of(head, extra, name(Name::Flags));
                si_max = member_of(head, extra, name(Name::Max));
                si_type = member_of(head, extra, name(Name::Type));
                si_cluster_info = member_of(head, extra, name(Name::ClusterInfo));
            }
            KIND_STRUCT if is(Name::BlockDevice) => {
                bd_struct = Some(id);
                bd_dev = member_of(head, extra, name(Name::BdDev));
            }
            KIND_STRUCT if is(Name::SwapClusterInfo) => {
                ci_struct = Some(id);
                cluster_info_bytes = Some(head.size_or_type);
            }
            KIND_STRUCT if is(Name::SwapTable) => {
                table_entries = extra
                    .chunks_exact(12)
                    .find(|member| name(Name::Entries).contains(&u32_at(member, 0)))
                    .map(|member| u32_at(member, 4));
            }
            KIND_ENUM => {
                if let Some(item) = extra
                    .chunks_exact(8)
                    .find(|item| name(Name::SwpBlkdev).contains(&u32_at(item, 0)))
                {
                    swp_blkdev = Some(u64::from(u32_at(item, 4)));
                }
            }
            KIND_FUNC => {
                for (i, proto) in protos.iter_mut().enumerate() {
                    if names[Name::FreeFunctions as usize + i].contains(&head.name_off) {
                        *proto = Some(head.size_or_type);
                    }
                }
            }
            _ => {}
        }
        true
    })?;
    let si_struct = si_struct.ok_or_else(|| missing("struct swap_info_struct"))?;
    let (function, proto) = FREE_FUNCTIONS
        .iter()
        .zip(protos)
        .find_map(|(&function, proto)| Some((function, proto?)))
        .ok_or_else(|| missing(&format!("function {}", FREE_FUNCTIONS.join(", "))))?;

    // Pass 2: the function's parameters, and how many slots a cluster's table holds.
    let mut params: Option<Vec<(u32, u32)>> = None;
    let mut cluster_slots = None;
    let last = proto.max(table_entries.unwrap_or(0));
    btf.for_each_type(|id, head, extra| {
        if id == proto && head.kind() == KIND_FUNC_PROTO {
            params = Some(
                extra
                    .chunks_exact(8)
                    .map(|param| (u32_at(param, 0), u32_at(param, 4)))
                    .collect(),
            );
        }
        if Some(id) == table_entries && head.kind() == KIND_ARRAY {
            cluster_slots = Some(u32_at(extra, 8));
        }
        id < last
    })?;
    let params = params.ok_or_else(|| missing(&format!("prototype of {function}")))?;
    let position = |n: Name| params.iter().position(|(p, _)| name(n).contains(p));
    let argument = |n: Name| {
        position(n)
            .ok_or_else(|| missing(&format!("`{}` argument of {function}", NAMES[n as usize])))
    };
    let arg_nr_pages = argument(Name::NrPages)?;
    let arg_type = |arg: usize| params[arg].1;
    let bd_struct = bd_struct.ok_or_else(|| missing("struct block_device"))?;
    let si_bdev = si_bdev.ok_or_else(|| missing("swap_info_struct.bdev"))?;
    let si_flags = si_flags.ok_or_else(|| missing("swap_info_struct.flags"))?;
    let si_max = si_max.ok_or_else(|| missing("swap_info_struct.max"))?;
    let bd_dev = bd_dev.ok_or_else(|| missing("block_device.bd_dev"))?;
    // The probe reads the flags and the pointer as 8 bytes, the device number and the swap
    // area's size as 4, the swap type as 1, and the low 32 bits of the count and of a slot's
    // place in its cluster.
    let mut checks = vec![
        (
            "swap_info_struct.flags".to_string(),
            si_flags.ty,
            Expect::Integer(&[8]),
        ),
        (
            "swap_info_struct.max".to_string(),
            si_max.ty,
            Expect::Integer(&[4]),
        ),
        (
            "swap_info_struct.bdev".to_string(),
            si_bdev.ty,
            Expect::PointerTo(bd_struct),
        ),
        (
            "block_device.bd_dev".to_string(),
            bd_dev.ty,
            Expect::Integer(&[4]),
        ),
        (
            format!("the `nr_pages` argument of {function}"),
            arg_type(arg_nr_pages),
            Expect::Integer(&[4, 8]),
        ),
    ];
    let first_slot = if position(Name::CiStart).is_some() {
        let ci_struct = ci_struct.ok_or_else(|| missing("struct swap_cluster_info"))?;
        let si_cluster_info =
            si_cluster_info.ok_or_else(|| missing("swap_info_struct.cluster_info"))?;
        let (arg_ci, arg_start) = (argument(Name::Ci)?, argument(Name::CiStart)?);
        checks.extend([
            (
                "swap_info_struct.cluster_info".to_string(),
                si_cluster_info.ty,
                Expect::PointerTo(ci_struct),
            ),
            (
                format!("the `ci` argument of {function}"),
                arg_type(arg_ci),
                Expect::PointerTo(ci_struct),
            ),
            (
                format!("the `ci_start` argument of {function}"),
                arg_type(arg_start),
                Expect::Integer(&[4, 8]),
            ),
        ]);
        FirstSlot::InCluster {
            arg_ci,
            arg_start,
            si_cluster_info: si_cluster_info.offset,
            cluster_info_bytes: cluster_info_bytes
                .filter(|&bytes| bytes > 0)
                .ok_or_else(|| missing("struct swap_cluster_info"))?,
            cluster_slots: cluster_slots
                .filter(|&slots| slots > 0)
                .ok_or_else(|| missing("swap_table.entries"))?,
        }
    } else if let Some(arg) = position(Name::Offset) {
        checks.push((
            format!("the `offset` argument of {function}"),
            arg_type(arg),
            Expect::Integer(&[8]),
        ));
        FirstSlot::Offset { arg }
    } else {
        let arg = argument(Name::Entry)?;
        let si_type = si_type.ok_or_else(|| missing("swap_info_struct.type"))?;
        checks.extend([
            (
                format!("the `entry` argument of {function}"),
                arg_type(arg),
                Expect::Word,
            ),
            (
                "swap_info_struct.type".to_string(),
                si_type.ty,
                Expect::Integer(&[1]),
            ),
        ]);
        FirstSlot::Entry {
            arg,
            si_type: si_type.offset,
        }
    };

    // Pass 3: which argument is the `struct swap_info_struct *`.
    let mut pointers_to_si = Vec::new();
    btf.for_each_type(|id, head, _| {
        if head.kind() == KIND_PTR && head.size_or_type == si_struct {
            pointers_to_si.push(id);
        }
        true
    })?;
    let arg_si = params
        .iter()
        .position(|(_, ty)| pointers_to_si.contains(ty))
        .ok_or_else(|| missing(&format!("swap_info_struct argument of {function}")))?;
    // The probe reads argument N from the Nth argument register: every parameter up to the
    // last it reads must take exactly one.
    let last_read = match first_slot {
        FirstSlot::Entry { arg, .. } | FirstSlot::Offset { arg } => arg,
        FirstSlot::InCluster {
            arg_ci, arg_start, ..
        } => arg_ci.max(arg_start),
    }
    .max(arg_si)
    .max(arg_nr_pages);
    for (n, &(_, ty)) in params.iter().enumerate().take(last_read + 1) {
        checks.push((
            format!("parameter {n} of {function} (in one register)"),
            ty,
            Expect::OneRegister,
        ));
    }
    // One flag: the probe tests its bit.
    let swp_blkdev = swp_blkdev
        .filter(|flag: &u64| flag.is_power_of_two())
        .ok_or_else(|| missing("SWP_BLKDEV as a single flag bit"))?;
    btf.check_types(&checks)?;

    Ok(KernelLayout {
        function,
        si_bdev: si_bdev.offset,
        si_flags: si_flags.offset,
        si_max: si_max.offset,
        bd_dev: bd_dev.offset,
        swp_blkdev,
        arg_si,
        arg_nr_pages,
        first_slot,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;

    /// A BTF file holding `types` (each a fixed part and its extra bytes) and `strings`.
    fn btf_file(types: &[(u32, u32, u32, Vec<u8>)], strings: &[&str]) -> Cursor<Vec<u8>> {
        let mut string_bytes = vec![0u8];
        for s in strings {
            string_bytes.extend_from_slice(s.as_bytes());
            string_bytes.push(0);
        }
        let mut type_bytes = Vec::new();
        for (name_off, info, size, extra) in types {
            for word in [name_off, info, size] {
                type_bytes.extend_from_slice(&word.to_le_bytes());
            }
            type_bytes.extend_from_slice(extra);
        }
        let mut file = Vec::new();
        file.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        file.extend_from_slice(&[1, 0]);
        let type_len = u32::try_from(type_bytes.len()).unwrap();
        let str_len = u32::try_from(string_bytes.len()).unwrap();
        for word in [24, 0, type_len, type_len, str_len] {
            file.extend_from_slice(&u32::to_le_bytes(word));
        }
        file.extend_from_slice(&type_bytes);
        file.extend_from_slice(&string_bytes);
        Cursor::new(file)
    }

    /// Offset of `name` in the string section `btf_file` makes from `strings`.
    fn off(strings: &[&str], name: &str) -> u32 {
        let mut at = 1;
        for s in strings {
            if *s == name {
                return at;
            }
            at += u32::try_from(s.len()).unwrap() + 1;
        }
        panic!("{name} not in strings")
    }

    fn words(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// A function prototype's parameters, each a name and a type id.
    fn params(strings: &[&str], params: [(&str, u32); 4]) -> Vec<u8> {
        let words_of: Vec<u32> = params
            .iter()
            .flat_map(|&(name, ty)| [off(strings, name), ty])
            .collect();
        words(&words_of)
    }

    fn info(kind: u32, vlen: u32) -> u32 {
        (kind << 24) | vlen
    }

    /// The names the lookup wants, and a few more for the sample's other types.
    fn strings() -> Vec<&'static str> {
        NAMES
            .into_iter()
            .chain(["si", "long", "SWP_USED", "other", "u32", "dev_t", "char"])
            .collect()
    }

    fn sample_types(s: &[&str]) -> Vec<(u32, u32, u32, Vec<u8>)> {
        vec![
            // 1: int
            (off(s, "long"), info(1, 0), 8, words(&[64])),
            // 2: struct swap_info_struct { long flags @0; long other @64; signed char type @
            //    80; u32 max @ 96; struct block_device *bdev @ 192;
            //    struct swap_cluster_info *cluster_info @ 256 }
            (
                off(s, "swap_info_struct"),
                info(KIND_STRUCT, 6),
                64,
                words(&[
                    off(s, "flags"),
                    1,
                    0,
                    off(s, "other"),
                    1,
                    64,
                    off(s, "type"),
                    15,
                    80,
                    off(s, "max"),
                    13,
                    96,
                    off(s, "bdev"),
                    5,
                    192,
                    off(s, "cluster_info"),
                    12,
                    256,
                ]),
            ),
            // 3: struct swap_info_struct *
            (0, info(KIND_PTR, 0), 2, vec![]),
            // 4: enum { SWP_USED = 1, SWP_BLKDEV = 64 }
            (
                0,
                info(KIND_ENUM, 2),
                4,
                words(&[off(s, "SWP_USED"), 1, off(s, "SWP_BLKDEV"), 64]),
            ),
            // 5: struct block_device *  (pointer to 6)
            (0, info(KIND_PTR, 0), 6, vec![]),
            // 6: struct block_device { long other @0; dev_t bd_dev @ 32 }
            (
                off(s, "block_device"),
                info(KIND_STRUCT, 2),
                16,
                words(&[off(s, "other"), 1, 0, off(s, "bd_dev"), 14, 32]),
            ),
            // 7: func swap_entry_range_free -> 8
            (
                off(s, "swap_entry_range_free"),
                info(KIND_FUNC, 0),
                8,
                vec![],
            ),
            // 8: proto (struct swap_info_struct *si, long other, long entry, long nr_pages)
            (
                0,
                info(KIND_FUNC_PROTO, 4),
                0,
                params(s, [("si", 3), ("other", 1), ("entry", 1), ("nr_pages", 1)]),
            ),
            // 9: struct swap_cluster_info, 48 bytes
            (
                off(s, "swap_cluster_info"),
                info(KIND_STRUCT, 0),
                48,
                vec![],
            ),
            // 10: long[512]
            (0, info(KIND_ARRAY, 0), 0, words(&[1, 1, 512])),
            // 11: struct swap_table { long entries[512] @0 }
            (
                off(s, "swap_table"),
                info(KIND_STRUCT, 1),
                4096,
                words(&[off(s, "entries"), 10, 0]),
            ),
            // 12: struct swap_cluster_info *
            (0, info(KIND_PTR, 0), 9, vec![]),
            // 13: u32
            (off(s, "u32"), info(KIND_INT, 0), 4, words(&[32])),
            // 14: typedef u32 dev_t
            (off(s, "dev_t"), info(8, 0), 13, vec![]),
            // 15: signed char
            (off(s, "char"), info(KIND_INT, 0), 1, words(&[8])),
        ]
    }

    /// The sample with 7.3's free function as well:
    /// `__swap_cluster_free_entries(si, ci, ci_start, nr_pages)`.
    fn sample_types_in_cluster(s: &[&str]) -> Vec<(u32, u32, u32, Vec<u8>)> {
        let mut types = sample_types(s);
        types.extend([
            // 16: func __swap_cluster_free_entries -> 17
            (
                off(s, "__swap_cluster_free_entries"),
                info(KIND_FUNC, 0),
                17,
                vec![],
            ),
            // 17: proto (struct swap_info_struct *si, struct swap_cluster_info *ci,
            //     long ci_start, long nr_pages)
            (
                0,
                info(KIND_FUNC_PROTO, 4),
                0,
                params(s, [("si", 3), ("ci", 12), ("ci_start", 1), ("nr_pages", 1)]),
            ),
        ]);
        types
    }

    #[test]
    fn finds_the_offsets_the_enumerator_and_the_argument_positions() {
        let file = btf_file(&sample_types(&strings()), &strings());
        let layout = layout_of(file).unwrap();
        assert_eq!(
            layout,
            KernelLayout {
                function: "swap_entry_range_free",
                si_bdev: 24,
                si_flags: 0,
                si_max: 12,
                bd_dev: 4,
                swp_blkdev: 64,
                arg_si: 0,
                arg_nr_pages: 3,
                first_slot: FirstSlot::Entry {
                    arg: 2,
                    si_type: 10,
                },
            }
        );
    }

    #[test]
    fn an_offset_argument_is_the_slot_itself() {
        let strings = strings();
        let mut types = sample_types(&strings);
        types[7].3 = params(
            &strings,
            [("si", 3), ("other", 1), ("offset", 1), ("nr_pages", 1)],
        );
        let layout = layout_of(btf_file(&types, &strings)).unwrap();
        assert_eq!(layout.first_slot, FirstSlot::Offset { arg: 2 });
    }

    #[test]
    fn the_newest_free_function_wins_and_its_cluster_arithmetic_comes_from_the_types() {
        let strings = strings();
        let layout = layout_of(btf_file(&sample_types_in_cluster(&strings), &strings)).unwrap();
        assert_eq!(layout.function, "__swap_cluster_free_entries");
        assert_eq!((layout.arg_si, layout.arg_nr_pages), (0, 3));
        assert_eq!(
            layout.first_slot,
            FirstSlot::InCluster {
                arg_ci: 1,
                arg_start: 2,
                si_cluster_info: 32,
                cluster_info_bytes: 48,
                cluster_slots: 512,
            }
        );
        // Without `struct swap_table` the cluster's size is unknown: refused, not guessed.
        let mut types = sample_types_in_cluster(&strings);
        types[10].0 = off(&strings, "other");
        let error = layout_of(btf_file(&types, &strings))
            .unwrap_err()
            .to_string();
        assert!(error.contains("swap_table.entries"), "{error}");
    }

    #[test]
    fn a_kernel_without_the_function_is_refused_with_its_name() {
        let strings = strings();
        let mut types = sample_types(&strings);
        types.truncate(6);
        let file = btf_file(&types, &strings);
        let error = layout_of(file).unwrap_err().to_string();
        for function in FREE_FUNCTIONS {
            assert!(error.contains(function), "{error}");
        }
    }

    #[test]
    fn an_argument_that_is_not_the_swap_area_pointer_is_refused() {
        let strings = strings();
        let mut types = sample_types(&strings);
        // The first parameter's type becomes `long`: no argument points to swap_info_struct.
        types[7].3 = params(
            &strings,
            [("si", 1), ("other", 1), ("entry", 1), ("nr_pages", 1)],
        );
        let file = btf_file(&types, &strings);
        assert!(layout_of(file).is_err());
    }

    #[test]
    fn a_value_the_kernel_types_otherwise_than_the_probe_reads_it_is_refused() {
        let strings = strings();
        // bd_dev as a `long`: the probe would compare 4 of its 8 bytes.
        let mut types = sample_types(&strings);
        types[5].3 = words(&[off(&strings, "other"), 1, 0, off(&strings, "bd_dev"), 1, 32]);
        let error = layout_of(btf_file(&types, &strings))
            .unwrap_err()
            .to_string();
        assert!(error.contains("block_device.bd_dev"), "{error}");
        // bdev pointing at something other than struct block_device.
        let mut types = sample_types(&strings);
        types[4].2 = 9;
        let error = layout_of(btf_file(&types, &strings))
            .unwrap_err()
            .to_string();
        assert!(error.contains("swap_info_struct.bdev"), "{error}");
        // flags as 4 bytes.
        let mut types = sample_types(&strings);
        types[1].3[4..8].copy_from_slice(&13u32.to_le_bytes());
        let error = layout_of(btf_file(&types, &strings))
            .unwrap_err()
            .to_string();
        assert!(error.contains("swap_info_struct.flags"), "{error}");
        // The swap type as 4 bytes, the area's size as 8: the probe would compare the wrong
        // bytes with the entry's type and the freed run's end.
        for (member, ty, what) in [
            (2, 13, "swap_info_struct.type"),
            (3, 1, "swap_info_struct.max"),
        ] {
            let mut types = sample_types(&strings);
            let at = member * 12 + 4;
            types[1].3[at..at + 4].copy_from_slice(&u32::to_le_bytes(ty));
            let error = layout_of(btf_file(&types, &strings))
                .unwrap_err()
                .to_string();
            assert!(error.contains(what), "{error}");
        }
        // The entry argument as a pointer.
        let mut types = sample_types(&strings);
        types[7].3 = params(
            &strings,
            [("si", 3), ("other", 1), ("entry", 12), ("nr_pages", 1)],
        );
        let error = layout_of(btf_file(&types, &strings))
            .unwrap_err()
            .to_string();
        assert!(error.contains("`entry` argument"), "{error}");
        // SWP_BLKDEV as two bits.
        let mut types = sample_types(&strings);
        types[3].3 = words(&[
            off(&strings, "SWP_USED"),
            1,
            off(&strings, "SWP_BLKDEV"),
            65,
        ]);
        let error = layout_of(btf_file(&types, &strings))
            .unwrap_err()
            .to_string();
        assert!(error.contains("SWP_BLKDEV"), "{error}");
        // A parameter before the entry passed by value in more than one register (a 4 KiB
        // struct): the entry and the count are not in the registers their places say.
        let mut types = sample_types(&strings);
        types[7].3 = params(
            &strings,
            [("si", 3), ("other", 11), ("entry", 1), ("nr_pages", 1)],
        );
        let error = layout_of(btf_file(&types, &strings))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("parameter 1 of swap_entry_range_free"),
            "{error}"
        );
        // A typedef that names itself is not followed for ever.
        let mut types = sample_types(&strings);
        types[13].2 = 14;
        assert!(layout_of(btf_file(&types, &strings)).is_err());
    }

    /// The running kernel's BTF, where it has one of the free functions: the layout is found
    /// and its types are those the probe reads.
    #[test]
    fn the_running_kernels_btf_passes_the_type_checks() {
        let path = Path::new("/sys/kernel/btf/vmlinux");
        if !path.exists() {
            eprintln!("skipped: no {}", path.display());
            return;
        }
        match kernel_layout(path) {
            Ok(layout) => eprintln!("{layout:?}"),
            Err(error) if error.to_string().contains(FREE_FUNCTIONS[0]) => {
                eprintln!("skipped: this kernel has none of the free functions ({error})");
            }
            Err(error) => panic!("{error}"),
        }
    }

    /// The parse_btf fuzz target's seed is the sample above, as a file.
    #[test]
    fn the_fuzz_seed_is_the_sample() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/seeds/parse_btf/sample");
        let sample = btf_file(&sample_types(&strings()), &strings()).into_inner();
        assert_eq!(
            std::fs::read(path).unwrap(),
            sample,
            "{path} is not the sample: write the sample's bytes there"
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let file = Cursor::new(b"not btf at all, just bytes".to_vec());
        assert!(layout_of(file).is_err());
        let strings = strings();
        let mut types = sample_types(&strings);
        types[0].1 = info(31, 0);
        let file = btf_file(&types, &strings);
        assert!(layout_of(file).is_err());
    }
}
