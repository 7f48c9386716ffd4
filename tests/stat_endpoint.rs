//! The statistics endpoint end to end in a temporary directory: a server per device answers
//! with its live report, `stat` reads and prints them, stale and broken sockets are reported.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use trueno_ublk::cli::StatArgs;
use trueno_ublk::procstat::ProcessMemory;
use trueno_ublk::slotfree::SlotFreeStats;
use trueno_ublk::stats::{
    collect, compact, reload, render, report_text, serve_in, socket_path, DeviceReport, Probe,
    StatError, StatFormat, StatsServer, Unserved, COLUMNS,
};
use trueno_ublk::store::StoreStats;
use trueno_ublk::ublk::{IoTiming, Op};

/// A directory for the sockets, not yet made (the server makes it), inside a scratch directory
/// removed when the test ends, passed or failed.
fn temp_dir(name: &str) -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::Builder::new()
        .prefix(&format!("tu-stat-{name}-"))
        .tempdir()
        .unwrap();
    let dir = root.path().join("run");
    (root, dir)
}

fn report(id: u32, orig_bytes: u64) -> DeviceReport {
    DeviceReport {
        id,
        device: format!("/dev/ublkb{id}"),
        pid: 4242,
        disksize: 8 << 30,
        queues: 2,
        depth: 64,
        algorithm: "lz4".into(),
        recompress: "zstd:3,idle=30s".into(),
        backend: "auto".into(),
        gpu: "unavailable: no libcuda".into(),
        store: StoreStats {
            disk_size: 8 << 30,
            orig_bytes,
            compr_bytes: orig_bytes / 4,
            // An empty device holds no memory.
            mem_used: if orig_bytes == 0 {
                0
            } else {
                orig_bytes / 4 + 4096
            },
            // Never zero: the allocator's size classes are metadata of an empty store too.
            metadata_bytes: 4096 * 3,
            mem_limit: 1 << 30,
            zero_pages: 10,
            same_pages: 15,
            pages_simd: 11,
            pages_simd_parallel: 22,
            pages_gpu: 33,
            pages_lz4: 5,
            pages_zstd: 6,
            recompressed_pages: 7,
            recompress_saved_bytes: 3 << 20,
            recompress_cpu_ns: 2_500_000_000,
            checksum_failures: 4,
            batch_flushes: 44,
            failed_reads: 1,
            failed_writes: 2,
            lost_pages: 3,
            ..StoreStats::default()
        },
        memory: ProcessMemory {
            rss_bytes: 30 << 20,
            idle_rss_bytes: 8 << 20,
            ..ProcessMemory::default()
        },
        io: {
            // Reads: 98 in [1024, 2048) ns, 2 in [65536, 131072) ns; no writes.
            let timing = IoTiming::default();
            for ns in std::iter::repeat_n(1500, 98).chain([100_000, 100_000]) {
                timing.record_request(Some(Op::Read), ns);
            }
            timing.snapshot()
        },
        requests: vec!["compact".into(), "reload".into()],
        // Device 0 has the probe; device 7 says why not.
        slot_frees: if id == 0 {
            SlotFreeStats {
                attached: true,
                detail: "swap_entry_range_free".into(),
                calls: 9,
                slots: 12,
            }
        } else {
            SlotFreeStats::off("no BTF")
        },
    }
}

fn args(id: Option<u32>, json: bool, raw: bool) -> StatArgs {
    StatArgs { id, json, raw }
}

fn stat_text(dir: &Path, args: &StatArgs) -> Result<String, StatError> {
    report_text(dir, args.id, args.format(), &[])
}

/// A server of device 0 in `dir` whose statistics thread is making a report that does not end
/// until the returned sender is dropped, and the client connection that asked for it.
fn server_stuck_in_a_report(
    dir: &Path,
) -> (
    StatsServer,
    std::os::unix::net::UnixStream,
    std::sync::mpsc::Sender<()>,
) {
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = std::sync::Mutex::new(release_rx);
    let server = serve_in(dir, 0, move || {
        let _ = started_tx.send(());
        let _ = release_rx.lock().unwrap().recv();
        report(0, 0)
    })
    .unwrap();
    let client = std::os::unix::net::UnixStream::connect(socket_path(dir, 0)).unwrap();
    started_rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the report was not started");
    (server, client, release_tx)
}

