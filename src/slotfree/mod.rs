//! Freed swap slots, heard of as the kernel frees them: the ublk counterpart of zram's
//! `swap_slot_free_notify`.
//!
//! Why: a ublk device learns that swap no longer needs a slot only through DISCARD, which swap
//! sends for a whole free cluster (512 slots), later, from a work queue; a cluster that keeps
//! one live slot is never discarded. Meanwhile the store keeps the data of slots that no
//! longer exist, in locked memory, exactly when memory runs out (a killed program's pages).
//! zram frees a slot's memory as the kernel frees the slot.
//!
//! How: a kprobe program (`program`) on the function every freed slot passes through (which one
//! depends on the kernel: `btf::FREE_FUNCTIONS`) sets the freed slots' bits in a bitmap shared
//! with the daemon (a BPF array map it maps), and counts its calls in the word after it. The
//! daemon looks at the count every `POLL` (`POLL_MEMORY_SHORT` while memory is short; once a
//! second on a device idle for two seconds) and, when it moved, frees the pages whose bits are
//! set (`SlotFreeProbe::free_reported`). Optional: a kernel without BTF, kprobes, the function
//! or the permissions has no probe, and memory comes back with discards as before
//! (`SlotFreeProbe::attach` says why not). A bit never set (the moments of a takeover) only
//! returns memory later.
//!
//! The one thing that must never happen is freeing a page written after its slot was freed (the
//! slot given out again and written before the daemon saw the bit): that would lose the new
//! page. The probe runs at the function's entry, before the slot is marked free, so the bit is
//! set before the slot can be given out again and so before any write to it reaches the
//! daemon. A write clears its pages' bits before it stores them (`forget`), and the daemon
//! frees a page only if its bit is still set when it holds the page's lock (the store's
//! `free_swap_slot`): whichever comes first, the new page stays.
//!
//! All `unsafe` is in `crate::bpf::sys`.

#![forbid(unsafe_code)]

pub mod btf;
pub mod program;

use crate::bpf::sys;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The kernel's BTF, where the probe learns the layout it reads.
const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";
/// How often the daemon looks at the probe's count (memory of freed slots comes back within
/// this; looking costs one load).
pub const POLL: Duration = Duration::from_millis(100);
/// ...and while the system is short of memory. Why: the kernel's OOM killer goes on to its
/// next victim 200-300 ms after one whose pages were all swapped out (it freed no RAM, only
/// slots of this device), and the memory of those slots must be back before then (the
/// near-OOM stage of `scripts/vm-test.sh --stress`: the OOM killer went from the fresh workers
/// on to the test's shells within 0.5 s). Not always enough: once it went on within 42 ms
/// (2026-11-29), less than freeing such a victim's pages takes under emulation.
pub const POLL_MEMORY_SHORT: Duration = Duration::from_millis(20);

