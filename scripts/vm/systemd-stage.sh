#!/usr/bin/env bash
# The real-systemd stage of scripts/vm-test.sh: a Debian bookworm root file system with
# systemd from Debian's packages, trueno-ublk installed into it by scripts/install.sh and
# swap enabled as README.md says, booted on the same 6.12 kernel with systemd as PID 1.
# scripts/vm/systemd-test.sh runs inside (after multi-user.target) and powers the VM off
# with pages still swapped out; this script then reads the console log of the whole boot
# and shutdown. The same image is then booted once more with ublk_drv kept out
# (module_blacklist=), where the swap unit must fail at once rather than hold the boot, and
# a third time to be powered off with --force while tmpfs pages are out on the device.
#
#   scripts/vm/systemd-stage.sh KDIR BIN VMTOOL
#     KDIR    the extracted kernel (vmlinuz, ublk_drv.ko) of scripts/vm-test.sh
#     BIN     the trueno-ublk binary to install
#     VMTOOL  scripts/vm/vmtool.c built static
#
# The root file system is made by mmdebstrap (installed with apt-get if missing) and cached
# in .vm/cache, keyed on the suite, variant and package list. It is never unpacked here:
# bsdtar turns the tarball into a cpio archive, and a second archive (what install.sh
# writes, the module, the test) is appended; the kernel unpacks both into a ramfs (nothing
# of the root file system can be swapped out). Exits 0 only if every check passed.
# Environment: VM_SYSTEMD_RAM_MIB [768], VM_CPUS [2], VM_SYSTEMD_TIMEOUT_S [900].
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VM_DIR="$ROOT/.vm"
CACHE="$VM_DIR/cache"
KDIR=${1:?usage: systemd-stage.sh KDIR BIN VMTOOL}
BIN=${2:?usage: systemd-stage.sh KDIR BIN VMTOOL}
VMTOOL=${3:?usage: systemd-stage.sh KDIR BIN VMTOOL}
RAM_MIB=${VM_SYSTEMD_RAM_MIB:-768}
CPUS=${VM_CPUS:-2}
TIMEOUT_S=${VM_SYSTEMD_TIMEOUT_S:-900}
SUITE=bookworm
PACKAGES=systemd,systemd-sysv,util-linux,udev,kmod,procps

log() { printf '[vm-test systemd %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() {
    printf 'vm-test systemd: %s\n' "$*" >&2
    exit 1
}
# shellcheck source=boot.sh
. "$ROOT/scripts/vm/boot.sh"
START_S=$SECONDS
# shellcheck source=../lib/apt.sh
. "$ROOT/scripts/lib/apt.sh"

missing=()
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
command -v bsdtar >/dev/null 2>&1 || missing+=(libarchive-tools)
command -v depmod >/dev/null 2>&1 || [ -x /sbin/depmod ] || missing+=(kmod)
# mmdebstrap checks Debian's archive with it (an Ubuntu host lacks it).
[ -r /usr/share/keyrings/debian-archive-keyring.gpg ] || missing+=(debian-archive-keyring)
if [ "${#missing[@]}" -gt 0 ]; then
    apt_install "${missing[@]}" || die "apt-get install ${missing[*]} failed"
fi
DEPMOD=$(command -v depmod || echo /sbin/depmod)

# --- 1. Root file system, cached -----------------------------------------------------------
key=$(printf '%s minbase %s\n' "$SUITE" "$PACKAGES" | sha256sum | cut -c1-12)
ROOTFS="$CACHE/rootfs-$SUITE-$key.tar"
if [ ! -f "$ROOTFS" ] || [ ! -s "$ROOTFS" ]; then
    log "mmdebstrap --variant=minbase --include=$PACKAGES $SUITE (cached as $(basename "$ROOTFS"))"
    mkdir -p "$CACHE"
    # A directory left by an older run in the tarball's place goes.
    "${SUDO[@]}" rm -rf "$ROOTFS" "$ROOTFS.tmp"
    # --format=tar: mmdebstrap picks the format by the target's extension, and ".tmp" would
    # make it a directory.
    "${SUDO[@]}" mmdebstrap --quiet --format=tar --variant=minbase --include="$PACKAGES" \
        "$SUITE" "$ROOTFS.tmp" || die "mmdebstrap failed"
    "${SUDO[@]}" chmod a+r "$ROOTFS.tmp"
    mv "$ROOTFS.tmp" "$ROOTFS"
