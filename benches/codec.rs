//! Codec benchmarks: classification, the page checksum, the two LZ4 libraries, per-page
//! codecs, and batch compression per backend for batch sizes 1 to 10 000.
//!
//! Pages come from `TRUENO_BENCH_CORPUS` (a file of 4 KiB pages, e.g. from
//! `scripts/make-corpus.sh`) or else from a synthetic heap-like mix. The default run is short;
//! pass `-- --measurement-time 5` for steadier numbers.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]

#[path = "../tests/store_common/mod.rs"]
mod store_common;

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use trueno_ublk::codec::{
    classify, compress_page, decompress_page, Algorithm, BatchCodec, CompressedBatch, CpuCodec,
    Encoding, Page, PageChecksum, PageClass, PAGE_SIZE,
};

/// `n` data pages (same-filled pages never reach a codec).
fn corpus(n: usize) -> Vec<Box<Page>> {
    if let Ok(path) = std::env::var("TRUENO_BENCH_CORPUS") {
        if let Ok(bytes) = std::fs::read(&path) {
            let pages: Vec<Box<Page>> = bytes
                .chunks_exact(PAGE_SIZE)
                .filter_map(|c| <&Page>::try_from(c).ok())
                .filter(|p| classify(p) == PageClass::Data)
                .take(n)
                .map(|p| Box::new(*p))
                .collect();
            if !pages.is_empty() {
                return pages.into_iter().cycle().take(n).collect();
            }
        }
        eprintln!("TRUENO_BENCH_CORPUS={path} unreadable or empty; using synthetic pages");
    }
    // Mostly heap-like pages, some text, a few random: roughly what process memory holds.
    (0..n as u64)
        .map(|i| match i % 10 {
            0 => store_common::text_page(i),
            1 => store_common::random_page(i),
            _ => store_common::mixed_page(i),
        })
        .collect()
}

fn bench_classify(c: &mut Criterion) {
    let data = corpus(1);
    let zero = store_common::zero_page();
    let mut g = c.benchmark_group("classify");
    g.throughput(Throughput::Bytes(PAGE_SIZE as u64));
    g.bench_function("data_page", |b| {
        b.iter(|| classify(std::hint::black_box(&data[0])))
    });
    g.bench_function("zero_page", |b| {
        b.iter(|| classify(std::hint::black_box(&zero)))
    });
    g.finish();
}

/// The checksum the store takes of every page it stores and checks on every read of one (a new
/// store takes the fastest of the three where it is made, `PageChecksum::fastest_here`): its
/// cost against `page_codec`'s figures for the same pages (256 of them, 1 MiB: in cache, as a
/// page the store has just decompressed or is about to compress is).
fn bench_checksum(c: &mut Criterion) {
    let pages = corpus(256);
    let mut g = c.benchmark_group("checksum");
    g.throughput(Throughput::Bytes((pages.len() * PAGE_SIZE) as u64));
    for (name, kind) in [
        ("xxh64_page", PageChecksum::Xxh64),
        ("crc32c_page", PageChecksum::Crc32c),
        ("xxh3_page", PageChecksum::Xxh3),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                pages
                    .iter()
                    .fold(0u32, |acc, p| acc ^ kind.of(std::hint::black_box(p)))
            })
        });
    }
    g.finish();
}

