//! A ublk block device kept in a plain file in memory (`/dev/shm/ublk_ramdisk-N`): no
//! compression, no page store. It tests the ublk layer (`trueno_ublk::ublk`) apart from the
//! store, so a protocol bug and a store bug can be told apart. The VM test (scripts/vm/test.sh)
//! runs it before the daemon.
//!
//!   cargo build --release --example ublk_ramdisk
//!   sudo target/release/examples/ublk_ramdisk --size 64M [--id N] [--queues Q] [--depth D]
//!        [--user-copy]
//!
//! Prints the block device's path once it is live, serves until a signal (or until the device
//! is stopped from outside), then prints how many requests of each kind it served:
//! - SIGTERM or SIGINT: deletes the device and its data file;
//! - SIGUSR1: hands the device over: it stays, quiesced (I/O waits), and so does the file.
//!
//! The data lives in the file, not in this process, so the device survives this process's
//! death (`kill -9`, SIGUSR1) when the driver has user recovery: run it again with the same
//! `--id` and `--size` and it resumes the device with every byte as it was. The kernel picks
//! the id of a new device when `--id` is left out; the file is named after it.

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use tracing::level_filters::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use trueno_ublk::ublk::device::{block_path, char_class_path};
use trueno_ublk::ublk::{BlockHandler, Device, DeviceSpec, Failure, Op, Request};

/// How often the main thread looks for a signal while it waits for a queue to end.
const SIGNAL_POLL: Duration = Duration::from_millis(100);
/// Where the devices' data lives: memory that outlives the process.
const DATA_DIR: &str = "/dev/shm";
/// Bytes of zeros written per call for a discard or write-zeroes.
const ZERO_CHUNK: usize = 64 << 10;
/// Bytes of the buffer per tag: larger than the daemon's 64 KiB, so requests of several
/// sizes reach the handler.
const MAX_IO_BYTES: u32 = 256 << 10;

#[derive(Parser, Debug)]
#[command(about = "A ublk block device in plain memory (tests the ublk layer alone)")]
struct Args {
    /// Device size: bytes, or with a K, M or G suffix (a multiple of 4 KiB).
    #[arg(long, value_parser = parse_size)]
    size: u64,
    /// Device id (/dev/ublkbID); the kernel picks one when left out.
    #[arg(long)]
    id: Option<u32>,
    /// Hardware queues, one thread each.
    #[arg(long, default_value_t = 1)]
    queues: u16,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 64)]
    depth: u16,
    /// Copy request data with pread/pwrite on the char device (UBLK_F_USER_COPY) where the
    /// driver offers it, instead of a buffer per tag.
    #[arg(long)]
    user_copy: bool,
}

fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last() {
        Some((at, 'k' | 'K')) => (&text[..at], 10),
        Some((at, 'm' | 'M')) => (&text[..at], 20),
        Some((at, 'g' | 'G')) => (&text[..at], 30),
        _ => (text, 0),
    };
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("'{text}' is not a size (e.g. 64M)"))?;
    value
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("'{text}' is too large"))
}

/// Requests served, by kind: printed at the end so a test can see each op reached the handler.
#[derive(Default)]
struct Counters {
    read: AtomicU64,
    write: AtomicU64,
    flush: AtomicU64,
    discard: AtomicU64,
    write_zeroes: AtomicU64,
    refused: AtomicU64,
}

/// The whole device as one file in memory. A new file reads as zeros and costs no memory
/// until written. No lock: each request is one positioned read or write of its own range,
/// and overlapping requests in flight at once are the block layer's users' business, as on
/// any disk.
struct RamDisk {
    size: u64,
    data: File,
    served: Counters,
}

impl RamDisk {
    /// A device's data file: created empty (all zeros) for a new device, or the one a
    /// previous process left for a device being resumed.
    fn open(path: &Path, size: u64, fresh: bool) -> Result<Self, String> {
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(fresh)
            .truncate(fresh)
            .open(path)
            .map_err(|e| {
                format!(
                    "{}: {e}{}",
                    path.display(),
                    if fresh {
                        ""
                    } else {
                        " (its data is gone: refusing to resume the device with zeros)"
                    }
                )
            })?;
        if fresh {
            data.set_len(size)
                .map_err(|e| format!("sizing {}: {e}", path.display()))?;
        }
        let len = data
            .metadata()
            .map_err(|e| format!("{}: {e}", path.display()))?
            .len();
        if len != size {
            return Err(format!(
                "{} holds {len} bytes, not the device's {size}",
                path.display()
            ));
        }
        Ok(Self {
            size,
            data,
            served: Counters::default(),
        })
    }

