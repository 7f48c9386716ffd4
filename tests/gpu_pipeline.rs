//! `GpuCodec` with the kernels' CPU model in place of the device (`GpuCodec::on_cpu_model`), on
//! every machine: the pipeline over many chunks and slots, the contract of `BatchCodec`, stats,
//! and fault injection (an injected OOM, launch failure, copy and sync failures) proving that a
//! failed GPU batch loses no page.

mod gpu_support;

use std::sync::Arc;
use std::time::Duration;

use gpu_support::{assert_is_model_output, inputs, mixed_pages, refs, CpuReference, MAX_LZ4_LEN};
use trueno_ublk::codec::{BatchCodec, CodecError, CompressedBatch, Encoding, Page, PAGE_SIZE};
use trueno_ublk::gpu::{FaultPoint, GpuCodec, GpuConfig, FAILURES_BEFORE_REST};

/// Small chunks so that even small batches run through several chunks and every slot.
fn model_codec(chunk_pages: usize) -> GpuCodec {
    let config = GpuConfig {
        chunk_pages,
        max_compressed_len: MAX_LZ4_LEN,
        ..GpuConfig::default()
    };
    GpuCodec::on_cpu_model(config, Arc::new(CpuReference))
}

fn decompress_all(codec: &dyn BatchCodec, batch: &CompressedBatch) -> Vec<Page> {
    let inputs = inputs(batch);
    let mut out = vec![[0u8; PAGE_SIZE]; inputs.len()];
    let mut status = vec![Err(CodecError::Corrupt); inputs.len()];
    codec.decompress_batch(&inputs, &mut out, &mut status);
    for (i, st) in status.iter().enumerate() {
        assert_eq!(st, &Ok(()), "page {i}");
    }
    out
}

#[test]
fn round_trips_model_to_cpu_cpu_to_model_and_model_to_model() {
    let codec = model_codec(64);
    for (n, seed) in [(1, 1), (2, 2), (7, 3), (999, 4), (4096, 5)] {
        let pages = mixed_pages(n, seed);
        let mut gpu_batch = CompressedBatch::default();
        codec.compress_batch(&refs(&pages), &mut gpu_batch).unwrap();
        // Chunks are placed by index: checking every 5th page of the big batches still covers
        // every chunk and slot.
        assert_is_model_output(&pages, &gpu_batch, if n > 100 { 5 } else { 1 });
        assert_eq!(
            decompress_all(&CpuReference, &gpu_batch),
            pages,
            "GPU -> CPU, {n}"
        );
        assert_eq!(decompress_all(&codec, &gpu_batch), pages, "GPU -> GPU, {n}");

        let mut cpu_batch = CompressedBatch::default();
        CpuReference
            .compress_batch(&refs(&pages), &mut cpu_batch)
            .unwrap();
        assert_eq!(decompress_all(&codec, &cpu_batch), pages, "CPU -> GPU, {n}");
    }
    let stats = codec.stats();
    assert_eq!(stats.fallback_batches, 0);
    assert_eq!(stats.pages_compressed, 1 + 2 + 7 + 999 + 4096);
    assert!(stats.pages_decompressed > 0);
    let json = serde_json::to_string(&stats).unwrap();
    assert!(json.contains("\"pages_compressed\":5105"), "{json}");
}

