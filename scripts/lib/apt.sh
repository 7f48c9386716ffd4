# shellcheck shell=bash
# apt for the project's scripts, sourced: `apt_install PACKAGE...` installs them (through
# sudo when not root; an `apt-get update` first, once per script), `apt_update_once`
# updates the lists alone (for `apt-get download` and `apt-cache`), and SUDO is the prefix
# for other commands that need root. Both return non-zero on failure; the caller says so.

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    # A password is asked for only at a terminal; a test run never waits on one.
    if [ -t 0 ]; then SUDO=(sudo); else SUDO=(sudo -n); fi
fi
APT_UPDATED=0

apt_update_once() {
    if [ "${#SUDO[@]}" -gt 0 ] && ! command -v sudo >/dev/null 2>&1; then
        echo "apt: not root and no sudo: run as root to let apt-get install what is missing" >&2
        return 1
    fi
    if [ "$APT_UPDATED" -eq 0 ]; then
        echo "apt: apt-get update" >&2
        "${SUDO[@]}" apt-get update -qq || return 1
        APT_UPDATED=1
    fi
}

apt_install() {
    [ "$#" -gt 0 ] || return 0
    apt_update_once || return 1
    echo "apt: apt-get install $*" >&2
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "$@" >/dev/null
}
