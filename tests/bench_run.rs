//! `trueno-ublk bench` end to end on tiny corpora: every page goes through the store's write
//! and read paths and is checked, and the report carries the figures the issue asks for.

use clap::Parser;
use trueno_ublk::bench::{load_corpus, measure, BenchOptions, Progress};
use trueno_ublk::cli::{Cli, Command};
use trueno_ublk::codec::PAGE_SIZE;

fn bench_args(extra: &[&str]) -> BenchOptions {
    let cli = Cli::try_parse_from(["trueno-ublk", "bench"].iter().chain(extra)).unwrap();
    match cli.command {
        Command::Bench(args) => args.options(),
        other => panic!("parsed as {other:?}"),
    }
}

fn run(extra: &[&str]) -> trueno_ublk::bench::report::BenchReport {
    let args = bench_args(extra);
    let corpus = load_corpus(&args).unwrap();
    measure(&args, &corpus, &Progress::hidden()).unwrap()
}

#[test]
fn batched_run_round_trips_every_page_and_reports_figures() {
    let report = run(&[
        "--size",
        "8M",
        "--threads",
        "2",
        "--latency-samples",
        "200",
        "--overwrites",
        "2",
        "--algorithm",
        "lz4",
        "--recompress-idle",
        "100ms",
    ]);
    let pages = 8 << 20 >> 12;
    // LZ4's default recompression (to zstd:3 once idle) settled after the read pass.
    assert_eq!(report.recompress, "zstd:3,idle=100ms");
    let settle = report.settle.as_ref().unwrap();
    assert!(settle.settled, "{settle:?}");
    assert!(settle.recompressed_pages > 0);
    assert_eq!(settle.stats.recompress_backlog, 0);
    // More zstd pages once settled than right after the writes (with a 100 ms idle
    // threshold a slow machine recompresses some before that snapshot: CI run of
    // 2026-11-25 05:40).
    assert!(
        settle.stats.pages_zstd > report.stats.pages_zstd,
        "{settle:?}"
    );
    assert!(
        report.mem_ratio > report.mem_ratio_hot,
        "settled {} against {} right after the writes",
        report.mem_ratio,
        report.mem_ratio_hot
    );
    assert_eq!(report.pages, pages);
    // Named as the command line writes them.
    assert_eq!(
        (report.algorithm.as_str(), report.backend.as_str()),
        ("lz4", "auto")
    );
    assert_eq!(report.stats.orig_bytes, (pages * PAGE_SIZE) as u64);
    assert!(report.write_gbps > 0.0 && report.read_gbps > 0.0);
    // The built-in mix compresses; a store that kept pages raw would fail this.
    assert!(report.ratio > 1.5, "ratio {}", report.ratio);
    assert!(report.mem_ratio > 1.0, "memory ratio {}", report.mem_ratio);
    assert!(report.stats.zero_pages + report.stats.same_pages > 0);
    let overwrite = report.overwrite.as_ref().unwrap();
    assert_eq!(overwrite.passes, 2);
    assert_eq!(overwrite.stats.orig_bytes, (pages * PAGE_SIZE) as u64);
    assert!(overwrite.mem_ratio > 1.0);
    let latency = &report.latency;
    assert_eq!(latency.write_page.samples, 200);
    assert_eq!(latency.read_page.samples, 200);
    assert_eq!(latency.batch_pages, 1000);
    // Without a GPU a flush takes the default batch threshold, 256 pages.
    assert_eq!(latency.flush_pages, 256);
    assert_eq!(latency.batch_flush.samples, 20);
    assert_eq!(latency.batch_read.samples, 20);
    for p in [
        &latency.write_page,
        &latency.read_page,
        &latency.batch_flush,
        &latency.batch_read,
    ] {
        assert!(p.p50_us > 0.0 && p.p50_us <= p.p99_us && p.p99_us <= p.p999_us);
    }
    assert!(report.zram.is_none() && report.vs_zram.is_none());
    let codec = &report.codec;
    assert_eq!(codec.backend, "simd-parallel");
    assert!(codec.compress_gbps > 0.0 && codec.decompress_gbps > 0.0);
    // Same pages, same codec: the ratios differ only by the same-filled pages the store
    // keeps without compressed data.
    assert!(codec.ratio > 1.5 && codec.ratio <= report.ratio * 1.01);
}

