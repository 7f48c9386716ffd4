//! Page codecs: classification (zero / same-filled), LZ4, zstd and raw pages, and batch
//! compression on one core or many. Knows nothing of the page table or the kernel.
//!
//! SKELETON: the types below are the contract the store, the GPU backend and the daemon
//! build against. Implementations are filled in by the codec/store work.

use thiserror::Error;

/// Size of one page of the device, in bytes.
pub const PAGE_SIZE: usize = 4096;

/// One uncompressed page.
pub type Page = [u8; PAGE_SIZE];

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

/// The compression algorithm asked for on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    Lz4,
    Zstd {
        level: i32,
    },
    /// Chosen per page.
    Adaptive,
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
}

/// A compressed batch: page `i` is `data[i * PAGE_SIZE..][..lens[i]]`, encoded as
/// `encodings[i]`. Fixed 4 KiB slots let every backend (rayon, GPU) write in place.
#[derive(Debug, Default)]
pub struct CompressedBatch {
    pub data: Vec<u8>,
    pub lens: Vec<u16>,
    pub encodings: Vec<Encoding>,
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
}
