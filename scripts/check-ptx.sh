#!/usr/bin/env bash
# Assembles every committed src/gpu/kernels/*.ptx with ptxas for sm_75, sm_80 and sm_90 (-v),
# prints registers and shared memory per kernel, and fails on any error or register spill.
# Then checks that the PTX is what its CUDA C source compiles to (scripts/gen-ptx.sh --check).
# No GPU needed: ptxas comes from the pip wheel nvidia-cuda-nvcc-cu12 (pinned), cached in .tools/.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC_VERSION=12.9.86
TOOLS=${TRUENO_TOOLS_DIR:-$PWD/.tools}
NVCC_DIR=$TOOLS/nvcc-$NVCC_VERSION
PTXAS=$NVCC_DIR/nvidia/cuda_nvcc/bin/ptxas
if [[ ! -x $PTXAS ]]; then
    echo "installing nvidia-cuda-nvcc-cu12==$NVCC_VERSION into $NVCC_DIR" >&2
    python3 -m pip install --quiet --no-deps --target "$NVCC_DIR" \
        "nvidia-cuda-nvcc-cu12==$NVCC_VERSION" >&2
fi

shopt -s nullglob
files=(src/gpu/kernels/*.ptx)
if [[ ${#files[@]} == 0 ]]; then
    echo "no PTX files in src/gpu/kernels" >&2
    exit 1
fi
status=0
for ptx in "${files[@]}"; do
    for arch in sm_75 sm_80 sm_90; do
        out=$(mktemp)
        if ! "$PTXAS" -arch="$arch" -v -o /dev/null "$ptx" >"$out" 2>&1; then
            echo "FAIL: ptxas -arch=$arch $ptx" >&2
            cat "$out" >&2
            status=1
            rm -f "$out"
            continue
        fi
        # ptxas -v: "Compiling entry function 'k' for 'sm_90'", then
        # "N bytes stack frame, N bytes spill stores, N bytes spill loads" and
        # "Used N registers, ... N bytes smem ...".
        awk -v arch="$arch" -v file="$ptx" '
            /Compiling entry function/ { match($0, /\047[^\047]+\047/); fn = substr($0, RSTART + 1, RLENGTH - 2) }
            /spill stores/ {
                split($0, a, ","); stores = a[2]; loads = a[3]
                gsub(/[^0-9]/, "", stores); gsub(/[^0-9]/, "", loads)
                if (stores + 0 > 0 || loads + 0 > 0) { spill[fn] = stores "/" loads }
            }
            /Used [0-9]+ registers/ {
                match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15)
                smem = "0"
                if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH - 11)
                printf "%-32s %-6s %-24s registers %3d  shared %6d bytes\n", file, arch, fn, regs, smem
            }
            END { for (f in spill) { printf "SPILL: %s %s %s (stores/loads bytes %s)\n", file, arch, f, spill[f] > "/dev/stderr"; bad = 1 } exit bad }
        ' "$out" || status=1
        if grep -qi "error" "$out"; then
            cat "$out" >&2
            status=1
        fi
        rm -f "$out"
    done
done

scripts/gen-ptx.sh --check || status=1
if [[ $status != 0 ]]; then
    echo "check-ptx: FAILED" >&2
else
    echo "check-ptx: ok"
fi
exit $status
