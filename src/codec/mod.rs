//! Page codecs: classification (zero / same-filled), LZ4, zstd and raw pages, and batch
//! compression on one core or many. Knows nothing of the page table or the kernel.
//!
//! LZ4 is liblz4 (the C library, through the `lz4` crate): on real memory pages it compresses
//! and decompresses faster than lz4_flex (see `benches/codec.rs`, group `lz4_library`) at the
//! same ratio, since both emit the standard LZ4 block format.

#![forbid(unsafe_code)]

mod batch;
mod compressor;
mod page;

use thiserror::Error;

pub use batch::{pool_thread_name, CpuCodec};
pub use compressor::{Compressed, Compressor};
pub use page::{
    classify, compress_page, decompress_page, fill_page, prepare_thread, sampled_entropy_bits,
    thread_contexts_bytes, PageChecksum, ThreadCodecs, ADAPTIVE_ZSTD_LEVEL, MAX_COMPRESSED_LEN,
};

/// Size of one page of the device, in bytes.
pub const PAGE_SIZE: usize = 4096;

/// One uncompressed page.
pub type Page = [u8; PAGE_SIZE];

/// A stored length (at most `PAGE_SIZE`) as the 16 bits the page table and batches keep.
pub fn page_len(len: usize) -> u16 {
    debug_assert!(len <= PAGE_SIZE, "a page's bytes are at most a page");
    #[allow(
        clippy::cast_possible_truncation,
        reason = "callers pass lengths of at most PAGE_SIZE (4096), which fit 16 bits"
    )]
    let len = len.min(PAGE_SIZE) as u16;
    len
}

/// How a stored page's bytes are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Encoding {
    /// LZ4 block format (no frame), decodes to exactly `PAGE_SIZE` bytes.
    Lz4 = 0,
    /// zstd frame, decodes to exactly `PAGE_SIZE` bytes.
    Zstd = 1,
    /// The page itself (it did not compress below the huge-page threshold).
    Raw = 2,
}

impl Encoding {
    /// The encoding stored as `bits` by `Encoding as u8`, if any.
    pub fn from_bits(bits: u8) -> Option<Self> {
        match bits {
            0 => Some(Encoding::Lz4),
            1 => Some(Encoding::Zstd),
            2 => Some(Encoding::Raw),
            _ => None,
        }
    }
}

/// The compression algorithm asked for on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    Lz4,
    Zstd {
        level: i32,
    },
    /// Chosen per page by sampled byte entropy: LZ4 for repetitive pages, zstd level
    /// `ADAPTIVE_ZSTD_LEVEL` for the rest.
    Adaptive,
}

/// As the command line and the config file write it: `lz4`, `zstd:3`, `adaptive`.
impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Algorithm::Lz4 => f.write_str("lz4"),
            Algorithm::Zstd { level } => write!(f, "zstd:{level}"),
            Algorithm::Adaptive => f.write_str("adaptive"),
        }
    }
}

/// Which engine compresses a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// One core.
    Simd,
    /// All cores (rayon).
    SimdParallel,
    /// The GPU batch codec.
    Gpu,
}

impl Backend {
    /// As the command line and the config file write it: `simd`, `simd-parallel`, `gpu`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Simd => "simd",
            Backend::SimdParallel => "simd-parallel",
            Backend::Gpu => "gpu",
        }
    }
}

/// What a page holds before any codec sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageClass {
    /// Every 8-byte word of the page equals this one (zero pages are `SameFilled(0)`).
    SameFilled(u64),
    /// Anything else: goes to a codec.
    Data,
}

/// Errors of the codecs.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CodecError {
    #[error("compressed page is corrupt")]
    Corrupt,
    #[error("compressed page decodes to {0} bytes, not {PAGE_SIZE}")]
    WrongLength(usize),
    #[error("GPU batch failed: {0}")]
    Gpu(String),
    /// No memory for a codec context (what it says).
    #[error("{0}")]
    NoContext(String),
}

/// A compressed batch: page `i` is `data[i * PAGE_SIZE..][..lens[i]]`, encoded as
/// `encodings[i]`. Fixed 4 KiB slots let every backend (rayon, GPU) write in place.
#[derive(Debug, Default)]
pub struct CompressedBatch {
    pub data: Vec<u8>,
    pub lens: Vec<u16>,
    pub encodings: Vec<Encoding>,
}

impl CompressedBatch {
    /// Number of pages in the batch.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    /// Page `i`: its encoding and its compressed bytes.
    pub fn page(&self, i: usize) -> (Encoding, &[u8]) {
        let len = usize::from(self.lens[i]);
        (self.encodings[i], &self.data[i * PAGE_SIZE..][..len])
    }

    /// Heap bytes a batch sized for `pages` pages holds (see `reset`).
    pub fn heap_bytes(pages: usize) -> usize {
        pages * (PAGE_SIZE + std::mem::size_of::<u16>() + std::mem::size_of::<Encoding>())
    }