#[test]
fn zstd_pages_go_to_the_cpu_and_bad_pages_get_their_own_status() {
    let codec = model_codec(16);
    let pages = mixed_pages(40, 7);
    let zstd_page = zstd::bulk::compress(&pages[0][..], 3).unwrap();
    let lz4_page = gpu_support::liblz4(&pages[1]);
    let truncated = &lz4_page[..lz4_page.len() / 2];
    let inputs: Vec<(Encoding, &[u8])> = vec![
        (Encoding::Zstd, &zstd_page),
        (Encoding::Lz4, &lz4_page),
        (Encoding::Lz4, truncated),
        (Encoding::Raw, &pages[3][..]),
        (Encoding::Raw, &pages[4][..100]),
        (Encoding::Lz4, &[0x10, b'a', 5, 0]),
    ];
    let mut out = vec![[0u8; PAGE_SIZE]; inputs.len()];
    let mut status = vec![Ok(()); inputs.len()];
    codec.decompress_batch(&inputs, &mut out, &mut status);
    assert_eq!(status[0], Ok(()));
    assert_eq!(out[0], pages[0]);
    assert_eq!(status[1], Ok(()));
    assert_eq!(out[1], pages[1]);
    assert!(status[2].is_err());
    assert_eq!(status[3], Ok(()));
    assert_eq!(out[3], pages[3]);
    assert_eq!(status[4], Err(CodecError::WrongLength(100)));
    assert_eq!(status[5], Err(CodecError::Corrupt));
    assert_eq!(codec.stats().fallback_batches, 0);
}

/// The store's side of the contract: a batch whose `compress_batch` fails is redone on the CPU.
fn compress_like_the_store(codec: &GpuCodec, pages: &[Page]) -> (CompressedBatch, bool) {
    let mut batch = CompressedBatch::default();
    match codec.compress_batch(&refs(pages), &mut batch) {
        Ok(()) => (batch, true),
        Err(e) => {
            assert!(matches!(e, CodecError::Gpu(_)), "{e:?}");
            CpuReference
                .compress_batch(&refs(pages), &mut batch)
                .unwrap();
            (batch, false)
        }
    }
}

#[test]
fn injected_faults_in_compression_fall_back_without_losing_pages() {
    let pages = mixed_pages(200, 8);
    // 200 pages in chunks of 24: 9 chunks over 3 slots. Fail the first allocation (OOM), or
    // the third chunk's copy in / launch / copy out / wait, with earlier chunks in flight.
    let cases = [
        (FaultPoint::Alloc, 0),
        (FaultPoint::Alloc, 1),
        (FaultPoint::CopyIn, 2),
        (FaultPoint::Launch, 2),
        (FaultPoint::CopyOut, 2),
        (FaultPoint::Sync, 2),
        (FaultPoint::Launch, 7),
    ];
    for (point, skip) in cases {
        let codec = model_codec(24);
        codec.inject_fault(point, skip, 1);
        let (batch, on_gpu) = compress_like_the_store(&codec, &pages);
        assert!(
            !on_gpu,
            "{point:?} after {skip}: the batch should have failed"
        );
        assert_eq!(decompress_all(&CpuReference, &batch), pages, "{point:?}");
        let stats = codec.stats();
        assert_eq!(stats.fallback_batches, 1, "{point:?}");
        let error = stats.last_error.unwrap_or_default();
        assert!(error.contains("injected fault"), "{point:?}: {error}");
        assert_eq!(stats.pages_compressed, 0);

        // The next batch runs on the GPU again, from freshly allocated slots.
        let (batch, on_gpu) = compress_like_the_store(&codec, &pages);
        assert!(on_gpu, "{point:?}: the GPU should work again");
        assert_is_model_output(&pages, &batch, 1);
        assert_eq!(decompress_all(&codec, &batch), pages);
        assert_eq!(codec.stats().pages_compressed, pages.len() as u64);
    }
}

#[test]
fn injected_faults_in_decompression_fall_back_to_the_cpu() {
    let pages = mixed_pages(150, 9);
    let mut batch = CompressedBatch::default();
    CpuReference
        .compress_batch(&refs(&pages), &mut batch)
        .unwrap();
    for point in [
        FaultPoint::Alloc,
        FaultPoint::CopyIn,
        FaultPoint::Launch,
        FaultPoint::CopyOut,
        FaultPoint::Sync,
    ] {
        let codec = model_codec(32);
        codec.inject_fault(point, 1, 1);
        // Every page comes back, the failed GPU batch redone on the CPU.
        assert_eq!(decompress_all(&codec, &batch), pages, "{point:?}");
        let stats = codec.stats();
        assert_eq!(stats.fallback_batches, 1, "{point:?}");
        assert_eq!(stats.pages_decompressed, 0, "{point:?}");
        assert_eq!(decompress_all(&codec, &batch), pages, "{point:?}");
        assert_eq!(codec.stats().fallback_batches, 1, "{point:?}");
    }
}

