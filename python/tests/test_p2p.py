"""ferry.p2p: the seed's API, its (ok, ...) shapes and its error cases."""

import hashlib
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ferry
from ferry import p2p

import peer

HERE = os.path.dirname(os.path.abspath(__file__))


def digest(a):
    return hashlib.sha256(bytes(a)).hexdigest()


def test_module_surface():
    for name in [
        "get_metadata", "parse_metadata", "get_oob_ip", "connect", "accept",
        "start_passive_accept", "add_remote_endpoint", "remove_remote_endpoint",
        "connect_local", "accept_local", "conn_id_of_rank", "reg", "regv", "dereg",
        "advertise", "advertisev", "read", "write", "readv", "writev", "read_async",
        "write_async", "readv_async", "writev_async", "poll_async", "advertise_ipc",
        "advertisev_ipc", "write_ipc", "read_ipc", "writev_ipc", "readv_ipc",
        "write_ipc_async", "read_ipc_async", "writev_ipc_async", "readv_ipc_async",
        "register_memory", "deregister_memory", "get_serialized_descs",
        "deserialize_descs", "transfer", "send_notification", "recv_notification",
        "send", "recv", "send_async", "recv_async", "sendv", "recvv", "sendv_async",
        "recvv_async", "send_ipc", "recv_ipc", "send_ipc_async", "recv_ipc_async",
    ]:
        assert hasattr(p2p.Endpoint, name), name
    assert p2p.kFloat16 == p2p.FloatType.kFloat16
    assert isinstance(p2p.get_oob_ip(), str)
    assert p2p.XferDesc().mr_id == p2p.UINT64_MAX


def test_metadata_round_trip_and_lazy_gpu():
    ep = p2p.Endpoint(None, 8, 16)  # extra positional arguments are ignored
    assert ep.gpu is None
    ip, port, bdf = p2p.Endpoint.parse_metadata(ep.get_metadata())
    assert port > 0 and bdf == ""
    assert ip == p2p.get_oob_ip() or ip == "127.0.0.1" or ip
    with pytest.raises(p2p.FerryError):
        p2p.Endpoint.parse_metadata(b"\x01\x02")
    assert ep.conn_id_of_rank(0) == p2p.UINT64_MAX
    assert "ferry P2P Endpoint" in repr(ep)
    ep.close()
    assert "closed" in repr(ep)


def pair(transport):
    """Two endpoints of this process, connected (shm: same host)."""
    a, b = p2p.Endpoint(), p2p.Endpoint()
    assert a.start_passive_accept()
    ok, conn = b.add_remote_endpoint(a.get_metadata())
    assert ok
    assert b.peer(conn)[0] == transport
    return a, b, conn


