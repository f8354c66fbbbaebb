#!/usr/bin/env python3
"""What ferry's gather kernel (src/gpu/gather.rs) costs on its own, beside
the copy engine, on one GPU in one process: for each shape N x SIZE
(pieces GAP bytes apart in one allocation, device to device), the wall
time from the first driver call to a completed event (polled, as a shard
polls), p50 over --rounds, of:

  engine 1 call   one cuMemcpyDtoDAsync of the same bytes, contiguous
                  (what nixl_bench.py's "copy" is, less Python);
  engine batch    cuMemcpyBatchAsync of the N pieces;
  kernel, pinned  ferry_gather, descriptors read from pinned host memory;
  kernel, device  ferry_gather, descriptors already in device memory;
  kernel, params  ferry_gather_p, descriptors by value (N <= 160).

With --neighbour a second process holds its own context on the same GPU
(allocated, idle), as the target of a same-host transfer does.

With --completion it first measures what one 4 KiB copy's completion
costs by each way the engine could learn of it (the floor under a small
one-sided op and a small GPU message; issue 49 asks 6 and 10 us):

  copy + event        cuMemcpyDtoDAsync, cuEventRecord, cuEventQuery polled
                      (what a shard does today);
  event alone         cuEventRecord and its polling, no copy;
  copy + flag         the copy, then cuStreamWriteValue32 into mapped pinned
                      memory, polled with plain loads (no driver call);
  flag alone          the stream write and its polling, no copy;
  sync copy           cuMemcpyDtoD (it returns before a device-to-device
                      copy has ended: the 64M rows);
  armed copy          the copy queued beforehand behind cuStreamWaitValue32
                      on a pinned word: timed from the host's store of that
                      word to the flag (no driver call on the path);
  armed kernel        ferry_gather queued beforehand behind the wait, its
                      descriptor written into pinned memory with the word;
  kernel + flag       ferry_gather_p (by value), then the stream write;
  null copy+event, blocking s, priority N, two streams: the copy and its
                      event on the legacy default stream, a blocking
                      stream, the highest-priority one, two in turn;
  copy + s sync, null copy+ctxsync: waited by the driver, not polled;
  copy, 3us, event    the event recorded 3 us after the copy;
  sync copy, s        the sync copy, then an event on the probe's stream;
  sync cuMemcpy       the unified synchronous copy;
  sync, legacy busy / s busy: the sync copy alone, a 256 MiB memset queued
                      first on the legacy stream / the probe's stream;
  64M async+event, 64M sync, 64M sync+lgcy ev, 4K sync+lgcy ev: whether a
                      sync device-to-device copy ends before it returns;
  runner, runner IPC: ferry's copy runner (src/gpu/runner/ptx.rs), a kernel
                      already running, copies when a pinned word moves and
                      writes a done word back;
  IPC copy+event, IPC sync copy, IPC sync read (with --neighbour): to and
                      from the neighbour's allocation, opened by CUDA IPC.

    python3 benches/gather_probe.py [--shapes 4Kx32,64Kx32,16Kx1024] [--rounds 300] [--neighbour] [--completion]
"""
import argparse
import ctypes as C
import multiprocessing as mp
import os
import re
import time

GAP = 4096
PARAM_DESCS = 160


def ok(r, what):
    if r != 0:
        raise SystemExit(f"{what}: CUresult {r}")


def p50(v):
    return sorted(v)[len(v) // 2]


def ptx():
    """The kernel's two PTX modules as gather.rs builds them: its raw
    strings are the copy loop (the macro's), then the two entries' heads."""
    src = open(os.path.join(os.path.dirname(__file__), "..", "src", "gpu", "gather.rs")).read()
    body, head, head_p = re.findall(r'r#"(.*?)"#', src, re.S)[:3]
    return (head + body).encode() + b"\0", (head_p + body).encode() + b"\0"


def chunk_bytes():
    """Bytes one block copies (gather.rs's CHUNK_BYTES): the grid's y."""
    src = open(os.path.join(os.path.dirname(__file__), "..", "src", "gpu", "gather.rs")).read()
    return int(re.search(r"const CHUNK_BYTES: usize = (\d+);", src).group(1))


CHUNK = chunk_bytes()


def size(s):
    s = s.upper()
    m = {"K": 1 << 10, "M": 1 << 20}
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)