/// Why there is no probe.
#[derive(Debug, thiserror::Error)]
pub enum SlotFreeError {
    #[error("the probe is built for x86-64 only")]
    Architecture,
    #[error("reading the kernel's BTF ({VMLINUX_BTF}): {0}")]
    Btf(String),
    #[error("building the probe: {0}")]
    Program(#[from] program::ProgramError),
    #[error("the device is too large for the probe's bitmap")]
    TooLarge,
    #[error("{what}: {source}")]
    Kernel {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{what}: {source} (needs root with CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN, and the bpf and perf_event_open system calls)")]
    Permission {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the kernel's verifier refused the probe: {error}: {log}")]
    Verifier { error: std::io::Error, log: String },
    #[error("attaching the kprobe to {function}: {source}{}", attach_hint(source))]
    Attach {
        function: &'static str,
        source: std::io::Error,
    },
}

/// What the kernel's answer to attaching a kprobe means, where it is its usual one.
fn attach_hint(source: &std::io::Error) -> &'static str {
    match source.raw_os_error() {
        Some(libc::ENOENT) => " (this kernel has no such function to probe, or it is inlined)",
        Some(libc::EADDRNOTAVAIL) => " (the function's name is not unique in this kernel)",
        _ => "",
    }
}

impl SlotFreeError {
    /// A kernel call's failure: `Permission` when it was refused for want of privilege.
    fn from_kernel(what: &'static str, source: std::io::Error) -> Self {
        if matches!(source.raw_os_error(), Some(libc::EPERM | libc::EACCES)) {
            Self::Permission { what, source }
        } else {
            Self::Kernel { what, source }
        }
    }
}

/// Why the kernel refused to load the probe. The verifier answers most faults of a program
/// with EACCES, as a missing privilege is answered: a log says it was the verifier (a
/// privilege check fails before it runs, and leaves none).
fn load_error(error: std::io::Error, log: String) -> SlotFreeError {
    if log.trim().is_empty() {
        match SlotFreeError::from_kernel("loading the probe", error) {
            SlotFreeError::Kernel { source, .. } => SlotFreeError::Verifier {
                error: source,
                log: "(no log)".to_string(),
            },
            denied => denied,
        }
    } else {
        SlotFreeError::Verifier { error, log }
    }
}

/// What `stat` shows of the probe.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotFreeStats {
    pub attached: bool,
    /// The probed function, or why there is no probe (empty from a daemon that predates it).
    pub detail: String,
    /// Calls of the function on this device the probe saw.
    pub calls: u64,
    /// Pages freed because the probe reported their slots freed.
    pub slots: u64,
}

impl SlotFreeStats {
    /// No probe, and why.
    pub fn off(why: &str) -> Self {
        Self {
            detail: why.to_string(),
            ..Self::default()
        }
    }
}

/// The probe, attached: the bitmap (and count) it sets, mapped, and what keeps it in the
/// kernel.
pub struct SlotFreeProbe {
    /// Bits of the device's pages, then the count of calls.
    shared: sys::WordArrayMapping,
    /// Closing it detaches the program.
    _event: std::os::fd::OwnedFd,
    _program: std::os::fd::OwnedFd,
    _map: std::os::fd::OwnedFd,
    /// The kernel function it is attached to (one of `btf::FREE_FUNCTIONS`).
    function: &'static str,
    /// `(major, minor)` of the block device whose swap slots it reports.
    device: (u32, u32),
    /// The count when the bitmap was last looked through.
    seen_calls: AtomicU64,
    slots: AtomicU64,
}

impl SlotFreeProbe {
    /// Attach a probe for swap on the block device `major:minor` of `pages` pages.
    pub fn attach(major: u32, minor: u32, pages: u64) -> Result<Self, SlotFreeError> {
        if !cfg!(target_arch = "x86_64") {
            return Err(SlotFreeError::Architecture);
        }
        let layout = btf::kernel_layout(Path::new(VMLINUX_BTF))?;
        let kernel = |what| move |source| SlotFreeError::from_kernel(what, source);
        let words = u32::try_from(pages.div_ceil(64)).map_err(|_| SlotFreeError::TooLarge)?;
        let map_words = words.checked_add(1).ok_or(SlotFreeError::TooLarge)?;
        let map = sys::create_word_array(map_words, "trueno_frees")
            .map_err(kernel("creating the bitmap"))?;
        let map_fd = std::os::fd::AsRawFd::as_raw_fd(&map);
        let code = program::slot_free_probe(&layout, kernel_dev(major, minor), map_fd, words)?;
        let program = sys::load_program(&code, sys::ProgramType::Kprobe, "trueno_frees")
            .map_err(|(error, log)| load_error(error, log))?;
        let shared = sys::WordArrayMapping::map(&map, map_words as usize)
            .map_err(kernel("mapping the bitmap"))?;
        let event = sys::attach_kprobe(layout.function, &program).map_err(|source| {
            match SlotFreeError::from_kernel("attaching the kprobe", source) {
                SlotFreeError::Kernel { source, .. } => SlotFreeError::Attach {
                    function: layout.function,
                    source,
                },
                denied => denied,
            }
        })?;
        Ok(Self {
            shared,
            _event: event,
            _program: program,
            _map: map,
            function: layout.function,
            device: (major, minor),
            seen_calls: AtomicU64::new(0),
            slots: AtomicU64::new(0),
        })
    }

