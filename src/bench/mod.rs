//! `trueno-ublk bench`: the page store's write and read paths on a corpus of pages, the codec
//! alone on the same pages, latency percentiles, and kernel zram on the same pages with
//! `--compare-zram`. Every page read back is checked byte for byte; a mismatch fails the run.

pub mod corpus;
pub mod report;
pub mod zram;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use parking_lot::Mutex;
use rayon::prelude::*;
use thiserror::Error;

use crate::cli::{parse_size, StoreArgs};
use crate::codec::{
    select_backend, Backend, BatchCodec, CodecError, CompressedBatch, CpuCodec, Encoding, Page,
    PAGE_SIZE,
};
use crate::store::{BatchedPageStore, FlusherHandle, StoreConfig, StoreError, StoreStats};
use corpus::{AlignedBuf, Corpus, SplitMix64};
use report::{
    BenchReport, CodecReport, LatencyReport, OverwriteReport, Percentiles, RunFigures, VersusZram,
};

/// Size of the built-in mix when neither `--size` nor `--input` says otherwise.
const DEFAULT_MIX_BYTES: u64 = 256 << 20;
/// Pages per batch in the batch-latency figures (the spec's G.113/G.114).
const LATENCY_BATCH_PAGES: usize = 1000;
/// Requests a worker takes at a time from the shared queue of work.
const REQUESTS_PER_GRAB: usize = 64;

#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// Corpus file of 4 KiB pages (scripts/make-corpus.sh) [default: a built-in realistic mix]
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// Bytes of pages: the size of the built-in mix [default: 256M], or the first SIZE bytes of
    /// --input [default: all of it]
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Writer and reader threads, like the daemon's queue threads [default: number of cores]
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// Bytes per write and read request to the store (4K = one page, as swap mostly does)
    #[arg(long, value_parser = parse_size, default_value = "4K")]
    pub request_size: u64,
    /// Overwrite the whole corpus this many times in random order, then report the memory
    /// ratio again (0 skips it)
    #[arg(long, default_value_t = 3)]
    pub overwrites: u32,
    /// Samples of each single-page latency; the 1000-page batch figures take a tenth as many
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub latency_samples: u32,
    /// Rounds of the store's write and read, the codec alone and zram, back to back; the best
    /// figure of each counts (other work on a shared machine only ever slows a run down)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub repeat: u16,
    /// Seed of the built-in mix and of the random orders
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object instead of the text report
    #[arg(long)]
    pub json: bool,
    /// Also run kernel zram (lz4) on the same pages: needs root and /sys/block/zram0, and
    /// resets zram0 before and after
    #[arg(long)]
    pub compare_zram: bool,
    /// Parallel O_DIRECT streams for zram (1 = one dd)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub zram_streams: u16,
    #[command(flatten)]
    pub store: StoreArgs,
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
    #[error("--backend gpu: no usable GPU ({0}); use --backend auto, simd or simd-parallel")]
    NoGpu(String),
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
    #[error("cannot print the JSON report: {0}")]
    Json(#[from] serde_json::Error),
}

/// A progress bar on stderr that appears only once a run has lasted a second, and never with
/// `--json` or when stderr is not a terminal.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn hidden() -> Self {
        Self {
            bar: ProgressBar::hidden(),
        }
    }

    fn on_stderr_after_a_second() -> Self {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template("{msg:<22} [{bar:40}] {percent:>3}% {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        let weak = bar.downgrade();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            if let Some(bar) = weak.upgrade() {
                if !bar.is_finished() {
                    bar.set_draw_target(ProgressDrawTarget::stderr());
                }
            }
        });
        Self { bar }
    }

    /// Start a phase of `total` units (bytes or operations).
    pub fn phase(&self, name: &'static str, total: u64) {
        self.bar.set_message(name);
        self.bar.set_length(total);
        self.bar.set_position(0);
    }

    pub fn advance(&self, units: u64) {
        self.bar.inc(units);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Bytes per second in GB/s (10^9 bytes).
pub fn gbps(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}

fn ratio(numerator: u64, denominator: u64) -> f64 {
    if denominator == 0 {
        0.0
    } else {
        numerator as f64 / denominator as f64
    }
}

/// Check every page of `got` against `expected(page index)`.
pub fn verify<'a>(
    phase: &'static str,
    got: &[u8],
    expected: impl Fn(usize) -> &'a [u8] + Sync,
) -> Result<(), BenchError> {
    let bad: Vec<usize> = got
        .par_chunks(PAGE_SIZE)
        .enumerate()
        .filter(|(index, page)| *page != expected(*index))
        .map(|(index, _)| index)
        .collect();
    match bad.first() {
        None => Ok(()),
        Some(&first_page) => Err(BenchError::Mismatch {
            phase,
            first_page,
            pages: bad.len(),
        }),
    }
}

