//! The CUDA C source of the kernels (`src/gpu/kernels/lz4.cu`), compiled for the CPU with the
//! small SIMT emulator in `src/gpu/kernels/emu/` (one thread per lane, warp intrinsics as
//! collectives), against the Rust model byte for byte. This checks on machines without a GPU
//! that the kernel source and the model compute the same thing; the PTX itself is checked by
//! ptxas (`scripts/check-ptx.sh`) and on hardware by `tests/gpu_device.rs`.
//! Skipped with a printed reason when no C++20 compiler is found (`CXX`, else `c++`).
//! `KERNEL_EMU_SANITIZE=1` builds the emulated kernels with AddressSanitizer and UBSan, so an
//! out-of-bounds access or undefined behaviour in the kernel source fails the test (slow).

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "test data: small, known values"
)]

mod gpu_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use gpu_support::{liblz4, mixed_pages, process_memory_pages, Rng, MAX_LZ4_LEN};
use trueno_ublk::codec::{Page, PAGE_SIZE};
use trueno_ublk::gpu::model::{self, LEN_RAW};

const KERNELS: &str = "src/gpu/kernels/lz4.cu";
const EMU_HEADER: &str = "src/gpu/kernels/emu/cuda_emu.h";
const HARNESS: &str = "src/gpu/kernels/emu/harness.cpp";

fn work_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gpu_kernel_emu");
    std::fs::create_dir_all(&dir).expect("create the emulator work dir");
    dir
}

/// The emulator binary, built once per test run; `None` (skip) without a C++ compiler.
/// It needs g++ or clang++ with C++20 on Linux (ucontext, _setjmp).
fn emulator() -> Option<&'static Path> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
            if Command::new(&cxx).arg("--version").output().is_err() {
                println!("skipped: no C++ compiler ({cxx}) to build the kernel emulator");
                return None;
            }
            let root = Path::new(env!("CARGO_MANIFEST_DIR"));
            let binary = work_dir().join("lz4_emu");
            let sanitize: &[&str] = if sanitized() {
                &[
                    "-g",
                    "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all",
                ]
            } else {
                &[]
            };
            let output = Command::new(&cxx)
                .args(["-std=c++20", "-O2", "-Wall", "-Werror"])
                .args(sanitize)
                .arg("-include")
                .arg(root.join(EMU_HEADER))
                .args(["-x", "c++"])
                .arg(root.join(KERNELS))
                .args(["-x", "none"])
                .arg(root.join(HARNESS))
                .arg("-o")
                .arg(&binary)
                .output()
                .expect("run the C++ compiler");
            if !output.status.success() {
                let message = String::from_utf8_lossy(&output.stderr);
                panic!("building the kernel emulator failed:\n{message}");
            }
            Some(binary)
        })
        .as_deref()
}

fn sanitized() -> bool {
    std::env::var("KERNEL_EMU_SANITIZE").as_deref() == Ok("1")
}

/// The emulator as a command; under ASan, without the check that the lanes' separate stacks
/// (fibers) confuse.
fn emu_command(emu: &Path) -> Command {
    let mut command = Command::new(emu);
    if sanitized() {
        command.env("ASAN_OPTIONS", "detect_stack_use_after_return=0");
    }
    command
}

fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect()
}

/// Runs the emulated compress kernel: per page, its length word and output slot.
fn emu_compress(emu: &Path, pages: &[Page], max_out: usize, name: &str) -> (Vec<u32>, Vec<u8>) {
    let dir = work_dir();
    let input = dir.join(format!("{name}.pages"));
    let output = dir.join(format!("{name}.out"));
    std::fs::write(&input, pages.as_flattened()).unwrap();
    let status = emu_command(emu)
        .arg("compress")
        .arg(&input)
        .arg(max_out.to_string())
        .arg(&output)
        .status()
        .unwrap();
    assert!(status.success(), "emulated compress failed");
    let out = std::fs::read(&output).unwrap();
    let (lens, slots) = out.split_at(pages.len() * 4);
    (words(lens), slots.to_vec())
}

