#!/usr/bin/env python3
"""The floor under GPU memory over tcp at small blocks: how long one small
device<->pinned-host copy takes from launch to a completed event, alone and
as a group of 32 on one stream with one event (what ferry's batched staging
issues), measured with torch on GPU 0. Prints p50/p99 in microseconds.

    python3 benches/gpu_copy_floor.py [--size 4096] [--iters 2000]
"""
import argparse
import time

import torch


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * p))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    dev = torch.empty(a.size * 32, dtype=torch.uint8, device="cuda")
    host = torch.empty(a.size * 32, dtype=torch.uint8).pin_memory()
    s = torch.cuda.Stream()
    for label, n in (("one copy", 1), ("32 copies, one event", 32)):
        for way in ("D2H", "H2D"):
            lat = []
            for i in range(a.iters):
                t0 = time.perf_counter()
                with torch.cuda.stream(s):
                    for k in range(n):
                        d = dev[k * a.size:(k + 1) * a.size]
                        h = host[k * a.size:(k + 1) * a.size]
                        if way == "D2H":
                            h.copy_(d, non_blocking=True)
                        else:
                            d.copy_(h, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(s)
                while not ev.query():
                    pass
                if i >= 50:
                    lat.append((time.perf_counter() - t0) * 1e6)
            print(f"{label:22s} {way} {a.size} B: p50 {pct(lat, 0.5):7.1f} us  p99 {pct(lat, 0.99):7.1f} us")


if __name__ == "__main__":
    main()
