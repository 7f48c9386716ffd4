#!/usr/bin/env bash
# Runs every fuzz target in fuzz/ (libFuzzer through libfuzzer-sys) for a bounded time on the
# stable toolchain, with AddressSanitizer; scripts/test.sh (and so CI) calls it.
#
#   scripts/fuzz.sh [TARGET...]   all targets of fuzz/Cargo.toml when none is named
#
# No cargo-fuzz and no nightly needed: the targets are built with plain cargo and the
# instrumentation flags libFuzzer needs (what `cargo fuzz build` would pass), and
# RUSTC_BOOTSTRAP=1 lets stable rustc take the one unstable flag, -Zsanitizer=address.
# `cargo fuzz run TARGET` (with cargo-fuzz installed) runs the same targets by hand.
# Each run starts from the committed seeds (fuzz/seeds/TARGET) and the local corpus
# (fuzz/corpus/TARGET, git-ignored, grows between runs). A crash, panic, leak or timeout fails
# the script and prints the path of the input that caused it (under fuzz/artifacts/TARGET).
# Environment knobs (defaults in brackets):
#   FUZZ_TIME_S [30]          seconds per target
#   FUZZ_SANITIZER [address]  address, or none where ASan does not work (coverage-guided only)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FUZZ="$ROOT/fuzz"
TIME_S=${FUZZ_TIME_S:-30}
SANITIZER=${FUZZ_SANITIZER:-address}
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')

log() { printf '[fuzz %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() {
    printf 'fuzz: %s\n' "$*" >&2
    exit 1
}

if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    # The [[bin]] names of fuzz/Cargo.toml: one per target.
    mapfile -t targets < <(awk '/^\[\[bin\]\]/ { bin = 1; next } bin && $1 == "name" { gsub(/"/, "", $3); print $3; bin = 0 }' "$FUZZ/Cargo.toml")
fi
[ "${#targets[@]}" -gt 0 ] || die "no fuzz targets in $FUZZ/Cargo.toml"

# SanitizerCoverage as libFuzzer reads it: 8-bit edge counters with their PC table, and
# comparison tracing so it can solve magic values (section names, keys, frame headers).
flags=(-Cpasses=sancov-module
    -Cllvm-args=-sanitizer-coverage-level=4
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters
    -Cllvm-args=-sanitizer-coverage-pc-table
    -Cllvm-args=-sanitizer-coverage-trace-compares
    -Cllvm-args=-sanitizer-coverage-stack-depth
    --cfg fuzzing
    # Overflow and debug assertions turn silent arithmetic bugs into panics the fuzzer sees.
    -Cdebug-assertions -Coverflow-checks)
case "$SANITIZER" in
address) flags+=(-Zsanitizer=address) ;;
none) ;;
*) die "FUZZ_SANITIZER=$SANITIZER: use address or none" ;;
esac

start_s=$SECONDS
log "building ${targets[*]} (sanitizer: $SANITIZER)"
bins=()
for target in "${targets[@]}"; do bins+=(--bin "$target"); done
# --target keeps RUSTFLAGS away from build scripts and proc macros, which must not be
# instrumented; the fuzz crate is its own workspace with its own target/ (git-ignored).
RUSTC_BOOTSTRAP=1 RUSTFLAGS="${flags[*]}" nice cargo build --quiet --release \
    --manifest-path "$FUZZ/Cargo.toml" --target "$TRIPLE" "${bins[@]}" ||
    die "building the fuzz targets failed (FUZZ_SANITIZER=none builds without ASan)"
log "built in $((SECONDS - start_s)) s"

failed=()
for target in "${targets[@]}"; do
    bin="$FUZZ/target/$TRIPLE/release/$target"
    corpus="$FUZZ/corpus/$target"
    artifacts="$FUZZ/artifacts/$target"
    mkdir -p "$corpus" "$artifacts"
    dirs=("$corpus")
    [ -d "$FUZZ/seeds/$target" ] && dirs+=("$FUZZ/seeds/$target")
    log "$target: ${TIME_S} s"
    logfile="$artifacts/last-run.log"
    rc=0
    # New inputs go to the first directory only, so the committed seeds stay as they are.
    # -timeout: one input taking 10 s is a hang; -rss_limit_mb: a 2-core CI machine.
    "$bin" -max_total_time="$TIME_S" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" "${dirs[@]}" >"$logfile" 2>&1 || rc=$?
    grep -E '^(stat::number_of_executed_units|stat::new_units_added|Done [0-9]+ runs)' "$logfile" | sed "s/^/  $target: /" || true
    if [ "$rc" -ne 0 ]; then
        tail -n 60 "$logfile"
        crash=$(sed -n 's/^.*Test unit written to \(.*\)$/\1/p' "$logfile" | tail -n 1)
        echo "fuzz: $target FAILED (exit $rc); input: ${crash:-none written, see $logfile}" >&2
        [ -n "$crash" ] && echo "fuzz: reproduce with: $bin $crash" >&2
        failed+=("$target")
    fi
done
log "done in $((SECONDS - start_s)) s"
[ "${#failed[@]}" -eq 0 ] || die "fuzz targets failed: ${failed[*]}"