/// The GPU codec when the backend may use one (`auto` or `gpu`); `--backend gpu` without a
/// usable GPU is an error that says why.
fn gpu_codec(
    settings: &crate::config::StoreSettings,
) -> Result<Option<Arc<dyn BatchCodec>>, BenchError> {
    if matches!(
        settings.forced_backend,
        Some(Backend::Simd | Backend::SimdParallel)
    ) {
        return Ok(None);
    }
    let (codec, state) = crate::gpu::open_for_store(settings.algorithm);
    match codec {
        Some(codec) => Ok(Some(codec as Arc<dyn BatchCodec>)),
        None if settings.forced_backend == Some(Backend::Gpu) => Err(BenchError::NoGpu(state)),
        None => Ok(None),
    }
}

/// Run `count` write requests on `threads` threads; request `i` is `request(i)`, an
/// `(offset, data)` pair. Stops at the first error.
fn write_requests<'a>(
    store: &BatchedPageStore,
    threads: usize,
    count: usize,
    progress: &Progress,
    phase: &'static str,
    request: impl Fn(usize) -> (u64, &'a [u8]) + Sync,
) -> Result<(), BenchError> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let first_error = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let first = next.fetch_add(REQUESTS_PER_GRAB, Ordering::Relaxed);
                    if first >= count {
                        break;
                    }
                    let mut bytes = 0;
                    for index in first..(first + REQUESTS_PER_GRAB).min(count) {
                        let (offset, data) = request(index);
                        if let Err(error) = store.write(offset, data) {
                            first_error.lock().get_or_insert(error);
                            stop.store(true, Ordering::Relaxed);
                            return;
                        }
                        bytes += data.len();
                    }
                    progress.advance(bytes as u64);
                }
            });
        }
    });
    match first_error.into_inner() {
        Some(source) => Err(BenchError::Store { phase, source }),
        None => Ok(()),
    }
}

/// Read the whole device into `out` with `threads` threads in requests of `request_bytes`.
fn read_all(
    store: &BatchedPageStore,
    threads: usize,
    request_bytes: usize,
    out: &mut [u8],
    progress: &Progress,
    phase: &'static str,
) -> Result<(), BenchError> {
    let grab_bytes = request_bytes * REQUESTS_PER_GRAB;
    let work = Mutex::new(out.chunks_mut(grab_bytes).enumerate());
    let stop = AtomicBool::new(false);
    let first_error = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let Some((grab, chunk)) = work.lock().next() else {
                        break;
                    };
                    let base = (grab * grab_bytes) as u64;
                    for (index, request) in chunk.chunks_mut(request_bytes).enumerate() {
                        let offset = base + (index * request_bytes) as u64;
                        if let Err(error) = store.read(offset, request) {
                            first_error.lock().get_or_insert(error);
                            stop.store(true, Ordering::Relaxed);
                            return;
                        }
                    }
                    progress.advance(chunk.len() as u64);
                }
            });
        }
    });
    match first_error.into_inner() {
        Some(source) => Err(BenchError::Store { phase, source }),
        None => Ok(()),
    }
}

fn flush(store: &BatchedPageStore, phase: &'static str) -> Result<(), BenchError> {
    store
        .flush_pending()
        .map_err(|source| BenchError::Store { phase, source })
}

