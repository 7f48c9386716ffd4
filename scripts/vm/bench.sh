#!/bin/sh
# shellcheck shell=dash disable=SC1091 # /test/env is in the VM
# The benchmark run by /init inside the VM (scripts/vm-bench.sh boots it twice). Output goes to
# the host through ttyS1: "FIGURE name=value" lines, then "VMTEST RESULT: PASS|FAIL".
#
# MODE=bench-fio (1 GiB VM, fio's libraries live in its RAM): for kernel zram with lz4 and with
#   zstd, and for trueno-ublk with its defaults (LZ4) and with --algorithm zstd, each a fresh 1 GiB
#   device: fio with O_DIRECT and io_uring on 60%-compressible buffers over the first 256 MiB
#   (written first): 4 KiB random read and write at QD1 and QD32, 1 MiB sequential read and
#   write at QD4, FIO_RUNTIME_S seconds each (FIO_JOBS: only the jobs it names). FIGURE
#   fio_<device>_<job>_iops=N.
#   With COMPARE_ROUNDS set (scripts/vm-bench.sh --compare BIN), instead: that many rounds of
#   zram lz4, this build ("a") and the other build ("b", /usr/bin/trueno-ublk-b), both with
#   their defaults, the two builds' order swapped each round. FIGURE fio_<device>_r<N>_<job>_iops.
# MODE=bench-storm (256 MiB VM, as the VM test's): the swap storm on zram lz4 and on
#   trueno-ublk with its defaults: 1.5x RAM of the mixed pattern filled and verified twice
#   (vmtool pressure), every word checked. FIGURE storm_<device>_seconds=S.
# MODE=bench-store (1 GiB VM): `trueno-ublk bench --compare-zram` on the built-in mix, with
#   the default backend (every vCPU) and with one core (--backend simd): the store, the codec
#   alone and kernel zram (lz4, as many streams as the store has writer threads: one per vCPU)
#   under the same emulation, no ublk involved.
#   FIGURE store_<backend>_<write|read|codec_compress|zram_write>_gbps=G.

. /test/env
. /test/kernel-log.sh
VT=/test/vmtool
UL=/usr/sbin
FAILS=0
DEV_BYTES=$((1 << 30))
REGION=256M

fail() {
    FAILS=$((FAILS + 1))
    echo "FAIL: $*"
}
figure() { echo "FIGURE $1=$2"; }

insmod /lib/modules/ublk_drv.ko || fail "insmod ublk_drv.ko"
for m in lz4_compress lz4hc_compress zsmalloc zram; do
    # Not there: built into this kernel (scripts/vm-test.sh copies what the package has).
    [ ! -e /lib/modules/$m.ko ] || insmod /lib/modules/$m.ko || fail "insmod $m.ko"
done
# The daemon's queue thread serves swap: give the kernel the same time to find it as the test.
echo 60 >/proc/sys/kernel/hung_task_timeout_secs
[ -z "${PAGE_CLUSTER:-}" ] || echo "$PAGE_CLUSTER" >/proc/sys/vm/page-cluster ||
    fail "vm.page-cluster $PAGE_CLUSTER"
echo "vm.page-cluster $(cat /proc/sys/vm/page-cluster)"

zram_up() { # ALGORITHM
    echo 1 >/sys/block/zram0/reset
    echo "$1" >/sys/block/zram0/comp_algorithm
    echo "$DEV_BYTES" >/sys/block/zram0/disksize
}
# The build ublk_up and ublk_down run: this one, or the other of a comparison.
UBLK=trueno-ublk
ublk_up() { # create options...
    # shellcheck disable=SC2086 # VM_CREATE_ARGS: options, split on purpose
    $UBLK create --size "$DEV_BYTES" --id 0 "$@" $CREATE_ARGS >/dev/null ||
        fail "$UBLK create $* $CREATE_ARGS"
}
ublk_down() {
    $UBLK delete --id 0 >/dev/null || fail "$UBLK delete --id 0"
}

