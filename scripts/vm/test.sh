#!/bin/sh
# shellcheck shell=dash disable=SC1091,SC2317 # sourced files are in the VM; functions run through check
# The end-to-end test, run by /init inside the VM (busybox sh; util-linux's swapon, swapoff,
# mkswap, blkdiscard and blockdev in /usr/sbin). Output goes to the host through ttyS1.
# Lines starting with "ok:" or "FAIL:" are checks, "FIGURE name=value" are measurements, and
# the last line is "VMTEST RESULT: PASS" or "VMTEST RESULT: FAIL".
#
# MODE=full (scripts/vm-test.sh), in this order:
#   1. ublk_drv loads and /dev/ublk-control appears; zram loads.
#  1b. The ublk layer alone (examples/ublk_ramdisk, a 64 MiB device in plain memory): O_DIRECT
#      patterns at bs 4k, 64k and 1M at the start, middle and end read back by sha256; discard
#      and write-zeroes read back as zeros; out-of-range reads and writes fail cleanly; SIGTERM
#      stops it and the device is gone.
#  1c. The ublk layer's recovery alone (ublk_ramdisk, its data in /dev/shm): kill -9 while a
#      heartbeat does I/O, a new process resumes the device; a hand-over (SIGUSR1) and a
#      resume; every pattern reads back; the heartbeat sees no error (its longest stall is a
#      figure); SIGTERM deletes the device.
#   2. Kernel zram (lz4) in the same VM, for comparison: O_DIRECT 1 MiB dd write/read speed
#      and the swap run of step 8 (with a rewrite pass).
#   3. `trueno-ublk create --size 1G` returns once /dev/ublkb0 is live (timed), prints its path,
#      leaves the daemon running (memory locked) and does not hold the caller's stdout; `list`
#      shows it.
#   4. Distinct random patterns written with O_DIRECT at bs 4k, 64k and 1M at the start, the
#      middle and the last MiB, read back and compared by sha256.
#   5. O_DIRECT 1 MiB write and read speed of /dev/ublkb0 (a mixed, compressible pattern).
#   6. blkdiscard and blkdiscard -z of a range read back as zeros; the data around it stays.
#   7. A second device is created, used and deleted (a process holding it open keeps neither
#      its daemon nor its memory) while I/O runs on the first; `create` refuses strict
#      overcommit and tags' buffers that would lock too much, leaving nothing behind.
#   8. mkswap + swapon -d; `delete --id 0` refused while it is swap; a program fills 1.5x the
#      RAM with a mixed pattern and verifies every word twice; pswpout and pswpin grew;
#      `trueno-ublk stat` while the data is swapped out; once the kernel freed that swap and
#      the daemon gave its memory back (20 s at most, timed), three processes fill as much
#      together and verify it twice in random order; `trueno-ublk compact`; swapoff;
#      `delete --id 0`.
#   9. (The systemd units run under a real systemd in a second VM: scripts/vm/systemd-stage.sh.)
#  10. dmesg has no ublk or swap I/O errors, hung tasks, BUG, Oops, warnings or OOM kills.
#  10b. (MODE full, with cgroup2's memory controller) A device's daemon says it probes OOM
#      kills at oom:mark_victim; a program OOM-killed in a memory cgroup of 16 MiB wakes it,
#      and it looks for the process being killed.
#  10c. (MODE full) A bit flipped under a stored page: of eight one-page reads submitted at
#      once (merged), those before it read back right and it fails with EIO; the page after
#      it read alone is right; `stat` counts the checksum failure.
#  11. (MODE=stress only, not in the full run; scripts/test.sh runs it with the compressible
#      `all` case: see docs/measurements.md, "Near OOM") Near OOM
#      (stress.sh, after step 10: OOM kills are expected there): stress-ng's vm stressor on
#      zram lz4 and on a fresh trueno-ublk device, compared; the serving process's memory
#      comes back when a program's swap is freed.
# MODE=kernel-only: steps 1, 2 and 10, plus the pattern checks of step 4 on zram.
# MODE=recovery: steps 1, 1c, 8b, 8c, 8d, 8e and 10 (what survives a daemon's death, and nothing else).
# MODE=stress: steps 1, 10 and 11.
#  8b. (MODE full and recovery) The daemon's recovery: device 0 as swap under the pressure
#      program (1.5x the RAM, every word verified, and once more after a hold), started by
#      the previous build (PREVIOUS_BIN, see vm-test.sh) when the VM has it; kill -9 of the
#      serving process while pages go out and again while they come back, a reload (SIGHUP
#      to the supervisor: a standby of the binary on disk takes the device over from the
#      serving process) and EXTRA_KILLS more kills (the standby takes over; the pause from
#      kill to live is a figure, with its p50 and worst); first, with the pages paged out,
#      an upgrade (SIGTERM to the supervisor hands the device over, this build's `create`
#      resumes it), and, while the memory is held, kill -9 of every trueno-ublk process (the
#      device stays quiesced, `create` again resumes it). `trueno-ublk fault-in` (what the
#      unit's ExecStop does for PID 1) reads a paged-out program's pages back while the device
#      is served, and reads nothing, at once, while it is quiesced.
#      Then a device whose store's shared memory is gone (removed with every daemon dead):
#      `create` refuses to resume it (it would serve zeros), the device stays quiesced,
#      `delete` refuses it while it is in use (mounted), --lose-pages deletes it, and its id
#      is free once its last user lets go.
#  8c. (MODE full and recovery) A serving process killed before its device went live (its start
#      held up by strace): the device it added and its store's memory are removed, `create`
#      fails saying so, nothing is left behind; killed before it added its device, the same,
#      at once.
#  8d. (MODE full and recovery) Signals to every process of a daemon: job control stops none;
#      SIGUSR2 to the supervisor compacts, SIGUSR1 does nothing; SIGQUIT stops it cleanly.
#  8e. (MODE full and recovery) A second `create` of a device whose supervisor is about to
#      resume it is refused, and so is `delete --lose-pages` of it as active swap; the
#      supervisor resumes it. A stop that comes as the serving
#      process dies still deletes the unused device.
# A monitor prints free memory and swap counters every 20 s and, if the test is still running
# at WATCHDOG_S or swap stops moving for STALL_S during a pressure run, dumps the blocked tasks
# to the console and fails the run. If this shell dies (the OOM killer took it, say), the VM's
# init has the monitor print its last 30 seconds and every process's state.

. /test/env
# The build an upgrade starts from, when vm-test.sh put one in (xz-compressed until used; the
# same file name as this build's: the daemon's processes are found by it).
PREVIOUS_BIN=${PREVIOUS_BIN:-}
. /test/stress.sh
. /test/kernel-log.sh
# Two cgroups, where the VM has cgroup2 with the memory controller: "shell" (memory.swap.max=0)
# for this shell, its checkers and the daemons it starts, so that nothing the test needs to
# carry on waits for swap while a device has no daemon; "work" for the programs that are meant
# to swap (`work CMD...`). Memory stays charged to the cgroup that first touched it, so the
# shell moves itself and then starts afresh.
CG=/sys/fs/cgroup
if [ -z "${TEST_IN_CGROUP:-}" ] && [ -w $CG/cgroup.subtree_control ] &&
    echo +memory >$CG/cgroup.subtree_control 2>/dev/null &&
    mkdir -p $CG/shell $CG/work && [ -e $CG/shell/memory.swap.max ] &&
    echo 0 >$CG/shell/memory.swap.max && echo $$ >$CG/shell/cgroup.procs; then
    export TEST_IN_CGROUP=1
    exec sh "$0" "$@"
fi
# work CMD...: run CMD in the "work" cgroup (or here, without cgroups).
work() {
    sh -c "echo \$\$ 2>/dev/null >$CG/work/cgroup.procs; exec \"\$@\"" work "$@"
}
VT=/test/vmtool
UL=/usr/sbin # util-linux tools (busybox's would win for bare names in this shell)
MIB=1048576
FIGURES_LOG=/tmp/figures.log
. /test/checks.sh
now() { $VT now; }
# child_of PID: the (first) child of PID: the program `work timeout ...` runs.
child_of() { awk '{ print $1 }' "/proc/$1/task/$1/children" 2>/dev/null; }
since() { awk -v a="$(now)" -v b="$1" 'BEGIN { printf "%.3f", a - b }'; }
mbps() { awk -v b="$1" -v s="$2" 'BEGIN { if (s <= 0) s = 1e-6; printf "%.1f", b / 1e6 / s }'; }
daemon_logs() {
    local f
    for f in /run/trueno-ublk/*.log /run/trueno-ublk/*.log.1; do
        [ -e "$f" ] || continue
        echo "--- $f (last 40 lines)"
        tail -n 40 "$f"
        echo "--- $f (its first 30 warnings and errors)"
        grep -E ' (WARN|ERROR) ' "$f" | head -n 30
    done
}
finish() {
    [ "$FAILS" -eq 0 ] || daemon_logs
    section "verdict"
    echo "$CHECKS checks, $FAILS failed"
    if [ "$FAILS" -eq 0 ] && [ "$CHECKS" -gt 0 ]; then
        echo "VMTEST RESULT: PASS"
    else
        echo "VMTEST RESULT: FAIL"
    fi
    exit 0
}
abort() {
    fail "$* (cannot go on)"
    dmesg | tail -n 40
    finish
}
# alive PID: the process exists and is not a zombie (orphans are reparented to /init,
# which does not reap them).
alive() {
    local state
    # No pid is no process (/proc//stat would read as /proc/stat).
    [ -n "$1" ] && [ -r "/proc/$1/stat" ] || return 1
    state=$(sed 's/^.*) \(.\).*/\1/' "/proc/$1/stat" 2>/dev/null)
    [ -n "$state" ] && [ "$state" != Z ]
}
# wait_until SECONDS command...: polls every 0.1 s.
wait_until() {
    local limit=$1 t0
    shift
    t0=$(now)
    while ! "$@"; do
        awk -v e="$(since "$t0")" -v l="$limit" 'BEGIN { exit !(e > l) }' && return 1
        usleep 100000
    done
    return 0
}
not() { ! "$@"; }
in_swaps() { grep -q "^$1 " /proc/swaps; }
# Hang guard and progress: free memory and swap counters every 20 s; at the deadline, or when
# swap has not moved for STALL_S during a pressure run (/run/pressure-on), blocked tasks and
# memory go to the console and the VM powers off with a FAIL verdict.
echo 1 >/proc/sys/kernel/sysrq
$VT monitor 20 "$WATCHDOG_S" "$STALL_S" /run/pressure-on &

# --- pattern I/O ---------------------------------------------------------------------------
# pat_write TAG DEV BS OFFSET LEN: a fresh random pattern, O_DIRECT, remembered under TAG.
pat_write() {
    local tag=$1 dev=$2 bs=$3 off=$4 len=$5 rc
    head -c "$len" /dev/urandom >"/tmp/pat-$tag.data"
    sha256sum <"/tmp/pat-$tag.data" | cut -d' ' -f1 >"/tmp/pat-$tag.sum"
    echo "$dev $bs $off $len" >"/tmp/pat-$tag.loc"
    dd if="/tmp/pat-$tag.data" of="$dev" bs="$bs" seek=$((off / bs)) oflag=direct conv=notrunc status=none
    rc=$?
    rm -f "/tmp/pat-$tag.data"
    return $rc
}
# pat_read TAG: the pattern reads back (O_DIRECT, same block size) with the same sha256.
pat_read() {
    local dev bs off len got
    read -r dev bs off len <"/tmp/pat-$1.loc"
    got=$(dd if="$dev" bs="$bs" skip=$((off / bs)) count=$((len / bs)) iflag=direct status=none |
        sha256sum | cut -d' ' -f1)
    [ "$got" = "$(cat "/tmp/pat-$1.sum")" ]
}
# zeros DEV OFFSET LEN: the range reads back as zeros.
zeros() {
    local got want
    got=$(dd if="$1" bs="$MIB" skip=$(($2 / MIB)) count=$(($3 / MIB)) iflag=direct status=none |
        sha256sum | cut -d' ' -f1)
    want=$(dd if=/dev/zero bs="$MIB" count=$(($3 / MIB)) status=none | sha256sum | cut -d' ' -f1)
    [ "$got" = "$want" ]
}
pattern_checks() { # DEV SIZE_BYTES
    local dev=$1 size=$2 mid last spec bs n
    mid=$((size / 2))
    last=$((size - MIB))
    # Start and middle regions of each block size, all written before any is read back; the
    # middle ones straddle the midpoint so they cross whatever boundaries the store has.
    for spec in "4k 4096 0 $((mid - 8192))" "64k 65536 $((8 * MIB)) $((mid + 16 * MIB - 65536))" \
        "1M $MIB $((16 * MIB)) $((mid + 32 * MIB))"; do
        # shellcheck disable=SC2086 # word splitting wanted
        set -- $spec
        check "O_DIRECT write bs=$1 at the start ($3)" pat_write "start-$1" "$dev" "$2" "$3" $((4 * MIB))
        check "O_DIRECT write bs=$1 in the middle ($4)" pat_write "mid-$1" "$dev" "$2" "$4" $((4 * MIB))
    done
    for bs in 4k 64k 1M; do
        check "read back bs=$bs at the start matches" pat_read "start-$bs"
        check "read back bs=$bs in the middle matches" pat_read "mid-$bs"
    done
    # The last MiB, by each block size in turn.
    for spec in "4k 4096" "64k 65536" "1M $MIB"; do
        # shellcheck disable=SC2086 # word splitting wanted
        set -- $spec
        check "O_DIRECT write bs=$1 of the last MiB" pat_write "last-$1" "$dev" "$2" "$last" $MIB
        check "read back bs=$1 of the last MiB matches" pat_read "last-$1"
    done
    n=$(dd if="$dev" bs="$MIB" skip=$((size / MIB)) count=1 iflag=direct status=none | wc -c)
    check "a read at the end of the device returns nothing (got $n bytes)" [ "$n" -eq 0 ]
}
recheck_patterns() { # what: every start/middle pattern still reads back
    local all=0 bs
    for bs in 4k 64k 1M; do
        pat_read "start-$bs" && pat_read "mid-$bs" || all=1
    done
    check "start and middle patterns still intact $1" [ "$all" -eq 0 ]
}
discard_checks() { # DEV OFFSET
    local dev=$1 at=$2
    check "O_DIRECT write 8 MiB at $at for discard" pat_write disc-lo "$dev" $MIB "$at" $((2 * MIB))
    pat_write disc-mid "$dev" $MIB $((at + 2 * MIB)) $((4 * MIB))
    pat_write disc-hi "$dev" $MIB $((at + 6 * MIB)) $((2 * MIB))
    check "blkdiscard of 4 MiB at $((at + 2 * MIB))" $UL/blkdiscard -o $((at + 2 * MIB)) -l $((4 * MIB)) "$dev"
    check "the discarded range reads back as zeros" zeros "$dev" $((at + 2 * MIB)) $((4 * MIB))
    check "the data before the discarded range is intact" pat_read disc-lo
    check "the data after the discarded range is intact" pat_read disc-hi
    pat_write disc-z-lo "$dev" $MIB $((at + 8 * MIB)) $MIB
    pat_write disc-z-mid "$dev" $MIB $((at + 9 * MIB)) $((2 * MIB))
    pat_write disc-z-hi "$dev" $MIB $((at + 11 * MIB)) $MIB
    check "blkdiscard -z (WRITE_ZEROES) of 2 MiB at $((at + 9 * MIB))" $UL/blkdiscard -z -o $((at + 9 * MIB)) -l $((2 * MIB)) "$dev"
    check "the zeroed range reads back as zeros" zeros "$dev" $((at + 9 * MIB)) $((2 * MIB))
    check "the data around the zeroed range is intact" eval "pat_read disc-z-lo && pat_read disc-z-hi"
}

