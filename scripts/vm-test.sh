#!/usr/bin/env bash
# End-to-end test of trueno-ublk in a qemu VM running Debian 12's 6.12 kernel (which ships
# ublk_drv and zram as modules). The host needs no ublk driver and no KVM (TCG emulation).
#
#   scripts/vm-test.sh                 build, boot the VM, run everything (scripts/vm/test.sh),
#                                      then the real-systemd stage (scripts/vm/systemd-stage.sh)
#   scripts/vm-test.sh --kernel-only   only the VM plumbing: ublk_drv loads, zram dd and swap runs
#   scripts/vm-test.sh --recovery      only what survives a daemon's death: the ublk layer's
#                                      recovery (ublk_ramdisk) and the daemon's (kill -9 under
#                                      swap pressure, create again); busybox VM only
#   scripts/vm-test.sh --stress        the near-OOM stage (scripts/vm/stress.sh: stress-ng on
#                                      zram, then on trueno-ublk; memory return); busybox VM only;
#                                      not part of the full run; scripts/test.sh runs it with
#                                      STRESS_CASES="all:150", the cases of pages that do not
#                                      compress out until they stop losing the VM now and then
#   scripts/vm-test.sh --bench-fio     the benchmark's fio table (scripts/vm/bench.sh; see
#   scripts/vm-test.sh --bench-storm   scripts/vm-bench.sh, which runs both)
#   scripts/vm-test.sh --bench-store   `trueno-ublk bench --compare-zram` inside the VM: the store
#                                      and the codec alone against kernel zram under the same
#                                      emulation (scripts/vm-bench.sh --store)
#
# What the VM tests do is described at the top of scripts/vm/test.sh (a busybox initramfs
# driving the daemon directly) and scripts/vm/systemd-test.sh (Debian with systemd as PID 1,
# the project installed by scripts/install.sh). Downloads (the kernel package, busybox-static,
# stress-ng and the libraries it needs, the Debian root file system made by mmdebstrap) are
# cached under .vm/cache; missing tools are installed with apt-get.
# Exits 0 only if every check in the VM passed. Environment knobs (defaults in brackets):
#   VM_RAM_MIB [256]  VM_CPUS [2]  VM_TIMEOUT_S [900]  VM_KERNEL_META [linux-image-6.12-cloud-amd64]
#   VM_CPU            the emulated guest's CPU model (default and why: tcg_cpu in scripts/vm/boot.sh)
#   VM_ACCEL [tcg]    kvm: the busybox VM on the host's CPU through KVM (needs /dev/kvm); its
#                     figures are then not comparable with the emulated ones. Not seen working
#                     yet: under the GPU machine's nested KVM the guest kernel died in its boot
#                     decompressor (2026-11-29; docs/measurements.md; vm-kvm-bundle.sh boots
#                     it uncompressed instead)
#   VM_BUILD_ONLY     a folder: make the busybox VM (kernel, initramfs, vm.env) there and stop,
#                     for scripts/vm-boot-prepared.sh on another machine (one with KVM; see
#                     scripts/vm-kvm-bundle.sh)
#   VM_KERNEL_SUITE   boot the newest cloud kernel of this Debian suite instead (trixie-backports:
#                     7.x, the newer ublk driver), fetched by scripts/vm/fetch-kernel.sh;
#                     VM_KERNEL_VERSION (say 6.18): the newest of that release line in it
#   VM_STALL_S [90]   fail when no page was swapped in or out for this long during a swap run
#   VM_EXTRA_KILLS    kill -9s of the serving process beyond the two of the daemon's recovery
#                     step, for the pause's p50 and worst [8]
#   TRUENO_UBLK_BIN   use this binary instead of building target/release/trueno-ublk
#   UBLK_RAMDISK_BIN  use this binary instead of target/release/examples/ublk_ramdisk
#   VM_TEST_SKIP      debugging: steps to leave out ("ramdisk ramdisk-recovery zram ublk-swap
#                     daemon-recovery early-death signals claim oom-probe bitflip systemd"); the run
#                     then fails
#   VM_TEST_ONLY      debugging: "systemd" runs only the real-systemd stage (the run then fails)
#   VM_SYSTEMD_RAM_MIB [768]  VM_SYSTEMD_TIMEOUT_S [900]  the real-systemd stage's VM
#   VM_KERNEL_ARGS    debugging: more kernel command-line options (loglevel=7 puts the stacks
#                     of hung tasks on the console, .vm/console.log)
#   VM_CREATE_ARGS    debugging: more options for the 1 GiB device's `create` (store options)
#   VM_COMPARE_BIN, VM_COMPARE_ROUNDS [4]  --bench-fio: compare this build with another one in
#                     the same VM (scripts/vm-bench.sh --compare)
#   VM_FIO_JOBS       --bench-fio: only these fio jobs (names as in scripts/vm/bench.sh)
#   VM_PAGE_CLUSTER   vm.page-cluster for the busybox VM's run (swap's readahead: at most
#                     2^N pages a swap-in; the kernel's default 3)
#   STRESS_CASES [move-inv:100]  --stress: stress-ng vm METHOD:MiB per worker (2 workers),
#                     space-separated
#   STRESS_S [30]     --stress: seconds per stress-ng run
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VM_DIR="$ROOT/.vm"
CACHE="$VM_DIR/cache"
RAM_MIB=${VM_RAM_MIB:-256}
CPUS=${VM_CPUS:-2}
TIMEOUT_S=${VM_TIMEOUT_S:-900}
KERNEL_META=${VM_KERNEL_META:-linux-image-6.12-cloud-amd64}
MODE=full
# The build the upgrade in the daemon's recovery step starts from: an earlier commit of main
# whose store layout this build reads (version 3, CRC32C checksums; this build makes version 7,
# 6 or 5, with XXH3, CRC32C or XXH64 checksums, whichever is fastest there, and resumes 3 as it
# is). It only starts the device and hands it over; every takeover in the step is this build's
# (builds before ab0f020 can stall a takeover during a swap storm: their resumed store faulted
# in memory on the I/O path).
UPGRADE_FROM=f6b57ebbf397aaceafd24de96c3580185e2c19dd
PREVIOUS_BIN=

