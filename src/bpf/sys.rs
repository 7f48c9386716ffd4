//! The kernel calls of the daemon's BPF programs: bpf(2) (an array map, a ring buffer, a
//! program, a raw tracepoint), perf_event_open(2) (a kprobe) and the maps' mappings. All
//! `unsafe` of the probes lives here.

use std::ffi::CString;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

use super::insn::Insn;
use crate::mem::HOST_PAGE;

const BPF_MAP_CREATE: libc::c_int = 0;
const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_RAW_TRACEPOINT_OPEN: libc::c_int = 17;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
/// A ring buffer shared with user space, who can wait for records with poll(2) (Linux 5.8+).
const BPF_MAP_TYPE_RINGBUF: u32 = 27;
/// An array map user space may mmap (Linux 5.5+).
const BPF_F_MMAPABLE: u32 = 1 << 10;
const BPF_PROG_TYPE_KPROBE: u32 = 2;
const BPF_PROG_TYPE_RAW_TRACEPOINT: u32 = 17;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
/// `_IO('$', 0)` and `_IOW('$', 8, __u32)` from include/uapi/linux/perf_event.h.
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;
/// Where the kernel says which perf event type its kprobes are.
const KPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/kprobe/type";

/// `union bpf_attr` as BPF_MAP_CREATE reads it (the fields up to `map_name`).
#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<MapCreateAttr>() == 44);

/// `union bpf_attr` as BPF_PROG_LOAD reads it (the fields up to `expected_attach_type`).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}
const _: () = assert!(std::mem::size_of::<ProgLoadAttr>() == 72);
const _: () = assert!(std::mem::offset_of!(ProgLoadAttr, prog_name) == 48);

/// `union bpf_attr` as BPF_RAW_TRACEPOINT_OPEN reads it (without the `cookie` of 6.10+).
#[repr(C)]
struct RawTracepointOpenAttr {
    name: u64,
    prog_fd: u32,
    padding: u32,
}
const _: () = assert!(std::mem::size_of::<RawTracepointOpenAttr>() == 16);

/// `struct perf_event_attr` up to `config2` (`PERF_ATTR_SIZE_VER1`).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    /// `kprobe_func`: the probed function's name.
    config1: u64,
    /// `probe_offset`: where in it.
    config2: u64,
}
const _: () = assert!(std::mem::size_of::<PerfEventAttr>() == 72);
const _: () = assert!(std::mem::offset_of!(PerfEventAttr, config1) == 56);

fn name16(name: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (to, from) in out.iter_mut().zip(name.bytes().take(15)) {
        *to = from;
    }
    out
}

