//! `trueno-ublk swapon`: enable a device as swap with the priority its config section gives,
//! and discard on. `trueno-ublk fault-in`: bring a process's swapped-out pages back into its
//! memory while every device is served (the unit does it for PID 1 before a stop).

#![forbid(unsafe_code)]

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use thiserror::Error;

use crate::config::{self, ConfigError};
use crate::devices::{GateUnavailable, HandOverGate};
use crate::ublk::device::block_path;

#[derive(Debug, Error)]
pub enum SwapError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("'{command}' failed: {source}{}", swapon_hint(source))]
    Swapon {
        command: String,
        source: std::io::Error,
    },
    #[error("no process {pid}")]
    NoProcess { pid: u32 },
    #[error("cannot read {path} ({source}): run as root, outside any sandbox")]
    ProcessMemory {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Devices(#[from] crate::devices::DevicesError),
}

/// What to do about a failed swapon(2), where its errno says it.
fn swapon_hint(error: &std::io::Error) -> &'static str {
    match error.raw_os_error() {
        Some(libc::EINVAL) => " (no swap signature on the device? run mkswap on it first)",
        Some(libc::EBUSY) => " (it is swap already, or mounted or otherwise in use)",
        Some(libc::ENOENT | libc::ENXIO | libc::ENODEV) => {
            " (no such device: see `trueno-ublk list`)"
        }
        Some(libc::EPERM) => " (needs root, or too many swap areas)",
        _ => "",
    }
}

/// The swap priority of device `id`: its section's `swap-priority` in `config_path`, else the
/// default.
pub fn priority(id: u32, config_path: Option<&Path>) -> Result<u16, ConfigError> {
    Ok(config::load_for(config_path, Some(id))?.swap_priority(id))
}

/// The swapon command line for device `id`: discard on (how freed slots give memory back
/// where the daemon's slot-free probe does not run, and for slots freed while no process
/// serves the device) and the priority. Short
/// options, because util-linux and busybox both accept them.
pub fn swapon_command(id: u32, priority: u16) -> Vec<String> {
    vec![
        "swapon".to_string(),
        "-d".to_string(),
        "-p".to_string(),
        priority.to_string(),
        block_path(id),
    ]
}

/// Enable `/dev/ublkb{id}` as swap with `priority` and discard: swapon(2) itself, because
/// busybox's swapon (in minimal systems) has no priority option.
pub fn swapon(id: u32, priority: u16) -> Result<(), SwapError> {
    let failed = |source| SwapError::Swapon {
        command: swapon_command(id, priority).join(" "),
        source,
    };
    let path = std::ffi::CString::new(block_path(id))
        .map_err(|_| failed(std::io::ErrorKind::InvalidInput.into()))?;
    crate::os::swapon(&path, priority).map_err(failed)
}

/// What `fault_in` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultIn {
    /// The process's swapped-out pages were read: `swapped` pages were out before,
    /// `still_swapped` after (swapped out again at once, or their read failed).
    /// `out_of_reach`: pages its smaps counts as swapped out that its page tables do not show
    /// (shared memory: a shmem or memfd mapping's swapped pages are in the shared object,
    /// not in the process's page table), which are left where they are: reading every page
    /// of such a mapping to find them would fill its holes with new memory.
    Read {
        swapped: u64,
        still_swapped: u64,
        out_of_reach: u64,
    },
    /// Nothing (more) was read: a ublk device is not served right now (quiesced between two
    /// daemons, or its daemon is gone), and a read of a page of the process on it would wait
    /// for the next daemon.
    NotServed { path: String, state: &'static str },
}

/// `/proc/PID/pagemap`: bit 62 of a page's entry says the page is swapped out.
const PAGEMAP_SWAPPED: u64 = 1 << 62;
/// Pagemap entries read at once.
const PAGEMAP_CHUNK: usize = 512;

