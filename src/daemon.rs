//! Wiring one device: the page store behind a ublk device, queue threads, signals, readiness
//! (sd_notify) and a clean stop. `create` without `--foreground` starts this same program
//! detached and returns once the device is live.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::mman::{mlockall, MlockAllFlags};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use thiserror::Error;

use crate::cli::CreateArgs;
use crate::codec::{Algorithm, Backend, BatchCodec};
use crate::config::{self, DeviceSettings};
use crate::stats::{self, DeviceReport};
use crate::store::{BatchedPageStore, StoreError, StoreThread};
use crate::ublk::device::block_path;
use crate::ublk::{BlockHandler, Device, DeviceSpec, Op, Request, UblkError};

/// Where daemons keep their logs and endpoints (root only).
pub const RUN_DIR: &str = stats::SOCKET_DIR;
/// Environment variable telling a started daemon that it was detached by `create`.
const DETACHED_ENV: &str = "TRUENO_UBLK_DETACHED_LOG";
/// How long `create` waits for a detached daemon to report the device live. START_DEV
/// scans partitions, which under emulation can take a while.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

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
            crate::cli::human_size(size_bytes),
            crate::cli::human_size(ram)
        )));
    }
    Ok(())
}

/// `mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT)`: lock every page the daemon has and
/// every page it faults in later. On fault, not up front: with plain `MCL_FUTURE` every new
/// mapping is populated on the spot, the page arena's whole address space included, and a
/// heap extension under memory pressure would wait in reclaim (which swaps out through this
/// very daemon) while holding the mmap lock that the queue threads may need.
fn lock_memory() {
    const MCL_ONFAULT: libc::c_int = 4;
    let flags = libc::MCL_CURRENT | libc::MCL_FUTURE | MCL_ONFAULT;
    if let Err(error) = mlockall(MlockAllFlags::from_bits_retain(flags)) {
        tracing::warn!(%error, "mlockall failed: the daemon's memory may be swapped out, which can deadlock swap on this device");
    }
}

/// Ready a thread of the store (flusher, reserve refill, rayon worker) for the I/O path, as
/// the ublk layer does its queue threads: stack and arena faulted in, codec contexts made, an
/// I/O flusher, top CPU priority.
fn ready_store_thread(algorithm: Algorithm) {
    crate::mem::prepare_io_thread();
    crate::codec::prepare_thread(algorithm);
    if let Err(error) = crate::ublk::sys::set_io_flusher() {
        tracing::warn!(%error, "PR_SET_IO_FLUSHER failed on a store thread");
    }
    if let Err(error) = crate::ublk::sys::raise_thread_priority() {
        tracing::warn!(%error, "could not raise a store thread's priority");
    }
}

/// Make the reserve's refill thread real-time. Why: it allocates the memory every stored page
/// needs, at the moment RAM runs out, in competition with the programs whose pages are being
/// swapped out. A real-time task may allocate below the min watermark (as zram, compressing in
/// the reclaiming task, may dip into the reserves), and runs as soon as it can, so the reserve
/// refills before writes wait on it: without this, the first seconds of a swap storm in a
/// 512 MiB VM failed writes with ENOMEM. It sleeps between refills, so it takes little CPU.
fn make_refill_realtime() {
    if let Err(error) = crate::ublk::sys::make_thread_realtime() {
        tracing::warn!(%error, "could not make the reserve's refill thread real-time (needs CAP_SYS_NICE): under sudden memory pressure writes may fail with ENOMEM");
    }
}

