//! The CUDA side: probing, the context and module (set up once), and pipeline slots with a
//! stream, pinned host buffers and device buffers each. Every driver call is here.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "page counts per launch are at most a chunk (thousands), and kernel times are milliseconds"
)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::model::{PAGES_PER_BLOCK, WARP};
use super::pipeline::{hung, DeviceSlot, Job, SlotFactory};
use super::{BatchTimes, FaultPoint, Faults, GpuError};
use crate::codec::PAGE_SIZE;

/// The kernels, generated from `kernels/lz4.cu` by `scripts/gen-ptx.sh`.
const LZ4_PTX: &str = include_str!("kernels/lz4.ptx");
const THREADS_PER_BLOCK: u32 = (WARP * PAGES_PER_BLOCK) as u32;

fn driver(doing: &'static str) -> impl FnOnce(DriverError) -> GpuError {
    move |e| GpuError::Driver {
        doing,
        message: e.to_string(),
    }
}

/// Opens device `ordinal` and returns its description, or why it cannot be used.
pub(super) fn probe_device(ordinal: usize) -> Result<String, GpuError> {
    CudaDevice::open(ordinal).map(|device| device.description)
}

/// A context with the LZ4 module loaded.
pub(super) struct CudaDevice {
    ctx: Arc<CudaContext>,
    compress: CudaFunction,
    decompress: CudaFunction,
    description: String,
}

impl CudaDevice {
    pub(super) fn open(ordinal: usize) -> Result<Self, GpuError> {
        // SAFETY: only tries to dlopen the driver library; no CUDA call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        // cudarc panics when a driver symbol it expects is missing (a driver older than the
        // CUDA version it was built for): that is "no usable GPU", not a crash of the daemon.
        catch_unwind(AssertUnwindSafe(|| Self::open_checked(ordinal))).unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(GpuError::Driver {
                doing: "loading the CUDA driver (is it older than CUDA 12.8?)",
                message: message.to_owned(),
            })
        })
    }

    fn open_checked(ordinal: usize) -> Result<Self, GpuError> {
        let count = CudaContext::device_count().map_err(driver("counting CUDA devices"))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(GpuError::NoDevice(ordinal));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("creating the CUDA context"))?;
        let name = ctx.name().map_err(driver("reading the device name"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        if (major, minor) < (7, 5) {
            return Err(GpuError::TooOld { name, major, minor });
        }
        let module = ctx.load_module(Ptx::from_src(LZ4_PTX)).map_err(driver(
            "loading the LZ4 kernels (PTX 8.8 needs a driver for CUDA 12.9 or newer)",
        ))?;
        let compress = module
            .load_function("lz4_compress_pages")
            .map_err(driver("finding lz4_compress_pages"))?;
        let decompress = module
            .load_function("lz4_decompress_pages")
            .map_err(driver("finding lz4_decompress_pages"))?;
        Ok(Self {
            ctx,
            compress,
            decompress,
            description: format!("{name} (sm_{major}{minor})"),
        })
    }
}

/// Pinned host memory, zeroed (cudarc hands it out uninitialised).
fn pinned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    len: usize,
    flags: u32,
) -> Result<PinnedHostSlice<T>, GpuError> {
    // SAFETY: the memory is uninitialised; it is zeroed below before anything reads it.
    let mut slice = unsafe { ctx.alloc_pinned_with_flags::<T>(len, flags) }
        .map_err(driver("allocating pinned host memory"))?;
    let ptr = slice
        .as_mut_ptr()
        .map_err(driver("allocating pinned host memory"))?;
    // SAFETY: `ptr` points to `len` elements of `T` owned by `slice`, for which all-zero bytes
    // are a valid value (`ValidAsZeroBits`).
    unsafe { std::ptr::write_bytes(ptr, 0, len) };
    Ok(slice)
}

fn timing_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent, GpuError> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(driver("creating a CUDA event"))
}

impl SlotFactory for CudaDevice {
    fn new_slot(
        &self,
        chunk_pages: usize,
        faults: Arc<Faults>,
    ) -> Result<Box<dyn DeviceSlot>, GpuError> {
        let ctx = &self.ctx;
        let stream = ctx.new_stream().map_err(driver("creating a CUDA stream"))?;
        let bytes = chunk_pages * PAGE_SIZE;
        // Inputs are only written by the host: write-combined memory copies in faster.
        // Outputs are read by the host: plain pinned memory.
        let write_combined = sys::CU_MEMHOSTALLOC_WRITECOMBINED;
        let alloc = "allocating device memory";
        Ok(Box::new(CudaSlot {
            host_in: pinned(ctx, bytes, write_combined)?,
            host_index: pinned(ctx, 2 * chunk_pages, write_combined)?,
            host_out: pinned(ctx, bytes, 0)?,
            host_words: pinned(ctx, chunk_pages, 0)?,
            dev_in: stream.alloc_zeros(bytes).map_err(driver(alloc))?,
            dev_offsets: stream.alloc_zeros(chunk_pages).map_err(driver(alloc))?,
            dev_lens: stream.alloc_zeros(chunk_pages).map_err(driver(alloc))?,
            dev_out: stream.alloc_zeros(bytes).map_err(driver(alloc))?,
            dev_words: stream.alloc_zeros(chunk_pages).map_err(driver(alloc))?,
            started: timing_event(ctx)?,
            copied_in: timing_event(ctx)?,
            ran: timing_event(ctx)?,
            copied_out: timing_event(ctx)?,
            drained: timing_event(ctx)?,
            submitted: false,
            chunk_pages,
            compress: self.compress.clone(),
            decompress: self.decompress.clone(),
            ctx: ctx.clone(),
            stream,
            faults,
        }))
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.ctx.mem_get_info().ok()
    }
}

