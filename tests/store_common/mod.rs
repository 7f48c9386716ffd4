//! Page generators and test doubles shared by the store and codec tests.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]
#![allow(dead_code)] // each test crate uses a different part of this module

use std::sync::atomic::{AtomicUsize, Ordering};

use trueno_ublk::codec::{
    Algorithm, BatchCodec, CodecError, CompressedBatch, CpuCodec, Encoding, Page, PAGE_SIZE,
};

/// xorshift64*: deterministic pseudo-random numbers for page contents.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

pub fn zero_page() -> Box<Page> {
    Box::new([0u8; PAGE_SIZE])
}

pub fn same_page(word: u64) -> Box<Page> {
    let mut p = zero_page();
    for w in p.chunks_exact_mut(8) {
        w.copy_from_slice(&word.to_ne_bytes());
    }
    p
}

pub fn random_page(seed: u64) -> Box<Page> {
    let mut rng = Rng(seed | 1);
    let mut p = zero_page();
    for w in p.chunks_exact_mut(8) {
        w.copy_from_slice(&rng.next().to_ne_bytes());
    }
    p
}

/// Word salad: compresses about 2-3x with LZ4, better with zstd.
pub fn text_page(seed: u64) -> Box<Page> {
    const WORDS: [&str; 16] = [
        "the ",
        "page ",
        "swap ",
        "memory ",
        "kernel ",
        "of ",
        "and ",
        "compressed ",
        "block ",
        "device ",
        "queue ",
        "a ",
        "to ",
        "zram ",
        "batch ",
        "flush ",
    ];
    let mut rng = Rng(seed | 1);
    let mut p = zero_page();
    let mut i = 0;
    while i < PAGE_SIZE {
        let w = WORDS[(rng.next() % WORDS.len() as u64) as usize].as_bytes();
        let n = w.len().min(PAGE_SIZE - i);
        p[i..i + n].copy_from_slice(&w[..n]);
        i += n;
    }
    p
}

/// Heap-like page: pointers into a few regions, small integers, zero padding and some bytes
/// of noise, as process memory looks.
pub fn mixed_page(seed: u64) -> Box<Page> {
    let mut rng = Rng(seed | 1);
    let mut p = zero_page();
    for w in p.chunks_exact_mut(8) {
        let r = rng.next();
        let v = match r % 8 {
            0 | 1 => 0x0000_7f00_0000_0000 | ((r >> 8) & 0xff_fff0),
            2 | 3 => (r >> 32) % 64,
            4 | 5 => 0,
            6 => 0x0000_5555_0000_0000 | ((r >> 16) & 0xfff8),
            _ => r,
        };
        w.copy_from_slice(&v.to_ne_bytes());
    }
    p
}

/// Random bytes for the first `random` bytes, zeros after: compresses to about `random`.
pub fn partly_random_page(seed: u64, random: usize) -> Box<Page> {
    let mut p = random_page(seed);
    p[random..].fill(0);
    p
}

/// A page of kind `kind % 5`: zero, same-filled, text, random, mixed.
pub fn page_of_kind(kind: u64, seed: u64) -> Box<Page> {
    match kind % 5 {
        0 => zero_page(),
        // A fill word the page table holds in the entry (sign-extended 60 bits); other fill
        // words are compressed like any page (see `store_roundtrip`).
        1 => same_page((seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1) >> 5),
        2 => text_page(seed),
        3 => random_page(seed),
        _ => mixed_page(seed),
    }
}

/// Stands for the GPU: LZ4 on the CPU, counting batches. `fail` makes every batch fail,
/// `malformed` returns Ok with output that does not hold together.
pub struct FakeGpu {
    pub fail: bool,
    pub malformed: bool,
    /// Keep LZ4 output up to a whole page, as a codec without the huge-page rule would.
    pub no_huge_rule: bool,
    pub batches: AtomicUsize,
    inner: CpuCodec,
}

impl FakeGpu {
    pub fn working() -> Self {
        Self {
            fail: false,
            malformed: false,
            no_huge_rule: false,
            batches: AtomicUsize::new(0),
            inner: CpuCodec::single(Algorithm::Lz4),
        }
    }
    pub fn failing() -> Self {
        Self {
            fail: true,
            ..Self::working()
        }
    }
    pub fn without_huge_rule() -> Self {
        Self {
            no_huge_rule: true,
            ..Self::working()
        }
    }
    pub fn malformed() -> Self {
        Self {
            malformed: true,
            ..Self::working()
        }
    }
}

impl BatchCodec for FakeGpu {
    fn compress_batch(&self, pages: &[&Page], out: &mut CompressedBatch) -> Result<(), CodecError> {
        self.batches.fetch_add(1, Ordering::Relaxed);
        if self.fail {
            return Err(CodecError::Gpu("injected failure".into()));
        }
        if self.malformed {
            out.reset(pages.len());
            return Ok(());
        }
        if self.no_huge_rule {
            out.reset(pages.len());
            for (i, page) in pages.iter().enumerate() {
                let slot = &mut out.data[i * PAGE_SIZE..][..PAGE_SIZE];
                match lz4::block::compress_to_buffer(&page[..], None, false, slot) {
                    Ok(n) => (out.lens[i], out.encodings[i]) = (n as u16, Encoding::Lz4),
                    Err(_) => {
                        slot.copy_from_slice(&page[..]);
                        (out.lens[i], out.encodings[i]) = (PAGE_SIZE as u16, Encoding::Raw);
                    }
                }
            }
            return Ok(());
        }
        self.inner.compress_batch(pages, out)
    }

    fn decompress_batch(
        &self,
        inputs: &[(Encoding, &[u8])],
        out: &mut [Page],
        status: &mut [Result<(), CodecError>],
    ) {
        self.inner.decompress_batch(inputs, out, status)
    }
}

/// Poll `cond` until it holds or `secs` pass; no timing assertion beyond a generous deadline.
pub fn wait_until(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    cond()
}