# --- the ublk layer alone ------------------------------------------------------------------
# ramdisk_checks [--user-copy]: examples/ublk_ramdisk serves a 64 MiB device from plain memory
# (no store, no compression), so a failure here is the ublk layer's and not the store's. Run
# with a buffer per tag, then with user copy (UBLK_F_USER_COPY: the data moved by
# pread/pwrite on the char device, the daemon's default).
ramdisk_checks() {
    local size=$((64 * MIB)) mid=$((32 * MIB)) pid dev spec rc n tag mode="${1:-}" rd
    rd="ramdisk${mode:+ $mode}"
    if ! command -v ublk_ramdisk >/dev/null; then
        fail "ublk_ramdisk is not in the initramfs"
        return
    fi
    rm -f /tmp/ramdisk.out /tmp/ramdisk.err
    # shellcheck disable=SC2086 # no mode, no argument
    ublk_ramdisk --size 64M --id 9 --queues 2 $mode >/tmp/ramdisk.out 2>/tmp/ramdisk.err &
    pid=$!
    if ! wait_until 30 grep -q '^/dev/ublkb' /tmp/ramdisk.out; then
        fail "ublk_ramdisk --size 64M --id 9 did not print a device path within 30 s: $(cat /tmp/ramdisk.err)"
        kill "$pid" 2>/dev/null
        return
    fi
    dev=$(grep -o '^/dev/ublkb[0-9]*' /tmp/ramdisk.out | head -n1)
    check "ublk_ramdisk${mode:+ $mode} printed its device path ($dev)" [ "$dev" = /dev/ublkb9 ]
    if [ -n "$mode" ]; then
        check "$rd: the driver took user copy" grep -q ', user copy$' /tmp/ramdisk.err
    fi
    check "$dev is 64 MiB" [ "$($UL/blockdev --getsize64 "$dev")" -eq "$size" ]
    # 1 MiB at the start, across the middle and at the end by each block size, all written
    # before any is read back (the ramdisk's I/O buffer is 256 KiB, so 1M writes are split).
    for spec in "4k 4096 0 $((mid - 8192)) $((size - 3 * MIB))" \
        "64k 65536 $((2 * MIB)) $((mid + 4 * MIB - 65536)) $((size - 2 * MIB))" \
        "1M $MIB $((4 * MIB)) $((mid + 8 * MIB)) $((size - MIB))"; do
        # shellcheck disable=SC2086 # word splitting wanted
        set -- $spec
        check "$rd: O_DIRECT write bs=$1 at the start ($3)" pat_write "rd-start-$1" "$dev" "$2" "$3" $MIB
        check "$rd: O_DIRECT write bs=$1 in the middle ($4)" pat_write "rd-mid-$1" "$dev" "$2" "$4" $MIB
        check "$rd: O_DIRECT write bs=$1 at the end ($5)" pat_write "rd-end-$1" "$dev" "$2" "$5" $MIB
    done
    for spec in 4k 64k 1M; do
        for tag in start mid end; do
            check "$rd: read back bs=$spec at $tag matches" pat_read "rd-$tag-$spec"
        done
    done
    discard_checks "$dev" $((44 * MIB))
    rc=0
    n=$(dd if="$dev" bs=4096 skip=$((size / 4096)) count=1 iflag=direct status=none | wc -c)
    check "$rd: a read at the device end returns nothing (got $n bytes)" [ "$n" -eq 0 ]
    dd if=/dev/zero of="$dev" bs=4096 seek=$((size / 4096)) count=1 oflag=direct conv=notrunc status=none 2>/dev/null || rc=$?
    check "$rd: a write at the device end fails (dd exit $rc)" [ "$rc" -ne 0 ]
    check "$rd: the last MiB is intact after it" pat_read rd-end-1M
    check "$rd: still serving after the out-of-range access" alive "$pid"
    kill -TERM "$pid"
    check "$rd: exits on SIGTERM" wait_until 10 not alive "$pid"
    rc=0
    wait "$pid" || rc=$?
    check "$rd: exit status 0 (got $rc)" [ "$rc" -eq 0 ]
    check "$rd: $dev is gone" wait_until 5 not test -e "$dev"
    check "$rd: /dev/ublkc9 is gone" wait_until 5 not test -e /dev/ublkc9
    echo "$rd $(grep '^served:' /tmp/ramdisk.out)"
    [ -s /tmp/ramdisk.err ] && echo "$rd stderr: $(cat /tmp/ramdisk.err)"
    check "$rd: discard and write-zeroes reached the handler, no request refused" \
        grep -q '^served:.* discard=[1-9][0-9]* write_zeroes=[1-9][0-9]* refused=0$' /tmp/ramdisk.out
}

# --- the ublk layer's recovery alone -----------------------------------------------------
# ublk_ramdisk keeps its data in /dev/shm, so a new process can resume its device: it is
# killed with -9 while a heartbeat does I/O on it and started again with the same id; then
# it hands the device over (SIGUSR1) and is started again; every pattern written before reads
# back after each, the heartbeat never sees an error, and SIGTERM finally deletes it.
RD_ID=8
RD_DEV=/dev/ublkb$RD_ID
# dev_row ID: "STATE PID" of device ID as `trueno-ublk list` shows it ("STATE PID (gone)" when
# that process has exited).
dev_row() { trueno-ublk list 2>/dev/null | awk -v id="$1" '$1 == id { $1 = $2 = $3 = $4 = $5 = ""; print substr($0, 6) }'; }
dev_state_is() { [ "$(dev_row "$1" | cut -d' ' -f1)" = "$2" ]; }
# serving_pid ID: the live process serving device ID, empty if none.
serving_pid() { dev_row "$1" | awk '$1 == "live" && NF == 2 { print $2 }'; }
# dev_live_with ID PID: live, served by PID.
dev_live_with() { [ -n "$2" ] && [ "$(serving_pid "$1")" = "$2" ]; }
rd_start() {
    ublk_ramdisk --size 64M --id $RD_ID --queues 2 >/tmp/rd.out 2>>/tmp/rd.err &
    RD_PID=$!
    wait_until 30 grep -q "^$RD_DEV\$" /tmp/rd.out
}
rd_patterns_intact() {
    local tag all=0
    for tag in rd8-start rd8-mid rd8-end; do
        pat_read "$tag" || all=1
    done
    [ "$all" -eq 0 ]
}
ramdisk_recovery_checks() {
    local t0 rc hb pid0 pause
    if ! command -v ublk_ramdisk >/dev/null; then
        fail "ublk_ramdisk is not in the initramfs"
        return
    fi
    rm -f /tmp/rd.err /tmp/hb.stop /tmp/hb.out
    if ! rd_start; then
        fail "ublk_ramdisk --id $RD_ID did not print $RD_DEV within 30 s: $(cat /tmp/rd.err)"
        return
    fi
    ok "ublk_ramdisk serves $RD_DEV (pid $RD_PID)"
    check "ramdisk recovery: the device is live, served by pid $RD_PID" wait_until 5 dev_live_with $RD_ID $RD_PID
    check "ramdisk recovery: its data file exists" test -f /dev/shm/ublk_ramdisk-$RD_ID
    check "ramdisk recovery: O_DIRECT write bs=4k at the start" pat_write rd8-start $RD_DEV 4096 0 $MIB
    check "ramdisk recovery: O_DIRECT write bs=1M across the middle" pat_write rd8-mid $RD_DEV $MIB $((31 * MIB)) $((2 * MIB))
    check "ramdisk recovery: O_DIRECT write bs=64k at the end" pat_write rd8-end $RD_DEV 65536 $((63 * MIB)) $MIB
    $VT heartbeat $RD_DEV $((48 * MIB)) /tmp/hb.stop >/tmp/hb.out 2>&1 &
    hb=$!
    usleep 500000

    # kill -9 while the heartbeat's I/O runs: the device stays, quiesced; a new process
    # resumes it.
    pid0=$RD_PID
    t0=$(now)
    kill -9 $pid0
    wait $pid0 2>/dev/null
    check "ramdisk recovery: after kill -9 the device stays and is quiesced" wait_until 10 dev_state_is $RD_ID quiesced
    check "ramdisk recovery: ... $RD_DEV is still there" test -b $RD_DEV
    if rd_start && wait_until 10 dev_live_with $RD_ID $RD_PID; then
        pause=$(since "$t0")
        ok "ramdisk recovery: a new process (pid $RD_PID) resumed $RD_DEV, $pause s after the kill"
        figure ramdisk_kill9_to_live_s "$pause"
    else
        fail "ramdisk recovery: no new process resumed $RD_DEV after kill -9 ($(dev_row $RD_ID); $(tail -n 3 /tmp/rd.err))"
    fi
    grep resumed /tmp/rd.err | tail -n 1
    check "ramdisk recovery: every pattern reads back after kill -9 and resume" rd_patterns_intact

    # A hand-over: the process leaves, the device stays quiesced, the next one resumes it.
    pid0=$RD_PID
    t0=$(now)
    kill -USR1 $pid0
    rc=0
    wait $pid0 || rc=$?
    check "ramdisk recovery: the hand-over (SIGUSR1) exits 0 (exit $rc, $(since "$t0") s)" [ "$rc" -eq 0 ]
    check "ramdisk recovery: after the hand-over the device is quiesced" dev_state_is $RD_ID quiesced
    if rd_start && wait_until 10 dev_live_with $RD_ID $RD_PID; then
        pause=$(since "$t0")
        ok "ramdisk recovery: a new process (pid $RD_PID) resumed $RD_DEV, $pause s after the hand-over began"
        figure ramdisk_handover_to_live_s "$pause"
    else
        fail "ramdisk recovery: no new process resumed $RD_DEV after the hand-over ($(dev_row $RD_ID); $(tail -n 3 /tmp/rd.err))"
    fi
    check "ramdisk recovery: every pattern reads back after the hand-over and resume" rd_patterns_intact

    touch /tmp/hb.stop
    rc=0
    wait $hb || rc=$?
    cat /tmp/hb.out
    check "ramdisk recovery: the heartbeat saw no I/O error or wrong data (exit $rc)" \
        grep -q '^HEARTBEAT_BAD=0$' /tmp/hb.out
    figure ramdisk_heartbeat_max_stall_s "$(sed -n 's/^HEARTBEAT_MAX_STALL_S=//p' /tmp/hb.out)"

    kill -TERM $RD_PID
    rc=0
    wait $RD_PID || rc=$?
    check "ramdisk recovery: SIGTERM stops it (exit $rc)" [ "$rc" -eq 0 ]
    check "ramdisk recovery: $RD_DEV is gone" wait_until 5 not test -e $RD_DEV
    check "ramdisk recovery: its data file is gone" not test -e /dev/shm/ublk_ramdisk-$RD_ID
    [ -s /tmp/rd.err ] && sed 's/^/ramdisk stderr: /' /tmp/rd.err
}