/// Read every swapped-out page of process `pid` back into its memory (one byte of each, read
/// through `/proc/PID/mem`, faults the page in as the process's own access would), but only
/// while every ublk device is served: a read of a page on a device between two daemons would
/// wait for the next one. The unit runs this for PID 1 before a stop: PID 1 starts the next
/// daemon while the device waits, and must not wait on a page of its own there.
pub fn fault_in(pid: u32) -> Result<FaultIn, SwapError> {
    let mut held = None;
    if let Some(waits) = look(&mut held)? {
        return Ok(waits);
    }
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(SwapError::NoProcess { pid });
    }
    let proc_file = |name: &str| format!("/proc/{pid}/{name}");
    let unreadable = |path: String| move |source| SwapError::ProcessMemory { path, source };
    let smaps =
        std::fs::read_to_string(proc_file("smaps")).map_err(unreadable(proc_file("smaps")))?;
    let pagemap = File::open(proc_file("pagemap")).map_err(unreadable(proc_file("pagemap")))?;
    let memory = File::open(proc_file("mem")).map_err(unreadable(proc_file("mem")))?;
    let page = crate::mem::HOST_PAGE as u64;
    let (mappings, swap_kib) = swapped_mappings(&smaps);
    let mut swapped = 0;
    // Looked at again as the walk goes: a device handed over meanwhile (another unit's stop)
    // would hold a read of a page on it, with the process's memory map locked (PID 1 could
    // then not fork the next daemon), until the next daemon serves it.
    let mut stopped: Result<Option<FaultIn>, SwapError> = Ok(None);
    for mapping in &mappings {
        for_each_page_with(&pagemap, mapping, page, PAGEMAP_SWAPPED, |address| {
            if !matches!(stopped, Ok(None)) {
                return;
            }
            if swapped % RECHECK_EVERY_PAGES == 0 {
                stopped = look(&mut held);
                if !matches!(stopped, Ok(None)) {
                    return;
                }
            }
            swapped += 1;
            // A failed read leaves the page out; the count after says so.
            let _ = memory.read_at(&mut [0u8], address);
        })
        .map_err(unreadable(proc_file("pagemap")))?;
        if let Some(waits) = std::mem::replace(&mut stopped, Ok(None))? {
            return Ok(waits);
        }
    }
    drop(held);
    let mut still_swapped = 0;
    for mapping in &mappings {
        for_each_page_with(&pagemap, mapping, page, PAGEMAP_SWAPPED, |_| {
            still_swapped += 1;
        })
        .map_err(unreadable(proc_file("pagemap")))?;
    }
    Ok(FaultIn::Read {
        swapped,
        still_swapped,
        out_of_reach: (swap_kib * 1024 / page).saturating_sub(swapped),
    })
}

/// Swapped-out pages `fault_in` reads between two looks at the devices' states.
const RECHECK_EVERY_PAGES: u64 = 64;

/// How long `fault_in` waits for hand-overs under way (each holds the gate until its device
/// is quiesced: well under a second when all is well) before it stops reading.
const GATE_PATIENCE: Duration = Duration::from_secs(5);

/// Look at the devices' states before the next reads, holding the hand-over gate in `held`
/// from then until the next look (`HandOverGate`): `FaultIn::NotServed` if a device's I/O
/// waits, or if hand-overs kept the gate from it for `GATE_PATIENCE` (a read now could wait
/// for a daemon on one of them).
fn look(held: &mut Option<HandOverGate>) -> Result<Option<FaultIn>, SwapError> {
    // The gate held since the last look goes first, so that a hand-over due can go.
    *held = None;
    match HandOverGate::for_reads(Path::new(crate::stats::SOCKET_DIR), GATE_PATIENCE) {
        Ok(gate) => *held = Some(gate),
        Err(GateUnavailable::Busy) => {
            return Ok(Some(FaultIn::NotServed {
                path: "a ublk device".to_string(),
                state: "being handed over",
            }))
        }
        // No lock files (no root: its reads would fail too): as before the gate.
        Err(GateUnavailable::NoLockFiles) => {}
    }
    device_io_waits()
}

/// `FaultIn::NotServed` for the first ublk device whose I/O would wait now, if any.
fn device_io_waits() -> Result<Option<FaultIn>, SwapError> {
    Ok(crate::devices::waiting_for_daemon()?
        .into_iter()
        .next()
        .map(|device| FaultIn::NotServed {
            path: block_path(device.id),
            state: device.state,
        }))
}

