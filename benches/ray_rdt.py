#!/usr/bin/env python3
"""Ray Direct Transport: ferry's tensor transport (``ferry.ray``, "FERRY")
beside Ray's own NIXL transport and Ray's object store, each on a local
Ray cluster of its own (below), same tensors, same run.

A source actor (on the GPU when --devices has cuda) makes one tensor of
SIZE bytes once and returns it again and again (a fresh Ray object each
time, the same memory: a registration cache's case, as in serving); the
driver waits for each object to exist, then times its ``ray.get`` (plus
``torch.cuda.synchronize()`` for CUDA) and checks the bytes of the first. Per point: p50 of the ``ray.get`` time and GB/s of payload at it.
OBJECT_STORE is a plain actor method (Ray serializes the tensor into its
shared-memory store, CUDA tensors through host memory).

    python3 benches/ray_rdt.py [--transports FERRY,NIXL,OBJECT_STORE]
        [--devices cpu,cuda] [--sizes 4K,1M,64M,1G] [--rounds N] [--json]

Each transport is measured in its own child process with its own Ray
cluster (driver and source actor), one after another: Ray's NIXL transport
leaves busy-polling threads in every process that used it (two a process,
at 100 % of a core each, seen with `top -H` after five `ray.get`s on a
2-core VM), which halved FERRY's 64 MiB rate when both shared the
processes. Rounds (--rounds) repeat the transports in turn; a point's p50
is the median of its rounds' p50s.

A transport that cannot run here (NIXL without the nixl module or without
torch; cuda without a GPU) is left out with the reason printed.
Tensors are torch tensors where torch imports, else numpy arrays (CPU
only, FERRY and OBJECT_STORE).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import ray

import ferry.ray

try:
    import torch
except ImportError:
    torch = None

# Before the actor classes: Ray checks transport names when it reads them.
ferry.ray.register()

ITERS = {1 << 12: 200, 1 << 20: 60, 64 << 20: 12, 1 << 30: 4}


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def human(n):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def make(nbytes, device):
    if torch is None:
        import numpy

        return (numpy.arange(nbytes) % 251).astype(numpy.uint8)
    t = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t.copy_((torch.arange(nbytes, device=device) % 251).to(torch.uint8))
    return t


def sample_ok(t, nbytes):
    """The bytes at every 4097th place are what make() wrote."""
    idx = list(range(0, nbytes, 4097))[:4096]
    if torch is not None:
        got = t[idx].cpu().tolist()
    else:
        got = t[idx].tolist()
    return got == [i % 251 for i in idx]


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Source:
    def __init__(self):
        ferry.ray.register()
        self.t = None

    def prepare(self, nbytes, device):
        self.t = None
        self.t = make(nbytes, device)
        if device == "cuda":
            torch.cuda.synchronize()
        return True

    def tensor(self):
        """Called with .options(tensor_transport=...), or plain for the object store."""
        return self.t


def available(name, devices):
    """(usable?, why not) for a transport here."""
    if name == "NIXL":
        if torch is None:
            return False, "Ray's NIXL transport needs torch"
        try:
            import nixl._api  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any reason it cannot load
            return False, f"Ray's NIXL transport needs the nixl module ({e})"
    return True, ""


def measure(a, name, devices):
    """One transport's points in this process (the child's work): a JSON
    line per point on stdout."""
    gpus = 1 if "cuda" in devices else 0
    ray.init(num_cpus=4, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    src = Source.options(num_gpus=gpus).remote()
    m = src.tensor if name == "OBJECT_STORE" else src.tensor.options(tensor_transport=name)
    for device in devices:
        for size in [parse_size(s) for s in a.sizes.split(",") if s]:
            ray.get(src.prepare.remote(size, device))
            iters = a.iters or ITERS.get(size, 10)
            times = []
            for i in range(iters + 1):  # the first one warms (connects, registers)
                ref = m.remote()
                ray.wait([ref])
                t0 = time.perf_counter()
                t = ray.get(ref)
                if device == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                ok = sample_ok(t, size) if i == 0 else True
                where = str(getattr(t, "device", "cpu"))
                del t
                if not ok:
                    sys.exit(f"{name} {device} {human(size)}: the bytes that arrived are wrong")
                if not where.startswith(device):
                    sys.exit(f"{name} {device} {human(size)}: arrived on {where}")
                if i:
                    times.append(dt)
                del ref
            p50 = statistics.median(times)
            print(json.dumps({"transport": name, "device": device, "size": size, "iters": iters, "p50_s": p50}), flush=True)
    ray.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="FERRY,NIXL,OBJECT_STORE")
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--sizes", default="4K,1M,64M,1G")
    ap.add_argument("--iters", type=int, default=0, help="ray.get calls per point (default: by size)")
    ap.add_argument("--rounds", type=int, default=1, help="times each transport runs, in turn (default 1)")
    ap.add_argument("--json", action="store_true", help="one JSON line per point")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # a child's transport
    a = ap.parse_args()

    devices = [d for d in a.devices.split(",") if d]
    if "cuda" in devices and not (torch is not None and torch.cuda.is_available()):
        print("# cuda left out: no torch with a GPU here", file=sys.stderr)
        devices.remove("cuda")
    if a.only:
        measure(a, a.only, devices)
        return
    transports = []
    for name in [t for t in a.transports.split(",") if t]:
        ok, why = available(name, devices)
        if ok:
            transports.append(name)
        else:
            print(f"# {name} left out: {why}", file=sys.stderr)
    # (transport, device, size) -> each round's p50, in seconds.
    got = {}
    for r in range(a.rounds):
        for name in transports:
            child = [sys.executable, os.path.abspath(__file__), "--only", name,
                     "--devices", ",".join(devices), "--sizes", a.sizes, "--iters", str(a.iters)]
            out = subprocess.run(child, stdout=subprocess.PIPE, text=True)
            if out.returncode != 0:
                sys.exit(f"{name} (round {r + 1}) failed: exit {out.returncode}")
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    p = json.loads(line)
                    got.setdefault((name, p["device"], p["size"]), []).append(p["p50_s"])

    print(f"{'device':6} {'size':>8} " + " ".join(f"{t + ' p50 µs':>18} {'GB/s':>8}" for t in transports))
    for device in devices:
        for size in [parse_size(s) for s in a.sizes.split(",") if s]:
            row = {"bench": "ray_rdt", "device": device, "size": size, "rounds": a.rounds}
            cells = []
            for name in transports:
                p50 = statistics.median(got[(name, device, size)])
                row[f"{name}_p50_us"] = p50 * 1e6
                row[f"{name}_gbs"] = size / p50 / 1e9
                cells.append(f"{p50 * 1e6:>18.1f} {size / p50 / 1e9:>8.2f}")
            print(f"{device:6} {human(size):>8} " + " ".join(cells), flush=True)
            if a.json:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
