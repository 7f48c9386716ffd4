//! The GPU batch codec: LZ4 compress and decompress of 4 KiB pages with the in-tree kernels of
//! `kernels/lz4.cu` (committed as `kernels/lz4.ptx`), behind `codec::BatchCodec`.
//!
//! - `probe()` never panics: it looks for the driver library before any CUDA call (cudarc
//!   panics without one) and says why there is no GPU. It opens a context and loads the
//!   kernels, so call it once (at start-up), not per batch.
//! - `GpuCodec` sets up context, module and streams once; pinned buffers and device buffers are
//!   allocated at the first batch, in `slots` pipeline slots that overlap host-to-device copy,
//!   kernel and device-to-host copy across the chunks of a batch (`pipeline.rs`).
//! - Any CUDA error in a batch makes `compress_batch` return `Err` (the store redoes the batch
//!   on the CPU) and makes `decompress_batch` decode that batch with the CPU codec it was given;
//!   either way the failure is counted (`GpuStats::fallback_batches`) and logged. A slot's
//!   work not done within `GpuConfig::hang_after` is a hung GPU: that batch and every later
//!   one go to the CPU, and the slots are abandoned, never freed (the GPU may still write to
//!   their buffers, and freeing them would wait for it).
//!
//! The kernels (one warp per page, four per block): compression loads the page into shared
//! memory, finds for every position the most recent earlier position with the same 4-byte hash
//! (rounds of 32 positions, a 4096-entry table in shared memory, `__match_any_sync` inside a
//! round), then parses greedily a window of 32 positions at a time (a ballot finds the first
//! position whose candidate really matches), extends the match 32 bytes per ballot, and encodes
//! each sequence (lane 0 writes token, lengths and offset; the warp copies the literals).
//! Decompression parses the tokens on every lane (broadcast reads) and copies each literal run
//! and match with the whole warp; every read and write is bounds-checked, and corrupt input is
//! a per-page status.
//!
//! How they are checked: `model.rs` is the same algorithm in Rust, step for step; the tests
//! check that its output decodes with liblz4 and lz4_flex and compresses as well as liblz4
//! (`tests/gpu_model.rs`), that the CUDA C source run on the CPU by a small SIMT emulator
//! (`kernels/emu/`) gives the model's bytes (`tests/gpu_kernel_emu.rs`), that the pipeline and
//! its fault handling lose no page (`tests/gpu_pipeline.rs`, on `GpuCodec::on_cpu_model`), and
//! on a GPU (`GPU_TESTS=1`) that the device gives the model's bytes (`tests/gpu_device.rs`).
//! `scripts/gen-ptx.sh` regenerates the PTX with NVRTC; `scripts/check-ptx.sh` assembles it
//! with ptxas for sm_75/80/90 and checks it is what the source compiles to.

pub mod bench;
mod cuda;
pub mod model;
mod pipeline;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use thiserror::Error;

use crate::codec::{BatchCodec, CodecError, CompressedBatch, Encoding, Page, PAGE_SIZE};
use pipeline::{Pipeline, SlotFactory};

/// Whether a GPU can be used, and if not, why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuProbe {
    Available { name: String },
    Unavailable { reason: String },
}

/// Probe for a usable GPU without panicking.
pub fn probe() -> GpuProbe {
    match cuda::probe_device(0) {
        Ok(name) => GpuProbe::Available { name },
        Err(e) => GpuProbe::Unavailable {
            reason: e.to_string(),
        },
    }
}

/// The one place that decides whether a store gets a GPU codec: `(codec, state in words)`,
/// where the state is what `stat` and `bench` show (the device's name, or why there is none).
/// `forced_backend` is the user's `--backend`: only `gpu` opens one, and without a usable one
/// it is an error that says why. `auto` (and a CPU backend) opens none, not even to probe: the
/// kernels have passed their tests on one GPU but never served a device, are no faster than
/// 16 CPU cores there (README, Benchmarks), and a CUDA context in a daemon whose memory is locked
/// would lock what the driver maps, so a GPU is the administrator's choice, not a default
/// (LZ4, which the GPU compresses, is the default algorithm). Only LZ4 runs on the GPU, so
/// other algorithms get no codec.
pub fn open_for_store(
    algorithm: crate::codec::Algorithm,
    forced_backend: Option<crate::codec::Backend>,
) -> Result<(Option<Arc<GpuCodec>>, String), NoGpu> {
    use crate::codec::Backend;
    if forced_backend != Some(Backend::Gpu) {
        return Ok((None, "not used (--backend gpu to use one)".to_string()));
    }
    match open_codec(algorithm) {
        (Some(codec), state) => Ok((Some(codec), state)),
        (None, state) => Err(NoGpu(state)),
    }
}

