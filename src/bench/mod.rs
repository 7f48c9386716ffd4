//! `trueno-ublk bench`: the page store's write and read paths on a corpus of pages, the codec
//! alone on the same pages, latency percentiles, and kernel zram on the same pages with
//! `--compare-zram`. Every page read back is checked byte for byte; a mismatch fails the run.

#![forbid(unsafe_code)]

mod codec_alone;
pub mod corpus;
mod cpu;
mod latency;
mod progress;
pub mod report;
mod workers;
pub mod zram;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::codec::{BatchCodec, CodecError, PAGE_SIZE};
use crate::config::StoreOptions;
use crate::store::{BatchedPageStore, FlusherHandle, StoreConfig, StoreError, StoreStats};
use codec_alone::{measure_codec, CodecRun};
use corpus::{AlignedBuf, Corpus, SplitMix64};
use latency::measure_latency;
pub use progress::Progress;
use report::{BenchReport, CodecReport, OverwriteReport, RunFigures, SettleReport, VersusZram};
pub use workers::verify;
use workers::{flush, read_all, write_requests};

/// Size of the built-in mix when neither `--size` nor `--input` says otherwise.
const DEFAULT_MIX_BYTES: u64 = 256 << 20;
/// Requests a worker takes at a time from the shared queue of work.
pub(crate) const REQUESTS_PER_GRAB: usize = 64;

/// Bytes per request to the store by default: one page, as swap mostly does.
pub const DEFAULT_REQUEST_BYTES: u64 = 4096;
/// Random-order overwrites of the whole corpus by default.
pub const DEFAULT_OVERWRITES: u32 = 3;
/// Samples of each single-page latency by default.
pub const DEFAULT_LATENCY_SAMPLES: u32 = 10_000;
/// Seed of the built-in mix and of the random orders by default.
pub const DEFAULT_SEED: u64 = 1;
/// zram's algorithm for `--compare-zram` by default: the fastest zram has, against which
/// `--algorithm lz4` is compared like for like.
pub const DEFAULT_ZRAM_ALGORITHM: &str = "lz4";
/// How long the bench waits for the recompressor, beyond the idle threshold, before it reports
/// what it has (the memory ratio so far, `settled: false`).
const SETTLE_TIMEOUT_AFTER_IDLE: Duration = Duration::from_secs(300);
/// How long the bench waits, beyond the idle threshold, for the recompressor to start on the
/// pages it wrote again before the latency phases.
const RECOMPRESSOR_START_LIMIT: Duration = Duration::from_secs(30);
/// How often the bench looks whether the recompressor has settled.
const SETTLE_POLL: Duration = Duration::from_millis(50);

/// What to measure (`trueno-ublk bench`'s options).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchOptions {
    /// Corpus file of 4 KiB pages; `None`: a built-in realistic mix.
    pub input: Option<PathBuf>,
    /// Bytes of pages: the size of the built-in mix, or the first bytes of `input`.
    pub size: Option<u64>,
    /// Writer and reader threads; `None`: one per core.
    pub threads: Option<u16>,
    pub request_size: u64,
    /// Random-order overwrites of the whole corpus after the first pass (0: none).
    pub overwrites: u32,
    pub latency_samples: u32,
    /// Rounds of the store, the codec alone and zram; the best figure of each counts.
    pub repeat: u16,
    pub seed: u64,
    /// Also run kernel zram (lz4) on the same pages.
    pub compare_zram: bool,
    /// Parallel O_DIRECT streams for zram; `None`: as many as the store's writer threads
    /// (zram compresses in the writing thread: one stream would give it one core where the
    /// store has them all).
    pub zram_streams: Option<u16>,
    /// zram's compression algorithm.
    pub zram_algorithm: String,
    pub store: StoreOptions,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            input: None,
            size: None,
            threads: None,
            request_size: DEFAULT_REQUEST_BYTES,
            overwrites: DEFAULT_OVERWRITES,
            latency_samples: DEFAULT_LATENCY_SAMPLES,
            repeat: 1,
            seed: DEFAULT_SEED,
            compare_zram: false,
            zram_streams: None,
            zram_algorithm: DEFAULT_ZRAM_ALGORITHM.to_string(),
            store: StoreOptions::default(),
        }
    }
}

