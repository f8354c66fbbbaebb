#!/usr/bin/env python3
"""What registering and deregistering raw memory costs from Python: p50 of
`Endpoint.register` of a fresh 4 KiB numpy array, and of `Region.close`
(unused, and right after a 4 KiB READ into it), in microseconds.

    python3 benches/register_cost.py [--rounds 300]

Run it with two builds of the `ferry` package to compare them (the
registration check and the deregistration wait are most of both costs).
"""

import argparse
import statistics
import time

import numpy as np

import ferry


def p50_us(xs):
    return statistics.median(xs) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300)
    a = ap.parse_args()
    with ferry.Endpoint() as ep, ferry.Endpoint() as peer:
        ep.listen()
        peer.listen()
        reg, close = [], []
        for _ in range(a.rounds):
            b = np.empty(4096, np.uint8)
            t0 = time.perf_counter()
            r = ep.register(b)
            t1 = time.perf_counter()
            r.close()
            close.append(time.perf_counter() - t1)
            reg.append(t1 - t0)
        src = peer.register(np.arange(4096, dtype=np.uint8))
        window = src.advertise()
        conn = ep.connect(peer.metadata)
        after = []
        for _ in range(a.rounds):
            r = ep.register(np.empty(4096, np.uint8))
            conn.read(r, window)
            t0 = time.perf_counter()
            r.close()
            after.append(time.perf_counter() - t0)
        print(f"register 4 KiB p50 {p50_us(reg):.1f} us; close p50 {p50_us(close):.1f} us; "
              f"close after a READ p50 {p50_us(after):.1f} us "
              f"({len(open('/proc/self/maps').read().splitlines())} mappings)")


if __name__ == "__main__":
    main()
