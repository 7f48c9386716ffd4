//! Sets `cfg(gpu_tests)` when built with `GPU_TESTS=1` (see tests/gpu_device.rs).
//!
//! Links the binaries with packed relative relocations (DT_RELR) where the C library they
//! are built against can load them (glibc 2.36 or later). Why: the dynamic loader reads all
//! of `.rela.dyn` at start-up, and the daemon locks every page its start-up touches; the
//! daemon's 3,935 relative relocations took 94 KB there, packed they take about 1 KB
//! (issue 16's idle footprint). An older glibc refuses such a binary, so a build against one
//! links as before.

use std::process::Command;

/// The first glibc whose loader applies DT_RELR.
const RELR_GLIBC: (u32, u32) = (2, 36);

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // `GPU_TESTS=1 cargo test --test gpu_device` runs the tests that need an NVIDIA GPU;
    // without it they are built as ignored (listed so), not passed unrun.
    println!("cargo:rerun-if-env-changed=GPU_TESTS");
    println!("cargo::rustc-check-cfg=cfg(gpu_tests)");
    if std::env::var("GPU_TESTS").as_deref() == Ok("1") {
        println!("cargo:rustc-cfg=gpu_tests");
    }
    let var = |name| std::env::var(name).unwrap_or_default();
    let native = var("HOST") == var("TARGET");
    let glibc_linux = var("CARGO_CFG_TARGET_OS") == "linux" && var("CARGO_CFG_TARGET_ENV") == "gnu";
    // Only a native build can ask the glibc it links against, by asking the one it runs on.
    if native && glibc_linux && glibc_version().is_some_and(|version| version >= RELR_GLIBC) {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

/// This system's glibc version, from `getconf GNU_LIBC_VERSION` ("glibc 2.36").
fn glibc_version() -> Option<(u32, u32)> {
    let output = Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
        .ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let mut numbers = text.trim().strip_prefix("glibc ")?.split('.');
    Some((numbers.next()?.parse().ok()?, numbers.next()?.parse().ok()?))
}