# --- the daemon's recovery ------------------------------------------------------------------
# live_not_by ID PID: device ID is live, served by a process other than PID.
live_not_by() {
    local pid
    pid=$(serving_pid "$1")
    [ -n "$pid" ] && [ "$pid" != "$2" ]
}
daemon_log() { # ID: the last lines of the detached daemon's log
    [ -e "/run/trueno-ublk/ublkb$1.log" ] && tail -n "${2:-12}" "/run/trueno-ublk/ublkb$1.log"
}
resumed_count() { daemon_log "$1" 100000 | grep -c 'device resumed'; }
# standby_ready ID: its supervisor said "standby ready" more often than a standby was used up:
# by a takeover, or by a reload (which dismisses the standby, its new one coming later).
standby_ready() {
    [ "$(daemon_log "$1" 100000 | grep -c 'supervise: standby ready')" -gt \
        "$(daemon_log "$1" 100000 | grep -c -e 'the standby takes the device over' -e 'reload: the new standby is ready')" ]
}
# log_clock LINE: the time of day (seconds since midnight UTC) of a daemon log line.
log_clock() { echo "$1" | sed -n 's/^[0-9-]*T\([0-9]*\):\([0-9]*\):\([0-9.]*\)Z.*/\1 \2 \3/p' | awk '{ printf "%.3f", $1 * 3600 + $2 * 60 + $3 }'; }
# pause_figure NAME FROM LINE: FIGURE NAME, the seconds from FROM (a time of day as `$VT clock`
# gives it) to the daemon log LINE's; none, said so, where LINE or FROM is missing or LINE is
# earlier (an older line than the one waited for, or midnight in between).
pause_figure() {
    local at
    at=$(log_clock "$3")
    if [ -n "$at" ] && [ -n "$2" ] && awk -v a="$at" -v b="$2" 'BEGIN { exit !(a >= b) }'; then
        figure "$1" "$(awk -v a="$at" -v b="$2" 'BEGIN { printf "%.3f", a - b }')"
    else
        echo "NOTE: no figure $1: no log line after ${2:-no time} ('${3:-none}')"
    fi
}
# kill_serving ID WHAT FIGURE: kill -9 the process serving device ID; its supervisor's
# standby takes the device over. Checks it and records the pause: from the kill to the
# resumed device's log line (FIGURE), and to `list` showing it live (polled, slower).
kill_serving() {
    local id=$1 what=$2 pid t0 c0 n0 pause resumed
    pid=$(serving_pid "$id")
    if [ -z "$pid" ]; then
        fail "$what: no live process serves device $id ($(dev_row "$id"))"
        return
    fi
    # A standby must be ready (its supervisor said so more often than it handed the device over).
    wait_until 30 standby_ready "$id" || echo "$what: no standby ready within 30 s; killing anyway"
    n0=$(resumed_count "$id")
    c0=$($VT clock)
    t0=$(now)
    kill -9 "$pid"
    if wait_until 30 live_not_by "$id" "$pid"; then
        pause=$(since "$t0")
        # The new process logs that it resumed the device once it is live: wait for the line.
        wait_until 10 eval "[ \$(resumed_count $id) -gt $n0 ]"
        resumed=$(daemon_log "$id" 30 | grep 'device resumed' | tail -n 1)
        ok "$what: kill -9 of the serving process $pid; pid $(serving_pid "$id") resumed the device (seen by list $pause s after the kill)"
        pause_figure "$3" "$c0" "$resumed"
        echo "$resumed"
        # Where the resume's queue start waited (the kernel's release of the old daemon, the
        # tags' fetch, END_USER_RECOVERY).
        daemon_log "$id" 30 | grep 'resume: queues started' | tail -n 1
    else
        fail "$what: nobody resumed device $id within 30 s of kill -9 of $pid ($(dev_row "$id"))"
        daemon_log "$id"
    fi
}
# reload_daemon ID WHAT FIGURE: `trueno-ublk reload --id ID` (SIGHUP to the supervisor, what
# `systemctl reload` sends): a standby of the binary on disk is readied while the serving
# process serves on, then the serving process hands the device over and the standby takes it
# over. Checks it and records the pause: from the supervisor's word to hand over to the
# resumed device's log line.
reload_daemon() {
    local id=$1 what=$2 pid sup n0 asked resumed rc
    pid=$(serving_pid "$id")
    sup=$(awk '/^PPid:/ { print $2 }' "/proc/$pid/status" 2>/dev/null)
    if [ -z "$pid" ] || [ -z "$sup" ]; then
        fail "$what: no live process serves device $id ($(dev_row "$id"))"
        return
    fi
    n0=$(resumed_count "$id")
    trueno-ublk reload --id "$id" >/tmp/reload.out 2>&1
    rc=$?
    check "$what: trueno-ublk reload --id $id (exit $rc: $(cat /tmp/reload.out))" [ "$rc" -eq 0 ]
    if wait_until 60 live_not_by "$id" "$pid"; then
        wait_until 10 eval "[ \$(resumed_count $id) -gt $n0 ]"
        ok "$what: pid $(serving_pid "$id") took the device over from $pid"
        asked=$(daemon_log "$id" 100 | grep 'reload: the new standby is ready' | tail -n 1)
        resumed=$(daemon_log "$id" 30 | grep 'device resumed' | tail -n 1)
        pause_figure "$3" "$(log_clock "$asked")" "$resumed"
        check "$what: the old serving process handed the device over for it" \
            eval "daemon_log $id 100 | grep -q 'reload: handing the device over'"
        check "$what: ... and the supervisor ($sup) stayed" alive "$sup"
    else
        fail "$what: nobody took device $id over from $pid within 60 s of SIGHUP to $sup ($(dev_row "$id"))"
        daemon_log "$id"
    fi
}
phase_is() { [ "$(cat /tmp/phase 2>/dev/null)" = "$1" ]; }
# daemon_pids: the pids of trueno-ublk processes, found by their comm alone. Not pidof: it
# reads every process's command line from that process's memory, and while a swap device
# waits for its daemon, a process whose stack is swapped out (this VM's init, reaping the
# daemon) makes pidof wait with it.
daemon_pids() { grep -lx trueno-ublk /proc/[0-9]*/comm 2>/dev/null | sed 's,^/proc/,,; s,/comm$,,'; }
# no_daemon_runs: no trueno-ublk process but zombies (orphans this VM's init never reaps).
no_daemon_runs() {
    local pid
    for pid in $(daemon_pids); do
        alive "$pid" && return 1
    done
    return 0
}
# grew_by KEY N SINCE: /proc/vmstat's KEY is at least N above SINCE.
grew_by() { [ "$(vmstat_of "$1")" -ge $(($3 + $2)) ]; }

# spares_a_tag ID: the block layer hands device ID's daemon at most one request fewer than the
# queue depth, so that its death is noticed at once (src/ublk/device.rs, tune_for_survival).
spares_a_tag() {
    [ "$(cat "/sys/block/ublkb$1/queue/nr_requests")" -eq $(($(cat "/sys/block/ublkb$1/mq/0/nr_tags") - 1)) ]
}
tag_limits() { echo "nr_requests $(cat "/sys/block/ublkb$1/queue/nr_requests"), nr_tags $(cat "/sys/block/ublkb$1/mq/0/nr_tags")"; }

# create_resumes WHAT FIGURE C0: this build's `create` resumes device 0 (printing its path)
# and the device is live again; FIGURE is the time from C0 (a `$VT clock`) to the daemon's
# "device resumed" line.
create_resumes() {
    local rc n0
    n0=$(resumed_count 0)
    # shellcheck disable=SC2086 # word splitting wanted
    trueno-ublk create --size 1G --id 0 $CREATE_ARGS >/tmp/create.out 2>/tmp/create.err
    rc=$?
    check "daemon recovery: $1 (exit $rc, printed '$(cat /tmp/create.out)' $(cat /tmp/create.err))" \
        [ "$rc" -eq 0 -a "$(cat /tmp/create.out)" = /dev/ublkb0 ]
    if wait_until 10 live_not_by 0 none; then
        ok "daemon recovery: live again, served by pid $(serving_pid 0)"
        check "daemon recovery: ... one tag spared ($(tag_limits 0))" spares_a_tag 0
        wait_until 10 eval "[ \$(resumed_count 0) -gt $n0 ]"
        pause_figure "$2" "$3" "$(daemon_log 0 30 | grep 'device resumed' | tail -n 1)"
    else
        fail "daemon recovery: not live after: $1 ($(dev_row 0))"
    fi
}

# fault_in_checks: `trueno-ublk fault-in` on a program of 16 MiB paged out to the served
# device 0: the pages come back into its memory (its VmSwap falls) and every word still
# matches.
fault_in_checks() {
    local pid program out swapped back swap_kib rc words bad
    rm -f /tmp/hold-fi
    VMTOOL_PASSES=0 VMTOOL_VERIFY_AFTER_HOLD=1 VMTOOL_PAGEOUT=1 \
        work timeout 300 $VT pressure 16 "$(date +%s)" /tmp/hold-fi >/tmp/fault-in-program.out 2>&1 &
    pid=$!
    if ! wait_until 120 test -e /tmp/hold-fi; then
        fail "fault-in: the 16 MiB program never held its memory"
        kill "$pid" 2>/dev/null
        wait "$pid"
        return
    fi
    program=$(child_of "$pid")
    echo "fault-in: before, pid $program $(grep VmSwap "/proc/$program/status")"
    out=$(timeout 60 trueno-ublk fault-in --pid "$program" 2>&1)
    rc=$?
    swap_kib=$(awk '/^VmSwap:/ { print $2 }' "/proc/$program/status")
    echo "fault-in: $out; after, VmSwap $swap_kib kB"
    swapped=$(echo "$out" | sed -n 's/.*: \([0-9]*\) pages were swapped out.*/\1/p')
    back=$(echo "$out" | sed -n 's/.*, \([0-9]*\) read back.*/\1/p')
    check "fault-in --pid $program: exit 0, the program's 4096 pages read back (exit $rc: $out)" \
        [ "$rc" -eq 0 -a "${swapped:-0}" -ge 4096 -a "${back:-0}" -ge 4000 ]
    check "fault-in: ... its VmSwap is below 1 MiB after (${swap_kib:-?} kB)" [ "${swap_kib:-99999}" -lt 1024 ]
    rm -f /tmp/hold-fi
    wait "$pid"
    rc=$?
    words=$(sed -n 's/^PRESSURE_AFTER_HOLD_WORDS_CHECKED=//p' /tmp/fault-in-program.out)
    bad=$(sed -n 's/^PRESSURE_AFTER_HOLD_BAD_WORDS=//p' /tmp/fault-in-program.out)
    check "fault-in: ... and every word matched after (rc $rc, ${words:-0} checked, ${bad:-?} bad)" \
        [ "$rc" -eq 0 -a "${bad:-1}" = 0 -a "${words:-0}" -ge "$((16 * MIB / 8))" ]
}