/// Single-page and 1000-page latencies on a store holding `content[p]` at page `p`, with the
/// flusher running. Writes put back the same content, so the store's contents do not change.
/// A flushed batch is 1000 pages, or the store's threshold if that is smaller (it flushes there).
fn measure_latency(
    store: &BatchedPageStore,
    batch_threshold: usize,
    corpus: &Corpus,
    content: &[u32],
    samples: usize,
    rng: &mut SplitMix64,
    progress: &Progress,
) -> Result<LatencyReport, BenchError> {
    let pages = content.len();
    let expected = |position: usize| corpus.page(content[position] as usize);
    let offset = |position: usize| (position * PAGE_SIZE) as u64;
    let store_error = |phase| move |source| BenchError::Store { phase, source };

    progress.phase("latency: write", samples as u64);
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let position = rng.below(pages as u64) as usize;
        let data = expected(position);
        let start = Instant::now();
        store
            .write(offset(position), data)
            .map_err(store_error("latency write"))?;
        times.push(start.elapsed());
        progress.advance(1);
    }
    let write_page = Percentiles::from_samples(std::mem::take(&mut times));
    flush(store, "latency flush")?;

    progress.phase("latency: read", samples as u64);
    let mut page = vec![0u8; PAGE_SIZE];
    for _ in 0..samples {
        let position = rng.below(pages as u64) as usize;
        let start = Instant::now();
        store
            .read(offset(position), &mut page)
            .map_err(store_error("latency read"))?;
        times.push(start.elapsed());
        verify("latency read", &page, |_| expected(position))?;
        progress.advance(1);
    }
    let read_page = Percentiles::from_samples(std::mem::take(&mut times));

    let batch_pages = LATENCY_BATCH_PAGES.min(pages);
    let flush_pages = batch_pages.min(batch_threshold.max(1));
    let batch_samples = (samples / 10).max(1);
    progress.phase("latency: batch flush", batch_samples as u64);
    for _ in 0..batch_samples {
        let first = rng.below((pages - flush_pages + 1) as u64) as usize;
        let last = first + flush_pages - 1;
        for position in first..last {
            store
                .write(offset(position), expected(position))
                .map_err(store_error("latency batch write"))?;
        }
        // The write of the last page fills the batch; the flush may start on the flusher
        // thread before it returns, so the clock starts before it.
        let start = Instant::now();
        store
            .write(offset(last), expected(last))
            .map_err(store_error("latency batch write"))?;
        flush(store, "latency batch flush")?;
        times.push(start.elapsed());
        progress.advance(1);
    }
    let batch_flush = Percentiles::from_samples(std::mem::take(&mut times));

    progress.phase("latency: batch read", batch_samples as u64);
    let mut batch = vec![0u8; batch_pages * PAGE_SIZE];
    for _ in 0..batch_samples {
        let first = rng.below((pages - batch_pages + 1) as u64) as usize;
        let start = Instant::now();
        store
            .read(offset(first), &mut batch)
            .map_err(store_error("latency batch read"))?;
        times.push(start.elapsed());
        verify("latency batch read", &batch, |index| {
            expected(first + index)
        })?;
        progress.advance(1);
    }
    let batch_read = Percentiles::from_samples(times);

    Ok(LatencyReport {
        write_page,
        read_page,
        flush_pages,
        batch_flush,
        batch_pages,
        batch_read,
    })
}

/// What the codec alone did with the corpus.
struct CodecRun {
    backend: Backend,
    batch_pages: usize,
    compress_time: Duration,
    decompress_time: Duration,
    compressed_bytes: usize,
}