    /// Size the batch for `pages` pages (slots of `PAGE_SIZE`) with lengths 0. Old slot bytes
    /// are left in place rather than zeroed (4 KiB of memset per page): `page` never reads a
    /// slot past its length.
    pub fn reset(&mut self, pages: usize) {
        self.data.resize(pages * PAGE_SIZE, 0);
        self.lens.clear();
        self.lens.resize(pages, 0);
        self.encodings.clear();
        self.encodings.resize(pages, Encoding::Raw);
    }

    /// Whether every page's length fits its slot and agrees with its encoding; a store must
    /// not install a batch from a codec it does not control without this check.
    pub fn is_well_formed(&self, pages: usize) -> bool {
        self.lens.len() == pages
            && self.encodings.len() == pages
            && self.data.len() >= pages * PAGE_SIZE
            && self
                .lens
                .iter()
                .zip(&self.encodings)
                .all(|(&len, &enc)| match enc {
                    Encoding::Raw => usize::from(len) == PAGE_SIZE,
                    Encoding::Lz4 | Encoding::Zstd => len > 0 && usize::from(len) <= PAGE_SIZE,
                })
    }
}

/// A batch compressor/decompressor. Every implementation decodes every other one's output.
pub trait BatchCodec: Send + Sync {
    /// Compress `pages` into `out` (cleared and resized by the callee).
    fn compress_batch(&self, pages: &[&Page], out: &mut CompressedBatch) -> Result<(), CodecError>;
    /// Decompress each `(encoding, bytes)` into the page at the same index of `out`;
    /// `status[i]` gets the result of page `i`.
    fn decompress_batch(
        &self,
        inputs: &[(Encoding, &[u8])],
        out: &mut [Page],
        status: &mut [Result<(), CodecError>],
    );
    /// The output of a batch of `pages` pages this codec reported done was found wrong by its
    /// user (malformed, or a page that does not decode to itself), and compressed again
    /// elsewhere: a codec that can fail so (the GPU's) counts it as a failure.
    fn output_rejected(&self, pages: usize) {
        let _ = pages;
    }
}

/// The smallest batch worth a GPU: below it, the transfers and the launch cost more than the
/// cores would spend.
pub const GPU_MIN_BATCH_PAGES: usize = 1000;

/// Batch sizes at which the store switches backend (see `select_backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendThresholds {
    /// Batches of at least this many pages use all cores.
    pub parallel_min_pages: usize,
    /// Batches of at least this many pages use the GPU when one is present.
    pub gpu_min_pages: usize,
}

impl Default for BackendThresholds {
    fn default() -> Self {
        Self {
            parallel_min_pages: 100,
            gpu_min_pages: GPU_MIN_BATCH_PAGES,
        }
    }
}

/// The backend for a batch of `batch_len` pages: small batches stay on one core (spreading
/// them costs more than it saves), medium ones use all cores, large ones the GPU if present.
pub fn select_backend(
    batch_len: usize,
    gpu_available: bool,
    thresholds: &BackendThresholds,
) -> Backend {
    if gpu_available && batch_len >= thresholds.gpu_min_pages {
        Backend::Gpu
    } else if batch_len >= thresholds.parallel_min_pages {
        Backend::SimdParallel
    } else {
        Backend::Simd
    }
}

#[cfg(test)]
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]
mod tests {
    use super::*;

    #[test]
    fn backend_follows_batch_size() {
        let t = BackendThresholds::default();
        assert_eq!(select_backend(1, true, &t), Backend::Simd);
        assert_eq!(select_backend(99, true, &t), Backend::Simd);
        assert_eq!(select_backend(100, true, &t), Backend::SimdParallel);
        assert_eq!(select_backend(999, true, &t), Backend::SimdParallel);
        assert_eq!(select_backend(1000, true, &t), Backend::Gpu);
        assert_eq!(select_backend(1000, false, &t), Backend::SimdParallel);
        assert_eq!(select_backend(50_000, false, &t), Backend::SimdParallel);
        let custom = BackendThresholds {
            parallel_min_pages: 10,
            gpu_min_pages: 20,
        };
        assert_eq!(select_backend(9, true, &custom), Backend::Simd);
        assert_eq!(select_backend(10, true, &custom), Backend::SimdParallel);
        assert_eq!(select_backend(20, true, &custom), Backend::Gpu);
    }

    #[test]
    fn batch_well_formedness() {
        let mut b = CompressedBatch::default();
        b.reset(2);
        assert!(
            !b.is_well_formed(2),
            "zero-length raw pages are not well formed"
        );
        b.lens = vec![PAGE_SIZE as u16, 10];
        b.encodings = vec![Encoding::Raw, Encoding::Lz4];
        assert!(b.is_well_formed(2));
        assert!(!b.is_well_formed(3));
        b.lens[1] = PAGE_SIZE as u16 + 1;
        assert!(!b.is_well_formed(2));
    }
}
