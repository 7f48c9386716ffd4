//! Property test: random writes, overwrites, reads and discards from several threads, racing
//! with the flusher, checked against a reference model with zero mismatches.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]

mod store_common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use store_common::page_of_kind;
use trueno_ublk::codec::{Algorithm, PAGE_SIZE};
use trueno_ublk::store::BatchedPageStore;

const PAGE: u64 = PAGE_SIZE as u64;
const THREADS: usize = 3;
/// Pages each thread owns (threads own disjoint pages so each has an exact model, while they
/// still share batches, allocator classes and the flusher).
const PAGES_PER_THREAD: u64 = 24;

#[derive(Clone, Debug)]
enum Op {
    Write {
        page: u64,
        pages: u64,
        kind: u64,
        seed: u64,
    },
    Read {
        page: u64,
        pages: u64,
    },
    Discard {
        page: u64,
        pages: u64,
    },
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    let start = 0..PAGES_PER_THREAD;
    prop_oneof![
        5 => (start.clone(), 1..4u64, 0..5u64, any::<u64>())
            .prop_map(|(page, pages, kind, seed)| Op::Write { page, pages, kind, seed }),
        4 => (start.clone(), 1..6u64).prop_map(|(page, pages)| Op::Read { page, pages }),
        1 => (start, 1..8u64).prop_map(|(page, pages)| Op::Discard { page, pages }),
        1 => Just(Op::Flush),
    ]
}

/// Expected contents of one page: `None` = zeros.
type Model = Vec<Option<(u64, u64)>>;

fn expected(model: &Model, i: u64) -> Box<[u8; PAGE_SIZE]> {
    match model[i as usize] {
        Some((kind, seed)) => page_of_kind(kind, seed),
        None => Box::new([0; PAGE_SIZE]),
    }
}

fn run_thread(store: &BatchedPageStore, t: usize, ops: &[Op]) -> Result<Model, String> {
    let base = t as u64 * PAGES_PER_THREAD;
    let mut model: Model = vec![None; PAGES_PER_THREAD as usize];
    for (n, op) in ops.iter().enumerate() {
        match *op {
            Op::Write {
                page,
                pages,
                kind,
                seed,
            } => {
                let pages = pages.min(PAGES_PER_THREAD - page);
                let mut buf = Vec::with_capacity(pages as usize * PAGE_SIZE);
                for i in 0..pages {
                    let seed = seed.wrapping_add(i);
                    buf.extend_from_slice(&page_of_kind(kind + i, seed)[..]);
                    model[(page + i) as usize] = Some((kind + i, seed));
                }
                store
                    .write((base + page) * PAGE, &buf)
                    .map_err(|e| e.to_string())?;
            }
            Op::Read { page, pages } => {
                let pages = pages.min(PAGES_PER_THREAD - page);
                let mut buf = vec![0u8; pages as usize * PAGE_SIZE];
                store
                    .read((base + page) * PAGE, &mut buf)
                    .map_err(|e| e.to_string())?;
                for (i, got) in buf.chunks_exact(PAGE_SIZE).enumerate() {
                    if got != &expected(&model, page + i as u64)[..] {
                        return Err(format!(
                            "thread {t} op {n}: page {} differs",
                            page + i as u64
                        ));
                    }
                }
            }
            Op::Discard { page, pages } => {
                let pages = pages.min(PAGES_PER_THREAD - page);
                store
                    .discard((base + page) * PAGE, pages * PAGE)
                    .map_err(|e| e.to_string())?;
                for i in page..page + pages {
                    model[i as usize] = None;
                }
            }
            Op::Flush => store.flush_pending().map_err(|e| e.to_string())?,
        }
    }
    Ok(model)
}

