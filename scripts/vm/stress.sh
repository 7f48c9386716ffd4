# shellcheck shell=dash disable=SC2317 # sourced by test.sh; functions run through check
# Near-OOM stage of the VM test (issue 16): stress-ng's `vm` stressor from Debian's package,
# on kernel zram (lz4) and then on a fresh 1 GiB trueno-ublk device in the same VM, and the
# memory-return check on the daemon. stress-ng and its libraries come on a second disk
# (/dev/vda, a tar archive) and are unpacked into RAM only for this stage.
#
# For each case (STRESS_CASES, default "move-inv:100": method and MiB per worker), 2 workers run
# `stress-ng --vm 2 --vm-bytes 2xMIB --vm-method METHOD --vm-keep --verify -t STRESS_S`
# (stress-ng divides --vm-bytes between its workers) in the "work" cgroup, while `vmtool wakeup`
# there measures how late an ordinary process wakes up. Figures per device and case: workers'
# bogo ops/s and CPU time (user and system, from their cgroup), failed swap writes, OOM kills
# (all, and of anything but the workers), the longest wake-up delay, OOM kills the store asked
# for, the chunk reserve's churn, the CPU seconds of the daemon's threads (the refill thread's
# in the kernel apart), of kswapd and of idle CPUs over the run, and how often and how long
# tasks waited in the kernel's reclaim throttles (`reclaim over the run`). Checks, per case,
# ublk against zram in this VM: no verify failure, write errors 0 where zram's are 0, no OOM
# kill of anything but the workers where zram killed only workers, wake-up delay at most
# zram's + 2 s; the workers' progress against zram's is printed (a NOTE when lower), not
# checked. A kernel panic or hang ends the VM without a verdict (a failure).
#
# The daemon is three processes (supervisor, serving process, standby); its memory here is the
# serving process's, the one `trueno-ublk list` names and whose RSS `stat` shows: it alone maps
# the store's pages. The supervisor's and the standby's are printed beside it.

SNG=/opt/stress-ng

stress_unpack() {
    insmod /lib/modules/virtio_blk.ko || return 1
    wait_until 5 test -b /dev/vda || return 1
    mkdir -p $SNG && tar -x -f /dev/vda -C $SNG && test -x $SNG/stress-ng
}

# sfigure NAME VALUE: a figure, also kept for stress_compare.
sfigure() {
    figure "$1" "$2"
    echo "FIGURE $1=$2" >>/tmp/stress.figures
}

# json_field NAME [FILE]: the first number named NAME in FILE (a `stat_snapshot`), or in
# `trueno-ublk stat --json --id 0` now.
json_field() {
    if [ -n "${2:-}" ]; then cat "$2"; else trueno-ublk stat --json --id 0; fi |
        sed -n "s/.*\"$1\": *\([0-9]*\).*/\1/p" | head -n1
}

# stat_snapshot FILE: the device's counters now, for `json_field` and `stat_delta`: one
# process started near OOM for all of them rather than one per counter.
stat_snapshot() {
    trueno-ublk stat --json --id 0 >"$1"
}

# stat_delta NAME [DIVISOR]: how much counter NAME grew from /tmp/stat.before to
# /tmp/stat.after (stat_snapshot), divided by DIVISOR.
stat_delta() {
    echo $((($(json_field "$1" /tmp/stat.after) - $(json_field "$1" /tmp/stat.before)) / ${2:-1}))
}

# failed_writes NAME: swap writes the device failed so far.
failed_writes() {
    case $1 in
    zram) awk '{ print $2 }' /sys/block/zram0/io_stat ;;
    *) json_field failed_writes ;;
    esac
}

# cpu_ticks: clock ticks (user + system) used so far by the daemon's threads (those that
# serve and store, and the two that release OOM victims' memory) and kswapd, by thread name,
# and the CPUs' idle ticks (idle + iowait): where the case's CPU time went beside the
# workers' own (stress-ng prints theirs).
cpu_ticks() {
    cat /proc/[0-9]*/task/[0-9]*/stat 2>/dev/null | awk '
        $2 ~ /^\((trueno|ublk|kswapd|oom-)/ { t[$2] += $14 + $15 }
        # The refill thread: its time in the kernel alone (commits, reclaim, giving back).
        $2 == "(trueno-reserve)" { t["(sys:trueno-reserve)"] += $15 }
        END { for (n in t) print n, t[n] }'
    awk '/^cpu / { print "(idle)", $5 + $6 }' /proc/stat
}

# cpu_seconds BEFORE AFTER [PATTERN]: CPU seconds between two cpu_ticks outputs, by name
# (" name=s" each), or summed over the names matching PATTERN.
cpu_seconds() {
    awk -v p="${3:-}" 'NR == FNR { b[$1] = $2; next }
        { d = $2 - b[$1] }
        p == "" && d > 0 { printf " %s=%.1f", $1, d / 100 }
        p != "" && $1 ~ p { s += d }
        END { if (p != "") printf "%.1f", s / 100 }' "$1" "$2"
}

# work_cpu: the user and system CPU microseconds of everything that ran in the "work" cgroup
# since it was made, the exited included (cgroup v2's cpu.stat, kept without the cpu
# controller); "0 0" without cgroups.
work_cpu() {
    awk '$1 == "user_usec" { u = $2 } $1 == "system_usec" { s = $2 } END { print u + 0, s + 0 }' \
        "$CG/work/cpu.stat" 2>/dev/null || echo 0 0
}

# The kernel's reclaim throttle, where tracefs has its event: each time a task in reclaim
# slept in `reclaim_throttle` (waiting for writeback to finish, for isolated pages, for
# progress), for how long and why. Why: a swap device whose writes complete later than zram's
# (in the daemon, not in the reclaiming task) could make reclaim meet pages still under
# writeback and sleep, idling the CPUs while the workers wait; on 6.12 in this VM it measured
# next to nothing on either device (2026-11-29), so the idle CPUs of our `all` case are not it.
TRACE=/sys/kernel/tracing
throttle_trace_on() {
    [ -d $TRACE/events ] || mount -t tracefs tracefs $TRACE 2>/dev/null
    [ -e $TRACE/events/vmscan/mm_vmscan_throttled/enable ] || return 0
    echo 2048 >$TRACE/buffer_size_kb
    echo 1 >$TRACE/events/vmscan/mm_vmscan_throttled/enable
}

# throttle_trace_take: clears the trace; its throttled sleeps, summed by reason, as
# " REASON=COUNTx/SECONDS s" each (nothing where there is no trace).
throttle_trace_take() {
    [ -e $TRACE/trace ] || return 0
    awk '/mm_vmscan_throttled:/ {
            r = ""; d = 0
            for (i = 1; i <= NF; i++) {
                if ($i ~ /^reason=/) r = substr($i, 8)
                if ($i ~ /delayed=/) { split($i, kv, "="); d = kv[2] }
            }
            sub(/^VMSCAN_THROTTLE_/, "", r); n[r]++; s[r] += d
        }
        END { for (r in n) printf " %s=%dx/%.1fs", r, n[r], s[r] / 1e6 }' $TRACE/trace
    echo >$TRACE/trace
}

