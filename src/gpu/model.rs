//! CPU model of the kernels in `kernels/lz4.cu`, step for step: one warp of 32 lanes per page,
//! candidates in rounds of 32 positions with the same hash and table, the same first-hit greedy
//! parse with the same forward (32 bytes per ballot) and backward extension, and the same
//! sequence encoding. Its output is byte for byte what the kernel writes, so the tests that run
//! everywhere (model vs the reference LZ4 decoder, model ratio vs CPU LZ4) say what the kernel
//! does, and the GPU tests compare the kernel with the model.
//!
//! Lane-parallel steps are written as loops over `lane in 0..WARP`; warp intrinsics
//! (`__match_any_sync`, `__ballot_sync`, `__shfl_sync`) as the helpers below.

#![allow(
    clippy::cast_possible_truncation,
    reason = "the model mirrors the CUDA kernel: positions, offsets and lengths are within a 4 KiB page, token nibbles are clamped to 15, and hash slots are masked"
)]
#![forbid(unsafe_code)]

use crate::codec::{Page, PAGE_SIZE};

/// Lanes per warp; one warp handles one page.
pub const WARP: usize = 32;
/// Pages per 128-thread block.
pub const PAGES_PER_BLOCK: usize = 4;
const HASH_BITS: u32 = 12;
const HASH_SIZE: usize = 1 << HASH_BITS;
const NO_POS: u32 = 0xFFFF;
const MIN_MATCH: usize = 4;
/// LZ4 block rules: a match starts at most 12 bytes before the end; the last 5 bytes are
/// literals.
const LAST_MATCH_START: usize = PAGE_SIZE - 12;
const MATCH_END_LIMIT: usize = PAGE_SIZE - 5;

/// `out_lens[i]` of the compress kernel when page `i` did not fit in `max_out` bytes.
pub const LEN_RAW: u32 = u32::MAX;
/// Statuses of the decompress kernel.
pub const STATUS_OK: u32 = 0;
pub const STATUS_CORRUPT: u32 = 1;
/// `STATUS_WRONG_LENGTH | n`: the page decoded to `n` bytes, not `PAGE_SIZE`.
pub const STATUS_WRONG_LENGTH: u32 = 0x8000_0000;

fn read32(page: &[u8], pos: usize) -> u32 {
    u32::from_le_bytes([page[pos], page[pos + 1], page[pos + 2], page[pos + 3]])
}

fn hash4(v: u32) -> u32 {
    v.wrapping_mul(2_654_435_761) >> (32 - HASH_BITS)
}

/// Bytes taken by the 255-run that extends a 4-bit length field holding `len`.
fn ext_bytes(len: usize) -> usize {
    if len >= 15 {
        (len - 15) / 255 + 1
    } else {
        0
    }
}

fn write_ext(out: &mut [u8], mut op: usize, len: usize) -> usize {
    if len < 15 {
        return op;
    }
    let mut rest = len - 15;
    while rest >= 255 {
        out[op] = 255;
        op += 1;
        rest -= 255;
    }
    out[op] = rest as u8;
    op + 1
}

/// `__match_any_sync`: for each lane, the mask of lanes holding the same key.
fn match_any(keys: &[u32; WARP]) -> [u32; WARP] {
    let mut peers = [0u32; WARP];
    for lane in 0..WARP {
        if peers[lane] != 0 {
            continue; // already in a group found from a lower lane
        }
        let mut group = 0u32;
        for (other, &key) in keys.iter().enumerate().skip(lane) {
            if key == keys[lane] {
                group |= 1 << other;
            }
        }
        let mut members = group;
        while members != 0 {
            peers[members.trailing_zeros() as usize] = group;
            members &= members - 1;
        }
    }
    peers
}

/// `__ballot_sync`: the mask of lanes whose predicate holds.
fn ballot(pred: impl Fn(usize) -> bool) -> u32 {
    (0..WARP)
        .filter(|&lane| pred(lane))
        .fold(0u32, |mask, lane| mask | 1 << lane)
}

/// `__ffs(x) - 1` for non-zero `x`.
fn first_lane(mask: u32) -> usize {
    mask.trailing_zeros() as usize
}

