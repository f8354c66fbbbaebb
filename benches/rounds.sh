#!/usr/bin/env bash
# Several built `ferry` binaries, each with several flag sets, measured in
# turn round after round (the machine drifts; every build and flag set
# sees every part of the run): medians of the rounds and every round.
#
#   benches/rounds.sh BINS ROUNDS POINTS [FLAGS...]
#
# BINS: comma-separated paths to `ferry` binaries. POINTS: comma-separated,
# from the list below. FLAGS: each one extra-flags string for `ferry bench`
# ("" for none), e.g. "" "--batch 128". Raw lines go to
# $OUT/rounds.jsonl ($OUT defaults to target/ab). Per (point, binary +
# flags): the median of GB/s and submit ns/op, or of p50 and p99 us.
#
# Points: shm-4k, tcp-4k (4 KiB x32 WRITE), shm-4k-s4, tcp-4k-s4 (the same
# from one thread over --shards 4 --conns 4), shm-4k-s8, shm-lat, tcp-lat
# (8-byte round trips on an embedded shard), shm-lat-m, tcp-lat-m (on two
# managed shards).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
BINS=$1 R=$2 P=$3; shift 3
[ $# -gt 0 ] || set -- ""
out=${OUT:-target/ab}/rounds.jsonl
mkdir -p "$(dirname "$out")"
: > "$out"
for r in $(seq "$R"); do
  for p in ${P//,/ }; do
    case $p in
      shm-4k) a="--transport shm --sizes 4K --op write";;
      tcp-4k) a="--transport tcp --sizes 4K --op write";;
      shm-4k-s4) a="--transport shm --sizes 4K --op write --shards 4 --conns 4";;
      tcp-4k-s4) a="--transport tcp --sizes 4K --op write --shards 4 --conns 4";;
      shm-4k-s8) a="--transport shm --sizes 4K --op write --shards 8 --conns 8";;
      shm-lat) a="--transport shm --sizes 4K --op write --latency --batch 1";;
      tcp-lat) a="--transport tcp --sizes 4K --op write --latency --batch 1";;
      shm-lat-m) a="--transport shm --sizes 4K --op write --latency --batch 1 --shards 2";;
      tcp-lat-m) a="--transport tcp --sizes 4K --op write --latency --batch 1 --shards 2";;
      *) echo "rounds.sh: unknown point $p" >&2; exit 2;;
    esac
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