# daemon_recovery_checks: what issue #11 asks of the daemon, under swap pressure. Device 0 is
# swap; the pressure program fills 1.5x the RAM and verifies every word, then holds its
# memory and verifies every word once more when released. Before it, an upgrade from the
# build that started the device (SIGTERM hand-over, this build's `create`) under a first
# such program. Meanwhile: kill -9 of the serving process while pages go out, and again
# while they come back (its supervisor starts a new one, which resumes the device); then,
# while the memory is held, kill -9 of every trueno-ublk process: the device stays
# quiesced, and `create` again resumes it.
daemon_recovery_checks() {
    local dev=/dev/ublkb0 out0 in0 rc pid sup role c0 filled words bad after_bad after_words n pauses t0
    local first=trueno-ublk
    # The device starts under the previous build when the VM has one (see vm-test.sh), so
    # that step 0 is an upgrade.
    [ -x "$PREVIOUS_BIN" ] && first=$PREVIOUS_BIN
    # shellcheck disable=SC2086 # word splitting wanted
    $first create --size 1G --id 0 $CREATE_ARGS >/tmp/create.out 2>/tmp/create.err
    rc=$?
    check "daemon recovery: $first create --size 1G --id 0 (exit $rc: $(cat /tmp/create.out /tmp/create.err))" \
        [ "$rc" -eq 0 ]
    [ "$rc" -eq 0 ] || return
    check "daemon recovery: the request timeout is 1 s (io_timeout $(cat /sys/block/ublkb0/queue/io_timeout))" \
        [ "$(cat /sys/block/ublkb0/queue/io_timeout)" = 1000 ]
    check "daemon recovery: mkswap" eval "$UL/mkswap $dev >/dev/null"
    check "daemon recovery: swapon -d" $UL/swapon -d $dev
    fault_in_checks
    # 0. An upgrade, as a package's `systemctl restart` does it, with the previous build's
    #    pages out: a first pressure program fills its memory, paging each part out as it
    #    goes (RAM never at the watermark), and holds it;
    #    SIGTERM to the supervisor of the build that started the device hands the device over
    #    (quiesced, still swap, pages kept) and this build's `create` resumes it; then the
    #    program checks every word. With the pages out and RAM free again, not at the
    #    watermark: there, whatever starts the next daemon needs reclaim, which waits for the
    #    quiesced device (seen in the VM: the shell's fork blocked for good; docs/limits.md),
    #    and the previous build's fill there once failed writes with ENOMEM (its starvation
    #    rule; this build keeps its reserve across a takeover).
    #    The kills below, at the watermark, are this build's: its standby is running already.
    rm -f /tmp/hold /tmp/phase
    touch /run/pressure-on
    VMTOOL_PASSES=0 VMTOOL_VERIFY_AFTER_HOLD=1 VMTOOL_PAGEOUT=1 \
        work timeout "$PRESSURE_TIMEOUT_S" $VT pressure "$FILL_MIB" "$(date +%s)" /tmp/hold >/tmp/pressure0.out 2>&1 &
    pid=$!
    if wait_until 300 test -e /tmp/hold; then
        grep -E '^(SwapTotal|SwapFree)' /proc/meminfo
        sup=$(awk '/^PPid:/ { print $2 }' "/proc/$(serving_pid 0)/status" 2>/dev/null)
        c0=$($VT clock)
        kill -TERM "$sup"
        check "daemon recovery: SIGTERM to the supervisor ($sup, $first): every process exits" wait_until 30 no_daemon_runs
        check "daemon recovery: ... the device stays, quiesced ($(dev_row 0))" dev_state_is 0 quiesced
        check "daemon recovery: ... and is still swap" in_swaps $dev
        create_resumes "this build's create resumes the device $first handed over" recovery_handover_to_live_s "$c0"
        rm -f /tmp/hold
    else
        fail "daemon recovery: the first pressure program never held its memory"
    fi
    wait "$pid"
    rc=$?
    cat /tmp/pressure0.out
    words=$(sed -n 's/^PRESSURE_AFTER_HOLD_WORDS_CHECKED=//p' /tmp/pressure0.out)
    bad=$(sed -n 's/^PRESSURE_AFTER_HOLD_BAD_WORDS=//p' /tmp/pressure0.out)
    check "daemon recovery: every word matched after the hand-over from $first (rc $rc, ${words:-0} checked, ${bad:-?} bad)" \
        [ "$rc" -eq 0 -a "${bad:-1}" = 0 -a "${words:-0}" -ge "$((FILL_MIB * MIB / 8))" ]
    # This build's processes: their private anonymous memory (heap, stacks; the serving
    # process's store is shared memory, and may still hold pages of the first program whose
    # discards have not come yet).
    pid=$(serving_pid 0)
    sup=$(awk '/^PPid:/ { print $2 }' "/proc/$pid/status" 2>/dev/null)
    check "daemon recovery: the serving process ($pid) has a supervisor ($sup)" \
        [ "$(cat "/proc/$sup/comm" 2>/dev/null)" = trueno-ublk ]
    check "daemon recovery: a standby is ready" wait_until 20 standby_ready 0
    for p in $(daemon_pids); do
        role=standby
        [ "$p" = "$pid" ] && role=serving
        [ "$p" = "$sup" ] && role=supervisor
        echo "daemon recovery: $role $p: $(grep -E '^(Rss|Pss|Private_Dirty|Anonymous):' "/proc/$p/smaps_rollup" | tr -s ' ' | tr '\n' ' ')"
        figure "recovery_${role}_anon_kib" "$(awk '/^Anonymous:/ { print $2 }' "/proc/$p/smaps_rollup")"
    done
    out0=$(vmstat_of pswpout)
    in0=$(vmstat_of pswpin)
    rm -f /tmp/hold /tmp/phase
    VMTOOL_PASSES=1 VMTOOL_VERIFY_AFTER_HOLD=1 VMTOOL_PHASE_FILE=/tmp/phase \
        work timeout "$PRESSURE_TIMEOUT_S" $VT pressure "$FILL_MIB" "$(date +%s)" /tmp/hold >/tmp/pressure.out 2>&1 &
    pid=$!
    # 1. While pages go out: the fill, once 64 MiB went out.
    if wait_until 300 eval "phase_is fill && grew_by pswpout 16384 $out0"; then
        kill_serving 0 "daemon recovery, pages going out ($(($(vmstat_of pswpout) - out0)) out)" recovery_kill_out_to_live_s
    else
        fail "daemon recovery: the fill never pushed 64 MiB out (phase $(cat /tmp/phase), pswpout +$(($(vmstat_of pswpout) - out0)))"
    fi
    # 2. While pages come back: the first verify pass, once 16 MiB came in during it.
    in0=$(vmstat_of pswpin)
    if wait_until 300 eval "phase_is verify-1 && grew_by pswpin 4096 $in0"; then
        kill_serving 0 "daemon recovery, pages coming back ($(($(vmstat_of pswpin) - in0)) in)" recovery_kill_in_to_live_s
    else
        fail "daemon recovery: verify-1 never brought 16 MiB back (phase $(cat /tmp/phase), pswpin +$(($(vmstat_of pswpin) - in0)))"
    fi
    # 2a. A reload (what `systemctl reload` does) while pages come back, RAM at the watermark.
    #     Not tried once the pass has ended: a FAIL, not a step left out unsaid.
    if phase_is verify-1; then
        wait_until 30 standby_ready 0
        reload_daemon 0 "daemon recovery, reload ($(cat /tmp/phase))" recovery_reload_pause_s
    else
        fail "daemon recovery: the reload was not tried: verify-1 ended before it (phase $(cat /tmp/phase))"
    fi
    # 2b. EXTRA_KILLS more, each once a new standby is ready, while pages come back.
    n=0
    while [ "$n" -lt "${EXTRA_KILLS:-0}" ] && phase_is verify-1; do
        n=$((n + 1))
        kill_serving 0 "daemon recovery, extra kill $n ($(cat /tmp/phase))" "recovery_kill_extra${n}_to_live_s"
    done
    check "daemon recovery: $n extra kills while pages came back, of ${EXTRA_KILLS:-0} (phase $(cat /tmp/phase))" \
        [ "$n" -eq "${EXTRA_KILLS:-0}" ]
    pauses=$(sed -n 's/^FIGURE recovery_kill_[a-z0-9]*_to_live_s=//p' /tmp/figures.log 2>/dev/null)
    if [ -n "$pauses" ]; then
        # shellcheck disable=SC2086 # one pause per word
        set -- $pauses
        figure recovery_kills "$#"
        figure recovery_pause_p50_s "$(printf '%s\n' "$@" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')"
        figure recovery_pause_max_s "$(printf '%s\n' "$@" | sort -n | tail -n 1)"
    fi
    # While the memory is held with pages out:
    if wait_until 300 test -e /tmp/hold; then
        grep -E '^(SwapTotal|SwapFree)' /proc/meminfo
        # 3. Every trueno-ublk process killed.
        c0=$($VT clock)
        # shellcheck disable=SC2046 # one pid per word
        kill -9 $(daemon_pids)
        check "daemon recovery: no trueno-ublk process left after kill -9 of all" wait_until 10 no_daemon_runs
        check "daemon recovery: ... and the device stays, quiesced ($(dev_row 0))" wait_until 10 dev_state_is 0 quiesced
        check "daemon recovery: ... and is still swap" in_swaps $dev
        # The program's pages out there would hold a read until the next daemon.
        t0=$(now)
        timeout 20 trueno-ublk fault-in --pid "$(child_of "$pid")" >/tmp/fault-in.out 2>&1
        rc=$?
        check "daemon recovery: ... fault-in of the program reads nothing while it is quiesced (exit $rc after $(since "$t0") s: $(cat /tmp/fault-in.out))" \
            eval "[ $rc -eq 0 ] && grep -q 'read back: $dev is not served right now (quiesced)' /tmp/fault-in.out"
        create_resumes "create --size 1G --id 0 again resumes it" recovery_kill_all_to_live_s "$c0"
        # 4. fault-in of the program while this build hands the device over (SIGTERM to its
        #    supervisor, as a unit's stop): the hand-over waits for the reads under way, and
        #    fault-in reads none after it, so it ends (saying the device is not served) instead
        #    of waiting in a read for the next daemon (PID 1 waiting so for a daemon it must
        #    fork would be a deadlock: src/devices.rs, HandOverGate).
        wait_until 20 standby_ready 0
        sup=$(awk '/^PPid:/ { print $2 }' "/proc/$(serving_pid 0)/status" 2>/dev/null)
        trueno-ublk fault-in --pid "$(child_of "$pid")" >/tmp/fault-in4.out 2>&1 &
        fpid=$!
        sleep 1
        if alive "$fpid"; then
            c0=$($VT clock)
            kill -TERM "$sup"
            check "daemon recovery: SIGTERM to the supervisor ($sup) during a fault-in: every process exits" wait_until 30 no_daemon_runs
            check "daemon recovery: ... the device stays, quiesced ($(dev_row 0))" dev_state_is 0 quiesced
            check "daemon recovery: ... and the fault-in ends without a daemon ($(cat /tmp/fault-in4.out))" \
                eval "wait_until 10 eval '! alive $fpid' && grep -q 'not served right now (quiesced)' /tmp/fault-in4.out"
            create_resumes "create --size 1G --id 0 resumes it after the hand-over" recovery_handover_during_fault_in_to_live_s "$c0"
        else
            fail "daemon recovery: fault-in read every page of the program within a second, before the hand-over ($(cat /tmp/fault-in4.out))"
        fi
        wait "$fpid"
        rm -f /tmp/hold
    else
        fail "daemon recovery: the pressure program never held its memory (phase $(cat /tmp/phase))"
    fi
    wait "$pid"
    rc=$?
    rm -f /run/pressure-on
    cat /tmp/pressure.out
    filled=$((FILL_MIB * MIB / 8))
    words=$(sed -n 's/^PRESSURE_WORDS_CHECKED=//p' /tmp/pressure.out)
    bad=$(sed -n 's/^PRESSURE_BAD_WORDS=//p' /tmp/pressure.out)
    after_words=$(sed -n 's/^PRESSURE_AFTER_HOLD_WORDS_CHECKED=//p' /tmp/pressure.out)
    after_bad=$(sed -n 's/^PRESSURE_AFTER_HOLD_BAD_WORDS=//p' /tmp/pressure.out)
    check "daemon recovery: the pressure program exited 0 (rc $rc)" [ "$rc" -eq 0 ]
    check "daemon recovery: every word matched across the kills (${words:-0} checked, ${bad:-?} bad)" \
        [ "${bad:-1}" = 0 -a "${words:-0}" -ge "$filled" ]
    check "daemon recovery: every word matched after kill -9 of all and create (${after_words:-0} checked, ${after_bad:-?} bad)" \
        [ "${after_bad:-1}" = 0 -a "${after_words:-0}" -ge "$filled" ]
    check "daemon recovery: pages went out ($(($(vmstat_of pswpout) - out0))) and came back" \
        [ "$(vmstat_of pswpout)" -gt "$out0" -a "$(vmstat_of pswpin)" -gt "$in0" ]
    daemon_log 0 40 | grep -E 'resumed|died|handed|WARN|ERROR' | tail -n 12
    # What the daemons warned of (the log goes with the device).
    grep -E ' (WARN|ERROR) ' /run/trueno-ublk/ublkb0.log | head -n 30
    check "daemon recovery: swapoff $dev" $UL/swapoff $dev
    check "daemon recovery: delete --id 0" trueno-ublk delete --id 0
    check "daemon recovery: $dev is gone" wait_until 10 not test -e $dev
}

