#!/usr/bin/env bash
# The device-level benchmark, reproducible by anyone: trueno-ublk against kernel zram in the
# same kind of qemu VM (Debian 12's 6.12 kernel, TCG emulation, 2 vCPUs), back to back.
#
#   scripts/vm-bench.sh
#
# Two boots of scripts/vm-test.sh's VM (see scripts/vm/bench.sh for what runs inside):
#   1. --bench-fio, 1 GiB RAM: fio (O_DIRECT, io_uring, 60%-compressible buffers) on zram lz4,
#      zram zstd, trueno-ublk with its defaults (LZ4) and with --algorithm zstd: 4 KiB random read and
#      write at QD1 and QD32, 1 MiB sequential read and write at QD4.
#   2. --bench-storm, 256 MiB RAM: 1.5x RAM of mixed pages filled and verified twice through
#      swap on zram lz4 and on trueno-ublk.
#   scripts/vm-bench.sh --compare BIN [ROUNDS]
#   scripts/vm-bench.sh --store
#
# Compares this build with another (BIN, say a build of the commit before a change): one
# 1 GiB VM, ROUNDS [4] rounds of the fio table on zram lz4, this build and BIN (defaults
# both), the two builds' order swapped each round. Prints each round's ratios against that
# round's zram and BIN's IOPS over this build's, then those paired ratios with the order
# balanced out (see compare_summary; use an even ROUNDS): the host's speed drifts within
# minutes, so only paired ratios say which build is faster, and the build run first in a
# round has an edge of its own.
#
# --store: one 1 GiB VM running `trueno-ublk bench --compare-zram` (no ublk involved): the
# store and the codec alone, on every vCPU and on one, against kernel zram lz4 under the same
# emulation: what the device rows that compress can reach there at best.
#
# Prints a table of IOPS and of ratios against zram lz4. Under emulation absolute figures mean
# little: compare only ratios taken in the same run. Environment: VM_FIO_RUNTIME_S [5] seconds
# per fio job, VM_FIO_JOBS (only these fio jobs, e.g. "randread_4k_qd1 read_1m_qd4"; the
# other rows print "-"), VM_CPUS [2], VM_CPU (the guest's CPU model; default and why in
# scripts/vm/boot.sh), VM_CREATE_ARGS (more options for trueno-ublk's `create`, e.g.
# "--queues 2"). After each fio job the log has a "CPU" line: the vCPUs' idle time and the CPU time
# (ticks) the daemon's threads have used so far, by thread name.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=vm/boot.sh
. "$ROOT/scripts/vm/boot.sh" # for tcg_cpu: the figures depend on the guest's CPU model
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT

# compare_summary ROUNDS <LOG: the table of a --compare run from its FIGURE lines. Per job: each
# round's ratios, then BIN's IOPS over this build's with the order of the two in a round
# balanced out: the build run first in a round ran up to a third faster in every row on
# 2026-12-06 (a first in odd rounds, b in even ones), so a plain median over an odd number of
# rounds favours this build. Balanced: the geometric mean of the odd rounds' b/a times that
# of the even rounds', square-rooted; "second/first": how fast a round's second build ran
# against its first, the order's own effect (below 1: the first is favoured).
compare_summary() {
    tr -d '\r' | sed -n 's/^FIGURE //p' | awk -F= -v rounds="$1" '
        { v[$1] = $2 }
        END {
            n = split("randread_4k_qd1 randread_4k_qd32 randwrite_4k_qd1 randwrite_4k_qd32 read_1m_qd4 write_1m_qd4", job, " ")
            printf "%-18s %-48s %-12s %s\n", "fio job", "per round: a/zram b/zram b/a", "b/a balanced", "second/first"
            for (i = 1; i <= n; i++) {
                line = ""; lo = 0; no = 0; le = 0; ne = 0
                for (r = 1; r <= rounds; r++) {
                    z = v["fio_zram_lz4_r" r "_" job[i] "_iops"]
                    a = v["fio_ublk_a_r" r "_" job[i] "_iops"]; b = v["fio_ublk_b_r" r "_" job[i] "_iops"]
                    if (z > 0 && a > 0 && b > 0) {
                        line = line sprintf("%.2f %.2f %.2f; ", a / z, b / z, b / a)
                        if (r % 2) { lo += log(b / a); no++ } else { le += log(b / a); ne++ }
                    } else line = line "- ; "
                }
                if (no && ne)
                    printf "%-18s %-48s %-12.2f %.2f\n", job[i], line, exp((lo / no + le / ne) / 2), exp((lo / no - le / ne) / 2)
                else
                    printf "%-18s %-48s %-12s %s\n", job[i], line, "-", "-"
            }
            print "(b/a above 1: BIN is faster than this build; \"-\": no round with each build first)"
        }'
}

