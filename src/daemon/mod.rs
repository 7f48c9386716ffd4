//! Wiring one device: the page store behind a ublk device, queue threads, signals, readiness
//! (sd_notify) and a clean stop. `create` without `--foreground` starts this same program
//! detached and returns once the device is live.
//!
//! Three processes take part (`supervise` says why): `create` (which returns once the device
//! is live, unless `--foreground`), the supervisor (`create --foreground`, what systemd runs)
//! and the serving process it starts (`create ... --serve-child`), which owns the device and
//! the store. A serving process that finds its device already there, left quiesced by a
//! daemon that died or handed it over, resumes it with its pages.

#![forbid(unsafe_code)]

mod activity;
mod detach;
mod handler;
mod harden;
mod log_file;
mod memory_watch;
mod oom_victims;
mod signal_wake;
mod slot_frees;
mod supervise;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use thiserror::Error;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::codec::{BatchCodec, ThreadCodecs};
use crate::config::{self, DeviceOptions, DeviceSettings};
use crate::devices::{GateUnavailable, HandOverGate};
use crate::gpu::NoGpu;
use crate::slotfree::SlotFreeStats;
use crate::stats::{self, DeviceReport};
use crate::store::{
    remove_shared, store_thread_codecs, Backing, BatchedPageStore, Opened, StoreError, StoreThread,
    StoreThreads,
};
use crate::ublk::device::{block_path, device_exists};
use crate::ublk::{AddedDevice, Device, DeviceSpec, Standby, UblkError};
use crate::units::human_size;
use detach::{start_detached, Notifier};
use handler::StoreHandler;
use harden::{
    disable_writeback_throttling, lock_memory, prepare_codec_thread, protect_from_oom_killer,
    ready_io_thread, ready_refill_thread, ready_store_thread, reserve_list_space,
};
use signal_wake::SignalWake;

/// Where daemons keep their logs and endpoints (root only).
pub const RUN_DIR: &str = stats::SOCKET_DIR;

/// How long a hand-over waits for `fault-in` reads under way (64 pages at most each) before
/// it goes on without them: well within the unit's 10 s stop timeout.
const HAND_OVER_GATE_PATIENCE: Duration = Duration::from_secs(3);

/// The file a device's supervisor holds locked for its life (see `supervise::claim_device`).
fn claim_path(id: u32) -> String {
    format!("{RUN_DIR}/ublkb{id}.lock")
}

/// The pid of the supervisor that holds device `id`'s claim, if one does: it serves the
/// device, or resumes it (the device quiesced between a serving process's death and the
/// next one's takeover). `Some("?")` when the claim is held but names no pid.
pub fn device_claimed_by(id: u32) -> Option<String> {
    let path = claim_path(id);
    let file = std::fs::File::open(&path).ok()?;
    match file.try_lock_shared() {
        // Free: no supervisor (the lock goes when its holder's descriptor closes).
        Ok(()) => None,
        Err(std::fs::TryLockError::WouldBlock) => {
            let pid = std::fs::read_to_string(&path).unwrap_or_default();
            let pid = pid.trim();
            Some(if pid.is_empty() { "?" } else { pid }.to_string())
        }
        Err(std::fs::TryLockError::Error(_)) => None,
    }
}

/// For the command line's check that `reload` waits past it.
#[cfg(test)]
pub(crate) use supervise::RELOAD_READY_LIMIT;
/// Environment variable telling a started daemon that it was detached by `create`.
const DETACHED_ENV: &str = "TRUENO_UBLK_DETACHED_LOG";
/// Set by the supervisor for its children when a service manager restarts it should it die
/// (it runs in the foreground under one: systemd's unit, `Type=notify`). Without it (a
/// detached `create`, or one in a terminal), a serving process whose supervisor died serves
/// on: a device it handed over would wait for a daemon that nothing starts.
const MANAGED_ENV: &str = "TRUENO_UBLK_MANAGED";
/// Set by the supervisor for a serving process it starts once its device has been live: that
/// process resumes the device or ends; it never adds one (a `delete --lose-pages` between a
/// death and the restart would otherwise be answered with a new, empty device nobody asked
/// for, made without the unit's tuning).
const RESUME_ONLY_ENV: &str = "TRUENO_UBLK_RESUME_ONLY";

/// Log lines waiting for the writer thread before new ones are dropped.
const LOG_BACKLOG_LINES: usize = 1024;
/// How often a standby asks the kernel for its device's state (see `Standby::ping`) and
/// follows the store (`keep_ready`) while the store grows: each look maps what was carved
/// since the last, so what a takeover would still have to map stays small.
const STANDBY_PING: std::time::Duration = std::time::Duration::from_secs(1);
/// How often it does while the store is quiet (the last look found it as the one before):
/// there is nothing to follow, and an idle machine should not wake for it (a laptop's
/// `powertop` counts wake-ups). Under io_uring's idle time for a worker thread (5 s), although
/// a ring's last worker stays past it anyway.
const STANDBY_QUIET_PING: std::time::Duration = std::time::Duration::from_secs(4);
/// Heap a standby faults in for its takeover beyond what resuming the store needs (see
/// `store::resume_heap_bytes`): the main thread's codec context, the store's own structures.
const STANDBY_HEAP_BYTES: usize = 512 << 10;
/// Pages a standby holds and frees just before its takeover, for the kernel memory the
/// takeover needs (page tables of the store's mapping, the descriptor arrays' mappings).
const STANDBY_SPARE_BYTES: usize = 1 << 20;
/// The largest READ or WRITE the kernel sends us when every tag has a buffer that large (no
/// user copy).
const TAG_BUFFER_MAX_IO_BYTES: u32 = 64 << 10;
/// Of RAM, the share the buffers of every tag may lock where a device has them (no user copy),
/// for the device's life and again in the supervisor's standby: the default depth takes 2 MiB a
/// queue, a depth of thousands would take a small machine's memory.
const TAG_BUFFERS_RAM_DIVISOR: u64 = 16;
// Every id the driver takes names a store of its own.
const _: () = assert!(crate::ublk::params::MAX_DEVICE_ID <= crate::store::MAX_DEVICE_ID);
/// The largest READ or WRITE with user copy, whose data goes through the queue's staging
/// buffer a piece at a time.
const USER_COPY_MAX_IO_BYTES: u32 = 1 << 20;

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

/// Refuse to start on a host the daemon cannot serve on (`check_page_size`,
/// `check_overcommit`): before anything is set up, so that nothing is left to undo. A device
/// that exists already (a restart, an upgrade) is resumed whatever the overcommit mode: its
/// pages are in its store, and a daemon that tries to serve them beats none.
fn check_host(settings: &DeviceSettings) -> Result<(), DaemonError> {
    check_page_size()?;
    if settings.id.is_some_and(device_exists) {
        return Ok(());
    }
    check_overcommit(crate::mem::overcommit_mode())
}

/// Refuse strict overcommit (`vm.overcommit_memory` 2, `mode`): Linux 6.12 charges the
/// store's whole address space to the commit limit when its segment is made, and 7.3, which
/// grants the segment, refused the allocations after it (the flusher thread's signal stack, 41
/// bytes of heap), which killed the serving process before its device was live (SIGABRT).
/// Refused at once instead, whatever the commit limit's room today.
fn check_overcommit(mode: Option<u32>) -> Result<(), DaemonError> {
    if mode == Some(2) {
        return Err(DaemonError::Settings(
            "under strict overcommit (vm.overcommit_memory = 2) the kernel counts the store's \
             address space (16 times the device's size and 1 GiB) against the commit limit, or \
             refuses the daemon's threads memory after it: set vm.overcommit_memory to 0 (the \
             default) or 1"
                .to_string(),
        ));
    }
    Ok(())
}