# daemon_refusal_checks: a device whose pages are gone (its store's shared memory removed
# while no daemon ran) must not be resumed: an empty store would serve zeros where data was.
# The device stays quiesced; `delete` refuses it while it is in use (a read-only mount claims
# it) and no daemon serves it, --lose-pages deletes it, and its id is free again once the
# mount, its last user, lets go.
daemon_refusal_checks() {
    local id=5 dev=/dev/ublkb5 rc
    trueno-ublk create --size 64M --id $id >/tmp/create5.out 2>&1 || {
        fail "refusal: create --size 64M --id $id: $(cat /tmp/create5.out)"
        return
    }
    check "refusal: O_DIRECT write on $dev" pat_write dev5 $dev $MIB 0 $((4 * MIB))
    check "refusal: a read-only ext2 on $dev mounts (it claims the device)" \
        eval "mke2fs -q -b 4096 $dev 16384 >/dev/null 2>&1 && mkdir -p /mnt5 && mount -o ro $dev /mnt5"
    # shellcheck disable=SC2046 # one pid per word
    kill -9 $(daemon_pids)
    check "refusal: every trueno-ublk process is gone" wait_until 10 no_daemon_runs
    check "refusal: the device stays, quiesced ($(dev_row $id))" wait_until 10 dev_state_is $id quiesced
    # The store's SysV key for device N is 0x74000000 + N (src/store/layout.rs).
    check "refusal: its store's shared memory is removed" $VT shm-remove $((0x74000000 + id))
    rc=0
    trueno-ublk create --size 64M --id $id >/tmp/create5.out 2>&1 || rc=$?
    check "refusal: create --id $id fails and says why (exit $rc: $(tail -n 1 /tmp/create5.out))" \
        eval "[ $rc -ne 0 ] && grep -q 'its pages are gone' /tmp/create5.out"
    check "refusal: ... and leaves the device quiesced" dev_state_is $id quiesced
    # With no socket at all (as a stop that hands a device over leaves it), `stat` still
    # names the device and why its I/O waits, and fails when asked for it alone.
    rm -f /run/trueno-ublk/ublkb$id.sock
    rc=0
    trueno-ublk stat --id $id >/tmp/stat5.out 2>&1 || rc=$?
    check "refusal: stat --id $id of the quiesced device without a socket fails and says why (exit $rc: $(cat /tmp/stat5.out))" \
        eval "[ $rc -ne 0 ] && grep -q 'no daemon serves it (the device is quiesced)' /tmp/stat5.out"
    check "refusal: ... and plain stat lists it ($(trueno-ublk stat 2>&1 | tail -n 1))" \
        eval "trueno-ublk stat 2>&1 | grep -q '^ublkb$id: no daemon serves it'"
    # With its node gone (a private /dev, one removed by hand) nothing can tell it is unused.
    local majmin
    majmin=$(cat /sys/block/ublkb$id/dev)
    rm -f $dev
    rc=0
    trueno-ublk delete --id $id >/tmp/delete5.out 2>&1 || rc=$?
    check "refusal: with $dev's node removed, delete is refused: it cannot tell whether the device is used (exit $rc: $(cat /tmp/delete5.out))" \
        eval "[ $rc -ne 0 ] && grep -q 'could not tell' /tmp/delete5.out"
    mknod $dev b "${majmin%:*}" "${majmin#*:}"
    rc=0
    trueno-ublk delete --id $id >/tmp/delete5.out 2>&1 || rc=$?
    check "refusal: delete of a device in use that no daemon serves is refused (exit $rc: $(cat /tmp/delete5.out))" \
        eval "[ $rc -ne 0 ] && grep -q 'no daemon serves it' /tmp/delete5.out"
    rc=0
    timeout 30 trueno-ublk delete --id $id --lose-pages >/tmp/delete5.out 2>&1 || rc=$?
    cat /tmp/delete5.out
    check "refusal: delete --lose-pages deletes it (exit $rc)" [ "$rc" -eq 0 ]
    check "refusal: $dev is gone from list" eval "trueno-ublk list >/tmp/list.out 2>&1 && ! grep -q ublkb$id /tmp/list.out"
    umount /mnt5
    check "refusal: once unmounted the id is free: create --id $id works again" \
        wait_until 10 eval "trueno-ublk create --size 64M --id $id >/dev/null 2>&1"
    check "refusal: and delete --id $id" trueno-ublk delete --id $id
}

# early_death_checks: a serving process killed (-9) before its device went live, held up 5 s
# by strace: in the shmat of its store's new segment (after ADD_DEV, before START_DEV), where
# the supervisor removes the device it had added and the store's shared memory, and `create`
# fails saying so; or in its open of /dev/ublk-control (before ADD_DEV), where there is
# nothing to resume and `create` fails at once (before 2026-12-07 night the supervisor started
# serving processes again while `create` waited). No device, segment or process is left. With
# the id the kernel picks, and with --id.
serving_child() {
    local p
    for p in $(daemon_pids); do
        tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -- '--serve-child' | grep -qv -- '--standby' && echo "$p"
    done
}
early_death_checks() {
    local when args shm_before rc pid st trace held said
    for when in added unadded; do
        if [ "$when" = added ]; then
            trace="--seccomp-bpf -e trace=shmat -e inject=shmat:delay_enter=5s"
            held='ls /dev/ublkc* >/dev/null 2>&1 && pid=$(serving_child) && [ -n "$pid" ]'
            said='before device [0-9]* went live; the device and its memory were removed'
        else
            trace="-P /dev/ublk-control -e trace=openat -e inject=openat:delay_enter=5s"
            held='pid=$(serving_child) && [ -n "$pid" ]'
            said='killed by signal 9 before it added its device'
        fi
        for args in "" "--id 6"; do
            shm_before=$(grep -c . /proc/sysvipc/shm)
            # shellcheck disable=SC2086 # $trace, $args: words
            strace -f -qq -o /dev/null $trace trueno-ublk create --size 64M $args >/tmp/early.out 2>&1 &
            st=$!
            pid=
            if ! wait_until 30 eval "$held"; then
                fail "early death ($when, $args): no serving process held up within 30 s ($(ls /dev/ublk* 2>&1))"
            elif [ "$when" = added ]; then
                check "early death ($when, $args): its store's segment is made when it is killed" \
                    wait_until 10 eval '[ "$(grep -c . /proc/sysvipc/shm)" -gt "$shm_before" ]'
            fi
            [ -z "$pid" ] || kill -9 "$pid"
            rc=0
            if wait_until 30 not alive $st; then
                wait $st || rc=$?
            else
                kill -9 $st
                rc=timeout
            fi
            cat /tmp/early.out
            check "early death ($when, $args): create fails at once (exit $rc), saying why" \
                eval "[ '$rc' != 0 ] && [ '$rc' != timeout ] && grep -q '$said' /tmp/early.out"
            check "early death ($when, $args): no device is left ($(trueno-ublk list 2>&1 | tail -n +2))" \
                wait_until 10 eval '[ -z "$(ls /dev/ublkc* 2>/dev/null)" ]'
            check "early death ($when, $args): no shared memory is left ($shm_before lines of /proc/sysvipc/shm before)" \
                wait_until 10 eval '[ "$(grep -c . /proc/sysvipc/shm)" -eq "$shm_before" ]'
            check "early death ($when, $args): no trueno-ublk process is left" wait_until 10 no_daemon_runs
            [ -z "$(daemon_pids)" ] || kill -9 $(daemon_pids) 2>/dev/null
        done
    done
    check "early death: create --size 64M --id 6 works after it" trueno-ublk create --size 64M --id 6
    check "early death: and delete --id 6" trueno-ublk delete --id 6
}

# parent_of PID: its parent's pid (a serving process's is its supervisor).
parent_of() { awk '{ print $4 }' "/proc/$1/stat"; }
# signal_checks: signals as a terminal or an administrator sends them to every process of a
# daemon: `create --foreground` of device 7 run as a terminal's job (`vmtool job`: a process
# group that job control stops), as in the terminal of `sudo trueno-ublk create --foreground`.
# Job control (Ctrl-Z's SIGTSTP, SIGTTIN, SIGTTOU) stops none of its processes; SIGUSR2 to
# the supervisor is a compaction, SIGUSR1 nothing; SIGQUIT (Ctrl-\) to every process stops
# the daemon as Ctrl-C does: the device and its memory go, nothing is left.
proc_state() { sed 's/^.*) \(.\).*/\1/' "/proc/$1/stat" 2>/dev/null; }
none_stopped() {
    local p
    [ "$#" -gt 0 ] || return 1
    for p in "$@"; do
        [ "$(proc_state "$p")" != T ] || return 1
    done
}
signal_checks() {
    local id=7 dev=/dev/ublkb7 pids serving supervisor shm_before job rc
    shm_before=$(grep -c . /proc/sysvipc/shm)
    $VT job trueno-ublk create --foreground --size 64M --id $id >/tmp/fg7.out 2>&1 &
    job=$!
    if ! wait_until 30 grep -q "^$dev\$" /tmp/fg7.out; then
        fail "signals: create --foreground --size 64M --id $id did not print $dev: $(tail -n 5 /tmp/fg7.out)"
        return
    fi
    check "signals: O_DIRECT write on $dev" pat_write dev7 $dev $MIB 0 $((4 * MIB))
    check "signals: its standby is ready" wait_until 30 grep -q 'supervise: standby ready' /tmp/fg7.out
    serving=$(serving_pid $id)
    supervisor=$(parent_of "$serving")
    pids=$(daemon_pids)
    # shellcheck disable=SC2086 # one pid per word
    kill -TSTP $pids && kill -TTIN $pids && kill -TTOU $pids
    sleep 1
    # shellcheck disable=SC2086
    check "signals: SIGTSTP, SIGTTIN and SIGTTOU to every process ($(echo $pids)) stop none of them" none_stopped $pids
    # shellcheck disable=SC2086
    kill -CONT $pids
    check "signals: ... and $dev reads back" pat_read dev7
    kill -USR2 "$supervisor"
    check "signals: SIGUSR2 to the supervisor ($supervisor) is a compaction" \
        wait_until 10 grep -q 'compaction asked for' /tmp/fg7.out
    kill -USR1 "$supervisor"
    check "signals: SIGUSR1 to the supervisor changes nothing" eval "sleep 1; alive $supervisor && dev_live_with $id $serving"
    # shellcheck disable=SC2086
    kill -QUIT $pids
    check "signals: SIGQUIT to every process (Ctrl-\\) stops the daemon: $dev is gone" wait_until 20 not test -e $dev
    rc=0
    wait_until 10 not alive $job && wait $job || rc=$?
    check "signals: ... create --foreground exits 0 (exit $rc)" [ "$rc" -eq 0 ]
    check "signals: ... every process has exited" wait_until 10 no_daemon_runs
    check "signals: ... and its shared memory is freed" \
        wait_until 10 eval '[ "$(grep -c . /proc/sysvipc/shm)" -eq "$shm_before" ]'
    [ -z "$(daemon_pids)" ] || kill -9 $(daemon_pids) 2>/dev/null
}

# claim_checks: a second `create` of a device whose supervisor is about to resume it (its
# serving process and standby killed, the device quiesced, the supervisor held with SIGSTOP
# before it starts the next process) is refused, saying so, and touches nothing, and so is a
# `delete --lose-pages` of it while it is active swap; let go on, the supervisor resumes the
# device with its data.
claim_checks() {
    local id=8 dev=/dev/ublkb8 serving supervisor p rc
    trueno-ublk create --size 64M --id $id >/tmp/create8.out 2>&1 || {
        fail "claim: create --size 64M --id $id: $(cat /tmp/create8.out)"
        return
    }
    # Past the swap header (the first page), which mkswap writes.
    check "claim: O_DIRECT write on $dev" pat_write dev8 $dev $MIB $((16 * MIB)) $((4 * MIB))
    check "claim: $dev made active swap" eval "$UL/mkswap $dev >/dev/null && $UL/swapon $dev"
    check "claim: its standby is ready" wait_until 30 standby_ready $id
    serving=$(serving_pid $id)
    supervisor=$(parent_of "$serving")
    kill -STOP "$supervisor"
    for p in $(daemon_pids); do
        [ "$p" = "$supervisor" ] || kill -9 "$p"
    done
    check "claim: with its serving process and standby killed, $dev is quiesced" wait_until 10 dev_state_is $id quiesced
    rc=0
    timeout 60 trueno-ublk create --size 64M --id $id >/tmp/create8b.out 2>&1 || rc=$?
    cat /tmp/create8b.out
    check "claim: a second create --id $id is refused while its supervisor ($supervisor) lives (exit $rc)" \
        eval "[ $rc -ne 0 ] && grep -q 'has a daemon already' /tmp/create8b.out"
    check "claim: ... and leaves $dev quiesced" dev_state_is $id quiesced
    rc=0
    timeout 30 trueno-ublk delete --id $id --lose-pages >/tmp/delete8.out 2>&1 || rc=$?
    cat /tmp/delete8.out
    check "claim: delete --id $id --lose-pages of the swap device its supervisor resumes is refused (exit $rc)" \
        eval "[ $rc -ne 0 ] && grep -q 'being resumed' /tmp/delete8.out"
    check "claim: ... and leaves $dev quiesced" dev_state_is $id quiesced
    kill -CONT "$supervisor"
    check "claim: let go on, the supervisor resumes $dev" wait_until 30 eval '[ -n "$(serving_pid $id)" ]'
    check "claim: ... its pages intact" pat_read dev8
    check "claim: swapoff $dev" $UL/swapoff $dev
    check "claim: trueno-ublk delete --id $id" trueno-ublk delete --id $id
    check "claim: ... every process has exited" wait_until 10 no_daemon_runs
}

# stop_at_death_checks: a stop (SIGTERM to the supervisor) that comes as the serving process
# dies (kill -9 of it right before): the standby takes the device over and is stopped in its
# turn, so the unused device is deleted and nothing is left (until 2026-12-05, when both came
# in one round of the supervisor's loop, it dismissed the standby and left the device
# quiesced, its memory locked, and failed).
stop_at_death_checks() {
    local id=9 dev=/dev/ublkb9 serving supervisor shm_before
    shm_before=$(grep -c . /proc/sysvipc/shm)
    trueno-ublk create --size 64M --id $id >/tmp/create9.out 2>&1 || {
        fail "stop at death: create --size 64M --id $id: $(cat /tmp/create9.out)"
        return
    }
    check "stop at death: its standby is ready" wait_until 30 standby_ready $id
    serving=$(serving_pid $id)
    supervisor=$(parent_of "$serving")
    kill -9 "$serving"
    kill -TERM "$supervisor"
    check "stop at death: kill -9 of the serving process and SIGTERM to the supervisor at once: $dev is deleted" \
        wait_until 30 not test -e $dev
    check "stop at death: ... every process has exited" wait_until 10 no_daemon_runs
    check "stop at death: ... and its shared memory is freed" \
        wait_until 10 eval '[ "$(grep -c . /proc/sysvipc/shm)" -eq "$shm_before" ]'
    trueno-ublk list 2>&1 | grep -q "ublkb$id" && trueno-ublk delete --id $id --lose-pages >/dev/null 2>&1
    [ -z "$(daemon_pids)" ] || kill -9 $(daemon_pids) 2>/dev/null
}

