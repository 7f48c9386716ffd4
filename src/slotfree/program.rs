//! The probe itself: a kprobe program of about 100 BPF instructions, written out here rather
//! than compiled (no BPF compiler needed to build or run the daemon). On every call of the
//! kernel's slot-free function (`KernelLayout::function`) it reads the swap area's flags and
//! its block device's number, and for a swap area that is the whole of our device it sets
//! the freed slots' bits in a bitmap the daemon maps (an array map of 64-bit words, one bit
//! per device page), then counts the call in the word after the bitmap, which the daemon
//! watches. Everything it reads of the kernel's structs goes through
//! `bpf_probe_read_kernel`, so a wrong offset reads a wrong value, never faults. A bitmap cannot overflow, as a queue of records would when a program
//! with 100k pages out exits faster than the daemon reads.
//!
//! A bit set for a slot the kernel did not free is a page of a process lost, so the slots are
//! checked against what every kernel's free looks like before any bit is set: at least one
//! slot, never slot 0 (swap's header, which the kernel marks bad and never frees), all inside
//! the swap area (its `max` slots) and in one cluster (every caller frees within one), for a
//! slot given as a swap entry, an entry of this swap area's type, and for a slot given as a
//! cluster and a place in it, a cluster that is an element of the swap area's array and a
//! place inside it. Arguments read from registers other than the ones the kernel passed them
//! in (a kernel whose code and BTF disagree) then fail the checks, but for small values that
//! happen to pass.
//!
//! The argument registers are x86-64's (`struct pt_regs`); other architectures have no probe.

#![forbid(unsafe_code)]

use super::btf::{FirstSlot, KernelLayout};
use crate::bpf::insn::*;

/// The most slots one call frees: a cluster (`SWAPFILE_CLUSTER`). A larger count (none in
/// Linux 6.12) is left to the discard.
pub const MAX_RANGE: i32 = 512;

/// Offsets in x86-64's `struct pt_regs` of the first six argument registers (rdi, rsi, rdx,
/// rcx, r8, r9).
const ARG_REGS: [i16; 6] = [112, 104, 96, 88, 72, 64];

/// Bits of a `swp_entry_t` above the slot's offset: the swap type (64 - `SWP_TYPE_SHIFT`, which
/// is BITS_PER_XA_VALUE 63 less MAX_SWAPFILES_SHIFT 5 on 64-bit kernels).
const SWP_TYPE_BITS: i32 = 6;

/// Why the probe cannot be built for this kernel.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error("argument {0} of the free function is not in a register")]
    ArgumentOnStack(usize),
    #[error("an offset or value the probe needs does not fit its instruction: {0}")]
    TooLarge(&'static str),
}