/// liblz4 (C) against lz4_flex (Rust) on the same pages: the measurement behind the codec's
/// choice of liblz4.
fn bench_lz4_library(c: &mut Criterion) {
    let pages = corpus(256);
    let bytes = (pages.len() * PAGE_SIZE) as u64;
    let mut out = vec![0u8; 2 * PAGE_SIZE];
    let liblz4: Vec<Vec<u8>> = pages
        .iter()
        .map(|p| lz4::block::compress(&p[..], None, false).unwrap_or_default())
        .collect();
    let flex: Vec<Vec<u8>> = pages
        .iter()
        .map(|p| lz4_flex::block::compress(&p[..]))
        .collect();
    let mut g = c.benchmark_group("lz4_library");
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function("liblz4_compress", |b| {
        b.iter(|| {
            for p in &pages {
                let _ = lz4::block::compress_to_buffer(&p[..], None, false, &mut out);
            }
        })
    });
    g.bench_function("lz4_flex_compress", |b| {
        b.iter(|| {
            for p in &pages {
                let _ = lz4_flex::block::compress_into(&p[..], &mut out);
            }
        })
    });
    let mut page = [0u8; PAGE_SIZE];
    g.bench_function("liblz4_decompress", |b| {
        b.iter(|| {
            for c in &liblz4 {
                let _ = lz4::block::decompress_to_buffer(c, Some(PAGE_SIZE as i32), &mut page);
            }
        })
    });
    g.bench_function("lz4_flex_decompress", |b| {
        b.iter(|| {
            for c in &flex {
                let _ = lz4_flex::block::decompress_into(c, &mut page);
            }
        })
    });
    g.finish();
}

const ALGORITHMS: [(&str, Algorithm); 4] = [
    ("lz4", Algorithm::Lz4),
    ("zstd1", Algorithm::Zstd { level: 1 }),
    // The recompressor's, and new pages' while memory is short.
    ("zstd3", Algorithm::Zstd { level: 3 }),
    ("adaptive", Algorithm::Adaptive),
];

fn bench_page_codecs(c: &mut Criterion) {
    let pages = corpus(256);
    let bytes = (pages.len() * PAGE_SIZE) as u64;
    let mut g = c.benchmark_group("page_codec");
    g.throughput(Throughput::Bytes(bytes));
    for (name, alg) in ALGORITHMS {
        let mut out = [0u8; PAGE_SIZE];
        g.bench_function(BenchmarkId::new("compress", name), |b| {
            b.iter(|| {
                for p in &pages {
                    compress_page(alg, p, &mut out);
                }
            })
        });
        let compressed: Vec<(Encoding, Vec<u8>)> = pages
            .iter()
            .map(|p| {
                let (e, n) = compress_page(alg, p, &mut out);
                (e, out[..n].to_vec())
            })
            .collect();
        let mut page = [0u8; PAGE_SIZE];
        g.bench_function(BenchmarkId::new("decompress", name), |b| {
            b.iter(|| {
                for (e, c) in &compressed {
                    let _ = decompress_page(*e, c, &mut page);
                }
            })
        });
    }
    g.finish();
}

fn bench_batches(c: &mut Criterion) {
    let pages = corpus(10_000);
    let backends: [(&str, CpuCodec); 2] = [
        ("simd", CpuCodec::single(Algorithm::Lz4)),
        ("simd_parallel", CpuCodec::parallel(Algorithm::Lz4)),
    ];
    let mut g = c.benchmark_group("batch_lz4");
    for n in [1usize, 10, 100, 1000, 10_000] {
        let refs: Vec<&Page> = pages[..n].iter().map(|p| &**p).collect();
        g.throughput(Throughput::Bytes((n * PAGE_SIZE) as u64));
        for (name, codec) in &backends {
            let mut out = CompressedBatch::default();
            g.bench_with_input(
                BenchmarkId::new(format!("{name}_compress"), n),
                &n,
                |b, _| b.iter(|| codec.compress_batch(&refs, &mut out)),
            );
            let _ = codec.compress_batch(&refs, &mut out);
            let inputs: Vec<(Encoding, &[u8])> = (0..n).map(|i| out.page(i)).collect();
            let mut back = vec![[0u8; PAGE_SIZE]; n];
            let mut status = vec![Ok(()); n];
            g.bench_with_input(
                BenchmarkId::new(format!("{name}_decompress"), n),
                &n,
                |b, _| b.iter(|| codec.decompress_batch(&inputs, &mut back, &mut status)),
            );
        }
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(800))
        .sample_size(10)
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_classify, bench_checksum, bench_lz4_library, bench_page_codecs, bench_batches
}
criterion_main!(benches);