/// The kernel's `emit_sequence`: `lit` literals from `page[anchor..]`, then a match of `mlen` at
/// distance `off` if any. `None` when the sequence would pass `max_out`.
fn emit_sequence(
    page: &[u8],
    out: &mut [u8],
    op: usize,
    max_out: usize,
    anchor: usize,
    lit: usize,
    matched: Option<(usize, usize)>,
) -> Option<usize> {
    let mcode = matched.map_or(0, |(_, mlen)| mlen - MIN_MATCH);
    let size = 1 + ext_bytes(lit) + lit + matched.map_or(0, |_| 2 + ext_bytes(mcode));
    if op + size > max_out {
        return None;
    }
    let lit_start = 1 + ext_bytes(lit) + op;
    // Lane 0: token and literal length bytes.
    out[op] = ((lit.min(15) << 4) | mcode.min(15)) as u8;
    write_ext(out, op + 1, lit);
    // The warp: literals (lane j copies bytes j, j + 32, ...).
    out[lit_start..lit_start + lit].copy_from_slice(&page[anchor..anchor + lit]);
    // Lane 0: offset and match length bytes.
    if let Some((off, _)) = matched {
        let mp = lit_start + lit;
        out[mp..mp + 2].copy_from_slice(&(off as u16).to_le_bytes());
        write_ext(out, mp + 2, mcode);
    }
    Some(op + size)
}

/// One warp of `lz4_compress_pages`: compresses `page` into `out` in the LZ4 block format.
/// Returns the compressed length, or `None` (the kernel's `LEN_RAW`) when it would pass
/// `max_out` bytes (`max_out <= PAGE_SIZE`).
pub fn compress_page(page: &Page, max_out: usize, out: &mut [u8; PAGE_SIZE]) -> Option<usize> {
    let max_out = max_out.min(PAGE_SIZE);
    let mut table = [NO_POS as u16; HASH_SIZE];
    // Candidates of the two latest rounds, one per lane (the kernel keeps them in registers).
    let mut cand_prev = [NO_POS; WARP];
    let mut cand_cur = [NO_POS; WARP];
    let mut round_base = 0usize;

    let (mut p, mut anchor, mut op) = (0usize, 0usize, 0usize);
    while p <= LAST_MATCH_START {
        // Step 2: candidate rounds until the window [p, p + 32) is covered.
        let need = (p + WARP).min(LAST_MATCH_START + 1);
        while round_base < need {
            let valid = |lane: usize| round_base + lane <= LAST_MATCH_START;
            let hashes: [u32; WARP] = std::array::from_fn(|lane| {
                if valid(lane) {
                    hash4(read32(page, round_base + lane))
                } else {
                    0
                }
            });
            let keys: [u32; WARP] = std::array::from_fn(|lane| {
                if valid(lane) {
                    hashes[lane]
                } else {
                    0x8000_0000 | lane as u32
                }
            });
            let peers = match_any(&keys);
            // All lanes read the table, then (after __syncwarp) the group leaders write it.
            let cand: [u32; WARP] = std::array::from_fn(|lane| {
                let lower = peers[lane] & ((1u32 << lane) - 1);
                if !valid(lane) {
                    NO_POS
                } else if lower != 0 {
                    (round_base + 31 - lower.leading_zeros() as usize) as u32
                } else {
                    u32::from(table[hashes[lane] as usize])
                }
            });
            for lane in 0..WARP {
                let highest = peers[lane] >> lane == 1;
                if valid(lane) && highest {
                    table[hashes[lane] as usize] = (round_base + lane) as u16;
                }
            }
            cand_prev = cand_cur;
            cand_cur = cand;
            round_base += WARP;
        }

        // Step 3: the first window position whose candidate matches 4 bytes.
        let cand_of = |lane: usize| {
            let q = p + lane;
            let from_lane = q % WARP;
            if q >= round_base - WARP {
                cand_cur[from_lane]
            } else {
                cand_prev[from_lane]
            }
        };
        let hits = ballot(|lane| {
            let q = p + lane;
            let c = cand_of(lane);
            q <= LAST_MATCH_START && c != NO_POS && read32(page, q) == read32(page, c as usize)
        });
        if hits == 0 {
            p += WARP;
            continue;
        }
        let first = first_lane(hits);
        let mut mstart = p + first;
        let mut mref = cand_of(first) as usize;

        // Step 4: extend forward 32 bytes per ballot, then backward over pending literals.
        let limit = MATCH_END_LIMIT - mstart;
        let mut mlen;
        let mut k = MIN_MATCH;
        loop {
            let differ = ballot(|lane| {
                let j = k + lane;
                !(j < limit && page[mstart + j] == page[mref + j])
            });
            if differ != 0 {
                mlen = k + first_lane(differ);
                break;
            }
            k += WARP;
        }
        while mstart > anchor && mref > 0 && page[mstart - 1] == page[mref - 1] {
            mstart -= 1;
            mref -= 1;
            mlen += 1;
        }

        // Step 5: encode.
        op = emit_sequence(
            page,
            out,
            op,
            max_out,
            anchor,
            mstart - anchor,
            Some((mstart - mref, mlen)),
        )?;
        p = mstart + mlen;
        anchor = p;
    }
    emit_sequence(page, out, op, max_out, anchor, PAGE_SIZE - anchor, None)
}

