"""Medians of benches/idle_conns.sh's runs, with ratios to N = 1."""
import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]


def med(xs):
    return statistics.median(xs) if xs else float("nan")


print("| transport | N | p50 us (ratio) | p99 us (ratio) | 4 KiB x32 GB/s (ratio) | RSS KiB per idle conn (here / target) |")
print("|---|---|---|---|---|---|")
for t, ns in [("tcp", [1, 1000, 4000]), ("shm", [1, 100, 1000])]:
    base = None
    for n in ns:
        pick = [r for r in rows if r.get("t") == t and r.get("n") == n]
        lat = [r for r in pick if r.get("op") == "write_latency"]
        p50 = med([r["p50_us"] for r in lat])
        p99 = med([r["p99_us"] for r in lat])
        gbps = med([r["gbps"] for r in pick if r.get("op") == "write"])
        mem = [r for r in pick if "idle_conns" in r]
        here = med([r["rss_kib_each"] for r in mem])
        there = med([r["target_rss_kib_each"] for r in mem])
        if base is None:
            base = (p50, p99, gbps)
        print(
            f"| {t} | {n} | {p50:.1f} ({p50 / base[0]:.2f}x) | {p99:.1f} ({p99 / base[1]:.2f}x) "
            f"| {gbps:.2f} ({gbps / base[2]:.2f}x) | {here:.1f} / {there:.1f} |"
        )
