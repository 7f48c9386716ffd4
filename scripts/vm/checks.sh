# shellcheck shell=dash
# Sourced by the VM's test scripts (test.sh under busybox sh, systemd-test.sh under bash): how
# a check is counted and reported to the host, which reads "ok:"/"FAIL:" and "FIGURE name=value"
# lines from the console. FIGURES_LOG, when set, keeps a copy of each figure (test.sh prints
# them again at its end).
FAILS=0
CHECKS=0

ok() {
    CHECKS=$((CHECKS + 1))
    echo "ok: $*"
}
fail() {
    CHECKS=$((CHECKS + 1))
    FAILS=$((FAILS + 1))
    echo "FAIL: $*"
}
check() { # description command...
    local desc=$1
    shift
    if "$@"; then ok "$desc"; else fail "$desc"; fi
}
figure() {
    echo "FIGURE $1=$2"
    if [ -n "${FIGURES_LOG:-}" ]; then echo "FIGURE $1=$2" >>"$FIGURES_LOG"; fi
}
vmstat_of() { awk -v k="$1" '$1 == k { print $2 }' /proc/vmstat; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
section() {
    echo
    echo "=== $* (t=$(uptime_s) s)"
}