# fio_job NAME DEV RW BS DEPTH: one job on the region; prints its IOPS (reads or writes).
fio_job() {
    local name=$1 dev=$2 rw=$3 bs=$4 depth=$5 field
    case "$rw" in
    *read) field=8 ;;
    *) field=49 ;;
    esac
    /usr/bin/fio --name="$name" --filename="$dev" --direct=1 --ioengine=io_uring \
        --rw="$rw" --bs="$bs" --iodepth="$depth" --size="$REGION" \
        --runtime="$FIO_RUNTIME_S" --time_based --ramp_time=1 \
        --buffer_compress_percentage=60 --refill_buffers --randrepeat=0 \
        --output-format=terse --terse-version=3 2>/tmp/fio.err |
        awk -F';' -v f="$field" 'NR == 1 { printf "%d\n", $f }'
}

# cpu_report LABEL: CPU time (clock ticks, user + system) the daemon's threads have used so
# far, by thread name: which of them a fio job kept busy (the queue thread, the flusher or the
# compression pool, the reserve's refill thread); and the time the vCPUs have idled so far,
# waiting for I/O or not (`idle`: /proc/stat's idle and iowait), so that what neither the
# daemon nor idling took is fio's and the kernel's; and kswapd's (which compresses for zram).
cpu_report() {
    local stats idle
    stats=$(cat /proc/[0-9]*/task/[0-9]*/stat 2>/dev/null)
    idle=$(awk '$1 == "cpu" { print $5 + $6; exit }' /proc/stat)
    echo "$stats" | awk -v label="$1" -v idle="$idle" '
        $2 ~ /^\((trueno|ublk|kswapd)/ { t[$2] += $14 + $15 }
        END { printf "CPU %s: idle=%d", label, idle; for (n in t) printf " %s=%d", n, t[n]; print "" }'
}

fio_table() { # NAME DEV
    local name=$1 dev=$2 spec iops
    # The region is written once, so that reads find data (and the device holds it).
    /usr/bin/fio --name=fill --filename="$dev" --direct=1 --ioengine=io_uring --rw=write \
        --bs=1M --iodepth=4 --size="$REGION" --buffer_compress_percentage=60 \
        --refill_buffers --output-format=terse >/dev/null 2>/tmp/fio.err ||
        fail "$name: fio fill: $(cat /tmp/fio.err)"
    for spec in "randread_4k_qd1 randread 4k 1" "randread_4k_qd32 randread 4k 32" \
        "randwrite_4k_qd1 randwrite 4k 1" "randwrite_4k_qd32 randwrite 4k 32" \
        "read_1m_qd4 read 1M 4" "write_1m_qd4 write 1M 4"; do
        # shellcheck disable=SC2086 # word splitting wanted
        set -- $spec
        case " ${FIO_JOBS:-$1} " in
        *" $1 "*) ;;
        *) continue ;;
        esac
        iops=$(fio_job "$1" "$dev" "$2" "$3" "$4")
        if [ -n "$iops" ] && [ "$iops" -gt 0 ]; then
            figure "fio_${name}_$1_iops" "$iops"
        else
            fail "$name: fio $1 gave no figure: $(cat /tmp/fio.err)"
        fi
        cpu_report "$name after $1"
    done
}

storm() { # NAME DEV
    local name=$1 dev=$2 t0 t1 rc bad
    $UL/mkswap "$dev" >/dev/null || fail "$name: mkswap"
    $UL/swapon -d "$dev" || fail "$name: swapon -d"
    cpu_report "$name before the storm"
    t0=$($VT now)
    VMTOOL_PASSES=2 $VT pressure "$FILL_MIB" 7 >/tmp/storm.out 2>&1
    rc=$?
    t1=$($VT now)
    cpu_report "$name after the storm"
    # Each phase's time (the fill, then each verifying pass): where the two devices differ.
    grep -E '^pressure: (fill|verify)' /tmp/storm.out | sed "s/^/$name storm /"
    bad=$(sed -n 's/^PRESSURE_BAD_WORDS=//p' /tmp/storm.out)
    if [ "$rc" -eq 0 ] && [ "$bad" = 0 ]; then
        figure "storm_${name}_seconds" "$(awk -v a="$t1" -v b="$t0" 'BEGIN { printf "%.1f", a - b }')"
    else
        fail "$name: the swap storm failed (rc $rc, ${bad:-?} bad words)"
        tail -n 5 /tmp/storm.out
    fi
    $UL/swapoff "$dev" || fail "$name: swapoff"
}

