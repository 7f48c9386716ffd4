//! Freed swap slots, heard of as the kernel frees them: the ublk counterpart of zram's
//! `swap_slot_free_notify`.
//!
//! Why: a ublk device learns that swap no longer needs a slot only through DISCARD, which swap
//! sends for a whole free cluster (512 slots), later, from a work queue; a cluster that keeps
//! one live slot is never discarded. Meanwhile the store keeps the data of slots that no
//! longer exist, in locked memory, exactly when memory runs out (a killed program's pages).
//! zram frees a slot's memory as the kernel frees the slot.
//!
//! How: a kprobe program (`program`) on the function every freed slot passes through
//! (`btf::FREE_FUNCTION`) sends the freed range of a swap area on our device to a BPF ring
//! buffer, which the daemon reads (`SlotFreeProbe::drain`) and frees those pages in the store.
//! Optional: a kernel without BTF, kprobes, the function or the permissions has no probe, and
//! memory comes back with discards as before (`SlotFreeProbe::attach` says why not). Losing a
//! record (a full ring, a daemon that died) only returns memory later.
//!
//! The one thing that must never happen is freeing a page written after its slot was freed (the
//! slot given out again and written before the daemon read the record): that would lose the new
//! page. The order that rules it out: the probe runs at the function's entry, before the slot
//! is marked free, so its record is in the ring before the slot can be given out again, and so
//! before any write to it reaches the daemon. A queue thread drains the ring (`drain`, through
//! every record reserved by then, waiting out one still being written) before it serves the
//! requests that arrived; so every free that happened before a write is applied before it.
//!
//! All `unsafe` is in `sys`.

pub mod btf;
pub mod program;
mod sys;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// Bytes of the ring buffer: 10,922 records of 24 bytes, freed faster than a program exits.
const RING_BYTES: u32 = 256 << 10;
/// The kernel's BTF, where the probe learns the layout it reads.
const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";
/// A record's header: the length, with these two flags.
const RECORD_BUSY: u64 = 1 << 31;
const RECORD_DISCARDED: u64 = 1 << 30;
/// Bytes of a record's header, and of the probe's records after it.
const HEADER_BYTES: u64 = 8;
const RECORD_LEN: u64 = program::RECORD_BYTES.unsigned_abs() as u64;
/// Bits of a `swp_entry_t` below the swap type: the slot's offset (`SWP_TYPE_SHIFT` on 64-bit
/// kernels: BITS_PER_XA_VALUE 63 less MAX_SWAPFILES_SHIFT 5).
const SWP_OFFSET_BITS: u32 = 58;
/// When a drain that waits for a record a probe is still writing says so (the kernel writes
/// one in well under a microsecond; a descheduled virtual CPU can hold one for milliseconds).
const BUSY_RECORD_WARN: Duration = Duration::from_secs(1);

