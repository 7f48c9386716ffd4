//! The kernels on a real GPU (built with `GPU_TESTS=1`, which `build.rs` turns into
//! `cfg(gpu_tests)`; otherwise they are listed as ignored, never passed unrun; the probe's
//! own test runs everywhere):
//! byte-exact round trips GPU→CPU, CPU→GPU and GPU→GPU on 1 to 65 536-page batches, GPU output
//! equal to the CPU model's byte for byte, corrupt input handled like the model decoder, no
//! device-memory growth over many batches, and injected faults on the device path.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]

mod gpu_support;

use std::sync::Arc;

use gpu_support::{
    assert_is_model_output, inputs, mixed_pages, process_memory_pages, refs, CpuReference, Rng,
    MAX_LZ4_LEN,
};
use trueno_ublk::codec::{BatchCodec, CodecError, CompressedBatch, Encoding, Page, PAGE_SIZE};
use trueno_ublk::gpu::{model, probe, FaultPoint, GpuCodec, GpuConfig, GpuProbe};

/// The codec on the GPU; a missing GPU is a failure (the test asked for one).
fn gpu() -> GpuCodec {
    match probe() {
        GpuProbe::Available { name } => println!("GPU: {name}"),
        GpuProbe::Unavailable { reason } => panic!("a GPU test, but no usable GPU: {reason}"),
    }
    let config = GpuConfig {
        max_compressed_len: MAX_LZ4_LEN,
        ..GpuConfig::default()
    };
    GpuCodec::new(config, Arc::new(CpuReference)).expect("open the GPU codec")
}

fn decompress(
    codec: &dyn BatchCodec,
    inputs: &[(Encoding, &[u8])],
) -> Vec<Result<Page, CodecError>> {
    let mut out = vec![[0u8; PAGE_SIZE]; inputs.len()];
    let mut status = vec![Err(CodecError::Corrupt); inputs.len()];
    codec.decompress_batch(inputs, &mut out, &mut status);
    out.into_iter()
        .zip(status)
        .map(|(page, st)| st.map(|()| page))
        .collect()
}

fn assert_pages(decoded: Vec<Result<Page, CodecError>>, pages: &[Page], what: &str) {
    assert_eq!(decoded.len(), pages.len());
    for (i, (got, want)) in decoded.iter().zip(pages).enumerate() {
        assert_eq!(got.as_ref(), Ok(want), "{what}: page {i}");
    }
}

fn corpus(n: usize, seed: u64) -> Vec<Page> {
    let mut pages = process_memory_pages(n / 2);
    pages.extend(mixed_pages(n - pages.len(), seed));
    pages
}

#[test]
#[cfg_attr(not(gpu_tests), ignore = "needs a GPU: GPU_TESTS=1 cargo test")]
fn probe_finds_the_gpu() {
    assert!(trueno_ublk::gpu::gpu_available());
    assert!(matches!(probe(), GpuProbe::Available { name } if !name.is_empty()));
}

#[test]
#[cfg_attr(not(gpu_tests), ignore = "needs a GPU: GPU_TESTS=1 cargo test")]
fn round_trips_gpu_to_cpu_cpu_to_gpu_and_gpu_to_gpu() {
    let codec = gpu();
    for (n, seed) in [(1, 1), (2, 2), (7, 3), (999, 4), (4096, 5), (65536, 6)] {
        let pages = corpus(n, seed);
        let mut gpu_batch = CompressedBatch::default();
        codec.compress_batch(&refs(&pages), &mut gpu_batch).unwrap();
        assert_is_model_output(&pages, &gpu_batch, if n > 4096 { 16 } else { 1 });
        assert_pages(
            decompress(&CpuReference, &inputs(&gpu_batch)),
            &pages,
            "GPU -> CPU",
        );
        assert_pages(
            decompress(&codec, &inputs(&gpu_batch)),
            &pages,
            "GPU -> GPU",
        );

        let mut cpu_batch = CompressedBatch::default();
        CpuReference
            .compress_batch(&refs(&pages), &mut cpu_batch)
            .unwrap();
        assert_pages(
            decompress(&codec, &inputs(&cpu_batch)),
            &pages,
            "CPU -> GPU",
        );
    }
    let stats = codec.stats();
    println!("{stats:?}");
    assert_eq!(stats.fallback_batches, 0, "{:?}", stats.last_error);
    assert!(stats.kernel_ns > 0 && stats.transfer_ns > 0);
}

