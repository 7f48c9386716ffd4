//! The pages a bench run writes: a corpus file of 4 KiB pages (see `scripts/make-corpus.sh`) or
//! a built-in generated mix shaped like real memory, so the bench runs anywhere.

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::BenchError;
use crate::codec::PAGE_SIZE;

/// Alignment of page buffers: O_DIRECT I/O to a block device needs the logical block size.
pub const IO_ALIGN: usize = 4096;

/// A zero-filled byte buffer whose start is `IO_ALIGN`-aligned, built in safe code by
/// over-allocating a `Vec` (whose heap block never moves) and slicing at the aligned offset.
pub struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> Self {
        let storage = vec![0u8; len + IO_ALIGN];
        let address = storage.as_ptr() as usize;
        let start = (IO_ALIGN - address % IO_ALIGN) % IO_ALIGN;
        Self {
            storage,
            start,
            len,
        }
    }

    /// Fill with a filler byte before a timed read into the buffer: a page a read skipped
    /// cannot then pass verification by holding stale data, and the kernel's first-touch page
    /// faults happen here instead of inside the timing.
    pub fn poison(&mut self) {
        self.as_mut_slice().fill(0xA5);
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// Where a corpus came from, for the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CorpusSource {
    File(PathBuf),
    Generated { seed: u64 },
}

impl std::fmt::Display for CorpusSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CorpusSource::File(path) => write!(f, "{}", path.display()),
            CorpusSource::Generated { seed } => write!(f, "built-in mix (seed {seed})"),
        }
    }
}

/// Whole 4 KiB pages in one aligned buffer.
pub struct Corpus {
    pages: AlignedBuf,
    pub source: CorpusSource,
}

impl Corpus {
    /// Load the first `max_bytes` (or all) of a corpus file.
    pub fn load(path: &Path, max_bytes: Option<u64>) -> Result<Self, BenchError> {
        let io_error = |source| BenchError::Corpus {
            path: path.to_owned(),
            source,
        };
        let mut file = File::open(path).map_err(io_error)?;
        let file_len = file.metadata().map_err(io_error)?.len();
        let len = max_bytes.map_or(file_len, |cap| cap.min(file_len));
        if len == 0 || !len.is_multiple_of(PAGE_SIZE as u64) {
            return Err(BenchError::NotWholePages {
                path: path.to_owned(),
                len,
            });
        }
        let len = usize::try_from(len).map_err(|_| BenchError::NotWholePages {
            path: path.to_owned(),
            len,
        })?;
        let mut pages = AlignedBuf::zeroed(len);
        file.read_exact(pages.as_mut_slice()).map_err(io_error)?;
        Ok(Self {
            pages,
            source: CorpusSource::File(path.to_owned()),
        })
    }

    /// The built-in mix: `page_count` pages, the same bytes for the same seed.
    pub fn generated(page_count: usize, seed: u64) -> Self {
        let mut pages = AlignedBuf::zeroed(page_count * PAGE_SIZE);
        pages
            .as_mut_slice()
            .par_chunks_mut(PAGE_SIZE)
            .enumerate()
            .for_each(|(index, page)| fill_mixed_page(seed, index as u64, page));
        Self {
            pages,
            source: CorpusSource::Generated { seed },
        }
    }

    pub fn page_count(&self) -> usize {
        self.pages.len / PAGE_SIZE
    }

    pub fn bytes(&self) -> &[u8] {
        self.pages.as_slice()
    }

    pub fn page(&self, index: usize) -> &[u8] {
        &self.bytes()[index * PAGE_SIZE..][..PAGE_SIZE]
    }
}

/// SplitMix64: a tiny, fast, seedable generator; the bench needs reproducible pages and
/// shuffles, not cryptographic randomness.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..bound` (`bound > 0`); the modulo bias is irrelevant here.
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next_u64() % bound
    }

    /// An index in `0..bound` (`bound > 0`).
    pub fn index_below(&mut self, bound: usize) -> usize {
        #[allow(
            clippy::cast_possible_truncation,
            reason = "usize is no wider than u64 on Linux targets, and the value is below a usize"
        )]
        let index = self.below(bound as u64) as usize;
        index
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.index_below(i + 1);
            items.swap(i, j);
        }
    }
}

/// What a generated page imitates, with its share of the mix in per mille. Real memory dumps
/// had 1–2% zero or same-filled pages, 3% that LZ4 cannot compress and an LZ4 ratio of 2.7–3.3;
/// this mix gives LZ4 (zram) a ratio of about 2.6 with 4% huge pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixKind {
    Zero,
    SameFilled,
    Text,
    Structs,
    Sparse,
    Numeric,
    Incompressible,
}

const MIX: [(MixKind, u64); 7] = [
    (MixKind::Zero, 15),
    (MixKind::SameFilled, 10),
    (MixKind::Text, 250),
    (MixKind::Structs, 320),
    (MixKind::Sparse, 175),
    (MixKind::Numeric, 190),
    (MixKind::Incompressible, 40),
];

/// The kind of generated page `index` for `seed`, decided by the page's own generator.
pub fn mix_kind(rng: &mut SplitMix64) -> MixKind {
    let mut pick = rng.below(1000);
    for (kind, share) in MIX {
        if pick < share {
            return kind;
        }
        pick -= share;
    }
    MixKind::Incompressible
}

fn page_rng(seed: u64, index: u64) -> SplitMix64 {
    let mut rng = SplitMix64::new(seed ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03));
    rng.next_u64();
    rng
}

