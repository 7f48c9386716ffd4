//! The spec's G.101-G.106: batch threshold, flush timer, read-before-flush, backend per batch
//! size, zero-page fast path.

mod store_common;

use std::sync::Arc;
use std::time::Duration;

use store_common::{mixed_page, partly_random_page, text_page, wait_until, zero_page, FakeGpu};
use trueno_ublk::codec::{BatchCodec, PAGE_SIZE};
use trueno_ublk::store::{BatchedPageStore, StoreConfig, StoreThread};

const PAGE: u64 = PAGE_SIZE as u64;

/// LZ4, the one algorithm the GPU codec takes.
fn config(pages: u64, threshold: usize, timeout: Duration) -> StoreConfig {
    let mut c = trueno_ublk::config::StoreSettings::default().store_config(pages * PAGE, false);
    c.algorithm = trueno_ublk::codec::Algorithm::Lz4;
    c.batch_threshold = threshold;
    c.flush_timeout = timeout;
    c
}

#[test]
fn g101_threshold_triggers_flush() {
    let gpu = Arc::new(FakeGpu::working());
    let store = BatchedPageStore::new(
        config(4096, 1000, Duration::from_secs(3600)),
        Some(gpu.clone() as Arc<dyn BatchCodec>),
    )
    .unwrap();
    let _flusher = store.start_flusher(|_| {}).unwrap();
    for i in 0..999u64 {
        store.write(i * PAGE, &mixed_page(i)[..]).unwrap();
    }
    // Give a wrongly eager flusher time to act before checking it did not.
    std::thread::sleep(Duration::from_millis(50));
    let s = store.stats();
    assert_eq!(s.pending_pages, 999);
    assert_eq!(s.batch_flushes, 0);
    assert_eq!(s.pages_stored, 0);
    store.write(999 * PAGE, &mixed_page(999)[..]).unwrap();
    assert!(wait_until(30, || store.stats().pages_stored == 1000));
    let s = store.stats();
    assert_eq!(s.batch_flushes, 1);
    assert_eq!(s.pending_pages, 0);
    assert_eq!(s.pages_gpu, 1000, "a 1000-page batch goes to the GPU");
    assert_eq!(gpu.batches.load(std::sync::atomic::Ordering::Relaxed), 1);
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..1000u64 {
        store.read(i * PAGE, &mut buf).unwrap();
        assert_eq!(&buf[..], &mixed_page(i)[..], "page {i}");
    }
}

#[test]
fn g102_flush_timer_flushes_partial_batch() {
    let store = BatchedPageStore::new(config(1024, 1000, Duration::from_millis(10)), None).unwrap();
    let _flusher = store.start_flusher(|_| {}).unwrap();
    for i in 0..500u64 {
        store.write(i * PAGE, &text_page(i)[..]).unwrap();
    }
    assert!(wait_until(30, || store.stats().pending_pages == 0));
    let s = store.stats();
    assert_eq!(s.pages_stored, 500);
    assert!(s.batch_flushes >= 1);
    assert_eq!(s.pages_simd + s.pages_simd_parallel, 500);
}

#[test]
fn g103_read_before_flush_returns_pending_data() {
    let store = BatchedPageStore::new(config(1024, 1000, Duration::from_secs(3600)), None).unwrap();
    let _flusher = store.start_flusher(|_| {}).unwrap();
    for i in 0..100u64 {
        store.write(i * PAGE, &text_page(i)[..]).unwrap();
    }
    let mut buf = vec![0u8; 100 * PAGE_SIZE];
    store.read(0, &mut buf).unwrap();
    assert_eq!(store.stats().pending_pages, 100, "still pending while read");
    for (i, page) in buf.chunks_exact(PAGE_SIZE).enumerate() {
        assert_eq!(page, &text_page(i as u64)[..], "page {i}");
    }
    // An overwrite of a pending page is seen at once too.
    store.write(7 * PAGE, &mixed_page(77)[..]).unwrap();
    let mut one = vec![0u8; PAGE_SIZE];
    store.read(7 * PAGE, &mut one).unwrap();
    assert_eq!(&one[..], &mixed_page(77)[..]);
}

/// Writes `n` pages then flushes them as one batch; returns the stats after.
fn flush_batch_of(store: &BatchedPageStore, first: u64, n: u64) {
    for i in first..first + n {
        store.write(i * PAGE, &mixed_page(i)[..]).unwrap();
    }
    store.flush_pending().unwrap();
}

#[test]
fn g105_backend_follows_batch_size() {
    let gpu = Arc::new(FakeGpu::working());
    let store = BatchedPageStore::new(
        config(8192, 4000, Duration::from_secs(3600)),
        Some(gpu.clone() as Arc<dyn BatchCodec>),
    )
    .unwrap();
    flush_batch_of(&store, 0, 50);
    let s = store.stats();
    assert_eq!(
        (s.pages_simd, s.pages_simd_parallel, s.pages_gpu),
        (50, 0, 0)
    );
    flush_batch_of(&store, 50, 500);
    let s = store.stats();
    assert_eq!(
        (s.pages_simd, s.pages_simd_parallel, s.pages_gpu),
        (50, 500, 0)
    );
    flush_batch_of(&store, 550, 2000);
    let s = store.stats();
    assert_eq!(
        (s.pages_simd, s.pages_simd_parallel, s.pages_gpu),
        (50, 500, 2000)
    );
    assert_eq!(s.batch_flushes, 3);
    assert_eq!(s.gpu_fallback_batches, 0);
    let mut buf = vec![0u8; 2550 * PAGE_SIZE];
    store.read(0, &mut buf).unwrap();
    for (i, page) in buf.chunks_exact(PAGE_SIZE).enumerate() {
        assert_eq!(page, &mixed_page(i as u64)[..], "page {i}");
    }
}

