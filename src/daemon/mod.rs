//! Wiring one device: the page store behind a ublk device, queue threads, signals, readiness
//! (sd_notify) and a clean stop. `create` without `--foreground` starts this same program
//! detached and returns once the device is live.

#![forbid(unsafe_code)]

mod detach;
mod handler;
mod harden;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use thiserror::Error;

use crate::codec::BatchCodec;
use crate::config::{self, DeviceOptions, DeviceSettings};
use crate::gpu::NoGpu;
use crate::stats::{self, DeviceReport};
use crate::store::{BatchedPageStore, StoreError, StoreThread};
use crate::ublk::device::block_path;
use crate::ublk::{Device, DeviceSpec, UblkError};
use crate::units::human_size;
use detach::{start_detached, Notifier};
use handler::StoreHandler;
use harden::{
    disable_writeback_throttling, lock_memory, make_refill_realtime, protect_from_oom_killer,
    ready_store_thread,
};

/// Where daemons keep their logs and endpoints (root only).
pub const RUN_DIR: &str = stats::SOCKET_DIR;
/// Environment variable telling a started daemon that it was detached by `create`.
const DETACHED_ENV: &str = "TRUENO_UBLK_DETACHED_LOG";

/// Log lines waiting for the writer thread before new ones are dropped.
const LOG_BACKLOG_LINES: usize = 1024;
/// Bytes of buffer per tag: the largest READ or WRITE the kernel sends us.
pub const DEFAULT_MAX_IO_BYTES: u32 = 64 << 10;

