#!/usr/bin/env python3
"""BENCHMARKS.md's summary table, made from the results files that
`benches/record.py` appends to (benches/results/*.jsonl): for each path,
op and size the newest record. It replaces the text between the
`summary:begin` and `summary:end` markers of BENCHMARKS.md.

    benches/summary.py            # rewrite the table
    benches/summary.py --check    # exit 1 if the table is not what the files make
    benches/summary.py --print    # print it

Ratio: ferry's rate over the reference's (throughput), the reference's
time over ferry's (latency): above 1, ferry is ahead. The reference is
measured in the same run (the machine is noisy); "peer" is another engine
on the same path in the same run (NIXL's UCX backend).
"""

import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "BENCHMARKS.md")
BEGIN, END = "<!-- summary:begin -->", "<!-- summary:end -->"
MAX_ROWS = 36  # the table stays a screen (with its header: <= 40 lines)


def size_text(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}iB"
    return f"{n} B"


def normalize(r):
    """(key, cells) of one record, or None for a record the table skips."""
    if "block_bytes" in r:  # ferry bench --json
        size, batch = r["block_bytes"], r.get("batch", 1)
        op = r["op"]
        if op.endswith("_latency"):
            op = op[: -len("_latency")] + " p50"
            ferry = f"{r['p50_us']:.2f} µs"
            ref = r.get("baseline_p50_us")
            reference = f"{r.get('reference', '')} {ref:.2f} µs" if ref else ""
            ratio = f"{ref / r['p50_us']:.2f}" if ref else ""
        else:
            ferry = f"{r['gbps']:.2f} GB/s"
            ref = r.get("baseline_gbps")
            reference = f"{r.get('reference', '')} {ref:.2f}" if ref else ""
            ratio = f"{r['ratio']:.2f}" if "ratio" in r else ""
        peer = ""
    elif "FERRY_gbs" in r:  # benches/nixl_bench.py --json
        size, batch, op = r["size"], r["batch"], r["op"].lower()
        ferry = f"{r['FERRY_gbs']:.2f} GB/s"
        ref_name = "copy" if "copy_gbs" in r else None
        reference = f"copy {r['copy_gbs']:.2f}" if ref_name else ""
        ratio = f"{r['FERRY_gbs'] / r['copy_gbs']:.2f}" if ref_name else ""
        peer = f"UCX {r['UCX_gbs']:.2f} ({r['FERRY_gbs'] / r['UCX_gbs']:.2f}×)" if "UCX_gbs" in r else ""
    else:
        return None
    shape = size_text(size) + (f" × {batch}" if batch > 1 else "")
    key = (r["label"], op, size, batch, r["machine"])
    cells = [r["label"], op, shape, ferry, reference, ratio, peer, r["machine"],
             r["commit"], f"`{r['command']}`"]
    return key, r.get("date", ""), cells


def table():
    newest = {}
    for path in sorted(glob.glob(os.path.join(HERE, "results", "*.jsonl"))):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    got = normalize(json.loads(line))
                except (ValueError, KeyError) as e:
                    sys.exit(f"{path}:{n}: not a record this script knows: {e}")
                if got is None:
                    continue
                key, date, cells = got
                # Later lines are newer (files are appended to).
                if key not in newest or date >= newest[key][0]:
                    newest[key] = (date, cells)
    rows = [newest[k][1] for k in sorted(newest)]
    if len(rows) > MAX_ROWS:
        sys.exit(f"{len(rows)} rows: more than the summary's {MAX_ROWS}; "
                 "drop points from benches/results/ (the log keeps the rest)")
    head = ["path", "op", "size", "ferry", "reference (same run)", "ratio", "peer (same run)",
            "machine", "commit", "command"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "--write"
    made = table()
    if mode == "--print":
        print(made)
        return
    with open(DOC) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        sys.exit(f"{DOC} has no {BEGIN} … {END} markers")
    before, rest = doc.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    new = f"{before}{BEGIN}\n{made}\n{END}{after}"
    if mode == "--check":
        if new != doc:
            sys.exit("BENCHMARKS.md's summary is not what benches/results/ makes: run benches/summary.py")
        return
    if mode != "--write":
        sys.exit(__doc__)
    with open(DOC, "w") as f:
        f.write(new)


if __name__ == "__main__":
    main()