# The OOM killer's victims, where tracefs has the events, in the same trace: when the kernel
# marked each (its kill), when it exited (after its memory was released: its swap slots freed,
# which the slot-free probe reports), and whether the OOM reaper took its memory first (the
# victim had not exited 2 s after the kill: blocked, waiting on I/O say). Why: in a VM lost to
# the race (the kernel going on from the killed workers to the shells, 2026-12-06) the daemon
# began freeing a victim's pages 1.6-2.4 s after its kill, against 0.03-0.7 s earlier in the
# same case; whether the victim or the daemon was late, only the kernel's side can say.
oom_trace_on() {
    [ -e $TRACE/events/oom/mark_victim/enable ] || return 0
    echo 'comm == "stress-ng-vm"' >$TRACE/events/sched/sched_process_exit/filter &&
        echo 1 >$TRACE/events/sched/sched_process_exit/enable
    for e in mark_victim start_task_reaping finish_task_reaping; do
        echo 1 >$TRACE/events/oom/$e/enable
    done
}

# oom_trace_take TAG: a line per victim of the trace so far (the last 30), "TAG: OOM victim PID
# killed at T s, exited +MS ms, reaped +MS ms", then the count of victims that exited 1 s or more after
# their kill and of those reaped; nothing without the events. Run before `throttle_trace_take`,
# which clears the trace.
oom_trace_take() {
    [ -e $TRACE/events/oom/mark_victim/enable ] || return 0
    awk -v tag="$1" '
        {
            ev = ""
            for (i = 2; i <= NF; i++)
                if ($i ~ /^(mark_victim|start_task_reaping|sched_process_exit):$/) { ev = $i; t = $(i - 1); break }
            if (ev == "") next
            sub(/:$/, "", ev); sub(/:$/, "", t)
            pid = ""
            for (j = i + 1; j <= NF; j++) if ($j ~ /^pid=/) { pid = substr($j, 5); break }
            if (pid == "") next
            if (ev == "mark_victim") { killed[pid] = t; order[++n] = pid }
            else if (ev == "start_task_reaping" && !(pid in reaped)) reaped[pid] = t
            else if (ev == "sched_process_exit" && !(pid in exited)) exited[pid] = t
        }
        END {
            late = 0; reap = 0
            for (k = 1; k <= n; k++) {
                p = order[k]; line = sprintf("%s: OOM victim %s killed at %.3f s", tag, p, killed[p])
                if (p in exited) {
                    d = (exited[p] - killed[p]) * 1000; line = line sprintf(", exited +%d ms", d)
                    if (d >= 1000) late++
                } else line = line ", not exited"
                if (p in reaped) { line = line sprintf(", reaped +%d ms", (reaped[p] - killed[p]) * 1000); reap++ }
                print line
            }
            if (n > 0) printf "%s: OOM victims: %d, exited 1 s or more after the kill %d, reaped %d\n", tag, n, late, reap
        }' $TRACE/trace | tail -n 31
}

# vmstat_now: the reclaim counters of /proc/vmstat that say how often tasks waited in
# reclaim: `pgscan_direct_throttle` (slept in `throttle_direct_reclaim`, free memory below
# half the min watermark), `allocstall_*` (entered direct reclaim), summed.
vmstat_now() {
    awk '$1 == "pgscan_direct_throttle" { t = $2 } $1 ~ /^allocstall_/ { a += $2 }
        END { print t + 0, a + 0 }' /proc/vmstat
}

