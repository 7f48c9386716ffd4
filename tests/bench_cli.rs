//! `trueno-ublk bench`: argument parsing, the built-in mix, corpus files and verification.
//! (End-to-end runs through the store are in bench_run.rs.)

use clap::Parser;
use trueno_ublk::bench::corpus::Corpus;
use trueno_ublk::bench::{load_corpus, verify, BenchError};
use trueno_ublk::cli::{BenchArgs, Cli, Command};
use trueno_ublk::codec::PAGE_SIZE;
use trueno_ublk::config::{AlgorithmChoice, BackendChoice, MemLimit, RecompressChoice, SizeExpr};

fn bench_args(extra: &[&str]) -> Result<BenchArgs, clap::Error> {
    let cli = Cli::try_parse_from(["trueno-ublk", "bench"].iter().chain(extra))?;
    match cli.command {
        Command::Bench(args) => Ok(args),
        other => panic!("parsed as {other:?}"),
    }
}

#[test]
fn bench_parses_its_flags_and_the_store_options() {
    let args = bench_args(&[
        "--input",
        "/tmp/pages.corpus",
        "--size",
        "64M",
        "--threads",
        "3",
        "--request-size",
        "64K",
        "--overwrites",
        "0",
        "--latency-samples",
        "500",
        "--seed",
        "9",
        "--repeat",
        "3",
        "--json",
        "--compare-zram",
        "--zram-streams",
        "2",
        "--zram-algorithm",
        "lzo-rle",
        "--algorithm",
        "adaptive",
        "--backend",
        "simd-parallel",
        "--batch-threshold",
        "256",
        "--flush-timeout-ms",
        "3",
        "--mem-limit",
        "1G",
        "--recompress",
        "zstd:9",
        "--recompress-idle",
        "5s",
    ])
    .unwrap();
    assert_eq!(args.input.as_deref(), Some("/tmp/pages.corpus".as_ref()));
    assert_eq!(args.size, Some(64 << 20));
    assert_eq!(args.threads, Some(3));
    assert_eq!(args.request_size, 64 << 10);
    assert_eq!(args.overwrites, 0);
    assert_eq!(args.latency_samples, 500);
    assert_eq!(args.seed, 9);
    assert_eq!(args.repeat, 3);
    assert!(args.json && args.compare_zram);
    assert_eq!(args.zram_streams, Some(2));
    assert_eq!(args.zram_algorithm, "lzo-rle");
    assert_eq!(args.store.algorithm, Some(AlgorithmChoice::Adaptive));
    assert_eq!(args.store.backend, Some(BackendChoice::SimdParallel));
    assert_eq!(args.store.batch_threshold, Some(256));
    assert_eq!(args.store.flush_timeout_ms, Some(3));
    assert_eq!(
        args.store.mem_limit,
        Some(MemLimit::Size(SizeExpr::Bytes(1 << 30)))
    );
    assert_eq!(
        args.store.recompress,
        Some(RecompressChoice::Zstd { level: 9 })
    );
    assert_eq!(
        args.store.recompress_idle,
        Some(std::time::Duration::from_secs(5))
    );
}

#[test]
fn bench_defaults_are_the_documented_ones() {
    let args = bench_args(&[]).unwrap();
    assert_eq!(args.input, None);
    assert_eq!(args.size, None);
    assert_eq!(args.threads, None);
    assert_eq!(args.request_size, PAGE_SIZE as u64);
    assert_eq!(args.overwrites, 3);
    assert_eq!(args.latency_samples, 10_000);
    assert_eq!(args.repeat, 1);
    assert!(!args.json && !args.compare_zram && !args.store.no_batched);
    assert_eq!(args.store.algorithm, None);
    assert_eq!(args.zram_algorithm, "lz4");
    assert_eq!(
        (args.store.recompress, args.store.recompress_idle),
        (None, None)
    );
}

#[test]
fn bench_rejects_bad_values() {
    for bad in [
        &["--threads", "0"][..],
        &["--size", "0"],
        &["--size", "lots"],
        &["--latency-samples", "0"],
        &["--zram-streams", "0"],
        &["--repeat", "0"],
        &["--algorithm", "lzo"],
        &["--backend", "fpga"],
        &["--recompress", "lz4"],
        &["--recompress-idle", "later"],
    ] {
        assert!(bench_args(bad).is_err(), "{bad:?} was accepted");
    }
}

fn is_same_filled(page: &[u8]) -> bool {
    page.chunks_exact(8).all(|word| word == &page[..8])
}

