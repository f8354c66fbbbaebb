#!/bin/bash
# Idle connections (issue 12): 8-byte WRITE round trip and 4 KiB x32 WRITE
# throughput on one connection while N-1 others stay open and idle, three
# rounds over tcp N = 1, 1000, 4000 and shm N = 1, 100, 1000; then the
# medians and the ratios to N = 1 (benches/idle_table.py).
#
#   benches/idle_conns.sh [FERRY_BIN] [OUT.jsonl]
#
# FERRY_BIN defaults to target/release/ferry (cargo build --release).
# 4000 tcp connections need ~8200 descriptors per process (ulimit -n).
set -euo pipefail
BIN=${1:-target/release/ferry}
OUT=${2:-idle_conns.jsonl}
: > "$OUT"
for rep in 1 2 3; do
  for spec in "tcp 1" "tcp 1000" "tcp 4000" "shm 1" "shm 100" "shm 1000"; do
    set -- $spec
    "$BIN" bench --transport "$1" --sizes 4K --op write --latency --json --idle-conns "$2" 2>/dev/null |
      sed "s/^{/{\"t\":\"$1\",\"n\":$2,\"rep\":$rep,/" >> "$OUT"
  done
done
python3 "$(dirname "$0")/idle_table.py" "$OUT"
