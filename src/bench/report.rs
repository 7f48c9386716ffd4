//! What a bench run measured, as one serializable object, and its text form.

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::cpu::PhaseCpu;
use super::zram::ZramReport;
use crate::store::StoreStats;

/// Latency percentiles of one operation, in microseconds (nearest-rank).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub samples: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Percentiles {
    pub fn from_samples(mut samples: Vec<Duration>) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let rank = |quantile: f64| {
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                reason = "a quantile in 0..=1 of the sample count: a non-negative index, clamped"
            )]
            let index = (quantile * samples.len() as f64).ceil() as usize;
            samples[index.clamp(1, samples.len()) - 1].as_nanos() as f64 / 1000.0
        };
        Self {
            samples: samples.len(),
            p50_us: rank(0.50),
            p99_us: rank(0.99),
            p999_us: rank(0.999),
            max_us: rank(1.0),
        }
    }
}

/// Latencies measured with the flusher running (the spec's G.111–G.114).
#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencyReport {
    /// `write` of one page (batched: a copy into the pending batch).
    pub write_page: Percentiles,
    /// `read` of one stored page.
    pub read_page: Percentiles,
    /// Pages per flushed batch: 1000, or the batch threshold or the corpus if smaller.
    pub flush_pages: usize,
    /// From the write that fills a batch until `flush_pending` returns with all of it stored.
    pub batch_flush: Percentiles,
    /// Pages per batch read: 1000, or the corpus if smaller.
    pub batch_pages: usize,
    /// One `read` of `batch_pages` consecutive stored pages.
    pub batch_read: Percentiles,
    /// What the recompressor did while the single-page figures were taken; `None` with
    /// recompression off.
    pub recompressor: Option<RecompressorWork>,
}

/// The recompressor's work over a span of the bench.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RecompressorWork {
    /// Pages it recompressed.
    pub pages: u64,
    /// CPU seconds it spent.
    pub cpu_seconds: f64,
    /// The span's length in seconds.
    pub seconds: f64,
}

/// The codec alone on the same pages and cores: every page through `compress_batch` and
/// `decompress_batch` in batches of the store's threshold.
#[derive(Clone, Debug, Serialize)]
pub struct CodecReport {
    pub backend: String,
    pub batch_pages: usize,
    pub compress_gbps: f64,
    pub decompress_gbps: f64,
    /// Corpus bytes / compressed bytes (every page through the codec, none classified away).
    pub ratio: f64,
    /// Store write GB/s / codec compress GB/s.
    pub store_write_share: f64,
    /// Store read GB/s / codec decompress GB/s.
    pub store_read_share: f64,
}

/// The corpus overwritten in random order with its pages in a shuffled placement.
#[derive(Clone, Debug, Serialize)]
pub struct OverwriteReport {
    pub passes: u32,
    pub write_gbps: f64,
    /// Right after the overwrites (recompression has not caught up).
    pub mem_ratio: f64,
    /// Change of the memory ratio against `mem_ratio_hot` of the first write, in percent.
    pub mem_ratio_change_pct: f64,
    pub stats: StoreStats,
}

/// The wait for the recompressor after the read pass (see `bench::settle`).
#[derive(Clone, Debug, Serialize)]
pub struct SettleReport {
    /// Whether every page was dealt with before the bound (idle threshold + 300 s).
    pub settled: bool,
    /// Seconds from the end of the read pass (pages go idle from then on) until settled.
    pub seconds: f64,
    /// Pages recompressed meanwhile.
    pub recompressed_pages: u64,
    /// CPU seconds the recompressor spent meanwhile.
    pub cpu_seconds: f64,
    /// The store's counters then.
    pub stats: StoreStats,
}

/// The throughputs of one round (GB/s).
#[derive(Clone, Debug, Serialize)]
pub struct RunFigures {
    /// From the store made (its chunk reserve filled) until `flush_pending` returned.
    pub write_gbps: f64,
    /// Seconds to make the store and start its flusher, before the writes.
    pub store_setup_s: f64,
    /// As the bench measured `write_gbps` until 2026-12-05: with the store's making counted.
    pub write_gbps_with_setup: f64,
    pub read_gbps: f64,
    pub codec_compress_gbps: f64,
    pub codec_decompress_gbps: f64,
    pub zram_write_gbps: Option<f64>,
    pub zram_read_gbps: Option<f64>,
    /// Where the store's write phase (writes and the flush) spent CPU, by thread.
    pub write_cpu: PhaseCpu,
}

/// Ours divided by zram's.
#[derive(Clone, Debug, Serialize)]
pub struct VersusZram {
    pub write: f64,
    pub read: f64,
    pub ratio: f64,
    /// Settled, as `BenchReport::mem_ratio`.
    pub mem_ratio: f64,
    pub mem_ratio_hot: f64,
}

