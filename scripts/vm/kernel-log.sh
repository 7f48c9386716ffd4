# Sourced by the VM's scripts (test.sh, bench.sh; busybox sh): what in the kernel log makes a
# run fail.
#
#   kernel_log_errors FILE   print each bad line of FILE (a saved dmesg) with the lines around
#                            it (a call trace's first lines say what printed it); status 0 if
#                            there was one, 1 if none
#   kernel_swap_table_reports FILE
#                            a note with the first line of each report of the kernel's own
#                            swap-table allocation failing (see below), which
#                            kernel_log_errors passes; nothing if there was none

# One extended regular expression (busybox's shell has no arrays).
KERNEL_LOG_BAD='[Uu][Bb][Ll][Kk].*([Ee]rror|[Ff]ail|[Tt]imeout|[Aa]bort)'
KERNEL_LOG_BAD="$KERNEL_LOG_BAD|hung_task|blocked for more than|BUG:|Oops:|WARNING:|Call Trace"
KERNEL_LOG_BAD="$KERNEL_LOG_BAD|general protection|Out of memory|oom-kill|soft lockup"
KERNEL_LOG_BAD="$KERNEL_LOG_BAD|Write-error on swap-device|Read-error on swap-device|I/O error"
KERNEL_LOG_BAD="$KERNEL_LOG_BAD|resource error"

# Since 6.18 the kernel gives each swap cluster in use a table, allocated when swap-out in
# reclaim takes a fresh cluster; where its first try (no sleep, no warning) fails it tries
# again with GFP_KERNEL|__GFP_NOMEMALLOC and no __GFP_NOWARN, which inside reclaim cannot
# reclaim, so near OOM it fails with a `page allocation failure` report (call trace, memory
# dump) and the allocator takes another cluster or leaves the page in memory. Nothing of the
# device: 6.18.15 printed two such reports during zram's swap runs and two during ours in the
# same VM (2026-11-28). Such a report, from its first line to the end of its memory dump
# (`pages hwpoisoned`), with `isolate_lock_cluster` (where the table is allocated) in its call
# trace, is taken out before the check; a bad line of anything else printed in between stays.
#
# kernel_log_sift MODE FILE: FILE without those reports (MODE checked) or their first lines
# (MODE reports). A report the log cuts off before its end stays in.
kernel_log_sift() {
    awk -v mode="$1" -v bad="$KERNEL_LOG_BAD" '
        function emit(line) { if (mode == "checked") print line }
        function finish(swap_table,  i) {
            if (swap_table && mode == "reports") print block[0]
            for (i = 0; i < n; i++)
                if (!swap_table || (block[i] ~ bad && block[i] !~ /Call Trace/)) emit(block[i])
            n = 0; inside = 0; table = 0
        }
        /page allocation failure/ { if (inside) finish(0); inside = 1 }
        inside {
            block[n++] = $0
            if ($0 ~ /isolate_lock_cluster/) table = 1
            if ($0 ~ /pages hwpoisoned/) finish(table)
            next
        }
        { emit($0) }
        END { if (inside) finish(0) }
    ' "$2"
}

kernel_log_errors() {
    kernel_log_sift checked "$1" >"$1.checked"
    grep -qE "$KERNEL_LOG_BAD" "$1.checked" || return 1
    grep -E -B 4 -A 16 "$KERNEL_LOG_BAD" "$1.checked" | head -n 200
}

kernel_swap_table_reports() {
    kernel_log_sift reports "$1" >"$1.reports"
    [ -s "$1.reports" ] || return 0
    echo "note: the kernel's own swap-table allocation failed near OOM (6.18 and later, with zram too; not an error):"
    cat "$1.reports"
}