/// Refuse a kernel whose pages are not 4 KiB (arm64 with 16 or 64 KiB pages): the store's
/// shared memory and the ublk queues' descriptor arrays are laid out in 4 KiB pages.
fn check_page_size() -> Result<(), DaemonError> {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE) {
        Ok(Some(size)) if usize::try_from(size).ok() != Some(crate::mem::HOST_PAGE) => {
            Err(DaemonError::Settings(format!(
                "this kernel's pages are {size} bytes; trueno-ublk needs a kernel with 4 KiB \
                 pages (on arm64, a 4K-page kernel flavour)"
            )))
        }
        _ => Ok(()),
    }
}

/// Refuse a device more than 32 times RAM, which no compressed RAM device could fill: its
/// page table alone (an entry, an idle hint and a checksum for each 4 KiB page, committed as
/// writes reach it, 14 bytes in all) would take a ninth of RAM at that size.
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

/// Signals that stop the daemon: `systemctl stop` or `restart`, a package upgrade, `delete`,
/// and Ctrl-C or Ctrl-\ in the terminal of a `create --foreground` (which reach all of its
/// processes at once: a SIGQUIT's default, a core dump of each, would leave the device with
/// no daemon).
const STOP_SIGNALS: [i32; 3] = [SIGTERM, SIGINT, SIGQUIT];

/// Why the serving process was asked to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StopRequest {
    /// One of `STOP_SIGNALS`.
    Stop,
    /// SIGUSR1, the parent-death signal: the supervisor is gone, so nobody would restart
    /// this process if it died; the service manager starts a new supervisor.
    SupervisorGone,
    /// The supervisor's reload (`systemctl reload`, SIGHUP to it): a standby of the binary
    /// now on disk is ready to take the device over.
    Replace,
}

/// What the serving process does with its device when it stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StopAction {
    /// STOP_DEV and DEL_DEV, and the store's shared memory freed: the device is gone.
    Delete,
    /// Leave the device quiesced with its pages kept (I/O waits), for the next daemon.
    HandOver,
}

/// What a stop request does. A device the kernel holds (active swap, a mounted file system)
/// must never be stopped: every I/O after STOP_DEV fails, and processes with pages on it die,
/// PID 1 among them. With user recovery it is handed over instead: the next start resumes it
/// (so `systemctl restart` loses nothing). Without recovery (an older kernel) nothing else can
/// serve it, and the process keeps serving (`None`), as before.
fn stop_action(
    request: StopRequest,
    in_use: Option<bool>,
    survives_daemon: bool,
) -> Option<StopAction> {
    match (request, in_use, survives_daemon) {
        (StopRequest::SupervisorGone | StopRequest::Replace, _, true) => Some(StopAction::HandOver),
        (StopRequest::SupervisorGone | StopRequest::Replace, _, false) => None,
        (StopRequest::Stop, Some(false), _) => Some(StopAction::Delete),
        // Claimed, or unknown (then as if claimed: a wrong "no" would lose its pages).
        (StopRequest::Stop, _, true) => Some(StopAction::HandOver),
        (StopRequest::Stop, _, false) => None,
    }
}

/// `stop_action` for the device at `path`, with the log line that says what and why; with
/// `Delete`, the claim on the device found unused (`None` where its open raced a removal), held
/// until it is stopped: a swapon or mount after the decision would see its I/O fail, so none
/// can come.
fn decide_stop(
    request: StopRequest,
    path: &str,
    survives_daemon: bool,
) -> Option<(StopAction, Option<std::fs::File>)> {
    // Only a stop asks: a claim, even a moment's, fails a swapon or mount made meanwhile.
    let claim = (request == StopRequest::Stop).then(|| crate::blockdev::claim(Path::new(path)));
    let in_use = match &claim {
        Some(Ok(claim)) => Some(matches!(claim, crate::blockdev::Claim::Busy)),
        _ => None,
    };
    let action = stop_action(request, in_use, survives_daemon);
    match (action, in_use) {
        (Some(StopAction::Delete), _) => {
            tracing::info!(device = path, "stopping: the device is not in use, deleting it")
        }
        (Some(StopAction::HandOver), _) if request == StopRequest::SupervisorGone => {
            tracing::warn!(device = path, "the supervisor is gone: handing the device over (quiesced, pages kept) for the next daemon")
        }
        (Some(StopAction::HandOver), _) if request == StopRequest::Replace => tracing::info!(
            device = path,
            "reload: handing the device over to the standby of the binary on disk"
        ),
        (Some(StopAction::HandOver), Some(true)) => tracing::info!(
            device = path,
            "stopping: the device is in use (active swap or mounted), handing it over: it stays, quiesced with its pages, and the next start resumes it; `trueno-ublk delete --id N --force` deletes it"
        ),
        (Some(StopAction::HandOver), _) => tracing::info!(
            device = path,
            "stopping: could not tell whether the device is in use, handing it over (quiesced, pages kept); the next start resumes it"
        ),
        (None, _) if request == StopRequest::Replace => tracing::warn!(
            device = path,
            "reload refused: this kernel cannot hand the device over; serving on"
        ),
        (None, _) if request == StopRequest::SupervisorGone => tracing::warn!(
            device = path,
            "the supervisor is gone; serving on (this kernel cannot hand the device over)"
        ),
        (None, Some(true)) => tracing::warn!(
            device = path,
            "not stopping: the device is in use (active swap or mounted) and this kernel's ublk driver offers no user recovery (Linux 6.5+), so stopping it would fail every page it holds. Run `swapoff {path}` (or stop its swap unit) first, then stop again"
        ),
        (None, _) => tracing::warn!(
            device = path,
            "not stopping: could not tell whether the device is in use; check /proc/swaps and mounts, then use `trueno-ublk delete --force`"
        ),
    }
    let held = match (action, claim) {
        (Some(StopAction::Delete), Some(Ok(crate::blockdev::Claim::Held(file)))) => Some(file),
        _ => None,
    };
    action.map(|action| (action, held))
}

/// Refuse settings no device can be made with (a size beyond what RAM can index, queues or
/// depth the driver refuses), before anything is set up; the generator asks too, so that a
/// section with them gets no swap unit that would wait at boot for a device that never comes.
pub fn check_startable(settings: &DeviceSettings) -> Result<(), DaemonError> {
    // A device that exists already (a restart, a standby) is resumed whatever RAM is now
    // (memory unplugged, a balloon inflated): its pages are in its store, and refusing would
    // leave its swap waiting.
    if !settings.id.is_some_and(device_exists) {
        check_size_against_ram(settings.size_bytes)?;
    }
    crate::store::check_size(settings.size_bytes)?;
    device_spec(settings).validate()?;
    Ok(())
}

/// The ublk side of the settings.
fn device_spec(settings: &DeviceSettings) -> DeviceSpec {
    DeviceSpec {
        id: settings.id,
        size_bytes: settings.size_bytes,
        queues: settings.queues,
        depth: settings.depth,
        max_io_bytes: TAG_BUFFER_MAX_IO_BYTES,
        user_copy_max_io_bytes: settings.user_copy.then_some(USER_COPY_MAX_IO_BYTES),
        tag_buffers_limit_bytes: config::ram_bytes()
            .map_or(u64::MAX, |ram| ram / TAG_BUFFERS_RAM_DIVISOR),
    }
}

