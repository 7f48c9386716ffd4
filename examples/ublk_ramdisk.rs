//! A ublk block device kept in a plain in-memory buffer: no compression, no page store. It
//! tests the ublk layer (`trueno_ublk::ublk`) apart from the store, so a protocol bug and a
//! store bug can be told apart. The VM test (scripts/vm/test.sh) runs it before the daemon.
//!
//!   cargo build --release --example ublk_ramdisk
//!   sudo target/release/examples/ublk_ramdisk --size 64M [--id N] [--queues Q] [--depth D]
//!
//! Prints the block device's path once it is live, serves until SIGTERM or SIGINT (or until
//! the device is stopped from outside), then deletes the device and prints how many requests
//! of each kind it served.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use parking_lot::RwLock;
use signal_hook::consts::{SIGINT, SIGTERM};
use trueno_ublk::ublk::device::block_path;
use trueno_ublk::ublk::{BlockHandler, Device, DeviceSpec, Op, Request, UblkError};

/// How often the main thread looks for a signal while it waits for a queue to end.
const SIGNAL_POLL: Duration = Duration::from_millis(100);
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

/// The whole device as one zeroed buffer. `vec![0; n]` gets zeroed pages from the kernel on
/// first touch, so an unused range costs no memory. One lock for the whole buffer: this is a
/// protocol test target, not a fast device.
struct RamDisk {
    size: usize,
    bytes: RwLock<Vec<u8>>,
    served: Counters,
}

impl RamDisk {
    fn new(size: usize) -> Self {
        Self {
            size,
            bytes: RwLock::new(vec![0; size]),
            served: Counters::default(),
        }
    }

    /// The byte range of `request` in the buffer, or None if any of it lies outside. The ublk
    /// layer checks this already; checking again keeps a bug there from turning into a panic
    /// here.
    fn range(&self, request: &Request, len: usize) -> Option<std::ops::Range<usize>> {
        let start = usize::try_from(request.offset).ok()?;
        let end = start.checked_add(len)?;
        (end <= self.size).then_some(start..end)
    }

    fn refuse(&self, request: &Request, errno: i32) -> Result<(), i32> {
        self.served.refused.fetch_add(1, Ordering::Relaxed);
        eprintln!("ublk_ramdisk: refused {request:?}: errno {errno}");
        Err(-errno)
    }
}

impl BlockHandler for RamDisk {
    fn prepare_thread(&self) {}

    fn handle(&self, request: &Request, data: &mut [u8]) -> Result<(), i32> {
        let counter = match request.op {
            Op::Read => &self.served.read,
            Op::Write => &self.served.write,
            Op::Flush => &self.served.flush,
            Op::Discard => &self.served.discard,
            Op::WriteZeroes => &self.served.write_zeroes,
            Op::Unsupported(_) => return self.refuse(request, libc::EOPNOTSUPP),
        };
        if request.op == Op::Flush {
            // Nothing is cached apart from the buffer itself.
            counter.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        // READ and WRITE move `data`, which the ublk layer sized to the request; the others
        // carry no data and act on `request.len` bytes.
        let len = match request.op {
            Op::Read | Op::Write if u64::try_from(data.len()) != Ok(request.len) => {
                return self.refuse(request, libc::EINVAL)
            }
            Op::Read | Op::Write => data.len(),
            _ => match usize::try_from(request.len) {
                Ok(len) => len,
                Err(_) => return self.refuse(request, libc::EIO),
            },
        };
        let Some(range) = self.range(request, len) else {
            return self.refuse(request, libc::EIO);
        };
        match request.op {
            Op::Read => data.copy_from_slice(&self.bytes.read()[range]),
            Op::Write => self.bytes.write()[range].copy_from_slice(data),
            _ => self.bytes.write()[range].fill(0),
        }
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn run(args: &Args) -> Result<(), String> {
    let size = usize::try_from(args.size)
        .map_err(|_| format!("size {} does not fit in memory here", args.size))?;
    let spec = DeviceSpec {
        id: args.id,
        size_bytes: args.size,
        queues: args.queues,
        depth: args.depth,
        max_io_bytes: MAX_IO_BYTES,
    };
    // Checked before the buffer is allocated, so a bad size is a message and not an abort.
    spec.validate().map_err(|e| e.to_string())?;
    // Installed before the device exists, so a signal during start-up is not lost.
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
        .map_err(|e| format!("installing signal handlers: {e}"))?;
    let disk = Arc::new(RamDisk::new(size));
    let device = Device::create(spec, disk.clone()).map_err(|e: UblkError| e.to_string())?;
    println!("{}", block_path(device.id()));
    loop {
        if let Some(signal) = signals.pending().next() {
            eprintln!("ublk_ramdisk: signal {signal}: stopping");
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
    device.shutdown().map_err(|e| e.to_string())?;
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
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TRUENO_UBLK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
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

    const SIZE: usize = 1 << 20;

    fn request(op: Op, offset: u64, len: u64) -> Request {
        Request {
            op,
            flags: 0,
            offset,
            len,
        }
    }

    #[test]
    fn writes_read_back_and_discard_zeroes() {
        let disk = RamDisk::new(SIZE);
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
    fn out_of_range_and_unknown_ops_get_an_errno() {
        let disk = RamDisk::new(SIZE);
        let mut page = vec![0u8; 4096];
        let end = SIZE as u64;
        let eio = Err(-libc::EIO);
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
            Err(-libc::EINVAL)
        );
        assert_eq!(
            disk.handle(&request(Op::Unsupported(99), 0, 4096), &mut []),
            Err(-libc::EOPNOTSUPP)
        );
        assert_eq!(disk.served.refused.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999G").is_err());
    }
}