for arg in "$@"; do
    case "$arg" in
    --kernel-only) MODE=kernel-only ;;
    --recovery) MODE=recovery ;;
    --stress) MODE=stress ;;
    --bench-fio) MODE=bench-fio ;;
    --bench-storm) MODE=bench-storm ;;
    --bench-store) MODE=bench-store ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "vm-test: unknown argument '$arg' (see --help)" >&2
        exit 2
        ;;
    esac
done

log() { printf '[vm-test %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() {
    printf 'vm-test: %s\n' "$*" >&2
    exit 1
}
# shellcheck source=vm/boot.sh
. "$ROOT/scripts/vm/boot.sh"

START_S=$SECONDS
export PATH="$PATH:/usr/sbin:/sbin" # util-linux's swap tools, also for a non-root caller
# shellcheck source=lib/apt.sh
. "$ROOT/scripts/lib/apt.sh"

# --- 1. Host tools ------------------------------------------------------------------------
# The guest runs this host's binaries and libraries (the daemon, vmtool, libc) on an x86-64
# kernel: another host architecture would build a VM that cannot run them.
[ "$(uname -m)" = x86_64 ] || die "the VM test needs an x86-64 host (this one is $(uname -m))"
missing=()
need() { command -v "$1" >/dev/null 2>&1 || missing+=("$2"); }
need qemu-system-x86_64 qemu-system-x86
need cpio cpio
need gzip gzip
need xz xz-utils
need gcc gcc
need objcopy binutils
need dpkg-deb dpkg
need swapon mount # Debian 12 and Ubuntu ship swapon in mount, not util-linux
need blkdiscard util-linux
need mkswap util-linux
if [ "$MODE" = bench-fio ]; then need fio fio; fi
# The recovery step holds a start up with it (a serving process killed before its device is live).
if [ "$MODE" = full ] || [ "$MODE" = recovery ]; then need strace strace; fi
# The recovery step's upgrade starts from an earlier commit's build, taken from git history.
if [ "$MODE" = full ] || [ "$MODE" = recovery ]; then need git git; fi
[ -e /usr/lib/x86_64-linux-gnu/libc.a ] || missing+=(libc6-dev)
if [ "${#missing[@]}" -gt 0 ]; then
    # shellcheck disable=SC2207
    missing=($(printf '%s\n' "${missing[@]}" | sort -u))
    apt_install "${missing[@]}" || die "apt-get install ${missing[*]} failed"