/// `--backend gpu` and no GPU codec could be opened.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("--backend gpu: no usable GPU ({0}); use --backend auto, simd or simd-parallel")]
pub struct NoGpu(pub String);

fn open_codec(algorithm: crate::codec::Algorithm) -> (Option<Arc<GpuCodec>>, String) {
    let name = match probe() {
        GpuProbe::Available { name } => name,
        GpuProbe::Unavailable { reason } => return (None, format!("no GPU: {reason}")),
    };
    if algorithm != crate::codec::Algorithm::Lz4 {
        return (
            None,
            format!("{name} (unused: the GPU compresses LZ4 only)"),
        );
    }
    let config = GpuConfig::default();
    let cpu = Arc::new(crate::codec::CpuCodec::parallel(
        crate::codec::Algorithm::Lz4,
    ));
    match GpuCodec::new(config, cpu) {
        Ok(codec) => (Some(Arc::new(codec)), name),
        Err(error) => (None, format!("{name} unusable: {error}")),
    }
}

/// `true` when `probe()` finds a usable GPU.
pub fn gpu_available() -> bool {
    matches!(probe(), GpuProbe::Available { .. })
}

/// Errors of the GPU backend. Each one makes the batch go to the CPU.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GpuError {
    #[error("no CUDA driver library (libcuda.so.1) found: install the NVIDIA driver to use the GPU backend")]
    NoDriver,
    #[error("no CUDA device {0}: check `nvidia-smi` and CUDA_VISIBLE_DEVICES")]
    NoDevice(usize),
    #[error(
        "GPU {name} has compute capability {major}.{minor}; the LZ4 kernels need 7.5 or newer"
    )]
    TooOld {
        name: String,
        major: i32,
        minor: i32,
    },
    #[error("CUDA driver call failed while {doing}: {message}")]
    Driver {
        doing: &'static str,
        message: String,
    },
    #[error("injected fault at {0:?} (test)")]
    Injected(FaultPoint),
    #[error("GPU kernel returned an impossible result: {0}")]
    BadOutput(String),
    #[error("GPU resting for {seconds} s more after {failures} failed batches in a row")]
    Resting { seconds: u64, failures: u32 },
    #[error(
        "the GPU did not finish a batch within {waited_ms} ms (hung? look for Xid lines in dmesg \
         and at `nvidia-smi`): the CPU compresses from now on; restart the daemon to use the GPU \
         again"
    )]
    Hung { waited_ms: u64 },
    #[error("the GPU hung earlier and is not used again until the daemon restarts")]
    GivenUp,
}

impl From<GpuError> for CodecError {
    fn from(e: GpuError) -> Self {
        CodecError::Gpu(e.to_string())
    }
}

/// The places in a batch where a test can make the next driver call fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    /// Allocating pinned or device buffers (an injected OOM).
    Alloc,
    /// Host-to-device copy.
    CopyIn,
    /// Kernel launch.
    Launch,
    /// Device-to-host copy.
    CopyOut,
    /// Waiting for a slot's work (where asynchronous kernel faults show up).
    Sync,
    /// Waiting for a slot's work that never finishes (a hung GPU): the wait gives up after
    /// `GpuConfig::hang_after`.
    Hang,
}

const FAULT_POINTS: usize = 6;

/// Armed faults: at each point, the next `skip` passes succeed, then `fail` passes fail with
/// `GpuError::Injected`.
#[derive(Debug, Default)]
pub struct Faults {
    armed: Mutex<[(u32, u32); FAULT_POINTS]>,
}

impl Faults {
    fn arm(&self, point: FaultPoint, skip: u32, fail: u32) {
        self.armed.lock()[point as usize] = (skip, fail);
    }

    /// Called by the slots just before the driver call at `point`.
    fn check(&self, point: FaultPoint) -> Result<(), GpuError> {
        let mut armed = self.armed.lock();
        let (skip, fail) = &mut armed[point as usize];
        if *skip > 0 {
            *skip -= 1;
            Ok(())
        } else if *fail > 0 {
            *fail -= 1;
            Err(GpuError::Injected(point))
        } else {
            Ok(())
        }
    }
}

