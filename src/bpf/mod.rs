//! The daemon's BPF programs' common ground: their instructions (`insn`) and the kernel calls
//! that load, attach and share maps with them (`sys`, where all their `unsafe` is). The
//! programs themselves are `crate::slotfree`'s (freed swap slots) and `crate::oom_kills`'s
//! (a wake-up at each OOM kill).

pub mod insn;
pub mod sys;