fi

# --- 2. What goes on top: install.sh's files, the module, the test --------------------------
KVER=$(cat "$KDIR/kver")
OVER="$VM_DIR/systemd-overlay"
rm -rf "$OVER"
mkdir -p "$OVER"
# Debug info stripped: the root file system lives in the VM's unswappable RAM.
objcopy --strip-debug "$BIN" "$VM_DIR/trueno-ublk.stripped"
DESTDIR="$OVER" bash "$ROOT/scripts/install.sh" --binary "$VM_DIR/trueno-ublk.stripped" >"$VM_DIR/install.log" ||
    die "install.sh failed: $(cat "$VM_DIR/install.log")"
# "Swap on device 0 at boot" as README.md says: swap = yes in its section.
conf="$OVER/etc/trueno-ublk.conf"
grep -q '^swap = no$' "$conf" || die "the installed /etc/trueno-ublk.conf has no 'swap = no' line to turn on"
sed -i 's/^swap = no$/swap = yes/' "$conf"
# The module where modules-load.d finds it (the root file system has no kernel). Under
# usr/: the image's /lib is a link to usr/lib, which an archive entry "lib" would replace.
mkdir -p "$OVER/usr/lib/modules/$KVER/extra"
cp "$KDIR/ublk_drv.ko" "$OVER/usr/lib/modules/$KVER/extra/"
# (modules.order and modules.builtin are part of a kernel package; not needed to load one.)
: >"$OVER/usr/lib/modules/$KVER/modules.order"
: >"$OVER/usr/lib/modules/$KVER/modules.builtin"
: >"$OVER/usr/lib/modules/$KVER/modules.builtin.modinfo"
"$DEPMOD" -b "$OVER/usr" "$KVER" || die "depmod failed"
# PID 1 is systemd; the test runs once the system is up and writes to the second serial port.
ln -s /lib/systemd/systemd "$OVER/init"
mkdir -p "$OVER/test" "$OVER/etc/systemd/system/multi-user.target.wants"
cp "$ROOT/scripts/vm/systemd-test.sh" "$OVER/test/systemd-test.sh"
cp "$ROOT/scripts/vm/checks.sh" "$OVER/test/checks.sh"
cp "$VMTOOL" "$OVER/test/vmtool"
cat >"$OVER/etc/systemd/system/trueno-test.service" <<'UNIT'
[Unit]
Description=trueno-ublk real-systemd test (results on ttyS1, then poweroff)
After=multi-user.target

[Service]
Type=oneshot
ExecStart=/bin/bash /test/systemd-test.sh
TimeoutStartSec=infinity
# The test's own pages never wait for a device that waits for its daemon (its pressure
# programs run in scopes of their own, which may swap).
MemorySwapMax=0

[Install]
WantedBy=multi-user.target
UNIT
ln -s ../trueno-test.service "$OVER/etc/systemd/system/multi-user.target.wants/trueno-test.service"
# No login prompt on the console (it would only add noise to the log).
ln -s /dev/null "$OVER/etc/systemd/system/serial-getty@ttyS0.service"
ln -s /dev/null "$OVER/etc/systemd/system/getty@tty1.service"
echo trueno-vm >"$OVER/etc/hostname"
# /tmp on a tmpfs, as Debian 13 and Fedora have it by default (bookworm ships the unit, off):
# tmp.mount comes After=swap.target and Before=local-fs.target, so a unit of ours ordered
# after local-fs.target (or with PrivateTmp=) would make an ordering cycle with the swap.
mkdir -p "$OVER/etc/systemd/system/local-fs.target.wants"
ln -s /usr/share/systemd/tmp.mount "$OVER/etc/systemd/system/tmp.mount"
ln -s ../tmp.mount "$OVER/etc/systemd/system/local-fs.target.wants/tmp.mount"