/// Why there is no probe.
#[derive(Debug, thiserror::Error)]
pub enum SlotFreeError {
    #[error("the probe is built for x86-64 only")]
    Architecture,
    #[error("reading the kernel's BTF ({VMLINUX_BTF}): {0}")]
    Btf(String),
    #[error("building the probe: {0}")]
    Program(#[from] program::ProgramError),
    #[error("{what}: {source} (needs root with CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN, and the bpf and perf_event_open system calls)")]
    Kernel {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the kernel's verifier refused the probe: {error}: {log}")]
    Verifier { error: std::io::Error, log: String },
}

/// What `stat` shows of the probe.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotFreeStats {
    pub attached: bool,
    /// The probed function, or why there is no probe (empty from a daemon that predates it).
    pub detail: String,
    /// Freed ranges read from the ring, and the slots in them.
    pub ranges: u64,
    pub slots: u64,
    /// Ranges outside the device (never freed; a sign of a probe reading the wrong thing).
    pub refused: u64,
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

/// The probe, attached: its ring buffer, mapped, and what keeps it in the kernel.
pub struct SlotFreeProbe {
    ring: sys::RingMapping,
    /// Closed first: detaches the program.
    _event: OwnedFd,
    _program: OwnedFd,
    map: OwnedFd,
    /// Held while reading records and freeing their pages, so that a thread that finds the
    /// ring drained knows the frees in it are done.
    drain: Mutex<()>,
    ranges: AtomicU64,
    slots: AtomicU64,
    refused: AtomicU64,
}

impl SlotFreeProbe {
    /// Attach a probe for swap on the block device `major:minor`.
    pub fn attach(major: u32, minor: u32) -> Result<Self, SlotFreeError> {
        if !cfg!(target_arch = "x86_64") {
            return Err(SlotFreeError::Architecture);
        }
        let layout = btf::kernel_layout(Path::new(VMLINUX_BTF))?;
        let kernel = |what| move |source| SlotFreeError::Kernel { what, source };
        let map = sys::create_ring_buffer(RING_BYTES, "trueno_frees")
            .map_err(kernel("creating the ring buffer"))?;
        let ring_fd = std::os::fd::AsRawFd::as_raw_fd(&map);
        let code = program::slot_free_probe(&layout, kernel_dev(major, minor), ring_fd)?;
        let program = sys::load_kprobe_program(&code, "trueno_frees")
            .map_err(|(error, log)| SlotFreeError::Verifier { error, log })?;
        let event = sys::attach_kprobe(btf::FREE_FUNCTION, &program)
            .map_err(kernel("attaching the kprobe"))?;
        let ring = sys::RingMapping::map(&map, RING_BYTES as usize)
            .map_err(kernel("mapping the ring buffer"))?;
        Ok(Self {
            ring,
            _event: event,
            _program: program,
            map,
            drain: Mutex::new(()),
            ranges: AtomicU64::new(0),
            slots: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        })
    }

    /// Readable (poll) when records are waiting.
    pub fn ring_fd(&self) -> BorrowedFd<'_> {
        self.map.as_fd()
    }

    /// Read every record reserved by now, calling `free(first slot, slots)` for each freed
    /// range (`free` says whether the range was the device's); returns when they are all done.
    /// Cheap when there is none: two loads.
    pub fn drain(&self, mut free: impl FnMut(u64, u64) -> bool) {
        let ring = RingWords {
            consumer: self.ring.consumer_pos(),
            producer: self.ring.producer_pos(),
            data: self.ring.data(),
        };
        if !ring.has_records() {
            return;
        }
        let _held = self.drain.lock();
        ring.read(|first, count| {
            self.ranges.fetch_add(1, Ordering::Relaxed);
            if free(first, count) {
                self.slots.fetch_add(count, Ordering::Relaxed);
            } else {
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
        });
    }

    pub fn stats(&self) -> SlotFreeStats {
        SlotFreeStats {
            attached: true,
            detail: btf::FREE_FUNCTION.to_string(),
            ranges: self.ranges.load(Ordering::Relaxed),
            slots: self.slots.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }
}

/// A BPF ring buffer as its consumer sees it: the two positions (bytes, ever growing) and the
/// data as 8-byte words (records are 8-byte aligned; a record may wrap around the end).
struct RingWords<'a> {
    consumer: &'a AtomicU64,
    producer: &'a AtomicU64,
    data: &'a [AtomicU64],
}

impl RingWords<'_> {
    fn has_records(&self) -> bool {
        self.consumer.load(Ordering::Acquire) != self.producer.load(Ordering::Acquire)
    }

    fn word(&self, pos: u64) -> u64 {
        let index = (pos / 8) % self.data.len() as u64;
        self.data[usize::try_from(index).unwrap_or(0)].load(Ordering::Acquire)
    }

    /// Read the records reserved by now (waiting for one still being written), calling
    /// `freed(first slot, slots)` for each, then move the consumer past them. The caller
    /// holds the drain's lock.
    fn read(&self, mut freed: impl FnMut(u64, u64)) {
        let producer = self.producer.load(Ordering::Acquire);
        let mut consumer = self.consumer.load(Ordering::Acquire);
        while consumer < producer {
            let mut header = self.word(consumer);
            let waited = Instant::now();
            let mut warned = false;
            while header & RECORD_BUSY != 0 {
                // Never skipped: a later record may free a slot about to be written. The probe
                // writes a record within one helper call, which waits on nothing of ours.
                if waited.elapsed() > BUSY_RECORD_WARN && !warned {
                    tracing::warn!(consumer, "slot-free probe: a record is still being written after 1 s; waiting for it");
                    warned = true;
                }
                if warned {
                    std::thread::sleep(Duration::from_millis(1));
                } else {
                    std::thread::yield_now();
                }
                header = self.word(consumer);
            }
            let len = header & 0xffff_ffff & !(RECORD_BUSY | RECORD_DISCARDED);
            if header & RECORD_DISCARDED == 0 && len == RECORD_LEN {
                let entry = self.word(consumer + HEADER_BYTES);
                let count = self.word(consumer + HEADER_BYTES + 8) & 0xffff_ffff;
                freed(entry & ((1 << SWP_OFFSET_BITS) - 1), count);
            }
            consumer += (HEADER_BYTES + len).div_ceil(8) * 8;
        }
        self.consumer.store(consumer, Ordering::Release);
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

    /// A ring of `words` data words with the records `(entry, count)` written from `start`.
    fn ring(
        words: usize,
        start: u64,
        records: &[(u64, u64)],
    ) -> (AtomicU64, AtomicU64, Vec<AtomicU64>) {
        let data: Vec<AtomicU64> = (0..words).map(|_| AtomicU64::new(0)).collect();
        let mut pos = start;
        for &(entry, count) in records {
            let put = |at: u64, value: u64| {
                data[(at / 8) as usize % words].store(value, Ordering::Relaxed)
            };
            put(pos, RECORD_LEN);
            put(pos + 8, entry);
            put(pos + 16, count);
            pos += 24;
        }
        (AtomicU64::new(start), AtomicU64::new(pos), data)
    }

    fn read_all(consumer: &AtomicU64, producer: &AtomicU64, data: &[AtomicU64]) -> Vec<(u64, u64)> {
        let words = RingWords {
            consumer,
            producer,
            data,
        };
        let mut out = Vec::new();
        words.read(|first, count| out.push((first, count)));
        out
    }

    #[test]
    fn records_are_read_in_order_across_the_wrap_and_the_consumer_moves_past_them() {
        let swap_type_3 = 3u64 << SWP_OFFSET_BITS;
        let records = [
            (swap_type_3 | 100, 1),
            (swap_type_3 | 7, 512),
            (5, 0xdead_0000_0002),
        ];
        // 16 words: the second record straddles the end.
        let (consumer, producer, data) = ring(16, 96, &records);
        let words = RingWords {
            consumer: &consumer,
            producer: &producer,
            data: &data,
        };
        assert!(words.has_records());
        assert_eq!(
            read_all(&consumer, &producer, &data),
            [(100, 1), (7, 512), (5, 2)]
        );
        assert_eq!(consumer.load(Ordering::Relaxed), 96 + 72);
        let words = RingWords {
            consumer: &consumer,
            producer: &producer,
            data: &data,
        };
        assert!(!words.has_records());
        assert!(read_all(&consumer, &producer, &data).is_empty());
    }

    #[test]
    fn discarded_and_foreign_records_are_skipped() {
        let (consumer, producer, data) = ring(32, 0, &[(1, 1), (2, 1), (3, 1)]);
        data[0].store(RECORD_LEN | RECORD_DISCARDED, Ordering::Relaxed);
        // A record of another length (not the probe's), 12 bytes: skipped, padded to 8.
        data[3].store(12, Ordering::Relaxed);
        assert_eq!(read_all(&consumer, &producer, &data), [(3, 1)]);
    }

    #[test]
    fn a_record_still_being_written_is_waited_for() {
        let (consumer, producer, data) = ring(32, 0, &[(1, 1), (2, 1)]);
        data[3].store(RECORD_LEN | RECORD_BUSY, Ordering::Relaxed);
        let data = std::sync::Arc::new(data);
        let writer = {
            let data = data.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                data[3].store(RECORD_LEN, Ordering::Release);
            })
        };
        assert_eq!(read_all(&consumer, &producer, &data), [(1, 1), (2, 1)]);
        writer.join().unwrap();
    }

    #[test]
    fn the_kernel_device_number_is_mkdev_not_makedev() {
        assert_eq!(kernel_dev(259, 0), 259 << 20);
        assert_eq!(kernel_dev(259, 5), (259 << 20) | 5);
    }
}
