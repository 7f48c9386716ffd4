//! A GPU batch benchmark the `bench` command can call: compresses a corpus in batches through a
//! `GpuCodec`, decompresses it again, checks every page, and reports host-to-host and
//! kernel-only throughput (from the codec's GPU event times) and the ratio beside the CPU
//! codec's on the same pages.

#![forbid(unsafe_code)]

use std::time::Instant;

use serde::Serialize;
use thiserror::Error;

use super::{GpuCodec, GpuStats};
use crate::codec::{BatchCodec, CodecError, CompressedBatch, Encoding, Page, PAGE_SIZE};

#[derive(Debug, Error)]
pub enum GpuBenchError {
    #[error("the GPU batch failed (see `last_error` in the GPU stats): {0}")]
    Batch(#[from] CodecError),
    #[error("page {page} did not come back intact after GPU compression and decompression")]
    Mismatch { page: usize },
}

/// Throughput of one direction.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Throughput {
    /// Wall time of the batches, host buffers to host buffers.
    pub wall_s: f64,
    pub host_to_host_gbps: f64,
    /// GPU event time in the kernels only: the sum over chunks of each chunk's kernel. With
    /// several pipeline slots, kernels of consecutive chunks may share the GPU, so this can
    /// exceed the kernels' wall time (`kernel_gbps` is then a lower bound); a codec built with
    /// `GpuConfig { slots: 1, .. }` gives the kernel-only figure exactly.
    pub kernel_s: f64,
    pub kernel_gbps: f64,
    /// GPU event time of the copies in and out.
    pub transfer_s: f64,
}

impl Throughput {
    fn new(bytes: usize, wall_s: f64, before: &GpuStats, after: &GpuStats) -> Self {
        let gb = bytes as f64 / 1e9;
        let kernel_s = (after.kernel_ns - before.kernel_ns) as f64 / 1e9;
        let per_s = |s: f64| if s > 0.0 { gb / s } else { 0.0 };
        Self {
            wall_s,
            host_to_host_gbps: per_s(wall_s),
            kernel_s,
            kernel_gbps: per_s(kernel_s),
            transfer_s: (after.transfer_ns - before.transfer_ns) as f64 / 1e9,
        }
    }
}

/// What `run` measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GpuBenchReport {
    pub pages: usize,
    pub batch_pages: usize,
    pub compress: Throughput,
    pub decompress: Throughput,
    /// Input bytes over stored bytes (LZ4 length, or a page for raw pages).
    pub ratio: f64,
    /// The same for the CPU codec on the same pages.
    pub cpu_ratio: f64,
    pub raw_pages: usize,
    /// The codec's counters at the end (fallbacks, last error).
    pub stats: GpuStats,
}

fn stored_bytes(batch: &CompressedBatch) -> usize {
    batch.lens.iter().map(|&len| usize::from(len)).sum()
}

/// Compresses `pages` in batches of `batch_pages` with `gpu`, decompresses them with `gpu`,
/// checks each page, and compares the ratio with `cpu` on the same pages.
pub fn run(
    gpu: &GpuCodec,
    cpu: &dyn BatchCodec,
    pages: &[Page],
    batch_pages: usize,
) -> Result<GpuBenchReport, GpuBenchError> {
    let batch_pages = batch_pages.max(1);
    let mut report = GpuBenchReport {
        pages: pages.len(),
        batch_pages,
        ..GpuBenchReport::default()
    };
    let mut batches = Vec::new();
    let before = gpu.stats();
    let start = Instant::now();
    for chunk in pages.chunks(batch_pages) {
        let refs: Vec<&Page> = chunk.iter().collect();
        let mut batch = CompressedBatch::default();
        gpu.compress_batch(&refs, &mut batch)?;
        batches.push(batch);
    }
    let wall = start.elapsed().as_secs_f64();
    let after = gpu.stats();
    report.compress = Throughput::new(pages.len() * PAGE_SIZE, wall, &before, &after);

    let before = after;
    let mut decoded = vec![[0u8; PAGE_SIZE]; batch_pages];
    let mut status = vec![Ok(()); batch_pages];
    let mut wall = 0.0;
    for (b, batch) in batches.iter().enumerate() {
        let n = batch.lens.len();
        let inputs: Vec<(Encoding, &[u8])> = (0..n)
            .map(|i| {
                let len = usize::from(batch.lens[i]);
                (batch.encodings[i], &batch.data[i * PAGE_SIZE..][..len])
            })
            .collect();
        let start = Instant::now();
        gpu.decompress_batch(&inputs, &mut decoded[..n], &mut status[..n]);
        wall += start.elapsed().as_secs_f64();
        for i in 0..n {
            let page = b * batch_pages + i;
            if status[i].is_err() || decoded[i] != pages[page] {
                return Err(GpuBenchError::Mismatch { page });
            }
        }
        report.raw_pages += batch
            .encodings
            .iter()
            .filter(|&&e| e == Encoding::Raw)
            .count();
    }
    let after = gpu.stats();
    report.decompress = Throughput::new(pages.len() * PAGE_SIZE, wall, &before, &after);
    let stored: usize = batches.iter().map(stored_bytes).sum();
    report.ratio = (pages.len() * PAGE_SIZE) as f64 / stored.max(1) as f64;

    let mut cpu_stored = 0;
    for chunk in pages.chunks(batch_pages) {
        let refs: Vec<&Page> = chunk.iter().collect();
        let mut batch = CompressedBatch::default();
        cpu.compress_batch(&refs, &mut batch)?;
        cpu_stored += stored_bytes(&batch);
    }
    report.cpu_ratio = (pages.len() * PAGE_SIZE) as f64 / cpu_stored.max(1) as f64;
    report.stats = after;
    Ok(report)
}
