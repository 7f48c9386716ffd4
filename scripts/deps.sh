#!/usr/bin/env bash
# What building and testing trueno-ublk need on a fresh Debian or Ubuntu machine, installed
# where missing: a C and C++ compiler (liblz4 and zstd are built from source, libFuzzer is
# C++), pkg-config, python3 with pip (the PTX check's NVIDIA wheels), curl; and, where no
# Rust at least as new as Cargo.toml's rust-version is on PATH, the toolchain the project's
# formatting and lints are checked with (RUST_TOOLCHAIN: a newer clippy may warn of more),
# with rustfmt and clippy, through rustup (Debian's and Ubuntu's own rustc are older); a new
# enough Rust without rustfmt or clippy gets them through its rustup. What only the VM test needs (qemu, the
# kernel, mmdebstrap) scripts/vm-test.sh installs itself.
#
#   bash scripts/deps.sh       install what is missing
#   . scripts/deps.sh          the same, and a toolchain it installed is on this shell's PATH
#                              (scripts/test.sh and .ci/run source it)
# Needs root, or sudo without a password, when something is missing.

RUST_TOOLCHAIN=1.95.0

deps_main() {
    local root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    # shellcheck source=lib/apt.sh
    . "$root/scripts/lib/apt.sh"

    local missing=()
    command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
    command -v c++ >/dev/null 2>&1 || missing+=(g++)
    command -v make >/dev/null 2>&1 || missing+=(make)
    command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
    command -v curl >/dev/null 2>&1 || missing+=(curl ca-certificates)
    command -v python3 >/dev/null 2>&1 || missing+=(python3)
    python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
    if [ "${#missing[@]}" -gt 0 ]; then
        apt_install "${missing[@]}" || {
            echo "deps: apt-get install ${missing[*]} failed" >&2
            return 1
        }
    fi

    # Rust: rustup's own toolchain wins over an older one on PATH.
    [ -x "$HOME/.cargo/bin/cargo" ] && PATH="$HOME/.cargo/bin:$PATH"
    local wanted have
    wanted=$(sed -n 's/^rust-version *= *"\([0-9.]*\)".*/\1/p' "$root/Cargo.toml")
    have=$(rustc --version 2>/dev/null | awk '{print $2}')
    if [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$wanted" "$have" | sort -V | head -n1)" = "$wanted" ]; then
        # New enough; the test command also runs cargo fmt and cargo clippy, which a distro's
        # or a minimal toolchain may lack.
        if cargo fmt --version >/dev/null 2>&1 && cargo clippy --version >/dev/null 2>&1; then
            return 0
        fi
        if command -v rustup >/dev/null 2>&1; then
            echo "deps: rustc $have has no rustfmt or clippy: rustup component add rustfmt clippy" >&2
            rustup component add rustfmt clippy >/dev/null || return 1
            return 0
        fi
        echo "deps: rustc $have has no rustfmt or clippy" >&2
    fi
    if command -v rustup >/dev/null 2>&1; then
        echo "deps: rustc ${have:-missing}, $wanted needed: rustup toolchain install $RUST_TOOLCHAIN" >&2
        rustup toolchain install "$RUST_TOOLCHAIN" --profile minimal --component rustfmt,clippy &&
            rustup default "$RUST_TOOLCHAIN" >/dev/null || return 1
        return 0
    fi
    echo "deps: rustc ${have:-missing}, $wanted needed: installing Rust $RUST_TOOLCHAIN through rustup into $HOME/.cargo" >&2
    # rustup-init must keep its name: rustup's binaries act on the name they were run by.
    local dir
    dir=$(mktemp -d)
    curl --proto '=https' --tlsv1.2 -sSf --retry 3 -o "$dir/rustup-init" \
        "https://static.rust-lang.org/rustup/dist/$(uname -m)-unknown-linux-gnu/rustup-init" &&
        chmod +x "$dir/rustup-init" &&
        "$dir/rustup-init" -y --no-modify-path --profile minimal --default-toolchain "$RUST_TOOLCHAIN" \
            --component rustfmt,clippy >/dev/null
    local status=$?
    rm -rf "$dir"
    [ "$status" -eq 0 ] || {
        echo "deps: installing Rust failed (see https://rustup.rs)" >&2
        return 1
    }
    PATH="$HOME/.cargo/bin:$PATH"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    deps_main
else
    deps_main || return 1
    export PATH
fi
