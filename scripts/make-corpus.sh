#!/usr/bin/env bash
# Build a corpus of real memory pages for `trueno-ublk bench --input FILE`: the resident
# anonymous pages of live processes (what swap would take from them), read through
# /proc/PID/pagemap and /proc/PID/mem. Each physical page is taken once, even when several
# processes map it. Needs root (pagemap hides page frame numbers, and /proc/PID/mem of other
# users' processes, from others).
#
# Usage: scripts/make-corpus.sh -o FILE [-s SIZE] [-p PID]...
#   -o FILE   corpus to write (4 KiB pages, raw); keep it out of git (corpus/ and *.corpus are ignored)
#   -s SIZE   stop at SIZE bytes (K/M/G suffixes) [default: 1G]
#   -p PID    only this process (repeatable) [default: every process but this script]
#
# The corpus holds other processes' memory, secrets included: keep it private (it is written
# with mode 0600) and do not share one made on a machine with anything sensitive on it.

set -euo pipefail

usage() {
    sed -n '2,/^$/s/^# \{0,1\}//p' "$0" >&2
    exit "${1:-2}"
}

out=""
size="1G"
pids=()
while getopts "o:s:p:h" opt; do
    case "$opt" in
        o) out="$OPTARG" ;;
        s) size="$OPTARG" ;;
        p) pids+=("$OPTARG") ;;
        h) usage 0 ;;
        *) usage ;;
    esac
done
[[ -n "$out" ]] || { echo "make-corpus: -o FILE is required" >&2; usage; }
if [[ "$(id -u)" != 0 ]]; then
    echo "make-corpus: needs root to read other processes' pagemap and memory (try sudo)" >&2
    exit 1
fi
command -v python3 >/dev/null || { echo "make-corpus: needs python3" >&2; exit 1; }

mkdir -p "$(dirname "$out")"
exec python3 - "$out" "$size" "${pids[@]}" <<'PYTHON'
import os
import struct
import sys

PAGE = 4096
PRESENT = 1 << 63
FILE_OR_SHARED_ANON = 1 << 61
PFN_MASK = (1 << 55) - 1
# Entries of pagemap read at a time (8 bytes each).
CHUNK_ENTRIES = 1 << 16
SPECIAL = {"[vvar]", "[vvar_vclock]", "[vdso]", "[vsyscall]"}


def parse_size(text):
    units = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    digits = text.rstrip("KMGT")
    suffix = text[len(digits):]
    if not digits.isdigit() or suffix not in units:
        sys.exit(f"make-corpus: bad size '{text}' (use e.g. 512M or 1G)")
    return int(digits) << units[suffix]


out_path, size_text = sys.argv[1], sys.argv[2]
wanted = [int(p) for p in sys.argv[3:]]
cap_pages = parse_size(size_text) // PAGE
skip = {os.getpid()}
if wanted:
    pids = wanted
else:
    pids = sorted(int(d) for d in os.listdir("/proc") if d.isdigit())
pids = [p for p in pids if p not in skip]

seen_frames = set()
pages = zero_pages = processes = 0
zero = bytes(PAGE)


def runs_of_anon_pages(pagemap, start, end):
    """Yield (address, page count) runs of present, private anonymous pages in [start, end)
    whose physical frame was not seen before."""
    first = start // PAGE
    last = end // PAGE
    for chunk_first in range(first, last, CHUNK_ENTRIES):
        count = min(CHUNK_ENTRIES, last - chunk_first)
        pagemap.seek(chunk_first * 8)
        data = pagemap.read(count * 8)
        if not data or data.count(0) == len(data):
            continue
        entries = struct.unpack(f"<{len(data) // 8}Q", data)
        run_start = None
        for i, entry in enumerate(entries):
            take = entry & PRESENT and not entry & FILE_OR_SHARED_ANON
            if take:
                frame = entry & PFN_MASK
                if frame:
                    if frame in seen_frames:
                        take = False
                    else:
                        seen_frames.add(frame)
            if take and run_start is None:
                run_start = i
            elif not take and run_start is not None:
                yield (chunk_first + run_start) * PAGE, i - run_start
                run_start = None
        if run_start is not None:
            yield (chunk_first + run_start) * PAGE, len(entries) - run_start


fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(fd, "wb") as out:
    for pid in pids:
        if pages >= cap_pages:
            break
        try:
            with open(f"/proc/{pid}/maps") as maps_file:
                maps = maps_file.read().splitlines()
            pagemap = open(f"/proc/{pid}/pagemap", "rb", buffering=0)
            mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
        except OSError:
            continue  # gone, or a kernel thread
        taken_before = pages
        with pagemap, mem:
            for line in maps:
                fields = line.split(None, 5)
                name = fields[5].strip() if len(fields) > 5 else ""
                if fields[1][0] != "r" or name in SPECIAL:
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                try:
                    for address, count in runs_of_anon_pages(pagemap, start, end):
                        count = min(count, cap_pages - pages)
                        mem.seek(address)
                        data = mem.read(count * PAGE)
                        data = data[: len(data) // PAGE * PAGE]
                        out.write(data)
                        for offset in range(0, len(data), PAGE):
                            if data[offset : offset + PAGE] == zero:
                                zero_pages += 1
                        pages += len(data) // PAGE
                        if pages >= cap_pages:
                            break
                except OSError:
                    continue  # the mapping changed or the process exited under us
                if pages >= cap_pages:
                    break
        if pages > taken_before:
            processes += 1

if pages == 0:
    os.unlink(out_path)
    sys.exit("make-corpus: no resident anonymous pages found (are you root? any processes?)")
print(
    f"make-corpus: {out_path}: {pages} pages ({pages * PAGE / 2**20:.1f} MiB) "
    f"from {processes} processes, {100 * zero_pages / pages:.1f}% zero pages",
    file=sys.stderr,
)
PYTHON
