//! Unit tests that need the store's insides: corruption of stored bytes, allocator overhead.

#![forbid(unsafe_code)]
#![allow(
    clippy::cast_possible_truncation,
    reason = "test data: small, known values"
)]

use super::recompress;
use super::*;

/// Compressible, but not same-filled: a short random phrase repeated with variations.
fn text(seed: u64) -> Box<Page> {
    let mut p = Box::new([0u8; PAGE_SIZE]);
    let mut x = seed | 1;
    let mut next = || {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 56) as u8
    };
    let phrase: Vec<u8> = (0..61).map(|_| b'a' + next() % 26).collect();
    for (i, b) in p.iter_mut().enumerate() {
        *b = if i % 97 == 0 {
            next()
        } else {
            phrase[i % phrase.len()]
        };
    }
    p
}

fn store(config: StoreConfig) -> Arc<BatchedPageStore> {
    BatchedPageStore::new(config, None).unwrap()
}

/// Read page `i` of `s` back for each `i` of `pages`, and check that it holds `content(i)`
/// (`what`: the caller's context for a failure's message, the round say).
#[track_caller]
fn assert_pages_read_back(
    s: &BatchedPageStore,
    pages: impl IntoIterator<Item = u64>,
    content: impl Fn(u64) -> Box<Page>,
    what: &str,
) {
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in pages {
        s.read(i * PAGE_SIZE as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &content(i)[..], "{what} page {i}");
    }
}

/// Write `content(i)` at page `i` of `s` for each `i` of `pages`, then flush what is pending.
fn write_pages_and_flush(
    s: &BatchedPageStore,
    pages: std::ops::Range<u64>,
    content: impl Fn(u64) -> Box<Page>,
) {
    for i in pages {
        s.write(i * PAGE_SIZE as u64, &content(i)[..]).unwrap();
    }
    s.flush_pending().unwrap();
}

#[test]
fn corrupt_stored_page_fails_only_its_read() {
    for algorithm in [Algorithm::Lz4, Algorithm::Zstd { level: 3 }] {
        let mut c =
            crate::config::StoreSettings::default().store_config(64 * PAGE_SIZE as u64, false);
        c.algorithm = algorithm;
        let s = store(c);
        write_pages_and_flush(&s, 0..8u64, text);
        assert!(s.corrupt_stored_page(3, 0xff));
        let mut buf = vec![0u8; PAGE_SIZE];
        let err = s.read(3 * PAGE_SIZE as u64, &mut buf).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { page: 3, .. }), "{err}");
        assert_eq!(err.errno(), -libc::EIO);
        assert_eq!(s.stats().failed_reads, 1);
        assert_pages_read_back(&s, (0..8u64).filter(|&i| i != 3), text, "");
        // Overwriting the corrupt page heals it.
        s.write(3 * PAGE_SIZE as u64, &text(33)[..]).unwrap();
        s.read(3 * PAGE_SIZE as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &text(33)[..]);
    }
}

/// A read of many pages (a swap-in merged with its neighbours') that meets bad ones names the
/// first, and has read every page before it, in order or in parallel.
#[test]
fn a_read_of_many_pages_fails_at_its_first_bad_page_having_read_those_before() {
    let pages = 2 * PARALLEL_READ_MIN_PAGES as u64;
    let s = store(
        crate::config::StoreSettings::default().store_config(pages * PAGE_SIZE as u64, false),
    );
    write_pages_and_flush(&s, 0..pages, text);
    for bad in [pages - 3, 300, 5] {
        assert!(s.corrupt_stored_page(bad, 0xff));
    }
    // Eight pages from page 2: page 5 is the first bad one.
    let mut buf = vec![0u8; 8 * PAGE_SIZE];
    let err = s.read(2 * PAGE_SIZE as u64, &mut buf).unwrap_err();
    assert_eq!(err.bad_page(), Some(5), "{err}");
    for (i, page) in buf.chunks_exact(PAGE_SIZE).take(3).enumerate() {
        assert_eq!(page, &text(2 + i as u64)[..], "page {}", 2 + i);
    }
    // Every page, read in parallel: page 5 still, not whichever a thread met first.
    let mut buf = vec![0u8; pages as usize * PAGE_SIZE];
    for _ in 0..8 {
        let err = s.read(0, &mut buf).unwrap_err();
        assert_eq!(err.bad_page(), Some(5), "{err}");
    }
    // A failure that is not a page's own names none: nothing is taken as read.
    let err = s
        .read(pages * PAGE_SIZE as u64, &mut buf[..PAGE_SIZE])
        .unwrap_err();
    assert_eq!(err.bad_page(), None, "{err}");
}

#[test]
fn pending_page_overwritten_during_flush_keeps_newest() {
    // Entries that changed after their slot was written are not installed.
    let s =
        store(crate::config::StoreSettings::default().store_config(16 * PAGE_SIZE as u64, false));
    s.write(0, &text(1)[..]).unwrap();
    s.write(0, &text(2)[..]).unwrap();
    s.write(PAGE_SIZE as u64, &text(3)[..]).unwrap();
    s.discard(PAGE_SIZE as u64, PAGE_SIZE as u64).unwrap();
    s.flush_pending().unwrap();
    let st = s.stats();
    assert_eq!(
        (st.pages_stored, st.pending_pages, st.discarded_pages),
        (1, 0, 1)
    );
    let mut buf = vec![0u8; 2 * PAGE_SIZE];
    s.read(0, &mut buf).unwrap();
    assert_eq!(&buf[..PAGE_SIZE], &text(2)[..]);
    assert!(buf[PAGE_SIZE..].iter().all(|&b| b == 0));
    assert_eq!(s.reserved_bytes.load(Ordering::Relaxed), 0);
}

#[test]
fn a_flush_takes_no_memory_for_pages_freed_while_pending() {
    // Near OOM a killed program's pages are freed (slot frees, discards) while still pending:
    // the flush neither compresses them nor takes memory to store them.
    let s =
        store(crate::config::StoreSettings::default().store_config(64 * PAGE_SIZE as u64, false));
    for i in 0..32u64 {
        s.write(i * PAGE_SIZE as u64, &text(i)[..]).unwrap();
    }
    s.discard(0, 32 * PAGE_SIZE as u64).unwrap();
    let commits = s.alloc.reserve.commits();
    s.flush_pending().unwrap();
    assert_eq!(
        s.alloc.reserve.commits(),
        commits,
        "memory taken for freed pages"
    );
    let st = s.stats();
    assert_eq!((st.pages_stored, st.pending_pages), (0, 0));
    assert_eq!(s.reserved_bytes.load(Ordering::Relaxed), 0);
    // A page written after them is flushed as ever.
    s.write(0, &text(40)[..]).unwrap();
    s.flush_pending().unwrap();
    let mut buf = vec![0u8; PAGE_SIZE];
    s.read(0, &mut buf).unwrap();
    assert_eq!(&buf[..], &text(40)[..]);
}

/// A batch codec that panics after `calls_before` calls (a codec bug, or a GPU library that
/// panics).
struct PanickingCodec {
    calls: std::sync::atomic::AtomicUsize,
    calls_before: usize,
}

impl BatchCodec for PanickingCodec {
    fn compress_batch(
        &self,
        pages: &[&Page],
        out: &mut CompressedBatch,
    ) -> Result<(), crate::codec::CodecError> {
        if self.calls.fetch_add(1, Ordering::Relaxed) >= self.calls_before {
            panic!("codec bug (test)");
        }
        crate::codec::CpuCodec::single(Algorithm::Lz4).compress_batch(pages, out)
    }

    fn decompress_batch(
        &self,
        inputs: &[(crate::codec::Encoding, &[u8])],
        out: &mut [Page],
        status: &mut [Result<(), crate::codec::CodecError>],
    ) {
        crate::codec::CpuCodec::single(Algorithm::Lz4).decompress_batch(inputs, out, status);
    }
}

/// A store of room for four batches of `pages` pages, whose batch codec (taken for a GPU)
/// panics after `calls_before` calls.
fn store_with_panicking_codec(pages: usize, calls_before: usize) -> Arc<BatchedPageStore> {
    let mut c =
        crate::config::StoreSettings::default().store_config(4 * (pages * PAGE_SIZE) as u64, false);
    c.algorithm = Algorithm::Lz4;
    c.batch_threshold = pages;
    c.forced_backend = Some(Backend::Gpu);
    let codec = Arc::new(PanickingCodec {
        calls: std::sync::atomic::AtomicUsize::new(0),
        calls_before,
    });
    BatchedPageStore::new(c, Some(codec as Arc<dyn BatchCodec>)).unwrap()
}

#[test]
fn a_panicking_codec_loses_no_page_and_the_batch_is_reused_safely() {
    const PAGES: usize = 64;
    let pages = PAGES as u64;
    let s = store_with_panicking_codec(PAGES, 1);
    // Four batches: the first compresses, the others panic in the codec; batches are reused.
    for round in 0..4u64 {
        for i in 0..pages {
            let index = round * pages + i;
            s.write(index * PAGE_SIZE as u64, &text(index)[..]).unwrap();
        }
        s.flush_pending().unwrap();
    }
    let st = s.stats();
    assert_eq!((st.pending_pages, st.pages_stored), (0, 4 * pages));
    assert_eq!(
        st.huge_pages,
        3 * pages,
        "pages of panicked flushes are stored raw"
    );
    let mut buf = vec![0u8; PAGE_SIZE];
    for index in 0..4 * pages {
        s.read(index * PAGE_SIZE as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &text(index)[..], "page {index}");
    }
    assert_eq!(s.reserved_bytes.load(Ordering::Relaxed), 0);
}

#[test]
fn a_page_whose_raw_install_panics_too_is_lost_not_read_from_the_reused_batch() {
    const PAGES: usize = 16;
    let pages = PAGES as u64;
    let s = store_with_panicking_codec(PAGES, 0);
    // The codec panics, and so does storing the first page raw: it is lost, the rest stored.
    s.install_panics.store(1, Ordering::Release);
    write_pages_and_flush(&s, 0..pages, text);
    // The batches are reused by other pages: the lost page reads none of them.
    for round in 1..4u64 {
        for i in 0..pages {
            let index = round * pages + i;
            s.write(index * PAGE_SIZE as u64, &text(index)[..]).unwrap();
        }
        s.flush_pending().unwrap();
    }
    let st = s.stats();
    assert_eq!((st.pending_pages, st.pages_stored), (0, 4 * pages - 1));
    let mut buf = vec![0u8; PAGE_SIZE];
    let lost: Vec<u64> = (0..pages)
        .filter(|&i| s.read(i * PAGE_SIZE as u64, &mut buf).is_err())
        .collect();
    assert_eq!(lost.len(), 1, "exactly one page lost: {lost:?}");
    for index in (0..4 * pages).filter(|i| !lost.contains(i)) {
        s.read(index * PAGE_SIZE as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &text(index)[..], "page {index}");
    }
    assert_eq!(s.reserved_bytes.load(Ordering::Relaxed), 0);
}

/// Incompressible: xorshift bytes.
fn noise(seed: u64) -> Box<Page> {
    let mut p = Box::new([0u8; PAGE_SIZE]);
    let mut x = seed | 1;
    for b in p.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 32) as u8;
    }
    p
}

fn recompressing_store(pages: u64) -> (Arc<BatchedPageStore>, RecompressConfig) {
    let mut c =
        crate::config::StoreSettings::default().store_config(pages * PAGE_SIZE as u64, false);
    c.algorithm = Algorithm::Lz4;
    let config = RecompressConfig {
        algorithm: Algorithm::Zstd { level: 3 },
        idle: std::time::Duration::from_millis(16),
        min_saving_divisor: 8,
        cpu_percent: 100,
    };
    c.recompress = Some(config);
    (store(c), config)
}

/// Move the idle clock on by one idle threshold: every page is idle now.
fn let_time_pass(s: &BatchedPageStore) {
    s.idle_clock
        .set(u64::from(s.idle_clock.now()) + u64::from(recompress::TICKS_PER_IDLE));
}

fn pass(s: &BatchedPageStore, config: &RecompressConfig) {
    s.recompress_pass(
        config,
        recompress::tick(config),
        &mut recompress::Scratch::new(),
    );
}

fn read_page_back(s: &BatchedPageStore, index: u64) -> Vec<u8> {
    let mut buf = vec![0u8; PAGE_SIZE];
    s.read(index * PAGE_SIZE as u64, &mut buf).unwrap();
    buf
}