fn check_all(store: &BatchedPageStore, models: &[Model]) -> Result<(), String> {
    let mut buf = vec![0u8; PAGE_SIZE];
    for (t, model) in models.iter().enumerate() {
        for i in 0..PAGES_PER_THREAD {
            store
                .read((t as u64 * PAGES_PER_THREAD + i) * PAGE, &mut buf)
                .map_err(|e| e.to_string())?;
            if buf[..] != expected(model, i)[..] {
                return Err(format!("final check: thread {t} page {i} differs"));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn concurrent_ops_match_the_model(
        threads in proptest::collection::vec(proptest::collection::vec(op(), 1..150), THREADS),
        threshold in 1usize..40,
        timeout_us in 0u64..3000,
        algorithm in prop_oneof![Just(Algorithm::Lz4), Just(Algorithm::Zstd { level: 1 }), Just(Algorithm::Adaptive)],
        batched in prop::bool::weighted(0.85),
        flip_memory_short in prop::bool::weighted(0.5),
    ) {
        let mut c = trueno_ublk::config::StoreSettings::default().store_config(THREADS as u64 * PAGES_PER_THREAD * PAGE, false);
        c.batch_threshold = threshold;
        c.flush_timeout = Duration::from_micros(timeout_us);
        c.algorithm = algorithm;
        c.batched = batched;
        // Small batches use all cores too, so the rayon path races as well.
        c.thresholds.parallel_min_pages = 8;
        let store = BatchedPageStore::new(c, None).unwrap();
        let flusher = store.start_flusher(|_| {}).unwrap();
        let done = AtomicBool::new(false);
        let results: Vec<Result<Model, String>> = std::thread::scope(|s| {
            if flip_memory_short {
                // Memory running short and coming back while pages are written and flushed:
                // an LZ4 store's new pages switch between LZ4 and zstd mid-batch.
                let (store, done) = (&store, &done);
                s.spawn(move || {
                    let mut short = false;
                    while !done.load(Ordering::Acquire) {
                        short = !short;
                        store.set_memory_short(short);
                        std::thread::sleep(Duration::from_micros(50));
                    }
                });
            }
            let handles: Vec<_> = threads
                .iter()
                .enumerate()
                .map(|(t, ops)| {
                    let store = &store;
                    s.spawn(move || run_thread(store, t, ops))
                })
                .collect();
            let results = handles.into_iter().map(|h| h.join().unwrap()).collect();
            done.store(true, Ordering::Release);
            results
        });
        let models: Vec<Model> = results.into_iter().collect::<Result<_, _>>().map_err(TestCaseError::fail)?;
        check_all(&store, &models).map_err(TestCaseError::fail)?;
        store.flush_pending().unwrap();
        check_all(&store, &models).map_err(TestCaseError::fail)?;
        drop(flusher);
        let s = store.stats();
        let held = models.iter().flatten().filter(|p| p.is_some()).count() as u64;
        prop_assert_eq!(s.orig_bytes, held * PAGE);
        prop_assert_eq!(s.pending_pages, 0);
        prop_assert_eq!(s.pages_stored + s.same_pages, held);
        prop_assert_eq!(s.failed_reads + s.failed_writes, 0);
        // Everything freed once every page is discarded.
        store.discard(0, store.size_bytes()).unwrap();
        let s = store.stats();
        prop_assert_eq!((s.mem_used, s.orig_bytes, s.compr_bytes), (0, 0, 0));
    }
}

/// Four threads each overwriting two pages of eight over and over, and reading every page,
/// while a one-page batch flushes constantly: each write reads back at once, each page
/// reads as its writer's last write after they stop, and no memory leaks.
#[test]
fn same_pages_overwritten_while_flushing() {
    let mut c = trueno_ublk::config::StoreSettings::default().store_config(8 * PAGE, false);
    c.batch_threshold = 1;
    c.flush_timeout = Duration::from_micros(1);
    let store = BatchedPageStore::new(c, None).unwrap();
    let flusher = store.start_flusher(|_| {}).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let store = &store;
            s.spawn(move || {
                let mut buf = vec![0u8; PAGE_SIZE];
                for n in 0..2000u64 {
                    let page = n % 8;
                    // Each thread writes its own pages 2t, 2t+1 with a seed it can check.
                    if page / 2 == t {
                        store
                            .write(page * PAGE, &page_of_kind(2 + n % 3, n)[..])
                            .unwrap();
                        store.read(page * PAGE, &mut buf).unwrap();
                        assert!(
                            buf[..] == page_of_kind(2 + n % 3, n)[..],
                            "thread {t} n {n}"
                        );
                    } else {
                        store.read(page * PAGE, &mut buf).unwrap();
                    }
                }
            });
        }
    });
    drop(flusher);
    let s = store.stats();
    assert_eq!(s.pending_pages, 0);
    let mut buf = vec![0u8; PAGE_SIZE];
    for page in 0..8u64 {
        // The last n below 2000 with n % 8 == page.
        let n = 1992 + page;
        store.read(page * PAGE, &mut buf).unwrap();
        assert!(
            buf[..] == page_of_kind(2 + n % 3, n)[..],
            "page {page}: not its last write"
        );
    }
    store.discard(0, 8 * PAGE).unwrap();
    assert_eq!(store.stats().mem_used, 0);
}

/// Writers racing into a memory limit with the flusher running: every write either succeeds
/// or fails with ENOSPC, successful pages read back, and once everything is discarded nothing
/// is left reserved (a leaked reservation would make the next writes fail).
#[test]
fn writers_racing_into_the_memory_limit() {
    let mut c = trueno_ublk::config::StoreSettings::default().store_config(4 * 256 * PAGE, false);
    c.batch_threshold = 16;
    c.flush_timeout = Duration::from_micros(200);
    c.mem_limit = Some(96 * PAGE);
    let store = BatchedPageStore::new(c, None).unwrap();
    let _flusher = store.start_flusher(|_| {}).unwrap();
    for round in 0..3u64 {
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let store = &store;
                s.spawn(move || {
                    let mut buf = vec![0u8; PAGE_SIZE];
                    for i in 0..256u64 {
                        let page = t * 256 + i;
                        let content = page_of_kind(3, page + round); // random: stored raw
                        match store.write(page * PAGE, &content[..]) {
                            Ok(()) => {
                                store.read(page * PAGE, &mut buf).unwrap();
                                assert!(buf[..] == content[..], "page {page}");
                            }
                            Err(e) => assert_eq!(e.errno(), -libc::ENOSPC),
                        }
                    }
                });
            }
        });
        store.flush_pending().unwrap();
        let s = store.stats();
        assert!(s.mem_limit_hits > 0, "round {round}: the limit was reached");
        assert!(
            s.mem_used <= 96 * PAGE + 8 * PAGE,
            "round {round}: {} bytes used",
            s.mem_used
        );
        store.discard(0, store.size_bytes()).unwrap();
        let s = store.stats();
        assert_eq!(
            (s.mem_used, s.pending_pages, s.orig_bytes),
            (0, 0, 0),
            "round {round}"
        );
    }
    // Nothing leaked: the full limit is available again.
    for page in 0..90u64 {
        store
            .write(page * PAGE, &page_of_kind(3, page)[..])
            .unwrap();
    }
}