# stress_case NAME METHOD MIB: one stress-ng run with swap on; figures under NAME_METHOD_MIB.
stress_case() {
    local name=$1 method=$2 mib=$3 tag w0 w1 n0 h0 h1 a0 a1 rc wk st kills others delay bogo vfail wu0 ws0 wu1 ws1 wuser wsys
    tag="${name}_$(echo "$method" | tr -c 'a-z0-9\n' _)_${mib}"
    dmesg -c >>/tmp/dmesg.kept
    # Where memory is as the case starts: a VM lost at a case's start (the OOM killer going on
    # from the fresh workers to the shells) leaves only this line to tell what held it.
    echo "$tag: before: $(swap_used); $(grep -E '^(MemFree|MemAvailable|Shmem|Unevictable|Mlocked|SwapCached):' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"
    w0=$(failed_writes "$name")
    [ "$name" = zram ] || {
        stat_snapshot /tmp/stat.before
        n0=$(wc -l </run/trueno-ublk/ublkb0.log)
        echo "$tag: before: serving process RSS $(rss_kib "$(serving_pid 0)") kB"
    }
    work "$VT" wakeup 100 $((STRESS_S + 10)) >/tmp/wakeup.out 2>&1 &
    wk=$!
    # Where the timer waits whenever it wakes a second late or more (its kernel stack, the
    # devices' requests in flight, the daemon's threads): not in the work cgroup, locked.
    "$VT" stalls "$wk" $((STRESS_S + 10)) >/tmp/stalls.out 2>&1 &
    st=$!
    # Still running well past its time: the blocked tasks go to the console (sysrq w), from a
    # subshell forked now that needs no new process (or memory) to do it then.
    rm -f /tmp/stress.done /tmp/stress.fifo
    mkfifo /tmp/stress.fifo
    (
        # shellcheck disable=SC3045 # busybox sh's read has -t
        read -r -t $((STRESS_S + 30)) _ <>/tmp/stress.fifo
        if [ ! -e /tmp/stress.done ]; then
            echo 8 >/proc/sys/kernel/printk
            echo w >/proc/sysrq-trigger
            echo 4 >/proc/sys/kernel/printk
        fi
    ) &
    # A swap run for the monitor: swap that stops moving for STALL_S fails the VM at once, with
    # where each of the daemon's threads waits (a wedged case otherwise waits for the VM's end).
    touch /run/pressure-on
    throttle_trace_take >/dev/null
    vmstat_now >/tmp/vmstat.before
    cpu_ticks >/tmp/cpu.before
    work_cpu >/tmp/work-cpu.before
    work env LD_LIBRARY_PATH=$SNG/lib timeout -s KILL $((STRESS_S + 120)) $SNG/stress-ng --vm 2 \
        --vm-bytes "$((2 * mib))M" --vm-method "$method" --vm-keep --verify -t "${STRESS_S}s" \
        --metrics-brief --yaml /tmp/sng.yaml >/tmp/sng.out 2>&1
    rc=$?
    cpu_ticks >/tmp/cpu.after
    work_cpu >/tmp/work-cpu.after
    vmstat_now >/tmp/vmstat.after
    oom_trace_take "$tag" >/tmp/oom.victims
    throttle_trace_take >/tmp/throttled
    rm -f /run/pressure-on
    touch /tmp/stress.done
    echo 1 <>/tmp/stress.fifo # read-write: never blocks, even with the reader gone
    wait "$wk" "$st"
    w1=$(failed_writes "$name")
    dmesg -c >"/tmp/dmesg.$tag"
    grep -E 'vm |fail|error|warn' /tmp/sng.out | head -n 12
    # The workers' own CPU, which a pass cut short at the deadline keeps (see stress_compare):
    # for a single method user time is its loops over the buffer; system time is mostly their
    # page faults.
    read -r wu0 ws0 </tmp/work-cpu.before
    read -r wu1 ws1 </tmp/work-cpu.after
    read -r wuser wsys <<EOF2
$(awk -v u0="$wu0" -v s0="$ws0" -v u1="$wu1" -v s1="$ws1" \
        'BEGIN { printf "%.2f %.2f\n", (u1 - u0) / 1e6, (s1 - s0) / 1e6 }')
EOF2
    kills=$(grep -c 'Killed process' "/tmp/dmesg.$tag")
    others=$(grep 'Killed process' "/tmp/dmesg.$tag" | grep -vc '(stress-ng')
    grep 'Killed process' "/tmp/dmesg.$tag" | grep -v '(stress-ng' | head -n 5
    delay=$(sed -n 's/^WAKEUP_MAX_DELAY_MS=//p' /tmp/wakeup.out)
    bogo=$(sed -n 's/^ *bogo-ops-per-second-real-time: *//p' /tmp/sng.yaml 2>/dev/null | head -n1)
    vfail=$(grep -ciE 'verif.*fail|fail.*verif|bit error|miscompare' /tmp/sng.out)
    echo "$tag: stress-ng exit $rc, bogo ops/s ${bogo:-none}, workers' CPU s user $wuser system $wsys, failed writes $((w1 - w0)), OOM kills $kills ($others not workers), longest wake-up delay ${delay:-none} ms"
    echo "$tag: the longest wake-up: $(grep '^WAKEUP_WORST' /tmp/wakeup.out)"
    echo "$tag: CPU seconds over the run:$(cpu_seconds /tmp/cpu.before /tmp/cpu.after)"
    read -r h0 a0 </tmp/vmstat.before
    read -r h1 a1 </tmp/vmstat.after
    echo "$tag: reclaim over the run: direct reclaim entered $((a1 - a0))x, throttled below half the min watermark $((h1 - h0))x; reclaim_throttle sleeps:$(cat /tmp/throttled)"
    head -n 80 /tmp/stalls.out | sed "s/^/$tag: /"
    grep -E 'Write-error|resource error|Kernel panic|deadlocked' "/tmp/dmesg.$tag" | head -n 3
    # The refill thread's backtrace, where `vmtool stalls` asked for the CPUs' (sysrq l).
    awk '/NMI backtrace for cpu/ { block = $0; inside = 1; next }
        inside { block = block "\n" $0 }
        inside && /<\/TASK>/ { inside = 0; if (block ~ /Comm: trueno-reserve/) print block }' \
        "/tmp/dmesg.$tag" | grep -vE '\] (R[A-HJ-Z0-9][A-Z0-9]*|Code|CS|FS|CR2|PKRU): ' | head -n 100 |
        sed "s/^/$tag: refill backtrace: /"
    # Where the memory a failed write waited for was (the daemon says so once per fail-fast
    # period; the log's tail at the end of the stage is often past it).
    [ "$name" = zram ] || [ "$w1" -eq "$w0" ] ||
        grep 'starved for memory' /run/trueno-ublk/ublkb0.log | tail -n 3
    # The killed workers' pages freed as the slot-free probe reported their slots (4 MiB or
    # more at a time), with how long each took and the hole punches that gave the memory back
    # (a punch per run of adjacent chunks; a build before 9f1494b logs no punches, and its
    # lines are printed without them), against the kernel's kill lines: who was first.
    [ "$name" = zram ] || {
        tail -n +$((n0 + 1)) /run/trueno-ublk/ublkb0.log | grep 'freed the pages of slots' |
            sed -n -e "s/^[0-9-]*T\([0-9:.]*\)Z.* pages=\([0-9]*\) took_ms=\([0-9]*\) punches=\([0-9]*\) punched_pages=\([0-9]*\) punch_ms=\([0-9]*\).*/$tag: slots freed at \1: \2 pages in \3 ms; \5 pages given back in \4 hole punches, \6 ms/p" -e t \
                -e "s/^[0-9-]*T\([0-9:.]*\)Z.* pages=\([0-9]*\) took_ms=\([0-9]*\).*/$tag: slots freed at \1: \2 pages in \3 ms/p" | head -n 30
        grep 'Killed process' "/tmp/dmesg.$tag" | sed "s/^/$tag: /" | head -n 30
        # Each OOM kill the daemon saw (src/daemon/oom_victims.rs): when it was done with it,
        # and each process being killed whose memory it released ahead of its exit, held
        # ahead of the kill or found in /proc after it.
        tail -n +$((n0 + 1)) /run/trueno-ublk/ublkb0.log | grep -E 'looked for processes being killed|released the memory of a process' |
            sed -n -e "s/^[0-9-]*T\([0-9:.]*\)Z.* pid=\([0-9]*\) how=\"\([^\"]*\)\" after_kill_seen_ms=\([0-9]*\) took_ms=\([0-9]*\).*/$tag: released at \1: pid \2 (\3), \4 ms after the kill was seen, in \5 ms/p" \
                -e "s/^[0-9-]*T\([0-9:.]*\)Z.* held=\([0-9]*\) released_held=\([0-9]*\) looked_at=\([0-9]*\) released_found=\([0-9]*\) took_ms=\([0-9]*\).*/$tag: an OOM kill seen, done by \1: \3 of \2 held released, \5 more of \4 in \/proc, in \6 ms/p" | head -n 40
        tail -n +$((n0 + 1)) /run/trueno-ublk/ublkb0.log | grep -E 'process_mrelease|release the memory of a process|no memory left to release' | head -n 5
        echo "$tag: the log's time of day $("$VT" clock) s was the kernel's $(cut -d' ' -f1 /proc/uptime) s"
    }
    cat /tmp/oom.victims
    # Its report, written as it ends: without it (not started: a library missing from the tar;
    # killed) the checks below and the comparison with zram would pass on a run that did nothing.
    check "$tag: stress-ng ran and reported the workers' progress (exit $rc)" [ -n "$bogo" ]
    check "$tag: stress-ng's --verify found no corrupted data" [ "$vfail" -eq 0 ]
    check "$tag: stress-ng ended within its time limit (exit $rc)" [ "$rc" -ne 137 ]
    # A count read after the run that came back empty (`stat` itself failed or was killed near
    # OOM) would make the failed writes -w0, so 0 on a fresh device: fail rather than pass.
    check "$tag: the failed-write count was read before and after the run (${w0:-none}, ${w1:-none})" \
        [ "${w0:+read}${w1:+read}" = readread ]
    check "$tag: the wake-up timer survived and reported" [ -n "$delay" ]
    sfigure "${tag}_bogo_ops_s" "${bogo:-0}"
    sfigure "${tag}_work_user_s" "$wuser"
    sfigure "${tag}_work_sys_s" "$wsys"
    sfigure "${tag}_write_errors" "$((w1 - w0))"
    sfigure "${tag}_oom_kills" "$kills"
    sfigure "${tag}_oom_kills_not_workers" "$others"
    sfigure "${tag}_wakeup_max_delay_ms" "${delay:--1}"
    sfigure "${tag}_cpu_idle_s" "$(cpu_seconds /tmp/cpu.before /tmp/cpu.after '^[(]idle')"
    sfigure "${tag}_cpu_kswapd_s" "$(cpu_seconds /tmp/cpu.before /tmp/cpu.after '^[(]kswapd')"
    sfigure "${tag}_direct_reclaim_throttled" "$((h1 - h0))"
    sfigure "${tag}_reclaim_throttle_s" "$(awk '{ for (i = 1; i <= NF; i++) { split($i, p, "/"); s += p[2] } } END { printf "%.1f", s + 0 }' /tmp/throttled)"
    [ "$name" = zram ] || {
        # Each OOM kill is seen by the daemon's releasing thread (src/daemon/oom_victims.rs),
        # which says what it released.
        [ "$kills" -eq 0 ] || check "$tag: the daemon looked for the OOM killer's victims to release their memory ($(tail -n +$((n0 + 1)) /run/trueno-ublk/ublkb0.log | grep -c 'released the memory of a process') released)" \
            eval "tail -n +$((n0 + 1)) /run/trueno-ublk/ublkb0.log | grep -q 'looked for processes being killed after an OOM kill'"
        stat_snapshot /tmp/stat.after
        sfigure "${tag}_oom_kills_asked" "$(stat_delta oom_kills_asked)"
        sfigure "${tag}_deferred_writes" "$(stat_delta deferred)"
        sfigure "${tag}_given_back_past_refill_kB" "$(stat_delta reserve_given_back_past_refill_bytes 1024)"
        sfigure "${tag}_refill_rousings" "$(stat_delta reserve_refill_rousings)"
        sfigure "${tag}_table_spares_taken" "$(stat_delta table_spares_taken)"
        sfigure "${tag}_table_group_waits" "$(stat_delta table_group_waits)"
        sfigure "${tag}_batch_span_grows" "$(stat_delta batch_span_grows)"
        sfigure "${tag}_reserve_split_chunks" "$(stat_delta reserve_split_chunks)"
        sfigure "${tag}_reserve_joined_chunks" "$(stat_delta reserve_joined_chunks)"
        # Ready chunks given back to commit others while memory was short (`steal_for`,
        # `make_room_for`), and takes that found the reserve empty and waited for the refill
        # thread: how the reserve churned.
        sfigure "${tag}_reserve_stolen_kB" "$(stat_delta reserve_stolen_bytes 1024)"
        sfigure "${tag}_reserve_misses" "$(stat_delta reserve_misses)"
        # Writes that waited over a second for memory and were stored all the same, and the
        # longest wait of the device's life so far.
        sfigure "${tag}_long_waited_writes" "$(stat_delta long_waited_writes)"
        sfigure "${tag}_longest_write_wait_ms_so_far" "$(json_field longest_write_wait_ms /tmp/stat.after)"
        sfigure "${tag}_cpu_daemon_s" "$(cpu_seconds /tmp/cpu.before /tmp/cpu.after '^[(](trueno|ublk)')"
    }
}

