//! Single-page and batch latencies of the store with its flusher running.

#![forbid(unsafe_code)]

use std::time::Instant;

use super::corpus::{Corpus, SplitMix64};
use super::progress::Progress;
use super::report::{LatencyReport, Percentiles, RecompressorWork};
use super::workers::{flush, verify};
use super::{BenchError, Plan};
use crate::codec::PAGE_SIZE;
use crate::store::BatchedPageStore;

/// Pages per batch in the batch-latency figures (the spec's G.113/G.114).
const LATENCY_BATCH_PAGES: usize = 1000;

/// Single-page and 1000-page latencies on a store holding `content[p]` at page `p`, with the
/// flusher running, and with recompression on the recompressor's work during the single-page
/// phases (`super::recompressor_at_work` has it at work then). Writes put back the same
/// content, so the store's contents do not change. A flushed batch is 1000 pages, or the
/// store's threshold if that is smaller (it flushes there).
pub(super) fn measure_latency(
    store: &BatchedPageStore,
    plan: &Plan,
    corpus: &Corpus,
    content: &[u32],
    samples: usize,
    rng: &mut SplitMix64,
    progress: &Progress,
) -> Result<LatencyReport, BenchError> {
    let pages = content.len();
    let expected = |position: usize| corpus.page(content[position] as usize);
    let offset = |position: usize| (position * PAGE_SIZE) as u64;
    let store_error = |phase| move |source| BenchError::Store { phase, source };

    let single_start = (Instant::now(), store.stats());
    progress.phase("latency: write", samples as u64);
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        let position = rng.index_below(pages);
        let data = expected(position);
        let start = Instant::now();
        store
            .write(offset(position), data)
            .map_err(store_error("latency write"))?;
        times.push(start.elapsed());
        progress.advance(1);
    }
    let write_page = Percentiles::from_samples(std::mem::take(&mut times));
    flush(store, "latency flush")?;

    progress.phase("latency: read", samples as u64);
    let mut page = vec![0u8; PAGE_SIZE];
    for _ in 0..samples {
        let position = rng.index_below(pages);
        // Poisoned before every read: a read that wrote nothing must not pass on the page
        // the one before left (same-filled pages abound).
        page.fill(0xA5);
        let start = Instant::now();
        store
            .read(offset(position), &mut page)
            .map_err(store_error("latency read"))?;
        times.push(start.elapsed());
        verify("latency read", &page, |_| expected(position))?;
        progress.advance(1);
    }
    let read_page = Percentiles::from_samples(std::mem::take(&mut times));
    let recompressor = plan.config.recompress.is_some().then(|| {
        let (at, before) = &single_start;
        let after = store.stats();
        RecompressorWork {
            pages: after
                .recompressed_pages
                .saturating_sub(before.recompressed_pages),
            cpu_seconds: after
                .recompress_cpu_ns
                .saturating_sub(before.recompress_cpu_ns) as f64
                / 1e9,
            seconds: at.elapsed().as_secs_f64(),
        }
    });

    let batch_pages = LATENCY_BATCH_PAGES.min(pages);
    let flush_pages = batch_pages.min(plan.config.batch_threshold.max(1));
    let batch_samples = (samples / 10).max(1);
    progress.phase("latency: batch flush", batch_samples as u64);
    for _ in 0..batch_samples {
        let first = rng.index_below(pages - flush_pages + 1);
        let last = first + flush_pages - 1;
        for position in first..last {
            store
                .write(offset(position), expected(position))
                .map_err(store_error("latency batch write"))?;
        }
        // The write of the last page fills the batch; the flush may start on the flusher
        // thread before it returns, so the clock starts before it.
        let start = Instant::now();
        store
            .write(offset(last), expected(last))
            .map_err(store_error("latency batch write"))?;
        flush(store, "latency batch flush")?;
        times.push(start.elapsed());
        progress.advance(1);
    }
    let batch_flush = Percentiles::from_samples(std::mem::take(&mut times));

    progress.phase("latency: batch read", batch_samples as u64);
    let mut batch = vec![0u8; batch_pages * PAGE_SIZE];
    for _ in 0..batch_samples {
        let first = rng.index_below(pages - batch_pages + 1);
        batch.fill(0xA5);
        let start = Instant::now();
        store
            .read(offset(first), &mut batch)
            .map_err(store_error("latency batch read"))?;
        times.push(start.elapsed());
        verify("latency batch read", &batch, |index| {
            expected(first + index)
        })?;
        progress.advance(1);
    }
    let batch_read = Percentiles::from_samples(times);

    Ok(LatencyReport {
        write_page,
        read_page,
        flush_pages,
        batch_flush,
        batch_pages,
        batch_read,
        recompressor,
    })
}