/// Run `stop` on a thread of its own; it must end within `secs`, or the test fails saying
/// `waited`.
fn ends_within(secs: u64, waited: &str, stop: impl FnOnce() + Send + 'static) {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        stop();
        let _ = done_tx.send(());
    });
    done_rx
        .recv_timeout(std::time::Duration::from_secs(secs))
        .expect(waited);
}

/// A daemon handing its device over leaves its endpoint without waiting for the thread, which
/// may be making a report (in reclaim, say) for as long as it takes: the socket goes at once.
#[test]
fn a_server_left_removes_its_socket_without_waiting_for_a_report_under_way() {
    let (_root, dir) = temp_dir("leave");
    let (server, client, release) = server_stuck_in_a_report(&dir);
    ends_within(10, "leave waited for the report under way", move || {
        server.leave()
    });
    assert!(!socket_path(&dir, 0).exists(), "socket left behind");
    drop(release);
    drop(client);
}

/// A daemon that stops while its statistics thread is stuck making a report (in reclaim, say)
/// waits for it a bounded time, then goes on: the stop is not held for good.
#[test]
fn a_server_stuck_in_a_report_does_not_hold_its_stop() {
    let (_root, dir) = temp_dir("stuck-stop");
    let (server, client, release) = server_stuck_in_a_report(&dir);
    ends_within(30, "the stop waited for the stuck report", move || {
        drop(server)
    });
    assert!(!socket_path(&dir, 0).exists(), "socket left behind");
    drop(release);
    drop(client);
}

/// A socket whose daemon listens but takes no connection (its statistics thread stuck, its
/// backlog full) is a live daemon's, not a stale one: a second daemon for the same id is
/// refused in bounded time, and the first one's socket stays.
#[test]
fn a_listener_that_takes_no_connection_is_not_taken_for_stale() {
    use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
    use std::os::fd::AsRawFd;
    let (_root, dir) = temp_dir("full-backlog");
    std::fs::create_dir_all(&dir).unwrap();
    let path = socket_path(&dir, 3);
    let address = UnixAddr::new(&path).unwrap();
    let unix_socket = || {
        socket::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK,
            None,
        )
        .unwrap()
    };
    let listener = unix_socket();
    socket::bind(listener.as_raw_fd(), &address).unwrap();
    socket::listen(&listener, Backlog::new(1).unwrap()).unwrap();
    let mut queued = Vec::new();
    loop {
        let client = unix_socket();
        match socket::connect(client.as_raw_fd(), &address) {
            Ok(()) => queued.push(client),
            Err(nix::errno::Errno::EAGAIN) => break,
            Err(error) => panic!("connect: {error}"),
        }
        assert!(queued.len() < 64, "the backlog never filled");
    }
    let asked = std::time::Instant::now();
    let error = serve_in(&dir, 3, || report(3, 0)).map(|_| ()).unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse, "{error}");
    assert!(error.to_string().contains("ublkb3.sock"), "{error}");
    assert!(
        asked.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        asked.elapsed()
    );
    assert!(path.exists(), "a live daemon's socket was removed");
    drop(queued);
    drop(listener);
}

#[test]
fn server_answers_live_reports_and_cleans_up() {
    let (_root, dir) = temp_dir("live");
    let written = Arc::new(AtomicU64::new(4096));
    let counter = Arc::clone(&written);
    let server = serve_in(&dir, 0, move || report(0, counter.load(Ordering::Relaxed))).unwrap();
    let path = socket_path(&dir, 0);
    assert_eq!(server.path(), path);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&path), 0o600);

    let probes = collect(&dir, None, &[]).unwrap();
    let [Probe::Live(first)] = probes.as_slice() else {
        panic!("{probes:?}")
    };
    assert_eq!(first.id, 0);
    assert_eq!(first.store.orig_bytes, 4096);
    assert_eq!(first.store.pages_gpu, 33);
    assert_eq!(first.gpu, "unavailable: no libcuda");

    // Each connection gets the state of that moment.
    written.store(3 << 30, Ordering::Relaxed);
    let probes = collect(&dir, Some(0), &[]).unwrap();
    let [Probe::Live(second)] = probes.as_slice() else {
        panic!("{probes:?}")
    };
    assert_eq!(second.store.orig_bytes, 3 << 30);

    drop(server);
    assert!(!path.exists(), "socket left behind");
    assert!(collect(&dir, None, &[]).unwrap().is_empty());
}

