//! Live statistics: each daemon answers on a root-only unix socket
//! (`/run/trueno-ublk/ublkb{id}.sock`, directory 0700, socket 0600) with one JSON line holding
//! its `DeviceReport`; `trueno-ublk stat` reads every socket and prints zramctl's columns.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::cli::{human_size, StatArgs};
use crate::config::DeviceSettings;
use crate::store::StoreStats;

/// Where the daemons put their sockets.
pub const SOCKET_DIR: &str = "/run/trueno-ublk";

/// How long `stat` waits for a daemon's answer, and a daemon for a client to take it.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// A report is about 1 KiB; anything longer than this is not one.
const MAX_REPORT_BYTES: u64 = 64 << 10;

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
    /// `auto`, `simd`, `simd-parallel` or `gpu`.
    pub backend: String,
    /// GPU state in words: the device name, or why there is none.
    pub gpu: String,
    pub store: StoreStats,
}

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
            device: format!("/dev/ublkb{id}"),
            pid: std::process::id(),
            disksize: settings.size_bytes,
            queues: settings.queues,
            depth: settings.depth,
            algorithm: settings.store.algorithm_name(),
            backend: settings.store.backend_name().to_string(),
            gpu: gpu.into(),
            store,
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
        let total = self.total_bytes();
        (total > 0).then(|| self.store.orig_bytes as f64 / total as f64)
    }
}

/// `dir/ublkb{id}.sock`.
pub fn socket_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("ublkb{id}.sock"))
}

/// The daemon's side: answers on the socket until dropped, then removes it.
pub struct StatsServer {
    path: PathBuf,
    /// (device, inode) of the socket we bound, so drop never removes a successor's socket.
    identity: (u64, u64),
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl StatsServer {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for StatsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // The thread sits in accept(): one connection wakes it to see the flag.
        let woke = UnixStream::connect(&self.path).is_ok();
        if let Some(thread) = self.thread.take() {
            if woke {
                let _ = thread.join();
            } else {
                tracing::warn!(
                    "stats socket {} vanished; leaving its thread to process exit",
                    self.path.display()
                );
            }
        }
        let ours = fs::symlink_metadata(&self.path)
            .map(|m| (m.dev(), m.ino()) == self.identity)
            .unwrap_or(false);
        if ours {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Serve `report()` for device `id` at `/run/trueno-ublk/ublkb{id}.sock` (needs root).
pub fn serve(
    id: u32,
    report: impl Fn() -> DeviceReport + Send + Sync + 'static,
) -> io::Result<StatsServer> {
    serve_in(Path::new(SOCKET_DIR), id, report)
}

/// `serve` with the socket directory given (tests use a temporary one).
pub fn serve_in(
    dir: &Path,
    id: u32,
    report: impl Fn() -> DeviceReport + Send + Sync + 'static,
) -> io::Result<StatsServer> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    let path = socket_path(dir, id);
    remove_stale_socket(&path)?;
    let listener = UnixListener::bind(&path)?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600))?;
    let metadata = fs::symlink_metadata(&path)?;
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name(format!("stats-ublkb{id}"))
        .spawn(move || accept_loop(&listener, &thread_stop, &report))?;
    Ok(StatsServer {
        path,
        identity: (metadata.dev(), metadata.ino()),
        stop,
        thread: Some(thread),
    })
}

/// A socket left by a daemon that died is removed; one a live daemon answers on is an error.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    let metadata = match fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error),
    };
    if !metadata.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket; remove it", path.display()),
        ));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "another trueno-ublk daemon answers on {}; is this device id already served?",
                path.display()
            ),
        ));
    }
    fs::remove_file(path)
}