fi
command -v cargo >/dev/null || [ -n "${TRUENO_UBLK_BIN:-}" ] ||
    die "cargo not found: install Rust (https://rustup.rs) to build trueno-ublk"

# --- 2. Kernel and busybox, cached in .vm/cache --------------------------------------------
mkdir -p "$CACHE"
fetch_deb() { # package
    log "downloading $1"
    (cd "$CACHE" && { apt-get download -q "$1" 2>&1 | grep -v 'unsandboxed' || true; })
}
# cached_deb PACKAGE: DEB= the newest cached .deb of PACKAGE, downloaded first if none is
# (after an apt-get update if the first try finds nothing); empty if it cannot be had.
cached_deb() {
    DEB=$(find "$CACHE" -maxdepth 1 -name "${1}_*.deb" | sort | tail -n1)
    if [ -z "$DEB" ]; then
        fetch_deb "$1"
        DEB=$(find "$CACHE" -maxdepth 1 -name "${1}_*.deb" | sort | tail -n1)
    fi
    if [ -z "$DEB" ]; then
        apt_update_once || die "apt-get update failed"
        fetch_deb "$1"
        DEB=$(find "$CACHE" -maxdepth 1 -name "${1}_*.deb" | sort | tail -n1)
    fi
}
resolve_kernel_pkg() {
    apt-cache depends "$KERNEL_META" 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-/ {print $2; exit}'
}
# KERNEL_DEBS: the package(s) holding the kernel's image and modules.
if [ -n "${VM_KERNEL_SUITE:-}" ]; then
    # Straight from the Debian archive, checked; the host's apt sources need not know the suite.
    debs=$(bash "$ROOT/scripts/vm/fetch-kernel.sh" "$VM_KERNEL_SUITE" "$CACHE" ${VM_KERNEL_VERSION:+"$VM_KERNEL_VERSION"}) ||
        die "no kernel from Debian's $VM_KERNEL_SUITE"
    mapfile -t KERNEL_DEBS <<<"$debs"
else
    KERNEL_PKG=$(resolve_kernel_pkg || true)
    if [ -z "$KERNEL_PKG" ]; then
        apt_update_once || die "apt-get update failed"
        KERNEL_PKG=$(resolve_kernel_pkg || true)
    fi
    if [ -z "$KERNEL_PKG" ]; then
        # Not in the host's apt sources (Ubuntu, or Debian without bookworm-security): a
        # cached package, else the newest of its release line from Debian's security archive,
        # checked against Debian's keys as fetch-kernel.sh does.
        release=$(sed -n 's/^linux-image-\([0-9.]*\)-cloud-amd64$/\1/p' <<<"$KERNEL_META")
        DEB=$(find "$CACHE" -maxdepth 1 -name "linux-image-${release:-none}*.deb" | sort | tail -n1)
        if [ -z "$DEB" ] && [ -n "$release" ]; then
            fetch_tools=()
            command -v gpgv >/dev/null 2>&1 || fetch_tools+=(gpgv)
            [ -r /usr/share/keyrings/debian-archive-keyring.gpg ] || fetch_tools+=(debian-archive-keyring)
            command -v curl >/dev/null 2>&1 || fetch_tools+=(curl ca-certificates)
            apt_install "${fetch_tools[@]}" || die "apt-get install ${fetch_tools[*]} failed"
            log "apt knows no '$KERNEL_META': fetching it from Debian's bookworm-security archive"
            DEB=$(DEBIAN_MIRROR=http://security.debian.org/debian-security \
                bash "$ROOT/scripts/vm/fetch-kernel.sh" bookworm-security "$CACHE" "$release" | tail -n1) || DEB=
        fi
        [ -n "$DEB" ] || die "no '$KERNEL_META': apt knows none, and none came from Debian's bookworm-security archive"
    else
        cached_deb "$KERNEL_PKG"
        [ -n "$DEB" ] || die "could not download $KERNEL_PKG"
    fi
    KERNEL_DEBS=("$DEB")