#[derive(Debug, Error)]
pub enum BenchError {
    #[error("cannot read corpus {path}: {source}")]
    Corpus {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "corpus {path}: {len} bytes is not a whole, non-zero number of 4 KiB pages \
         (make one with scripts/make-corpus.sh, or pass --size)"
    )]
    NotWholePages { path: PathBuf, len: u64 },
    #[error("store {phase} failed: {source}")]
    Store {
        phase: &'static str,
        source: StoreError,
    },
    #[error("cannot start the store's flusher thread: {0}")]
    Flusher(std::io::Error),
    #[error("cannot start the compression pool's threads: {0}")]
    Pool(rayon::ThreadPoolBuildError),
    #[error(
        "{phase}: {pages} page(s) read back differ from what was written (first: page {first_page})"
    )]
    Mismatch {
        phase: &'static str,
        first_page: usize,
        pages: usize,
    },
    #[error("codec alone: {0}")]
    Codec(CodecError),
    #[error(transparent)]
    NoGpu(#[from] crate::gpu::NoGpu),
    #[error("{0}")]
    Settings(String),
    #[error("--compare-zram: {0}")]
    ZramUnavailable(String),
    #[error("zram: {what} failed: {source}")]
    Zram {
        what: String,
        source: std::io::Error,
    },
    #[error("a bench worker thread panicked")]
    WorkerPanicked,
    #[error("interrupted (the zram device the bench used is reset or removed)")]
    Interrupted,
    #[error("cannot print the JSON report: {0}")]
    Json(#[from] serde_json::Error),
}

/// A corpus page number as the `u32` the bench's orders keep.
fn page_number(page: usize) -> u32 {
    #[allow(
        clippy::cast_possible_truncation,
        reason = "a corpus is loaded into memory: far fewer than 2^32 pages (16 TiB)"
    )]
    let number = page as u32;
    number
}

/// Bytes per second in GB/s (10^9 bytes).
pub fn gbps(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}

/// Memory the store holds for pages: theirs, and the chunk reserve's committed memory (which
/// zram, allocating as it stores, has no like of). The reserve's target is the machine's (RAM
/// / 64, at most 64 MiB), whatever the corpus: against a small corpus it outweighs the pages,
/// so the ratios that compare with zram's `mem_used_total` leave it out and it is given
/// beside them (`mem_ratio_hot_with_reserve`, and in `mem_ratio_all_in`).
fn held_for_pages(stats: &StoreStats) -> u64 {
    stats.mem_used + stats.reserve_bytes
}

pub(crate) fn ratio(numerator: u64, denominator: u64) -> f64 {
    if denominator == 0 {
        0.0
    } else {
        numerator as f64 / denominator as f64
    }
}

/// Everything a run needs besides the corpus, resolved from the arguments.
struct Plan {
    config: StoreConfig,
    /// `zstd:3,idle=30s` or `off`.
    recompress_name: String,
    gpu: Option<Arc<dyn BatchCodec>>,
    threads: usize,
    request_bytes: usize,
}

fn plan(args: &BenchOptions, corpus: &Corpus) -> Result<Plan, BenchError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bytes = (corpus.page_count() * PAGE_SIZE) as u64;
    // A request never spans beyond the corpus, and the corpus is whole requests.
    let request_bytes = usize::try_from(args.request_size).unwrap_or(usize::MAX);
    let mut request_pages = (request_bytes / PAGE_SIZE).clamp(1, corpus.page_count());
    while !corpus.page_count().is_multiple_of(request_pages) {
        request_pages -= 1;
    }
    let settings = crate::config::store_settings(&args.store)
        .map_err(|e| BenchError::Settings(e.to_string()))?;
    let (gpu, _) = crate::gpu::open_for_store(settings.algorithm, settings.forced_backend)?;
    let gpu = gpu.map(|codec| codec as Arc<dyn BatchCodec>);
    let mut config = settings.store_config(bytes, gpu.is_some());
    // The chunk reserve the daemon keeps on this machine: its refill thread commits memory
    // beside the writes, as in the daemon, instead of the flush committing it.
    config.reserve_bytes =
        crate::config::reserve_bytes(crate::config::ram_bytes().unwrap_or(0), config.mem_limit);
    Ok(Plan {
        config,
        recompress_name: settings.recompress_name(),
        gpu,
        threads: args.threads.map_or(cores, usize::from),
        request_bytes: request_pages * PAGE_SIZE,
    })
}