# --- dd speed ------------------------------------------------------------------------------
# dd_speed NAME DEV: O_DIRECT bs=1M write then read of 32 MiB of the mixed pattern (3 runs,
# median), then a checksum of what reads back. The pattern lives in RAM only meanwhile.
median3() { printf '%s\n' "$@" | sort -n | sed -n 2p; }
dd_speed() {
    local name=$1 dev=$2 len count seek w r t0 got wm rm_
    $VT gen $((32 * MIB)) 11 >/tmp/mixed || fail "vmtool gen"
    len=$(wc -c </tmp/mixed)
    count=$((len / MIB))
    seek=$((128 * MIB / MIB))
    w=""
    r=""
    for _ in 1 2 3; do
        t0=$(now)
        dd if=/tmp/mixed of="$dev" bs="$MIB" seek=$seek oflag=direct conv=notrunc status=none || fail "$name: dd write"
        w="$w $(since "$t0")"
        t0=$(now)
        dd if="$dev" of=/dev/null bs="$MIB" skip=$seek count=$count iflag=direct status=none || fail "$name: dd read"
        r="$r $(since "$t0")"
    done
    got=$(dd if="$dev" bs="$MIB" skip=$seek count=$count iflag=direct status=none | sha256sum | cut -d' ' -f1)
    check "$name: the $count MiB dd pattern reads back intact" [ "$got" = "$(sha256sum </tmp/mixed | cut -d' ' -f1)" ]
    # shellcheck disable=SC2086
    wm=$(mbps "$len" "$(median3 $w)")
    # shellcheck disable=SC2086
    rm_=$(mbps "$len" "$(median3 $r)")
    rm -f /tmp/mixed
    echo "$name: O_DIRECT bs=1M $count MiB: write s:$w, read s:$r"
    figure "${name}_dd_write_MBps" "$wm"
    figure "${name}_dd_read_MBps" "$rm_"
}

# --- swap run ------------------------------------------------------------------------------
# pressure_run NAME MIB INSPECT_CMD [PASSES]: the pressure program over MIB MiB with swap on;
# checks and figures. INSPECT_CMD runs while the program still holds its memory (data swapped
# out). PASSES 1 or 2: fill and verify that many times; otherwise fill, verify twice, rewrite a
# third of the pages and verify again.
pressure_run() {
    local name=$1 mib=$2 inspect=$3 passes=${4:-} out0 in0 out1 in1 t0 pid tailpid dur rc bad words filled
    out0=$(vmstat_of pswpout)
    in0=$(vmstat_of pswpin)
    t0=$(now)
    rm -f /tmp/hold
    touch /run/pressure-on
    # There for tail before the program's shell opens it (emptied here, not after the program
    # may have written to it).
    : >/tmp/pressure.out
    VMTOOL_PASSES=$passes work timeout "$PRESSURE_TIMEOUT_S" $VT pressure "$mib" "$(date +%s)" /tmp/hold >/tmp/pressure.out 2>&1 &
    pid=$!
    tail -f /tmp/pressure.out &
    tailpid=$!
    wait_until "$PRESSURE_TIMEOUT_S" sh -c "[ -e /tmp/hold ] || ! kill -0 $pid 2>/dev/null"
    dur=$(since "$t0")
    if [ -e /tmp/hold ]; then
        echo "$name: swapped out while the program holds its memory:"
        grep -E '^(SwapTotal|SwapFree|MemFree|MemAvailable)' /proc/meminfo
        $inspect
        rm -f /tmp/hold
    fi
    wait "$pid"
    rc=$?
    rm -f /run/pressure-on
    out1=$(vmstat_of pswpout)
    in1=$(vmstat_of pswpin)
    usleep 200000
    kill "$tailpid"
    wait "$tailpid" 2>/dev/null
    check "$name: the pressure program over $mib MiB (RAM ${RAM_MIB} MiB) exited 0 (rc $rc)" [ "$rc" -eq 0 ]
    bad=$(sed -n 's/^PRESSURE_BAD_WORDS=//p' /tmp/pressure.out)
    words=$(sed -n 's/^PRESSURE_WORDS_CHECKED=//p' /tmp/pressure.out)
    filled=$((mib * MIB / 8))
    check "$name: every word matched (${words:-0} checked, ${bad:-?} mismatched)" [ "${bad:-1}" = 0 ]
    if [ "$passes" != 1 ]; then
        check "$name: every word verified at least twice" [ "${words:-0}" -ge $((2 * filled)) ]
    fi
    check "$name: pswpout grew ($((out1 - out0)) pages)" [ "$out1" -gt "$out0" ]
    check "$name: pswpin grew ($((in1 - in0)) pages)" [ "$in1" -gt "$in0" ]
    figure "${name}_swap_fill_MiB" "$mib"
    figure "${name}_swap_seconds" "$dur"
    figure "${name}_swap_pswpout" "$((out1 - out0))"
    figure "${name}_swap_pswpin" "$((in1 - in0))"
}
# scatter_run NAME MIB PROCS: PROCS processes fill MIB MiB together and verify it twice, a page
# at a time in random order (another program and access pattern than pressure_run's).
scatter_run() {
    local name=$1 mib=$2 procs=$3 out0 in0 t0 rc dur words bad
    out0=$(vmstat_of pswpout)
    in0=$(vmstat_of pswpin)
    t0=$(now)
    touch /run/pressure-on
    work timeout "$PRESSURE_TIMEOUT_S" $VT scatter "$mib" "$procs" "$(date +%s)" >/tmp/scatter.out 2>&1
    rc=$?
    rm -f /run/pressure-on
    dur=$(since "$t0")
    cat /tmp/scatter.out
    check "$name: $procs processes over $mib MiB, random-order verify, exited 0 (rc $rc)" [ "$rc" -eq 0 ]
    words=$(sed -n 's/^SCATTER_WORDS_CHECKED=//p' /tmp/scatter.out)
    bad=$(sed -n 's/^SCATTER_BAD_WORDS=//p' /tmp/scatter.out)
    check "$name: every word matched (${words:-0} checked, ${bad:-?} mismatched)" [ "${bad:-1}" = 0 ]
    check "$name: ... and each verified twice" [ "${words:-0}" -ge $((2 * (mib * 256 / procs) * procs * 512)) ]
    check "$name: pswpout grew" [ "$(vmstat_of pswpout)" -gt "$out0" ]
    check "$name: pswpin grew" [ "$(vmstat_of pswpin)" -gt "$in0" ]
    figure "${name}_scatter_seconds" "$dur"
}

# swap_in_use_kib: what the kernel has allocated on swap.
swap_in_use_kib() { awk '/^SwapTotal:/ { t = $2 } /^SwapFree:/ { f = $2 } END { print t - f }' /proc/meminfo; }
# ublk_slots_freed: swap slots the daemon serving device 0 freed as the kernel freed them
# (the slot-free probe; `stat --json`).
ublk_slots_freed() {
    trueno-ublk stat --json 2>/dev/null | sed -n 's/.*"slots": *\([0-9]*\).*/\1/p' | head -n1
}
# ublk_deferred_writes: writes the daemon serving device 0 set aside while they waited for
# memory, its queue serving other requests meanwhile (`stat --json`, io.deferred).
ublk_deferred_writes() {
    trueno-ublk stat --json 2>/dev/null | sed -n 's/.*"deferred": *\([0-9]*\).*/\1/p' | head -n1
}
# ublk_held_kib: what the daemon serving device 0 holds beyond its idle footprint (its RSS
# less its IDLE-RSS, from `stat --json`).
ublk_held_kib() {
    trueno-ublk stat --json 2>/dev/null | tr ',{}' '\n\n\n' |
        awk -F: '/"rss_bytes"/ { r = $2 } /"idle_rss_bytes"/ { i = $2 }
            END { if (r == "" || i == "") { print "no-figure"; exit 1 } printf "%d", (r - i) / 1024 }'
}
# ublk_data_kib: what the store of device 0 holds (pages stored and pending, 4 KiB each).
ublk_data_kib() {
    trueno-ublk stat --json 2>/dev/null | tr ',{}' '\n\n\n' |
        awk -F: '/"pages_stored"/ { s = $2 } /"pending_pages"/ { p = $2 }
            END { if (s == "" || p == "") { print "no-figure"; exit 1 } printf "%d", (s + p) * 4 }'
}
# ublk_json_count FIELD: a count of `stat --json` of device 0.
ublk_json_count() {
    trueno-ublk stat --json 2>/dev/null | tr ',{}' '\n\n\n' |
        awk -F: -v k="\"$1\"" '$1 ~ k { printf "%d", $2; exit }'
}
# ublk_json_kib FIELD: a byte count of `stat --json` of device 0, in KiB.
ublk_json_kib() {
    trueno-ublk stat --json 2>/dev/null | tr ',{}' '\n\n\n' |
        awk -F: -v k="\"$1\"" '$1 ~ k { printf "%d", $2 / 1024; exit }'
}
# memory_settles NAME: after a program that swapped exits, wait (20 s at most) until the kernel
# has freed its swap and, for ublk, the store holds no more than swap still uses (1 MiB of
# slack): the memory of every freed slot given back (the slot-free probe, and discards); the
# time it took is a figure, and what the daemon still holds beyond its idle RSS 2 s after
# the program exited another, checked to be at most 4 MiB. So the next run starts with the
# memory the last one gave back, as zram gives it back at once.
memory_settles() {
    local name=$1 t0
    t0=$(now)
    wait_until 20 eval '[ $(swap_in_use_kib) -lt 4096 ]'
    if [ "$name" = ublk ]; then
        if wait_until 20 eval '[ $(ublk_data_kib) -le $(($(swap_in_use_kib) + 1024)) ]'; then
            ok "ublk: the store gave back the memory of the slots swap freed"
        else
            fail "ublk: the store still holds $(ublk_data_kib) KiB of pages with $(swap_in_use_kib) KiB of swap in use after 20 s"
            trueno-ublk stat --json
        fi
    fi
    figure "${name}_memory_return_s" "$(since "$t0")"
    if [ "$name" = ublk ]; then
        # What the daemon holds 2 s on (its reserve shrinks once quiet for a second, and the
        # page table's groups no write reached go once none was asked for a second).
        # (The parentheses matter: awk reads `printf ..., r > 0 ...` as output to a file
        # named "0 ...", and usleep was given nothing until 2026-11-28.)
        usleep "$(awk -v s="$(since "$t0")" 'BEGIN { r = 2 - s; printf "%d", (r > 0 ? r * 1e6 : 0) }')"
    fi
    echo "$name: swap in use $(swap_in_use_kib) KiB$([ "$name" = ublk ] && echo ", the store holds $(ublk_data_kib) KiB of pages, the daemon $(ublk_held_kib) KiB beyond its idle RSS 2 s after the program exited")"
    if [ "$name" = ublk ]; then
        echo "ublk: held now (KiB): store memory $(ublk_json_kib mem_used), page table $(ublk_json_kib table_bytes), reserve $(ublk_json_kib reserve_bytes), batch buffers $(ublk_json_kib batch_buffer_bytes)"
        check "ublk: the daemon holds at most 4 MiB beyond its idle RSS ($(ublk_held_kib) KiB)" \
            [ "$(ublk_held_kib)" -le 4096 ]
        figure ublk_memory_held_kib "$(ublk_held_kib)"
        figure ublk_slots_freed "$(ublk_slots_freed)"
        figure ublk_deferred_writes "$(ublk_deferred_writes)"
        check "ublk: the slot-free probe freed the slots the kernel freed ($(ublk_slots_freed) slots)" \
            [ "$(ublk_slots_freed)" -gt 0 ]
    fi
}