struct CudaSlot {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    compress: CudaFunction,
    decompress: CudaFunction,
    chunk_pages: usize,
    host_in: PinnedHostSlice<u8>,
    host_index: PinnedHostSlice<u32>,
    host_out: PinnedHostSlice<u8>,
    host_words: PinnedHostSlice<u32>,
    dev_in: CudaSlice<u8>,
    dev_offsets: CudaSlice<u32>,
    dev_lens: CudaSlice<u32>,
    dev_out: CudaSlice<u8>,
    dev_words: CudaSlice<u32>,
    /// Recorded before copy in, after copy in, after the kernel, after copy out.
    started: CudaEvent,
    copied_in: CudaEvent,
    ran: CudaEvent,
    copied_out: CudaEvent,
    /// Recorded by `wait`: done once everything submitted to the stream is.
    drained: CudaEvent,
    submitted: bool,
    faults: Arc<Faults>,
}

impl CudaSlot {
    fn record(&self, event: &CudaEvent) -> Result<(), GpuError> {
        event
            .record(&self.stream)
            .map_err(driver("recording a CUDA event"))
    }

    fn launch_config(pages: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (pages.div_ceil(PAGES_PER_BLOCK) as u32, 1, 1),
            block_dim: (THREADS_PER_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    // The host buffers are handed to the asynchronous copies as plain slices: they are pinned,
    // so the copies really are asynchronous, and the pipeline touches a slot's host buffers
    // only after `wait` (stream synchronised) — never while its copies may still run.

    fn submit_compress(&mut self, pages: usize, max_out: u32) -> Result<(), GpuError> {
        let bytes = pages * PAGE_SIZE;
        let copy_in = "copying pages to the GPU";
        self.faults.check(FaultPoint::CopyIn)?;
        self.record(&self.started)?;
        let host_in = &self.host_in.as_slice().map_err(driver(copy_in))?[..bytes];
        self.stream
            .memcpy_htod(host_in, &mut self.dev_in.slice_mut(..bytes))
            .map_err(driver(copy_in))?;
        self.record(&self.copied_in)?;

        self.faults.check(FaultPoint::Launch)?;
        let count = pages as u32;
        // The kernel's writes stay inside a page's slot only up to a page: checked here, where
        // the launch relies on it, whatever the caller asked for.
        let max_out = max_out.min(PAGE_SIZE as u32);
        let mut launch = self.stream.launch_builder(&self.compress);
        launch
            .arg(&self.dev_in)
            .arg(&mut self.dev_out)
            .arg(&mut self.dev_words)
            .arg(&count)
            .arg(&max_out);
        // SAFETY: the arguments match `lz4_compress_pages(const uint4 *pages, u8 *out,
        // u32 *out_lens, u32 n_pages, u32 max_out)`; every buffer holds `chunk_pages >= pages`
        // pages or words, and `max_out`, clamped to PAGE_SIZE above, keeps each page's output
        // inside its slot.
        unsafe { launch.launch(Self::launch_config(pages)) }
            .map_err(driver("launching lz4_compress_pages"))?;
        self.record(&self.ran)?;

        self.copy_out(pages)
    }

    fn submit_decompress(&mut self, pages: usize, bytes: usize) -> Result<(), GpuError> {
        let copy_in = "copying compressed pages to the GPU";
        let chunk = self.chunk_pages;
        self.faults.check(FaultPoint::CopyIn)?;
        self.record(&self.started)?;
        let host_in = &self.host_in.as_slice().map_err(driver(copy_in))?[..bytes];
        self.stream
            .memcpy_htod(host_in, &mut self.dev_in.slice_mut(..bytes))
            .map_err(driver(copy_in))?;
        let index = self.host_index.as_slice().map_err(driver(copy_in))?;
        self.stream
            .memcpy_htod(&index[..pages], &mut self.dev_offsets.slice_mut(..pages))
            .map_err(driver(copy_in))?;
        self.stream
            .memcpy_htod(
                &index[chunk..chunk + pages],
                &mut self.dev_lens.slice_mut(..pages),
            )
            .map_err(driver(copy_in))?;
        self.record(&self.copied_in)?;

        self.faults.check(FaultPoint::Launch)?;
        let count = pages as u32;
        let mut launch = self.stream.launch_builder(&self.decompress);
        launch
            .arg(&self.dev_in)
            .arg(&self.dev_offsets)
            .arg(&self.dev_lens)
            .arg(&mut self.dev_out)
            .arg(&mut self.dev_words)
            .arg(&count);
        // SAFETY: the arguments match `lz4_decompress_pages(const u8 *inputs,
        // const u32 *in_offsets, const u32 *in_lens, uint4 *out, u32 *status, u32 n_pages)`;
        // the host packed every page's bytes inside `dev_in` (offset + len <= bytes), and the
        // kernel itself checks every read against `in_lens` and every write against the page.
        unsafe { launch.launch(Self::launch_config(pages)) }
            .map_err(driver("launching lz4_decompress_pages"))?;
        self.record(&self.ran)?;

        self.copy_out(pages)
    }

    fn copy_out(&mut self, pages: usize) -> Result<(), GpuError> {
        let copy_out = "copying results from the GPU";
        self.faults.check(FaultPoint::CopyOut)?;
        let words = self.host_words.as_mut_slice().map_err(driver(copy_out))?;
        self.stream
            .memcpy_dtoh(&self.dev_words.slice(..pages), &mut words[..pages])
            .map_err(driver(copy_out))?;
        let out = self.host_out.as_mut_slice().map_err(driver(copy_out))?;
        self.stream
            .memcpy_dtoh(
                &self.dev_out.slice(..pages * PAGE_SIZE),
                &mut out[..pages * PAGE_SIZE],
            )
            .map_err(driver(copy_out))?;
        self.record(&self.copied_out)?;
        self.submitted = true;
        Ok(())
    }
}

/// `wait` spins this long before it sleeps between polls of the stream.
const SPIN_FOR: Duration = Duration::from_micros(100);
/// `wait`'s sleep between polls once it has spun `SPIN_FOR`.
const POLL_SLEEP: Duration = Duration::from_micros(50);

fn elapsed_ns(from: &CudaEvent, to: &CudaEvent) -> Result<u64, GpuError> {
    let ms = from
        .elapsed_ms(to)
        .map_err(driver("reading CUDA event times"))?;
    // A negative time (events recorded out of order) counts as none.
    Ok((f64::from(ms.max(0.0)) * 1e6) as u64)
}

impl DeviceSlot for CudaSlot {
    fn input(&mut self) -> Result<&mut [u8], GpuError> {
        self.host_in
            .as_mut_slice()
            .map_err(driver("using pinned memory"))
    }

    fn index(&mut self) -> Result<&mut [u32], GpuError> {
        self.host_index
            .as_mut_slice()
            .map_err(driver("using pinned memory"))
    }

    fn submit(&mut self, job: Job) -> Result<(), GpuError> {
        self.submitted = false;
        match job {
            Job::Compress { pages, max_out } => self.submit_compress(pages, max_out),
            Job::Decompress { pages, bytes } => self.submit_decompress(pages, bytes),
        }
    }

    fn wait(&mut self, hang_after: Duration) -> Result<BatchTimes, GpuError> {
        let waiting = "waiting for the GPU";
        let hangs = self.faults.check(FaultPoint::Hang).is_err();
        self.faults.check(FaultPoint::Sync)?;
        // Polled against a deadline rather than `synchronize`d, which has none: a wedged GPU
        // would hold the store's flush mutex for good. An event recorded now covers whatever
        // reached the stream, a job or part of one whose submit failed.
        self.record(&self.drained)?;
        let start = Instant::now();
        while hangs || !self.drained.try_is_complete().map_err(driver(waiting))? {
            let waited = start.elapsed();
            if waited >= hang_after {
                return Err(hung(waited));
            }
            // A chunk takes about a millisecond: spin through the first tenth of one.
            if waited < SPIN_FOR {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(POLL_SLEEP);
            }
        }
        self.ctx
            .check_err()
            .map_err(driver("waiting for the GPU"))?;
        if !std::mem::take(&mut self.submitted) {
            return Ok(BatchTimes::default());
        }
        Ok(BatchTimes {
            kernel_ns: elapsed_ns(&self.copied_in, &self.ran)?,
            transfer_ns: elapsed_ns(&self.started, &self.copied_in)?
                + elapsed_ns(&self.ran, &self.copied_out)?,
        })
    }

    fn output(&mut self) -> Result<(&[u8], &[u32]), GpuError> {
        let out = self
            .host_out
            .as_slice()
            .map_err(driver("reading pinned memory"))?;
        let words = self
            .host_words
            .as_slice()
            .map_err(driver("reading pinned memory"))?;
        Ok((out, words))
    }
}
