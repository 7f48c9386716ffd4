//! Round trips of every kind of page through every store mode, range errors, discard, and the
//! memory limit.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]

mod store_common;

use std::time::Duration;

use store_common::{page_of_kind, random_page, same_page, text_page};
use trueno_ublk::codec::{Algorithm, PAGE_SIZE};
use trueno_ublk::store::{BatchedPageStore, StoreConfig, StoreError};

const PAGE: u64 = PAGE_SIZE as u64;

fn configs(pages: u64) -> Vec<StoreConfig> {
    let mut out = Vec::new();
    for algorithm in [
        Algorithm::Lz4,
        Algorithm::Zstd { level: 3 },
        Algorithm::Adaptive,
    ] {
        for batched in [true, false] {
            let mut c =
                trueno_ublk::config::StoreSettings::default().store_config(pages * PAGE, false);
            c.algorithm = algorithm;
            c.batched = batched;
            c.batch_threshold = 64;
            c.flush_timeout = Duration::from_millis(1);
            out.push(c);
        }
    }
    out
}

#[test]
fn every_kind_round_trips_in_every_mode() {
    for config in configs(600) {
        let algorithm = config.algorithm;
        let label = format!("{algorithm:?} batched={}", config.batched);
        let store = BatchedPageStore::new(config, None).unwrap();
        let _flusher = store.start_flusher(|_| {}).unwrap();
        // 500 pages, kinds interleaved, written 16 pages per request.
        let pages: Vec<_> = (0..500u64).map(|i| page_of_kind(i, i)).collect();
        for (chunk_no, chunk) in pages.chunks(16).enumerate() {
            let buf: Vec<u8> = chunk.iter().flat_map(|p| p.iter().copied()).collect();
            store.write(chunk_no as u64 * 16 * PAGE, &buf).unwrap();
        }
        let check = |when: &str| {
            let mut buf = vec![0u8; 600 * PAGE_SIZE];
            store.read(0, &mut buf).unwrap();
            for (i, got) in buf.chunks_exact(PAGE_SIZE).enumerate() {
                let want: &[u8] = pages.get(i).map_or(&[0u8; PAGE_SIZE][..], |p| &p[..]);
                assert!(got == want, "{label}: page {i} differs {when}");
            }
        };
        check("before flush");
        store.flush_pending().unwrap();
        check("after flush");
        let s = store.stats();
        assert_eq!(s.orig_bytes, 500 * PAGE, "{label}");
        assert_eq!(s.same_pages, 200, "{label}");
        assert_eq!(s.zero_pages, 100, "{label}");
        assert_eq!(s.pages_stored, 300, "{label}");
        assert!(s.huge_pages >= 100, "{label}: random pages are huge");
        assert!(s.compr_bytes < 300 * PAGE, "{label}");
        assert!(s.mem_used >= s.compr_bytes, "{label}");
        assert_eq!(s.pending_pages, 0, "{label}");
        match algorithm {
            Algorithm::Lz4 => assert_eq!((s.pages_zstd, s.pages_lz4), (0, 200), "{label}"),
            Algorithm::Zstd { .. } => assert_eq!((s.pages_zstd, s.pages_lz4), (200, 0), "{label}"),
            Algorithm::Adaptive => assert_eq!(s.pages_zstd + s.pages_lz4, 200, "{label}"),
        }
    }
}

#[test]
fn same_filled_pages_whose_word_the_entry_cannot_hold_are_compressed() {
    let config = trueno_ublk::config::StoreSettings::default().store_config(8 * PAGE, false);
    let store = BatchedPageStore::new(config, None).unwrap();
    let words = [0x8000_0000_0000_0001u64, 0x1234_5678_9abc_def0, u64::MAX, 7];
    for (i, &word) in words.iter().enumerate() {
        store.write(i as u64 * PAGE, &same_page(word)[..]).unwrap();
    }
    store.flush_pending().unwrap();
    for (i, &word) in words.iter().enumerate() {
        let mut got = vec![0u8; PAGE_SIZE];
        store.read(i as u64 * PAGE, &mut got).unwrap();
        assert!(got[..] == same_page(word)[..], "word {word:#x}");
    }
    let s = store.stats();
    assert_eq!((s.same_pages, s.pages_stored), (2, 2));
}