class IpcHandle(C.Structure):
    _fields_ = [("reserved", C.c_char * 64)]


def neighbour(ready, done, handle_out):
    cu = C.CDLL("libcuda.so.1")
    cu.cuInit(0)
    dev, ctx, d = C.c_int(), C.c_void_p(), C.c_uint64()
    cu.cuDeviceGet(C.byref(dev), 0)
    cu.cuCtxCreate_v2(C.byref(ctx), 0, dev)
    cu.cuMemAlloc_v2(C.byref(d), C.c_size_t(64 << 20))
    h = IpcHandle()
    # Its memory for the completion probe's IPC rows (a peer's allocation,
    # as a CUDA IPC op copies into).
    got = cu.cuIpcGetMemHandle(C.byref(h), d) == 0
    handle_out.put(C.string_at(C.addressof(h), 64) if got else b"")
    ready.set()
    done.wait()


class Attr(C.Structure):
    _fields_ = [("order", C.c_int), ("src_t", C.c_int), ("src_id", C.c_int),
                ("dst_t", C.c_int), ("dst_id", C.c_int), ("flags", C.c_uint)]


def runner_ptx():
    """The copy runner's PTX (src/gpu/runner/ptx.rs), NUL-terminated."""
    src = open(os.path.join(os.path.dirname(__file__), "..", "src", "gpu", "runner", "ptx.rs")).read()
    return re.findall(r'r#"(.*?)"#', src, re.S)[0].encode() + b"\0"


def resident(cu, src, dst, peer, rounds, sz=4096):
    """A 4 KiB copy by ferry's copy runner already running (src/gpu/runner/, its
    control block driven as the shard does): from the host's store of the
    go word to its load of the done word, p50 us, to our own memory and
    (with --neighbour) to the neighbour's."""
    mod, fn = C.c_void_p(), C.c_void_p()
    ok(cu.cuModuleLoadData(C.byref(mod), C.c_char_p(runner_ptx())), "runner module")
    ok(cu.cuModuleGetFunction(C.byref(fn), mod, b"ferry_runner"), "runner fn")
    host, st = C.c_void_p(), C.c_void_p()
    ok(cu.cuMemHostAlloc(C.byref(host), C.c_size_t(4096), 0x1), "hostalloc")
    ok(cu.cuStreamCreate(C.byref(st), 1), "runner stream")
    C.memset(host, 0, 4096)
    go = (C.c_uint64 * 1).from_address(host.value)
    desc = (C.c_uint64 * 2).from_address(host.value + 16)
    done = (C.c_uint32 * 1).from_address(host.value + 64)
    # ctl, last = 0, idle and life of a second: it stays for the rows.
    ctl, last, idle, life = C.c_uint64(host.value), C.c_uint32(0), C.c_uint64(10**9), C.c_uint64(10**9)
    params = (C.c_void_p * 4)(*[C.cast(C.byref(x), C.c_void_p) for x in (ctl, last, idle, life)])
    ok(cu.cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, st, params, None), "runner launch")
    seq = 0
    rows = [("runner", dst)] + ([("runner IPC", peer)] if peer.value else [])
    try:
        for name, to in rows:
            out = []
            for k in range(rounds + 1):
                seq += 1
                desc[0], desc[1] = to.value, src.value
                t0 = time.perf_counter_ns()
                go[0] = seq | (sz << 32)
                spins = 0
                while done[0] != seq:
                    spins += 1
                    if spins > 5_000_000:
                        raise SystemExit(f"the runner never answered {seq}")
                if k:
                    out.append(time.perf_counter_ns() - t0)
            print(f"completion 4K  {name:<15} p50 {p50(out) / 1e3:8.2f} us")
    except SystemExit as err:
        print(f"completion 4K  runner          failed: {err}")
    go[0] = (seq + 1) | (0xFFFFFFFF << 32)  # STOP
    ok(cu.cuStreamSynchronize(st), "runner end")
    cu.cuStreamDestroy_v2(st)
    cu.cuMemFreeHost(host)
    cu.cuModuleUnload(mod)