/// Load or generate the corpus the arguments name. Refused when it would not fit: the bench
/// holds the corpus, a buffer as large for its reads, and the store's copy (and zram's), all
/// in memory; a corpus past a third of RAM would end in the OOM killer, maybe half-way through
/// zram's run, or in an allocation that cannot be made at all.
pub fn load_corpus(args: &BenchOptions) -> Result<Corpus, BenchError> {
    let wanted = match &args.input {
        Some(path) => std::fs::metadata(path)
            .map_err(|source| BenchError::Corpus {
                path: path.clone(),
                source,
            })?
            .len()
            .min(args.size.unwrap_or(u64::MAX)),
        None => args.size.unwrap_or(DEFAULT_MIX_BYTES),
    };
    let memory = crate::os::MeminfoReader::open()
        .and_then(|mut meminfo| meminfo.read())
        .map_err(|error| BenchError::Settings(format!("cannot read /proc/meminfo: {error}")))?;
    if wanted > memory.available / 3 {
        return Err(BenchError::Settings(format!(
            "a corpus of {} is more than a third of the memory available now ({} of {}): the \
             bench holds it about three times over; give a smaller --size",
            crate::units::human_size(wanted),
            crate::units::human_size(memory.available),
            crate::units::human_size(memory.total)
        )));
    }
    match &args.input {
        Some(path) => Corpus::load(path, args.size),
        None => {
            let bytes = args.size.unwrap_or(DEFAULT_MIX_BYTES);
            Ok(Corpus::generated(
                usize::try_from(bytes).unwrap_or(usize::MAX) / PAGE_SIZE,
                args.seed,
            ))
        }
    }
}

/// A fresh store holding the corpus, with its flusher running.
struct StorePass {
    store: Arc<BatchedPageStore>,
    /// Stops and joins the flusher when dropped.
    _flusher: FlusherHandle,
    /// Making the store and starting its flusher: the chunk reserve's fill, which the daemon
    /// pays at `create`, before its device is live.
    setup_time: Duration,
    write_time: Duration,
    write_cpu: cpu::PhaseCpu,
    read_time: Duration,
    /// Right after the write and flush.
    stats: StoreStats,
}

/// Write every page into a fresh store as the daemon's queue threads do, flush what is
/// pending, then read every page back into `scratch` and check it.
fn store_pass(
    plan: &Plan,
    corpus: &Corpus,
    scratch: &mut AlignedBuf,
    progress: &Progress,
) -> Result<StorePass, BenchError> {
    let bytes = corpus.bytes().len();
    let request_bytes = plan.request_bytes;
    progress.phase("store write", bytes as u64);
    // Making the store fills its chunk reserve (up to `reserve_bytes`, most of it still unused
    // when the writes end), as the daemon's `create` does before its device is live; zram's
    // figure likewise starts once its disksize is set. Timed apart, and reported.
    let start = Instant::now();
    let store = BatchedPageStore::new(plan.config.clone(), plan.gpu.clone()).map_err(|source| {
        BenchError::Store {
            phase: "setup",
            source,
        }
    })?;
    let flusher = store.start_flusher(|_| ()).map_err(BenchError::Flusher)?;
    let setup_time = start.elapsed();
    let cpu_mark = cpu::CpuMark::now();
    let start = Instant::now();
    write_requests(
        &store,
        plan.threads,
        bytes / request_bytes,
        progress,
        "write",
        |request| {
            let at = request * request_bytes;
            (at as u64, &corpus.bytes()[at..at + request_bytes])
        },
    )?;
    flush(&store, "flush")?;
    let write_time = start.elapsed();
    let write_cpu = cpu_mark.since();
    let stats = store.stats();

    scratch.poison();
    progress.phase("store read", bytes as u64);
    let start = Instant::now();
    read_all(
        &store,
        plan.threads,
        request_bytes,
        scratch.as_mut_slice(),
        progress,
        "read",
    )?;
    let read_time = start.elapsed();
    verify("store read-back", scratch.as_slice(), |page| {
        corpus.page(page)
    })?;
    Ok(StorePass {
        store,
        _flusher: flusher,
        setup_time,
        write_time,
        write_cpu,
        read_time,
        stats,
    })
}