#[test]
fn idle_pages_are_recompressed_once_and_incompressible_ones_not_retried() {
    let (s, config) = recompressing_store(64);
    for i in 0..32u64 {
        s.write(i * PAGE_SIZE as u64, &text(i)[..]).unwrap();
    }
    write_pages_and_flush(&s, 32..40u64, noise);
    let before = s.stats();
    assert_eq!((before.pages_lz4, before.huge_pages), (32, 8));

    // Nothing is idle yet.
    pass(&s, &config);
    let st = s.stats();
    assert_eq!((st.recompressed_pages, st.recompress_backlog), (0, 40));

    let_time_pass(&s);
    pass(&s, &config);
    let st = s.stats();
    assert_eq!(st.recompressed_pages, 32, "{st:?}");
    assert_eq!(st.recompress_rejected_pages, 8, "noise does not compress");
    assert_eq!((st.pages_zstd, st.pages_lz4, st.huge_pages), (32, 0, 8));
    assert_eq!(st.recompress_backlog, 0);
    assert!(st.recompress_saved_bytes > 0);
    assert_eq!(
        st.compr_bytes,
        before.compr_bytes - st.recompress_saved_bytes,
        "the gauges follow the new objects"
    );
    for i in 0..40u64 {
        let want = if i < 32 { text(i) } else { noise(i) };
        assert_eq!(&read_page_back(&s, i)[..], &want[..], "page {i}");
    }

    // Settled pages are not tried again, however idle.
    let_time_pass(&s);
    pass(&s, &config);
    let again = s.stats();
    assert_eq!(
        (again.recompressed_pages, again.recompress_rejected_pages),
        (32, 8)
    );

    // New data is tried again.
    s.write(33 * PAGE_SIZE as u64, &noise(1033)[..]).unwrap();
    s.write(3 * PAGE_SIZE as u64, &text(1003)[..]).unwrap();
    s.flush_pending().unwrap();
    pass(&s, &config);
    assert_eq!(
        s.stats().recompress_backlog,
        2,
        "written pages are young again"
    );
    let_time_pass(&s);
    pass(&s, &config);
    let st = s.stats();
    assert_eq!(
        (st.recompressed_pages, st.recompress_rejected_pages),
        (33, 9)
    );
    assert_eq!(&read_page_back(&s, 3)[..], &text(1003)[..]);
    assert_eq!(&read_page_back(&s, 33)[..], &noise(1033)[..]);
    s.shutdown();
}

/// While memory is short, an LZ4 store compresses new pages with its recompression codec at
/// once, and the recompressor leaves them as they are (settled, no backlog); once memory is
/// back, new pages get LZ4 again. Every page reads back.
#[test]
fn new_pages_get_the_stronger_codec_while_memory_is_short() {
    let (s, config) = recompressing_store(64);
    s.set_memory_short(true);
    assert!(s.stats().memory_short);
    write_pages_and_flush(&s, 0..16u64, text);
    let st = s.stats();
    assert_eq!((st.pages_zstd, st.pages_lz4), (16, 0), "{st:?}");
    assert_eq!(st.short_memory_pages, 16);

    s.set_memory_short(false);
    write_pages_and_flush(&s, 16..24u64, text);
    let st = s.stats();
    assert!(!st.memory_short);
    assert_eq!((st.pages_zstd, st.pages_lz4), (16, 8), "{st:?}");
    assert_eq!(st.short_memory_pages, 16);

    // The zstd pages are settled as written: only the LZ4 ones wait for the recompressor.
    pass(&s, &config);
    assert_eq!(s.stats().recompress_backlog, 8);
    let_time_pass(&s);
    pass(&s, &config);
    let st = s.stats();
    assert_eq!(
        (st.recompressed_pages, st.recompress_backlog, st.pages_zstd),
        (8, 0, 24),
        "{st:?}"
    );
    for i in 0..24u64 {
        assert_eq!(&read_page_back(&s, i)[..], &text(i)[..], "page {i}");
    }
    s.shutdown();
}

/// A store without a stronger codec (zstd, or LZ4 with recompression off) keeps its own
/// algorithm whatever memory does.
#[test]
fn memory_short_changes_nothing_without_a_stronger_codec() {
    let mut c = crate::config::StoreSettings::default().store_config(16 * PAGE_SIZE as u64, false);
    c.algorithm = Algorithm::Lz4;
    c.recompress = None;
    let s = store(c);
    s.set_memory_short(true);
    s.write(0, &text(1)[..]).unwrap();
    s.flush_pending().unwrap();
    let st = s.stats();
    // Short of memory all the same (the flag says the system's state), but the page is LZ4.
    assert!(st.memory_short);
    assert_eq!((st.pages_lz4, st.short_memory_pages), (1, 0));
    s.shutdown();
}

#[test]
fn a_page_written_read_or_discarded_while_recompressed_wins() {
    let (s, config) = recompressing_store(8);
    let page = PAGE_SIZE as u64;
    let mut scratch = recompress::Scratch::new();
    for i in 0..3u64 {
        s.write(i * page, &text(i)[..]).unwrap();
    }
    s.flush_pending().unwrap();
    let_time_pass(&s);

    // Written meanwhile (same length, so the new object may take the old one's place).
    let claim = s.claim(0, &mut scratch).unwrap();
    s.write(0, &text(0)[..]).unwrap();
    s.write(0, &text(100)[..]).unwrap();
    s.flush_pending().unwrap();
    assert_eq!(
        s.finish(claim, &config, &mut scratch),
        recompress::Outcome::Dropped
    );
    assert_eq!(&read_page_back(&s, 0)[..], &text(100)[..]);

    // Read meanwhile: the page is hot again, and stays as it is.
    let claim = s.claim(1, &mut scratch).unwrap();
    assert_eq!(&read_page_back(&s, 1)[..], &text(1)[..]);
    let_time_pass(&s);
    assert_eq!(
        s.finish(claim, &config, &mut scratch),
        recompress::Outcome::Dropped
    );
    assert_eq!(&read_page_back(&s, 1)[..], &text(1)[..]);

    // Discarded meanwhile.
    let claim = s.claim(2, &mut scratch).unwrap();
    s.discard(2 * page, page).unwrap();
    assert_eq!(
        s.finish(claim, &config, &mut scratch),
        recompress::Outcome::Dropped
    );
    assert!(read_page_back(&s, 2).iter().all(|&b| b == 0));

    let st = s.stats();
    assert_eq!(
        (st.pages_zstd, st.pages_lz4),
        (0, 2),
        "nothing was installed"
    );
    assert_eq!(st.recompressed_pages, 0);
    // Untouched, it is recompressed after all.
    let_time_pass(&s);
    pass(&s, &config);
    assert_eq!(s.stats().pages_zstd, 2);
    for (i, want) in [(0, text(100)), (1, text(1))] {
        assert_eq!(&read_page_back(&s, i)[..], &want[..], "page {i}");
    }
    // Every object the dropped results took went back.
    let fresh = BatchedPageStore::new(s.config.clone(), None).unwrap();
    for (i, want) in [(0, text(100)), (1, text(1))] {
        fresh.write(i * page, &want[..]).unwrap();
    }
    fresh.flush_pending().unwrap();
    let_time_pass(&fresh);
    pass(&fresh, &config);
    assert_eq!(s.stats().compr_bytes, fresh.stats().compr_bytes);
    assert_eq!(s.alloc.chunk_bytes(), fresh.alloc.chunk_bytes());
    s.shutdown();
    fresh.shutdown();
}

#[test]
fn writers_and_readers_racing_the_recompressor_keep_their_data() {
    const PAGES: u64 = 96;
    const THREADS: u64 = 3;
    let (s, _) = recompressing_store(PAGES);
    let flusher = s.start_flusher(|_| ()).unwrap();
    let page = PAGE_SIZE as u64;
    // Page i belongs to thread i % THREADS, which writes version v of it as text(i * 1000 + v)
    // (or noise for every fifth version) and checks it reads back the last one. Version 0:
    // never written, zeros.
    let content = |i: u64, v: u64| {
        if v == 0 {
            Box::new([0u8; PAGE_SIZE])
        } else if v % 5 == 4 {
            noise(i * 1000 + v)
        } else {
            text(i * 1000 + v)
        }
    };
    let last: Vec<u64> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let s = &s;
                scope.spawn(move || {
                    let mine: Vec<u64> = (t..PAGES).step_by(THREADS as usize).collect();
                    let mut versions = vec![0u64; mine.len()];
                    let mut x = t + 1;
                    for round in 0..400u64 {
                        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                        let k = (x >> 33) as usize % mine.len();
                        let i = mine[k];
                        if round % 3 == 0 {
                            versions[k] += 1;
                            s.write(i * page, &content(i, versions[k])[..]).unwrap();
                        } else {
                            let want = content(i, versions[k]);
                            assert!(read_page_back(s, i)[..] == want[..], "page {i}");
                        }
                        if round % 50 == 0 {
                            // Long enough for pages to go idle and the recompressor to work.
                            std::thread::sleep(std::time::Duration::from_millis(20));
                        }
                    }
                    mine.into_iter().zip(versions).collect::<Vec<_>>()
                })
            })
            .collect();
        let mut last = vec![0u64; PAGES as usize];
        for worker in workers {
            for (i, v) in worker.join().unwrap() {
                last[i as usize] = v;
            }
        }
        last
    });
    // The race itself had recompressions to race with (about 230 here), not only the settle
    // below.
    let raced = s.stats();
    assert!(raced.recompressed_pages > 0, "{raced:?}");
    s.flush_pending().unwrap();
    // Let the recompressor settle everything (bounded).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let passes = s.stats().recompress_passes;
    while std::time::Instant::now() < deadline {
        let st = s.stats();
        if st.recompress_passes > passes + 1 && st.recompress_backlog == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let st = s.stats();
    assert_eq!(st.recompress_backlog, 0, "{st:?}");
    assert!(st.recompressed_pages > 0, "{st:?}");
    for i in 0..PAGES {
        assert!(
            read_page_back(&s, i)[..] == content(i, last[i as usize])[..],
            "page {i}"
        );
    }
    drop(flusher);
}

#[test]
fn a_flipped_bit_in_a_stored_page_fails_its_read_with_eio_and_is_counted() {
    let mut c = crate::config::StoreSettings::default().store_config(16 * PAGE_SIZE as u64, false);
    c.algorithm = Algorithm::Lz4;
    let s = store(c);
    s.write(0, &noise(1)[..]).unwrap();
    s.write(PAGE_SIZE as u64, &text(2)[..]).unwrap();
    s.write(2 * PAGE_SIZE as u64, &text(3)[..]).unwrap();
    s.flush_pending().unwrap();
    assert_eq!((s.stats().huge_pages, s.stats().pages_lz4), (1, 2));
    // A raw page: the copy succeeds, the checksum does not. An LZ4 page: its last bytes are
    // literals, so it still decodes, to a page one bit off.
    assert!(s.flip_stored_bit(0, 1234));
    let lz4_len = s.stored_len(1).unwrap();
    assert!(s.flip_stored_bit(1, lz4_len - 1));
    let mut buf = vec![0u8; PAGE_SIZE];
    for page in [0u64, 1] {
        let err = s.read(page * PAGE_SIZE as u64, &mut buf).unwrap_err();
        assert!(
            matches!(err, StoreError::ChecksumMismatch { page: p } if p == page),
            "{err}"
        );
        assert_eq!(err.errno(), -libc::EIO);
    }
    let st = s.stats();
    assert_eq!((st.checksum_failures, st.failed_reads), (2, 2));
    assert_eq!(&read_page_back(&s, 2)[..], &text(3)[..], "other pages read");
    // Writing the page again heals it.
    s.write(0, &noise(5)[..]).unwrap();
    s.flush_pending().unwrap();
    assert_eq!(&read_page_back(&s, 0)[..], &noise(5)[..]);
}

#[test]
fn the_recompressor_does_not_store_a_page_that_fails_its_checksum_again() {
    let (s, config) = recompressing_store(8);
    s.write(0, &text(1)[..]).unwrap();
    s.write(PAGE_SIZE as u64, &text(2)[..]).unwrap();
    s.flush_pending().unwrap();
    let len = s.stored_len(0).unwrap();
    assert!(s.flip_stored_bit(0, len - 1));
    let_time_pass(&s);
    pass(&s, &config);
    let st = s.stats();
    assert_eq!(st.checksum_failures, 1);
    assert_eq!(
        (st.recompressed_pages, st.recompress_rejected_pages),
        (1, 1)
    );
    let mut buf = vec![0u8; PAGE_SIZE];
    assert!(matches!(
        s.read(0, &mut buf),
        Err(StoreError::ChecksumMismatch { page: 0 })
    ));
    assert_eq!(&read_page_back(&s, 1)[..], &text(2)[..]);
    s.shutdown();
}

/// A GPU stand-in whose output is well formed but wrong: pages 0 and 1 of each batch swapped.
/// Counts the pages of the batches whose output the store rejected.
#[derive(Default)]
struct SwappingGpu {
    rejected: std::sync::atomic::AtomicUsize,
}

impl BatchCodec for SwappingGpu {
    fn output_rejected(&self, pages: usize) {
        self.rejected.fetch_add(pages, Ordering::Relaxed);
    }

    fn compress_batch(
        &self,
        pages: &[&Page],
        out: &mut CompressedBatch,
    ) -> Result<(), crate::codec::CodecError> {
        crate::codec::CpuCodec::single(Algorithm::Lz4).compress_batch(pages, out)?;
        if pages.len() >= 2 {
            let (first, rest) = out.data.split_at_mut(PAGE_SIZE);
            first.swap_with_slice(&mut rest[..PAGE_SIZE]);
            out.lens.swap(0, 1);
            out.encodings.swap(0, 1);
        }
        Ok(())
    }