/// The probe for swap areas on the block device numbered `dev` (the kernel's encoding,
/// `major << 20 | minor`), setting bits in the array map `bitmap_fd` of `words` bitmap words
/// (and the counter at index `words`).
pub fn slot_free_probe(
    layout: &KernelLayout,
    dev: u32,
    bitmap_fd: i32,
    words: u32,
) -> Result<Vec<Insn>, ProgramError> {
    let arg = |n: usize| {
        ARG_REGS
            .get(n)
            .copied()
            .ok_or(ProgramError::ArgumentOnStack(n))
    };
    let (si, nr_pages) = (arg(layout.arg_si)?, arg(layout.arg_nr_pages)?);
    let imm = |value: u64, what| i32::try_from(value).map_err(|_| ProgramError::TooLarge(what));
    let si_flags = imm(layout.si_flags.into(), "swap_info_struct.flags")?;
    let si_bdev = imm(layout.si_bdev.into(), "swap_info_struct.bdev")?;
    let si_max = imm(layout.si_max.into(), "swap_info_struct.max")?;
    let bd_dev = imm(layout.bd_dev.into(), "block_device.bd_dev")?;
    let blkdev = imm(layout.swp_blkdev, "SWP_BLKDEV")?;
    let bitmap_pages = u64::from(words) * 64;
    let words = imm(words.into(), "bitmap words")?;
    // A 32-bit comparison takes the immediate's 32 bits as they are.
    let dev = i32::from_ne_bytes(dev.to_ne_bytes());

    let mut probe = Builder::default();
    // r6 = ctx (kept across calls).
    probe.push(insn(MOV64_X, R6, R1, 0, 0));
    // The swap area's flags: a whole block device?
    probe.read_swap_area_field(si, si_flags, -8, 8);
    probe.push(insn(LDX_DW, R1, FP, -8, 0));
    probe.push(insn(AND64_K, R1, 0, 0, blkdev));
    probe.jump_if(JEQ_K, R1, 0, Exit);
    // Its block device's number: ours?
    probe.read_swap_area_field(si, si_bdev, -8, 8);
    probe.push(insn(LDX_DW, R3, FP, -8, 0));
    probe.jump_if(JEQ_K, R3, 0, Exit);
    probe.push(insn(ADD64_K, R3, 0, 0, bd_dev));
    probe.read_kernel_into(-16, 4);
    probe.push(insn(LDX_W, R1, FP, -16, 0));
    probe.jump_if(JNE32_K, R1, dev, Exit);
    // r7 = the first slot, r8 = the count (32 bits), r9 = 0. `cluster`: the slots of the
    // layout's clusters, or where the layout names none, `MAX_RANGE` (swap's clusters are 512
    // or 256 slots, aligned to their size, so a run inside one is inside one of 512).
    let cluster = match layout.first_slot {
        FirstSlot::Entry {
            arg: entry,
            si_type,
        } => {
            // The entry's type bits: this swap area's type?
            let si_type = imm(si_type.into(), "swap_info_struct.type")?;
            probe.read_swap_area_field(si, si_type, -16, 1);
            probe.push(insn(LDX_B, R1, FP, -16, 0));
            probe.push(insn(LDX_DW, R7, R6, arg(entry)?, 0));
            probe.push(insn(MOV64_X, R2, R7, 0, 0));
            probe.push(insn(RSH64_K, R2, 0, 0, 64 - SWP_TYPE_BITS));
            probe.jump_if_reg(JNE_X, R2, R1, Exit);
            // Its offset bits.
            probe.push(insn(LSH64_K, R7, 0, 0, SWP_TYPE_BITS));
            probe.push(insn(RSH64_K, R7, 0, 0, SWP_TYPE_BITS));
            MAX_RANGE
        }
        FirstSlot::Offset { arg: offset } => {
            probe.push(insn(LDX_DW, R7, R6, arg(offset)?, 0));
            MAX_RANGE
        }
        FirstSlot::InCluster {
            arg_ci,
            arg_start,
            si_cluster_info,
            cluster_info_bytes,
            cluster_slots,
        } => {
            // (ci - si->cluster_info) / cluster_info_bytes * cluster_slots + ci_start (32
            // bits), for a `ci` among the clusters the bitmap covers (any other leaves).
            let si_cluster_info = imm(si_cluster_info.into(), "swap_info_struct.cluster_info")?;
            if cluster_info_bytes == 0 || cluster_slots == 0 {
                return Err(ProgramError::TooLarge("a cluster of no bytes or no slots"));
            }
            let clusters_bytes = bitmap_pages
                .div_ceil(cluster_slots.into())
                .saturating_mul(cluster_info_bytes.into());
            let clusters_bytes = imm(clusters_bytes, "the clusters' array")?;
            let cluster_info_bytes = imm(cluster_info_bytes.into(), "swap_cluster_info")?;
            let cluster_slots = imm(cluster_slots.into(), "SWAPFILE_CLUSTER")?;
            probe.read_swap_area_field(si, si_cluster_info, -8, 8);
            probe.push(insn(LDX_DW, R7, R6, arg(arg_ci)?, 0));
            probe.push(insn(LDX_DW, R1, FP, -8, 0));
            probe.push(insn(SUB64_X, R7, R1, 0, 0));
            probe.jump_if(JGE_K, R7, clusters_bytes, Exit);
            // An element of the array, not a place inside one.
            probe.push(insn(MOV64_X, R1, R7, 0, 0));
            probe.push(insn(MOD64_K, R1, 0, 0, cluster_info_bytes));
            probe.jump_if(JNE_K, R1, 0, Exit);
            probe.push(insn(DIV64_K, R7, 0, 0, cluster_info_bytes));
            probe.push(insn(MUL64_K, R7, 0, 0, cluster_slots));
            probe.push(insn(LDX_DW, R1, R6, arg(arg_start)?, 0));
            probe.keep_low_32_bits(R1);
            // A place inside the cluster (with the count, see below, the whole run).
            probe.jump_if(JGE_K, R1, cluster_slots, Exit);
            probe.push(insn(ADD64_X, R7, R1, 0, 0));
            cluster_slots
        }
    };
    probe.push(insn(LDX_DW, R8, R6, nr_pages, 0));
    probe.keep_low_32_bits(R8);
    probe.jump_if(JGT_K, R8, MAX_RANGE, Exit);
    probe.jump_if(JEQ_K, R8, 0, Exit);
    probe.jump_if(JEQ_K, R7, 0, Exit);
    // The last slot inside the swap area (`max` slots).
    probe.read_swap_area_field(si, si_max, -16, 4);
    probe.push(insn(LDX_W, R1, FP, -16, 0));
    probe.push(insn(MOV64_X, R2, R7, 0, 0));
    probe.push(insn(ADD64_X, R2, R8, 0, 0));
    probe.jump_if_reg(JGT_X, R2, R1, Exit);
    // The first and the last slot in one cluster.
    probe.push(insn(MOV64_X, R1, R7, 0, 0));
    probe.push(insn(DIV64_K, R1, 0, 0, cluster));
    probe.push(insn(MOV64_X, R2, R7, 0, 0));
    probe.push(insn(ADD64_X, R2, R8, 0, 0));
    probe.push(insn(ADD64_K, R2, 0, 0, -1));
    probe.push(insn(DIV64_K, R2, 0, 0, cluster));
    probe.jump_if_reg(JNE_X, R1, R2, Exit);
    probe.push(insn(MOV64_K, R9, 0, 0, 0));
    // Each slot: bitmap[slot / 64] |= 1 << slot % 64. A bounded loop: r8 <= MAX_RANGE.
    let top = probe.here();
    probe.jump_if_reg(JGE_X, R9, R8, Count);
    probe.push(insn(MOV64_X, R1, R7, 0, 0));
    probe.push(insn(ADD64_X, R1, R9, 0, 0));
    probe.push(insn(MOV64_X, R2, R1, 0, 0));
    probe.push(insn(RSH64_K, R2, 0, 0, 6));
    probe.jump_if(JGE_K, R2, words, Count);
    probe.push(insn(STX_W, FP, R2, -4, 0));
    probe.push(insn(AND64_K, R1, 0, 0, 63));
    probe.push(insn(MOV64_K, R3, 0, 0, 1));
    probe.push(insn(LSH64_X, R3, R1, 0, 0));
    probe.push(insn(STX_DW, FP, R3, -16, 0));
    probe.lookup_key_at(bitmap_fd, -4);
    probe.jump_if(JEQ_K, R0, 0, Count);
    probe.push(insn(LDX_DW, R3, FP, -16, 0));
    probe.push(insn(ATOMIC_DW, R0, R3, 0, ATOMIC_OR));
    probe.push(insn(ADD64_K, R9, 0, 0, 1));
    probe.jump_back_to(top);
    // The counter after the bitmap: one more call seen.
    probe.mark(Count);
    probe.push(insn(ST_W, FP, 0, -4, words));
    probe.lookup_key_at(bitmap_fd, -4);
    probe.jump_if(JEQ_K, R0, 0, Exit);
    probe.push(insn(MOV64_K, R1, 0, 0, 1));
    probe.push(insn(ATOMIC_DW, R0, R1, 0, ATOMIC_ADD));
    probe.finish()
}

