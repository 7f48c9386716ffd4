#!/usr/bin/env bash
# Install trueno-ublk: the release binary, the systemd units, the swap-unit generator (a link
# to the binary), the example config (as /etc/trueno-ublk.conf unless that exists) and a
# modules-load.d entry for ublk_drv.
#
#   cargo build --release && sudo scripts/install.sh   install under /usr/local
#   sudo scripts/install.sh --uninstall      stop the units and remove what was installed
#   DESTDIR=/tmp/stage scripts/install.sh    stage into a directory (packaging, tests)
#
# Options: --prefix DIR (default /usr/local), --unitdir DIR (default /etc/systemd/system),
# --binary FILE (install this binary instead of target/release/trueno-ublk). It never builds:
# under sudo, root's PATH has no rustup toolchain (Debian's own cargo is too old for this
# project), and a build as root would leave root's files in your target/.
# The config and modules-load.d entry always go under /etc, where the units look. The
# generator goes to PREFIX/lib/systemd/system-generators for the prefixes systemd searches
# (/usr/local, /usr), else to /etc/systemd/system-generators.
set -euo pipefail

usage() {
    sed -n '2,17s/^# \{0,1\}//p' "$0"
    exit "${1:-0}"
}

prefix=/usr/local
unitdir=/etc/systemd/system
binary=""
uninstall=0
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
        --prefix=*) prefix=${1#*=}; shift ;;
        --unitdir) unitdir=${2:?--unitdir needs a directory}; shift 2 ;;
        --unitdir=*) unitdir=${1#*=}; shift ;;
        --binary) binary=${2:?--binary needs a file}; shift 2 ;;
        --binary=*) binary=${1#*=}; shift ;;
        --uninstall) uninstall=1; shift ;;
        -h|--help) usage 0 ;;
        *) echo "install.sh: unknown option '$1'" >&2; usage 2 >&2 ;;
    esac
done