/// bpf(2) with `attr`; a new file descriptor or the error.
fn bpf<T>(command: libc::c_int, attr: &mut T) -> std::io::Result<OwnedFd> {
    let size =
        u32::try_from(std::mem::size_of::<T>()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: `attr` is a properly laid out `union bpf_attr` prefix (see the assertions) that
    // outlives the call; the kernel reads `size` bytes of it and writes nothing back for the
    // commands used here (map create, program load, raw tracepoint open).
    let fd = unsafe { libc::syscall(libc::SYS_bpf, command, std::ptr::from_mut(attr), size) };
    own_fd(fd)
}

fn own_fd(rc: libc::c_long) -> std::io::Result<OwnedFd> {
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = RawFd::try_from(rc).map_err(|_| std::io::ErrorKind::InvalidData)?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A BPF array map of `words` 64-bit words (keys 0..words), zeroed, that user space may map.
pub fn create_word_array(words: u32, name: &str) -> std::io::Result<OwnedFd> {
    let mut attr = MapCreateAttr {
        map_type: BPF_MAP_TYPE_ARRAY,
        key_size: 4,
        value_size: 8,
        max_entries: words,
        map_flags: BPF_F_MMAPABLE,
        map_name: name16(name),
        ..MapCreateAttr::default()
    };
    bpf(BPF_MAP_CREATE, &mut attr)
}

/// Where a program runs.
#[derive(Clone, Copy, Debug)]
pub enum ProgramType {
    /// At a kernel function's entry (`attach_kprobe`); its context is the registers.
    Kprobe,
    /// At a tracepoint (`attach_raw_tracepoint`); its context is the tracepoint's arguments.
    RawTracepoint,
}

/// Load `program` as a program of type `kind`. On failure, the error and the verifier's log.
pub fn load_program(
    program: &[Insn],
    kind: ProgramType,
    name: &str,
) -> Result<OwnedFd, (std::io::Error, String)> {
    let bytes: Vec<u8> = program.iter().flat_map(|insn| insn.to_bytes()).collect();
    let license = c"Dual MIT/GPL";
    let load = |log: &mut [u8]| {
        let mut attr = ProgLoadAttr {
            prog_type: match kind {
                ProgramType::Kprobe => BPF_PROG_TYPE_KPROBE,
                ProgramType::RawTracepoint => BPF_PROG_TYPE_RAW_TRACEPOINT,
            },
            insn_cnt: u32::try_from(program.len()).unwrap_or(u32::MAX),
            insns: bytes.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: u32::from(!log.is_empty()),
            log_size: u32::try_from(log.len()).unwrap_or(0),
            // No buffer at all without a log: the kernel refuses a pointer without a size.
            log_buf: if log.is_empty() {
                0
            } else {
                log.as_mut_ptr() as u64
            },
            prog_name: name16(name),
            ..ProgLoadAttr::default()
        };
        bpf(BPF_PROG_LOAD, &mut attr)
    };
    load(&mut []).or_else(|error| {
        // Again with the verifier's log, to say why (its last lines: the log keeps the end).
        let mut log = vec![0u8; 64 << 10];
        match load(&mut log) {
            Ok(fd) => Ok(fd),
            // The log alone, empty where the kernel wrote none (a privilege check fails
            // before the verifier runs): the caller tells the two apart by it.
            Err(_) => {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                let text = String::from_utf8_lossy(&log[..end]);
                let tail: Vec<&str> = text.lines().rev().take(6).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                Err((error, tail.join(" / ")))
            }
        }
    })
}

/// Run `program` at the entry of the kernel function `function` (a kprobe through perf);
/// it stays attached until the returned descriptor is closed.
pub fn attach_kprobe(function: &str, program: &OwnedFd) -> std::io::Result<OwnedFd> {
    // Absent where the kernel has no kprobe events (CONFIG_KPROBE_EVENTS): say so, rather
    // than an ENOENT that reads like the function's.
    let pmu: u32 = std::fs::read_to_string(KPROBE_PMU_TYPE)
        .map_err(|error| {
            std::io::Error::new(
                error.kind(),
                format!("{KPROBE_PMU_TYPE}: {error} (a kernel without kprobe events)"),
            )
        })?
        .trim()
        .parse()
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, KPROBE_PMU_TYPE))?;
    let function = CString::new(function).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let attr = PerfEventAttr {
        kind: pmu,
        size: 72,
        config1: function.as_ptr() as u64,
        ..PerfEventAttr::default()
    };
    // SAFETY: `attr` is a `perf_event_attr` of the size it states, and `function` a C string,
    // both outliving the call; pid -1 with cpu 0 is how a kprobe for every task is asked for.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            std::ptr::from_ref(&attr),
            -1,
            0,
            -1,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    let event = own_fd(fd)?;
    // SAFETY: both ioctls take an int argument by value (the program's descriptor, or 0) on a
    // perf event descriptor we own.
    crate::os::cvt(unsafe {
        libc::ioctl(
            event.as_raw_fd(),
            PERF_EVENT_IOC_SET_BPF,
            program.as_raw_fd(),
        )
    })?;
    // SAFETY: as above.
    crate::os::cvt(unsafe { libc::ioctl(event.as_raw_fd(), PERF_EVENT_IOC_ENABLE, 0) })?;
    Ok(event)
}

/// Run `program` (a `ProgramType::RawTracepoint`) at the kernel's tracepoint `tracepoint`
/// (its name without the group: `mark_victim`, not `oom:mark_victim`); it stays attached until
/// the returned descriptor is closed. No tracefs needed (Linux 4.17+).
pub fn attach_raw_tracepoint(tracepoint: &str, program: &OwnedFd) -> std::io::Result<OwnedFd> {
    let tracepoint = CString::new(tracepoint).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let mut attr = RawTracepointOpenAttr {
        name: tracepoint.as_ptr() as u64,
        prog_fd: u32::try_from(program.as_raw_fd())
            .map_err(|_| std::io::ErrorKind::InvalidInput)?,
        padding: 0,
    };
    bpf(BPF_RAW_TRACEPOINT_OPEN, &mut attr)
}

/// A BPF ring buffer of `bytes` (a power of two, a multiple of the page size).
pub fn create_ring_buffer(bytes: u32, name: &str) -> std::io::Result<OwnedFd> {
    let mut attr = MapCreateAttr {
        map_type: BPF_MAP_TYPE_RINGBUF,
        max_entries: bytes,
        map_name: name16(name),
        ..MapCreateAttr::default()
    };
    bpf(BPF_MAP_CREATE, &mut attr)
}

/// A ring buffer's reading end: its descriptor to wait on and its two positions mapped (the
/// consumer's page, which user space writes, and the producer's, which the kernel writes).
/// Records are not read, only counted as arrived and then skipped: a program that only says
/// "now" needs no more.
pub struct RingBufferReader {
    map: OwnedFd,
    consumer: NonNull<AtomicU64>,
    producer: NonNull<AtomicU64>,
}

// SAFETY: the two mappings are plain shared memory, accessed only through atomics; they
// belong to this value, and no thread owns them.
unsafe impl Send for RingBufferReader {}
// SAFETY: as above.
unsafe impl Sync for RingBufferReader {}