/// Fill one page of the built-in mix; a pure function of `(seed, index)`.
pub fn fill_mixed_page(seed: u64, index: u64, page: &mut [u8]) {
    let mut rng = page_rng(seed, index);
    match mix_kind(&mut rng) {
        MixKind::Zero => page.fill(0),
        MixKind::SameFilled => {
            let word = match rng.below(3) {
                0 => u64::MAX,
                1 => 0x0101_0101_0101_0101 * (rng.below(255) + 1),
                _ => rng.next_u64(),
            };
            for chunk in page.chunks_exact_mut(8) {
                chunk.copy_from_slice(&word.to_le_bytes());
            }
        }
        MixKind::Text => fill_text(&mut rng, page),
        MixKind::Structs => fill_structs(&mut rng, page),
        MixKind::Sparse => {
            page.fill(0);
            for _ in 0..rng.below(48) + 1 {
                let at = rng.index_below(PAGE_SIZE / 8) * 8;
                let value = if rng.below(2) == 0 {
                    rng.below(4096)
                } else {
                    heap_pointer(&mut rng)
                };
                page[at..at + 8].copy_from_slice(&value.to_le_bytes());
            }
        }
        MixKind::Numeric => fill_numeric(&mut rng, page),
        MixKind::Incompressible => {
            for chunk in page.chunks_exact_mut(8) {
                chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
            }
        }
    }
}

const WORDS: [&str; 48] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be",
    "by", "this", "are", "from", "or", "have", "an", "they", "which", "one", "you", "were",
    "memory", "page", "swap", "kernel", "return", "self", "error", "value", "buffer", "struct",
    "const", "while", "import", "function", "string", "length", "index", "config", "request",
    "device", "thread", "result",
];

/// Prose, JSON records or log lines built from a small vocabulary.
fn fill_text(rng: &mut SplitMix64, page: &mut [u8]) {
    let style = rng.below(3);
    let mut text = String::with_capacity(PAGE_SIZE + 256);
    let mut serial = rng.below(1 << 20);
    while text.len() < PAGE_SIZE {
        let mut word = || WORDS[rng.index_below(WORDS.len())];
        serial += 1;
        let _ = match style {
            0 => write!(
                text,
                "{} {} {}, {} {}. ",
                word(),
                word(),
                word(),
                word(),
                word()
            ),
            1 => writeln!(
                text,
                "{{\"id\": {serial}, \"name\": \"{} {}\", \"kind\": \"{}\", \"active\": true}},",
                word(),
                word(),
                word()
            ),
            _ => writeln!(
                text,
                "2026-11-22T11:{:02}:{:02} INFO {}: {} {} request {serial} done",
                serial / 60 % 60,
                serial % 60,
                word(),
                word(),
                word()
            ),
        };
    }
    page.copy_from_slice(&text.as_bytes()[..PAGE_SIZE]);
}

/// A pointer into a 64 MiB heap; records on one page mostly point near each other.
fn heap_pointer(rng: &mut SplitMix64) -> u64 {
    0x0000_5581_2000_0000 + (rng.below(64 << 20) & !15)
}

fn nearby_pointer(rng: &mut SplitMix64, base: u64) -> u64 {
    base + (rng.below(1 << 16) & !15)
}

/// An array of 64-byte records: two heap pointers, a small key, refcount and flags, a shared
/// vtable pointer, a length and padding — what much of a process's heap looks like.
fn fill_structs(rng: &mut SplitMix64, page: &mut [u8]) {
    let vtable = 0x0000_5581_1000_0000 + rng.below(256) * 64;
    let first_key = rng.below(1 << 20);
    let arena = heap_pointer(rng);
    for (i, record) in page.chunks_exact_mut(64).enumerate() {
        let fields = [
            nearby_pointer(rng, arena),
            nearby_pointer(rng, arena),
            first_key + i as u64,
            rng.below(8) | ([0, 1, 0x10, 0x11][rng.index_below(4)] << 32),
            vtable,
            rng.below(512),
            0,
            if rng.below(4) == 0 {
                heap_pointer(rng)
            } else {
                0
            },
        ];
        for (slot, field) in record.chunks_exact_mut(8).zip(fields) {
            slot.copy_from_slice(&field.to_le_bytes());
        }
    }
}

/// Counters, small integers, or floating-point values on a coarse grid (prices, sizes).
fn fill_numeric(rng: &mut SplitMix64, page: &mut [u8]) {
    match rng.below(3) {
        0 => {
            let mut value = rng.below(1 << 32);
            let stride = rng.below(64) + 1;
            for slot in page.chunks_exact_mut(8) {
                value += stride;
                slot.copy_from_slice(&value.to_le_bytes());
            }
        }
        1 => {
            for slot in page.chunks_exact_mut(4) {
                // A small u32 (below 24): the low 4 bytes of the little-endian u64.
                let value = rng.below(8) * rng.below(3);
                slot.copy_from_slice(&value.to_le_bytes()[..4]);
            }
        }
        _ => {
            let mut value = rng.below(1000) as f64;
            for slot in page.chunks_exact_mut(8) {
                value += (rng.below(9) as f64 - 4.0) * 0.25;
                slot.copy_from_slice(&value.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_start_on_a_block_boundary() {
        for len in [0, 1, 4096, 12345, 1 << 20] {
            let mut buf = AlignedBuf::zeroed(len);
            assert_eq!(buf.as_slice().len(), len);
            assert_eq!(buf.as_mut_slice().as_ptr() as usize % IO_ALIGN, 0);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut items: Vec<u32> = (0..1000).collect();
        SplitMix64::new(7).shuffle(&mut items);
        assert_ne!(items, (0..1000).collect::<Vec<_>>());
        items.sort_unstable();
        assert_eq!(items, (0..1000).collect::<Vec<_>>());
    }
}