/// Where a forward jump goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Label {
    /// The counter's update.
    Count,
    /// `r0 = 0; exit`.
    Exit,
}
use Label::{Count, Exit};

/// A program being written: its instructions, where the labels are, and the jumps still to
/// point at them.
#[derive(Default)]
struct Builder {
    program: Vec<Insn>,
    labels: Vec<(Label, usize)>,
    jumps: Vec<(usize, Label)>,
}

impl Builder {
    fn push(&mut self, instruction: Insn) {
        self.program.push(instruction);
    }

    fn here(&self) -> usize {
        self.program.len()
    }

    fn mark(&mut self, label: Label) {
        self.labels.push((label, self.here()));
    }

    /// Go to `label` when `reg` compared with `imm` by `jump` holds.
    fn jump_if(&mut self, jump: u8, reg: u8, imm: i32, label: Label) {
        self.jumps.push((self.here(), label));
        self.push(insn(jump, reg, 0, 0, imm));
    }

    /// Go to `label` when `reg` compared with `other` by `jump` holds.
    fn jump_if_reg(&mut self, jump: u8, reg: u8, other: u8, label: Label) {
        self.jumps.push((self.here(), label));
        self.push(insn(jump, reg, other, 0, 0));
    }

    /// Go back to the instruction at `target`.
    fn jump_back_to(&mut self, target: usize) {
        // From the instruction after this one; a program this small never needs i16::MIN,
        // which the verifier would refuse.
        let back = self.here() + 1 - target;
        let off = i16::try_from(back).map_or(i16::MIN, |back| -back);
        self.push(insn(JA, 0, 0, off, 0));
    }