    /// `(major, minor)` of the block device it watches.
    pub fn device(&self) -> (u32, u32) {
        self.device
    }

    fn bitmap(&self) -> FreedBits<'_> {
        let words = self.shared.words();
        FreedBits(&words[..words.len() - 1])
    }

    fn calls(&self) -> &AtomicU64 {
        &self.shared.words()[self.shared.words().len() - 1]
    }

    /// Pages `first..first + count` are about to be written: a free reported before is of
    /// their old data. Call before the write stores them (see the module's comment).
    pub fn forget(&self, first: u64, count: u64) {
        self.bitmap().clear(first, count);
    }

    /// If the probe has reported frees since the last look, call `free(page, still_freed)` for
    /// every page whose slot was reported freed; `free` must call `still_freed` while it holds
    /// the page's lock and free the page only if it says so, and return whether it did. The
    /// pages freed.
    pub fn free_reported(&self, mut free: impl FnMut(u64, &dyn Fn() -> bool) -> bool) -> u64 {
        let calls = self.calls().load(Ordering::Acquire);
        if calls == self.seen_calls.swap(calls, Ordering::AcqRel) {
            return 0;
        }
        let bits = self.bitmap();
        let mut freed = 0;
        bits.for_each_set(|page| {
            if free(page, &|| bits.take(page)) {
                freed += 1;
            }
        });
        self.slots.fetch_add(freed, Ordering::Relaxed);
        freed
    }

    /// The kernel function the probe is attached to.
    pub fn function(&self) -> &'static str {
        self.function
    }

    pub fn stats(&self) -> SlotFreeStats {
        SlotFreeStats {
            attached: true,
            detail: self.function.to_string(),
            calls: self.calls().load(Ordering::Relaxed),
            slots: self.slots.load(Ordering::Relaxed),
        }
    }
}

/// The bitmap of freed slots: bit `p % 64` of word `p / 64` is device page `p`.
struct FreedBits<'a>(&'a [AtomicU64]);

impl FreedBits<'_> {
    /// Clear the bits of pages `first..first + count` (those past the bitmap have none).
    fn clear(&self, first: u64, count: u64) {
        let end = first.saturating_add(count);
        let mut page = first;
        while page < end {
            let Some(word) = usize::try_from(page / 64).ok().and_then(|w| self.0.get(w)) else {
                return;
            };
            let bit = page % 64;
            let bits = (end - page).min(64 - bit);
            let mask = if bits == 64 {
                u64::MAX
            } else {
                ((1u64 << bits) - 1) << bit
            };
            // Most writes find nothing to clear: a load first keeps the word's cache line shared.
            if word.load(Ordering::Relaxed) & mask != 0 {
                word.fetch_and(!mask, Ordering::AcqRel);
            }
            page += bits;
        }
    }

    /// Clear page `page`'s bit; whether it was set.
    fn take(&self, page: u64) -> bool {
        let Some(word) = usize::try_from(page / 64).ok().and_then(|w| self.0.get(w)) else {
            return false;
        };
        let bit = 1u64 << (page % 64);
        word.fetch_and(!bit, Ordering::AcqRel) & bit != 0
    }

    /// Call `visit` with every page whose bit is set now.
    fn for_each_set(&self, mut visit: impl FnMut(u64)) {
        for (index, word) in self.0.iter().enumerate() {
            let mut bits = word.load(Ordering::Acquire);
            while bits != 0 {
                let bit = u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                visit(index as u64 * 64 + bit);
            }
        }
    }
}

