//! A detached daemon's log: the file `create` made in the run directory, which is tmpfs on
//! every systemd machine, so each byte of it is RAM (or swap on this very device). Under
//! systemd the journal bounds what a daemon says; here this module does: past
//! `DETACHED_LOG_CAP` the file starts again from empty, with a line that says so.

#![forbid(unsafe_code)]

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::path::Path;

/// The most a detached daemon's log holds: days of its usual lines (a few a minute at most
/// while memory comes and goes), and little RAM.
pub(super) const DETACHED_LOG_CAP: u64 = 1 << 20;

/// The log file this process writes to, if its stderr is one of the run directory's logs
/// (the detached daemon's three processes share it); `None` for a terminal, the journal or a
/// file of the administrator's own choosing, which are left as they are.
pub(super) fn detached_log(run_dir: &Path) -> Option<File> {
    let target = std::fs::read_link("/proc/self/fd/2").ok()?;
    if target.parent() != Some(run_dir) || target.extension()? != "log" {
        return None;
    }
    let file = File::from(std::io::stderr().as_fd().try_clone_to_owned().ok()?);
    file.metadata().ok()?.is_file().then_some(file)
}

/// A log file kept under `cap` bytes: a line that would take it past the cap empties it
/// first. The file is shared with the daemon's other processes (one open file, opened to
/// append), so whichever of them empties it, the others' next lines land at its new end.
pub(super) struct CappedLog {
    file: File,
    cap: u64,
}

impl CappedLog {
    pub(super) fn new(file: File, cap: u64) -> Self {
        Self { file, cap }
    }

    fn restart_if_full(&mut self, incoming: usize) -> std::io::Result<()> {
        let len = self.file.metadata()?.len();
        if len.saturating_add(incoming as u64) <= self.cap {
            return Ok(());
        }
        self.file.set_len(0)?;
        // For a file opened without O_APPEND (the offset is shared with the other processes).
        self.file.seek(SeekFrom::Start(0))?;
        writeln!(
            self.file,
            "(this log was emptied here: it had reached {len} bytes, and it is kept under {})",
            self.cap
        )
    }
}

impl Write for CappedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // A failure to empty the file is no reason to lose the line.
        let _ = self.restart_if_full(buf.len());
        self.file.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("trueno-log-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("ublkb0.log")
    }

    /// Two writers sharing one open file (the supervisor and its serving process) keep it
    /// under the cap however much they write, and the file says where it was emptied.
    #[test]
    fn a_log_written_past_its_cap_starts_again_and_says_so() {
        for append in [true, false] {
            let path = scratch(if append { "append" } else { "plain" });
            let file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(append)
                .open(&path)
                .unwrap();
            file.set_len(0).unwrap();
            let mut first = CappedLog::new(file.try_clone().unwrap(), 4096);
            let mut second = CappedLog::new(file, 4096);
            let line = [b'x'; 99];
            for i in 0..200 {
                let writer = if i % 2 == 0 { &mut first } else { &mut second };
                writer.write_all(&line).unwrap();
                writer.write_all(b"\n").unwrap();
                let len = std::fs::metadata(&path).unwrap().len();
                assert!(len <= 4096, "{len} bytes after line {i} (append {append})");
            }
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(text.starts_with("(this log was emptied here"), "{text:.80}");
            assert!(!text.contains('\0'), "a hole in the file (append {append})");
            std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
        }
    }

    #[test]
    fn only_the_run_directorys_logs_are_capped() {
        // This test's stderr is the harness's pipe or terminal, never a log of that directory.
        assert!(detached_log(Path::new("/run/trueno-ublk")).is_none());
    }
}