fi
cached_deb busybox-static
BUSYBOX_DEB=$DEB
[ -n "$BUSYBOX_DEB" ] || die "could not download busybox-static"

# The kernel's image, the modules the VM loads and its release (kver), in KDIR. Debian 12's
# packages put the image in /boot and the modules under /lib/modules; trixie-backports' both
# under /usr/lib/modules/RELEASE. A module the package lacks is built into the kernel (7.x:
# zsmalloc, lz4_compress); the VM loads the modules it finds.
KDIR="$VM_DIR/kernel/$(basename "${KERNEL_DEBS[-1]}" .deb)"
if [ ! -e "$KDIR/done" ] || [ ! -e "$KDIR/kver" ]; then
    log "extracting ${KERNEL_DEBS[*]##*/}"
    rm -rf "$KDIR" "$VM_DIR/kx"
    mkdir -p "$KDIR" "$VM_DIR/kx"
    for deb in "${KERNEL_DEBS[@]}"; do
        dpkg-deb -x "$deb" "$VM_DIR/kx"
    done
    moddir=$(find "$VM_DIR/kx" -type d -path '*/lib/modules/*/kernel' | head -n1)
    [ -n "$moddir" ] || die "${KERNEL_DEBS[*]##*/}: no lib/modules/RELEASE/kernel"
    basename "$(dirname "$moddir")" >"$KDIR/kver"
    image=
    for candidate in "$VM_DIR"/kx/boot/vmlinuz-* "$(dirname "$moddir")/vmlinuz"; do
        if [ -f "$candidate" ]; then image=$candidate; fi
    done
    [ -n "$image" ] || die "${KERNEL_DEBS[*]##*/}: no vmlinuz"
    cp "$image" "$KDIR/vmlinuz"
    for m in drivers/block/ublk_drv mm/zsmalloc lib/lz4/lz4_compress lib/lz4/lz4hc_compress \
        drivers/block/zram/zram drivers/block/virtio_blk; do
        src=$(find "$moddir" -path "*/$m.ko*" | head -n1)
        if [ -z "$src" ]; then
            case $m in
            drivers/block/ublk_drv | drivers/block/zram/zram | drivers/block/virtio_blk)
                die "${KERNEL_DEBS[*]##*/}: no $m.ko" ;;
            esac
            log "$(cat "$KDIR/kver"): no $m.ko (built in)"
            continue
        fi
        case "$src" in
        *.xz) xz -dc "$src" >"$KDIR/$(basename "$m").ko" ;;
        *.zst) zstd -dcq "$src" >"$KDIR/$(basename "$m").ko" ;;
        *) cp "$src" "$KDIR/$(basename "$m").ko" ;;
        esac
    done
    rm -rf "$VM_DIR/kx"
    touch "$KDIR/done"
fi
BUSYBOX="$VM_DIR/busybox"
if [ ! -x "$BUSYBOX" ] || [ "$BUSYBOX_DEB" -nt "$BUSYBOX" ]; then
    rm -rf "$VM_DIR/bbx"
    dpkg-deb -x "$BUSYBOX_DEB" "$VM_DIR/bbx"
    cp "$VM_DIR/bbx/bin/busybox" "$BUSYBOX"
    rm -rf "$VM_DIR/bbx"
fi