/// Settings of the GPU codec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuConfig {
    /// CUDA device ordinal.
    pub device: usize,
    /// Most pages per pipeline chunk (one kernel launch); 2048 pages = 512 blocks of 4 warps.
    /// Smaller batches are cut into one chunk per slot (of 256 pages at least), and each slot's
    /// buffers hold the chunks of the largest batch so far, up to this.
    pub chunk_pages: usize,
    /// Pipeline slots (>= 3 so that copy in, kernel and copy out of consecutive chunks overlap).
    pub slots: usize,
    /// The longest LZ4 output kept; longer pages are stored `Raw` (zram's "huge" pages; the
    /// same rule and default as the CPU codec's `codec::MAX_COMPRESSED_LEN`). At most a page.
    pub max_compressed_len: usize,
    /// After `FAILURES_BEFORE_REST` failed batches in a row, batches skip the GPU (and go to
    /// the CPU at once) for this long, instead of failing and logging one by one.
    pub rest: Duration,
    /// A slot's work not done after this is a hung GPU (a batch takes milliseconds): the batch
    /// goes to the CPU, and so does every later one. Without a bound, a wedged GPU would stop
    /// every write to the device (the flush waits under the store's flush mutex) and its stop.
    pub hang_after: Duration,
}

/// Failed batches in a row that make the codec rest the GPU for `GpuConfig::rest`.
pub const FAILURES_BEFORE_REST: u32 = 3;

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            device: 0,
            chunk_pages: 2048,
            slots: 3,
            max_compressed_len: crate::codec::MAX_COMPRESSED_LEN,
            rest: Duration::from_secs(30),
            hang_after: Duration::from_secs(2),
        }
    }
}

/// A snapshot of the GPU codec's counters (`trueno-ublk stat`, `bench --backend gpu`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GpuStats {
    /// Batches done on the GPU.
    pub batches: u64,
    pub pages_compressed: u64,
    pub pages_decompressed: u64,
    /// Time in the kernels (GPU events).
    pub kernel_ns: u64,
    /// Time in host-to-device and device-to-host copies (GPU events).
    pub transfer_ns: u64,
    /// Host wall time of GPU batches, end to end (packing, pipeline, unpacking).
    pub wall_ns: u64,
    /// Batches that failed on the GPU and were done on the CPU.
    pub fallback_batches: u64,
    pub last_error: Option<String>,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    pages_compressed: AtomicU64,
    pages_decompressed: AtomicU64,
    kernel_ns: AtomicU64,
    transfer_ns: AtomicU64,
    wall_ns: AtomicU64,
    fallback_batches: AtomicU64,
    last_error: Mutex<Option<String>>,
}

/// Failures in a row, and until when the GPU rests.
#[derive(Default)]
struct Health {
    failures_in_a_row: u32,
    /// `failures_in_a_row` before the last success ended the row: a batch whose output is
    /// rejected after it came back (`output_rejected`) puts the row back and adds itself.
    row_before_last_success: u32,
    resting_until: Option<Instant>,
    /// The GPU hung: its slots are abandoned (their buffers may still be written to), and no
    /// batch goes to it again.
    given_up: bool,
}

/// GPU event times of one batch, in nanoseconds.
#[derive(Clone, Copy, Debug, Default)]
struct BatchTimes {
    kernel_ns: u64,
    transfer_ns: u64,
}

/// The GPU batch codec. LZ4 only: compresses to `Lz4` (or `Raw` for pages whose LZ4 is longer
/// than `max_compressed_len`); decompresses `Lz4` on the GPU, `Raw` by copy, and hands `Zstd`
/// to the CPU codec.
pub struct GpuCodec {
    config: GpuConfig,
    pipeline: Mutex<Pipeline>,
    faults: Arc<Faults>,
    cpu: Arc<dyn BatchCodec>,
    counters: Counters,
    health: Mutex<Health>,
}

