"""Two-sided messages in a request loop, as UCCL's benchmark_uccl.py sends
them (its default mode), without torch: a server process posts each
blocking `recv` once the last one ended, a client process sends blocking
`send`s, both through `ferry.p2p`; the server's time per message, after
200 to warm up. Host memory, or GPU memory allocated through the driver
(`--device gpu`, GPU 0). FERRY_* variables apply to both processes
(FERRY_MSG_BOUNCE_SLOTS=0: no bounce slots, every message waits for its
receive's offer).

  python3 benches/msg_loop.py [--device host|gpu] [--sizes 4096,8192] [--iters 3000]
"""

from __future__ import annotations

import argparse
import ctypes as C
import multiprocessing as mp
import os
import sys
import time


def alloc(device: str, n: int):
    """(address, keep-alive) of `n` bytes."""
    if device == "host":
        buf = C.create_string_buffer(n)
        return C.addressof(buf), buf
    from py_op_probe import driver_alloc  # beside this file
    return driver_alloc(n), None


def server(pipe, device: str, sizes, iters: int) -> None:
    from ferry import p2p
    ep = p2p.Endpoint(0 if device == "gpu" else None)
    pipe.send(ep.get_metadata())
    ok, _, _, conn = ep.accept()
    assert ok
    ptr, keep = alloc(device, max(sizes))
    ok, mr = ep.reg(ptr, max(sizes))
    assert ok
    for size in sizes:
        for _ in range(200):
            assert ep.recv(conn, mr, ptr, size)
        t = time.perf_counter()
        for _ in range(iters):
            assert ep.recv(conn, mr, ptr, size)
        pipe.send((size, (time.perf_counter() - t) / iters * 1e6))
    del keep


def client(meta: bytes, device: str, sizes, iters: int) -> None:
    from ferry import p2p
    ep = p2p.Endpoint(0 if device == "gpu" else None)
    ok, conn = ep.add_remote_endpoint(meta)
    assert ok
    ptr, keep = alloc(device, max(sizes))
    ok, mr = ep.reg(ptr, max(sizes))
    assert ok
    for size in sizes:
        for _ in range(iters + 200):
            assert ep.send(conn, mr, ptr, size)
    del keep


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["host", "gpu"], default="host")
    p.add_argument("--sizes", default="4096,8192")
    p.add_argument("--iters", type=int, default=3000)
    a = p.parse_args()
    os.environ.setdefault("FERRY_LISTEN_ADDR", "127.0.0.1")
    sizes = [int(s) for s in a.sizes.split(",")]
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    s = ctx.Process(target=server, args=(theirs, a.device, sizes, a.iters))
    s.start()
    meta = mine.recv()
    c = ctx.Process(target=client, args=(meta, a.device, sizes, a.iters))
    c.start()
    slots = os.environ.get("FERRY_MSG_BOUNCE_SLOTS", "default")
    for _ in sizes:
        size, us = mine.recv()
        print(f"{a.device} {size:>8} B: {us:7.1f} us a message (FERRY_MSG_BOUNCE_SLOTS {slots})", flush=True)
    s.join(60)
    c.join(60)
    return 0 if s.exitcode == 0 and c.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
