//! The codec alone on the corpus, with the backend the store would pick, for the store's
//! share of the codec's speed.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::corpus::Corpus;
use super::progress::Progress;
use super::workers::verify;
use super::BenchError;
use crate::codec::{Backend, BatchCodec, CompressedBatch, Compressor, Encoding, Page, PAGE_SIZE};
use crate::store::StoreConfig;

/// What the codec alone did with the corpus.
pub(super) struct CodecRun {
    pub(super) backend: Backend,
    pub(super) batch_pages: usize,
    pub(super) compress_time: Duration,
    pub(super) decompress_time: Duration,
    pub(super) compressed_bytes: usize,
}

/// The codec alone on every page of the corpus (none classified away), in batches of the
/// store's threshold with the backend the store picks for such a batch, on the same cores.
/// Every page is decompressed again and checked.
pub(super) fn measure_codec(
    config: &StoreConfig,
    gpu: Option<&Arc<dyn BatchCodec>>,
    corpus: &Corpus,
    progress: &Progress,
) -> Result<CodecRun, BenchError> {
    let batch_pages = config.batch_threshold.clamp(1, corpus.page_count());
    let compressor = Compressor::new(
        config.algorithm,
        gpu.cloned(),
        config.forced_backend,
        config.thresholds,
    );
    let backend = compressor.backend_for(batch_pages);
    let codec = compressor.codec(backend);
    let pages: Vec<&Page> = corpus
        .bytes()
        .chunks_exact(PAGE_SIZE)
        .filter_map(|page| page.try_into().ok())
        .collect();

    // Output buffers are allocated and faulted in before the clock starts: the store reuses
    // its own, so fresh memory per batch would charge the codec for page faults the store
    // does not take.
    let mut batches: Vec<CompressedBatch> = pages
        .chunks(batch_pages)
        .map(|chunk| {
            let mut batch = CompressedBatch::default();
            batch.reset(chunk.len());
            batch
        })
        .collect();
    progress.phase("codec compress", pages.len() as u64);
    let start = Instant::now();
    for (chunk, out) in pages.chunks(batch_pages).zip(&mut batches) {
        codec
            .compress_batch(chunk, out)
            .map_err(BenchError::Codec)?;
        progress.advance(chunk.len() as u64);
    }
    let compress_time = start.elapsed();
    let compressed_bytes = batches
        .iter()
        .flat_map(|batch| batch.lens.iter())
        .map(|&len| usize::from(len))
        .sum();

    progress.phase("codec decompress", pages.len() as u64);
    // Poisoned (and so faulted in) before any timing, as the store reads into a caller's buffer.
    let mut out = vec![[0xA5u8; PAGE_SIZE]; batch_pages];
    let mut status = vec![Ok(()); batch_pages];
    let mut decompress_time = Duration::ZERO;
    for (number, batch) in batches.iter().enumerate() {
        let n = batch.len();
        let inputs: Vec<(Encoding, &[u8])> = (0..n).map(|i| batch.page(i)).collect();
        // Again before every batch: a page the decoder left alone must not pass on what the
        // batch before wrote there.
        out[..n].iter_mut().for_each(|page| page.fill(0xA5));
        let start = Instant::now();
        codec.decompress_batch(&inputs, &mut out[..n], &mut status[..n]);
        decompress_time += start.elapsed();
        if let Some(error) = status[..n].iter().find_map(|s| s.clone().err()) {
            return Err(BenchError::Codec(error));
        }
        let first = number * batch_pages;
        verify("codec round trip", out[..n].as_flattened(), |i| {
            corpus.page(first + i)
        })?;
        progress.advance(n as u64);
    }
    Ok(CodecRun {
        backend,
        batch_pages,
        compress_time,
        decompress_time,
        compressed_bytes,
    })
}