/// A server whose socket file was removed and made again by someone else (a new listener
/// that never accepts) stops without waiting: woken through the other socket, its thread would
/// never see the flag, and the join would wait for good.
#[test]
fn a_server_whose_socket_was_replaced_stops_at_once() {
    let (_root, dir) = temp_dir("replaced");
    let server = serve_in(&dir, 0, || report(0, 0)).unwrap();
    let path = socket_path(&dir, 0);
    std::fs::remove_file(&path).unwrap();
    let other = UnixListener::bind(&path).unwrap();
    ends_within(
        10,
        "the server's drop waited on a socket not its own",
        move || drop(server),
    );
    assert!(path.exists(), "another's socket was removed");
    drop(other);
}

#[test]
fn table_json_and_raw_output() {
    let (_root, dir) = temp_dir("render");
    let _zero = serve_in(&dir, 0, || report(0, 3 << 30)).unwrap();
    let _seven = serve_in(&dir, 7, || report(7, 0)).unwrap();

    let table = stat_text(&dir, &args(None, false, false)).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(header, COLUMNS);
    let row: Vec<&str> = lines[1].split_whitespace().collect();
    // NAME DISKSIZE DATA COMPR ALGORITHM STREAMS ZERO-PAGES TOTAL MEM-LIMIT MEM-USED COMP-RATIO
    assert_eq!(
        &row[..11],
        [
            "/dev/ublkb0",
            "8G",
            "3G",
            "768M",
            "lz4",
            "2",
            "15",
            "768M",
            "1G",
            "768M",
            "4.00"
        ]
    );
    // PAGES-SIMD PAGES-PARALLEL PAGES-GPU
    assert_eq!(&row[11..14], ["11", "22", "33"]);
    // RECOMPRESS MEM-SHORT PAGES-LZ4 PAGES-ZSTD RECOMPRESSED RECOMP-SAVED RECOMP-CPU
    assert_eq!(
        &row[14..21],
        ["zstd:3,idle=30s", "no", "5", "6", "7", "3M", "2.5s"]
    );
    // FLUSHES READ-ERRS WRITE-ERRS LOST CSUM-ERRS
    assert_eq!(&row[21..26], ["44", "1", "2", "3", "4"]);
    // RSS IDLE-RSS, then READ-P50 READ-P99 WRITE-P50 WRITE-P99: bucket upper bounds in µs,
    // `-` without requests.
    assert_eq!(&row[26..28], ["30M", "8M"]);
    assert_eq!(&row[28..32], ["<=3us", "<=132us", "-", "-"]);
    // SLOT-FREES: slots freed through the probe, or `off`.
    assert_eq!(row[32], "12");
    assert_eq!(lines[2].split_whitespace().nth(32), Some("off"));
    assert!(lines[1].ends_with("unavailable: no libcuda"));
    assert!(lines[2].starts_with("/dev/ublkb7"), "sorted by id: {table}");
    // Nothing stored: no ratio.
    assert_eq!(lines[2].split_whitespace().nth(10), Some("-"));
    // Every row lines up under the header.
    let zero_pages_end = lines[0].find("ZERO-PAGES").unwrap() + "ZERO-PAGES".len();
    assert_eq!(&lines[1][zero_pages_end - 2..zero_pages_end], "15");

    let raw = stat_text(&dir, &args(Some(0), false, true)).unwrap();
    let row: Vec<&str> = raw.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(row[1], (8u64 << 30).to_string());
    assert_eq!(row[2], (3u64 << 30).to_string());
    assert_eq!(raw.lines().count(), 2);

    let json = stat_text(&dir, &args(None, true, false)).unwrap();
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    let devices = value["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0]["id"], 0);
    assert_eq!(devices[0]["device"], "/dev/ublkb0");
    assert_eq!(devices[0]["store"]["orig_bytes"], 3u64 << 30);
    let total = (3u64 << 30) / 4 + 4096 * 4;
    assert_eq!(devices[0]["total"], total);
    assert_eq!(devices[0]["comp_ratio"], (3u64 << 30) as f64 / total as f64);
    assert_eq!(devices[1]["comp_ratio"], serde_json::Value::Null);
    assert!(value["unreachable"].as_array().unwrap().is_empty());
}

#[test]
fn no_devices_is_said_and_not_an_error() {
    let (_root, dir) = temp_dir("none");
    // No directory at all (no daemon ever ran).
    let text = stat_text(&dir, &args(None, false, false)).unwrap();
    assert_eq!(text, "no running trueno-ublk devices\n");
    let json = stat_text(&dir, &args(None, true, false)).unwrap();
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(value["devices"].as_array().unwrap().is_empty());
    // An empty directory, and files that are not device sockets.
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "x").unwrap();
    std::fs::write(dir.join("ublkbX.sock"), "x").unwrap();
    let text = stat_text(&dir, &args(None, false, false)).unwrap();
    assert_eq!(text, "no running trueno-ublk devices\n");
    // Asking for one device that does not run is an error that names it.
    let error = stat_text(&dir, &args(Some(3), false, false)).unwrap_err();
    assert!(matches!(error, StatError::NoSuchDevice { id: 3, .. }));
    assert!(error.to_string().contains("ublkb3"));
}

