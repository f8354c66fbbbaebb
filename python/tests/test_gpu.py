"""GPU memory from Python: CUDA IPC (`*_ipc`), torch tensors through
`register_memory` + `transfer`, GPU memory over tcp. Needs torch with CUDA;
skipped (and shown as skipped) where there is none."""

import multiprocessing as mp
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

from ferry import p2p  # noqa: E402

MiB = 1 << 20


def _gpu(n=1):
    return min(torch.cuda.device_count() - 1, n)


def _target(pipe, transport, dev):
    os.environ["FERRY_TRANSPORT"] = transport
    os.environ["FERRY_LISTEN_ADDR"] = "127.0.0.1"
    from ferry import p2p

    ep = p2p.Endpoint(dev)
    assert ep.start_passive_accept()
    pipe.send(ep.get_metadata())
    ok, _, _, conn = ep.accept()
    assert ok
    t = torch.zeros(64 * MiB, dtype=torch.uint8, device=f"cuda:{dev}")
    src = torch.arange(64 * MiB, dtype=torch.int64, device=f"cuda:{dev}").to(torch.uint8)
    descs = ep.register_memory([t, src])
    pipe.send(ep.get_serialized_descs(descs))
    _, info = ep.advertise_ipc(conn, t.data_ptr(), t.numel())
    pipe.send(info)
    while True:
        cmd = pipe.recv()
        if cmd == "sum":
            torch.cuda.synchronize(dev)
            pipe.send(int(t.to(torch.int64).sum().item()))
        elif cmd == "zero":
            t.zero_()
            torch.cuda.synchronize(dev)
            pipe.send("ok")
        else:
            pipe.send("bye")
            return


@pytest.fixture(params=["auto", "tcp"])
def target(request):
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(theirs, request.param, _gpu()))
    proc.start()
    os.environ["FERRY_TRANSPORT"] = request.param
    # The target says which GPU it serves (for connect_local) before it
    # sends its metadata; ours comes second, so the record stays the target's.
    meta = mine.recv()
    ep = p2p.Endpoint(0)
    ok, conn = ep.add_remote_endpoint(meta)
    assert ok
    descs = ep.deserialize_descs(mine.recv())
    info = mine.recv()
    yield request.param, ep, conn, descs, info, mine, meta
    mine.send("stop")
    mine.recv()
    proc.join(30)
    ep.close()
    os.environ.pop("FERRY_TRANSPORT", None)


def test_tensors_via_register_memory_and_transfer(target):
    transport, ep, conn, remote, _, pipe, _ = target
    assert ep.peer(conn)[0] == ("shm" if transport == "auto" else "tcp")
    mine = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, device="cuda:0")
    back = torch.zeros(64 * MiB, dtype=torch.uint8, device="cuda:0")
    local = ep.register_memory([mine, back])
    ok, tid = ep.transfer(conn, "write", [local[0]], [remote[0]])
    assert ok
    assert ep.wait(tid, 60)
    pipe.send("sum")
    assert pipe.recv() == int(mine.to(torch.int64).sum().item())
    ok, tid = ep.transfer(conn, "read", [local[1]], [remote[1]])
    assert ok and ep.wait(tid, 60)
    want = torch.arange(64 * MiB, dtype=torch.int64, device="cuda:0").to(torch.uint8)
    assert torch.equal(back, want)
    ep.deregister_memory(local)


def test_write_ipc_and_read_ipc_gpu_and_pinned(target):
    transport, ep, conn, _, info, pipe, _ = target
    if transport != "auto":
        pytest.skip("CUDA IPC is a same-host path")
    assert len(info) == 136
    src = torch.full((64 * MiB,), 3, dtype=torch.uint8, device="cuda:0")
    assert ep.write_ipc(conn, src.data_ptr(), src.numel(), info)
    pipe.send("sum")
    assert pipe.recv() == 3 * 64 * MiB
    # Host (pinned) to GPU, 4 pieces, async
    pipe.send("zero")
    pipe.recv()
    host = torch.full((4 * MiB,), 5, dtype=torch.uint8).pin_memory()
    ok, tid = ep.write_ipc_async(conn, host.data_ptr(), host.numel(), info)
    assert ok and ep.wait(tid, 60)
    pipe.send("sum")
    assert pipe.recv() == 5 * 4 * MiB
    back = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda:0")
    assert ep.read_ipc(conn, back.data_ptr(), back.numel(), info)
    assert int(back.sum().item()) == 5 * 4 * MiB


def test_connect_local_by_bus_id(target):
    transport, ep, conn, _, _, _, meta = target
    if transport != "auto":
        pytest.skip("a same-host path")
    _, _, bdf = p2p.Endpoint.parse_metadata(meta)
    assert bdf, "an endpoint with a GPU puts its bus id in the metadata"
    ok, c2 = ep.connect_local(bdf)
    assert ok and ep.peer(c2)[0] == "shm"


def test_pythonic_api_with_cuda_tensors():
    import ferry

    with ferry.Endpoint(0) as a, ferry.Endpoint(0) as b:
        a.listen()
        conn = b.connect(a.metadata)
        dst = torch.zeros(MiB, dtype=torch.uint8, device="cuda:0")
        src = torch.full((MiB,), 7, dtype=torch.uint8, device="cuda:0")
        r_dst, r_src = a.register(dst), b.register(src)
        assert r_dst.is_gpu and r_src.is_gpu
        theirs = a.accept()
        conn.write(r_src, r_dst.advertise_ipc(theirs))
        torch.cuda.synchronize()
        assert torch.equal(dst, src)