def completion(cu, s, e, fn, fn_p, rounds, peer_handle=b""):
    """The completion probe (see the module doc): p50 us of each way."""
    sz = 4096
    src, dst = C.c_uint64(), C.c_uint64()
    ok(cu.cuMemAlloc_v2(C.byref(src), C.c_size_t(sz)), "alloc")
    ok(cu.cuMemAlloc_v2(C.byref(dst), C.c_size_t(sz)), "alloc")
    peer = C.c_uint64()
    if peer_handle:
        h = IpcHandle()
        C.memmove(C.addressof(h), peer_handle, 64)
        r = cu.cuIpcOpenMemHandle_v2(C.byref(peer), h, 1)
        if r != 0:
            print(f"completion 4K  IPC rows skipped: cuIpcOpenMemHandle CUresult {r}")
            peer.value = 0
    # Work queued ahead of a sync copy: 256 MiB to memset.
    big = C.c_uint64()
    ok(cu.cuMemAlloc_v2(C.byref(big), C.c_size_t(256 << 20)), "alloc")
    # Pinned words the GPU reaches: [0] the done flag, [1] the go word,
    # then one descriptor (dst, src, len) for the armed kernel.
    host = C.c_void_p()
    ok(cu.cuMemHostAlloc(C.byref(host), C.c_size_t(4096), 0x2 | 0x1), "hostalloc mapped")
    dev = C.c_uint64()
    ok(cu.cuMemHostGetDevicePointer_v2(C.byref(dev), host, 0), "device pointer")
    words = (C.c_uint32 * 2).from_address(host.value)
    desc = (C.c_uint64 * 3).from_address(host.value + 64)
    words[0] = words[1] = 0
    done_at, go_at = C.c_uint64(dev.value), C.c_uint64(dev.value + 4)
    hdesc = C.c_uint64(host.value + 64)
    write = getattr(cu, "cuStreamWriteValue32_v2", None) or cu.cuStreamWriteValue32
    wait = getattr(cu, "cuStreamWaitValue32_v2", None) or cu.cuStreamWaitValue32
    one = C.c_uint32(1)

    def copy_on(st, to=dst, frm=src):
        ok(cu.cuMemcpyDtoDAsync_v2(to, frm, C.c_size_t(sz), st), "copy")

    def sync_copy(to=dst, frm=src):
        ok(cu.cuMemcpyDtoD_v2(to, frm, C.c_size_t(sz)), "sync copy")

    copy = lambda: copy_on(s)
    seq = [0]

    def flag_now():
        seq[0] += 1
        ok(write(s, done_at, C.c_uint32(seq[0]), 0), "cuStreamWriteValue32")

    def until_flag():
        spins = 0
        while words[0] != seq[0]:
            spins += 1
            if spins > 5_000_000:  # seconds: the write never landed
                raise SystemExit(f"the stream's write of {seq[0]} never landed (flag {words[0]})")

    def event_on(st):
        ok(cu.cuEventRecord(e, st), "record")
        while cu.cuEventQuery(e) == 600:
            pass

    event_now = lambda: event_on(s)

    def run(issue):
        issue()
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            issue()
            out.append(time.perf_counter_ns() - t0)
        return p50(out) / 1e3

    def armed(queue):
        """Queues `queue` behind a wait on the go word, then times the
        host's store to the done flag."""
        out = []
        for k in range(rounds + 1):
            target = seq[0] + 1
            ok(wait(s, go_at, C.c_uint32(target), 0), "cuStreamWaitValue32")  # GEQ
            queue()
            flag_now()
            time.sleep(0.0002)  # the GPU is parked on the wait
            t0 = time.perf_counter_ns()
            desc[0], desc[1], desc[2] = dst.value, src.value, sz
            words[1] = target
            until_flag()
            if k:
                out.append(time.perf_counter_ns() - t0)
        return p50(out) / 1e3

    chunks = 1
    p_host = (C.c_void_p * 2)(C.cast(C.byref(hdesc), C.c_void_p), C.cast(C.byref(one), C.c_void_p))
    byval = (C.c_uint64 * (3 * PARAM_DESCS))(dst.value, src.value, sz)
    p_val = (C.c_void_p * 2)(C.cast(C.byref(one), C.c_void_p), C.cast(byval, C.c_void_p))
    launch = lambda f, params: ok(cu.cuLaunchKernel(f, 1, chunks, 1, 256, 1, 1, 0, s, params, None), "launch")
    # Other streams, to tell why an async copy costs more than a sync one:
    # the legacy default stream, a blocking one, the highest priority, and
    # two streams in turn (as a shard's pool takes them).
    null = C.c_void_p(0)
    sb, sh, s2 = C.c_void_p(), C.c_void_p(), C.c_void_p()
    ok(cu.cuStreamCreate(C.byref(sb), 0), "blocking stream")
    lo, hi = C.c_int(), C.c_int()
    ok(cu.cuCtxGetStreamPriorityRange(C.byref(lo), C.byref(hi)), "priority range")
    ok(cu.cuStreamCreateWithPriority(C.byref(sh), 1, hi), "high-priority stream")
    ok(cu.cuStreamCreate(C.byref(s2), 1), "second stream")
    turn = [0]

    def in_turn():
        turn[0] ^= 1
        st = s if turn[0] else s2
        copy_on(st)
        event_on(st)

    def spin_us(us):
        t = time.perf_counter_ns() + us * 1000
        while time.perf_counter_ns() < t:
            pass

    rows = [
        ("copy + event", lambda: (copy(), event_now())),
        ("null copy+event", lambda: (copy_on(null), event_on(null))),
        ("blocking s", lambda: (copy_on(sb), event_on(sb))),
        (f"priority {hi.value}", lambda: (copy_on(sh), event_on(sh))),
        ("two streams", in_turn),
        ("copy + s sync", lambda: (copy(), ok(cu.cuStreamSynchronize(s), "stream sync"))),
        ("null copy+ctxsync", lambda: (copy_on(null), ok(cu.cuCtxSynchronize(), "ctx sync"))),
        ("copy, 3us, event", lambda: (copy(), spin_us(3), event_now())),
        ("sync copy, s", lambda: (sync_copy(), event_now())),
        ("sync cuMemcpy", lambda: ok(cu.cuMemcpy(dst, src, C.c_size_t(sz)), "sync cuMemcpy")),
        ("event alone", event_now),
        ("copy + flag", lambda: (copy(), flag_now(), until_flag())),
        ("flag alone", lambda: (flag_now(), until_flag())),
        ("sync copy", sync_copy),
        ("kernel + flag", lambda: (launch(fn_p, p_val), flag_now(), until_flag())),
    ]
    if peer.value:
        rows += [
            ("IPC copy+event", lambda: (copy_on(s, to=peer), event_now())),
            ("IPC sync copy", lambda: sync_copy(to=peer)),
            ("IPC sync read", lambda: sync_copy(frm=peer)),
        ]
    for name, issue in rows:
        try:
            print(f"completion 4K  {name:<15} p50 {run(issue):8.2f} us")
        except SystemExit as err:
            print(f"completion 4K  {name:<15} failed: {err}")
        ok(cu.cuCtxSynchronize(), "sync")

    def behind(st):
        """A sync copy timed alone, with a 256 MiB memset queued on `st`
        first: does it wait for that stream's work?"""
        out = []
        for _ in range(min(rounds, 100)):
            ok(cu.cuMemsetD8Async(big, 0, C.c_size_t(256 << 20), st), "memset")
            t0 = time.perf_counter_ns()
            sync_copy()
            out.append(time.perf_counter_ns() - t0)
            ok(cu.cuCtxSynchronize(), "sync")
        return p50(out) / 1e3

    for name, st in (("sync, legacy busy", null), ("sync, s busy", s)):
        print(f"completion 4K  {name:<15} p50 {behind(st):8.2f} us")

    # Does a synchronous device-to-device copy end before it returns? CUDA
    # documents no host-side synchronisation for that direction. 64 MiB
    # takes tens of microseconds to move: a return much sooner than the
    # async copy's end says the call only queued it. Then an event on the
    # legacy stream, recorded after the sync copy, tells when it ended.
    n64 = 64 << 20
    half = C.c_uint64(big.value + n64)

    def timed(issue, n=50):
        out = []
        for _ in range(n):
            ok(cu.cuCtxSynchronize(), "sync")
            t0 = time.perf_counter_ns()
            issue()
            out.append(time.perf_counter_ns() - t0)
        return p50(out) / 1e3

    sync64 = lambda: ok(cu.cuMemcpyDtoD_v2(half, big, C.c_size_t(n64)), "sync copy 64M")
    for name, issue in (
        ("64M async+event", lambda: (ok(cu.cuMemcpyDtoDAsync_v2(half, big, C.c_size_t(n64), s), "copy"), event_now())),
        ("64M sync", sync64),
        ("64M sync+lgcy ev", lambda: (sync64(), event_on(null))),
        ("4K sync+lgcy ev", lambda: (sync_copy(), event_on(null))),
    ):
        print(f"completion     {name:<15} p50 {timed(issue):8.2f} us")
    for name, queue in (("armed copy", copy), ("armed kernel", lambda: launch(fn, p_host))):
        try:
            print(f"completion 4K  {name:<15} p50 {armed(queue):8.2f} us")
        except SystemExit as err:
            print(f"completion 4K  {name:<15} failed: {err}")
            words[1] = 0xFFFFFFFF  # lets any wait still queued go
        ok(cu.cuCtxSynchronize(), "sync")
        words[1] = seq[0]
    resident(cu, src, dst, peer, rounds)
    for p in (src, dst, big):
        cu.cuMemFree_v2(p)
    for st in (sb, sh, s2):
        cu.cuStreamDestroy_v2(st)
    if peer.value:
        cu.cuIpcCloseMemHandle(peer)
    cu.cuMemFreeHost(host)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4Kx32,64Kx32,16Kx1024")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--neighbour", action="store_true")
    ap.add_argument("--completion", action="store_true", help="first, the completion probe (module doc)")
    a = ap.parse_args()
    if a.neighbour:
        ctx = mp.get_context("spawn")
        ready, done, handle = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=neighbour, args=(ready, done, handle), daemon=True)
        proc.start()
        ready.wait(60)
        peer_handle = handle.get(timeout=60)
    cu = C.CDLL("libcuda.so.1")
    ok(cu.cuInit(0), "cuInit")
    dev, ctx = C.c_int(), C.c_void_p()
    ok(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    ok(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "retain")
    ok(cu.cuCtxSetCurrent(ctx), "set")
    mod, mod_p, fn, fn_p = C.c_void_p(), C.c_void_p(), C.c_void_p(), C.c_void_p()
    image, image_p = ptx()
    ok(cu.cuModuleLoadData(C.byref(mod), C.c_char_p(image)), "cuModuleLoadData")
    ok(cu.cuModuleGetFunction(C.byref(fn), mod, b"ferry_gather"), "fn")
    ok(cu.cuModuleLoadData(C.byref(mod_p), C.c_char_p(image_p)), "cuModuleLoadData (by value)")
    ok(cu.cuModuleGetFunction(C.byref(fn_p), mod_p, b"ferry_gather_p"), "fn_p")
    s, e = C.c_void_p(), C.c_void_p()
    ok(cu.cuStreamCreate(C.byref(s), 1), "stream")
    ok(cu.cuEventCreate(C.byref(e), 2), "event")

    def timed(issue):
        out = []
        for _ in range(a.rounds):
            t0 = time.perf_counter_ns()
            issue()
            ok(cu.cuEventRecord(e, s), "record")
            while cu.cuEventQuery(e) == 600:  # CUDA_ERROR_NOT_READY
                pass
            out.append(time.perf_counter_ns() - t0)
        return p50(out) / 1e3

    print(f"neighbour context: {'yes' if a.neighbour else 'no'}")
    if a.completion:
        completion(cu, s, e, fn, fn_p, a.rounds, peer_handle if a.neighbour else b"")
    for shape in a.shapes.split(","):
        sz, n = shape.lower().split("x")
        sz, n = size(sz), int(n)
        span = n * (sz + GAP)
        src, dst, ddesc = C.c_uint64(), C.c_uint64(), C.c_uint64()
        ok(cu.cuMemAlloc_v2(C.byref(src), C.c_size_t(span)), "alloc")
        ok(cu.cuMemAlloc_v2(C.byref(dst), C.c_size_t(span)), "alloc")
        ok(cu.cuMemAlloc_v2(C.byref(ddesc), C.c_size_t(24 * n)), "alloc")
        hdesc = C.c_void_p()
        ok(cu.cuMemHostAlloc(C.byref(hdesc), C.c_size_t(24 * n), 0), "hostalloc")
        offs = [k * (sz + GAP) for k in range(n)]
        words = []
        for o in offs:
            words += [dst.value + o, src.value + o, sz]
        arr = (C.c_uint64 * len(words)).from_address(hdesc.value)
        arr[:] = words
        ok(cu.cuMemcpyHtoD_v2(ddesc, hdesc, C.c_size_t(24 * n)), "descs")
        dsts = (C.c_uint64 * n)(*[dst.value + o for o in offs])
        srcs = (C.c_uint64 * n)(*[src.value + o for o in offs])
        sizes = (C.c_size_t * n)(*[sz] * n)
        attr, idx = Attr(1, 0, 0, 0, 0, 0), (C.c_size_t * 1)(0)
        fail = C.c_size_t()
        chunks = max(1, -(-sz // CHUNK))
        count = C.c_uint32(n)

        def launch(f, params):
            ok(cu.cuLaunchKernel(f, n, chunks, 1, 256, 1, 1, 0, s, params, None), "launch")

        hptr, dptr = C.c_uint64(hdesc.value), C.c_uint64(ddesc.value)
        p_host = (C.c_void_p * 2)(C.cast(C.byref(hptr), C.c_void_p), C.cast(C.byref(count), C.c_void_p))
        p_dev = (C.c_void_p * 2)(C.cast(C.byref(dptr), C.c_void_p), C.cast(C.byref(count), C.c_void_p))
        byval = (C.c_uint64 * (3 * PARAM_DESCS))(*(words + [0] * (3 * PARAM_DESCS - len(words)))) if n <= PARAM_DESCS else None
        rows = [
            ("engine 1 call", lambda: ok(cu.cuMemcpyDtoDAsync_v2(dst, src, C.c_size_t(sz * n), s), "copy")),
            ("engine batch", lambda: ok(cu.cuMemcpyBatchAsync_v2(dsts, srcs, sizes, C.c_size_t(n), C.byref(attr), idx, C.c_size_t(1), s)
                                        if hasattr(cu, "cuMemcpyBatchAsync_v2") else
                                        cu.cuMemcpyBatchAsync(dsts, srcs, sizes, C.c_size_t(n), C.byref(attr), idx, C.c_size_t(1), C.byref(fail), s), "batch")),
            ("kernel, pinned", lambda: launch(fn, p_host)),
            ("kernel, device", lambda: launch(fn, p_dev)),
        ]
        if byval is not None:
            p_val = (C.c_void_p * 2)(C.cast(C.byref(count), C.c_void_p), C.cast(byval, C.c_void_p))
            rows.append(("kernel, params", lambda: launch(fn_p, p_val)))
        for name, issue in rows:
            issue()
            ok(cu.cuCtxSynchronize(), "sync")
            print(f"{shape:>10}  {name:<15} p50 {timed(issue):8.2f} us")
        # The kernels copied right: check the last piece's bytes landed.
        ok(cu.cuMemsetD8_v2(src, 7, C.c_size_t(span)), "memset")
        ok(cu.cuMemsetD8_v2(dst, 0, C.c_size_t(span)), "memset")
        launch(fn_p if byval is not None else fn, p_val if byval is not None else p_dev)
        ok(cu.cuCtxSynchronize(), "sync")
        back = (C.c_uint8 * sz)()
        ok(cu.cuMemcpyDtoH_v2(back, C.c_uint64(dst.value + offs[-1]), C.c_size_t(sz)), "back")
        print(f"{shape:>10}  last piece copied: {all(b == 7 for b in back)}")
        for p in (src, dst, ddesc):
            cu.cuMemFree_v2(p)
        cu.cuMemFreeHost(hdesc)
    if a.neighbour:
        done.set()


if __name__ == "__main__":
    main()