    /// `reg &= 0xffff_ffff`: an `unsigned int` argument, whose register's upper half is
    /// whatever the caller left there.
    fn keep_low_32_bits(&mut self, reg: u8) {
        self.push(insn(LSH64_K, reg, 0, 0, 32));
        self.push(insn(RSH64_K, reg, 0, 0, 32));
    }

    /// `r0 = bpf_map_lookup_elem(map, fp + key)`.
    fn lookup_key_at(&mut self, map_fd: i32, key: i16) {
        self.push(insn(LD_IMM64, R1, PSEUDO_MAP_FD, 0, map_fd));
        self.push(insn(0, 0, 0, 0, 0));
        self.push(insn(MOV64_X, R2, FP, 0, 0));
        self.push(insn(ADD64_K, R2, 0, 0, i32::from(key)));
        self.push(insn(CALL, 0, 0, 0, HELPER_MAP_LOOKUP_ELEM));
    }

    /// `size` bytes at `offset` in the swap area (`struct swap_info_struct`) whose pointer is
    /// the argument at `si` in the context (r6) into `fp + to`; leave when the read fails.
    fn read_swap_area_field(&mut self, si: i16, offset: i32, to: i16, size: i32) {
        self.push(insn(LDX_DW, R3, R6, si, 0));
        self.push(insn(ADD64_K, R3, 0, 0, offset));
        self.read_kernel_into(to, size);
    }

    /// `bpf_probe_read_kernel(fp + to, size, r3)`; leave when it fails.
    fn read_kernel_into(&mut self, to: i16, size: i32) {
        self.push(insn(MOV64_X, R1, FP, 0, 0));
        self.push(insn(ADD64_K, R1, 0, 0, i32::from(to)));
        self.push(insn(MOV64_K, R2, 0, 0, size));
        self.push(insn(CALL, 0, 0, 0, HELPER_PROBE_READ_KERNEL));
        self.jump_if(JNE_K, R0, 0, Exit);
    }