# stress-ng (Debian's package) and the libraries it needs, as a tar archive the VM reads from
# a second disk: unpacked into RAM only for the near-OOM stage, so it costs the other stages
# nothing. Three of its libraries are usually not installed on the host: taken from their
# packages too.
STRESS_TAR="$VM_DIR/stress-ng.tar"
if [ "$MODE" = stress ] && [ ! -s "$STRESS_TAR" ]; then
    SX="$VM_DIR/stress-ng-root"
    rm -rf "$SX" "$VM_DIR/stress-ng-tar"
    mkdir -p "$SX" "$VM_DIR/stress-ng-tar/lib"
    for pkg in stress-ng libipsec-mb1 libjudydebian1 libsctp1; do
        cached_deb "$pkg"
        [ -n "$DEB" ] || die "could not download $pkg"
        dpkg-deb -x "$DEB" "$SX"
    done
    cp "$SX/usr/bin/stress-ng" "$VM_DIR/stress-ng-tar/stress-ng"
    LD_LIBRARY_PATH="$SX/usr/lib/x86_64-linux-gnu" ldd "$SX/usr/bin/stress-ng" |
        awk '/=> \// {print $3}' | while read -r lib; do cp -L "$lib" "$VM_DIR/stress-ng-tar/lib/"; done
    [ -e "$VM_DIR/stress-ng-tar/lib/libJudy.so.1" ] || die "stress-ng's libraries are incomplete"
    tar -C "$VM_DIR/stress-ng-tar" -cf "$STRESS_TAR.tmp" . && mv "$STRESS_TAR.tmp" "$STRESS_TAR"
    rm -rf "$SX" "$VM_DIR/stress-ng-tar"
fi

# --- 3. Build ------------------------------------------------------------------------------
if [ "$MODE" != kernel-only ]; then
    if [ -n "${TRUENO_UBLK_BIN:-}" ]; then
        BIN=$TRUENO_UBLK_BIN
    else
        log "cargo build --release (trueno-ublk and examples/ublk_ramdisk)"
        (cd "$ROOT" && cargo build --release --quiet --bin trueno-ublk --example ublk_ramdisk) ||
            die "cargo build --release failed"
        BIN="$ROOT/target/release/trueno-ublk"
    fi
    [ -x "$BIN" ] || die "no binary at $BIN"
    # The previous build, for the upgrade in the daemon's recovery step: UPGRADE_FROM's source
    # built here (cached in .vm/). In a target directory of its own: cargo tells a package's
    # builds apart by their files' times, not by where the package is, so in this one the
    # older sources would pass for this build's. Move UPGRADE_FROM forward when the store's
    # layout version changes (an older layout is refused, by design).
    if [ "$MODE" = full ] || [ "$MODE" = recovery ]; then
        PREVIOUS_BIN="$VM_DIR/previous-$UPGRADE_FROM/trueno-ublk"
        if [ ! -x "$PREVIOUS_BIN" ]; then
            # A shallow clone (`git clone --depth 1`, as some CI systems make) lacks the commit.
            if [ "$(git -C "$ROOT" rev-parse --is-shallow-repository 2>/dev/null)" = true ] &&
                ! git -C "$ROOT" cat-file -e "$UPGRADE_FROM^{commit}" 2>/dev/null; then
                log "a shallow clone: git fetch --unshallow, for commit $UPGRADE_FROM"
                git -C "$ROOT" fetch --quiet --unshallow || log "warning: git fetch --unshallow failed"
            fi
            if git -C "$ROOT" cat-file -e "$UPGRADE_FROM^{commit}" 2>/dev/null; then
                log "cargo build --release of $UPGRADE_FROM (the build the upgrade starts from)"
                src="$VM_DIR/previous-src"
                rm -rf "$src" && mkdir -p "$src"
                git -C "$ROOT" archive "$UPGRADE_FROM" | tar -x -C "$src"
                (cd "$src" && cargo build --release --locked --quiet --bin trueno-ublk \
                    --target-dir "$VM_DIR/previous-target") ||
                    die "cargo build --release of $UPGRADE_FROM failed"
                mkdir -p "$(dirname "$PREVIOUS_BIN")"
                cp "$VM_DIR/previous-target/release/trueno-ublk" "$PREVIOUS_BIN"
                rm -rf "$src" "$VM_DIR/previous-target"
            elif [ "${CI:-}" = true ]; then
                die "commit $UPGRADE_FROM (the build the upgrade test starts from) is not in this clone's history"
            else
                log "warning: commit $UPGRADE_FROM is not in this clone: no upgrade in the recovery step"
                PREVIOUS_BIN=
            fi
        fi
    fi
    # The ublk layer's own test target; without it the VM test's ramdisk step fails.
    RAMDISK=${UBLK_RAMDISK_BIN:-$ROOT/target/release/examples/ublk_ramdisk}
    if [ ! -x "$RAMDISK" ] && command -v cargo >/dev/null; then
        (cd "$ROOT" && cargo build --release --quiet --example ublk_ramdisk) ||
            die "cargo build --release --example ublk_ramdisk failed"
    fi