# sfig TAG NAME: figure TAG_NAME of this stage.
sfig() { sed -n "s/^FIGURE $1_$2=//p" /tmp/stress.figures | tail -n1; }

# stress_compare METHOD MIB: ublk's figures against zram's for one case.
stress_compare() {
    local z u
    z="zram_$(echo "$1" | tr -c 'a-z0-9\n' _)_$2"
    u="ublk_$(echo "$1" | tr -c 'a-z0-9\n' _)_$2"
    if [ "$(sfig "$z" write_errors)" -eq 0 ]; then
        check "$u: no failed swap writes, as on zram ($(sfig "$u" write_errors))" [ "$(sfig "$u" write_errors)" -eq 0 ]
    fi
    if [ "$(sfig "$z" oom_kills_not_workers)" -eq 0 ]; then
        check "$u: the OOM killer killed only workers, as on zram ($(sfig "$u" oom_kills_not_workers) others)" [ "$(sfig "$u" oom_kills_not_workers)" -eq 0 ]
    fi
    check "$u: longest wake-up delay $(sfig "$u" wakeup_max_delay_ms) ms within zram's $(sfig "$z" wakeup_max_delay_ms) ms + 2 s" \
        [ "$(sfig "$u" wakeup_max_delay_ms)" -le $(($(sfig "$z" wakeup_max_delay_ms) + 2000)) ]
    # Issue 16 asks for at least zram's progress; not met yet: said loudly, not checked, so
    # that the figure is there to follow. stress-ng 0.15's bogo ops come in steps: a worker
    # credits its count at the end of each pass of a method over its buffer (`all` starts
    # with one that counts a single op, of the 4096 that make one reported), and at the
    # deadline stress-ng asks it to stop and, where it has not within seconds, kills it: the
    # pass under way is lost, with the worker's CPU time in stress-ng's own figures. While
    # swap thrashes a pass can outlast the run: 0 on either device (zram's in 5 of 10 30 s
    # `all` runs of 2026-12-07 evening). The workers' user CPU time in their cgroup stays
    # whatever happens at the deadline: printed beside it. With one method (move-inv) it is
    # the work of its loop; with `all`, whose methods differ in CPU per page, it runs against
    # stress-ng's count (zram's that evening: 0 bogo ops with 2.6-3.0 s, 18 with 2.3-2.4 s,
    # 33-37 with 1.2-1.3 s), so neither figure alone ranks two runs of `all`.
    echo "$u: workers' CPU s, user (their loops) / system: $(sfig "$u" work_user_s) / $(sfig "$u" work_sys_s) against zram's $(sfig "$z" work_user_s) / $(sfig "$z" work_sys_s)"
    if awk -v u="$(sfig "$u" bogo_ops_s)" -v z="$(sfig "$z" bogo_ops_s)" 'BEGIN { exit !(u + 0 >= z + 0) }'; then
        echo "$u: workers' bogo ops/s $(sfig "$u" bogo_ops_s), at least zram's $(sfig "$z" bogo_ops_s)"
    else
        echo "NOTE: $u: workers' bogo ops/s $(sfig "$u" bogo_ops_s) below zram's $(sfig "$z" bogo_ops_s) (issue 16 goal not met)"
    fi
}

