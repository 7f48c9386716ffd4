//! Kernel zram on the same pages (`--compare-zram`): a zram device of the bench's own (one
//! added through `/sys/class/zram-control/hot_add` and removed after; zram0 only where the
//! kernel cannot add one, and only if nobody set it up), the algorithm asked for
//! (`--zram-algorithm`, lz4 by default), O_DIRECT 1 MiB writes and reads of the corpus,
//! mm_stat, reset. Why not simply zram0: resetting a zram device that an administrator set
//! up but is not using this minute (swapped off, say) would destroy its set-up. A Ctrl-C or
//! SIGTERM while the bench holds the device stops its I/O at the next chunk and removes the
//! device before the bench ends (a second one ends it at once, as signals do).

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
use signal_hook::SigId;

use serde::Serialize;

use super::corpus::{AlignedBuf, Corpus};
use super::{gbps, ratio, BenchError, Progress};

const ZRAM_CONTROL: &str = "/sys/class/zram-control";
/// Size of one O_DIRECT request, as `dd bs=1M oflag=direct`.
const IO_CHUNK: usize = 1 << 20;

/// zram's figures for the corpus.
#[derive(Clone, Debug, Serialize)]
pub struct ZramReport {
    pub algorithm: String,
    /// Parallel O_DIRECT streams (each writes and reads its own contiguous part).
    pub streams: usize,
    pub write_gbps: f64,
    pub read_gbps: f64,
    /// orig_data_size / compr_data_size.
    pub ratio: f64,
    /// orig_data_size / mem_used_total.
    pub mem_ratio: f64,
    pub orig_data_size: u64,
    pub compr_data_size: u64,
    pub mem_used_total: u64,
    pub same_pages: u64,
    pub huge_pages: u64,
}

/// The fields of `/sys/block/zramN/mm_stat` the report uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MmStat {
    pub orig_data_size: u64,
    pub compr_data_size: u64,
    pub mem_used_total: u64,
    pub same_pages: u64,
    pub huge_pages: u64,
}

impl MmStat {
    /// Parse mm_stat: orig_data_size compr_data_size mem_used_total mem_limit mem_used_max
    /// same_pages pages_compacted huge_pages [huge_pages_since].
    pub fn parse(text: &str) -> Option<Self> {
        let fields: Vec<u64> = text
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        if fields.len() < 8 {
            return None;
        }
        Some(Self {
            orig_data_size: fields[0],
            compr_data_size: fields[1],
            mem_used_total: fields[2],
            same_pages: fields[5],
            huge_pages: fields[7],
        })
    }
}

/// The zram device the bench uses: removed when dropped if the bench added it, else reset if
/// the bench set it up, so an error half-way leaves no pages in kernel memory; a device the
/// bench did not touch is left alone.
struct ZramDevice {
    index: u32,
    added: bool,
    /// The bench has written its settings to the device (which then holds the bench's, not
    /// an administrator's).
    set_up: bool,
}