INITRD="$VM_DIR/systemd-initrd.cpio"
{
    bsdtar -cf - --format newc --exclude './usr/share/doc/*' --exclude './usr/share/man/*' \
        --exclude './usr/share/locale/*' --exclude './usr/share/info/*' \
        --exclude './var/cache/apt/*' --exclude './var/lib/apt/lists/*' "@$ROOTFS"
    (cd "$OVER" && find . -mindepth 1 | cpio -o -H newc -R 0:0 --quiet)
} >"$INITRD" || die "building the initramfs failed"
rm -f "$VM_DIR/trueno-ublk.stripped"
log "initramfs $(du -h "$INITRD" | cut -f1) (Debian $SUITE + systemd, trueno-ublk installed by install.sh), kernel $KVER"

# --- 3. Boot -------------------------------------------------------------------------------
# boot_systemd CONSOLE RESULT [KERNEL_ARGS...]: boot the image (once more if the guest kernel
# died in its own boot), its console and test results (ttyS1) into files; sets VM_S and QEMU_RC.
boot_systemd() {
    local console=$1 result=$2 attempt qemu_pid tail_pid vm_start
    shift 2
    for attempt in 1 2; do
        : >"$console"
        : >"$result"
        log "booting systemd${*:+ ($*)}: ${RAM_MIB} MiB RAM, $CPUS vCPUs, TCG, CPU $(tcg_cpu) (limit ${TIMEOUT_S} s)"
        vm_start=$SECONDS
        QEMU_RC=0
        timeout --kill-after=10 "$TIMEOUT_S" qemu-system-x86_64 \
            -nodefaults -no-user-config -accel tcg,thread=multi -cpu "$(tcg_cpu)" -smp "$CPUS" -m "${RAM_MIB}M" \
            -kernel "$KDIR/vmlinuz" -initrd "$INITRD" \
            -append "console=ttyS0 rdinit=/init rootfstype=ramfs panic=-1 loglevel=4 systemd.show_status=1${*:+ $*}" \
            -nic none -display none -no-reboot \
            -chardev file,id=console,path="$console" -serial chardev:console \
            -chardev file,id=result,path="$result" -serial chardev:result \
            </dev/null >"$VM_DIR/systemd-qemu.log" 2>&1 &
        qemu_pid=$!
        tail -n +1 -s 0.5 --pid "$qemu_pid" -F "$result" 2>/dev/null | sed -u 's/\r$//' &
        tail_pid=$!
        wait "$qemu_pid" || QEMU_RC=$?
        wait "$tail_pid" 2>/dev/null || true
        VM_S=$((SECONDS - vm_start))
        boot_again "$attempt" "$console" "$result" || break
    done
}
CONSOLE="$VM_DIR/systemd-console.log"
RESULT="$VM_DIR/systemd-result.log"
boot_systemd "$CONSOLE" "$RESULT"
# The same image on a kernel that may not load ublk_drv: the daemon fails for good, and the
# swap unit must fail at once rather than hold the boot for the 90 s device timeout
# (systemd-test.sh, section 0).
NO_DRIVER_CONSOLE="$VM_DIR/systemd-no-driver-console.log"
NO_DRIVER_RESULT="$VM_DIR/systemd-no-driver-result.log"
MAIN_VM_S=$VM_S
MAIN_QEMU_RC=$QEMU_RC
boot_systemd "$NO_DRIVER_CONSOLE" "$NO_DRIVER_RESULT" module_blacklist=ublk_drv trueno.test=no-driver
NO_DRIVER_VM_S=$VM_S
NO_DRIVER_QEMU_RC=$QEMU_RC
# Once more, powered off with --force while tmpfs pages are out on the device: no unit is
# stopped, systemd-shutdown kills every process it may and swaps off (systemd-test.sh,
# section 0b). A daemon it killed would leave that swapoff waiting for good: a shorter limit.
FORCED_CONSOLE="$VM_DIR/systemd-forced-console.log"
FORCED_RESULT="$VM_DIR/systemd-forced-result.log"
FORCED_TIMEOUT_S=$((TIMEOUT_S / 2))
# loglevel=7: systemd-shutdown's own lines (the kill, the swapoff) on the console.
TIMEOUT_S=$FORCED_TIMEOUT_S boot_systemd "$FORCED_CONSOLE" "$FORCED_RESULT" trueno.test=forced-poweroff loglevel=7
FORCED_VM_S=$VM_S
FORCED_QEMU_RC=$QEMU_RC
VM_S=$MAIN_VM_S
QEMU_RC=$MAIN_QEMU_RC
rm -f "$INITRD"