# stress_cases NAME: every case of STRESS_CASES on the active swap device.
stress_cases() {
    local c
    for c in $STRESS_CASES; do
        stress_case "$1" "${c%%:*}" "${c##*:}"
    done
}

# swap_used: the kernel's swap in use, and its swap cache, in kB.
swap_used() {
    awk '/^SwapTotal/ { t = $2 } /^SwapFree/ { f = $2 } /^SwapCached/ { c = $2 }
        END { printf "swap in use %d kB (swap cache %d kB)", t - f, c }' /proc/meminfo
}

# memory_return PID MIB [random]: a program swaps MIB MiB of compressible pages out and exits
# (with `random`: random words, a one-page chunk each in the store, and it is killed with
# SIGKILL, as the OOM killer's move-inv workers are, the time taken from the kill); the serving
# process's RSS must come back within 4 MiB of its idle RSS within 2 s. The program runs in a
# cgroup of its own, reclaimed right after it ends: on a device that completes writes
# asynchronously (any but zram's synchronous one) the kernel keeps the last pages it wrote in
# its swap cache, and their slots stay taken until reclaim drops them (with swap less than
# half full it does not at exit). Dropping them frees the slots, as memory pressure would.
memory_return() {
    local pid=$1 mib=$2 kind=${3:-} idle t0 out prog settle what figure=ublk_memory_return_s
    local cg=/sys/fs/cgroup/pageout
    what="memory return (${mib} MiB${kind:+ $kind})"
    [ -n "$kind" ] && figure=ublk_memory_return_${kind}_s
    idle=$(awk '/^VmRSS/ { print $2 }' "/proc/$pid/status")
    mkdir -p $cg
    if [ -z "$kind" ]; then
        sh -c "echo \$\$ >$cg/cgroup.procs && exec $VT pageout $mib 7" >/tmp/pageout.out 2>&1
        t0=$(now)
        settle=
    else
        sh -c "echo \$\$ >$cg/cgroup.procs && exec $VT pageout $mib 7 $kind wait" >/tmp/pageout.out 2>&1 &
        prog=$!
        wait_until 120 grep -q PAGEOUT_SWAPPED_KB /tmp/pageout.out || echo "$what: not paged out within 120 s"
        # Its pages' writes done and their swap cache dropped before the kill: a page still
        # in the swap cache when its process dies keeps its slot (with swap less than half
        # full the kernel does not free it at exit), and reclaim right after the kill may meet
        # it still under writeback (seen 2026-11-30: 11 MiB left in the swap cache 10 s on).
        wait_until 10 awk '/^Writeback:/ { exit $2 != 0 }' /proc/meminfo ||
            echo "$what: writeback still under way after 10 s"
        echo 256M >$cg/memory.reclaim 2>/dev/null
        echo "before the kill, its cgroup reclaimed: $(swap_used)"
        # Timed from before the kill: RSS is above the limit until the store frees the pages.
        $VT rss-settle "$pid" $((idle + 4096)) 10 >/tmp/settle.out &
        settle=$!
        t0=$(now)
        kill -9 $prog
        wait $prog 2>/dev/null
    fi
    echo "after the program ended: $(swap_used)"
    echo 256M >$cg/memory.reclaim 2>/dev/null
    echo "after reclaiming the program's cgroup: $(swap_used)"
    if [ -n "$settle" ]; then
        wait $settle
        out=$(cat /tmp/settle.out)
    else
        out=$($VT rss-settle "$pid" $((idle + 4096)) 10)
    fi
    echo "$out"
    echo "$(since "$t0") s after the program ended: $(swap_used)"
    cat /tmp/pageout.out
    trueno-ublk stat
    grep -E '^(VmRSS|RssAnon|RssFile|RssShmem)' "/proc/$pid/status"
    rmdir $cg
    check "$what: the program swapped out ($(sed -n 's/^PAGEOUT_SWAPPED_KB=//p' /tmp/pageout.out) kB)" \
        [ "$(sed -n 's/^PAGEOUT_SWAPPED_KB=//p' /tmp/pageout.out)" -gt $((mib * 512)) ]
    sfigure $figure "$(echo "$out" | sed -n 's/^RSS_SETTLE_S=//p')"
    check "$what: serving process's RSS back within 4 MiB of idle ($idle kB) within 2 s: $(echo "$out" | tr '\n' ' ')" \
        awk -v s="$(echo "$out" | sed -n 's/^RSS_SETTLE_S=//p')" 'BEGIN { exit !(s >= 0 && s <= 2) }'
}