fn accept_loop(listener: &UnixListener, stop: &AtomicBool, report: &dyn Fn() -> DeviceReport) {
    for connection in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let result = connection.and_then(|stream| answer(stream, report));
        if let Err(error) = result {
            tracing::debug!("stats connection failed: {error}");
            // accept() failing over and over (EMFILE) must not spin a core.
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn answer(mut stream: UnixStream, report: &dyn Fn() -> DeviceReport) -> io::Result<()> {
    let mut line = serde_json::to_vec(&report()).map_err(io::Error::other)?;
    line.push(b'\n');
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    stream.write_all(&line)
}

#[derive(Debug, Error)]
pub enum StatError {
    #[error("cannot read {}: the statistics sockets are root-only; run with sudo", dir.display())]
    NeedsRoot { dir: PathBuf },
    #[error("cannot list {}: {source}", dir.display())]
    List { dir: PathBuf, source: io::Error },
    #[error("no trueno-ublk daemon serves ublkb{id} (no socket in {})", dir.display())]
    NoSuchDevice { id: u32, dir: PathBuf },
    #[error("cannot write the output: {0}")]
    Output(io::Error),
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

/// Read the report of every socket in `dir` (or only `ublkb{only}`), in id order.
pub fn collect(dir: &Path, only: Option<u32>) -> Result<Vec<Probe>, StatError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) if error.kind() == io::ErrorKind::PermissionDenied => {
            return Err(StatError::NeedsRoot {
                dir: dir.to_path_buf(),
            })
        }
        Err(source) => {
            return Err(StatError::List {
                dir: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut ids: Vec<u32> = entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| socket_id(&entry.file_name().to_string_lossy()))
        .filter(|id| only.map_or(true, |only| only == *id))
        .collect();
    ids.sort_unstable();
    let mut probes = Vec::with_capacity(ids.len());
    for id in ids {
        let socket = socket_path(dir, id);
        match query(&socket, id) {
            Ok(report) => probes.push(Probe::Live(Box::new(report))),
            Err(QueryError::Gone) => {}
            Err(QueryError::Denied) => {
                return Err(StatError::NeedsRoot {
                    dir: dir.to_path_buf(),
                })
            }
            Err(QueryError::Failed(reason)) => {
                probes.push(Probe::Unreachable { id, socket, reason })
            }
        }
    }
    Ok(probes)
}

/// `ublkb7.sock` → 7.
fn socket_id(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("ublkb")?.strip_suffix(".sock")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

enum QueryError {
    /// The socket disappeared between listing and connecting (the daemon stopped).
    Gone,
    Denied,
    Failed(String),
}

fn query(socket: &Path, id: u32) -> Result<DeviceReport, QueryError> {
    let stream = UnixStream::connect(socket).map_err(|error| match error.kind() {
        io::ErrorKind::NotFound => QueryError::Gone,
        io::ErrorKind::PermissionDenied => QueryError::Denied,
        io::ErrorKind::ConnectionRefused => QueryError::Failed(
            "stale socket: its daemon is gone (see `trueno-ublk list`)".to_string(),
        ),
        _ => QueryError::Failed(format!("cannot connect: {error}")),
    })?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|error| QueryError::Failed(error.to_string()))?;
    let mut answer = Vec::new();
    stream
        .take(MAX_REPORT_BYTES)
        .read_to_end(&mut answer)
        .map_err(|error| match error.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                QueryError::Failed(format!("no answer within {} s", IO_TIMEOUT.as_secs()))
            }
            _ => QueryError::Failed(format!("cannot read the answer: {error}")),
        })?;
    let line = answer.split(|&b| b == b'\n').next().unwrap_or_default();
    let report: DeviceReport = serde_json::from_slice(line)
        .map_err(|error| QueryError::Failed(format!("unreadable answer: {error}")))?;
    if report.id != id {
        return Err(QueryError::Failed(format!(
            "answered for ublkb{} instead",
            report.id
        )));
    }
    Ok(report)
}

/// How `render` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatFormat {
    /// Human-readable sizes.
    Table,
    /// Sizes in bytes.
    RawTable,
    Json,
}

impl StatFormat {
    pub fn from_args(args: &StatArgs) -> Self {
        match (args.json, args.raw) {
            (true, _) => StatFormat::Json,
            (false, true) => StatFormat::RawTable,
            (false, false) => StatFormat::Table,
        }
    }
}

/// The table's columns: zramctl's, then ours.
pub const COLUMNS: &[&str] = &[
    "NAME",
    "DISKSIZE",
    "DATA",
    "COMPR",
    "ALGORITHM",
    "STREAMS",
    "ZERO-PAGES",
    "TOTAL",
    "MEM-LIMIT",
    "MEM-USED",
    "COMP-RATIO",
    "PAGES-SIMD",
    "PAGES-PARALLEL",
    "PAGES-GPU",
    "FLUSHES",
    "READ-ERRS",
    "WRITE-ERRS",
    "GPU",
];

/// Columns printed left-aligned (the others are numbers).
const TEXT_COLUMNS: &[&str] = &["NAME", "ALGORITHM", "GPU"];