#[derive(Debug, Error)]
pub enum DaemonError {
    #[error(transparent)]
    Ublk(#[from] UblkError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Settings(String),
    #[error(transparent)]
    NoGpu(#[from] NoGpu),
    #[error("{0}")]
    Daemon(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let what = what.into();
    move |source| DaemonError::Io { what, source }
}

/// Refuse a size whose page table (16 bytes per 4 KiB page, allocated up front) would take
/// more than an eighth of RAM, that is a device more than 32 times RAM, which no compressed
/// RAM device could fill anyway.
fn check_size_against_ram(size_bytes: u64) -> Result<(), DaemonError> {
    let Ok(ram) = config::ram_bytes() else {
        return Ok(());
    };
    if size_bytes > ram.saturating_mul(32) {
        return Err(DaemonError::Settings(format!(
            "size {} is more than 32 times this machine's RAM ({}); a compressed RAM device \
             cannot hold that much",
            human_size(size_bytes),
            human_size(ram)
        )));
    }
    Ok(())
}

/// Whether a stop request may stop the device: not while the kernel holds it (swap, a mount),
/// since every I/O after STOP_DEV fails and processes with pages out die, PID 1 among them.
/// The daemon keeps serving instead and says why; swapoff (or `systemctl stop` of the swap
/// unit, which is ordered before this daemon's stop) first, then stop again.
fn may_stop(path: &str) -> bool {
    match crate::blockdev::is_claimed(Path::new(path)) {
        Ok(false) => true,
        Ok(true) => {
            tracing::warn!(
                device = path,
                "not stopping: the device is in use (active swap or mounted); stopping it now would fail every page it holds. Run `swapoff {path}` (or stop its swap unit) first, then stop again"
            );
            false
        }
        Err(error) => {
            tracing::warn!(
                device = path,
                %error,
                "not stopping: could not tell whether the device is in use; check /proc/swaps and mounts, then use `trueno-ublk delete --force`"
            );
            false
        }
    }
}

/// The ublk side of the settings.
fn device_spec(settings: &DeviceSettings) -> DeviceSpec {
    DeviceSpec {
        id: settings.id,
        size_bytes: settings.size_bytes,
        queues: settings.queues,
        depth: settings.depth,
        max_io_bytes: DEFAULT_MAX_IO_BYTES,
    }
}

/// `trueno-ublk create`: serve the device in this process (`foreground`), or start a detached
/// daemon that does and return once the device is live.
pub fn create(options: &DeviceOptions, foreground: bool) -> Result<(), DaemonError> {
    let settings = config::resolve(options).map_err(|e| DaemonError::Settings(e.to_string()))?;
    check_size_against_ram(settings.size_bytes)?;
    device_spec(&settings).validate()?;
    if foreground {
        run_foreground(settings)
    } else {
        start_detached(&settings)
    }
}

/// Serve the device in this process until SIGTERM/SIGINT or until the device is stopped.
fn run_foreground(settings: DeviceSettings) -> Result<(), DaemonError> {
    // Fail before anything else on what needs no set-up: no driver, no permission.
    drop(crate::ublk::Control::open()?);
    let detached_log = std::env::var_os(DETACHED_ENV).map(PathBuf::from);
    if detached_log.is_some() {
        // Leave the terminal's session so its hangup and job control never reach us.
        let _ = nix::unistd::setsid();
    }
    let _log_writer = init_logging();
    let mut notifier = Notifier::from_env();
    let result = serve(settings, detached_log.as_deref(), &mut notifier);
    if let Err(error) = &result {
        tracing::error!(%error, "trueno-ublk daemon failed");
        notifier.send(&format!("STATUS={error}\nERRNO={}", libc::EIO));
    }
    result
}

/// Log to stderr (the log file, when detached) through a writer thread: a queue thread that
/// logs under memory pressure must not wait for the page cache of the log file (seen in the
/// VM: a queue thread stuck allocating a page of the log while every swap bio waited for it).
/// Lines past the writer's backlog are dropped, never waited for. Keep the guard alive: its
/// drop flushes the backlog.
fn init_logging() -> tracing_appender::non_blocking::WorkerGuard {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TRUENO_UBLK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // A short backlog: its buffer is allocated (and locked) up front.
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(LOG_BACKLOG_LINES)
        .lossy(true)
        .finish(std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    guard
}

fn serve(
    settings: DeviceSettings,
    detached_log: Option<&Path>,
    notifier: &mut Notifier,
) -> Result<(), DaemonError> {
    // The daemon serves swap, so none of its own memory may ever need swap to come back:
    // lock what is mapped now and every page faulted in later. What the I/O path uses is
    // written, and so faulted in and locked, when it is set up (page table, pending batches,
    // tag buffers, chunk reserve), before the device is live.
    lock_memory();
    protect_from_oom_killer();
    crate::mem::configure_heap();
    let algorithm = settings.store.algorithm;
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
        .start_handler(move |_| ready_store_thread(algorithm))
        .build_global();

    // Signals first, so a SIGTERM during start-up is not lost.
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .map_err(io_error("installing signal handlers"))?;
    let (gpu, gpu_state) = crate::gpu::open_for_store(algorithm, settings.store.forced_backend)?;
    tracing::info!(gpu = gpu_state, "GPU backend");
    let store_config = settings.store_config(gpu.is_some(), config::ram_bytes().unwrap_or(0));
    let store = BatchedPageStore::new(store_config, gpu.clone().map(|g| g as Arc<dyn BatchCodec>))?;
    let flusher = store
        .start_flusher(move |role| {
            ready_store_thread(algorithm);
            if role == StoreThread::Refill {
                make_refill_realtime();
            }
        })
        .map_err(io_error("starting the flusher"))?;
    let handler = Arc::new(StoreHandler::new(store.clone(), algorithm));

    let started = Instant::now();
    let device = Device::create(device_spec(&settings), handler)?;
    let id = device.id();
    let path = block_path(id);
    disable_writeback_throttling(id);
    if let Some(log) = detached_log {
        let _ = std::fs::rename(log, format!("{RUN_DIR}/ublkb{id}.log"));
    }
    tracing::info!(
        device = path,
        size = settings.size_bytes,
        queues = device.info().nr_hw_queues,
        depth = device.info().queue_depth,
        ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        "device live"
    );
    // Only root can read the endpoint; `stat` still works for the device if it fails.
    let report_store = store.clone();
    let report_settings = settings.clone();
    let timing = device.timing();
    // The idle footprint: everything set up, nothing stored yet.
    let idle_rss = crate::procstat::ProcessMemory::now(0).rss_bytes;
    let _stats_endpoint = stats::serve(id, move || {
        let gpu = match &gpu {
            Some(codec) => {
                let stats = codec.stats();
                format!(
                    "{gpu_state}: {} pages in {} batches, kernel {} ms, transfer {} ms, {} batches fell back to the CPU",
                    stats.pages_compressed,
                    stats.batches,
                    stats.kernel_ns / 1_000_000,
                    stats.transfer_ns / 1_000_000,
                    stats.fallback_batches
                )
            }
            None => gpu_state.clone(),
        };
        let mut report = DeviceReport::new(id, &report_settings, gpu, report_store.stats());
        report.io = timing.snapshot();
        report.memory = crate::procstat::ProcessMemory::now(idle_rss);
        report
    })
    .map_err(|error| tracing::warn!(%error, "stats endpoint unavailable: `trueno-ublk stat` will not see this device"))
    .ok();
    if detached_log.is_none() {
        println!("{path}");
        let _ = std::io::stdout().flush();
    }
    notifier.send(&format!(
        "READY=1\nSTATUS={path}\nMAINPID={}",
        std::process::id()
    ));
    if detached_log.is_some() {
        // `create` has printed the path and exited: nobody listens any more.
        notifier.socket = None;
    }

    let (signal_tx, signal_rx) = crossbeam_channel::bounded(4);
    let signal_handle = signals.handle();
    let signal_thread = std::thread::Builder::new()
        .name("signals".into())
        .stack_size(64 << 10)
        .spawn(move || {
            for signal in signals.forever() {
                if signal_tx.send(signal).is_err() {
                    break;
                }
            }
        })
        .map_err(io_error("starting the signal thread"))?;
    loop {
        crossbeam_channel::select! {
            recv(signal_rx) -> signal => match signal {
                Ok(SIGHUP) => tracing::info!("SIGHUP ignored"),
                Ok(signal) => {
                    if may_stop(&path) {
                        tracing::info!(signal, "stopping");
                        break;
                    }
                }
                Err(_) => break,
            },
            recv(device.queue_exits()) -> _ => {
                tracing::warn!("a queue ended (device stopped from outside?); shutting down");
                break;
            }
        }
    }
    notifier.send("STOPPING=1");
    let stopped = device.shutdown();
    signal_handle.close();
    let _ = signal_thread.join();
    store.shutdown();
    drop(flusher);
    stopped?;
    tracing::info!(device = path, "device deleted");
    Ok(())
}