#[test]
fn g105_without_gpu_large_batches_use_all_cores() {
    let store = BatchedPageStore::new(config(4096, 4000, Duration::from_secs(3600)), None).unwrap();
    flush_batch_of(&store, 0, 2000);
    let s = store.stats();
    assert_eq!(
        (s.pages_simd, s.pages_simd_parallel, s.pages_gpu),
        (0, 2000, 0)
    );
}

#[test]
fn g105_failing_gpu_falls_back_to_cpu_without_losing_pages() {
    for gpu in [FakeGpu::failing(), FakeGpu::malformed()] {
        let gpu = Arc::new(gpu);
        let store = BatchedPageStore::new(
            config(4096, 4000, Duration::from_secs(3600)),
            Some(gpu.clone() as Arc<dyn BatchCodec>),
        )
        .unwrap();
        flush_batch_of(&store, 0, 1500);
        let s = store.stats();
        assert_eq!(gpu.batches.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(s.gpu_fallback_batches, 1);
        assert_eq!((s.pages_simd_parallel, s.pages_gpu), (1500, 0));
        assert_eq!(s.pages_stored, 1500);
        let mut buf = vec![0u8; PAGE_SIZE];
        for i in 0..1500u64 {
            store.read(i * PAGE, &mut buf).unwrap();
            assert_eq!(&buf[..], &mixed_page(i)[..], "page {i}");
        }
    }
}

#[test]
fn forced_backend_overrides_selection() {
    let mut c = config(1024, 1000, Duration::from_secs(3600));
    c.forced_backend = Some(trueno_ublk::codec::Backend::Simd);
    let store = BatchedPageStore::new(c, None).unwrap();
    flush_batch_of(&store, 0, 600);
    assert_eq!(store.stats().pages_simd, 600);
    let mut c = config(1024, 1000, Duration::from_secs(3600));
    c.forced_backend = Some(trueno_ublk::codec::Backend::Gpu);
    let err = BatchedPageStore::new(c, None)
        .err()
        .expect("gpu without a GPU is refused");
    assert!(err.to_string().contains("no GPU"), "{err}");
}

#[test]
fn g106_zero_pages_bypass_the_batch() {
    let store = BatchedPageStore::new(config(4096, 1500, Duration::from_secs(3600)), None).unwrap();
    let _flusher = store.start_flusher(|_| {}).unwrap();
    for i in 0..1000u64 {
        store.write(i * PAGE, &zero_page()[..]).unwrap();
    }
    let s = store.stats();
    assert_eq!(s.pending_pages, 0, "zero pages never enter the batch");
    assert_eq!((s.zero_pages, s.same_pages), (1000, 1000));
    assert_eq!(s.orig_bytes, 1000 * PAGE);
    assert_eq!(s.mem_used, 0);
    for i in 1000..2000u64 {
        store.write(i * PAGE, &text_page(i)[..]).unwrap();
    }
    let s = store.stats();
    assert_eq!(s.pending_pages, 1000, "data pages use the batch");
    store.flush_pending().unwrap();
    let s = store.stats();
    assert_eq!(
        (s.pending_pages, s.pages_stored, s.zero_pages),
        (0, 1000, 1000)
    );
    assert_eq!(s.pages_simd + s.pages_simd_parallel, 1000);
}

#[test]
fn thread_init_runs_on_the_flusher_refill_and_recompress_threads_and_names_them() {
    let mut c = config(16, 8, Duration::from_millis(1));
    c.reserve_bytes = 1 << 20;
    c.algorithm = trueno_ublk::codec::Algorithm::Lz4;
    c.recompress = Some(trueno_ublk::store::RecompressConfig {
        algorithm: trueno_ublk::codec::Algorithm::Zstd { level: 3 },
        idle: Duration::from_secs(30),
        min_saving_divisor: 8,
        cpu_percent: 50,
    });
    let store = BatchedPageStore::new(c, None).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let flusher = store
        .start_flusher(move |role| {
            let _ = tx.send((role, std::thread::current().name().map(str::to_owned)));
        })
        .unwrap();
    let mut seen = [0, 1, 2].map(|_| rx.recv_timeout(Duration::from_secs(30)).unwrap());
    let order = [
        StoreThread::Flusher,
        StoreThread::Refill,
        StoreThread::Recompress,
    ];
    seen.sort_by_key(|(role, _)| order.iter().position(|r| r == role));
    assert_eq!(
        seen,
        [
            (StoreThread::Flusher, Some("trueno-flusher".to_string())),
            (StoreThread::Refill, Some("trueno-reserve".to_string())),
            (
                StoreThread::Recompress,
                Some("trueno-recompress".to_string())
            ),
        ]
    );
    drop(flusher);
}

#[test]
fn huge_pages_are_stored_raw_whichever_backend_compressed() {
    let gpu = Arc::new(FakeGpu::without_huge_rule());
    let store = BatchedPageStore::new(
        config(2048, 2000, Duration::from_secs(3600)),
        Some(gpu as Arc<dyn BatchCodec>),
    )
    .unwrap();
    // LZ4 leaves these at about 3700 bytes: above the huge threshold, below a page.
    for i in 0..1000u64 {
        store
            .write(i * PAGE, &partly_random_page(i, 3700)[..])
            .unwrap();
    }
    store.flush_pending().unwrap();
    let s = store.stats();
    assert_eq!(s.pages_gpu, 1000);
    assert_eq!((s.huge_pages, s.pages_lz4), (1000, 0));
    assert_eq!(s.compr_bytes, 1000 * PAGE);
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..1000u64 {
        store.read(i * PAGE, &mut buf).unwrap();
        assert_eq!(&buf[..], &partly_random_page(i, 3700)[..], "page {i}");
    }
}
