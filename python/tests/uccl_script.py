"""A two-process script written against UCCL P2P's Python API.

The only ferry line is the import: with UCCL installed, `from uccl import
p2p` runs the same script. Host buffers (numpy), one server and one client
process; the transport is whatever the endpoints pick (same host: shared
memory; FERRY_TRANSPORT=tcp forces tcp). Exits 0 when every check held.

    python uccl_script.py
"""

import hashlib
import multiprocessing as mp
import sys
import time

import numpy as np

from ferry import p2p  # the seed: from uccl import p2p

SIZE = 1 << 20
N_IOV = 4
IOV = 4096


def poll_done(ep, transfer_id):
    is_done = False
    while not is_done:
        ok, is_done = ep.poll_async(transfer_id)
        assert ok, "poll_async failed"
        time.sleep(0.001)  # as Ray's transport does


def digest(a):
    return hashlib.sha256(a.tobytes()).hexdigest()


def server(pipe):
    ep = p2p.Endpoint(None, 4)  # lazy GPU; num_cpus ignored
    pipe.send(bytes(ep.get_metadata()))
    ok, ip, gpu_idx, conn_id = ep.accept()
    assert ok, "accept"
    buf = np.zeros(SIZE, dtype=np.uint8)
    ok, mr_id = ep.reg(buf.ctypes.data, buf.nbytes)
    assert ok, "reg"
    ok, meta = ep.advertise(conn_id, mr_id, buf.ctypes.data, buf.nbytes)
    assert ok and len(meta) == 64, "advertise"
    iovs = [np.zeros(IOV, dtype=np.uint8) for _ in range(N_IOV)]
    ok, mr_ids = ep.regv([a.ctypes.data for a in iovs], [IOV] * N_IOV)
    assert ok and len(mr_ids) == N_IOV, "regv"
    ok, metas = ep.advertisev(
        conn_id, mr_ids, [a.ctypes.data for a in iovs], [IOV] * N_IOV, N_IOV
    )
    assert ok and len(metas) == N_IOV, "advertisev"
    pipe.send((meta, metas))
    # write/read round 1: the client wrote `buf`; tell it what arrived.
    assert pipe.recv() == "wrote"
    pipe.send((digest(buf), [digest(a) for a in iovs]))
    # Fill for the client's reads.
    buf[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
    for i, a in enumerate(iovs):
        a[:] = 100 + i
    pipe.send((digest(buf), [digest(a) for a in iovs]))
    # Tensors and descriptors, then the *_ipc calls with host memory.
    t = np.full(SIZE // 4, 7, dtype=np.float32)
    descs = ep.register_memory([t])
    pipe.send(ep.get_serialized_descs(descs))
    ok, info = ep.advertise_ipc(conn_id, buf.ctypes.data, SIZE)
    assert ok, "advertise_ipc"
    pipe.send(info)
    assert pipe.recv() == "transferred"
    pipe.send((digest(t), digest(buf)))
    assert pipe.recv() == "bye"
    ep.deregister_memory(descs)
    assert ep.dereg(mr_id)
    for m in mr_ids:
        assert ep.dereg(m)


def client(pipe):
    ep = p2p.Endpoint()
    meta_bytes = pipe.recv()
    ip, port, bdf = p2p.Endpoint.parse_metadata(meta_bytes)
    assert port > 0 and isinstance(ip, str), "parse_metadata"
    ok, conn_id = ep.add_remote_endpoint(meta_bytes)
    assert ok, "add_remote_endpoint"
    meta, metas = pipe.recv()
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, SIZE, dtype=np.uint8)
    ok, mr = ep.reg(src.ctypes.data, src.nbytes, p2p.FloatType.kUndefined)
    assert ok, "reg"
    assert ep.write(conn_id, mr, src.ctypes.data, SIZE, meta), "write"
    iovs = [rng.integers(0, 256, IOV, dtype=np.uint8) for _ in range(N_IOV)]
    ok, mrs = ep.regv([a.ctypes.data for a in iovs], [IOV] * N_IOV)
    assert ok, "regv"
    ok, tid = ep.writev_async(conn_id, mrs, [a.ctypes.data for a in iovs], [IOV] * N_IOV, metas, N_IOV)
    assert ok, "writev_async"
    poll_done(ep, tid)
    pipe.send("wrote")
    got, got_iovs = pipe.recv()
    assert got == digest(src), "write: bytes differ"
    assert got_iovs == [digest(a) for a in iovs], "writev: bytes differ"
    want, want_iovs = pipe.recv()
    dst = np.zeros(SIZE, dtype=np.uint8)
    ok, dmr = ep.reg(dst.ctypes.data, dst.nbytes)
    assert ok
    ok, tid = ep.read_async(conn_id, dmr, dst.ctypes.data, SIZE, meta)
    assert ok, "read_async"
    poll_done(ep, tid)
    assert digest(dst) == want, "read_async: bytes differ"
    assert ep.readv(conn_id, mrs, [a.ctypes.data for a in iovs], [IOV] * N_IOV, metas, N_IOV), "readv"
    assert [digest(a) for a in iovs] == want_iovs, "readv: bytes differ"
    dst[:] = 0
    assert ep.read(conn_id, dmr, dst.ctypes.data, SIZE, meta), "read"
    assert digest(dst) == want, "read: bytes differ"
    # Descriptors: write a tensor's worth into the server's tensor.
    remote = ep.deserialize_descs(pipe.recv())
    t = np.full(SIZE // 4, 3.5, dtype=np.float32)
    local = ep.register_memory([t])
    ok, tid = ep.transfer(conn_id, "write", local, remote)
    assert ok, "transfer"
    poll_done(ep, tid)
    # *_ipc with host memory: write src again through the ipc window.
    info = pipe.recv()
    assert ep.write_ipc(conn_id, src.ctypes.data, SIZE, info), "write_ipc"
    pipe.send("transferred")
    got_t, got_buf = pipe.recv()
    assert got_t == digest(t), "transfer: bytes differ"
    assert got_buf == digest(src), "write_ipc: bytes differ"
    pipe.send("bye")
    assert ep.remove_remote_endpoint(conn_id), "remove_remote_endpoint"
    ep.deregister_memory(local)


def main():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    s = ctx.Process(target=server, args=(a,))
    c = ctx.Process(target=client, args=(b,))
    s.start()
    c.start()
    c.join(60)
    s.join(60)
    codes = (s.exitcode, c.exitcode)
    print("server, client exit codes:", codes)
    return 0 if codes == (0, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
