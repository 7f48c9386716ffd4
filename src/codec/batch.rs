//! CPU batch codecs: one core (`Backend::Simd`) or every core through rayon
//! (`Backend::SimdParallel`). Both write each page into its fixed slot of the output, so the
//! parallel one needs no merging and the two produce identical bytes.

#![forbid(unsafe_code)]

use rayon::prelude::*;

use super::page::{compress_page, decompress_page};
use super::{Algorithm, BatchCodec, CodecError, CompressedBatch, Encoding, Page, PAGE_SIZE};

/// The name of thread `index` of rayon's global pool, the compression pool that
/// `Backend::SimdParallel` and the store's flush run on (as the daemon and the bench name it).
pub fn pool_thread_name(index: usize) -> String {
    format!("trueno-pool{index}")
}

/// Batch codec on the CPU.
#[derive(Clone, Copy, Debug)]
pub struct CpuCodec {
    algorithm: Algorithm,
    parallel: bool,
}

impl CpuCodec {
    /// One core (`Backend::Simd`).
    pub fn single(algorithm: Algorithm) -> Self {
        Self {
            algorithm,
            parallel: false,
        }
    }

    /// All cores of rayon's global pool (`Backend::SimdParallel`).
    pub fn parallel(algorithm: Algorithm) -> Self {
        Self {
            algorithm,
            parallel: true,
        }
    }
}

/// Compress one page into its slot of a batch.
fn compress_one(
    algorithm: Algorithm,
    page: &Page,
    slot: &mut [u8],
    len: &mut u16,
    enc: &mut Encoding,
) {
    if let Ok(slot) = <&mut Page>::try_from(slot) {
        let (e, n) = compress_page(algorithm, page, slot);
        *enc = e;
        // n <= PAGE_SIZE (4096), which fits u16.
        *len = super::page_len(n);
    }
}

type DecompressItem<'a, 'b> = (
    (&'a (Encoding, &'b [u8]), &'a mut Page),
    &'a mut Result<(), CodecError>,
);

fn decompress_one(((&(enc, src), page), status): DecompressItem<'_, '_>) {
    *status = decompress_page(enc, src, page);
}

impl BatchCodec for CpuCodec {
    fn compress_batch(&self, pages: &[&Page], out: &mut CompressedBatch) -> Result<(), CodecError> {
        out.reset(pages.len());
        let alg = self.algorithm;
        let CompressedBatch {
            data,
            lens,
            encodings,
        } = out;
        if self.parallel {
            data.par_chunks_exact_mut(PAGE_SIZE)
                .zip(lens.par_iter_mut())
                .zip(encodings.par_iter_mut())
                .zip(pages.par_iter())
                .for_each(|(((slot, len), enc), page)| compress_one(alg, page, slot, len, enc));
        } else {
            data.chunks_exact_mut(PAGE_SIZE)
                .zip(lens.iter_mut())
                .zip(encodings.iter_mut())
                .zip(pages.iter())
                .for_each(|(((slot, len), enc), page)| compress_one(alg, page, slot, len, enc));
        }
        Ok(())
    }

    fn decompress_batch(
        &self,
        inputs: &[(Encoding, &[u8])],
        out: &mut [Page],
        status: &mut [Result<(), CodecError>],
    ) {
        if self.parallel {
            inputs
                .par_iter()
                .zip(out.par_iter_mut())
                .zip(status.par_iter_mut())
                .for_each(decompress_one);
        } else {
            inputs
                .iter()
                .zip(out.iter_mut())
                .zip(status.iter_mut())
                .for_each(decompress_one);
        }
    }
}