# --- 4. Verdict, with the shutdown in the console log ----------------------------------------
fails=0
host_check() { # description command...
    local desc=$1
    shift
    if "$@"; then
        echo "ok: $desc"
    else
        echo "FAIL: $desc"
        fails=$((fails + 1))
    fi
}
# console_text LOG: LOG.txt, without carriage returns and colour codes (systemd shortens
# long unit names with "…").
console_text() { tr -d '\r' <"$1" | sed 's/\x1b\[[0-9;]*[A-Za-z]//g' >"$1.txt"; }
# What no console of the stage's boots may show.
KERNEL_FAULTS='Kernel panic|Attempted to kill init|BUG:|Oops:|general protection|Call Trace'
SWAP_IO_ERRORS='Write-error on swap-device|Read-error on swap-device|I/O error'
console_text "$CONSOLE"
echo
echo "=== console log of boot and shutdown ($CONSOLE)"
grep -nE 'ublk|[Ss]wap|trueno|Power down|panic' "$CONSOLE.txt" | tail -n 40 || true
bad=$(grep -E -e "$KERNEL_FAULTS" -e "$SWAP_IO_ERRORS" -e 'attempt to access beyond end' \
    -e 'Out of memory|oom-kill' "$CONSOLE.txt" || true)
host_check "console log (boot and shutdown): no panic, swap I/O error, Oops or OOM kill" [ -z "$bad" ]
[ -z "$bad" ] || echo "$bad" | head -n 20
host_check "the VM powered off by itself (reboot: Power down)" grep -q 'reboot: Power down' "$CONSOLE.txt"
# At poweroff the swap unit's swapoff must finish before the daemon is told to stop.
# The last of each is the poweroff's (the test stops and starts the units before).
swapoff_line=$(grep -n 'Deactivated swap .*ublkb0' "$CONSOLE.txt" | tail -n1 | cut -d: -f1)
stop_line=$(grep -n 'Stopping trueno-ublk@0' "$CONSOLE.txt" | tail -n1 | cut -d: -f1)
stopped_line=$(grep -n 'OK  \] Stopped trueno-ublk@0' "$CONSOLE.txt" | tail -n1 | cut -d: -f1)
host_check "at poweroff swapoff of /dev/ublkb0 finished (line ${swapoff_line:-none}) before the daemon's stop began (line ${stop_line:-none})" \
    [ "${swapoff_line:-999999}" -lt "${stop_line:-0}" ]
host_check "at poweroff the daemon then stopped cleanly (line ${stopped_line:-none})" [ "${stopped_line:-0}" -gt "${stop_line:-999999}" ]
# The boot without the driver: its own verdict, and a console free of the same faults.
console_text "$NO_DRIVER_CONSOLE"
no_driver_results=$(tr -d '\r' <"$NO_DRIVER_RESULT")
echo
echo "=== the boot without ublk_drv ($NO_DRIVER_RESULT; console $NO_DRIVER_CONSOLE)"
grep -E '^(ok|FAIL):' <<<"$no_driver_results" || true
host_check "without ublk_drv: the in-VM checks passed (qemu exit $NO_DRIVER_QEMU_RC, ${NO_DRIVER_VM_S} s)" \
    grep -q '^VMTEST RESULT: PASS$' <<<"$no_driver_results"