# The prefix goes into the units' ExecStart lines (through sed), where a space would split
# the command and `#`, `&` or `\` would garble it.
case "$prefix" in
    /*) ;;
    *) echo "install.sh: --prefix must be an absolute path, not '$prefix'" >&2; exit 2 ;;
esac
if [[ ! "$prefix" =~ ^[A-Za-z0-9._/+-]+$ ]]; then
    echo "install.sh: --prefix '$prefix' has characters a unit's command line cannot take: use letters, digits and . _ / + - only" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
destdir=${DESTDIR:-}
bindir="$prefix/bin"
docdir="$prefix/share/doc/trueno-ublk"
config=/etc/trueno-ublk.conf
modules_load=/etc/modules-load.d/trueno-ublk.conf
units=(trueno-ublk@.service trueno-ublk-mkswap@.service trueno-ublk-failed@.service)
# Installed by earlier versions (a oneshot that ran swapon itself); removed on uninstall.
old_units=(trueno-ublk-swap@.service)
example="$repo/systemd/trueno-ublk.conf.example"
case "$prefix" in
    /usr | /usr/local) generatordir="$prefix/lib/systemd/system-generators" ;;
    *) generatordir=/etc/systemd/system-generators ;;
esac
generator="$generatordir/trueno-ublk-generator"

# systemctl only for a real install on a host that runs systemd.
with_systemd() {
    [ -z "$destdir" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1
}

if [ "$uninstall" -eq 1 ]; then
    if with_systemd; then
        # The swap units first, the daemons only once every swapoff worked: a daemon whose
        # device still holds swap hands it over and exits, and the swap would then wait for a
        # daemon that this uninstall removes.
        active_units() {
            systemctl list-units --plain --no-legend --state=active "$@" | awk '{print $1}'
        }
        mapfile -t swaps < <(active_units 'dev-ublkb*.swap' 'trueno-ublk-swap@*.service')
        if [ "${#swaps[@]}" -gt 0 ]; then
            echo "stopping ${swaps[*]}"
            systemctl stop "${swaps[@]}" || true
        fi
        if grep -q '^/dev/ublkb' /proc/swaps; then
            echo "install.sh: swap is still on a trueno-ublk device (see /proc/swaps and systemctl status above); nothing stopped or removed: run swapoff on it, then --uninstall again" >&2
            exit 1
        fi
        mapfile -t daemons < <(active_units 'trueno-ublk-mkswap@*.service' 'trueno-ublk@*.service')
        if [ "${#daemons[@]}" -gt 0 ]; then
            echo "stopping ${daemons[*]}"
            systemctl stop "${daemons[@]}" || true
        fi
        systemctl disable "${units[@]}" "${old_units[@]}" >/dev/null 2>&1 || true
    fi
    # Enablement symlinks (systemctl disable removes them too; DESTDIR installs have no systemctl).
    if [ -d "$destdir/etc/systemd/system" ]; then
        find "$destdir/etc/systemd/system" -path '*.wants/trueno-ublk*@*.service' -type l -print -delete
    fi
    for file in "$bindir/trueno-ublk" "$generator" "${units[@]/#/$unitdir/}" \
        "${old_units[@]/#/$unitdir/}" "$modules_load" \
        "$docdir/trueno-ublk.conf.example" "$docdir/README.md" "$docdir/docs/limits.md" \
        "$docdir/docs/measurements.md"; do
        if [ -e "$destdir$file" ] || [ -L "$destdir$file" ]; then
            rm -f "$destdir$file"
            echo "removed $destdir$file"
        fi
    done
    rmdir "$destdir$docdir/docs" "$destdir$docdir" 2>/dev/null || true
    if [ -e "$destdir$config" ]; then
        if cmp -s "$destdir$config" "$example"; then
            rm -f "$destdir$config"
            echo "removed $destdir$config"
        else
            echo "kept $destdir$config (changed from the example; remove it yourself)"
        fi
    fi
    if with_systemd; then
        systemctl daemon-reload
    fi
    exit 0
fi

if [ -z "$binary" ]; then
    binary="$repo/target/release/trueno-ublk"
    if [ ! -x "$binary" ]; then
        echo "install.sh: no $binary: run 'cargo build --release' as your user first" >&2
        exit 1
    fi
    # Sources changed since the build (a git pull, an edit): installing the old build would
    # then be reloaded into use as if it were the new one.
    newer=$(find "$repo/src" "$repo/Cargo.toml" "$repo/Cargo.lock" "$repo/build.rs" \
        -newer "$binary" -type f -print -quit 2>/dev/null)
    if [ -n "$newer" ]; then
        echo "install.sh: $binary is older than ${newer#"$repo"/}: run 'cargo build --release' as your user first (or name a build with --binary)" >&2
        exit 1
    fi
fi
if [ ! -x "$binary" ]; then
    echo "install.sh: $binary is not an executable" >&2
    exit 1
fi

install -d "$destdir$bindir" "$destdir$unitdir" "$destdir/etc/modules-load.d" "$destdir$docdir"
# Beside it, then renamed over it: a unit's restart or a reload's standby that starts the
# binary meanwhile runs the old one or the new one, never a half-copied file.
install -m 0755 "$binary" "$destdir$bindir/.trueno-ublk.new"
mv -f "$destdir$bindir/.trueno-ublk.new" "$destdir$bindir/trueno-ublk"
echo "installed $destdir$bindir/trueno-ublk"
for unit in "${units[@]}"; do
    # The units name /usr/local/bin/trueno-ublk; point them at this prefix.
    sed "s#/usr/local/bin/trueno-ublk#$bindir/trueno-ublk#g" "$repo/systemd/$unit" >"$destdir$unitdir/$unit.tmp"
    chmod 0644 "$destdir$unitdir/$unit.tmp"
    mv "$destdir$unitdir/$unit.tmp" "$destdir$unitdir/$unit"
    echo "installed $destdir$unitdir/$unit"
done
# Earlier versions' swap service, which ran swapon itself: a second owner of the swap.
for unit in "${old_units[@]}"; do
    if [ -e "$destdir$unitdir/$unit" ]; then
        find "$destdir/etc/systemd/system" -path "*.wants/${unit%@.service}@*.service" -type l -print -delete
        rm -f "$destdir$unitdir/$unit"
        echo "removed $destdir$unitdir/$unit (replaced by the generated dev-ublkbN.swap units)"
    fi
done
# The generator is the binary itself, run under another name (systemd runs it at boot and at
# every daemon-reload to write dev-ublkbN.swap from $config).
install -d "$destdir$generatordir"
ln -sfn "$bindir/trueno-ublk" "$destdir$generator"
echo "installed $destdir$generator -> $bindir/trueno-ublk"
echo ublk_drv >"$destdir$modules_load"
chmod 0644 "$destdir$modules_load"
echo "installed $destdir$modules_load"
install -m 0644 "$example" "$destdir$docdir/trueno-ublk.conf.example"
install -m 0644 "$repo/README.md" "$destdir$docdir/README.md"
install -D -m 0644 "$repo/docs/limits.md" "$destdir$docdir/docs/limits.md"
install -D -m 0644 "$repo/docs/measurements.md" "$destdir$docdir/docs/measurements.md"
if [ -e "$destdir$config" ]; then
    echo "kept $destdir$config (exists; the example is in $destdir$docdir)"
else
    install -m 0644 "$example" "$destdir$config"
    echo "installed $destdir$config"
fi

if with_systemd; then
    systemctl daemon-reload
fi
if [ -z "$destdir" ]; then
    cat <<MSG

Next: load the driver now (it loads at every boot from $modules_load), set
"swap = yes" in the [ublkb0] section of $config for swap on /dev/ublkb0 at boot, and
start it now:
    modprobe ublk_drv
    systemctl daemon-reload
    systemctl start dev-ublkb0.swap
After installing a new build over a running one, take it into use without the device
waiting: systemctl reload trueno-ublk@0
MSG
fi
