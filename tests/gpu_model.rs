//! The CPU model of the GPU kernels (`src/gpu/model.rs`), on every machine: its LZ4 decodes
//! with the reference decoders to the exact input, its ratio is that of CPU LZ4 (G.116, G.120),
//! it decodes CPU LZ4, and its decoder turns corrupt input into an error.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]

mod gpu_support;

use gpu_support::{liblz4, mixed_pages, process_memory_pages, ratio, stored_len, MAX_LZ4_LEN};
use proptest::prelude::*;
use trueno_ublk::codec::{Page, PAGE_SIZE};
use trueno_ublk::gpu::model::{
    compress_page, decompress_page, STATUS_CORRUPT, STATUS_OK, STATUS_WRONG_LENGTH,
};

/// The model's LZ4 block of `page`, `None` when it does not fit in a page (then liblz4's does
/// not either: the page is incompressible and stored raw).
fn model_lz4(page: &Page) -> Option<Vec<u8>> {
    let mut out = [0u8; PAGE_SIZE];
    let block = compress_page(page, PAGE_SIZE, &mut out).map(|len| out[..len].to_vec());
    if block.is_none() {
        assert!(
            liblz4(page).len() > PAGE_SIZE - 16,
            "liblz4 fits where the model does not"
        );
    }
    block
}

/// Checks a model block with both reference decoders and the model decoder.
fn assert_decodes_to(block: &[u8], page: &Page) {
    let flex = lz4_flex::block::decompress(block, PAGE_SIZE).expect("lz4_flex decodes");
    assert_eq!(&flex[..], &page[..], "lz4_flex");
    let lib = lz4::block::decompress(block, Some(PAGE_SIZE as i32)).expect("liblz4 decodes");
    assert_eq!(&lib[..], &page[..], "liblz4");
    let mut back = [0u8; PAGE_SIZE];
    assert_eq!(decompress_page(block, &mut back), STATUS_OK);
    assert_eq!(&back, page, "model decoder");
}

fn edge_pages() -> Vec<Page> {
    let mut pages = Vec::new();
    pages.push([0u8; PAGE_SIZE]);
    pages.push([0xAB; PAGE_SIZE]);
    let mut ramp = [0u8; PAGE_SIZE];
    ramp.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    pages.push(ramp);
    for period in [1usize, 2, 3, 5, 7, 12, 31, 32, 33, 64, 255, 1000, 2048] {
        let mut page = [0u8; PAGE_SIZE];
        page.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = ((i % period) * 37 + 11) as u8);
        pages.push(page);
    }
    // A unique prefix, then a copy of it: one long match ending near the page end.
    let mut halves = mixed_pages(1, 99)[0];
    halves.copy_within(0..2048, 2048);
    pages.push(halves);
    // Matches only possible inside the last 12 bytes (they must stay literals).
    let mut tail = mixed_pages(1, 5)[0];
    for (i, b) in tail.iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
    }
    tail[PAGE_SIZE - 12..].fill(7);
    pages.push(tail);
    pages
}

#[test]
fn model_output_decodes_with_the_reference_decoders() {
    let mut pages = mixed_pages(800, 1);
    pages.extend(process_memory_pages(800));
    pages.extend(edge_pages());
    let mut compressed = 0;
    for page in &pages {
        if let Some(block) = model_lz4(page) {
            assert_decodes_to(&block, page);
            compressed += 1;
        }
    }
    assert!(
        compressed > pages.len() * 9 / 10,
        "only {compressed} pages compressed"
    );
}

#[test]
fn model_decodes_cpu_lz4() {
    let mut pages = mixed_pages(500, 2);
    pages.extend(process_memory_pages(300));
    pages.extend(edge_pages());
    for page in &pages {
        for block in [liblz4(page), lz4_flex::block::compress(&page[..])] {
            let mut back = [0u8; PAGE_SIZE];
            if block.len() > PAGE_SIZE {
                // Incompressible: the store keeps such pages raw, never as LZ4.
                assert_eq!(decompress_page(&block, &mut back), STATUS_CORRUPT);
                continue;
            }
            assert_eq!(decompress_page(&block, &mut back), STATUS_OK);
            assert_eq!(&back, page);
        }
    }
}

/// (model ratio, liblz4 ratio) with pages above `MAX_LZ4_LEN` stored raw.
fn ratios(pages: &[Page]) -> (f64, f64) {
    let mut model_stored = 0;
    let mut cpu_stored = 0;
    let mut out = [0u8; PAGE_SIZE];
    for page in pages {
        model_stored += stored_len(compress_page(page, MAX_LZ4_LEN, &mut out));
        cpu_stored += stored_len(Some(liblz4(page).len()));
    }
    (
        ratio(pages.len(), model_stored),
        ratio(pages.len(), cpu_stored),
    )
}

#[test]
fn g116_mixed_data_ratio_at_least_1_8_and_within_5_percent_of_cpu_lz4() {
    let pages = mixed_pages(2500, 3);
    let (model, cpu) = ratios(&pages);
    println!("mixed data: model ratio {model:.3}, liblz4 ratio {cpu:.3}");
    assert!(model >= 1.8, "G.116: model ratio {model:.3} < 1.8");
    assert!(model >= 0.95 * cpu, "model {model:.3} vs liblz4 {cpu:.3}");
}

