//! Arbitrary bytes as the kernel's BTF (/sys/kernel/btf/vmlinux), which the serving process
//! reads to attach the slot-free probe once its device is live: the reader must return the
//! layout or an error, never panic, hang or read out of bounds (a panic there would end the
//! serving process, and every takeover would read the same file again).
//!
//! Seed: the unit tests' sample kernel (`slotfree::btf::tests::sample_types`), a 6.12-like
//! layout the reader accepts. Run with `scripts/fuzz.sh` (stable toolchain) or
//! `cargo fuzz run parse_btf`.

#![no_main]

use std::io::Cursor;

use libfuzzer_sys::fuzz_target;
use trueno_ublk::slotfree::btf::layout_of;

fuzz_target!(|data: &[u8]| {
    let _ = layout_of(Cursor::new(data));
});