#[test]
fn an_empty_batch_is_fine() {
    let codec = model_codec(8);
    let mut batch = CompressedBatch::default();
    codec.compress_batch(&[], &mut batch).unwrap();
    assert!(batch.lens.is_empty() && batch.data.is_empty());
    let mut status: Vec<Result<(), CodecError>> = Vec::new();
    codec.decompress_batch(&[], &mut [], &mut status);
}

#[test]
fn the_bench_hook_checks_every_page_and_reports_the_ratio() {
    let codec = model_codec(32);
    let pages = mixed_pages(300, 10);
    let report = trueno_ublk::gpu::bench::run(&codec, &CpuReference, &pages, 128).unwrap();
    assert_eq!(report.pages, 300);
    assert!(report.ratio > 1.5, "{report:?}");
    assert!(report.ratio >= 0.95 * report.cpu_ratio, "{report:?}");
    assert_eq!(report.stats.pages_compressed, 300);
    assert_eq!(
        report.stats.pages_decompressed,
        300 - report.raw_pages as u64
    );
    assert_eq!(report.stats.fallback_batches, 0);
    assert!(serde_json::to_string(&report)
        .unwrap()
        .contains("host_to_host_gbps"));
}

#[test]
fn repeated_failures_rest_the_gpu_then_it_comes_back() {
    let pages = mixed_pages(20, 11);
    for (rest, fourth_on_gpu) in [(Duration::from_secs(3600), false), (Duration::ZERO, true)] {
        let config = GpuConfig {
            chunk_pages: 8,
            max_compressed_len: MAX_LZ4_LEN,
            rest,
            ..GpuConfig::default()
        };
        let codec = GpuCodec::on_cpu_model(config, Arc::new(CpuReference));
        codec.inject_fault(FaultPoint::Launch, 0, FAILURES_BEFORE_REST);
        for _ in 0..FAILURES_BEFORE_REST {
            assert!(!compress_like_the_store(&codec, &pages).1);
        }
        // The injected faults are used up: only resting keeps the next batch off the GPU.
        let (batch, on_gpu) = compress_like_the_store(&codec, &pages);
        assert_eq!(on_gpu, fourth_on_gpu, "rest {rest:?}");
        assert_eq!(decompress_all(&codec, &batch), pages);
        let stats = codec.stats();
        // While resting, both the compression and the decompression of the 4th batch count.
        let failed = u64::from(FAILURES_BEFORE_REST) + if fourth_on_gpu { 0 } else { 2 };
        assert_eq!(stats.fallback_batches, failed, "rest {rest:?}");
        assert!(stats.last_error.unwrap().contains("injected fault"));
    }
}

/// Output the store rejects (a page that did not decode to itself) counts as a failure, though
/// the batch came back `Ok`: rejected batches in a row rest the GPU as failed ones do.
#[test]
fn rejected_output_in_a_row_rests_the_gpu() {
    let pages = mixed_pages(20, 12);
    let config = GpuConfig {
        chunk_pages: 8,
        max_compressed_len: MAX_LZ4_LEN,
        rest: Duration::from_secs(3600),
        ..GpuConfig::default()
    };
    let codec = GpuCodec::on_cpu_model(config, Arc::new(CpuReference));
    for _ in 0..FAILURES_BEFORE_REST {
        assert!(compress_like_the_store(&codec, &pages).1, "the GPU did it");
        codec.output_rejected(pages.len());
    }
    assert!(
        !compress_like_the_store(&codec, &pages).1,
        "resting after rejected batches"
    );
    let stats = codec.stats();
    assert!(stats.last_error.unwrap().contains("rejected"));
}