/// Everything one bench run measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub corpus: String,
    pub pages: usize,
    pub bytes: u64,
    pub algorithm: String,
    pub backend: String,
    pub batched: bool,
    pub batch_threshold: usize,
    pub flush_timeout_ms: u64,
    pub threads: usize,
    pub request_bytes: usize,
    /// Runs of the store's write and read, the codec alone and zram; the best one counts.
    pub repeat: usize,
    /// The machine's 1, 5 and 15 minute load averages when the run started.
    pub load_average: [f64; 3],
    /// Corpus bytes / time from the store made (its chunk reserve filled, as the daemon's
    /// `create` does before the device is live) until `flush_pending` returned (GB = 10^9 B).
    /// Until 2026-12-05 the making was counted: `write_gbps_with_setup`.
    pub write_gbps: f64,
    /// The best round's `write_gbps_with_setup` (see `RunFigures`).
    pub write_gbps_with_setup: f64,
    /// Seconds the store took to be made in the round of the best `write_gbps`.
    pub store_setup_s: f64,
    /// Corpus bytes / time to read every page back.
    pub read_gbps: f64,
    /// Each round's figures (GB/s); the headline figures are the best of these.
    pub runs: Vec<RunFigures>,
    /// orig / compressed bytes, settled.
    pub ratio: f64,
    /// orig bytes / memory holding pages, settled: once the recompressor has dealt with every
    /// page (the same as `mem_ratio_hot` without recompression).
    pub mem_ratio: f64,
    /// orig bytes / memory holding pages right after the writes and the flush.
    pub mem_ratio_hot: f64,
    /// orig bytes / (memory holding pages + the chunk reserve's committed memory) right after
    /// the writes and the flush: what the store held then (zram has no reserve).
    pub mem_ratio_hot_with_reserve: f64,
    /// orig bytes / (memory holding pages + the chunk reserve + metadata + pending-batch
    /// buffers), settled.
    pub mem_ratio_all_in: f64,
    /// Metadata bytes (page table, idle hints, allocator bookkeeping) per page of the device.
    pub metadata_bytes_per_page: f64,
    /// Background recompression: `zstd:3,idle=30s`, or `off`.
    pub recompress: String,
    /// The wait for the recompressor; `None` without recompression.
    pub settle: Option<SettleReport>,
    /// The store's counters right after the first write and flush.
    pub stats: StoreStats,
    pub overwrite: Option<OverwriteReport>,
    pub codec: CodecReport,
    pub latency: LatencyReport,
    pub zram: Option<ZramReport>,
    pub vs_zram: Option<VersusZram>,
}

fn latency_row(out: &mut String, name: &str, p: &Percentiles) {
    let _ = writeln!(
        out,
        "  {name:<22} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8}",
        p.p50_us, p.p99_us, p.p999_us, p.max_us, p.samples
    );
}