#[test]
#[cfg_attr(not(gpu_tests), ignore = "needs a GPU: GPU_TESTS=1 cargo test")]
fn corrupt_input_gets_the_model_decoders_status() {
    let codec = gpu();
    let pages = mixed_pages(64, 7);
    let mut rng = Rng::new(7);
    let mut blocks: Vec<Vec<u8>> = Vec::new();
    for page in &pages {
        let mut block = gpu_support::liblz4(page);
        if block.len() > PAGE_SIZE {
            continue;
        }
        blocks.push(block[..rng.below(block.len() as u64) as usize].to_vec());
        let at = rng.below(block.len() as u64) as usize;
        block[at] = rng.next() as u8;
        blocks.push(block);
        blocks.push((0..rng.below(300)).map(|_| rng.next() as u8).collect());
    }
    let inputs: Vec<(Encoding, &[u8])> = blocks.iter().map(|b| (Encoding::Lz4, &b[..])).collect();
    let decoded = decompress(&codec, &inputs);
    for (i, (block, got)) in blocks.iter().zip(decoded).enumerate() {
        let mut expect = [0u8; PAGE_SIZE];
        let status = model::decompress_page(block, &mut expect);
        match got {
            Ok(page) => {
                assert_eq!(status, model::STATUS_OK, "input {i}");
                assert_eq!(page, expect, "input {i}");
            }
            Err(CodecError::Corrupt) => assert_eq!(status, model::STATUS_CORRUPT, "input {i}"),
            Err(CodecError::WrongLength(n)) => {
                assert_eq!(status, model::STATUS_WRONG_LENGTH | n as u32, "input {i}")
            }
            Err(e) => panic!("input {i}: {e}"),
        }
    }
    assert_eq!(codec.stats().fallback_batches, 0);
}

#[test]
#[cfg_attr(not(gpu_tests), ignore = "needs a GPU: GPU_TESTS=1 cargo test")]
fn no_device_memory_growth_over_many_batches() {
    let codec = gpu();
    let pages = corpus(4096, 8);
    let mut batch = CompressedBatch::default();
    let round = |batch: &mut CompressedBatch| {
        codec.compress_batch(&refs(&pages), batch).unwrap();
        assert_pages(decompress(&codec, &inputs(batch)), &pages, "round");
    };
    round(&mut batch);
    let (free_before, total) = codec.device_memory().expect("device memory info");
    for _ in 0..50 {
        round(&mut batch);
    }
    let (free_after, _) = codec.device_memory().expect("device memory info");
    println!("device memory free: {free_before} -> {free_after} of {total}");
    assert!(
        free_after + (1 << 20) >= free_before,
        "device memory shrank by {} bytes",
        free_before - free_after
    );
}

#[test]
#[cfg_attr(not(gpu_tests), ignore = "needs a GPU: GPU_TESTS=1 cargo test")]
fn injected_faults_on_the_device_fall_back_without_losing_pages() {
    let pages = corpus(10_000, 9);
    for (point, skip) in [
        (FaultPoint::Alloc, 0),
        (FaultPoint::Launch, 2),
        (FaultPoint::CopyOut, 1),
        (FaultPoint::Sync, 3),
    ] {
        let codec = gpu();
        codec.inject_fault(point, skip, 1);
        let mut batch = CompressedBatch::default();
        let failed = codec.compress_batch(&refs(&pages), &mut batch);
        assert!(failed.is_err(), "{point:?}");
        CpuReference
            .compress_batch(&refs(&pages), &mut batch)
            .unwrap();
        assert_pages(
            decompress(&codec, &inputs(&batch)),
            &pages,
            "after the fault",
        );
        assert_eq!(codec.stats().fallback_batches, 1, "{point:?}");

        codec.compress_batch(&refs(&pages), &mut batch).unwrap();
        assert_is_model_output(&pages, &batch, 7);
        assert_pages(
            decompress(&CpuReference, &inputs(&batch)),
            &pages,
            "next batch",
        );
    }
}

#[test]
#[cfg_attr(not(gpu_tests), ignore = "needs a GPU: GPU_TESTS=1 cargo test")]
fn bench_hook_on_the_gpu() {
    let codec = gpu();
    let pages = corpus(65536, 10);
    let report = trueno_ublk::gpu::bench::run(&codec, &CpuReference, &pages, 16384).unwrap();
    println!(
        "pipelined: {}",
        serde_json::to_string_pretty(&report).unwrap()
    );
    assert!(report.ratio >= 0.95 * report.cpu_ratio);
    assert_eq!(report.stats.fallback_batches, 0);
    // One slot: no overlap, so the kernel times are the kernels' own.
    let config = GpuConfig {
        slots: 1,
        max_compressed_len: MAX_LZ4_LEN,
        ..GpuConfig::default()
    };
    let serial = GpuCodec::new(config, Arc::new(CpuReference)).expect("open the GPU codec");
    let report = trueno_ublk::gpu::bench::run(&serial, &CpuReference, &pages, 16384).unwrap();
    println!(
        "one slot: {}",
        serde_json::to_string_pretty(&report).unwrap()
    );
}

#[test]
fn probe_never_panics_and_gives_a_reason() {
    match probe() {
        GpuProbe::Available { name } => assert!(!name.is_empty()),
        GpuProbe::Unavailable { reason } => {
            println!("no GPU here: {reason}");
            assert!(!reason.is_empty());
            assert!(!trueno_ublk::gpu::gpu_available());
        }
    }
}
