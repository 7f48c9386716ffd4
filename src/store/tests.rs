//! Unit tests that need the store's insides: corruption of stored bytes, allocator overhead.

#![forbid(unsafe_code)]

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

#[test]
fn corrupt_stored_page_fails_only_its_read() {
    for algorithm in [Algorithm::Lz4, Algorithm::Zstd { level: 3 }] {
        let mut c =
            crate::config::StoreSettings::default().store_config(64 * PAGE_SIZE as u64, false);
        c.algorithm = algorithm;
        let s = store(c);
        for i in 0..8u64 {
            s.write(i * PAGE_SIZE as u64, &text(i)[..]).unwrap();
        }
        s.flush_pending().unwrap();
        assert!(s.corrupt_stored_page(3, 0xff));
        let mut buf = vec![0u8; PAGE_SIZE];
        let err = s.read(3 * PAGE_SIZE as u64, &mut buf).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { page: 3, .. }), "{err}");
        assert_eq!(err.errno(), -libc::EIO);
        assert_eq!(s.stats().failed_reads, 1);
        for i in (0..8u64).filter(|&i| i != 3) {
            s.read(i * PAGE_SIZE as u64, &mut buf).unwrap();
            assert_eq!(&buf[..], &text(i)[..]);
        }
        // Overwriting the corrupt page heals it.
        s.write(3 * PAGE_SIZE as u64, &text(33)[..]).unwrap();
        s.read(3 * PAGE_SIZE as u64, &mut buf).unwrap();
        assert_eq!(&buf[..], &text(33)[..]);
    }
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

#[test]
fn a_panicking_codec_loses_no_page_and_the_batch_is_reused_safely() {
    const PAGES: usize = 64;
    let pages = PAGES as u64;
    let mut c =
        crate::config::StoreSettings::default().store_config(4 * pages * PAGE_SIZE as u64, false);
    c.algorithm = Algorithm::Lz4;
    c.batch_threshold = PAGES;
    c.forced_backend = Some(Backend::Gpu);
    let codec = Arc::new(PanickingCodec {
        calls: std::sync::atomic::AtomicUsize::new(0),
        calls_before: 1,
    });
    let s = BatchedPageStore::new(c, Some(codec as Arc<dyn BatchCodec>)).unwrap();
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
