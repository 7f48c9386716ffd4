//! `--compare-zram` against the machine's real zram. These add a zram device (or reset zram0
//! where the kernel cannot add one) and need root, so they are ignored by default: run them by
//! hand with `cargo test --test bench_zram -- --ignored --test-threads 1`.

use trueno_ublk::bench::corpus::{AlignedBuf, Corpus};
use trueno_ublk::bench::{zram, Progress};

#[test]
#[ignore = "adds and removes a zram device; needs root"]
fn zram_stores_and_returns_the_same_pages() {
    let before = zram_devices();
    let corpus = Corpus::generated(4096, 3);
    let mut scratch = AlignedBuf::zeroed(corpus.bytes().len());
    for streams in [1, 2] {
        let report =
            zram::compare(&corpus, &mut scratch, streams, "lz4", &Progress::hidden()).unwrap();
        assert_eq!(report.algorithm, "lz4");
        assert_eq!(report.streams, streams);
        assert_eq!(report.orig_data_size, 16 << 20);
        assert!(report.write_gbps > 0.0 && report.read_gbps > 0.0);
        assert!(report.ratio > 1.5 && report.mem_ratio > 1.0, "{report:?}");
        assert!(report.same_pages > 0 && report.huge_pages > 0, "{report:?}");
        assert_eq!(scratch.as_slice(), corpus.bytes());
    }
    assert_eq!(
        zram_devices(),
        before,
        "the bench's zram device was not removed"
    );
}

#[test]
#[ignore = "adds and removes a zram device; needs root"]
fn ctrl_c_during_the_zram_phase_removes_the_device() {
    let before = zram_devices();
    let bench = std::process::Command::new(env!("CARGO_BIN_EXE_trueno-ublk"))
        .args([
            "bench",
            "--compare-zram",
            "--size",
            "1G",
            "--overwrites",
            "0",
            "--latency-samples",
            "10",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The signal goes as soon as the bench's device appears: its handlers are in place by then.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while zram_devices().len() <= before.len() {
        assert!(std::time::Instant::now() < deadline, "no zram device added");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(bench.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::SIGINT).unwrap();
    let output = bench.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert_eq!(zram_devices(), before, "the bench's zram device was left");
}

fn zram_devices() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/block")
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("zram"))
        .collect();
    names.sort();
    names
}
