//! The daemon's side of the statistics socket.

#![forbid(unsafe_code)]

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{connect, socket_path, ConnectError, DeviceReport, IO_TIMEOUT, SOCKET_DIR};

/// How long a stopping server waits for its thread: an answer being written may take
/// `IO_TIMEOUT`, and the wake-up connection is taken after it.
const STOP_WAIT: Duration = IO_TIMEOUT.saturating_mul(2);

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

    /// Remove the socket without waiting for the thread, which ends with the process: a
    /// process that hands its device over exits without joining threads (the one answering
    /// may be making a report in reclaim, while swap waits for the next daemon).
    pub fn leave(mut self) {
        drop(self.thread.take());
    }
}

impl Drop for StatsServer {
    fn drop(&mut self) {
        let ours = || {
            fs::symlink_metadata(&self.path)
                .map(|m| (m.dev(), m.ino()) == self.identity)
                .unwrap_or(false)
        };
        if let Some(thread) = self.thread.take() {
            self.stop.store(true, Ordering::Release);
            // The thread sits in accept(): one connection wakes it to see the flag. Only
            // through this socket: at the path another's (this one's file removed, a new
            // daemon's made there) would answer instead, and the join would wait for good.
            // Nor for longer than an answer to a client may take: a thread stuck making a
            // report (in reclaim, say) must not hold the daemon's stop.
            if !ours() {
                tracing::warn!(
                    "stats socket {} vanished; leaving its thread to process exit",
                    self.path.display()
                );
            } else if let Err(error) = connect(&self.path) {
                tracing::warn!(
                    "stats socket {}: {error}; leaving its thread to process exit",
                    self.path.display()
                );
            } else {
                let deadline = Instant::now() + STOP_WAIT;
                while !thread.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                if thread.is_finished() {
                    let _ = thread.join();
                } else {
                    tracing::warn!(
                        "the statistics thread did not end within {} s; leaving it to process exit",
                        STOP_WAIT.as_secs()
                    );
                }
            }
        }
        if ours() {
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
    // Only a socket nobody listens on is stale: a live daemon whose statistics thread takes
    // no connection (`Unanswered`) still serves the device.
    match connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "another trueno-ublk daemon answers on {}; is this device id already served?",
                path.display()
            ),
        )),
        Err(ConnectError::Unanswered) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "another trueno-ublk daemon listens on {} ({}); is this device id already served?",
                path.display(),
                ConnectError::Unanswered
            ),
        )),
        Err(_) => fs::remove_file(path),
    }
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