/// Turn the block layer's writeback throttling off for the device, as it is for zram (a bio
/// device, which has none). Why: swap-out is writeback, and throttled swap-out parks kswapd and
/// every task in reclaim in `wbt_wait` whenever the daemon is slow for a moment, so nobody frees
/// the pages whose swap-out has completed, and the store's refill thread cannot get them.
fn disable_writeback_throttling(id: u32) {
    let knob = format!("/sys/block/ublkb{id}/queue/wbt_lat_usec");
    match std::fs::write(&knob, "0") {
        Ok(()) => {}
        // A sandbox with a read-only /sys (systemd's ProtectKernelTunables=): the service
        // manager sets the knob instead (trueno-ublk@.service's ExecStartPost=+...).
        Err(error) if error.raw_os_error() == Some(libc::EROFS) => {
            tracing::info!(
                knob,
                "read-only /sys here: writeback throttling is left to the service manager"
            );
        }
        Err(error) => tracing::warn!(%error, knob, "could not turn writeback throttling off"),
    }
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

/// Keep the OOM killer away from the daemon: killing it would lose every page swapped to it,
/// and with them the processes that own those pages.
fn protect_from_oom_killer() {
    if let Err(error) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        tracing::warn!(%error, "could not set oom_score_adj: the OOM killer may pick this daemon and lose the pages swapped to it");
    }
}

