#!/usr/bin/env bash
# Check every systemd unit in systemd/ with `systemd-analyze verify`, the swap unit that
# trueno-ublk-generator writes for a `swap = yes` section, and a boot transaction with swap on
# device 0 enabled (no ordering cycle); any warning fails.
# Installs systemd through apt-get when systemd-analyze is missing (CI containers).
#
# verify also checks that each command exists. The units name the installed binary
# /usr/local/bin/trueno-ublk; this script verifies copies that name the binary built in
# target/ instead (the same rewrite install.sh does for another --prefix): the debug build of
# the sources as they are (a no-op after scripts/test.sh's cargo test; a release binary left
# from earlier could be of older sources, and its generator would be what gets checked).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "check-units: systemd-analyze missing; installing systemd" >&2
    # shellcheck source=lib/apt.sh
    . "$repo/scripts/lib/apt.sh"
    apt_install systemd
fi

cargo build --quiet --bin trueno-ublk
binary="$repo/target/debug/trueno-ublk"

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

# The generator (the binary run as trueno-ublk-generator) on the example config with swap on
# for device 0: the unit it writes must verify like the shipped ones.
conf="$work/trueno-ublk.conf"
sed 's/^swap = no$/swap = yes/' systemd/trueno-ublk.conf.example >"$conf"
grep -q '^swap = yes$' "$conf" || { echo "check-units: the example config has no 'swap = no' line" >&2; exit 1; }
mkdir -p "$work/gen"
ln -s "$binary" "$work/trueno-ublk-generator"
if ! TRUENO_UBLK_CONFIG="$conf" "$work/trueno-ublk-generator" "$work/gen" "$work/gen" "$work/gen"; then
    echo "check-units: trueno-ublk-generator FAILED" >&2
    failed=1
fi
if [ -f "$work/gen/dev-ublkb0.swap" ] && [ -L "$work/gen/swap.target.wants/dev-ublkb0.swap" ]; then
    cp "$work/gen/dev-ublkb0.swap" "$work/"
    if output=$(cd "$work" && systemd-analyze verify --man=no "$work/dev-ublkb0.swap" 2>&1) && [ -z "$output" ]; then
        echo "check-units: generated dev-ublkb0.swap OK"
    else
        echo "check-units: generated dev-ublkb0.swap FAILED" >&2
        printf '%s\n' "$output" >&2
        failed=1
    fi
else
    echo "check-units: trueno-ublk-generator wrote no dev-ublkb0.swap (and link) for swap = yes" >&2
    failed=1
fi

# A boot with swap on device 0 enabled: the units must join swap.target (which sysinit.target
# waits for) without an ordering cycle. verify reports cycles in the start transaction.
cat >"$work/boot-check.target" <<'UNIT'
[Unit]
Description=A boot with swap on /dev/ublkb0 (swap = yes)
Wants=multi-user.target swap.target dev-ublkb0.swap
UNIT
if output=$(cd "$work" && systemd-analyze verify --man=no "$work/boot-check.target" 2>&1) && [ -z "$output" ]; then
    echo "check-units: boot with dev-ublkb0.swap enabled OK"
else
    echo "check-units: boot with dev-ublkb0.swap enabled FAILED" >&2
    printf '%s\n' "$output" >&2
    failed=1
fi
exit "$failed"