/// How `create` runs: see the module's comment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CreateRole {
    /// Start a detached supervisor and return once the device is live.
    Detach,
    /// Be the supervisor (`--foreground`).
    Supervise,
    /// Be the serving process (`--serve-child`, started by the supervisor only).
    Serve,
    /// Be the standby serving process (`--serve-child --standby`): made ready while another
    /// serves the device, it takes the device over when the supervisor says so.
    Standby,
}

/// `trueno-ublk create`.
pub fn create(options: &DeviceOptions, role: CreateRole) -> Result<(), DaemonError> {
    let (mut settings, config_ignored) = resolve_settings(options)?;
    let kept = KeptForResume {
        size: keep_existing_size(&mut settings),
        config_ignored,
    };
    check_startable(&settings)?;
    match role {
        CreateRole::Detach => start_detached(&settings),
        CreateRole::Supervise => run_supervisor(&settings),
        CreateRole::Serve => run_serving_process(settings, false, &kept),
        CreateRole::Standby => run_serving_process(settings, true, &kept),
    }
}

/// The settings `options` and their config file give. A config file that no longer reads
/// (an edit with a typo, then a restart, a reload or a crash of the serving process) must not
/// keep a device that exists from being served: someone's swap may wait on it, every swap-in
/// stuck until the file is mended. Such a device is served with the command line's settings
/// and the defaults instead, and the error is logged (`KeptForResume`); a new device is
/// refused, with the error, and so is a reload (its standby fails, and the running build
/// serves on with its settings).
fn resolve_settings(
    options: &DeviceOptions,
) -> Result<(DeviceSettings, Option<String>), DaemonError> {
    let error = match config::resolve(options) {
        Ok(settings) => return Ok((settings, None)),
        Err(error) => error.to_string(),
    };
    let reload = std::env::var_os(supervise::RELOAD_ENV).is_some();
    if reload || options.config.is_none() || !options.id.is_some_and(device_exists) {
        return Err(DaemonError::Settings(error));
    }
    let without_file = DeviceOptions {
        config: None,
        ..options.clone()
    };
    match config::resolve(&without_file) {
        Ok(settings) => Ok((settings, Some(error))),
        Err(_) => Err(DaemonError::Settings(error)),
    }
}

/// Where the settings of a device that exists already are not what was asked for.
#[derive(Debug, Default)]
struct KeptForResume {
    size: Option<SizeKept>,
    /// The config file's error, when the file was left out (`resolve_settings`).
    config_ignored: Option<String>,
}

impl KeptForResume {
    fn log(&self, id: Option<u32>) {
        let device = block_path(id.unwrap_or_default());
        if let Some(error) = &self.config_ignored {
            tracing::error!(
                device,
                %error,
                "the config file does not read: the device, which exists, is served with the command line's settings and the defaults; mend the file, then `systemctl reload trueno-ublk@N` to apply it"
            );
        }
        if let Some(SizeKept {
            asked,
            device: bytes,
        }) = self.size
        {
            tracing::warn!(
                device,
                size = %human_size(bytes),
                asked = %human_size(asked),
                "the device keeps its size while it exists; the size asked for (the config file's `size`, or --size) takes effect when it is made again (swapoff, then stop the unit or `trueno-ublk delete`)"
            );
        }
    }
}

/// A device's size as the kernel has it, where the settings asked for another.
#[derive(Clone, Copy, Debug)]
struct SizeKept {
    asked: u64,
    device: u64,
}

/// A device that exists already is served with the size the kernel has for it, whatever the
/// settings say now. Why: every serving process, standby and restart reads the config file
/// afresh, and a device's size cannot change while it exists; an edited `size` (or `ram / 2`
/// after the machine's RAM changed) made the next takeover fail with the device's swap
/// waiting on it. The new size takes effect when the device is made again (`swapoff`, then
/// stopping the unit or `delete`). `Some` when the settings asked for another size.
fn keep_existing_size(settings: &mut DeviceSettings) -> Option<SizeKept> {
    let id = settings.id?;
    if !device_exists(id) {
        return None;
    }
    // If the kernel cannot say, the resume itself reports why (`Standby::wait_resumable`).
    let device = crate::ublk::Control::open()
        .and_then(|mut control| control.device_bytes(id))
        .ok()?;
    if device == 0 {
        // Added a moment ago and its parameters not set yet: not a device to resume.
        return None;
    }
    let asked = std::mem::replace(&mut settings.size_bytes, device);
    (asked != device).then_some(SizeKept { asked, device })
}

/// A failure as told to the supervisor, `create` or systemd: `STATUS=` and `ERRNO=`, the
/// error on one line (a line of its text must never read as another field, `READY=1` say).
fn failure_status(error: &DaemonError) -> String {
    let text = error.to_string().replace(['\n', '\r'], " ");
    format!("STATUS={text}\nERRNO={}", libc::EIO)
}

/// The supervisor's life: start serving processes until one exits (see `supervise`).
fn run_supervisor(settings: &DeviceSettings) -> Result<(), DaemonError> {
    // Fail before anything else on what needs no set-up: no driver, no permission.
    check_host(settings)?;
    drop(crate::ublk::Control::open()?);
    let detached_log = std::env::var_os(DETACHED_ENV).map(PathBuf::from);
    if detached_log.is_some() {
        // Leave the terminal's session so its hangup and job control never reach us.
        let _ = nix::unistd::setsid();
    }
    let _log_writer = init_logging();
    let notifier = Notifier::from_env();
    let result = supervise::supervise(settings, &notifier, detached_log.as_deref());
    if let Err(error) = &result {
        tracing::error!(%error, "trueno-ublk supervisor failed");
        notifier.send(&failure_status(error));
    }
    result
}

/// The serving process's life: serve the device until asked to stop or until it is stopped
/// from outside; readiness and failure go to the supervisor.
fn run_serving_process(
    settings: DeviceSettings,
    standby: bool,
    kept: &KeptForResume,
) -> Result<(), DaemonError> {
    let started = Instant::now();
    let _log_writer = init_logging();
    kept.log(settings.id);
    // Started as /proc/self/exe; `pidof trueno-ublk` and `list`'s checks go by this name.
    let _ = crate::os::set_process_name(crate::os::DAEMON_NAME);
    if let Some(supervisor) = std::env::var(supervise::SUPERVISOR_ENV)
        .ok()
        .and_then(|pid| pid.parse::<i32>().ok())
    {
        if let Err(error) = crate::os::set_parent_death_signal(nix::sys::signal::Signal::SIGUSR1) {
            tracing::warn!(%error, "PR_SET_PDEATHSIG failed: this process will not notice its supervisor's death");
        }
        if nix::unistd::getppid().as_raw() != supervisor {
            // The supervisor died before the signal was armed: nobody waits for this process.
            tracing::warn!("the supervisor is gone before the start: not starting");
            return Ok(());
        }
    }
    let notifier = Notifier::to_supervisor();
    let result = serve(settings, &notifier, started, standby);
    if let Err(error) = &result {
        tracing::error!(%error, "trueno-ublk daemon failed");
        notifier.send(&failure_status(error));
    }
    result
}

/// What to log: `TRUENO_UBLK_LOG` as tracing's per-target directives (`debug`,
/// `trueno_ublk::store=debug,info`), else `default` and up. Not `EnvFilter`: its regex
/// engine was 260 KB of the binary's code, and every page of it start-up touches stays locked.
pub fn log_filter(default: LevelFilter) -> Targets {
    std::env::var("TRUENO_UBLK_LOG")
        .ok()
        .and_then(|spec| spec.parse().ok())
        .unwrap_or_else(|| Targets::new().with_default(default))
}

