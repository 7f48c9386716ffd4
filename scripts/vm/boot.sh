# shellcheck shell=bash
# Sourced by scripts/vm-test.sh and scripts/vm/systemd-stage.sh: what their boots share.

# Whether a boot died before its test began, in the kernel's own context: nothing on the result
# port ($2), and the console's ($1) first Oops in a swapper task (the kernel's boot or idle
# thread), which runs none of our code. Seen once (2026-11-25 23:48, a `--stress` run): "Oops:
# int3" in sched_clock_cpu 3 s into the boot, a text-patching race under multi-threaded TCG,
# before init ran. Such a boot is tried once more; every other death counts.
died_before_test() { # console result
    [ ! -s "$2" ] || return 1
    local first_oops
    first_oops=$(tr -d '\r' <"$1" | grep -A2 -m1 'Oops:' || true)
    [[ $first_oops == *'Comm: swapper'* ]]
}

# Whether boot number $1 (of two) is to be tried again: the first, if it died before its test
# began (said through the sourcing script's `log`, with the console's first lines).
boot_again() { # attempt console result
    { [ "$1" -eq 1 ] && died_before_test "$2" "$3"; } || return 1
    log "the guest kernel died in its own boot before the test began (an emulator fault; console below): booting again"
    tr -d '\r' <"$2" | head -n 6 || true
}

# The CPU model of an emulated (TCG) guest: QEMU's `max` without ERMS and FSRM. Why: with
# those flags glibc's memcpy and memset (and some of the kernel's copies and its clear_page)
# use `rep movsb` and `rep stosb`, which QEMU 7.2's TCG runs an iteration at a time, so a
# program's copies cost several times what they would on a CPU that has the flags (which runs
# them at full speed), and a user-space codec falls behind the kernel's for a reason no real
# machine has. Measured with `VM_CPU=... bash scripts/vm-bench.sh --store`, 2026-11-30: the
# codec alone on one vCPU at 0.126-0.127 GB/s with `max` or `max` without AVX, 0.241-0.242
# without ERMS and FSRM (or as `qemu64` or `Nehalem`), kernel zram lz4 0.211-0.242 under all
# of them. VM_CPU overrides it.
tcg_cpu() {
    printf '%s' "${VM_CPU:-max,erms=off,fsrm=off}"
}

# qemu_boot TIMEOUT_S CPUS RAM_MIB KERNEL INITRD CONSOLE RESULT [QEMU_ARGS...]: boot the
# busybox VM (its /init runs the test or benchmark the initramfs holds), the console and the
# result port (ttyS1) into files; returns qemu's status (124: the time limit). Software
# emulation (TCG, the CPU of `tcg_cpu`), or the host's CPU through KVM with VM_ACCEL=kvm.
# QEMU names the emulator [qemu-system-x86_64].
qemu_boot() {
    local timeout_s=$1 cpus=$2 ram_mib=$3 kernel=$4 initrd=$5 console=$6 result=$7
    shift 7
    local accel=(-accel tcg,thread=multi -cpu "$(tcg_cpu)")
    [ "${VM_ACCEL:-tcg}" = kvm ] && accel=(-accel kvm -cpu host)
    timeout --kill-after=10 "$timeout_s" "${QEMU:-qemu-system-x86_64}" \
        -nodefaults -no-user-config "${accel[@]}" -smp "$cpus" -m "${ram_mib}M" \
        -kernel "$kernel" -initrd "$initrd" \
        -append "console=ttyS0 rdinit=/init rootfstype=ramfs panic=-1 loglevel=4 ${VM_KERNEL_ARGS:-}" \
        -nic none -display none -no-reboot "$@" \
        -chardev file,id=console,path="$console" -serial chardev:console \
        -chardev file,id=result,path="$result" -serial chardev:result
}
