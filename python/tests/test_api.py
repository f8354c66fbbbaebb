"""ferry.Endpoint: the Pythonic API."""

import array
import asyncio
import ctypes
import mmap

import numpy as np
import pytest

import ferry


def connected(transport):
    a, b = ferry.Endpoint(), ferry.Endpoint()
    a.listen()
    conn = b.connect(a.metadata)
    assert conn.peer[0] == transport
    return a, b, conn


def test_locate_understands_the_usual_buffers():
    ba = bytearray(b"x" * 100)
    b = ferry.locate(ba)
    assert (b.nbytes, b.readonly, b.device) == (100, False, False)
    assert ctypes.string_at(b.ptr, 3) == b"xxx"
    with pytest.raises(BufferError):
        ba.extend(b"y")  # pinned while located: cannot move
    ro = ferry.locate(b"abc")
    assert ro.readonly and ctypes.string_at(ro.ptr, 3) == b"abc"
    arr = np.arange(10, dtype=np.float64)
    n = ferry.locate(arr)
    assert n.ptr == arr.ctypes.data and n.nbytes == 80
    ron = arr.copy()
    ron.flags.writeable = False
    assert ferry.locate(ron).readonly and ferry.locate(ron).ptr == ron.ctypes.data
    assert ferry.locate(array.array("i", [1, 2, 3])).nbytes == 12
    m = mmap.mmap(-1, 4096)
    assert ferry.locate(m).nbytes == 4096
    with pytest.raises(ValueError, match="contiguous"):
        ferry.locate(np.zeros((4, 4))[:, 1])
    with pytest.raises(TypeError):
        ferry.locate(object())

    class Cai:  # a GPU array as cupy/numba describe it
        __cuda_array_interface__ = {"data": (0x7000, False), "shape": (4, 8), "typestr": "<f2", "version": 3}

    g = ferry.locate(Cai())
    assert (g.ptr, g.nbytes, g.device) == (0x7000, 64, True)


def test_dlpack_producers_are_read_without_copies():
    arr = np.arange(64, dtype=np.uint32)

    class OnlyDlpack:  # hides the buffer protocol: DLPack is the only way in
        def __dlpack__(self, **kw):
            return arr.__dlpack__(**kw)

        def __dlpack_device__(self):
            return arr.__dlpack_device__()

    b = ferry.locate(OnlyDlpack())
    assert b.ptr == arr.ctypes.data and b.nbytes == 256 and not b.device


def test_write_read_and_windows(transport):
    with ferry.Endpoint() as a, ferry.Endpoint() as b:
        a.listen()
        conn = b.connect(a.metadata)
        assert conn.peer[0] == transport
        dst = np.zeros(1 << 20, np.uint8)
        with a.register(dst) as region:
            window = ferry.Window(bytes(region.advertise()))  # as sent over the wire
            src = b.register(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8))
            conn.write(src, window)
            assert bytes(dst) == bytes(src.view())
            # a part: 4 KiB at offset 8 KiB of both
            part = region.advertise(8192, 4096, conn=None)
            back = b.alloc(4096)
            conn.read(back, part)
            assert bytes(back.view()) == bytes(dst[8192:12288])
            conn.write((src, 0, 16), part)
            assert bytes(dst[8192:8208]) == bytes(src.view()[:16])
            # vectored
            wins = [region.advertise(i * 4096, 4096) for i in range(4)]
            conn.writev([(src, i * 4096, 4096) for i in range(4)], wins)
            assert bytes(dst[:16384]) == bytes(src.view()[:16384])
            with pytest.raises(ferry.FerryError, match="outside the region"):
                region.advertise(1 << 20, 1)
            with pytest.raises(ferry.FerryError, match="do not fit"):
                conn.write(src, part)
            with pytest.raises(ValueError):
                ferry.Window(b"123")


def test_metrics_count_the_ops_and_their_bytes(transport):
    with ferry.Endpoint() as a, ferry.Endpoint() as b:
        a.listen()
        conn = b.connect(a.metadata)
        dst = np.zeros(1 << 16, np.uint8)
        with a.register(dst) as region:
            window = region.advertise()
            src = b.register(np.ones(1 << 16, np.uint8))
            for _ in range(5):
                conn.write(src, window)
            conn.read(src, window)
        m = b.metrics()
        ok = 'ferry_ops_total{op="%s",transport="%s",result="ok"}'
        assert m[ok % ("write", transport)] == 5
        assert m[ok % ("read", transport)] == 1
        out = 'ferry_bytes_total{op="write",transport="%s",direction="out",role="initiator"}'
        assert m[out % transport] == 5 << 16
        assert m['ferry_op_duration_seconds_count{op="write"}'] == 5
        served = a.metrics()
        into = 'ferry_bytes_total{op="write",transport="%s",direction="in",role="target"}'
        assert served[into % transport] == 5 << 16
        assert "# TYPE ferry_ops_total counter" in b.metrics_text()


