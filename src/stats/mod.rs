//! Live statistics: each daemon answers on a root-only unix socket
//! (`/run/trueno-ublk/ublkb{id}.sock`, directory 0700, socket 0600) with one JSON line holding
//! its `DeviceReport` (`server`); `trueno-ublk stat` reads every socket (`client`) and prints
//! zramctl's columns (`render`). Beside each socket, the outcomes of the device's reloads
//! (`reload`).

#![forbid(unsafe_code)]

mod client;
mod reload;
mod render;
mod server;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::DeviceSettings;
use crate::procstat::ProcessMemory;
use crate::slotfree::SlotFreeStats;
use crate::store::StoreStats;
use crate::ublk::device::block_path;
use crate::ublk::IoTimingReport;
pub use client::{collect, compact, reload, report_text, StatError, Unserved};
pub use reload::{ReloadOutcome, ReloadOutcomes};
pub use render::{render, StatFormat, COLUMNS};
pub use server::{serve, serve_in, StatsServer};

/// Where the daemons put their sockets.
pub const SOCKET_DIR: &str = "/run/trueno-ublk";

/// How long `stat` waits for a daemon's answer, and a daemon for a client to take it.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// A report is 3-5 KiB of JSON; anything longer than this is not one.
const MAX_REPORT_BYTES: u64 = 64 << 10;

/// Why `connect` made no connection to a statistics socket.
#[derive(Debug)]
enum ConnectError {
    /// No socket there (its daemon stopped).
    Gone,
    /// Not this user's to connect to (the sockets are root's).
    Denied,
    /// A daemon listens but took no connection within `IO_TIMEOUT`.
    Unanswered,
    /// Nobody listens: a socket a daemon that died left behind.
    Stale,
    Failed(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Gone => f.write_str("no socket (its daemon stopped)"),
            Self::Denied => f.write_str("permission denied"),
            Self::Unanswered => write!(
                f,
                "its daemon accepts no connection within {} s (its statistics thread is stuck; its log may say why)",
                IO_TIMEOUT.as_secs()
            ),
            Self::Stale => f.write_str("stale socket: its daemon is gone (see `trueno-ublk list`)"),
            Self::Failed(reason) => f.write_str(reason),
        }
    }
}

/// Connect to `socket` within `IO_TIMEOUT`. Why not `UnixStream::connect`: a blocking
/// connect to a listener whose backlog is full (a daemon whose statistics thread is stuck,
/// after a `watch trueno-ublk stat` left a hundred connections it never accepted) waits for
/// good, and both `stat`, which an administrator runs to look at a daemon in trouble, and a
/// daemon checking whether another serves its device or waking its own statistics thread to
/// stop it, must not. A non-blocking connect to a unix socket either completes at once or
/// says `EAGAIN`.
fn connect(socket: &Path) -> Result<UnixStream, ConnectError> {
    use nix::errno::Errno;
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
    let failed = |what: &str, error: Errno| ConnectError::Failed(format!("{what}: {error}"));
    let address = UnixAddr::new(socket).map_err(|error| failed("bad socket path", error))?;
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(|error| failed("cannot make a socket", error))?;
    let started = Instant::now();
    loop {
        match socket::connect(fd.as_raw_fd(), &address) {
            Ok(()) => break,
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) if started.elapsed() < IO_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(Errno::EAGAIN) => return Err(ConnectError::Unanswered),
            Err(Errno::ENOENT) => return Err(ConnectError::Gone),
            Err(Errno::EACCES | Errno::EPERM) => return Err(ConnectError::Denied),
            Err(Errno::ECONNREFUSED) => return Err(ConnectError::Stale),
            Err(error) => return Err(failed("cannot connect", error)),
        }
    }
    let stream = UnixStream::from(fd);
    stream
        .set_nonblocking(false)
        .map_err(|error| ConnectError::Failed(error.to_string()))?;
    Ok(stream)
}