/// The output of `stat` for these probes.
pub fn render(probes: &[Probe], format: StatFormat) -> String {
    if format == StatFormat::Json {
        return render_json(probes);
    }
    let reports: Vec<&DeviceReport> = probes
        .iter()
        .filter_map(|probe| match probe {
            Probe::Live(report) => Some(report.as_ref()),
            Probe::Unreachable { .. } => None,
        })
        .collect();
    let mut out = String::new();
    if reports.is_empty() {
        out.push_str("no running trueno-ublk devices\n");
    } else {
        let size = |bytes: u64| match format {
            StatFormat::RawTable => bytes.to_string(),
            _ => human_size(bytes),
        };
        let mut rows = vec![COLUMNS.iter().map(|c| c.to_string()).collect::<Vec<_>>()];
        for report in reports {
            let s = &report.store;
            rows.push(vec![
                report.device.clone(),
                size(report.disksize),
                size(s.orig_bytes),
                size(s.compr_bytes),
                report.algorithm.clone(),
                report.queues.to_string(),
                // zram's same_pages: every same-filled page, zero pages included.
                s.same_pages.to_string(),
                size(report.total_bytes()),
                size(s.mem_limit),
                size(s.mem_used),
                report
                    .comp_ratio()
                    .map_or_else(|| "-".to_string(), |ratio| format!("{ratio:.2}")),
                s.pages_simd.to_string(),
                s.pages_simd_parallel.to_string(),
                s.pages_gpu.to_string(),
                s.batch_flushes.to_string(),
                s.failed_reads.to_string(),
                s.failed_writes.to_string(),
                report.gpu.clone(),
            ]);
        }
        out.push_str(&format_table(&rows));
    }
    for probe in probes {
        if let Probe::Unreachable { id, socket, reason } = probe {
            out.push_str(&format!("ublkb{id}: {reason} ({})\n", socket.display()));
        }
    }
    out
}

fn format_table(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..COLUMNS.len())
        .map(|column| rows.iter().map(|row| row[column].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let last = row.len() - 1;
        for (column, cell) in row.iter().enumerate() {
            let width = widths[column];
            if TEXT_COLUMNS.contains(&COLUMNS[column]) {
                if column == last {
                    out.push_str(cell);
                } else {
                    out.push_str(&format!("{cell:<width$}"));
                }
            } else {
                out.push_str(&format!("{cell:>width$}"));
            }
            out.push(if column == last { '\n' } else { ' ' });
        }
    }
    out
}

#[derive(Serialize)]
struct JsonOutput<'a> {
    devices: Vec<JsonDevice<'a>>,
    unreachable: Vec<JsonUnreachable<'a>>,
}

#[derive(Serialize)]
struct JsonDevice<'a> {
    #[serde(flatten)]
    report: &'a DeviceReport,
    total: u64,
    comp_ratio: Option<f64>,
}

#[derive(Serialize)]
struct JsonUnreachable<'a> {
    id: u32,
    socket: &'a Path,
    reason: &'a str,
}

fn render_json(probes: &[Probe]) -> String {
    let mut output = JsonOutput {
        devices: Vec::new(),
        unreachable: Vec::new(),
    };
    for probe in probes {
        match probe {
            Probe::Live(report) => output.devices.push(JsonDevice {
                report,
                total: report.total_bytes(),
                comp_ratio: report.comp_ratio(),
            }),
            Probe::Unreachable { id, socket, reason } => output.unreachable.push(JsonUnreachable {
                id: *id,
                socket,
                reason,
            }),
        }
    }
    let mut text = serde_json::to_string_pretty(&output).unwrap_or_default();
    text.push('\n');
    text
}

/// `trueno-ublk stat`.
pub fn stat(args: &StatArgs) -> Result<(), StatError> {
    stat_in(Path::new(SOCKET_DIR), args, &mut io::stdout().lock())
}

/// `stat` reading the sockets of `dir` and writing to `out`.
pub fn stat_in(dir: &Path, args: &StatArgs, out: &mut dyn Write) -> Result<(), StatError> {
    let probes = collect(dir, args.id)?;
    if let (Some(id), true) = (args.id, probes.is_empty()) {
        return Err(StatError::NoSuchDevice {
            id,
            dir: dir.to_path_buf(),
        });
    }
    out.write_all(render(&probes, StatFormat::from_args(args)).as_bytes())
        .map_err(StatError::Output)
}
