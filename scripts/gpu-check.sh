#!/bin/bash
# The checks for a machine with an NVIDIA GPU (and, maybe, a kernel with ublk_drv), run from a
# folder holding two binaries built elsewhere:
#   cargo build --release && GPU_TESTS=1 cargo test --release --test gpu_device --no-run
#   (built without GPU_TESTS=1 its GPU tests are ignored)
#   mkdir -p DIR && strip -o DIR/trueno-ublk target/release/trueno-ublk
#   strip -o DIR/gpu_device target/release/deps/gpu_device-<hash>   (the path cargo printed)
# then, on that machine as root: bash scripts/gpu-check.sh DIR
# It prints the kernel's ublk and zram support, runs the GPU test binary (GPU_TESTS=1) and
# `trueno-ublk bench --compare-zram` with the GPU backend, the CPU backends and the defaults.
set -u -o pipefail
dir=${1:?usage: gpu-check.sh DIR (with trueno-ublk and gpu_device in it)}
cd "$dir" || exit 1
date -u
uname -r
nproc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
echo "--- ublk and zram in this kernel"
grep -i ublk /proc/modules
modprobe ublk_drv 2>&1
ls -l /dev/ublk-control 2>&1
{ zcat /proc/config.gz 2>/dev/null || cat "/boot/config-$(uname -r)" 2>/dev/null; } |
    grep -E "BLK_DEV_UBLK|ZRAM=|CONFIG_MODULES="
cat /sys/block/zram0/comp_algorithm 2>&1
echo "--- GPU_TESTS=1 gpu_device"
GPU_TESTS=1 timeout 150 ./gpu_device --test-threads=1 2>&1 | tail -n 15
bench() {
    echo "--- bench $*"
    timeout 100 ./trueno-ublk bench --overwrites 0 --repeat 2 --latency-samples 500 \
        --compare-zram --zram-streams 16 "$@" 2>&1 | tail -n 40
}
bench --algorithm lz4 --recompress off --backend gpu --batch-threshold 8192
bench --algorithm lz4 --recompress off --backend simd-parallel
bench --algorithm lz4 --recompress off --backend auto
bench --zram-algorithm lzo-rle
date -u
