//! The kernel calls of the probe: bpf(2) (an array map, a kprobe program),
//! perf_event_open(2) (the kprobe it runs on) and the array's mapping. All `unsafe` of the
//! probe lives here.

use std::ffi::CString;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

use super::program::Insn;

const BPF_MAP_CREATE: libc::c_int = 0;
const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
/// An array map user space may mmap (Linux 5.5+).
const BPF_F_MMAPABLE: u32 = 1 << 10;
const BPF_PROG_TYPE_KPROBE: u32 = 2;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
/// `_IO('$', 0)` and `_IOW('$', 8, __u32)` from include/uapi/linux/perf_event.h.
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;
/// Where the kernel says which perf event type its kprobes are.
const KPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/kprobe/type";
const HOST_PAGE: usize = 4096;

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
    // two commands used here.
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

/// Load `program` as a kprobe program. On failure, the error and the verifier's log.
pub fn load_kprobe_program(
    program: &[Insn],
    name: &str,
) -> Result<OwnedFd, (std::io::Error, String)> {
    let bytes: Vec<u8> = program.iter().flat_map(|insn| insn.to_bytes()).collect();
    let license = c"Dual MIT/GPL";
    let load = |log: &mut [u8]| {
        let mut attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_KPROBE,
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
        let length = NonZeroUsize::new(map_len).ok_or(std::io::ErrorKind::InvalidInput)?;
        // SAFETY: a fresh shared mapping of the map's values (an mmapable array maps them from
        // offset 0, 8 bytes a key); it aliases no Rust object.
        let base = unsafe {
            mmap(
                None,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                map.as_fd(),
                0,
            )
        }?;
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
