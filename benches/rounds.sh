#!/usr/bin/env bash
# Several built `ferry` binaries, each with several flag sets, measured in
# turn round after round (the machine drifts; every build and flag set
# sees every part of the run): medians of the rounds and every round.
#
#   benches/rounds.sh BINS ROUNDS POINTS [FLAGS...]
#
# BINS: comma-separated paths to `ferry` binaries. POINTS: comma-separated
# (benches/points.sh). FLAGS: each one extra-flags string for `ferry bench`
# ("" for none), e.g. "" "--batch 128". Raw lines go to
# $OUT/rounds.jsonl ($OUT defaults to target/ab). Per (point, binary +
# flags): the median of GB/s and submit ns/op, or of p50 and p99 us.
#
# Points: those of benches/points.sh (shm-4k, tcp-4k-s4, shm-lat, ...).
set -euo pipefail
# shellcheck source=benches/points.sh
. "$(dirname "$0")/points.sh"
[ $# -ge 3 ] || { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
BINS=$1 R=$2 P=$3; shift 3
[ $# -gt 0 ] || set -- ""
out=${OUT:-target/ab}/rounds.jsonl
mkdir -p "$(dirname "$out")"
: > "$out"
for r in $(seq "$R"); do
  for p in ${P//,/ }; do
    a=$(point_args "$p") || exit 2
    for bin in ${BINS//,/ }; do for m in "$@"; do
      # shellcheck disable=SC2086
      l=$("$bin" bench $a $m --seconds 1 --json 2>/dev/null | tail -1 || true)
      echo "{\"round\":$r,\"point\":\"$p\",\"mode\":\"$(basename "$bin") $m\",\"r\":${l:-null}}" >> "$out"
    done; done
  done
done
python3 - "$out" <<'PY'
import json, sys, statistics as st, collections
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    try:
        j = json.loads(line)
    except ValueError:
        continue
    r = j["r"]
    if not r:
        continue
    k = (j["point"], j["mode"])
    d[k].append((r["gbps"], r.get("submit_ns", 0)) if "gbps" in r else (r["p50_us"], r["p99_us"]))
for k in sorted(d):
    a = [x[0] for x in d[k]]
    b = [x[1] for x in d[k]]
    print(f"{k[0]:10} {k[1]:34} med {st.median(a):6.2f} {st.median(b):7.2f}  {['%.2f' % x for x in a]}")
PY