/// Call `each` with the address of every page of `mapping` whose `pagemap` entry has `flag`.
fn for_each_page_with(
    pagemap: &File,
    mapping: &Range<u64>,
    page: u64,
    flag: u64,
    mut each: impl FnMut(u64),
) -> std::io::Result<()> {
    const ENTRY: usize = std::mem::size_of::<u64>();
    let mut entries = [0u8; PAGEMAP_CHUNK * ENTRY];
    let mut address = mapping.start;
    while address < mapping.end {
        let pages = usize::try_from((mapping.end - address) / page)
            .unwrap_or(usize::MAX)
            .min(PAGEMAP_CHUNK);
        let want = &mut entries[..pages * ENTRY];
        pagemap.read_exact_at(want, address / page * ENTRY as u64)?;
        for entry in want.chunks_exact(ENTRY) {
            let entry = u64::from_le_bytes(entry.try_into().unwrap_or_default());
            if entry & flag != 0 {
                each(address);
            }
            address += page;
        }
    }
    Ok(())
}

/// The address ranges of the mappings in a `/proc/PID/smaps` text that have pages swapped out,
/// and the KiB swapped out in all.
fn swapped_mappings(smaps: &str) -> (Vec<Range<u64>>, u64) {
    let mut mappings = Vec::new();
    let mut total_kib = 0u64;
    let mut current = None;
    for line in smaps.lines() {
        if let Some(range) = crate::os::smaps_mapping_range(line) {
            current = Some(range);
        } else if let Some(kib) = line.strip_prefix("Swap:") {
            let kib: u64 = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0);
            if kib > 0 {
                mappings.extend(current.take());
                total_kib = total_kib.saturating_add(kib);
            }
        }
    }
    (mappings, total_kib)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_swapon_says_what_to_do() {
        let failed = |errno| {
            SwapError::Swapon {
                command: swapon_command(0, 100).join(" "),
                source: std::io::Error::from_raw_os_error(errno),
            }
            .to_string()
        };
        assert!(
            failed(libc::EINVAL).contains("run mkswap"),
            "{}",
            failed(libc::EINVAL)
        );
        assert!(failed(libc::EBUSY).contains("swap already"));
        assert!(
            failed(libc::EIO).ends_with("(os error 5)"),
            "{}",
            failed(libc::EIO)
        );
    }

    #[test]
    fn mappings_with_swapped_pages_are_read_from_smaps() {
        let smaps = "\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Swap:                  8 kB
SwapPss:               8 kB
VmFlags: rd wr mr mw me ac sd
7f1e2c000000-7f1e2c021000 rw-p 00000000 00:00 0 
Size:                132 kB
Swap:                  0 kB
SwapPss:               0 kB
7f1e2d000000-7f1e2d100000 r--p 00001000 fe:01 1234                       /usr/lib/x86_64-linux-gnu/libc.so.6 (deleted)
Swap:                 12 kB
";
        assert_eq!(
            swapped_mappings(smaps),
            (
                vec![
                    0x55d0_c0a0_0000..0x55d0_c0a2_1000,
                    0x7f1e_2d00_0000..0x7f1e_2d10_0000
                ],
                20
            )
        );
        assert_eq!(swapped_mappings(""), (Vec::<Range<u64>>::new(), 0));
    }

    #[test]
    fn the_pagemap_walk_finds_each_page_of_a_range() {
        // The walk with another flag of the entry (bit 63, present) over memory this test has
        // just written: every page of the range, at its own address, and none twice.
        const PAGEMAP_PRESENT: u64 = 1 << 63;
        let page = crate::mem::HOST_PAGE;
        let pages = 40;
        let mut buffer = vec![1u8; page * (pages + 1)];
        for byte in buffer.iter_mut().step_by(page) {
            *byte = 2;
        }
        let page = page as u64;
        let start = (buffer.as_ptr() as u64).next_multiple_of(page);
        let range = start..start + pages as u64 * page;
        let pagemap = File::open("/proc/self/pagemap").expect("pagemap");
        let mut seen = Vec::new();
        for_each_page_with(&pagemap, &range, page, PAGEMAP_PRESENT, |address| {
            seen.push(address);
        })
        .expect("pagemap read");
        let want: Vec<u64> = range.clone().step_by(crate::mem::HOST_PAGE).collect();
        assert_eq!(seen, want);
        drop(buffer);
    }
}