def test_typed_arrays_carry_their_dtype_and_move_exactly(monkeypatch):
    """A float array's dtype rides in its windows (byte 42: the codec's
    type + 1); over tcp with FERRY_COMPRESS=on its chunks go packed and
    land byte-exact; integer arrays carry none."""
    monkeypatch.setenv("FERRY_TRANSPORT", "tcp")
    monkeypatch.setenv("FERRY_LISTEN_ADDR", "127.0.0.1")
    monkeypatch.setenv("FERRY_COMPRESS", "on")
    rng = np.random.default_rng(1)
    with ferry.Endpoint() as a, ferry.Endpoint() as b:
        a.listen()
        conn = b.connect(a.metadata)
        dst = np.zeros(1 << 20, np.float16)
        with a.register(dst) as region:
            window = region.advertise()
            assert bytes(window)[42] == 2 + 1  # fp16
            src_arr = (rng.standard_normal(1 << 20) * 0.02).astype(np.float16)
            src = b.register(src_arr)
            conn.write(src, window)
            assert bytes(dst) == bytes(src_arr)
            back = np.zeros(1 << 20, np.float16)
            conn.read(b.register(back), window)
            assert bytes(back) == bytes(src_arr)
        assert bytes(a.register(np.zeros(16, np.int32)).advertise())[42] == 0
        assert bytes(a.register(np.zeros(16, np.uint8), dtype="bf16").advertise())[42] == 1 + 1


def test_awaiting_a_thousand_transfers_spins_no_thread(transport):
    """1 000 transfers over 4 connections, awaited: the event loop sleeps
    on the endpoint's completion fd between completions."""
    import threading
    import time

    targets = [ferry.Endpoint() for _ in range(4)]
    for t in targets:
        t.listen()
    b = ferry.Endpoint()
    conns = [b.connect(t.metadata) for t in targets]
    dsts = [t.alloc(250 * 4096) for t in targets]
    src = b.register(bytearray(bytes(range(256)) * 16 * 250))

    async def go():
        # Another thread posts a wave of 40 every 10 ms, as a service's
        # requests come, and hands each wave over; this loop only awaits.
        loop = asyncio.get_running_loop()
        waves: "asyncio.Queue[list]" = asyncio.Queue()

        def post():
            for wave in range(25):
                ts = []
                for k in range(40):
                    i = wave * 40 + k
                    c, slot = i % 4, i // 4
                    ts.append(conns[c].write_async((src, slot * 4096, 4096), dsts[c].advertise(slot * 4096, 4096)))
                loop.call_soon_threadsafe(waves.put_nowait, ts)
                time.sleep(0.01)

        poster = threading.Thread(target=post)
        cpu0, t0 = time.thread_time(), time.perf_counter()
        poster.start()
        done = []
        for _ in range(25):
            wave = await waves.get()
            await asyncio.gather(*wave)
            done += wave
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - t0
        poster.join()
        return done, cpu, wall

    ts, cpu, wall = asyncio.run(go())
    assert all(t.done() for t in ts)
    for d in dsts:
        assert bytes(d.view()) == bytes(range(256)) * 16 * 250
    print(f"{transport}: 1000 transfers awaited over 4 connections; the event loop's thread used "
          f"{cpu * 1e3:.1f} ms of CPU in {wall * 1e3:.0f} ms ({100 * cpu / wall:.1f} % of a core)")
    # A transfer that fails raises through await.
    gone = targets[0].alloc(4096)
    w = gone.advertise()
    gone.close()

    async def fails():
        await conns[0].write_async((src, 0, 4096), w)

    with pytest.raises(ferry.FerryError):
        asyncio.run(fails())
    b.close()
    for t in targets:
        t.close()


def test_await_and_wait(transport):
    a, b, conn = connected(transport)
    dst = a.alloc(1 << 16)
    window = dst.advertise()
    src = b.register(bytearray(b"\x5a" * (1 << 16)))

    async def go():
        await conn.write_async(src, window)
        ts = [conn.read_async((src, i * 1024, 1024), dst.advertise(i * 1024, 1024)) for i in range(8)]
        await asyncio.gather(*ts)

    asyncio.run(go())
    assert bytes(dst.view()) == b"\x5a" * (1 << 16)
    t = conn.write_async(src, window)
    t.wait(10)
    assert t.done()
    t.wait()  # again: no error
    a.close()
    b.close()


