//! The probe itself: a kprobe program of 41 BPF instructions, written out here rather than
//! compiled (no BPF compiler needed to build or run the daemon). On every call of
//! `swap_entry_range_free` it reads the swap area's flags and its block device's number, and
//! for a swap area that is the whole of our device it sends the freed entry and count to the
//! daemon through a ring buffer. Everything it reads of the kernel's structs goes through
//! `bpf_probe_read_kernel`, so a wrong offset reads a wrong value, never faults.
//!
//! The argument registers are x86-64's (`struct pt_regs`); other architectures have no probe.

#![forbid(unsafe_code)]

use super::btf::KernelLayout;

/// Bytes the probe sends per freed range: the `swp_entry_t` word, then the count of slots.
pub const RECORD_BYTES: i32 = 16;

/// One BPF instruction (`struct bpf_insn`), as the kernel reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    pub code: u8,
    /// Destination register in the low nibble, source in the high one.
    pub regs: u8,
    pub off: i16,
    pub imm: i32,
}

impl Insn {
    pub fn to_bytes(self) -> [u8; 8] {
        let [o0, o1] = self.off.to_le_bytes();
        let [i0, i1, i2, i3] = self.imm.to_le_bytes();
        [self.code, self.regs, o0, o1, i0, i1, i2, i3]
    }
}

// Opcodes (include/uapi/linux/bpf.h, bpf_common.h).
const LDX_DW: u8 = 0x79; // dst = *(u64 *)(src + off)
const LDX_W: u8 = 0x61; // dst = *(u32 *)(src + off)
const STX_DW: u8 = 0x7b; // *(u64 *)(dst + off) = src
const MOV64_X: u8 = 0xbf;
const MOV64_K: u8 = 0xb7;
const ADD64_K: u8 = 0x07;
const AND64_K: u8 = 0x57;
const JEQ_K: u8 = 0x15;
const JNE_K: u8 = 0x55;
const JNE32_K: u8 = 0x56;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
const LD_IMM64: u8 = 0x18;
/// `src` of a 64-bit immediate load that names a map by its file descriptor.
const PSEUDO_MAP_FD: u8 = 1;

const HELPER_PROBE_READ_KERNEL: i32 = 113;
const HELPER_RINGBUF_OUTPUT: i32 = 130;

const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R4: u8 = 4;
const R6: u8 = 6;
const FP: u8 = 10;

/// Offsets in x86-64's `struct pt_regs` of the first six argument registers (rdi, rsi, rdx,
/// rcx, r8, r9).
const ARG_REGS: [i16; 6] = [112, 104, 96, 88, 72, 64];

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | dst,
        off,
        imm,
    }
}

/// Why the probe cannot be built for this kernel.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error("argument {0} of the free function is not in a register")]
    ArgumentOnStack(usize),
    #[error("an offset or value the probe needs does not fit its instruction: {0}")]
    TooLarge(&'static str),
}

/// The probe for swap areas on the block device numbered `dev` (the kernel's encoding,
/// `major << 20 | minor`), sending to the ring buffer map `ring_fd`.
pub fn slot_free_probe(
    layout: &KernelLayout,
    dev: u32,
    ring_fd: i32,
) -> Result<Vec<Insn>, ProgramError> {
    let arg = |n: usize| {
        ARG_REGS
            .get(n)
            .copied()
            .ok_or(ProgramError::ArgumentOnStack(n))
    };
    let (si, entry, nr_pages) = (
        arg(layout.arg_si)?,
        arg(layout.arg_entry)?,
        arg(layout.arg_nr_pages)?,
    );
    let imm = |value: u64, what| i32::try_from(value).map_err(|_| ProgramError::TooLarge(what));
    let si_flags = imm(layout.si_flags.into(), "swap_info_struct.flags")?;
    let si_bdev = imm(layout.si_bdev.into(), "swap_info_struct.bdev")?;
    let bd_dev = imm(layout.bd_dev.into(), "block_device.bd_dev")?;
    let blkdev = imm(layout.swp_blkdev, "SWP_BLKDEV")?;
    // A 32-bit comparison takes the immediate's 32 bits as they are.
    let dev = i32::from_ne_bytes(dev.to_ne_bytes());

    let mut probe = Builder::default();
    probe.push(insn(MOV64_X, R6, R1, 0, 0)); // r6 = ctx (kept across calls)
                                             // The swap area's flags: a whole block device?
    probe.push(insn(LDX_DW, R3, R6, si, 0));
    probe.push(insn(ADD64_K, R3, 0, 0, si_flags));
    probe.read_kernel_into(-8, 8);
    probe.push(insn(LDX_DW, R1, FP, -8, 0));
    probe.push(insn(AND64_K, R1, 0, 0, blkdev));
    probe.exit_if(JEQ_K, R1, 0);
    // Its block device's number: ours?
    probe.push(insn(LDX_DW, R3, R6, si, 0));
    probe.push(insn(ADD64_K, R3, 0, 0, si_bdev));
    probe.read_kernel_into(-8, 8);
    probe.push(insn(LDX_DW, R3, FP, -8, 0));
    probe.exit_if(JEQ_K, R3, 0);
    probe.push(insn(ADD64_K, R3, 0, 0, bd_dev));
    probe.read_kernel_into(-16, 4);
    probe.push(insn(LDX_W, R1, FP, -16, 0));
    probe.exit_if(JNE32_K, R1, dev);
    // The record: entry, count.
    probe.push(insn(LDX_DW, R1, R6, entry, 0));
    probe.push(insn(STX_DW, FP, R1, -32, 0));
    probe.push(insn(LDX_DW, R1, R6, nr_pages, 0));
    probe.push(insn(STX_DW, FP, R1, -24, 0));
    // bpf_ringbuf_output(map, fp - 32, 16, 0): a full ring drops the record (the slot's
    // memory then comes back with the discard of its cluster).
    probe.push(insn(LD_IMM64, R1, PSEUDO_MAP_FD, 0, ring_fd));
    probe.push(insn(0, 0, 0, 0, 0));
    probe.push(insn(MOV64_X, R2, FP, 0, 0));
    probe.push(insn(ADD64_K, R2, 0, 0, -32));
    probe.push(insn(MOV64_K, R3, 0, 0, RECORD_BYTES));
    probe.push(insn(MOV64_K, R4, 0, 0, 0));
    probe.push(insn(CALL, 0, 0, 0, HELPER_RINGBUF_OUTPUT));
    probe.finish()
}

