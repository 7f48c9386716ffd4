//! Codecs: every backend decodes every other backend's output; corrupt or truncated input is
//! an error, never a panic or a short page.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]

mod store_common;

use proptest::prelude::*;
use store_common::{page_of_kind, FakeGpu, Rng};
use trueno_ublk::codec::{
    classify, decompress_page, Algorithm, BatchCodec, CodecError, CompressedBatch, CpuCodec,
    Encoding, Page, PageClass, PAGE_SIZE,
};

fn pages(n: u64) -> Vec<Box<Page>> {
    // Kinds 2..5: text, random, mixed (same-filled pages never reach a codec).
    (0..n).map(|i| page_of_kind(2 + i % 3, i)).collect()
}

fn codecs(algorithm: Algorithm) -> Vec<(&'static str, Box<dyn BatchCodec>)> {
    let mut v: Vec<(&'static str, Box<dyn BatchCodec>)> = vec![
        ("simd", Box::new(CpuCodec::single(algorithm))),
        ("simd-parallel", Box::new(CpuCodec::parallel(algorithm))),
    ];
    if algorithm == Algorithm::Lz4 {
        v.push(("gpu-stand-in", Box::new(FakeGpu::working())));
    }
    v
}

#[test]
fn every_backend_decodes_every_other_backends_output() {
    let input = pages(300);
    let refs: Vec<&Page> = input.iter().map(|p| &**p).collect();
    for algorithm in [
        Algorithm::Lz4,
        Algorithm::Zstd { level: 5 },
        Algorithm::Adaptive,
    ] {
        let codecs = codecs(algorithm);
        for (enc_name, encoder) in &codecs {
            let mut out = CompressedBatch::default();
            encoder.compress_batch(&refs, &mut out).unwrap();
            assert!(out.is_well_formed(refs.len()), "{enc_name}");
            let inputs: Vec<(Encoding, &[u8])> = (0..out.len()).map(|i| out.page(i)).collect();
            for (dec_name, decoder) in &codecs {
                let mut back = vec![[0u8; PAGE_SIZE]; refs.len()];
                let mut status = vec![Err(CodecError::Corrupt); refs.len()];
                decoder.decompress_batch(&inputs, &mut back, &mut status);
                for (i, (got, st)) in back.iter().zip(&status).enumerate() {
                    assert_eq!(st, &Ok(()), "{algorithm:?} {enc_name}->{dec_name} page {i}");
                    assert!(
                        got == &*input[i],
                        "{algorithm:?} {enc_name}->{dec_name} page {i}"
                    );
                }
            }
            // And the per-page decoder the store's read path uses.
            let mut page = [0u8; PAGE_SIZE];
            for (i, (enc, bytes)) in inputs.iter().enumerate() {
                decompress_page(*enc, bytes, &mut page).unwrap();
                assert!(page == *input[i]);
            }
        }
    }
}

#[test]
fn single_and_parallel_produce_the_same_bytes() {
    let input = pages(257);
    let refs: Vec<&Page> = input.iter().map(|p| &**p).collect();
    let (mut a, mut b) = (CompressedBatch::default(), CompressedBatch::default());
    CpuCodec::single(Algorithm::Adaptive)
        .compress_batch(&refs, &mut a)
        .unwrap();
    CpuCodec::parallel(Algorithm::Adaptive)
        .compress_batch(&refs, &mut b)
        .unwrap();
    for i in 0..refs.len() {
        assert_eq!(a.page(i), b.page(i), "page {i}");
    }
}

#[test]
fn truncated_and_corrupted_pages_are_errors() {
    let input = pages(60);
    let refs: Vec<&Page> = input.iter().map(|p| &**p).collect();
    let mut rng = Rng(42);
    let mut out_page = [0u8; PAGE_SIZE];
    for algorithm in [Algorithm::Lz4, Algorithm::Zstd { level: 3 }] {
        let mut out = CompressedBatch::default();
        CpuCodec::single(algorithm)
            .compress_batch(&refs, &mut out)
            .unwrap();
        let mut detected = 0;
        let mut tried = 0;
        for i in 0..out.len() {
            let (enc, bytes) = out.page(i);
            // Every truncation of a compressed page is an error: the page is then short.
            for cut in [0, 1, bytes.len() / 2, bytes.len().saturating_sub(1)] {
                if cut < bytes.len() {
                    assert!(
                        decompress_page(enc, &bytes[..cut], &mut out_page).is_err(),
                        "{algorithm:?} page {i} truncated to {cut} of {} decoded",
                        bytes.len()
                    );
                }
            }
            // Random corruption: never a panic; an Ok result is a whole page, every byte of
            // it written (the buffer is filled with two sentinels in turn: a byte the decoder
            // left alone keeps the sentinel, which cannot match both times).
            for _ in 0..50 {
                let mut bad = bytes.to_vec();
                for _ in 0..1 + rng.next() % 4 {
                    let at = (rng.next() % bad.len() as u64) as usize;
                    bad[at] ^= 1 + (rng.next() % 255) as u8;
                }
                tried += 1;
                out_page.fill(0x5a);
                match decompress_page(enc, &bad, &mut out_page) {
                    Ok(()) => {
                        let first = out_page;
                        out_page.fill(0xa5);
                        decompress_page(enc, &bad, &mut out_page).unwrap();
                        assert_eq!(
                            out_page, first,
                            "{algorithm:?} page {i}: bytes left unwritten"
                        );
                    }
                    Err(_) => detected += 1,
                }
            }
        }
        // LZ4 has no checksum, so some corruptions decode to other data (the store cannot
        // tell either); most must still be caught as malformed.
        assert!(
            detected * 4 > tried,
            "{algorithm:?}: only {detected} of {tried} detected"
        );
    }
}

#[test]
fn wrong_encoding_is_an_error_or_a_full_page() {
    let input = pages(20);
    let mut out = [0u8; PAGE_SIZE];
    for (i, p) in input.iter().enumerate() {
        let mut c = CompressedBatch::default();
        CpuCodec::single(Algorithm::Lz4)
            .compress_batch(&[&**p], &mut c)
            .unwrap();
        let (enc, bytes) = c.page(0);
        if enc == Encoding::Lz4 {
            assert!(
                decompress_page(Encoding::Zstd, bytes, &mut out).is_err(),
                "page {i}"
            );
            assert!(
                decompress_page(Encoding::Raw, bytes, &mut out).is_err(),
                "page {i}"
            );
        }
    }
}

#[test]
fn classify_finds_same_filled_pages_only() {
    assert_eq!(classify(&page_of_kind(0, 1)), PageClass::SameFilled(0));
    let same = page_of_kind(1, 5);
    assert!(matches!(classify(&same), PageClass::SameFilled(w) if w != 0));
    for kind in 2..5 {
        assert_eq!(classify(&page_of_kind(kind, 3)), PageClass::Data);
    }
    let mut almost = page_of_kind(1, 5);
    almost[2048] ^= 0x80;
    assert_eq!(classify(&almost), PageClass::Data);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..5000), enc in 0u8..3) {
        let enc = Encoding::from_bits(enc).unwrap();
        let mut out = [0u8; PAGE_SIZE];
        if decompress_page(enc, &bytes, &mut out).is_ok() && enc == Encoding::Raw {
            prop_assert_eq!(&out[..], &bytes[..]);
        }
    }
}