/// Overwrite the whole device `passes` times, each pass in a new random order and with the
/// corpus pages in a new shuffled placement, so compressed sizes change under every slot.
/// `content[p]` is the corpus page at page `p` before and after. Reads everything back.
#[allow(clippy::too_many_arguments)]
fn overwrite_passes(
    plan: &Plan,
    store: &BatchedPageStore,
    corpus: &Corpus,
    passes: u32,
    content: &mut [u32],
    rng: &mut SplitMix64,
    scratch: &mut AlignedBuf,
    progress: &Progress,
) -> Result<(Duration, StoreStats), BenchError> {
    let bytes = corpus.bytes().len();
    let mut order: Vec<u32> = (0..page_number(content.len())).collect();
    let mut write_time = Duration::ZERO;
    for pass in 0..passes {
        rng.shuffle(&mut order);
        rng.shuffle(content);
        let content = &*content;
        progress.phase(
            ["overwrite 1", "overwrite 2", "overwrite 3+"][pass.min(2) as usize],
            bytes as u64,
        );
        let start = Instant::now();
        write_requests(
            store,
            plan.threads,
            content.len(),
            progress,
            "overwrite",
            |index| {
                let position = order[index] as usize;
                (
                    (position * PAGE_SIZE) as u64,
                    corpus.page(content[position] as usize),
                )
            },
        )?;
        flush(store, "overwrite flush")?;
        write_time += start.elapsed();
    }
    let stats = store.stats();
    scratch.poison();
    progress.phase("overwrite read-back", bytes as u64);
    read_all(
        store,
        plan.threads,
        plan.request_bytes,
        scratch.as_mut_slice(),
        progress,
        "read after overwrite",
    )?;
    verify("read-back after overwrites", scratch.as_slice(), |page| {
        corpus.page(content[page] as usize)
    })?;
    Ok((write_time, stats))
}

/// With recompression on, give the recompressor work for the latency phases, as in a daemon
/// in steady use: every page written again (the same content, so hot again, in the hot
/// codec), the idle threshold waited out, and then until the recompressor has stored its
/// first page again (bounded: `RECOMPRESSOR_START_LIMIT` beyond the threshold).
fn recompressor_at_work(
    plan: &Plan,
    store: &BatchedPageStore,
    corpus: &Corpus,
    content: &[u32],
    progress: &Progress,
) -> Result<(), BenchError> {
    let Some(recompress) = plan.config.recompress else {
        return Ok(());
    };
    progress.phase(
        "latency: rewrite for the recompressor",
        (content.len() * PAGE_SIZE) as u64,
    );
    write_requests(
        store,
        plan.threads,
        content.len(),
        progress,
        "rewrite",
        |position| {
            (
                (position * PAGE_SIZE) as u64,
                corpus.page(content[position] as usize),
            )
        },
    )?;
    flush(store, "rewrite flush")?;
    let before = store.stats().recompressed_pages;
    let deadline = Instant::now() + recompress.idle + RECOMPRESSOR_START_LIMIT;
    progress.phase("latency: waiting for the recompressor", 0);
    while store.stats().recompressed_pages == before && Instant::now() < deadline {
        std::thread::sleep(SETTLE_POLL);
    }
    Ok(())
}

/// Wait until the recompressor has dealt with every page: a pass that started after the
/// pages went idle left none to do. Bounded: the idle threshold plus
/// `SETTLE_TIMEOUT_AFTER_IDLE`. `None` without recompression.
fn settle(plan: &Plan, store: &BatchedPageStore, progress: &Progress) -> Option<SettleReport> {
    let recompress = plan.config.recompress?;
    let start = Instant::now();
    let deadline = start + recompress.idle + SETTLE_TIMEOUT_AFTER_IDLE;
    let pages = store.stats().pages_stored;
    progress.phase("recompress (settle)", pages);
    let handled = |s: &StoreStats| s.recompressed_pages + s.recompress_rejected_pages;
    let first = store.stats();
    let mut shown = handled(&first);
    // A pass counts only if it started once every page was idle: the one after the pass that
    // was running when they became so.
    let mut passes_needed: Option<u64> = None;
    let settled = loop {
        let now = store.stats();
        progress.advance(handled(&now).saturating_sub(shown));
        shown = handled(&now);
        if passes_needed.is_none() && start.elapsed() >= recompress.idle {
            passes_needed = Some(now.recompress_passes + 2);
        }
        if passes_needed.is_some_and(|n| now.recompress_passes >= n) && now.recompress_backlog == 0
        {
            break true;
        }
        if Instant::now() >= deadline {
            break false;
        }
        std::thread::sleep(SETTLE_POLL);
    };
    let stats = store.stats();
    Some(SettleReport {
        settled,
        seconds: start.elapsed().as_secs_f64(),
        recompressed_pages: stats.recompressed_pages - first.recompressed_pages,
        cpu_seconds: stats
            .recompress_cpu_ns
            .saturating_sub(first.recompress_cpu_ns) as f64
            / 1e9,
        stats,
    })
}