/// Runs the emulated decompress kernel: per input, its status word and output page.
fn emu_decompress(emu: &Path, blocks: &[Vec<u8>], name: &str) -> (Vec<u32>, Vec<u8>) {
    let dir = work_dir();
    let (inputs_path, index_path, output) = (
        dir.join(format!("{name}.in")),
        dir.join(format!("{name}.index")),
        dir.join(format!("{name}.out")),
    );
    let mut offsets = Vec::new();
    let mut offset = 0u32;
    for block in blocks {
        offsets.push(offset);
        offset += block.len() as u32;
    }
    let index: Vec<u8> = offsets
        .iter()
        .copied()
        .chain(blocks.iter().map(|b| b.len() as u32))
        .flat_map(u32::to_le_bytes)
        .collect();
    std::fs::write(&inputs_path, blocks.concat()).unwrap();
    std::fs::write(&index_path, index).unwrap();
    let status = emu_command(emu)
        .arg("decompress")
        .arg(&inputs_path)
        .arg(&index_path)
        .arg(&output)
        .status()
        .unwrap();
    assert!(status.success(), "emulated decompress failed");
    let out = std::fs::read(&output).unwrap();
    let (status, pages) = out.split_at(blocks.len() * 4);
    (words(status), pages.to_vec())
}

fn corpus() -> Vec<Page> {
    let mut pages = mixed_pages(300, 11);
    pages.extend(process_memory_pages(200));
    pages.push([0; PAGE_SIZE]);
    pages.push([0x11; PAGE_SIZE]);
    let mut periodic = [0u8; PAGE_SIZE];
    periodic
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 7) as u8);
    pages.push(periodic);
    // Not a multiple of 4 pages: the last block has idle warps.
    pages.truncate(pages.len() - pages.len() % 4 + 1);
    pages
}

#[test]
fn compress_kernel_source_matches_the_model_byte_for_byte() {
    let Some(emu) = emulator() else { return };
    let pages = corpus();
    for (max_out, name) in [
        (PAGE_SIZE, "full"),
        (MAX_LZ4_LEN, "max_len"),
        (600, "tight"),
    ] {
        let (lens, slots) = emu_compress(emu, &pages, max_out, name);
        let mut expect = [0u8; PAGE_SIZE];
        for (i, page) in pages.iter().enumerate() {
            match model::compress_page(page, max_out, &mut expect) {
                Some(len) => {
                    assert_eq!(lens[i], len as u32, "page {i}, max_out {max_out}");
                    let got = &slots[i * PAGE_SIZE..][..len];
                    let first_difference = got.iter().zip(&expect[..len]).position(|(a, b)| a != b);
                    assert_eq!(first_difference, None, "page {i}, max_out {max_out}");
                }
                None => assert_eq!(lens[i], LEN_RAW, "page {i}, max_out {max_out}"),
            }
        }
    }
}

#[test]
fn decompress_kernel_source_matches_the_model() {
    let Some(emu) = emulator() else { return };
    let pages = corpus();
    let mut rng = Rng::new(12);
    let mut blocks: Vec<Vec<u8>> = Vec::new();
    let mut out = [0u8; PAGE_SIZE];
    for page in &pages {
        let cpu = liblz4(page);
        if cpu.len() <= PAGE_SIZE {
            blocks.push(cpu.clone());
            // Corrupt variants: truncated, a byte changed, random bytes.
            blocks.push(cpu[..rng.below(cpu.len() as u64) as usize].to_vec());
            let mut flipped = cpu;
            let at = rng.below(flipped.len() as u64) as usize;
            flipped[at] ^= 1 + rng.below(255) as u8;
            blocks.push(flipped);
        }
        if let Some(len) = model::compress_page(page, PAGE_SIZE, &mut out) {
            blocks.push(out[..len].to_vec());
        }
        blocks.push((0..rng.below(64)).map(|_| rng.next() as u8).collect());
    }
    blocks.push(vec![0u8; PAGE_SIZE + 1]);
    blocks.push(Vec::new());
    let (status, decoded) = emu_decompress(emu, &blocks, "blocks");
    let mut accepted = 0;
    for (i, block) in blocks.iter().enumerate() {
        let mut expect = [0u8; PAGE_SIZE];
        let want = model::decompress_page(block, &mut expect);
        assert_eq!(status[i], want, "input {i} ({} bytes)", block.len());
        if want == model::STATUS_OK {
            accepted += 1;
            let got = &decoded[i * PAGE_SIZE..][..PAGE_SIZE];
            let first_difference = got.iter().zip(&expect).position(|(a, b)| a != b);
            assert_eq!(first_difference, None, "input {i}");
        }
    }
    assert!(accepted >= pages.len(), "only {accepted} inputs decoded");
}