def test_every_operation_in_one_process(transport):
    a, b, conn = pair(transport)
    size = 256 << 10
    dst = np.zeros(size, np.uint8)
    ok, dmr = a.reg(dst.ctypes.data, size)
    assert ok
    _, meta_any = a.advertise(dmr, dst.ctypes.data, size)  # repository form
    src = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    ok, smr = b.reg(src.ctypes.data, size)
    assert b.write(conn, smr, src.ctypes.data, size, meta_any)
    assert digest(dst) == digest(src)
    # A window on the second half only, and a write of 4 KiB at its start.
    _, half = a.advertise(dmr, dst.ctypes.data + size // 2, size // 2)
    src[:4096] = 9
    ok, tid = b.write_async(conn, smr, src.ctypes.data, 4096, half)
    assert ok
    assert b.wait(tid, 10.0)
    assert (dst[size // 2 : size // 2 + 4096] == 9).all()
    # READ back the whole window, vectored in 4 pieces.
    back = np.zeros(size, np.uint8)
    ok, bmr = b.reg(back.ctypes.data, size)
    q = size // 4
    _, metas = a.advertisev([dmr] * 4, [dst.ctypes.data + i * q for i in range(4)], [q] * 4, 4)
    ok, tid = b.readv_async(conn, [bmr] * 4, [back.ctypes.data + i * q for i in range(4)], [q] * 4, metas, 4)
    assert ok
    while True:
        ok, done = b.poll_async(tid)
        assert ok
        if done:
            break
    assert digest(back) == digest(dst)
    # A finished id is forgotten.
    assert b.poll_async(tid) == (False, False)
    # Notifications both ways.
    assert b.send_notification(conn, b"hello")
    ok, from_conn, msg = a.recv_notification(5000)
    assert ok and msg == b"hello"
    assert a.send_notification(from_conn, b"back")
    assert b.recv_notification(5000)[2] == b"back"
    assert b.recv_notification(50) == (False, 0, b"")
    # regv / dereg
    ok, ids = a.regv([dst.ctypes.data, back.ctypes.data], [16, 16])
    assert ok and len(ids) == 2 and all(a.dereg(i) for i in ids)
    assert b.remove_remote_endpoint(conn)
    assert b.write(conn, smr, src.ctypes.data, 16, meta_any) is False
    a.close()
    b.close()


def test_two_sided_messages_in_order(transport):
    """send/recv as the seed's callers use them: in order per connection,
    a receive size past the registration cut to it (UCCL's own test posts
    twice the tensor's bytes), a longer message refused on both sides,
    the vectored and async forms, and notifications kept apart."""
    a, b, conn = pair(transport)
    ok, a_conn, _, _ = True, None, None, None
    # a's id for the connection: from a notification b sends first.
    assert b.send_notification(conn, b"hi")
    ok, a_conn, msg = a.recv_notification(5000)
    assert ok and msg == b"hi"
    src = np.random.default_rng(4).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    _, smr = b.reg(src.ctypes.data, src.nbytes)
    _, dmr = a.reg(dst.ctypes.data, dst.nbytes)
    ok, rid = a.recv_async(a_conn, dmr, dst.ctypes.data, dst.nbytes * 2)
    assert ok
    assert b.send(conn, smr, src.ctypes.data, src.nbytes)
    assert a.wait(rid, 10.0)
    assert digest(dst) == digest(src)
    # Vectored: one message per piece, in order.
    dst[:] = 0
    q = 1 << 14
    # (One thread plays both sides, and a side's work moves in its own
    # calls: the receiver posts, the sender waits, then the receiver.)
    ok, rid = a.recvv_async(a_conn, [dmr] * 4, [dst.ctypes.data + i * q for i in range(4)], [q] * 4, 4)
    assert ok
    assert b.sendv(conn, [smr] * 4, [src.ctypes.data + i * q for i in range(4)], [q] * 4, 4)
    assert a.wait(rid, 10.0)
    assert digest(dst) == digest(src)
    # Too long for the buffer: both sides fail, nothing lands.
    dst[:] = 7
    ok, rid = a.recv_async(a_conn, dmr, dst.ctypes.data, 100)
    assert ok
    assert b.send(conn, smr, src.ctypes.data, 200) is False
    assert a.wait(rid, 10.0) is False
    assert (dst == 7).all()
    # Unknown ids are refused at once.
    assert b.send_async(conn + 999, smr, src.ctypes.data, 8) == (False, 0)
    assert b.send_async(conn, smr + 999, src.ctypes.data, 8) == (False, 0)
    # The app's inbox saw only the app's note.
    assert a.recv_notification(50) == (False, 0, b"")
    a.close()
    b.close()


def test_error_cases_return_not_ok_and_log(transport, caplog):
    a, b, conn = pair(transport)
    buf = np.zeros(8192, np.uint8)
    ok, mr = a.reg(buf.ctypes.data, 8192)
    _, meta = a.advertise(mr, buf.ctypes.data, 4096)
    src = np.ones(8192, np.uint8)
    _, smr = b.reg(src.ctypes.data, 8192)
    with caplog.at_level(logging.WARNING, logger="ferry"):
        # unknown ids
        assert b.poll_async(987654) == (False, False)
        assert b.write(conn, 999, src.ctypes.data, 16, meta) is False
        assert b.write(conn + 12345, smr, src.ctypes.data, 16, meta) is False
        assert b.dereg(424242) is False
        # wrong sizes: more than the window holds, outside the registration
        assert b.write(conn, smr, src.ctypes.data, 8192, meta) is False
        assert b.write(conn, smr, src.ctypes.data + 4096, 8192, meta) is False
        assert b.write_async(conn, smr, src.ctypes.data, 8192, meta)[0] is False
        # a window whose key is not valid at the peer
        forged = bytearray(meta)
        forged[32] ^= 0xFF  # the key's tag
        assert b.write(conn, smr, src.ctypes.data, 16, bytes(forged)) is False
        assert b.connect("not-an-ip", 0, 1)[0] is False
        assert b.connect("127.0.0.1", 0, -1)[0] is False
        assert b.connect_local("zz:zz")[0] is False
    assert "unknown or already reported transfer id 987654" in caplog.text
    assert "unknown mr_id 999" in caplog.text
    # malformed arguments raise, as in the seed
    with pytest.raises(p2p.FerryError, match="64 bytes"):
        b.write(conn, smr, src.ctypes.data, 16, b"short")
    with pytest.raises(p2p.FerryError, match="num_iovs"):
        b.writev(conn, [smr], [src.ctypes.data], [16, 16], [meta], 1)
    with pytest.raises(p2p.FerryError, match="advertise takes"):
        a.advertise(1, 2)
    with pytest.raises(p2p.FerryError, match="op_name"):
        b.transfer(conn, "copy", [], [])
    # strict mode raises where the seed returns False
    s = p2p.Endpoint(strict=True)
    with pytest.raises(p2p.FerryError, match="poll_async: unknown"):
        s.poll_async(1)
    a.close()
    b.close()
    s.close()


def test_async_calls_on_an_unknown_connection_are_not_ok_at_once(transport):
    a, b, conn = pair(transport)
    buf = np.zeros(4096, np.uint8)
    _, mr = a.reg(buf.ctypes.data, 4096)
    _, meta = a.advertise(mr, buf.ctypes.data, 4096)
    src = np.ones(4096, np.uint8)
    _, smr = b.reg(src.ctypes.data, 4096)
    bad = conn + 4242
    p = src.ctypes.data
    assert b.write_async(bad, smr, p, 16, meta)[0] is False
    assert b.read_async(bad, smr, p, 16, meta)[0] is False
    assert b.writev_async(bad, [smr], [p], [16], [meta], 1)[0] is False
    assert b.readv_async(bad, [smr], [p], [16], [meta], 1)[0] is False
    # and on the known connection they go through
    ok, t = b.write_async(conn, smr, p, 16, meta)
    assert ok
    while not b.poll_async(t)[1]:
        pass
    a.close()
    b.close()


def test_a_read_into_a_readonly_registration_returns_not_ok(transport):
    a, b, conn = pair(transport)
    src = np.full(4096, 0x42, np.uint8)
    _, smr = a.reg(src.ctypes.data, 4096)
    _, meta = a.advertise(smr, src.ctypes.data, 4096)
    dst = np.zeros(4096, np.uint8)
    _, ro = b.reg(dst.ctypes.data, 4096, readonly=True)
    assert b.read(conn, ro, dst.ctypes.data, 4096, meta) is False
    assert not dst.any(), "bytes landed in read-only memory"
    _, rw = b.reg(dst.ctypes.data, 4096)
    assert b.read(conn, rw, dst.ctypes.data, 4096, meta) is True
    assert (dst == 0x42).all()
    a.close()
    b.close()


def test_dead_peer_fails_operations(transport):
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=peer.serve, args=(theirs, 1 << 20, transport))
    proc.start()
    try:
        ep = p2p.Endpoint()
        ok, conn = ep.add_remote_endpoint(mine.recv())
        assert ok
        meta = mine.recv()
        src = np.ones(1 << 20, np.uint8)
        _, mr = ep.reg(src.ctypes.data, src.nbytes)
        assert ep.write(conn, mr, src.ctypes.data, src.nbytes, meta)
        mine.send("digest")
        assert mine.recv() == digest(src)
        proc.kill()
        proc.join(10)
        t0 = time.monotonic()
        results = [ep.write(conn, mr, src.ctypes.data, src.nbytes, meta) for _ in range(3)]
        assert results[-1] is False
        assert time.monotonic() - t0 < 15
        ep.close()
    finally:
        proc.kill()


def test_descriptors_round_trip_and_reject_hostile_bytes():
    ep = p2p.Endpoint()
    t = np.zeros(1024, np.float32)
    descs = ep.register_memory([t])
    assert descs[0].mr_id != p2p.UINT64_MAX and descs[0].size == 4096
    assert descs[0].addr == t.ctypes.data and len(descs[0].info) == 64
    b = ep.get_serialized_descs(descs)
    back = ep.deserialize_descs(b)
    assert [(d.addr, d.size, d.rkeys, d.info) for d in back] == [
        (d.addr, d.size, d.rkeys, d.info) for d in descs
    ]
    assert ep.deserialize_descs(b"") == []
    for bad in [b[:-1], b + b"\0", (1 << 60).to_bytes(8, "little") + b[8:], b[:12]]:
        with pytest.raises(p2p.FerryError):
            ep.deserialize_descs(bad)
    with pytest.raises(p2p.FerryError, match="not a tensor"):
        ep.register_memory([object()])
    ep.deregister_memory(descs)
    assert ep.dereg(descs[0].mr_id) is False  # already gone
    ep.close()


def test_blocking_calls_release_the_gil():
    ep = p2p.Endpoint()
    result = {}

    def waiter():
        result["r"] = ep.recv_notification(600)

    th = threading.Thread(target=waiter)
    count = 0
    t0 = time.monotonic()
    th.start()
    while time.monotonic() - t0 < 0.3:
        count += 1
    assert th.is_alive()
    th.join(5)
    assert result["r"][0] is False
    # The Python loop ran all along (with the GIL held by the waiter it would
    # manage only a handful of switches per 5 ms interval).
    assert count > 10_000, count
    ep.close()


def interrupted(setup: str, call: str) -> None:
    """Runs `setup` then the blocking `call` in a child process and sends
    it Ctrl-C once it is waiting: the call must raise KeyboardInterrupt
    within seconds."""
    code = (
        "import sys, numpy as np\n"
        "from ferry import p2p\n"
        + textwrap.dedent(setup)
        + textwrap.dedent(
            f"""
            print("ready", flush=True)
            try:
                {call}
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                sys.exit(0)
            sys.exit(3)
            """
        )
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=10)
    assert p.returncode == 0 and "interrupted" in out
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("call", ["ep.accept()", "ep.recv_notification()", "ep.accept_local()"])
def test_ctrl_c_interrupts_a_blocking_call(call):
    interrupted("ep = p2p.Endpoint()\n", call)


@pytest.mark.parametrize("call", ["recv", "send"])
def test_ctrl_c_interrupts_a_blocking_message(call):
    """A blocking recv with no message coming (and a send with no receive
    posted) waits in one native call: Ctrl-C still ends it."""
    setup = """
        a, b = p2p.Endpoint(), p2p.Endpoint()
        assert b.start_passive_accept()
        ok, conn = a.add_remote_endpoint(b.get_metadata())
        assert ok
        buf = np.zeros(4096, np.uint8)
        ok, mr = a.reg(buf.ctypes.data, buf.nbytes)
        """
    size = "64 << 10" if call == "recv" else "4096"
    interrupted(setup, f"a.{call}(conn, mr, buf.ctypes.data, {size})")


def test_uccl_aliases_are_honoured_and_said_once():
    code = textwrap.dedent(
        """
        import logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from ferry import p2p
        try:
            p2p.Endpoint()
        except p2p.FerryError as e:
            print("error:", e)
        """
    )
    env = dict(os.environ, UCCL_P2P_MAX_INFLIGHT_OPS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "FERRY_MAX_INFLIGHT_OPS" in out.stdout, out
    env = dict(os.environ, UCCL_P2P_TRANSPORT="tcp")
    code2 = code.replace("p2p.Endpoint()", "p2p.Endpoint(); p2p.Endpoint()")
    out = subprocess.run([sys.executable, "-c", code2], env=env, capture_output=True, text=True)
    assert out.stderr.count("UCCL_P2P_TRANSPORT=tcp read as FERRY_TRANSPORT=tcp") == 1, out


@pytest.mark.parametrize("transport_env", ["auto", "tcp"])
def test_a_uccl_script_runs_unchanged(transport_env):
    env = dict(os.environ, FERRY_TRANSPORT=transport_env, FERRY_LISTEN_ADDR="127.0.0.1")
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "uccl_script.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_connect_local_by_metadata_and_accept_local():
    a = p2p.Endpoint()
    b = p2p.Endpoint()
    res = {}
    th = threading.Thread(target=lambda: res.update(r=a.accept_local()))
    th.start()
    ok, conn = b.connect_local(a.get_metadata())
    th.join(10)
    assert ok and res["r"][0] is True and res["r"][1] == ""
    assert b.peer(conn)[0] == "shm"
    a.close()
    b.close()


def test_connect_by_address_and_accept():
    a = p2p.Endpoint()
    b = p2p.Endpoint()
    ip, port, _ = p2p.Endpoint.parse_metadata(a.get_metadata())
    res = {}
    th = threading.Thread(target=lambda: res.update(r=a.accept()))
    th.start()
    ok, conn = b.connect("127.0.0.1", 0, port)
    th.join(10)
    assert ok
    ok_a, ip_a, gpu_a, conn_a = res["r"]
    assert ok_a and gpu_a == -1 and isinstance(ip_a, str)
    a.close()
    b.close()


def test_a_deregistered_buffer_is_never_found_again(transport):
    """write_ipc finds the registration holding its pointer (the last one
    found first): after dereg the same pointer is registered anew, not
    served by the closed registration."""
    a, b, conn = pair(transport)
    ok, _, _, theirs = a.accept()
    assert ok
    dst = np.zeros(4096, np.uint8)
    ok, info = a.advertise_ipc(theirs, dst.ctypes.data, 4096)
    assert ok
    src = np.full(4096, 5, np.uint8)
    ok, mr = b.reg(src.ctypes.data, 4096)
    assert ok and b.write_ipc(conn, src.ctypes.data, 4096, info)
    assert (dst == 5).all()
    assert b.dereg(mr)
    src[:] = 6
    assert b.write_ipc(conn, src.ctypes.data, 4096, info)
    assert (dst == 6).all()
    # And a write in another buffer, then back in a fresh registration.
    other = np.full(4096, 7, np.uint8)
    assert b.write_ipc(conn, other.ctypes.data, 4096, info)
    assert (dst == 7).all()
    a.close()
    b.close()


def test_ipc_family_and_blocking_vectors_with_host_memory(transport):
    a, b, conn = pair(transport)
    # The target side needs its own id of the connection for advertise_ipc.
    ok, _, _, theirs = a.accept()
    assert ok
    n, size = 4, 8192
    dst = [np.zeros(size, np.uint8) for _ in range(n)]
    ok, infos = a.advertisev_ipc(theirs, [d.ctypes.data for d in dst], [size] * n)
    assert ok and all(len(i) == 64 for i in infos)  # host memory: ordinary windows
    ok, one = a.advertise_ipc(theirs, dst[0].ctypes.data, size)
    assert ok and len(one) == 64
    src = [np.full(size, i + 1, np.uint8) for i in range(n)]
    ptrs = [s.ctypes.data for s in src]
    assert b.writev_ipc(conn, ptrs, [size] * n, infos)
    assert [int(d[0]) for d in dst] == [1, 2, 3, 4]
    for d in dst:
        d[:] = 9
    back = [np.zeros(size, np.uint8) for _ in range(n)]
    assert b.readv_ipc(conn, [x.ctypes.data for x in back], [size] * n, infos)
    assert all((x == 9).all() for x in back)
    ok, tid = b.writev_ipc_async(conn, ptrs, [size] * n, infos)
    assert ok and b.wait(tid, 10)
    ok, tid = b.readv_ipc_async(conn, [x.ctypes.data for x in back], [size] * n, infos)
    assert ok and b.wait(tid, 10)
    assert [int(x[0]) for x in back] == [1, 2, 3, 4]
    ok, tid = b.write_ipc_async(conn, ptrs[3], size, one)
    assert ok and b.wait(tid, 10) and int(dst[0][0]) == 4
    x = np.zeros(size, np.uint8)
    assert b.read_ipc(conn, x.ctypes.data, size, one) and int(x[0]) == 4
    ok, tid = b.read_ipc_async(conn, x.ctypes.data, size, one)
    assert ok and b.wait(tid, 10)
    # the window as a bytearray or a memoryview, as bytes
    x[:] = 0
    assert b.read_ipc(conn, x.ctypes.data, size, bytearray(one)) and int(x[0]) == 4
    assert b.write_ipc(conn, ptrs[1], size, memoryview(one)) and int(dst[0][0]) == 2
    # wrong info length, an unknown connection, a range past the buffer,
    # unequal lists
    assert b.write_ipc(conn, ptrs[0], size, b"\0" * 10) is False
    assert b.write_ipc(conn + 1000, ptrs[0], size, one) is False
    assert b.read_ipc(conn, x.ctypes.data, size + 1, one) is False
    assert int(dst[0][0]) == 2 and int(x[0]) == 4
    # The native call refuses a region of another endpoint before any move.
    ok, amr = a.reg(dst[1].ctypes.data, size)
    assert ok
    with pytest.raises(p2p.FerryError, match="another endpoint"):
        b._ep().run_one(conn, False, a._regs[amr], dst[1].ctypes.data, size, one)
    assert int(dst[1][0]) == 2 and int(dst[0][0]) == 2
    with pytest.raises(p2p.FerryError):
        b.writev_ipc(conn, ptrs, [size] * 3, infos)
    # the blocking registration forms
    _, mrs = b.regv(ptrs, [size] * n)
    _, metas = a.advertisev(theirs, [a.reg(d.ctypes.data, size)[1] for d in dst],
                            [d.ctypes.data for d in dst], [size] * n, n)
    assert b.writev(conn, mrs, ptrs, [size] * n, metas, n)
    assert [int(d[-1]) for d in dst] == [1, 2, 3, 4]
    ok, tid = b.readv_async(conn, mrs, ptrs, [size] * n, metas, n)
    assert ok and b.wait(tid, 10)
    a.close()
    b.close()


def test_ctrl_c_interrupts_a_blocking_write_to_a_stopped_peer(transport):
    """A peer that stops answering (SIGSTOP) holds a blocking write until the
    op timeout; Ctrl-C ends the wait at once."""
    target_code = textwrap.dedent(
        """
        import sys, numpy as np
        from ferry import p2p
        ep = p2p.Endpoint()
        ep.start_passive_accept()
        buf = np.zeros(64 << 20, np.uint8)
        ok, mr = ep.reg(buf.ctypes.data, buf.nbytes)
        ok, meta = ep.advertise(mr, buf.ctypes.data, buf.nbytes)
        print(ep.get_metadata().hex(), meta.hex(), flush=True)
        sys.stdin.read()
        """
    )
    init_code = textwrap.dedent(
        """
        import sys, numpy as np
        from ferry import p2p
        ep = p2p.Endpoint()
        ok, conn = ep.add_remote_endpoint(bytes.fromhex(sys.argv[1]))
        meta = bytes.fromhex(sys.argv[2])
        src = np.ones(64 << 20, np.uint8)
        ok, mr = ep.reg(src.ctypes.data, src.nbytes)
        assert ep.write(conn, mr, src.ctypes.data, src.nbytes, meta)
        print("ready", flush=True)
        sys.stdin.readline()
        try:
            for _ in range(1000):
                ep.write(conn, mr, src.ctypes.data, src.nbytes, meta)
            sys.exit(4)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    env = dict(os.environ, FERRY_OP_TIMEOUT_MS="60000")
    t = subprocess.Popen([sys.executable, "-c", target_code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        meta_hex, win_hex = t.stdout.readline().split()
        i = subprocess.Popen([sys.executable, "-c", init_code, meta_hex, win_hex],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert i.stdout.readline().strip() == "ready"
        t.send_signal(signal.SIGSTOP)
        i.stdin.write("go\n")
        i.stdin.flush()
        time.sleep(0.5)
        t0 = time.monotonic()
        i.send_signal(signal.SIGINT)
        out, _ = i.communicate(timeout=20)
        assert "interrupted" in out and i.returncode == 0
        assert time.monotonic() - t0 < 5
    finally:
        t.send_signal(signal.SIGCONT)
        t.kill()
        t.wait()


@pytest.mark.skipif(ferry._native.gpu_count() > 0, reason="a GPU is visible here")
def test_gpu_zero_on_a_host_without_gpus_serves_host_memory(caplog):
    """Ray's transport passes GPU 0 everywhere: with no GPU that is a
    warning and a host-memory endpoint, not an error (issue 28 #10)."""
    with caplog.at_level(logging.WARNING, logger="ferry"):
        ep = p2p.Endpoint(0)
    assert ep.gpu is None
    assert "no GPU is visible" in caplog.text
    buf = np.zeros(64, np.uint8)
    assert ep.reg(buf.ctypes.data, 64)[0]
    ep.close()


def test_hand_built_descriptors_name_a_sub_range(transport):
    """XferDesc is built by hand with its fields set (clients cut a
    registered buffer into pieces that way): a local piece of a registered
    tensor moves with the registration's mr_id."""
    a, b, conn = pair(transport)
    dst = np.zeros(8192, np.uint8)
    src = np.arange(8192, dtype=np.uint32).astype(np.uint8)
    rdesc = a.register_memory([dst])[0]
    ldesc = b.register_memory([src])[0]
    piece = p2p.XferDesc()
    piece.addr = ldesc.addr + 4096
    piece.size = 4096
    piece.mr_id = ldesc.mr_id
    piece.lkeys, piece.rkeys = ldesc.lkeys, ldesc.rkeys
    remote = p2p.XferDesc(addr=rdesc.addr, size=4096, mr_id=rdesc.mr_id, info=rdesc.info)
    assert remote.size == 4096 and list(remote.info) == list(rdesc.info)
    remote = b.deserialize_descs(a.get_serialized_descs([remote]))[0]
    ok, tid = b.transfer(conn, "write", [piece], [remote])
    assert ok and b.wait(tid, 10.0)
    assert bytes(dst[:4096]) == bytes(src[4096:])
    a.close()
    b.close()


def test_reg_refuses_pointers_that_are_not_mapped(caplog):
    """A Python caller cannot prove its pointer: reg checks the range is
    mapped with the access asked for, and names the address (issue 28 #3)."""
    import mmap

    ep = p2p.Endpoint()
    for ptr, size in [(0x1, 4096), (0x1000, 4096), (0xDEAD0000, 4096), (2**63, 1 << 40)]:
        with caplog.at_level(logging.WARNING, logger="ferry"):
            assert ep.reg(ptr, size) == (False, 0)
        assert f"{ptr:#x}" in caplog.text, caplog.text
        caplog.clear()
    # A read-only mapping registers read-only, not writable.
    ro = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)

    buf = np.frombuffer(ro, np.uint8)
    ptr = buf.ctypes.data
    ok, _ = ep.reg(ptr, 4096)
    assert not ok
    assert "not readable and writable" in caplog.text or "r--" in caplog.text, caplog.text
    assert ep.reg(ptr, 4096, readonly=True)[0]
    strict = p2p.Endpoint(strict=True)
    with pytest.raises(p2p.FerryError, match="0x1000"):
        strict.reg(0x1000, 16)
    ep.close()
    strict.close()


def test_register_memory_shares_a_live_registration_as_uccl_does():
    """UCCL's registration cache (p2p/tests/test_register_memory_cache.py
    with numpy arrays): the same buffer again or a part of it gets a new
    mr_id and the same keys; dropping one keeps the others; a partial
    overlap or another buffer gets its own (issue 28 #8)."""
    ep = p2p.Endpoint()
    t = np.arange(4096, dtype=np.float32)
    d1, d2 = ep.register_memory([t])[0], ep.register_memory([t])[0]
    assert d1.addr == d2.addr == t.ctypes.data and d1.size == d2.size == t.nbytes
    assert d1.mr_id != d2.mr_id
    assert d1.lkeys == d2.lkeys and d1.rkeys == d2.rkeys
    ep.deregister_memory([d1])
    d3 = ep.register_memory([t])[0]
    assert d3.rkeys == d2.rkeys
    sub = ep.register_memory([t[256:1280]])[0]
    assert sub.rkeys == d2.rkeys and sub.addr == t[256:].ctypes.data
    ep.deregister_memory([d2, d3])
    assert ep.register_memory([t[256:1280]])[0].rkeys == sub.rkeys, "sub still holds it"
    assert ep._n.reg_cache_stats() == (4, 1)
    ep.close()
    # A fresh endpoint: nothing registered that holds these.
    ep = p2p.Endpoint()
    base = ep.register_memory([t[:1024]])[0]
    over = ep.register_memory([t[768:1792]])[0]
    other = ep.register_memory([t.copy()])[0]
    assert base.rkeys != over.rkeys and over.rkeys != other.rkeys and base.rkeys != other.rkeys
    ep.close()