# rss_by_mapping PID [MIN_KB]: what PID's resident memory is made of, summed per mapping name from
# /proc/PID/smaps (anonymous mappings without a name are thread stacks, glibc's per-thread
# malloc arenas and mmaps), largest first, then each mapping with at least MIN_KB (128) of it:
# the account of the idle footprint in docs/limits.md.
rss_by_mapping() {
    awk '/^[0-9a-f]+-[0-9a-f]+ / { name = (NF >= 6 ? $6 : "[anonymous]"); next }
         /^Rss:/ { rss[name] += $2; n[name]++ }
         END { for (k in rss) if (rss[k] > 0) printf "rss by mapping: %7d kB %4d mappings  %s\n", rss[k], n[k], k }' \
        "/proc/$1/smaps" | sort -k4 -n -r
    awk '/^[0-9a-f]+-[0-9a-f]+ / { split($1, r, "-"); name = (NF >= 6 ? $6 : "[anonymous]"); next }
         /^Size:/ { size = $2 }
         /^Rss:/ && $2 >= min { printf "rss by mapping:   %7d of %8d kB  %s %s\n", $2, size, r[1], name }' \
        min="${2:-128}" "/proc/$1/smaps"
    echo "threads:$(cat /proc/"$1"/task/*/comm | sort | uniq -c | tr -s ' ' | tr '\n' ',')"
}