    fn decompress_batch(
        &self,
        inputs: &[(crate::codec::Encoding, &[u8])],
        out: &mut [Page],
        status: &mut [Result<(), crate::codec::CodecError>],
    ) {
        crate::codec::CpuCodec::single(Algorithm::Lz4).decompress_batch(inputs, out, status);
    }
}

/// A page whose GPU output does not decode to it is compressed again on the CPU (stored raw,
/// as it was until 2026-12-03, a GPU that kept getting pages wrong left them all
/// uncompressed), and the batch is counted against the GPU, whose failures in a row rest it.
#[test]
fn gpu_output_that_does_not_decode_to_its_page_is_compressed_again_on_the_cpu() {
    let mut c = crate::config::StoreSettings::default().store_config(64 * PAGE_SIZE as u64, false);
    c.algorithm = Algorithm::Lz4;
    c.batch_threshold = 8;
    c.forced_backend = Some(Backend::Gpu);
    let gpu = Arc::new(SwappingGpu::default());
    let s = BatchedPageStore::new(c, Some(gpu.clone() as Arc<dyn BatchCodec>)).unwrap();
    // (`text` seeds 2k and 2k + 1 make the same page.)
    write_pages_and_flush(&s, 0..8u64, |i| text(2 * i + 1));
    let st = s.stats();
    assert_eq!(st.gpu_mismatched_pages, 2, "{st:?}");
    assert_eq!((st.huge_pages, st.pages_lz4), (0, 8));
    assert_eq!(
        gpu.rejected.load(Ordering::Relaxed),
        8,
        "one batch of 8 pages"
    );
    for i in 0..8u64 {
        assert_eq!(&read_page_back(&s, i)[..], &text(2 * i + 1)[..], "page {i}");
    }
    assert_eq!(s.stats().checksum_failures, 0);
}

/// Distinct pages of a few compressed sizes (`text` seeds 2k and 2k + 1 make the same page).
fn sized_page(i: u64) -> Box<Page> {
    let mut p = text(2 * i + 1);
    let noisy = (i % 7) as usize * 300;
    p[..noisy].copy_from_slice(&noise(i)[..noisy]);
    p
}

/// Discard a random half of the first `pages` pages (xorshift from `seed`); returns the kept.
fn discard_random_half(s: &BatchedPageStore, pages: u64, seed: u64) -> Vec<u64> {
    let page = PAGE_SIZE as u64;
    let mut x = seed;
    let mut kept = Vec::new();
    for i in 0..pages {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x.is_multiple_of(2) {
            s.discard(i * page, page).unwrap();
        } else {
            kept.push(i);
        }
    }
    kept
}

#[test]
fn compaction_brings_memory_after_random_discards_within_5_percent_of_a_fresh_store() {
    const PAGES: u64 = 4096;
    let page = PAGE_SIZE as u64;
    let (s, config) = recompressing_store(PAGES);
    let content = sized_page;
    for i in 0..PAGES {
        s.write(i * page, &content(i)[..]).unwrap();
    }
    s.flush_pending().unwrap();
    let_time_pass(&s);
    pass(&s, &config);
    let kept = discard_random_half(&s, PAGES, 0x9e37_79b9_7f4a_7c15u64);
    let fragmented = s.alloc.chunk_bytes();
    for _ in 0..4 {
        pass(&s, &config);
    }
    let st = s.stats();
    assert!(st.compacted_pages > 0, "{st:?}");
    assert_eq!(st.checksum_failures, 0);
    for &i in &kept {
        assert!(read_page_back(&s, i)[..] == content(i)[..], "page {i}");
    }
    // The same pages in a fresh store, recompressed the same way.
    let (fresh, _) = recompressing_store(PAGES);
    for &i in &kept {
        fresh.write(i * page, &content(i)[..]).unwrap();
    }
    fresh.flush_pending().unwrap();
    let_time_pass(&fresh);
    for _ in 0..4 {
        pass(&fresh, &config);
    }
    assert_eq!(fresh.stats().compr_bytes, s.stats().compr_bytes);
    let (compacted, wanted) = (s.alloc.chunk_bytes(), fresh.alloc.chunk_bytes());
    assert!(
        compacted * 100 <= wanted * 105,
        "compacted {compacted} B against {wanted} B fresh (fragmented: {fragmented} B)"
    );
    assert!(fragmented > compacted);
    s.shutdown();
    fresh.shutdown();
}

/// `compact` (what `trueno-ublk compact` asks for) in a store without recompression, which
/// never compacts by itself: after random discards of half its pages, one call brings its
/// memory within 5% of a fresh store holding the same pages, every page intact.
#[test]
fn compact_asked_for_brings_a_store_without_recompression_within_5_percent_of_a_fresh_one() {
    const PAGES: u64 = 4096;
    let page = PAGE_SIZE as u64;
    let config = || {
        let mut config =
            crate::config::StoreSettings::default().store_config(PAGES * PAGE_SIZE as u64, false);
        config.recompress = None;
        config
    };
    let content = sized_page;
    let s = store(config());
    for i in 0..PAGES {
        s.write(i * page, &content(i)[..]).unwrap();
    }
    s.flush_pending().unwrap();
    let kept = discard_random_half(&s, PAGES, 0x2545_f491_4f6c_dd1du64);
    let fragmented = s.alloc.chunk_bytes();
    let done = s.compact();
    assert_eq!(done.chunk_bytes_before, fragmented);
    assert_eq!(done.chunk_bytes_after, s.alloc.chunk_bytes());
    assert!(done.moved_pages > 0 && done.passes > 0, "{done:?}");
    let st = s.stats();
    assert_eq!((st.compactions, st.compacted_pages), (1, done.moved_pages));
    for &i in &kept {
        assert!(read_page_back(&s, i)[..] == content(i)[..], "page {i}");
    }
    let fresh = store(config());
    for &i in &kept {
        fresh.write(i * page, &content(i)[..]).unwrap();
    }
    fresh.flush_pending().unwrap();
    let (compacted, wanted) = (s.alloc.chunk_bytes(), fresh.alloc.chunk_bytes());
    assert!(
        compacted * 100 <= wanted * 105,
        "compacted {compacted} B against {wanted} B fresh (fragmented: {fragmented} B)"
    );
    // Nothing left to do: a second call moves nothing.
    assert_eq!(s.compact().moved_pages, 0);
}

/// The configuration of the layout tests' 64-page stores.
fn layout_test_config() -> StoreConfig {
    crate::config::StoreSettings::default().store_config(64 * PAGE_SIZE as u64, false)
}

/// A store of `bytes` with a chunk reserve of 1 MiB: a refill thread, which keeps the table's
/// spare slots.
fn refilled_config(bytes: u64) -> StoreConfig {
    let mut c = crate::config::StoreSettings::default().store_config(bytes, false);
    c.reserve_bytes = 1 << 20;
    c
}

/// The key under `key_base` and this process's id, with no segment under it (one a test left
/// is removed), and its backing: a shared store, not locked.
fn fresh_shared_backing(key_base: i32) -> (i32, Backing) {
    let key = key_base | i32::try_from(std::process::id() & 0xffff).unwrap();
    let _ = crate::mem::Segment::remove_shared(key);
    (key, Backing::SharedUnlocked { key })
}

/// Poll `done` every 5 ms for up to 5 s; fail the test with `what` if it is not.
fn wait_for(what: &str, done: &dyn Fn() -> bool) {
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A new shared store (unlocked) under `key_base` and this process's id, holding `text(i)` at
/// pages 0..16, flushed and closed again (`check` sees it while it is open); its key and
/// backing.
fn shared_store_holding_16_pages(
    key_base: i32,
    check: impl FnOnce(&BatchedPageStore, Opened),
) -> (i32, Backing) {
    let (key, backing) = fresh_shared_backing(key_base);
    let (s, opened) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
    check(&s, opened);
    write_pages_and_flush(&s, 0..16u64, text);
    (key, backing)
}

/// A local user who makes a segment under a store's own SysV key first (device keys are
/// known to all) does not keep the store from being made: it is made under a random key,
/// recorded where the next look for it reads first; removing it frees that segment, the
/// record, and the other user's segment.
#[test]
fn a_store_whose_own_key_another_user_holds_is_made_under_a_recorded_key() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: making a segment another user's needs root");
        return;
    }
    let dir = std::env::temp_dir().join(format!("trueno-key-records-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    layout::KEY_RECORD_DIR_FOR_TESTS.with(|records| *records.borrow_mut() = Some(dir.clone()));
    let (own_key, backing) = fresh_shared_backing(0x7900_0000);
    drop(crate::mem::Segment::create_shared(own_key, PAGE_SIZE, false).unwrap());
    crate::mem::give_shared_to_user(own_key, 65534).unwrap();
    let record = dir.join(format!("shm-{own_key:#x}.key"));
    {
        let (s, opened) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
        assert_eq!(opened, Opened::Fresh);
        s.write(0, &text(7)[..]).unwrap();
        s.flush_pending().unwrap();
    }
    let key: i32 = std::fs::read_to_string(&record)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_ne!(key, own_key);
    assert!(crate::mem::Segment::shared_exists(key));
    {
        let (s, opened) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
        assert_eq!(opened, Opened::Resumed { pages: 1, lost: 0 });
        let mut buf = vec![0u8; PAGE_SIZE];
        s.read(0, &mut buf).unwrap();
        assert_eq!(&buf[..], &text(7)[..]);
    }
    // No drawn key is a device's own (that device's creation would free it as its own).
    for attempt in 0..500 {
        let drawn = layout::record_new_key(own_key, attempt).unwrap();
        assert!(drawn > 0 && drawn & !0xf_ffff != 0x7400_0000, "{drawn:#x}");
    }
    std::fs::write(&record, format!("{key}\n")).unwrap();
    assert!(layout::shared_store_under(own_key)
        .unwrap()
        .remove()
        .unwrap());
    assert!(!crate::mem::Segment::shared_exists(key));
    assert!(!crate::mem::Segment::shared_exists(own_key));
    assert!(!record.exists());
    layout::KEY_RECORD_DIR_FOR_TESTS.with(|records| *records.borrow_mut() = None);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `trueno-ublk delete` looks up a store without a daemon before it deletes the device, and
/// frees what it found after: a `create` of the same id in between (a unit restarted, say)
/// freed that store by key and made its own, which must stay, with its key record.
#[test]
fn a_store_looked_up_before_a_create_of_its_id_frees_only_itself() {
    let dir = std::env::temp_dir().join(format!("trueno-key-looked-up-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    layout::KEY_RECORD_DIR_FOR_TESTS.with(|records| *records.borrow_mut() = Some(dir.clone()));
    let (key, backing) = shared_store_holding_16_pages(0x7a40_0000, |_, _| ());
    let looked_up = layout::shared_store_under(key).unwrap();
    // The create: the stale store freed by key, a new one made under it.
    assert!(crate::mem::Segment::remove_shared(key).unwrap());
    let (new, opened) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Fresh);
    new.write(0, &text(99)[..]).unwrap();
    new.flush_pending().unwrap();
    drop(new);
    assert!(
        !looked_up.remove().unwrap(),
        "the old store was gone already"
    );
    let (next, opened) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 1, lost: 0 });
    let mut buf = vec![0u8; PAGE_SIZE];
    next.read(0, &mut buf).unwrap();
    assert_eq!(&buf[..], &text(99)[..]);
    drop(next);
    // A key record the create wrote since (another key) stays; the one looked up goes.
    let record = dir.join(format!("shm-{key:#x}.key"));
    std::fs::write(&record, "4660\n").unwrap();
    let looked_up = layout::shared_store_under(key).unwrap();
    std::fs::write(&record, "4661\n").unwrap();
    assert!(looked_up.remove().unwrap(), "the store under its own key");
    assert_eq!(std::fs::read_to_string(&record).unwrap(), "4661\n");
    let looked_up = layout::shared_store_under(key).unwrap();
    assert!(!looked_up.remove().unwrap());
    assert!(!record.exists());
    layout::KEY_RECORD_DIR_FOR_TESTS.with(|records| *records.borrow_mut() = None);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A deleted device's daemon frees the segment it maps, not the one under the device's key
/// by then: a `create` of the same id after the device's DEL_DEV frees the old store by key
/// and makes its own there, and that one must outlive the old daemon's late free (or the new
/// device's next daemon would find nothing to resume).
#[test]
fn freeing_a_store_leaves_a_store_made_under_its_key_since() {
    let (key, backing) = fresh_shared_backing(0x7a00_0000);
    let (old, _) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
    old.write(0, &text(1)[..]).unwrap();
    old.flush_pending().unwrap();
    // The new device's create: the stale store freed by key, a new one made under it.
    assert!(crate::mem::Segment::remove_shared(key).unwrap());
    let (new, opened) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Fresh);
    new.write(0, &text(2)[..]).unwrap();
    new.flush_pending().unwrap();
    assert!(old.free_shared_memory().unwrap());
    drop(old);
    assert!(crate::mem::Segment::shared_exists(key));
    drop(new);
    {
        // The next daemon of the new device finds its page.
        let (next, opened) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
        assert_eq!(opened, Opened::Resumed { pages: 1, lost: 0 });
        let mut buf = vec![0u8; PAGE_SIZE];
        next.read(0, &mut buf).unwrap();
        assert_eq!(&buf[..], &text(2)[..]);
        // Its own delete frees it: the key is free at once.
        assert!(next.free_shared_memory().unwrap());
        assert!(!crate::mem::Segment::shared_exists(key));
    }
    let (private, _) =
        BatchedPageStore::open(layout_test_config(), None, Backing::Private).unwrap();
    assert!(!private.free_shared_memory().unwrap());
}

/// An upgrade that cannot read the store leaves it as it was: a store whose header names
/// another layout version is refused with a message that says what to do, its header and
/// page metadata do not change, and a binary of the store's own version then resumes every
/// page.
#[test]
fn a_store_of_another_layout_version_is_refused_and_left_untouched() {
    let config = layout_test_config;
    let (key, backing) = shared_store_holding_16_pages(0x7e00_0000, |_, opened| {
        assert_eq!(opened, Opened::Fresh);
    });
    let segment = crate::mem::Segment::attach_shared(key).unwrap().unwrap();
    // The header page, then the table, hints, checksums (of a whole group: 4, 1 and 2 pages)
    // and the group map (a page).
    let metadata = segment.words(0, 9 * PAGE_SIZE / 8).unwrap();
    let snapshot = || -> Vec<u64> { metadata.iter().map(|w| w.load(Ordering::Relaxed)).collect() };
    // Header word 1 is the layout version (see `layout`).
    metadata[1].store(layout::LAYOUT_VERSION + 1, Ordering::Relaxed);
    let before = snapshot();

    let err = BatchedPageStore::open(config(), None, backing)
        .err()
        .unwrap();
    let message = err.to_string();
    assert!(matches!(err, StoreError::Layout(_)), "{message}");
    assert!(
        message.contains(&format!("layout version {}", layout::LAYOUT_VERSION + 1))
            && message.contains("left untouched"),
        "{message}"
    );
    assert!(before == snapshot(), "the refused open changed the store");
    // A standby of this binary finds that out before it says it is ready.
    let attached = layout::AttachedStore::attach_key(key).unwrap().unwrap();
    let err = attached.check_this_binary_reads().unwrap_err();
    assert!(
        err.to_string() == message,
        "the standby's error is the resume's: {err}"
    );
    // Header word 5 is the size classes' fingerprint.
    metadata[1].store(layout::LAYOUT_VERSION, Ordering::Relaxed);
    let classes = metadata[5].load(Ordering::Relaxed);
    metadata[5].store(classes ^ 1, Ordering::Relaxed);
    let err = attached.check_this_binary_reads().unwrap_err();
    assert!(err.to_string().contains("size classes"), "{err}");
    metadata[5].store(classes, Ordering::Relaxed);
    attached.check_this_binary_reads().unwrap();
    // A store still being made (no magic yet) is not refused.
    let magic = metadata[0].swap(0, Ordering::Relaxed);
    attached.check_this_binary_reads().unwrap();
    metadata[0].store(magic, Ordering::Relaxed);
    drop(attached);

    metadata[1].store(layout::LAYOUT_VERSION, Ordering::Relaxed);
    let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 16, lost: 0 });
    assert_pages_read_back(&s, 0..16u64, text, "");
    drop(s);
    drop(metadata);
    drop(segment);
    crate::mem::Segment::remove_shared(key).unwrap();
}

