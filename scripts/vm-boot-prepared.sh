#!/usr/bin/env bash
# Boot the busybox VM that `VM_BUILD_ONLY=DIR bash scripts/vm-test.sh [MODE]` made (kernel,
# initramfs, vm.env in DIR) on this machine, and print what its /init reported (FIGURE lines,
# the verdict): for a machine with KVM but without the project's build tools or network, such
# as a GPU machine. Through KVM when /dev/kvm is there (VM_ACCEL=tcg to emulate anyway).
# QEMU names the emulator [qemu-system-x86_64]. Not for --stress (it needs a second disk).
# Usage: scripts/vm-boot-prepared.sh DIR [VCPUS (default: vm.env's)]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:?usage: vm-boot-prepared.sh DIR [VCPUS]}
RAM_MIB='' CPUS='' TIMEOUT_S='' MODE='' KERNEL=''
# shellcheck source=/dev/null # written by vm-test.sh
. "$dir/vm.env"
# shellcheck source=vm/boot.sh
. "$ROOT/scripts/vm/boot.sh"
[ "$MODE" != stress ] || { echo "vm-boot-prepared: --stress VMs need their stress-ng disk" >&2; exit 2; }
cpus=${2:-$CPUS}
# An uncompressed kernel beside it (vm-kvm-bundle.sh) is booted through its PVH entry.
kernel=$dir/vmlinuz
[ -e "$dir/vmlinux" ] && kernel=$dir/vmlinux
[ -e /dev/kvm ] && export VM_ACCEL=${VM_ACCEL:-kvm}
echo "booting $KERNEL ($(basename "$kernel")), mode $MODE: $RAM_MIB MiB, $cpus vCPUs, ${VM_ACCEL:-tcg}"
rc=0
qemu_boot "$TIMEOUT_S" "$cpus" "$RAM_MIB" "$kernel" "$dir/initrd.cpio.gz" \
    "$dir/console.log" "$dir/result.log" </dev/null >"$dir/qemu.log" 2>&1 || rc=$?
tr -d '\r' <"$dir/result.log"
echo "qemu exit $rc"
[ "$rc" -eq 0 ] || tail -n 20 "$dir/qemu.log" "$dir/console.log"
tr -d '\r' <"$dir/result.log" | grep -q '^VMTEST RESULT: PASS$'