/// Reads a length field's 255-run; `None` when the input ends inside it.
fn read_ext(input: &[u8], ip: &mut usize, mut len: usize) -> Option<usize> {
    loop {
        let b = *input.get(*ip)?;
        *ip += 1;
        len += usize::from(b);
        if b != 255 {
            return Some(len);
        }
    }
}

/// One warp of `lz4_decompress_pages`: decodes one LZ4 block into `out`. Returns the kernel's
/// status: `STATUS_OK`, `STATUS_CORRUPT`, or `STATUS_WRONG_LENGTH | n`. Every read and write is
/// checked; on an error `out` holds a partial page.
pub fn decompress_page(input: &[u8], out: &mut Page) -> u32 {
    if input.len() > PAGE_SIZE {
        return STATUS_CORRUPT;
    }
    let in_len = input.len();
    let (mut ip, mut op) = (0usize, 0usize);
    loop {
        let Some(&token) = input.get(ip) else {
            return STATUS_CORRUPT;
        };
        ip += 1;
        let mut lit = usize::from(token >> 4);
        if lit == 15 {
            let Some(len) = read_ext(input, &mut ip, lit) else {
                return STATUS_CORRUPT;
            };
            lit = len;
        }
        if lit > in_len - ip || lit > PAGE_SIZE - op {
            return STATUS_CORRUPT;
        }
        out[op..op + lit].copy_from_slice(&input[ip..ip + lit]);
        ip += lit;
        op += lit;
        if ip == in_len {
            break;
        }
        if in_len - ip < 2 {
            return STATUS_CORRUPT;
        }
        let off = usize::from(u16::from_le_bytes([input[ip], input[ip + 1]]));
        ip += 2;
        if off == 0 || off > op {
            return STATUS_CORRUPT;
        }
        let mut mlen = usize::from(token & 15);
        if mlen == 15 {
            let Some(len) = read_ext(input, &mut ip, mlen) else {
                return STATUS_CORRUPT;
            };
            mlen = len;
        }
        mlen += MIN_MATCH;
        if mlen > PAGE_SIZE - op {
            return STATUS_CORRUPT;
        }
        // Byte j of the match is out[op - off + j % off], already written: the warp copies all
        // of it at once.
        let from = op - off;
        for j in 0..mlen {
            out[op + j] = out[from + if j < off { j } else { j % off }];
        }
        op += mlen;
    }
    if op != PAGE_SIZE {
        return STATUS_WRONG_LENGTH | op as u32;
    }
    STATUS_OK
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_page(seed: u64) -> Page {
        let words = [
            "swap", "page", "memory", "kernel", "device", "block", "the", "of", "compress", "ring",
        ];
        let mut page = [0u8; PAGE_SIZE];
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let mut pos = 0;
        while pos < PAGE_SIZE {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let word = words[(state >> 33) as usize % words.len()];
            for &b in word.as_bytes().iter().chain(b" ") {
                if pos < PAGE_SIZE {
                    page[pos] = b;
                    pos += 1;
                }
            }
        }
        page
    }

    #[test]
    fn round_trip_through_the_model_decoder() {
        let page = text_page(7);
        let mut out = [0u8; PAGE_SIZE];
        let len = compress_page(&page, PAGE_SIZE, &mut out).expect("text compresses");
        let mut back = [0u8; PAGE_SIZE];
        assert_eq!(decompress_page(&out[..len], &mut back), STATUS_OK);
        assert_eq!(back, page);
    }

    #[test]
    fn too_small_a_budget_is_raw() {
        let page = text_page(3);
        let mut out = [0u8; PAGE_SIZE];
        let len = compress_page(&page, PAGE_SIZE, &mut out).unwrap();
        assert_eq!(compress_page(&page, len - 1, &mut out), None);
        assert_eq!(compress_page(&page, len, &mut out), Some(len));
    }

    #[test]
    fn short_output_is_wrong_length() {
        // One sequence of 5 literals and nothing else.
        let input = [0x50, 1, 2, 3, 4, 5];
        let mut back = [0u8; PAGE_SIZE];
        assert_eq!(decompress_page(&input, &mut back), STATUS_WRONG_LENGTH | 5);
    }
}