impl ZramDevice {
    /// A device of the bench's own where the kernel can add one, else zram0 if it is unused
    /// and not set up; root only.
    fn acquire() -> Result<Self, BenchError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(BenchError::ZramUnavailable(
                "setting up a zram device needs root: run as root or drop --compare-zram".into(),
            ));
        }
        let hot_add = format!("{ZRAM_CONTROL}/hot_add");
        if Path::new(&hot_add).exists() {
            // Reading hot_add adds a device and says its number.
            let text = std::fs::read_to_string(&hot_add).map_err(|source| BenchError::Zram {
                what: format!("adding a zram device ({hot_add})"),
                source,
            })?;
            let index = text.trim().parse().map_err(|_| {
                BenchError::ZramUnavailable(format!("{hot_add} answered '{}'", text.trim()))
            })?;
            let device = Self {
                index,
                added: true,
                set_up: false,
            };
            device.wait_for_node()?;
            return Ok(device);
        }
        let zram0 = Self {
            index: 0,
            added: false,
            set_up: false,
        };
        if !Path::new(&zram0.sys_path("")).exists() {
            return Err(BenchError::ZramUnavailable(
                "the kernel has no zram device: load the module (modprobe zram) or drop --compare-zram"
                    .into(),
            ));
        }
        zram0.check_unused()?;
        Ok(zram0)
    }

    /// zram0, used where no device can be added, must be neither in use nor set up: its
    /// reset would undo an administrator's set-up.
    fn check_unused(&self) -> Result<(), BenchError> {
        let node = self.node();
        let listed = |table: &str| {
            std::fs::read_to_string(table).map(|text| {
                text.lines()
                    .any(|line| line.split_whitespace().next() == Some(node.as_str()))
            })
        };
        for (table, what) in [
            ("/proc/swaps", "an active swap device"),
            ("/proc/mounts", "mounted"),
        ] {
            match listed(table) {
                Ok(false) => {}
                Ok(true) => {
                    return Err(BenchError::ZramUnavailable(format!(
                        "{node} is {what}, and this kernel cannot add a zram device for the bench: drop --compare-zram"
                    )))
                }
                Err(source) => {
                    return Err(BenchError::Zram {
                        what: format!("reading {table}"),
                        source,
                    })
                }
            }
        }
        if self.read("disksize")?.trim() != "0" {
            return Err(BenchError::ZramUnavailable(format!(
                "{node} is set up (its disksize is not 0), and this kernel cannot add a zram device for the bench: reset it yourself (echo 1 > {}) or drop --compare-zram",
                self.sys_path("reset")
            )));
        }
        Ok(())
    }

    /// The node of a device just added appears when devtmpfs (or udev) makes it.
    fn wait_for_node(&self) -> Result<(), BenchError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !Path::new(&self.node()).exists() {
            if Instant::now() > deadline {
                return Err(BenchError::ZramUnavailable(format!(
                    "{} did not appear within 5 s of adding zram{}",
                    self.node(),
                    self.index
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    fn node(&self) -> String {
        format!("/dev/zram{}", self.index)
    }

    fn sys_path(&self, attribute: &str) -> String {
        format!("/sys/block/zram{}/{attribute}", self.index)
    }

    /// Write one of the bench's settings; from then on the device is the bench's to reset.
    fn set(&mut self, attribute: &str, value: &str) -> Result<(), BenchError> {
        self.set_up = true;
        std::fs::write(self.sys_path(attribute), value).map_err(|source| BenchError::Zram {
            what: format!("writing '{value}' to {}", self.sys_path(attribute)),
            source,
        })
    }

    fn read(&self, attribute: &str) -> Result<String, BenchError> {
        std::fs::read_to_string(self.sys_path(attribute)).map_err(|source| BenchError::Zram {
            what: format!("reading {}", self.sys_path(attribute)),
            source,
        })
    }
}

impl Drop for ZramDevice {
    fn drop(&mut self) {
        if !self.added && !self.set_up {
            // zram0 refused (in use, set up) or never written: not the bench's.
            return;
        }
        // A reset (or a removal) is refused while the device is open: udev's probe after our
        // close may hold it a moment.
        let mut tries = 0;
        loop {
            let done = if self.added {
                std::fs::write(format!("{ZRAM_CONTROL}/hot_remove"), self.index.to_string())
            } else {
                std::fs::write(self.sys_path("reset"), "1")
            };
            match done {
                Ok(()) => return,
                Err(error) if error.raw_os_error() == Some(libc::EBUSY) && tries < 50 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                // Said on stderr: the bench sets up no log.
                Err(error) => {
                    let undo = if self.added {
                        format!("echo {} > {ZRAM_CONTROL}/hot_remove", self.index)
                    } else {
                        format!("echo 1 > {}", self.sys_path("reset"))
                    };
                    crate::os::print_err(&format!(
                        "trueno-ublk bench: could not {} zram{} after the bench ({error}): it still \
                         holds the corpus; once nothing has it open: {undo}",
                        if self.added { "remove" } else { "reset" },
                        self.index
                    ));
                    return;
                }
            }
        }
    }
}

/// The signals that end the bench: caught while it holds a zram device, so that the device is
/// removed (`ZramDevice`'s drop) rather than left behind, holding the corpus in kernel memory,
/// by a process the signal ended.
const INTERRUPTS: [libc::c_int; 4] = [SIGINT, SIGTERM, SIGHUP, SIGQUIT];
/// What failed when one of them could not be caught.
const CATCHING: &str = "catching Ctrl-C, SIGTERM, SIGHUP and SIGQUIT";

/// Whether one of `INTERRUPTS` came while a zram device was held; true while none is held, so
/// that such a signal then ends the process as if nothing were caught.
static INTERRUPTED: OnceLock<Result<Arc<AtomicBool>, std::io::ErrorKind>> = OnceLock::new();

/// The flag of `INTERRUPTED`, with each signal's conditional default registered the first
/// time. Those stay for the process's life: signal-hook cannot give a signal its default back
/// once a handler is gone (it would be ignored), so between zram phases they end the process.
fn interrupted_flag() -> Result<Arc<AtomicBool>, BenchError> {
    INTERRUPTED
        .get_or_init(|| {
            let flag = Arc::new(AtomicBool::new(true));
            for signal in INTERRUPTS {
                signal_hook::flag::register_conditional_default(signal, Arc::clone(&flag))
                    .map_err(|error| error.kind())?;
            }
            Ok(flag)
        })
        .clone()
        .map_err(|kind| BenchError::Zram {
            what: CATCHING.to_string(),
            source: kind.into(),
        })
}

/// The bench's signals caught while it holds a zram device: the first one only sets a flag,
/// which ends the I/O; a second one, or one after the device is gone, ends the process.
struct Interrupts {
    caught: Arc<AtomicBool>,
    handlers: Vec<SigId>,
}

impl Interrupts {
    fn catch() -> Result<Self, BenchError> {
        let caught = interrupted_flag()?;
        let mut interrupts = Self {
            caught: Arc::clone(&caught),
            handlers: Vec::new(),
        };
        // Runs after the conditional default (registered first), which reads the flag before
        // this sets it.
        for signal in INTERRUPTS {
            let handler =
                signal_hook::flag::register(signal, Arc::clone(&caught)).map_err(|source| {
                    BenchError::Zram {
                        what: CATCHING.to_string(),
                        source,
                    }
                })?;
            interrupts.handlers.push(handler);
        }
        caught.store(false, Ordering::SeqCst);
        Ok(interrupts)
    }

    /// An error that ends the I/O once a signal came.
    fn check(&self) -> std::io::Result<()> {
        if self.caught.load(Ordering::Relaxed) {
            Err(std::io::ErrorKind::Interrupted.into())
        } else {
            Ok(())
        }
    }
}

impl Drop for Interrupts {
    fn drop(&mut self) {
        // From here on the conditional defaults end the process at the first signal.
        self.caught.store(true, Ordering::SeqCst);
        for handler in self.handlers.drain(..) {
            signal_hook::low_level::unregister(handler);
        }
    }
}

/// Split `len` bytes into `streams` contiguous parts on `IO_CHUNK` boundaries.
fn stream_ranges(len: usize, streams: usize) -> Vec<std::ops::Range<usize>> {
    let chunks = len.div_ceil(IO_CHUNK);
    let per_stream = chunks.div_ceil(streams.max(1)).max(1);
    (0..chunks)
        .step_by(per_stream)
        .map(|first| first * IO_CHUNK..((first + per_stream) * IO_CHUNK).min(len))
        .collect()
}

/// Run `io` on each stream's work in its own thread; returns the wall time.
fn timed_streams<T, F>(work: Vec<T>, what: String, io: F) -> Result<Duration, BenchError>
where
    T: Send,
    F: Fn(T) -> std::io::Result<()> + Sync,
{
    let start = Instant::now();
    std::thread::scope(|scope| {
        let workers: Vec<_> = work
            .into_iter()
            .map(|item| scope.spawn(|| io(item)))
            .collect();
        for worker in workers {
            worker
                .join()
                .map_err(|_| BenchError::WorkerPanicked)?
                .map_err(|source| match source.kind() {
                    // `Interrupts::check`: the positioned I/O retries EINTR itself.
                    std::io::ErrorKind::Interrupted => BenchError::Interrupted,
                    _ => BenchError::Zram {
                        what: what.clone(),
                        source,
                    },
                })?;
        }
        Ok(start.elapsed())
    })
}

/// Write the corpus to a zram device and read it back; `scratch` (corpus-sized) receives the
/// reads.
pub fn compare(
    corpus: &Corpus,
    scratch: &mut AlignedBuf,
    streams: usize,
    algorithm: &str,
    progress: &Progress,
) -> Result<ZramReport, BenchError> {
    // Caught before the device exists and let go after it is gone (drops run in reverse).
    let interrupts = Interrupts::catch()?;
    let mut zram = ZramDevice::acquire()?;
    let algorithms = zram.read("comp_algorithm")?;
    if !algorithms
        .split_whitespace()
        .any(|name| name.trim_matches(|c| c == '[' || c == ']') == algorithm)
    {
        return Err(BenchError::ZramUnavailable(format!(
            "this kernel's zram has no {algorithm} (it offers: {})",
            algorithms.trim()
        )));
    }
    let data = corpus.bytes();
    // No reset first: the device is fresh (added) or was found with no disksize (zram0),
    // and a reset of one udev still probes is refused.
    zram.set("comp_algorithm", algorithm)?;
    let disksize = data.len().div_ceil(IO_CHUNK) * IO_CHUNK;
    zram.set("disksize", &disksize.to_string())?;

    let node = zram.node();
    let device: File = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&node)
        .map_err(|source| BenchError::Zram {
            what: format!("opening {node} with O_DIRECT"),
            source,
        })?;

    progress.phase("zram write", data.len() as u64);
    let ranges = stream_ranges(data.len(), streams);
    // What ran: a small corpus has fewer 1 MiB chunks than streams asked for.
    let streams = ranges.len();
    let write_time = timed_streams(ranges, format!("O_DIRECT write to {node}"), |range| {
        for offset in range.clone().step_by(IO_CHUNK) {
            interrupts.check()?;
            let chunk = &data[offset..(offset + IO_CHUNK).min(range.end)];
            device.write_all_at(chunk, offset as u64)?;
            progress.advance(chunk.len() as u64);
        }
        Ok(())
    })?;
    let mm_stat = zram.read("mm_stat")?;
    let stat = MmStat::parse(&mm_stat).ok_or_else(|| {
        BenchError::ZramUnavailable(format!(
            "cannot parse {}: '{}'",
            zram.sys_path("mm_stat"),
            mm_stat.trim()
        ))
    })?;

    scratch.poison();
    let out = scratch.as_mut_slice();
    progress.phase("zram read", data.len() as u64);
    let mut parts = Vec::new();
    let mut rest = out;
    for range in stream_ranges(data.len(), streams) {
        let (part, tail) = rest.split_at_mut(range.len());
        parts.push((range.start, part));
        rest = tail;
    }
    let read_time = timed_streams(parts, format!("O_DIRECT read of {node}"), |(base, part)| {
        for (index, chunk) in part.chunks_mut(IO_CHUNK).enumerate() {
            interrupts.check()?;
            device.read_exact_at(chunk, (base + index * IO_CHUNK) as u64)?;
            progress.advance(chunk.len() as u64);
        }
        Ok(())
    })?;
    drop(device);
    super::verify("zram read-back", scratch.as_slice(), |page| {
        corpus.page(page)
    })?;
    // A signal after the I/O (the checks above, the device's removal) ends the bench too.
    drop(zram);
    interrupts.check().map_err(|_| BenchError::Interrupted)?;

    Ok(ZramReport {
        algorithm: algorithm.to_string(),
        streams,
        write_gbps: gbps(data.len(), write_time),
        read_gbps: gbps(data.len(), read_time),
        ratio: ratio(stat.orig_data_size, stat.compr_data_size),
        mem_ratio: ratio(stat.orig_data_size, stat.mem_used_total),
        orig_data_size: stat.orig_data_size,
        compr_data_size: stat.compr_data_size,
        mem_used_total: stat.mem_used_total,
        same_pages: stat.same_pages,
        huge_pages: stat.huge_pages,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mm_stat_parses_kernel_format() {
        let stat = MmStat::parse(
            "  1073741824 324009984 333713408        0 333713408     4213        0    10911        0\n",
        )
        .unwrap();
        assert_eq!(stat.orig_data_size, 1 << 30);
        assert_eq!(stat.compr_data_size, 324009984);
        assert_eq!(stat.mem_used_total, 333713408);
        assert_eq!(stat.same_pages, 4213);
        assert_eq!(stat.huge_pages, 10911);
        assert_eq!(MmStat::parse("1 2 3"), None);
        assert_eq!(MmStat::parse("a b c d e f g h"), None);
    }

    #[test]
    fn streams_cover_the_corpus_on_chunk_boundaries() {
        for (len, streams) in [
            (4096, 1),
            (3 * IO_CHUNK + 4096, 2),
            (10 * IO_CHUNK, 3),
            (IO_CHUNK, 4),
        ] {
            let ranges = stream_ranges(len, streams);
            assert!(ranges.len() <= streams);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges.last().unwrap().end, len);
            for pair in ranges.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
                assert_eq!(pair[0].end % IO_CHUNK, 0);
            }
        }
    }
}