impl GpuCodec {
    /// Opens the GPU (context, stream per slot, kernels). `cpu` decodes what the GPU does not
    /// (zstd pages, and whole batches after a GPU failure). Buffers are allocated at the first
    /// batch.
    pub fn new(config: GpuConfig, cpu: Arc<dyn BatchCodec>) -> Result<Self, GpuError> {
        let device = cuda::CudaDevice::open(config.device)?;
        Ok(Self::with_factory(config, cpu, Box::new(device)))
    }

    /// The same codec with the kernels' CPU model (`model.rs`) in place of the GPU: the whole
    /// pipeline, fault handling and CPU fallback run on any machine. For tests, and for checking
    /// the GPU path's output where there is no GPU; it is not fast.
    pub fn on_cpu_model(config: GpuConfig, cpu: Arc<dyn BatchCodec>) -> Self {
        Self::with_factory(config, cpu, Box::new(pipeline::ModelDevice))
    }

    fn with_factory(
        config: GpuConfig,
        cpu: Arc<dyn BatchCodec>,
        factory: Box<dyn SlotFactory>,
    ) -> Self {
        let faults = Arc::new(Faults::default());
        let pipeline = Pipeline::new(
            factory,
            config.slots.max(1),
            config.chunk_pages.max(1),
            config.hang_after,
            faults.clone(),
        );
        Self {
            config,
            pipeline: Mutex::new(pipeline),
            faults,
            cpu,
            counters: Counters::default(),
            health: Mutex::new(Health::default()),
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> GpuStats {
        let c = &self.counters;
        GpuStats {
            batches: c.batches.load(Ordering::Relaxed),
            pages_compressed: c.pages_compressed.load(Ordering::Relaxed),
            pages_decompressed: c.pages_decompressed.load(Ordering::Relaxed),
            kernel_ns: c.kernel_ns.load(Ordering::Relaxed),
            transfer_ns: c.transfer_ns.load(Ordering::Relaxed),
            wall_ns: c.wall_ns.load(Ordering::Relaxed),
            fallback_batches: c.fallback_batches.load(Ordering::Relaxed),
            last_error: c.last_error.lock().clone(),
        }
    }

    /// Free and total device memory in bytes (`None` without a device).
    pub fn device_memory(&self) -> Option<(usize, usize)> {
        self.pipeline.lock().memory_info()
    }

    /// Test hook: after `skip` more passes through `point`, the next `fail` passes fail as if
    /// the driver call there had failed (`FaultPoint::Alloc`: out of memory).
    pub fn inject_fault(&self, point: FaultPoint, skip: u32, fail: u32) {
        self.faults.arm(point, skip, fail);
    }

    /// `Err` while the GPU rests after repeated failures, and for good once it hung.
    fn check_rested(&self) -> Result<(), GpuError> {
        let health = self.health.lock();
        if health.given_up {
            return Err(GpuError::GivenUp);
        }
        match health.resting_until {
            Some(until) if until > Instant::now() => Err(GpuError::Resting {
                seconds: until.saturating_duration_since(Instant::now()).as_secs(),
                failures: FAILURES_BEFORE_REST,
            }),
            _ => Ok(()),
        }
    }

    fn record_success(&self, pages: usize, compress: bool, times: BatchTimes, start: Instant) {
        {
            let mut health = self.health.lock();
            health.row_before_last_success = std::mem::take(&mut health.failures_in_a_row);
        }
        let c = &self.counters;
        c.batches.fetch_add(1, Ordering::Relaxed);
        let pages_counter = if compress {
            &c.pages_compressed
        } else {
            &c.pages_decompressed
        };
        pages_counter.fetch_add(pages as u64, Ordering::Relaxed);
        c.kernel_ns.fetch_add(times.kernel_ns, Ordering::Relaxed);
        c.transfer_ns
            .fetch_add(times.transfer_ns, Ordering::Relaxed);
        c.wall_ns.fetch_add(
            u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Counts a batch done on the CPU instead; logs and rests the GPU unless it was resting.
    fn record_failure(&self, what: &str, pages: usize, e: &GpuError) {
        self.counters
            .fallback_batches
            .fetch_add(1, Ordering::Relaxed);
        if matches!(e, GpuError::Resting { .. } | GpuError::GivenUp) {
            return;
        }
        *self.counters.last_error.lock() = Some(e.to_string());
        let mut health = self.health.lock();
        if matches!(e, GpuError::Hung { .. }) {
            health.given_up = true;
            tracing::error!("GPU {what} of {pages} pages: {e}");
            return;
        }
        health.failures_in_a_row += 1;
        if health.failures_in_a_row >= FAILURES_BEFORE_REST {
            health.failures_in_a_row = 0;
            health.resting_until = Some(Instant::now() + self.config.rest);
            tracing::error!(
                "GPU {what} of {pages} pages failed, {FAILURES_BEFORE_REST} batches in a row; \
                 using the CPU only for {:?}: {e}",
                self.config.rest
            );
        } else {
            tracing::warn!("GPU {what} of {pages} pages failed, done on the CPU instead: {e}");
        }
    }

    /// Decodes the pages `indices` of `inputs` with the CPU codec into `out`/`status`.
    fn decompress_on_cpu(
        &self,
        inputs: &[(Encoding, &[u8])],
        indices: &[usize],
        out: &mut [Page],
        status: &mut [Result<(), CodecError>],
    ) {
        if indices.is_empty() {
            return;
        }
        let sub: Vec<(Encoding, &[u8])> = indices.iter().map(|&i| inputs[i]).collect();
        let mut pages = vec![[0u8; PAGE_SIZE]; indices.len()];
        let mut sub_status = vec![Ok(()); indices.len()];
        self.cpu.decompress_batch(&sub, &mut pages, &mut sub_status);
        for ((&i, page), st) in indices.iter().zip(&pages).zip(sub_status) {
            if st.is_ok() {
                out[i] = *page;
            }
            status[i] = st;
        }
    }
}

impl BatchCodec for GpuCodec {
    /// A failure like any other: in a row, they rest the GPU (its output came back `Ok`, so
    /// `record_success` had counted the batch a success and ended the row).
    fn output_rejected(&self, pages: usize) {
        {
            let mut health = self.health.lock();
            health.failures_in_a_row = health.row_before_last_success;
        }
        self.record_failure(
            "compression",
            pages,
            &GpuError::BadOutput("output rejected by the store".into()),
        );
    }

    fn compress_batch(&self, pages: &[&Page], out: &mut CompressedBatch) -> Result<(), CodecError> {
        let start = Instant::now();
        let max_out = self.config.max_compressed_len.min(PAGE_SIZE);
        let result = self.check_rested().and_then(|()| {
            self.pipeline
                .lock()
                .compress(pages, u32::from(crate::codec::page_len(max_out)), out)
        });
        match result {
            Ok(times) => {
                self.record_success(pages.len(), true, times, start);
                Ok(())
            }
            Err(e) => {
                self.record_failure("compression", pages.len(), &e);
                Err(e.into())
            }
        }
    }

    fn decompress_batch(
        &self,
        inputs: &[(Encoding, &[u8])],
        out: &mut [Page],
        status: &mut [Result<(), CodecError>],
    ) {
        let start = Instant::now();
        let n = inputs.len().min(out.len()).min(status.len());
        if n < inputs.len() {
            tracing::error!(
                "decompress_batch: {} inputs but {} pages and {} statuses; decoding {n}",
                inputs.len(),
                out.len(),
                status.len()
            );
        }
        let (inputs, out, status) = (&inputs[..n], &mut out[..n], &mut status[..n]);
        let mut on_gpu = Vec::new();
        let mut on_cpu = Vec::new();
        for (i, &(encoding, bytes)) in inputs.iter().enumerate() {
            match encoding {
                Encoding::Raw if bytes.len() == PAGE_SIZE => {
                    out[i].copy_from_slice(bytes);
                    status[i] = Ok(());
                }
                Encoding::Raw => status[i] = Err(CodecError::WrongLength(bytes.len())),
                Encoding::Lz4 if bytes.len() > PAGE_SIZE => status[i] = Err(CodecError::Corrupt),
                Encoding::Lz4 => on_gpu.push(i),
                Encoding::Zstd => on_cpu.push(i),
            }
        }
        if !on_gpu.is_empty() {
            let result = self.check_rested().and_then(|()| {
                self.pipeline
                    .lock()
                    .decompress(inputs, &on_gpu, out, status)
            });
            match result {
                Ok(times) => self.record_success(on_gpu.len(), false, times, start),
                Err(e) => {
                    self.record_failure("decompression", on_gpu.len(), &e);
                    on_cpu.extend_from_slice(&on_gpu);
                }
            }
        }
        self.decompress_on_cpu(inputs, &on_cpu, out, status);
    }
}
