//! Kernel zram on the same pages (`--compare-zram`): reset zram0, the algorithm asked for
//! (`--zram-algorithm`, lz4 by default), O_DIRECT 1 MiB writes and reads of the corpus,
//! mm_stat, reset again.

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::corpus::{AlignedBuf, Corpus};
use super::{gbps, BenchError, Progress};

const ZRAM_SYS: &str = "/sys/block/zram0";
const ZRAM_DEV: &str = "/dev/zram0";
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

/// The fields of `/sys/block/zram0/mm_stat` the report uses.
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

fn sys_path(attribute: &str) -> String {
    format!("{ZRAM_SYS}/{attribute}")
}

fn set_attribute(attribute: &str, value: &str) -> Result<(), BenchError> {
    std::fs::write(sys_path(attribute), value).map_err(|source| BenchError::Zram {
        what: format!("writing '{value}' to {}", sys_path(attribute)),
        source,
    })
}

fn read_attribute(attribute: &str) -> Result<String, BenchError> {
    std::fs::read_to_string(sys_path(attribute)).map_err(|source| BenchError::Zram {
        what: format!("reading {}", sys_path(attribute)),
        source,
    })
}

/// Check that zram0 can be used: present, we are root, and it is neither swap nor mounted.
fn check_usable() -> Result<(), BenchError> {
    if !Path::new(ZRAM_SYS).exists() {
        return Err(BenchError::ZramUnavailable(
            "/sys/block/zram0 does not exist: load the module (modprobe zram) or drop --compare-zram"
                .into(),
        ));
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(BenchError::ZramUnavailable(
            "resetting and configuring zram0 needs root: run as root or drop --compare-zram".into(),
        ));
    }
    let in_use = |table: &str| {
        std::fs::read_to_string(table).is_ok_and(|text| {
            text.lines()
                .any(|line| line.split_whitespace().next() == Some(ZRAM_DEV))
        })
    };
    if in_use("/proc/swaps") {
        return Err(BenchError::ZramUnavailable(
            "zram0 is an active swap device: swapoff /dev/zram0 first".into(),
        ));
    }
    if in_use("/proc/mounts") {
        return Err(BenchError::ZramUnavailable(
            "zram0 is mounted: unmount it first".into(),
        ));
    }
    Ok(())
}

/// Resets zram0 when dropped, so an error half-way leaves no pages in kernel memory.
struct ResetOnDrop;

impl Drop for ResetOnDrop {
    fn drop(&mut self) {
        if let Err(error) = set_attribute("reset", "1") {
            tracing::warn!("could not reset zram0 after the bench: {error}");
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
fn timed_streams<T, F>(work: Vec<T>, what: &str, io: F) -> Result<Duration, BenchError>
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
                .map_err(|source| BenchError::Zram {
                    what: format!("{what} {ZRAM_DEV}"),
                    source,
                })?;
        }
        Ok(start.elapsed())
    })
}

/// Write the corpus to zram0 and read it back; `scratch` (corpus-sized) receives the reads.
pub fn compare(
    corpus: &Corpus,
    scratch: &mut AlignedBuf,
    streams: usize,
    algorithm: &str,
    progress: &Progress,
) -> Result<ZramReport, BenchError> {
    check_usable()?;
    let algorithms = read_attribute("comp_algorithm")?;
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
    set_attribute("reset", "1")?;
    let _reset = ResetOnDrop;
    set_attribute("comp_algorithm", algorithm)?;
    let disksize = data.len().div_ceil(IO_CHUNK) * IO_CHUNK;
    set_attribute("disksize", &disksize.to_string())?;

    let device: File = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(ZRAM_DEV)
        .map_err(|source| BenchError::Zram {
            what: format!("opening {ZRAM_DEV} with O_DIRECT"),
            source,
        })?;

    progress.phase("zram write", data.len() as u64);
    let ranges = stream_ranges(data.len(), streams);
    let write_time = timed_streams(ranges, "O_DIRECT write to", |range| {
        for offset in range.clone().step_by(IO_CHUNK) {
            let chunk = &data[offset..(offset + IO_CHUNK).min(range.end)];
            device.write_all_at(chunk, offset as u64)?;
            progress.advance(chunk.len() as u64);
        }
        Ok(())
    })?;
    let mm_stat = read_attribute("mm_stat")?;
    let stat = MmStat::parse(&mm_stat).ok_or_else(|| {
        BenchError::ZramUnavailable(format!(
            "cannot parse /sys/block/zram0/mm_stat: '{}'",
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
    let read_time = timed_streams(parts, "O_DIRECT read of", |(base, part)| {
        for (index, chunk) in part.chunks_mut(IO_CHUNK).enumerate() {
            device.read_exact_at(chunk, (base + index * IO_CHUNK) as u64)?;
            progress.advance(chunk.len() as u64);
        }
        Ok(())
    })?;
    drop(device);
    super::verify("zram read-back", scratch.as_slice(), |page| {
        corpus.page(page)
    })?;

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

fn ratio(numerator: u64, denominator: u64) -> f64 {
    if denominator == 0 {
        0.0
    } else {
        numerator as f64 / denominator as f64
    }
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