#[test]
fn stale_socket_is_reported_then_replaced() {
    let (_root, dir) = temp_dir("stale");
    std::fs::create_dir_all(&dir).unwrap();
    let path = socket_path(&dir, 2);
    // A daemon that died: its socket file stays, nobody listens.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let _live = serve_in(&dir, 1, || report(1, 4096)).unwrap();

    let probes = collect(&dir, None, &[]).unwrap();
    assert!(matches!(probes[0], Probe::Live(ref r) if r.id == 1));
    assert!(matches!(probes[1], Probe::Unreachable { id: 2, .. }));
    let text = render(&probes, StatFormat::Table);
    assert!(text.lines().nth(1).unwrap().starts_with("/dev/ublkb1"));
    let last = text.lines().last().unwrap();
    assert!(
        last.starts_with("ublkb2: stale socket") && last.contains("ublkb2.sock"),
        "{text}"
    );
    // No daemon answering is not "no running devices": the reasons follow.
    let text = render(&probes[1..], StatFormat::Table);
    assert_eq!(
        text.lines().next(),
        Some("no trueno-ublk device answered"),
        "{text}"
    );
    let json = render(&probes, StatFormat::Json);
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value["unreachable"][0]["id"], 2);
    // Only the stale one, asked for by its id: an error that says why (a check of that one
    // device must fail), as for a device with no socket at all.
    let error = stat_text(&dir, &args(Some(2), false, false)).unwrap_err();
    assert!(
        matches!(error, StatError::Unreachable { id: 2, .. })
            && error.to_string().contains("stale socket"),
        "{error}"
    );

    // A new daemon for id 2 removes the stale socket and serves.
    let _new = serve_in(&dir, 2, || report(2, 8192)).unwrap();
    let probes = collect(&dir, Some(2), &[]).unwrap();
    assert!(matches!(probes[..], [Probe::Live(ref r)] if r.store.orig_bytes == 8192));
}

/// A device the kernel has waiting for a daemon, with no socket (a stop that handed it over
/// removed it): a line that says so, in id order, not a device left out as if it were not
/// there; one that has a socket is not listed twice.
#[test]
fn a_device_waiting_for_a_daemon_without_a_socket_gets_a_line() {
    let (_root, dir) = temp_dir("unserved");
    let _live = serve_in(&dir, 1, || report(1, 4096)).unwrap();
    let unserved = [
        Unserved {
            id: 0,
            state: "quiesced",
            supervisor: None,
        },
        Unserved {
            id: 1,
            state: "live",
            supervisor: None,
        },
        Unserved {
            id: 2,
            state: "quiesced",
            supervisor: Some("77".into()),
        },
    ];
    let probes = collect(&dir, None, &unserved).unwrap();
    assert_eq!(probes.len(), 3, "{probes:?}");
    assert!(matches!(
        probes[0],
        Probe::Unreachable { id: 0, ref reason, .. }
            if reason.contains("quiesced") && reason.contains("trueno-ublk@0")
    ));
    assert!(matches!(probes[1], Probe::Live(ref r) if r.id == 1));
    // One being resumed by its supervisor says so, not "start it".
    assert!(matches!(
        probes[2],
        Probe::Unreachable { id: 2, ref reason, .. }
            if reason.contains("supervisor (pid 77)") && !reason.contains("systemctl start")
    ));
    let text = report_text(&dir, None, StatFormat::Table, &unserved).unwrap();
    assert!(
        text.lines()
            .any(|line| line.starts_with("ublkb0: no daemon serves it")),
        "{text}"
    );
    // Asked for by its id: an error (exit status 1), not "no such device".
    let error = report_text(&dir, Some(0), StatFormat::Table, &unserved).unwrap_err();
    assert!(
        matches!(error, StatError::Unreachable { id: 0, .. }),
        "{error}"
    );
    // Another id asked for leaves it out.
    let probes = collect(&dir, Some(1), &unserved).unwrap();
    assert!(matches!(probes[..], [Probe::Live(ref r)] if r.id == 1));
}