fi
gcc -O2 -static -Wall -Wextra -Werror -o "$VM_DIR/vmtool" "$ROOT/scripts/vm/vmtool.c" ||
    die "building scripts/vm/vmtool.c failed"

# --- 4. Initramfs --------------------------------------------------------------------------
STAGE="$VM_DIR/initramfs"
rm -rf "$STAGE"
# Merged /usr as on Debian 12; busybox's applet links are made at boot where no real tool is.
mkdir -p "$STAGE"/{usr/bin,usr/sbin,usr/local/bin,lib/modules,etc/systemd/system,test,proc,sys,dev,tmp,run}
ln -s usr/bin "$STAGE/bin"
ln -s usr/sbin "$STAGE/sbin"
cp "$BUSYBOX" "$STAGE/usr/bin/busybox"
cp "$ROOT/scripts/vm/init" "$STAGE/init"
cp "$ROOT/scripts/vm/test.sh" "$ROOT/scripts/vm/stress.sh" "$ROOT/scripts/vm/kernel-log.sh" \
    "$ROOT/scripts/vm/checks.sh" "$STAGE/test/"
cp "$VM_DIR/vmtool" "$STAGE/test/vmtool"
cp "$KDIR"/*.ko "$STAGE/lib/modules/"
chmod +x "$STAGE/init" "$STAGE/test/test.sh"

copy_libs() { # binary: its shared libraries, at the same paths as on the host
    ldd "$1" 2>/dev/null | awk '/=> \// {print $3} /^\t\/[^ ]+ \(/ {print $1}' | while read -r lib; do
        mkdir -p "$STAGE$(dirname "$lib")"
        [ -e "$STAGE$lib" ] || cp -L "$lib" "$STAGE$lib"
    done
}
# util-linux's swap and discard tools, as on a systemd host (busybox swapon has no -p).
for tool in swapon swapoff mkswap blkdiscard blockdev; do
    path=$(command -v "$tool") || die "$tool not found"
    cp -L "$path" "$STAGE/usr/sbin/$tool"
    copy_libs "$path"
done

case "$MODE" in
bench-*)
    # /init runs the benchmark instead of the test.
    cp "$ROOT/scripts/vm/bench.sh" "$STAGE/test/"
    ;;
esac
if [ "$MODE" = bench-fio ]; then
    cp -L "$(command -v fio)" "$STAGE/usr/bin/fio"
    copy_libs "$(command -v fio)"
fi
if [ "$MODE" = full ] || [ "$MODE" = recovery ]; then
    cp -L "$(command -v strace)" "$STAGE/usr/bin/strace"
    copy_libs "$(command -v strace)"
fi
if [ "$MODE" != kernel-only ]; then
    # Debug info stripped: the initramfs lives in the VM's unswappable RAM.
    objcopy --strip-debug "$BIN" "$STAGE/usr/bin/trueno-ublk"
    copy_libs "$BIN"
    if [ -n "$PREVIOUS_BIN" ]; then
        # Compressed (1.5 of its 6 MiB): the VM unpacks it for the recovery step only.
        mkdir -p "$STAGE/opt/previous"
        objcopy --strip-debug "$PREVIOUS_BIN" "$STAGE/opt/previous/trueno-ublk"
        xz -9 "$STAGE/opt/previous/trueno-ublk"
        # Its libraries may be more than this build's (it still linked libm).
        copy_libs "$PREVIOUS_BIN"
    fi
    if [ "$MODE" = bench-fio ] && [ -n "${VM_COMPARE_BIN:-}" ]; then
        [ -x "$VM_COMPARE_BIN" ] || die "no binary at $VM_COMPARE_BIN (VM_COMPARE_BIN)"
        objcopy --strip-debug "$VM_COMPARE_BIN" "$STAGE/usr/bin/trueno-ublk-b"
        copy_libs "$VM_COMPARE_BIN"
    fi
    if [ -x "$RAMDISK" ]; then
        objcopy --strip-debug "$RAMDISK" "$STAGE/usr/bin/ublk_ramdisk"
        copy_libs "$RAMDISK"
    fi
fi
FILL_MIB=$((RAM_MIB * 3 / 2 + 8))
cat >"$STAGE/test/env" <<EOF
MODE=$MODE
RAM_MIB=$RAM_MIB
FILL_MIB=$FILL_MIB
WATCHDOG_S=$((TIMEOUT_S - 30))
PRESSURE_TIMEOUT_S=300
STALL_S=${VM_STALL_S:-90}
SKIP="${VM_TEST_SKIP:-}"
EXTRA_KILLS=${VM_EXTRA_KILLS:-8}
PREVIOUS_BIN=${PREVIOUS_BIN:+/opt/previous/trueno-ublk}
CREATE_ARGS="${VM_CREATE_ARGS:-}"
FIO_RUNTIME_S=${VM_FIO_RUNTIME_S:-5}
FIO_JOBS="${VM_FIO_JOBS:-}"
PAGE_CLUSTER="${VM_PAGE_CLUSTER:-}"
COMPARE_ROUNDS=${VM_COMPARE_BIN:+${VM_COMPARE_ROUNDS:-4}}
STRESS_CASES="${STRESS_CASES:-move-inv:100}"
STRESS_S=${STRESS_S:-30}
EOF
(cd "$STAGE" && find . | cpio -o -H newc --quiet) | gzip -1 >"$VM_DIR/initrd.cpio.gz"
log "initramfs $(du -h "$VM_DIR/initrd.cpio.gz" | cut -f1), kernel $(basename "$KDIR"), mode $MODE"
if [ -n "${VM_BUILD_ONLY:-}" ]; then
    # The busybox VM made, not booted: for a machine with KVM and no build tools
    # (scripts/vm-boot-prepared.sh boots it there).
    mkdir -p "$VM_BUILD_ONLY"
    cp "$KDIR/vmlinuz" "$VM_DIR/initrd.cpio.gz" "$VM_BUILD_ONLY/"
    printf 'RAM_MIB=%s\nCPUS=%s\nTIMEOUT_S=%s\nMODE=%s\nKERNEL=%s\n' "$RAM_MIB" "$CPUS" \
        "$TIMEOUT_S" "$MODE" "$(basename "$KDIR")" >"$VM_BUILD_ONLY/vm.env"
    log "VM_BUILD_ONLY: kernel, initramfs and vm.env in $VM_BUILD_ONLY; not booted"
    exit 0
fi

# --- 5. Boot (the busybox VM) --------------------------------------------------------------
run_busybox_vm() {
CONSOLE="$VM_DIR/console.log"
RESULT="$VM_DIR/result.log"
DISK=()
if [ "$MODE" = stress ]; then
    # shellcheck disable=SC2054 # qemu's option values hold commas
    DISK=(-drive "file=$STRESS_TAR,if=none,format=raw,readonly=on,id=sng" -device virtio-blk-pci,drive=sng)
fi
for attempt in 1 2; do
: >"$CONSOLE"
: >"$RESULT"
if [ "${VM_ACCEL:-tcg}" = kvm ]; then ACCEL_SAID=kvm; else ACCEL_SAID="tcg, CPU $(tcg_cpu)"; fi
log "booting: ${RAM_MIB} MiB RAM, $CPUS vCPUs, $ACCEL_SAID (limit ${TIMEOUT_S} s)"
VM_START=$SECONDS
qemu_boot "$TIMEOUT_S" "$CPUS" "$RAM_MIB" "$KDIR/vmlinuz" "$VM_DIR/initrd.cpio.gz" \
    "$CONSOLE" "$RESULT" "${DISK[@]}" </dev/null >"$VM_DIR/qemu.log" 2>&1 &
QEMU_PID=$!
# Show the in-VM log as it comes (tail ends by itself once qemu has exited).
tail -n +1 -s 0.5 --pid "$QEMU_PID" -F "$RESULT" 2>/dev/null | sed -u 's/\r$//' &
TAIL_PID=$!
QEMU_RC=0
wait "$QEMU_PID" || QEMU_RC=$?
wait "$TAIL_PID" 2>/dev/null || true
VM_S=$((SECONDS - VM_START))
boot_again "$attempt" "$CONSOLE" "$RESULT" || break
done

# --- 6. Verdict ----------------------------------------------------------------------------
echo
echo "================ trueno-ublk VM test: figures ================"
tr -d '\r' <"$RESULT" | sed -n 's/^FIGURE //p' | while IFS='=' read -r key value; do
    printf '  %-34s %s\n' "$key" "$value"
done
# The figure that means something under emulation: trueno-ublk relative to zram in the same VM.
tr -d '\r' <"$RESULT" | sed -n 's/^FIGURE //p' | awk -F= '
    { v[$1] = $2 }
    END {
        n = split("dd_write_MBps dd_read_MBps swap_seconds", k, " ")
        for (i = 1; i <= n; i++)
            if (v["ublk_" k[i]] > 0 && v["zram_" k[i]] > 0)
                printf "  %-34s %.2f\n", "ublk/zram " k[i], v["ublk_" k[i]] / v["zram_" k[i]]
    }'
echo "  vm wall time                       ${VM_S} s (qemu exit $QEMU_RC)"
echo "  whole script                       $((SECONDS - START_S)) s"
fails=$(tr -d '\r' <"$RESULT" | grep -c '^FAIL' || true)
if tr -d '\r' <"$RESULT" | grep -q '^VMTEST RESULT: PASS$' && [ "$fails" -eq 0 ]; then
    echo "================ busybox VM: PASS ================"
    return 0
fi
echo "================ busybox VM: FAIL ================"
tr -d '\r' <"$RESULT" | grep '^FAIL' || true
[ "$QEMU_RC" -eq 124 ] && echo "the VM did not finish within ${TIMEOUT_S} s (VM_TIMEOUT_S)"
[ -s "$VM_DIR/qemu.log" ] && { echo "--- qemu ---"; tail -n 20 "$VM_DIR/qemu.log"; }
echo "--- VM console (last 60 lines of $CONSOLE) ---"
tr -d '\r' <"$CONSOLE" | tail -n 60
return 1
}

# --- 7. The real-systemd stage, and the verdict ------------------------------------------
ONLY=${VM_TEST_ONLY:-}
[ -z "$ONLY" ] || [ "$ONLY" = systemd ] || die "VM_TEST_ONLY: unknown stage '$ONLY' (only 'systemd')"
BUSYBOX_PASS=0
if [ "$ONLY" = systemd ]; then
    log "VM_TEST_ONLY=systemd: the busybox VM is left out (the run fails)"
else
    run_busybox_vm && BUSYBOX_PASS=1
fi
SYSTEMD_PASS=1
if [ "$MODE" = full ] && [[ " ${VM_TEST_SKIP:-} " != *" systemd "* ]]; then
    SYSTEMD_PASS=0
    echo
    log "real-systemd stage (scripts/vm/systemd-stage.sh)"
    bash "$ROOT/scripts/vm/systemd-stage.sh" "$KDIR" "$BIN" "$VM_DIR/vmtool" && SYSTEMD_PASS=1
elif [ "$MODE" = full ]; then
    echo "FAIL: the real-systemd stage was skipped (VM_TEST_SKIP)"
    SYSTEMD_PASS=0
fi
echo
echo "  whole script                       $((SECONDS - START_S)) s"
if [ "$BUSYBOX_PASS" -eq 1 ] && [ "$SYSTEMD_PASS" -eq 1 ]; then
    echo "================ VM test: PASS ================"
    exit 0
fi
systemd_verdict=failed
[ "$SYSTEMD_PASS" -eq 1 ] && systemd_verdict=passed
[ "$MODE" = full ] || systemd_verdict="not run in this mode"
echo "================ VM test: FAIL (busybox VM $([ "$BUSYBOX_PASS" -eq 1 ] && echo passed || echo failed), real-systemd stage $systemd_verdict) ================"
exit 1