def test_notifications_and_read_only_sources(transport):
    a, b, conn = connected(transport)
    conn.notify(b"ping")
    cid, msg = a.recv_notification(5)
    assert msg == b"ping"
    with pytest.raises(ferry.FerryError, match="notification"):
        a.recv_notification(0.05)
    dst = a.alloc(16)
    src = b.register(b"0123456789abcdef")  # bytes: read-only, fine as a source
    conn.write(src, dst.advertise())
    assert bytes(dst.view()) == b"0123456789abcdef"
    # ... and peers may not write into it.
    ro = a.register(b"immutable bytes!")
    with pytest.raises(ferry.FerryError):
        conn.write(b.alloc(16), ro.advertise())
    assert bytes(ctypes.string_at(ro.ptr, 16)) == b"immutable bytes!"
    with pytest.raises(ferry.FerryError, match="another endpoint"):
        conn.read(dst, ro.advertise())
    back = b.alloc(16)
    conn.read(back, ro.advertise())
    assert bytes(back.view()) == b"immutable bytes!"
    conn.close()
    with pytest.raises(ferry.FerryError):
        conn.write(src, dst.advertise())
    a.close()
    b.close()


def test_a_read_into_read_only_memory_is_refused(transport):
    a, b, conn = connected(transport)
    src = a.register(bytearray(b"\x42" * 4096))
    window = src.advertise()
    immutable = b.register(bytes(4096))  # read-only to Python
    with pytest.raises(ferry.FerryError, match="read-only"):
        conn.read(immutable, window)
    with pytest.raises(ferry.FerryError, match="read-only"):
        conn.readv([(immutable, 0, 16)], [src.advertise(0, 16)])
    assert bytes(ctypes.string_at(immutable.ptr, 4096)) == bytes(4096)
    a.close()
    b.close()


def test_closed_endpoint_says_so():
    ep = ferry.Endpoint()
    r = ep.alloc(64)
    ep.close()
    with pytest.raises(ferry.FerryError, match="closed"):
        ep.metadata
    with pytest.raises(ferry.FerryError, match="closed"):
        r.advertise()
    assert "closed" in repr(ep)


def test_the_type_stub_matches_the_extension():
    """ferry/_native.pyi lists exactly what the extension defines."""
    import ast
    import os

    from ferry import _native

    stub = os.path.join(os.path.dirname(ferry.__file__), "_native.pyi")
    tree = ast.parse(open(stub).read())
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    top |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    public = {k for k in dir(_native) if not k.startswith("_")}
    assert top == public, (top ^ public)
    ep_stub = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Endpoint")
    methods = {n.name for n in ep_stub.body if isinstance(n, ast.FunctionDef)} - {"__init__"}
    real = {k for k in dir(_native.Endpoint) if not k.startswith("_")}
    assert methods == real, (methods ^ real)


def test_three_causes_are_three_exception_classes(monkeypatch):
    """A silent, a lying and a gone peer (ferry's rogue test peers) fail
    their connections with three subclasses of ``ferry.ConnectionFailed``;
    later calls on the dead connection raise the same class."""
    import struct
    import time

    monkeypatch.setenv("FERRY_OP_TIMEOUT_MS", "500")
    monkeypatch.setenv("FERRY_TRANSPORT", "tcp")
    ep = ferry.Endpoint()
    src = ep.alloc(64)
    # A window the rogue never answers for: addr 0x1000, 64 bytes, rkey 1.
    w = ferry.Window(struct.pack("<QII", 0x1000, 64, 1) + bytes(48))

    def fail(how):
        port = ferry._native._rogue_peer(how)
        conn = ferry.Connection(ep, ep._n.connect("127.0.0.1", port))
        deadline = time.monotonic() + 10
        while True:
            try:
                conn.write(src, w, timeout=5)
            except ferry.ConnectionFailed as e:
                with pytest.raises(type(e)):
                    conn.write(src, w, timeout=5)
                return type(e)
            assert time.monotonic() < deadline, how

    assert fail("silent") is ferry.PeerTimeout
    assert fail("garbage") is ferry.PeerMisbehaved
    assert fail("hangup") is ferry.Disconnected
    with pytest.raises(ferry.InvalidArgument):
        ferry._native._rogue_peer("polite")
    assert issubclass(ferry.PeerTimeout, ferry.FerryError)


def test_vouch_tells_the_dialer_from_another(transport):
    """The endpoint whose metadata we trust vouches for the connection it
    dialed, not for one another endpoint dialed."""
    target, dialer, _ = connected(transport)
    dialer.listen()  # its accept loop answers the question
    from_dialer = target.accept(5)
    other = ferry.Endpoint()
    other.connect(target.metadata)
    from_other = target.accept(5)
    assert from_dialer.vouch(dialer.metadata)
    assert not from_other.vouch(dialer.metadata)
    with pytest.raises(ferry.FerryError):
        from_dialer.vouch(b"not metadata")