/// A new store is version 6, checksummed with CRC32C, version 5, with XXH64, or version 7,
/// with XXH3, whichever checksum is the fastest here (`PageChecksum::fastest_here`): each is
/// resumed with its own checksum and keeps its version, whatever a new store would get.
#[test]
fn stores_of_versions_5_to_7_are_resumed_with_their_own_checksums() {
    let config = layout_test_config;
    for (version, checksum, key_base, other) in [
        (5, PageChecksum::Xxh64, 0x7b00_0000, layout::LAYOUT_VERSION),
        (6, PageChecksum::Crc32c, 0x7a00_0000, 5),
        (7, PageChecksum::Xxh3, 0x7700_0000, 6),
    ] {
        layout::LAYOUT_FOR_TESTS.with(|v| v.set(version));
        let (key, backing) = shared_store_holding_16_pages(key_base, |s, _| {
            assert_eq!(s.checksum, checksum, "a new store of version {version}");
        });
        layout::LAYOUT_FOR_TESTS.with(|v| v.set(other));
        let segment = crate::mem::Segment::attach_shared(key).unwrap().unwrap();
        // Header word 1 is the layout version; the checksums follow the header page, the
        // table's group (4 pages) and its hints (a page).
        let header = segment.words(0, 2).unwrap();
        let checksums = segment
            .words_of::<std::sync::atomic::AtomicU32>(6 * PAGE_SIZE, 64)
            .unwrap();
        assert_eq!(header[1].load(Ordering::Relaxed), version);
        for i in 0..16usize {
            assert_eq!(
                checksums[i].load(Ordering::Relaxed),
                checksum.of(&text(i as u64)),
                "version {version}, page {i}"
            );
        }
        let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
        assert_eq!(opened, Opened::Resumed { pages: 16, lost: 0 });
        assert_eq!(s.checksum, checksum, "version {version} resumed");
        assert_pages_read_back(&s, 0..16u64, text, &format!("version {version}"));
        let stats = s.stats();
        assert_eq!(stats.checksum_failures, 0);
        assert_eq!(
            (stats.layout_version, stats.checksum.as_str()),
            (version, checksum.name()),
            "what stat shows of a resumed store of version {version}"
        );
        assert_eq!(
            header[1].load(Ordering::Relaxed),
            version,
            "the version stays"
        );
        drop(s);
        drop((header, checksums, segment));
        crate::mem::Segment::remove_shared(key).unwrap();
    }
    layout::LAYOUT_FOR_TESTS.with(|v| v.set(layout::LAYOUT_VERSION));
}

/// A store of layout version 3 (what binaries before version 4 made: CRC32C checksums, the
/// table's groups each in its own place, as in version 4) is resumed with its pages and keeps
/// its checksum, its layout and its version, so that the binary that made it could take it
/// back; new stores are version 5, 6 or 7 (see the test before).
#[test]
fn a_store_of_layout_version_3_is_resumed_with_crc32c_and_kept_at_3() {
    let config = layout_test_config;
    layout::LAYOUT_FOR_TESTS.with(|version| version.set(4));
    let (key, backing) = shared_store_holding_16_pages(0x7d00_0000, |s, _| {
        assert_eq!(s.checksum, PageChecksum::Xxh64);
    });
    layout::LAYOUT_FOR_TESTS.with(|version| version.set(layout::LAYOUT_VERSION));
    let segment = crate::mem::Segment::attach_shared(key).unwrap().unwrap();
    // Header word 1 is the layout version; the checksums of 64 pages are the fourth page
    // (after the header, the table and the hints: a page each, see `layout`).
    let header = segment.words(0, 2).unwrap();
    let checksums = segment
        .words_of::<std::sync::atomic::AtomicU32>(3 * PAGE_SIZE, 64)
        .unwrap();
    assert_eq!(header[1].load(Ordering::Relaxed), 4);
    for i in 0..16usize {
        assert_eq!(
            checksums[i].load(Ordering::Relaxed),
            PageChecksum::Xxh64.of(&text(i as u64))
        );
    }
    // What a binary of version 3 leaves.
    header[1].store(3, Ordering::Relaxed);
    for i in 0..16usize {
        checksums[i].store(PageChecksum::Crc32c.of(&text(i as u64)), Ordering::Relaxed);
    }
    let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 16, lost: 0 });
    assert_eq!(s.checksum, PageChecksum::Crc32c);
    let mut buf = vec![0u8; PAGE_SIZE];
    assert_pages_read_back(&s, 0..16u64, text, "");
    // Pages stored from here on get CRC32C too.
    s.write(20 * PAGE_SIZE as u64, &text(20)[..]).unwrap();
    s.flush_pending().unwrap();
    assert_eq!(
        checksums[20].load(Ordering::Relaxed),
        PageChecksum::Crc32c.of(&text(20))
    );
    s.read(20 * PAGE_SIZE as u64, &mut buf).unwrap();
    assert_eq!(s.stats().checksum_failures, 0);
    assert_eq!(header[1].load(Ordering::Relaxed), 3, "the version stays");
    drop(s);
    drop((header, checksums, segment));
    crate::mem::Segment::remove_shared(key).unwrap();
}

/// `start_compaction` runs `compact` in a thread of its own, started by the caller's
/// `thread_init`, and reports what it did; a second one may start once it is done.
#[test]
fn start_compaction_compacts_in_a_thread_and_reports() {
    let s =
        store(crate::config::StoreSettings::default().store_config(256 * PAGE_SIZE as u64, false));
    write_pages_and_flush(&s, 0..256u64, text);
    for i in (0..256u64).step_by(2) {
        s.discard(i * PAGE_SIZE as u64, PAGE_SIZE as u64).unwrap();
    }
    for round in 1..=2u64 {
        let (tx, rx) = std::sync::mpsc::channel();
        let init_tx = tx.clone();
        let started = s
            .start_compaction(
                move || init_tx.send(Err(())).unwrap(),
                move |done| tx.send(Ok(done)).unwrap(),
            )
            .unwrap();
        assert!(started);
        assert_eq!(rx.recv().unwrap(), Err(()));
        let done = rx.recv().unwrap().unwrap();
        assert_eq!(done.chunk_bytes_after, s.alloc.chunk_bytes());
        assert_eq!(s.stats().compactions, round);
    }
    for i in (1..256u64).step_by(2) {
        assert_eq!(read_page_back(&s, i)[..], text(i)[..]);
    }
}

/// A 1 GiB store with the default settings but a chunk reserve of `target` bytes, its threads
/// running.
fn store_with_reserve(target: u64) -> (Arc<BatchedPageStore>, FlusherHandle) {
    let mut c = crate::config::StoreSettings::default().store_config(1 << 30, false);
    c.reserve_bytes = target;
    let s = store(c);
    let flusher = s.start_flusher(|_| ()).unwrap();
    (s, flusher)
}

