#!/usr/bin/env bash
# A/B of the C face's per-call cost: benches/c_handles.c against two
# libferry.so builds, alternately, ROUNDS rounds (default 5); medians.
#
#   benches/c_handles.sh DIR_A DIR_B      (each holding a libferry.so)
# POLLS (default 5e6) and OPS (default 2e4) per round.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { sed -n '2,6p' "$0"; exit 2; }
rounds=${ROUNDS:-5}
bin=$(mktemp)
trap 'rm -f "$bin"' EXIT
cc -O2 -std=c11 -D_DEFAULT_SOURCE -I include benches/c_handles.c -L "$1" -lferry -o "$bin"
for r in $(seq "$rounds"); do
    for side in A B; do
        dir=$([ $side = A ] && echo "$1" || echo "$2")
        echo "$side $(LD_LIBRARY_PATH="$dir" "$bin" ${POLLS:-5000000} ${OPS:-20000})"
    done
done | python3 -c '
import json, statistics, sys
rows = {"A": [], "B": []}
for line in sys.stdin:
    side, js = line.split(" ", 1)
    rows[side].append(json.loads(js))
for k in ("poll_ns", "write_8b_us"):
    a = [r[k] for r in rows["A"]]; b = [r[k] for r in rows["B"]]
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{k:12s} A {ma:8.3f}  B {mb:8.3f}  B/A {mb/ma:5.2f}   A {a}  B {b}")
'