/// Log to stderr (the log file, when detached, kept under `DETACHED_LOG_CAP`) through a
/// writer thread: a queue thread that logs under memory pressure must not wait for the page
/// cache of the log file (seen in the VM: a queue thread stuck allocating a page of the log
/// while every swap bio waited for it). Lines past the writer's backlog are dropped, never
/// waited for. Keep the guard alive: its drop flushes the backlog.
fn init_logging() -> tracing_appender::non_blocking::WorkerGuard {
    let output: Box<dyn std::io::Write + Send> = match log_file::detached_log(Path::new(RUN_DIR)) {
        Some(file) => Box::new(log_file::CappedLog::new(file, log_file::DETACHED_LOG_CAP)),
        None => Box::new(std::io::stderr()),
    };
    // A short backlog: its buffer is allocated (and locked) up front.
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(LOG_BACKLOG_LINES)
        .lossy(true)
        .finish(output);
    let _ = tracing_subscriber::fmt()
        .with_writer(writer)
        .with_ansi(std::io::stderr().is_terminal())
        .finish()
        .with(log_filter(LevelFilter::INFO))
        .try_init();
    guard
}

/// The device this process will serve: one it adds, or one another daemon served.
enum Target {
    Fresh(AddedDevice),
    /// With what a standby made ahead (boxed: the larger part).
    Resume(Standby, Box<Ahead>),
}

/// What a standby makes before its takeover, where it can.
#[derive(Default)]
struct Ahead {
    store: Option<crate::store::AttachedStore>,
    slot_frees: Option<crate::slotfree::SlotFreeProbe>,
}

impl Target {
    fn id(&self) -> u32 {
        match self {
            Target::Fresh(added) => added.id(),
            Target::Resume(standby, _) => standby.id(),
        }
    }
}

/// Find the device to serve: with an id whose device exists, that one, to resume; otherwise a
/// new one. Nothing in the kernel changes for a resume until `Standby::resume`.
fn find_target(
    settings: &DeviceSettings,
    handler: Arc<dyn crate::ublk::BlockHandler>,
    notifier: &Notifier,
) -> Result<Target, DaemonError> {
    if let Some(id) = settings.id {
        if device_exists(id) {
            return Ok(Target::Resume(
                Device::standby(id, handler)?,
                Box::default(),
            ));
        }
        if std::env::var_os(RESUME_ONLY_ENV).is_some() {
            return Err(crate::ublk::UblkError::NoSuchDevice(id).into());
        }
    }
    // At once: should this process die by a signal before the device is live, the supervisor
    // removes the device (see `supervise`).
    let added = |id| notifier.send(&format!("ADDED=1\nDEVICE={id}"));
    Ok(Target::Fresh(Device::add(device_spec(settings), added)?))
}

/// A standby's wait for the supervisor's word to take the device over: true on `TAKEOVER=1`,
/// false when told to go (SIGTERM, SIGINT, or SIGUSR1: the supervisor died) or when the
/// device is gone. It pings the device (see `Standby::ping`) and then runs `keep_ready`, every
/// second while that says the store changed, every `STANDBY_QUIET_PING` while it does not;
/// between pings it sleeps until the supervisor writes or a signal comes.
fn wait_for_takeover(
    notifier: &Notifier,
    signals: &mut signal_hook::iterator::Signals,
    standby: &mut Standby,
    keep_ready: &mut dyn FnMut() -> bool,
) -> Result<bool, DaemonError> {
    let Notifier::Supervisor(channel, _) = notifier else {
        return Err(DaemonError::Daemon(
            "a standby needs a supervisor (it is started by one)".into(),
        ));
    };
    let wake = SignalWake::new(
        &STOP_SIGNALS
            .iter()
            .chain(&[SIGUSR1])
            .copied()
            .collect::<Vec<_>>(),
    )
    .map_err(io_error("installing signal handlers"))?;
    let mut pinged = Instant::now();
    let mut ping_every = STANDBY_PING;
    // The first poll only looks: a signal that came before `wake` was made is in `signals`.
    let mut first = true;
    loop {
        if pinged.elapsed() >= ping_every {
            pinged = Instant::now();
            match standby.ping() {
                Err(
                    error @ (UblkError::NoSuchDevice(_)
                    | UblkError::Command {
                        errno: libc::ENODEV,
                        ..
                    }),
                ) => {
                    tracing::info!(%error, "standby: the device is gone; nothing to take over");
                    return Ok(false);
                }
                // Anything else (no memory for the command now, say) is no reason to leave
                // the device without a standby: the next ping looks again.
                Err(error) => tracing::warn!(%error, "standby: cannot look at the device now"),
                Ok(_) => {}
            }
            ping_every = if keep_ready() {
                STANDBY_PING
            } else {
                STANDBY_QUIET_PING
            };
        }
        let mut fds = [
            nix::poll::PollFd::new(
                std::os::fd::AsFd::as_fd(channel),
                nix::poll::PollFlags::POLLIN,
            ),
            nix::poll::PollFd::new(
                std::os::fd::AsFd::as_fd(&wake),
                nix::poll::PollFlags::POLLIN,
            ),
        ];
        // Rounded up to whole milliseconds, poll's unit: not a few spins just short of a ping.
        let until_ping = if std::mem::take(&mut first) {
            Duration::ZERO
        } else {
            ping_every.saturating_sub(pinged.elapsed()) + Duration::from_micros(999)
        };
        let timeout =
            nix::poll::PollTimeout::try_from(until_ping).unwrap_or(nix::poll::PollTimeout::MAX);
        match nix::poll::poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(errno) => return Err(io_error("waiting for the supervisor")(errno.into())),
        }
        wake.drain();
        // The channel before the signals: a stop that comes right after the supervisor told
        // this standby to take over (the serving process died just before) is for the device
        // it now serves, which must be stopped (or handed over) as any other, not left
        // quiesced. The signal stays pending for the serving loop.
        if fds[0]
            .revents()
            .is_some_and(|events| events.contains(nix::poll::PollFlags::POLLIN))
            && notifier.supervisor_said(detach::TAKEOVER)
        {
            return Ok(true);
        }
        // SIGHUP and SIGUSR2 (a compaction, see `serve`) say nothing to a standby.
        if let Some(stop) = signals
            .pending()
            .find(|&signal| signal != SIGHUP && signal != SIGUSR2)
        {
            // The word may have come after the channel was looked at above, with the stop
            // right behind it (the supervisor forwards a stop to the process it now counts
            // as serving): then this process serves the device, and stops it as the serving
            // loop does, with the signal raised again for that loop.
            if notifier.supervisor_said(detach::TAKEOVER) {
                signal_hook::low_level::raise(stop)
                    .map_err(io_error("passing a stop on to the serving loop"))?;
                return Ok(true);
            }
            return Ok(false);
        }
    }
}

/// How `open_store` opens a device's store.
enum Opening {
    /// For a new device.
    Fresh,
    /// For a device that has one, attached ahead where a standby could.
    Resume(Option<crate::store::AttachedStore>),
}

