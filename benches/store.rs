//! Store benchmarks: the write path (batched and per-page), the read path, one page at a
//! time with the flusher running, and a killed program's slots freed. Pages as in `benches/codec.rs` (`TRUENO_BENCH_CORPUS` or a
//! synthetic mix, same-filled pages included as they come).

#[path = "../tests/store_common/mod.rs"]
mod store_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use trueno_ublk::codec::{Algorithm, Page, PAGE_SIZE};
use trueno_ublk::store::BatchedPageStore;

const PAGES: usize = 4000;

fn corpus() -> Vec<u8> {
    if let Ok(path) = std::env::var("TRUENO_BENCH_CORPUS") {
        if let Ok(mut bytes) = std::fs::read(&path) {
            bytes.truncate(PAGES * PAGE_SIZE);
            if bytes.len() == PAGES * PAGE_SIZE {
                return bytes;
            }
        }
        eprintln!("TRUENO_BENCH_CORPUS={path} unreadable or short; using synthetic pages");
    }
    (0..PAGES as u64)
        .flat_map(|i| {
            let page = match i % 20 {
                0 => store_common::zero_page(),
                1 | 2 => store_common::text_page(i),
                3 => store_common::random_page(i),
                _ => store_common::mixed_page(i),
            };
            page.to_vec()
        })
        .collect()
}

fn store(algorithm: Algorithm, batched: bool) -> Arc<BatchedPageStore> {
    let mut c = trueno_ublk::config::StoreSettings::default()
        .store_config((PAGES * PAGE_SIZE) as u64, false);
    c.algorithm = algorithm;
    c.batched = batched;
    BatchedPageStore::new(c, None).expect("store")
}

/// Whole corpus written in 64 KiB requests then flushed: the bulk write path.
fn bench_write(c: &mut Criterion) {
    let data = corpus();
    let mut g = c.benchmark_group("store_write");
    g.throughput(Throughput::Bytes(data.len() as u64));
    for (name, alg, batched) in [
        ("lz4_batched", Algorithm::Lz4, true),
        ("lz4_per_page", Algorithm::Lz4, false),
        ("adaptive_batched", Algorithm::Adaptive, true),
    ] {
        let s = store(alg, batched);
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                for (i, chunk) in data.chunks(16 * PAGE_SIZE).enumerate() {
                    let _ = s.write((i * 16 * PAGE_SIZE) as u64, chunk);
                }
                let _ = s.flush_pending();
            })
        });
    }
    g.finish();
}

/// The corpus read back: in 64 KiB requests, and one 1000-page request.
fn bench_read(c: &mut Criterion) {
    let data = corpus();
    let mut g = c.benchmark_group("store_read");
    for (name, alg) in [("lz4", Algorithm::Lz4), ("adaptive", Algorithm::Adaptive)] {
        let s = store(alg, true);
        let _ = s.write(0, &data);
        let _ = s.flush_pending();
        let mut buf = vec![0u8; data.len()];
        g.throughput(Throughput::Bytes(data.len() as u64));
        g.bench_function(BenchmarkId::new("64k_requests", name), |b| {
            b.iter(|| {
                for (i, chunk) in buf.chunks_mut(16 * PAGE_SIZE).enumerate() {
                    let _ = s.read((i * 16 * PAGE_SIZE) as u64, chunk);
                }
            })
        });
        g.throughput(Throughput::Bytes((1000 * PAGE_SIZE) as u64));
        g.bench_function(BenchmarkId::new("1000_pages", name), |b| {
            b.iter(|| s.read(0, &mut buf[..1000 * PAGE_SIZE]))
        });
    }
    g.finish();
}

/// One page at a time with the flusher running, as a queue thread sees it.
fn bench_single_page(c: &mut Criterion) {
    let data = corpus();
    let s = store(Algorithm::Lz4, true);
    let _flusher = s.start_flusher(|_| {}).expect("flusher");
    let mut g = c.benchmark_group("store_single_page");
    g.throughput(Throughput::Bytes(PAGE_SIZE as u64));
    let mut i = 0usize;
    g.bench_function("write", |b| {
        b.iter(|| {
            i = (i + 1) % PAGES;
            let _ = s.write((i * PAGE_SIZE) as u64, &data[i * PAGE_SIZE..][..PAGE_SIZE]);
        })
    });
    let _ = s.flush_pending();
    let mut page = vec![0u8; PAGE_SIZE];
    g.bench_function("read_stored", |b| {
        b.iter(|| {
            i = (i + 7) % PAGES;
            let _ = s.read((i * PAGE_SIZE) as u64, &mut page);
        })
    });
    g.finish();
}

/// Pages of a killed stress-ng move-inv worker in the VM's near-OOM stage, about.
const KILLED_PAGES: usize = 17_000;

/// A killed program's incompressible pages (a one-page chunk each) freed as the slot-free
/// probe reports them, and their memory given back (the refill thread running, the VM's 4 MiB
/// reserve target): the run of frees alone is timed.
fn bench_slot_frees(c: &mut Criterion) {
    let pages: Vec<Box<Page>> = (0..KILLED_PAGES as u64)
        .map(store_common::random_page)
        .collect();
    let mut config = trueno_ublk::config::StoreSettings::default()
        .store_config((KILLED_PAGES * PAGE_SIZE) as u64, false);
    config.reserve_bytes = 4 << 20;
    let s = BatchedPageStore::new(config, None).expect("store");
    let _flusher = s.start_flusher(|_| {}).expect("flusher");
    let mut g = c.benchmark_group("store_slot_frees");
    g.throughput(Throughput::Bytes((KILLED_PAGES * PAGE_SIZE) as u64));
    g.bench_function("incompressible", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                for (i, page) in pages.iter().enumerate() {
                    let _ = s.write((i * PAGE_SIZE) as u64, &page[..]);
                }
                let _ = s.flush_pending();
                let started = Instant::now();
                let mut frees = s.swap_slot_frees();
                for i in 0..KILLED_PAGES as u64 {
                    frees.free(i, &|| true);
                }
                drop(frees);
                spent += started.elapsed();
            }
            spent
        })
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1))
        .sample_size(10)
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_write, bench_read, bench_single_page, bench_slot_frees
}
criterion_main!(benches);
