//! BPF instructions (`struct bpf_insn`) and the opcodes, helpers and registers the daemon's
//! programs use, written out rather than compiled (no BPF compiler needed to build or run the
//! daemon).

#![forbid(unsafe_code)]

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
pub const LDX_DW: u8 = 0x79; // dst = *(u64 *)(src + off)
pub const LDX_W: u8 = 0x61; // dst = *(u32 *)(src + off)
pub const LDX_B: u8 = 0x71; // dst = *(u8 *)(src + off)
pub const STX_DW: u8 = 0x7b; // *(u64 *)(dst + off) = src
pub const STX_W: u8 = 0x63; // *(u32 *)(dst + off) = src
pub const ST_W: u8 = 0x62; // *(u32 *)(dst + off) = imm
pub const ST_DW: u8 = 0x7a; // *(u64 *)(dst + off) = imm
pub const ATOMIC_DW: u8 = 0xdb; // lock *(u64 *)(dst + off) op= src
pub const ATOMIC_ADD: i32 = 0x00;
pub const ATOMIC_OR: i32 = 0x40;
pub const MOV64_X: u8 = 0xbf;
pub const MOV64_K: u8 = 0xb7;
pub const ADD64_X: u8 = 0x0f;
pub const SUB64_X: u8 = 0x1f;
pub const MUL64_K: u8 = 0x27;
pub const DIV64_K: u8 = 0x37; // unsigned
pub const MOD64_K: u8 = 0x97; // unsigned
pub const ADD64_K: u8 = 0x07;
pub const AND64_K: u8 = 0x57;
pub const LSH64_K: u8 = 0x67;
pub const LSH64_X: u8 = 0x6f;
pub const RSH64_K: u8 = 0x77;
pub const JA: u8 = 0x05;
pub const JEQ_K: u8 = 0x15;
pub const JGT_K: u8 = 0x25;
pub const JGE_K: u8 = 0x35;
pub const JGT_X: u8 = 0x2d;
pub const JGE_X: u8 = 0x3d;
pub const JNE_X: u8 = 0x5d;
pub const JNE_K: u8 = 0x55;
pub const JNE32_K: u8 = 0x56;
pub const CALL: u8 = 0x85;
pub const EXIT: u8 = 0x95;
pub const LD_IMM64: u8 = 0x18;
/// `src` of a 64-bit immediate load that names a map by its file descriptor.
pub const PSEUDO_MAP_FD: u8 = 1;

pub const HELPER_MAP_LOOKUP_ELEM: i32 = 1;
pub const HELPER_PROBE_READ_KERNEL: i32 = 113;
pub const HELPER_RINGBUF_OUTPUT: i32 = 130;

pub const R0: u8 = 0;
pub const R1: u8 = 1;
pub const R2: u8 = 2;
pub const R3: u8 = 3;
pub const R4: u8 = 4;
pub const R6: u8 = 6;
pub const R7: u8 = 7;
pub const R8: u8 = 8;
pub const R9: u8 = 9;
pub const FP: u8 = 10;

pub fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | dst,
        off,
        imm,
    }
}