/// Open the store of device `id`. A new device gets an empty one (stale shared memory a
/// deleted device of the same id left is freed first). A resumed device must find its pages:
/// an empty store would serve zeros for every page it held, to processes that swapped them
/// out; then this fails and the device stays as it is (quiesced: its I/O waits).
fn open_store(
    config: crate::store::StoreConfig,
    gpu: Option<Arc<dyn BatchCodec>>,
    id: u32,
    opening: Opening,
) -> Result<Arc<BatchedPageStore>, DaemonError> {
    let resume = !matches!(opening, Opening::Fresh);
    if !resume && remove_shared(id)? {
        tracing::warn!(
            id,
            "freed the shared memory of an earlier device {id} (deleted without it being freed)"
        );
    }
    let (store, opened) = match opening {
        Opening::Resume(Some(attached)) => {
            BatchedPageStore::open_attached(config, gpu, id, attached)?
        }
        _ => BatchedPageStore::open(config, gpu, Backing::Shared { device_id: id })?,
    };
    match (opened, resume) {
        (Opened::Resumed { pages, lost }, true) => {
            if lost > 0 {
                tracing::error!(
                    id,
                    pages,
                    lost,
                    "resumed the store, but {lost} pages could not be recovered: reads of them fail with EIO until they are written again"
                );
            } else {
                tracing::info!(id, pages, "resumed the store with every page");
            }
            Ok(store)
        }
        (Opened::Fresh, true) => {
            store.shutdown();
            let _ = store.free_shared_memory();
            drop(store);
            Err(DaemonError::Ublk(UblkError::CannotResume {
                id,
                reason: "its pages are gone (its shared memory was removed); serving it \
                         would read zeros where data was. Delete it (`trueno-ublk delete --id \
                         N --lose-pages` if it is in use) and create it again"
                    .replace("--id N", &format!("--id {id}")),
            }))
        }
        (Opened::Resumed { pages, .. }, false) => {
            // Freed just above, so this is another process's store: never serve it.
            store.shutdown();
            Err(DaemonError::Daemon(format!(
                "device {id} is new but its store already holds {pages} pages (another process \
                 made it meanwhile?); not serving it"
            )))
        }
        (Opened::Fresh, false) => {
            tracing::info!(
                id,
                checksum = store.checksum().name(),
                "made a new store (its page checksum is the faster one on this machine)"
            );
            Ok(store)
        }
    }
}

