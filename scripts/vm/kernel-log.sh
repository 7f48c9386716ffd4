# Sourced by the VM's scripts (test.sh, bench.sh; busybox sh): what in the kernel log makes a
# run fail.
#
#   kernel_log_errors FILE   print each bad line of FILE (a saved dmesg) with the lines around
#                            it (a call trace's first lines say what printed it); status 0 if
#                            there was one, 1 if none
kernel_log_errors() {
    # One extended regular expression (busybox's shell has no arrays).
    bad='[Uu][Bb][Ll][Kk].*([Ee]rror|[Ff]ail|[Tt]imeout|[Aa]bort)'
    bad="$bad|hung_task|blocked for more than|BUG:|Oops:|WARNING:|Call Trace|general protection"
    bad="$bad|Out of memory|oom-kill|soft lockup"
    bad="$bad|Write-error on swap-device|Read-error on swap-device|I/O error|resource error"
    grep -qE "$bad" "$1" || return 1
    grep -E -B 4 -A 16 "$bad" "$1" | head -n 200
}