#[test]
fn a_batch_is_spread_over_all_slots() {
    // With room for 2048 pages per chunk, a 999-page batch still runs as 3 chunks (one per
    // slot, so that copies and kernels overlap): the third launch is reached and fails.
    // A 300-page batch is 2 chunks (at least 256 pages each): the third launch never comes.
    for (pages, launches) in [(999, 3), (600, 3), (300, 2), (1, 1)] {
        let codec = model_codec(2048);
        codec.inject_fault(FaultPoint::Launch, 2, 1);
        let batch = mixed_pages(pages, 12);
        let (_, on_gpu) = compress_like_the_store(&codec, &batch);
        assert_eq!(on_gpu, launches < 3, "{pages} pages");
    }
}

/// A GPU that never finishes a chunk (a wedged device): the wait gives up after `hang_after`,
/// that batch and every later one (compression and decompression) go to the CPU at once, and
/// no page is lost; the error says so once.
#[test]
fn a_hung_gpu_is_given_up_on_and_every_later_batch_goes_to_the_cpu() {
    let pages = mixed_pages(100, 13);
    let hang_after = Duration::from_millis(50);
    // The first chunk's wait hangs, or a later one's with earlier chunks harvested.
    for skip in [0, 2] {
        let config = GpuConfig {
            chunk_pages: 24,
            max_compressed_len: MAX_LZ4_LEN,
            hang_after,
            ..GpuConfig::default()
        };
        let codec = GpuCodec::on_cpu_model(config, Arc::new(CpuReference));
        codec.inject_fault(FaultPoint::Hang, skip, 1);
        let started = std::time::Instant::now();
        let (batch, on_gpu) = compress_like_the_store(&codec, &pages);
        assert!(!on_gpu, "skip {skip}");
        assert!(
            started.elapsed() < 20 * hang_after,
            "skip {skip}: waited too long"
        );
        assert_eq!(decompress_all(&CpuReference, &batch), pages);
        let error = codec.stats().last_error.unwrap_or_default();
        assert!(error.contains("did not finish a batch"), "{error}");

        // The injected hang is used up: only having given up keeps the GPU unused, for
        // compression and decompression, with no waiting.
        for _ in 0..FAILURES_BEFORE_REST + 1 {
            let started = std::time::Instant::now();
            let (batch, on_gpu) = compress_like_the_store(&codec, &pages);
            assert!(!on_gpu);
            assert_eq!(decompress_all(&codec, &batch), pages);
            assert!(started.elapsed() < hang_after, "a later batch waited");
        }
        let stats = codec.stats();
        assert_eq!(stats.pages_compressed + stats.pages_decompressed, 0);
        assert_eq!(
            stats.fallback_batches,
            1 + 2 * u64::from(FAILURES_BEFORE_REST + 1)
        );
        assert!(stats.last_error.unwrap().contains("did not finish a batch"));
    }
}

/// Slots are sized for the chunks of the batches they get (pinned memory), and made again,
/// larger, when a larger batch comes: every batch, before and after, compresses to the
/// kernel's output and decompresses on the GPU, chunk lengths and all.
#[test]
fn slots_grow_with_the_batches() {
    let codec = model_codec(2048);
    // Chunks of 256 pages (the least), then of 334, then 256 again in slots of 334.
    for pages in [300, 1000, 300] {
        let batch = mixed_pages(pages, 14);
        let (compressed, on_gpu) = compress_like_the_store(&codec, &batch);
        assert!(on_gpu, "{pages} pages");
        assert_is_model_output(&batch, &compressed, 7);
        assert_eq!(decompress_all(&codec, &compressed), batch, "{pages} pages");
    }
    let stats = codec.stats();
    assert_eq!(stats.fallback_batches, 0);
    assert_eq!(stats.pages_compressed, 1600);
}
