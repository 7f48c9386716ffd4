#!/usr/bin/env bash
# Regenerates src/gpu/kernels/*.ptx from the CUDA C beside it with NVRTC (no GPU needed).
#   scripts/gen-ptx.sh          rewrite the committed .ptx files
#   scripts/gen-ptx.sh --check  fail if regenerating does not reproduce them byte for byte
# NVRTC comes from the pip wheel nvidia-cuda-nvrtc-cu12 (pinned below), cached in .tools/.
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_VERSION=12.9.86
TOOLS=${TRUENO_TOOLS_DIR:-$PWD/.tools}
NVRTC_DIR=$TOOLS/nvrtc-$NVRTC_VERSION
LIB=$NVRTC_DIR/nvidia/cuda_nvrtc/lib/libnvrtc.so.12
if [[ ! -f $LIB ]]; then
    echo "installing nvidia-cuda-nvrtc-cu12==$NVRTC_VERSION into $NVRTC_DIR" >&2
    python3 -m pip install --quiet --no-deps --target "$NVRTC_DIR" \
        "nvidia-cuda-nvrtc-cu12==$NVRTC_VERSION" >&2
fi

check=0
[[ ${1:-} == --check ]] && check=1
status=0
for cu in src/gpu/kernels/*.cu; do
    ptx=${cu%.cu}.ptx
    tmp=$(mktemp)
    python3 - "$LIB" "$cu" "$tmp" <<'PY'
import ctypes, sys
lib_path, src_path, out_path = sys.argv[1:4]
nvrtc = ctypes.CDLL(lib_path)
src = open(src_path, "rb").read()
prog = ctypes.c_void_p()
name = src_path.rsplit("/", 1)[-1].encode()
def check(rc, what):
    if rc != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"{what}: {nvrtc.nvrtcGetErrorString(rc).decode()}")
check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, name, 0, None, None), "create")
# The kernels need sm_70+ (__match_any_sync); compute_75 PTX runs on Turing and newer.
opts = [b"--gpu-architecture=compute_75", b"--std=c++17"]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
log_size = ctypes.c_size_t()
nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
log = ctypes.create_string_buffer(log_size.value)
nvrtc.nvrtcGetProgramLog(prog, log)
if log.value.strip():
    sys.stderr.write(log.value.decode())
check(rc, "compile")
size = ctypes.c_size_t()
check(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "ptx size")
ptx = ctypes.create_string_buffer(size.value)
check(nvrtc.nvrtcGetPTX(prog, ptx), "ptx")
open(out_path, "wb").write(ptx.value)
PY
    if [[ $check == 1 ]]; then
        if cmp -s "$tmp" "$ptx"; then
            echo "ok: $ptx is what $cu compiles to"
        else
            echo "STALE: $ptx differs from the NVRTC output of $cu (run scripts/gen-ptx.sh)" >&2
            status=1
        fi
        rm -f "$tmp"
    else
        mv "$tmp" "$ptx"
        echo "wrote $ptx"
    fi
done
exit $status
