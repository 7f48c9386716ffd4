# shellcheck shell=bash
# Sourced by scripts/vm-test.sh and scripts/vm/systemd-stage.sh: what their boots share.

# Whether a boot died before its test began, in the kernel's own context: nothing on the result
# port ($2), and the console's ($1) first Oops in a swapper task (the kernel's boot or idle
# thread), which runs none of our code. Seen once (2026-11-25 23:48, a `--stress` run): "Oops:
# int3" in sched_clock_cpu 3 s into the boot, a text-patching race under multi-threaded TCG,
# before init ran. Such a boot is tried once more; every other death counts.
died_before_test() { # console result
    [ ! -s "$2" ] || return 1
    tr -d '\r' <"$1" | grep -A2 -m1 'Oops:' | grep -q 'Comm: swapper'
}
