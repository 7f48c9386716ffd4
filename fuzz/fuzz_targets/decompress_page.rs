//! Arbitrary bytes as an LZ4, zstd or raw page: the decoder must return an error or a whole
//! page, never panic, read or write out of bounds, or hand back a short page.
//!
//! Run with `scripts/fuzz.sh` (stable toolchain) or `cargo fuzz run decompress_page`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use trueno_ublk::codec::{decompress_page, Encoding, PAGE_SIZE};

fuzz_target!(|data: &[u8]| {
    // First byte picks the encoding; the rest is the "compressed" page.
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    let Some(encoding) = Encoding::from_bits(selector % 3) else {
        return;
    };
    // A dirty buffer, as the store's read path hands over a reused request buffer.
    let mut out = [0xa5u8; PAGE_SIZE];
    if decompress_page(encoding, bytes, &mut out).is_ok() && encoding == Encoding::Raw {
        assert_eq!(&out[..], bytes, "a raw page decodes to itself");
    }
});
