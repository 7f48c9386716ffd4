#!/usr/bin/env bash
# Download the newest cloud kernel of a Debian suite (say trixie-backports, which carries 7.x
# kernels with the newer ublk driver) straight from the Debian archive, for scripts/vm-test.sh
# (VM_KERNEL_SUITE); the host's own apt sources need not know the suite. Every file is
# checked: the suite's InRelease against Debian's archive keyring (gpgv), its package index
# against InRelease, each package against the index.
#
#   scripts/vm/fetch-kernel.sh SUITE DIR [VERSION]   print the kernel's .deb files in DIR, one
#                                                    per line; VERSION (say 7.0): the newest of
#                                                    that release line instead of the newest
#
# A kernel of Debian's split packaging (linux-image-V-cloud-amd64 depending on
# linux-binary-V-cloud-amd64 and linux-modules-V-cloud-amd64, as in trixie-backports) is
# those two; one of the older packaging is the image package alone.
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
die() {
    echo "fetch-kernel: $*" >&2
    exit 1
}
[ $# -eq 2 ] || [ $# -eq 3 ] || die "usage: $0 SUITE DIR [VERSION]"
suite=$1
dir=$2
version=${3:-}
command -v gpgv >/dev/null || die "gpgv not found: apt-get install gpgv"
[ -r "$KEYRING" ] || die "$KEYRING not found: apt-get install debian-archive-keyring"
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

curl -sSfL -o "$work/InRelease" "$MIRROR/dists/$suite/InRelease" ||
    die "could not download $MIRROR/dists/$suite/InRelease"
gpgv --keyring "$KEYRING" --output "$work/Release" "$work/InRelease" 2>"$work/gpgv.log" ||
    die "$suite's InRelease is not signed by a Debian archive key: $(cat "$work/gpgv.log")"
index=main/binary-amd64/Packages.xz
# The SHA256 section of Release lists " HASH SIZE PATH".
want=$(awk -v f="$index" '/^SHA256:/ {s = 1; next} /^[^ ]/ {s = 0} s && $3 == f {print $1}' "$work/Release")
[ -n "$want" ] || die "$suite's Release lists no $index"
curl -sSfL -o "$work/Packages.xz" "$MIRROR/dists/$suite/$index" || die "could not download $index"
echo "$want  $work/Packages.xz" | sha256sum -c --quiet - >/dev/null || die "$index does not match $suite's Release"
xz -dc "$work/Packages.xz" >"$work/Packages"

# newest PACKAGE: "VERSION FILENAME SHA256" of the package's newest version in the index
# (nothing if the index has none).
newest() {
    awk -v p="$1" '
        $1 == "Package:" {inside = ($2 == p); v = f = s = ""}
        inside && $1 == "Version:" {v = $2}
        inside && $1 == "Filename:" {f = $2}
        inside && $1 == "SHA256:" {s = $2}
        inside && /^$/ {if (v != "") print v, f, s; inside = 0}
        END {if (inside && v != "") print v, f, s}' "$work/Packages" | sort -V -k1,1 | tail -n1
}

image=$(awk '$1 == "Package:" && $2 ~ /^linux-image-[0-9][^ ]*-cloud-amd64$/ {print $2}' "$work/Packages" |
    sed 's/^linux-image-//' | awk -v v="$version" 'v == "" || index($0, v ".") == 1' | sort -V | tail -n1)
[ -n "$image" ] || die "$suite has no linux-image-${version:+$version.}*-cloud-amd64"
packages=("linux-image-$image")
if [ -n "$(newest "linux-binary-$image")" ]; then
    packages=("linux-binary-$image" "linux-modules-$image")
fi
for package in "${packages[@]}"; do
    read -r _ file sum <<<"$(newest "$package")"
    [ -n "$file" ] && [ -n "$sum" ] || die "$suite's index has no file for $package"
    deb="$dir/$(basename "$file")"
    if [ ! -e "$deb" ]; then
        echo "fetch-kernel: downloading $(basename "$file")" >&2
        curl -sSfL -o "$deb.part" "$MIRROR/$file" || die "could not download $file"
        mv "$deb.part" "$deb"
    fi
    echo "$sum  $deb" | sha256sum -c --quiet - >/dev/null || {
        rm -f "$deb"
        die "$(basename "$file") does not match $suite's index"
    }
    echo "$deb"
done
