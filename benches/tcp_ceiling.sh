#!/usr/bin/env bash
# How far one thread feeding four shards is from the most that four
# connections of 8 ops in flight each can move (issue 29): per round, tcp
# 4 KiB WRITEs,
#
#   one32  one embedded shard, 32 in flight (the 1-shard figure)
#   s4     --shards 4 --conns 4 from one submitting thread, 32 in flight
#   s4t4   the same from four submitting threads, one per connection,
#          8 in flight each (--threads 4 --batch 8: 32 in all)
#   one8   one embedded shard, 8 in flight
#   four8  four `ferry bench` processes at once, each one embedded shard
#          with 8 in flight: four independent pipelines, a thread each,
#          nothing shared but the machine (GB/s summed)
#
# and each round's ratios; then the medians. four8 / one32 is the ceiling
# of s4 / one32 for a design that runs each connection on one thread per
# side: it has no thread feeding others at all.
#
#   benches/tcp_ceiling.sh [FERRY_BIN]    (ROUNDS=5, SECS=2; OUT=target/ab)
set -euo pipefail
BIN=${1:-target/release/ferry}
R=${ROUNDS:-5} S=${SECS:-2}
out=${OUT:-target/ab}
mkdir -p "$out"
j=$out/tcp_ceiling.jsonl
: > "$j"
run() { "$BIN" bench --transport tcp --sizes 4K --op write --seconds "$S" --json "$@" 2>/dev/null | tail -1; }
for r in $(seq "$R"); do
  echo "{\"r\":$r,\"k\":\"one32\",\"v\":[$(run)]}" >> "$j"
  echo "{\"r\":$r,\"k\":\"s4\",\"v\":[$(run --shards 4 --conns 4)]}" >> "$j"
  echo "{\"r\":$r,\"k\":\"s4t4\",\"v\":[$(run --shards 4 --conns 4 --threads 4 --batch 8)]}" >> "$j"
  echo "{\"r\":$r,\"k\":\"one8\",\"v\":[$(run --batch 8)]}" >> "$j"
  for i in 1 2 3 4; do run --batch 8 > "$out/four8.$i.json" & done
  wait
  v=$(cat "$out"/four8.{1,2,3,4}.json | paste -sd,)
  echo "{\"r\":$r,\"k\":\"four8\",\"v\":[$v]}" >> "$j"
  rm -f "$out"/four8.?.json
done
python3 - "$j" <<'PY'
import collections, json, statistics as st, sys
d = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    try:
        x = json.loads(line)
    except ValueError:  # a run that printed nothing (it failed): the round is left out
        print("left out:", line.strip()[:120])
        continue
    if len(x["v"]) == (4 if x["k"] == "four8" else 1):
        d[x["r"]][x["k"]] = sum(v["gbps"] for v in x["v"])
keys = ["one32", "s4", "s4t4", "one8", "four8"]
ratios = [("s4/one32", "s4", "one32"), ("four8/one32", "four8", "one32"), ("s4/four8", "s4", "four8"),
          ("s4t4/four8", "s4t4", "four8")]
full = [r for r in sorted(d) if all(k in d[r] for k in keys)]
for r in full:
    x = d[r]
    print(f"round {r}: " + "  ".join(f"{k} {x[k]:.2f}" for k in keys) + "  |  "
          + "  ".join(f"{n} {x[a] / x[b]:.2f}" for n, a, b in ratios))
if full:
    print("medians (GB/s): " + "  ".join(f"{k} {st.median(d[r][k] for r in full):.2f}" for k in keys))
    med = {k: st.median(d[r][k] for r in full) for k in keys}
    print("ratios of the medians: " + "  ".join(f"{n} {med[a] / med[b]:.2f}" for n, a, b in ratios))
    print("median of the rounds' ratios: " + "  ".join(
        f"{n} {st.median(d[r][a] / d[r][b] for r in full):.2f}" for n, a, b in ratios))
print(f"{len(full)} of {len(d)} rounds complete")
PY
