#!/usr/bin/env python3
"""NIXL's Python API driven the same way for backend FERRY and backend UCX,
in one run, alternating (A/B rounds), with the ratio.

Two processes: this one initiates, a child owns the far buffer. Per point
(`--sizes`: SIZE or SIZExN, N descriptors of SIZE bytes per request), a
transfer handle is made once (the descriptors at non-adjacent places, so
NIXL cannot merge them) and posted again and again;
the figure is payload bytes per second of the whole loop (post, poll to
DONE). Medians over `--rounds`.

    NIXL_PLUGIN_DIR=... python3 benches/nixl_bench.py [--transport shm|tcp]
        [--op WRITE|READ] [--sizes 4K,4Kx32,64K,256K,1M,4M,16M,64M]
        [--rounds 3] [--plot out.png] [--json]

--mem vram puts both sides' buffers in GPU memory (CuPy, GPU 0) and adds
the reference of the same run: a device-to-device cudaMemcpy of the same
bytes in one process (the peer-copy rate), with FERRY's ratio to it.

--transport tcp runs both over 127.0.0.1 TCP (FERRY_TRANSPORT=tcp;
UCX_TLS=tcp with UCX_NET_DEVICES=lo); shm leaves each backend its
same-host path. nixl/run_bench.sh sets up the venv and plugin folder.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

GAP = 4096
POINT_S = float(os.environ.get("NIXL_BENCH_POINT_S", "0.4"))


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def parse_point(s):
    """SIZE or SIZExN: (bytes per descriptor, descriptors per request)."""
    size, _, n = s.partition("x")
    return parse_size(size), int(n) if n else 1


def human(n):
    for unit, m in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


MEM = {"dram": ("DRAM", 0), "vram": ("VRAM", 0)}


def alloc(mem, n, fill):
    if mem == "vram":
        import cupy

        return cupy.full(n, fill, dtype=cupy.uint8)
    return np.full(n, fill, dtype=np.uint8)


def addr(a):
    return a.data.ptr if not isinstance(a, np.ndarray) else a.ctypes.data


def copy_rate(nbytes):
    """GB/s of a device-to-device cudaMemcpy of `nbytes` in one process:
    the peer-copy rate (what a CUDA IPC copy would cost without any
    engine around it)."""
    import cupy

    a, b = cupy.ones(nbytes, dtype=cupy.uint8), cupy.zeros(nbytes, dtype=cupy.uint8)
    rt = cupy.cuda.runtime

    def once():
        rt.memcpy(b.data.ptr, a.data.ptr, nbytes, rt.memcpyDeviceToDevice)

    once()
    cupy.cuda.Device().synchronize()
    iters, t0 = 0, time.perf_counter()
    while True:
        once()
        cupy.cuda.Device().synchronize()
        iters += 1
        dt = time.perf_counter() - t0
        if dt >= POINT_S and iters >= 5:
            return nbytes * iters / dt / 1e9


def agent(name, backend):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=[backend]))


def _target(pipe, backend, nbytes, mem):
    ag = agent("bench-target", backend)
    kind, dev = MEM[mem]
    buf = alloc(mem, nbytes, 0)
    ag.register_memory(ag.get_reg_descs([(addr(buf), nbytes, dev, "")], kind))
    pipe.send((ag.get_agent_metadata(), addr(buf)))
    ag.add_remote_agent(pipe.recv())
    pipe.recv()  # done


def layout(size, batch):
    """Offsets of `batch` pieces of `size` bytes, GAP apart."""
    return [i * (size + GAP) for i in range(batch)]


def measure(backend, points, op, mem):
    span = max(off + size for size, batch in points for off in layout(size, batch)[-1:])
    kind, dev = MEM[mem]
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, backend, span, mem), daemon=True)
    proc.start()
    ag = agent("bench-init", backend)
    local = alloc(mem, span, 1)
    reg = ag.get_reg_descs([(addr(local), span, dev, "")], kind)
    ag.register_memory(reg)
    assert pipe.poll(60), "target did not start"
    meta, taddr = pipe.recv()
    name = ag.add_remote_agent(meta)
    pipe.send(ag.get_agent_metadata())
    out = {}
    for size, batch in points:
        offs = layout(size, batch)
        l = ag.get_xfer_descs([(addr(local) + o, size, dev) for o in offs], kind)
        r = ag.get_xfer_descs([(taddr + o, size, dev) for o in offs], kind)
        h = ag.initialize_xfer(op, l, r, name)
        # Warm up (connection, first touches), then a timed loop.
        for _ in range(3):
            post_wait(ag, h)
        iters, t0, c0, call, checks = 0, time.perf_counter(), time.process_time(), 0.0, 0
        while True:
            c, k = post_wait(ag, h)
            call, checks = call + c, checks + k
            iters += 1
            dt = time.perf_counter() - t0
            if dt >= POINT_S and iters >= 5:
                break
        cpu = time.process_time() - c0
        # GB/s of payload; wall µs per post (post to DONE); this process's
        # CPU (every thread) per descriptor, ns; µs in the post call alone;
        # polls per post.
        out[(size, batch)] = (size * batch * iters / dt / 1e9, dt / iters * 1e6, cpu / iters / batch * 1e9,
                              call / iters * 1e6, checks / iters)
        ag.release_xfer_handle(h)
    ag.deregister_memory(reg)
    pipe.send(True)
    proc.join(10)
    return out


def post_wait(ag, h):
    """Posts `h` and polls it to DONE; returns how long the post call
    itself took (s) and how many polls followed it."""
    t = time.perf_counter()
    st = ag.transfer(h)
    call, checks = time.perf_counter() - t, 0
    while st == "PROC":
        st = ag.check_xfer_state(h)
        checks += 1
    if st != "DONE":
        raise RuntimeError(f"transfer ended {st}")
    return call, checks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", help="A,B: the ratio is A/B (default FERRY,UCX; FERRY with --mem vram)")
    ap.add_argument("--mem", choices=["dram", "vram"], default="dram")
    ap.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    ap.add_argument("--op", choices=["WRITE", "READ"], default="WRITE")
    ap.add_argument(
        "--sizes",
        default="4K,4Kx32,64K,256K,1M,4M,16M,64M",
        help="points: SIZE or SIZExN (N descriptors per request)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plot", help="write a PNG of GB/s against size (needs matplotlib)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    a = ap.parse_args()
    if not os.environ.get("NIXL_PLUGIN_DIR"):
        sys.exit("NIXL_PLUGIN_DIR must name a folder holding libplugin_FERRY.so (nixl/run_bench.sh makes one)")
    if a.transport == "tcp":
        # UCX's NIXL backend refuses a UCX_TLS without cuda_copy where a GPU
        # is, and warns about it where none is.
        tls = "tcp,cuda_copy" if os.path.exists("/dev/nvidia0") else "tcp"
        os.environ.update(FERRY_TRANSPORT="tcp", UCX_TLS=tls, UCX_NET_DEVICES="lo")
    os.environ.setdefault("FERRY_LISTEN_ADDR", "127.0.0.1")
    os.environ.setdefault("FERRY_ADVERTISE_ADDR", "127.0.0.1")
    backends = (a.backends or ("FERRY" if a.mem == "vram" else "FERRY,UCX")).split(",")
    points = [parse_point(p) for p in a.sizes.split(",")]
    runs = {b: {p: [] for p in points} for b in backends}
    costs = {b: {p: [] for p in points} for b in backends}
    for rnd in range(a.rounds):
        for b in backends if rnd % 2 == 0 else reversed(backends):
            for p, (gbs, post_us, cpu_ns, call_us, checks) in measure(b, points, a.op, a.mem).items():
                runs[b][p].append(gbs)
                costs[b][p].append((post_us, cpu_ns, call_us, checks))
    if a.mem == "vram":
        # The reference, measured in the same run: "copy" is a backend.
        runs["copy"] = {p: [copy_rate(p[0] * p[1]) for _ in range(a.rounds)] for p in points}
        backends = backends + ["copy"]
    med = {b: {p: statistics.median(v) for p, v in runs[b].items()} for b in backends}
    A, B = backends[0], backends[-1]
    if a.json:
        for p in points:
            print(json.dumps({"size": p[0], "batch": p[1], "op": a.op, "mem": a.mem, "transport": a.transport,
                              **{f"{b}_gbs": med[b][p] for b in backends},
                              **{f"{b}_runs": runs[b][p] for b in backends},
                              **{f"{b}_post_us": statistics.median(c[0] for c in costs[b][p])
                                 for b in costs},
                              **{f"{b}_cpu_ns_per_desc": statistics.median(c[1] for c in costs[b][p])
                                 for b in costs},
                              **{f"{b}_call_us": statistics.median(c[2] for c in costs[b][p]) for b in costs},
                              **{f"{b}_polls_per_post": statistics.median(c[3] for c in costs[b][p])
                                 for b in costs},
                              "ratio": med[A][p] / med[B][p]}))
    else:
        print(f"NIXL {a.op}, {a.mem}, {a.transport}, medians of {a.rounds} rounds (GB/s of payload)")
        print(f"{'size x batch':>16} " + " ".join(f"{b:>9}" for b in backends) + f" {A + '/' + B:>10}")
        for p in points:
            print(f"{human(p[0]) + ' x ' + str(p[1]):>16} " + " ".join(f"{med[b][p]:9.3f}" for b in backends)
                  + f" {med[A][p] / med[B][p]:10.2f}")
        print("per post: wall µs / CPU ns per descriptor (this process, every thread)")
        for p in points:
            print(f"{human(p[0]) + ' x ' + str(p[1]):>16} " + " ".join(
                f"{b} {statistics.median(c[0] for c in costs[b][p]):.1f} / "
                f"{statistics.median(c[1] for c in costs[b][p]):.0f}" for b in costs))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        by_bytes = sorted(points, key=lambda p: p[0] * p[1])
        for b in backends:
            ax.plot([p[0] * p[1] for p in by_bytes], [med[b][p] for p in by_bytes], marker="o", label=b)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per request")
        ax.set_ylabel("GB/s")
        ax.set_title(f"NIXL {a.op} over {a.transport}")
        ax.legend()
        fig.savefig(a.plot)


if __name__ == "__main__":
    main()