/// The kernel's own encoding of a device number (`MKDEV`), which `block_device.bd_dev` holds;
/// not user space's `makedev`.
pub fn kernel_dev(major: u32, minor: u32) -> u32 {
    (major << 20) | (minor & 0xf_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bitmap(words: usize) -> Vec<AtomicU64> {
        (0..words).map(|_| AtomicU64::new(0)).collect()
    }

    fn set(words: &[AtomicU64], pages: &[u64]) {
        for &page in pages {
            words[(page / 64) as usize].fetch_or(1 << (page % 64), Ordering::Relaxed);
        }
    }

    fn set_pages(bits: &FreedBits) -> Vec<u64> {
        let mut pages = Vec::new();
        bits.for_each_set(|page| pages.push(page));
        pages
    }

    #[test]
    fn set_bits_are_visited_in_order_and_taken_once() {
        let words = bitmap(4);
        set(&words, &[0, 63, 64, 200, 255]);
        let bits = FreedBits(&words);
        assert_eq!(set_pages(&bits), [0, 63, 64, 200, 255]);
        assert!(bits.take(200));
        assert!(!bits.take(200));
        assert!(!bits.take(1));
        assert!(!bits.take(10_000), "past the bitmap: nothing");
        assert_eq!(set_pages(&bits), [0, 63, 64, 255]);
    }

    #[test]
    fn a_write_clears_exactly_its_pages_bits_across_word_boundaries() {
        let words = bitmap(4);
        let all: Vec<u64> = (0..256).collect();
        set(&words, &all);
        let bits = FreedBits(&words);
        bits.clear(60, 70); // pages 60..130
        bits.clear(192, 64); // one whole word
        bits.clear(250, u64::MAX); // to the end, without overflow
        let left = set_pages(&bits);
        let want: Vec<u64> = (0..60).chain(130..192).collect();
        assert_eq!(left, want);
        bits.clear(1 << 40, 5); // past the bitmap: nothing
        assert_eq!(set_pages(&bits), want);
    }

    #[test]
    fn the_kernel_device_number_is_mkdev_not_makedev() {
        assert_eq!(kernel_dev(259, 0), 259 << 20);
        assert_eq!(kernel_dev(259, 5), (259 << 20) | 5);
    }
}
#[cfg(test)]
mod kernel_verifier {
    use super::*;

    /// The probe passes this kernel's verifier, for a made-up layout, where this process may
    /// load BPF programs (root); elsewhere there is nothing to check and it says so.
    #[test]
    fn the_probe_passes_the_running_kernels_verifier() {
        let entry = btf::KernelLayout::sample();
        let offset = btf::KernelLayout {
            first_slot: btf::FirstSlot::Offset { arg: 1 },
            ..entry
        };
        for layout in [entry, offset, btf::KernelLayout::sample_in_cluster()] {
            passes_the_verifier(&layout);
        }
    }

    fn passes_the_verifier(layout: &btf::KernelLayout) {
        let words = 4096;
        let map = match sys::create_word_array(words + 1, "trueno_test") {
            Ok(map) => map,
            Err(error) => {
                eprintln!("skipped: this process may not make BPF maps ({error})");
                return;
            }
        };
        let fd = std::os::fd::AsRawFd::as_raw_fd(&map);
        let code = program::slot_free_probe(layout, kernel_dev(259, 0), fd, words).unwrap();
        if let Err((error, log)) = sys::load_program(&code, sys::ProgramType::Kprobe, "trueno_test")
        {
            // Only a want of privilege skips: the verifier's refusals are EACCES too, with a
            // log.
            match load_error(error, log) {
                SlotFreeError::Permission { source, .. } => {
                    eprintln!("skipped: this process may not load kprobe programs ({source})");
                    return;
                }
                refused => panic!("{refused}"),
            }
        }
        let shared = sys::WordArrayMapping::map(&map, words as usize + 1).unwrap();
        assert!(shared
            .words()
            .iter()
            .all(|word| word.load(Ordering::Relaxed) == 0));
    }
}
