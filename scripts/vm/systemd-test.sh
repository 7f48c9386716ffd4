#!/bin/bash
# The test of the real-systemd stage (scripts/vm/systemd-stage.sh), run inside the VM by
# trueno-test.service once multi-user.target is reached. trueno-ublk was installed by
# scripts/install.sh and swap enabled as README.md says (`swap = yes` for [ublkb0]); systemd
# started everything at boot. Output goes to the host through ttyS1: "ok:"/"FAIL:" lines,
# "FIGURE name=value", and last "VMTEST RESULT: PASS|FAIL". Then it powers the VM off with
# pages still swapped out, and the host reads the shutdown from the console log.
#
#   1. At boot: the generator wrote dev-ublkb0.swap; it, trueno-ublk-mkswap@0 and
#      trueno-ublk@0 are active; /proc/swaps and `swapon --show` name /dev/ublkb0 with the
#      configured priority; no other swap unit acts on its own for it; writeback throttling
#      is off; `list` and `stat` work; the units' boot journal has no warning or error.
#   2. The config file's size edited (the device keeps its own through everything below).
#      Under pressure (a program holds more than the available memory, with every word
#      verified): `delete --id 0` is refused at once; kill -9 of the serving process (the
#      supervisor's standby takes the device over; the unit's main process stays); SIGTERM
#      to the serving process alone (it hands the device over; the standby takes it over);
#      `systemctl reload trueno-ublk@0` with the config file broken (fails, saying why; the
#      serving process serves on); `systemctl reload trueno-ublk@0` (a standby of the binary on disk takes the device
#      over from the serving process; the main process stays); `systemctl restart
#      trueno-ublk@0` (ExecStop reads PID 1's swapped-out pages back, the daemon hands the
#      device over, the new one resumes it: swap stays on, no new mkswap); kill -9 of every
#      process of the unit
#      (systemd restarts it, and the start resumes the device); kill -9 of the supervisor
#      alone (the serving process hands the device over, ExecStop reads nothing, systemd
#      restarts the unit); the program then verifies every word once more. The pause of each
#      is a figure.
#   3. The stop the README gives (swap unit, then the daemon: the device is deleted), a fresh
#      start of the swap unit (a new device, of the edited size, gets a new signature), a
#      second pressure run. Then `create --foreground` on a pseudo-terminal that hangs up:
#      the daemon serves on, the same processes (the kernel's SIGHUP is no reload).
# The test runs with MemorySwapMax=0 (its unit), so that its own pages never wait for a
# device that waits for its daemon; the pressure programs run in a scope of their own.
#   4. Poweroff while pages (PID 1's and journald's among them) are still swapped out.
# On the stage's second boot (ublk_drv kept out) only section 0 runs: the daemon fails for
# good and the swap unit fails at once, without holding the boot. On its third only section
# 0b: a tmpfs's pages are pushed out to the device and the VM is powered off with --force.
# shellcheck disable=SC2317,SC2119,SC2120 # functions run through check; journal_units takes optional options
set -u
exec >/dev/ttyS1 2>&1
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
VT=/test/vmtool
# The watchdog of the busybox stage (see vmtool.c): when swap stops moving for 90 s during a
# pressure run (/run/pressure-on), or the test runs past 780 s, it dumps the blocked tasks
# and memory to the console and powers off with a FAIL verdict.
echo 1 >/proc/sys/kernel/sysrq
$VT monitor 20 780 90 /run/pressure-on &
DEV=/dev/ublkb0
ID=0
PRIO=100
# shellcheck source=checks.sh # copied to /test beside this script
. /test/checks.sh
swap_prio() { awk -v d="$DEV" '$1 == d { print $5 }' /proc/swaps; }
swap_used_kib() { awk -v d="$DEV" '$1 == d { print $4 }' /proc/swaps; }
avail_mib() { awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo; }
device_bytes() { echo $(($(cat /sys/block/ublkb$ID/size 2>/dev/null || echo 0) * 512)); }
vmswap_kib() { awk '/^VmSwap:/ { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }
main_pid() { systemctl show -p MainPID --value trueno-ublk@$ID.service; }
# serving_pid: the live process serving the device (`list`), empty if none.
serving_pid() { trueno-ublk list 2>/dev/null | awk -v id=$ID '$1 == id && $6 == "live" && NF == 7 { print $7 }'; }
# live_other_than PID: the device is live, served by a process other than PID, in one look at
# `list` (two looks could see it live, then no serving process for a moment, and pass).
live_other_than() {
    local pid
    pid=$(serving_pid)
    [ -n "$pid" ] && [ "$pid" != "$1" ]
}
# settle_serving: serving0 becomes the serving process, waiting up to 10 s for `list` to show
# one (right after a takeover it showed none for a moment: CI, 2026-11-27); a FAIL where none
# shows, since the kills and comparisons after it would then act on no process and could pass
# (`resumed_after` fails for an empty pid).
settle_serving() {
    serving0=
    if wait_for 10 eval '[ -n "$(serving_pid)" ]'; then serving0=$(serving_pid); fi
    [ -n "$serving0" ] || fail "a process serves $DEV within 10 s ($(trueno-ublk list 2>&1 | tail -n +2))"
}
# resumed_after PID T0 WAIT_S WHAT FIGURE: within WAIT_S, a process other than PID serves the
# device; "ok: WHAT: pid P resumed ... N s later" (N since T0, also as FIGURE), else FAIL.
resumed_after() {
    local took
    if [ -z "$1" ]; then
        fail "$4: no serving process was found to stop"
        return
    fi
    if wait_for "$3" live_other_than "$1"; then
        took=$(since "$2")
        ok "$4: pid $(serving_pid) resumed $DEV $took s later"
        figure "$5" "$took"
    else
        fail "$4: nobody resumed $DEV ($(trueno-ublk list | tail -n +2))"
    fi
}
# supervisor_stayed MAINPID: the unit's main process is still MAINPID, and the unit active.
supervisor_stayed() {
    check "... the unit's main process (the supervisor, $1) stayed" [ "$(main_pid)" = "$1" ]
    check "... and the unit stayed active" systemctl -q is-active trueno-ublk@$ID.service
}
now() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$(now)" -v b="$1" 'BEGIN { printf "%.2f", a - b }'; }
journal_units() { journalctl -b --no-pager -o short-monotonic -u 'trueno-ublk*' -u "dev-ublkb$ID.swap" "$@"; }
wait_for() { # SECONDS command...: polls every 0.2 s
    local n=$(($1 * 5))
    shift
    while ! "$@"; do
        n=$((n - 1))
        [ "$n" -gt 0 ] || return 1
        sleep 0.2
    done
}
finish() {
    section "verdict"
    echo "$CHECKS checks, $FAILS failed"
    if [ "$FAILS" -eq 0 ] && [ "$CHECKS" -gt 0 ]; then
        echo "VMTEST RESULT: PASS"
    else
        echo "VMTEST RESULT: FAIL"
    fi
    sync
    systemctl poweroff --no-block ${POWEROFF_FORCE:+--force}
    exit 0
}

# pressure_start MIB PASSES: the pressure program in the background, holding its memory
# (/tmp/hold) once filled and verified PASSES times (0: not yet), verifying every word once
# more when released (what `pressure_finish` checks: with PASSES 0 the program checks no word
# before the hold).
pressure_start() {
    rm -f /tmp/hold /tmp/pressure.out
    VMTOOL_PASSES=$2 VMTOOL_VERIFY_AFTER_HOLD=1 systemd-run --scope --quiet --collect \
        -p MemorySwapMax=infinity $VT pressure "$1" "$(date +%s)" /tmp/hold >/tmp/pressure.out 2>&1 &
    PRESSURE_PID=$!
    PRESSURE_MIB=$1
    PRESSURE_OUT0=$(vmstat_of pswpout)
    PRESSURE_T0=$(date +%s)
    touch /run/pressure-on
    wait_for 400 eval "[ -e /tmp/hold ] || ! kill -0 $PRESSURE_PID 2>/dev/null"
    # Nothing swaps while the program holds its memory: no stall to watch for.
    rm -f /run/pressure-on
}
pressure_finish() { # NAME
    local rc after_bad after_words filled
    touch /run/pressure-on
    rm -f /tmp/hold
    wait "$PRESSURE_PID"
    rc=$?
    rm -f /run/pressure-on
    cat /tmp/pressure.out
    filled=$((PRESSURE_MIB * 1048576 / 8))
    after_bad=$(sed -n 's/^PRESSURE_AFTER_HOLD_BAD_WORDS=//p' /tmp/pressure.out)
    after_words=$(sed -n 's/^PRESSURE_AFTER_HOLD_WORDS_CHECKED=//p' /tmp/pressure.out)
    check "$1: the pressure program over $PRESSURE_MIB MiB exited 0 (rc $rc)" [ "$rc" -eq 0 ]
    check "$1: every word matched after the hold (${after_words:-0} checked, ${after_bad:-?} bad)" \
        [ "${after_bad:-1}" = 0 -a "${after_words:-0}" -ge "$filled" ]
    check "$1: pages were swapped out ($(($(vmstat_of pswpout) - PRESSURE_OUT0)) pages)" \
        [ "$(vmstat_of pswpout)" -gt "$PRESSURE_OUT0" ]
    figure "systemd_${1}_seconds" "$(($(date +%s) - PRESSURE_T0))"
    figure "systemd_${1}_pswpout" "$(($(vmstat_of pswpout) - PRESSURE_OUT0))"
}

# --- 0. a boot whose kernel cannot load ublk_drv (systemd-stage.sh's second boot) ------------
# The daemon fails for good; trueno-ublk-failed@0 (its OnFailure=) must fail the swap unit and
# trueno-ublk-mkswap@0, which wait for a device that will not come, so that the boot goes on
# at once rather than after systemd's 90 s device timeout.
if grep -qw 'trueno.test=no-driver' /proc/cmdline; then
    section "boot without ublk_drv (module_blacklist): kernel $(uname -r)"
    up=$(now)
    systemd-analyze time 2>/dev/null | head -n1
    check "multi-user.target came ${up} s after the kernel started (under 60 s: not held by the 90 s device timeout)" \
        awk -v t="$up" 'BEGIN { exit !(t < 60) }'
    check "/dev/ublk-control is absent (the driver was kept out)" [ ! -e /dev/ublk-control ]
    check "trueno-ublk@$ID failed ($(systemctl show -p ActiveState,Result --value trueno-ublk@$ID.service | tr '\n' ' '))" \
        systemctl -q is-failed trueno-ublk@$ID.service
    check "... saying what to do (modprobe ublk_drv)" eval "journal_units | grep -q 'modprobe ublk_drv'"
    check "trueno-ublk-failed@$ID ran" eval "journalctl -b --no-pager -u trueno-ublk-failed@$ID.service | grep -q 'Finished\|Deactivated'"
    # A start job failed by a dependency leaves its unit inactive, not failed.
    check "the start of dev-ublkb$ID.swap failed (its state: $(systemctl is-active dev-ublkb$ID.swap))" \
        eval "journalctl -b --no-pager | grep -q 'Dependency failed for dev-ublkb$ID.swap'"
    check "... as did trueno-ublk-mkswap@$ID's" \
        eval "journalctl -b --no-pager | grep -q 'Dependency failed for trueno-ublk-mkswap@$ID'"
    systemctl list-jobs --no-pager
    check "no job is left but this test's own" eval "[ \"\$(systemctl list-jobs --no-legend | grep -vc trueno-test.service)\" = 0 ]"
    journal_units | tail -n 20
    finish
fi

# --- 0b. a forced poweroff with pages out (systemd-stage.sh's third boot) -------------------
# `systemctl poweroff --force` stops no unit: systemd-shutdown stops every process, sends
# SIGTERM, then SIGKILL, to all but root's whose argv[0] starts with '@' (root storage
# daemons), lets them go on, unmounts what it can and swaps off. A tmpfs under /run (an API
# file system it never unmounts) whose pages are out on the device makes that swapoff read
# them back: a daemon killed there would leave it waiting for good, and the machine with it
# (the host checks that it powered off). Only the tmpfs's pages are pushed out (memory.reclaim
# of the scope that wrote them): to tell whether a process is marked, systemd-shutdown reads
# each root process's argv while every process, this daemon too, is stopped, and waits for
# good if that page is out on the device (docs/limits.md).
if grep -qw 'trueno.test=forced-poweroff' /proc/cmdline; then
    section "forced poweroff with tmpfs pages out: kernel $(uname -r)"
    check "swap is on $DEV" wait_for 60 eval "grep -q '^$DEV ' /proc/swaps"
    for pid in $(pgrep -x trueno-ublk); do
        check "daemon process $pid is spared by systemd-shutdown's kill: argv[0] '$(tr '\0' ' ' </proc/$pid/cmdline | cut -d' ' -f1)' starts with @" \
            [ "$(head -c1 /proc/$pid/cmdline)" = @ ]
    done
    systemd-run --scope --quiet --collect -p MemorySwapMax=infinity /bin/sh -c \
        'head -c 64M /dev/urandom >/run/trueno-test-keep && echo 64M >"/sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup)/memory.reclaim"'
    cat /proc/swaps
    figure systemd_forced_poweroff_swap_used_kib "$(swap_used_kib)"
    check "pages of /run are out on $DEV ($(swap_used_kib) KiB)" [ "$(swap_used_kib)" -ge 32768 ]
    POWEROFF_FORCE=1
    finish
fi

# --- 1. boot --------------------------------------------------------------------------------
section "boot: kernel $(uname -r), systemd $(systemctl --version | head -n1 | cut -d' ' -f2), $(grep MemTotal /proc/meminfo | tr -s ' ')"
systemctl is-system-running
systemd-analyze time 2>/dev/null | head -n1
journalctl -b --no-pager -q | grep -iE 'ordering cycle|break ordering' >/tmp/cycles.log
cat /tmp/cycles.log
check "systemd found no ordering cycle at boot ($(wc -l </tmp/cycles.log) lines)" [ ! -s /tmp/cycles.log ]
check "/tmp is a tmpfs of tmp.mount, as in Debian 13 ($(systemctl is-active tmp.mount), $(findmnt -no FSTYPE /tmp))" \
    eval "systemctl -q is-active tmp.mount && [ \"\$(findmnt -no FSTYPE /tmp)\" = tmpfs ]"
check "trueno-ublk-generator wrote dev-ublkb$ID.swap" test -f /run/systemd/generator/dev-ublkb$ID.swap
check "... and linked it into swap.target.wants" test -L /run/systemd/generator/swap.target.wants/dev-ublkb$ID.swap
for unit in trueno-ublk@$ID.service trueno-ublk-mkswap@$ID.service dev-ublkb$ID.swap; do
    check "$unit is active after boot ($(systemctl is-active "$unit"))" systemctl -q is-active "$unit"
done
systemctl --no-pager status trueno-ublk@$ID.service dev-ublkb$ID.swap 2>&1 | head -n 30
swapon_us=$(systemctl show -p ActiveEnterTimestampMonotonic --value dev-ublkb$ID.swap)
daemon_us=$(systemctl show -p ActiveEnterTimestampMonotonic --value trueno-ublk@$ID.service)
figure systemd_boot_to_daemon_ready_s "$(awk -v u="$daemon_us" 'BEGIN { printf "%.2f", u / 1e6 }')"
figure systemd_boot_to_swap_on_s "$(awk -v u="$swapon_us" 'BEGIN { printf "%.2f", u / 1e6 }')"
cat /proc/swaps
swapon --show
check "/proc/swaps names $DEV" grep -q "^$DEV " /proc/swaps
check "swapon --show names $DEV" eval "swapon --show=NAME --noheadings | grep -qx $DEV"
check "swap priority is the configured $PRIO (got '$(swap_prio)')" [ "$(swap_prio)" = "$PRIO" ]
# systemd also makes swap units for the device's other names (by-uuid ...): they must follow
# dev-ublkb0.swap, not act on their own.
others=$(systemctl list-units --all --type=swap --plain --no-legend | awk '{ print $1 }' | grep -vx "dev-ublkb$ID.swap" || true)
lone=""
for u in $others; do
    following=$(systemctl show -p Following --value "$u")
    echo "swap unit $u follows '${following}'"
    [ -z "$following" ] && [ "$(systemctl is-active "$u")" = active ] && lone="$lone $u"
done
check "exactly one swap unit acts for $DEV (others follow it:${others:+ }$(echo "$others" | tr '\n' ' '))" [ -z "$lone" ]
check "no service of ours runs swapon (trueno-ublk-swap@ is gone)" eval "systemctl list-units --all --plain --no-legend 'trueno-ublk-swap@*' >/tmp/units.out && ! grep -q . /tmp/units.out"
check "writeback throttling is off (wbt_lat_usec $(cat /sys/block/ublkb$ID/queue/wbt_lat_usec))" \
    [ "$(cat /sys/block/ublkb$ID/queue/wbt_lat_usec)" = 0 ]
check "the request timeout is 1 s (io_timeout $(cat /sys/block/ublkb$ID/queue/io_timeout))" \
    [ "$(cat /sys/block/ublkb$ID/queue/io_timeout)" = 1000 ]
check "one tag spared (nr_requests $(cat /sys/block/ublkb$ID/queue/nr_requests), nr_tags $(cat /sys/block/ublkb$ID/mq/0/nr_tags))" \
    [ "$(cat /sys/block/ublkb$ID/queue/nr_requests)" -eq $(($(cat /sys/block/ublkb$ID/mq/0/nr_tags) - 1)) ]
trueno-ublk list | tee /tmp/list.out
check "trueno-ublk list shows $DEV" grep -q "ublkb$ID" /tmp/list.out
trueno-ublk stat >/tmp/stat.out 2>&1
rc=$?
cat /tmp/stat.out
check "trueno-ublk stat exits 0 (exit $rc)" [ "$rc" -eq 0 ]
check "trueno-ublk stat shows ublkb$ID" grep -q "ublkb$ID" /tmp/stat.out
# The unit's sandbox (system call filter, capabilities) leaves the slot-free probe its calls.
check "the slot-free probe is attached under the unit ($(trueno-ublk stat --json | tr -d '\n ' | grep -o '"slot_frees":{[^}]*}'))" \
    eval "trueno-ublk stat --json | tr -d '\n ' | grep -q '\"slot_frees\":{\"attached\":true'"
echo "--- journal of the units at boot:"
journal_units | tee /tmp/journal-boot
check "the units' boot journal has lines" [ -s /tmp/journal-boot ]
check "the units' boot journal has no warning or error (priority <= warning)" \
    eval "[ -z \"\$(journal_units -p warning -q)\" ]"
# (But for the driver's feature names: USER_RECOVERY_FAIL_IO is one.)
check "the units' boot journal has no line saying warn/error/fail" \
    eval "! grep -v 'ublk driver features' /tmp/journal-boot | grep -iE 'warn|error|fail'"
journalctl -b --no-pager -q | grep -i 'trueno-ublk-generator' >/tmp/gen.log
check "the generator logged nothing ($(wc -l </tmp/gen.log) lines)" [ ! -s /tmp/gen.log ]
# A section the daemon would refuse, read by a daemon-reload: no unit for it, and the reason
# in the journal (systemd runs generators with stderr on /dev/null: they write to /dev/kmsg).
cp /etc/trueno-ublk.conf /tmp/conf.saved
printf '[ublkb9]\nswap = yes\nsize = 100T\n' >>/etc/trueno-ublk.conf
systemctl daemon-reload
check "a refused section's reason is in the journal ($(journalctl -b -q --no-pager -t trueno-ublk-generator | tail -n 1))" \
    eval "journalctl -b -q --no-pager -t trueno-ublk-generator | grep -qF '[ublkb9]: size 100T'"
check "... and it got no swap unit" [ ! -e /run/systemd/generator/dev-ublkb9.swap ]
cp /tmp/conf.saved /etc/trueno-ublk.conf
systemctl daemon-reload

check "PID 1's memory is kept out of swap (init.scope memory.swap.max $(cat /sys/fs/cgroup/init.scope/memory.swap.max 2>&1))" \
    [ "$(cat /sys/fs/cgroup/init.scope/memory.swap.max 2>/dev/null)" = 0 ]

# --- 2. delete and restart under pressure ---------------------------------------------------
# The config file's size edited while the device serves (`ram / 2` to `ram`): every
# takeover and restart below reads the file afresh and must resume the device with the
# size it has; the new size takes effect when the device is made again (section 3).
size0=$(device_bytes)
sed -i 's|^size = ram / 2$|size = ram|' /etc/trueno-ublk.conf
check "the config file's size edited while $DEV serves ($(grep '^size' /etc/trueno-ublk.conf), the device $size0 bytes)" \
    grep -q '^size = ram$' /etc/trueno-ublk.conf
swap_kib=$(awk -v d="$DEV" '$1 == d { print $3 }' /proc/swaps)
fill=$(($(avail_mib) + 64))
section "pressure 1: $fill MiB (available $(avail_mib) MiB, swap $((swap_kib / 1024)) MiB)"
pressure_start "$fill" 0
if [ -e /tmp/hold ]; then
    grep -E '^(MemAvailable|SwapTotal|SwapFree)' /proc/meminfo
    check "pages are out on $DEV while the program holds its memory ($(swap_used_kib) KiB)" [ "$(swap_used_kib)" -gt 0 ]
    t0=$(date +%s)
    timeout 60 trueno-ublk delete --id $ID >/tmp/delete.out 2>&1
    rc=$?
    cat /tmp/delete.out
    check "trueno-ublk delete --id $ID is refused while swap is on (exit $rc, $(($(date +%s) - t0)) s)" \
        [ "$rc" -ne 0 -a "$rc" -ne 124 ]
    check "... saying the device is in use" grep -q 'in use' /tmp/delete.out
    check "... and swap stays on" grep -q "^$DEV " /proc/swaps
    trueno-ublk stat
    # a. kill -9 of the serving process: the standby takes over; systemd sees nothing.
    main0=$(main_pid)
    check "a standby is ready beside the serving process" \
        wait_for 30 eval "journal_units | grep -q 'standby ready'"
    settle_serving
    standbys=$(journal_units | grep -c 'standby ready')
    t0=$(now)
    kill -9 "$serving0"
    resumed_after "$serving0" "$t0" 30 "kill -9 of the serving process $serving0" systemd_kill_serving_to_live_s
    supervisor_stayed "$main0"
    # a1. SIGTERM to the serving process alone (a stray kill, or a `delete` that found the
    #     device unused just before a swapon): it hands the device over and exits 0; the
    #     supervisor's standby takes it over (before, the supervisor took exit 0 for a
    #     deletion and ended, leaving swap on a device nobody served).
    check "a new standby is ready after the takeover" \
        wait_for 30 eval "[ \"\$(journal_units | grep -c 'standby ready')\" -gt $standbys ]"
    settle_serving
    t0=$(now)
    kill -TERM "$serving0"
    resumed_after "$serving0" "$t0" 30 "SIGTERM to the serving process $serving0 alone" systemd_term_serving_to_live_s
    check "... the supervisor said it took the device over" \
        eval "journal_units | grep -q 'ended on its own and left its device'"
    supervisor_stayed "$main0"
    # a2. A reload with the config file broken (a typo): refused, the running build serves
    #     on with its settings (where a takeover or restart serves without the file, c).
    settle_serving
    standbys=$(journal_units | grep -c 'standby ready')
    echo 'depth = lots' >>/etc/trueno-ublk.conf
    timeout 70 systemctl reload trueno-ublk@$ID.service
    rc=$?
    # Not a timeout (124): ExecReload's `trueno-ublk reload` reads the supervisor's outcome.
    check "systemctl reload with the config file broken fails (exit $rc)" \
        eval "[ $rc -ne 0 ] && [ $rc -ne 124 ]"
    check "... saying why, in the journal: the supervisor, and the reload command" \
        eval "journal_units | grep -q 'reload failed: the standby of the binary on disk ended' &&
              journal_units | grep -q 'reload of ublkb$ID failed: the standby of the binary on disk ended before it was ready'"
    check "... and $serving0 still serves $DEV ($(serving_pid))" [ "$(serving_pid)" = "$serving0" ]
    sed -i '/^depth = lots$/d' /etc/trueno-ublk.conf
    # a3. systemctl reload (SIGHUP to the supervisor): a standby of the binary on disk is
    #     readied while the serving process serves on, then takes the device over from it.
    check "a standby is ready again after the failed reload" \
        wait_for 30 eval "[ \"\$(journal_units | grep -c 'standby ready')\" -gt $standbys ]"
    settle_serving
    t0=$(now)
    timeout 60 systemctl reload trueno-ublk@$ID.service
    rc=$?
    check "systemctl reload trueno-ublk@$ID with swap on: exit 0 (exit $rc)" [ "$rc" -eq 0 ]
    resumed_after "$serving0" "$t0" 60 "... the reload's standby took over from $serving0" systemd_reload_to_live_s
    check "... the old serving process handed the device over for the reload" \
        eval "journal_units | grep -q 'reload: handing the device over'"
    supervisor_stayed "$main0"
    # b. systemctl restart: the daemon hands the device over, the new one resumes it. First
    #    the unit's ExecStop reads PID 1's swapped-out pages back (`trueno-ublk fault-in`).
    #    PID 1 paged out first, as reclaim may do it: what is charged to init.scope
    #    (swap.max 0) stays; what it touched at boot, charged to the root cgroup, goes out to
    #    the device. Then a short burst of demand reclaims the swap cache, so that those
    #    pages are on the device alone, as reclaim leaves them (a restart in CI's run of
    #    2026-11-29 20:24 stalled on such a page; this does not make that stall happen
    #    reliably, but without the ExecStop the check below fails).
    $VT pageout-pid 1
    touch /run/pressure-on
    VMTOOL_PASSES=1 systemd-run --scope --quiet --collect -p MemorySwapMax=infinity \
        $VT pressure $(($(avail_mib) + 48)) 7 >/tmp/burst.out 2>&1
    rm -f /run/pressure-on
    grep '^PRESSURE_BAD_WORDS' /tmp/burst.out
    pid1_swap_kib=$(vmswap_kib 1)
    echo "PID 1 VmSwap after the burst: $pid1_swap_kib kB"
    settle_serving
    t0=$(now)
    timeout 120 systemctl restart trueno-ublk@$ID.service
    rc=$?
    took=$(since "$t0")
    figure systemd_restart_s "$took"
    echo "systemctl restart trueno-ublk@$ID.service: exit $rc after $took s"
    systemctl --no-pager status trueno-ublk@$ID.service 2>&1 | head -n 20
    check "systemctl restart trueno-ublk@$ID with swap on: exit 0 (exit $rc, $took s)" [ "$rc" -eq 0 ]
    check "... a new supervisor ($(main_pid), was $main0) and serving process ($(serving_pid), was $serving0)" \
        eval "[ \"\$(main_pid)\" != \"$main0\" ] && live_other_than \"$serving0\""
    if [ "${pid1_swap_kib:-0}" -gt 0 ]; then
        check "... ExecStop read PID 1's $pid1_swap_kib KiB of swapped-out pages back first ($(journal_units | grep -o 'pid 1: .*' | tail -n 1))" \
            eval "journal_units | grep -Eq 'pid 1: [1-9][0-9]* pages were swapped out'"
    else
        check "... ExecStop ran (PID 1 had nothing swapped out: $(journal_units | grep -o 'pid 1: .*' | tail -n 1))" \
            eval "journal_units | grep -q 'pid 1: '"
    fi
    check "... the old daemon handed the device over" eval "journal_units | grep -q 'device handed over'"
    check "... and the new one resumed it with every page" eval "journal_units | grep -q 'resumed the store with every page'"
    check "... swap is still on" grep -q "^$DEV " /proc/swaps
    check "... dev-ublkb$ID.swap is still active" systemctl -q is-active dev-ublkb$ID.swap
    check "... trueno-ublk-mkswap@$ID did not run again" \
        [ "$(journalctl -b --no-pager -q -u trueno-ublk-mkswap@$ID.service | grep -c 'Setting up swapspace')" -le 1 ]
    # c. kill -9 of every process of the unit: systemd restarts it, the start resumes. With
    #    the config file broken first (an edit with a typo): the device exists, in use, and
    #    is resumed anyway (the command line's settings and the defaults), the error logged;
    #    before, every start failed on the file and swap waited until it was mended.
    echo 'depth = lots' >>/etc/trueno-ublk.conf
    main0=$(main_pid)
    settle_serving
    t0=$(now)
    systemctl kill --signal=SIGKILL trueno-ublk@$ID.service
    if wait_for 60 eval "live_other_than \"$serving0\" && systemctl -q is-active trueno-ublk@$ID.service"; then
        took=$(since "$t0")
        ok "kill -9 of every process of trueno-ublk@$ID: systemd restarted it and pid $(serving_pid) resumed $DEV $took s later"
        figure systemd_kill_all_to_live_s "$took"
    else
        fail "kill -9 of every process of trueno-ublk@$ID: not resumed ($(systemctl is-active trueno-ublk@$ID.service); $(trueno-ublk list | tail -n +2))"
    fi
    check "... with a new supervisor ($(main_pid), was $main0)" [ "$(main_pid)" != "$main0" ]
    check "... the config file's error was logged, the device served without the file ($(journal_units | grep -c 'config file does not read') lines)" \
        eval "journal_units | grep -q 'the config file does not read.*depth'"
    sed -i '/^depth = lots$/d' /etc/trueno-ublk.conf
    # d. kill -9 of the supervisor alone (the unit's main process): the serving process, told
    #    by its parent-death signal, hands the device over; systemd runs the stop (ExecStop
    #    reads no page of PID 1 then: $MAINPID is unset, and a read reaching the device being
    #    handed over would wait for the very restart) and restarts the unit, which resumes it.
    main0=$(main_pid)
    settle_serving
    fault_ins0=$(journal_units | grep -c 'pid 1: ')
    t0=$(now)
    kill -9 "$main0"
    if wait_for 60 eval "live_other_than \"$serving0\" && systemctl -q is-active trueno-ublk@$ID.service && [ \"\$(main_pid)\" != \"$main0\" ]"; then
        took=$(since "$t0")
        ok "kill -9 of the supervisor $main0 alone: systemd restarted the unit and pid $(serving_pid) resumed $DEV $took s later"
        figure systemd_kill_supervisor_to_live_s "$took"
    else
        fail "kill -9 of the supervisor $main0 alone: not resumed ($(systemctl is-active trueno-ublk@$ID.service); $(trueno-ublk list | tail -n +2))"
    fi
    check "... the serving process handed the device over when its supervisor died" \
        eval "journal_units | grep -q 'the supervisor is gone: handing the device over'"
    check "... and ExecStop read no page of PID 1 meanwhile ($(journal_units | grep -c 'pid 1: ') fault-in lines, $fault_ins0 before)" \
        [ "$(journal_units | grep -c 'pid 1: ')" = "$fault_ins0" ]
    # e. Restarts past the unit's start limit: the one refused (start-limit-hit) has handed
    #    the device over first, and the unit fails; trueno-ublk-failed@ finds the device
    #    there and starts the unit again 10 s later, where swap used to wait for an
    #    administrator. The limit's interval lengthened for the test (a drop-in), so that
    #    restarts at the VM's pace meet it; taken away before the retry.
    mkdir -p /run/systemd/system/trueno-ublk@$ID.service.d
    printf '[Unit]\nStartLimitIntervalSec=600s\n' >/run/systemd/system/trueno-ublk@$ID.service.d/limit.conf
    systemctl daemon-reload
    settle_serving
    restarts=0
    refused=no
    while [ "$restarts" -lt 8 ]; do
        restarts=$((restarts + 1))
        timeout 60 systemctl restart trueno-ublk@$ID.service 2>/dev/null || {
            refused=yes
            break
        }
    done
    t0=$(now)
    result=$(systemctl show -P Result trueno-ublk@$ID.service)
    rm -r /run/systemd/system/trueno-ublk@$ID.service.d
    systemctl daemon-reload
    check "restarts past the start limit: restart $restarts refused ($result)" \
        [ "$refused" = yes -a "$result" = start-limit-hit ]
    if wait_for 40 eval "systemctl -q is-active trueno-ublk@$ID.service && live_other_than \"$serving0\""; then
        took=$(since "$t0")
        ok "... trueno-ublk-failed@$ID started the unit again: pid $(serving_pid) resumed $DEV $took s after the refusal"
        figure systemd_start_limit_to_live_s "$took"
    else
        fail "... the unit was not started again ($(systemctl is-active trueno-ublk@$ID.service); $(trueno-ublk list | tail -n +2); $(journalctl -b --no-pager -q -u trueno-ublk-failed@$ID.service | tail -n 3))"
    fi
    check "... swap is still on" grep -q "^$DEV " /proc/swaps
    check "$DEV kept its size ($(device_bytes) bytes, was $size0) through the takeovers and restarts after the config file's edit" \
        [ "$(device_bytes)" = "$size0" ]
    check "... and the daemon said so ($(journal_units | grep -c 'keeps its size') lines)" \
        eval "journal_units | grep -q 'the device keeps its size while it exists'"
    journal_units | grep -E 'handed over|resumed|died|takes the device|Scheduled restart' | tail -n 12
    # The hand-overs took the gate that orders them with fault-in (src/devices.rs), which
    # the unit's sandbox must leave them (its run directory, flock).
    check "every hand-over under the unit took the hand-over gate ($(journal_units | grep -c 'without waiting for `fault-in`') lines say otherwise)" \
        eval "! journal_units | grep -q 'without waiting for .fault-in'"
    check "the kernel is alive and $DEV still reads" \
        eval "dd if=$DEV of=/dev/null bs=4096 count=1 iflag=direct status=none"
else
    fail "the pressure program ended before holding its memory"
fi
pressure_finish pressure1

# --- 3. stop as README.md says, start again ----------------------------------------------
section "stop: systemctl stop dev-ublkb$ID.swap, then the daemon (deletes the device)"
t0=$(date +%s)
check "systemctl stop dev-ublkb$ID.swap (swapoff)" systemctl stop dev-ublkb$ID.swap
check "... took $(($(date +%s) - t0)) s and /proc/swaps no longer lists $DEV" eval "! grep -q '^$DEV ' /proc/swaps"
t0=$(date +%s)
check "systemctl stop trueno-ublk@$ID (the device unused now: deleted)" systemctl stop trueno-ublk@$ID.service
check "... took $(($(date +%s) - t0)) s and $DEV is gone" wait_for 10 eval "[ ! -e /sys/class/ublk-char/ublkc$ID ]"
check "... and no trueno-ublk process is left" wait_for 10 eval "! pgrep -x trueno-ublk >/dev/null"
check "... and the unit is inactive, not failed ($(systemctl is-active trueno-ublk@$ID.service))" \
    eval "[ \"\$(systemctl is-active trueno-ublk@$ID.service)\" = inactive ]"
check "trueno-ublk-mkswap@$ID went inactive with the device" wait_for 10 eval "! systemctl -q is-active trueno-ublk-mkswap@$ID.service"
systemctl reset-failed trueno-ublk@$ID.service 2>/dev/null
t0=$(date +%s)
check "systemctl start dev-ublkb$ID.swap (daemon, mkswap, swapon)" systemctl start dev-ublkb$ID.swap
echo "start took $(($(date +%s) - t0)) s"
check "... swap is on again with priority $PRIO" [ "$(swap_prio)" = "$PRIO" ]
check "... trueno-ublk@$ID is active again" systemctl -q is-active trueno-ublk@$ID.service
check "... the new device has the config file's new size ($(device_bytes) bytes, was $size0)" \
    [ "$(device_bytes)" -gt "$size0" ]
fill=$(($(avail_mib) + 32))
section "pressure 2: $fill MiB (available $(avail_mib) MiB)"
pressure_start "$fill" 0
pressure_finish pressure2

# --- 3b. a terminal that hangs up is no reload ----------------------------------------------
# `create --foreground` on a pseudo-terminal (script(1)), whose `script` is then killed: the
# kernel hangs the terminal up, sending SIGHUP to its session. The daemon serves on: the same
# supervisor and serving process (a SIGHUP the kernel sends is no reload), its log on the
# hung-up terminal failing quietly.
section "a terminal's hang-up: create --foreground on a pseudo-terminal that goes away"
HUP_ID=7
hup_serving() { trueno-ublk list 2>/dev/null | awk -v id=$HUP_ID '$1 == id && $6 == "live" && NF == 7 { print $7 }'; }
script -qfc "exec trueno-ublk create --size 64M --id $HUP_ID --foreground" /dev/null </dev/null >/dev/null 2>&1 &
term=$!
if wait_for 60 eval '[ -n "$(hup_serving)" ]'; then
    ok "create --foreground on a pseudo-terminal: /dev/ublkb$HUP_ID is live"
    # Its standby ready, so that a reload, if the hang-up made one, would not wait for it.
    sleep 5
    hup_pid=$(hup_serving)
    hup_supervisor=$(awk '/^PPid:/ { print $2 }' /proc/$hup_pid/status)
    kill -KILL "$term"
    sleep 8
    check "... after the hang-up the same process $hup_pid serves it ($(hup_serving))" \
        [ "${hup_pid:-none}" = "$(hup_serving)" ]
    check "... and its supervisor $hup_supervisor is alive" \
        eval "[ \"\$(cat /proc/$hup_supervisor/comm 2>/dev/null)\" = trueno-ublk ]"
    check "... and /dev/ublkb$HUP_ID reads" \
        eval "dd if=/dev/ublkb$HUP_ID of=/dev/null bs=4096 count=1 iflag=direct status=none"
else
    fail "create --foreground on a pseudo-terminal: /dev/ublkb$HUP_ID not live within 60 s"
fi
kill -KILL "$term" 2>/dev/null
check "trueno-ublk delete --id $HUP_ID" eval "timeout 60 trueno-ublk delete --id $HUP_ID >/dev/null"
check "... and no process of it is left" \
    wait_for 10 eval "! pgrep -f -- '--id $HUP_ID --foreground' >/dev/null"

# --- 4. poweroff with pages out ----------------------------------------------------------
section "poweroff with pages swapped out"
journald=$(pidof systemd-journald | cut -d' ' -f1)
cat /proc/swaps
figure systemd_poweroff_swap_used_kib "$(swap_used_kib)"
figure systemd_poweroff_pid1_vmswap_kib "$(vmswap_kib 1)"
figure systemd_poweroff_journald_vmswap_kib "$(vmswap_kib "$journald")"
check "pages are still out on $DEV at poweroff ($(swap_used_kib) KiB)" [ "$(swap_used_kib)" -gt 0 ]
check "PID 1 or journald have pages out (PID 1 $(vmswap_kib 1) KiB, journald $(vmswap_kib "$journald") KiB)" \
    [ $(($(vmswap_kib 1) + $(vmswap_kib "$journald"))) -gt 0 ]
# What PID 1 touched before it moved into init.scope is charged to the root cgroup, which has
# no swap limit: only the limit itself is checked.
check "init.scope's swap limit held to the end (memory.swap.max $(cat /sys/fs/cgroup/init.scope/memory.swap.max 2>&1))" \
    [ "$(cat /sys/fs/cgroup/init.scope/memory.swap.max 2>/dev/null)" = 0 ]
# Swap turned off for the next boot as README.md says (swap = no, daemon-reload) while it is
# on: the generated swap unit goes, and systemd makes one of its own from /proc/swaps, which
# knows nothing of the daemon. The poweroff must still swap off before the daemon stops (the
# host checks the console): the daemon's unit orders itself before that unit by name.
sed -i 's/^swap = yes$/swap = no/' /etc/trueno-ublk.conf
systemctl daemon-reload
check "with swap = no and a daemon-reload, dev-ublkb$ID.swap is systemd's own, from /proc/swaps (unit file '$(systemctl show -P FragmentPath dev-ublkb$ID.swap)', active: $(systemctl is-active dev-ublkb$ID.swap))" \
    eval "[ -z \"\$(systemctl show -P FragmentPath dev-ublkb$ID.swap)\" ] && systemctl -q is-active dev-ublkb$ID.swap"
echo "--- journal of the units since boot:"
journal_units | tail -n 40
finish