/// The 1, 5 and 15 minute load averages (zeros where /proc/loadavg cannot be read): other
/// work on the machine while the bench runs is part of what its figures mean.
fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut fields = text
        .split_whitespace()
        .map(|field| field.parse().unwrap_or(0.0));
    [(); 3].map(|()| fields.next().unwrap_or(0.0))
}

/// One round: the codec alone, zram, and the store's write and read, back to back so that all
/// three meet about the same load from other work on the machine.
struct Round {
    pass: StorePass,
    codec: CodecRun,
    zram: Option<zram::ZramReport>,
}

impl Round {
    fn figures(&self, bytes: usize) -> RunFigures {
        RunFigures {
            write_gbps: gbps(bytes, self.pass.write_time),
            store_setup_s: self.pass.setup_time.as_secs_f64(),
            write_gbps_with_setup: gbps(bytes, self.pass.setup_time + self.pass.write_time),
            read_gbps: gbps(bytes, self.pass.read_time),
            codec_compress_gbps: gbps(bytes, self.codec.compress_time),
            codec_decompress_gbps: gbps(bytes, self.codec.decompress_time),
            zram_write_gbps: self.zram.as_ref().map(|z| z.write_gbps),
            zram_read_gbps: self.zram.as_ref().map(|z| z.read_gbps),
            write_cpu: self.pass.write_cpu.clone(),
        }
    }
}

fn round(
    plan: &Plan,
    args: &BenchOptions,
    corpus: &Corpus,
    scratch: &mut AlignedBuf,
    progress: &Progress,
) -> Result<Round, BenchError> {
    // The codec and zram first: once the store exists, its recompressor may work in the
    // background, and they are measured without it.
    let codec = measure_codec(&plan.config, plan.gpu.as_ref(), corpus, progress)?;
    let zram = if args.compare_zram {
        Some(zram::compare(
            corpus,
            scratch,
            args.zram_streams.map_or(plan.threads, usize::from),
            &args.zram_algorithm,
            progress,
        )?)
    } else {
        None
    };
    let pass = store_pass(plan, corpus, scratch, progress)?;
    Ok(Round { pass, codec, zram })
}