/// Daemons that take a connection and never answer (a stuck statistics thread) are asked
/// side by side: four cost one timeout (2 s), not four, and each gets its line.
#[test]
fn stuck_daemons_are_asked_side_by_side() {
    let (_root, dir) = temp_dir("stuck");
    std::fs::create_dir_all(&dir).unwrap();
    // Bound and listening, never accepting: a connect succeeds, the answer never comes.
    let _stuck: Vec<UnixListener> = (0..4)
        .map(|id| UnixListener::bind(socket_path(&dir, id)).unwrap())
        .collect();
    let _live = serve_in(&dir, 4, || report(4, 4096)).unwrap();
    let started = std::time::Instant::now();
    let probes = collect(&dir, None, &[]).unwrap();
    let took = started.elapsed();
    assert_eq!(probes.len(), 5, "{probes:?}");
    for (id, probe) in probes.iter().take(4).enumerate() {
        assert!(
            matches!(probe, Probe::Unreachable { id: theirs, .. } if *theirs as usize == id),
            "{probe:?}"
        );
    }
    assert!(matches!(probes[4], Probe::Live(ref r) if r.id == 4));
    assert!(
        took < std::time::Duration::from_secs(6),
        "asked one after the other: {took:?}"
    );
}

#[test]
fn a_live_socket_is_not_taken_over() {
    let (_root, dir) = temp_dir("taken");
    let first = serve_in(&dir, 0, || report(0, 4096)).unwrap();
    let error = serve_in(&dir, 0, || report(0, 0))
        .err()
        .expect("second server refused");
    assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse);
    assert!(error.to_string().contains("ublkb0.sock"));
    // The refused server did not disturb the first one.
    let probes = collect(&dir, None, &[]).unwrap();
    assert!(matches!(probes[..], [Probe::Live(ref r)] if r.store.orig_bytes == 4096));
    // A path that is not a socket is not removed either.
    std::fs::write(socket_path(&dir, 5), "data").unwrap();
    let error = serve_in(&dir, 5, || report(5, 0)).err().unwrap();
    assert!(error.to_string().contains("not a socket"), "{error}");
    assert_eq!(std::fs::read(socket_path(&dir, 5)).unwrap(), b"data");
    drop(first);
}

#[test]
fn garbage_and_wrong_answers_are_reported() {
    let (_root, dir) = temp_dir("garbage");
    std::fs::create_dir_all(&dir).unwrap();
    let garbage = UnixListener::bind(socket_path(&dir, 0)).unwrap();
    let wrong = UnixListener::bind(socket_path(&dir, 1)).unwrap();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = garbage.accept().unwrap();
        stream.write_all(b"this is not json\n").unwrap();
        drop(stream);
        let (mut stream, _) = wrong.accept().unwrap();
        let mut line = serde_json::to_vec(&report(9, 0)).unwrap();
        line.push(b'\n');
        stream.write_all(&line).unwrap();
    });
    let probes = collect(&dir, None, &[]).unwrap();
    server.join().unwrap();
    let reasons: Vec<&str> = probes
        .iter()
        .map(|probe| match probe {
            Probe::Unreachable { reason, .. } => reason.as_str(),
            Probe::Live(report) => panic!("accepted {report:?}"),
        })
        .collect();
    assert!(reasons[0].contains("unreadable answer"), "{reasons:?}");
    assert!(reasons[1].contains("ublkb9"), "{reasons:?}");
}

#[test]
fn binary_without_devices_says_so_and_exits_zero() {
    if Path::new(trueno_ublk::stats::SOCKET_DIR).exists() {
        eprintln!(
            "skipped: {} exists on this host",
            trueno_ublk::stats::SOCKET_DIR
        );
        return;
    }
    let output = Command::new(env!("CARGO_BIN_EXE_trueno-ublk"))
        .arg("stat")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "no running trueno-ublk devices\n"
    );
    let output = Command::new(env!("CARGO_BIN_EXE_trueno-ublk"))
        .args(["stat", "--id", "4"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("ublkb4"));
}

