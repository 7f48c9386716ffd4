//! Shared by the `gpu_*` tests: a reference CPU batch codec (liblz4 to compress, lz4_flex and
//! zstd to decompress) and page corpora (a synthetic realistic mix, and real memory pages of
//! the test process itself).

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]
#![allow(dead_code)] // each test binary uses a different part

use std::fs;
use std::io::{Read, Seek, SeekFrom};

use trueno_ublk::codec::{BatchCodec, CodecError, CompressedBatch, Encoding, Page, PAGE_SIZE};
use trueno_ublk::gpu::model;

/// The longest LZ4 output the tests keep; longer pages are stored raw (the codec's default).
pub const MAX_LZ4_LEN: usize = 3584;

/// The reference: liblz4 (default acceleration) per page, raw above `MAX_LZ4_LEN`; decodes LZ4 with
/// lz4_flex, zstd with the zstd crate.
pub struct CpuReference;

/// liblz4's LZ4 block of one page.
pub fn liblz4(page: &Page) -> Vec<u8> {
    lz4::block::compress(page, Some(lz4::block::CompressionMode::DEFAULT), false)
        .expect("liblz4 compresses any page")
}

impl BatchCodec for CpuReference {
    fn compress_batch(&self, pages: &[&Page], out: &mut CompressedBatch) -> Result<(), CodecError> {
        out.data = vec![0; pages.len() * PAGE_SIZE];
        out.lens.clear();
        out.encodings.clear();
        for (i, page) in pages.iter().enumerate() {
            let lz = liblz4(page);
            let slot = &mut out.data[i * PAGE_SIZE..][..PAGE_SIZE];
            if lz.len() > MAX_LZ4_LEN {
                slot.copy_from_slice(&page[..]);
                out.lens.push(PAGE_SIZE as u16);
                out.encodings.push(Encoding::Raw);
            } else {
                slot[..lz.len()].copy_from_slice(&lz);
                out.lens.push(lz.len() as u16);
                out.encodings.push(Encoding::Lz4);
            }
        }
        Ok(())
    }

    fn decompress_batch(
        &self,
        inputs: &[(Encoding, &[u8])],
        out: &mut [Page],
        status: &mut [Result<(), CodecError>],
    ) {
        for ((&(encoding, bytes), page), st) in inputs.iter().zip(out).zip(status) {
            *st = match encoding {
                Encoding::Raw if bytes.len() == PAGE_SIZE => {
                    page.copy_from_slice(bytes);
                    Ok(())
                }
                Encoding::Raw => Err(CodecError::WrongLength(bytes.len())),
                Encoding::Lz4 => match lz4_flex::block::decompress_into(bytes, page) {
                    Ok(PAGE_SIZE) => Ok(()),
                    Ok(n) => Err(CodecError::WrongLength(n)),
                    Err(_) => Err(CodecError::Corrupt),
                },
                Encoding::Zstd => match zstd::bulk::decompress_to_buffer(bytes, &mut page[..]) {
                    Ok(PAGE_SIZE) => Ok(()),
                    Ok(n) => Err(CodecError::WrongLength(n)),
                    Err(_) => Err(CodecError::Corrupt),
                },
            };
        }
    }
}

/// A small deterministic generator (PCG-style) so corpora are the same on every run.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let x = self.0;
        (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ (x >> 32)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "page",
    "memory",
    "swap",
    "kernel",
    "device",
    "block",
    "compress",
    "buffer",
    "thread",
    "queue",
    "request",
    "return",
    "error",
    "value",
    "struct",
    "const",
    "static",
    "self",
    "index",
    "length",
    "offset",
    "pointer",
    "allocate",
    "release",
    "function",
    "module",
    "config",
    "status",
    "daemon",
    "process",
    "signal",
    "handler",
    "stream",
    "context",
    "0x7f3a",
    "127.0.0.1",
    "GET /api/v1/items",
    "HTTP/1.1 200 OK",
    "user_id",
    "\n",
];

fn fill_text(rng: &mut Rng, page: &mut Page) {
    let mut pos = 0;
    while pos < PAGE_SIZE {
        let word = WORDS[rng.below(WORDS.len() as u64) as usize].as_bytes();
        for &b in word.iter().chain(b" ") {
            if pos < PAGE_SIZE {
                page[pos] = b;
                pos += 1;
            }
        }
    }
}

/// Arrays of records as a program's heap holds them: ids counting up, pointers into one
/// region, small enums, a few floats from a handful of values.
fn fill_records(rng: &mut Rng, page: &mut Page) {
    let base_ptr = 0x0000_7f3a_0000_0000u64 + (rng.below(1 << 20) << 12);
    let mut id = rng.below(1 << 30);
    for rec in page.chunks_exact_mut(32) {
        id += 1 + rng.below(3);
        rec[0..8].copy_from_slice(&id.to_le_bytes());
        rec[8..16].copy_from_slice(&(base_ptr + rng.below(64) * 64).to_le_bytes());
        rec[16..20].copy_from_slice(&(rng.below(4) as u32).to_le_bytes());
        rec[20..24].copy_from_slice(&[0, 0, 0, 0]);
        let value = [0.0f64, 1.0, 0.5, 100.0][rng.below(4) as usize];
        rec[24..32].copy_from_slice(&value.to_le_bytes());
    }
}

/// Mostly zero, with a few live words.
fn fill_sparse(rng: &mut Rng, page: &mut Page) {
    page.fill(0);
    for _ in 0..(8 + rng.below(24)) {
        let at = rng.below((PAGE_SIZE / 8) as u64) as usize * 8;
        page[at..at + 8].copy_from_slice(&rng.next().to_le_bytes());
    }
}