impl BenchReport {
    /// The human-readable report.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let s = &self.stats;
        let _ = writeln!(
            out,
            "corpus: {} — {} pages, {:.1} MiB (load average {:.2} {:.2} {:.2} at the start)",
            self.corpus,
            self.pages,
            self.bytes as f64 / (1u64 << 20) as f64,
            self.load_average[0],
            self.load_average[1],
            self.load_average[2]
        );
        let _ = writeln!(
            out,
            "store: {} algorithm, {} checksums, {} backend, {}, {} writer/reader threads, {}-byte requests",
            self.algorithm,
            self.stats.checksum,
            self.backend,
            if self.batched {
                format!(
                    "batches of {} pages or {} ms",
                    self.batch_threshold, self.flush_timeout_ms
                )
            } else {
                "per-page (not batched)".to_string()
            },
            self.threads,
            self.request_bytes
        );
        let _ = writeln!(
            out,
            "  write {:>7.3} GB/s   read {:>7.3} GB/s   (GB = 10^9 bytes; every byte verified)",
            self.write_gbps, self.read_gbps
        );
        let _ = writeln!(
            out,
            "  the store was made in {:.3} s before the writes (its chunk reserve filled); counted with them, write {:.3} GB/s",
            self.store_setup_s, self.write_gbps_with_setup
        );
        if self.repeat > 1 {
            let _ = writeln!(
                out,
                "  best of {} rounds; each round (GB/s): store write, read; codec compress, decompress; zram write, read",
                self.repeat
            );
            let optional =
                |value: Option<f64>| value.map_or("-".to_string(), |v| format!("{v:.3}"));
            for (number, r) in self.runs.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "    {}: {:.3} {:.3}; {:.3} {:.3}; {} {}",
                    number + 1,
                    r.write_gbps,
                    r.read_gbps,
                    r.codec_compress_gbps,
                    r.codec_decompress_gbps,
                    optional(r.zram_write_gbps),
                    optional(r.zram_read_gbps)
                );
            }
        }
        if let Some(settle) = &self.settle {
            let _ = writeln!(
                out,
                "  recompress {}: {} after the read pass: {} pages recompressed, {} moved to compact, in {:.1} s ({:.1} CPU s){}",
                self.recompress,
                if settle.settled { "settled" } else { "NOT settled" },
                settle.recompressed_pages,
                settle.stats.compacted_pages,
                settle.seconds,
                settle.cpu_seconds,
                if settle.settled { "" } else { " before the bound" }
            );
        }
        let _ = writeln!(
            out,
            "  ratio {:>7.3} (orig/compressed)   memory ratio {:.3} (orig/memory used, as zram's mem_used_total){}; {:.3} right after the writes with the chunk reserve then held ({} MiB)",
            self.ratio,
            self.mem_ratio,
            if self.settle.is_some() {
                format!(", settled; {:.3} right after the writes", self.mem_ratio_hot)
            } else {
                String::new()
            },
            self.mem_ratio_hot_with_reserve,
            self.stats.reserve_bytes >> 20
        );
        let _ = writeln!(
            out,
            "  with the chunk reserve, page table and batch buffers: memory ratio {:.3}, metadata {:.1} B/page",
            self.mem_ratio_all_in, self.metadata_bytes_per_page
        );
        let _ = writeln!(
            out,
            "  pages: same-filled {} (zero {}), huge {}, lz4 {}, zstd {}; by backend: simd {}, simd-parallel {}, gpu {}; {} batch flushes",
            s.same_pages,
            s.zero_pages,
            s.huge_pages,
            s.pages_lz4,
            s.pages_zstd,
            s.pages_simd,
            s.pages_simd_parallel,
            s.pages_gpu,
            s.batch_flushes
        );
        if let Some(o) = &self.overwrite {
            let _ = writeln!(
                out,
                "  overwritten {}x in random order ({:.3} GB/s): memory ratio {:.3} right after ({:+.1}% against the first writes)",
                o.passes, o.write_gbps, o.mem_ratio, o.mem_ratio_change_pct
            );
        }
        let c = &self.codec;
        let _ = writeln!(
            out,
            "codec alone ({}, batches of {}, same pages and cores): compress {:.3} GB/s, decompress {:.3} GB/s, ratio {:.3}",
            c.backend, c.batch_pages, c.compress_gbps, c.decompress_gbps, c.ratio
        );
        let _ = writeln!(
            out,
            "  store write path = {:.0}% of codec compress, read path = {:.0}% of codec decompress",
            c.store_write_share * 100.0,
            c.store_read_share * 100.0
        );
        if let Some(best) = self
            .runs
            .iter()
            .max_by(|a, b| a.write_gbps.total_cmp(&b.write_gbps))
        {
            let _ = writeln!(
                out,
                "  CPU of the store's writes{}, {}",
                if self.runs.len() > 1 {
                    " (the best round)"
                } else {
                    ""
                },
                best.write_cpu.summary()
            );
        }
        let l = &self.latency;
        let _ = writeln!(
            out,
            "latency with the flusher running (µs)    p50       p99     p99.9       max  samples"
        );
        latency_row(&mut out, "write 1 page", &l.write_page);
        latency_row(&mut out, "read 1 page", &l.read_page);
        if let Some(r) = &l.recompressor {
            let _ = writeln!(
                out,
                "  (meanwhile the recompressor recompressed {} pages in {:.3} CPU s of {:.3} s)",
                r.pages, r.cpu_seconds, r.seconds
            );
        }
        latency_row(
            &mut out,
            &format!("flush {}-page batch", l.flush_pages),
            &l.batch_flush,
        );
        latency_row(
            &mut out,
            &format!("read {} pages", l.batch_pages),
            &l.batch_read,
        );
        if let Some(z) = &self.zram {
            let _ = writeln!(
                out,
                "kernel zram ({}, {} O_DIRECT stream(s) of 1 MiB requests):",
                z.algorithm, z.streams
            );
            let _ = writeln!(
                out,
                "  write {:>7.3} GB/s   read {:>7.3} GB/s   ratio {:.3}   memory ratio {:.3} (orig_data_size/mem_used_total)   same {}, huge {}",
                z.write_gbps, z.read_gbps, z.ratio, z.mem_ratio, z.same_pages, z.huge_pages
            );
        }
        if let Some(v) = &self.vs_zram {
            let _ = writeln!(
                out,
                "ours / zram: write {:.2}x, read {:.2}x, ratio {:.2}x, memory ratio {:.2}x (right after the writes {:.2}x)",
                v.write, v.read, v.ratio, v.mem_ratio, v.mem_ratio_hot
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let samples: Vec<Duration> = (1..=1000).map(Duration::from_micros).collect();
        let p = Percentiles::from_samples(samples);
        assert_eq!(p.samples, 1000);
        assert_eq!(p.p50_us, 500.0);
        assert_eq!(p.p99_us, 990.0);
        assert_eq!(p.p999_us, 999.0);
        assert_eq!(p.max_us, 1000.0);
        let one = Percentiles::from_samples(vec![Duration::from_micros(7)]);
        assert_eq!((one.p50_us, one.p999_us), (7.0, 7.0));
        assert_eq!(Percentiles::from_samples(Vec::new()).samples, 0);
    }
}