/// Run the bench on `corpus` and return what it measured. With `--repeat N` there are N rounds
/// and the best figure of each kind counts, which filters out other work on a shared machine;
/// the overwrite and latency figures are measured once, on the last round's store.
pub fn measure(
    args: &BenchOptions,
    corpus: &Corpus,
    progress: &Progress,
) -> Result<BenchReport, BenchError> {
    // The pool's threads named as in the daemon, so that `write_cpu` tells them apart. Built
    // already (a second bench in one process, the tests), it keeps the names it was given;
    // only a thread that could not start carries a cause (`source`), and then there is no pool.
    if let Err(error) = rayon::ThreadPoolBuilder::new()
        .thread_name(crate::codec::pool_thread_name)
        .build_global()
    {
        if std::error::Error::source(&error).is_some() {
            return Err(BenchError::Pool(error));
        }
    }
    // The store's bookkeeping lists grow where a serving process's do: in the list space it
    // reserves as it starts (see `mem::lists`), not in mappings of their own.
    if let Err(error) = crate::mem::reserve_list_space() {
        crate::os::print_err(&format!(
            "trueno-ublk: note: no address space reserved for the store's bookkeeping lists \
             ({error}): they map buffers of their own, unlike the daemon's"
        ));
    }
    let plan = plan(args, corpus)?;
    let load_average = load_average();
    let repeat = usize::from(args.repeat).max(1);
    let pages = corpus.page_count();
    let bytes = corpus.bytes().len();
    let mut rng = SplitMix64::new(args.seed);
    let mut scratch = AlignedBuf::zeroed(bytes);

    let mut runs = Vec::with_capacity(repeat);
    let mut last = round(&plan, args, corpus, &mut scratch, progress)?;
    runs.push(last.figures(bytes));
    for _ in 1..repeat {
        // The previous store (and its memory) goes before the next one is built.
        drop(last);
        last = round(&plan, args, corpus, &mut scratch, progress)?;
        runs.push(last.figures(bytes));
    }
    let Round {
        pass:
            StorePass {
                store,
                _flusher: flusher,
                stats,
                ..
            },
        codec: codec_run,
        zram,
    } = last;
    let best_of =
        |figure: fn(&RunFigures) -> Option<f64>| runs.iter().filter_map(figure).fold(0.0, f64::max);
    let write_gbps = best_of(|r| Some(r.write_gbps));
    let write_gbps_with_setup = best_of(|r| Some(r.write_gbps_with_setup));
    let store_setup_s = runs
        .iter()
        .max_by(|a, b| a.write_gbps.total_cmp(&b.write_gbps))
        .map_or(0.0, |r| r.store_setup_s);
    let read_gbps = best_of(|r| Some(r.read_gbps));
    let mem_ratio_hot = ratio(stats.orig_bytes, stats.mem_used);
    let settled = settle(&plan, &store, progress);
    let settled_stats = settled.as_ref().map_or(&stats, |s| &s.stats);
    let mem_ratio = ratio(settled_stats.orig_bytes, settled_stats.mem_used);
    let codec = CodecReport {
        backend: codec_run.backend.name().to_string(),
        batch_pages: codec_run.batch_pages,
        compress_gbps: best_of(|r| Some(r.codec_compress_gbps)),
        decompress_gbps: best_of(|r| Some(r.codec_decompress_gbps)),
        ratio: ratio(bytes as u64, codec_run.compressed_bytes as u64),
        store_write_share: write_gbps / best_of(|r| Some(r.codec_compress_gbps)),
        store_read_share: read_gbps / best_of(|r| Some(r.codec_decompress_gbps)),
    };
    let zram = zram.map(|last| zram::ZramReport {
        write_gbps: best_of(|r| r.zram_write_gbps),
        read_gbps: best_of(|r| r.zram_read_gbps),
        ..last
    });

    let mut content: Vec<u32> = (0..page_number(pages)).collect();
    let overwrite = if args.overwrites > 0 {
        let (time, after) = overwrite_passes(
            &plan,
            &store,
            corpus,
            args.overwrites,
            &mut content,
            &mut rng,
            &mut scratch,
            progress,
        )?;
        let after_ratio = ratio(after.orig_bytes, after.mem_used);
        Some(OverwriteReport {
            passes: args.overwrites,
            write_gbps: gbps(bytes * args.overwrites as usize, time),
            mem_ratio: after_ratio,
            mem_ratio_change_pct: if mem_ratio_hot > 0.0 {
                (after_ratio / mem_ratio_hot - 1.0) * 100.0
            } else {
                0.0
            },
            stats: after,
        })
    } else {
        None
    };

    recompressor_at_work(&plan, &store, corpus, &content, progress)?;
    let latency = measure_latency(
        &store,
        &plan,
        corpus,
        &content,
        args.latency_samples as usize,
        &mut rng,
        progress,
    )?;
    drop(flusher);
    drop(store);

    let ours_ratio = ratio(settled_stats.orig_bytes, settled_stats.compr_bytes);
    let vs_zram = zram.as_ref().map(|z| VersusZram {
        write: write_gbps / z.write_gbps,
        read: read_gbps / z.read_gbps,
        ratio: ours_ratio / z.ratio,
        mem_ratio: mem_ratio / z.mem_ratio,
        mem_ratio_hot: mem_ratio_hot / z.mem_ratio,
    });

    let config = &plan.config;
    Ok(BenchReport {
        corpus: corpus.source.to_string(),
        pages,
        bytes: bytes as u64,
        algorithm: config.algorithm.to_string(),
        backend: config
            .forced_backend
            .map_or("auto", crate::codec::Backend::name)
            .to_string(),
        batched: config.batched,
        batch_threshold: config.batch_threshold,
        flush_timeout_ms: u64::try_from(config.flush_timeout.as_millis()).unwrap_or(u64::MAX),
        threads: plan.threads,
        request_bytes: plan.request_bytes,
        repeat,
        load_average,
        write_gbps,
        write_gbps_with_setup,
        store_setup_s,
        read_gbps,
        runs,
        ratio: ours_ratio,
        mem_ratio,
        mem_ratio_hot,
        mem_ratio_hot_with_reserve: ratio(stats.orig_bytes, held_for_pages(&stats)),
        mem_ratio_all_in: ratio(
            settled_stats.orig_bytes,
            held_for_pages(settled_stats)
                + settled_stats.metadata_bytes
                + settled_stats.batch_buffer_bytes,
        ),
        metadata_bytes_per_page: settled_stats.metadata_bytes as f64 / pages as f64,
        recompress: plan.recompress_name.clone(),
        settle: settled,
        stats,
        overwrite,
        codec,
        latency,
        zram,
        vs_zram,
    })
}
