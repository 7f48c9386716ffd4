#!/usr/bin/env bash
# Make what the VM bench needs on a machine that has KVM but no build tools, no network and no
# qemu (the project's GPU machines; see docs/measurements.md): in OUT, the fio and storm VMs
# of scripts/vm-bench.sh (made by VM_BUILD_ONLY, with time limits for KVM), the kernel
# uncompressed (vmlinux.xz, booted through its PVH entry: Debian's compressed image died in
# its boot decompressor under the GPU machine's nested KVM), this machine's qemu with its
# libraries, firmware and modules, and OUT/run.sh, which boots the VMs there through
# scripts/vm-boot-prepared.sh and prints their figures. About 55 MB.
# Usage: scripts/vm-kvm-bundle.sh OUT    (OUT in a folder git ignores)
# There, from the repository root: [VMS="storm fio"] bash OUT/run.sh [VCPUS...] (default 2);
# each VM's result.log is copied to $OUT (the device tool's folder) when set.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "${1:?usage: vm-kvm-bundle.sh OUT}")
rm -rf "$out"
mkdir -p "$out"
VM_BUILD_ONLY=$out/fio VM_RAM_MIB=1024 VM_TIMEOUT_S=400 bash "$ROOT/scripts/vm-test.sh" --bench-fio
VM_BUILD_ONLY=$out/storm VM_RAM_MIB=256 VM_TIMEOUT_S=120 bash "$ROOT/scripts/vm-test.sh" --bench-storm

# Debian's image holds the kernel zstd-compressed after its decompressor (zstd then complains
# of the bytes after the frame: the ELF header is the check).
offset=$(python3 -c 'import sys; print(open(sys.argv[1], "rb").read().find(b"\x28\xb5\x2f\xfd"))' "$out/fio/vmlinuz")
[ "$offset" -ge 0 ] || { echo "vm-kvm-bundle: no zstd frame in the kernel image" >&2; exit 1; }
tail -c +$((offset + 1)) "$out/fio/vmlinuz" | zstd -dcq >"$out/vmlinux" 2>/dev/null || true
[ "$(head -c 4 "$out/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ] ||
    { echo "vm-kvm-bundle: the kernel image did not unpack to an ELF file" >&2; exit 1; }
xz -T0 -6 "$out/vmlinux"
rm "$out/fio/vmlinuz" "$out/storm/vmlinuz"
# The fio VM's initramfs (fio's libraries): xz here, gzip again there.
zcat "$out/fio/initrd.cpio.gz" | xz -T0 -6 --check=crc32 >"$out/fio/initrd.cpio.xz"
rm "$out/fio/initrd.cpio.gz"

# qemu: the binary with every library it loads (the loader too), the firmware a direct
# kernel boot reads, and the TCG module (for trying the bundle without KVM).
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
q=$stage/qemu
mkdir -p "$q/lib" "$q/share" "$q/modules"
qemu=$(command -v qemu-system-x86_64)
cp "$qemu" "$q/"
ldd "$qemu" | awk '/=>/ { print $3 } !/=>/ && $1 ~ /^\// { print $1 }' | xargs -r cp -L -t "$q/lib"
cp -L /usr/share/seabios/bios-256k.bin /usr/share/qemu/linuxboot_dma.bin \
    /usr/share/qemu/kvmvapic.bin /usr/share/qemu/pvh.bin "$q/share/"
cp /usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so "$q/modules/"
tar -C "$stage" -cJf "$out/qemu.tar.xz" qemu

cat >"$out/run.sh" <<'RUN'
#!/bin/bash
# Written by scripts/vm-kvm-bundle.sh: boot its VMs here (through KVM when /dev/kvm is there)
# and print their figures. From the repository root: [VMS="storm fio"] bash DIR/run.sh [VCPUS...]
set -u
b=$(cd "$(dirname "$0")" && pwd)
python3 - "$b" <<'PY'
import gzip, lzma, shutil, sys, tarfile
b = sys.argv[1]
tarfile.open(b + "/qemu.tar.xz", "r:xz").extractall(b)
with lzma.open(b + "/vmlinux.xz") as src, open(b + "/vmlinux", "wb") as dst:
    shutil.copyfileobj(src, dst)
with lzma.open(b + "/fio/initrd.cpio.xz") as src, gzip.open(b + "/fio/initrd.cpio.gz", "wb", compresslevel=1) as dst:
    shutil.copyfileobj(src, dst)
PY
printf '#!/bin/sh\nQEMU_MODULE_DIR=%s/qemu/modules exec %s/qemu/lib/ld-linux-x86-64.so.2 --library-path %s/qemu/lib %s/qemu/qemu-system-x86_64 -L %s/qemu/share "$@"\n' \
    "$b" "$b" "$b" "$b" "$b" >"$b/qemu.sh"
chmod +x "$b/qemu.sh"
export QEMU=$b/qemu.sh
"$QEMU" --version | head -n 1
for cpus in "${@:-2}"; do
    for vm in ${VMS:-storm fio}; do
        ln -sf ../vmlinux "$b/$vm/vmlinux"
        bash scripts/vm-boot-prepared.sh "$b/$vm" "$cpus" | grep -E '^(FIGURE|VMTEST|FAIL|booting|qemu exit)'
        [ -z "${OUT:-}" ] || cp "$b/$vm/result.log" "$OUT/result-$vm-$cpus.log"
    done
done
RUN
chmod +x "$out/run.sh"
du -sh "$out"