impl RingBufferReader {
    /// Map the positions of the ring buffer `map` (made by `create_ring_buffer`).
    pub fn map(map: OwnedFd) -> std::io::Result<Self> {
        // The consumer's page (offset 0, the one page of a ring buffer user space may write),
        // then the producer's (the next, read-only: the kernel refuses to map it writable;
        // the records after it are not mapped).
        let producer_offset =
            libc::off_t::try_from(HOST_PAGE).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let consumer = map_shared(
            &map,
            HOST_PAGE,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            0,
        )?;
        let producer = match map_shared(&map, HOST_PAGE, ProtFlags::PROT_READ, producer_offset) {
            Ok(producer) => producer,
            Err(error) => {
                // SAFETY: the mapping just made, of that length; nothing points into it.
                let _ = unsafe { munmap(consumer, HOST_PAGE) };
                return Err(error);
            }
        };
        Ok(Self {
            map,
            consumer: consumer.cast(),
            producer: producer.cast(),
        })
    }

    /// Wait for a record not yet skipped, until `also` is readable (or closed) or for up to
    /// `timeout` (`None`: no limit): whether a record is there.
    pub fn wait(
        &self,
        also: Option<BorrowedFd<'_>>,
        timeout: Option<std::time::Duration>,
    ) -> std::io::Result<bool> {
        let mut fds: smallvec::SmallVec<[nix::poll::PollFd<'_>; 2]> =
            std::iter::once(self.map.as_fd())
                .chain(also)
                .map(|fd| nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN))
                .collect();
        let timeout = timeout.map_or(nix::poll::PollTimeout::NONE, |timeout| {
            nix::poll::PollTimeout::try_from(timeout).unwrap_or(nix::poll::PollTimeout::MAX)
        });
        match nix::poll::poll(&mut fds, timeout) {
            Ok(_) => Ok(fds[0]
                .revents()
                .is_some_and(|events| events.contains(nix::poll::PollFlags::POLLIN))),
            Err(nix::errno::Errno::EINTR) => Ok(false),
            Err(error) => Err(error.into()),
        }
    }

    /// Skip every record written so far: the next `wait` waits for a new one.
    pub fn skip_all(&self) {
        // SAFETY: both positions are the first word of a page mapped for our lifetime, and
        // every access is atomic (the kernel's too).
        let (consumer, producer) = unsafe { (self.consumer.as_ref(), self.producer.as_ref()) };
        consumer.store(producer.load(Ordering::Acquire), Ordering::Release);
    }
}

impl Drop for RingBufferReader {
    fn drop(&mut self) {
        // SAFETY: our two mappings, one page each; no reference into them outlives `self`.
        unsafe {
            let _ = munmap(self.consumer.cast(), HOST_PAGE);
            let _ = munmap(self.producer.cast(), HOST_PAGE);
        }
    }
}

/// A fresh shared mapping of `length` bytes of the map `map` from `offset`; the caller unmaps
/// it.
fn map_shared(
    map: &OwnedFd,
    length: usize,
    protection: ProtFlags,
    offset: libc::off_t,
) -> std::io::Result<NonNull<std::ffi::c_void>> {
    let length = NonZeroUsize::new(length).ok_or(std::io::ErrorKind::InvalidInput)?;
    // SAFETY: a new mapping, placed by the kernel, of a map's memory: it aliases no Rust
    // object, and what is in it is read and written only through atomics.
    let mapped = unsafe {
        mmap(
            None,
            length,
            protection,
            MapFlags::MAP_SHARED,
            map.as_fd(),
            offset,
        )
    }?;
    Ok(mapped)
}

/// A mappable array map of 64-bit words, mapped: its values, in key order.
pub struct WordArrayMapping {
    base: NonNull<AtomicU64>,
    words: usize,
    map_len: usize,
}

// SAFETY: the mapping is plain shared memory, accessed only through atomics; it belongs to this
// value, and no thread owns it.
unsafe impl Send for WordArrayMapping {}
// SAFETY: as above: every access is an atomic load or read-modify-write.
unsafe impl Sync for WordArrayMapping {}

impl WordArrayMapping {
    /// Map the array map `map` of `words` words (made by `create_word_array`).
    pub fn map(map: &OwnedFd, words: usize) -> std::io::Result<Self> {
        let map_len = (words * 8).div_ceil(HOST_PAGE) * HOST_PAGE;
        // An mmapable array maps its values from offset 0, 8 bytes a key.
        let base = map_shared(
            map,
            map_len,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            0,
        )?;
        Ok(Self {
            base: base.cast(),
            words,
            map_len,
        })
    }

    pub fn words(&self) -> &[AtomicU64] {
        // SAFETY: `words` 8-byte words, page-aligned, mapped for our lifetime; every access is
        // atomic (the kernel's program changes them with atomic instructions too).
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.words) }
    }
}

impl Drop for WordArrayMapping {
    fn drop(&mut self) {
        // SAFETY: our mapping, of the length it was made with; no reference into it outlives
        // `self`.
        let _ = unsafe { munmap(self.base.cast(), self.map_len) };
    }
}
