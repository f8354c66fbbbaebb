#!/usr/bin/env python3
"""Medians and ratios of an A/B run (benches/ab.sh writes the input).

    benches/ab_table.py AB.jsonl [NAME_A NAME_B]

Per point and build: the median over rounds of each figure, every round's
value beside it, and B / A. For tcp latency also each build's p99 over the
raw TCP ping-pong p99 measured in the same bench run; for same-host latency
with --baseline (point shm-lat-f) its p50 and p99 over the cache-line
ping-pong's (the floor) of the same run.
"""
import json
import statistics
import sys
from collections import defaultdict


def figures(row):
    """The figures of one bench row worth comparing, by name."""
    out = {}
    if row["op"].endswith("_latency"):
        for k in ("p50_us", "p99_us", "p999_us"):
            out[k] = row[k]
        if row.get("baseline_p99_us") and row.get("transport") == "shm":
            out["p50/floor"] = row["p50_us"] / row["baseline_p50_us"]
            out["p99/floor"] = row["p99_us"] / row["baseline_p99_us"]
        elif row.get("baseline_p99_us"):
            out["p99/raw_p99"] = row["p99_us"] / row["baseline_p99_us"]
    elif "gbps" in row:
        out["gbps"] = row["gbps"]
        if "submit_ns" in row:
            out["submit_ns/op"] = row["submit_ns"]
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    names = {"A": "A", "B": "B"}
    if len(sys.argv) >= 4:
        names = {"A": sys.argv[2], "B": sys.argv[3]}
    # (point, op, figure) -> build -> [values in round order]
    vals = defaultdict(lambda: defaultdict(list))
    with open(sys.argv[1]) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            for k, v in figures(row).items():
                vals[(row["point"], row["op"], k)][row["build"]].append(v)
    print(f"A = {names['A']}, B = {names['B']}; medians of the rounds (each round in brackets)")
    print(f"{'point':<10} {'op':<14} {'figure':<12} {'A':>9} {'B':>9} {'B/A':>6}")
    for (point, op, k), by in vals.items():
        a, b = by.get("A", []), by.get("B", [])
        ma = statistics.median(a) if a else float("nan")
        mb = statistics.median(b) if b else float("nan")
        ratio = mb / ma if a and b and ma else float("nan")
        fmt = lambda xs: ",".join(f"{x:.3g}" for x in xs)
        print(f"{point:<10} {op:<14} {k:<12} {ma:>9.3f} {mb:>9.3f} {ratio:>6.2f}"
              f"   [{fmt(a)}] [{fmt(b)}]")


if __name__ == "__main__":
    main()