#[test]
fn per_page_zstd_run_with_multi_page_requests_round_trips() {
    let report = run(&[
        "--size",
        "2M",
        "--no-batched",
        "--algorithm",
        "zstd",
        "--request-size",
        "64K",
        "--latency-samples",
        "20",
        "--overwrites",
        "1",
        "--repeat",
        "2",
        "--recompress",
        "off",
    ]);
    assert_eq!(report.repeat, 2);
    assert_eq!(report.runs.len(), 2);
    assert_eq!(
        report.read_gbps,
        report.runs[0].read_gbps.max(report.runs[1].read_gbps)
    );
    assert_eq!(
        report.codec.compress_gbps,
        report.runs[0]
            .codec_compress_gbps
            .max(report.runs[1].codec_compress_gbps)
    );
    assert!(report.runs[0].zram_write_gbps.is_none());
    assert_eq!(report.request_bytes, 64 << 10);
    assert!(!report.batched);
    assert!(report.stats.pages_zstd > 0);
    assert!(
        report.settle.is_none(),
        "no recompression, nothing to wait for"
    );
    assert_eq!(report.mem_ratio, report.mem_ratio_hot);
    // Fewer pages than a latency batch: the batch is the whole corpus, flushed 256 pages (the
    // default threshold without a GPU) at a time.
    assert_eq!(report.latency.batch_pages, 512);
    assert_eq!(report.latency.flush_pages, 256);
}

#[test]
fn json_report_has_the_required_keys() {
    let report = run(&[
        "--size",
        "1M",
        "--latency-samples",
        "10",
        "--overwrites",
        "0",
        "--algorithm",
        "lz4",
        "--recompress-idle",
        "100ms",
    ]);
    let json = serde_json::to_value(&report).unwrap();
    for key in [
        "write_gbps",
        "write_gbps_with_setup",
        "store_setup_s",
        "read_gbps",
        "ratio",
        "mem_ratio",
        "mem_ratio_hot",
    ] {
        assert!(
            json[key].as_f64().is_some_and(|v| v > 0.0),
            "{key}: {}",
            json[key]
        );
    }
    // The store's making is timed apart from its writes, and counted with them it only slows.
    assert!(json["write_gbps_with_setup"].as_f64() < json["write_gbps"].as_f64());
    assert!(json["latency"]["write_page"]["p99_us"].is_number());
    assert!(json["latency"]["batch_read"]["p999_us"].is_number());
    assert!(json["stats"]["orig_bytes"].is_number());
    assert!(json["settle"]["seconds"].is_number());
    assert!(json["settle"]["stats"]["recompressed_pages"].is_number());
    assert!(json["overwrite"].is_null());
    assert!(json["zram"].is_null());
}

/// Run the binary's `bench` with `args` and `--json`, which must succeed: its JSON report and
/// what it wrote on stderr.
fn bench_json(args: &[&str]) -> (serde_json::Value, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_trueno-ublk"))
        .arg("bench")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    (serde_json::from_slice(&output.stdout).unwrap(), stderr)
}

#[test]
fn the_binary_prints_one_json_object() {
    let (json, _) = bench_json(&[
        "--size",
        "1M",
        "--latency-samples",
        "10",
        "--overwrites",
        "1",
    ]);
    assert!(json["write_gbps"].as_f64().is_some_and(|v| v > 0.0));
    assert!(json["overwrite"]["mem_ratio"]
        .as_f64()
        .is_some_and(|v| v > 0.0));
}

#[test]
fn a_missing_corpus_fails_with_a_message() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_trueno-ublk"))
        .args(["bench", "--input", "/nonexistent/pages.corpus"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cannot read corpus"), "{stderr}");
}

#[test]
fn a_request_size_the_corpus_cannot_take_is_changed_with_a_note() {
    let bench = |request_size: &str| {
        let (json, stderr) = bench_json(&[
            "--size",
            "1M",
            "--request-size",
            request_size,
            "--latency-samples",
            "10",
            "--overwrites",
            "0",
            // No recompression to wait for: the run takes a tenth of a second.
            "--recompress",
            "off",
        ]);
        (json["request_bytes"].as_u64(), stderr)
    };
    // 256 pages: 12 KiB (3 pages) does not divide them, 8 KiB does.
    let (bytes, stderr) = bench("12K");
    assert_eq!(bytes, Some(8192));
    assert!(
        stderr.contains("requests of 8192 bytes, not the 12288 asked for"),
        "{stderr}"
    );
    let (bytes, stderr) = bench("16K");
    assert_eq!(bytes, Some(16384));
    assert!(!stderr.contains("note"), "{stderr}");
}