/// A program being written: its instructions and the jumps still to point at its exit.
#[derive(Default)]
struct Builder {
    program: Vec<Insn>,
    exits: Vec<usize>,
}

impl Builder {
    fn push(&mut self, instruction: Insn) {
        self.program.push(instruction);
    }

    /// Leave (return 0) when `reg` compared with `imm` by `jump` holds.
    fn exit_if(&mut self, jump: u8, reg: u8, imm: i32) {
        self.exits.push(self.program.len());
        self.push(insn(jump, reg, 0, 0, imm));
    }

    /// `bpf_probe_read_kernel(fp + to, size, r3)`; leave when it fails.
    fn read_kernel_into(&mut self, to: i16, size: i32) {
        self.push(insn(MOV64_X, R1, FP, 0, 0));
        self.push(insn(ADD64_K, R1, 0, 0, i32::from(to)));
        self.push(insn(MOV64_K, R2, 0, 0, size));
        self.push(insn(CALL, 0, 0, 0, HELPER_PROBE_READ_KERNEL));
        self.exit_if(JNE_K, R0, 0);
    }

    /// The program with its exit (`r0 = 0`) appended and every jump pointed at it.
    fn finish(mut self) -> Result<Vec<Insn>, ProgramError> {
        let exit_at = self.program.len();
        self.push(insn(MOV64_K, R0, 0, 0, 0));
        self.push(insn(EXIT, 0, 0, 0, 0));
        for at in self.exits {
            // A jump's offset counts from the instruction after it.
            self.program[at].off =
                i16::try_from(exit_at - at - 1).map_err(|_| ProgramError::TooLarge("jump"))?;
        }
        Ok(self.program)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KernelLayout {
        KernelLayout {
            si_bdev: 216,
            si_flags: 0,
            bd_dev: 144,
            swp_blkdev: 64,
            arg_si: 0,
            arg_entry: 1,
            arg_nr_pages: 2,
        }
    }

    #[test]
    fn every_jump_lands_on_the_exit_and_the_program_ends_with_one() {
        let program = slot_free_probe(&layout(), (259 << 20) | 3, 7).unwrap();
        assert_eq!(program.len(), 41);
        let exit_at = program.len() - 2;
        assert_eq!(program[exit_at], insn(MOV64_K, R0, 0, 0, 0));
        assert_eq!(program.last().unwrap().code, EXIT);
        let jumps: Vec<usize> = (0..program.len())
            .filter(|&at| matches!(program[at].code, JEQ_K | JNE_K | JNE32_K))
            .collect();
        assert_eq!(jumps.len(), 6);
        for at in jumps {
            let target = at + 1 + usize::try_from(program[at].off).unwrap();
            assert_eq!(target, exit_at, "jump at {at}");
        }
    }

    #[test]
    fn reads_the_arguments_the_layout_names_and_compares_the_device_number() {
        let mut layout = layout();
        layout.arg_si = 1;
        layout.arg_entry = 2;
        layout.arg_nr_pages = 3;
        let program = slot_free_probe(&layout, (259 << 20) | 3, 7).unwrap();
        let ctx_loads: Vec<i16> = program
            .iter()
            .filter(|i| i.code == LDX_DW && i.regs >> 4 == R6)
            .map(|i| i.off)
            .collect();
        // si twice (flags, bdev), then entry and count.
        assert_eq!(ctx_loads, [104, 104, 96, 88]);
        let compare = program.iter().find(|i| i.code == JNE32_K).unwrap();
        assert_eq!(compare.imm, (259 << 20) | 3);
        let map = program.iter().find(|i| i.code == LD_IMM64).unwrap();
        assert_eq!((map.regs >> 4, map.imm), (PSEUDO_MAP_FD, 7));
    }

    #[test]
    fn an_argument_past_the_sixth_or_a_huge_offset_is_refused() {
        let mut layout = layout();
        layout.arg_nr_pages = 6;
        assert!(slot_free_probe(&layout, 1, 7).is_err());
        let mut layout = self::layout();
        layout.swp_blkdev = 1 << 40;
        assert!(slot_free_probe(&layout, 1, 7).is_err());
    }
}