/// Wait up to `timeout` for the reserve to hold no more than `target` (the refill thread
/// gives back what it holds beyond).
fn await_reserve_within(s: &BatchedPageStore, target: u64, timeout: std::time::Duration) {
    let deadline = Instant::now() + timeout;
    while s.stats().reserve_bytes > target && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn memory_follows_the_data_after_a_discard() {
    let target = 4u64 << 20;
    let (s, flusher) = store_with_reserve(target);
    let n = 20_000u64;
    write_pages_and_flush(&s, 0..n, text);
    assert!(s.stats().mem_used > target);
    s.discard(0, n * PAGE_SIZE as u64).unwrap();
    // Every chunk is free at once; the refill thread, woken by the discard, gives back what
    // the reserve holds beyond its target.
    assert_eq!(s.stats().mem_used, 0);
    await_reserve_within(&s, target, std::time::Duration::from_secs(2));
    let held = s.stats().reserve_bytes;
    assert!(
        held <= target,
        "reserve holds {held} bytes for a {target}-byte target"
    );
    drop(flusher);
}

/// A store whose OOM killer only counts, holding `pages` pages made by `page`, flushed, on a
/// system that is out of memory or not.
fn starving_store(
    pages: u64,
    page: fn(u64) -> Box<Page>,
    system_out_of_memory: bool,
) -> (Arc<BatchedPageStore>, Arc<AtomicU64>) {
    let asked = Arc::new(AtomicU64::new(0));
    let count = Arc::clone(&asked);
    let mut c =
        crate::config::StoreSettings::default().store_config(pages * PAGE_SIZE as u64, false);
    c.oom_killer = Some(OomKiller::new(
        move || system_out_of_memory,
        move || {
            count.fetch_add(1, Ordering::Relaxed);
            Ok(())
        },
    ));
    let s = store(c);
    write_pages_and_flush(&s, 0..pages, page);
    (s, asked)
}

#[test]
fn a_starving_writer_asks_for_an_oom_kill_only_when_pages_do_not_compress() {
    use std::time::Duration;
    let ms = Duration::from_millis;
    let (s, asked) = starving_store(64, noise, true);
    // Nobody waits for the refill thread: memory comes, however slowly.
    assert!(!s.gives_up(ms(5000)));
    assert_eq!(asked.load(Ordering::Relaxed), 0);
    // A taker waits for the refill thread, which commits nothing (the system has no memory).
    s.alloc.reserve.note_waiting();
    assert!(!s.gives_up(ms(299)));
    assert_eq!(asked.load(Ordering::Relaxed), 0, "a short wait is a burst");
    assert!(!s.gives_up(ms(300)), "asked for a kill, still waiting");
    assert_eq!(asked.load(Ordering::Relaxed), 1);
    assert!(
        !s.gives_up(ms(1000)),
        "the kill asked for just now may still free memory"
    );
    assert!(
        s.gives_up(ms(5000)),
        "however many kills, a write waits 5 s at most"
    );
    assert_eq!(
        asked.load(Ordering::Relaxed),
        1,
        "at most one kill a second"
    );
    assert_eq!(s.stats().oom_kills_asked, 1);
    s.alloc.reserve.note_served();

    // Pages that compress: swapping frees memory, a starving store is only slow, and a
    // writer waits longer before it gives up.
    let (s, asked) = starving_store(64, text, true);
    s.alloc.reserve.note_waiting();
    assert!(!s.gives_up(ms(1000)));
    assert!(!s.gives_up(ms(4900)));
    assert!(s.gives_up(ms(5000)));
    assert_eq!(asked.load(Ordering::Relaxed), 0);
    assert_eq!(s.stats().oom_kills_asked, 0);
    s.alloc.reserve.note_served();

    // Pages that do not compress, but the system has free memory (a limit on the daemon's
    // own cgroup): no kill, which could not mend it; the write gives up as when no kill is
    // under way.
    let (s, asked) = starving_store(64, noise, false);
    s.alloc.reserve.note_waiting();
    assert!(!s.gives_up(ms(300)));
    assert!(s.gives_up(ms(1000)));
    assert_eq!(asked.load(Ordering::Relaxed), 0);
    assert_eq!(s.stats().oom_kills_asked, 0);
    s.alloc.reserve.note_served();
}

#[test]
fn writers_flush_for_themselves_until_the_flusher_is_ready() {
    // A flusher thread still readying itself (faulting in memory under pressure, say) must
    // not leave writers waiting for it: every batch fills many times over here while its
    // `thread_init` is held, and every write completes and reads back.
    let mut c =
        crate::config::StoreSettings::default().store_config(1024 * PAGE_SIZE as u64, false);
    c.batch_threshold = 8;
    let s = store(c);
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flusher = s
        .start_flusher({
            let ready = Arc::clone(&ready);
            move |role| {
                while role == StoreThread::Flusher && !ready.load(Ordering::Acquire) {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        })
        .unwrap();
    let pages = 16 * 8 * PENDING_BATCHES as u64;
    for i in 0..pages {
        s.write(i * PAGE_SIZE as u64, &text(i)[..]).unwrap();
    }
    assert_pages_read_back(&s, 0..pages, text, "");
    ready.store(true, Ordering::Release);
    drop(flusher);
}

#[test]
fn store_threads_are_readied_before_the_store_they_serve_exists() {
    // A standby starts them before its takeover: each has run its `thread_init` with no store
    // yet, and once handed one they serve it (the flusher flushes, the refill thread refills).
    let (tx, rx) = std::sync::mpsc::channel();
    let threads = super::StoreThreads::start(move |role| tx.send(role).unwrap()).unwrap();
    let mut roles: Vec<StoreThread> = (0..3).map(|_| rx.recv().unwrap()).collect();
    roles.sort_by_key(|role| *role as u8);
    assert_eq!(
        roles,
        [
            StoreThread::Flusher,
            StoreThread::Refill,
            StoreThread::Recompress
        ]
    );
    let mut c =
        crate::config::StoreSettings::default().store_config(4096 * PAGE_SIZE as u64, false);
    c.batch_threshold = 8;
    c.flush_timeout = std::time::Duration::from_millis(1);
    c.reserve_bytes = 1 << 20;
    let s = store(c);
    let flusher = s.start_threads(threads).unwrap();
    // Not a whole number of batches: the last one only the flusher flushes (by its age).
    for i in 0..60u64 {
        s.write(i * PAGE_SIZE as u64, &text(i)[..]).unwrap();
    }
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while s.stats().pending_pages > 0 && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert_eq!(
        s.stats().pending_pages,
        0,
        "the flusher handed the store flushed nothing"
    );
    // The refill thread runs once its prepared thread has taken the job up, which on a busy
    // machine may come after the flush (takers commit chunks themselves until then).
    while !s.alloc.reserve.refill_running() && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert!(s.alloc.reserve.refill_running());
    for i in 0..60u64 {
        assert_eq!(read_page_back(&s, i)[..], text(i)[..]);
    }
    drop(flusher);
    assert!(!s.alloc.reserve.refill_running());
}

#[test]
fn a_freed_swap_slot_empties_its_page_only_while_the_report_stands() {
    let pages = 64u64;
    let s = store(
        crate::config::StoreSettings::default().store_config(pages * PAGE_SIZE as u64, false),
    );
    write_pages_and_flush(&s, 0..pages, text);
    let data = s.stats().orig_bytes;
    // Past the end: nothing freed, but the report is consumed.
    let asked = std::cell::Cell::new(0);
    let ask = || {
        asked.set(asked.get() + 1);
        true
    };
    let mut frees = s.swap_slot_frees();
    assert!(!frees.free(pages, &ask));
    assert!(!frees.free(u64::MAX, &ask));
    assert_eq!(asked.get(), 2);
    // A report withdrawn (a write came since): the page stays.
    assert!(!frees.free(3, &|| false));
    assert_eq!(read_page_back(&s, 3), text(3).to_vec());
    // Reports standing for pages 10..20: emptied, and their data gone; the others stay.
    for i in 10..20 {
        assert!(frees.free(i, &|| true));
    }
    assert!(!frees.free(10, &|| true), "already empty");
    drop(frees);
    assert_eq!(s.stats().orig_bytes, data - 10 * PAGE_SIZE as u64);
    for i in 0..pages {
        let want = if (10..20).contains(&i) {
            vec![0u8; PAGE_SIZE]
        } else {
            text(i).to_vec()
        };
        assert_eq!(read_page_back(&s, i), want, "page {i}");
    }
    assert_eq!(s.stats().failed_writes, 0);
}

/// A stored entry whose length is longer than its size class's objects (a table word broken,
/// or not written by this build) is lost at the resume, and its read fails with an error: a
/// read of it went past its object into the next one, or past the chunk's end (a panic).
#[test]
fn a_resumed_entry_longer_than_its_object_is_lost() {
    let (key, backing) = shared_store_holding_16_pages(0x7b10_0000, |_, _| {});
    {
        // Page 1 raw, in a chunk of one page, its entry then made to say a compressed 5000
        // bytes: the largest class is a page's, so its chunk alone would take the object.
        let (s, _) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
        s.write(PAGE_SIZE as u64, &noise(1)[..]).unwrap();
        s.flush_pending().unwrap();
        let mut entry = s.table.lock(1).unwrap();
        let PageState::Stored {
            handle,
            encoding: crate::codec::Encoding::Raw,
            ..
        } = entry.state()
        else {
            panic!("page 1 is not stored raw: {:?}", entry.state());
        };
        entry.replace(PageState::Stored {
            handle,
            len: 5000,
            encoding: crate::codec::Encoding::Lz4,
        });
    }
    let (s, opened) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 16, lost: 1 });
    let mut buf = vec![0u8; PAGE_SIZE];
    assert!(
        s.read(PAGE_SIZE as u64, &mut buf).is_err(),
        "the lost page read"
    );
    assert_pages_read_back(&s, (0..16u64).filter(|&i| i != 1), text, "");
    drop(s);
    crate::mem::Segment::remove_shared(key).unwrap();
}

/// A process that died overwriting a stored page in place (`--no-batched`: the new data's
/// checksum set under the entry's lock, the entry still naming the old data) leaves the page
/// readable as it was: the resume checksums a stored page whose entry was locked from the data
/// it names. Before, every read of it failed its checksum (EIO) for a write never acknowledged.
#[test]
fn a_page_whose_overwrite_died_after_its_checksum_reads_as_it_was() {
    let (key, backing) = shared_store_holding_16_pages(0x7b20_0000, |_, _| {});
    {
        let (s, _) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
        let entry = s.table.lock(1).unwrap();
        assert!(matches!(entry.state(), PageState::Stored { .. }));
        entry.set_checksum(s.checksum.of(&noise(1)));
        // Dies here: the lock bit stays set in the shared table.
        std::mem::forget(entry);
    }
    let (s, opened) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 16, lost: 0 });
    assert_pages_read_back(&s, 0..16u64, text, "");
    assert_eq!(s.stats().checksum_failures, 0);
    drop(s);
    crate::mem::Segment::remove_shared(key).unwrap();
}

/// A resumed store keeps the free pages its predecessor still had in memory (its reserve,
/// the rest of a commit group) ready, up to the reserve's target, instead of giving them back
/// and committing them again when memory is scarcest; its pages read back as they were, and
/// the kept chunks take new writes.
#[test]
fn a_resumed_store_keeps_the_free_memory_it_finds_ready() {
    let config = || StoreConfig {
        reserve_bytes: 1 << 20,
        ..layout_test_config()
    };
    let (key, backing) = fresh_shared_backing(0x7c00_0000);
    let (s, _) = BatchedPageStore::open(config(), None, backing).unwrap();
    write_pages_and_flush(&s, 0..16u64, text);
    s.alloc.reserve.refill();
    let before = s.stats().reserve_bytes;
    assert!(before > 0, "the first store holds no reserve");
    drop(s);

    let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 16, lost: 0 });
    let kept = s.stats().reserve_bytes;
    assert!(kept > 0, "nothing kept ready ({before} held before)");
    assert_eq!(
        s.alloc.reserve.commits(),
        0,
        "the resume committed memory though {kept} bytes were kept ready ({before} before)"
    );
    write_pages_and_flush(&s, 16..32u64, text);
    assert_pages_read_back(&s, 0..32u64, text, "");
    drop(s);
    crate::mem::Segment::remove_shared(key).unwrap();
}

#[test]
fn a_write_that_would_wait_for_a_pending_slot_is_deferred_with_what_it_wrote() {
    use std::time::Duration;
    let mut c =
        crate::config::StoreSettings::default().store_config(1024 * PAGE_SIZE as u64, false);
    c.batch_threshold = 8;
    let s = store(c);
    let pages: Vec<Box<Page>> = (0..12).map(text).collect();
    let data: Vec<u8> = pages.iter().flat_map(|p| p.iter().copied()).collect();
    // A flusher that runs but flushes nothing (as one waiting for memory): the open batch
    // takes 8 pages, and the write is given back with them written.
    s.control.lock().flusher_running = true;
    assert_eq!(
        s.try_write(0, &data, None).unwrap(),
        WriteOutcome::Deferred {
            done_bytes: 8 * PAGE_SIZE as u64
        }
    );
    // Tried again: still no slot, and nobody waits for the refill thread: deferred, however
    // long ago it was first deferred (memory is not short, only the flusher is slow).
    let rest = &data[8 * PAGE_SIZE..];
    let long_ago = Instant::now().checked_sub(Duration::from_secs(60));
    assert_eq!(
        s.try_write(8 * PAGE_SIZE as u64, rest, long_ago).unwrap(),
        WriteOutcome::Deferred { done_bytes: 0 }
    );
    // While writes fail fast (one starved a moment ago), so does a deferred one.
    let in_a_while = s.now_ns() + Duration::from_secs(60).as_nanos() as u64;
    s.fail_fast_until.store(in_a_while, Ordering::Release);
    assert!(matches!(
        s.try_write(8 * PAGE_SIZE as u64, rest, long_ago),
        Err(StoreError::OutOfMemory { .. })
    ));
    s.fail_fast_until.store(0, Ordering::Release);
    // The flusher gets going (here: writers flush for themselves): the rest is stored.
    s.control.lock().flusher_running = false;
    assert_eq!(
        s.try_write(8 * PAGE_SIZE as u64, rest, long_ago).unwrap(),
        WriteOutcome::Done
    );
    let mut back = vec![0u8; data.len()];
    s.read(0, &mut back).unwrap();
    assert!(back == data, "every page reads back as written");
    assert_eq!(s.stats().failed_writes, 1, "the one that starved");
    assert_eq!(
        s.stats().long_waited_writes,
        1,
        "stored a minute after it was deferred"
    );
    assert!(s.stats().longest_write_wait_ms >= 60_000);
}

#[test]
fn unbatched_store_has_no_flusher_spinning() {
    let mut c = crate::config::StoreSettings::default().store_config(16 * PAGE_SIZE as u64, false);
    c.batched = false;
    let s = store(c);
    let flusher = s.start_flusher(|_| ()).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !flusher.flusher_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "the flusher of a store without batching still runs (it spins: its batches have no slots)"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    s.write(0, &text(1)[..]).unwrap();
    let mut buf = vec![0u8; PAGE_SIZE];
    s.read(0, &mut buf).unwrap();
    assert_eq!(&buf[..], &text(1)[..]);
    drop(flusher);
}

