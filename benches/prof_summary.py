"""Reads py-spy's raw stacks of a NIXL bench (`benches/device_run.sh
profile`, `py-spy record --native --subprocesses -f raw`) and prints where
the bench process's samples went, in two parts: the post call
(`nixl_agent.transfer`) and the polls after it (`check_xfer_state`); for
each, the frames that held the most samples themselves, and the ferry and
driver frames that held the most in all (inclusive). py-spy samples the
threads Python knows only: with the plugin's default `FERRY_DRIVE=caller`
the shards' passes run inside those calls (`Engine::assist`) and show;
ferry's own threads (`FERRY_DRIVE=threads`) do not.

  python3 benches/prof_summary.py RAW [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

PARTS = (("post call", "nixl_agent.transfer"), ("polls", "nixl_agent.check_xfer_state"))


def clean(frame: str) -> str:
    """A frame without its Rust hash, shortened."""
    frame = re.sub(r"::h[0-9a-f]{16}", "", frame)
    frame = frame.replace("$LT$", "<").replace("$GT$", ">").replace("$u20$", " ").replace("..", "::")
    return frame[:150]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    own = {name: collections.Counter() for name, _ in PARTS}
    incl = {name: collections.Counter() for name in own}
    total = collections.Counter()
    for line in open(a.raw, encoding="utf-8", errors="replace"):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        # The bench itself, not its target process (a second "process" frame).
        if sum(f.startswith("process ") for f in frames) != 1 or "nixl_bench.py" not in frames[0]:
            continue
        for name, key in PARTS:
            at = next((i for i, f in enumerate(frames) if key in f), None)
            if at is not None:
                break
        else:
            continue  # set-up, imports, the bench's own Python
        frames = frames[at:]
        total[name] += int(n)
        own[name][clean(frames[-1])] += int(n)
        for f in {clean(f) for f in frames}:
            if "ferry" in f or f.startswith("cu") or "libcuda" in f:
                incl[name][f] += int(n)
    for name in own:
        t = total[name]
        print(f"== {name}: {t} samples")
        if not t:
            continue
        for f, n in own[name].most_common(a.top):
            print(f"  self {n:5d} {100 * n / t:5.1f}%  {f}")
        for f, n in incl[name].most_common(a.top):
            print(f"  incl {n:5d} {100 * n / t:5.1f}%  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
