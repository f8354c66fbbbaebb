"""A peer process for the tests: a ferry.p2p endpoint that accepts one
connection, registers a buffer, advertises it and answers commands on a
multiprocessing pipe until told to stop (or killed)."""

import hashlib

import numpy as np


def serve(pipe, size, transport):
    import os

    os.environ["FERRY_TRANSPORT"] = transport
    os.environ["FERRY_LISTEN_ADDR"] = "127.0.0.1"
    from ferry import p2p

    ep = p2p.Endpoint()
    pipe.send(ep.get_metadata())
    ok, _, _, conn = ep.accept()
    assert ok
    buf = np.zeros(size, dtype=np.uint8)
    ok, mr = ep.reg(buf.ctypes.data, size)
    ok, meta = ep.advertise(conn, mr, buf.ctypes.data, size)
    pipe.send(meta)
    while True:
        cmd = pipe.recv()
        if cmd == "digest":
            pipe.send(hashlib.sha256(buf.tobytes()).hexdigest())
        elif cmd == "fill":
            buf[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
            pipe.send(hashlib.sha256(buf.tobytes()).hexdigest())
        elif cmd == "stop":
            pipe.send("ok")
            return