/// What reading one socket gave.
#[derive(Clone, Debug)]
pub enum Probe {
    Live(Box<DeviceReport>),
    /// The socket is there but no daemon answers properly (it died, or hangs).
    Unreachable {
        id: u32,
        socket: PathBuf,
        reason: String,
    },
}

/// What one daemon reports about its device.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DeviceReport {
    pub id: u32,
    /// `/dev/ublkb{id}`.
    pub device: String,
    /// The daemon's process id.
    pub pid: u32,
    /// Device size in bytes.
    pub disksize: u64,
    pub queues: u16,
    pub depth: u16,
    /// `lz4`, `zstd:3`, `adaptive` (see `config::StoreSettings::algorithm_name`).
    pub algorithm: String,
    /// Background recompression of idle pages: `zstd:3,idle=30s`, or `off` (see
    /// `config::StoreSettings::recompress_name`).
    #[serde(default)]
    pub recompress: String,
    /// `auto`, `simd`, `simd-parallel` or `gpu`.
    pub backend: String,
    /// GPU state in words: the device name, or why there is none.
    pub gpu: String,
    pub store: StoreStats,
    /// Where requests' time went (see `ublk::timing`); empty from a daemon that predates it.
    #[serde(default)]
    pub io: IoTimingReport,
    /// The daemon's own resident memory, now and idle.
    #[serde(default)]
    pub memory: ProcessMemory,
    /// What the daemon does when asked by a signal: `compact` (SIGUSR2 to its `pid`), `reload`
    /// (SIGHUP to its supervisor). A daemon that predates one does not list it, and a signal
    /// it does not handle would end it or be ignored.
    #[serde(default)]
    pub requests: Vec<String>,
    /// Swap slots freed as the kernel freed them (see `crate::slotfree`).
    #[serde(default)]
    pub slot_frees: SlotFreeStats,
}

/// The request `trueno-ublk compact` makes, and the signal that makes it.
pub const COMPACT_REQUEST: &str = "compact";
/// The request `trueno-ublk reload` makes: SIGHUP to the serving process's supervisor (its
/// parent), which readies a standby of the binary on disk and has it take the device over.
pub const RELOAD_REQUEST: &str = "reload";
pub const COMPACT_SIGNAL: nix::sys::signal::Signal = nix::sys::signal::Signal::SIGUSR2;

impl DeviceReport {
    /// The report of this process serving device `id` with `settings`.
    pub fn new(
        id: u32,
        settings: &DeviceSettings,
        gpu: impl Into<String>,
        store: StoreStats,
    ) -> Self {
        Self {
            id,
            device: block_path(id),
            pid: std::process::id(),
            disksize: settings.size_bytes,
            queues: settings.queues,
            depth: settings.depth,
            algorithm: settings.store.algorithm_name(),
            recompress: settings.store.recompress_name(),
            backend: settings.store.backend_name().to_string(),
            gpu: gpu.into(),
            store,
            io: IoTimingReport::default(),
            memory: ProcessMemory::default(),
            requests: vec![COMPACT_REQUEST.to_string(), RELOAD_REQUEST.to_string()],
            slot_frees: SlotFreeStats::default(),
        }
    }

    /// All memory the device's pages cost: page data plus metadata (zramctl's TOTAL).
    pub fn total_bytes(&self) -> u64 {
        self.store
            .mem_used
            .saturating_add(self.store.metadata_bytes)
    }

    /// DATA / TOTAL, as zramctl's COMP-RATIO; `None` while nothing is stored.
    pub fn comp_ratio(&self) -> Option<f64> {
        // By the data, not the total: the allocator's metadata is never zero, and an empty
        // device read 0.00.
        let total = self.total_bytes();
        (self.store.orig_bytes > 0 && total > 0)
            .then(|| self.store.orig_bytes as f64 / total as f64)
    }
}

/// `dir/ublkb{id}.sock`.
pub fn socket_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("ublkb{id}.sock"))
}