    /// The byte range of `request`, or None if any of it lies outside. The ublk layer checks
    /// this already; checking again keeps a bug there from becoming a wrong write here.
    fn range(&self, request: &Request, len: u64) -> Option<(u64, u64)> {
        let end = request.offset.checked_add(len)?;
        (end <= self.size).then_some((request.offset, end))
    }

    fn refuse(&self, request: &Request, errno: i32) -> Result<(), Failure> {
        self.served.refused.fetch_add(1, Ordering::Relaxed);
        eprintln!("ublk_ramdisk: refused {request:?}: errno {errno}");
        Err(Failure::from(-errno))
    }

    fn zero(&self, start: u64, end: u64) -> std::io::Result<()> {
        let zeros = [0u8; ZERO_CHUNK];
        let mut at = start;
        while at < end {
            let n = usize::try_from(end - at).map_or(ZERO_CHUNK, |left| left.min(ZERO_CHUNK));
            self.data.write_all_at(&zeros[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }
}

impl BlockHandler for RamDisk {
    fn prepare_thread(&self) {}

    fn handle(&self, request: &Request, data: &mut [u8]) -> Result<(), Failure> {
        let counter = match request.op {
            Op::Read => &self.served.read,
            Op::Write => &self.served.write,
            Op::Flush => &self.served.flush,
            Op::Discard => &self.served.discard,
            Op::WriteZeroes => &self.served.write_zeroes,
        };
        if request.op == Op::Flush {
            // Every write went to the file at once: nothing to flush.
            counter.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        // READ and WRITE move `data`, which the ublk layer sized to the request; the others
        // carry no data and act on `request.len` bytes.
        if matches!(request.op, Op::Read | Op::Write) && data.len() as u64 != request.len {
            return self.refuse(request, libc::EINVAL);
        }
        let Some((start, end)) = self.range(request, request.len) else {
            return self.refuse(request, libc::EIO);
        };
        let done = match request.op {
            Op::Read => self.data.read_exact_at(data, start),
            Op::Write => self.data.write_all_at(data, start),
            _ => self.zero(start, end),
        };
        if let Err(error) = done {
            eprintln!("ublk_ramdisk: {request:?}: {error}");
            return self.refuse(request, libc::EIO);
        }
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn data_path(id: u32) -> PathBuf {
    Path::new(DATA_DIR).join(format!("ublk_ramdisk-{id}"))
}

fn run(args: &Args) -> Result<(), String> {
    let spec = DeviceSpec {
        id: args.id,
        size_bytes: args.size,
        queues: args.queues,
        depth: args.depth,
        max_io_bytes: MAX_IO_BYTES,
        user_copy_max_io_bytes: args.user_copy.then_some(MAX_IO_BYTES),
        // A test target, given its depth as asked (the driver caps it at 4096).
        tag_buffers_limit_bytes: u64::MAX,
    };
    spec.validate().map_err(|e| e.to_string())?;
    // Installed before the device exists, so a signal during start-up is not lost.
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGUSR1])
        .map_err(|e| format!("installing signal handlers: {e}"))?;
    let started = Instant::now();
    // A device with this id that exists already is one a previous run left (killed, or
    // handed over): resume it from its file.
    let (device, disk, resumed) = match args.id {
        Some(id) if Path::new(&char_class_path(id)).exists() => {
            let disk = Arc::new(RamDisk::open(&data_path(id), args.size, false)?);
            let device = Device::recover(id, args.size, disk.clone()).map_err(|e| e.to_string())?;
            (device, disk, true)
        }
        _ => {
            let added = Device::add(spec, |_| {}).map_err(|e| e.to_string())?;
            if !added.survives_daemon() {
                eprintln!(
                    "ublk_ramdisk: this kernel's ublk driver has no user recovery: the \
                     device will not survive this process"
                );
            }
            let disk = Arc::new(RamDisk::open(&data_path(added.id()), args.size, true)?);
            let device = added.start(disk.clone()).map_err(|e| e.to_string())?;
            (device, disk, false)
        }
    };
    println!("{}", block_path(device.id()));
    eprintln!(
        "ublk_ramdisk: {} {} (pid {}) in {} ms, {}",
        if resumed { "resumed" } else { "created" },
        block_path(device.id()),
        std::process::id(),
        started.elapsed().as_millis(),
        if device.user_copy() {
            "user copy"
        } else {
            "a buffer per tag"
        }
    );
    let mut hand_over = false;
    loop {
        if let Some(signal) = signals.pending().next() {
            hand_over = signal == SIGUSR1;
            eprintln!(
                "ublk_ramdisk: signal {signal}: {}",
                if hand_over {
                    "handing over"
                } else {
                    "stopping"
                }
            );
            break;
        }
        match device.queue_exits().recv_timeout(SIGNAL_POLL) {
            Ok(q_id) => {
                eprintln!("ublk_ramdisk: queue {q_id} ended (device stopped?): stopping");
                break;
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
    }
    let id = device.id();
    if hand_over {
        device.hand_over().map_err(|e| e.to_string())?;
    } else {
        device.shutdown().map_err(|e| e.to_string())?;
        let _ = std::fs::remove_file(data_path(id));
    }
    let served = &disk.served;
    let n = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    println!(
        "served: read={} write={} flush={} discard={} write_zeroes={} refused={}",
        n(&served.read),
        n(&served.write),
        n(&served.flush),
        n(&served.discard),
        n(&served.write_zeroes),
        n(&served.refused)
    );
    Ok(())
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .finish()
        .with(trueno_ublk::daemon::log_filter(LevelFilter::WARN))
        .try_init();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("ublk_ramdisk: {message}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u64 = 1 << 20;

    fn request(op: Op, offset: u64, len: u64) -> Request {
        Request {
            op,
            flags: 0,
            offset,
            len,
        }
    }

    /// A data file of its own for each test, removed when the test ends.
    struct TempData(PathBuf);

    impl TempData {
        fn new(name: &str) -> Self {
            Self(
                std::env::temp_dir()
                    .join(format!("ublk_ramdisk-test-{name}-{}", std::process::id())),
            )
        }
    }

    impl Drop for TempData {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn writes_read_back_and_discard_zeroes() {
        let file = TempData::new("rw");
        let disk = RamDisk::open(&file.0, SIZE, true).unwrap();
        let mut page = vec![0x5au8; 8192];
        disk.handle(&request(Op::Write, 4096, 8192), &mut page)
            .unwrap();
        disk.handle(&request(Op::Discard, 8192, 4096), &mut [])
            .unwrap();
        disk.handle(&request(Op::Flush, 0, 0), &mut []).unwrap();
        let mut back = vec![0u8; 8192];
        disk.handle(&request(Op::Read, 4096, 8192), &mut back)
            .unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0x5a));
        assert!(back[4096..].iter().all(|&b| b == 0));
        disk.handle(&request(Op::WriteZeroes, 4096, 4096), &mut [])
            .unwrap();
        disk.handle(&request(Op::Read, 4096, 4096), &mut back[..4096])
            .unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0));
    }

    #[test]
    fn data_outlives_the_disk_and_a_fresh_open_zeroes_it() {
        let file = TempData::new("keep");
        let mut page = vec![0x33u8; 4096];
        let disk = RamDisk::open(&file.0, SIZE, true).unwrap();
        disk.handle(&request(Op::Write, SIZE - 4096, 4096), &mut page)
            .unwrap();
        drop(disk);
        let resumed = RamDisk::open(&file.0, SIZE, false).unwrap();
        let mut back = vec![0u8; 4096];
        resumed
            .handle(&request(Op::Read, SIZE - 4096, 4096), &mut back)
            .unwrap();
        assert_eq!(back, page);
        // Another size is another device: refused, not served.
        assert!(RamDisk::open(&file.0, 2 * SIZE, false).is_err());
        let fresh = RamDisk::open(&file.0, SIZE, true).unwrap();
        fresh
            .handle(&request(Op::Read, SIZE - 4096, 4096), &mut back)
            .unwrap();
        assert!(back.iter().all(|&b| b == 0));
        // No file: a resume is refused rather than served as zeros.
        drop(file);
        let missing = TempData::new("keep");
        assert!(RamDisk::open(&missing.0, SIZE, false)
            .err()
            .unwrap()
            .contains("refusing"));
    }

    #[test]
    fn out_of_range_and_unknown_ops_get_an_errno() {
        let file = TempData::new("range");
        let disk = RamDisk::open(&file.0, SIZE, true).unwrap();
        let mut page = vec![0u8; 4096];
        let end = SIZE;
        let eio = Err(Failure::from(-libc::EIO));
        assert_eq!(disk.handle(&request(Op::Read, end, 4096), &mut page), eio);
        assert_eq!(
            disk.handle(&request(Op::Write, end - 2048, 4096), &mut page),
            eio
        );
        assert_eq!(
            disk.handle(&request(Op::Discard, u64::MAX - 10, 4096), &mut []),
            eio
        );
        assert_eq!(
            disk.handle(&request(Op::WriteZeroes, 0, u64::MAX), &mut []),
            eio
        );
        assert_eq!(
            disk.handle(&request(Op::Read, 0, 8192), &mut page),
            Err(Failure::from(-libc::EINVAL))
        );
        assert_eq!(disk.served.refused.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999G").is_err());
    }
}
