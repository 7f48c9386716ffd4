//! The one place that picks a backend for a batch and falls back from the GPU to the CPU. The
//! store compresses its batches through it, and the bench measures the codec alone through
//! the same choice.

#![forbid(unsafe_code)]

use std::sync::Arc;

use super::{
    select_backend, Algorithm, Backend, BackendThresholds, BatchCodec, CompressedBatch, CpuCodec,
    Page,
};

/// Compresses batches on one core, on all cores, or on a GPU codec, by batch size unless a
/// backend is forced.
pub struct Compressor {
    algorithm: Algorithm,
    simd: CpuCodec,
    parallel: CpuCodec,
    /// Only for LZ4, the one algorithm a GPU codec compresses.
    gpu: Option<Arc<dyn BatchCodec>>,
    forced_backend: Option<Backend>,
    thresholds: BackendThresholds,
}

/// What `Compressor::compress` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compressed {
    /// The backend whose output is in the batch.
    pub backend: Backend,
    /// The GPU was chosen, failed or gave malformed output, and the CPU compressed instead.
    pub fell_back: bool,
}

impl Compressor {
    pub fn new(
        algorithm: Algorithm,
        gpu: Option<Arc<dyn BatchCodec>>,
        forced_backend: Option<Backend>,
        thresholds: BackendThresholds,
    ) -> Self {
        Self {
            algorithm,
            simd: CpuCodec::single(algorithm),
            parallel: CpuCodec::parallel(algorithm),
            gpu: gpu.filter(|_| algorithm == Algorithm::Lz4),
            forced_backend,
            thresholds,
        }
    }

    /// The algorithm of the CPU codecs.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The backend a batch of `pages` pages goes to first.
    pub fn backend_for(&self, pages: usize) -> Backend {
        self.forced_backend
            .unwrap_or_else(|| select_backend(pages, self.gpu.is_some(), &self.thresholds))
    }

    /// The codec behind `backend` (the CPU's when there is no GPU codec).
    pub fn codec(&self, backend: Backend) -> &dyn BatchCodec {
        match (backend, &self.gpu) {
            (Backend::Gpu, Some(gpu)) => gpu.as_ref(),
            (Backend::Simd, _) => &self.simd,
            _ => &self.parallel,
        }
    }

    /// The CPU backend that compresses a batch of `pages` pages (one core or all of them), or
    /// `None` if it goes to the GPU codec.
    pub fn cpu_backend_for(&self, pages: usize) -> Option<Backend> {
        match (self.backend_for(pages), &self.gpu) {
            (Backend::Gpu, Some(_)) => None,
            (Backend::Simd, _) => Some(Backend::Simd),
            _ => Some(Backend::SimdParallel),
        }
    }

    /// Compress `pages` into `out`. A GPU failure, or GPU output that does not hold together,
    /// sends the batch to all cores; CPU codecs do not fail (pages that do not compress are
    /// stored raw).
    pub fn compress(&self, pages: &[&Page], out: &mut CompressedBatch) -> Compressed {
        if let Some(cpu) = self.cpu_backend_for(pages.len()) {
            return Compressed {
                backend: self.compress_on_cpu(cpu, pages, out),
                fell_back: false,
            };
        }
        if let Some(gpu) = &self.gpu {
            match gpu.compress_batch(pages, out) {
                Ok(()) if out.is_well_formed(pages.len()) => {
                    return Compressed {
                        backend: Backend::Gpu,
                        fell_back: false,
                    }
                }
                Ok(()) => {
                    tracing::warn!(
                        pages = pages.len(),
                        "GPU batch output malformed; compressing on the CPU"
                    );
                    gpu.output_rejected(pages.len());
                }
                // The GPU codec logs its failures itself, and stays quiet while it rests the
                // GPU (every batch would log otherwise, up to a hundred lines a second).
                Err(_) => {}
            }
        }
        Compressed {
            backend: self.compress_on_cpu(Backend::SimdParallel, pages, out),
            fell_back: true,
        }
    }

    /// The GPU's output for a batch of `pages` pages held pages that did not decode to
    /// themselves (the store compressed them again on the CPU): counted against the GPU.
    pub fn gpu_output_rejected(&self, pages: usize) {
        if let Some(gpu) = &self.gpu {
            gpu.output_rejected(pages);
        }
    }

    fn compress_on_cpu(
        &self,
        backend: Backend,
        pages: &[&Page],
        out: &mut CompressedBatch,
    ) -> Backend {
        if let Err(error) = self.codec(backend).compress_batch(pages, out) {
            tracing::error!("CPU batch compression failed: {error}");
        }
        backend
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{CodecError, Encoding, PAGE_SIZE};

    /// A GPU stand-in that always fails.
    struct BrokenGpu;

    impl BatchCodec for BrokenGpu {
        fn compress_batch(&self, _: &[&Page], _: &mut CompressedBatch) -> Result<(), CodecError> {
            Err(CodecError::Gpu("broken".into()))
        }
        fn decompress_batch(
            &self,
            _: &[(Encoding, &[u8])],
            _: &mut [Page],
            status: &mut [Result<(), CodecError>],
        ) {
            status.fill(Err(CodecError::Gpu("broken".into())));
        }
    }

    #[test]
    fn a_failing_gpu_batch_is_compressed_on_the_cpu() {
        let compressor = Compressor::new(
            Algorithm::Lz4,
            Some(Arc::new(BrokenGpu)),
            None,
            BackendThresholds {
                parallel_min_pages: 2,
                gpu_min_pages: 3,
            },
        );
        let page = [7u8; PAGE_SIZE];
        let pages = [&page; 3];
        let mut out = CompressedBatch::default();
        let done = compressor.compress(&pages, &mut out);
        assert_eq!(done.backend, Backend::SimdParallel);
        assert!(done.fell_back);
        assert!(out.is_well_formed(3));
        let small = compressor.compress(&pages[..1], &mut out);
        assert_eq!(small.backend, Backend::Simd);
        assert!(!small.fell_back);
    }

    #[test]
    fn only_lz4_goes_to_the_gpu() {
        let compressor = Compressor::new(
            Algorithm::Zstd { level: 1 },
            Some(Arc::new(BrokenGpu)),
            None,
            BackendThresholds::default(),
        );
        assert_eq!(
            compressor.backend_for(100_000),
            Backend::SimdParallel,
            "zstd never picks the GPU"
        );
    }
}
