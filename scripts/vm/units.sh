# shellcheck shell=dash
# The systemd units' start and stop sequence, run without systemd, from the unit files
# themselves (so the test cannot drift from them). Sourced by test.sh (busybox sh).
#
# unit_lines FILE KEY INSTANCE prints, in order, the values of KEY (ExecStartPre, ExecStart,
# ExecStartPost, ExecStop, ExecStopPost, Type, KillSignal, ...) in the [Service] section, as
# systemd reads them: continuation lines joined, comments skipped, an empty assignment
# resetting the list, and the specifiers %i %I %n %N %p %P %t %% replaced (any other
# specifier is an error).
#
# unit_exec LINE runs one Exec line: systemd's prefixes '-' (failure ignored), '@' (the second
# word is argv[0]: dropped), ':' and '+', '!', '!!' (privilege and expansion variants; as root
# without a sandbox they change nothing here) are handled; a bare executable name is looked up
# in systemd's fixed search path (busybox's shell would otherwise run its own applet); the
# rest is given to sh, whose word splitting, quoting and $VAR expansion match systemd's for
# the command lines units use.

unit_lines() { # FILE KEY INSTANCE
    local file=$1 key=$2 inst=$3 unit prefix
    unit=$(basename "$file")
    prefix=${unit%%@*}
    awk -v key="$key" -v inst="$inst" -v unit="${unit%@.service}@$inst.service" -v prefix="$prefix" '
        function specifiers(s,    out, c) {
            out = ""
            while ((i = index(s, "%")) > 0) {
                out = out substr(s, 1, i - 1)
                c = substr(s, i + 1, 1)
                if (c == "i" || c == "I") out = out inst
                else if (c == "n") out = out unit
                else if (c == "N") out = out substr(unit, 1, length(unit) - 8)
                else if (c == "p" || c == "P") out = out prefix
                else if (c == "t") out = out "/run"
                else if (c == "%") out = out "%"
                else { print "unit_lines: unsupported specifier %" c " in " FILENAME > "/dev/stderr"; exit 1 }
                s = substr(s, i + 2)
            }
            return out s
        }
        {
            line = $0
            while (line ~ /\\$/ && (getline next_line) > 0)
                line = substr(line, 1, length(line) - 1) " " next_line
            sub(/^[ \t]+/, "", line)
            if (line ~ /^[#;]/ || line == "") next
            if (line ~ /^\[/) { section = line; next }
            if (section != "[Service]") next
            eq = index(line, "=")
            if (eq == 0) next
            k = substr(line, 1, eq - 1)
            sub(/[ \t]+$/, "", k)
            if (k != key) next
            v = substr(line, eq + 1)
            sub(/^[ \t]+/, "", v)
            if (v == "") { n = 0; next }
            values[++n] = specifiers(v)
        }
        END { for (j = 1; j <= n; j++) print values[j] }
    ' "$file"
}

unit_resolve() { # NAME: the executable as systemd finds it
    local d
    case "$1" in
    /*) echo "$1" ;;
    *)
        for d in /usr/local/sbin /usr/local/bin /usr/sbin /usr/bin /sbin /bin; do
            if [ -x "$d/$1" ]; then
                echo "$d/$1"
                return
            fi
        done
        echo "$1"
        ;;
    esac
}

unit_exec() { # LINE
    local line=$1 ignore=0 at=0 exe rest rc
    while :; do
        case "$line" in
        -*) ignore=1 line=${line#-} ;;
        @*) at=1 line=${line#@} ;;
        :* | +* | !*) line=${line#?} ;;
        *) break ;;
        esac
    done
    # The executable is the first word; the rest keeps its quoting for sh.
    line=$(echo "$line" | tr '\t' ' ' | sed 's/^ *//')
    exe=$(unit_resolve "${line%% *}")
    rest=""
    case "$line" in *" "*) rest=${line#* } ;; esac
    if [ "$at" -eq 1 ]; then
        rest=$(echo "$rest" | sed 's/^ *[^ ]*//')
    fi
    echo "+ $exe $rest"
    sh -c "exec $exe $rest"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        if [ "$ignore" -eq 1 ]; then
            echo "  (exit $rc, ignored: '-' prefix)"
            return 0
        fi
        echo "  (exit $rc)"
    fi
    return $rc
}

unit_exec_all() { # FILE KEY INSTANCE: runs each line; stops at the first failure
    local l
    unit_lines "$1" "$2" "$3" >/tmp/unit-lines || return 1
    while IFS= read -r l; do
        unit_exec "$l" </dev/null || return 1
    done </tmp/unit-lines
}

unit_value() { # FILE KEY INSTANCE DEFAULT: the last value of a single-valued key
    local v
    v=$(unit_lines "$1" "$2" "$3" | tail -n 1)
    echo "${v:-$4}"
}

# The config's value of KEY for [ublkbN], or DEFAULT.
conf_value() { # FILE SECTION KEY DEFAULT
    local v
    v=$(awk -v sec="[$2]" -v key="$3" '
        /^[ \t]*[#;]/ { next }
        /^[ \t]*\[/ { gsub(/[ \t]/, ""); in_sec = ($0 == sec); next }
        in_sec && index($0, "=") {
            k = substr($0, 1, index($0, "=") - 1); gsub(/[ \t]/, "", k)
            if (k == key) { v = substr($0, index($0, "=") + 1); gsub(/^[ \t]+|[ \t]+$/, "", v); val = v }
        }
        END { print val }' "$1" 2>/dev/null)
    echo "${v:-$4}"
}

# Start both units for device 0 (the daemon's first: the swap unit BindsTo= and is After= it),
# memory pressure, `stat`, then stop in the reverse order, as systemd would.
units_phase() {
    section "systemd units: start and stop sequence from the unit files"
    D=/etc/systemd/system/trueno-ublk@.service
    S=/etc/systemd/system/trueno-ublk-swap@.service
    if [ ! -f "$D" ] || [ ! -f "$S" ]; then
        fail "systemd/trueno-ublk@.service and systemd/trueno-ublk-swap@.service are missing"
        return
    fi
    I=0
    for u in "$D" "$S"; do
        check "$(basename "$u") sets no Environment/EnvironmentFile (not emulated here)" \
            not grep -qE '^(Environment|EnvironmentFile)=' "$u"
    done
    check "the swap unit binds to the daemon unit" grep -q "^BindsTo=trueno-ublk@%i.service" "$S"
    check "the swap unit is ordered after the daemon unit" grep -q "^After=trueno-ublk@%i.service" "$S"
    for key in ExecStartPre ExecStart ExecStartPost ExecStop ExecStopPost; do
        unit_lines "$D" $key $I | sed "s/^/trueno-ublk@$I.service $key=/"
        unit_lines "$S" $key $I | sed "s/^/trueno-ublk-swap@$I.service $key=/"
    done
    prio=$(conf_value /etc/trueno-ublk.conf "ublkb$I" swap-priority 100)
    echo "config: /etc/trueno-ublk.conf, [ublkb$I] swap-priority = $prio"

    # trueno-ublk@0.service
    dtype=$(unit_value "$D" Type $I simple)
    check "trueno-ublk@.service is Type=notify" [ "$dtype" = notify ]
    unit_exec_all "$D" ExecStartPre $I || fail "trueno-ublk@$I ExecStartPre"
    unit_lines "$D" ExecStart $I >/tmp/unit-lines
    check "trueno-ublk@.service has one ExecStart" [ "$(wc -l </tmp/unit-lines)" -eq 1 ]
    start=$(sed 's/^[-@:+!]*//' /tmp/unit-lines)
    # shellcheck disable=SC2086 # word splitting wanted
    set -- $start
    exe=$(unit_resolve "$1")
    shift
    echo "+ $exe $* (Type=notify, NOTIFY_SOCKET set)"
    t0=$(now)
    $VT notify-run 60 /tmp/unit-daemon.state "$exe" "$@" >/tmp/unit-daemon.log 2>&1 &
    wait_until 60 grep -qE '^(ready|exit|timeout)' /tmp/unit-daemon.state
    cat /tmp/unit-daemon.log
    if ! grep -q '^ready' /tmp/unit-daemon.state; then
        fail "trueno-ublk@$I.service: no READY=1 ($(tr '\n' ' ' </tmp/unit-daemon.state))"
        return
    fi
    MAINPID=$(sed -n 's/^pid //p' /tmp/unit-daemon.state)
    ok "trueno-ublk@$I.service sent READY=1 after $(sed -n 's/^ready //p' /tmp/unit-daemon.state) s (main pid $MAINPID)"
    figure unit_ready_s "$(sed -n 's/^ready //p' /tmp/unit-daemon.state)"
    check "/dev/ublkb$I is live when READY=1 arrives" test -b /dev/ublkb$I
    export MAINPID
    check "trueno-ublk@$I ExecStartPost" unit_exec_all "$D" ExecStartPost $I

    # trueno-ublk-swap@0.service (Type=oneshot: each ExecStart in turn)
    check "trueno-ublk-swap@.service is Type=oneshot" [ "$(unit_value "$S" Type $I simple)" = oneshot ]
    started=0
    if unit_exec_all "$S" ExecStartPre $I && unit_exec_all "$S" ExecStart $I &&
        unit_exec_all "$S" ExecStartPost $I; then
        started=1
    fi
    check "trueno-ublk-swap@$I.service started" [ "$started" -eq 1 ]
    cat /proc/swaps
    got=$(awk -v d=/dev/ublkb$I '$1 == d { print $5 }' /proc/swaps)
    check "/proc/swaps lists /dev/ublkb$I with the configured priority $prio (got '$got')" [ "$got" = "$prio" ]

    if [ "$started" -eq 1 ]; then
        # The configured device is smaller than the 1 GiB one (size = ram / 2 by default):
        # fill what is available now plus half the swap device, so that it swaps, but well
        # below RAM + swap, which the swap device's compressed pages share with the program.
        avail=$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo)
        swap=$(awk -v d=/dev/ublkb$I '$1 == d { print int($3 / 1024) }' /proc/swaps)
        rm -f /tmp/stat.raw
        pressure_run units $((avail + swap / 2)) units_inspect 1
        data=$(awk -v d=ublkb$I 'NR > 1 && $1 ~ d "$" { print $3 }' /tmp/stat.raw)
        check "trueno-ublk stat reported non-zero DATA under pressure ($data bytes)" [ "${data:-0}" -gt 0 ]
    fi

    # Stop: the swap unit first (it is ordered after the daemon unit), then the daemon unit.
    t0=$(now)
    check "trueno-ublk-swap@$I ExecStop" unit_exec_all "$S" ExecStop $I
    check "trueno-ublk-swap@$I ExecStopPost" unit_exec_all "$S" ExecStopPost $I
    check "/proc/swaps no longer lists /dev/ublkb$I" not in_swaps /dev/ublkb$I
    check "trueno-ublk@$I ExecStop" unit_exec_all "$D" ExecStop $I
    sig=$(unit_value "$D" KillSignal $I SIGTERM)
    echo "+ kill -${sig#SIG} $MAINPID (KillSignal)"
    kill "-${sig#SIG}" "$MAINPID"
    limit=$(unit_value "$D" TimeoutStopSec $I 90s)
    limit=${limit%s}
    case "$limit" in *min) limit=$((${limit%min} * 60)) ;; esac
    check "the daemon exited within TimeoutStopSec=${limit}s" wait_until "$limit" grep -q '^exit' /tmp/unit-daemon.state
    cat /tmp/unit-daemon.log
    code=$(sed -n 's/^exit //p' /tmp/unit-daemon.state)
    check "the daemon exited 0 on $sig (exit ${code:-none})" [ "$code" = 0 ]
    check "trueno-ublk@$I ExecStopPost" unit_exec_all "$D" ExecStopPost $I
    check "/dev/ublkb$I is gone after stop" not test -e /dev/ublkb$I
    trueno-ublk list >/tmp/list.out 2>&1
    cat /tmp/list.out
    check "list shows no device after stop" not grep -q ublkb /tmp/list.out
    echo "units: stop sequence took $(since "$t0") s"
}