#[test]
fn overwrite_and_discard_free_memory() {
    for config in configs(256) {
        let store = BatchedPageStore::new(config, None).unwrap();
        for i in 0..200u64 {
            store.write(i * PAGE, &text_page(i)[..]).unwrap();
        }
        store.flush_pending().unwrap();
        let full = store.stats().mem_used;
        assert!(full > 0);
        // Overwrite with the same data: memory stays the same size.
        for i in 0..200u64 {
            store.write(i * PAGE, &text_page(i)[..]).unwrap();
        }
        store.flush_pending().unwrap();
        let again = store.stats().mem_used;
        assert!(again <= full + full / 20, "{again} vs {full}");
        store.discard(0, 256 * PAGE).unwrap();
        let s = store.stats();
        assert_eq!((s.mem_used, s.orig_bytes, s.compr_bytes), (0, 0, 0));
        assert_eq!(s.discarded_pages, 200);
        let mut buf = vec![1u8; PAGE_SIZE];
        store.read(5 * PAGE, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
    }
}

#[test]
fn range_errors() {
    let store = BatchedPageStore::new(
        trueno_ublk::config::StoreSettings::default().store_config(16 * PAGE, false),
        None,
    )
    .unwrap();
    let page = text_page(1);
    let mut buf = vec![0u8; PAGE_SIZE];
    let e = store.write(16 * PAGE, &page[..]).unwrap_err();
    assert!(matches!(e, StoreError::OutOfRange { .. }));
    assert_eq!(e.errno(), -libc::EIO);
    assert!(matches!(
        store.write(15 * PAGE, &vec![0u8; 2 * PAGE_SIZE]),
        Err(StoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        store.read(u64::MAX - 4095, &mut buf),
        Err(StoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        store.discard(8 * PAGE, 9 * PAGE),
        Err(StoreError::OutOfRange { .. })
    ));
    let e = store.write(512, &page[..]).unwrap_err();
    assert!(matches!(e, StoreError::Misaligned { .. }));
    assert_eq!(e.errno(), -libc::EINVAL);
    assert!(matches!(
        store.write(0, &page[..100]),
        Err(StoreError::Misaligned { .. })
    ));
    assert!(matches!(
        store.read(0, &mut buf[..512]),
        Err(StoreError::Misaligned { .. })
    ));
    assert!(matches!(
        store.discard(0, 512),
        Err(StoreError::Misaligned { .. })
    ));
    let s = store.stats();
    assert_eq!((s.failed_writes, s.failed_reads), (6, 2));
    assert_eq!(s.orig_bytes, 0, "failed requests change nothing");
    // Zero-length requests inside the device are fine and do nothing.
    store.write(0, &[]).unwrap();
    store.read(16 * PAGE, &mut []).unwrap();
}

#[test]
fn bad_configs_are_refused() {
    assert!(BatchedPageStore::new(
        trueno_ublk::config::StoreSettings::default().store_config(0, false),
        None
    )
    .is_err());
    assert!(BatchedPageStore::new(
        trueno_ublk::config::StoreSettings::default().store_config(PAGE + 1, false),
        None
    )
    .is_err());
    let mut c = trueno_ublk::config::StoreSettings::default().store_config(PAGE, false);
    c.batch_threshold = 0;
    assert!(BatchedPageStore::new(c, None).is_err());
    let mut c = trueno_ublk::config::StoreSettings::default().store_config(PAGE, false);
    c.algorithm = Algorithm::Zstd { level: 1000 };
    assert!(matches!(
        BatchedPageStore::new(c, None),
        Err(StoreError::Config(_))
    ));
}

#[test]
fn mem_limit_gives_enospc_and_discard_recovers() {
    for batched in [true, false] {
        let mut c = trueno_ublk::config::StoreSettings::default().store_config(1024 * PAGE, false);
        c.batched = batched;
        c.batch_threshold = 16;
        c.mem_limit = Some(256 * 1024);
        let store = BatchedPageStore::new(c, None).unwrap();
        let _flusher = store.start_flusher(|_| {}).unwrap();
        let mut written = 0u64;
        let err = loop {
            match store.write(written * PAGE, &random_page(written)[..]) {
                Ok(()) => written += 1,
                Err(e) => break e,
            }
            assert!(written < 1024, "limit never reached");
        };
        assert!(matches!(err, StoreError::NoSpace { limit: 262_144 }));
        assert_eq!(err.errno(), -libc::ENOSPC);
        // Random pages are stored raw: the limit admits at most 64 of them.
        assert!(
            (48..=64).contains(&written),
            "batched={batched}: {written} pages admitted"
        );
        // Same-filled pages need no memory and still succeed.
        store.write(1000 * PAGE, &[0u8; PAGE_SIZE]).unwrap();
        store.flush_pending().unwrap();
        let s = store.stats();
        assert!(s.mem_used <= 256 * 1024 + 8 * PAGE, "{} used", s.mem_used);
        assert!(s.mem_limit_hits >= 1);
        // Every admitted page is still there.
        let mut buf = vec![0u8; PAGE_SIZE];
        for i in 0..written {
            store.read(i * PAGE, &mut buf).unwrap();
            assert_eq!(&buf[..], &random_page(i)[..]);
        }
        store.discard(0, written * PAGE).unwrap();
        store.write(0, &random_page(7)[..]).unwrap();
    }
}

#[test]
fn shutdown_flushes_and_store_keeps_working() {
    let mut c = trueno_ublk::config::StoreSettings::default().store_config(64 * PAGE, false);
    c.flush_timeout = Duration::from_secs(3600);
    c.batch_threshold = 8;
    let store = BatchedPageStore::new(c, None).unwrap();
    let flusher = store.start_flusher(|_| {}).unwrap();
    assert!(
        store.start_flusher(|_| {}).is_err(),
        "one flusher per store"
    );
    for i in 0..5u64 {
        store.write(i * PAGE, &text_page(i)[..]).unwrap();
    }
    store.shutdown();
    drop(flusher);
    assert_eq!(store.stats().pending_pages, 0);
    // Without a flusher, a full batch is flushed by the writer that finds it full.
    for i in 0..40u64 {
        store.write(i * PAGE, &text_page(100 + i)[..]).unwrap();
    }
    assert!(store.stats().pending_pages <= 8);
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..40u64 {
        store.read(i * PAGE, &mut buf).unwrap();
        assert_eq!(&buf[..], &text_page(100 + i)[..]);
    }
}

#[test]
fn memory_stays_put_when_everything_is_overwritten_in_random_order() {
    const PAGES: u64 = 6000;
    let mut c = trueno_ublk::config::StoreSettings::default().store_config(PAGES * PAGE, false);
    c.batch_threshold = 500;
    let store = BatchedPageStore::new(c, None).unwrap();
    let content = |seed: u64| match seed % 10 {
        0 => text_page(seed),
        1 => random_page(seed),
        _ => store_common::mixed_page(seed),
    };
    for i in 0..PAGES {
        store.write(i * PAGE, &content(i)[..]).unwrap();
    }
    store.flush_pending().unwrap();
    let first = store.stats().mem_used;
    // Three rounds: every page gets another page's content, pages visited in random order.
    let mut rng = store_common::Rng(12345);
    let mut holds: Vec<u64> = (0..PAGES).collect();
    for _ in 0..3 {
        let mut order: Vec<u64> = (0..PAGES).collect();
        let mut sources: Vec<u64> = (0..PAGES).collect();
        for v in [&mut order, &mut sources] {
            for i in (1..v.len()).rev() {
                v.swap(i, (rng.next() % (i as u64 + 1)) as usize);
            }
        }
        for &i in &order {
            let src = sources[i as usize];
            holds[i as usize] = src;
            store.write(i * PAGE, &content(src)[..]).unwrap();
        }
        store.flush_pending().unwrap();
        let now = store.stats().mem_used;
        assert!(
            now <= first + first / 20,
            "memory grew from {first} to {now} bytes after overwrites"
        );
    }
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..PAGES {
        store.read(i * PAGE, &mut buf).unwrap();
        assert!(buf[..] == content(holds[i as usize])[..], "page {i}");
    }
}