#[test]
fn g120_real_memory_ratio_within_5_percent_of_cpu_lz4() {
    let pages = process_memory_pages(2500);
    assert!(pages.len() >= 200, "only {} memory pages read", pages.len());
    let (model, cpu) = ratios(&pages);
    println!(
        "{} real memory pages: model ratio {model:.3}, liblz4 ratio {cpu:.3}",
        pages.len()
    );
    assert!(
        model >= 0.95 * cpu,
        "G.120: model {model:.3} vs liblz4 {cpu:.3}"
    );
}

#[test]
fn output_over_the_budget_is_raw_and_never_written_past_it() {
    let pages = mixed_pages(300, 4);
    for page in &pages {
        let Some(full) = model_lz4(page) else {
            continue;
        };
        for budget in [full.len().saturating_sub(1), full.len() / 2, 0] {
            let mut out = [0x5Au8; PAGE_SIZE];
            assert_eq!(compress_page(page, budget, &mut out), None);
            assert!(
                out[budget..].iter().all(|&b| b == 0x5A),
                "wrote past the budget"
            );
        }
        let mut out = [0u8; PAGE_SIZE];
        assert_eq!(compress_page(page, full.len(), &mut out), Some(full.len()));
    }
}

#[test]
fn corrupt_input_is_an_error() {
    let page = mixed_pages(1, 6)[0];
    let block = liblz4(&page);
    let mut out = [0u8; PAGE_SIZE];
    // Every truncation.
    for cut in 0..block.len() {
        assert_ne!(
            decompress_page(&block[..cut], &mut out),
            STATUS_OK,
            "cut at {cut}"
        );
    }
    // Trailing garbage: either corrupt or the wrong length, never OK.
    let mut longer = block.clone();
    longer.extend_from_slice(&[0x10, 0xFF]);
    assert_ne!(decompress_page(&longer, &mut out), STATUS_OK);
    // Offset 0, and an offset reaching before the page start.
    assert_eq!(
        decompress_page(&[0x10, b'a', 0, 0], &mut out),
        STATUS_CORRUPT
    );
    assert_eq!(
        decompress_page(&[0x10, b'a', 2, 0], &mut out),
        STATUS_CORRUPT
    );
    // A match running past the page end.
    let mut overrun = vec![0x1F, b'a', 1, 0];
    overrun.extend(std::iter::repeat_n(255u8, 17));
    overrun.push(0);
    assert_eq!(decompress_page(&overrun, &mut out), STATUS_CORRUPT);
    // A literal run longer than the input.
    assert_eq!(
        decompress_page(&[0xF0, 40, 1, 2, 3], &mut out),
        STATUS_CORRUPT
    );
    // Too short a page, and more than a page of input.
    assert_eq!(
        decompress_page(&[0x30, 1, 2, 3], &mut out),
        STATUS_WRONG_LENGTH | 3
    );
    assert_eq!(
        decompress_page(&vec![0u8; PAGE_SIZE + 1], &mut out),
        STATUS_CORRUPT
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random input never panics the model decoder. Random bytes almost never decode to a
    /// whole page, so the agreement with lz4_flex below seldom runs: `mutated_blocks_are_handled`
    /// checks it on blocks that do.
    #[test]
    fn random_bytes_never_panic_the_model_decoder(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let mut out = [0u8; PAGE_SIZE];
        if decompress_page(&bytes, &mut out) == STATUS_OK {
            let flex = lz4_flex::block::decompress(&bytes, PAGE_SIZE).expect("lz4_flex accepts");
            prop_assert_eq!(&flex[..], &out[..]);
        }
    }

    /// Flipping bytes of a valid block never panics; an accepted result matches lz4_flex.
    #[test]
    fn mutated_blocks_are_handled(seed in 0u64..1000, flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4)) {
        let page = mixed_pages(1, seed)[0];
        let Some(mut block) = model_lz4(&page) else {
            return Ok(());
        };
        for (at, value) in flips {
            let at = at % block.len();
            block[at] = value;
        }
        let mut out = [0u8; PAGE_SIZE];
        if decompress_page(&block, &mut out) == STATUS_OK {
            let flex = lz4_flex::block::decompress(&block, PAGE_SIZE).expect("lz4_flex accepts");
            prop_assert_eq!(&flex[..], &out[..]);
        }
    }

    /// Any page round-trips through the model and the reference decoders.
    #[test]
    fn any_page_round_trips(seed in any::<u64>(), kind in 0u8..4) {
        let mut page = mixed_pages(1, seed)[0];
        if kind == 0 {
            // Low-entropy random bytes: many short matches.
            let mut rng = gpu_support::Rng::new(seed);
            page.iter_mut().for_each(|b| *b = (rng.below(4)) as u8);
        }
        if let Some(block) = model_lz4(&page) {
            assert_decodes_to(&block, &page);
        }
    }
}