/// Serve the device of `settings`; `started` is when this process started, for the log line
/// that says how long the device waited for it. A `standby` first makes everything it can
/// and waits for the supervisor's word (see `Standby`).
fn serve(
    settings: DeviceSettings,
    notifier: &Notifier,
    started: Instant,
    standby: bool,
) -> Result<(), DaemonError> {
    // Signals first, so a SIGTERM during start-up is not lost (nor kills the process with the
    // default action, which the supervisor took for a failed stop). Job control is ignored
    // already: the supervisor's ignoring it carries over exec.
    let mut signals =
        signal_hook::iterator::Signals::new(STOP_SIGNALS.iter().chain(&[SIGHUP, SIGUSR1, SIGUSR2]))
            .map_err(io_error("installing signal handlers"))?;
    // The daemon serves swap, so none of its own memory may ever need swap to come back:
    // lock what is mapped now and every page faulted in later. What the I/O path uses is
    // written, and so faulted in and locked, when it is set up (page table, pending batches,
    // tag buffers, chunk reserve), before the device is live.
    lock_memory();
    protect_from_oom_killer();
    crate::mem::configure_heap();
    reserve_list_space();
    // The main thread opens the store (for a standby: after the word to take over, when
    // the device waits): its stack and heap are faulted in now.
    crate::mem::prepare_io_thread();
    let algorithm = settings.store.algorithm;
    // The codec contexts every thread that compresses new pages makes before it serves:
    // those of the stronger codec too, where memory running short switches to it.
    let thread_algorithm = settings.store.thread_algorithm();
    let recompress = settings.store.recompress;
    // The store's compression pool (the flush's), a standby's too, before it waits: made at
    // the takeover, its threads faulted in their stacks, heaps and codec contexts while memory
    // was at the watermark, and the flush that the resumed queue's writes waited for waited
    // on them, in reclaim that waited for those writes (seen in the VM: a kill -9 during a
    // fill left swap stalled for good). It costs a standby its threads' memory.
    // A pool that cannot start fails the start: rayon would take the global pool as made,
    // without threads, and every parallel flush or read after it would panic.
    rayon::ThreadPoolBuilder::new()
        .thread_name(crate::codec::pool_thread_name)
        .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
        .start_handler(move |_| ready_store_thread(ThreadCodecs::reading(thread_algorithm)))
        .build_global()
        .map_err(|error| {
            DaemonError::Daemon(format!(
                "cannot start the compression pool's threads: {error} (raise the unit's TasksMax or the memory limit)"
            ))
        })?;

    let (gpu, gpu_state) = crate::gpu::open_for_store(algorithm, settings.store.forced_backend)?;
    tracing::info!(gpu = gpu_state, "GPU backend");
    let mut store_config = settings.store_config(gpu.is_some(), config::ram_bytes().unwrap_or(0));
    // Opened now, for a standby too: when the store needs it, memory is short.
    store_config.oom_killer = if !settings.oom_kill {
        tracing::info!("oom-kill = no (or --no-oom-kill): when writes starve for memory and pages do not compress, they fail without asking the kernel's OOM killer to act");
        None
    } else {
        match crate::os::oom_kill_trigger() {
            Ok(ask) => Some(crate::store::OomKiller::new(
                || !crate::mem::free_memory_is_back(),
                ask,
            )),
            Err(error) => {
                tracing::warn!(%error, "cannot open /proc/sysrq-trigger: when writes starve for memory and pages do not compress, the store cannot ask the kernel's OOM killer to act");
                None
            }
        }
    };
    let handler = Arc::new(StoreHandler::new(thread_algorithm));
    // The store's threads, ready before there is a store for them (see `StoreThreads`): a
    // standby's before it says it is ready.
    let start_store_threads = || {
        StoreThreads::start(move |role| {
            if role == StoreThread::Refill {
                ready_refill_thread();
            } else {
                ready_store_thread(store_thread_codecs(role, algorithm, recompress));
            }
        })
        .map_err(io_error("starting the store's threads"))
    };
    // Heap a standby keeps ready for its takeover; for the log line of the takeover.
    let heap_ready = std::cell::Cell::new(0);
    let (target, threads, started) = if standby {
        let id = settings.id.ok_or_else(|| {
            DaemonError::Daemon("a standby is started with the device's --id".into())
        })?;
        let mut standby = Device::standby(id, handler.clone())?;
        // This thread compresses the pending pages of the store it resumes.
        prepare_codec_thread(ThreadCodecs::reading(thread_algorithm));
        // What the takeover allocates, kept ready (see `SparePages`): heap in this thread's
        // arena, as much as resuming the store as it is now needs (it grows as the serving
        // process stores pages, and is looked at again every ping), the page tables of the
        // store's memory (see `AttachedStore`), and pages for the kernel, given back just
        // before the takeover.
        let attach = || {
            crate::store::AttachedStore::attach(id).unwrap_or_else(|error| {
                tracing::debug!(%error, "standby: cannot attach the device's store yet");
                None
            })
        };
        let mut attached = attach();
        // Not ready for a store this build cannot resume (a `reload` to an older build, say):
        // ending here keeps the serving process serving (see `supervise`).
        if let Some(store) = &attached {
            store.check_this_binary_reads()?;
        }
        // What the last look found: the store's extent and the heap resuming it needs.
        let mut last_seen = None;
        // True when the store changed since the last look (or is not there to look at yet).
        let mut keep_ready = || {
            let mut changed = false;
            if !attached.as_ref().is_some_and(|store| store.is_current()) {
                attached = attach();
                changed = true;
            }
            let seen = attached.as_mut().map(|store| {
                let extent = store.make_page_tables().unwrap_or_else(|error| {
                    tracing::debug!(%error, "standby: cannot map the device's store ahead");
                    0
                });
                (
                    extent,
                    crate::store::resume_heap_bytes(store, gpu.is_some()),
                )
            });
            let need = STANDBY_HEAP_BYTES + seen.map_or(0, |(_, store_heap)| store_heap);
            if need > heap_ready.get() {
                // With room to grow, so that a filling store does not make this touch the
                // whole heap every second.
                heap_ready.set(need + need / 8);
                crate::mem::warm_heap(heap_ready.get());
            }
            // Recorded whatever else changed: a look after a re-attach then compares with it.
            let moved = std::mem::replace(&mut last_seen, seen) != seen;
            changed || seen.is_none() || moved
        };
        keep_ready();
        let slot_frees = settings
            .slot_free_probe
            .then(|| slot_frees::attach_ahead(id, settings.size_bytes / crate::codec::PAGE_SIZE as u64))
            .and_then(|attached| {
                attached
                    .map_err(|why| tracing::info!(%why, "standby: no slot-free probe ahead; the takeover attaches one"))
                    .ok()
            });
        let threads = start_store_threads()?;
        let spare = crate::mem::SparePages::new(STANDBY_SPARE_BYTES)
            .map_err(io_error("reserving the standby's spare pages"))?;
        tracing::info!(
            id,
            ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(0),
            spare = spare.len(),
            heap_kib = heap_ready.get() >> 10,
            "standby ready to take the device over"
        );
        notifier.send(&format!("STANDBY=1\nPID={}", std::process::id()));
        if !wait_for_takeover(notifier, &mut signals, &mut standby, &mut keep_ready)? {
            tracing::info!(id, "standby told to go; the device was not touched");
            return Ok(());
        }
        // From here on the device waits for this process. Real-time until it is live: the
        // kernel lets a real-time task allocate below the min watermark, and runs it first.
        drop(spare);
        if let Err(error) = crate::os::make_thread_realtime(crate::os::REALTIME_PRIORITY) {
            tracing::warn!(%error, "could not make the takeover real-time");
        }
        (
            Target::Resume(
                standby,
                Box::new(Ahead {
                    store: attached,
                    slot_frees,
                }),
            ),
            threads,
            Instant::now(),
        )
    } else {
        let target = find_target(&settings, handler.clone(), notifier)?;
        (target, start_store_threads()?, started)
    };
    // What the start from here to live faults in (for a standby: what the takeover needed
    // beyond what it had ready), for the log line below.
    let anon_now = || crate::procstat::ProcessMemory::now(0).rss_anon_bytes;
    let anon_before = anon_now();
    let setup_done = Instant::now();
    let id = target.id();
    let resume = matches!(target, Target::Resume(..));
    let start_flusher = |store: &Arc<BatchedPageStore>, threads| {
        store
            .start_threads(threads)
            .map_err(io_error("starting the flusher"))
    };
    let gpu_codec = gpu.clone().map(|g| g as Arc<dyn BatchCodec>);
    // A standby's slot-free probe, attached before its takeover and given to the handler
    // before the device is live again.
    let mut probe_ahead = None;
    let (device, store, flusher, found, store_opened, live, anon_live) = match target {
        Target::Fresh(added) => {
            if !added.survives_daemon() {
                tracing::warn!(
                    id,
                    "this kernel's ublk driver offers no user recovery to this daemon (UBLK_F_USER_RECOVERY with _REISSUE, asked only of a driver that reports its features: Linux 6.5+): the device will not survive this daemon; if it dies, every page on the device is lost"
                );
            }
            let found = Instant::now();
            let store = open_store(store_config, gpu_codec, id, Opening::Fresh)?;
            handler.set_store(store.clone());
            let store_opened = Instant::now();
            let started = start_flusher(&store, threads).and_then(|flusher| {
                let device = added.start(handler.clone())?;
                Ok((flusher, device))
            });
            let (flusher, device) = started.inspect_err(|_| {
                // Nothing will resume a store whose device never went live (the device is
                // deleted as `added` drops): its locked segment goes with the process, not
                // at the next `create` of this id.
                if let Err(error) = store.free_shared_memory() {
                    tracing::warn!(%error, "the new store's shared memory was not freed");
                }
            })?;
            let anon_live = anon_now();
            (
                device,
                store,
                flusher,
                found,
                store_opened,
                Instant::now(),
                anon_live,
            )
        }
        Target::Resume(mut standby, ahead) => {
            match standby.wait_resumable(settings.size_bytes) {
                // Deleted meanwhile (`trueno-ublk delete` while no process served it): nothing
                // to serve, and an exit 0 tells the supervisor (and a service manager's
                // restart policy) so, where a failure would have a new, empty device made.
                Err(UblkError::NoSuchDevice(_)) => {
                    tracing::info!(
                        id,
                        "the device was deleted before it could be resumed: nothing to serve"
                    );
                    return Ok(());
                }
                waited => waited?,
            }
            let found = Instant::now();
            let store = open_store(store_config, gpu_codec, id, Opening::Resume(ahead.store))?;
            handler.set_store(store.clone());
            // While the device is quiesced: every free the probe reports from here on is one
            // that no write served by the old daemon can have followed, so the reports
            // withdrawn now (`slot_frees::give_ahead`) are all that is dropped; given after
            // the device went live, the frees between that and the attach were dropped as well.
            probe_ahead = ahead.slot_frees.and_then(|probe| {
                let pages = settings.size_bytes / crate::codec::PAGE_SIZE as u64;
                slot_frees::give_ahead(id, pages, &handler, probe)
            });
            let store_opened = Instant::now();
            let device = standby.resume()?;
            let live = Instant::now();
            let anon_live = anon_now();
            if let Err(error) = crate::os::make_thread_normal() {
                tracing::warn!(%error, "could not end the takeover's real-time priority");
            }
            // The store's threads, readied by the standby (see `StoreThreads`), once the
            // device is live: the refill thread's first commits wait in reclaim, which must
            // not hold up the resume. Writes meanwhile go to pending slots, which the resumed
            // store has ready.
            let flusher = start_flusher(&store, threads)?;
            (device, store, flusher, found, store_opened, live, anon_live)
        }
    };
    let path = block_path(id);
    if !resume {
        disable_writeback_throttling(id);
    }
    let ms = |from: Instant, to: Instant| u64::try_from((to - from).as_millis()).unwrap_or(0);
    // Where the time from this process's start (a standby's: from the word to take over) to
    // a live device went: set-up (memory locked, thread pool, GPU probe, queue threads), the
    // device found (for a resume: the wait for the kernel to quiesce it and for the old daemon
    // to be gone), the store opened (a resume checks every page's entry), the queues started
    // (START_DEV, or the recovery commands).
    tracing::info!(
        device = path,
        size = settings.size_bytes,
        queues = device.info().nr_hw_queues,
        depth = device.info().queue_depth,
        user_copy = device.user_copy(),
        standby,
        ms = ms(started, live),
        setup_ms = ms(started, setup_done),
        find_ms = ms(setup_done, found),
        store_ms = ms(found, store_opened),
        queues_ms = ms(store_opened, live),
        ready_heap_kib = heap_ready.get() >> 10,
        anon_kib = anon_live.saturating_sub(anon_before) >> 10,
        "{}",
        if resume {
            "device resumed"
        } else {
            "device live"
        }
    );
    // Freed swap slots as the kernel frees them (see `crate::slotfree`), once the device is
    // live: attaching allocates (the BTF read, the kernel's verifier, the bitmap), which must
    // not wait on a device that is waiting for us. This thread frees the reported pages
    // between signals, holding pages' locks the queue threads may wait for: so it is made an
    // I/O thread like them.
    let slot_free_probe = if let Some(attached) = probe_ahead {
        Ok(attached)
    } else if settings.slot_free_probe {
        slot_frees::attach(
            id,
            settings.size_bytes / crate::codec::PAGE_SIZE as u64,
            &handler,
        )
    } else {
        Err("turned off (slot-free-probe = no, or --no-slot-free-probe)".to_string())
    };
    match &slot_free_probe {
        Ok(probe) => {
            ready_io_thread();
            tracing::info!(
                function = probe.function(),
                "slot-free probe attached: the memory of a freed swap slot comes back at once"
            );
        }
        Err(why) => {
            tracing::info!(%why, "no slot-free probe: the memory of freed swap slots comes back with discards (whole free clusters)")
        }
    }
    // Only root can read the endpoint; `stat` still works for the device if it fails.
    let report_store = store.clone();
    // The queues and depth the device has, not those asked for: the kernel makes no more
    // queues than CPUs, and a resumed device keeps its own.
    let mut report_settings = settings.clone();
    report_settings.queues = device.info().nr_hw_queues;
    report_settings.depth = device.info().queue_depth;
    let timing = device.timing();
    // The idle footprint: everything set up, nothing stored yet; taken again by the main
    // loop once the chunk reserve has gone quiet (its next refill pass after the quiet time).
    let idle = Arc::new(crate::procstat::IdleFootprint::at_go_live(
        crate::store::RESERVE_QUIET_AFTER + Duration::from_secs(1),
    ));
    let report_idle = Arc::clone(&idle);
    let stats_endpoint = stats::serve(id, move || {
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
        report.memory = crate::procstat::ProcessMemory::now(report_idle.rss_bytes());
        report.slot_frees = match &slot_free_probe {
            Ok(probe) => probe.stats(),
            Err(why) => SlotFreeStats::off(why),
        };
        report
    })
    .map_err(|error| tracing::warn!(%error, "stats endpoint unavailable: `trueno-ublk stat` will not see this device"))
    .ok();
    notifier.send(&format!(
        "READY=1\nDEVICE={id}\nSTATUS={path}\nPID={}",
        std::process::id()
    ));

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
    let survives = device.survives_daemon();
    let mut memory_watch = memory_watch::MemoryWatch::open();
    let oom_victims = oom_victims::OomVictimReleaser::start(Arc::clone(&store));
    let mut main_poll = activity::MainPoll::new();
    // What to do with the device, whether the stop was unexpected (a failure to report), and
    // the claim on a device found unused (see `decide_stop`).
    let (action, unexpected, claim) = loop {
        let poll = main_poll.interval(poll_interval(&store));
        crossbeam_channel::select! {
            recv(signal_rx) -> signal => {
                let request = match signal {
                    // The supervisor's nudge after it asked for a hand-over on the channel
                    // (see `supervise`'s reload), which is otherwise looked at every poll.
                    Ok(SIGHUP) if notifier.handover_asked() => StopRequest::Replace,
                    Ok(SIGHUP) => {
                        tracing::info!("SIGHUP ignored (no hand-over asked for)");
                        continue;
                    }
                    Ok(SIGUSR1) if std::env::var_os(MANAGED_ENV).is_none() => {
                        tracing::warn!(device = path, "the supervisor is gone and nothing will start another (no service manager): serving on, without a standby; `trueno-ublk delete --id {id}` stops the device");
                        continue;
                    }
                    Ok(SIGUSR1) => StopRequest::SupervisorGone,
                    Ok(SIGUSR2) => {
                        // `trueno-ublk compact`: in a thread of its own at the lowest priority.
                        match store.start_compaction(
                            || ready_store_thread(ThreadCodecs::none()),
                            |done| tracing::info!(
                                passes = done.passes,
                                moved_pages = done.moved_pages,
                                chunk_bytes_before = done.chunk_bytes_before,
                                chunk_bytes_after = done.chunk_bytes_after,
                                "compaction done"
                            ),
                        ) {
                            Ok(true) => tracing::info!("compaction asked for (SIGUSR2)"),
                            Ok(false) => tracing::info!("compaction asked for while one runs"),
                            Err(error) => tracing::warn!(%error, "could not start a compaction"),
                        }
                        continue;
                    }
                    Ok(_) => StopRequest::Stop,
                    Err(_) if survives => break (StopAction::HandOver, true, None),
                    Err(_) => {
                        // No signals any more (cannot happen: the thread ends only when told):
                        // serve until the device is stopped from outside.
                        let _ = device.queue_exits().recv();
                        break (StopAction::Delete, true, None);
                    }
                };
                if let Some((action, claim)) = decide_stop(request, &path, survives) {
                    break (action, false, claim);
                }
            },
            recv(device.queue_exits()) -> _ => {
                // Stopped from outside (every tag aborted), or a queue failed. A device that
                // still exists and can outlive us is handed over and the failure reported:
                // the supervisor exits with it, and the service manager's restart resumes it.
                // A state that cannot be read counts as live: deleting a device that is swap
                // fails every page on it, a hand-over of one that is gone only fails.
                let exists = match device_state(id) {
                    Ok(state) => matches!(
                        state,
                        Some(crate::ublk::sys::UBLK_S_DEV_LIVE | crate::ublk::sys::UBLK_S_DEV_QUIESCED)
                    ),
                    Err(error) => {
                        tracing::error!(device = path, %error, "a queue ended and the device's state cannot be read");
                        true
                    }
                };
                if survives && exists {
                    tracing::error!(device = path, "a queue ended while the device is live: handing it over");
                    break (StopAction::HandOver, true, None);
                }
                tracing::warn!(device = path, "a queue ended (device stopped from outside?); shutting down");
                break (StopAction::Delete, false, None);
            }
            recv(handler.activity().woken()) -> _ => main_poll.wake(),
            // Only here are reported slots freed: once the loop ends (a hand-over), no page of
            // the device changes in this process.
            default(poll) => {
                if notifier.handover_asked() {
                    if let Some((action, claim)) = decide_stop(StopRequest::Replace, &path, survives) {
                        break (action, false, claim);
                    }
                }
                let freed = handler.free_reported_slots();
                store.give_back_past_stuck_refill();
                idle.settle(|| store.stats().orig_bytes == 0);
                let went_short = memory_watch.as_mut().is_some_and(|watch| watch.look(&store));
                if let (true, Some(releaser)) = (went_short, oom_victims.as_ref()) {
                    releaser.memory_went_short();
                }
                main_poll.looked(handler.activity(), freed > 0 || store.memory_short());
            }
        }
    };
    // No process's memory released once this one stops serving (a successor does that).
    drop(oom_victims);
    notifier.send("STOPPING=1");
    let mut action = action;
    // A device stopped from outside, or whose queue failed, is claimed here if it can be: a
    // swapon (or mount) since then makes it in use, and it is handed over as such a device is.
    let claim = match (action, claim) {
        (StopAction::Delete, Some(claim)) => Some(claim),
        (StopAction::Delete, None) => match crate::blockdev::open_exclusive(Path::new(&path)) {
            Err(error) if error.raw_os_error() == Some(libc::EBUSY) && survives => {
                tracing::warn!(device = path, "stopping: the device was taken into use since it was found unused; handing it over instead");
                action = StopAction::HandOver;
                None
            }
            // Not claimed for another reason (no descriptor left, say), while the node is
            // there: whether a swapon came meanwhile is not known, so nothing is stopped.
            Err(error)
                if survives
                    && !matches!(
                        error.raw_os_error(),
                        Some(libc::ENOENT | libc::ENXIO | libc::ENODEV)
                    ) =>
            {
                tracing::warn!(device = path, %error, "stopping: the device found unused cannot be claimed; handing it over instead");
                action = StopAction::HandOver;
                None
            }
            claim => claim.ok(),
        },
        (StopAction::HandOver, _) => None,
    };
    let stopped = match action {
        StopAction::Delete => device.shutdown_holding(claim),
        StopAction::HandOver => {
            // The frees reported since the last poll, while the device still serves: the
            // next daemon drops what was reported before its takeover.
            handler.free_reported_slots();
            // No `fault-in` read starts on the device from here until it is quiesced (see
            // `HandOverGate`); without the gate in time, handed over all the same.
            let gate = HandOverGate::for_hand_over(Path::new(RUN_DIR), HAND_OVER_GATE_PATIENCE);
            match gate {
                Ok(_) => {}
                Err(GateUnavailable::Busy) => tracing::warn!(
                    waited_s = HAND_OVER_GATE_PATIENCE.as_secs(),
                    "handing the device over while `fault-in` reads are under way (one may wait for the next daemon)"
                ),
                Err(GateUnavailable::NoLockFiles) => tracing::warn!(
                    dir = RUN_DIR,
                    "no hand-over gate (its lock files cannot be made): handing the device over without waiting for `fault-in` reads"
                ),
            }
            let handed_over = device.hand_over();
            drop(gate);
            handed_over
        }
    };
    // Nothing reads signals from here on: the channel goes first, so that a signal thread
    // blocked on the full channel (a few Ctrl-C's during a slow stop) wakes to the closed
    // channel and ends, and the join below cannot wait for good.
    drop(signal_rx);
    signal_handle.close();
    let _ = signal_thread.join();
    match action {
        StopAction::Delete => {
            store.shutdown();
            drop(flusher);
            drop(stats_endpoint);
        }
        // Not flushed, nor its threads joined: the next daemon waits for this process to be
        // gone, and a flush with the device quiesced can wait in reclaim for as long as the
        // refill thread does (swap-outs to this device wait for the next daemon). What is
        // pending the next daemon installs, as after a kill -9 (the store is kept consistent
        // at every step for that); the threads end with the process.
        StopAction::HandOver => {
            std::mem::forget(flusher);
            if let Some(endpoint) = stats_endpoint {
                endpoint.leave();
            }
        }
    }
    stopped?;
    match action {
        StopAction::Delete => {
            // The segment this process maps, not whatever is under the device's key: a
            // `create` of this id since the device's DEL_DEV has made its own there.
            let freed = store.free_shared_memory();
            drop(store);
            if let Err(error) = freed {
                tracing::warn!(%error, id, "could not free the store's shared memory");
            }
            tracing::info!(device = path, "device deleted");
        }
        StopAction::HandOver => tracing::info!(
            device = path,
            "device handed over: quiesced with its pages kept; the next `create --id {id}` (or unit start) resumes it"
        ),
    }
    if unexpected {
        return Err(DaemonError::Daemon(format!(
            "serving {path} ended unexpectedly; the device was {}",
            match action {
                StopAction::Delete => "deleted",
                StopAction::HandOver => "handed over",
            }
        )));
    }
    Ok(())
}