# swap_run NAME DEV INSPECT_CMD [PASSES]: mkswap, swapon -d, pressure_run, scatter_run (three
# processes over the same amount) once the memory of the first settled, for ublk a
# `trueno-ublk compact`, swapoff.
swap_run() {
    local name=$1 dev=$2 t0
    check "$name: mkswap $dev" eval "$UL/mkswap $dev >/dev/null"
    check "$name: swapon -d $dev" $UL/swapon -d "$dev"
    check "$name: /proc/swaps lists $dev" in_swaps "$dev"
    pressure_run "$name" "$FILL_MIB" "$3" "${4:-}"
    memory_settles "$name"
    scatter_run "$name" "$FILL_MIB" 3
    if [ "$name" = ublk ]; then
        # How often a write reached a page table group with no memory: a spare slot taken at
        # once, or a wait for the refill thread (see src/store/table_memory.rs).
        figure ublk_table_spares_taken "$(ublk_json_count table_spares_taken)"
        figure ublk_table_group_waits "$(ublk_json_count table_group_waits)"
        # How often the pending batches grew to every slot (a burst filled quiet ones) and
        # gave those slots back again (quiet for a second; see src/store/pending.rs).
        figure ublk_batch_span_grows "$(ublk_json_count batch_span_grows)"
        figure ublk_batch_span_shrinks "$(ublk_json_count batch_span_shrinks)"
        # The detached daemon's log (tmpfs: RAM) is kept under 1 MiB: filled past that from
        # outside, the next line the daemon logs (the compaction's) empties it first.
        local log=/run/trueno-ublk/ublkb0.log
        dd if=/dev/zero bs=1024 count=1100 2>/dev/null | tr '\0' x >>"$log"
        # A compaction asked for, after the discards of two runs left chunks half empty.
        trueno-ublk compact --id 0 >/tmp/compact.out 2>&1
        check "$name: trueno-ublk compact --id 0 ($(cat /tmp/compact.out))" \
            grep -q '^/dev/ublkb0: compacted: ' /tmp/compact.out
        check "$name: the daemon's log, filled past 1 MiB, was emptied and says so ($(wc -c <"$log") bytes)" \
            wait_until 10 eval "[ \$(wc -c <$log) -lt 1048576 ] && head -n1 $log | grep -q '^(this log was emptied' && grep -q 'compaction done' $log"
        # The checksum the store took where it was made, and the layout version that says
        # which (src/store/layout.rs): 5 with XXH64, 6 with CRC32C, 7 with XXH3.
        local kind
        kind="$(ublk_json_count layout_version):$(trueno-ublk stat --json 2>/dev/null |
            sed -n 's/.*"checksum": *"\([a-z0-9]*\)".*/\1/p' | head -n1)"
        check "$name: stat --json names the store's layout version and checksum ($kind)" \
            eval '[ "$kind" = 5:xxh64 ] || [ "$kind" = 6:crc32c ] || [ "$kind" = 7:xxh3 ]'
    fi
    t0=$(now)
    check "$name: swapoff $dev" $UL/swapoff "$dev"
    echo "$name: swapoff took $(since "$t0") s"
    check "$name: /proc/swaps no longer lists $dev" not in_swaps "$dev"
}

# --- 1. the kernel -------------------------------------------------------------------------
section "kernel $(uname -r), $(grep MemTotal /proc/meminfo | tr -s ' '), $(nproc) CPUs, mode $MODE"
echo 60 >/proc/sys/kernel/hung_task_timeout_secs
[ -z "${PAGE_CLUSTER:-}" ] || echo "$PAGE_CLUSTER" >/proc/sys/vm/page-cluster ||
    abort "vm.page-cluster $PAGE_CLUSTER"
echo "vm.page-cluster $(cat /proc/sys/vm/page-cluster)"
insmod /lib/modules/ublk_drv.ko || abort "insmod ublk_drv.ko"
# ublk_ramdisk keeps its data in /dev/shm, as on a distribution.
mkdir -p /dev/shm
grep -q ' /dev/shm ' /proc/mounts || mount -t tmpfs tmpfs /dev/shm
check "/dev/ublk-control appears" wait_until 5 test -c /dev/ublk-control
for m in lz4_compress lz4hc_compress zsmalloc zram; do
    # Not there: built into this kernel (scripts/vm-test.sh copies what the package has).
    [ ! -e /lib/modules/$m.ko ] || insmod /lib/modules/$m.ko || fail "insmod $m.ko"
done
check "/dev/zram0 appears" wait_until 5 test -b /dev/zram0
# VM_TEST_SKIP (debugging only): a skipped step counts as a failure.
skipped() {
    case " $SKIP " in
    *" $1 "*)
        fail "step '$1' skipped (VM_TEST_SKIP)"
        return 0
        ;;
    esac
    return 1
}

# --- 1b. the ublk layer alone, before the daemon: examples/ublk_ramdisk --------------------
if [ "$MODE" = full ] && ! skipped ramdisk; then
    section "the ublk layer alone: ublk_ramdisk --size 64M (plain memory, no store)"
    ramdisk_checks
    section "the ublk layer alone, user copy: ublk_ramdisk --size 64M --user-copy"
    ramdisk_checks --user-copy
fi
if { [ "$MODE" = full ] || [ "$MODE" = recovery ]; } && ! skipped ramdisk-recovery; then
    section "the ublk layer's recovery alone: ublk_ramdisk killed, handed over and resumed"
    ramdisk_recovery_checks
fi

zram_up() {
    echo 1 >/sys/block/zram0/reset
    echo lz4 >/sys/block/zram0/comp_algorithm
    echo 1G >/sys/block/zram0/disksize
}
zram_inspect() { echo "zram mm_stat: $(cat /sys/block/zram0/mm_stat)"; }
ublk_inspect() {
    trueno-ublk stat
    trueno-ublk stat --raw >/tmp/stat.raw 2>&1
}

# --- 2. kernel zram in the same VM (first: its figures do not depend on the daemon) ------
if [ "$MODE" != recovery ] && [ "$MODE" != stress ] && ! skipped zram; then
    section "kernel zram (lz4) in the same VM"
    zram_up
    dd_speed zram /dev/zram0
    zram_inspect
    zram_up
    swap_run zram /dev/zram0 zram_inspect
    echo 1 >/sys/block/zram0/reset
fi