/// Machine-code-like bytes: a skewed alphabet with repeated short idioms.
fn fill_code(rng: &mut Rng, page: &mut Page) {
    const IDIOMS: &[&[u8]] = &[
        &[0x48, 0x89, 0xe5],
        &[0x48, 0x83, 0xec, 0x20],
        &[0xe8],
        &[0xc3],
        &[0x0f, 0x1f, 0x44, 0x00, 0x00],
        &[0x48, 0x8b, 0x45],
        &[0x89, 0x7d],
        &[0x74],
        &[0x75],
        &[0x31, 0xc0],
    ];
    let mut pos = 0;
    while pos < PAGE_SIZE {
        let chunk: Vec<u8> = if rng.below(3) == 0 {
            (0..1 + rng.below(4)).map(|_| rng.next() as u8).collect()
        } else {
            IDIOMS[rng.below(IDIOMS.len() as u64) as usize].to_vec()
        };
        for b in chunk {
            if pos < PAGE_SIZE {
                page[pos] = b;
                pos += 1;
            }
        }
    }
}

fn fill_random(rng: &mut Rng, page: &mut Page) {
    for word in page.chunks_exact_mut(8) {
        word.copy_from_slice(&rng.next().to_le_bytes());
    }
}

/// A realistic mix of pages that reach the codec (no zero or same-filled pages): text, heap
/// records, sparse pages, code-like pages and 3% incompressible ones.
pub fn mixed_pages(n: usize, seed: u64) -> Vec<Page> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| {
            let mut page = [0u8; PAGE_SIZE];
            match rng.below(100) {
                0..=29 => fill_text(&mut rng, &mut page),
                30..=59 => fill_records(&mut rng, &mut page),
                60..=74 => fill_sparse(&mut rng, &mut page),
                75..=96 => fill_code(&mut rng, &mut page),
                _ => fill_random(&mut rng, &mut page),
            }
            page
        })
        .collect()
}

fn same_filled(page: &Page) -> bool {
    let first = &page[..8];
    page.chunks_exact(8).all(|w| w == first)
}

/// Up to `max` real memory pages of this process (its binary, libraries, heap and stacks),
/// read through /proc/self/mem; zero and same-filled pages are left out, as the store does.
pub fn process_memory_pages(max: usize) -> Vec<Page> {
    // Fill some heap with live data structures first so the heap is not empty.
    let heap: Vec<String> = (0..20_000)
        .map(|i| format!("entry-{i}-{}", i * 7))
        .collect();
    let maps = fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    let mut mem = fs::File::open("/proc/self/mem").expect("open /proc/self/mem");
    let mut pages = Vec::new();
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        // Device mappings (the GPU driver's among them) are not memory to read.
        let path = fields.nth(3).unwrap_or("");
        let special = path.starts_with("/dev/")
            || path.starts_with("anon_inode:")
            || path.starts_with("[vvar")
            || path == "[vsyscall]";
        if !perms.starts_with('r') || special {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        else {
            continue;
        };
        let mut addr = start;
        while addr < end && pages.len() < max {
            let mut page = [0u8; PAGE_SIZE];
            if mem.seek(SeekFrom::Start(addr)).is_ok()
                && mem.read_exact(&mut page).is_ok()
                && !same_filled(&page)
            {
                pages.push(page);
            }
            addr += PAGE_SIZE as u64;
        }
    }
    drop(heap);
    pages
}

/// Stored bytes of a page: its LZ4 length, or a whole page when it is raw (> `MAX_LZ4_LEN`).
pub fn stored_len(lz4_len: Option<usize>) -> usize {
    match lz4_len {
        Some(len) if len <= MAX_LZ4_LEN => len,
        _ => PAGE_SIZE,
    }
}

/// Ratio of input bytes to stored bytes.
pub fn ratio(pages: usize, stored: usize) -> f64 {
    (pages * PAGE_SIZE) as f64 / stored as f64
}

pub fn refs(pages: &[Page]) -> Vec<&Page> {
    pages.iter().collect()
}

/// A compressed batch as the inputs of `BatchCodec::decompress_batch`.
pub fn inputs(batch: &CompressedBatch) -> Vec<(Encoding, &[u8])> {
    (0..batch.lens.len())
        .map(|i| {
            let bytes = &batch.data[i * PAGE_SIZE..][..usize::from(batch.lens[i])];
            (batch.encodings[i], bytes)
        })
        .collect()
}

/// Every `step`-th page of `batch` is the model kernel's LZ4 of `pages` byte for byte, or the
/// page raw where that is longer than `MAX_LZ4_LEN`.
pub fn assert_is_model_output(pages: &[Page], batch: &CompressedBatch, step: usize) {
    assert_eq!(batch.lens.len(), pages.len());
    assert_eq!(batch.encodings.len(), pages.len());
    let mut expect = [0u8; PAGE_SIZE];
    for (i, page) in pages.iter().enumerate().step_by(step) {
        let slot = &batch.data[i * PAGE_SIZE..][..usize::from(batch.lens[i])];
        match model::compress_page(page, MAX_LZ4_LEN, &mut expect) {
            Some(len) => {
                assert_eq!(batch.encodings[i], Encoding::Lz4, "page {i}");
                assert_eq!(slot, &expect[..len], "page {i}: not the model's output");
            }
            None => {
                assert_eq!(batch.encodings[i], Encoding::Raw, "page {i}");
                assert_eq!(slot, &page[..], "page {i}");
            }
        }
    }
}