/// The kernel's state of device `id` (`UBLK_S_DEV_*`), or None if it is gone or unreadable.
/// Device `id`'s state, `None` once it is gone; an error (no descriptor or memory for a
/// control ring, say) says neither.
fn device_state(id: u32) -> Result<Option<u16>, crate::ublk::UblkError> {
    use crate::ublk::UblkError;
    match crate::ublk::Control::open().and_then(|mut control| control.dev_info(id)) {
        Ok(info) => Ok(Some(info.state)),
        Err(
            UblkError::NoSuchDevice(_)
            | UblkError::Command {
                errno: libc::ENODEV,
                ..
            },
        ) => Ok(None),
        Err(error) => Err(error),
    }
}

/// How long the main thread, and the threads that release OOM victims' memory, wait between
/// looks: `slotfree::POLL`, `POLL_MEMORY_SHORT` while `store` says memory is short.
fn poll_interval(store: &BatchedPageStore) -> Duration {
    if store.memory_short() {
        crate::slotfree::POLL_MEMORY_SHORT
    } else {
        crate::slotfree::POLL
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_overcommit_is_refused_saying_which_setting_to_change() {
        let refused = check_overcommit(Some(2)).unwrap_err().to_string();
        assert!(refused.contains("vm.overcommit_memory to 0"), "{refused}");
        for mode in [Some(0), Some(1), None] {
            assert!(check_overcommit(mode).is_ok(), "{mode:?}");
        }
    }

    #[test]
    fn a_takeover_word_is_found_among_what_the_supervisor_sent_without_waiting() {
        let (supervisor, standby) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let standby = detach::Notifier::supervisor(standby);
        let told_to_take_over = || standby.supervisor_said(detach::TAKEOVER);
        assert!(!told_to_take_over(), "nothing sent");
        supervisor.send(b"SOMETHING=1").unwrap();
        assert!(!told_to_take_over());
        supervisor.send(b"SOMETHING=1").unwrap();
        supervisor.send(detach::TAKEOVER.as_bytes()).unwrap();
        assert!(told_to_take_over(), "the word after another");
        assert!(!told_to_take_over(), "read once");
    }

    #[test]
    fn a_hand_over_sent_with_the_takeover_is_still_heard_after_it() {
        let (supervisor, serving) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let serving = detach::Notifier::supervisor(serving);
        supervisor.send(detach::TAKEOVER.as_bytes()).unwrap();
        supervisor.send(detach::HANDOVER.as_bytes()).unwrap();
        assert!(serving.supervisor_said(detach::TAKEOVER));
        assert!(serving.handover_asked(), "read with the takeover, kept");
        assert!(!serving.handover_asked(), "heard once");
        assert!(!serving.supervisor_said(detach::TAKEOVER), "heard once");
    }

    #[test]
    fn a_stop_never_stops_a_device_in_use() {
        use StopAction::{Delete, HandOver};
        use StopRequest::{Replace, Stop, SupervisorGone};
        let unknown = None;
        let cases: [(StopRequest, Option<bool>, bool, Option<StopAction>); 13] = [
            // Unused: deleted, with or without recovery.
            (Stop, Some(false), true, Some(Delete)),
            (Stop, Some(false), false, Some(Delete)),
            // In use, or unknown: handed over when it can outlive us, else kept serving.
            (Stop, Some(true), true, Some(HandOver)),
            (Stop, Some(true), false, None),
            (Stop, unknown, true, Some(HandOver)),
            (Stop, unknown, false, None),
            // The supervisor gone: handed over whatever the use, never deleted.
            (SupervisorGone, Some(false), true, Some(HandOver)),
            (SupervisorGone, Some(true), true, Some(HandOver)),
            (SupervisorGone, Some(false), false, None),
            (SupervisorGone, Some(true), false, None),
            // A reload: handed over to the new standby, in use or not; never deleted.
            (Replace, Some(false), true, Some(HandOver)),
            (Replace, unknown, true, Some(HandOver)),
            (Replace, Some(true), false, None),
        ];
        for (request, claimed, survives, want) in cases {
            assert_eq!(
                stop_action(request, claimed, survives),
                want,
                "{request:?} claimed {claimed:?} survives {survives}"
            );
        }
    }
}