if [ "${1:-}" = --compare ]; then
    other=${2:?usage: scripts/vm-bench.sh --compare BIN [ROUNDS]}
    rounds=${3:-4}
    VM_RAM_MIB=1024 VM_TIMEOUT_S=$((300 + rounds * 300)) VM_COMPARE_BIN=$other \
        VM_COMPARE_ROUNDS=$rounds bash "$ROOT/scripts/vm-test.sh" --bench-fio | tee "$LOGS/fio.log"
    echo
    echo "================ this build (a) against $other (b), $(date -u '+%Y-%m-%d %H:%M UTC'), guest CPU $(tcg_cpu) ================"
    compare_summary "$rounds" <"$LOGS/fio.log"
    exit 0
fi

if [ "${1:-}" = --store ]; then
    VM_RAM_MIB=1024 bash "$ROOT/scripts/vm-test.sh" --bench-store | tee "$LOGS/store.log"
    echo
    echo "================ store and codec against zram inside the VM ($(date -u '+%Y-%m-%d %H:%M UTC'), guest CPU $(tcg_cpu)) ================"
    tr -d '\r' <"$LOGS/store.log" | sed -n 's/^FIGURE //p' | awk -F= '
        { v[$1] = $2 }
        END {
            printf "%-8s %12s %12s %14s %16s %12s %14s\n", "backend", "store write", "store read", "codec compress", "zram lz4 write", "store/zram", "codec/zram"
            n = split("auto simd", b, " ")
            for (i = 1; i <= n; i++) {
                w = v["store_" b[i] "_write_gbps"]; r = v["store_" b[i] "_read_gbps"]
                c = v["store_" b[i] "_codec_compress_gbps"]; z = v["store_" b[i] "_zram_write_gbps"]
                printf "%-8s %12s %12s %14s %16s %12s %14s\n", b[i], w, r, c, z, (z > 0 ? sprintf("%.2f", w / z) : "-"), (z > 0 ? sprintf("%.2f", c / z) : "-")
            }
            print "(GB/s; auto: every vCPU compresses, simd: one; zram: a stream per vCPU)"
        }'
    exit 0
fi

VM_RAM_MIB=1024 bash "$ROOT/scripts/vm-test.sh" --bench-fio | tee "$LOGS/fio.log"
VM_RAM_MIB=256 bash "$ROOT/scripts/vm-test.sh" --bench-storm | tee "$LOGS/storm.log"

echo
echo "================ trueno-ublk VM bench ($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) host cores, guest CPU $(tcg_cpu)) ================"
cat "$LOGS/fio.log" "$LOGS/storm.log" | tr -d '\r' | sed -n 's/^FIGURE //p' | awk -F= '
    { v[$1] = $2 }
    function ratio(a, b) { return (a > 0 && b > 0) ? sprintf("%.2f", a / b) : "-" }
    END {
        n = split("randread_4k_qd1 randread_4k_qd32 randwrite_4k_qd1 randwrite_4k_qd32 read_1m_qd4 write_1m_qd4", job, " ")
        printf "%-18s %10s %10s %12s %10s %14s %10s\n", "fio job (IOPS)", "zram lz4", "zram zstd", "ours default", "ours zstd", "default/zram", "zstd/zram"
        for (i = 1; i <= n; i++) {
            z = v["fio_zram_lz4_" job[i] "_iops"]; zs = v["fio_zram_zstd_" job[i] "_iops"]
            d = v["fio_ublk_default_" job[i] "_iops"]; oz = v["fio_ublk_zstd_" job[i] "_iops"]
            printf "%-18s %10s %10s %12s %10s %14s %10s\n", job[i], z, zs, d, oz, ratio(d, z), ratio(oz, z)
        }
        z = v["storm_zram_lz4_seconds"]; d = v["storm_ublk_default_seconds"]
        printf "%-18s %10s %10s %12s %10s %14s %10s\n", "swap storm (s)", z, "", d, "", ratio(z, d), ""
        print "(ratios: ours / zram lz4 for IOPS, zram time / ours for the storm: above 1 is faster)"
    }'
