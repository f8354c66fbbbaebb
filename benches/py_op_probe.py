"""Where one blocking 4 KiB write_ipc from Python spends its time (issue
49's "≤ 6 µs from Python"): the same op through each layer, in one
process, p50 and p99 µs of `--rounds` ops after a warm-up:

  p2p        ferry.p2p's write_ipc (what UCCL's callers use)
  run        _native.Connection.run: check, submit and wait in one call
  submit     _native.Connection.submit alone (the op is then waited)
  wait       Transfer.wait alone, after that submit
  nothing    an empty native call (pyo3's own cost, the floor)

The target is `python -m ferry.bench`'s (a ferry.p2p endpoint in a spawned
process, its GPU memory advertised with advertisev_ipc). `--alloc ctypes`
allocates our GPU memory with the driver through ctypes instead of torch,
so the process has no torch in it. FERRY_* variables apply to both
processes (FERRY_GPU_RUNNER_US=0 turns the copy runner off).

  python3 benches/py_op_probe.py [--rounds 3000] [--alloc torch|ctypes]
"""

from __future__ import annotations

import argparse
import ctypes as C
import multiprocessing as mp
import os
import sys
import time


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))]


def timed(op, rounds):
    out = []
    for i in range(rounds + 200):
        t = time.perf_counter()
        op()
        if i >= 200:
            out.append((time.perf_counter() - t) * 1e6)
    return out


def driver_alloc(n):
    cu = C.CDLL("libcuda.so.1")
    dev, ctx, ptr = C.c_int(), C.c_void_p(), C.c_uint64()
    assert cu.cuInit(0) == 0
    assert cu.cuDeviceGet(C.byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    assert cu.cuMemAlloc_v2(C.byref(ptr), C.c_size_t(n)) == 0
    return ptr.value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3000)
    p.add_argument("--alloc", choices=["torch", "ctypes"], default="torch")
    a = p.parse_args()
    os.environ.setdefault("FERRY_LISTEN_ADDR", "127.0.0.1")
    from ferry import bench, p2p

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    target = ctx.Process(target=bench._target, args=(theirs, [4096], 1, 0), daemon=True)
    target.start()
    if a.alloc == "torch":
        buf = bench._gpu_alloc(0, 1 << 20)
        ptr = bench._gpu_ptr(buf)
    else:
        ptr = driver_alloc(1 << 20)
    ep = p2p.Endpoint(0)
    ok, conn = ep.add_remote_endpoint(mine.recv())
    assert ok
    mine.send(("accept",))
    peer_conn = mine.recv()
    mine.send(("windows", 4096, peer_conn))
    meta = mine.recv()[0]
    assert ep.write_ipc(conn, ptr, 4096, meta)
    nconn, region = ep._conn(conn), ep._by_ptr(ptr, 4096)
    piece, wins = [(region, ptr, 4096)], [meta]
    held = []

    def submit():
        held.append(nconn.submit(True, piece, wins))

    def wait():
        held.pop().wait()

    rows = {}
    for r in range(2):
        rows.setdefault("p2p", []).extend(timed(lambda: ep.write_ipc(conn, ptr, 4096, meta), a.rounds))
        rows.setdefault("run", []).extend(timed(lambda: nconn.run(True, piece, wins), a.rounds))
        sub, wt = [], []
        for i in range(a.rounds + 200):
            t0 = time.perf_counter()
            submit()
            t1 = time.perf_counter()
            wait()
            t2 = time.perf_counter()
            if i >= 200:
                sub.append((t1 - t0) * 1e6)
                wt.append((t2 - t1) * 1e6)
        rows.setdefault("submit", []).extend(sub)
        rows.setdefault("wait", []).extend(wt)
        rows.setdefault("nothing", []).extend(timed(lambda: nconn.id, a.rounds))
    for k, v in rows.items():
        print(f"{k:8} p50 {pct(v, 0.5):6.2f} us  p99 {pct(v, 0.99):6.2f} us  "
              f"(alloc {a.alloc}, runner {os.environ.get('FERRY_GPU_RUNNER_US', 'default')})", flush=True)
    mine.send(("stop",))
    target.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