#[test]
fn many_writers_with_a_chunk_reserve_keep_every_page() {
    // More writers than cores and a chunk reserve (whose waits slow installs down), through
    // 256-page batches: pages written in groups, as the bench does. A version of the flush
    // that handed batches to pool workers lost a batch here (2026-11-26): its late "batch
    // flushed" reopened a batch that a seal had already reopened and filled.
    const PAGES: u64 = 8192;
    const THREADS: u64 = 16;
    const GROUP: u64 = 64;
    let mut c =
        crate::config::StoreSettings::default().store_config(PAGES * PAGE_SIZE as u64, false);
    c.batch_threshold = 256;
    c.reserve_bytes = 4 << 20;
    let s = store(c);
    let flusher = s.start_flusher(|_| ()).unwrap();
    for round in 0..3u64 {
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let s = &s;
                scope.spawn(move || {
                    for g in (t..PAGES / GROUP).step_by(THREADS as usize) {
                        for i in g * GROUP..(g + 1) * GROUP {
                            s.write(i * PAGE_SIZE as u64, &text(i + round * PAGES)[..])
                                .unwrap();
                        }
                    }
                });
            }
        });
        s.flush_pending().unwrap();
        let mut buf = vec![0u8; PAGE_SIZE];
        let bad: Vec<u64> = (0..PAGES)
            .filter(|&i| {
                s.read(i * PAGE_SIZE as u64, &mut buf).unwrap();
                buf[..] != text(i + round * PAGES)[..]
            })
            .collect();
        assert!(
            bad.is_empty(),
            "round {round}: {} pages differ, first {:?}",
            bad.len(),
            &bad[..bad.len().min(8)]
        );
    }
    drop(flusher);
}

#[test]
fn the_page_table_holds_memory_only_for_the_part_of_the_device_in_use() {
    use super::table_memory::{GROUP_PAGES, SPARE_SLOTS};
    const GROUP_BYTES: u64 = 28 << 10;
    const SPARES: u64 = SPARE_SLOTS as u64 * GROUP_BYTES;
    let group = GROUP_PAGES as u64;
    let mut c = crate::config::StoreSettings::default().store_config(1 << 30, false);
    c.reserve_bytes = 4 << 20;
    let s = store(c);
    assert_eq!(s.table.bytes(), 0, "a fresh store commits no table");
    let flusher = s.start_flusher(|_| ()).unwrap();
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while !done() {
            assert!(
                Instant::now() < deadline,
                "{what}: table {} bytes",
                s.table.bytes()
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    // The refill thread commits the spare slots, and no group.
    wait_for("the spares", &|| s.table.bytes() == SPARES);
    // A write in group 10 takes a spare; groups 11 and 18 are asked for beside it.
    s.write(10 * group * PAGE_SIZE as u64, &text(1)[..])
        .unwrap();
    wait_for("group 10, 11 and 18", &|| {
        s.table.bytes() == 3 * GROUP_BYTES + SPARES
    });
    let committed = |g: u64| s.table.is_committed((g * group) as usize);
    assert!([10, 11, 18].into_iter().all(committed));
    // Writers and discarders racing over groups 20..24 (the refill thread giving back
    // groups that empty meanwhile): every page that was last written reads back.
    let pages: Vec<u64> = (20 * group..24 * group).step_by(7).collect();
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (s, pages) = (&s, &pages);
            scope.spawn(move || {
                for round in 0..3u64 {
                    for &i in pages.iter().skip(t as usize).step_by(4) {
                        s.write(i * PAGE_SIZE as u64, &text(i + round)[..]).unwrap();
                        if (i + round) % 3 == 0 {
                            s.discard(i * PAGE_SIZE as u64, PAGE_SIZE as u64).unwrap();
                        }
                    }
                }
            });
        }
    });
    s.flush_pending().unwrap();
    let mut buf = vec![0u8; PAGE_SIZE];
    for &i in &pages {
        s.read(i * PAGE_SIZE as u64, &mut buf).unwrap();
        if (i + 2) % 3 == 0 {
            assert!(buf.iter().all(|&b| b == 0), "page {i} was discarded last");
        } else {
            assert_eq!(&buf[..], &text(i + 2)[..], "page {i}");
        }
    }
    // Pages never written read as zeros, in committed groups and others alike.
    for i in [0, 21 * group + 1, 200 * group / 2, 127 * group] {
        s.read(i * PAGE_SIZE as u64, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "page {i}");
    }
    // Writes into a group that is empty most of the time, so that it is given back and
    // committed again under them: each write is read back before it is discarded. Far from
    // the groups in use, whose next groups stay when empty (see `provide_table`).
    // Measured with every spare ready (a writer may have taken one the refill thread has not
    // replaced yet).
    // And with the groups asked for ahead of the writes above committed (the refill thread
    // may be busy with the pending batches' memory a while).
    let spares_ready = || s.table.memory().spares() == SPARE_SLOTS;
    wait_for("the spares", &|| {
        spares_ready() && !(0..128).any(|g| s.table.memory().is_wanted(g))
    });
    let retired_before = s.table.bytes();
    let groups_before: Vec<u64> = (0..128).filter(|&g| committed(g)).collect();
    let until = Instant::now() + std::time::Duration::from_millis(1500);
    std::thread::scope(|scope| {
        for t in 0..2u64 {
            let s = &s;
            scope.spawn(move || {
                let mut buf = vec![0u8; PAGE_SIZE];
                let i = 50 * group + t;
                let mut n = 0;
                while Instant::now() < until {
                    n += 1;
                    s.write(i * PAGE_SIZE as u64, &text(i + n)[..]).unwrap();
                    s.read(i * PAGE_SIZE as u64, &mut buf).unwrap();
                    assert_eq!(&buf[..], &text(i + n)[..], "page {i}, write {n}");
                    s.discard(i * PAGE_SIZE as u64, PAGE_SIZE as u64).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            });
        }
    });
    // Groups 50, 51 and 58, at most.
    wait_for("the spares", &spares_ready);
    assert!(
        s.table.bytes() <= retired_before + 3 * GROUP_BYTES,
        "groups before {groups_before:?}, after {:?}",
        (0..128).filter(|&g| committed(g)).collect::<Vec<u64>>()
    );
    // Everything discarded: each group that held pages goes back; what may stay is the groups
    // asked for ahead of writes and never written (11, 18, 24, 28..=31, 51, 58). Which of them
    // are still there depends on the clock: they go once no group was asked for `QUIET_FOR`,
    // which a loaded machine may reach during the writes to group 50 above (kept committed
    // throughout, it asks for nothing).
    s.discard(0, 1 << 30).unwrap();
    wait_for("the emptied groups given back", &|| {
        ![10, 20, 21, 22, 23, 50].into_iter().any(committed)
    });
    let asked_ahead = [11, 18, 24, 28, 29, 30, 31, 51, 58];
    let stayed: Vec<u64> = (0..128).filter(|&g| committed(g)).collect();
    assert!(
        stayed.iter().all(|g| asked_ahead.contains(g)),
        "stayed {stayed:?}"
    );
    // Once no group was asked for a while, they go too, all but the spares.
    wait_for("the groups no write reached given back", &|| {
        s.table.bytes() == SPARES
    });
    // And a group given back works again.
    s.write(21 * group * PAGE_SIZE as u64, &text(5)[..])
        .unwrap();
    s.flush_pending().unwrap();
    s.read(21 * group * PAGE_SIZE as u64, &mut buf).unwrap();
    assert_eq!(&buf[..], &text(5)[..]);
    drop(flusher);
}

/// A 1 GiB store (the page table's groups: 8 MiB of device each) with a 4 MiB chunk reserve,
/// `adjust`ed, and its flusher (and so its refill thread) running.
fn gib_store_with_flusher(
    adjust: impl FnOnce(&mut StoreConfig),
) -> (Arc<BatchedPageStore>, flusher::FlusherHandle) {
    let mut c = crate::config::StoreSettings::default().store_config(1 << 30, false);
    c.reserve_bytes = 4 << 20;
    adjust(&mut c);
    let s = store(c);
    let flusher = s.start_flusher(|_| ()).unwrap();
    (s, flusher)
}

/// A write that fails after pinning its page-table group (here at the memory limit) stores
/// nothing, and the group it took (a spare, or one committed for it) is given back as after a
/// discard. Before, pinning cleared the group's "never written" mark and nothing marked it
/// emptied: committed, locked and empty for good, exactly when writes fail near OOM.
#[test]
fn a_table_group_a_failed_write_pinned_is_given_back() {
    use super::table_memory::{GROUP_PAGES, SPARE_SLOTS};
    let group = GROUP_PAGES as u64;
    let (s, flusher) = gib_store_with_flusher(|c| c.mem_limit = Some(1));
    let committed = |g: u64| s.table.is_committed((g * group) as usize);
    wait_for("the spares", &|| s.table.memory().spares() == SPARE_SLOTS);
    let failed = s.write(60 * group * PAGE_SIZE as u64, &text(1)[..]);
    assert!(
        matches!(failed, Err(StoreError::NoSpace { .. })),
        "{failed:?}"
    );
    wait_for("group 60 given back", &|| !committed(60));
    drop(flusher);
}

#[test]
fn the_groups_after_one_in_use_stay_when_emptied_and_go_with_it() {
    use super::table_memory::GROUP_PAGES;
    let group = GROUP_PAGES as u64;
    let (s, flusher) = gib_store_with_flusher(|_| ());
    let committed = |g: u64| s.table.is_committed((g * group) as usize);
    // As swap: its header in page 0, then pages in groups 1..=9 and far away, in group 40.
    s.write(0, &text(0)[..]).unwrap();
    for g in (1..=9).chain([40]) {
        s.write(g * group * PAGE_SIZE as u64, &text(g)[..]).unwrap();
    }
    s.flush_pending().unwrap();
    // Everything but the header discarded (`swapon -d`): group 40 goes back, and group 9,
    // beyond the eight after group 0, and once writes stopped, groups 10..=17, 41 and 48,
    // asked for ahead and never written; groups 1..=8 stay for the next writes.
    s.discard(PAGE_SIZE as u64, (1 << 30) - PAGE_SIZE as u64)
        .unwrap();
    wait_for("groups 9 and 40 given back", &|| {
        !committed(9) && !committed(40)
    });
    wait_for("the groups no write reached given back", &|| {
        !(10..=17).chain([41, 48]).any(committed)
    });
    std::thread::sleep(std::time::Duration::from_millis(600));
    assert!((0..=8).all(committed), "group 0 and the eight after it");
    // The header goes too: so do they.
    s.discard(0, PAGE_SIZE as u64).unwrap();
    wait_for("groups 0..=8 given back", &|| !(0..=8).any(committed));
    drop(flusher);
}

/// Groups placed in spare slots (not their own), and one in the slot another group left, are
/// found again by a resumed store through the group map; the spares are spares again.
#[test]
fn a_resumed_store_finds_groups_in_the_slots_they_took_and_gives_spares_back() {
    use super::table_memory::GROUP_PAGES;
    let group = GROUP_PAGES as u64;
    let (key, backing) = fresh_shared_backing(0x7a20_0000);
    let config = || refilled_config(16 * group * PAGE_SIZE as u64);
    let kept = [9 * group + 1, 14 * group + 2, 3 * group + 3];
    {
        let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
        assert_eq!(opened, Opened::Fresh);
        let flusher = s.start_flusher(|_| ()).unwrap();
        let spares = super::table_memory::SPARE_SLOTS as u64 * (28 << 10);
        wait_for("the spares", &|| s.table.bytes() == spares);
        // Group 6 takes a spare slot, is emptied and goes: its slot a spare again.
        s.write(6 * group * PAGE_SIZE as u64, &text(6)[..]).unwrap();
        s.flush_pending().unwrap();
        s.discard(6 * group * PAGE_SIZE as u64, PAGE_SIZE as u64)
            .unwrap();
        wait_for("group 6 given back", &|| {
            !s.table.is_committed(6 * group as usize)
        });
        for &i in &kept {
            s.write(i * PAGE_SIZE as u64, &text(i)[..]).unwrap();
        }
        s.flush_pending().unwrap();
        wait_for("the spares taken replaced", &|| {
            s.table.memory().spares() == super::table_memory::SPARE_SLOTS
        });
        drop(flusher);
    }
    let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 3, lost: 0 });
    let mut buf = vec![0u8; PAGE_SIZE];
    for &i in &kept {
        s.read(i * PAGE_SIZE as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &text(i)[..], "page {i}");
    }
    for g in [0, 6, 9, 14] {
        s.read((g * group + 4) * PAGE_SIZE as u64, &mut buf)
            .unwrap();
        assert!(buf.iter().all(|&b| b == 0), "group {g}");
    }
    // The groups written and some of those asked for ahead of writes (the next and the
    // eighth after each written, where there is one), nothing else, and the spares, spare
    // again.
    let committed: Vec<u64> = (0..16)
        .filter(|&g| s.table.is_committed((g * group) as usize))
        .collect();
    assert!(
        [3, 9, 14].iter().all(|g| committed.contains(g))
            && committed
                .iter()
                .all(|g| [3, 4, 7, 9, 10, 11, 14, 15].contains(g)),
        "{committed:?}"
    );
    let spares = s.table.memory().spares();
    assert_eq!(spares, super::table_memory::SPARE_SLOTS);
    assert_eq!(
        s.table.bytes(),
        (committed.len() + spares) as u64 * (28 << 10)
    );
    drop(s);
    crate::mem::Segment::remove_shared(key).unwrap();
}