/// Chunk memory the store keeps ready so that storing swapped-out pages never waits on
/// reclaim: a sixty-fourth of RAM, between 4 and 64 MiB, and no more than the memory limit.
/// What is held here is locked memory nobody else can use until the store fills it; with the
/// refill thread real-time, 4 MiB kept every write in the VM tests served.
fn reserve_bytes(ram_bytes: u64, mem_limit: Option<u64>) -> u64 {
    (ram_bytes / 64)
        .clamp(4 << 20, 64 << 20)
        .min(mem_limit.unwrap_or(u64::MAX))
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

/// `trueno-ublk create`.
pub fn create(args: CreateArgs) -> Result<(), DaemonError> {
    let settings = config::resolve(&args).map_err(|e| DaemonError::Settings(e.to_string()))?;
    check_size_against_ram(settings.size_bytes)?;
    device_spec(&settings).validate()?;
    if args.foreground {
        run_foreground(settings)
    } else {
        start_detached(&settings)
    }
}

/// Start this program again as a detached daemon (`create --foreground` with a private
/// notify socket) and wait until it reports the device live, or fails.
fn start_detached(settings: &DeviceSettings) -> Result<(), DaemonError> {
    // Fail fast, in the user's terminal, on what we can check here.
    drop(crate::ublk::Control::open()?);
    if let Some(id) = settings.id {
        if Path::new(&format!("/sys/class/ublk-char/ublkc{id}")).exists() {
            return Err(UblkError::IdInUse(id).into());
        }
    }
    std::fs::create_dir_all(RUN_DIR).map_err(io_error(format!("creating {RUN_DIR}")))?;
    set_mode(Path::new(RUN_DIR), 0o700)?;
    let log_path = PathBuf::from(format!("{RUN_DIR}/starting-{}.log", std::process::id()));
    let log = std::fs::File::create(&log_path)
        .map_err(io_error(format!("creating {}", log_path.display())))?;

    let socket_name = format!("trueno-ublk-create-{}-{:x}", std::process::id(), nanos());
    let socket = UnixDatagram::bind_addr(
        &SocketAddr::from_abstract_name(socket_name.as_bytes())
            .map_err(io_error("naming the notify socket"))?,
    )
    .map_err(io_error("binding the notify socket"))?;
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .map_err(io_error("notify socket"))?;

    let exe = std::env::current_exe().map_err(io_error("finding this program"))?;
    let mut child_args: Vec<OsString> = std::env::args_os().skip(1).collect();
    child_args.push("--foreground".into());
    let mut child = Command::new(exe)
        .args(child_args)
        .env("NOTIFY_SOCKET", format!("@{socket_name}"))
        .env(DETACHED_ENV, &log_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(io_error("starting the daemon"))?;

    let deadline = Instant::now() + READY_TIMEOUT;
    let mut buffer = [0u8; 4096];
    loop {
        match socket.recv(&mut buffer) {
            Ok(n) => {
                let message = String::from_utf8_lossy(&buffer[..n]);
                let field = |key: &str| {
                    message
                        .lines()
                        .find_map(|l| l.strip_prefix(key))
                        .map(str::to_owned)
                };
                if message.lines().any(|l| l == "READY=1") {
                    println!("{}", field("STATUS=").unwrap_or_default());
                    return Ok(());
                }
                if field("ERRNO=").is_some() {
                    let _ = child.wait();
                    return Err(DaemonError::Daemon(
                        field("STATUS=").unwrap_or_else(|| "the daemon failed".into()),
                    ));
                }
            }
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(error) => return Err(io_error("reading the notify socket")(error)),
        }
        if let Some(status) = child
            .try_wait()
            .map_err(io_error("waiting for the daemon"))?
        {
            return Err(DaemonError::Daemon(format!(
                "the daemon exited ({status}) before the device was live; its log: {}",
                log_path.display()
            )));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err(DaemonError::Daemon(format!(
                "the device was not live after {}s; daemon log: {}",
                READY_TIMEOUT.as_secs(),
                log_path.display()
            )));
        }
    }
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn set_mode(path: &Path, mode: u32) -> Result<(), DaemonError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io_error(
        format!("setting permissions of {}", path.display()),
    ))
}

/// Readiness and status for the service manager, or for the `create` that started us
/// (`NOTIFY_SOCKET`, the sd_notify protocol).
struct Notifier {
    socket: Option<String>,
}

impl Notifier {
    fn from_env() -> Self {
        Self {
            socket: std::env::var_os("NOTIFY_SOCKET").map(|s| s.to_string_lossy().into_owned()),
        }
    }

    fn send(&self, state: &str) {
        let Some(path) = &self.socket else { return };
        let address = match path.strip_prefix('@') {
            Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
            None => SocketAddr::from_pathname(path),
        };
        let sent = address
            .and_then(|address| UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &address));
        if let Err(error) = sent {
            tracing::warn!(%error, socket = path, "sd_notify failed");
        }
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
    let (gpu, gpu_state) = match settings.store.forced_backend {
        Some(Backend::Simd | Backend::SimdParallel) => (None, "not used (--backend)".to_string()),
        _ => crate::gpu::open_for_store(algorithm),
    };
    tracing::info!(gpu = gpu_state, "GPU backend");
    let mut store_config = settings.store_config(gpu.is_some());
    store_config.reserve_bytes =
        reserve_bytes(config::ram_bytes().unwrap_or(0), store_config.mem_limit);
    let store = BatchedPageStore::new(store_config, gpu.clone().map(|g| g as Arc<dyn BatchCodec>))?;
    let flusher = store
        .start_flusher(move |role| {
            ready_store_thread(algorithm);
            if role == StoreThread::Refill {
                make_refill_realtime();
            }
        })
        .map_err(io_error("starting the flusher"))?;
    let handler = Arc::new(StoreHandler {
        store: store.clone(),
        algorithm,
        errors: AtomicU64::new(0),
    });

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
        ms = started.elapsed().as_millis() as u64,
        "device live"
    );
    // Only root can read the endpoint; `stat` still works for the device if it fails.
    let report_store = store.clone();
    let report_settings = settings.clone();
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
        DeviceReport::new(id, &report_settings, gpu, report_store.stats())
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

/// Serves block requests from the page store.
struct StoreHandler {
    store: Arc<BatchedPageStore>,
    algorithm: Algorithm,
    errors: AtomicU64,
}

impl BlockHandler for StoreHandler {
    fn prepare_thread(&self) {
        crate::codec::prepare_thread(self.algorithm);
    }

    fn handle(&self, request: &Request, data: &mut [u8]) -> Result<(), i32> {
        let result = match request.op {
            Op::Read => self.store.read(request.offset, data),
            Op::Write => self.store.write(request.offset, data),
            // Pages are in daemon memory as soon as a write is acknowledged: nothing to flush.
            Op::Flush => Ok(()),
            Op::Discard | Op::WriteZeroes => self.store.discard(request.offset, request.len),
            Op::Unsupported(_) => return Err(-libc::EOPNOTSUPP),
        };
        result.map_err(|error| {
            // Log the first errors and then every 1024th, so a full device cannot flood the log.
            let count = self.errors.fetch_add(1, Ordering::Relaxed);
            if count < 16 || count % 1024 == 0 {
                tracing::warn!(?request, %error, errors = count + 1, "request failed");
            }
            error.errno()
        })
    }
}