/// Shannon entropy of the page's bytes, in bits per byte.
fn byte_entropy(page: &[u8]) -> f64 {
    let mut counts = [0usize; 256];
    page.iter().for_each(|&b| counts[b as usize] += 1);
    counts
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| {
            let p = n as f64 / page.len() as f64;
            -p * p.log2()
        })
        .sum()
}

#[test]
fn built_in_mix_is_deterministic_and_shaped_like_memory() {
    let pages = 4096;
    let a = Corpus::generated(pages, 42);
    let b = Corpus::generated(pages, 42);
    let c = Corpus::generated(pages, 43);
    assert_eq!(a.page_count(), pages);
    assert!(a.bytes() == b.bytes(), "same seed, different pages");
    assert!(a.bytes() != c.bytes(), "different seeds, same pages");

    let zero = (0..pages)
        .filter(|&i| a.page(i).iter().all(|&b| b == 0))
        .count();
    let same_filled = (0..pages).filter(|&i| is_same_filled(a.page(i))).count() - zero;
    let noise = (0..pages)
        .filter(|&i| byte_entropy(a.page(i)) > 7.8)
        .count();
    // 1.5% zero, 1% other same-filled, 4% incompressible by construction.
    assert!((30..=100).contains(&zero), "{zero} zero pages");
    assert!(
        (15..=70).contains(&same_filled),
        "{same_filled} same-filled"
    );
    assert!((110..=230).contains(&noise), "{noise} incompressible");
}

#[test]
fn corpus_files_load_as_whole_pages() {
    let scratch = tempfile::Builder::new()
        .prefix("trueno-bench-test-")
        .tempdir()
        .unwrap();
    let dir = scratch.path();
    let path = dir.join("three.corpus");
    let mut bytes = vec![0u8; 3 * PAGE_SIZE];
    bytes[PAGE_SIZE..2 * PAGE_SIZE].fill(7);
    bytes[2 * PAGE_SIZE] = 1;
    std::fs::write(&path, &bytes).unwrap();

    let args = bench_args(&["--input", path.to_str().unwrap()]).unwrap();
    let corpus = load_corpus(&args.options()).unwrap();
    assert_eq!(corpus.page_count(), 3);
    assert_eq!(corpus.bytes(), &bytes[..]);
    assert_eq!(
        corpus.bytes().as_ptr() as usize % 4096,
        0,
        "not O_DIRECT-aligned"
    );

    let args = bench_args(&["--input", path.to_str().unwrap(), "--size", "8K"]).unwrap();
    assert_eq!(load_corpus(&args.options()).unwrap().page_count(), 2);

    let ragged = dir.join("ragged.corpus");
    std::fs::write(&ragged, &bytes[..PAGE_SIZE + 100]).unwrap();
    let args = bench_args(&["--input", ragged.to_str().unwrap()]).unwrap();
    assert!(matches!(
        load_corpus(&args.options()),
        Err(BenchError::NotWholePages { len, .. }) if len == PAGE_SIZE as u64 + 100
    ));
    let args = bench_args(&["--input", dir.join("missing").to_str().unwrap()]).unwrap();
    assert!(matches!(
        load_corpus(&args.options()),
        Err(BenchError::Corpus { .. })
    ));
}

#[test]
fn verification_finds_every_differing_page() {
    let corpus = Corpus::generated(64, 5);
    let mut copy = corpus.bytes().to_vec();
    assert!(verify("test", &copy, |i| corpus.page(i)).is_ok());
    copy[17 * PAGE_SIZE + 4095] ^= 1;
    copy[40 * PAGE_SIZE] ^= 0x80;
    match verify("test", &copy, |i| corpus.page(i)) {
        Err(BenchError::Mismatch {
            first_page, pages, ..
        }) => assert_eq!((first_page, pages), (17, 2)),
        other => panic!("{other:?}"),
    }
}

/// `--mem-limit` takes a share of RAM in the bench as in `create`: of this machine's RAM.
#[test]
fn bench_takes_a_memory_limit_as_a_share_of_ram() {
    let args = bench_args(&["--mem-limit", "ram / 4"]).unwrap();
    let settings = trueno_ublk::config::store_settings(&args.options().store).unwrap();
    let ram = trueno_ublk::config::ram_bytes().unwrap();
    let limit = settings.mem_limit.expect("a limit");
    assert!(limit > 0 && limit <= ram / 4, "{limit} of {ram}");
    assert!(limit + 4096 > ram / 4, "{limit} of {ram}");
}