# thread_faults PID: "NAME FAULTS" for each thread of PID: its minor and major page faults so
# far (/proc/PID/task/*/stat).
thread_faults() {
    cat /proc/"$1"/task/*/stat 2>/dev/null | awk '{
        name = substr($0, index($0, "(") + 1)
        name = substr(name, 1, index(name, ")") - 1)
        split(substr($0, index($0, ") ") + 2), f, " ")
        print name, f[8] + f[10] }'
}

# io_alloc_trace_on: records, in a trace instance of its own, every allocation of a page for
# user memory (`__GFP_MOVABLE`: anonymous, shared memory, page cache) made by a thread named
# as the serving process's I/O threads that compress or serve requests, or by `dd` (the
# control: `io_alloc_trace_take` runs one, so that a trace that records nothing fails).
# Armed before zram's cases, though it counts only ours (`io_alloc_trace_clear` at idle): the
# kernel evaluates the filters at every page fault and page allocation in the VM, so armed for
# trueno-ublk's cases alone (until 2026-12-06) that cost fell on its workers only.
IO_TRACE=$TRACE/instances/io_allocs
IO_THREADS='comm ~ "ublk*-q*" || comm == "trueno-flusher" || comm ~ "trueno-pool*" || comm == "trueno-recompre"'
io_alloc_trace_on() {
    mkdir -p $IO_TRACE 2>/dev/null || return 0
    [ -e $IO_TRACE/events/kmem/mm_page_alloc/filter ] || return 0
    echo "($IO_THREADS || comm == \"dd\") && gfp_flags & 8" \
        >$IO_TRACE/events/kmem/mm_page_alloc/filter || return 0
    # Their page faults too, so that an allocation's address can be found (the fault before it).
    echo "$IO_THREADS" >$IO_TRACE/events/exceptions/page_fault_user/filter 2>/dev/null &&
        echo 1 >$IO_TRACE/events/exceptions/page_fault_user/enable
    echo 1 >$IO_TRACE/events/kmem/mm_page_alloc/enable
}

# io_alloc_trace_clear: what the trace recorded so far dropped (the daemon's start-up).
io_alloc_trace_clear() {
    [ -e $IO_TRACE/trace ] && : >$IO_TRACE/trace
    return 0
}

# io_alloc_trace_take: "CONTROL IO" (the control's allocations, the I/O threads'), then those of
# the I/O threads, a line each (nothing where there is no trace); stops the trace.
io_alloc_trace_take() {
    [ -e $IO_TRACE/trace ] || return 0
    dd if=/dev/zero of=/dev/null bs=1M count=1 2>/dev/null
    echo 0 >$IO_TRACE/events/kmem/mm_page_alloc/enable
    echo 0 >$IO_TRACE/events/exceptions/page_fault_user/enable 2>/dev/null
    grep -v '^#' $IO_TRACE/trace | grep -v ' page_fault_user: ' >/tmp/io_allocs
    echo "$(grep -c '^ *dd-' /tmp/io_allocs) $(grep -vc '^ *dd-' /tmp/io_allocs)"
    grep -v '^ *dd-' /tmp/io_allocs | head -20
}

# io_trace_faults_and_maps PID: the I/O threads' traced page faults and allocations in order,
# and PID's mappings: where an allocation happened (the fault just before it).
io_trace_faults_and_maps() {
    [ -e $IO_TRACE/trace ] || return 0
    grep -v '^#' $IO_TRACE/trace | grep -v '^ *dd-' | tail -60
    cat "/proc/$1/maps"
}

# rss_kib PID: VmRSS of PID in KiB (0 if it is gone).
rss_kib() { awk '/^VmRSS/ { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }

# rss_settle_beside_data PID IDLE_KB TIMEOUT_S: polls every 0.1 s until PID's RSS less the
# memory of the pages its store still holds (`stat --json`'s mem_used, and table_bytes: the
# page table's part for the parts of the device that hold them, which the idle RSS does not
# have) is within 4 MiB of IDLE_KB; prints RSS_SETTLE_S (-1 if it never was), and
# RSS_SETTLE_KB, DATA_KB and TABLE_KB as last seen (and, if it never was, the store's other memory).
rss_settle_beside_data() {
    local pid=$1 idle=$2 t0 rss json data table i
    t0=$(cut -d' ' -f1 /proc/uptime)
    for i in $(seq 0 $(($3 * 10))); do
        rss=$(rss_kib "$pid")
        json=$(trueno-ublk stat --json 2>/dev/null)
        data=$(echo "$json" | grep -o '"mem_used": *[0-9]*' | head -1 | grep -o '[0-9]*$')
        table=$(echo "$json" | grep -o '"table_bytes": *[0-9]*' | head -1 | grep -o '[0-9]*$')
        data=$((${data:-0} / 1024))
        table=$((${table:-0} / 1024))
        if [ $((rss - data - table)) -le $((idle + 4096)) ]; then
            awk -v a="$(cut -d' ' -f1 /proc/uptime)" -v b="$t0" 'BEGIN { printf "RSS_SETTLE_S=%.2f\n", a - b }'
            echo "RSS_SETTLE_KB=$rss DATA_KB=$data TABLE_KB=$table"
            return
        fi
        sleep 0.1
    done
    echo "RSS_SETTLE_S=-1.00"
    echo "RSS_SETTLE_KB=$rss DATA_KB=$data TABLE_KB=$table"
    # What the store holds beside the data, to tell which part stayed.
    echo "$json" | grep -oE '"(reserve_bytes|metadata_bytes|batch_buffer_bytes|memory_short|pending_pages)": *[0-9a-z]*' |
        tr -d ' "' | tr '\n' ' '
    echo
}

stress_phase() {
    local pid sup sby p idle out
    section "near OOM: stress-ng vm ($STRESS_CASES, ${STRESS_S} s) on zram, then trueno-ublk"
    if ! stress_unpack; then
        fail "stress-ng could not be unpacked from /dev/vda"
        return
    fi
    : >/tmp/stress.figures
    throttle_trace_on
    oom_trace_on
    io_alloc_trace_on
    zram_up
    "$UL"/mkswap /dev/zram0 >/dev/null
    check "zram: swapon -d /dev/zram0" "$UL"/swapon -d /dev/zram0
    stress_cases zram
    "$UL"/swapoff /dev/zram0 || fail "zram: swapoff after stress-ng"
    echo 1 >/sys/block/zram0/reset
    # shellcheck disable=SC2086 # word splitting wanted
    if ! trueno-ublk create --size 1G $CREATE_ARGS >/tmp/create.out 2>&1; then
        cat /tmp/create.out
        fail "trueno-ublk create --size 1G for the stress stage"
        return
    fi
    # Idle: the standby made and ready, nothing stored.
    wait_until 20 eval "[ \$(pidof trueno-ublk | wc -w) -eq 3 ] && grep -q 'standby ready' /run/trueno-ublk/ublkb0.log" ||
        echo "no standby ready within 20 s"
    usleep 500000
    pid=$(serving_pid 0)
    sup=$(awk '/^PPid:/ { print $2 }' "/proc/$pid/status")
    sby=$(for p in $(pidof trueno-ublk); do [ "$p" != "$pid" ] && [ "$p" != "$sup" ] && echo "$p"; done)
    grep -E '^(VmRSS|RssAnon|RssFile|RssShmem|VmLck)' "/proc/$pid/status"
    idle=$(rss_kib "$pid")
    echo "idle RSS (KiB): serving process $idle, supervisor $(rss_kib "$sup"), standby $(rss_kib "$sby")"
    sfigure ublk_idle_rss_kB "$(rss_kib "$pid")"
    thread_faults "$pid" >/tmp/faults.idle
    daemons_idle=$(pidof trueno-ublk)
    io_alloc_trace_clear
    sfigure ublk_idle_rss_all_processes_kB "$(($(rss_kib "$pid") + $(rss_kib "$sup") + $(rss_kib "$sby")))"
    # Quiet: nothing written for seconds, the chunk reserve down to a quarter of its target.
    sleep 3
    echo "quiet RSS (KiB): serving process $(rss_kib "$pid")"
    sfigure ublk_quiet_rss_kB "$(rss_kib "$pid")"
    rss_by_mapping "$pid"
    trueno-ublk stat
    "$UL"/mkswap /dev/ublkb0 >/dev/null
    check "ublk: swapon -d /dev/ublkb0" "$UL"/swapon -d /dev/ublkb0
    memory_return "$pid" 200
    memory_return "$pid" 64 random
    stress_cases ublk
    for p in $STRESS_CASES; do
        stress_compare "${p%%:*}" "${p##*:}"
    done
    # The threads that serve requests and compress allocate no page of user memory once readied
    # (their stacks and heap are faulted in up front, `mem::prepare_io_thread`): near OOM such
    # an allocation waits in reclaim for the very swap-outs they serve (with less heap faulted
    # in for them, tried on 2026-12-06, the flusher did, and swap stalled for good). The refill
    # thread commits memory, and the main thread may, by design. Their page faults are
    # counted too, but are none of that where they were traced (2026-12-06): pages there all
    # along, most likely being moved by compaction (locked memory is not pinned).
    io_allocs=$(io_alloc_trace_take)
    # Judged only with the same processes as at idle: a new one's threads fault theirs in.
    if [ "$(pidof trueno-ublk)" = "$daemons_idle" ] && [ -n "$io_allocs" ]; then
        out=$(thread_faults "$pid" | awk 'NR == FNR { before[$1] = $2; next }
            $1 ~ /^(ublk[0-9]+-q[0-9]+|trueno-flusher|trueno-pool[0-9]+|trueno-recompre)$/ {
                d = $2 - before[$1]; total += d; line = line " " $1 "=" d }
            END { print total + 0 line }' /tmp/faults.idle -)
        echo "page faults of the I/O threads during the cases:${out#* }"
        sfigure ublk_io_thread_faults "${out%% *}"
        echo "$io_allocs" | sed 1d
        counts=$(echo "$io_allocs" | head -1)
        control=${counts%% *} allocs=${counts##* }
        sfigure ublk_io_thread_page_allocations "$allocs"
        check "the trace of page allocations records (the control dd's: $control)" [ "$control" -gt 0 ]
        check "the serving process's I/O threads allocated no page of user memory during the cases ($allocs)" [ "$allocs" -eq 0 ]
        if [ "$allocs" -gt 0 ]; then io_trace_faults_and_maps "$pid"; fi
    else
        echo "I/O threads' faults and page allocations: not counted (a daemon process ended or started since idle, or no trace)"
    fi
    # Memory follows the data after the cases too: their workers are gone and so are their
    # pages, so the serving process comes back within 4 MiB of its idle RSS (its chunk lists
    # and the reserve's cold list made small again, issue 16), beside the memory of the pages
    # other programs (the shell, the test's own) still have swapped out, which the store keeps
    # with the page table's groups they are in.
    out=$(rss_settle_beside_data "$(serving_pid 0)" "$idle" 10)
    echo "after the stress cases: $out"
    sfigure ublk_rss_after_stress_settle_s "$(echo "$out" | sed -n 's/^RSS_SETTLE_S=//p')"
    check "after the stress cases: serving process's RSS, less the memory of the pages still stored and their table, back within 4 MiB of its idle RSS ($idle kB) within 10 s: $(echo "$out" | tr '\n' ' ')" \
        awk -v s="$(echo "$out" | sed -n 's/^RSS_SETTLE_S=//p')" 'BEGIN { exit !(s >= 0 && s <= 10) }'
    trueno-ublk stat
    echo "RSS now (KiB): serving process $(rss_kib "$(serving_pid 0)"), supervisor $(rss_kib "$sup")"
    rss_by_mapping "$(serving_pid 0)" 8
    "$UL"/swapoff /dev/ublkb0 || fail "ublk: swapoff after stress-ng"
    check "trueno-ublk delete --id 0 after the stress stage" trueno-ublk delete --id 0
    rm -rf $SNG
}
