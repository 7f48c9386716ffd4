#!/usr/bin/env bash
# Check every systemd unit in systemd/ with `systemd-analyze verify`, and a boot transaction
# with swap on device 0 enabled (no ordering cycle); any warning fails.
# Installs systemd through apt-get when systemd-analyze is missing (CI containers).
#
# verify also checks that each command exists. The units name the installed binary
# /usr/local/bin/trueno-ublk; this script verifies copies that name the binary built in
# target/ instead (the same rewrite install.sh does for another --prefix), building it if
# there is none.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "check-units: systemd-analyze missing; installing systemd" >&2
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq systemd >/dev/null
fi

binary=""
for candidate in target/release/trueno-ublk target/debug/trueno-ublk; do
    if [ -x "$candidate" ]; then
        binary="$repo/$candidate"
        break
    fi
done
if [ -z "$binary" ]; then
    cargo build --release --bin trueno-ublk
    binary="$repo/target/release/trueno-ublk"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

units=(systemd/*.service)
failed=0
for unit in "${units[@]}"; do
    copy="$work/$(basename "$unit")"
    sed "s#/usr/local/bin/trueno-ublk#$binary#g" "$unit" >"$copy"
done
for unit in "${units[@]}"; do
    copy="$work/$(basename "$unit")"
    if output=$(cd "$work" && systemd-analyze verify --man=no "$copy" 2>&1) && [ -z "$output" ]; then
        echo "check-units: $unit OK"
    else
        echo "check-units: $unit FAILED" >&2
        printf '%s\n' "$output" >&2
        failed=1
    fi
done

# A boot with swap on device 0 enabled: the units must join swap.target (which sysinit.target
# waits for) without an ordering cycle. verify reports cycles in the start transaction.
cat >"$work/boot-check.target" <<'UNIT'
[Unit]
Description=A boot with trueno-ublk-swap@0.service enabled
Wants=multi-user.target swap.target trueno-ublk-swap@0.service
UNIT
if output=$(cd "$work" && systemd-analyze verify --man=no "$work/boot-check.target" 2>&1) && [ -z "$output" ]; then
    echo "check-units: boot with trueno-ublk-swap@0.service enabled OK"
else
    echo "check-units: boot with trueno-ublk-swap@0.service enabled FAILED" >&2
    printf '%s\n' "$output" >&2
    failed=1
fi
exit "$failed"