bad=$(grep -E -e "$KERNEL_FAULTS" "$NO_DRIVER_CONSOLE.txt" || true)
host_check "without ublk_drv: no panic or Oops, and the VM powered off by itself" \
    eval '[ -z "$bad" ] && grep -q "reboot: Power down" "$NO_DRIVER_CONSOLE.txt"'
# The forced poweroff: its own verdict, and a console free of the same faults.
console_text "$FORCED_CONSOLE"
forced_results=$(tr -d '\r' <"$FORCED_RESULT")
echo
echo "=== the boot powered off with --force ($FORCED_RESULT; console $FORCED_CONSOLE)"
grep -E '^(ok|FAIL):' <<<"$forced_results" || true
tail -n 12 "$FORCED_CONSOLE.txt"
host_check "forced poweroff: the in-VM checks passed (qemu exit $FORCED_QEMU_RC, ${FORCED_VM_S} s)" \
    grep -q '^VMTEST RESULT: PASS$' <<<"$forced_results"
bad=$(grep -E -e "$KERNEL_FAULTS" -e "$SWAP_IO_ERRORS" -e 'hung_task|blocked for more than' \
    "$FORCED_CONSOLE.txt" || true)
host_check "forced poweroff: no panic, Oops, swap I/O error or hung task" [ -z "$bad" ]
[ -z "$bad" ] || echo "$bad" | head -n 20
spared=$(grep -c 'systemd-shutdown.*(trueno-ublk) has been marked to be excluded from killing' "$FORCED_CONSOLE.txt" || true)
host_check "forced poweroff: systemd-shutdown spared the daemon's processes from its kill ($spared)" [ "$spared" -ge 2 ]
host_check "forced poweroff: systemd-shutdown's swapoff finished ('All swaps deactivated')" \
    grep -q 'systemd-shutdown.*All swaps deactivated' "$FORCED_CONSOLE.txt"
host_check "forced poweroff: the VM powered off by itself within ${FORCED_TIMEOUT_S} s" \
    eval '[ "$FORCED_QEMU_RC" -eq 0 ] && grep -q "reboot: Power down" "$FORCED_CONSOLE.txt"'
results=$(tr -d '\r' <"$RESULT")
in_vm_fails=$(grep -c '^FAIL' <<<"$results" || true)
echo
echo "================ trueno-ublk VM test (real systemd): figures ================"
printf '%s\n%s\n' "$results" "$forced_results" | sed -n 's/^FIGURE //p' | while IFS='=' read -r k v; do printf '  %-34s %s\n' "$k" "$v"; done
echo "  vm wall time                       ${VM_S} s (qemu exit $QEMU_RC)"
echo "  vm wall time without ublk_drv      ${NO_DRIVER_VM_S} s (qemu exit $NO_DRIVER_QEMU_RC)"
echo "  vm wall time, forced poweroff      ${FORCED_VM_S} s (qemu exit $FORCED_QEMU_RC)"
echo "  whole stage                        $((SECONDS - START_S)) s"
if grep -q '^VMTEST RESULT: PASS$' <<<"$results" && [ "$in_vm_fails" -eq 0 ] && [ "$fails" -eq 0 ]; then
    echo "================ systemd stage: PASS ================"
    exit 0
fi
echo "================ systemd stage: FAIL ================"
grep '^FAIL' <<<"$results" || true
[ "$QEMU_RC" -eq 124 ] && echo "the VM did not finish within ${TIMEOUT_S} s (VM_SYSTEMD_TIMEOUT_S)"
echo "--- VM console (last 80 lines of $CONSOLE) ---"
tail -n 80 "$CONSOLE.txt"
exit 1
