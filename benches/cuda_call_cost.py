#!/usr/bin/env python3
"""What one small copy costs the calling thread in the CUDA driver: 32
copies of --size bytes device->pinned host per round, issued as 32
cuMemcpyAsync calls or as one cuMemcpyBatchAsync, then one event polled to
completion. Prints the CPU time of the issuing calls per copy and the
round's total (launch to event), p50 over --rounds, next to the cost of an
empty driver call through ctypes (the measuring overhead).

    python3 benches/cuda_call_cost.py [--size 4096] [--rounds 2000]
"""
import argparse
import ctypes as C
import time

cu = C.CDLL("libcuda.so.1")


def ok(r, what):
    if r != 0:
        raise SystemExit(f"{what}: CUresult {r}")


def p50(v):
    return sorted(v)[len(v) // 2]


class Attr(C.Structure):
    _fields_ = [("order", C.c_int), ("src_t", C.c_int), ("src_id", C.c_int),
                ("dst_t", C.c_int), ("dst_id", C.c_int), ("flags", C.c_uint)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2000)
    a = ap.parse_args()
    n, sz = 32, a.size
    ok(cu.cuInit(0), "cuInit")
    dev, ctx = C.c_int(), C.c_void_p()
    ok(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    ok(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "retain")
    ok(cu.cuCtxSetCurrent(ctx), "set")
    d, h = C.c_uint64(), C.c_void_p()
    ok(cu.cuMemAlloc_v2(C.byref(d), C.c_size_t(n * sz)), "alloc")
    ok(cu.cuMemHostAlloc(C.byref(h), C.c_size_t(n * sz), 0), "hostalloc")
    s, e = C.c_void_p(), C.c_void_p()
    ok(cu.cuStreamCreate(C.byref(s), 1), "stream")
    ok(cu.cuEventCreate(C.byref(e), 2), "event")
    cur = C.c_void_p()
    empty = []
    for _ in range(a.rounds):
        t0 = time.perf_counter_ns()
        cu.cuCtxGetCurrent(C.byref(cur))
        empty.append(time.perf_counter_ns() - t0)
    print(f"empty driver call via ctypes: {p50(empty) / 1e3:.2f} us")
    dsts = (C.c_uint64 * n)(*[h.value + k * sz for k in range(n)])
    srcs = (C.c_uint64 * n)(*[d.value + k * sz for k in range(n)])
    sizes = (C.c_size_t * n)(*[sz] * n)
    attr = Attr(1, 0, 0, 0, 0, 0)
    idx = (C.c_size_t * 1)(0)
    batch = getattr(cu, "cuMemcpyBatchAsync_v2", None)
    for label in ("32 x cuMemcpyAsync", "1 x cuMemcpyBatchAsync(32)", "1 x cuMemcpyAsync (one copy)"):
        if "Batch" in label and batch is None:
            print("no cuMemcpyBatchAsync_v2")
            continue
        issue, total = [], []
        for r in range(a.rounds):
            t0 = time.perf_counter_ns()
            if label.startswith("32"):
                for k in range(n):
                    cu.cuMemcpyAsync(C.c_uint64(dsts[k]), C.c_uint64(srcs[k]), C.c_size_t(sz), s)
                per = n
            elif "Batch" in label:
                ok(batch(dsts, srcs, sizes, C.c_size_t(n), C.byref(attr), idx, C.c_size_t(1), s), "batch")
                per = n
            else:
                cu.cuMemcpyAsync(C.c_uint64(dsts[0]), C.c_uint64(srcs[0]), C.c_size_t(sz), s)
                per = 1
            t1 = time.perf_counter_ns()
            cu.cuEventRecord(e, s)
            while cu.cuEventQuery(e) == 600:
                pass
            t2 = time.perf_counter_ns()
            if r > 50:
                issue.append((t1 - t0) / per)
                total.append(t2 - t0)
        print(f"{label:30s} issue {p50(issue) / 1e3:6.2f} us per copy, launch to event {p50(total) / 1e3:7.1f} us")


if __name__ == "__main__":
    main()
