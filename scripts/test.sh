#!/usr/bin/env bash
# Every test of the project, as the README's "pass the tests" command:
#   unit, integration and property tests (cargo test), every fuzz target for 30 s each
#   (scripts/fuzz.sh), the committed PTX assembled for every target GPU (scripts/check-ptx.sh),
#   the systemd units verified (scripts/check-units.sh), the end-to-end test of the daemon in
#   a VM (scripts/vm-test.sh), and near OOM in a VM with stress-ng's compressible `all` case
#   (scripts/vm-test.sh --stress; the cases of incompressible pages stay out while they lose
#   the VM now and then: docs/measurements.md, "Near OOM").
# Installs what it needs (apt, pip) on a fresh Debian/Ubuntu machine; run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "build and test tools (scripts/deps.sh)"
# shellcheck source=deps.sh
. scripts/deps.sh

step "cargo test"
cargo test --all-targets

step "fuzz targets, 30 s each (scripts/fuzz.sh)"
bash scripts/fuzz.sh

step "PTX kernels (ptxas for sm_75, sm_80, sm_90)"
bash scripts/check-ptx.sh

step "systemd units (systemd-analyze verify)"
bash scripts/check-units.sh

step "end-to-end in a VM (scripts/vm-test.sh)"
bash scripts/vm-test.sh

step "near OOM in a VM: stress-ng's compressible case on zram, then on trueno-ublk (scripts/vm-test.sh --stress)"
STRESS_CASES="all:150" bash scripts/vm-test.sh --stress