# compare_build NAME BINARY ROUND: this round's fio table on a fresh device of that build.
compare_build() {
    UBLK=$2
    ublk_up
    fio_table "$1_r$3" /dev/ublkb0
    ublk_down
    UBLK=trueno-ublk
}

# compare_rounds: COMPARE_ROUNDS rounds of zram lz4 and both builds (see the top).
compare_rounds() {
    local round=1
    while [ "$round" -le "$COMPARE_ROUNDS" ]; do
        zram_up lz4
        fio_table "zram_lz4_r$round" /dev/zram0
        echo 1 >/sys/block/zram0/reset
        if [ $((round % 2)) -eq 1 ]; then
            compare_build ublk_a trueno-ublk "$round"
            compare_build ublk_b trueno-ublk-b "$round"
        else
            compare_build ublk_b trueno-ublk-b "$round"
            compare_build ublk_a trueno-ublk "$round"
        fi
        round=$((round + 1))
    done
}

case "$MODE" in
bench-fio)
    if [ -n "${COMPARE_ROUNDS:-}" ]; then
        compare_rounds
    else
        for algorithm in lz4 zstd; do
            zram_up "$algorithm"
            fio_table "zram_$algorithm" /dev/zram0
        done
        echo 1 >/sys/block/zram0/reset
        ublk_up
        fio_table ublk_default /dev/ublkb0
        ublk_down
        ublk_up --algorithm zstd
        fio_table ublk_zstd /dev/ublkb0
        ublk_down
    fi
    ;;
bench-store)
    for backend in auto simd; do
        trueno-ublk bench --compare-zram --backend "$backend" --size 64M --overwrites 0 \
            --latency-samples 200 --repeat 2 --recompress off >/tmp/store.txt 2>/tmp/store.err ||
            fail "bench --backend $backend: $(tail -n 3 /tmp/store.err)"
        cat /tmp/store.txt
        awk -v b="$backend" '
            /^  write +[0-9.]+ GB\/s/ && !s { s = 1; printf "FIGURE store_%s_write_gbps=%s\nFIGURE store_%s_read_gbps=%s\n", b, $2, b, $5 }
            /^codec alone/ { for (i = 1; i <= NF; i++) if ($i == "compress") printf "FIGURE store_%s_codec_compress_gbps=%s\n", b, $(i + 1) }
            /^kernel zram/ { z = 1 }
            z && /^  write +[0-9.]+ GB\/s/ { printf "FIGURE store_%s_zram_write_gbps=%s\n", b, $2; z = 0 }
        ' /tmp/store.txt
    done
    ;;
bench-storm)
    zram_up lz4
    storm zram_lz4 /dev/zram0
    echo 1 >/sys/block/zram0/reset
    ublk_up
    storm ublk_default /dev/ublkb0
    # Where its time went: the store's counters, the per-op service times and the
    # pages written while memory was short (`short_memory_pages`).
    $UBLK stat --id 0 --json || fail "$UBLK stat --id 0 --json"
    ublk_down
    ;;
*) fail "unknown MODE '$MODE'" ;;
esac

# A figure from a run that hit errors or stalls is no figure.
dmesg >/tmp/dmesg
if kernel_log_errors /tmp/dmesg >/tmp/dmesg-bad; then
    fail "dmesg has errors:"
    cat /tmp/dmesg-bad
fi
kernel_swap_table_reports /tmp/dmesg
if [ "$FAILS" -eq 0 ]; then echo "VMTEST RESULT: PASS"; else echo "VMTEST RESULT: FAIL"; fi