#[test]
fn a_resumed_store_finds_the_table_groups_it_used_and_no_others() {
    use super::table_memory::GROUP_PAGES;
    let group = GROUP_PAGES as u64;
    let (key, backing) = fresh_shared_backing(0x7a10_0000);
    let config = || {
        crate::config::StoreSettings::default().store_config(6 * group * PAGE_SIZE as u64, false)
    };
    let written = [3, 5 * group + 7];
    {
        let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
        assert_eq!(opened, Opened::Fresh);
        for &i in &written {
            s.write(i * PAGE_SIZE as u64, &text(i)[..]).unwrap();
        }
        s.flush_pending().unwrap();
    }
    let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 2, lost: 0 });
    assert_eq!(s.table.bytes(), 2 * (28 << 10), "groups 0 and 5");
    let mut buf = vec![0u8; PAGE_SIZE];
    for &i in &written {
        s.read(i * PAGE_SIZE as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &text(i)[..], "page {i}");
    }
    s.read(2 * group * PAGE_SIZE as u64, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    drop(s);
    crate::mem::Segment::remove_shared(key).unwrap();
}

/// A page of `i`: incompressible for even `i`, else text with 0 to 3,900 bytes of noise, so
/// that its compressed copy may fall in any size class.
fn mixed_page(i: u64) -> Box<Page> {
    if i.is_multiple_of(2) {
        return noise(i);
    }
    let mut p = text(2 * i + 1);
    let noisy = (i % 40) as usize * 100;
    p[..noisy].copy_from_slice(&noise(i)[..noisy]);
    p
}

#[test]
fn fills_of_every_size_discarded_again_and_again_carve_no_more_than_the_first() {
    let target = 1u64 << 20;
    let (s, flusher) = store_with_reserve(target);
    let n = 6_000u64;
    let mut carved = Vec::new();
    for round in 0..4u64 {
        for i in 0..n {
            s.write(i * PAGE_SIZE as u64, &mixed_page(i + round * 7919)[..])
                .unwrap();
        }
        s.flush_pending().unwrap();
        s.discard(0, n * PAGE_SIZE as u64).unwrap();
        await_reserve_within(&s, target, std::time::Duration::from_secs(5));
        carved.push(s.alloc.reserve.arena().carved());
    }
    // Every size's chunks come from the pages the others gave back: the arena (and the map
    // of its cold pages) stops growing once it has held one fill.
    let slack = 64 * 8 * PAGE_SIZE; // a commit group for each size
    assert!(
        carved[3] <= carved[0] + slack,
        "carved by round: {carved:?}"
    );
    drop(flusher);
}

/// Whether a slot of a pending batch past the quiet ones has memory.
fn batch_tails_in_memory(s: &BatchedPageStore) -> bool {
    use super::pending::QUIET_SLOTS;
    s.batches
        .iter()
        .any(|b| b.slots_in_memory(QUIET_SLOTS..b.capacity()))
}

#[test]
fn the_pending_batches_hold_memory_for_every_slot_only_while_writes_come() {
    use super::pending::QUIET_SLOTS;
    let (s, flusher) = store_with_reserve(1 << 20);
    let capacity = s.batches[0].capacity();
    let tails_in_memory = || batch_tails_in_memory(&s);
    let quiet_bytes = (2 * (QUIET_SLOTS * PAGE_SIZE + capacity * 8)) as u64;
    assert_eq!(s.stats().batch_buffer_bytes, quiet_bytes);
    assert!(
        !tails_in_memory(),
        "a fresh store commits the quiet slots only"
    );
    let n = 3_000u64;
    let write_all = |round: u64| {
        for i in 0..n {
            s.write(i * PAGE_SIZE as u64, &text(i + round)[..]).unwrap();
        }
    };
    let read_all = |round: u64| {
        assert_pages_read_back(&s, 0..n, |i| text(i + round), &format!("round {round}"));
    };
    for round in 0..2u64 {
        // A burst fills quiet batches: the refill thread commits every slot, and batches open
        // whole.
        let grows = s.stats().batch_span_grows;
        while s.stats().batch_span_grows == grows {
            write_all(round);
        }
        write_all(round);
        assert!(tails_in_memory());
        read_all(round);
        // Quiet for a second: back to the quiet slots, the rest given back.
        let shrinks = s.stats().batch_span_shrinks;
        wait_for("the batches shrink", &|| {
            s.stats().batch_span_shrinks > shrinks
        });
        assert!(!tails_in_memory());
        assert_eq!(s.stats().batch_buffer_bytes, quiet_bytes);
        read_all(round);
    }
    drop(flusher);
}

#[test]
fn batches_grow_though_a_flush_holds_the_flush_mutex_whenever_the_refill_thread_looks() {
    use super::pending::QUIET_SLOTS;
    // No refill thread: this test plays it (`provide_batches`), so nothing races it.
    let mut c = crate::config::StoreSettings::default().store_config(1 << 30, false);
    c.reserve_bytes = 1 << 20;
    let s = store(c);
    let n = QUIET_SLOTS as u64;
    let write_and_check = |pages: u64, round: u64| {
        write_pages_and_flush(&s, 0..pages, |i| text(i + round));
        assert_pages_read_back(&s, 0..pages, |i| text(i + round), &format!("round {round}"));
    };
    write_and_check(n, 0);
    {
        // A flush that never ends, as when flushes follow each other back to back.
        let _flush = s.flush.lock();
        s.provide_batches();
        assert!(s.span.is_offered(), "the whole span offered");
        assert_eq!(
            s.span.slots(),
            QUIET_SLOTS,
            "whole only once the offer is taken"
        );
    }
    // The next flush takes it.
    write_and_check(1, 1);
    assert_eq!(s.stats().batch_span_grows, 1);
    assert!(s.span.is_whole() && !s.span.is_offered());
    write_and_check(4 * n, 2);
}

#[test]
fn writers_racing_the_batches_growing_and_shrinking_keep_their_data() {
    super::pending::QUIET_AFTER_FOR_TESTS
        .with(|q| q.set(Some(std::time::Duration::from_millis(3))));
    let (s, flusher) = store_with_reserve(1 << 20);
    super::pending::QUIET_AFTER_FOR_TESTS.with(|q| q.set(None));
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; PAGE_SIZE];
                for round in 0..40u64 {
                    // Bursts of 1 to 200 pages, then a pause around the quiet spell.
                    let pages = 1 + (round * 37 + w * 11) % 200;
                    for p in 0..pages {
                        let i = w * 1_000 + p;
                        s.write(i * PAGE_SIZE as u64, &text(i * 97 + round)[..])
                            .unwrap();
                    }
                    for p in 0..pages {
                        let i = w * 1_000 + p;
                        s.read(i * PAGE_SIZE as u64, &mut buf).unwrap();
                        assert_eq!(
                            &buf[..],
                            &text(i * 97 + round)[..],
                            "round {round} page {i}"
                        );
                    }
                    // Both writers pause alike: from none to a few refill passes.
                    std::thread::sleep(std::time::Duration::from_millis((round % 4) * 40));
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    let st = s.stats();
    assert!(
        st.batch_span_grows > 2 && st.batch_span_shrinks > 2,
        "grows {} shrinks {}",
        st.batch_span_grows,
        st.batch_span_shrinks
    );
    drop(flusher);
}

#[test]
fn a_resumed_store_gives_back_the_batch_slots_its_predecessor_grew() {
    let (key, backing) = fresh_shared_backing(0x7a30_0000);
    let config = || refilled_config(64 << 20);
    let n = 2_000u64;
    {
        let (s, _) = BatchedPageStore::open(config(), None, backing).unwrap();
        let flusher = s.start_flusher(|_| ()).unwrap();
        while s.stats().batch_span_grows == 0 {
            for i in 0..n {
                s.write(i * PAGE_SIZE as u64, &text(i)[..]).unwrap();
            }
        }
        assert!(batch_tails_in_memory(&s));
        drop(flusher);
    }
    let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
    assert!(
        matches!(opened, Opened::Resumed { lost: 0, .. }),
        "{opened:?}"
    );
    assert!(!batch_tails_in_memory(&s));
    assert_pages_read_back(&s, 0..n, text, "");
    drop(s);
    crate::mem::Segment::remove_shared(key).unwrap();
}

#[test]
fn while_a_write_waits_for_memory_the_refill_thread_faults_in_nothing_ahead_of_need() {
    // No refill thread: this test plays it (`provide`).
    let mut c = crate::config::StoreSettings::default().store_config(1 << 30, false);
    c.reserve_bytes = 1 << 20;
    let s = store(c);
    let room = || s.alloc.list_capacities();
    let spares = || s.table.memory().spares();
    write_pages_and_flush(&s, 0..64u64, text);
    // A class whose lists are full: a new chunk of it would wait for room.
    let full = s.alloc.leave_an_unused_class_without_room().unwrap();
    let (room_before, spares_before) = (room(), spares());
    assert!(spares_before < super::table_memory::SPARE_SLOTS);
    s.alloc.reserve.note_waiting();
    assert!(!s.may_provide_ahead());
    s.provide();
    let waiting = room();
    for (class, (&before, &now)) in room_before.iter().zip(&waiting).enumerate() {
        if class == full {
            assert!(now > before, "the full class's lists grew");
        } else {
            assert_eq!(now, before, "class {class} grew ahead of need");
        }
    }
    assert_eq!(spares(), spares_before, "no spare table group committed");
    // Once nobody waits, everything is provided ahead again.
    s.alloc.reserve.note_served();
    assert!(s.may_provide_ahead());
    s.provide();
    assert_eq!(spares(), super::table_memory::SPARE_SLOTS);
    assert!(room().iter().zip(&waiting).any(|(now, then)| now > then));
}

/// The backend's and the short-memory codec's page counts are of pages compressed: a
/// pending page discarded before its flush is not compressed, nor counted (near OOM most of
/// a killed program's pending pages are).
#[test]
fn pages_discarded_while_pending_are_not_counted_as_compressed() {
    let s =
        store(crate::config::StoreSettings::default().store_config(64 * PAGE_SIZE as u64, false));
    s.set_memory_short(true);
    for i in 0..16u64 {
        s.write(i * PAGE_SIZE as u64, &text(i)[..]).unwrap();
    }
    for i in (0..16u64).step_by(2) {
        s.discard(i * PAGE_SIZE as u64, PAGE_SIZE as u64).unwrap();
    }
    s.flush_pending().unwrap();
    let stats = s.stats();
    assert_eq!(stats.pages_simd + stats.pages_simd_parallel, 8);
    assert_eq!(stats.short_memory_pages, 8);
    for i in (1..16u64).step_by(2) {
        assert_eq!(read_page_back(&s, i)[..], text(i)[..]);
    }
}

#[test]
fn sizes_the_store_cannot_index_are_refused_before_anything_is_made() {
    let page = PAGE_SIZE as u64;
    assert!(check_size(0).is_err());
    assert!(check_size(page - 1).is_err());
    assert!(check_size(page + 1).is_err());
    assert_eq!(check_size(page).ok(), Some(1));
    let most = u64::from(u32::MAX) * page;
    assert_eq!(check_size(most).ok(), usize::try_from(u32::MAX).ok());
    let error = check_size(most + page).expect_err("2^32 pages").to_string();
    assert!(error.contains("less than 16 TiB"), "{error}");
}

#[test]
fn a_pending_page_of_a_table_group_being_given_back_is_still_flushed() {
    // The refill thread's `retire` reads a group's entries without locks, finds them empty,
    // and only then marks the group retiring: a write may land in between. Until `retire`
    // locks its way to that entry and keeps the group, a flush must not take the page for
    // one freed meanwhile.
    let s =
        store(crate::config::StoreSettings::default().store_config(64 * PAGE_SIZE as u64, false));
    s.write(0, &text(1)[..]).unwrap();
    let group = TableMemory::group_of(0);
    assert!(
        s.table.memory().begin_retire(group),
        "the group is retiring"
    );
    std::thread::scope(|scope| {
        let flush = scope.spawn(|| s.flush_pending());
        // Long enough for the flush to reach the page; it waits for the group from there.
        std::thread::sleep(std::time::Duration::from_millis(100));
        s.table.memory().keep(group);
        flush.join().unwrap().unwrap();
    });
    let st = s.stats();
    assert_eq!((st.pages_stored, st.pending_pages), (1, 0));
    // The batch is open again: the next pages take its slots.
    for i in 1..8u64 {
        s.write(i * PAGE_SIZE as u64, &text(10 + i)[..]).unwrap();
    }
    let mut buf = vec![0u8; PAGE_SIZE];
    s.read(0, &mut buf).unwrap();
    assert_eq!(&buf[..], &text(1)[..]);
}

/// Page `index` of the broken-word tests: text, incompressible noise or zeros.
fn broken_words_page(index: u64) -> Box<Page> {
    match index % 3 {
        0 => text(index),
        1 => noise(index),
        _ => Box::new([0u8; PAGE_SIZE]),
    }
}

/// A page's read, against what it held: the same data or an error, never other data.
fn assert_reads_as_was_or_fails(s: &BatchedPageStore, index: u64, was: &Page, what: &str) {
    let mut buf = vec![0u8; PAGE_SIZE];
    if s.read(index * PAGE_SIZE as u64, &mut buf).is_ok() {
        let first = buf.iter().zip(was.iter()).position(|(a, b)| a != b);
        assert!(
            first.is_none(),
            "page {index} read other data (first at byte {first:?}): {what}"
        );
    }
}

