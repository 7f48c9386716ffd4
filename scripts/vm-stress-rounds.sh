#!/usr/bin/env bash
# The near-OOM stage, ROUNDS times: one VM per round (`scripts/vm-test.sh --stress`, so each
# round starts with fresh memory), then a table per case of how often each device did what
# issue 16 counts over many runs: kernel zram's own writes fail near OOM in some runs and not
# in others, so one run's "ours failed where zram did not" says little; the frequencies do.
#
#   scripts/vm-stress-rounds.sh ROUNDS [LOGDIR]
#
# Every knob of scripts/vm-test.sh applies (STRESS_CASES, STRESS_S, TRUENO_UBLK_BIN, ...).
# Each round's log goes to LOGDIR (default .vm/stress-rounds/<date>), with the whole VM console
# of a round that failed; the table is printed at the end and kept in LOGDIR/summary. A round
# that ends without figures for a case (a panic, a hang, the watchdog, the test's shell killed)
# counts as lost for that case. Per case and device:
#   runs          rounds with figures for the case
#   failed-writes rounds in which any swap write failed
#   other-kills   rounds in which the OOM killer killed anything but the workers
#   wake-up ms    the longest wake-up delay: median and worst of the rounds
#   bogo ops/s    the workers' progress as stress-ng counts it: median of the rounds
#   user CPU s    the workers' user CPU time, kept for a pass cut short at the deadline (which
#                 stress-ng's count loses): median; the work of the loop of a single method
#                 (move-inv), not comparable between runs of `all` (see stress_compare)
#   idle CPU s    seconds the VM's CPUs idled during the run (of STRESS_S x 2): median
#   throttle s    seconds tasks slept in the kernel's reclaim_throttle during the run, summed
#                 over tasks (where the VM's kernel has the trace event): median
# and for trueno-ublk, rounds that failed the stage's own checks against zram's in the same VM:
# failed writes where zram's failed none, a wake-up over zram's + 2 s. Last, over the rounds
# that counted them: in how many the serving process's I/O threads allocated memory during the
# cases (the stage fails such a round), and the median of their page faults.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${1:?usage: scripts/vm-stress-rounds.sh ROUNDS [LOGDIR]}
DIR=${2:-$ROOT/.vm/stress-rounds/$(date -u +%Y%m%d-%H%M%S)}
VM_DIR=$ROOT/.vm # scripts/vm-test.sh's, where its VM console is
mkdir -p "$DIR"

for round in $(seq 1 "$ROUNDS"); do
    echo "[vm-stress-rounds $(date -u +%H:%M:%S)] round $round of $ROUNDS: $DIR/round-$round.log"
    if bash "$ROOT/scripts/vm-test.sh" --stress >"$DIR/round-$round.log" 2>&1; then
        echo "  stage passed"
    else
        echo "  stage failed: $(grep -a -m3 '^FAIL' "$DIR/round-$round.log" | tr '\n' ' ')"
        # The whole console (the round's log has its last lines): the kernel's task dumps.
        cp "$VM_DIR/console.log" "$DIR/console-$round.log" 2>/dev/null || true
    fi
done

# "FIGURE <device>_<method>_<mib>_<name>=<value>" lines, the last of each name per round.
for round in $(seq 1 "$ROUNDS"); do
    grep -a -o '^FIGURE \(ublk\|zram\)_[a-z0-9_]*=[-0-9.]*' "$DIR/round-$round.log" |
        sed "s/^FIGURE /$round /; s/=/ /" || true
done | awk -v rounds="$ROUNDS" '
function median(list,    n, a, i, j, t) {
    n = split(list, a, " ")
    if (n == 0) return "-"
    for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) {
        t = a[j]; a[j] = a[j - 1]; a[j - 1] = t
    }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
{
    round = $1; key = $2; value = $3
    if (key == "ublk_io_thread_page_allocations") allocs[round] = value
    if (key == "ublk_io_thread_faults") faults[round] = value
    for (n = split("write_errors oom_kills_not_workers wakeup_max_delay_ms bogo_ops_s work_user_s cpu_idle_s reclaim_throttle_s", names, " "); n > 0; n--) {
        suffix = "_" names[n]
        if (substr(key, length(key) - length(suffix) + 1) == suffix) {
            tag = substr(key, 1, length(key) - length(suffix))
            fig[round, tag, names[n]] = value
            kase = substr(tag, 6)
            if (!(kase in seen)) { seen[kase] = 1; cases[++ncases] = kase }
        }
    }
}
END {
    printf "%-14s %-6s %5s %14s %12s %19s %11s %10s %10s %10s\n", "case", "device", "runs", "failed-writes", "other-kills", "wake-up ms (med/max)", "bogo ops/s", "user CPU s", "idle CPU s", "throttle s"
    for (c = 1; c <= ncases; c++) {
        kase = cases[c]
        for (d = 1; d <= 2; d++) {
            device = d == 1 ? "zram" : "ublk"; tag = device "_" kase
            runs = failed = others = 0; worst = 0; wakes = bogos = users = idles = throttles = ""
            for (r = 1; r <= rounds; r++) {
                if (!((r, tag, "write_errors") in fig)) continue
                runs++
                failed += fig[r, tag, "write_errors"] > 0
                others += fig[r, tag, "oom_kills_not_workers"] > 0
                w = fig[r, tag, "wakeup_max_delay_ms"]; wakes = wakes " " w
                if (w + 0 > worst) worst = w + 0
                bogos = bogos " " fig[r, tag, "bogo_ops_s"]
                if ((r, tag, "work_user_s") in fig) users = users " " fig[r, tag, "work_user_s"]
                if ((r, tag, "cpu_idle_s") in fig) idles = idles " " fig[r, tag, "cpu_idle_s"]
                if ((r, tag, "reclaim_throttle_s") in fig) throttles = throttles " " fig[r, tag, "reclaim_throttle_s"]
            }
            printf "%-14s %-6s %5d %14d %12d %12s/%-6d %11s %10s %10s %10s\n", kase, device, runs, failed, others, median(wakes), worst, median(bogos), median(users), median(idles), median(throttles)
        }
        worse_writes = worse_wake = lost = 0
        for (r = 1; r <= rounds; r++) {
            z = "zram_" kase; u = "ublk_" kase
            if (!((r, u, "write_errors") in fig)) { lost++; continue }
            if (!((r, z, "write_errors") in fig)) continue
            worse_writes += fig[r, z, "write_errors"] == 0 && fig[r, u, "write_errors"] > 0
            worse_wake += fig[r, u, "wakeup_max_delay_ms"] > fig[r, z, "wakeup_max_delay_ms"] + 2000
        }
        printf "%-14s ublk against zram in the same VM: %d of %d rounds failed writes where zram failed none, %d woke over zram + 2 s, %d lost\n", kase, worse_writes, rounds, worse_wake, lost
    }
    counted = allocating = 0; faulted = ""
    for (r = 1; r <= rounds; r++) {
        if (!(r in allocs)) continue
        counted++; allocating += allocs[r] > 0; faulted = faulted " " faults[r]
    }
    printf "I/O threads (queue, pool, flusher, recompressor): allocated memory during the cases in %d of %d rounds counted; page faults, median %s\n", allocating, counted, median(faulted)
}' | tee "$DIR/summary"