#[test]
fn report_from_device_settings() {
    use clap::Parser;
    use trueno_ublk::cli::{Cli, Command as CliCommand};
    use trueno_ublk::config::{resolve_with, ConfigFile};
    let cli = Cli::try_parse_from([
        "trueno-ublk",
        "create",
        "--size",
        "2G",
        "--queues",
        "3",
        "--depth",
        "32",
        "--algorithm",
        "zstd",
        "--zstd-level",
        "4",
        "--backend",
        "simd",
    ])
    .unwrap();
    let CliCommand::Create(args) = cli.command else {
        panic!("not create")
    };
    let settings = resolve_with(&args.options(), &ConfigFile::default(), 8 << 30).unwrap();
    let report = DeviceReport::new(6, &settings, "none", StoreStats::default());
    assert_eq!(report.device, "/dev/ublkb6");
    assert_eq!(report.pid, std::process::id());
    assert_eq!(report.disksize, 2 << 30);
    assert_eq!((report.queues, report.depth), (3, 32));
    assert_eq!(report.algorithm, "zstd:4");
    assert_eq!(report.backend, "simd");
    assert_eq!(report.gpu, "none");
}

/// `compact` signals only a trueno-ublk daemon: a report whose pid is another program's (here
/// this test's: a daemon's pid reused after it exited) is refused and nothing is signalled
/// (SIGUSR2 ends a process that does not handle it); a daemon whose report does not list the
/// request is not signalled either, and a device without a daemon is said to have none. The
/// signal and the wait for the count: `trueno-ublk compact` in the VM test (scripts/vm/test.sh).
#[test]
fn compact_signals_only_a_trueno_ublk_daemon() {
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;
    let (_root, dir) = temp_dir("compact");
    let asked = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGUSR2, Arc::clone(&asked)).unwrap();
    let _server = serve_in(&dir, 3, move || {
        let mut r = report(3, 4096);
        r.pid = std::process::id();
        r
    })
    .unwrap();
    let error = compact(&dir, 3, Duration::from_secs(1)).err().unwrap();
    assert!(
        matches!(error, StatError::NotDaemon { id: 3, .. }),
        "{error}"
    );
    assert!(
        !asked.load(Ordering::Relaxed),
        "another program was signalled"
    );

    let _old = serve_in(&dir, 4, || {
        let mut r = report(4, 4096);
        r.requests.clear();
        r
    })
    .unwrap();
    let error = compact(&dir, 4, Duration::from_secs(1)).err().unwrap();
    assert!(
        matches!(error, StatError::NoCompaction { id: 4, pid: 4242 }),
        "{error}"
    );
    assert!(error.to_string().contains("predates `compact`"), "{error}");

    let error = compact(&dir, 5, Duration::from_secs(1)).err().unwrap();
    assert!(
        matches!(error, StatError::NoSuchDevice { id: 5, .. }),
        "{error}"
    );
}

/// `reload` signals only a supervisor: the serving process's parent, and only if that is a
/// trueno-ublk (here the parent of the reported pid is this test, so nothing is signalled);
/// a daemon whose report does not list the request is not signalled either, and a device
/// without a daemon is said to have none.
#[test]
fn reload_signals_only_a_trueno_ublk_supervisor() {
    use std::time::Duration;
    let (_root, dir) = temp_dir("reload");
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id();
    let _server = serve_in(&dir, 6, move || {
        let mut r = report(6, 4096);
        r.pid = pid;
        r
    })
    .unwrap();
    let error = reload(&dir, 6, Duration::from_secs(1)).err().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        matches!(&error, StatError::NoSupervisor { id: 6, .. }),
        "{error}"
    );
    assert!(
        error.to_string().contains("no trueno-ublk supervisor"),
        "{error}"
    );

    let _old = serve_in(&dir, 7, || {
        let mut r = report(7, 4096);
        r.requests.retain(|request| request != "reload");
        r
    })
    .unwrap();
    let error = reload(&dir, 7, Duration::from_secs(1)).err().unwrap();
    assert!(
        matches!(error, StatError::NoReload { id: 7, pid: 4242 }),
        "{error}"
    );

    let error = reload(&dir, 8, Duration::from_secs(1)).err().unwrap();
    assert!(
        matches!(error, StatError::NoSuchDevice { id: 8, .. }),
        "{error}"
    );
}