/// Every bit of a served page's entry flipped in turn (a bit flipped in RAM), for pages of
/// every kind an entry holds: stored compressed and raw, same-filled with zeros and with
/// another word, pending, empty. Each read returns the page as it was or fails (EIO, counted),
/// never other data: a same-filled page has no memory but its entry. (Not the lock bit: a
/// page whose lock bit flipped makes its readers wait for a lock nobody holds.)
#[test]
fn a_bit_flipped_in_an_entry_reads_as_an_error_never_as_other_data() {
    let mut c = layout_test_config();
    c.recompress = None;
    // Page 5 stays pending: no batch fills, no deadline comes.
    c.batch_threshold = 64;
    c.flush_timeout = std::time::Duration::from_secs(3600);
    let s = store(c);
    let mut same = Box::new([0u8; PAGE_SIZE]);
    crate::codec::fill_page(&mut same[..], 0xdead_beef);
    let pages: Vec<Box<Page>> = vec![
        text(1),
        noise(2),
        Box::new([0u8; PAGE_SIZE]),
        same,
        Box::new([0u8; PAGE_SIZE]),
        text(5),
    ];
    for (i, page) in pages.iter().enumerate().take(4) {
        s.write(i as u64 * PAGE_SIZE as u64, &page[..]).unwrap();
    }
    s.flush_pending().unwrap();
    s.write(5 * PAGE_SIZE as u64, &pages[5][..]).unwrap();
    let kinds: Vec<PageState> = (0..6).map(|i| s.table.lock(i).unwrap().state()).collect();
    assert!(
        matches!(kinds[0], PageState::Stored { encoding, .. } if encoding != Encoding::Raw),
        "{kinds:?}"
    );
    assert!(
        matches!(
            kinds[1],
            PageState::Stored {
                encoding: Encoding::Raw,
                ..
            }
        ),
        "{kinds:?}"
    );
    assert_eq!(kinds[2], PageState::Same(0));
    assert_eq!(kinds[3], PageState::Same(0xdead_beef));
    assert_eq!(kinds[4], PageState::Empty);
    assert!(matches!(kinds[5], PageState::Pending { .. }), "{kinds:?}");
    let mut failed = 0;
    for (index, was) in pages.iter().enumerate() {
        let entry = s.table.entry_word(index).unwrap();
        for bit in 0..63 {
            entry.fetch_xor(1 << bit, Ordering::Relaxed);
            let before = s.stats().failed_reads;
            assert_reads_as_was_or_fails(
                &s,
                index as u64,
                was,
                &format!("bit {bit} flipped in its entry ({:?})", kinds[index]),
            );
            failed += s.stats().failed_reads - before;
            entry.fetch_xor(1 << bit, Ordering::Relaxed);
        }
        assert_reads_as_was_or_fails(&s, index as u64, was, "its entry whole again");
    }
    // Most flips are caught, not harmless: the kind's bits, a same-filled page's word, a
    // stored page's place and length.
    assert!(failed > 200, "{failed} of 378 flipped reads failed");
    assert!(s.stats().checksum_failures > 0);
}

/// A store resumed from a segment with words broken anywhere in the memory it holds (its
/// header, table, checksums, slot indexes, pending slots or objects: a bit flipped in RAM
/// while no process served it, or a word a predecessor's bug wrote) never panics: `open`
/// refuses it, or each page whose own entry is intact reads back as it was or fails its
/// read; and the store then takes new writes and reads each back as written, or fails it.
/// (A page whose own entry broke before the resume may read as other data: the resume sets
/// every entry's check from its word, see `table`.)
#[test]
fn a_resumed_store_with_broken_words_never_panics_or_reads_other_data() {
    const PAGES: u64 = 48;
    let (key, backing) = fresh_shared_backing(0x7b30_0000);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut refused = 0;
    for case in 0..40 {
        let entries: Vec<u64> = {
            let (s, _) = BatchedPageStore::open(layout_test_config(), None, backing).unwrap();
            for i in 0..PAGES {
                s.write(i * PAGE_SIZE as u64, &broken_words_page(i)[..])
                    .unwrap();
            }
            s.flush_pending().unwrap();
            (0..PAGES as usize)
                .map(|i| {
                    s.table
                        .entry_word(i)
                        .map_or(0, |w| w.load(Ordering::Relaxed))
                })
                .collect()
        };
        let segment = crate::mem::Segment::attach_shared(key).unwrap().unwrap();
        let held: Vec<usize> = (0..segment.len() / crate::mem::HOST_PAGE)
            .map(|page| page * crate::mem::HOST_PAGE)
            .filter(|&offset| {
                segment
                    .any_in_memory(offset, crate::mem::HOST_PAGE)
                    .unwrap()
            })
            .collect();
        // Words in use: the header, table, checksums and slot indexes in the first pages,
        // then the pending batches' slots and the chunks' objects. Most breaks go there.
        let in_use: Vec<usize> = held
            .iter()
            .flat_map(|&page| {
                let words = segment.words(page, crate::mem::HOST_PAGE / 8).unwrap();
                (0..words.len())
                    .filter(|&i| words[i].load(Ordering::Relaxed) != 0)
                    .map(|i| page + i * 8)
                    .collect::<Vec<_>>()
            })
            .collect();
        let metadata: Vec<usize> = in_use
            .iter()
            .copied()
            .filter(|&o| o < 10 * crate::mem::HOST_PAGE)
            .collect();
        let pick = |list: &[usize], n: u64| list[(n % list.len() as u64) as usize];
        let mut broken = Vec::new();
        for _ in 0..1 + next() % 3 {
            let offset = match next() % 10 {
                0..=5 => pick(&metadata, next()),
                6..=8 => pick(&in_use, next()),
                _ => {
                    pick(&held, next()) + (next() % (crate::mem::HOST_PAGE as u64 / 8)) as usize * 8
                }
            };
            let word = segment.words(offset, 1).unwrap();
            let old = word[0].load(Ordering::Relaxed);
            let new = match next() % 4 {
                0 | 1 => old ^ (1 << (next() % 64)),
                2 => next(),
                _ => 0,
            };
            word[0].store(new, Ordering::Relaxed);
            broken.push((offset, old, new));
        }
        drop(segment);
        let what = format!("case {case}: words broken (offset, was, now): {broken:x?}");
        match BatchedPageStore::open(layout_test_config(), None, backing) {
            Err(_) => refused += 1,
            Ok((s, _)) => {
                for i in 0..PAGES {
                    let intact = s
                        .table
                        .entry_word(i as usize)
                        .map_or(0, |w| w.load(Ordering::Relaxed))
                        == entries[i as usize];
                    if intact {
                        assert_reads_as_was_or_fails(&s, i, &broken_words_page(i), &what);
                    }
                }
                for i in 0..PAGES {
                    let _ = s.write(i * PAGE_SIZE as u64, &broken_words_page(i + 7)[..]);
                }
                let _ = s.flush_pending();
                for i in 0..PAGES {
                    assert_reads_as_was_or_fails(
                        &s,
                        i,
                        &broken_words_page(i + 7),
                        &format!("rewritten, {what}"),
                    );
                }
            }
        }
        crate::mem::Segment::remove_shared(key).unwrap();
    }
    assert!(refused < 40, "every broken store was refused");
}

/// A store last served by a binary before the entry checks, which left a stored page's
/// checksum beside each entry it emptied (in the groups it kept and in its spare slots), is
/// resumed with every empty page reading as zeros: in a group it kept, and in a group a
/// write places in a spare slot after the resume.
#[test]
fn empty_pages_read_as_zeros_after_a_binary_before_the_entry_checks() {
    use super::table_memory::GROUP_PAGES;
    let group = GROUP_PAGES as u64;
    let (key, backing) = fresh_shared_backing(0x7b40_0000);
    let config = || refilled_config(16 * group * PAGE_SIZE as u64);
    {
        let (s, _) = BatchedPageStore::open(config(), None, backing).unwrap();
        let flusher = s.start_flusher(|_| ()).unwrap();
        let spares = super::table_memory::SPARE_SLOTS as u64 * (28 << 10);
        wait_for("the spares", &|| s.table.bytes() == spares);
        s.write(3 * group * PAGE_SIZE as u64, &text(3)[..]).unwrap();
        s.flush_pending().unwrap();
        // Beside every entry but the stored page's.
        for word in s.table.checksum_words() {
            if word.load(Ordering::Relaxed) == 0 {
                word.store(0x5eed_1e55, Ordering::Relaxed);
            }
        }
        drop(flusher);
    }
    let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 1, lost: 0 });
    let flusher = s.start_flusher(|_| ()).unwrap();
    // Group 13 was never written, nor asked for ahead of writes: a write places it in a
    // spare slot.
    s.write(13 * group * PAGE_SIZE as u64, &text(13)[..])
        .unwrap();
    s.flush_pending().unwrap();
    let mut buf = vec![0u8; PAGE_SIZE];
    for page in [
        3 * group + 1,
        3 * group + 100,
        13 * group + 1,
        13 * group + 200,
    ] {
        s.read(page * PAGE_SIZE as u64, &mut buf)
            .unwrap_or_else(|error| panic!("page {page}: {error}"));
        assert!(buf.iter().all(|&b| b == 0), "page {page}");
    }
    for page in [3 * group, 13 * group] {
        s.read(page * PAGE_SIZE as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &text(page / group)[..], "page {page}");
    }
    assert_eq!(s.stats().checksum_failures, 0);
    drop(flusher);
    drop(s);
    crate::mem::Segment::remove_shared(key).unwrap();
}

/// The places of a table slot past the device's last page (in the last group's slot), which
/// no group of a process uses, keep what a binary before the entry checks left there: once the
/// slot is a spare and a whole group takes it, its empty pages there read as zeros.
#[test]
fn a_spare_slot_from_the_last_group_reads_as_zeros_in_every_place() {
    use super::table_memory::{TableMemory, GROUP_PAGES};
    let group = GROUP_PAGES as u64;
    let (key, backing) = fresh_shared_backing(0x7b50_0000);
    let config = || {
        crate::config::StoreSettings::default()
            .store_config((4 * group + 5) * PAGE_SIZE as u64, false)
    };
    {
        let (s, _) = BatchedPageStore::open(config(), None, backing).unwrap();
        s.write(4 * group * PAGE_SIZE as u64, &text(4)[..]).unwrap();
        s.flush_pending().unwrap();
        // Place 100 of group 4's slot: past the device's last page.
        let at = TableMemory::place(s.table.memory().word(4), 100);
        s.table.checksum_words()[at].store(0x5eed_1e55, Ordering::Relaxed);
    }
    let (s, _) = BatchedPageStore::open(config(), None, backing).unwrap();
    s.discard(4 * group * PAGE_SIZE as u64, PAGE_SIZE as u64)
        .unwrap();
    assert!(s.table.retire(4).unwrap(), "group 4 given back");
    assert!(s.table.memory().take_spare(1), "group 1 takes its slot");
    let mut buf = vec![0u8; PAGE_SIZE];
    s.read((group + 100) * PAGE_SIZE as u64, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    drop(s);
    crate::mem::Segment::remove_shared(key).unwrap();
}

/// A store of layout version 4 (group `g` in slot `g`) whose last process was killed giving a
/// group back, its entries punched and its checks not (those of a binary before the entry
/// checks: stored pages' checksums): the resume gives the rest back too, so the group,
/// committed again by a write, reads as zeros where nothing was written.
#[test]
fn a_group_half_given_back_by_a_killed_process_reads_as_zeros_when_committed_again() {
    use super::table_memory::GROUP_PAGES;
    let group = GROUP_PAGES as u64;
    let (key, backing) = fresh_shared_backing(0x7b60_0000);
    let config = || {
        crate::config::StoreSettings::default().store_config(4 * group * PAGE_SIZE as u64, false)
    };
    layout::LAYOUT_FOR_TESTS.with(|version| version.set(4));
    {
        let (s, _) = BatchedPageStore::open(config(), None, backing).unwrap();
        s.write(2 * group * PAGE_SIZE as u64, &text(2)[..]).unwrap();
        s.flush_pending().unwrap();
        for word in s.table.checksum_words() {
            word.store(0x5eed_1e55, Ordering::Relaxed);
        }
        s.table.memory().punch_entries_only(2).unwrap();
    }
    layout::LAYOUT_FOR_TESTS.with(|version| version.set(layout::LAYOUT_VERSION));
    let (s, opened) = BatchedPageStore::open(config(), None, backing).unwrap();
    assert_eq!(opened, Opened::Resumed { pages: 0, lost: 0 });
    s.write((2 * group + 1) * PAGE_SIZE as u64, &text(3)[..])
        .unwrap();
    s.flush_pending().unwrap();
    let mut buf = vec![0u8; PAGE_SIZE];
    s.read((2 * group + 100) * PAGE_SIZE as u64, &mut buf)
        .unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    drop(s);
    crate::mem::Segment::remove_shared(key).unwrap();
}