    /// The program with its exit (`r0 = 0`) appended and every jump pointed at its label.
    fn finish(mut self) -> Result<Vec<Insn>, ProgramError> {
        self.mark(Exit);
        self.push(insn(MOV64_K, R0, 0, 0, 0));
        self.push(insn(EXIT, 0, 0, 0, 0));
        for (at, label) in self.jumps {
            let target = self
                .labels
                .iter()
                .find(|(l, _)| *l == label)
                .map(|(_, target)| *target)
                .ok_or(ProgramError::TooLarge("a jump to a missing label"))?;
            // A jump's offset counts from the instruction after it.
            self.program[at].off =
                i16::try_from(target - at - 1).map_err(|_| ProgramError::TooLarge("jump"))?;
        }
        Ok(self.program)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KernelLayout {
        KernelLayout::sample()
    }

    /// The offsets in the context (`pt_regs`) of the program's argument loads, in order.
    fn ctx_loads(program: &[Insn]) -> Vec<i16> {
        program
            .iter()
            .filter(|i| i.code == LDX_DW && i.regs >> 4 == R6)
            .map(|i| i.off)
            .collect()
    }

    fn is_jump(code: u8) -> bool {
        code & 0x07 == 0x05 && !matches!(code, CALL | EXIT)
    }

    #[test]
    fn every_jump_lands_inside_the_program_and_only_the_loop_goes_back() {
        let program = slot_free_probe(&layout(), (259 << 20) | 3, 7, 4096).unwrap();
        let exit_at = program.len() - 2;
        assert_eq!(program[exit_at], insn(MOV64_K, R0, 0, 0, 0));
        assert_eq!(program.last().unwrap().code, EXIT);
        let mut backward = 0;
        for (at, instruction) in program.iter().enumerate() {
            if !is_jump(instruction.code) {
                continue;
            }
            let at = i64::try_from(at).unwrap();
            let target = at + 1 + i64::from(instruction.off);
            assert!(
                (0..i64::try_from(program.len()).unwrap()).contains(&target),
                "jump at {at} to {target}"
            );
            if target <= at {
                backward += 1;
                assert_eq!(instruction.code, JA, "only the loop's end jumps back");
            }
        }
        assert_eq!(backward, 1);
        // The counter's update sets key `words`.
        assert!(program.contains(&insn(ST_W, FP, 0, -4, 4096)));
    }

    #[test]
    fn reads_the_arguments_the_layout_names_and_compares_the_device_number() {
        let mut layout = layout();
        layout.arg_si = 1;
        layout.first_slot = FirstSlot::Entry {
            arg: 2,
            si_type: 34,
        };
        layout.arg_nr_pages = 3;
        let program = slot_free_probe(&layout, (259 << 20) | 3, 7, 4096).unwrap();
        // si three times (flags, bdev, type), then entry and count, then si (max).
        assert_eq!(ctx_loads(&program), [104, 104, 104, 96, 88, 104]);
        let compare = program.iter().find(|i| i.code == JNE32_K).unwrap();
        assert_eq!(compare.imm, (259 << 20) | 3);
        let maps: Vec<(u8, i32)> = program
            .iter()
            .filter(|i| i.code == LD_IMM64)
            .map(|i| (i.regs >> 4, i.imm))
            .collect();
        assert_eq!(maps, [(PSEUDO_MAP_FD, 7), (PSEUDO_MAP_FD, 7)]);
        // A bit is set with an atomic or, the counter bumped with an atomic add.
        assert!(program.contains(&insn(ATOMIC_DW, R0, R3, 0, ATOMIC_OR)));
        assert!(program.contains(&insn(ATOMIC_DW, R0, R1, 0, ATOMIC_ADD)));
    }

    #[test]
    fn a_slot_in_a_cluster_is_the_clusters_index_times_its_slots_plus_its_place() {
        let layout = KernelLayout::sample_in_cluster();
        let program = slot_free_probe(&layout, (259 << 20) | 3, 7, 4096).unwrap();
        // si three times (flags, bdev, cluster_info), then ci, ci_start and the count, then si
        // (max).
        assert_eq!(ctx_loads(&program), [112, 112, 112, 104, 96, 88, 112]);
        let at = |code: u8| program.iter().position(|i| i.code == code).unwrap();
        assert!(at(SUB64_X) < at(DIV64_K) && at(DIV64_K) < at(MUL64_K));
        assert_eq!(program[at(DIV64_K)].imm, 48);
        assert_eq!(program[at(MUL64_K)].imm, 512);
        // Past the clusters the 4096 words' 262,144 pages take: 512 clusters of 48 bytes.
        assert_eq!(
            program[at(SUB64_X) + 1],
            insn(JGE_K, R7, 0, program[at(SUB64_X) + 1].off, 512 * 48)
        );
    }

    /// Where the runs below put things: the context (`pt_regs`), the stack's top, the bitmap
    /// map's values, and the kernel's swap area, block device and clusters.
    const CTX: u64 = 0x1000_0000;
    const STACK_TOP: u64 = 0x2000_0200;
    const MAP: u64 = 0x3000_0000;
    const SI: u64 = 0xffff_8000_0000_1000;
    const BDEV: u64 = 0xffff_8000_0000_2000;
    const CLUSTERS: u64 = 0xffff_8000_0001_0000;
    const OUR_DEV: u32 = (259 << 20) | 3;
    const WORDS: u32 = 64;
    /// Our swap area's type (`swp_entry_t`'s top bits) and size in slots (`max`).
    const OUR_TYPE: u8 = 5;
    const OUR_MAX: u32 = 4000;

    /// The kernel memory a run of the probe reads: the swap area (its flags, size and block
    /// device, its type for a layout that reads it, and its clusters' array for a layout that
    /// has one) and the device's number.
    fn kernel_memory(layout: &KernelLayout, dev: u32) -> Vec<(u64, Vec<u8>)> {
        let mut memory = vec![
            (
                SI + u64::from(layout.si_flags),
                layout.swp_blkdev.to_le_bytes().to_vec(),
            ),
            (
                SI + u64::from(layout.si_max),
                OUR_MAX.to_le_bytes().to_vec(),
            ),
            (SI + u64::from(layout.si_bdev), BDEV.to_le_bytes().to_vec()),
            (BDEV + u64::from(layout.bd_dev), dev.to_le_bytes().to_vec()),
        ];
        if let FirstSlot::Entry { si_type, .. } = layout.first_slot {
            memory.push((SI + u64::from(si_type), vec![OUR_TYPE]));
        }
        if let FirstSlot::InCluster {
            si_cluster_info, ..
        } = layout.first_slot
        {
            memory.push((
                SI + u64::from(si_cluster_info),
                CLUSTERS.to_le_bytes().to_vec(),
            ));
        }
        memory
    }

    /// Run `program` as the kernel would for one call whose argument registers hold `args`
    /// (rdi, rsi, rdx, rcx, r8, r9), reading `kernel` memory: the map's words after it (the
    /// bitmap's `WORDS`, then the counter). Only the instructions the probe uses.
    fn run(program: &[Insn], args: [u64; 6], kernel: &[(u64, Vec<u8>)]) -> Vec<u64> {
        let mut ctx = [0u8; 168];
        for (reg, value) in ARG_REGS.iter().zip(args) {
            let at = usize::try_from(*reg).unwrap();
            ctx[at..at + 8].copy_from_slice(&value.to_le_bytes());
        }
        let mut stack = [0u8; 512];
        let mut map = vec![0u64; WORDS as usize + 1];
        let mut r = [0u64; 11];
        r[1] = CTX;
        r[10] = STACK_TOP;
        let kernel_byte = |address: u64| {
            kernel.iter().find_map(|(at, bytes)| {
                let i = usize::try_from(address.checked_sub(*at)?).ok()?;
                bytes.get(i).copied()
            })
        };
        let load = |stack: &[u8], map: &[u64], address: u64, size: usize| -> u64 {
            let bytes: Vec<u8> = if (CTX..CTX + 168).contains(&address) {
                let at = usize::try_from(address - CTX).unwrap();
                ctx[at..at + size].to_vec()
            } else if (STACK_TOP - 512..STACK_TOP).contains(&address) {
                let at = usize::try_from(address - (STACK_TOP - 512)).unwrap();
                stack[at..at + size].to_vec()
            } else {
                assert!(address >= MAP && size == 8, "load of {address:#x}");
                map[usize::try_from((address - MAP) / 8).unwrap()]
                    .to_le_bytes()
                    .to_vec()
            };
            let mut word = [0u8; 8];
            word[..size].copy_from_slice(&bytes);
            u64::from_le_bytes(word)
        };
        let store = |stack: &mut [u8], address: u64, value: u64, size: usize| {
            assert!(
                (STACK_TOP - 512..STACK_TOP).contains(&address),
                "store to {address:#x}"
            );
            let at = usize::try_from(address - (STACK_TOP - 512)).unwrap();
            stack[at..at + size].copy_from_slice(&value.to_le_bytes()[..size]);
        };
        let mut pc = 0;
        for _ in 0..100_000 {
            let i = program[pc];
            let (dst, src) = (usize::from(i.regs & 0xf), usize::from(i.regs >> 4));
            let imm = i64::from(i.imm).cast_unsigned(); // sign-extended, as the kernel does
            let address = |base: u64| base.wrapping_add(i64::from(i.off).cast_unsigned());
            pc += 1;
            let jump = |taken: bool, pc: &mut usize| {
                if taken {
                    *pc = usize::try_from(i64::try_from(*pc).unwrap() + i64::from(i.off)).unwrap();
                }
            };
            match i.code {
                LDX_DW => r[dst] = load(&stack, &map, address(r[src]), 8),
                LDX_W => r[dst] = load(&stack, &map, address(r[src]), 4),
                LDX_B => r[dst] = load(&stack, &map, address(r[src]), 1),
                STX_DW => store(&mut stack, address(r[dst]), r[src], 8),
                STX_W => store(&mut stack, address(r[dst]), r[src], 4),
                ST_W => store(&mut stack, address(r[dst]), imm, 4),
                ATOMIC_DW => {
                    let word = &mut map[usize::try_from((address(r[dst]) - MAP) / 8).unwrap()];
                    match i.imm {
                        ATOMIC_OR => *word |= r[src],
                        ATOMIC_ADD => *word = word.wrapping_add(r[src]),
                        other => panic!("atomic op {other:#x}"),
                    }
                }
                MOV64_X => r[dst] = r[src],
                MOV64_K => r[dst] = imm,
                ADD64_X => r[dst] = r[dst].wrapping_add(r[src]),
                SUB64_X => r[dst] = r[dst].wrapping_sub(r[src]),
                ADD64_K => r[dst] = r[dst].wrapping_add(imm),
                MUL64_K => r[dst] = r[dst].wrapping_mul(imm),
                DIV64_K => r[dst] /= imm,
                MOD64_K => r[dst] %= imm,
                AND64_K => r[dst] &= imm,
                LSH64_K => r[dst] <<= imm,
                LSH64_X => r[dst] <<= r[src] & 63,
                RSH64_K => r[dst] >>= imm,
                JA => jump(true, &mut pc),
                JEQ_K => jump(r[dst] == imm, &mut pc),
                JNE_K => jump(r[dst] != imm, &mut pc),
                JGT_K => jump(r[dst] > imm, &mut pc),
                JGE_K => jump(r[dst] >= imm, &mut pc),
                JGT_X => jump(r[dst] > r[src], &mut pc),
                JGE_X => jump(r[dst] >= r[src], &mut pc),
                JNE_X => jump(r[dst] != r[src], &mut pc),
                JNE32_K => jump(
                    r[dst] & 0xffff_ffff != u64::from(i.imm.cast_unsigned()),
                    &mut pc,
                ),
                LD_IMM64 => {
                    r[dst] = u64::from(i.imm.cast_unsigned()); // the map's fd; lookups take any
                    pc += 1;
                }
                CALL => {
                    r[0] = match i.imm {
                        HELPER_PROBE_READ_KERNEL => {
                            let (to, size, from) = (r[1], r[2], r[3]);
                            let bytes: Option<Vec<u8>> =
                                (0..size).map(|k| kernel_byte(from + k)).collect();
                            match bytes {
                                Some(bytes) => {
                                    for (k, byte) in bytes.into_iter().enumerate() {
                                        store(&mut stack, to + k as u64, byte.into(), 1);
                                    }
                                    0
                                }
                                None => (-14i64).cast_unsigned(), // EFAULT
                            }
                        }
                        HELPER_MAP_LOOKUP_ELEM => {
                            let key = load(&stack, &map, r[2], 4);
                            if key <= u64::from(WORDS) {
                                MAP + key * 8
                            } else {
                                0
                            }
                        }
                        other => panic!("helper {other}"),
                    };
                }
                EXIT => return map,
                other => panic!("opcode {other:#x} at {}", pc - 1),
            }
        }
        panic!("the program did not end");
    }

    /// The slots whose bits `map` has set, and its counter.
    fn freed(map: &[u64]) -> (Vec<u64>, u64) {
        let slots = (0..u64::from(WORDS) * 64)
            .filter(|slot| map[usize::try_from(slot / 64).unwrap()] & (1 << (slot % 64)) != 0)
            .collect();
        (slots, map[WORDS as usize])
    }

    /// The argument registers of a call freeing `nr` slots from `first` on our swap area (of
    /// swap type `OUR_TYPE`) by a kernel of `layout`'s shape.
    fn args(layout: &KernelLayout, first: u64, nr: u64) -> [u64; 6] {
        let mut args = [0u64; 6];
        args[layout.arg_si] = SI;
        args[layout.arg_nr_pages] = nr;
        match layout.first_slot {
            FirstSlot::Entry { arg, .. } => args[arg] = (u64::from(OUR_TYPE) << 58) | first,
            FirstSlot::Offset { arg } => args[arg] = first,
            FirstSlot::InCluster {
                arg_ci,
                arg_start,
                cluster_info_bytes,
                cluster_slots,
                ..
            } => {
                let cluster = first / u64::from(cluster_slots);
                args[arg_ci] = CLUSTERS + cluster * u64::from(cluster_info_bytes);
                args[arg_start] = first % u64::from(cluster_slots);
            }
        }
        args
    }

    fn layouts() -> [KernelLayout; 3] {
        let entry = KernelLayout::sample();
        let offset = KernelLayout {
            first_slot: FirstSlot::Offset { arg: 1 },
            ..KernelLayout::sample()
        };
        [entry, offset, KernelLayout::sample_in_cluster()]
    }

    #[test]
    fn a_free_of_our_device_sets_exactly_its_slots_and_counts_the_call() {
        for layout in layouts() {
            let program = slot_free_probe(&layout, OUR_DEV, 7, WORDS).unwrap();
            let kernel = kernel_memory(&layout, OUR_DEV);
            for (first, nr) in [
                (1, 1),
                (700, 1),
                (1024, 512),
                (1030, 3),
                (2047, 1),
                (3990, 10),
            ] {
                let map = run(&program, args(&layout, first, nr), &kernel);
                assert_eq!(
                    freed(&map),
                    ((first..first + nr).collect(), 1),
                    "{} {first}+{nr}",
                    layout.function
                );
            }
            // Another device's area, or one that is not a whole block device (a swap file).
            let other = kernel_memory(&layout, OUR_DEV + 1);
            assert_eq!(
                freed(&run(&program, args(&layout, 9, 1), &other)),
                (vec![], 0)
            );
            let mut file = kernel_memory(&layout, OUR_DEV);
            file[0].1 = 0u64.to_le_bytes().to_vec();
            assert_eq!(
                freed(&run(&program, args(&layout, 9, 1), &file)),
                (vec![], 0)
            );
        }
    }

    #[test]
    fn slots_no_kernel_frees_set_no_bit() {
        // What arguments read from the wrong registers may look like: no slot, slot 0 (swap's
        // header), a run across clusters, more than a cluster, a run past the swap area's
        // end, a place past its cluster, a pointer inside a cluster's element, an entry of
        // another swap type.
        for layout in layouts() {
            let program = slot_free_probe(&layout, OUR_DEV, 7, WORDS).unwrap();
            let kernel = kernel_memory(&layout, OUR_DEV);
            for (first, nr) in [
                (5, 0),
                (0, 1),
                (0, 4),
                (510, 4),
                (1000, 100),
                (512, 513),
                (3990, 11),
                (4000, 1),
            ] {
                let map = run(&program, args(&layout, first, nr), &kernel);
                assert_eq!(
                    freed(&map).0,
                    Vec::<u64>::new(),
                    "{} {first}+{nr}",
                    layout.function
                );
            }
            if let FirstSlot::InCluster {
                arg_ci, arg_start, ..
            } = layout.first_slot
            {
                let mut past = args(&layout, 1024, 1);
                past[arg_start] = 600; // cluster 2's place 600 of 512: cluster 3's slot 88
                assert_eq!(freed(&run(&program, past, &kernel)).0, Vec::<u64>::new());
                let mut inside = args(&layout, 1024, 1);
                inside[arg_ci] += 8;
                assert_eq!(freed(&run(&program, inside, &kernel)).0, Vec::<u64>::new());
            }
            if let FirstSlot::Entry { arg, .. } = layout.first_slot {
                for other_type in [OUR_TYPE + 1, OUR_TYPE | 0x20] {
                    let mut other = args(&layout, 9, 1);
                    other[arg] = (u64::from(other_type) << 58) | 9;
                    assert_eq!(freed(&run(&program, other, &kernel)).0, Vec::<u64>::new());
                }
            }
        }
    }

    #[test]
    fn an_argument_past_the_sixth_or_a_huge_offset_is_refused() {
        let mut layout = layout();
        layout.arg_nr_pages = 6;
        assert!(slot_free_probe(&layout, 1, 7, 64).is_err());
        let mut layout = self::layout();
        layout.swp_blkdev = 1 << 40;
        assert!(slot_free_probe(&layout, 1, 7, 64).is_err());
    }
}