/// The codec alone on every page of the corpus (none classified away), in batches of the
/// store's threshold with the backend the store picks for such a batch, on the same cores.
/// Every page is decompressed again and checked.
fn measure_codec(
    config: &StoreConfig,
    gpu: Option<&Arc<dyn BatchCodec>>,
    corpus: &Corpus,
    progress: &Progress,
) -> Result<CodecRun, BenchError> {
    let batch_pages = config.batch_threshold.clamp(1, corpus.page_count());
    let backend = config
        .forced_backend
        .unwrap_or_else(|| select_backend(batch_pages, gpu.is_some(), &config.thresholds));
    let single = CpuCodec::single(config.algorithm);
    let parallel = CpuCodec::parallel(config.algorithm);
    let codec: &dyn BatchCodec = match (backend, gpu) {
        (Backend::Gpu, Some(gpu)) => gpu.as_ref(),
        (Backend::Simd, _) => &single,
        _ => &parallel,
    };
    let pages: Vec<&Page> = corpus
        .bytes()
        .chunks_exact(PAGE_SIZE)
        .filter_map(|page| page.try_into().ok())
        .collect();

    // Output buffers are allocated and faulted in before the clock starts: the store reuses
    // its own, so fresh memory per batch would charge the codec for page faults the store
    // does not take.
    let mut batches: Vec<CompressedBatch> = pages
        .chunks(batch_pages)
        .map(|chunk| {
            let mut batch = CompressedBatch::default();
            batch.reset(chunk.len());
            batch
        })
        .collect();
    progress.phase("codec compress", pages.len() as u64);
    let start = Instant::now();
    for (chunk, out) in pages.chunks(batch_pages).zip(&mut batches) {
        codec
            .compress_batch(chunk, out)
            .map_err(BenchError::Codec)?;
        progress.advance(chunk.len() as u64);
    }
    let compress_time = start.elapsed();
    let compressed_bytes = batches
        .iter()
        .flat_map(|batch| batch.lens.iter())
        .map(|&len| usize::from(len))
        .sum();

    progress.phase("codec decompress", pages.len() as u64);
    // Poisoned (and so faulted in) before any timing, as the store reads into a caller's buffer.
    let mut out = vec![[0xA5u8; PAGE_SIZE]; batch_pages];
    let mut status = vec![Ok(()); batch_pages];
    let mut decompress_time = Duration::ZERO;
    for (number, batch) in batches.iter().enumerate() {
        let n = batch.len();
        let inputs: Vec<(Encoding, &[u8])> = (0..n).map(|i| batch.page(i)).collect();
        let start = Instant::now();
        codec.decompress_batch(&inputs, &mut out[..n], &mut status[..n]);
        decompress_time += start.elapsed();
        if let Some(error) = status[..n].iter().find_map(|s| s.clone().err()) {
            return Err(BenchError::Codec(error));
        }
        let first = number * batch_pages;
        verify("codec round trip", out[..n].as_flattened(), |i| {
            corpus.page(first + i)
        })?;
        progress.advance(n as u64);
    }
    Ok(CodecRun {
        backend,
        batch_pages,
        compress_time,
        decompress_time,
        compressed_bytes,
    })
}

/// Everything a run needs besides the corpus, resolved from the arguments.
struct Plan {
    config: StoreConfig,
    gpu: Option<Arc<dyn BatchCodec>>,
    threads: usize,
    request_bytes: usize,
}

fn plan(args: &BenchArgs, corpus: &Corpus) -> Result<Plan, BenchError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bytes = (corpus.page_count() * PAGE_SIZE) as u64;
    // A request never spans beyond the corpus, and the corpus is whole requests.
    let mut request_pages = (args.request_size as usize / PAGE_SIZE).clamp(1, corpus.page_count());
    while corpus.page_count() % request_pages != 0 {
        request_pages -= 1;
    }
    let settings = crate::config::store_settings(&args.store)
        .map_err(|e| BenchError::Settings(e.to_string()))?;
    let gpu = gpu_codec(&settings)?;
    Ok(Plan {
        config: settings.store_config(bytes, gpu.is_some()),
        gpu,
        threads: args.threads.map_or(cores, usize::from),
        request_bytes: request_pages * PAGE_SIZE,
    })
}

/// Load or generate the corpus the arguments name.
pub fn load_corpus(args: &BenchArgs) -> Result<Corpus, BenchError> {
    match &args.input {
        Some(path) => Corpus::load(path, args.size),
        None => {
            let bytes = args.size.unwrap_or(DEFAULT_MIX_BYTES);
            Ok(Corpus::generated(bytes as usize / PAGE_SIZE, args.seed))
        }
    }
}

/// A fresh store holding the corpus, with its flusher running.
struct StorePass {
    store: Arc<BatchedPageStore>,
    /// Stops and joins the flusher when dropped.
    _flusher: FlusherHandle,
    write_time: Duration,
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
    let store = BatchedPageStore::new(plan.config.clone(), plan.gpu.clone()).map_err(|source| {
        BenchError::Store {
            phase: "setup",
            source,
        }
    })?;
    let flusher = store.start_flusher(|_| ()).map_err(BenchError::Flusher)?;

    progress.phase("store write", bytes as u64);
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
        write_time,
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
    let mut order: Vec<u32> = (0..content.len() as u32).collect();
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

/// The 1, 5 and 15 minute load averages (zeros where /proc/loadavg cannot be read): other
/// work on the machine while the bench runs is part of what its figures mean.
fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut fields = text
        .split_whitespace()
        .map(|field| field.parse().unwrap_or(0.0));
    [(); 3].map(|()| fields.next().unwrap_or(0.0))
}

