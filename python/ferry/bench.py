"""python -m ferry.bench: the `ferry bench` sweep driven from Python.

Starts a target process (a `ferry.p2p` endpoint), connects to it and, for
each block size and op, keeps --batch operations in flight for --seconds
through `writev_async` + `poll_async` (the seed's calls: --depth vectors
of batch/depth blocks each), then prints GB/s (1e9 B/s). With the `ferry`
binary at hand (--ferry-bin, else target/release/ferry of this checkout,
else `ferry` on PATH) it also runs `ferry bench` with the same flags in
the same run, one round of it after each Python round, and prints the
ratio of the medians: the binding's overhead.

--transport ipc (needs a GPU and torch or cupy): `write_ipc` / `read_ipc`
of GPU memory into a same-host target's GPU memory, against a peer copy
(cudaMemcpy between the same two GPUs in one process) measured in the same
run, and the p50/p99 of one blocking 4 KiB `write_ipc`.

Environment: FERRY_* variables apply to both processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
         "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
FOOTPRINT_MAX = 1 << 30


def parse_size(s: str) -> int:
    t = s.strip()
    i = len(t) - len(t.lstrip("0123456789"))
    if i == 0 or t[i:].upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"size {s!r}: expected like 4K, 64M")
    return int(t[:i]) * UNITS[t[i:].upper()]


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def slots_for(size: int, batch: int) -> int:
    """Distinct blocks per size: the batch, within the 1 GiB footprint."""
    return max(1, min(batch, FOOTPRINT_MAX // size))


# ---- the target process ------------------------------------------------------

def _target(pipe, sizes: List[int], batch: int, gpu: Optional[int]) -> None:
    from ferry import p2p

    ep = p2p.Endpoint(gpu)
    assert ep.start_passive_accept()
    pipe.send(ep.get_metadata())
    big = max(s * slots_for(s, batch) for s in sizes)
    if gpu is None:
        import numpy as np

        import ctypes

        # Plain heap memory, as `ferry serve` registers (numpy would ask for
        # huge pages), touched as a live buffer is.
        raw = bytearray(big)
        buf = np.frombuffer(raw, np.uint8)
        ptr = buf.ctypes.data
        ctypes.memset(ptr, 0x5A, big)
    else:
        buf = _gpu_alloc(gpu, big)
        ptr = _gpu_ptr(buf)
    ok, mr = ep.reg(ptr, big)
    assert ok, "target reg"
    while True:
        cmd = pipe.recv()
        if cmd[0] == "windows":
            _, size, conn = cmd
            n = slots_for(size, batch)
            if gpu is None:
                ok, metas = ep.advertisev([mr] * n, [ptr + i * size for i in range(n)], [size] * n, n)
            else:
                ok, metas = ep.advertisev_ipc(conn, [ptr + i * size for i in range(n)], [size] * n)
            assert ok, "target advertise"
            pipe.send(metas)
        elif cmd[0] == "accept":
            ok, _, _, conn = ep.accept()
            pipe.send(conn)
        else:
            pipe.send("bye")
            return


# ---- GPU helpers (torch, else cupy) ------------------------------------------------

def _gpu_alloc(dev: int, n: int):
    try:
        import torch

        return torch.empty(n, dtype=torch.uint8, device=f"cuda:{dev}")
    except ImportError:
        import cupy

        with cupy.cuda.Device(dev):
            return cupy.empty(n, dtype=cupy.uint8)


def _gpu_ptr(t) -> int:
    return t.data_ptr() if hasattr(t, "data_ptr") else t.data.ptr


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()


def _peer_copy_gbps(src_dev: int, dst_dev: int, size: int, seconds: float) -> float:
    """cudaMemcpy between the two GPUs in one process: the reference."""
    import torch

    a = torch.empty(size, dtype=torch.uint8, device=f"cuda:{src_dev}")
    b = torch.empty(size, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    b.copy_(a)
    torch.cuda.synchronize(src_dev)
    torch.cuda.synchronize(dst_dev)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b.copy_(a, non_blocking=True)
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize(dst_dev)
    torch.cuda.synchronize(src_dev)
    torch.cuda.synchronize(dst_dev)
    return n * size / (time.perf_counter() - t0) / 1e9


# ---- the initiator -------------------------------------------------------------------

def _run(ep, conn: int, write: bool, size: int, metas: List[bytes], local: Tuple[List[int], List[int]],
         batch: int, depth: int, seconds: float, ipc: bool) -> float:
    """Keeps `depth` vectors of batch/depth blocks in flight; GB/s of what
    completed inside the measuring window."""
    mrs, ptrs = local
    n = len(metas)
    if depth == 0:
        # Small blocks: two vectors in flight; large ones: one block per
        # call, so the pipe never drains at a vector's end.
        depth = 2 if size < (1 << 20) else min(n, batch)
    per = max(1, min(n, batch) // depth)
    if ipc:
        submit = ep.writev_ipc_async if write else ep.readv_ipc_async
    else:
        submit = ep.writev_async if write else ep.readv_async
    vecs = []
    for d in range(depth):
        idx = [(d * per + i) % n for i in range(per)]
        if ipc:
            vecs.append(([ptrs[i] for i in idx], [size] * per, [metas[i] for i in idx]))
        else:
            vecs.append(([mrs[i] for i in idx], [ptrs[i] for i in idx], [size] * per,
                         [metas[i] for i in idx], per))
    warm = max(0.05, seconds * 0.15)
    t0 = time.perf_counter()
    warm_end, end = t0 + warm, t0 + warm + seconds
    inflight: List[int] = []
    k = 0
    done_bytes, first, last = 0, None, None
    poll = ep.poll_async
    yield_ = os.sched_yield
    while True:
        now = time.perf_counter()
        if now < end:
            while len(inflight) < depth:
                ok, tid = submit(conn, *vecs[k % depth])
                assert ok, "submit failed"
                inflight.append(tid)
                k += 1
        elif not inflight:
            break
        ok, done = poll(inflight[0])
        assert ok, "transfer failed"
        if not done:
            # Let the engine's threads have the core (a host with fewer
            # cores than spinning threads); a no-op where a core is idle.
            yield_()
        else:
            inflight.pop(0)
            t = time.perf_counter()
            if warm_end <= t < end:
                if first is None:
                    first = t
                else:
                    done_bytes += per * size
                last = t
    if first is None or last is None or last <= first:
        raise SystemExit(f"{fmt_size(size)}: too few completions in {seconds} s; raise --seconds")
    return done_bytes / (last - first) / 1e9


def _rust_reference(binary: str, a) -> Dict[Tuple[str, int], float]:
    cmd = [binary, "bench", "--transport", a.transport, "--sizes", ",".join(str(s) for s in a.sizes),
           "--batch", str(a.batch), "--seconds", str(a.seconds), "--op", a.op,
           "--rounds", "1", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        print(f"ferry bench failed ({' '.join(cmd)}):\n{out.stderr}", file=sys.stderr)
        return {}
    ref = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if "gbps" in r:
                ref[(r["op"], r["block_bytes"])] = r["gbps"]
    return ref


def _find_ferry(given: Optional[str]) -> Optional[str]:
    if given:
        return given
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.getcwd(), os.path.join(here, "..", "..")):
        p = os.path.join(root, "target", "release", "ferry")
        if os.access(p, os.X_OK):
            return os.path.abspath(p)
    return shutil.which("ferry")


def _ipc_latency(ep, conn: int, ptr: int, meta: bytes, n: int = 2000, op=None) -> Tuple[float, float]:
    op = op or (lambda: ep.write_ipc(conn, ptr, 4096, meta))
    lat = []
    for i in range(n + 100):
        t = time.perf_counter()
        assert op() is not False
        if i >= 100:
            lat.append((time.perf_counter() - t) * 1e6)
    lat.sort()
    return lat[len(lat) // 2], lat[int(len(lat) * 0.99)]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ferry.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=["auto", "tcp", "shm", "ipc"], default="auto")
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   default=[4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20],
                   help="block sizes (default 4K,64K,1M,16M,64M)")
    p.add_argument("--op", choices=["write", "read", "both"], default="both")
    p.add_argument("--batch", type=int, default=32, help="blocks in flight (default 32)")
    p.add_argument("--depth", type=int, default=0,
                   help="writev_async calls in flight, batch/depth blocks each (default: 2 "
                        "below 1 MiB, else one block per call)")
    p.add_argument("--seconds", type=float, default=1.0, help="measuring time per point")
    p.add_argument("--rounds", type=int, default=1, help="median of N rounds per point")
    p.add_argument("--ferry-bin", help="the ferry binary for the reference (default: found)")
    p.add_argument("--no-reference", action="store_true", help="skip the `ferry bench` run")
    p.add_argument("--gpu", type=int, default=0, help="ipc: the initiator's GPU")
    p.add_argument("--peer-gpu", type=int, default=None, help="ipc: the target's GPU (default 1 if any)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    a = p.parse_args(argv)
    if a.batch < 1 or a.depth < 0 or a.depth > a.batch:
        p.error("--batch must be >= 1 and 0 <= --depth <= --batch")
    ipc = a.transport == "ipc"
    if a.transport in ("tcp", "shm"):
        os.environ["FERRY_TRANSPORT"] = a.transport
    os.environ.setdefault("FERRY_LISTEN_ADDR", "127.0.0.1")

    from ferry import p2p

    peer_gpu = None
    if ipc:
        peer_gpu = a.peer_gpu if a.peer_gpu is not None else (1 if _gpu_count() > 1 else 0)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    target = ctx.Process(target=_target, args=(theirs, a.sizes, a.batch, peer_gpu), daemon=True)
    target.start()
    ep = p2p.Endpoint(a.gpu if ipc else None)
    ok, conn = ep.add_remote_endpoint(mine.recv())
    assert ok, "connect to the target"
    mine.send(("accept",))
    peer_conn = mine.recv()
    big = max(s * slots_for(s, a.batch) for s in a.sizes)
    if ipc:
        buf = _gpu_alloc(a.gpu, big)
        ptr = _gpu_ptr(buf)
        mr = None
    elif ep.peer(conn)[0] == "shm":
        # As `ferry bench` does: engine-owned memory shared with the target.
        ok, mr, ptr = ep.alloc_host(big)
        import ctypes

        ctypes.memset(ptr, 0x3C, big)  # touched, as a live buffer is
    else:
        import numpy as np

        buf = np.full(big, 0x3C, np.uint8)
        ok, mr = ep.reg(buf.ctypes.data, big)
        ptr = buf.ctypes.data
    kind = "ipc" if ipc else ep.peer(conn)[0]
    ops = ["write", "read"] if a.op == "both" else [a.op]
    binary = None if (a.no_reference or ipc) else _find_ferry(a.ferry_bin)
    points = []
    for size in a.sizes:
        mine.send(("windows", size, peer_conn))
        metas = mine.recv()
        n = len(metas)
        local = ([mr] * n, [ptr + i * size for i in range(n)])
        points += [(op, size, metas, local) for op in ops]
    # Rounds alternate Python and the reference, so that a machine whose
    # speed drifts during the run moves both alike; medians are reported.
    got: Dict[Tuple[str, int], List[float]] = {(op, s): [] for op, s, _, _ in points}
    refs: Dict[Tuple[str, int], List[float]] = {k: [] for k in got}
    for r in range(a.rounds):
        if a.rounds > 1:
            print(f"round {r + 1}/{a.rounds} ...", file=sys.stderr)
        for op, size, metas, local in points:
            got[(op, size)].append(
                _run(ep, conn, op == "write", size, metas, local, a.batch, a.depth, a.seconds, ipc))
        if binary:
            for k, v in _rust_reference(binary, a).items():
                if k in refs:
                    refs[k].append(v)
    rows = []
    for op, size, metas, _ in points:
        n = len(metas)
        g = statistics.median(got[(op, size)])
        depth = a.depth or (2 if size < (1 << 20) else min(n, a.batch))
        row = {"transport": kind, "op": op, "block_bytes": size, "batch": min(n, a.batch),
               "depth": depth, "gbps": round(g, 4)}
        if refs[(op, size)]:
            rg = statistics.median(refs[(op, size)])
            row["rust_gbps"] = round(rg, 4)
            row["ratio"] = round(g / rg, 3)
        if ipc and op == "write":
            row["peer_copy_gbps"] = round(_peer_copy_gbps(a.gpu, peer_gpu, size, a.seconds), 4)
            row["ratio"] = round(g / row["peer_copy_gbps"], 3)
        rows.append(row)
    if ipc:
        mine.send(("windows", 4096, peer_conn))
        meta = mine.recv()[0]
        p50, p99 = _ipc_latency(ep, conn, ptr, meta)
        rows.append({"transport": "ipc", "op": "write_latency", "block_bytes": 4096,
                     "p50_us": round(p50, 2), "p99_us": round(p99, 2)})
        # The same op one layer down (ferry._native, what write_ipc calls):
        # the difference is ferry.p2p's own Python.
        nconn, region = ep._conn(conn), ep._by_ptr(ptr, 4096)
        p50, p99 = _ipc_latency(ep, conn, ptr, meta, op=lambda: nconn.run(True, [(region, ptr, 4096)], [meta]))
        rows.append({"transport": "ipc", "op": "write_latency_native", "block_bytes": 4096,
                     "p50_us": round(p50, 2), "p99_us": round(p99, 2)})
    mine.send(("stop",))
    target.join(10)
    for r in rows:
        if a.json:
            print(json.dumps(r))
        elif "gbps" in r:
            ref_s = ""
            if "rust_gbps" in r:
                ref_s = f"  rust {r['rust_gbps']:8.3f} GB/s  ratio {r['ratio']:.3f}"
            if "peer_copy_gbps" in r:
                ref_s = f"  peer copy {r['peer_copy_gbps']:8.3f} GB/s  ratio {r['ratio']:.3f}"
            print(f"{r['transport']:4} {r['op']:5} {fmt_size(r['block_bytes']):>8} x{r['batch']:<3} "
                  f"{r['gbps']:8.3f} GB/s{ref_s}")
        else:
            print(f"{r['transport']:4} {r['op']} {fmt_size(r['block_bytes'])}: "
                  f"p50 {r['p50_us']:.1f} us  p99 {r['p99_us']:.1f} us")
    if binary is None and not ipc and not a.no_reference:
        print("(no ferry binary found for the reference: build it with cargo build --release, "
              "or pass --ferry-bin)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