if [ "$MODE" = full ]; then
    # --- 3. create ---------------------------------------------------------------------------
    section "create a 1 GiB device: trueno-ublk create --size 1G $CREATE_ARGS"
    rm -f /tmp/create.rc
    t0=$(now)
    # Through a pipe, as `DEV=$(trueno-ublk create ...)` would read it: the command is done
    # when the daemon left in the background no longer holds the pipe.
    (
        # shellcheck disable=SC2086
        trueno-ublk create --size 1G $CREATE_ARGS 2>/tmp/create.err
        # Whole when it appears (the wait below looks for the file, then reads it).
        echo $? >/tmp/create.rc.part && mv /tmp/create.rc.part /tmp/create.rc
    ) | cat >/tmp/create.out &
    pipe=$!
    wait_until 60 test -e /tmp/create.rc || abort "trueno-ublk create --size 1G did not return within 60 s"
    ready=$(since "$t0")
    rc=$(cat /tmp/create.rc)
    echo "create printed: $(cat /tmp/create.out)"
    [ -s /tmp/create.err ] && echo "create stderr: $(cat /tmp/create.err)"
    [ "$rc" -eq 0 ] || abort "trueno-ublk create --size 1G exited $rc"
    ok "trueno-ublk create --size 1G returned 0 after $ready s"
    if wait_until 5 not alive "$pipe"; then
        ok "create's output closed once it returned (\$(trueno-ublk create ...) does not hang)"
    else
        fail "the background daemon holds create's stdout: \$(trueno-ublk create ...) would hang"
    fi
    DEV=$(grep -o '/dev/ublkb[0-9]*' /tmp/create.out | head -n1)
    check "create printed the device path ($DEV)" [ "$DEV" = /dev/ublkb0 ]
    DEV=/dev/ublkb0
    check "$DEV is a block device" test -b $DEV
    dd if=$DEV of=/dev/null bs=4096 count=1 iflag=direct status=none || abort "first O_DIRECT read of $DEV"
    figure device_ready_s "$ready"
    figure device_usable_s "$(since "$t0")"
    size=$($UL/blockdev --getsize64 $DEV)
    check "$DEV is 1 GiB ($size bytes)" [ "$size" -eq $((1024 * MIB)) ]
    check "logical block size 4096" [ "$($UL/blockdev --getss $DEV)" -eq 4096 ]
    DAEMON=$(serving_pid 0)
    SUPERVISOR=$(awk '/^PPid:/ { print $2 }' "/proc/$DAEMON/status")
    check "the daemon runs in the background: a supervisor ($SUPERVISOR), the serving process ($DAEMON) and a standby" \
        wait_until 20 eval "[ \$(daemon_pids | wc -w) -eq 3 ] && grep -q 'standby ready' /run/trueno-ublk/ublkb0.log"
    STANDBY=$(for p in $(daemon_pids); do [ "$p" != "$DAEMON" ] && [ "$p" != "$SUPERVISOR" ] && echo "$p"; done)
    grep -E '^(VmRSS|VmLck)' "/proc/$DAEMON/status" "/proc/$SUPERVISOR/status" "/proc/$STANDBY/status"
    check "the serving process's memory is locked (mlockall)" [ "$(awk '/^VmLck/ { print $2 }' "/proc/$DAEMON/status")" -gt 0 ]
    check "the supervisor's memory is locked (mlockall)" [ "$(awk '/^VmLck/ { print $2 }' "/proc/$SUPERVISOR/status")" -gt 0 ]
    check "the standby's memory is locked (mlockall)" [ "$(awk '/^VmLck/ { print $2 }' "/proc/$STANDBY/status")" -gt 0 ]
    # (THP is off in a VM below 512 MiB whatever the setting; the flag is what keeps it off elsewhere.)
    for p in "$DAEMON" "$SUPERVISOR" "$STANDBY"; do
        check "process $p takes no transparent huge pages (PR_SET_THP_DISABLE)" grep -q '^THP_enabled:[[:space:]]*0' "/proc/$p/status"
    done
    # Every library it maps is locked with it; libm's start-up alone (its IFUNC resolvers)
    # maps about 330 KiB of its code, for no function the daemon calls (issue 16).
    check "the serving process does not map libm" eval "! grep -q 'libm\.so' /proc/$DAEMON/maps"
    figure supervisor_rss_kib "$(awk '/^VmRSS/ { print $2 }' "/proc/$SUPERVISOR/status")"
    figure standby_rss_kib "$(awk '/^VmRSS/ { print $2 }' "/proc/$STANDBY/status")"
    figure serving_rss_kib "$(awk '/^VmRSS/ { print $2 }' "/proc/$DAEMON/status")"
    # How often the idle daemon wakes: each thread's context switches over 10 s with no I/O,
    # from 3 s after the standby is ready (a laptop's powertop counts these; kernel zram makes
    # none). 69 a second before 2026-12-07, when every thread but the queue's polled.
    idle_wakeups() {
        for p in "$SUPERVISOR" "$DAEMON" "$STANDBY"; do
            for t in /proc/"$p"/task/*; do
                awk -v who="$p/$(cat "$t/comm" 2>/dev/null)" '/^(non)?voluntary_ctxt_switches/ { n += $2 }
                    END { print who, n }' "$t/status" 2>/dev/null
            done
        done
    }
    sleep 3
    idle_wakeups >/tmp/wakeups.before
    sleep 10
    idle_wakeups >/tmp/wakeups.after
    awk 'NR == FNR { b[$1] += $2; next } { a[$1] += $2 } END { for (k in a) { d = a[k] - b[k]; t += d; if (d > 0) printf "  %s %.1f/s\n", k, d / 10 } printf "TOTAL %.1f\n", t / 10 }' \
        /tmp/wakeups.before /tmp/wakeups.after | sort >/tmp/wakeups.rate
    echo "idle wake-ups per second, by process/thread (supervisor $SUPERVISOR, serving $DAEMON, standby $STANDBY):"
    grep -v TOTAL /tmp/wakeups.rate
    wakeups=$(awk '/^TOTAL/ { print $2 }' /tmp/wakeups.rate)
    figure idle_wakeups_per_s "$wakeups"
    check "the idle daemon's three processes wake at most 10 times a second ($wakeups)" \
        awk -v w="$wakeups" 'BEGIN { exit !(w <= 10) }'
    trueno-ublk list | tee /tmp/list.out
    check "trueno-ublk list shows $DEV" grep -q ublkb0 /tmp/list.out

    # --- 4-6. data -------------------------------------------------------------------------
    section "O_DIRECT patterns on $DEV"
    pattern_checks $DEV $((1024 * MIB))
    section "O_DIRECT speed of $DEV"
    dd_speed ublk $DEV
    section "discard and write-zeroes on $DEV"
    discard_checks $DEV $((300 * MIB))

    # --- 7. a second device while the first is busy ----------------------------------------
    section "a second device while $DEV is in use"
    rm -f /tmp/bg.stop /tmp/bg.result
    (
        n=0 bad=0
        while [ ! -e /tmp/bg.stop ]; do
            pat_write "bg" $DEV 65536 $((900 * MIB + (n % 16) * MIB)) $MIB && pat_read bg || bad=$((bad + 1))
            n=$((n + 1))
        done
        echo "$n $bad" >/tmp/bg.result
    ) &
    bg=$!
    shm_before=$(grep -c . /proc/sysvipc/shm)
    trueno-ublk create --size 256M --no-oom-kill >/tmp/create2.out 2>&1
    rc=$?
    cat /tmp/create2.out
    DEV2=$(grep -o '/dev/ublkb[0-9]*' /tmp/create2.out | head -n1)
    if [ "$rc" -eq 0 ] && [ -n "$DEV2" ] && [ "$DEV2" != $DEV ] && [ -b "$DEV2" ]; then
        ok "a second device $DEV2 came up while $DEV is in use"
        ID2=${DEV2#/dev/ublkb}
        check "$DEV2 (--no-oom-kill): its daemon says it never asks for an OOM kill" \
            grep -q "oom-kill = no" "/run/trueno-ublk/ublkb$ID2.log"
        check "... where the first device's can ask" \
            not grep -q "oom-kill = no\|cannot open /proc/sysrq-trigger" /run/trueno-ublk/ublkb0.log
        # The thread that releases the OOM killer's victims' memory is woken by a BPF program
        # at the kernel's oom:mark_victim tracepoint, not by reading /proc/vmstat.
        check "$DEV2: its daemon wakes at OOM kills through the probe at oom:mark_victim" \
            wait_until 5 grep -q "OOM kills are probed at the tracepoint" "/run/trueno-ublk/ublkb$ID2.log"
        check "$DEV2: O_DIRECT write" pat_write dev2 "$DEV2" $MIB $((100 * MIB)) $((4 * MIB))
        check "$DEV2: read back matches" pat_read dev2
        trueno-ublk list | tee /tmp/list.out
        check "list shows both devices" grep -q "ublkb$ID2" /tmp/list.out
        # A process holding the disk open without a claim keeps a deleted disk, and with
        # it DEL_DEV waiting: neither the daemon nor its store's locked memory may wait too.
        shm_live=$(grep -c . /proc/sysvipc/shm)
        check "$DEV2's store is a shared segment ($shm_before lines of /proc/sysvipc/shm before, $shm_live with it)" \
            [ "$shm_live" -gt "$shm_before" ]
        sleep 300 <"$DEV2" &
        holder=$!
        check "a process holds $DEV2 open" \
            wait_until 5 eval '[ "$(readlink /proc/$holder/fd/0)" = "$DEV2" ]'
        check "trueno-ublk delete --id $ID2 while it does" \
            eval "timeout 60 trueno-ublk delete --id $ID2 >/tmp/del2.out 2>&1"
        cat /tmp/del2.out
        check "... its daemon exited (not told it has not)" not grep -q "has not exited" /tmp/del2.out
        check "... its id is held by the open disk, and said so" grep -q "kernel keeps id $ID2" /tmp/del2.out
        # The standby attached the segment too: it goes once the supervisor has reaped both.
        check "... and its shared memory is gone" \
            wait_until 5 eval '[ "$(grep -c . /proc/sysvipc/shm)" -eq "$shm_before" ]'
        kill "$holder"
        wait "$holder" 2>/dev/null
        check "$DEV2 is gone" wait_until 5 not test -e "$DEV2"
        trueno-ublk list | tee /tmp/list.out
        check "list no longer shows $DEV2" not grep -q "ublkb$ID2" /tmp/list.out
        check "list still shows $DEV" grep -q ublkb0 /tmp/list.out
    else
        fail "trueno-ublk create --size 256M (second device) exited $rc, printed '$DEV2'"
    fi
    touch /tmp/bg.stop
    wait "$bg"
    read -r n bad </tmp/bg.result
    check "I/O on $DEV during that: $n rounds of 1 MiB write+read, $bad bad" [ "$n" -gt 0 -a "$bad" -eq 0 ]
    recheck_patterns "after the second device came and went"

    # Strict overcommit charges a SysV segment's whole size to the commit limit when it is
    # made (SHM_NORESERVE is ignored), and the store reserves far more address space than it
    # ever fills: `create` must refuse with the setting to change, and leave nothing behind.
    section "create under strict overcommit (vm.overcommit_memory = 2)"
    echo 2 >/proc/sys/vm/overcommit_memory
    trueno-ublk create --size 64M >/tmp/create3.out 2>&1
    rc=$?
    echo 0 >/proc/sys/vm/overcommit_memory
    cat /tmp/create3.out
    check "create refused (exit $rc)" [ "$rc" -ne 0 ]
    check "... saying which setting to change" grep -q "vm.overcommit_memory" /tmp/create3.out
    # Refused before any process of it started: on Linux 7.3 a serving process that got this
    # far died of an allocation the commit limit refused (SIGABRT) before its device was live.
    check "... before the daemon started serving" eval "! grep -q 'killed by signal' /tmp/create3.out"
    check "... leaving no device behind" eval "trueno-ublk list >/tmp/list.out 2>&1 && ! grep -q 'ublkb[1-9]' /tmp/list.out"
    recheck_patterns "after the refused create"

    # Without user copy every tag has a buffer, locked for the device's life: a depth that
    # would lock more than a sixteenth of RAM (here 256 MiB, where a sixteenth of the VM's RAM
    # is 13) is refused once the driver has said how many queues it gives, and the device it
    # added for that is removed; before, this VM refused it for want of memory to lock.
    section "create with buffers per tag that would lock too much (--no-user-copy --depth 4096)"
    procs=$(daemon_pids | wc -w)
    trueno-ublk create --size 64M --no-user-copy --depth 4096 >/tmp/create4.out 2>&1
    rc=$?
    cat /tmp/create4.out
    check "create refused (exit $rc)" [ "$rc" -ne 0 ]
    check "... saying what to lower" grep -q "lower the depth or the queues" /tmp/create4.out
    check "... leaving no device behind" eval "trueno-ublk list >/tmp/list.out 2>&1 && ! grep -q 'ublkb[1-9]' /tmp/list.out"
    check "... and no process of it" wait_until 10 eval '[ "$(daemon_pids | wc -w)" -eq "$procs" ]'
    recheck_patterns "after the refused create"

    # --- 8. swap ---------------------------------------------------------------------------
    section "swap on $DEV"
    check "mkswap $DEV, swapon -d $DEV" eval "$UL/mkswap $DEV >/dev/null && $UL/swapon -d $DEV"
    if in_swaps $DEV; then
        trueno-ublk delete --id 0 >/tmp/del.out 2>&1
        rc=$?
        cat /tmp/del.out
        check "delete --id 0 of an active swap device is refused (exit $rc)" [ "$rc" -ne 0 ]
        check "... and the device stays" in_swaps $DEV
        $UL/swapoff $DEV
    fi
    if ! skipped ublk-swap; then
        # The same run as zram's, its rewrite pass included: the old copies of rewritten
        # pages are freed as the kernel frees their slots (the slot-free probe), as zram frees
        # them (swap_slot_free_notify); with discards alone they stayed in the store.
        swap_run ublk $DEV ublk_inspect
        trueno-ublk stat
    fi
    # A detached daemon whose supervisor dies: nothing would start another, so the serving
    # process serves on (under a service manager it hands the device over for the restart);
    # its standby ends. `delete` then stops it as any other.
    kill -9 "$SUPERVISOR"
    check "kill -9 of the detached supervisor ($SUPERVISOR): its standby ($STANDBY) ends" wait_until 10 eval "! alive $STANDBY"
    check "... and the serving process ($DAEMON) serves on" eval "sleep 1; dev_live_with 0 $DAEMON"
    check "... saying so" grep -q 'the supervisor is gone and nothing will start another' /run/trueno-ublk/ublkb0.log
    check "... and $DEV still reads" dd if=$DEV of=/dev/null bs=4096 count=1 iflag=direct status=none
    check "trueno-ublk delete --id 0" trueno-ublk delete --id 0
    check "$DEV is gone" wait_until 10 not test -e $DEV
    check "the daemon exited (supervisor, serving process and standby)" wait_until 10 eval "! alive $DAEMON && ! alive $SUPERVISOR && ! alive $STANDBY"
    check "list shows no device" eval "trueno-ublk list >/tmp/list.out 2>&1 && ! grep -q ublkb /tmp/list.out"
    cat /tmp/list.out
    check "trueno-ublk stat with no device exits 0" trueno-ublk stat
    # The recovery stage makes /dev/ublkb0 again and the supervisor rotates its log twice;
    # keep this stage's log under its own name for daemon_logs.
    mv /run/trueno-ublk/ublkb0.log /run/trueno-ublk/swap-stage-ublkb0.log 2>/dev/null || true
fi
if { [ "$MODE" = full ] || [ "$MODE" = recovery ]; } && ! skipped daemon-recovery; then
    section "the daemon's recovery: kill -9 under swap pressure, an upgrade, and create again"
    if [ -n "$PREVIOUS_BIN" ]; then
        check "the previous build unpacks" unxz "$PREVIOUS_BIN.xz"
        chmod +x "$PREVIOUS_BIN"
    fi
    daemon_recovery_checks
    [ -n "$PREVIOUS_BIN" ] && rm -f "$PREVIOUS_BIN"
    section "the daemon refuses to resume a device whose pages are gone"
    daemon_refusal_checks
fi
if { [ "$MODE" = full ] || [ "$MODE" = recovery ]; } && ! skipped early-death; then
    section "a serving process killed before its device went live"
    early_death_checks
fi
if { [ "$MODE" = full ] || [ "$MODE" = recovery ]; } && ! skipped signals; then
    section "signals from a terminal or an administrator to every process of a daemon"
    signal_checks
fi
if { [ "$MODE" = full ] || [ "$MODE" = recovery ]; } && ! skipped claim; then
    section "a second create of a device whose supervisor is resuming it"
    claim_checks
    section "a stop that comes as the serving process dies"
    stop_at_death_checks
fi
if [ "$MODE" = kernel-only ]; then
    section "pattern checks on /dev/zram0 (kernel-only dry run)"
    zram_up
    pattern_checks /dev/zram0 $((1024 * MIB))
    discard_checks /dev/zram0 $((300 * MIB))
fi

# --- 10. kernel log ------------------------------------------------------------------------
section "kernel log"
dmesg >/tmp/dmesg
grep -iE 'ublk' /tmp/dmesg | tail -n 20
if kernel_log_errors /tmp/dmesg >/tmp/dmesg-bad; then
    fail "dmesg has errors:"
    cat /tmp/dmesg-bad
else
    ok "dmesg: no ublk or swap I/O errors, hung tasks, BUG, Oops, warnings or OOM kills"
fi
kernel_swap_table_reports /tmp/dmesg

# --- 10b. an OOM kill in a memory cgroup (after the kernel-log check: it logs the kill) ------
# The daemon's thread that releases the OOM killer's victims' memory is woken by its probe at
# oom:mark_victim, which fires for a memory cgroup's OOM kill as for the whole system's: a
# program of 64 MiB in a cgroup of 16 MiB without swap is killed, and the daemon says it
# looked for the process being killed.
# small_device NAME: create a 64 MiB device with the next free id and set SMALL_DEV to its
# path; or fail a check of NAME's with what create said and return 1.
small_device() {
    trueno-ublk create --size 64M >/tmp/create-small.out 2>&1
    SMALL_DEV=$(grep -o '/dev/ublkb[0-9]*' /tmp/create-small.out | head -n1)
    if [ -z "$SMALL_DEV" ]; then
        fail "$1: create --size 64M ($(cat /tmp/create-small.out))"
        return 1
    fi
}
oom_probe_checks() {
    local dev id log n0 pid rc
    small_device "OOM probe" || return
    dev=$SMALL_DEV
    id=${dev#/dev/ublkb}
    log=/run/trueno-ublk/ublkb$id.log
    wait_until 5 grep -q "OOM kills are probed at the tracepoint" "$log"
    n0=$(wc -l <"$log")
    mkdir -p $CG/oom-probe && echo 16M >$CG/oom-probe/memory.max && echo 0 >$CG/oom-probe/memory.swap.max
    sh -c 'echo $$ >/sys/fs/cgroup/oom-probe/cgroup.procs && exec "$@"' oom $VT pressure 64 1 >/tmp/oom-probe.out 2>&1 &
    pid=$!
    wait "$pid"
    rc=$?
    check "OOM probe: the program of 64 MiB in a cgroup of 16 MiB was OOM-killed (exit $rc)" \
        eval "[ $rc -eq 137 ] && dmesg | grep -q 'Memory cgroup out of memory'"
    check "OOM probe: the daemon woke at the kill and looked for the process being killed ($(tail -n +$((n0 + 1)) "$log" | grep -E 'looked for processes|process being killed' | tail -n 2 | tr '\n' ' '))" \
        wait_until 5 eval "tail -n +$((n0 + 1)) $log | grep -q 'looked for processes being killed after an OOM kill'"
    rmdir $CG/oom-probe 2>/dev/null
    check "OOM probe: delete $dev" trueno-ublk delete --id "$id"
}
if [ "$MODE" = full ] && [ -n "${TEST_IN_CGROUP:-}" ] && ! skipped oom-probe; then
    section "an OOM kill in a memory cgroup, seen by the daemon's probe"
    oom_probe_checks
fi

# --- 10c. a bit flipped under a stored page (after the kernel-log check: its read fails) --------
# The store keeps a checksum of every page: a bit flipped in its memory is an EIO for that
# page, and for nothing else, also where the block layer merged its read with its neighbours'
# (swap's readahead does): the pages before it are read (the daemon commits them as a partial
# result and the driver sends the rest again), and a page after it read alone is right.
bitflip_checks() {
    local dev id out rc=0
    small_device "bit flip" || return
    dev=$SMALL_DEV
    id=${dev#/dev/ublkb}
    # The store's SysV key: 0x74000000 plus the device id (src/store/layout.rs).
    out=$($VT bitflip "$dev" $((0x74000000 | id)) 2>&1) || rc=$?
    check "bit flip: of 8 one-page reads submitted at once, those before the flipped page read back right and it fails with EIO; the next page read alone is right ($(echo "$out" | tr '\n' ' '), exit $rc)" \
        [ "$rc" -eq 0 ]
    check "bit flip: stat counts the page's checksum failure" \
        eval "trueno-ublk stat --json --id $id | tr ',{}' '\n\n\n' | grep -Eq '\"checksum_failures\": *[1-9]'"
    check "bit flip: delete $dev" trueno-ublk delete --id "$id"
}
if [ "$MODE" = full ] && ! skipped bitflip; then
    section "a bit flipped under a stored page"
    bitflip_checks
fi

# --- 11. near OOM (after the kernel-log check: OOM kills are expected there) ---------------
if [ "$MODE" = stress ]; then
    stress_phase
fi
finish