/// One round: the store's write and read, the codec alone, and zram, back to back so that all
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
            read_gbps: gbps(bytes, self.pass.read_time),
            codec_compress_gbps: gbps(bytes, self.codec.compress_time),
            codec_decompress_gbps: gbps(bytes, self.codec.decompress_time),
            zram_write_gbps: self.zram.as_ref().map(|z| z.write_gbps),
            zram_read_gbps: self.zram.as_ref().map(|z| z.read_gbps),
        }
    }
}

fn round(
    plan: &Plan,
    args: &BenchArgs,
    corpus: &Corpus,
    scratch: &mut AlignedBuf,
    progress: &Progress,
) -> Result<Round, BenchError> {
    let pass = store_pass(plan, corpus, scratch, progress)?;
    let codec = measure_codec(&plan.config, plan.gpu.as_ref(), corpus, progress)?;
    let zram = if args.compare_zram {
        Some(zram::compare(
            corpus,
            scratch,
            usize::from(args.zram_streams),
            progress,
        )?)
    } else {
        None
    };
    Ok(Round { pass, codec, zram })
}

/// Run the bench on `corpus` and return what it measured. With `--repeat N` there are N rounds
/// and the best figure of each kind counts, which filters out other work on a shared machine;
/// the overwrite and latency figures are measured once, on the last round's store.
pub fn measure(
    args: &BenchArgs,
    corpus: &Corpus,
    progress: &Progress,
) -> Result<BenchReport, BenchError> {
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
    let read_gbps = best_of(|r| Some(r.read_gbps));
    let mem_ratio = ratio(stats.orig_bytes, stats.mem_used);
    let codec = CodecReport {
        backend: format!("{:?}", codec_run.backend),
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

    let mut content: Vec<u32> = (0..pages as u32).collect();
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
            mem_ratio_change_pct: (after_ratio / mem_ratio - 1.0) * 100.0,
            stats: after,
        })
    } else {
        None
    };

    let latency = measure_latency(
        &store,
        plan.config.batch_threshold,
        corpus,
        &content,
        args.latency_samples as usize,
        &mut rng,
        progress,
    )?;
    drop(flusher);
    drop(store);

    let ours_ratio = ratio(stats.orig_bytes, stats.compr_bytes);
    let vs_zram = zram.as_ref().map(|z| VersusZram {
        write: write_gbps / z.write_gbps,
        read: read_gbps / z.read_gbps,
        ratio: ours_ratio / z.ratio,
        mem_ratio: mem_ratio / z.mem_ratio,
    });

    let config = &plan.config;
    Ok(BenchReport {
        corpus: corpus.source.to_string(),
        pages,
        bytes: bytes as u64,
        algorithm: format!("{:?}", config.algorithm),
        backend: config
            .forced_backend
            .map_or_else(|| "auto".to_string(), |b| format!("{b:?}")),
        batched: config.batched,
        batch_threshold: config.batch_threshold,
        flush_timeout_ms: config.flush_timeout.as_millis() as u64,
        threads: plan.threads,
        request_bytes: plan.request_bytes,
        repeat,
        load_average,
        write_gbps,
        read_gbps,
        runs,
        ratio: ours_ratio,
        mem_ratio,
        mem_ratio_all_in: ratio(
            stats.orig_bytes,
            stats.mem_used + stats.metadata_bytes + stats.batch_buffer_bytes,
        ),
        metadata_bytes_per_page: stats.metadata_bytes as f64 / pages as f64,
        stats,
        overwrite,
        codec,
        latency,
        zram,
        vs_zram,
        verified: true,
    })
}

/// `trueno-ublk bench`: measure and print.
pub fn run(args: &BenchArgs) -> Result<(), BenchError> {
    let progress = if args.json || !std::io::stderr().is_terminal() {
        Progress::hidden()
    } else {
        Progress::on_stderr_after_a_second()
    };
    let corpus = load_corpus(args)?;
    let report = measure(args, &corpus, &progress);
    progress.finish();
    let report = report?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.to_text());
    }
    Ok(())
}
